"""A CPU rollout for verl 0.9.1: ``actor_rollout_ref.rollout.name=dora_cpu``.

It serves **the Hugging Face model the actor trains** (``actor_rollout_ref.model.path``, loaded
with transformers' own model code, ``sdpa`` attention) and speaks the contracts verl's
rollout side uses with vLLM/SGLang:

* ``DoraCpuReplica`` (``RolloutReplicaRegistry``): ``init_standalone`` starts one Ray actor per
  replica, a ``CpuRolloutWorker`` that is both verl's ``CheckpointEngineWorker`` (weights arrive
  through the configured checkpoint-engine backend: ``update_weights``,
  ``execute_checkpoint_engine``) and the server (``generate``, ``abort_all_requests``,
  ``resume_generation``, ``sleep``/``wake_up``, ``release/resume_kv_cache``, ``clear_kv_cache``,
  profiling no-ops). ``init_hybrid`` (verl's colocated ``sync`` trainer) starts a
  ``CpuLLMServer`` actor and the actor workers push weights into it through
  ``CpuServerAdapter`` (verl's ``BaseRollout``, found through the rollout registry).
* Shaped like vLLM: concurrent requests with continuous batching (each decode step advances every
  running request by one token; up to ``rollout.max_num_seqs`` run, the others queue; a request
  joins and leaves at step boundaries), the version read when a request *completes*, per-request
  ``abort_request``, and ``abort_all_requests`` / ``resume_generation`` as verl calls them (the
  gate closes, running requests return ``aborted`` with their partial tokens, new ones wait).
  Weight loads run between decode steps.
* ``generate`` returns verl's ``TokenOutput`` whose ``extra_fields`` carry the weight version the
  tokens were sampled with (``global_steps``, ``min_global_steps``, ``max_global_steps``): these
  are the engine-reported versions verl writes to TransferQueue and the dora sampler checks (C1).
* ``DORA_CPU_STEP_S`` (default 0: shape ``cpu``): the GPU shape (``gpu-shaped``): a decode step of
  the whole batch costs at least this many seconds, whatever the batch size, as memory-bound
  decode does on a GPU (the step sleeps the remainder). A step is one batched forward over all
  its requests (``_forward``: each keeps its own KV cache, stacked for the step; a joining
  request's prompt is prefilled in the same forward, as vLLM's chunked prefill mixes it in).
  ``DORA_CPU_SLOW_REPLICAS="<rank>:<factor>,..."`` makes chosen replicas' steps cost `factor`
  times that (injected stragglers); factor ``hold``: that replica advances a request only while
  it runs no other (a straggler that finishes nothing it shares: R5 must move work off it).
* Every weight load reports the checksum of the weights now in the model, every finished request
  its version (``DORA_CPU_REPORT_DIR``: JSON lines, read by the tests and the CPU benchmark).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Any

from .report import report

logger = logging.getLogger("dora_ext.verl")

ROLLOUT_NAME = "dora_cpu"


def _model_path(model_config: Any) -> str:
    for key in ("local_path", "path"):
        value = getattr(model_config, key, None)
        if value is None and hasattr(model_config, "get"):
            value = model_config.get(key)
        if value:
            return str(value)
    raise ValueError("actor_rollout_ref.model.path is not set")


class ServerCore:
    """The model and the generation loop (shared by the standalone worker and the hybrid server)."""

    def _init_server(self, model_config: Any, replica_rank: int, rollout_config: Any = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(int(os.environ.get("DORA_CPU_THREADS", "1")))
        path = _model_path(model_config)
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa")
        self.model.eval()
        self.replica_rank = int(replica_rank)
        self.version: int | None = None
        self.checksum_value: str | None = None
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
        self.default_max_tokens = int(getattr(rollout_config, "response_length", 0) or 16) if rollout_config else 16
        self.max_running = max(1, int(getattr(rollout_config, "max_num_seqs", 0) or 8) if rollout_config else 8)
        self._lock = asyncio.Lock()  # the model: one decode step or one weight load at a time
        self._gate = asyncio.Event()  # closed by abort_all_requests until resume_generation
        self._gate.set()
        self._queue: list[_Request] = []
        self._running: list[_Request] = []
        self._loop_task: asyncio.Task | None = None
        self.loads: list[dict] = []
        self.served = 0
        self.step_s = float(os.environ.get("DORA_CPU_STEP_S", "0") or 0)
        self.hold = False  # injected stragglers (DORA_CPU_SLOW_REPLICAS, module docstring)
        for item in filter(None, os.environ.get("DORA_CPU_SLOW_REPLICAS", "").split(",")):
            rank, factor = item.split(":")
            if int(rank) == self.replica_rank:
                self.hold = factor == "hold"
                self.step_s *= 1.0 if self.hold else float(factor)

    # ------------------------------------------------------------------ weights
    async def load_named_weights(self, named: dict, version: int | None) -> str:
        """Load `named` (HF parameter names -> tensors) as weight version `version`; returns the
        checksum of the weights now in the model (over the same names, read back)."""
        import torch

        from ..weights import checksum

        async with self._lock:
            params = dict(self.model.named_parameters())
            buffers = dict(self.model.named_buffers())
            unknown = [n for n in named if n not in params and n not in buffers]
            if unknown:
                raise KeyError(f"dora_cpu rollout: weights {unknown[:5]} are not in the served model")
            with torch.no_grad():
                for name, tensor in named.items():
                    target = params.get(name)
                    if target is None:
                        target = buffers[name]
                    target.copy_(tensor.to(target.dtype))
            loaded = {n: (params.get(n) if n in params else buffers[n]) for n in named}
            self.checksum_value = checksum(loaded)
            self.version = None if version is None else int(version)
            rec = {"replica": self.replica_rank, "version": self.version, "checksum": self.checksum_value,
                   "tensors": len(named)}
            self.loads.append(rec)
            report("load", **rec)
            return self.checksum_value

    async def weights_checksum(self, names: list[str], dtype: str | None = None) -> str:
        """:func:`dora_ext.verl.weights.checksum` over `names` of the tensors the model holds now
        (the engine-side evidence the coordinator compares with the publication after a load)."""
        from ..weights import checksum

        async with self._lock:
            held = dict(self.model.named_parameters())
            held.update(self.model.named_buffers())
            missing = [n for n in names if n not in held]
            if missing:
                raise KeyError(f"dora_cpu rollout: weights {missing[:5]} are not in the served model")
            return checksum(held, list(names), dtype)

    def get_load_reports(self) -> list[dict]:
        return list(self.loads)

    def get_version(self) -> int | None:
        return self.version

    # ------------------------------------------------------------------ generation
    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, **_: Any):
        from verl.workers.rollout.replica import TokenOutput

        await self._gate.wait()  # vLLM's admission gate: closed while paused
        req = _Request(str(request_id), list(prompt_ids), dict(sampling_params or {}), self)
        self._queue.append(req)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.ensure_future(self._serve())
        tokens, logprobs, reason = await req.done
        version = self.version  # read at completion, as vLLM and SGLang do
        self.served += 1
        report("generate", replica=self.replica_rank, request_id=req.id, version=version,
               tokens=len(tokens), stop=reason, start=req.started)
        return TokenOutput(
            token_ids=tokens, log_probs=logprobs, stop_reason=reason, num_preempted=0,
            extra_fields={"global_steps": version, "min_global_steps": version, "max_global_steps": version},
        )

    async def _serve(self) -> None:
        """The decode loop: admit queued requests into free slots, one step for all running, finish."""
        while self._queue or self._running:
            start = time.perf_counter()
            async with self._lock:
                while self._queue and len(self._running) < self.max_running:
                    self._running.append(self._queue.pop(0))
                for req in list(self._running):
                    if req.aborted or len(req.tokens) >= req.max_tokens:
                        self._finish(req, "aborted" if req.aborted else "length")
                stepping = [] if self.hold and len(self._running) > 1 else list(self._running)
                for req, logits in zip(stepping, _forward(self.model, stepping) if stepping else ()):
                    reason = req.sample(logits)
                    if reason is not None:
                        self._finish(req, reason)
            await asyncio.sleep(max(0.0, self.step_s - (time.perf_counter() - start)))

    def _finish(self, req: _Request, reason: str) -> None:
        self._running.remove(req)
        req.done.set_result((req.tokens, req.logprobs, reason))

    async def abort_request(self, request_id: str, **_: Any) -> dict[str, Any]:
        """Abort one request (verl's ``vLLMHttpServer.abort_request``): it returns ``aborted`` with
        its tokens so far at the next step; the other requests run on."""
        for req in self._queue + self._running:
            if req.id == str(request_id) and not req.done.done():
                req.aborted = True
                report("abort_request", replica=self.replica_rank, request_id=req.id, tokens=len(req.tokens))
                return {"aborted": True, "request_id": req.id}
        return {"aborted": False, "request_id": str(request_id), "error": "not found"}

    # ------------------------------------------------------------------ control (verl's server API)
    async def abort_all_requests(self, reject_request: bool = False) -> None:
        self._gate.clear()
        for req in self._queue + self._running:
            req.aborted = True
        while self._queue or self._running:  # each returns "aborted" at the next step
            await asyncio.sleep(0.005)

    async def resume_generation(self) -> None:
        self._gate.set()

    async def wake_up(self) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **_: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class CpuLLMServer(ServerCore):
    """The server actor of a hybrid (colocated ``sync``) replica; weights come from the actor
    workers' ``CpuServerAdapter``."""

    def __init__(self, model_config: Any, replica_rank: int, rollout_config: Any = None) -> None:
        self._init_server(model_config, replica_rank, rollout_config)


class _Request:
    """One request of the decode loop: its own KV cache, sampler and partial output (one row of
    each :func:`_forward` of the steps it runs in)."""

    def __init__(self, request_id: str, prompt: list[int], params: dict[str, Any], core: ServerCore) -> None:
        import torch

        self.id, self.core, self.started = request_id, core, time.time()
        vocab = core.model.get_input_embeddings().num_embeddings
        if not prompt or not all(0 <= t < vocab for t in prompt):
            # Refused here, as vLLM's input processor does: in the batched forward it would stop
            # the decode loop, and every request running beside it would wait forever.
            raise ValueError(f"request {request_id}: the prompt must be 1 or more token ids in [0, {vocab}) "
                             f"(the model's vocabulary); got {len(prompt)} ids, min {min(prompt, default=None)}, "
                             f"max {max(prompt, default=None)}")
        limit = int(getattr(core.model.config, "max_position_embeddings", 1 << 30))
        max_tokens = int(params.get("max_tokens") or params.get("max_new_tokens") or core.default_max_tokens)
        self.max_tokens = max(0, min(max_tokens, limit - len(prompt)))
        self.temperature = float(params.get("temperature", 1.0) or 0.0)
        self.top_p = float(params.get("top_p", 1.0) or 1.0)
        self.top_k = int(params.get("top_k", -1) or -1)
        seed = params.get("seed")
        self.gen = torch.Generator().manual_seed(int(seed)) if seed is not None else None
        self.new_ids = list(prompt)  # not yet in its KV cache: the prompt, then the last token
        self.past: list = []  # its KV cache: per layer (keys, values), each [1, heads, cached, head_dim]
        self.cached = 0
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.aborted = False
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def sample(self, logits: Any) -> str | None:
        """Sample the next token from `logits` (its last position's); the stop reason once finished."""
        import torch

        logits = logits.float()
        if self.temperature <= 0:
            logp = torch.log_softmax(logits, -1)
            tok = int(torch.argmax(logits))
        else:
            scaled = logits / self.temperature
            if self.top_k > 0:
                kth = torch.topk(scaled, min(self.top_k, scaled.numel())).values[-1]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            if self.top_p < 1.0:
                sorted_logits, order = torch.sort(scaled, descending=True)
                cum = torch.cumsum(torch.softmax(sorted_logits, -1), -1)
                cut = cum - torch.softmax(sorted_logits, -1) > self.top_p
                scaled[order[cut]] = float("-inf")
            logp = torch.log_softmax(scaled, -1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=self.gen))
        self.tokens.append(tok)
        self.logprobs.append(float(logp[tok]))
        self.new_ids = [tok]
        if tok in self.core.eos_ids:
            return "completed"
        return "length" if len(self.tokens) >= self.max_tokens else None


def _forward(model: Any, reqs: list[_Request]) -> Any:
    """One forward of `model` for all `reqs`: returns each one's last-position logits ([len(reqs),
    vocab]) and extends each one's KV cache with its new tokens.

    Row i is ``[pad][its cache][its new ids][pad]``: caches right-aligned at the longest cache C,
    new ids (a decode step's token, or a joining request's prompt) start at C. The attention mask
    hides the pads and each token gets its own position; no pad lies between a token and those it
    attends to, so a row computes what that request alone would, in sliding-window layers too
    (they count distance by index). Each row's logits are those of its last new id."""
    import torch
    from transformers import DynamicCache

    big_c, big_n, rows = max(r.cached for r in reqs), max(len(r.new_ids) for r in reqs), len(reqs)
    ids, pos = torch.zeros(rows, big_n, dtype=torch.long), torch.zeros(rows, big_n, dtype=torch.long)
    mask = torch.zeros(rows, big_c + big_n, dtype=torch.long)
    for i, r in enumerate(reqs):
        c, n = r.cached, len(r.new_ids)
        ids[i, :n], pos[i, :n] = torch.tensor(r.new_ids), torch.arange(c, c + n)
        mask[i, big_c - c:big_c + n] = 1

    def stacked(layer: int, kv: int):  # that layer's keys (0) or values (1) of every row
        ref = next(r.past[layer][kv] for r in reqs if r.past)
        out = ref.new_zeros(rows, ref.shape[1], big_c, ref.shape[3])
        for i, r in enumerate(reqs):
            if r.past:
                out[i, :, big_c - r.cached:] = r.past[layer][kv][0]
        return out

    layers = len(next((r.past for r in reqs if r.past), []))
    cache = DynamicCache([(stacked(j, 0), stacked(j, 1)) for j in range(layers)] or None)
    last = torch.tensor([len(r.new_ids) - 1 for r in reqs])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                       use_cache=True).logits[torch.arange(rows), last]
    for i, r in enumerate(reqs):  # each row's cache and new tokens, without the pads (copies: a view
        own = slice(big_c - r.cached, big_c + len(r.new_ids))  # would keep the whole batch alive)
        r.past = [(lay.keys[i:i + 1, :, own].clone(), lay.values[i:i + 1, :, own].clone()) for lay in cache.layers]
        r.cached += len(r.new_ids)
    return logits


def _server_name(replica_rank: int) -> str:
    return f"dora_cpu_server_{replica_rank}"


def _adapter_base():
    from verl.workers.rollout.base import BaseRollout

    return BaseRollout


class CpuServerAdapter(_adapter_base()):
    """verl's ``BaseRollout`` for ``dora_cpu``: receives weights and loads them into the server.

    In a standalone replica it lives in the ``CpuRolloutWorker`` next to the model (``server`` is
    that object); in a hybrid replica it lives in each actor worker and sends the weights to the
    ``CpuLLMServer`` actor of its replica (leader rank only; all ranks drain the generator, whose
    FSDP gathers are collective)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, server: Any = None,
                 replica_rank: int | None = None, **_: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        self._local = server
        self._remote = None
        if replica_rank is None:
            rank = int(os.environ.get("RANK", "0"))
            per = max(1, int(self.config.tensor_model_parallel_size) * int(self.config.data_parallel_size)
                      * int(self.config.pipeline_model_parallel_size))
            replica_rank, self.is_leader_rank = rank // per, rank % per == 0
        else:
            self.is_leader_rank = True
        self.replica_rank = int(replica_rank)

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", global_steps: int | None = None,
                             **kwargs: Any) -> None:
        from verl.workers.rollout.utils import ensure_async_iterator

        if wire_format != "named_tensors":
            raise NotImplementedError(f"dora_cpu rollout: wire format {wire_format!r} is not supported")
        named = {}
        async for name, tensor in ensure_async_iterator(weights):
            if self.is_leader_rank:
                named[name] = tensor.detach().to("cpu").clone()
        if not self.is_leader_rank:
            return
        if self._local is not None:
            await self._local.load_named_weights(named, global_steps)
            return
        from ..weights import checksum

        # Colocated (verl's sync trainer): what the actor hands over is the published version; the
        # server reports the checksum of what it then holds. verl's actor calls a colocated
        # rollout's update_weights only in checkpoint-engine mode naive (engine_workers.update_weights).
        report("publish", version=global_steps, checksum=checksum(named), replica=self.replica_rank, backend="naive")
        if self._remote is None:
            import ray

            self._remote = ray.get_actor(_server_name(self.replica_rank))
        await self._remote.load_named_weights.remote(named, global_steps)


def _worker_base():
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    return CheckpointEngineWorker


class CpuRolloutWorker(ServerCore, _worker_base()):
    """verl's ``CheckpointEngineWorker`` and the ``dora_cpu`` server in one Ray actor (standalone)."""

    def __init__(self, rollout_config: Any, model_config: Any, replica_rank: int = 0, **kwargs: Any) -> None:
        self._init_server(model_config, replica_rank, rollout_config)
        adapter = CpuServerAdapter(rollout_config, model_config, None, server=self, replica_rank=replica_rank)
        super().__init__(rollout_config, model_config, adapter)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica_base():
    from verl.workers.rollout.replica import RolloutReplica

    return RolloutReplica


class DoraCpuReplica(_replica_base()):
    """``RolloutReplica`` of ``actor_rollout_ref.rollout.name=dora_cpu`` (see the module docstring)."""

    async def init_standalone(self):
        import ray
        from verl.workers.rollout.replica import RolloutMode

        self.rollout_mode = RolloutMode.STANDALONE
        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_free_port())}
        worker = ray.remote(CpuRolloutWorker).options(
            name=f"dora_cpu_rollout_{self.replica_rank}{self.name_suffix}",
            num_cpus=0, max_concurrency=self.max_concurrency, runtime_env={"env_vars": env},
        ).remote(rollout_config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        self.workers = [worker]
        await self.launch_servers()

    async def launch_servers(self):
        import ray
        from verl.workers.rollout.replica import RolloutMode

        if self.rollout_mode == RolloutMode.STANDALONE:
            server = self.workers[0]
        else:
            server = ray.remote(CpuLLMServer).options(
                name=_server_name(self.replica_rank), num_cpus=0, max_concurrency=self.max_concurrency,
            ).remote(self.model_config, self.replica_rank, self.config)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"dora-cpu-{self.replica_rank}{self.name_suffix}"
        await server.get_version.remote()  # constructed (model loaded) before the first request

    def rollout_worker_use_gpu(self) -> bool:
        return False


def load_replica_class():
    return DoraCpuReplica

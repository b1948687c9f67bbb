"""``dora_store``: dora's one weight path, a verl ``CheckpointEngineWithCache`` backend.

``trainer_mode=dora`` always uses it (``DoraTrainer`` sets it; any other backend is refused at
launch): a replica loads a subset-independent copy, never through a process group that spans the
trainer and a varying set of replicas (verl's ``nccl`` backend keeps its first group and fails
``assert self.world_size == world_size`` at the first load of a subset; the delta backends diff
against the last weights *sent*, wrong after a subset or old-version load).

* **Publish once per version.** ``send_weights(weights, global_steps=v)`` on the actor's rank 0
  copies the full tensors to host memory once, in the dtype the engine serves (``dtype``,
  ``served_dtype``: an FSDP actor's float32 tensors are cast to a bfloat16 engine's dtype, half the
  bytes every load moves; integer buffers stay as they are), puts them into Ray's shared-memory
  object store once (``ray.put``) and hands that one object to the *weight store* of every rollout
  node (one Ray actor per node, ``WeightStore``, created at setup by ``ensure_stores``: a fixed
  membership, no group is ever built or rebuilt). Each store pulls the object onto its node at
  publish time: one host copy per node. Each tensor is published as its bytes, a flat uint8 numpy
  array, with its dtype and shape (``pack_tensor``): Ray hands a numpy array to every reader as a
  read-only view of the node's shared memory, whereas a torch tensor (without
  ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``, off by default) is deserialised into a private copy per
  reader: verl's first sync, where every worker of every replica loads at once, would need one host
  copy of the whole model per GPU.
  The other actor ranks only drain the generator (FSDP's gathers are collective). The first
  publication of a version wins.
* **Load from the node's store, without the trainer.** ``receive_weights(global_steps=v)`` on a
  rollout worker takes ``v`` from its own node's store (waiting while ``v`` is not published yet),
  reads the node's shared copy in place and yields it to the engine's adapter one tensor at a time,
  each copied to the worker's device (``unpack_tensor``, then on GPU the host-to-device copy, on CPU
  a private copy of that one tensor: nothing the engine holds aliases the shared, read-only memory).
  ``DoraTrainer`` lets its coordinator run the loads of drained replicas, off the trainer thread.
  ``get_weights()`` (the ``CheckpointEngineWithCache`` method) yields the newest version held by
  the node's store.
* **Evidence, not labels.** Each publication carries ``checksum`` over strided samples of
  every tensor (on vLLM and SGLang of every ``*norm.weight``: the tensors replicated under tensor
  parallelism and held under their Hugging Face names; ``sample_names``). After each load, and
  after verl's first sync, the coordinator asks the *engine* for the same checksum over what it
  now holds (``engine_checksum``: the CPU replica reads its model; SGLang through
  ``/get_weights_by_name``; vLLM through ``collective_rpc("dora_checksum")``, a method of dora's
  worker extension, ``DoraWorkerExtension``, which ``DoraTrainer`` sets as
  ``engine_kwargs.vllm.worker_extension_cls``) and refuses a mismatch (``WeightsMismatch``, the
  run stops with the message).

The transport is the same code on every machine (Ray's object store, then a copy to the device);
on CPU nothing else differs. The store keeps the newest ``keep_versions`` versions
(``engine_kwargs.dora_store.keep_versions``; ``DoraTrainer`` sets ``K + 2`` when unset, every
version a load can still ask for, and refuses less). Both sides must name the version
(``global_steps``); a fetch of a version not published within ``fetch_timeout_s`` (default
1800 s) fails, naming the version and the node.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import operator
import os
import time
import urllib.request
import warnings
from typing import Any, AsyncGenerator, Generator

import torch

BACKEND = "dora_store"
MODULE = "dora_ext.verl.weights"
STORE_PREFIX = "dora_weight_store_"
SAMPLE_POINTS = 64  # values of each tensor in the checksum, strided across all of it
ENGINES = ("dora_cpu", "vllm", "sglang")  # rollouts whose loads dora can check and whose requests it can abort
REPLICATED = ("vllm", "sglang")  # engines that shard/fuse most tensors: only *norm.weight reads back as published
FETCH_TIMEOUT_S = 1800.0  # default engine_kwargs.dora_store.fetch_timeout_s
TIMEOUT_KEY = f"actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.{BACKEND}.fetch_timeout_s"
VLLM_EXTENSION = "dora_ext.verl.vllm_worker.DoraWorkerExtension"  # DoraTrainer sets it on vLLM
VLLM_EXTENSION_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls"
METHOD = "dora_checksum"  # DoraChecksumMixin's, called in vLLM's workers by name
# The Hugging Face architectures whose SGLang model class defines or inherits get_weights_by_name,
# the route every load check on SGLang reads (read in SGLang 0.5.23's srt/models: Llama and the
# classes built on it, Granite, OPT, Exaone4; Qwen2/Qwen3 and most others have none). A model whose
# config names none of them is refused at launch (``DoraTrainer``'s ``_check_sglang_model``).
SGLANG_WEIGHTS_BY_NAME = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Ministral3ForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM",
    "IQuestCoderForCausalLM", "TeleFLMForCausalLM", "Llama4ForCausalLM", "GraniteForCausalLM",
    "GraniteSWAForCausalLM", "OPTForCausalLM", "Exaone4ForCausalLM",
})


def sample_names(names, rollout: str | None = None) -> list[str]:
    """The tensors a checksum covers: every one, except on vLLM and SGLang (`rollout`), which hold
    most tensors sharded under tensor parallelism and fused under other names: there every
    ``*norm.weight`` (replicated, trained, under its Hugging Face name; all names if none)."""
    names = sorted(names)
    if rollout not in REPLICATED:
        return names
    return [n for n in names if n.endswith("norm.weight")] or names


def served_dtype(rollout: Any) -> str:
    """The dtype the engine holds its weights in: ``dora_cpu`` serves float32 whatever the config
    says, vLLM and SGLang ``actor_rollout_ref.rollout.dtype`` (default bfloat16), a torch dtype's
    floating-point name: ``auto`` is refused (the weights are published, and checked, in this dtype)."""
    if str(rollout.get("name")) == "dora_cpu":
        return "float32"
    name = str(rollout.get("dtype") or "bfloat16")
    dtype = getattr(torch, name, None)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        from dora_ext.config import ConfigError

        raise ConfigError("actor_rollout_ref.rollout.dtype", f"{name!r}: dora publishes and checks the weights in "
                          "the engine's dtype and needs it by name (accepted: bfloat16, float16, float32)")
    return name


def checksum(named: dict[str, Any], names: list[str] | None = None, dtype: str | None = None) -> str:
    """sha256 over the sampled tensors of `named` in name order: each one's name, size and
    ``SAMPLE_POINTS`` float32 values strided across the whole tensor (a tensor left stale or
    corrupted anywhere but between the sampled points changes it); the same weights give the same
    digest on the trainer, in the store and read back from an engine (the same function runs in a
    vLLM worker, on SGLang's answers and on the CPU replica). `dtype` (the engine's, ``served_dtype``):
    each tensor is first rounded to it, as the engine rounds what it loads (an FSDP actor's float32
    master weights, held rounded by a bfloat16 vLLM/SGLang engine; ``send_weights`` publishes them
    rounded already, and rounding twice changes nothing)."""
    h = hashlib.sha256()
    cast = getattr(torch, dtype) if dtype else torch.float32
    for name in sample_names(named) if names is None else names:
        t = torch.as_tensor(named[name]).detach().reshape(-1)
        size = t.numel()
        t = t[:: max(1, size // SAMPLE_POINTS)][:SAMPLE_POINTS].to("cpu").to(cast).to(torch.float32).contiguous()
        h.update(f"{name}:{size}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def pack_tensor(tensor: torch.Tensor) -> tuple:
    """A contiguous host tensor as published: ``(its bytes as a flat uint8 numpy array, its dtype,
    its shape)``, sharing the tensor's memory. Ray deserialises a numpy array zero-copy (a read-only
    view of the node's object store, one copy for every reader of the node); a torch tensor into a
    private copy per reader."""
    return tensor.reshape(-1).view(torch.uint8).numpy(), tensor.dtype, tuple(tensor.shape)


def unpack_tensor(packed: tuple) -> torch.Tensor:
    """The tensor ``pack_tensor`` published, viewing the same memory (read-only when it is the object
    store's: copy it before anything may write to it)."""
    array, dtype, shape = packed
    if not array.size:  # (torch views an empty array with stride 0, which it cannot view as another dtype)
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # torch warns that the store's read-only array is not writable
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        flat = torch.from_numpy(array)
    return flat.view(dtype).reshape(shape)


class WeightsMismatch(RuntimeError):
    """An engine holds other weights than the version it was loaded with."""


class WeightStore:
    """Published weight versions on one rollout node (a Ray actor, ``dora_weight_store_<node>``)."""

    def __init__(self, keep_versions: int = 8, node_id: str = "", timeout_s: float | None = None) -> None:
        self.keep = max(1, int(keep_versions))
        self.node_id = node_id
        self.timeout_s = float(timeout_s or FETCH_TIMEOUT_S)
        self.versions: dict[int, tuple[list, str]] = {}  # version -> ([object ref or packed dict], checksum)
        self.checksums: dict[int, str] = {}
        self.names: dict[int, list[str]] = {}
        self.events: dict[int, asyncio.Event] = {}

    def _event(self, version: int) -> asyncio.Event:
        if version not in self.events:
            self.events[version] = asyncio.Event()
        return self.events[version]

    async def publish(self, version: int, boxed: list, digest: str, names: list[str] | None = None) -> bool:
        """Keep `boxed` as `version`: ``[ray.ObjectRef]`` of ``{name: pack_tensor(tensor)}``, or
        ``[that dict]`` without Ray."""
        from .cpu.report import report

        version = int(version)
        if version in self.checksums:
            return False  # first publication wins
        if not isinstance(boxed[0], dict):
            import ray

            # Pull the object onto this node now, without deserializing it here.
            await asyncio.get_running_loop().run_in_executor(None, lambda: ray.wait(boxed, fetch_local=True))
        self.versions[version] = (boxed, digest)
        self.checksums[version] = digest
        self.names[version] = list(names or [])
        report("publish", version=version, checksum=digest, backend=BACKEND)
        for old in sorted(self.versions)[: max(0, len(self.versions) - self.keep)]:
            self.versions.pop(old, None)
        self._event(version).set()
        return True

    async def fetch(self, version: int) -> tuple[int, list, str]:
        """``(version, boxed weights, checksum)`` published as `version`.

        Waits while `version` is newer than every version published (a load may start before its
        publication). Never answers with other weights: a version not named (None), no longer
        kept, or older than the newest published and never published raises, naming the version
        and what is held."""
        try:
            if isinstance(version, bool):
                raise TypeError
            version = operator.index(version)
        except TypeError:
            raise ValueError(f"dora weight store: a load must name the version it loads (global_steps, an "
                             f"integer), got {version!r}; held: {sorted(self.versions)}") from None
        if version not in self.versions:
            self._missing(version)  # raises unless it may still be published
        try:
            await asyncio.wait_for(self._event(version).wait(), self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"dora weight store of node {self.node_id or '?'}: version {version} was not published within "
                f"{self.timeout_s:g} s (held: {sorted(self.versions)}; a store created after the publication, e.g. "
                f"on a restarted node, never receives it): raise {TIMEOUT_KEY} if publishing is that slow") from None
        if version not in self.versions:  # published, and already evicted by newer ones
            self._missing(version)
        boxed, digest = self.versions[version]
        return version, boxed, digest

    def _missing(self, version: int) -> None:
        held = sorted(self.versions)
        if version in self.checksums:
            raise KeyError(f"dora weight store: version {version} is no longer kept (held: {held}; "
                           f"engine_kwargs.{BACKEND}.keep_versions={self.keep})")
        newest = max(self.checksums, default=None)
        if newest is not None and version < newest:
            raise KeyError(f"dora weight store: version {version} was never published and is older than "
                           f"the newest published, {newest} (held: {held})")

    def evidence(self, version: int) -> tuple[str, list[str]]:
        """The checksum published for `version` and the tensor names it covers."""
        return self.checksums[int(version)], self.names.get(int(version), [])

    def newest(self) -> int | None:
        return max(self.versions, default=None)

    def read_text(self, path: str) -> str | None:
        """A file on this node (what a vLLM worker wrote: ``engine_checksum``), or None."""
        if not os.path.exists(path):
            return None
        with open(path) as f:
            text = f.read()
        os.remove(path)  # read once: a later check that writes nothing cannot pass on this one
        return text


def _store_options(node_id: str) -> dict:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return dict(name=STORE_PREFIX + node_id, get_if_exists=True, num_cpus=0, max_concurrency=1000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


_KEPT: list = []  # every store handle this process took (never read): see node_store


def node_store(node_id: str | None = None, keep_versions: int = 8, timeout_s: float | None = None) -> Any:
    """The weight store of `node_id` (default: this process's node), created if missing. Ray ends
    a named actor once its creator's handles are gone, whatever handles others took by name: a
    publisher's handle dropped after its call took the store and its versions down under a
    worker's fetch. So the process keeps the handle for its life."""
    import ray

    node_id = node_id or ray.get_runtime_context().get_node_id()
    _KEPT.append(ray.remote(WeightStore).options(**_store_options(node_id)).remote(keep_versions, node_id, timeout_s))
    return _KEPT[-1]


def ensure_stores(node_ids, keep_versions: int = 8, timeout_s: float | None = None) -> dict[str, Any]:
    """One store per rollout node (``DoraTrainer`` calls this once, before the first publication)."""
    return {n: node_store(n, keep_versions, timeout_s) for n in sorted(set(node_ids))}


def all_stores(keep_versions: int = 8) -> list:
    """Every rollout node's store; if none exists yet (verl's own trainers on one machine), this
    node's (a receive on the same node finds the same one)."""
    import ray

    names = sorted(n for n in ray.util.list_named_actors() if n.startswith(STORE_PREFIX))
    if not names:
        return [node_store(None, keep_versions)]
    return [ray.get_actor(n) for n in names]


# ---------------------------------------------------------------------- engine-side checksums
class DoraChecksumMixin:
    """The engine-side checksum inside vLLM: vLLM mixes ``DoraWorkerExtension`` (``vllm_worker``:
    this class over verl's own ``vLLMColocateWorkerExtension``) into each GPU worker, and
    ``engine_checksum`` calls ``collective_rpc("dora_checksum", ...)`` by name."""

    def dora_checksum(self, names: list[str], path: str, dtype: str | None = None) -> None:
        """Rank 0 writes the checksum of its model's tensors `names` to `path` (verl's
        ``collective_rpc`` does not return results)."""
        if int(getattr(self, "rank", 0)) != 0:
            return
        runner = self.model_runner  # get_model(): the module under vLLM's CUDA-graph wrapper
        params = dict((runner.get_model() if hasattr(runner, "get_model") else runner.model).named_parameters())
        missing = [n for n in names if n not in params]
        out = {"error": f"not in the vLLM model: {missing[:5]}"} if missing else {"checksum": checksum(params, names, dtype)}
        with open(path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(path + ".tmp", path)


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _urlopen(req: urllib.request.Request, timeout: float):
    """``urlopen`` straight to the server, never through ``http_proxy`` / ``HTTP_PROXY``: the SGLang
    servers are the cluster's own (verl's SGLang HTTP client, aiohttp without ``trust_env``, ignores
    them too). Through a proxy that cannot reach the cluster's addresses (exported without them in
    ``no_proxy``) the first load check failed with a URLError and the run stopped at init."""
    return _DIRECT.open(req, timeout=timeout)


async def engine_checksum(rollout: str, server: Any, address: str, names: list[str], store: Any,
                          tag: str, dtype: str | None = None) -> str:
    """The checksum over `names` of the weights the engine behind `server` holds now.

    ``dora_cpu``: the replica reads back its model. ``sglang``: ``/get_weights_by_name`` on the
    server's HTTP address. ``vllm``: ``collective_rpc`` runs ``DoraChecksumMixin.dora_checksum`` in
    the workers, which write it to a file the node's store reads. (The GPU branches are not run by
    CI: no GPU.)"""
    if rollout == "dora_cpu":
        return await server.weights_checksum.remote(names, dtype)
    if rollout == "sglang":
        import urllib.error

        def get(name):
            body = json.dumps({"name": name, "truncate_size": 1 << 20}).encode()  # a whole norm weight
            req = urllib.request.Request(f"http://{address}/get_weights_by_name", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with _urlopen(req, timeout=60) as r:
                    return torch.tensor(json.loads(r.read()), dtype=torch.float32)
            except urllib.error.HTTPError as exc:
                # SGLang implements get_weights_by_name per model class (SGLANG_WEIGHTS_BY_NAME): without
                # it no load of this model can be checked (refused at launch when the model's config
                # could be read there).
                raise WeightsMismatch(
                    f"dora: SGLang cannot read back {name} of the loaded weights (/get_weights_by_name: HTTP "
                    f"{exc.code} {exc.read()[:200]!r}); its model class for actor_rollout_ref.model.path may not "
                    "implement get_weights_by_name: use actor_rollout_ref.rollout.name=vllm") from None

        named = {n: await asyncio.to_thread(get, n) for n in names}
        return checksum(named, names, dtype)
    if rollout == "vllm":
        import tempfile

        path = os.path.join(os.environ.get("DORA_CHECKSUM_DIR", tempfile.gettempdir()), f"dora_checksum_{tag}.json")
        # By name, with plain arguments: vLLM sends the call to its engine-core process through
        # msgpack, which refuses a function unless VLLM_ALLOW_INSECURE_SERIALIZATION=1 (verl never sets it).
        await server.collective_rpc.remote(METHOD, args=[list(names), path, dtype])
        text = await store.read_text.remote(path)
        out = json.loads(text) if text else {"error": f"vLLM worker wrote no checksum to {path}"}
        if "error" in out:
            raise WeightsMismatch(f"dora: vLLM engine checksum: {out['error']}")
        return out["checksum"]
    raise ValueError(f"dora: no engine checksum for actor_rollout_ref.rollout.name={rollout!r} "
                     f"(accepted: {', '.join(ENGINES)})")


async def abort_request(rollout: str, server: Any, address: str, request_id: str) -> dict:
    """Abort one request on one engine (R5: the moved trajectory's, the others there run on).

    ``dora_cpu`` and ``vllm``: the server actor's ``abort_request`` (on vLLM dora's subclass of
    verl's ``vLLMHttpServer``, ``vllm_server``: verl's own finds no request of vLLM >= 0.16);
    ``sglang`` (its server actor has none in verl 0.9.1): SGLang's ``/abort_request`` HTTP route,
    which answers 200 whether it held the id or not (``confirmed`` False)."""
    if rollout == "sglang":
        def post():
            body = json.dumps({"rid": request_id}).encode()
            req = urllib.request.Request(f"http://{address}/abort_request", data=body,
                                         headers={"Content-Type": "application/json"})
            with _urlopen(req, timeout=30) as r:
                return {"aborted": 200 <= r.status < 300, "confirmed": False}

        return await asyncio.to_thread(post)
    # verl's vLLMHttpServer.abort_request resets the whole prefix cache by default: the co-resident
    # requests would lose their cached prefixes at every move.
    out = await server.abort_request.remote(request_id, reset_prefix_cache=False)
    return out if isinstance(out, dict) else {"aborted": bool(out)}


def _register():
    from verl.checkpoint_engine.base import CheckpointEngineRegistry, CheckpointEngineWithCache

    class DoraStoreCheckpointEngine(CheckpointEngineWithCache):
        """See the module docstring."""

        def __init__(self, bucket_size: int = 0, is_master: bool = False, keep_versions: int = 8,
                     dtype: str | None = None, fetch_timeout_s: float | None = None, rollout: str | None = None,
                     **_: Any) -> None:
            self.is_master = is_master
            self.dtype = dtype  # the engine's (``served_dtype``; DoraTrainer sets engine_kwargs.dora_store.dtype)
            self.keep_versions = keep_versions
            self.fetch_timeout_s = fetch_timeout_s
            self.rollout = rollout  # the engine (actor_rollout_ref.rollout.name): what sample_names covers
            self.rank = 0
            self._store = None

        def _local_store(self):
            if self._store is None:
                self._store = node_store(None, self.keep_versions, self.fetch_timeout_s)
            return self._store

        def prepare(self) -> dict[str, Any]:
            import ray

            return {"node_id": ray.get_runtime_context().get_node_id()}

        @classmethod
        def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
            return ({"rank": list(range(actor_wg_world_size))},
                    {"rank": list(range(actor_wg_world_size, actor_wg_world_size + rollout_world_size))})

        def init_process_group(self, rank: int = 0, **_: Any) -> None:
            self.rank = rank  # no process group: the stores are reached through Ray

        def finalize(self) -> None:
            return None

        async def send_weights(self, weights: Generator, global_steps: int | None = None) -> dict:
            import ray
            from verl.workers.rollout.utils import ensure_async_iterator

            start = time.perf_counter()
            named = {}
            served = getattr(torch, self.dtype) if self.dtype else None  # the engine's: what it would round to
            async for name, tensor in ensure_async_iterator(weights):
                if self.is_master:
                    dtype = served if served is not None and tensor.is_floating_point() else tensor.dtype
                    # On GPU: the one device-to-host copy.
                    named[name] = tensor.detach().to("cpu", dtype=dtype, copy=True,
                                                     memory_format=torch.contiguous_format)
            if not self.is_master:
                return {}
            if global_steps is None:
                raise ValueError("dora_store: send_weights needs the version it publishes (global_steps), got None: "
                                 "a load names the version it loads, and an unnamed publication could not be "
                                 "told apart from the others")
            names = sample_names(named, self.rollout)
            digest = checksum(named, names, self.dtype)
            boxed = [ray.put({name: pack_tensor(t) for name, t in named.items()})]  # shared by a node's readers
            fresh = await asyncio.gather(*[s.publish.remote(int(global_steps), boxed, digest, names)
                                           for s in all_stores(self.keep_versions)])
            return {"dora_store/publish_s": time.perf_counter() - start, "dora_store/published_new": float(any(fresh))}

        async def _yield(self, boxed: list) -> AsyncGenerator:
            packed = boxed[0] if isinstance(boxed[0], dict) else await boxed[0]  # the node's shared copy
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
            for name, entry in packed.items():
                # One tensor at a time: on GPU the host-to-device copy, on CPU a private copy (the shared
                # memory is read-only).
                yield name, unpack_tensor(entry).to(device, copy=True)

        async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator:
            if global_steps is None:
                raise ValueError("dora_store: receive_weights needs the version it loads (global_steps), got None: "
                                 "the store would not know which published weights to hand out")
            got, boxed, _ = await self._local_store().fetch.remote(int(global_steps))
            if got != int(global_steps):
                raise RuntimeError(f"dora_store: asked the weight store for version {global_steps}, "
                                   f"it answered with version {got}: not loaded")
            async for item in self._yield(boxed):
                yield item

        async def get_weights(self) -> AsyncGenerator:
            newest = await self._local_store().newest.remote()
            if newest is None:
                raise KeyError("dora_store: the node's weight store holds no version yet")
            async for item in self.receive_weights(global_steps=newest):
                yield item

    CheckpointEngineRegistry.register(BACKEND)(DoraStoreCheckpointEngine)
    return DoraStoreCheckpointEngine


DoraStoreCheckpointEngine = _register()

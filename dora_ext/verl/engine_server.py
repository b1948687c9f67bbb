"""``EngineServer``: verl's rollout-server contract over dora-ext's ``TorchEngine`` (CPU or GPU).

verl's agent loops talk to a rollout server through a Ray actor handle:
``await server.generate.remote(request_id=, prompt_ids=, sampling_params=, image_data=,
video_data=, ...) -> TokenOutput`` whose ``extra_fields["global_steps"]`` is the weight version,
plus ``abort_all_requests`` / ``resume_generation`` for partial rollout. vLLM and SGLang
implement it on GPUs; this class implements it with the embedded engine (a small real torch
model with continuous batching), so the coordinator, the client and the trainer glue can run
on a machine without a GPU. It stands in for a vLLM server in tests: it is not a fake (tokens are
sampled from a real model, a version is a real set of weights), but it is not vLLM either.

Weights of version ``v`` are ``TinyLM(TinyConfig(seed=base_seed + v))``: distinct, deterministic
weights per version, so a trajectory's per-token versions prove C1.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any


class EngineServer:
    """Plain class; run it as ``ray.remote(EngineServer)`` (an async actor)."""

    def __init__(self, model: dict | None = None, capacity: int = 4, instance_id: int = 0,
                 default_max_tokens: int = 16, base_seed: int = 0) -> None:
        from dora_ext.engines import TorchEngine
        from dora_ext.models.tiny import TinyConfig

        self.model_config = TinyConfig(**(model or {}))
        self.engine = TorchEngine(self.model_config, capacity, None, device="cpu", instance_id=instance_id)
        self.default_max_tokens = default_max_tokens
        self.base_seed = base_seed
        self.futures: dict[str, asyncio.Future] = {}
        self.driver: asyncio.Task | None = None
        self.served: list[dict] = []  # one record per finished or aborted request
        self.gate = asyncio.Event()
        self.gate.set()

    # ------------------------------------------------------------------ weights
    def load_version(self, version: int) -> int:
        """Load the weights of `version` (refused while sequences hold KV: R4 is the caller's)."""
        from dora_ext.models.tiny import TinyLM

        cfg = dataclasses.replace(self.model_config, seed=self.base_seed + int(version), value_head=False)
        self.engine.load_version(TinyLM(cfg).state_dict(), int(version))
        return int(version)

    def version(self) -> int | None:
        return self.engine.version

    # ------------------------------------------------------------------ verl's server methods
    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, **_: Any):
        from verl.workers.rollout.replica import TokenOutput

        from dora_ext.engines import SamplingParams

        await self.gate.wait()
        max_tokens = int(sampling_params.get("max_tokens") or self.default_max_tokens)
        vocab = self.model_config.vocab_size
        prompt = [int(t) % vocab for t in prompt_ids]
        room = self.model_config.max_len - len(prompt)
        temperature = float(sampling_params.get("temperature", 1.0) or 0.0)
        top_p = float(sampling_params.get("top_p", 1.0) or 1.0)
        fut = asyncio.get_running_loop().create_future()
        self.futures[request_id] = fut
        self.engine.submit(request_id, prompt, max(1, min(max_tokens, room)),
                           SamplingParams(temperature=max(temperature, 0.0), top_p=min(max(top_p, 1e-6), 1.0)),
                           seed=hash(request_id) & 0x7FFFFFFF)
        if self.driver is None or self.driver.done():
            self.driver = asyncio.create_task(self._drive())
        fin = await fut
        return TokenOutput(
            token_ids=list(fin["response_ids"]), log_probs=list(fin["logprobs"]), stop_reason=fin["stop_reason"],
            num_preempted=0,
            extra_fields={"global_steps": fin["version"], "token_versions": sorted(set(fin["versions"]))},
        )

    async def _drive(self) -> None:
        while self.engine.has_work:
            for f in self.engine.step():
                self._resolve(f.request_id, f.response_ids, f.logprobs, f.versions, "completed")
            await asyncio.sleep(0)  # let new requests and control calls in between decode steps

    def _resolve(self, rid: Any, response, logprobs, versions, reason: str) -> None:
        rec = {"request_id": rid, "response_ids": tuple(response), "logprobs": tuple(logprobs),
               "versions": tuple(versions), "version": self.engine.version, "stop_reason": reason}
        self.served.append({k: rec[k] for k in ("request_id", "versions", "version", "stop_reason")})
        fut = self.futures.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(rec)

    async def abort_all_requests(self, reject_request: bool = False) -> int:
        """Partial rollout: end every held request now with the tokens it has (``aborted``)."""
        self.gate.clear()
        ids = list(self.engine.running) + list(self.engine.queued)
        for rid in ids:
            state = self.engine.export_sequence(rid, include_kv=False)
            self._resolve(rid, state.response_ids, state.logprobs, state.versions, "aborted")
        return len(ids)

    async def resume_generation(self) -> None:
        self.gate.set()

    def get_served(self) -> list[dict]:
        return list(self.served)

"""``dora_cpu``: a weight-sync backend for verl's checkpoint engine that publishes versions.

Selected with ``actor_rollout_ref.rollout.checkpoint_engine.backend=dora_cpu`` and
``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=dora_ext.verl.cpu.weights``
(verl imports that module in the trainer, the actor workers and the rollout workers before it
looks the backend up in ``CheckpointEngineRegistry``).

Unlike NCCL's broadcast, a send and a receive need not meet:

* ``send_weights(weights, global_steps=v)`` on the actor's rank 0 copies the full tensors once
  into a Ray actor, the *weight store*, as version ``v`` together with its checksum. The first
  publication of a version wins: a later send labelled ``v`` (e.g. verl's manager syncing a
  replica while the actor has already taken an optimizer step) cannot overwrite what ``v`` is.
  The other actor ranks only drain the generator (FSDP's gathers are collective).
* ``receive_weights(global_steps=v)`` on a rollout worker waits until ``v`` is published and
  yields that copy. A replica can thus load any kept version at any time, without the actor
  (``DoraTrainer`` loads drained replicas from the store straight from its coordinator, off the
  trainer thread).

Cost per publish: one full copy of the weights to host memory and one transfer into the store;
per load: one transfer out of the store. No process group is built (``prepare``,
``init_process_group`` and ``finalize`` are no-ops). The store keeps the newest
``keep_versions`` versions (``engine_kwargs.dora_cpu.keep_versions``; ``DoraTrainer`` sets it to
``max(8, K + 2)`` when unset and refuses a value below ``K + 2``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any, AsyncGenerator, Generator

import torch

logger = logging.getLogger("dora_ext.verl")

BACKEND = "dora_cpu"
STORE_NAME = "dora_cpu_weight_store"
MODULE = "dora_ext.verl.cpu.weights"


def checksum(named: dict[str, Any]) -> str:
    """sha256 over the float32 bytes of `named`, in name order (identical weights, same digest)."""
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


class WeightStore:
    """Published weight versions (a Ray actor, named ``dora_cpu_weight_store``)."""

    def __init__(self, keep_versions: int = 8) -> None:
        self.keep = max(1, int(keep_versions))
        self.versions: dict[int, tuple[dict, str]] = {}
        self.checksums: dict[int, str] = {}
        self.events: dict[int, asyncio.Event] = {}

    def _event(self, version: int) -> asyncio.Event:
        if version not in self.events:
            self.events[version] = asyncio.Event()
        return self.events[version]

    async def publish(self, version: int, named: dict, digest: str) -> bool:
        from .report import report

        version = int(version)
        if version in self.checksums:
            return False  # first publication wins
        self.versions[version] = (named, digest)
        self.checksums[version] = digest
        report("publish", version=version, checksum=digest)
        for old in sorted(self.versions)[: max(0, len(self.versions) - self.keep)]:
            self.versions.pop(old, None)
        self._event(version).set()
        return True

    async def fetch(self, version: int | None) -> tuple[int, dict, str]:
        if version is None:
            if not self.versions:
                raise KeyError("dora_cpu weight store: nothing published yet")
            version = max(self.versions)
        version = int(version)
        await self._event(version).wait()
        if version not in self.versions:
            raise KeyError(f"dora_cpu weight store: version {version} is no longer kept (kept: {sorted(self.versions)})")
        named, digest = self.versions[version]
        return version, named, digest

    def published(self) -> dict[int, str]:
        return dict(self.checksums)


def get_store(keep_versions: int = 8) -> Any:
    import ray

    return ray.remote(WeightStore).options(
        name=STORE_NAME, get_if_exists=True, num_cpus=0, max_concurrency=1000,
    ).remote(keep_versions)


def _register():
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

    class DoraCpuCheckpointEngine(CheckpointEngine):
        """See the module docstring."""

        publishes_versions = True

        def __init__(self, bucket_size: int = 0, is_master: bool = False, keep_versions: int = 8, **_: Any) -> None:
            self.is_master = is_master
            self.keep_versions = keep_versions
            self.rank = 0
            self._store = None

        def _get_store(self):
            if self._store is None:
                self._store = get_store(self.keep_versions)
            return self._store

        def prepare(self) -> dict[str, Any]:
            return {}

        @classmethod
        def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
            return ({"rank": list(range(actor_wg_world_size))},
                    {"rank": list(range(actor_wg_world_size, actor_wg_world_size + rollout_world_size))})

        def init_process_group(self, rank: int = 0, **_: Any) -> None:
            self.rank = rank

        def finalize(self) -> None:
            return None

        async def send_weights(self, weights: Generator, global_steps: int | None = None) -> dict:
            from verl.workers.rollout.utils import ensure_async_iterator

            start = time.perf_counter()
            named = {}
            async for name, tensor in ensure_async_iterator(weights):
                if self.is_master:
                    named[name] = tensor.detach().to("cpu").clone()
            if not self.is_master:
                return {}
            digest = checksum(named)
            version = -1 if global_steps is None else int(global_steps)
            fresh = await self._get_store().publish.remote(version, named, digest)
            return {"dora_cpu/publish_s": time.perf_counter() - start, "dora_cpu/published_new": float(fresh)}

        async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator:
            _, named, _ = await self._get_store().fetch.remote(global_steps)
            for name, tensor in named.items():
                yield name, tensor

    CheckpointEngineRegistry.register(BACKEND)(DoraCpuCheckpointEngine)
    return DoraCpuCheckpointEngine


DoraCpuCheckpointEngine = _register()

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
  trainer thread). A load never gets other weights than the version it names: a version no
  longer kept, or older than the newest published and never published, raises (naming it and
  the versions held), and the version the store answered with is checked against the one asked
  for. Both sides need ``global_steps`` (None raises: an unnamed sync cannot be matched to a
  publication; before, it was published as -1 while the load took the newest version held). verl
  0.9.1 names it on every sync through this backend; its one unnamed ``update_weights()``
  (``_validate`` with a colocated reward model) uses the trainer's ``checkpoint_manager``, which
  verl builds with backend ``naive``, and never reaches this one.

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
import operator
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

    async def fetch(self, version: int) -> tuple[int, dict, str]:
        """The weights published as `version`: ``(version, named tensors, checksum)``.

        Waits while `version` is newer than every version published (a load may start before its
        publication). Never answers with other weights: a version not named (None), no longer
        kept, or older than the newest published and never published raises, naming the version
        and what is held."""
        try:
            if isinstance(version, bool):
                raise TypeError
            version = operator.index(version)
        except TypeError:
            raise ValueError(f"dora_cpu weight store: a load must name the version it loads (global_steps, an "
                             f"integer), got {version!r}; held: {sorted(self.versions)}") from None
        if version not in self.versions:
            self._missing(version)  # raises unless it may still be published
        await self._event(version).wait()
        if version not in self.versions:  # published, and already evicted by newer ones
            self._missing(version)
        named, digest = self.versions[version]
        return version, named, digest

    def _missing(self, version: int) -> None:
        held = sorted(self.versions)
        if version in self.checksums:
            raise KeyError(f"dora_cpu weight store: version {version} is no longer kept (held: {held}; "
                           f"engine_kwargs.dora_cpu.keep_versions={self.keep})")
        newest = max(self.checksums, default=None)
        if newest is not None and version < newest:
            raise KeyError(f"dora_cpu weight store: version {version} was never published and is older than "
                           f"the newest published, {newest} (held: {held})")

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
            if global_steps is None:
                raise ValueError("dora_cpu: send_weights needs the version it publishes (global_steps), got None: "
                                 "a load names the version it loads, and an unnamed publication could not be "
                                 "told apart from the others")
            digest = checksum(named)
            version = int(global_steps)
            fresh = await self._get_store().publish.remote(version, named, digest)
            return {"dora_cpu/publish_s": time.perf_counter() - start, "dora_cpu/published_new": float(fresh)}

        async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator:
            if global_steps is None:
                raise ValueError("dora_cpu: receive_weights needs the version it loads (global_steps), got None: "
                                 "the store would not know which published weights to hand out")
            got, named, _ = await self._get_store().fetch.remote(int(global_steps))
            if got != int(global_steps):
                raise RuntimeError(f"dora_cpu: asked the weight store for version {global_steps}, "
                                   f"it answered with version {got}: not loaded")
            for name, tensor in named.items():
                yield name, tensor

    CheckpointEngineRegistry.register(BACKEND)(DoraCpuCheckpointEngine)
    return DoraCpuCheckpointEngine


DoraCpuCheckpointEngine = _register()

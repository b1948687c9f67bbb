"""The coordinator as verl's router plug-in: ``actor_rollout_ref.rollout.router_config_path``.

verl 0.9.1 builds the standalone pool's request router from that YAML (``router_class``, then
``cls.remote(servers, yaml_config)``, ``verl.workers.rollout.router``). ``DoraTrainer`` points the
key at ``router.yaml`` next to this module, so verl itself starts the coordinator as the pool's
router (nothing of verl's is killed or swapped); the trainer then hands it the run's
``DoraConfig`` (``setup``) before the first request.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from .coordinator import DoraCoordinator

CONFIG_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "router.yaml")


class _DoraRouter(DoraCoordinator):
    def __init__(self, servers: dict[str, Any], yaml_config: dict | None = None) -> None:
        self._servers = dict(servers)  # the scheduler starts at setup, once the config is known

    def setup(self, config: dict[str, Any]) -> None:
        DoraCoordinator.__init__(self, config, self._servers)


DoraRouter = ray.remote(num_cpus=0, max_concurrency=100_000)(_DoraRouter)

"""verl 0.9.1 on a CPU-only machine, through verl's own plug points (nothing in verl is patched).

Turned on by ``VERL_PLATFORM=cpu`` (the environment of the driver, inherited by every Ray
worker). ``dora_ext.verl.plugin`` (the ``verl.plugins`` entry point, imported by every
``import verl``) then:

* registers the ``cpu`` platform in ``PlatformRegistry`` (``platform.py``);
* wraps ``torch.distributed.init_process_group`` so that verl's ``cpu:gloo,cpu:gloo`` backend
  string becomes ``cpu:gloo`` (FSDP2 then runs over gloo);
* sets ``VERL_ENGINE_DEVICE=cuda`` (unless set): verl registers its FSDP engines for ``cuda`` and
  ``npu`` only, and they run on the CPU platform unchanged.

Always (whatever the platform), and only when verl imports the module that holds the registry:

* ``RolloutReplicaRegistry``: ``dora_cpu`` -> ``rollout.DoraCpuReplica`` (serves the HF model the
  actor trains, with transformers' model code);
* verl's rollout-class table (``verl.workers.rollout.base._ROLLOUT_REGISTRY``, which has no
  register function): ``("dora_cpu", "async")`` -> ``rollout.CpuServerAdapter``, used by verl's
  colocated ``sync`` trainer inside the actor workers.

The weight-sync backend is dora's one weight path on every machine, ``dora_store``
(``dora_ext.verl.weights``), registered by verl itself when
``checkpoint_engine.custom_backend_module=dora_ext.verl.weights``.

What a run needs besides (``recipes/verl/tiny_cpu.sh`` has all of it):
``actor_rollout_ref.actor.strategy=fsdp2``, ``+actor_rollout_ref.model.override_config.
attn_implementation=sdpa``, ``trainer.device=cpu``, ``+ray_kwargs.ray_init.num_gpus=<trainer ranks>``.
"""

from __future__ import annotations

import os

PLATFORM_ENV = "VERL_PLATFORM"
ROLLOUT_NAME = "dora_cpu"
ADAPTER_FQN = "dora_ext.verl.cpu.rollout.CpuServerAdapter"


def cpu_platform_selected() -> bool:
    return os.environ.get(PLATFORM_ENV, "").strip().lower() == "cpu"


def register_platform() -> None:
    from .platform import register_platform as _register

    _register()


def register_replica() -> None:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    def _load():
        from .rollout import DoraCpuReplica

        return DoraCpuReplica

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load)


def register_adapter() -> None:
    from verl.workers.rollout import base

    table = getattr(base, "_ROLLOUT_REGISTRY", None)
    if not isinstance(table, dict):
        raise RuntimeError("verl.workers.rollout.base._ROLLOUT_REGISTRY not found (verl changed)")
    table.setdefault((ROLLOUT_NAME, "async"), ADAPTER_FQN)


def install_process_fixes() -> None:
    """Per-process settings for the CPU platform (only when ``VERL_PLATFORM=cpu``)."""
    if not cpu_platform_selected():
        return
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    from .platform import dedupe_backend_strings

    dedupe_backend_strings()

"""A CPU platform for verl 0.9.1 (``VERL_PLATFORM=cpu``), registered in verl's ``PlatformRegistry``.

verl ships NVIDIA, Ascend and ROCm platforms and falls back to CUDA when none is found. On a
CPU-only machine this platform makes verl's device helpers answer for ``cpu``:

* ``device_name`` is ``"cpu"`` and ``current_device()`` returns ``"cpu"`` (verl passes
  ``get_device_id()`` to ``tensor.to()``);
* ``device_module`` is :data:`cpu_device_module`, ``torch.cpu`` plus the calls verl makes on a
  device module (``empty_cache``, ``mem_get_info``, ``memory_allocated``, ``set_device``, RNG
  state ...) as harmless CPU answers;
* the communication backend is ``gloo``. verl builds the string ``cpu:gloo,{device}:{backend}``,
  i.e. ``cpu:gloo,cpu:gloo`` here, which torch rejects; :func:`dedupe_backend_strings` (installed by
  ``dora_ext.verl.cpu.install`` in every process that imports verl) removes the duplicate;
* Ray resources stay ``GPU`` (verl's resource pools only count GPUs): start Ray with a logical
  ``num_gpus`` (``+ray_kwargs.ray_init.num_gpus=N``), one per trainer rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import types
from typing import Any, Optional

import torch

logger = logging.getLogger("dora_ext.verl")

NAME = "cpu"


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0


def _free_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` with the device-module calls verl makes answered for the CPU."""

    def __init__(self) -> None:
        super().__init__("dora_ext_cpu_device")
        self.Stream = torch.cpu.Stream
        self.Event = getattr(torch.cpu, "Event", None)

    # device
    def current_device(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, *_: Any) -> None:
        return None

    def get_device_name(self, *_: Any) -> str:
        return "cpu"

    def set_per_process_memory_fraction(self, *_: Any) -> None:
        return None

    def ipc_collect(self) -> None:
        return None

    def is_available(self) -> bool:
        return True

    def synchronize(self, *_: Any) -> None:
        return None

    def current_stream(self, *_: Any):
        return torch.cpu.current_stream()

    def stream(self, stream: Any = None):
        return contextlib.nullcontext()

    # memory
    def empty_cache(self) -> None:
        return None

    def mem_get_info(self, *_: Any) -> tuple[int, int]:
        return _free_memory(), _total_memory()

    def memory_allocated(self, *_: Any) -> int:
        return 0

    def memory_reserved(self, *_: Any) -> int:
        return 0

    def max_memory_allocated(self, *_: Any) -> int:
        return 0

    def max_memory_reserved(self, *_: Any) -> int:
        return 0

    def reset_peak_memory_stats(self, *_: Any) -> None:
        return None

    def memory_stats(self, *_: Any) -> dict:
        return {}

    # random numbers
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self, *_: Any):
        return torch.get_rng_state()

    def set_rng_state(self, state: Any, *_: Any) -> None:
        torch.set_rng_state(state)

    def __getattr__(self, item: str) -> Any:
        value = getattr(torch.cpu, item, None)
        if value is None:
            raise AttributeError(f"the dora-ext CPU device module has no {item!r}")
        return value


cpu_device_module = _CpuDeviceModule()


def build_platform_class() -> type:
    """The ``PlatformBase`` subclass (built lazily: verl's platform module is imported first)."""
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl platform for CPU-only machines (see ``dora_ext.verl.cpu.platform``)."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> types.ModuleType:
            return cpu_device_module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            # Only chosen explicitly (VERL_PLATFORM=cpu), never by auto-detection.
            return False

        def current_device(self):
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: Optional[int] = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {"num_gpus": num_gpus}

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def rollout_env_vars(self) -> dict[str, str]:
            return {}

        def get_collective_module(self) -> Any:
            return None

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def get_device_uuid(self, device_id):
            return f"cpu-{os.getpid()}"

        def cudart(self) -> Any:
            return None

    return PlatformCPU


def register_platform() -> None:
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get(NAME) is None:
        PlatformRegistry.register(platform=NAME)(build_platform_class())


def dedupe_backend(backend: Any) -> Any:
    """``"cpu:gloo,cpu:gloo"`` -> ``"cpu:gloo"``; any other value unchanged."""
    if isinstance(backend, str) and "," in backend:
        parts = [p.strip() for p in backend.split(",") if p.strip()]
        unique = list(dict.fromkeys(parts))
        if len(unique) != len(parts):
            return ",".join(unique)
    return backend


def dedupe_backend_strings() -> None:
    """Wrap ``torch.distributed.init_process_group`` so that a backend string naming the same
    device twice (verl's ``cpu:gloo,cpu:gloo`` on the CPU platform) is reduced to one entry."""
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, "_dora_dedupe", False):
        return

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any):
        return original(dedupe_backend(backend), *args, **kwargs)

    init_process_group._dora_dedupe = True  # type: ignore[attr-defined]
    init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    init_process_group.__doc__ = original.__doc__
    dist.init_process_group = init_process_group

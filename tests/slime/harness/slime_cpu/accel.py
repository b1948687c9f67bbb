"""Process setup for the slime CPU harness. `setup()` runs in the driver and, as Ray's
`worker_process_setup_hook`, in every Ray worker (rollout manager, SGLangEngine actors, train
actor).

* STAND-IN for the GPU: a CPU accelerator backend registered through slime's own plug point
  (`slime.utils.accelerator.register_accelerator`, "without changing Slime core"), selected with
  `SLIME_ACCELERATOR=cpu`.
* A version shim: slime 624b824 was written against sglang 0.5.15 (its docker image), whose
  `ServerArgs` is a dataclass; slime's `_compute_server_args` lists its fields with
  `dataclasses.fields`. The sglang installable here (0.5.23; 0.5.15 needs a CUDA torchvision)
  made `ServerArgs` a msgspec struct. slime's SGLangEngine module gets a dataclass with the
  same field names (only the names are read on the external-engine path; nothing constructs it).
"""

from __future__ import annotations

import os

import torch


def setup() -> None:
    from slime.utils.accelerator import register_accelerator
    from slime.utils.accelerator.base import Accelerator

    class CpuAccelerator(Accelerator):
        name = "cpu"
        device_type = "cpu"
        communication_backend_name = "gloo"

        def is_available(self) -> bool:
            return True

        def device(self, index=None) -> torch.device:
            return torch.device("cpu")

        def device_name(self, index=None) -> str:
            return "cpu"

        def set_device(self, index) -> None:
            return None

        def current_device(self):
            return "cpu"

        def device_count(self) -> int:
            return 1

        def synchronize(self, device=None) -> None:
            return None

        def current_stream(self, device=None):
            return None

        def empty_cache(self) -> None:
            return None

        def mem_get_info(self, device=None):
            return (1 << 34, 1 << 34)

        def memory_allocated(self, device=None) -> int:
            return 0

        def memory_reserved(self, device=None) -> int:
            return 0

    register_accelerator("cpu", CpuAccelerator, lambda: True, priority=0, communication_backends=("gloo",))
    os.environ["SLIME_ACCELERATOR"] = "cpu"
    _server_args_shim()


def _server_args_shim() -> None:
    import dataclasses
    import importlib.abc
    import sys

    def patch(module) -> None:
        sa = module.ServerArgs
        if dataclasses.is_dataclass(sa):
            return
        import msgspec

        names = [f.name for f in msgspec.structs.fields(sa)]
        module.ServerArgs = dataclasses.make_dataclass("ServerArgs", [(n, object, dataclasses.field(default=None)) for n in names])

    name = "slime.backends.sglang_utils.sglang_engine"
    if name in sys.modules:
        patch(sys.modules[name])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            loader = spec.loader
            orig = loader.exec_module

            def exec_module(module):
                orig(module)
                patch(module)

            loader.exec_module = exec_module
            return spec

    import importlib.util

    sys.meta_path.insert(0, Finder())

"""The ``verl.plugins`` entry point of dora-ext: imported by every ``import verl``.

verl loads this module at the end of its own ``__init__`` in every process that imports verl,
Ray workers included, so it must cost almost nothing and must never fail. It therefore imports
nothing heavy: verl's trainer registry lives in ``verl.trainer.ppo.v1`` (about 4 s of imports:
TransferQueue, the workers, the engines) and its loss registry in
``verl.trainer.ppo.core_algos``; importing them here would add that to every Ray worker.

Instead it installs *post-import hooks*: a finder on ``sys.meta_path`` that notices when Python
is about to execute one of those two modules and, right after the module body ran, registers
what dora-ext adds to it:

* ``verl.trainer.ppo.v1``        -> trainer ``dora`` (``register_trainer``), so that
  ``trainer.v1.trainer_mode=dora`` works with verl's own ``main_ppo``;
* ``verl.trainer.ppo.core_algos`` -> policy losses ``dora_sao`` and ``dora_decoupled``;
* ``verl.workers.rollout.replica`` -> rollouts ``dora_cpu`` and ``vllm`` (``vllm_server``: verl's
  vLLM replica with a per-request abort that works on vLLM >= 0.16; loaded, with vLLM, only when
  verl builds a vLLM replica).

If a module was imported already (``VERL_USE_EXTERNAL_PLUGINS=none`` and a later manual
``install()``), its callback runs at once. A callback that fails (a missing optional piece, a
changed verl) is logged as a warning and verl goes on without that piece.

Imports run one way: ``plugin`` -> ``trainer`` -> ``coordinator`` -> ``dora_ext.core`` (the
bridge to dora-ext's pluggy hooks, ``plugin_manager``, lives in ``coordinator``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from typing import Any, Callable

logger = logging.getLogger("dora_ext.verl")

TRAINER_NAME = "dora"
_V1 = "verl.trainer.ppo.v1"
_CORE_ALGOS = "verl.trainer.ppo.core_algos"

#: what ran, for inspection and tests: module name -> "ok" or the error text
status: dict[str, str] = {}


def _register_trainer() -> None:
    module = sys.modules.get("dora_ext.verl.trainer")
    if module is not None and not hasattr(module, "register"):
        # ``dora_ext.verl.trainer`` is being imported and its import of verl's trainer package
        # brought us here: it registers itself when its own body completes.
        return
    from .trainer import register

    register()


def _register_losses() -> None:
    from .losses import register

    register()


def _register_cpu_platform() -> None:
    from .cpu import register_platform

    register_platform()


def _register_replicas() -> None:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from .cpu import register_replica

    register_replica()
    RolloutReplicaRegistry.register("vllm", _vllm_replica)


def _vllm_replica() -> type:
    from .vllm_server import DoraVLLMReplica  # imports vLLM: only where verl builds a vLLM replica

    return DoraVLLMReplica


def _register_cpu_adapter() -> None:
    from .cpu import register_adapter

    register_adapter()


_CALLBACKS: dict[str, Callable[[], None]] = {
    _V1: _register_trainer,
    _CORE_ALGOS: _register_losses,
    "verl.plugin.platform.platform_manager": _register_cpu_platform,
    "verl.workers.rollout.replica": _register_replicas,
    "verl.workers.rollout.base": _register_cpu_adapter,
}


def _run(name: str) -> None:
    callback = _CALLBACKS.get(name)
    if callback is None or name in status:
        return
    try:
        callback()
        status[name] = "ok"
    except Exception as exc:  # never break verl: report and go on without this piece
        status[name] = f"{type(exc).__name__}: {exc}"
        logger.warning("dora-ext: could not extend %s (%s); verl runs without it", name, status[name])


class _PostImportLoader(importlib.abc.Loader):
    """Wraps the real loader; runs the dora-ext callback after the module body executed."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec):  # noqa: D401 - loader protocol
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        # Restore the real loader so that inspect/linecache/reload see the ordinary one.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        _run(self._name)

    def __getattr__(self, item: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._loader, item)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds the watched modules with the ordinary machinery and wraps their loaders."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in _CALLBACKS or fullname in status or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PostImportLoader(spec.loader, fullname)
        return spec


_finder: _PostImportFinder | None = None


def install() -> None:
    """Install the post-import hooks (idempotent); run callbacks of already-imported modules."""
    global _finder
    if _finder is None:
        _finder = _PostImportFinder()
        sys.meta_path.insert(0, _finder)
    for name in list(_CALLBACKS):
        if name in sys.modules:
            _run(name)


def plugin_manager() -> Any:
    """dora-ext's pluggy manager (see ``dora_ext.verl.coordinator.plugin_manager``)."""
    from .coordinator import plugin_manager as _pm

    return _pm()


try:
    from .cpu import install_process_fixes

    install_process_fixes()
    install()
except Exception as _exc:  # pragma: no cover - a broken interpreter state; never break verl
    logger.warning("dora-ext: verl plugin not installed: %s", _exc)

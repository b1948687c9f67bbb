"""The ``verl.plugins`` entry point: discovered by ``import verl``, harmless when pieces are missing.

Each check runs in a fresh interpreter, because what is tested is what ``import verl`` does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.slow  # each interpreter imports verl (~10 s)

DISCOVER = r"""
import json, sys
import verl
import dora_ext.verl.plugin as plugin
out = {"loaded_by_verl": "dora_ext.verl.plugin" in sys.modules, "v1_before": "verl.trainer.ppo.v1" in sys.modules}
from verl.trainer.ppo.v1 import get_trainer_cls
from verl.trainer.ppo.core_algos import get_policy_loss_fn
cls = get_trainer_cls("dora")
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
out["trainer"] = f"{cls.__module__}.{cls.__qualname__}"
out["subclass"] = issubclass(cls, PPOTrainerSeparateAsync)
out["losses"] = [get_policy_loss_fn(n).__name__ for n in ("dora_sao", "dora_decoupled")]
out["status"] = plugin.status
from verl.workers.rollout.replica import RolloutReplicaRegistry
out["vllm_loader"] = RolloutReplicaRegistry._registry["vllm"].__qualname__
out["vllm_imported"] = sorted(n for n in sys.modules if n.split(".")[0] == "vllm" or n.endswith("vllm_server"))
print("RESULT" + json.dumps(out))
"""

BLOCKED = r"""
import json, sys
# Simulate a dora-ext install without its optional pieces: these imports now fail.
for name in ("dora_ext.verl.trainer", "dora_ext.core.scheduler", "dora_ext.algo.losses"):
    sys.modules[name] = None
import verl
from verl.trainer.ppo.v1 import get_trainer_cls
from verl.trainer.ppo.core_algos import get_policy_loss_fn
import dora_ext.verl.plugin as plugin
out = {"sync": get_trainer_cls("sync").__name__, "status": plugin.status}
try:
    get_trainer_cls("dora")
    out["dora"] = "registered"
except ValueError as exc:
    out["dora"] = str(exc)
print("RESULT" + json.dumps(out))
"""


TRAINER_FIRST = r"""
import json
# Importing dora's trainer module before verl's trainer package: that import runs the plugin's
# hook while the module is half-initialised; the trainer must still end up registered.
from dora_ext.verl.trainer import DoraTrainer
from verl.trainer.ppo.v1 import get_trainer_cls
import dora_ext.verl.plugin as plugin
print("RESULT" + json.dumps({"same": get_trainer_cls("dora") is DoraTrainer, "status": plugin.status}))
"""


def _run(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def test_entry_point_is_declared():
    eps = [ep for ep in entry_points(group="verl.plugins") if ep.name == "dora"]
    assert [ep.value for ep in eps] == ["dora_ext.verl.plugin"]


def test_import_verl_discovers_trainer_and_losses():
    out = _run(DISCOVER)
    assert out["loaded_by_verl"] is True
    # The plugin itself must not pull in verl's trainer package (it is heavy); the hook does later.
    assert out["v1_before"] is False
    assert out["trainer"] == "dora_ext.verl.trainer.DoraTrainer"
    assert out["subclass"] is True
    assert out["losses"] == ["dora_sao", "dora_decoupled"]
    assert out["status"] == {k: "ok" for k in (
        "verl.trainer.ppo.v1", "verl.trainer.ppo.core_algos", "verl.plugin.platform.platform_manager",
        "verl.workers.rollout.replica", "verl.workers.rollout.base")}
    # verl's vLLM rollout gets dora's server (working per-request aborts), loaded only when verl
    # builds a vLLM replica: nothing imports vLLM here (``test_vllm_abort`` runs the class).
    assert out["vllm_loader"] == "_vllm_replica" and out["vllm_imported"] == []


def test_import_verl_survives_missing_optional_pieces():
    out = _run(BLOCKED)
    assert out["sync"] == "PPOTrainerSync"  # verl itself is intact
    assert "Unknown trainer 'dora'" in out["dora"]
    assert "dora_ext.verl.trainer" in out["status"]["verl.trainer.ppo.v1"]
    # The loss registration only needs verl; the maths module is imported when a loss is called.
    assert out["status"]["verl.trainer.ppo.core_algos"] == "ok"


def test_trainer_module_imported_before_verl_trainer_package():
    out = _run(TRAINER_FIRST)
    assert out["same"] is True
    assert out["status"]["verl.trainer.ppo.v1"] == "ok"

"""A chosen subset of verl's own CPU tests (shipped in the verl wheel) passes with dora-ext installed.

They run in one pytest session together with a probe that checks the plugin really was active in
that session (trainer ``dora`` and the ``dora_*`` losses registered), so "passes with the plugin
installed" is verified, not assumed. Chosen for speed and for touching what the plugin extends:
the policy-loss registry and loss aggregation, core algorithms, configs, multi-trajectory
advantages.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

import pytest

pytestmark = pytest.mark.slow

CHOSEN = [
    "tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py",
    "tests/trainer/ppo/test_core_algos_on_cpu.py",
    "tests/trainer/ppo/test_loss_aggregation_on_cpu.py",
    "tests/test_base_config_on_cpu.py",
    "tests/trainer/test_multi_trajectories_advantage_on_cpu.py",
]

PROBE = '''
def test_dora_plugin_active_in_this_session():
    import dora_ext.verl.plugin as plugin
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.trainer.ppo.v1 import get_trainer_cls

    assert get_trainer_cls("dora").__name__ == "DoraTrainer"
    assert get_policy_loss_fn("dora_sao").__module__ == "dora_ext.verl.losses"
    assert plugin.status["verl.trainer.ppo.v1"] == "ok" and plugin.status["verl.trainer.ppo.core_algos"] == "ok"
'''


def test_verl_cpu_tests_pass_with_plugin(tmp_path):
    site = sysconfig.get_paths()["purelib"]
    files = [os.path.join(site, f) for f in CHOSEN]
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        pytest.skip(f"verl's shipped tests not found: {missing}")
    probe = tmp_path / "test_probe_dora_plugin.py"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"}  # default: auto
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={site}", "-c", os.devnull,
         *files, str(probe)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail

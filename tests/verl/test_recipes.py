"""Every verl recipe composes with the installed verl's ``ppo_trainer.yaml`` in every twin mode.

The recipe scripts call ``$PYTHON -m verl.trainer.main_ppo <overrides>``; with
``recipes/verl/check_overrides.py`` as ``$PYTHON`` they compose the config instead of training,
so a misspelt key or an invalid ``dora`` value fails here rather than on a GPU cluster.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes" / "verl"
_EXT = " vllm_worker=dora_ext.verl.vllm_worker.DoraWorkerExtension"  # the load checks' vLLM worker method
CASES = [
    ("dapo_qwen25_math_7b.sh", "dora", "OK dora batch=512 n=16 K=1 instances=16 mode=dora weights=dora_store" + _EXT),
    ("dapo_qwen25_math_7b.sh", "separate_async", "OK separate_async batch=512 n=16"),
    ("dapo_qwen25_math_7b.sh", "sync", "OK sync batch=512 n=16"),
    ("grpo_qwen3_1_7b.sh", "pipeline", "OK dora batch=64 n=8 K=0 instances=4 mode=pipeline weights=dora_store" + _EXT),
    ("grpo_qwen3_1_7b.sh", "dora", "OK dora batch=64 n=8 K=1 instances=4 mode=dora weights=dora_store" + _EXT),
    ("grpo_qwen3_1_7b.sh", "separate_async", "OK separate_async batch=64 n=8"),
    ("grpo_qwen3_1_7b.sh", "sync", "OK sync batch=64 n=8"),
]


@pytest.mark.parametrize("script, mode, expected", CASES)
def test_recipe_composes(script, mode, expected, tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("bash is not available")
    env = dict(os.environ, MODE=mode, HOME=str(tmp_path),
               PYTHON=f"{sys.executable} {RECIPES / 'check_overrides.py'}")
    proc = subprocess.run(["bash", str(RECIPES / script)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expected in proc.stdout.splitlines(), proc.stdout[-2000:]


def test_twin_wrappers_point_at_their_recipe():
    for wrapper in sorted(RECIPES.glob("*_*.sh")):
        text = wrapper.read_text()
        if "exec env MODE=" not in text:
            continue
        mode = text.split("exec env MODE=")[1].split()[0]
        base = text.split('"$(dirname "$0")/')[1].split('"')[0]
        assert wrapper.name == base.replace(".sh", f"_{mode}.sh"), wrapper.name
        assert os.access(wrapper, os.X_OK)

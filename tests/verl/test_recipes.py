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


def _smoke(tmp_path, **env_over):
    """Run ``benchmarks/gpu_verl_smoke.sh`` with its runs composed instead of trained. Stand-ins:
    ``python3`` on PATH sends ``-m verl.trainer.main_ppo <overrides>`` to ``check_overrides.py``
    (no GPU here) and answers the engines' import check (``python3 -c "import vllm, ..."``; neither
    engine is installed here); the evidence stage is the real one and fails on the empty evidence.
    Returns the process and the leg logs' last lines."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(parents=True)
    out.mkdir()
    shim = bin_dir / "python3"
    shim.write_text(f"""#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = verl.trainer.main_ppo ]; then shift 2; exec {sys.executable} {RECIPES / 'check_overrides.py'} "$@"; fi
if [ "$1" = -c ]; then exit 0; fi
exec {sys.executable} "$@"
""")
    shim.chmod(0o755)
    for name, arch in (("qwen", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(f'{{"architectures": ["{arch}"]}}')
    (tmp_path / "train.parquet").touch()
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_MODEL_PATH"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", NUM_GPUS="3", OUT=str(out),
               MODEL_PATH=str(tmp_path / "qwen"), TRAIN_FILES=str(tmp_path / "train.parquet"),
               VAL_FILES=str(tmp_path / "train.parquet"), PYTHONPATH=str(ROOT), **env_over)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_verl_smoke.sh")], capture_output=True, text=True,
                          env=env, timeout=600)
    logs = {p.stem: p.read_text().strip().splitlines()[-1] for p in sorted(out.glob("*.log"))}
    return proc, logs


def test_gpu_smoke_without_an_sglang_model_fails_before_running_anything(tmp_path):
    """The smoke's default ENGINES has sglang; without SGLANG_MODEL_PATH its SGLang leg cannot run.
    Skipping it and ending ``SMOKE OK`` (exit 0) counted an unrun leg as passing: it must stop at
    once, naming SGLANG_MODEL_PATH and ENGINES=vllm (the honest vLLM-only run)."""
    if shutil.which("bash") is None:
        pytest.skip("bash is not available")
    proc, logs = _smoke(tmp_path)
    assert proc.returncode != 0 and logs == {}, (proc.returncode, logs)
    assert "SGLANG_MODEL_PATH" in proc.stderr and "ENGINES=vllm" in proc.stderr, proc.stderr[-2000:]


def test_gpu_smoke_legs_compose_and_pass_dora_launch_checks(tmp_path):
    """Every run of the smoke (dora and its twin, vLLM on MODEL_PATH, SGLang on SGLANG_MODEL_PATH)
    composes with verl's config and passes ``configure``: a Llama SGLang model is accepted, a Qwen
    one is refused at launch by the SGLang check."""
    if shutil.which("bash") is None:
        pytest.skip("bash is not available")
    proc, logs = _smoke(tmp_path, SGLANG_MODEL_PATH=str(tmp_path / "llama"))
    assert logs == {"dora_vllm": "OK dora batch=8 n=8 K=2 instances=2 mode=dora weights=dora_store" + _EXT,
                    "separate_async_vllm": "OK separate_async batch=8 n=8",
                    "dora_sglang": "OK dora batch=8 n=8 K=2 instances=2 mode=dora weights=dora_store",
                    "separate_async_sglang": "OK separate_async batch=8 n=8"}, logs
    assert proc.returncode == 1 and "SMOKE FAIL: dora_vllm: all steps logged" in proc.stderr  # no evidence here
    proc, logs = _smoke(tmp_path / "again", ENGINES="sglang", SKIP_TWIN="1", SGLANG_MODEL_PATH=str(tmp_path / "qwen"))
    assert proc.returncode == 1 and "get_weights_by_name" in logs["dora_sglang"], logs

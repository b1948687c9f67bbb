"""The slime recipes: each dora script and its baseline twin launch the same run but for the dora flags. slime, Ray and
GPUs are ABSENT here: `ray` is a stand-in executable that records the command it was given, and SLIME_DIR is a stand-in
holding only what the scripts read (the model args file and, for the patch check, the patched file rebuilt from the
patch itself)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from dora_ext.slime.cli import slime_flags

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes" / "slime"
PAIRS = [("qwen3-1.7B-grpo", "train.py", "train.py"), ("qwen3-4B-dapo", "train_async.py", "train_async.py")]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None,
                                reason="bash and git are needed to run the recipe scripts")


def _fake_slime(tmp_path: Path) -> Path:
    slime = tmp_path / "slime"
    (slime / "scripts" / "models").mkdir(parents=True)
    for name in ("qwen3-1.7B.sh", "qwen3-4B.sh"):
        (slime / "scripts" / "models" / name).write_text("MODEL_ARGS=(--num-layers 2 --hidden-size 8)\n")
    # The patched actor_group.py: the patch's pre-image with the patch applied.
    patch = (ROOT / "patches" / "slime" / "0001-rollout-weight-reload-hook.patch").read_text()
    body = patch[patch.index("diff --git"):]
    pre = [l[1:] for l in body.splitlines()[4:] if l.startswith((" ", "-"))]
    target = slime / "slime" / "ray" / "actor_group.py"
    target.parent.mkdir(parents=True)
    target.write_text("\n".join(pre) + "\n")
    (tmp_path / "p.patch").write_text(body)
    subprocess.run(["git", "apply", str(tmp_path / "p.patch")], cwd=slime, check=True)
    return slime


def _run(script: str, tmp_path: Path, slime: Path, run_name: str, extra_env: dict | None = None) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / f"ray-{run_name}.log"
    (bin_dir / "ray").write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" >> "{log}"\necho --- >> "{log}"\n')
    (bin_dir / "ray").chmod(0o755)
    env = dict(os.environ, SLIME_DIR=str(slime), RUN_DIR=str(tmp_path / run_name), RUN_NAME=run_name,
               PATH=os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), os.environ["PATH"]]),
               **(extra_env or {}))
    r = subprocess.run(["bash", str(RECIPES / script)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().split("---\n")
    submit = next(c for c in calls if c.startswith("job\nsubmit"))
    words = submit.split("\n")
    return words[words.index("--") + 1:-1]


@pytest.mark.parametrize("recipe, base_loop, dora_loop", PAIRS)
def test_dora_script_is_its_baseline_twin_plus_dora_flags(tmp_path, recipe, base_loop, dora_loop):
    slime = _fake_slime(tmp_path)
    base = _run(f"{recipe}-baseline.sh", tmp_path, slime, "baseline")
    dora = _run(f"{recipe}-dora.sh", tmp_path, slime, "dora")
    assert base[:2] == ["python3", base_loop] and dora[:2] == ["python3", dora_loop]
    strip = lambda argv, name: [w.replace(str(tmp_path / name), "RUN") for w in argv]  # noqa: E731
    base, dora = strip(base, "baseline"), strip(dora, "dora")
    assert dora[: len(base)] == base, "the dora twin changes a baseline setting"
    extra = dora[len(base):]
    assert extra[extra.index("--rollout-function-path") + 1] == "dora_ext.slime.rollout.generate_rollout"
    assert extra[extra.index("--update-weight-disk-dir") + 1] == "RUN/weights"
    assert "--colocate" not in base  # equal hardware: both on the same split pools
    assert base[base.index("--update-weight-transport") + 1] == "disk"  # the same weight transport
    assert ("--use-tis" in base) == ("--use-tis" in extra)  # the same staleness correction


def test_dora_script_refuses_an_unpatched_slime(tmp_path):
    slime = _fake_slime(tmp_path)
    subprocess.run(["git", "apply", "--reverse", str(tmp_path / "p.patch")], cwd=slime, check=True)
    env = dict(os.environ, SLIME_DIR=str(slime), RUN_DIR=str(tmp_path / "r"),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    r = subprocess.run(["bash", str(RECIPES / "qwen3-1.7B-grpo-dora.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "apply patches/slime" in r.stderr


@pytest.mark.parametrize("name, k", [("dora-pipeline.yaml", 0), ("dora-k2.yaml", 2)])
def test_recipe_configs_are_valid(name, k):
    data = yaml.safe_load((RECIPES / name).read_text())
    flags = slime_flags(data, str(RECIPES / name), "/shared/w")
    assert ("--use-tis" in flags) == (k > 0)


SCRIPTS = ["qwen3-1.7B-grpo-baseline.sh", "qwen3-1.7B-grpo-dora.sh", "qwen3-4B-dapo-baseline.sh", "qwen3-4B-dapo-dora.sh"]


@pytest.mark.slow
def test_recipe_flags_pass_slimes_own_argument_parser(tmp_path, patched_slime):
    """Each script's `ray job submit ... -- python3 train*.py FLAGS`, with SLIME_DIR a real
    (patched) slime checkout, parsed by slime's own `parse_args` (slime/utils/arguments.py),
    Megatron-LM's parser standing in (tests/slime/harness/slime_cpu/parse_flags.py). The model and
    data paths point at empty stand-ins (slime checks that they exist)."""
    import json

    from slime_helpers import harness_env

    models, data = tmp_path / "models", tmp_path / "data"
    for d in ("Qwen3-1.7B", "Qwen3-1.7B_torch_dist", "Qwen3-4B", "Qwen3-4B_torch_dist"):
        (models / d).mkdir(parents=True)
    for f in ("dapo-math-17k/dapo-math-17k.jsonl", "aime-2024/aime-2024.jsonl"):
        (data / f).parent.mkdir(parents=True, exist_ok=True)
        (data / f).write_text("")
    argvs = []
    for script in SCRIPTS:
        run_name = script.rsplit("-", 1)[1].removesuffix(".sh")
        (tmp_path / script).mkdir()
        argv = _run(script, tmp_path / script, patched_slime, run_name,
                    {"MODEL_ROOT": str(models), "DATA_ROOT": str(data)})
        assert argv[0] == "python3" and argv[1] in ("train.py", "train_async.py")
        argvs.append(argv[2:])
    r = subprocess.run([sys.executable, "-m", "slime_cpu.parse_flags"], input=json.dumps(argvs), text=True,
                       capture_output=True, env=harness_env(patched_slime), cwd=patched_slime, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = json.loads(r.stdout.strip().splitlines()[-1])
    for script, out in zip(SCRIPTS, outs):
        assert out["unknown"] == [], f"{script}: flags no parser knows: {out['unknown']}"
        a = out["args"]
        if script.endswith("-dora.sh"):
            assert a["rollout_function_path"] == a["eval_function_path"] == "dora_ext.slime.rollout.generate_rollout"
            assert a["data_source_path"] == "dora_ext.slime.data_source.DoraDataSource"
            assert a["update_weight_transport"] == "disk" and a["update_weight_disk_dir"].endswith("/weights")
            assert a["custom_rollout_weight_reload_path"] == "dora_ext.slime.weights.publish_weights"
            assert out["dora_config"]["mode"] in ("pipeline", "dora")
        else:
            assert a["rollout_function_path"] == "slime.rollout.sglang_rollout.generate_rollout"
            assert "dora_config" not in out


@pytest.mark.parametrize("room, linked", [(True, False), (False, False), (False, True)])
def test_a_weights_dir_in_node_memory_without_room_for_the_versions_stops_the_launch(tmp_path, room, linked):
    """WEIGHTS_DIR on tmpfs (/dev/shm): both twins write there and load from there; a tmpfs that
    cannot hold WEIGHT_VERSIONS checkpoints of the model stops the launch, naming the directory.
    The model's size counts its files through symlinks (a linked model dir, a Hugging Face snapshot)."""
    from dora_ext.slime.settings import memory_fs

    if memory_fs("/dev/shm") is None:
        pytest.skip("no tmpfs at /dev/shm on this machine")
    slime = _fake_slime(tmp_path)
    model = tmp_path / ("blobs" if linked else "models/Qwen3-1.7B")
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    if linked:
        (tmp_path / "models").mkdir()
        (tmp_path / "models" / "Qwen3-1.7B").symlink_to(model)
    weights = tempfile.mkdtemp(dir="/dev/shm")
    # No room: a 1 MB model takes 16 times the free space; its symlink (at most a 4 KB block) would fit.
    versions = 4 if room else shutil.disk_usage(weights).free // 1024 // 16 + 1
    env = {"MODEL_ROOT": str(tmp_path / "models"), "WEIGHTS_DIR": weights, "WEIGHT_VERSIONS": str(versions)}
    try:
        if room:
            argv = _run("qwen3-1.7B-grpo-dora.sh", tmp_path, slime, "dora", env)
            assert argv.count(weights) == 2  # the baseline's --update-weight-disk-dir and the dora flags'
        else:
            with pytest.raises(AssertionError, match=f"WEIGHTS_DIR={weights} is tmpfs with .* KB free"):
                _run("qwen3-1.7B-grpo-dora.sh", tmp_path, slime, "dora", env)
    finally:
        shutil.rmtree(weights, ignore_errors=True)

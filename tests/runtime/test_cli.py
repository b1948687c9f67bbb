"""`dora-ext train` and `dora-ext compare` end to end on a tiny recipe (real engines, real trainer)."""

from __future__ import annotations

import json

import pytest
import yaml

from dora_ext.cli import main
from dora_ext.runtime.report import JSON_KEYS

from .conftest import tiny


@pytest.fixture()
def recipe_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny(steps=3)))
    return str(path)


def test_compare_json_has_exactly_the_documented_shape(recipe_file, tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["compare", recipe_file, "--modes", "sync,dora", "--json", "--no-progress", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    data = json.loads(captured.out)
    assert set(data) == {"recipe", "modes"} and data["recipe"] == "tiny"
    assert list(data["modes"]) == ["sync", "dora"]
    for mode, row in data["modes"].items():
        assert set(row) == set(JSON_KEYS), mode
        assert row["c1_ok"] is True and row["c2_ok"] is True and row["c3_ok"] is True
        assert row["throughput_tokens_per_s"] > 0 and 0.0 <= row["final_reward_mean"] <= 1.0
    assert data["modes"]["sync"]["speedup_vs_sync"] == 1.0
    assert data["modes"]["sync"]["staleness_max"] == 0
    assert data["modes"]["dora"]["staleness_max"] <= 2
    assert "plots:" in captured.err  # says where the plots went
    for name in ("compare.json", "rewards.png", "reward_vs_time.png", "timeline.png", "sync-seed0.jsonl", "dora-seed0.jsonl"):
        assert (out / name).stat().st_size > 0, name


def test_train_writes_metrics_report_and_plots(recipe_file, tmp_path, capsys):
    out = tmp_path / "train"
    rc = main(["train", recipe_file, "--mode", "one_step_off", "--steps", "2", "--seed", "1", "--no-progress",
               "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1]
    for key in ("throughput_tokens_per_s", "reward_mean", "staleness_max", "live_versions", "weight_loads",
                "multi_version_trajectory_share", "c1_ok", "c2_ok", "c3_ok"):
        assert key in lines[0], key
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "one_step_off" and report["seed"] == 1 and report["metrics"]["c2_ok"] is True
    assert (out / "reward.png").stat().st_size > 0 and (out / "timeline.png").stat().st_size > 0
    assert "C1 yes" in captured.out and "throughput" in captured.out


def test_recipe_errors_exit_2_naming_the_field(recipe_file, tmp_path, capsys):
    rc = main(["train", recipe_file, "--set", "trainer.lr=-1", "--out", str(tmp_path / "x")])
    assert rc == 2
    assert "trainer.lr" in capsys.readouterr().err
    rc = main(["compare", recipe_file, "--modes", "sync,warp", "--out", str(tmp_path / "y")])
    assert rc == 2
    assert "modes" in capsys.readouterr().err


def test_train_resume_refuses_what_it_cannot_use(recipe_file, tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no run.json" in capsys.readouterr().err
    assert main(["train", recipe_file, "--resume", str(tmp_path)]) == 2
    assert "--resume: takes the run's folder only" in capsys.readouterr().err
    assert main(["train"]) == 2
    assert "recipe: give a recipe YAML file, or --resume DIR" in capsys.readouterr().err


def test_resume_keeps_the_runs_checkpoint_interval(recipe_file, tmp_path, monkeypatch):
    """A resumed run checkpoints as often as the run it continues (run.json), unless told otherwise:
    a run started with --checkpoint-every 3 and resumed must not fall back to the default 50."""
    seen = []

    def fake_runtime(recipe, prepared, **kw):  # stands in for the run itself: only its arguments matter here
        seen.append(kw["checkpoint_every"])
        raise ValueError("stopped before the run")

    monkeypatch.setattr("dora_ext.runtime.runtime.Runtime", fake_runtime)
    monkeypatch.setattr("dora_ext.runtime.runtime.prepare", lambda recipe: None)
    out = str(tmp_path / "run")
    assert main(["train", recipe_file, "--out", out, "--checkpoint-every", "3", "--no-progress"]) == 1
    assert main(["train", "--resume", out, "--no-progress"]) == 1
    assert main(["train", "--resume", out, "--checkpoint-every", "5", "--no-progress"]) == 1
    assert main(["train", recipe_file, "--out", str(tmp_path / "other"), "--no-progress"]) == 1
    assert seen == [3, 3, 5, 50]

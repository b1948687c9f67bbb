"""The reward-vs-time helpers used by `compare` and the CPU benchmark."""

from types import SimpleNamespace

import pytest

from dora_ext.runtime.report import mean_over, policy_rewards, smoothed, time_to_reward


def _run(rewards):
    return SimpleNamespace(steps=[{"step": i, "reward_mean": r, "time_s": 10.0 * (i + 1)} for i, r in enumerate(rewards)])


def test_smoothed_is_a_trailing_mean():
    assert smoothed([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5]
    assert smoothed([4.0], 3) == [4.0]


def test_time_to_reward_counts_full_windows_only():
    # high first batch (an asynchronous mode's short answers first), then a climb
    run = _run([0.9, 0.2, 0.2, 0.4, 0.6, 0.8])
    assert time_to_reward(run, 0.5, 3) == 60.0  # (0.4 + 0.6 + 0.8) / 3 = 0.6 at step 6
    assert time_to_reward(run, 0.7, 3) is None
    assert time_to_reward(run, 0.5, 1) == 10.0


def test_policy_rewards_place_a_batch_at_its_policys_publication_time():
    # version 0 at 0 s, version 1 at 10 s (step 0 ended), version 2 at 20 s, version 3 at 30 s
    steps = [{"step": 0, "time_s": 10.0, "reward_mean": 0.1, "staleness_mean": 0.0},
             {"step": 1, "time_s": 20.0, "reward_mean": 0.2, "staleness_mean": 1.0},   # version 0
             {"step": 2, "time_s": 30.0, "reward_mean": 0.3, "staleness_mean": 0.5}]   # version 1.5
    assert policy_rewards(SimpleNamespace(steps=steps)) == [(0.0, 0.1), (0.0, 0.2), (15.0, 0.3)]


def test_mean_over_is_the_time_average_of_the_linear_curve():
    pts = [(0.0, 0.0), (10.0, 1.0), (20.0, 1.0)]
    assert mean_over(pts, 0.0, 10.0) == pytest.approx(0.5)
    assert mean_over(pts, 5.0, 15.0) == pytest.approx((0.5 * 0.75 + 0.5 * 1.0))
    assert mean_over(pts, 5.0, 25.0) is None and mean_over(pts, -1.0, 5.0) is None  # not covered
    assert mean_over([(0.0, 0.0), (0.0, 1.0), (10.0, 0.5)], 0.0, 10.0) == pytest.approx(0.5)  # same time: averaged


def _bench(name):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _metrics(final, tps, stale, **kw):
    return {"final_reward": final, "throughput_tokens_per_s": tps, "staleness_mean": stale, "staleness_max": 2,
            "staleness_hist": {0: 1, 2: 3}, "initial_reward": 0.5, "wall_s": 60.0, "trainer_wait_ratio": 0.1,
            "c1_ok": True, "c2_ok": True, "c3_ok": True, **kw}


def test_convergence_statistics_on_synthetic_runs():
    import math
    import statistics

    conv = _bench("convergence")
    assert conv.t975(1) == 12.706 and conv.t975(4) == 2.776 and conv.t975(200) == 1.96
    xs = [0.80, 0.82, 0.78, 0.84, 0.81]
    lo, hi = conv.ci95(xs)
    half = 2.776 * statistics.stdev(xs) / math.sqrt(5)
    assert (lo, hi) == pytest.approx((0.81 - half, 0.81 + half)) and conv.ci95([0.8]) is None
    sync = [SimpleNamespace(seed=s, max_staleness=0, steps=_run([0.5, 0.6, 0.7, 0.8]).steps,
                            metrics=_metrics(0.8, 100.0, 0.0)) for s in (0, 1)]
    dora = [SimpleNamespace(seed=s, max_staleness=2, steps=_run(rs).steps, metrics=_metrics(f, t, 1.5))
            for s, rs, f, t in ((0, [0.9, 0.7, 0.8, 0.8], 0.82, 120.0), (1, [0.1, 0.2, 0.3, 0.4], 0.78, 90.0))]
    target = statistics.mean(conv.final_train_reward(r, 2) for r in sync)
    assert target == pytest.approx(0.75)
    a = conv.summarise(dora, sync, target, 2)
    # full windows only: (0.9 + 0.7) / 2 = 0.8 at step 2 (20 s); the second seed never gets there
    assert a["time_to_target_s"] == [20.0, None] and a["time_to_target_median_s"] == 20.0
    assert a["tokens_per_s_ratio_to_sync"] == pytest.approx([1.2, 0.9])
    assert a["final_reward_mean"] == pytest.approx(0.80) and a["staleness_mean"] == 1.5
    assert a["staleness_hist"] == {"0": 2, "2": 6} and a["c1_ok"] and a["c3_ok"]
    # equal time: the latest policy time both reach is sync's 30 s (version 3); sync's last 2 batches
    # cover policy times 10-30 s; a mode stepping as sync with the same rewards is level with it
    times = conv.equal_times({"sync": sync, "dora": dora})
    assert times == [30.0, 30.0]
    b = conv.summarise(dora, sync, target, 2, times)
    assert b["equal_time_span_s"] == [20.0, 20.0]
    # over 10-30 s, seed 0: dora's curve 0.7, 0.8, 0.8 gives (0.75 + 0.8) / 2, sync's 0.6, 0.7, 0.8
    # gives 0.7; seed 1: dora's 0.2, 0.3, 0.4 gives 0.3
    assert b["train_reward_at_equal_time"] == pytest.approx([0.775, 0.3])
    assert b["train_reward_at_equal_time_minus_sync"] == pytest.approx([0.075, -0.4])
    assert b["train_reward_at_equal_time_minus_sync_mean"] == pytest.approx(-0.1625)
    assert b["train_reward_at_equal_time_seeds"] == 2


def test_equal_time_reward_favours_neither_step_length_nor_staleness():
    """Both modes' batch rewards are one linear function of their policy's time; dora steps twice
    as often and trains batches 2 versions old. The equal-time difference is 0 (a step-count window
    read at step end times gave the faster mode a head start); a mode 0.05 better is 0.05 ahead."""
    conv = _bench("convergence")

    def curve(step_s, stale, n, lift=0.0):
        steps = []
        for k in range(n):
            s = min(k, stale)
            policy_t = step_s * (k - s)  # version k - s was published when step k - s - 1 ended
            steps.append({"step": k, "time_s": step_s * (k + 1), "staleness_mean": float(s),
                          "reward_mean": 0.5 + 0.01 * policy_t + lift})
        return SimpleNamespace(seed=0, max_staleness=stale, steps=steps, metrics=_metrics(0.8, 1.0, float(stale)))

    sync, dora, better = curve(10.0, 0, 8), curve(5.0, 2, 12), curve(5.0, 2, 12, lift=0.05)
    times = conv.equal_times({"sync": [sync], "dora": [dora]})
    assert times == [45.0]  # dora's last batch came from version 9, published at 45 s
    a = conv.summarise([dora], [sync], 0.7, 2, times)
    assert a["equal_time_span_s"] == [20.0]  # sync's batches at 20, 30, 40 s
    assert a["train_reward_at_equal_time"] == pytest.approx([0.5 + 0.01 * 35.0])
    assert a["train_reward_at_equal_time_minus_sync"][0] == pytest.approx(0.0, abs=1e-12)
    assert conv.summarise([better], [sync], 0.7, 2, times)["train_reward_at_equal_time_minus_sync"][0] == \
        pytest.approx(0.05)


def test_compare_table_shows_mean_staleness_and_no_std_of_one_seed():
    from dora_ext.runtime.report import aggregate, table

    def result(seed, stale, final):
        m = _metrics(final, 100.0, stale, rollout_bubble_ratio=0.2, multi_version_trajectory_share=0.0,
                     live_versions_max=2, migrations=0, weight_loads=3)
        return SimpleNamespace(seed=seed, metrics=m, max_staleness=2, split="1:1")

    rows = {line.split("  ")[0]: line for line in table(aggregate({"dora": [result(0, 1.25, 0.8)]})).splitlines()}
    assert rows["reward: final (std)"].endswith("n/a (1 seed)")
    # (the mean over the trained groups, from the runs' staleness histograms: {0: 2, 2: 6})
    assert rows["staleness mean (trained)"].endswith("1.50")
    agg = aggregate({"dora": [result(0, 1.0, 0.8), result(1, 2.0, 0.9)]})
    rows = {line.split("  ")[0]: line for line in table(agg).splitlines()}
    assert rows["reward: final (std)"].endswith("0.071") and rows["staleness mean (trained)"].endswith("1.50")


def test_sao_study_collapse_is_read_from_the_rewards():
    sao = _bench("sao_vs_grpo")
    assert sao.max_drop([0.2, 0.6, 0.45, 0.7, 0.4, 0.9]) == pytest.approx(0.3)
    steps = lambda rs: [{"reward_mean": r, "entropy": 1.0, "time_s": i} for i, r in enumerate(rs)]  # noqa: E731
    runs = [SimpleNamespace(seed=0, steps=steps([0.5, 0.6, 0.7, 0.7]), metrics=_metrics(0.72, 1.0, 2.0)),
            SimpleNamespace(seed=1, steps=steps([0.5, 0.8, 0.4, 0.4]), metrics=_metrics(0.52, 1.0, 2.0)),
            SimpleNamespace(seed=2, steps=steps([0.5, 0.5, 0.5, 0.5]), metrics=_metrics(0.40, 1.0, 2.0))]
    c = sao.cell(runs, 2)
    # seed 1: the 2-step mean falls from 0.65 to 0.4 (>= 0.15); seed 2 ends 0.1 below its start
    assert c["collapsed"] == [False, True, True] and c["any_collapsed"] and c["final_entropy"] == [1.0] * 3
    assert c["max_drop"][:2] == [0.0, pytest.approx(0.25)] and sao.summary(sao.records_of(c)) == c  # (--resume)
    assert c["collapse_step"] == [None, 3, None]  # seed 1's 2-step mean first falls at step 3 (0.8, 0.4)
    assert sao.drop_start([0.2, 0.6, 0.45, 0.7, 0.4, 0.9]) == 4 and sao.drop_start([1, 1]) is None


def test_sao_study_lr_flag_names_every_method(capsys):
    with pytest.raises(SystemExit):
        _bench("sao_vs_grpo").main(["--lr", "grpo=1e-3,sao=2e-4"])
    assert "--lr: give every method of --methods an lr; missing: grpo_sao_mask" in capsys.readouterr().err


def test_equal_time_reward_on_a_concave_curve_with_varying_staleness_and_step_lengths():
    """Beyond the linear case: a saturating reward of the policy's time, jittered step lengths and
    a batch staleness that varies from step to step (groups 0-2 versions old). What remains is the
    curvature's second-order error (chords, a batch's mixed versions): far below any difference
    the benchmark reports at its density (sync 150 steps, the other mode twice as fast, window 20)."""
    import math
    import random

    conv = _bench("convergence")

    def f(t):
        return 0.3 + 0.5 * (1.0 - math.exp(-t / 15.0))

    def curve(step_s, stale, rng):
        published, steps, t = [0.0], [], 0.0
        for k in range(150):
            t += step_s * (0.85 + 0.3 * rng.random())
            versions = [k - min(k, rng.randint(0, stale)) for _ in range(8)]
            steps.append({"step": k, "time_s": t, "staleness_mean": k - sum(versions) / 8,
                          "reward_mean": sum(f(published[v]) for v in versions) / 8})
            published.append(t)
        return SimpleNamespace(seed=0, max_staleness=stale, steps=steps, metrics=_metrics(0.8, 1.0, 1.0))

    for seed in range(3):
        rng = random.Random(seed)
        sync, dora = curve(0.47, 0, rng), curve(0.23, 2, rng)
        times = conv.equal_times({"sync": [sync], "dora": [dora]})
        a = conv.summarise([dora], [sync], 0.7, 20, times)
        assert a["train_reward_at_equal_time_seeds"] == 1
        assert abs(a["train_reward_at_equal_time_minus_sync"][0]) < 1e-3


def test_a_longer_run_is_read_at_equal_steps_and_at_syncs_end_time(monkeypatch):
    """`--dora-steps-factor`: a dora run of 8 steps against sync's 4 is read at version 4 (equal
    steps) and at the newest version it published by sync's end time (equal time); the held-out
    evaluation is stood in for by a function of the weights (each version's weights name it), and
    the run's last version is not evaluated again (the runtime's `final_reward` is its reward)."""
    conv = _bench("convergence")
    evaluated = []

    def held_out(recipe, prepared, weights, seed_offset=0):
        evaluated.append(weights["v"])
        return 0.5 + 0.01 * weights["v"]

    monkeypatch.setattr(conv, "held_out", held_out)

    def run(step_s, n, reward=None):
        steps = [{"step": k, "time_s": step_s * (k + 1), "reward_mean": 0.5} for k in range(n)]
        final = 0.5 + 0.01 * n if reward is None else reward
        return SimpleNamespace(seed=0, max_staleness=2, steps=steps, metrics=_metrics(final, 1.0, 1.0),
                               versions={v: {"v": v} for v in range(n + 1)})

    sync = run(10.0, 4, 0.8)  # sync publishes its version 4 at 40 s
    dora = run(4.5, 8)        # versions at 4.5 s apart: version 8 at 36 s, its last
    conv.read_longer_run(dora, None, None, 4, 40.0)
    assert dora.metrics["final_reward_at_steps"] == pytest.approx(0.54)  # version 4
    assert dora.metrics["reward_at_sync_end"] == pytest.approx(0.58)  # version 8: the runtime's final reward
    assert dora.metrics["version_at_sync_end"] == 8 and not dora.metrics["covers_sync_end"]
    assert dora.versions is None
    far = run(4.5, 10)  # version 8 at 36 s, version 9 at 40.5 s: the policy of 40 s is version 8
    conv.read_longer_run(far, None, None, 4, 40.0)
    assert far.metrics["reward_at_sync_end"] == pytest.approx(0.58) and far.metrics["covers_sync_end"]
    assert conv.version_at(far, 40.5) == 9 and conv.version_at(far, 0.0) == 0
    assert evaluated == [4, 4, 8]  # dora's version 8 is its last: not evaluated again
    at_four = run(4.5, 4)  # --steps is its last version and the policy of 40 s: no evaluation at all
    conv.read_longer_run(at_four, None, None, 4, 40.0)
    assert at_four.metrics["final_reward_at_steps"] == at_four.metrics["reward_at_sync_end"] == pytest.approx(0.54)
    assert evaluated == [4, 4, 8]
    with pytest.raises(ValueError, match=r"run: expected >= 4 steps \(--steps\), got 3"):
        conv.read_longer_run(run(1.0, 3), None, None, 4, 40.0)

    a = conv.summarise([far, dora], [sync, sync], 0.7, 2)
    assert a["final_reward"] == pytest.approx([0.54, 0.54])  # equal steps, not the runs' last versions
    assert a["final_reward_last"] == pytest.approx([0.6, 0.58]) and a["steps_run"] == [10, 8]
    assert a["reward_at_sync_end_minus_sync"] == pytest.approx([0.58 - 0.8, 0.58 - 0.8])
    assert a["covers_sync_end"] == [True, False] and a["reward_at_sync_end_ci95"] == pytest.approx([0.58, 0.58])
    assert "reward_at_sync_end" not in conv.summarise([sync], [sync], 0.7, 2)  # every mode ran --steps


def test_time_to_target_by_sync_end_leaves_out_a_longer_runs_late_reach():
    conv = _bench("convergence")
    sync = SimpleNamespace(seed=0, max_staleness=0, steps=_run([0.5, 0.6, 0.7, 0.8]).steps,
                           metrics=_metrics(0.8, 1.0, 0.0, wall_s=40.0))
    late = SimpleNamespace(seed=0, max_staleness=2, steps=_run([0.5, 0.5, 0.5, 0.5, 0.9, 0.9]).steps,
                           metrics=_metrics(0.8, 1.0, 1.0))
    a = conv.summarise([late, late], [sync, sync], 0.75, 2)
    # (0.5 + 0.9) / 2 = 0.7 at step 5 (50 s), 0.9 at step 6 (60 s): after sync's 40 s end
    assert a["time_to_target_s"] == [60.0, 60.0] and a["time_to_target_reached"] == 2
    assert a["time_to_target_reached_by_sync_end"] == 0


def test_convergence_modes_flag_runs_only_the_modes_named(tmp_path, capsys):
    """`--modes`: sync (the reference) and the named modes run, on the real runtime (a tiny recipe, 2 steps, 1
    seed); an unknown name is refused naming what is accepted."""
    import json

    import yaml

    from .conftest import tiny

    conv = _bench("convergence")
    with pytest.raises(SystemExit):
        conv.main(["--modes", "sync,dora_k3"])
    assert "--modes: unknown dora_k3; accepted: sync, dora, dora_k1, dora_k2, dora_fill, dora_ahead, dora_adaptive" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an empty policy is refused, not read as "the recipe's"
        conv.main(["--admission", ""])
    err = capsys.readouterr().err
    assert "--admission: invalid choice" in err and all(p in err for p in ("fill", "ahead", "adaptive"))
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny(steps=2)))
    assert conv.main(["--recipe", str(recipe), "--seeds", "1", "--modes", "dora_k1,dora,dora_ahead,dora_adaptive",
                      "--eval-repeats", "1", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    modes = out["modes"]
    assert list(modes) == ["sync", "dora", "dora_k1", "dora_ahead", "dora_adaptive"]
    assert modes["dora_k1"]["max_staleness"] == 1 and len(modes["dora_k1"]["final_reward"]) == 1
    assert "not run (--modes): dora_k2, dora_fill" in out["notes"]
    # the recipe has no `admission` key: dora runs the mode's default, adaptive, which is then the
    # same config as dora_adaptive (run once, no ratio of a run to itself); each mode names its policy
    assert [modes[m]["admission"] for m in modes] == [None, "adaptive", "adaptive", "ahead", "adaptive"]
    assert "dora_adaptive is the same config as dora: the same runs" in out["notes"]
    assert modes["dora_adaptive"]["tokens_per_s_per_seed"] == modes["dora"]["tokens_per_s_per_seed"]
    dora = modes["dora"]
    assert "tokens_per_s_ratio_to_adaptive" not in dora and "tokens_per_s_ratio_to_fill" not in dora
    assert len(dora["tokens_per_s_ratio_to_ahead"]) == 1
    assert dora["tokens_per_s_ratio_to_ahead"][0] == pytest.approx(
        dora["tokens_per_s_per_seed"][0] / modes["dora_ahead"]["tokens_per_s_per_seed"][0])


def test_convergence_dora_runs_the_recipes_own_admission(tmp_path, capsys):
    """A recipe that sets `admission: ahead`: dora runs it (dora_ahead is the same runs) and is
    paired with adaptive, which it is not; `--admission` overrides the recipe's for dora."""
    import json

    import yaml

    from .conftest import tiny

    conv = _bench("convergence")
    recipe = tmp_path / "ahead.yaml"
    recipe.write_text(yaml.safe_dump(tiny(steps=2, dora={"admission": "ahead"})))
    common = ["--recipe", str(recipe), "--seeds", "1", "--eval-repeats", "1", "--json", "--no-progress"]
    assert conv.main([*common, "--modes", "dora,dora_ahead,dora_adaptive"]) == 0
    out = json.loads(capsys.readouterr().out)
    modes = out["modes"]
    assert [modes[m]["admission"] for m in modes] == [None, "ahead", "ahead", "adaptive"]
    assert "dora_ahead is the same config as dora: the same runs" in out["notes"]
    assert "tokens_per_s_ratio_to_ahead" not in modes["dora"] and len(modes["dora"]["tokens_per_s_ratio_to_adaptive"]) == 1
    assert conv.main([*common, "--modes", "dora,dora_adaptive", "--admission", "adaptive"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["modes"]["dora"]["admission"] == "adaptive" and out["admission"] == "adaptive"
    assert "dora_adaptive is the same config as dora: the same runs" in out["notes"]

"""Property-based tests of the scheduler over random event orders, for every mode.

The driver (`dora_ext.testing.RandomDriver`) executes actions faithfully while a hypothesis-chosen
seed decides the order of completions, failures, crashes and publishes. Each property is checked
against the driver's own ledger, not only the scheduler's counters.
"""

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dora_ext.config import MODES, DoraConfig
from dora_ext.core import FailureStorm, Scheduler
from dora_ext.testing import RandomDriver

STALENESS = {"sync": [0], "one_step_off": [1], "partial": [0, 1, 3], "pipeline": [0], "dora": [1, 2, 3]}
#: Every mode with its default admission policy (`dora`: adaptive), and the other policies of the
#: modes that take one (`mode/admission`).
DRIVEN = MODES + ("dora/fill", "dora/ahead", "partial/ahead", "partial/adaptive")

scenario = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**31),
        "B": st.integers(1, 5),
        "n": st.integers(1, 4),
        "instances": st.integers(1, 4),
        "capacity": st.integers(1, 6),
        "fail": st.sampled_from([0.0, 0.05]),
        "crash": st.sampled_from([0.0, 0.01, 0.03]),
        "nan": st.sampled_from([0.0, 0.02]),
        "tail": st.sampled_from([0.0, 0.2, 0.6]),
        "kpick": st.integers(0, 2),
        "late": st.sampled_from([0.0, 0.5, 1.0]),
        "fail_awaiting": st.sampled_from([0.0, 0.1]),
        "stale": st.sampled_from([0.0, 1.0]),
        "decline": st.sampled_from([0.0, 0.2]),
        "data": st.sampled_from([None, None, 5, 13]),
        "breaker": st.sampled_from([1.0, 1.0, 0.5]),
    }
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_scenario(rng: random.Random) -> dict:
    """The same space as `scenario`, drawn from a seeded generator (for the large slow sweep)."""
    return {
        "seed": rng.randrange(2**31), "B": rng.randint(1, 5), "n": rng.randint(1, 4),
        "instances": rng.randint(1, 4), "capacity": rng.randint(1, 6),
        "fail": rng.choice([0.0, 0.05]), "crash": rng.choice([0.0, 0.01, 0.03]),
        "nan": rng.choice([0.0, 0.02]), "tail": rng.choice([0.0, 0.2, 0.6]), "kpick": rng.randint(0, 2),
        "late": rng.choice([0.0, 0.5, 1.0]), "fail_awaiting": rng.choice([0.0, 0.1]),
        "stale": rng.choice([0.0, 1.0]), "decline": rng.choice([0.0, 0.2]),
        "data": rng.choice([None, None, 5, 13]), "breaker": rng.choice([1.0, 1.0, 0.5]),
    }


def _config(driven: str, s: dict, steps: int | None = None) -> DoraConfig:
    mode, _, admission = driven.partition("/")
    ks = STALENESS[mode]
    return DoraConfig.from_dict(
        {
            "mode": mode,
            "admission": admission or None,
            "max_staleness": ks[s["kpick"] % len(ks)],
            "batch_size": s["B"],
            "group_size": s["n"],
            "instances": s["instances"],
            "capacity": s["capacity"],
            "max_retries": 2,
            "max_steps": steps,
            "max_failed_group_share": s.get("breaker", 1.0),
        }
    )


def _driver(mode: str, s: dict, steps: int) -> RandomDriver:
    return RandomDriver(
        _config(mode, s, steps), s["seed"], fail_prob=s["fail"], crash_prob=s["crash"], nan_prob=s["nan"],
        long_tail=s["tail"], late_reward=s.get("late", 0.0), fail_awaiting=s.get("fail_awaiting", 0.0),
        stale_prob=s.get("stale", 0.0), decline_prob=s.get("decline", 0.0), data_limit=s.get("data"),
        progress_prob=0.1, truncate_prob=0.0,
    )


def _run(mode: str, s: dict, steps: int = 8) -> RandomDriver:
    d = _driver(mode, s, steps)
    d.start()
    d.run(steps)  # raises Deadlock: engines progressing => the trainer always gets its batch
    return d


def check_run(mode: str, d: RandomDriver, steps: int) -> None:
    """Every property of one finished run, on the driver's ledger and the scheduler's metrics."""
    cfg, stats, m = d.config, d.stats, d.sched.metrics()
    mode = mode.partition("/")[0]
    trained = [g for _, gids in stats.steps for g in gids]
    failed = set(stats.failed_groups)
    # C2: every admitted group is trained exactly once or reported failed; never both, never twice.
    assert len(trained) == len(set(trained))
    assert len(failed) == len(stats.failed_groups)
    assert not set(trained) & failed
    assert set(trained) | failed <= set(stats.admitted)
    assert m["dropped"] == m["duplicated"] == m["truncated"] == 0 and m["c2_ok"]
    # Every late report of a dead instance reached the scheduler as one counted stale event.
    assert not stats.stale_uncounted, stats.stale_uncounted
    assert m["groups_trained"] == len(trained) and m["failed_groups"] == len(failed)
    if stats.halted is None:
        if d.sched.step >= steps or not stats.exhausted:
            assert d.sched.step == steps
        # Nothing admitted is lost: everything admitted was trained or reported failed, except
        # what the last (running) step has not finished.
        assert set(trained) | failed == set(stats.admitted), "admitted groups neither trained nor failed"
        full = [len(gids) == cfg.batch_size for _, gids in stats.steps]
        # Only the last batch may be short, and only when the data ran out.
        assert all(full[:-1]) and (full[-1] or stats.exhausted) if full else stats.exhausted
    else:
        assert "failure storm" in stats.halted and m["halted"]
    # C3: every group trained in step k has k - v <= K (checked on the driver's ledger).
    for k, versions in stats.step_versions.items():
        assert all(0 <= k - v <= cfg.max_staleness for v in versions.values()), (k, versions)
    assert m["c3_ok"]
    # C1: every trajectory generated by one version, except in mode partial where it is metered.
    trained_set = set(trained)
    multi = sum(1 for (gid, _), vs in stats.traj_versions.items() if gid in trained_set and len(set(vs)) > 1)
    if mode == "partial":
        # The scheduler's count must match the driver's ledger of what it executed.
        assert m["multi_version_trajectories"] == multi
        share = multi / (len(trained) * cfg.group_size) if trained else 0.0
        assert m["multi_version_trajectory_share"] == pytest.approx(share)
    else:
        assert multi == 0 and m["c1_ok"]
        # R1: the trajectory ran on its group's admission version.
        for (gid, _), vs in stats.traj_versions.items():
            assert vs == [stats.admitted[gid]]
    # R2: groups admitted at version <= v never exceed (v + K + 1) * B. A group reported failed
    # frees its slot (it is replaced by a new prompt), so it is not counted.
    by_version: dict[int, int] = {}
    for gid, v in stats.admitted.items():
        if gid in failed:
            continue
        by_version[v] = by_version.get(v, 0) + 1
    # `ahead` keeps them within one batch beyond the newest version's step (K = 0: R2 itself).
    ahead = min(cfg.max_staleness, 1) if cfg.admission_policy == "ahead" else cfg.max_staleness
    total = 0
    for v in sorted(by_version):
        total += by_version[v]
        assert total <= (v + ahead + 1) * cfg.batch_size
    # R7: in streaming modes every trained group was delivered to the step that trained it.
    if mode in ("pipeline", "dora"):
        for k, gids in stats.steps:
            assert all(stats.delivered[g] == k for g in gids)


@pytest.mark.parametrize("mode", DRIVEN)
@SETTINGS
@given(s=scenario)
def test_constraints_hold_for_every_mode(mode, s):
    d = _run(mode, s)
    check_run(mode, d, 8)


def sweep(mode: str, runs: int, seed: int, steps: int = 5) -> dict:
    """`runs` generated sequences of `mode`; returns counts. Any violation or deadlock raises."""
    rng = random.Random(seed)
    counts = {"runs": 0, "events": 0, "halted": 0, "exhausted": 0, "late_rewards": 0, "stale": 0,
              "stale_after_replacement": 0, "crashes": 0, "migrations": 0}
    for _ in range(runs):
        s = random_scenario(rng)
        try:
            d = _run(mode, s, steps)
            check_run(mode, d, steps)
        except BaseException as exc:
            raise AssertionError(f"mode {mode}, scenario {s}: {exc}") from exc
        st_ = d.stats
        counts["runs"] += 1
        counts["events"] += st_.events
        counts["halted"] += st_.halted is not None
        counts["exhausted"] += st_.exhausted
        counts["late_rewards"] += st_.late_rewards
        counts["stale"] += st_.stale_sent
        counts["stale_after_replacement"] += st_.stale_after_replacement
        counts["crashes"] += st_.crashes
        counts["migrations"] += st_.migrations
    return counts


@pytest.mark.parametrize("mode", DRIVEN)
def test_generated_sequences_default(mode):
    c = sweep(mode, 300, seed=1)
    # The sweep exercised what it claims to (else it could pass vacuously).
    assert c["late_rewards"] and c["stale"] and c["crashes"] and c["exhausted"]
    # Late reports of a dead instance also came after its replacement (a fresh id) had joined.
    assert c["stale_after_replacement"]
    if mode == "dora":
        assert c["migrations"]


#: The long sweep's sequences per mode: 10,000 where an admission policy decides (the policies
#: R2 caps: `dora` and `partial` under each policy), 2,000 for the modes without one.
LONG_SWEEP = {d: (10_000 if d.partition("/")[0] in ("dora", "partial") else 2_000) for d in DRIVEN}


@pytest.mark.slow
@pytest.mark.parametrize("mode", DRIVEN)
def test_generated_sequences_long(mode):
    """A longer sweep on another seed: under every admission policy `check_run` holds (C1-C3 as
    the mode promises them, R1, R2, R7, no deadlock) over 10,000 generated sequences; the modes
    without admission run 2,000 (their recent defects were all found in the adapters, where the CI
    time goes)."""
    runs = LONG_SWEEP[mode]
    c = sweep(mode, runs, seed=2)
    assert c["runs"] == runs
    assert c["late_rewards"] and c["stale"] and c["crashes"] and c["exhausted"] and c["stale_after_replacement"]
    if mode.startswith("dora"):
        assert c["migrations"]


@pytest.mark.parametrize("mode", DRIVEN)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=scenario, cut=st.integers(1, 400))
def test_snapshot_restore_yields_the_same_training_stream(mode, s, cut):
    steps = 6
    ref = _run(mode, s, steps)
    d = _driver(mode, s, steps)
    d.start()
    for _ in range(cut):
        try:
            if d.sched.step >= steps or d.sched.done or not d.tick():
                break
        except FailureStorm:
            assert ref.stats.halted  # the breaker trips in the reference run too
            return
    # JSON round trip, then continue with a fresh scheduler object.
    snap = json.loads(json.dumps(d.sched.snapshot()))
    d.sched = Scheduler.restore(snap)
    d.run(steps)
    assert d.stats.steps == ref.stats.steps
    assert d.sched.metrics() == ref.sched.metrics()


def test_no_deadlock_under_heavy_failures_and_crashes():
    for mode in DRIVEN:
        s = {"seed": 7, "B": 3, "n": 3, "instances": 3, "capacity": 2, "fail": 0.2, "crash": 0.05,
             "nan": 0.05, "tail": 0.5, "kpick": 1}
        d = _run(mode, s, steps=10)
        assert d.sched.step == 10

"""Elastic colocation and the R5 spread of the gating version, in the sans-I/O core.

Hand-driven scenarios force each decision (lend an idle instance to the trainer when the staleness
budget is spent, take trainer accelerators back when the trainer reports it waits, spread the
stragglers the trainer waits for onto an idle instance), and random event orders check that C1-C3
and R2 still hold with instances changing role at any time.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dora_ext.config import ConfigError, DoraConfig
from dora_ext.core import ProtocolError, Scheduler
from dora_ext.core import actions as A
from dora_ext.core import events as E
from dora_ext.testing import RandomDriver


def _sched(**kw) -> Scheduler:
    cfg = {"mode": "dora", "max_staleness": 1, "batch_size": 1, "group_size": 4, "instances": 2,
           "capacity": 4, "max_steps": 50, **kw}
    s = Scheduler(DoraConfig.from_dict(cfg))
    return s


def _of(acts, kind):
    return [a for a in acts if isinstance(a, kind)]


def _finish_group(s, gid, n=4):
    out = []
    for i in range(n):
        out += s.handle(E.TrajectoryFinished(gid, i, tokens=10, reward=1.0))
    return out


def _to_first_step(s):
    """Both instances on version 0, groups 0 and 1 running (0 on instance 0, 1 on instance 1),
    group 1 finished and trained in step 0."""
    acts = s.start()
    assert [(a.instance_id, a.version) for a in _of(acts, A.LoadVersion)] == [(0, 0), (1, 0)]
    assert _of(acts, A.RequestGroups) == [A.RequestGroups(2, 0)]
    s.handle(E.GroupAdmitted(0))
    s.handle(E.GroupAdmitted(1))
    acts = s.handle(E.InstanceLoaded(0, 0))
    assert {a.group_id for a in _of(acts, A.Dispatch)} == {0}
    acts = s.handle(E.InstanceLoaded(1, 0))
    assert {a.instance_id for a in _of(acts, A.Dispatch)} == {1}
    assert {(k[0], i) for i in s.instances for k in s.running_on(i)} == {(0, 0), (1, 1)}
    return _finish_group(s, 1)


def test_idle_instance_is_lent_to_the_trainer_and_comes_back_when_the_trainer_waits():
    s = _sched(elastic=True, elastic_spare=1, elastic_max_lent=0.5, spread=False)
    acts = _to_first_step(s)
    assert _of(acts, A.StartStep) == [A.StartStep(0, (1,))]
    # Instance 1 drained, the budget (K + 1) * B = 2 groups is spent, nothing is queued: the
    # trainer is the bottleneck, so the idle instance goes to it.
    assert _of(acts, A.SwitchToTrainer) == [A.SwitchToTrainer(1)]
    assert 1 not in s.instances
    # A host cannot bring it back on its own; lent, not failed: its id is below the largest
    # registered one, yet a report of it is an error, not a late report (counted and ignored).
    for ev, words in ((E.InstanceReady(1, 4), "serve the trainer"), (E.InstanceLoaded(1, 0), "unknown"),
                      (E.InstanceFailed(1, "crash"), "unknown")):
        copy = Scheduler.restore(s.snapshot())
        with pytest.raises(ProtocolError, match=words):
            copy.handle(ev)
        assert copy.metrics()["stale_events"] == 0
    s.handle(E.SwitchedToTrainer(1))
    s.handle(E.TrainerStepFinished(0))
    acts = s.handle(E.VersionPublished(1))
    # Version 1 has a budget of one group but no instance: the rollout is short. The trainer has
    # not said it waits, so nothing is taken from it yet.
    assert not _of(acts, A.SwitchToRollout)
    acts = s.handle(E.TrainerIdle())
    assert _of(acts, A.SwitchToRollout) == [A.SwitchToRollout(1, 4)]  # one instance is enough
    acts = s.handle(E.InstanceReady(1, 4))
    assert _of(acts, A.LoadVersion) == [A.LoadVersion(1, 1)]
    assert _of(acts, A.RequestGroups) == [A.RequestGroups(1, 1)]
    m = s.metrics()
    assert m["switches_to_trainer"] == 1 and m["switches_to_rollout"] == 1


def test_without_elastic_the_idle_instance_stays():
    s = _sched(spread=False)
    acts = _to_first_step(s)
    assert not _of(acts, A.SwitchToTrainer)
    assert 1 in s.instances
    acts = s.handle(E.TrainerIdle())
    assert not _of(acts, A.SwitchToRollout)


def test_lending_keeps_the_minimum_rollout_pool():
    # elastic_max_lent=0.0: never below the 2 configured instances.
    s = _sched(elastic=True, elastic_max_lent=0.0, spread=False)
    acts = _to_first_step(s)
    assert not _of(acts, A.SwitchToTrainer)


def test_switch_protocol_errors():
    s = _sched(elastic=True)
    s.start()
    with pytest.raises(Exception, match="without a SwitchToTrainer"):
        s.handle(E.SwitchedToTrainer(0))


def test_idle_instance_takes_an_even_share_of_the_gating_stragglers():
    s = _sched(spread=True)
    acts = _to_first_step(s)
    assert _of(acts, A.StartStep) == [A.StartStep(0, (1,))]
    s.handle(E.TrainerStepFinished(0))
    acts = s.handle(E.VersionPublished(1))
    assert _of(acts, A.LoadVersion) == [A.LoadVersion(1, 1)]
    assert _of(acts, A.RequestGroups) == [A.RequestGroups(1, 1)]
    s.handle(E.GroupAdmitted(2))
    acts = s.handle(E.InstanceLoaded(1, 1))
    assert len(_of(acts, A.Dispatch)) == 4
    acts = _finish_group(s, 2)
    # Step 1 must take group 0 (version 0, K=1): the trainer waits for its four stragglers, all
    # on instance 0. Instance 1 is idle with nothing left to admit: it loads version 0 ...
    assert not _of(acts, A.StartStep)
    assert _of(acts, A.LoadVersion) == [A.LoadVersion(1, 0)]
    acts = s.handle(E.InstanceLoaded(1, 0))
    # ... and takes half of them.
    moves = _of(acts, A.Migrate)
    assert len(moves) == 2 and all((m.src, m.dst, m.version) == (0, 1, 0) for m in moves)
    assert len(s.instances[0].running) == 2 and len(s.instances[1].running) == 2
    # Without spread the instance stays on version 1 and the stragglers stay crowded.
    t = _sched(spread=False)
    _to_first_step(t)
    t.handle(E.TrainerStepFinished(0))
    t.handle(E.VersionPublished(1))
    t.handle(E.GroupAdmitted(2))
    t.handle(E.InstanceLoaded(1, 1))
    assert not _of(_finish_group(t, 2), A.LoadVersion)


@pytest.mark.parametrize("bad,field", [
    ({"mode": "sync", "max_staleness": 0, "elastic": True}, "elastic"),
    ({"mode": "partial", "elastic": True}, "elastic"),
    ({"elastic": "yes"}, "elastic"),
    ({"elastic_spare": 2}, "elastic_spare"),
    ({"elastic": True, "elastic_spare": -1}, "elastic_spare"),
    ({"elastic": True, "elastic_max_lent": 1.0}, "elastic_max_lent"),
    ({"spread": 1}, "spread"),
])
def test_config_errors_name_the_field(bad, field):
    with pytest.raises(ConfigError) as exc:
        DoraConfig.from_dict(bad)
    assert exc.value.field == field


def test_config_round_trip():
    cfg = DoraConfig.from_dict({"mode": "pipeline", "elastic": True, "elastic_spare": 3, "elastic_max_lent": 0.25,
                                "spread": False})
    assert DoraConfig.from_dict(cfg.to_dict()) == cfg


scenario = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31), "B": st.integers(1, 4), "n": st.integers(1, 3),
    "instances": st.integers(1, 4), "capacity": st.integers(1, 5), "spare": st.integers(0, 2),
    "lent": st.sampled_from([0.0, 0.5, 0.75]), "tail": st.sampled_from([0.0, 0.3]),
    "crash": st.sampled_from([0.0, 0.01]), "mode": st.sampled_from(["dora", "pipeline"]),
    "k": st.integers(1, 3), "landed": st.sampled_from([0.0, 1.0]),
})


def _driver(s, steps=8):
    cfg = DoraConfig.from_dict({
        "mode": s["mode"], "max_staleness": s["k"] if s["mode"] == "dora" else 0, "batch_size": s["B"],
        "group_size": s["n"], "instances": s["instances"], "capacity": s["capacity"], "max_steps": steps,
        "elastic": True, "elastic_spare": s["spare"], "elastic_max_lent": s["lent"],
    })
    return RandomDriver(cfg, s["seed"], long_tail=s["tail"], crash_prob=s["crash"], landed_prob=s.get("landed", 0.0))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=scenario)
def test_constraints_hold_with_instances_changing_role(s):
    d = _driver(s)
    d.start()
    d.run(8)  # raises on deadlock
    stats, m, cfg = d.stats, d.sched.metrics(), d.config
    trained = [g for _, gids in stats.steps for g in gids]
    assert len(trained) == len(set(trained)) and set(trained) == set(stats.admitted)
    for k, versions in stats.step_versions.items():
        assert all(0 <= k - v <= cfg.max_staleness for v in versions.values())
    for (gid, _), vs in stats.traj_versions.items():
        assert vs == [stats.admitted[gid]]  # C1 / R1, migrations and role switches included
    assert m["c1_ok"] and m["c2_ok"] and m["c3_ok"]
    assert d.switches == m["switches_to_trainer"] + m["switches_to_rollout"]


def test_random_orders_do_switch_roles():
    """The property above is not vacuous: over fixed seeds, instances do change role both ways."""
    to_t = to_r = 0
    for seed in range(12):
        d = _driver({"seed": seed, "B": 2, "n": 2, "instances": 3, "capacity": 2, "spare": 1, "lent": 0.5,
                     "tail": 0.3, "crash": 0.0, "mode": "dora", "k": 2})
        d.start()
        d.run(8)
        m = d.sched.metrics()
        to_t += m["switches_to_trainer"]
        to_r += m["switches_to_rollout"]
    assert to_t > 0 and to_r > 0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=scenario, cut=st.integers(1, 300))
def test_snapshot_restore_with_elastic_state(s, cut):
    ref = _driver(s, 6)
    ref.start()
    ref.run(6)
    d = _driver(s, 6)
    d.start()
    for _ in range(cut):
        if d.sched.step >= 6 or not d.tick():
            break
    d.sched = Scheduler.restore(json.loads(json.dumps(d.sched.snapshot())))
    d.run(6)
    assert d.stats.steps == ref.stats.steps
    assert d.sched.metrics() == ref.sched.metrics()


def _a_move_in_flight():
    """A random dora run (3 instances, spread off) driven until R5 has a move in flight: the
    driver, the moved trajectory's key and the trajectory."""
    cfg = DoraConfig.from_dict({"mode": "dora", "max_staleness": 2, "batch_size": 1, "group_size": 4,
                                "instances": 3, "capacity": 4, "max_steps": 50, "spread": False,
                                "admission": "fill"})
    d = RandomDriver(cfg, 3, long_tail=0.6)
    d.start()
    while not d.migrating:  # run until a move is in flight
        assert d.tick() and d.sched.step < 50
    key = next(iter(d.migrating))
    t = d.sched.trajectory(key[0], key[1])
    return d, key, t


def test_a_trajectory_moves_again_only_after_its_migration_landed():
    d, key, t = _a_move_in_flight()
    assert t.moved  # until it lands it is never moved again (the driver asserts that too)
    d.sched.handle(E.MigrationLanded(key[0], key[1], t.attempt))
    assert not t.moved
    d.sched.handle(E.MigrationLanded(key[0], key[1], t.attempt + 1))  # another attempt's report: stale
    assert d.sched.metrics()["stale_events"] >= 1


def test_a_moved_trajectory_whose_instance_failed_is_a_new_attempt_that_may_move():
    """R5 moves a trajectory at most once per attempt (its move may be in flight). Its destination fails before the move
    lands: it is re-queued under a new attempt, of which no move exists, so it reads unmoved at once (the flag used to
    stay set while it waited, in `moved` and in snapshots) and after it is dispatched again, where R5 may move it."""
    d, key, t = _a_move_in_flight()
    assert t.moved and t.status == "R"
    attempt = t.attempt
    d._crash(t.instance)  # its destination fails (the driver's crash: ghosts, a replacement)
    assert (t.status, t.attempt, t.moved) == ("Q", attempt + 1, False)
    snap = d.sched.snapshot()
    assert not Scheduler.restore(json.loads(json.dumps(snap))).trajectory(key[0], key[1]).moved
    while t.status != "R":
        assert d.tick() and d.sched.step < 50
    assert t.attempt == attempt + 1 and not t.moved  # R5 may move it again


def test_a_moved_trajectory_that_failed_is_retried_unmoved():
    """The same for a retry: a runtime reports a trajectory lost in its move (`TrajectoryFailed`
    of the attempt that moved); the retry is a new attempt, not moved."""
    cfg = DoraConfig.from_dict({"mode": "dora", "max_staleness": 2, "batch_size": 1, "group_size": 4,
                                "instances": 3, "capacity": 4, "max_steps": 50, "spread": False,
                                "max_retries": 2})
    d = RandomDriver(cfg, 3, long_tail=0.6)
    d.start()
    while not d.migrating:
        assert d.tick() and d.sched.step < 50
    key = next(iter(d.migrating))
    t = d.sched.trajectory(key[0], key[1])
    attempt = t.attempt
    d.sched.handle(E.TrajectoryFailed(key[0], key[1], "lost in a migration", attempt))
    assert t.attempt == attempt + 1 and t.status in "QR" and not t.moved


def test_migration_landed_for_a_finished_trajectory_is_stale():
    s = _sched(spread=False)
    _to_first_step(s)
    s.handle(E.MigrationLanded(1, 0))  # group 1 finished long ago
    assert s.metrics()["stale_events"] == 1


def test_migration_landed_for_a_group_no_longer_held_is_stale_with_an_attempt():
    """A landing that carries its attempt, for a group the scheduler no longer holds (trained
    here; also failed and retired), is a late report like any other trajectory event: counted
    stale, not a `ProtocolError`. Without an attempt the group must still be known."""
    s = _sched(spread=False)
    _to_first_step(s)
    s.handle(E.TrainerStepFinished(0))  # group 1 trained: it leaves the scheduler
    s.handle(E.MigrationLanded(1, 0, 0))
    assert s.metrics()["stale_events"] == 1
    with pytest.raises(ProtocolError, match="unknown group 1"):
        s.handle(E.MigrationLanded(1, 0))

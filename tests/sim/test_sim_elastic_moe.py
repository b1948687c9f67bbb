"""Elastic colocation and MoE imbalance as the simulator executes them (tiny presets, fast)."""

from __future__ import annotations

import dataclasses

import pytest

from dora_ext.sim import simulate
from dora_ext.sim.engine import SimInstance
from dora_ext.sim.presets import PRESETS, EngineCost
from dora_ext.sim.runner import Simulation, WorkloadError


def _trainer_bound(tiny, **kw):
    # Plenty of rollout instances, an expensive trainer: idle instances should be lent to it.
    return tiny(accelerators=10, split=(6, 4), colocated=False, cv=1.0, batch=8, n=4, capacity=8,
                length=200, train=1e-2, optimizer=0.2, broadcast=0.05, load=0.1, **kw)


def test_elastic_lends_idle_rollout_to_a_trainer_bound_run_and_accounts_accelerators(tiny):
    p = _trainer_bound(tiny)
    sim = Simulation(p, "dora", steps=20, seed=0, max_staleness=2, split=(6, 4), config={"elastic": True})
    seen = []
    drain = sim._drain

    def check():
        drain()
        # Every accelerator is somewhere: trainer, a rollout instance, or switching roles.
        on_rollout = len(sim.inst) - len(sim.off_rollout)
        switching = sum(1 for r in sim.off_rollout.values() if r != "trainer")
        seen.append(sim.tacc + on_rollout + switching)

    sim._drain = check
    res = sim.run()
    assert set(seen) == {10}
    m = res.metrics
    assert m["role_switches"] > 0 and m["role_switch_s"] > 0
    assert m["trainer_accelerators_mean"] > 4  # it borrowed rollout accelerators on average
    assert m["c1_ok"] and m["c2_ok"] and m["c3_ok"]
    base = simulate(p, "dora", steps=20, seed=0, max_staleness=2, split=(6, 4)).metrics
    assert base["role_switches"] == 0 and base["trainer_accelerators_mean"] == 4
    # Same workload, more work done per second with the idle rollout training.
    assert m["throughput_tokens_per_s"] > base["throughput_tokens_per_s"]
    assert m["efficiency"] <= 1.0 + 1e-9


def test_switch_costs_are_paid(tiny):
    p = _trainer_bound(tiny)
    cheap = dataclasses.replace(p, trainer=dataclasses.replace(p.trainer, join_s=0.01, leave_s=0.01))
    dear = dataclasses.replace(p, trainer=dataclasses.replace(p.trainer, join_s=5.0, leave_s=5.0))
    kw = dict(steps=20, seed=0, max_staleness=2, split=(6, 4), config={"elastic": True})
    a, b = simulate(cheap, "dora", **kw).metrics, simulate(dear, "dora", **kw).metrics
    assert a["throughput_tokens_per_s"] > b["throughput_tokens_per_s"]


def test_elastic_needs_split_pools_and_an_elastic_mode(tiny):
    from dora_ext.config import ConfigError

    with pytest.raises(WorkloadError, match="split pools"):
        Simulation(tiny(), "sync", steps=2, config={"elastic": True})  # colocated sync

    with pytest.raises(ConfigError, match="elastic"):
        simulate(_trainer_bound(tiny), "partial", steps=2, config={"elastic": True})


def test_engine_speed_factor_scales_iterations(tiny):
    a, b = SimInstance(0, tiny().engine), SimInstance(1, tiny().engine)
    for si in (a, b):
        si.add(("g", 0), 100.0, 20.0, 0.0, 0)
    b.set_speed(1.5, 0.0)
    assert b.next_finish() == pytest.approx(1.5 * a.next_finish())
    b.set_speed(1.0, 0.0)
    assert b.next_finish() == pytest.approx(a.next_finish())


def _moe(p, m):
    return dataclasses.replace(p, engine=dataclasses.replace(p.engine, moe_imbalance=m, moe_period_s=2.0))


def test_moe_imbalance_slows_every_mode_and_is_the_same_in_every_mode(tiny):
    p = tiny(accelerators=6, split=(4, 2), colocated=False, cv=1.0, batch=8, n=4, capacity=8, length=200,
             train=1e-3, optimizer=0.2, broadcast=0.05, load=0.1)
    for mode in ("sync", "one_step_off", "partial", "pipeline", "dora"):
        plain = simulate(p, mode, steps=20, seed=0).metrics
        moe = simulate(_moe(p, 0.5), mode, steps=20, seed=0).metrics
        assert moe["throughput_tokens_per_s"] < plain["throughput_tokens_per_s"], mode
        assert moe["ideal_throughput"] == pytest.approx(plain["ideal_throughput"])  # balance is the bound
        assert moe["c2_ok"] and moe["c3_ok"]
    # Factors are keyed by (seed, instance, period): the same in two runs, other with another seed.
    s1 = Simulation(_moe(p, 0.5), "dora", steps=3, seed=0)
    s2 = Simulation(_moe(p, 0.5), "sync", steps=3, seed=0)
    for s in (s1, s2):
        s._seed = 0
        s._on_speed(3)
    assert [si.a for si in s1.inst.values()][:3] == [si.a for si in s2.inst.values()][:3]
    assert all(si.a >= si.base[0] for si in s1.inst.values())


def test_moe_preset_is_listed_and_validated():
    p = PRESETS["moe-imbalance"]
    assert p.engine.moe_imbalance > 0
    with pytest.raises(WorkloadError, match="moe_imbalance"):
        dataclasses.replace(p.engine, moe_imbalance=-1.0)
    assert isinstance(p.engine, EngineCost)


def test_a_finish_that_fires_is_due_also_across_role_switches(tiny):
    # An instance that goes to the trainer and comes back is a fresh engine, but events of its
    # earlier life can still be on the heap (a finish computed before its trajectories migrated
    # away). A stale finish must never match the returned instance: every finish event that is
    # handled must be the instance's true next finish (else a trajectory ends early).
    p = _trainer_bound(tiny)
    sim = Simulation(p, "dora", steps=20, seed=0, max_staleness=2, split=(6, 4), config={"elastic": True})
    on_finish = sim._on_finish
    handled = []

    def check(si):
        assert si.next_finish() == pytest.approx(sim.now, abs=1e-9), (si.id, si.next_finish(), sim.now)
        handled.append(si.id)
        on_finish(si)

    sim._on_finish = check
    # Force the collision: when an instance comes back, plant a stale finish of its earlier life
    # (generation 1) shortly after, while the new engine loads its weights: a counter restarted
    # at 0 reaches 1 with that load and would take the stale event for its own.
    on_role = sim._on_role
    planted = []

    def role(iid, payload):
        old = sim.inst[iid]
        on_role(iid, payload)
        if payload != "trainer":
            new = sim.inst[iid]
            assert new.gen > old.gen and new.load_token >= old.load_token
            if old.gen >= 1:  # (an instance that starts on the trainer side has no earlier life)
                sim._push(sim.now + 1e-3, 0, iid, 1)  # 0: the runner's finish event kind
                planted.append(iid)

    sim._on_role = role
    res = sim.run()
    assert res.metrics["role_switches"] > 0 and handled and planted
    assert res.metrics["c2_ok"]


def test_every_role_switch_pays_its_cost_and_a_returning_instance_loads_before_serving(tiny):
    # Each lend waits join_s before the trainer has the accelerators, each return leave_s (after
    # the trainer's current item) before the instance exists again, and a returned instance
    # serves nothing before it has loaded weights: timed per switch, not only in total.
    p = _trainer_bound(tiny)
    p = dataclasses.replace(p, trainer=dataclasses.replace(p.trainer, join_s=0.7, leave_s=0.3))
    sim = Simulation(p, "dora", steps=20, seed=0, max_staleness=2, split=(6, 4), config={"elastic": True})
    asked, back, loaded, errors = {}, [], set(), []
    to_t, to_r, on_role, on_loaded, dispatch = (sim._switch_to_trainer, sim._switch_to_rollout, sim._on_role,
                                                sim._on_loaded, sim._dispatch)

    charged = []

    def switch_to_trainer(act):
        asked[act.instance_id] = ("trainer", sim.now)
        charged.append(p.trainer.join_s)  # TP 1: one accelerator per instance
        to_t(act)

    def switch_to_rollout(act):
        start = max(sim.now, sim._tbusy_until) if sim._tbusy else sim.now
        asked[act.instance_id] = ("rollout", start)
        charged.append(start - sim.now + p.trainer.leave_s)
        to_r(act)

    def role(iid, payload):
        kind, t = asked.pop(iid)
        cost = p.trainer.join_s if kind == "trainer" else p.trainer.leave_s
        if sim.now != pytest.approx(t + cost, abs=1e-9) or (kind == "trainer") != (payload == "trainer"):
            errors.append((iid, kind, t, sim.now))
        if payload != "trainer":
            back.append(iid)
            loaded.discard(iid)
        on_role(iid, payload)

    def on_load(iid, payload):
        on_loaded(iid, payload)
        if payload[1] == sim.inst[iid].load_token:
            loaded.add(iid)

    def disp(act):
        if act.instance_id in back and act.instance_id not in loaded:
            errors.append(("served before loading", act.instance_id))
        dispatch(act)

    sim._switch_to_trainer, sim._switch_to_rollout, sim._on_role = switch_to_trainer, switch_to_rollout, role
    sim._on_loaded, sim._dispatch = on_load, disp
    m = sim.run().metrics
    assert not errors, errors[:5]
    assert back and m["role_switches"] == len(charged)
    # The total charged is every switch's own cost, plus a return's wait for the trainer's item.
    assert m["role_switch_s"] == pytest.approx(sum(charged))

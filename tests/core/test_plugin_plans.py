"""R5 through a plugin's `dora_plan_migration`, several moves per plan, against the plan
application as it was (the running view rebuilt for every move).

`Scheduler._consolidate_plugin` checks each move of a plan against the state the earlier moves
left (a trajectory moved by move 1 no longer runs on its source for move 2). It rebuilt the
source's running view for every move (O(moves x view)); it now reads the trajectory's instance
(O(1) per move). `PerMoveView` keeps the old application, and both are fed the same events by
the random driver with a plugin whose plans mix in what makes the per-move state matter:
shuffled default plans, a trajectory moved on from its destination (skipped: its first move may
be in flight), the same move twice (refused: the trajectory left its source), a move onto a full
instance (refused). Every batch of actions, and every refusal, must be equal.
"""

import numbers
import random

import pytest

from dora_ext import hookimpl
from dora_ext.config import DoraConfig
from dora_ext.core import Migrate, Scheduler
from dora_ext.core.scheduler import ProtocolError
from dora_ext.plugins import get_plugin_manager
from dora_ext.testing import RandomDriver, feed_twinned, stable_seed

from .test_hooks import pack_plan


class PerMoveView(Scheduler):
    """The plan application before the change (the running view rebuilt for every move)."""

    def _consolidate_plugin(self, v):
        instances = self.instances
        holders = [instances[i] for n, level in self._levels.get(v, {}).items() if n for i in level]
        holders.sort(key=lambda i: i.id)
        plan = self._plan_migration(
            version=v,
            instances=[{"id": i.id, "capacity": i.capacity, "running": list(map(self._key, i.running))}
                       for i in holders],
            newest_version=self.newest,
            fill=self.config.migrate_threshold,
        )
        for gid, idx, src, dst in plan or ():
            s, d = instances.get(src), instances.get(dst)
            if s is None or d is None or s.version != v or d.version != v or d.loading is not None:
                raise ProtocolError(f"migration plan moves {gid!r}/{idx} between instances not holding version {v}")
            g = self._slot_of.get(gid)
            ok = g is not None and isinstance(idx, numbers.Integral) and 0 <= idx < self.n
            h = g * self.n + int(idx) if ok else None
            if s is d or h not in s.running or d.nrun >= d.capacity:
                raise ProtocolError(f"migration plan for {gid!r}/{idx} from {src} to {dst} is not feasible")
            if self._traj_moved[h]:
                continue
            self._move(v, h, s, d)
        for i in holders:
            if not i.nrun:
                self._plan_instance(i)
        return True


class MixedPlans:
    """Deterministic in what it is given, so both schedulers get the same plan from the same view."""

    def __init__(self, tally):
        self.tally = tally

    @hookimpl
    def dora_plan_migration(self, version, instances, newest_version, fill):
        rng = random.Random(repr((version, instances, newest_version, fill)))
        plan = pack_plan(instances, fill)
        rng.shuffle(plan)
        r = rng.random()
        ids = [d["id"] for d in instances]
        if plan and r < 0.25:
            gid, idx, _, dst = rng.choice(plan)  # moved on from its destination: skipped
            plan.append((gid, idx, dst, rng.choice([i for i in ids if i != dst])))
            self.tally["chained"] += 1
        elif plan and r < 0.3:
            plan.append(rng.choice(plan))  # the same move again: it left its source
            self.tally["repeated"] += 1
        elif r < 0.35 and len(ids) >= 2:
            full = [d for d in instances if len(d["running"]) >= d["capacity"]]
            src = [d for d in instances if d["running"] and d not in full]
            if full and src:  # onto a full instance
                s = rng.choice(src)
                gid, idx = s["running"][0]
                plan.insert(0, (gid, idx, s["id"], full[0]["id"]))
                self.tally["onto_full"] += 1
        return plan


class TwinDriver(RandomDriver):
    def __init__(self, cfg, seed, pm, **kw):
        super().__init__(cfg, seed, plugins=pm, **kw)
        self.shadow = PerMoveView(cfg, plugins=pm)
        self.batches = 0
        self.multi = 0  # action batches with at least two moves (one consolidation's plan)

    def start(self):
        out = self.sched.start()
        assert self.shadow.start() == out
        self.execute(out)

    def _feed(self, event):
        out = feed_twinned(self.shadow, super()._feed, event)
        self.batches += 1
        self.multi += sum(1 for a in out if isinstance(a, Migrate)) >= 2
        return out


def _config(rng):
    caps = [rng.choice([2, 4, 6, 8]) for _ in range(rng.randint(3, 6))]
    return DoraConfig.from_dict({
        "mode": "dora", "max_staleness": rng.choice([2, 3]), "batch_size": rng.randint(2, 6),
        "group_size": rng.randint(1, 4), "instances": [{"capacity": c} for c in caps],
        "max_retries": 2, "max_steps": 10, "migrate_threshold": rng.choice([0.5, 0.75, 1.0]),
        "max_failed_group_share": 1.0,
    })


@pytest.mark.parametrize("block", range(2))
def test_plugin_plans_apply_as_with_the_per_move_view(block):
    tally = {"chained": 0, "repeated": 0, "onto_full": 0}
    runs = refused = multi = moves = carried = 0
    for seed in range(block * 30, block * 30 + 30):
        rng = random.Random(stable_seed(f"plugin-plans/{seed}"))
        pm = get_plugin_manager(load_entrypoints=False)
        pm.register(MixedPlans(tally))
        d = TwinDriver(_config(rng), rng.randrange(2**31), pm, long_tail=0.5, landed_prob=rng.choice([0.5, 1.0]),
                       crash_prob=rng.choice([0.0, 0.01]), fail_prob=0.02, late_reward=0.3)
        d.start()
        try:
            d.run(10)
        except ProtocolError as exc:  # a refused plan (both refused it alike: `_feed`)
            assert "not feasible" in str(exc), exc
            refused += 1
            # The moves applied before the bad one come on the error, none left for a later answer.
            assert d.sched._out == []
            last = {(a.group_id, a.index): a.dst for a in exc.actions if isinstance(a, Migrate)}
            for (gid, idx), dst in last.items():
                t = d.sched.trajectory(gid, idx)
                assert (t.status, t.instance) == ("R", dst), (gid, idx, t.status, t.instance, dst)
            carried += bool(last)
        else:
            assert d.sched.snapshot() == d.shadow.snapshot()
        runs += 1
        multi += d.multi
        moves += d.stats.migrations
    print({"runs": runs, "refused": refused, "refused_after_moves": carried, "batches_with_several_moves": multi, "moves": moves, **tally})
    # The runs reached what the change is about: plans of several moves, and each kind of odd move.
    assert multi and refused and carried and all(tally.values()), (multi, refused, carried, tally)

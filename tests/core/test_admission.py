"""The admission policies (`dora_ext.core.admission`, config `admission`) on a deterministic clock.

`TickDriver` executes the scheduler's actions on a discrete clock: every running trajectory
decodes one token per tick, its length fixed by (group, index) (the same in every policy's run),
and a trainer step lasts `step_ticks` once started. The trainer's wait is read from the
scheduler's own actions: the ticks between a step's `TrainerStepFinished` (or the first
`RequestGroups`) and the next `StartStep`.
"""

import json
import random

import pytest

from dora_ext.config import ConfigError, DoraConfig
from dora_ext.core import Scheduler
from dora_ext.core import actions as A
from dora_ext.core import events as E


class TickDriver:
    def __init__(self, step_ticks: int, seed: int = 0, **cfg):
        self.sched = Scheduler(DoraConfig.from_dict({"mode": "dora", **cfg}))
        self.step_ticks, self.seed = step_ticks, seed
        self.now = 0
        self.next_gid = 0
        self.left: dict = {}  # (gid, idx) -> [tokens left, attempt, total]
        self.loads: list = []
        self.trainer: tuple | None = None  # (step, tick it finishes)
        self.free_since = 0  # when the trainer last became free
        self.waited = 0  # ticks the trainer was free before a step started
        self.steps: list = []  # (step, group ids, versions)
        self.versions: dict = {}
        self.look: list = []  # the adaptive look-ahead after each step

    def length(self, gid: int, idx: int) -> int:
        r = random.Random(self.seed * 1_000_003 + gid * 97 + idx)
        return 2 + int(r.lognormvariate(2.5, 1.0))  # median ~14 ticks, a long tail

    def execute(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, A.RequestGroups):
                for _ in range(a.count):
                    gid, self.next_gid = self.next_gid, self.next_gid + 1
                    self.versions[gid] = self.sched.newest
                    self.execute(self.sched.handle(E.GroupAdmitted(gid)))
            elif isinstance(a, A.LoadVersion):
                self.loads.append(a)
            elif isinstance(a, A.Dispatch):
                n = self.length(a.group_id, a.index)
                self.left[(a.group_id, a.index)] = [n, a.attempt, n]
            elif isinstance(a, A.StartStep):
                assert self.trainer is None
                self.waited += self.now - self.free_since
                self.steps.append((a.step, a.group_ids, [self.versions[g] for g in a.group_ids]))
                self.trainer = (a.step, self.now + self.step_ticks)

    def run(self, steps: int) -> "TickDriver":
        self.execute(self.sched.start())
        while True:
            loads, self.loads = self.loads, []
            self.execute(self.sched.handle_many([E.InstanceLoaded(a.instance_id, a.version) for a in loads]))
            done = []
            for key, t in self.left.items():
                t[0] -= 1
                if t[0] <= 0:
                    done.append(key)
            for key in done:
                _, attempt, total = self.left.pop(key)
                self.execute(self.sched.handle(E.TrajectoryFinished(key[0], key[1], total, 1.0, attempt)))
            if self.trainer is not None and self.trainer[1] <= self.now:
                k = self.trainer[0]
                self.trainer = None
                self.free_since = self.now
                self.execute(self.sched.handle(E.TrainerStepFinished(k)))
                self.look.append(self.sched._adm.look)
                if k + 1 == steps:
                    del self.steps[steps:]
                    return self
                self.execute(self.sched.handle(E.VersionPublished(k + 1)))
            self.now += 1
            assert self.now < 100_000, "no progress"

    def staleness(self) -> float:
        s = [k - v for k, _, vs in self.steps for v in vs]
        return sum(s) / len(s)


ROLLOUT_BOUND = dict(step_ticks=1, max_staleness=3, batch_size=4, group_size=4, instances=4, capacity=8)
TRAINER_BOUND = dict(step_ticks=60, max_staleness=3, batch_size=4, group_size=4, instances=4, capacity=8)


def test_adaptive_never_starves_the_trainer_when_the_rollout_is_the_bottleneck():
    """Generation is slow (a step lasts one tick, a trajectory ~14 and up to ~150): on each of
    five seeds `adaptive` keeps the trainer waiting no longer than `fill`, and `ahead` (a fixed
    look-ahead of one batch) waits longer: the driver tells a starving policy apart."""
    waits = {p: [] for p in ("fill", "ahead", "adaptive")}
    for seed in range(5):
        for p, w in waits.items():
            w.append(TickDriver(seed=seed, admission=p, **ROLLOUT_BOUND).run(40).waited)
    assert all(a <= f for a, f in zip(waits["adaptive"], waits["fill"])), waits
    assert all(a > f * 1.05 for a, f in zip(waits["ahead"], waits["fill"])), waits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adaptive_lowers_staleness_at_equal_throughput_when_the_trainer_is_the_bottleneck(seed):
    """The trainer is slow (a step lasts 60 ticks, a trajectory ~14 and up to ~150): `adaptive` trains 30 steps within
    2% of `fill`'s time, and trains fresher groups than `fill`, which runs ahead to the bound K = 3."""
    fill, adaptive = (TickDriver(seed=seed, admission=p, **TRAINER_BOUND).run(30) for p in ("fill", "adaptive"))
    assert adaptive.now <= fill.now * 1.02, (adaptive.now, fill.now)
    assert fill.staleness() > 2.5 and adaptive.staleness() < 1.5, (fill.staleness(), adaptive.staleness())


def test_adaptive_look_ahead_moves_within_its_bounds_and_survives_a_snapshot():
    d = TickDriver(seed=0, admission="adaptive", **ROLLOUT_BOUND).run(20)
    B, K = ROLLOUT_BOUND["batch_size"], ROLLOUT_BOUND["max_staleness"]
    assert all(B <= x <= K * B for x in d.look) and len(set(d.look)) > 1  # it adapted
    snap = json.loads(json.dumps(d.sched.snapshot()))
    assert (snap["scalars"]["look"], snap["scalars"]["short"]) == (d.sched._adm.look, d.sched._adm.short)
    again = Scheduler.restore(snap)
    assert again._adm.look == d.sched._adm.look and again.snapshot() == d.sched.snapshot()


def test_admission_is_checked_and_applies_where_it_means_something():
    with pytest.raises(ConfigError, match="admission: unknown policy 'eager'; accepted: fill, ahead, adaptive"):
        DoraConfig(admission="eager")
    assert DoraConfig().admission_policy == "adaptive"
    assert DoraConfig(mode="partial").admission_policy == "fill"
    # Modes that admit a batch at a time run R2 alone: asking them for a policy is an error.
    for mode in ("sync", "pipeline", "one_step_off"):
        assert DoraConfig(mode=mode, max_staleness=int(mode == "one_step_off")).admission_policy == "fill"
        with pytest.raises(ConfigError, match=f"admission: mode '{mode}' .* accepted modes: partial, dora"):
            DoraConfig.from_dict({"mode": mode, "admission": "ahead"})
        # switching a config's mode drops the policy where the new mode takes none (as it resets K)
        assert DoraConfig(admission="ahead").with_overrides([f"mode={mode}"]).admission is None
    assert DoraConfig(admission="ahead").with_overrides(["mode=partial"]).admission == "ahead"
    with pytest.raises(ConfigError, match="admission: mode 'sync'"):
        DoraConfig(admission="ahead").with_overrides(["mode=sync", "admission=fill"])
    assert DoraConfig.from_dict(DoraConfig(admission="ahead").to_dict()).admission == "ahead"

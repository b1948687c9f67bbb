"""Adversarial event orders the stock `RandomDriver` does not generate (review of issue 9).

On top of everything `RandomDriver` sends, this driver:
- gives instances different capacities (the non-uniform fair-share path of `_pick`);
- resumes now and then as the embedded runtime does from a checkpoint (`_restart_from_checkpoint`):
  the scheduler restored from its JSON snapshot, every engine a fresh process, every instance
  failed in one `handle_many` batch (its void actions dropped), then the configured ids registered again. That is the one
  place where a host registers an id that had failed (a crash mid-run is replaced under a fresh
  id, as `RandomDriver` does), and it is safe there: no process of the old run can report;
- sends live events without an `attempt` now and then (runtimes that have none);
- sends integer rewards and uuid-like string group ids;
- replaces the scheduler by `restore(json(snapshot()))` at random points and keeps going.
Checks run on the driver's own ledger (C1, C2, C3, nothing lost, counters), as in
`test_properties.check_run`.
"""

import fractions
import json
import os
import random
import subprocess
import sys

import pytest

from dora_ext.config import MODES, DoraConfig
from dora_ext.core import Scheduler
from dora_ext.core import actions as A
from dora_ext.core import events as E
from dora_ext.testing import RandomDriver, feed_twinned, stable_seed

from .test_properties import STALENESS, check_run


class AdversarialDriver(RandomDriver):
    def __init__(self, *a, resume_prob: float = 0.005, no_attempt: float = 0.3, restore_prob: float = 0.01, **kw):
        super().__init__(*a, **kw)
        self.resume_prob, self.no_attempt, self.restore_prob = resume_prob, no_attempt, restore_prob
        self.restores = 0
        self.ghost_ids: set = set()
        self.ghost_keep: list = []
        self.shadow = None
        self.twin_events = 0  # events answered identically by a restored twin
        self.resumes = 0
        self.reused_ids = 0  # configured ids registered again by a resume after they had failed
        self.failed_ids: set = set()  # every id reported failed (the check that only resumes reuse one)

    def _feed(self, event):
        # Drop the attempt of a live (non-ghost) trajectory event now and then: unambiguous, since
        # the event is about the trajectory's current attempt.
        if getattr(event, "attempt", None) is not None and id(event) not in self.ghost_ids:
            if self.rng.random() < self.no_attempt:
                event = type(event)(**{**{f: getattr(event, f) for f in event.__slots__}, "attempt": None})
        if isinstance(event, E.RewardReady) and event.reward == event.reward and self.rng.random() < 0.2:
            event = E.RewardReady(event.group_id, event.index, int(event.reward > 0.5), event.attempt)
        if self.shadow is None:
            return super()._feed(event)
        # A restored twin gets the same events: it must answer with the same actions (or raise alike).
        out = feed_twinned(self.shadow, super()._feed, event)
        self.twin_events += 1
        return out

    def _resume(self):
        """The embedded runtime's `--resume` (`Runtime._restart_from_checkpoint`), at this moment: the coordinator reads
        the scheduler's snapshot back, every engine is a fresh process (what ran, loaded or moved on the old ones is
        gone, and no late report of them comes), every instance the snapshot lists is failed and every configured one
        registered again, in one batch. Rewards still owed come from the coordinator's ledger, as in the runtime."""
        assert not self.config.elastic  # (the runtime's resume re-registers configured ids only)
        self.sched = type(self.sched).restore(json.loads(json.dumps(self.sched.snapshot())))
        if self.shadow is not None:  # a twin resumes alike (from its own snapshot)
            self.shadow = type(self.shadow).restore(json.loads(json.dumps(self.shadow.snapshot())))
        self.running.clear()
        self.migrating.clear()
        self.paused.clear()
        self.loading.clear()
        self.loaded.clear()
        self.ghosts.clear()
        self.dead_instances.clear()  # replacements not started yet: the configured ids come back
        self.capacity.update({s.id: s.capacity for s in self.config.instances})
        failed = set(self.sched.instances)
        self.reused_ids += sum(1 for s in self.config.instances if s.id in self.failed_ids)
        self.failed_ids.update(failed)
        self.resumes += 1
        out = []
        for i, events in enumerate([[E.InstanceFailed(i, "resumed from a checkpoint") for i in failed],
                                    [E.InstanceReady(s.id, s.capacity) for s in self.config.instances]]):
            self.stats.events += len(events)
            acts = self.sched.handle_many(events)
            if self.shadow is not None:
                assert self.shadow.handle_many(events) == acts, (events, acts)
                self.twin_events += len(events)
            out += A.without_failed(acts, failed) if i == 0 else acts
        self.execute(out)

    def tick(self):
        if self.resume_prob and self.rng.random() < self.resume_prob:
            self._resume()
            return True
        if self.restore_prob and self.rng.random() < self.restore_prob:
            restored = Scheduler.restore(json.loads(json.dumps(self.sched.snapshot())))
            if self.rng.random() < 0.5:
                self.sched = restored  # continue on the restored scheduler
            else:
                self.shadow = restored  # keep both: they must stay identical from here on
            self.restores += 1
        return super().tick()

    def _crash(self, inst):
        self.failed_ids.add(inst)
        super()._crash(inst)
        # Ghosts keep their attempt (it is what marks them stale); kept alive so ids stay unique.
        self.ghost_keep.extend(self.ghosts)
        self.ghost_ids.update(id(g) for g in self.ghosts)
        # Its replacement joins under an id no instance had (only a resume registers a failed id).
        assert self.dead_instances[-1][0] not in self.failed_ids | set(self.sched.instances), self.dead_instances


def _config(mode, K, rng, steps):
    caps = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
    return DoraConfig.from_dict({
        "mode": mode, "max_staleness": K, "batch_size": rng.randint(1, 4), "group_size": rng.randint(1, 3),
        "instances": [{"capacity": c} for c in caps], "max_retries": rng.choice([0, 1, 2]), "max_steps": steps,
        "max_failed_group_share": 1.0,
    })


RUNS = 60


def _ks(mode):
    return STALENESS[mode] if mode != "dora" else [1, 2, 3]


def test_mode_seeds_are_the_same_in_every_process():
    """`test_adversarial_orders` draws its runs from `stable_seed(mode)`, not `hash(mode)`, which
    differs between processes (PYTHONHASHSEED): a failure it found could not be replayed."""
    code = ("import random; from dora_ext.testing import stable_seed; from dora_ext.config import MODES; "
            "print([random.Random(stable_seed(m)).random() for m in MODES])")
    out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONHASHSEED": h}).stdout for h in ("1", "2")}
    assert len(out) == 1, out


def _faults(rng):
    return dict(fail_prob=rng.choice([0, 0.05]), crash_prob=rng.choice([0.01, 0.04]), nan_prob=rng.choice([0, 0.03]),
                long_tail=0.3, late_reward=rng.choice([0.3, 1.0]), fail_awaiting=rng.choice([0, 0.1]),
                stale_prob=rng.choice([0, 1.0]), decline_prob=0.1, data_limit=rng.choice([None, 7, 13]),
                progress_prob=0.1)


@pytest.mark.parametrize("mode", MODES)
def test_adversarial_orders(mode):
    rng = random.Random(stable_seed(mode))
    totals = {"restores": 0, "resumes": 0, "reused": 0, "late": 0, "crashes": 0, "runs": 0, "twin_events": 0}
    for _ in range(RUNS):
        K = rng.choice(_ks(mode))
        steps = 6
        cfg = _config(mode, K, rng, steps)
        d = AdversarialDriver(cfg, rng.randrange(2**31), **_faults(rng), group_id=lambda n: f"uid-{n:04x}")
        d.start()
        try:
            d.run(steps)
            check_run(mode, d, steps)
        except BaseException as exc:
            raise AssertionError(f"mode {mode} K={K} cfg={cfg}: {exc!r}") from exc
        totals["restores"] += d.restores
        totals["twin_events"] += d.twin_events
        if d.shadow is not None and d.stats.halted is None:
            assert d.shadow.metrics() == d.sched.metrics()
        totals["resumes"] += d.resumes
        totals["reused"] += d.reused_ids
        totals["late"] += d.stats.late_rewards
        totals["crashes"] += d.stats.crashes
        totals["runs"] += 1
    print(mode, totals)
    assert totals["twin_events"] and totals["restores"] and totals["resumes"] and totals["reused"] and totals["late"] \
        and totals["crashes"], totals


class InboxDriver(AdversarialDriver):
    """Events queue up in an inbox and reach the scheduler through `handle_many` in batches of
    random size (how a runtime draining engine reports uses it); actions come back per batch."""

    counts_stale = False  # events reach the scheduler in a later batch, not when fed

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.inbox: list = []
        self.batches = 0

    def _feed(self, event):
        if getattr(event, "attempt", None) is not None and id(event) not in self.ghost_ids:
            if self.rng.random() < self.no_attempt:
                event = type(event)(**{**{f: getattr(event, f) for f in event.__slots__}, "attempt": None})
        self.stats.events += 1
        self.inbox.append(event)
        return []

    def flush(self) -> bool:
        if not self.inbox:
            return False
        batch, self.inbox = self.inbox, []
        self.batches += 1
        failed = {ev.instance_id for ev in batch if type(ev) is E.InstanceFailed}
        if self.shadow is None:
            self.execute(A.without_failed(self.sched.handle_many(batch), failed))
            return True
        # A restored twin gets the same batches: it must answer alike (or raise alike).
        try:
            twin = self.shadow.handle_many(batch)
        except Exception as exc:  # noqa: BLE001 - compared below
            twin = exc
        try:
            out = self.sched.handle_many(batch)
        except Exception as exc:
            assert type(twin) is type(exc) and str(twin) == str(exc), (batch, twin, exc)
            raise
        assert twin == out, (batch, twin, out)
        self.twin_events += len(batch)
        self.execute(A.without_failed(out, failed))
        return True

    def execute(self, actions):
        # A preempted trajectory whose finish still sits in the inbox has left the engine already:
        # the engine pauses only what runs (the scheduler learns of the finish from the inbox).
        from dora_ext.core import actions as A

        fixed, sent = [], set()
        for a in actions:
            if isinstance(a, A.Dispatch):
                sent.add((a.group_id, a.index))
            if isinstance(a, A.LoadVersion) and a.preempt:
                live = [k for k in a.preempt if k in self.running or k in sent]
                a = A.LoadVersion(a.instance_id, a.version, tuple(live))
            key = (getattr(a, "group_id", None), getattr(a, "index", None))
            if isinstance(a, A.Migrate) and key not in self.running and key not in sent:
                continue  # finished engine-side before the move (its finish is in the inbox)
            fixed.append(a)
        super().execute(fixed)

    def _crash(self, inst):
        # A crash is reported on its own: actions the inbox produces before it reach a live
        # engine. (Actions returned by a batch that also holds `InstanceFailed(x)` may still name
        # `x`: a runtime must drop those, see the review notes.)
        while self.flush():
            pass
        super()._crash(inst)
        self.flush()

    def _resume(self):
        # The coordinator checkpoints between batches: what its inbox held was handled first.
        while self.flush():
            pass
        super()._resume()

    def tick(self):
        if self.inbox and self.rng.random() < 0.3:
            return self.flush()
        if self.inbox and self.restore_prob and self.rng.random() < self.restore_prob:
            self.flush()
        ok = super().tick()
        return ok or self.flush()


@pytest.mark.parametrize("mode", MODES)
def test_handle_many_inbox_orders(mode):
    rng = random.Random(len(mode) * 1013)
    batches = 0
    for _ in range(RUNS):
        K = rng.choice(_ks(mode))
        steps = 6
        cfg = _config(mode, K, rng, steps)
        d = InboxDriver(cfg, rng.randrange(2**31), **_faults(rng))
        d.start()
        try:
            d.run(steps)
            d.flush()
            check_run(mode, d, steps)
        except BaseException as exc:
            raise AssertionError(f"mode {mode} K={K} cfg={cfg}: {exc!r}") from exc
        batches += d.batches
    assert batches


def _two_loaded_instances():
    s = Scheduler(DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "batch_size": 1, "group_size": 2,
                                        "instances": 2, "capacity": 2}))
    acts = s.start()
    acts += s.handle_many([E.InstanceLoaded(0, 0), E.InstanceLoaded(1, 0)])
    assert any(type(a).__name__ == "RequestGroups" for a in acts)
    return s


def test_without_failed_drops_what_a_batch_sent_to_an_instance_it_failed():
    s = _two_loaded_instances()
    out = A.without_failed(s.handle_many([E.GroupAdmitted(0), E.InstanceFailed(0, "crash")]), {0})
    assert not [a for a in out if isinstance(a, (A.Dispatch, A.LoadVersion)) and a.instance_id == 0], out
    dispatched = [(a.group_id, a.index) for a in out if isinstance(a, A.Dispatch)]
    assert sorted(dispatched) == [(0, 0), (0, 1)]  # each trajectory exactly once, on instance 1
    # handle() one by one: the runtime executes the Dispatch before it reports the failure.
    s2 = _two_loaded_instances()
    one = s2.handle(E.GroupAdmitted(0)) + s2.handle(E.InstanceFailed(0, "crash"))
    assert [(a.instance_id, a.attempt) for a in one if isinstance(a, A.Dispatch)][-1] == (1, 1)


def test_a_numpy_float32_reward_is_a_reward():
    """Hosts compute rewards with numpy/torch: a float32 scalar is not a `float` subclass, and was
    reported as an invalid reward and retried until the group failed."""
    np = pytest.importorskip("numpy", reason="numpy is needed to build a numpy scalar reward")
    for reward in (np.float32(0.5), np.float64(0.25), np.int64(1), 1, True):
        s = Scheduler(DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "batch_size": 1,
                                            "group_size": 1, "instances": 1, "capacity": 1}))
        s.start()
        s.handle(E.InstanceLoaded(0, 0))
        assert any(isinstance(a, A.Dispatch) for a in s.handle(E.GroupAdmitted(0)))
        out = s.handle(E.TrajectoryFinished(0, 0, tokens=3, reward=reward))
        assert not any(isinstance(a, A.ReportError) for a in out), (reward, out)
        assert [a for a in out if isinstance(a, A.StartStep)] == [A.StartStep(0, (0,))], (reward, out)
    # (10**400 and its Fraction: math.isfinite raised OverflowError out of the scheduler)
    for bad in (np.float32("nan"), float("inf"), "0.5", None, 10**400, fractions.Fraction(10**400, 3), 10**5000):
        s = Scheduler(DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "batch_size": 1,
                                            "group_size": 1, "instances": 1, "capacity": 1}))
        s.start()
        s.handle(E.InstanceLoaded(0, 0))
        s.handle(E.GroupAdmitted(0))
        out = s.handle(E.TrajectoryFinished(0, 0, tokens=3, reward=bad)) if bad is not None else \
            s.handle(E.TrajectoryFinished(0, 0, tokens=3)) + s.handle(E.RewardReady(0, 0, None))
        assert any(isinstance(a, A.ReportError) for a in out), (bad, out)

"""The instance log (handles under placement stamps, `nrun`, compaction) against two references.

1. Twin: the scheduler as it was before the hot-path rework (`REF`, where an instance's running
   trajectories were a dict) is loaded from git at test time (not copied into the repository) and
   fed the very same events as the current one, by the adversarial drivers of `test_adversarial`
   (random capacities, crashes, stale and late reports, retries, `MigrationLanded` so R5 moves a
   trajectory again, restores from JSON, checkpoint resumes that re-register failed ids, batches
   through `handle_many`, elastic lending, mode `partial`'s preemption). Every batch of actions
   must be equal, and so must the two snapshots at every restore and at the end. The rework was
   meant to change nothing but cost: a deliberate policy change after `REF` makes this fail, and
   then `REF` moves to the commit of that change. Skipped (with the reason) where git or that
   commit is not available (a source tarball, a shallow clone).
2. Ledger: whatever the policy, after every event each instance's live log (`running_on`) must be
   exactly the driver's own record of what runs there (the twin checks the order), with `nrun` its length
   and the log no longer than `3 * capacity + 33` entries (compaction runs on a placement: a log
   is bounded by what ran at its last placement, not by what runs now). Runs without git.
"""

import json
import random

import pytest

from dora_ext.config import DoraConfig
from dora_ext.core import Scheduler
from dora_ext.core import scheduler as S
from dora_ext.testing import stable_seed

from .test_adversarial import AdversarialDriver, InboxDriver
from .scheduler_at import scheduler_module_at
from .test_properties import check_run

#: The last commit of `dora_ext/core/scheduler.py` before the hot-path rework (instance logs,
#: inlined keys, R5's lazy plans), which changed no decision.
REF = "d2b310f"  # the last commit before the split into modules
STEPS = 12


def _reference_scheduler():
    mod = scheduler_module_at(REF, "dora_ext.core._scheduler_at_ref")
    return mod.Scheduler


class _Ledger:
    """What runs where, in placement order, from the actions alone (the driver's record keeps
    no order): checked against the scheduler's logs after every event."""

    def __init__(self):
        self.checks = 0
        self.max_log = 0

    @staticmethod
    def check(d):
        s = d.sched
        where: dict[int, list] = {}
        for key, r in d.running.items():
            where.setdefault(r[0], []).append(key)
        for iid, inst in s.instances.items():
            live = s.running_on(iid)
            assert inst.nrun == len(live), (iid, inst.nrun, live)
            # Compaction runs on a placement, so the bound is three times what ran at the last one
            # (at most the capacity), not three times what runs now.
            assert len(inst.hs) == len(inst.ps) <= 3 * inst.capacity + 33, (iid, len(inst.hs), inst.capacity)
            assert sorted(live, key=repr) == sorted(where.get(iid, []), key=repr), (iid, live, where.get(iid))
            assert len(set(inst.ps)) == len(inst.ps)  # stamps are never reused on one log
            assert list(inst.ps) == sorted(inst.ps)  # appended in placement order
        for iid in where:
            assert iid in s.instances, (iid, "runs work but is not registered")
        # An idle instance runs nothing (a finish that emptied an instance which its own dispatch
        # refilled at once left the busy instance listed as idle, out of its place in that order).
        busy = [iid for iid in s._idle if iid in s.instances and s.instances[iid].nrun]
        assert not busy, (busy, "listed idle while running work")


def _checked(cls):
    class Checked(cls):
        ledger_checks = 0

        def execute(self, actions):
            super().execute(actions)
            if not getattr(self, "inbox", None):
                # (an inbox driver's ledger is ahead of the scheduler until it flushes)
                _Ledger.check(self)
                self.ledger_checks += 1

    return Checked


def _config(mode, rng, elastic):
    wide = rng.random() < 0.5  # few large instances that seldom drain: logs grow until compacted
    caps = [rng.choice([8, 16] if wide else [1, 2, 5]) for _ in range(rng.randint(2, 4))]
    d = {"mode": mode, "max_staleness": rng.choice([1, 2, 3]) if mode == "dora" else (0 if mode in ("sync", "pipeline") else 1),
         "batch_size": rng.randint(1, 8 if wide else 4), "group_size": rng.randint(1, 4),
         "instances": [{"capacity": c} for c in caps], "max_retries": rng.choice([0, 1, 2]), "max_steps": STEPS,
         "max_failed_group_share": 1.0,
         "admission": "fill"}  # (the reference scheduler knows only `fill`)
    if mode == "partial":
        d["max_staleness"] = 1
    if elastic:
        d.update(elastic=True, elastic_spare=rng.choice([0, 1]))
    return DoraConfig.from_dict(d)


def _drive(cls, mode, seed, twin_cls, elastic=False):
    rng = random.Random(seed)
    cfg = _config(mode, rng, elastic)
    kw = dict(fail_prob=rng.choice([0, 0.05]), crash_prob=rng.choice([0.005, 0.03]), nan_prob=0.02,
              long_tail=rng.choice([0.3, 0.6]), late_reward=rng.choice([0.3, 1.0]), fail_awaiting=0.05,
              stale_prob=rng.choice([0, 1.0]), decline_prob=0.1, progress_prob=0.1, landed_prob=rng.choice([0.5, 1.0]),
              resume_prob=0 if elastic else 0.003, restore_prob=0)
    d = cls(cfg, rng.randrange(2**31), **kw)
    restores = 0
    if twin_cls is not None:
        d.shadow = twin_cls(cfg)
        orig_tick = d.tick

        def tick():
            nonlocal restores
            if rng.random() < 0.01:
                # Both restored from their own JSON snapshots, which must be equal.
                a, b = json.loads(json.dumps(d.sched.snapshot())), json.loads(json.dumps(d.shadow.snapshot()))
                assert a == b
                d.sched, d.shadow = Scheduler.restore(a), twin_cls.restore(b)
                restores += 1
            return orig_tick()

        d.tick = tick
    out = d.sched.start()
    if twin_cls is not None:
        assert d.shadow.start() == out
    d.execute(out)
    d.run(STEPS)
    if hasattr(d, "flush"):
        while d.flush():
            pass
    check_run(mode, d, STEPS)
    if twin_cls is not None and d.stats.halted is None:
        assert d.sched.snapshot() == d.shadow.snapshot()
        assert d.sched.metrics() == d.shadow.metrics()
    return d, restores


CASES = [(mode, elastic) for mode in ("dora", "pipeline", "partial", "sync") for elastic in (False, True)
         if not elastic or mode in ("dora", "pipeline")]


@pytest.mark.parametrize("mode,elastic", CASES)
def test_logs_match_the_driver_ledger(mode, elastic, monkeypatch):
    compactions = []
    real = S.Scheduler._compact
    monkeypatch.setattr(S.Scheduler, "_compact", lambda self, inst: (compactions.append(inst.id), real(self, inst)))
    moved = 0
    for seed in range(12):
        for base in (AdversarialDriver, InboxDriver):
            d, _ = _drive(_checked(base), mode, stable_seed(f"{mode}/{elastic}/{seed}/{base.__name__}"), None, elastic)
            moved += d.stats.migrations
    print(mode, elastic, {"compactions": len(compactions), "migrations": moved})
    if mode == "dora":
        assert moved


@pytest.mark.slow
@pytest.mark.parametrize("mode,elastic", CASES)
def test_twin_of_the_dict_scheduler(mode, elastic):
    ref = _reference_scheduler()
    events = restores = migrations = 0
    for seed in range(25):
        for base in (AdversarialDriver, InboxDriver):
            d, r = _drive(base, mode, seed * 7919 + len(mode) + elastic, ref, elastic)
            events += d.twin_events
            restores += r
            migrations += d.stats.migrations
    assert events and restores
    print(mode, elastic, {"twin_events": events, "restores": restores, "migrations": migrations})

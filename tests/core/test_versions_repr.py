"""A trajectory's versions kept unboxed (`_traj_version`: none or one version; `_traj_versions`: a list of several, in
`partial`): what the snapshot and the metrics see must not change with the representation (review of c9)."""

import json

import pytest

from dora_ext.config import DoraConfig
from dora_ext.core import Scheduler
from dora_ext.core import actions as A
from dora_ext.core import events as E


def _one(mode):
    s = Scheduler(DoraConfig.from_dict({"mode": mode, "max_staleness": 2, "batch_size": 1, "group_size": 2,
                                        "instances": 1, "capacity": 2}))
    s.start()
    return s


@pytest.mark.parametrize("mode", ["dora", "partial"])
def test_a_version_reported_as_a_numpy_integer_keeps_the_snapshot_working(mode):
    """A host may report `InstanceLoaded(version=np.int64(0))` (equal to the version asked for).
    With the single version kept unboxed, that numpy scalar became the trajectory's `versions`,
    which is neither an int nor a list: `snapshot()` raised TypeError."""
    np = pytest.importorskip("numpy", reason="numpy builds the host's integer version")
    s = _one(mode)
    s.handle(E.InstanceLoaded(0, np.int64(0)))
    assert [a for a in s.handle(E.GroupAdmitted(0)) if isinstance(a, A.Dispatch)]
    snap = json.loads(json.dumps(s.snapshot()))
    assert [t[4] for t in snap["groups"][0][-1]] == [[0], [0]]
    assert Scheduler.restore(snap).snapshot() == snap


def test_partial_multi_version_trajectories_survive_a_json_round_trip():
    """Mode `partial`: run until trajectories resumed under a second (or third) version (a list)
    while others ran under one (an int); the JSON round trip keeps each, and the restored twin,
    fed the same events, answers with the same actions to the end and ends with the same metrics
    (`multi_version_trajectories` is counted from these lists at each step)."""
    from .test_adversarial import AdversarialDriver

    cfg = DoraConfig.from_dict({"mode": "partial", "max_staleness": 1, "batch_size": 2, "group_size": 3,
                                "instances": 2, "capacity": 3, "max_steps": 8})
    d = AdversarialDriver(cfg, 7, long_tail=0.6, restore_prob=0.0, no_attempt=0.3, resume_prob=0.0)
    d.start()

    def multi():
        return {(gid, i): list(t.versions) for gid in d.sched.groups
                for i, t in enumerate(d.sched.trajectories(gid)) if type(t.versions) is list}

    while not multi():
        assert d.tick()
    assert any(len(v) >= 2 for v in multi().values())
    snap = json.loads(json.dumps(d.sched.snapshot()))
    twin = Scheduler.restore(snap)
    assert twin.snapshot() == snap
    assert {(gid, i): list(t.versions) for gid in twin.groups
            for i, t in enumerate(twin.trajectories(gid)) if type(t.versions) is list} == multi()
    singles = [(t.versions, u.versions) for g, h in zip(d.sched.groups, twin.groups)
               for t, u in zip(d.sched.trajectories(g), twin.trajectories(h)) if type(t.versions) is not list]
    assert singles and all(a == b and type(a) is type(b) for a, b in singles)
    d.shadow = twin
    d.run(8)
    assert d.twin_events > 0 and d.sched.metrics() == twin.metrics()
    assert d.sched.metrics()["multi_version_trajectories"] > 0

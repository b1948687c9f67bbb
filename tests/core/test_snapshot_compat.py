"""A snapshot written before the flat core state resumes in today's scheduler, event by event.

`data/snapshot_v2_<mode>.json` holds a format-2 snapshot taken by the scheduler of git revision
a2d9384 (one object per group and trajectory; `data/make_snapshot_v2_fixtures.py` wrote it),
at a moment with a trajectory generated under two versions (partial) or a migration in flight
(dora) and re-queued retries, and the 250 events that scheduler handled next with the actions it
answered. Restored here, today's scheduler must answer the same actions and end with the same
metrics: checkpoints stored by runtimes before the redesign stay resumable.
(A change that alters the scheduler's decisions on purpose makes the replay differ: regenerate
the fixtures with `REV` set to the last revision that reads format 2 as intended.)
"""

import json
import pathlib

import pytest

from dora_ext.core import Scheduler
from dora_ext.core import events as E

DATA = pathlib.Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("mode", ["partial", "dora"])
def test_a_snapshot_of_the_object_per_group_scheduler_resumes_with_the_same_actions(mode):
    fx = json.loads((DATA / f"snapshot_v2_{mode}.json").read_text())
    assert fx["snapshot"]["format"] == 2 and fx["mode"] == mode
    s = Scheduler.restore(fx["snapshot"])
    assert len(s.groups) == len(fx["snapshot"]["groups"]) > 0
    for i, (name, fields, expected) in enumerate(fx["trace"]):
        if fields.get("reward") == "nan":
            fields["reward"] = float("nan")
        event = getattr(E, name)(**fields)
        got = [repr(a) for a in s.handle(event)]
        assert got == expected, (i, event)
    assert json.loads(json.dumps(s.metrics())) == fx["metrics"]


@pytest.mark.parametrize("mode", ["partial", "dora"])
def test_a_format_2_snapshot_still_knows_its_failed_instances(mode):
    """Format 2 listed every failed instance (`dead`); format 3 keeps the largest id ever
    registered instead. Restored from format 2, a late report of an instance the list names is
    stale (counted, ignored), and one of an id no instance had is a protocol error."""
    from dora_ext.core import ProtocolError

    snap = json.loads((DATA / f"snapshot_v2_{mode}.json").read_text())["snapshot"]
    dead, live = snap["dead"], [i[0] for i in snap["instances"]]
    assert dead
    s = Scheduler.restore(snap)
    stale = s.metrics()["stale_events"]
    assert s.handle(E.InstanceFailed(dead[0], "reported twice")) == []
    assert s.handle(E.InstanceLoaded(dead[-1], 0)) == []
    assert s.metrics()["stale_events"] == stale + 2
    with pytest.raises(ProtocolError, match="unknown"):
        s.handle(E.InstanceFailed(max(dead + live) + 1, "never registered"))
    assert "dead" not in s.snapshot() and s.snapshot()["format"] == 3

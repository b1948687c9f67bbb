"""A late report from verl's agent loop for a group that was already trained.

verl's agent loop carries no attempt number, so a report that arrives after its group's step
finished (a request that completed on a replica after its trajectory was counted, for example)
cannot be told apart by the scheduler from a current one. The coordinator (the plain class that
``create_coordinator`` wraps as a Ray actor) must drop and count it, not stop the run.
No stand-in: the coordinator's routing and the scheduler run as in ``main_ppo``; no server is
called because nothing here generates.
"""

from __future__ import annotations

import asyncio

import pytest

from dora_ext.core.scheduler import ProtocolError
from dora_ext.verl.coordinator import DoraCoordinator

CFG = {"mode": "dora", "max_staleness": 1, "batch_size": 1, "group_size": 2, "instances": 1, "capacity": 4}


def _trained_once() -> DoraCoordinator:
    coord = DoraCoordinator(CFG, {"server-0": None}, use_plugins=False)
    asyncio.run(coord.start())
    coord.offer(["g0", "g1", "g2"])
    assert coord.route[("g0", 0)] == 0 and coord.route[("g0", 1)] == 0
    for idx in range(2):
        coord.trajectory_done("g0", idx, tokens=5, reward=1.0)
    assert coord.step_batch(0) == ["g0"]
    coord.step_finished(1)  # step 0 trained group g0: it leaves the coordinator and the scheduler
    assert "g0" not in coord.admitted
    return coord


@pytest.mark.parametrize("late", ["done", "reward", "failed"])
def test_late_report_for_trained_group_is_counted_not_fatal(late):
    coord = _trained_once()
    before = coord.sched.metrics()
    if late == "done":
        coord.trajectory_done("g0", 1, tokens=5, reward=1.0)
    elif late == "reward":
        coord.reward_ready("g0", 1, 0.5)
    else:
        assert coord.trajectory_failed("g0", 1, "replica gone") == "failed"
    m = coord.metrics()
    assert m["late_reports"] == 1
    assert ("late", {"done": "trajectory_done", "reward": "reward_ready", "failed": "trajectory_failed"}[late],
            "g0", 1) in coord.get_log()
    # The run goes on: the next group still trains, and nothing was counted twice.
    for idx in range(2):
        coord.trajectory_done("g1", idx, tokens=5, reward=0.0)
    assert coord.step_batch(1) == ["g1"]
    assert m.get("duplicated", 0) == before.get("duplicated", 0)


def test_the_scheduler_alone_would_reject_it():
    """What the guard protects against: the same report fed to the scheduler directly."""
    from dora_ext.core import events as E

    coord = _trained_once()
    with pytest.raises(ProtocolError):
        coord.sched.handle(E.TrajectoryFinished("g0", 1, 5, reward=1.0))

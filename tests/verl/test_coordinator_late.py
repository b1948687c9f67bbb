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


def test_servers_removed_together_get_no_redispatch():
    """verl removes several replicas in one ``remove_servers`` call: a trajectory of the first
    must not be re-routed to the second (gone in the same call), which a later server re-using
    its address could then receive as a void request."""
    cfg = dict(CFG, instances=3, capacity=4, batch_size=2, max_staleness=1)
    coord = DoraCoordinator(cfg, {"s0": None, "s1": None, "s2": None}, use_plugins=False)
    asyncio.run(coord.start())
    coord.offer([f"g{i}" for i in range(6)])
    held = {iid for iid in coord.route.values()}
    assert {0, 1} <= held  # both removed servers hold work
    n = len(coord.get_log())
    coord.remove_servers(["s0", "s1"])
    after = [e for e in coord.get_log()[n:] if e[0] == "dispatch"]
    assert after, "the removed servers' trajectories were not re-dispatched"
    assert all(e[3] == 2 for e in after), after  # only to the server that is left
    assert all(iid == 2 for iid in coord.route.values() if iid is not None), coord.route
    # A trajectory still waiting for a slot is not routed to a removed server: its request waits.
    waiting = [(g, i) for g in (f"g{j}" for j in range(6)) for i in range(2) if (g, i) not in coord.route]
    assert waiting

    async def ask():
        task = asyncio.ensure_future(coord.acquire_server("r", dora_group=waiting[0][0], dora_index=waiting[0][1]))
        await asyncio.sleep(0)
        assert not task.done()  # waits for a dispatch instead of failing on the removed server
        task.cancel()

    asyncio.run(ask())


def test_a_late_load_answer_of_a_removed_server_is_not_recorded():
    """A load answer (``loaded``) that reaches the coordinator after ``remove_servers`` took its
    server away: the scheduler counts it stale, and the coordinator must not record the version
    either. It did, so ``get_status`` listed the removed server, and once verl added a server at
    the same address again (a new instance id, nothing loaded on it yet) a request without a
    group (validation) was routed there as if it held that version."""
    cfg = dict(CFG, instances=2)
    coord = DoraCoordinator(cfg, {"s0": None, "s1": None}, use_plugins=False)
    asyncio.run(coord.start())
    assert coord.versions == {0: 0, 1: 0}
    coord.remove_servers(["s1"])
    coord.loaded([1], 1)  # the answer to a load of version 1 issued before the removal
    assert coord.sched.metrics()["stale_events"] == 1
    assert coord.versions == {0: 0} and coord.get_status()["versions"] == {"s0": 0}
    coord.add_servers({"s1": None})  # the same address again: instance 2, nothing loaded yet
    assert coord.instance_of["s1"] == 2 and coord.get_status()["versions"] == {"s0": 0}

    async def ask():
        return (await coord.acquire_server("validation-0"))[0]

    assert asyncio.run(ask()) == "s0"  # the only server known to hold a version


def test_a_move_to_a_server_removed_in_the_same_call_leaves_its_request_waiting():
    """``remove_servers(["s1", "s3"])`` is one scheduler batch: s1's failure re-dispatches its
    trajectories and R5 moves a trajectory from s0 to s3, which fails next. ``handle_many``
    keeps that ``Migrate`` (its source is live: the request there must stop), and the
    scheduler re-queues the trajectory. The coordinator routed it to s3 all the same, so the
    aborted request's next ``acquire_server`` failed on the removed server's in-flight count
    (KeyError 's3') instead of waiting for the new Dispatch.

    The state is a seeded random run's (``RandomDriver`` seed 21, 341 events: a move into a
    server removed in the same call), restored into the coordinator's scheduler, with the
    coordinator's routes and admitted groups set from it."""
    import json

    from dora_ext.config import DoraConfig
    from dora_ext.core import Scheduler
    from dora_ext.testing import RandomDriver

    cfg = {"mode": "dora", "max_staleness": 2, "batch_size": 2, "group_size": 4, "instances": 4, "capacity": 4,
           "max_steps": 30}
    d = RandomDriver(DoraConfig.from_dict(cfg), 21, long_tail=0.6)
    d.start()
    for _ in range(341):
        assert d.tick()
    coord = DoraCoordinator(cfg, {f"s{i}": None for i in range(4)}, use_plugins=False)
    coord.sched = Scheduler.restore(json.loads(json.dumps(d.sched.snapshot())))
    coord.started = True
    coord.admitted = {gid: 0 for gid in coord.sched.groups}
    for iid in coord.sched.instances:
        for key in coord.sched.running_on(iid):
            coord.route[key] = iid
    n = len(coord.get_log())
    coord.remove_servers(["s1", "s3"])
    moves = [e for e in coord.get_log()[n:] if e[0] == "migrate" and e[4] == 3]
    assert moves, "the batch no longer moves a trajectory into s3: pick another state"
    key = (moves[0][1], moves[0][2])
    assert coord.sched.trajectory(*key).status == "Q"  # re-queued by s3's failure
    # The move cannot land (its destination is gone): counted dropped, nothing pending.
    assert ("move_dropped", key[0], key[1], "removed") in coord.get_log() and key not in coord.moving
    assert 0 in coord.take_work()["abort"]  # its request on the live source stops
    assert all(iid not in (1, 3) for iid in coord.route.values()), coord.route

    async def ask():
        task = asyncio.ensure_future(coord.acquire_server("r", dora_group=key[0], dora_index=key[1]))
        await asyncio.sleep(0)
        assert not task.done()  # waits for its Dispatch (it raised KeyError 's3')
        task.cancel()

    asyncio.run(ask())

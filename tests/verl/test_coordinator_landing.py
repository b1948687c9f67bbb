"""verl's coordinator answers R5's ``Migrate`` with ``MigrationLanded``.

In verl a move is: the coordinator re-routes the trajectory to its destination and the trainer
aborts the source replica (``take_work``); verl's ``FullyAsyncLLMServerClient`` then re-acquires in
its resume loop (or the agent loop acquires for its next turn) and the coordinator sends the
request to the destination. That first acquire routed to the destination is the landing: the
coordinator feeds ``MigrationLanded`` and the scheduler may move the trajectory again in the same
attempt. verl carries no attempt number, so every event that ends the attempt (a failure, the end
of generation, a new dispatch, the group's failure or training, the removal of the destination)
drops the pending move.

No stand-in: the coordinator (the plain class that ``create_coordinator`` wraps as a Ray actor)
and its scheduler run as in ``main_ppo``; no server is called because nothing here generates
(``acquire_server`` returns the server's handle, ``None`` here). Each race is forced by the order
of the calls.
"""

from __future__ import annotations

import asyncio

import pytest

from dora_ext.verl.coordinator import DoraCoordinator, GroupFailedError

from .coordinator_helpers import ONE, all_but_the_last_two_done, before_the_move, started, waiting_then_offered
TWO = {"mode": "dora", "max_staleness": 2, "batch_size": 1, "group_size": 5, "instances": 2, "capacity": 10}


def _acquire(coord: DoraCoordinator, group, index) -> str:
    """One request of the trajectory: acquired, and released once it came back (verl's client
    releases in a ``finally``; a load decided on the instance meanwhile is held until then)."""
    async def ask():
        return (await coord.acquire_server("r", dora_group=group, dora_index=index))[0]

    sid = asyncio.run(ask())
    coord.release_server(sid, "r")
    return sid


def _since(coord: DoraCoordinator, n: int, kind: str) -> list[tuple]:
    return [e for e in coord.get_log()[n:] if e[0] == kind]


def _check_ledger(coord: DoraCoordinator) -> None:
    """The coordinator's counters against its log and the scheduler's own count of moves.

    One ``landed`` entry per landing fed (``migrations_landed``), each for the destination of that
    trajectory's last ``migrate``, with no ``dispatch`` of it (a new attempt) or drop in between,
    at most one per move; every move the scheduler made (its ``migrations``) ends landed, dropped
    (``moves_dropped``, with its cause) or is still pending (``moves_not_landed``)."""
    log = coord.get_log()
    m = coord.metrics()
    landed = [e for e in log if e[0] == "landed"]
    dropped = [e for e in log if e[0] == "move_dropped"]
    assert m["migrations_landed"] == len(landed), (m, landed)
    assert m["moves_dropped"] == len(dropped), (m, dropped)
    assert m["migrations"] == m["migrations_landed"] + m["moves_dropped"] + m["moves_not_landed"], m
    pending: dict[tuple, int] = {}
    for e in log:
        if e[0] == "migrate":
            assert (e[1], e[2]) not in pending, (e, log)  # moved again before it landed
            pending[(e[1], e[2])] = e[4]
        elif e[0] == "dispatch":
            assert (e[1], e[2]) not in pending, (e, log)  # a new attempt: its move was dropped first
        elif e[0] == "move_dropped":
            assert pending.pop((e[1], e[2]), None) is not None, (e, log)
        elif e[0] == "landed":
            assert pending.pop((e[1], e[2]), None) == e[3], (e, log)
    assert set(pending) == set(coord.moving), (pending, coord.moving)


def _one_move(cfg_extra: dict | None = None) -> DoraCoordinator:
    """Two instances of 4 slots, K=2, B=2, n=2. Version 0's last two trajectories run one on each
    instance when version 1 is published: R5 moves g1/1 from instance 1 onto instance 0, and
    instance 1 loads version 1 (its request there is aborted: ``take_work``)."""
    coord = before_the_move(dict(ONE, **(cfg_extra or {})))
    n = len(coord.get_log())
    coord.step_finished(1)
    assert _since(coord, n, "migrate") == [("migrate", "g1", 1, 1, 0)]
    assert coord.take_work() == {"load": [(1, 1)], "abort": [1]}
    assert coord.moving == {("g1", 1): (0, 0)}
    assert coord.sched.trajectory("g1", 1).moved
    return coord


def _two_moves(land: bool) -> tuple[DoraCoordinator, int]:
    """Two instances of 10 slots, K=2, B=1, n=5. Publishing version 1 moves g0/1 and g0/3 from
    instance 1 onto instance 0 (R5 consolidation). g0/1's request re-acquires on instance 0 if
    `land`. Once version 0 gates step 2 and instance 1 is idle, R5 spreads version 0's stragglers
    (g0/1, g0/3, both on instance 0) onto it: it may take only a trajectory whose move landed.
    Returns the coordinator and the length of its log before the spread."""
    coord = started(TWO)
    coord.offer([f"g{i}" for i in range(4)])
    for g in ("g1", "g2"):
        for i in range(5):
            coord.trajectory_done(g, i, 5, 1.0)
    assert coord.step_batch(0) == ["g1"]
    n = len(coord.get_log())
    coord.step_finished(1)
    assert _since(coord, n, "migrate") == [("migrate", "g0", 1, 1, 0), ("migrate", "g0", 3, 1, 0)]
    assert coord.take_work() == {"load": [(1, 1)], "abort": [1]}
    for i in (0, 2, 4):
        coord.trajectory_done("g0", i, 5, 1.0)
    if land:
        assert _acquire(coord, "g0", 1) == "s0"  # verl's client resumes after the abort of s1
    coord.loaded([1], 1)
    for i in range(5):
        coord.trajectory_done("g3", i, 5, 1.0)
    assert coord.step_batch(1) == ["g2"]
    coord.step_finished(2)  # version 0 now gates step 2
    assert coord.take_work()["load"] == [(1, 2)]
    coord.offer(["g4", "g5"])
    coord.loaded([1], 2)
    for i in range(5):
        coord.trajectory_done("g4", i, 5, 1.0)  # instance 1 is idle: R2's budget is spent
    assert coord.sched.running_on(0) == [("g0", 1), ("g0", 3)] and coord.sched.running_on(1) == []
    return coord, len(coord.get_log())


def test_a_landed_move_moves_again_in_the_same_attempt():
    coord, n = _two_moves(land=True)
    assert ("landed", "g0", 1, 0) in coord.get_log()
    assert coord.moving == {("g0", 3): (0, 0)}  # g0/3's request has not re-acquired yet
    attempt = coord.sched.trajectory("g0", 1).attempt
    assert coord.take_work()["load"] == [(1, 0)]  # instance 1 loads version 0 to take its share
    coord.loaded([1], 0)
    assert _since(coord, n, "migrate") == [("migrate", "g0", 1, 0, 1)]  # moved a second time
    t = coord.sched.trajectory("g0", 1)
    assert t.attempt == attempt and t.moved and t.instance == 1
    assert coord.moving[("g0", 1)] == (1, attempt)
    assert coord.take_work()["abort"] == [0]
    assert _acquire(coord, "g0", 1) == "s1"  # the second move lands too
    assert not coord.sched.trajectory("g0", 1).moved
    assert coord.metrics()["migrations_landed"] == 2
    assert _acquire(coord, "g0", 1) == "s1"  # a later turn on the same instance is no landing
    assert coord.metrics()["migrations_landed"] == 2
    _check_ledger(coord)


def test_without_the_landing_the_trajectory_does_not_move_again():
    """The same run, but g0/1's request had not re-acquired: both stragglers moved and did not
    land, so the idle instance has nothing it may take and loads nothing (a switch for nothing)."""
    coord, n = _two_moves(land=False)
    assert coord.sched.trajectory("g0", 1).moved and coord.sched.trajectory("g0", 3).moved
    assert coord.take_work()["load"] == []
    assert _since(coord, n, "migrate") == []
    assert coord.metrics()["migrations_landed"] == 0
    # The landing comes now: instance 1, idle, may take g0/1 on its next decision.
    assert _acquire(coord, "g0", 1) == "s0"
    assert not coord.sched.trajectory("g0", 1).moved and coord.sched.trajectory("g0", 3).moved
    _check_ledger(coord)


def test_the_landing_resets_the_schedulers_moved_flag():
    coord = _one_move()
    before = coord.sched.metrics()["stale_events"]
    assert _acquire(coord, "g1", 1) == "s0"
    assert not coord.sched.trajectory("g1", 1).moved
    assert coord.moving == {} and coord.metrics()["moves_not_landed"] == 0
    assert coord.sched.metrics()["stale_events"] == before  # accepted, not counted stale
    assert coord.get_log()[-1] == ("landed", "g1", 1, 0)
    _check_ledger(coord)


@pytest.mark.parametrize("order", ["acquire_first", "failed_first"])
def test_failure_and_reacquire_in_both_orders(order):
    """A failure of the moved trajectory ends its attempt; the retry is dispatched to the same
    instance (the move's destination, which holds version 0). Its acquire there must not be taken
    for the old attempt's landing."""
    coord = _one_move()
    before = coord.sched.metrics()["stale_events"]
    attempt = coord.sched.trajectory("g1", 1).attempt
    if order == "acquire_first":
        assert _acquire(coord, "g1", 1) == "s0"
    n = len(coord.get_log())
    assert coord.trajectory_failed("g1", 1, "replica error") == "retry"
    assert coord.moving == {}
    assert _since(coord, n, "dispatch") == [("dispatch", "g1", 1, 0, 0)]  # the retry, on the destination
    t = coord.sched.trajectory("g1", 1)
    assert t.attempt == attempt + 1 and t.status == "R" and not t.moved
    assert _acquire(coord, "g1", 1) == "s0"  # the retry's request
    assert coord.metrics()["migrations_landed"] == (1 if order == "acquire_first" else 0)
    assert (("move_dropped", "g1", 1, "failed") in coord.get_log()) == (order == "failed_first")
    assert coord.sched.metrics()["stale_events"] == before
    _check_ledger(coord)


@pytest.mark.parametrize("order", ["acquire_first", "done_first"])
def test_end_of_generation_and_reacquire_in_both_orders(order):
    """verl's client does not always re-acquire after the abort: a request that reached its token
    budget, or that the abort found finished, comes back as it is and the agent loop reports the
    end of generation. The pending move is then dropped, not kept for ever."""
    coord = _one_move()
    before = coord.sched.metrics()["stale_events"]
    if order == "acquire_first":
        assert _acquire(coord, "g1", 1) == "s0"
    coord.trajectory_done("g1", 1, 7, None)
    assert coord.moving == {}
    assert coord.sched.trajectory("g1", 1).status == "F"  # finished, awaiting its reward
    coord.reward_ready("g1", 1, 1.0)
    assert coord.metrics()["migrations_landed"] == (1 if order == "acquire_first" else 0)
    assert (("move_dropped", "g1", 1, "done") in coord.get_log()) == (order == "done_first")
    assert coord.sched.metrics()["stale_events"] == before
    assert coord.metrics()["late_reports"] == 0
    _check_ledger(coord)


def test_destination_removed_between_the_move_and_the_reacquire():
    """verl removes the destination's server before the moved request re-acquires: the scheduler
    re-queues the trajectory, the pending move is dropped, the request waits for the new
    Dispatch (a new attempt, on a server verl adds) and its acquire there is no landing."""
    coord = _one_move()
    attempt = coord.sched.trajectory("g1", 1).attempt
    coord.remove_servers(["s0"])
    assert coord.moving == {} and ("g1", 1) not in coord.route
    assert ("move_dropped", "g1", 1, "removed") in coord.get_log()
    assert coord.sched.trajectory("g1", 1).status == "Q"

    async def run():
        task = asyncio.ensure_future(coord.acquire_server("r", dora_group="g1", dora_index=1))
        await asyncio.sleep(0)
        assert not task.done()  # waits for its Dispatch
        coord.loaded([1], 1)  # instance 1 finishes its load and takes version 1's groups
        coord.add_servers({"s2": None})  # instance 2
        assert coord.take_work()["load"] == [(2, 0)]
        coord.loaded([2], 0)
        assert coord.route[("g1", 1)] == 2
        return await task

    sid, _ = asyncio.run(run())
    assert sid == "s2"
    t = coord.sched.trajectory("g1", 1)
    assert t.attempt > attempt and t.instance == 2 and not t.moved
    assert coord.metrics()["migrations_landed"] == 0 and coord.moving == {}
    _check_ledger(coord)


def test_destination_removed_after_the_landing():
    coord = _one_move()
    assert _acquire(coord, "g1", 1) == "s0"
    coord.remove_servers(["s0"])
    assert coord.moving == {}
    coord.loaded([1], 1)
    coord.add_servers({"s2": None})
    coord.loaded([2], 0)
    assert coord.route[("g1", 1)] == 2
    assert _acquire(coord, "g1", 1) == "s2"  # the new attempt's request: no second landing
    assert coord.metrics()["migrations_landed"] == 1
    _check_ledger(coord)


def test_moved_between_its_dispatch_and_the_waiting_acquire_resuming():
    """An acquire waits for its trajectory's Dispatch; the Dispatch resolves it, and R5 moves the
    trajectory before the waiting task runs again. The request goes where the trajectory runs now
    (the destination; it went to the source, whose abort could already have been executed), and
    that is the move's landing."""
    coord = started(ONE)

    async def run():
        task = await waiting_then_offered(coord)  # no await from here until the task resumes
        assert coord.route[("g1", 1)] == 1  # dispatched to instance 1: the waiter is resolved
        all_but_the_last_two_done(coord)
        coord.step_finished(1)  # R5 moves g1/1 from instance 1 to instance 0
        assert coord.route[("g1", 1)] == 0 and not task.done()
        return await task

    sid, _ = asyncio.run(run())
    assert sid == "s0"
    assert coord.metrics()["migrations_landed"] == 1 and not coord.sched.trajectory("g1", 1).moved
    _check_ledger(coord)


def test_group_failure_drops_its_pending_moves():
    """With no retries, a failure of another trajectory of the group fails the group: its moves
    that have not landed are dropped, and their requests get the group's failure."""
    coord = DoraCoordinator(dict(TWO, max_retries=0), {"s0": None, "s1": None}, use_plugins=False)
    asyncio.run(coord.start())
    coord.offer([f"g{i}" for i in range(4)])
    for g in ("g1", "g2"):
        for i in range(5):
            coord.trajectory_done(g, i, 5, 1.0)
    coord.step_finished(1)
    assert set(coord.moving) == {("g0", 1), ("g0", 3)}
    assert coord.trajectory_failed("g0", 0, "replica error") == "failed"
    assert "g0" in coord.failed and coord.moving == {}
    assert {e for e in coord.get_log() if e[0] == "move_dropped"} == {
        ("move_dropped", "g0", 1, "group_failed"), ("move_dropped", "g0", 3, "group_failed")}
    with pytest.raises(GroupFailedError):
        _acquire(coord, "g0", 1)
    assert coord.metrics()["migrations_landed"] == 0
    _check_ledger(coord)


def test_a_landing_for_a_group_no_longer_live_is_dropped():
    """A pending move of a group that left the coordinator without passing through the paths that
    drop it (a bookkeeping slip) must not stop the run (the scheduler refuses a landing with no
    attempt for an unknown group; one with an attempt it counts as stale). The landing is counted
    as a late report and not sent."""
    from dora_ext.core import events as E
    from dora_ext.core.scheduler import ProtocolError

    coord = _one_move()
    coord.trajectory_done("g1", 1, 5, 1.0)
    coord.moving[("g1", 1)] = (0, 0)  # the slip, forced
    coord.trajectory_done("g0", 0, 5, 1.0)
    coord.step_finished(2)  # step 1 (g4, g5) trained
    assert sorted(coord.step_batch(2)) == ["g0", "g1"]
    coord.step_finished(3)
    assert "g1" not in coord.admitted and coord.moving == {}  # training drops it too
    coord.moving[("g1", 1)] = (0, 0)  # forced again, after training
    coord.route[("g1", 1)] = 0
    assert _acquire(coord, "g1", 1) == "s0"
    assert coord.metrics()["late_reports"] == 1 and coord.metrics()["migrations_landed"] == 0
    causes = [e[3] for e in coord.get_log() if e[0] == "move_dropped"]
    assert causes == ["done", "trained", "late"], causes
    assert ("late", "migration_landed", "g1", 1) in coord.get_log()
    # What the guard protects against: the scheduler refuses a landing for a group it does not
    # hold when the landing has no attempt; with one it counts it as a stale event (as every
    # trajectory event with an attempt), but the coordinator drops it before then.
    from dora_ext.core import Scheduler

    with pytest.raises(ProtocolError):  # (on a copy: the error halts a scheduler)
        Scheduler.restore(coord.sched.snapshot()).handle(E.MigrationLanded("g1", 1))
    stale = coord.sched.metrics()["stale_events"]
    coord.sched.handle(E.MigrationLanded("g1", 1, 0))
    assert coord.sched.metrics()["stale_events"] == stale + 1


def test_pending_moves_stay_bounded_over_many_steps():
    """Every move is answered or dropped: over a run of many steps with moves that land, moves that
    end with the generation and moves whose trajectory fails, nothing is left pending once the
    work is done, and never more than there are running trajectories."""
    import random

    rng = random.Random(5)
    cfg = {"mode": "dora", "max_staleness": 2, "batch_size": 2, "group_size": 3, "instances": 3, "capacity": 4,
           "max_retries": 100}
    coord = DoraCoordinator(cfg, {f"s{i}": None for i in range(3)}, use_plugins=False)
    asyncio.run(coord.start())
    counter = iter(range(100_000))
    coord.offer([f"g{next(counter)}" for _ in range(6)])
    step = 0
    peak = 0
    for _ in range(3000):
        for iid, v in coord.take_work()["load"]:
            coord.loaded([iid], v)
        gids = coord.step_batch(step)
        if gids is not None:
            step += 1
            coord.offer([f"g{next(counter)}" for _ in range(2)])
            coord.step_finished(step)
            continue
        running = [k for iid in coord.sched.instances for k in coord.sched.running_on(iid)]
        peak = max(peak, len(coord.moving))
        assert len(coord.moving) <= len(running)
        if not running:
            continue
        key = rng.choice(running)
        r = rng.random()
        if r < 0.4 and key in coord.moving:
            _acquire(coord, *key)
        elif r < 0.5:
            coord.trajectory_failed(*key, "injected")
        else:
            coord.trajectory_done(*key, 3, None)
            coord.reward_ready(*key, rng.random())
    m = coord.metrics()
    assert step >= 50 and m["migrations"] >= 20, (step, m)
    assert m["migrations_landed"] >= 5, m
    assert peak >= 1
    live = {k for iid in coord.sched.instances for k in coord.sched.running_on(iid)}
    assert set(coord.moving) <= live, (coord.moving, live)
    assert m["moves_not_landed"] == len(coord.moving)
    _check_ledger(coord)


@pytest.mark.parametrize("event", ["removed", "group_failed"])
def test_a_waiting_acquire_rechecks_its_dispatch_when_it_resumes(event):
    """An acquire waits for its trajectory's Dispatch; the Dispatch resolves it, and before the
    waiting task runs again the Dispatch is voided (`removed`: verl removes that server; the
    scheduler re-queues the trajectory, no slot is free for it) or the group fails (`group_failed`:
    no retries, another trajectory of it failed).

    `removed`: the request must wait for the next Dispatch. Sent to the removed server it failed on
    the server's missing in-flight count, and the worker's failure report for a trajectory the
    scheduler holds queued was a ProtocolError: the trajectory was lost (its group never completes).
    `group_failed`: the request must get the group's failure, not run for a group already given up."""
    cfg = dict(ONE, max_retries=0) if event == "group_failed" else ONE
    coord = started(cfg)

    async def run():
        task = await waiting_then_offered(coord)  # no await from here until the task resumes
        assert coord.route[("g1", 1)] == 1 and ("g1", 1) not in coord.waiters  # resolved
        if event == "group_failed":
            assert coord.trajectory_failed("g1", 0, "replica error") == "failed"
            with pytest.raises(GroupFailedError):
                await task
            return None
        coord.remove_servers(["s1"])
        assert coord.sched.trajectory("g1", 1).status == "Q"  # instance 0 is full
        await asyncio.sleep(0)
        assert not task.done() and ("g1", 1) in coord.waiters  # waits again
        coord.add_servers({"s2": None})  # instance 2
        assert coord.take_work()["load"] == [(2, 0)]
        coord.loaded([2], 0)
        assert coord.route[("g1", 1)] == 2
        return await task

    out = asyncio.run(run())
    if event == "removed":
        assert out[0] == "s2"
        t = coord.sched.trajectory("g1", 1)
        assert t.status == "R" and t.instance == 2
        assert coord.trajectory_done("g1", 1, 5, 1.0) is None  # its report is the running attempt's
    assert coord.metrics()["stale_events"] == 0 and coord.metrics()["late_reports"] == 0


def test_a_landing_the_scheduler_would_not_take_is_not_counted_landed():
    """``migrations_landed`` counts what the scheduler took. A pending move whose record no longer
    matches the scheduler's state (a bookkeeping slip, forced here: another attempt) is dropped
    (cause ``stale``) instead of being fed and counted: fed, the scheduler only counted it stale
    and kept the trajectory marked moved (it never moves again in this attempt)."""
    coord = _one_move()
    attempt = coord.sched.trajectory("g1", 1).attempt
    coord.moving[("g1", 1)] = (0, attempt + 1)  # the slip
    assert _acquire(coord, "g1", 1) == "s0"
    m = coord.metrics()
    assert m["migrations_landed"] == 0 and m["stale_events"] == 0, m
    assert ("move_dropped", "g1", 1, "stale") in coord.get_log() and coord.moving == {}
    assert coord.sched.trajectory("g1", 1).moved  # what the scheduler says: it never landed
    _check_ledger(coord)


def test_a_failed_groups_running_trajectories_free_their_slots_when_they_end():
    """With no retries, g0/0's failure fails g0 while its four other trajectories run. The scheduler
    keeps them, holding their slots, until their end is reported (verl's worker reports it: the
    generation ends, then the reward or a failure, e.g. the group's failure raised by its next
    acquire). The coordinator dropped those reports for a failed group: the slots leaked for the
    rest of the run (the instances never drained, so never loaded a newer version), the group
    never left the scheduler, and R5 moved the ghosts: moves that could never land (seen in
    ``main_ppo``'s K=2 CPU test: a move of a failed group's trajectory pending for good)."""
    coord = DoraCoordinator(dict(TWO, max_retries=0), {"s0": None, "s1": None}, use_plugins=False)
    asyncio.run(coord.start())
    coord.offer([f"g{i}" for i in range(4)])
    ghosts = {k for iid in (0, 1) for k in coord.sched.running_on(iid) if k[0] == "g0"}
    assert len(ghosts) == 5
    assert coord.trajectory_failed("g0", 0, "replica error") == "failed" and "g0" in coord.failed
    assert ("g0", 1) not in coord.route
    with pytest.raises(GroupFailedError):  # g0/4's next acquire (a resume or its next turn)
        _acquire(coord, "g0", 4)
    assert coord.trajectory_failed("g0", 4, "GroupFailedError") == "failed"
    coord.trajectory_done("g0", 1, 5, None)  # its generation ended; then its reward
    coord.reward_ready("g0", 1, 1.0)
    coord.trajectory_done("g0", 2, 5, None)  # ... then the reward computation failed
    assert coord.trajectory_failed("g0", 2, "reward error") == "failed"
    coord.trajectory_done("g0", 3, 5, 0.5)  # with its reward
    assert not any(k[0] == "g0" for iid in (0, 1) for k in coord.sched.running_on(iid))
    from dora_ext.core.scheduler import ProtocolError

    with pytest.raises(ProtocolError):  # the group left the scheduler
        coord.sched.trajectory("g0", 1)
    # A report after that is dropped quietly, as before: no ProtocolError, no late report.
    coord.reward_ready("g0", 3, 0.5)
    assert coord.trajectory_failed("g0", 3, "again") == "failed"
    m = coord.metrics()
    assert m["late_reports"] == 0 and m["stale_events"] == 0 and m["failed_groups"] == 1, m
    _check_ledger(coord)


@pytest.mark.parametrize("order", ["abort_first", "finished_first"])
def test_a_failed_groups_sibling_aborted_or_already_finished_and_one_mid_move(order, monkeypatch):
    """g0/0 fails g0 (no retries) while one is mid-move (R5 aborted it on its source, not yet
    released) and another runs. Its abort lands first (it comes back aborted, its resume's acquire
    gets the group's failure) or its request had already finished (the abort finds nothing; its
    generation ends). Either way each sibling ends once in the scheduler, the group is failed and
    never trained, the move never lands, and nothing stays in flight. A retry aborts nothing, nor does the failure
    abort again the one mid-move, whose abort was confirmed (it was aborted twice)."""
    import dora_ext.verl.weights as weights

    calls, who = [], {}

    monkeypatch.setattr(weights, "abort_request", lambda *a: calls.append(a[3]) or asyncio.sleep(
        0, {"aborted": not (order == "finished_first" and a[3] == f"g0r{who['run']}")}))

    async def settle():
        for _ in range(3):
            await asyncio.sleep(0)

    async def run():
        coord = DoraCoordinator(dict(TWO, max_retries=1), {"s0": None, "s1": None}, use_plugins=False)
        await coord.start()
        coord.set_loaders({}, rollout="dora_cpu", abort_requests=True)
        coord.offer([f"g{i}" for i in range(4)])
        sids = {i: (await coord.acquire_server(f"g0r{i}", dora_group="g0", dora_index=i))[0] for i in range(5)}
        other = (await coord.acquire_server("g1r0", dora_group="g1", dora_index=0))[0]  # another group's
        for g in ("g1", "g2"):
            for i in range(5):
                coord.trajectory_done(g, i, 5, 1.0)
        coord.release_server(sids[0], request_id="g0r0")
        assert coord.trajectory_failed("g0", 0, "first") == "retry"  # attempt 1: nothing aborted
        await settle()
        assert calls == [] and "g0" not in coord.failed
        sids[0] = (await coord.acquire_server("g0r0", dora_group="g0", dora_index=0))[0]
        coord.step_finished(1)
        moved = {k[1] for k in coord.moving}
        (mid, back), (run, done) = sorted(moved), sorted({1, 2, 3, 4} - moved)
        who.update(run=run)
        await settle()
        assert sorted(calls) == [f"g0r{mid}", f"g0r{back}"]  # R5's aborts on the sources
        for i in (back, done):  # they came back (`back`'s abort; `done` finished) before the failure
            coord.release_server(sids[i], request_id=f"g0r{i}")
        coord.trajectory_done("g0", done, 5, None)
        coord.release_server(sids[0], request_id="g0r0")
        assert coord.trajectory_failed("g0", 0, "second") == "failed" and coord.moving == {}
        await settle()
        # + `run`, in flight (its abort, finding nothing, is sent again until its release)
        sent = lambda: [c for j, c in enumerate(calls) if c != f"g0r{run}" or c not in calls[:j]]  # noqa: E731
        assert sorted(sent()) == sorted([f"g0r{mid}", f"g0r{run}", f"g0r{back}"])
        assert coord.trajectory_failed("g0", 0, "again") == "failed"  # a second report aborts nothing
        await settle()
        assert len(sent()) == 3
        for i in (mid, run, back):  # each came back; an aborted one resumes, its acquire fails
            if i != back:
                coord.release_server(sids[i], request_id=f"g0r{i}")
            if i == run and order == "finished_first":
                coord.trajectory_done("g0", run, 5, None)
                coord.reward_ready("g0", run, 1.0)
                continue
            with pytest.raises(GroupFailedError):
                await coord.acquire_server(f"g0r{i}", dora_group="g0", dora_index=i)
            assert coord.trajectory_failed("g0", i, "GroupFailedError") == "failed"
        coord.reward_ready("g0", done, 1.0)
        coord.release_server(other, request_id="g1r0")  # left alone, it came back
        return coord, mid

    coord, mid = asyncio.run(run())
    from dora_ext.core.scheduler import ProtocolError

    with pytest.raises(ProtocolError):  # every sibling ended: the group left the scheduler
        coord.sched.trajectory("g0", mid)
    m = coord.metrics()
    assert m["failed_groups"] == 1 and m["migrations_landed"] == 0 and m["late_reports"] == 0, m
    assert "g0" not in {g for gs in coord.steps.values() for g in gs}  # never trained
    assert coord.request_of == {} and set(coord.inflight.values()) == {0}, (coord.request_of, coord.inflight)
    _check_ledger(coord)


def test_a_request_whose_move_abort_is_in_flight_when_its_group_fails_gets_one_abort(monkeypatch):
    """R5 moves two of g0's trajectories; their aborts find nothing yet (the engine has not seen the requests) and are
    sent again. g0 then fails: its other requests are aborted, the two moved ones not again. Once the engine confirms,
    each request has had one abort loop and one report (each moved one had two, running side by side)."""
    import dora_ext.verl.weights as weights

    calls, confirm = [], set()
    monkeypatch.setattr(weights, "abort_request",
                        lambda *a: calls.append(a[3]) or asyncio.sleep(0, {"aborted": a[3] in confirm}))

    async def run():
        coord = DoraCoordinator(dict(TWO, max_retries=0), {"s0": None, "s1": None}, use_plugins=False)
        await coord.start()
        coord.set_loaders({}, rollout="dora_cpu", abort_requests=True)
        coord.offer([f"g{i}" for i in range(4)])
        sids = {i: (await coord.acquire_server(f"g0r{i}", dora_group="g0", dora_index=i))[0] for i in range(5)}
        for g in ("g1", "g2"):
            for i in range(5):
                coord.trajectory_done(g, i, 5, 1.0)
        coord.step_finished(1)
        moved = sorted(k[1] for k in coord.moving)
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(moved) == 2 and set(calls) == {f"g0r{i}" for i in moved}  # sent, finding nothing (sent again)
        first = min(set(range(5)) - set(moved))
        coord.release_server(sids[first], request_id=f"g0r{first}")
        assert coord.trajectory_failed("g0", first, "boom") == "failed"
        confirm.update(f"g0r{i}" for i in range(5))
        loops = lambda: [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.endswith("_abort_request")]  # noqa: E731
        while loops():
            await asyncio.sleep(0.01)
        return coord, first

    coord, first = asyncio.run(asyncio.wait_for(run(), 30))
    reports = sorted(e[2] for e in coord.get_log() if e[0] == "abort_request")
    assert reports == [f"g0r{i}" for i in range(5) if i != first], reports


def test_an_abort_finding_nothing_ends_once_its_server_is_removed(monkeypatch):
    """An abort re-sent (the engine holds no such id) for a request never released (its worker died)
    ends once its server leaves the load balancer: no abort call on it forever."""
    import dora_ext.verl.weights as weights

    calls = []
    monkeypatch.setattr(weights, "abort_request", lambda *a: calls.append(a[3]) or asyncio.sleep(0, {"aborted": False}))

    async def run():
        coord = DoraCoordinator(dict(TWO, max_retries=0), {"s0": None, "s1": None}, use_plugins=False)
        await coord.start()
        coord.set_loaders({}, rollout="dora_cpu", abort_requests=True)
        coord.offer(["g0"])
        sids = [(await coord.acquire_server(f"r{i}", dora_group="g0", dora_index=i))[0] for i in range(2)]
        coord.release_server(sids[0], request_id="r0")
        coord.trajectory_failed("g0", 0, "boom")  # g0/1's request is aborted (and never released)
        while len(calls) < 3 or sids[1] in coord.instance_of:  # sent again and again, then removed
            await asyncio.sleep(0) if len(calls) < 3 else coord.remove_servers([sids[1]])
        while not [e for e in coord.get_log() if e[0] == "abort_request"]:  # (without the fix: forever)
            await asyncio.sleep(0.01)
        n = len(calls)
        await asyncio.sleep(0.05)
        return coord, n

    coord, n = asyncio.run(asyncio.wait_for(run(), 30))
    assert set(calls) == {"r1"} and n == len(calls), (calls, n)
    assert [e[2:] for e in coord.get_log() if e[0] == "abort_request"] == [("r1", False)]

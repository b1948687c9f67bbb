"""A weight load never overtakes a request already routed to its instance (C1).

``acquire_server`` routes a trajectory's request to server X (X's in-flight count goes up); before
the request has crossed the Ray hop to X, R5 moves the trajectory off X (or its end is reported
before the release arrives), X counts as drained and the scheduler decides ``LoadVersion(X,
newer)``. Handed out at once, the load could run before the request reaches X: the request then
runs under the newer version (queued behind the load), and a resumed trajectory spans two
versions. The coordinator holds such
a load until X's in-flight count is back to 0 (verl's client releases in a ``finally``), and hands
it out from that release.

No stand-in for the coordinator (the plain class ``create_coordinator`` wraps as a Ray actor) or
its scheduler; no server is called here (``acquire_server`` returns the server's handle, ``None``).
The loaders are stand-ins for the rollout workers' actor handles: their
``update_weights.remote`` records the call (the real one fetches the version from the weight
store, ``tests/verl/test_cpu_weights.py``). Each order is forced by the order of the calls.
"""

from __future__ import annotations

import asyncio

import pytest

from dora_ext.verl.coordinator import DoraCoordinator

from .coordinator_helpers import (ONE, Handle, RayLikeHandle, Server, all_but_the_last_two_done, before_the_move,
                                  client_of, started)


def _before_the_move() -> DoraCoordinator:
    """Two instances of 4 slots, K=2, B=2, n=2: g1/1 runs on instance 1, alone there, and
    publishing version 1 moves it onto instance 0 (R5); instance 1, drained, loads version 1."""
    coord = before_the_move()
    assert coord.route[("g1", 1)] == 1
    assert coord.sched.running_on(1) == [("g1", 1)]
    return coord


def _acquire(coord: DoraCoordinator, request_id: str, group=None, index=None, validate=False) -> str:
    async def ask():
        return (await coord.acquire_server(request_id, dora_group=group, dora_index=index,
                                           dora_validate=validate))[0]

    return asyncio.run(ask())


def _watch_hand_outs(coord: DoraCoordinator) -> list[tuple[int, int, int]]:
    """Record (instance, version, requests in flight on it) at every load the coordinator hands
    out (to ``take_work`` or its loaders)."""
    seen: list[tuple[int, int, int]] = []
    hand_out = coord._hand_out

    def watched(iid, version):
        seen.append((iid, version, coord.get_inflight_count(coord.server_of[iid])))
        hand_out(iid, version)

    coord._hand_out = watched
    return seen


@pytest.mark.parametrize("order", ["load_decided_first", "released_first"])
def test_a_load_waits_for_the_requests_routed_to_its_instance(order):
    """(1) `load_decided_first`: the move and the load are decided while g1/1's request, routed to
    instance 1, is still in flight: the load is not handed out (``take_work`` gives the abort of
    the move, not the load) until that request is released, and goes out at the release.
    (2) `released_first`: the request came back before the decision: the load goes out at once."""
    coord = _before_the_move()
    hand_outs = _watch_hand_outs(coord)
    assert _acquire(coord, "r", "g1", 1) == "s1"
    assert coord.get_inflight_count("s1") == 1
    if order == "released_first":
        coord.release_server("s1", "r")
    coord.step_finished(1)  # R5 moves g1/1 onto instance 0; instance 1 is drained: LoadVersion(1, 1)
    assert coord.route[("g1", 1)] == 0
    m = coord.metrics()
    if order == "released_first":
        assert coord.take_work() == {"load": [(1, 1)], "abort": [1]}
        assert m["loads_held"] == 0 and m["loads_held_now"] == 0
    else:
        assert coord.take_work() == {"load": [], "abort": [1]}  # the abort goes out, the load waits
        assert m["loads_held"] == 1 and m["loads_held_now"] == 1
        assert ("load_held", 1, 1, 1) in coord.get_log()
        assert coord.take_work() == {"load": [], "abort": []}  # still held at the trainer's next poll
        assert hand_outs == []
        coord.release_server("s1", "r")  # the request came back (aborted, or finished)
        assert coord.take_work() == {"load": [(1, 1)], "abort": []}
        m = coord.metrics()
        assert m["loads_released"] == 1 and m["loads_held_now"] == 0
    coord.loaded([1], 1)
    assert coord.versions[1] == 1 and coord.loading == {}
    assert hand_outs == [(1, 1, 0)]  # handed out once, with nothing in flight on instance 1


def test_the_load_waits_for_the_last_of_several_requests():
    """A validation request (ungrouped) routed to instance 1 before the decision counts too: the
    load goes out only at the second release, whichever comes first."""
    coord = _before_the_move()
    assert _acquire(coord, "r", "g1", 1) == "s1"
    coord.inflight["s0"] = 5  # instance 0 busier: the validation request goes to instance 1
    assert _acquire(coord, "val", validate=True) == "s1"
    coord.inflight["s0"] = 0
    coord.step_finished(1)
    assert coord.take_work()["load"] == []
    coord.release_server("s1", "val")
    assert coord.take_work()["load"] == [] and coord.metrics()["loads_held_now"] == 1
    coord.release_server("s1", "r")
    assert coord.take_work()["load"] == [(1, 1)]


def test_ungrouped_requests_avoid_an_instance_whose_load_is_pending():
    """While instance 1's load is held or running, validation goes to instance 0 (there it would
    keep the held load waiting, or meet the load), even when its sticky session was on 1 and
    instance 1 is less loaded. When every loaded instance has a load pending it does not wait (the
    trainer may be waiting for it, not executing loads): it goes to one of them, counted."""
    coord = _before_the_move()
    assert _acquire(coord, "r", "g1", 1) == "s1"
    coord.step_finished(1)
    assert coord.metrics()["loads_held_now"] == 1
    coord.sticky["val"] = "s1"
    coord.inflight["s0"] = 3  # least-loaded would be instance 1
    assert _acquire(coord, "val", validate=True) == "s0"
    coord.inflight["s0"] = 0
    coord.release_server("s1", "r")
    assert coord.take_work()["load"] == [(1, 1)]
    assert _acquire(coord, "val2", validate=True) == "s0"  # the load is handed out, not done
    coord.release_server("s0", "val2")
    assert coord.metrics()["ungrouped_on_pending_load"] == 0
    coord.loading[0] = 1  # instance 0 has a load pending too (forced)
    assert _acquire(coord, "val3", validate=True) in ("s0", "s1")
    assert coord.metrics()["ungrouped_on_pending_load"] == 1
    coord.loaded([1], 1)  # instance 1 holds version 1 now, no load pending: the newest, and free
    assert _acquire(coord, "val4", validate=True) == "s1"
    assert coord.metrics()["ungrouped_on_pending_load"] == 1


def test_a_held_load_of_a_removed_server_is_dropped():
    coord = _before_the_move()
    assert _acquire(coord, "r", "g1", 1) == "s1"
    coord.step_finished(1)
    coord.remove_servers(["s1"])
    assert coord.held == {} and ("load_dropped", 1, 1) in coord.get_log()
    m = coord.metrics()
    assert m["loads_held"] == 1 and m["held_loads_dropped"] == 1 and m["loads_released"] == 0
    assert m["loads_held_now"] == 0
    coord.release_server("s1", "r")  # the late release of the removed server changes nothing
    assert coord.take_work()["load"] == []


class _Worker:
    """Stands in for a ``dora_cpu`` rollout worker's actor handle: ``update_weights.remote``
    records the version asked for (the real worker loads it from the weight store)."""

    def __init__(self, calls: list):
        self.calls = calls
        self.update_weights = self

    def remote(self, global_steps):
        self.calls.append(global_steps)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


@pytest.mark.parametrize("order", ["load_decided_first", "released_first"])
def test_dora_cpu_loaders_run_a_held_load_at_the_release(order):
    """With a publishing backend the coordinator runs loads itself (``_load`` on the instance's
    workers): a held load runs from the release, with no trainer call in between."""
    calls: list[int] = []

    async def run():
        coord = DoraCoordinator(ONE, {"s0": None, "s1": None}, use_plugins=False)
        coord.set_loaders({0: [_Worker([])], 1: [_Worker(calls)]})
        await coord.start()
        coord.offer([f"g{i}" for i in range(10)])
        all_but_the_last_two_done(coord)
        sid, _ = await coord.acquire_server("r", dora_group="g1", dora_index=1)
        assert sid == "s1"
        if order == "released_first":
            coord.release_server("s1", "r")
        coord.step_finished(1)
        for _ in range(5):
            await asyncio.sleep(0)  # let a load handed out run
        if order == "load_decided_first":
            assert calls == [] and coord.versions[1] == 0  # held: not run
            coord.release_server("s1", "r")
            for _ in range(5):
                await asyncio.sleep(0)
        assert calls == [1] and coord.versions[1] == 1
        assert coord.take_work()["load"] == []  # never through the trainer
        return coord.metrics()

    m = asyncio.run(run())
    assert m["loads_held"] == (1 if order == "load_decided_first" else 0)
    assert m["loads_released"] == m["loads_held"] and m["loads_held_now"] == 0


class _Remote:
    """``.remote(*args)`` answering `value` (an actor method's stand-in), recording the calls."""

    def __init__(self, value):
        self.value, self.calls = value, []

    def remote(self, *args, **kwargs):
        self.calls.append(args)

        async def out():
            return self.value

        return out()


def _checked_coordinator(published, engine_checksum):
    """A coordinator over two replicas whose loads are checked: the store published `published`
    over ``model.norm.weight``; both engines answer `engine_checksum`."""
    coord = DoraCoordinator(ONE, {"s0": None, "s1": None}, use_plugins=False)
    store = type("Store", (), {"evidence": _Remote((published, ["model.norm.weight"]))})()
    server = type("Server", (), {"weights_checksum": _Remote(engine_checksum)})()
    checks = {i: {"server": server, "address": f"s{i}", "store": store} for i in (0, 1)}
    coord.set_loaders({0: [_Worker([])], 1: [_Worker([])]}, checks, "dora_cpu")
    return coord, store, server


@pytest.mark.parametrize("engine_checksum", ["c1", "other"])
def test_a_load_whose_engine_checksum_differs_from_the_publication_is_refused(engine_checksum):
    """After each load the coordinator asks the engine (here the ``dora_cpu`` server's
    ``weights_checksum``) for the checksum of what it holds, over the tensors the store's
    publication covers: equal, the instance is loaded; different, it is not, and the trainer's
    next ``take_work`` carries the message naming what to change."""
    async def run():
        coord, store, server = _checked_coordinator("c1", engine_checksum)
        await coord.start()
        coord.offer([f"g{i}" for i in range(10)])
        all_but_the_last_two_done(coord)
        coord.step_finished(1)
        for _ in range(10):
            await asyncio.sleep(0)
        assert store.evidence.calls == [(1,)] and server.weights_checksum.calls == [(["model.norm.weight"], None)]
        return coord.versions[1], coord.take_work(), coord.metrics()

    version, work, m = asyncio.run(run())
    if engine_checksum == "c1":
        assert version == 1 and "error" not in work and m["load_errors"] == 0
    else:
        assert version == 0 and m["load_errors"] == 1
        assert "checksum other after loading version 1, published with c1" in work["error"]
        assert "checkpoint_engine.backend=dora_store" in work["error"]


@pytest.mark.parametrize("engine_checksum", ["c0", "other"])
def test_the_first_sync_is_checked_on_every_engine(engine_checksum):
    """verl's ``on_init_end`` loads every replica itself (not through the coordinator's loads):
    ``check_loaded`` compares each engine's checksum with the publication of that version too."""
    from dora_ext.verl.weights import WeightsMismatch

    async def run():
        coord, store, server = _checked_coordinator("c0", engine_checksum)
        await coord.check_loaded(0)
        return store.evidence.calls

    if engine_checksum == "c0":
        assert asyncio.run(run()) == [(0,), (0,)]
    else:
        with pytest.raises(WeightsMismatch, match="checksum other after loading version 0, published with c0"):
            asyncio.run(run())


def _readded() -> DoraCoordinator:
    """Instance 1 (address s1) runs g0/1 when verl removes s1 and adds it again: instance 2, which
    loads version 0 and takes the trajectories instance 1 had (re-dispatched by the scheduler)."""
    coord = started(ONE)
    coord.offer([f"g{i}" for i in range(10)])
    assert coord.route[("g0", 1)] == 1
    assert _acquire(coord, "old", "g0", 1) == "s1"  # in flight on instance 1
    coord.remove_servers(["s1"])
    coord.add_servers({"s1": None})
    assert coord.instance_of["s1"] == 2
    assert coord.take_work()["load"] == [(2, 0)]
    coord.loaded([2], 0)
    assert coord.route[("g0", 1)] == 2
    return coord


@pytest.mark.parametrize("order", ["late_release_after_new_acquire", "late_release_before_new_acquire"])
def test_a_late_release_of_a_removed_instance_ends_no_request_of_the_new_one(order):
    """verl's client releases in a ``finally``, fire-and-forget: the release of a request acquired on
    instance 1 can reach the coordinator after s1 serves again as instance 2 and a request was
    routed there. Counted by address, that release ended the new request: instance 2 counted 0 in
    flight, and a load decided for it then went out at once, ahead of the request on its way there
    (C1). Each release is now matched to its acquire; the late one uncounts nothing."""
    coord = _readded()
    hand_outs = _watch_hand_outs(coord)
    if order == "late_release_before_new_acquire":
        coord.release_server("s1", "old")
    assert _acquire(coord, "new", "g0", 1) == "s1"  # g0/1 re-dispatched onto instance 2
    if order == "late_release_after_new_acquire":
        coord.release_server("s1", "old")
    assert coord.get_inflight_count("s1") == 1  # the request on instance 2 is still counted
    m = coord.metrics()
    assert m["unmatched_releases"] == 1 and ("unmatched_release", "s1", "old", "instance removed") in coord.get_log()
    coord._issue_load(2, 1)  # a LoadVersion the scheduler decides for instance 2 now (forced)
    assert coord.take_work()["load"] == [] and coord.metrics()["loads_held_now"] == 1
    coord.release_server("s1", "new")
    assert coord.take_work()["load"] == [(2, 1)]
    assert hand_outs == [(2, 1, 0)] and coord.acquired == {}


def test_a_release_no_acquire_made_does_not_free_a_held_load():
    """A release matching no acquire (a request id never acquired on that server) must not bring
    the count to 0 while the request routed there is in flight: the held load stays held."""
    coord = _before_the_move()
    assert _acquire(coord, "r", "g1", 1) == "s1"
    coord.step_finished(1)
    assert coord.metrics()["loads_held_now"] == 1
    coord.release_server("s1", "never-acquired")
    coord.release_server("s0", "r")  # the right request id, the wrong server
    assert coord.get_inflight_count("s1") == 1 and coord.take_work()["load"] == []
    assert coord.metrics()["unmatched_releases"] == 2
    coord.release_server("s1", "r")
    coord.release_server("s1", "r")  # released twice: the second matches nothing
    assert coord.take_work()["load"] == [(1, 1)] and coord.metrics()["unmatched_releases"] == 3


def test_a_validation_session_does_not_stick_to_a_readded_address_with_nothing_loaded():
    """Every loaded instance has a load pending, so validation may go to one of them; its sticky
    session was on s1, which now serves instance 2 with nothing loaded: not there."""
    coord = started(ONE)
    assert _acquire(coord, "val", validate=True) in ("s0", "s1")
    coord.sticky["val"] = "s1"
    coord.release_server("s1", "val")
    coord.remove_servers(["s1"])
    coord.add_servers({"s1": None})  # instance 2: its load of version 0 is not done
    coord.loading[0] = 1  # instance 0 has a load pending too (forced)
    assert _acquire(coord, "val", validate=True) == "s0"
    assert coord.metrics()["ungrouped_on_pending_load"] == 1


def test_verls_client_sends_the_request_id_its_release_is_matched_by():
    """verl 0.9.1's ``LLMServerClient.generate`` releases with the fields the balancer names in
    ``require_release_fields``; ``DoraLLMServerClient`` names them without the round trip. Real:
    verl's client code and ours; stand-ins: the actor handles (in-process) and a server answering
    at once."""
    pytest.importorskip("verl")
    from dora_ext.verl.manager import Route, current_route

    coord = _before_the_move()

    async def run():
        coord.handles = {"s0": Handle(Server()), "s1": Handle(Server())}
        client = client_of(coord)
        assert client._lb_require_release_fields == coord.require_release_fields()
        token = current_route.set(Route("g1", 1))
        try:
            await client.generate(request_id="r", prompt_ids=[1, 2], sampling_params={"max_tokens": 3})
        finally:
            current_route.reset(token)
        await asyncio.sleep(0)

    asyncio.run(run())
    assert coord.get_inflight_count("s1") == 0 and coord.acquired == {}
    assert coord.metrics()["unmatched_releases"] == 0


@pytest.mark.parametrize("point", ["waiting_for_dispatch", "answer_on_its_way", "in_flight"])
def test_a_caller_cancelled_after_acquiring_releases_and_the_held_load_goes_out(point):
    """The caller of verl's ``generate`` (``DoraLLMServerClient`` on verl's real client code) is
    cancelled between its acquire and the end of its request, at three points:

    * `waiting_for_dispatch`: the coordinator's acquire waits for g1/1's Dispatch (before the
      offer); it goes on after the caller is gone and counts the request on s1;
    * `answer_on_its_way`: the coordinator answered (s1 counts the request) and the answer has not
      reached the caller: nothing was sent to the server;
    * `in_flight`: the request runs on s1 (verl's own ``finally`` releases it).

    Then R5 moves g1/1 off instance 1, whose load of version 1 is held while s1 counts the request.
    Before the fix the first two never released: s1 counted the request for good and the load
    stayed held. Now the acquire is released once its answer comes back, and the held load goes
    out from that release (``loads_released``). Stand-ins (``RayLikeHandle``): the actor handles,
    with Ray's rule that cancelling the wait on an answer does not cancel the actor's task; the
    scripted servers. Each order is forced by holding the acquire's answer until the test lets it
    go and by waiting on the server's arrival; no sleeps."""
    pytest.importorskip("verl")
    from dora_ext.verl.manager import Route, current_route

    coord = started(ONE) if point == "waiting_for_dispatch" else before_the_move()

    async def run():
        servers = {"s0": Server(), "s1": Server()}
        servers["s1"].hold = True  # a request on s1 runs until the test aborts it
        coord.handles = {sid: RayLikeHandle(server) for sid, server in servers.items()}
        lb = RayLikeHandle(coord)
        client = client_of(coord, lb)
        if point != "in_flight":
            lb.hold("acquire_server")  # its answer waits on its way back until deliver()
        token = current_route.set(Route("g1", 1))
        try:
            caller = asyncio.ensure_future(
                client.generate(request_id="r", prompt_ids=[1, 2], sampling_params={"max_tokens": 3}))
        finally:
            current_route.reset(token)
        if point == "waiting_for_dispatch":
            for _ in range(20):  # let the acquire reach its wait for the Dispatch
                if ("g1", 1) in coord.waiters:
                    break
                await asyncio.sleep(0)
            assert ("g1", 1) in coord.waiters and coord.get_total_inflight() == 0
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
            coord.offer([f"g{i}" for i in range(10)])  # dispatches g1/1 onto instance 1
            all_but_the_last_two_done(coord)
            await lb.finished("acquire_server", 1)  # the acquire went on without its caller
        elif point == "answer_on_its_way":
            await lb.finished("acquire_server", 1)
        else:
            await servers["s1"].next_arrival()
        assert coord.get_inflight_count("s1") == 1 and coord.route[("g1", 1)] == 1
        coord.step_finished(1)  # R5 moves g1/1 onto instance 0; instance 1's load of version 1 is held
        assert coord.metrics()["loads_held_now"] == 1 and coord.take_work() == {"load": [], "abort": [1]}
        if point != "waiting_for_dispatch":
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
        if point != "in_flight":
            assert coord.get_inflight_count("s1") == 1  # released only once the answer is back
            lb.deliver("acquire_server")
        try:  # (a bound on a failure, not a wait for timing: the release follows within a few loop turns)
            await asyncio.wait_for(lb.finished("release_server", 1), 10)
        except asyncio.TimeoutError:
            pytest.fail(f"the cancelled request was never released: s1 counts {coord.get_inflight_count('s1')}, "
                        f"loads held now {coord.metrics()['loads_held_now']}")
        assert coord.get_inflight_count("s1") == 0 and coord.acquired == {}
        assert coord.take_work() == {"load": [(1, 1)], "abort": []}  # the held load went out at the release
        # Only the in-flight request reached the server (the client never got the others' answer).
        assert servers["s1"].prompts == ([2] if point == "in_flight" else [])
        servers["s1"].aborted.set()  # the cancelled request's server task ends (its answer is dropped)
        return coord.metrics()

    m = asyncio.run(run())
    assert m["loads_held"] == 1 and m["loads_released"] == 1 and m["loads_held_now"] == 0
    assert m["unmatched_releases"] == 0
    coord.loaded([1], 1)
    assert coord.versions[1] == 1

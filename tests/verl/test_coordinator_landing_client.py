"""Landings with verl's real resuming client, in forced orders.

What is real: verl 0.9.1's ``FullyAsyncLLMServerClient.generate`` (its abort/resume loop: merge the
tokens, lower the budget, re-acquire), our ``DoraLLMServerClient`` on top of it, the coordinator
(the plain class ``create_coordinator`` wraps as a Ray actor) and its scheduler. What stands in,
in-process instead of over Ray: the actor handles (``.remote`` calls the method and returns an
awaitable) and a scripted rollout server that speaks verl's server interface (``generate``
returning a ``TokenOutput``; a request can be held until the test aborts it, as the trainer's
``abort_replicas`` does). verl's one-second pause between resumes is made a yield. No order here
depends on timing: each step waits for an event the previous one set.

The property checked at every landing: no server is running a request of the trajectory (the
landing is the first acquire on the destination, which verl's client makes only after its
previous request came back), so the scheduler never moves a trajectory again while its source
still runs it.
"""

from __future__ import annotations

import asyncio
import types

import pytest

pytest.importorskip("verl")

from .coordinator_helpers import Handle, Method, Server, before_the_move, client_of  # noqa: E402


def _before_the_move():
    """The state of ``test_coordinator_landing._one_move`` just before version 1 is published:
    g1/1 runs on instance 1, and the publish moves it onto instance 0 (R5)."""
    coord = before_the_move()
    assert coord.route[("g1", 1)] == 1
    return coord


@pytest.fixture(autouse=True)
def _resume_at_once(monkeypatch):
    """verl's one-second pause between resumes is made a yield."""
    from verl.workers.rollout import llm_server

    real_sleep = asyncio.sleep
    monkeypatch.setattr(llm_server, "asyncio", types.SimpleNamespace(sleep=lambda s: real_sleep(0),
                                                                     gather=asyncio.gather))


async def _turn(client, max_tokens=10):
    """One turn of g1/1 through `client`, its route set as verl's agent-loop worker sets it."""
    from dora_ext.verl.manager import Route, current_route

    token = current_route.set(Route("g1", 1))
    try:
        return await client.generate(request_id="r", prompt_ids=[1, 2], sampling_params={"max_tokens": max_tokens})
    finally:
        current_route.reset(token)


async def until(cond):
    """Yield to the loop until `cond()` holds (the stand-ins answer within a few turns)."""
    while not cond():
        await asyncio.sleep(0)


@pytest.mark.parametrize("order", ["abort_after_move", "reacquired_before_move", "turn_ended_before_abort"])
def test_the_landing_comes_after_the_source_request_returned(order):
    """`abort_after_move`: the move, then the abort of the source: verl's client re-acquires and
    lands on the destination. `reacquired_before_move`: an abort for another reason came first and
    the client re-acquired on the source before the move: that acquire is no landing, the scheduler
    must not move the trajectory again, and the landing comes after the move's own abort.
    `turn_ended_before_abort`: the turn ended on the source before the move's abort ran (the trainer
    was busy); the next turn's acquire is the landing, and the late abort finds nothing of it."""
    coord = _before_the_move()
    landings = []
    land = coord._land

    def checked_land(key, iid):
        n = coord.counts["migrations_landed"]
        land(key, iid)
        if coord.counts["migrations_landed"] > n:
            landings.append((key, iid, {sid: s.active for sid, s in servers.items()}))

    coord._land = checked_land

    async def run():
        servers.update({"s0": Server(), "s1": Server()})
        coord.handles = {sid: Handle(s) for sid, s in servers.items()}
        client = client_of(coord)

        s0, s1 = servers["s0"], servers["s1"]
        if order == "turn_ended_before_abort":
            out = await _turn(client, 4)  # the first turn ends on the source
            assert out.stop_reason == "length" and s1.prompts == [2]
            coord.step_finished(1)  # R5 moves g1/1 onto instance 0; its abort waits for the trainer
            assert coord.moving == {("g1", 1): (0, 0)} and coord.aborts == [1]
            out = await _turn(client, 4)  # the next turn: the landing
            assert landings and s0.prompts == [2]
            assert coord.take_work()["abort"] == [1]  # the late abort: nothing of g1/1 runs there
            return out
        s1.hold = True
        task = asyncio.ensure_future(_turn(client))
        await s1.next_arrival()
        if order == "reacquired_before_move":
            s1.aborted.set()  # an abort for another reason: the client resumes on the source
            await s1.next_arrival()
            assert s1.prompts == [2, 5] and s1.active == 1
        coord.step_finished(1)  # R5 moves g1/1 onto instance 0
        assert coord.moving == {("g1", 1): (0, 0)} and landings == []
        assert coord.sched.trajectory("g1", 1).moved  # the scheduler will not move it again yet
        assert coord.take_work()["abort"] == [1]
        s1.aborted.set()  # the trainer's abort of the source
        out = await task
        assert s0.prompts == [2 + (6 if order == "reacquired_before_move" else 3)]  # re-prefilled there
        return out

    servers: dict[str, Server] = {}
    out = asyncio.run(run())
    assert len(landings) == 1, landings
    key, iid, active = landings[0]
    assert key == ("g1", 1) and iid == 0
    assert active == {"s0": 0, "s1": 0}, active  # nothing of g1/1 ran anywhere when it landed
    assert not coord.sched.trajectory("g1", 1).moved and coord.moving == {}
    assert coord.metrics()["migrations_landed"] == 1 and coord.metrics()["stale_events"] == 0
    if order != "turn_ended_before_abort":
        assert len(out.token_ids) == 10 and out.stop_reason == "length"  # verl's merge across the resume


class _VersionedServer:
    """A scripted rollout server with weights: each request answers with the version it ran under
    (``extra_fields["global_steps"]``, which verl's client folds into ``min/max_global_steps``).
    As verl's servers do for the trainer: ``abort_all_requests`` ends the running request
    (``aborted`` with its tokens so far) and parks requests arriving after it until
    ``resume_generation``; ``load`` is the trainer's weight sync (abort, swap, resume)."""

    def __init__(self):
        self.version = 0
        self.open = asyncio.Event()
        self.open.set()
        self.stop = asyncio.Event()
        self.hold = False  # the next request runs until it is aborted
        self.arrived = asyncio.Event()
        self.runs: list[tuple[int, int]] = []  # (prompt length, version) per request

    async def generate(self, request_id, prompt_ids, sampling_params, **_):
        from verl.workers.rollout.replica import TokenOutput

        await self.open.wait()
        version = self.version
        self.runs.append((len(prompt_ids), version))
        self.arrived.set()
        if self.hold:
            self.hold = False
            self.stop.clear()
            await self.stop.wait()
            tokens, reason = [5, 5, 5], "aborted"
        else:
            tokens, reason = [6] * int(sampling_params["max_tokens"]), "length"
        return TokenOutput(token_ids=tokens, log_probs=[0.0] * len(tokens), stop_reason=reason, num_preempted=0,
                           extra_fields={"global_steps": version})

    async def abort_all_requests(self):
        self.open.clear()
        self.stop.set()

    async def resume_generation(self):
        self.open.set()

    async def load(self, version):
        await self.abort_all_requests()
        self.version = version
        await self.resume_generation()


class _InTransit(Handle):
    """A server handle whose next ``generate`` call stays on its way (the Ray hop, the server's
    event loop) until the test lets it through."""

    def __init__(self, obj):
        super().__init__(obj)
        self.delay = False
        self.sent = asyncio.Event()
        self.through = asyncio.Event()

    def __getattr__(self, name):
        if name == "generate" and self.delay:
            self.delay = False

            async def delayed(**kwargs):
                self.sent.set()
                await self.through.wait()
                return await self._obj.generate(**kwargs)

            return Method(delayed)
        return super().__getattr__(name)


@pytest.mark.parametrize("order", ["arrives_after_the_load_decision", "arrives_before_the_abort"])
def test_a_resume_in_transit_runs_under_its_version(order):
    """g1/1 runs on instance 1 (version 0); its request is aborted for another reason and verl's
    client resumes it on instance 1 (not moved yet). Then R5 moves g1/1 onto instance 0 and the
    scheduler, seeing instance 1 drained, decides its load of version 1; the trainer (played here:
    ``take_work``, aborts, then loads) executes what it is handed.

    `arrives_after_the_load_decision`: the resume is still on its way to instance 1 when the
    trainer executes its work. The load must not run before it arrives: the resume would run
    under version 1 after 3 tokens of version 0 (C1 broken; it failed so before the fix). It runs
    under version 0 and the load goes out at its release, at the trainer's next poll.
    `arrives_before_the_abort`: the resume runs on instance 1 when the move is decided; the move's
    abort returns it, its release hands the load out, and the client resumes on instance 0."""
    coord = _before_the_move()

    async def run():
        s0, s1 = _VersionedServer(), _VersionedServer()
        servers = {"s0": s0, "s1": s1}
        transit = _InTransit(s1)
        coord.handles = {"s0": Handle(s0), "s1": transit}
        client = client_of(coord)
        executed = []

        async def service():  # DoraTrainer._service: aborts (then resume), then loads
            work = coord.take_work()
            for iid in work["abort"]:
                await servers[f"s{iid}"].abort_all_requests()
                await servers[f"s{iid}"].resume_generation()
            for iid, version in work["load"]:
                await servers[f"s{iid}"].load(version)
                coord.loaded([iid], version)
                executed.append((iid, version))

        s1.hold = True
        task = asyncio.ensure_future(_turn(client))
        await s1.arrived.wait()
        s1.arrived.clear()
        transit.delay = True
        s1.hold = order == "arrives_before_the_abort"
        await s1.abort_all_requests()  # an abort for another reason: the client resumes on instance 1
        await s1.resume_generation()
        await transit.sent.wait()  # the resume was routed to instance 1 and is on its way
        assert coord.get_inflight_count("s1") == 1
        if order == "arrives_before_the_abort":
            transit.through.set()
            await s1.arrived.wait()
        coord.step_finished(1)  # R5 moves g1/1 onto instance 0; instance 1 is drained: load version 1
        assert coord.route[("g1", 1)] == 0
        await service()
        early = list(executed)  # loads run while the resume was on its way (none: held)
        transit.through.set()
        out = await task
        await service()  # the trainer's next poll
        return out, s0.runs, s1.runs, early, executed, s1.version

    out, runs0, runs1, early, executed, version1 = asyncio.run(run())
    # C1: every token of the trajectory from version 0 (without the hold: min 0, max 1).
    assert out.extra_fields["min_global_steps"] == out.extra_fields["max_global_steps"] == 0, (out.extra_fields,
                                                                                            runs0, runs1)
    assert early == [] and executed == [(1, 1)] and version1 == 1  # the held load ran at the next poll
    assert len(out.token_ids) == 10
    if order == "arrives_after_the_load_decision":
        assert runs1 == [(2, 0), (5, 0)] and runs0 == []  # the resume ran on instance 1, version 0
    else:
        assert runs1 == [(2, 0), (5, 0)] and runs0 == [(8, 0)]  # aborted by the move, resumed on 0
    m = coord.metrics()
    assert m["loads_held"] == 1 and m["loads_released"] == 1 and m["loads_held_now"] == 0


@pytest.mark.parametrize("cause", ["move", "group_failed"])
@pytest.mark.parametrize("order", ["abort_then_request", "request_then_abort"])
def test_a_per_request_abort_stops_its_request_in_either_order(order, cause, tmp_path, monkeypatch):
    """The coordinator aborts g1/1's request alone on instance 1 (R5 moves it onto instance 0, or g1
    fails) of the real ``dora_cpu`` server (``ServerCore``: like vLLM it ignores an abort of an id it
    does not hold), a ``hold`` straggler where it stalls beside another request. The abort arrives
    while the request is on its way (on another actor's path) and finds nothing, or after it. Either
    way the request comes back aborted: the moved trajectory runs once, landed on instance 0; the
    failed group's sibling ends, its slot freed; the other request runs on; nothing stays in flight.
    Before the fix the late request stayed stalled on instance 1 (the guard's timeout)."""
    pytest.importorskip("transformers")
    from dora_ext.verl.coordinator import GroupFailedError
    from dora_ext.verl.cpu.rollout import ServerCore
    from dora_ext.verl.cpu.tiny import build_model

    from .coordinator_helpers import ONE, started

    monkeypatch.setenv("DORA_CPU_SLOW_REPLICAS", "1:hold")
    model = type("ModelConfig", (), {"local_path": build_model(str(tmp_path / "model"))})()
    coord = _before_the_move() if cause == "move" else started(dict(ONE, max_retries=0))
    if cause == "group_failed":
        coord.offer([f"g{i}" for i in range(10)])  # g1/0 runs on instance 0, g1/1 on instance 1
    abort = {"move": lambda: coord.step_finished(1),
             "group_failed": lambda: coord.trajectory_failed("g1", 0, "reward error")}[cause]
    answers = []

    async def run():
        s0, s1 = ServerCore(), ServerCore()
        for rank, core in enumerate((s0, s1)):
            core._init_server(model, rank)
            core.eos_ids, core.version = set(), 0
        real_abort = s1.abort_request

        async def spied_abort(request_id, **kwargs):
            answers.append((await real_abort(request_id, **kwargs))["aborted"])
            return {"aborted": answers[-1]}

        async def other():  # a request beside it on the straggler
            task = asyncio.ensure_future(s1.generate("other", [3, 4], {"max_tokens": 100}))
            await until(lambda: s1._running)
            return task

        s1.abort_request, transit = spied_abort, _InTransit(s1)
        coord.handles, coord._loop = {"s0": Handle(s0), "s1": transit}, asyncio.get_running_loop()
        coord.set_loaders({}, rollout="dora_cpu", abort_requests=True)
        first = order == "abort_then_request"
        beside = None if first else await other()
        transit.delay = first
        task = asyncio.ensure_future(_turn(client_of(coord)))
        if first:
            await transit.sent.wait()  # routed to instance 1, still on its way
            abort()
            await until(lambda: answers == [False])  # the abort found nothing there
            beside = await other()
            transit.through.set()
        await until(lambda: len(s1._running) == 2)  # both stalled on the straggler
        if not first:
            abort()
        try:
            out = await asyncio.wait_for(task, 30)  # (a guard: without the fix it never ends)
        except GroupFailedError:  # the aborted request's resume: the group failed
            out = None
            assert coord.trajectory_failed("g1", 1, "GroupFailedError") == "failed"
        return out, await beside, s0.served

    out, beside, served0 = asyncio.run(run())
    assert answers[-1] is True and answers.count(True) == 1, answers
    assert beside.stop_reason == "length" and len(beside.token_ids) == 100  # not aborted
    assert coord.request_of == {} and set(coord.inflight.values()) == {0}, (coord.request_of, coord.inflight)
    m = coord.metrics()
    if cause == "move":  # ran once, on instance 0, after an aborted start on instance 1
        assert out.stop_reason == "length" and len(out.token_ids) == 10 and served0 == 1
        assert m["migrations_landed"] == 1 and coord.moving == {}, m
        coord.trajectory_done("g1", 1, 10, 1.0)
    else:
        assert out is None and served0 == 0 and m["failed_groups"] == 1, m
    assert ("g1", 1) not in coord.sched.running_on(0) + coord.sched.running_on(1)  # its slot is free


class _AbortsById:
    """A rollout server that, like vLLM, accepts several requests under one id and aborts every one
    of them on ``abort_request(id)`` (vLLM >= 0.16 maps an external id to all its internal ids,
    ``AsyncLLM.abort``). Each request is held until it is aborted (it returns 2 tokens, ``aborted``)
    or ``finish`` lets it run out its budget."""

    def __init__(self):
        self.seen: list[str] = []  # the id of each request that arrived
        self.held: dict[str, list[asyncio.Future]] = {}

    async def generate(self, request_id, prompt_ids, sampling_params, **_):
        from verl.workers.rollout.replica import TokenOutput

        self.seen.append(request_id)
        fut = asyncio.get_running_loop().create_future()
        self.held.setdefault(request_id, []).append(fut)
        reason = await fut
        n = 2 if reason == "aborted" else int(sampling_params["max_tokens"])
        return TokenOutput(token_ids=[5] * n, log_probs=[0.0] * n, stop_reason=reason, num_preempted=0,
                           extra_fields={"global_steps": 0})

    async def abort_request(self, request_id, reset_prefix_cache=True):
        running = [f for f in self.held.pop(request_id, []) if not f.done()]
        for f in running:
            f.set_result("aborted")
        return {"aborted": bool(running), "request_id": request_id}

    def finish(self):
        for futs in self.held.values():
            for f in futs:
                if not f.done():
                    f.set_result("length")


def test_requests_verl_names_alike_are_told_apart_and_an_abort_stops_only_its_own():
    """Under ``actor_rollout_ref.rollout.full_determinism`` verl 0.9.1's agent loops name each request
    ``det-<priority>`` and its TransferQueue worker passes no priority: every request is ``det-0``.
    The coordinator keyed requests by (server, id) and aborts by id, so on vLLM the abort of g1/1's
    request (its group failed; an R5 move aborts the same way) also stopped g0/1's beside it on
    the same server, which then resumed. Our client now sends each trajectory's request under its own
    id: the abort stops g1/1's alone and g0/1 runs through once."""
    from dora_ext.verl.coordinator import GroupFailedError
    from dora_ext.verl.manager import Route, current_route

    from .coordinator_helpers import ONE, started

    coord = started(dict(ONE, max_retries=0))
    coord.offer([f"g{i}" for i in range(10)])
    assert coord.route[("g1", 1)] == coord.route[("g0", 1)] == 1  # both on instance 1 (s1)

    async def turn(client, group, index):
        token = current_route.set(Route(group, index))
        try:  # the id verl's single-turn agent loop gives every request under full_determinism
            return await client.generate(request_id="det-0", prompt_ids=[1, 2], sampling_params={"max_tokens": 4})
        finally:
            current_route.reset(token)

    async def run():
        s0, s1 = _AbortsById(), _AbortsById()
        coord.handles, coord._loop = {"s0": Handle(s0), "s1": Handle(s1)}, asyncio.get_running_loop()
        coord.set_loaders({}, rollout="vllm", abort_requests=True)
        client = client_of(coord)
        failed = asyncio.ensure_future(turn(client, "g1", 1))
        beside = asyncio.ensure_future(turn(client, "g0", 1))
        await until(lambda: len(s1.seen) == 2)
        assert len(set(s1.seen)) == 2 and all(i.startswith("det-0") for i in s1.seen), s1.seen
        assert coord.trajectory_failed("g1", 0, "reward error") == "failed"  # aborts g1/1's request
        with pytest.raises(GroupFailedError):  # its resume: the group failed
            await asyncio.wait_for(failed, 30)
        assert coord.trajectory_failed("g1", 1, "GroupFailedError") == "failed"
        await asyncio.sleep(0)
        assert not beside.done()  # still running: not aborted with it
        s1.finish()
        return await asyncio.wait_for(beside, 30), s1.seen

    out, seen = asyncio.run(run())
    assert out.stop_reason == "length" and len(out.token_ids) == 4
    assert len(seen) == 2  # g0/1's request ran once: no abort, no resume
    assert coord.request_of == {} and set(coord.inflight.values()) == {0}, (coord.request_of, coord.inflight)


def test_trajectory_request_ids_are_prefix_free():
    """SGLang aborts every request whose id starts with the one named (``rid.startswith``): under
    full_determinism every verl id is ``det-0``, so session 1's id must not start session 10's,
    nor group ``g1``'s group ``g10``'s."""
    from dora_ext.verl.manager import Route, trajectory_request_id

    ids = [trajectory_request_id("det-0", Route(g, i)) for g in ("g1", "g10", "g100") for i in range(16)]
    assert len(set(ids)) == len(ids)
    assert [(a, b) for a in ids for b in ids if a != b and b.startswith(a)] == []
    assert trajectory_request_id("det-0", None) == trajectory_request_id("det-0", Route(None, 0)) == "det-0"

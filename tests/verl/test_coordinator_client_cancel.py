"""A caller of verl's ``generate`` cancelled around its acquire: every order releases an acquire
the coordinator counted exactly once, and none it did not count.

``DoraLLMServerClient._acquire_server`` awaits the coordinator's answer shielded and, when its
caller is cancelled first, releases the acquire once the answer arrives (verl 0.9.1's
``LLMServerClient.generate`` releases in a ``finally`` entered only after ``_acquire_server``
returned). ``test_coordinator_load_hold.py`` forces three points on the real coordinator; here
the orders around the answer itself, each forced by resolving the answer future and cancelling the
caller in a chosen loop turn (no sleeps):

* the answer arrives and the caller is cancelled in the same turn, or after the shield passed the
  answer on but before the caller resumed;
* the acquire raises, or its answer is cancelled, after the caller was cancelled (nothing was
  counted: nothing is released, no exception is left unretrieved);
* a late release for a replica address that was removed and re-added meanwhile (a replica
  restart) leaves the new instance's request counted (real coordinator);
* the same over real Ray (``ObjectRef`` answers; the garbage collector runs while the caller is
  gone and only the pending answer keeps the shielded wait alive; the actor killed before it
  answers).

Real: verl's client code under our subclass, the coordinator, Ray. Stand-ins: the load balancer's
actor handle (``ScriptedBalancer``: its answers are futures the test resolves, its releases are
recorded) and a rollout server's handle (``HeldServer``), speaking verl's interfaces.
"""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

pytest.importorskip("verl")

LEAKS = ("never retrieved", "destroyed but it is pending", "Exception in callback")


def _leaks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if any(w in r.getMessage() for w in LEAKS)]


class ScriptedBalancer:
    """The coordinator's actor handle: ``acquire_server.remote`` returns a future the test
    resolves (``answers``); ``release_server.remote`` is recorded (``releases``)."""

    def __init__(self):
        self.answers: list[asyncio.Future] = []
        self.releases: list[tuple] = []
        self.acquire_server = _Call(self._acquire)
        self.release_server = _Call(self._release)

    def _acquire(self, request_id, **_):
        fut = asyncio.get_running_loop().create_future()
        self.answers.append(fut)
        return fut

    def _release(self, server_id, request_id=None):
        self.releases.append((server_id, request_id))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


class _Call:
    def __init__(self, fn):
        self.remote = fn


class HeldServer:
    """A rollout server's handle: ``generate.remote`` runs until ``go`` is set."""

    def __init__(self):
        self.generate = _Call(self._generate)
        self.entered = asyncio.Event()
        self.go = asyncio.Event()

    async def _generate(self, **_):
        from verl.workers.rollout.replica import TokenOutput

        self.entered.set()
        await self.go.wait()
        return TokenOutput(token_ids=[1], log_probs=[0.0], stop_reason="length", num_preempted=0,
                           extra_fields={"global_steps": 0})


def _client(handle):
    from omegaconf import OmegaConf

    from dora_ext.verl.manager import DoraLLMServerClient

    return DoraLLMServerClient(config=OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm"}}}),
                               load_balancer_handle=handle)


def _generate(client):
    return asyncio.ensure_future(client.generate(request_id="r", prompt_ids=[1], sampling_params={"max_tokens": 1}))


async def _turns(n: int = 10) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


ORDERS = {
    # order: releases expected (the answer names server s1)
    "cancelled_then_answered": 1,
    "answered_and_cancelled_in_one_turn": 1,
    "cancelled_after_the_shield_passed_the_answer_on": 1,
    "cancelled_twice_then_answered": 1,
    "cancelled_in_flight": 1,  # verl's own finally
    "not_cancelled": 1,  # verl's own finally
    "cancelled_then_the_acquire_raised": 0,
    "cancelled_then_the_answer_was_cancelled": 0,
    "the_acquire_raised": 0,
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_each_order_releases_a_counted_acquire_exactly_once(order, caplog):
    caplog.set_level(logging.WARNING, logger="asyncio")

    async def run():
        lb, server = ScriptedBalancer(), HeldServer()
        caller = _generate(_client(lb))
        await _turns()
        assert len(lb.answers) == 1 and not caller.done()
        answer = lb.answers[0]
        if order == "cancelled_then_answered":
            caller.cancel()
            await _turns()
            assert caller.cancelled() and lb.releases == []  # nothing to release before the answer
            answer.set_result(("s1", server))
        elif order == "cancelled_twice_then_answered":
            caller.cancel()
            await asyncio.sleep(0)
            caller.cancel()
            await _turns()
            answer.set_result(("s1", server))
        elif order == "answered_and_cancelled_in_one_turn":
            answer.set_result(("s1", server))
            caller.cancel()
        elif order == "cancelled_after_the_shield_passed_the_answer_on":
            seen = []

            def after_the_shield(_):
                # Registered after the shield's own callback on the answer: the shield has passed
                # the answer on (the caller's wait is done) and the caller has not resumed.
                waiter = caller._fut_waiter
                seen.append((waiter is not None and waiter.done(), caller.done()))
                caller.cancel()

            answer.add_done_callback(after_the_shield)
            answer.set_result(("s1", server))
            await _turns()
            assert seen == [(True, False)], seen  # the order was the one meant
        elif order == "cancelled_in_flight":
            answer.set_result(("s1", server))
            await server.entered.wait()
            caller.cancel()
        elif order == "not_cancelled":
            answer.set_result(("s1", server))
            await server.entered.wait()
            server.go.set()
        elif order == "cancelled_then_the_acquire_raised":
            caller.cancel()
            await _turns()
            answer.set_exception(RuntimeError("the coordinator died"))
        elif order == "cancelled_then_the_answer_was_cancelled":
            caller.cancel()
            await _turns()
            answer.cancel()
        elif order == "the_acquire_raised":
            answer.set_exception(RuntimeError("the coordinator died"))
        await _turns()
        try:
            outcome = (await caller).stop_reason
        except asyncio.CancelledError:
            outcome = "cancelled"
        except RuntimeError as exc:
            outcome = str(exc)
        await _turns()
        gc.collect()
        return outcome, list(lb.releases)

    outcome, releases = asyncio.run(run())
    gc.collect()
    assert outcome == {"not_cancelled": "length",
                       "the_acquire_raised": "the coordinator died"}.get(order, "cancelled")
    assert releases == [("s1", "r")] * ORDERS[order], releases
    assert not _leaks(caplog)


def test_a_late_release_after_a_replica_restart_leaves_the_new_instances_request_counted():
    """The answer of an abandoned acquire (g1/1 on s1, instance 1) is on its way when s1 is removed
    and added again (instance 2, a restarted replica at the same address) and a new request runs
    there. The abandoned acquire's release then arrives: it is for instance 1, so it is counted
    unmatched and does not end the new instance's request (the coordinator matches releases to
    acquires per instance). Real coordinator; ``RayLikeHandle`` stands in for its actor handle."""
    from dora_ext.verl.manager import Route, current_route

    from .coordinator_helpers import RayLikeHandle, Server, before_the_move, client_of

    coord = before_the_move()

    async def run():
        coord.handles = {sid: RayLikeHandle(Server()) for sid in ("s0", "s1")}
        lb = RayLikeHandle(coord)
        client = client_of(coord, lb)
        lb.hold("acquire_server")
        token = current_route.set(Route("g1", 1))
        try:
            caller = _generate(client)
        finally:
            current_route.reset(token)
        await lb.finished("acquire_server", 1)
        assert coord.get_inflight_count("s1") == 1 and coord.instance_of["s1"] == 1
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        coord.remove_servers(["s1"])
        coord.add_servers({"s1": coord.handles["s1"]})
        assert coord.instance_of["s1"] == 2
        assert coord.take_work()["load"] == [(2, 0)]
        coord.loaded([2], 0)
        landed = [(await coord.acquire_server(f"v{i}", dora_validate=True))[0] for i in range(2)]
        assert sorted(landed) == ["s0", "s1"] and coord.get_inflight_count("s1") == 1
        lb.deliver("acquire_server")
        await asyncio.wait_for(lb.finished("release_server", 1), 10)  # a bound on a failure
        return coord.get_inflight_count("s1"), coord.metrics()["unmatched_releases"]

    assert asyncio.run(run()) == (1, 1)


def _gated_balancer_class():
    """A Ray actor with the coordinator's acquire/release API: an acquire waits until ``open``
    (then answers ``("s1", None)`` and counts, or raises); releases are recorded and ``released(n)``
    returns once `n` arrived. Defined in a
    function so that Ray ships the class by value (the test package is not importable there)."""

    class GatedBalancer:
        def __init__(self):
            self.gate = asyncio.Event()
            self.changed = None
            self.acquires = 0
            self.releases: list[tuple] = []
            self.inflight = 0
            self.fail = False

        def _changed(self) -> asyncio.Condition:
            if self.changed is None:
                self.changed = asyncio.Condition()
            return self.changed

        async def acquire_server(self, request_id, **_):
            async with self._changed():
                self.acquires += 1
                self._changed().notify_all()
            await self.gate.wait()
            if self.fail:
                raise RuntimeError("acquire refused")
            self.inflight += 1
            return "s1", None

        async def release_server(self, server_id, request_id=None):
            async with self._changed():
                self.releases.append((server_id, request_id))
                self.inflight -= 1
                self._changed().notify_all()

        async def acquired(self, n):
            async with self._changed():
                await self._changed().wait_for(lambda: self.acquires >= n)

        def open(self, fail=False):
            self.fail = fail
            self.gate.set()

        async def released(self, n):
            async with self._changed():
                await self._changed().wait_for(lambda: len(self.releases) >= n)
            return list(self.releases), self.inflight

    return GatedBalancer


@pytest.mark.slow
@pytest.mark.parametrize("how", ["answered", "raised", "actor_killed"])
def test_over_ray_a_cancelled_callers_acquire_is_released_once_it_answers(ray_tq, how, caplog):
    """Over real Ray: the caller is cancelled while the actor's acquire waits (cancelling the wait
    on the ``ObjectRef`` does not cancel the actor task); the garbage collector runs while nothing
    but the pending answer keeps the shielded wait alive; then the acquire answers (released once,
    the actor's in-flight count back to 0), raises (nothing released), or the actor is killed
    (nothing released). Each end is awaited through a spy on ``_release_abandoned``; no exception
    or task is left unretrieved."""
    import ray

    caplog.set_level(logging.WARNING, logger="asyncio")
    lb = ray.remote(_gated_balancer_class()).options(num_cpus=0, max_concurrency=100).remote()

    async def run():
        client = _client(lb)
        settled = asyncio.Event()
        sent: list[tuple] = []  # the releases the client sent
        release_abandoned, release_server = client._release_abandoned, client._release_server

        def settle(answer, request_id):
            release_abandoned(answer, request_id)
            settled.set()

        def send(server_id, request_id=None):
            sent.append((server_id, request_id))
            release_server(server_id, request_id=request_id)

        client._release_abandoned, client._release_server = settle, send
        caller = _generate(client)
        await lb.acquired.remote(1)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        gc.collect()
        if how == "actor_killed":
            ray.kill(lb)
        else:
            await lb.open.remote(fail=(how == "raised"))
        await asyncio.wait_for(settled.wait(), 60)  # a bound on a failure (the answer never settled)
        gc.collect()
        at_the_actor = None
        if how == "answered":
            at_the_actor = await asyncio.wait_for(lb.released.remote(1), 60)
        return sent, at_the_actor

    out = asyncio.run(run())
    gc.collect()
    if how == "answered":
        assert out == ([("s1", "r")], ([("s1", "r")], 0))  # released once; the actor counts none in flight
    else:
        assert out == ([], None)  # the acquire counted nothing: nothing released
    assert not _leaks(caplog)

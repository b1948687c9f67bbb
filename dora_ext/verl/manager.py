"""The agent-loop side of the dora trainer: a manager, its workers and their LLM client.

* ``DoraAgentLoopManager`` (``actor_rollout_ref.rollout.agent.agent_loop_manager_class``) is
  verl's ``AgentLoopManagerTQ`` that first *offers* each training prompt to the coordinator
  (the scheduler admits it when R2's budget and free slots allow) and then hands the batch to its
  workers as verl does.
* ``DoraAgentLoopWorker`` is verl's ``AgentLoopWorkerTQ``; each session (trajectory) runs with
  its ``(uid, session)`` in a context variable, reports generation end, reward and failure to the
  coordinator, and re-runs a failed trajectory when the scheduler retries it (C2).
* ``DoraLLMServerClient`` is verl's ``FullyAsyncLLMServerClient`` whose ``_acquire_server``
  passes that ``(uid, session)`` to the coordinator, which answers with the instance the
  scheduler dispatched the trajectory to (R1, R6). After an abort (R5 migration) the client's own
  resume loop re-acquires and lands on the trajectory's new instance, same version (C1); the
  coordinator answers the move with ``MigrationLanded`` on that acquire.

Everything else (agent loops, tokenisation, reward, TransferQueue writes) is verl's code.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from dataclasses import dataclass
from typing import Any

import ray
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

logger = logging.getLogger("dora_ext.verl")


@dataclass(frozen=True)
class Route:
    """Which trajectory the current task generates: verl's prompt ``uid`` and session index."""

    group: Any
    index: int
    validate: bool = False


#: set by the worker around each session; read by the client in the same asyncio task
current_route: contextvars.ContextVar[Route | None] = contextvars.ContextVar("dora_route", default=None)


def trajectory_request_id(request_id: str, route: Any) -> str:
    """``<verl's id>-<group>-<session>-`` for a trajectory's requests (`route`: its ``Route``), verl's
    id unchanged for a request of no group. Prefix-free: SGLang aborts every id that starts with the
    one named."""
    if route is None or route.group is None:
        return request_id
    return f"{request_id}-{route.group}-{route.index}-"


class DoraLLMServerClient(FullyAsyncLLMServerClient):
    """verl's resuming client, routed by the coordinator (see the module docstring)."""

    def __init__(self, config: Any, load_balancer_handle: Any = None, **kwargs: Any) -> None:
        super().__init__(config=config, load_balancer_handle=load_balancer_handle, **kwargs)
        self._lb_require_acquire_fields = []
        self._lb_require_release_fields = ["request_id"]  # the coordinator matches releases to acquires

    def _vllm_request_id(self, request_id: str) -> str:
        # The engine sees the id the coordinator was given at acquire, so that an R5 move aborts
        # just that request (``abort_request``); verl passes it through under full_determinism too.
        return request_id

    async def generate(self, request_id: str, **kwargs: Any) -> Any:
        """verl's resuming ``generate`` under the trajectory's own id, ``<id>-<uid>-<session>-``
        (every turn and resume of a trajectory keeps it; the closing ``-`` because SGLang aborts
        every request whose id starts with the one named, and ``...-1`` would start ``...-10``). The coordinator keys a request by its id
        and an R5 move aborts it by that id, but verl's agent loops do not make ids unique: under
        ``actor_rollout_ref.rollout.full_determinism`` every request is ``det-<priority>`` and verl's
        TransferQueue worker passes no priority, so all are ``det-0``; one abort on vLLM (which
        aborts every request under an id) stopped them all. What verl's determinism reads (per-request
        seeds, batch-invariant kernels) does not depend on the id and is untouched; the id keeps verl's
        part and adds only what names the trajectory."""
        return await super().generate(trajectory_request_id(request_id, current_route.get()), **kwargs)

    @property
    def coordinator(self) -> Any:
        return self._load_balancer

    async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        """The coordinator's answer: ``(server id, handle)``; the coordinator counts the request in
        flight on that server until its release.

        verl's ``generate`` releases in a ``finally`` that starts only once this returned. A caller
        cancelled while this waits (for the Dispatch, or for the answer on its way back) never
        reaches it, while the coordinator's acquire runs on (cancelling the wait on a Ray
        ``ObjectRef`` does not cancel the actor task) and counts the request: nothing would release
        it, and a load held for that server would stay held for good. The answer is therefore
        awaited shielded, and when the caller is cancelled, the acquire is released as soon as it
        answers (an acquire that fails counted nothing: nothing to release)."""
        route = current_route.get()
        fields: dict[str, Any] = {}
        if route is not None:
            fields = {"dora_group": route.group, "dora_index": route.index, "dora_validate": route.validate}
        answer = asyncio.ensure_future(self._load_balancer.acquire_server.remote(request_id=request_id, **fields))
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            answer.add_done_callback(lambda done: self._release_abandoned(done, request_id))
            raise

    def _release_abandoned(self, answer: asyncio.Future, request_id: str) -> None:
        """Release an acquire whose caller was cancelled before it got the answer."""
        if answer.cancelled() or answer.exception() is not None:
            return
        server_id = answer.result()[0]
        logger.warning("dora: request %s was cancelled while acquiring; releasing its server %s", request_id, server_id)
        self._release_server(server_id, request_id=request_id)


class _DoraWorkerMixin:
    """The per-trajectory reporting around verl's ``AgentLoopWorkerTQ`` methods."""

    def _coordinator(self) -> Any:
        return getattr(self.llm_client, "coordinator", None)

    async def _run_agent_loop(self, sampling_params: dict, trajectory: dict, **kwargs: Any):
        validate = bool(trajectory.get("validate", False))
        route = Route(kwargs.get("uid"), int(kwargs.get("session_id", 0)), validate)
        token = current_route.set(route)
        try:
            coordinator = self._coordinator()
            if validate or coordinator is None or route.group is None:
                return await super()._run_agent_loop(sampling_params, trajectory, **kwargs)
            while True:
                try:
                    return await super()._run_agent_loop(sampling_params, trajectory, **kwargs)
                except Exception as exc:
                    verdict = await coordinator.trajectory_failed.remote(route.group, route.index, repr(exc)[:500])
                    if verdict != "retry":
                        raise
                    logger.warning("dora: retrying trajectory %s/%s after %r", route.group, route.index, exc)
        finally:
            current_route.reset(token)

    async def _agent_loop_postprocess(self, output: Any, validate: bool, **kwargs: Any):
        coordinator = self._coordinator()
        route = current_route.get()
        report = coordinator is not None and route is not None and not validate and route.group is not None
        if report:
            outputs = output if isinstance(output, list) else [output]
            tokens = sum(len(o.response_ids) for o in outputs)
            # Generation is over: the slot is free while the reward is computed.
            await coordinator.trajectory_done.remote(route.group, route.index, tokens, None)
        result = await super()._agent_loop_postprocess(output, validate, **kwargs)
        if report:
            final = (output if isinstance(output, list) else [output])[-1]
            score = final.reward_score
            # A colocated reward model scores at train time: 0.0 stands for "not known yet".
            await coordinator.reward_ready.remote(route.group, route.index, 0.0 if score is None else float(score))
        return result


class DoraAgentLoopWorker(_DoraWorkerMixin, AgentLoopWorkerTQ.__ray_actor_class__):
    """verl's TransferQueue agent-loop worker with per-trajectory reporting (a plain class: the
    manager wraps it with ``ray.remote``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Defined here on purpose: Ray ships an actor class's inherited ``__init__`` by value, and
        # verl's (which calls zero-argument ``super()``) would then point at a copy of its class
        # that is not in this class's MRO.
        super().__init__(*args, **kwargs)


class DoraAgentLoopManager(AgentLoopManagerTQ):
    """verl's TransferQueue agent-loop manager that offers training prompts to the coordinator."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = ray.remote(DoraAgentLoopWorker)

    def generate_sequences(self, prompts: Any) -> None:
        validate = bool(prompts["validate"]) if "validate" in prompts.keys() else False
        coordinator = getattr(self.llm_client, "coordinator", None)
        if coordinator is not None and not validate:
            uids = [str(u) for u in list(prompts["uid"])]
            ray.get(coordinator.offer.remote(uids))
        super().generate_sequences(prompts)

"""Pieces the coordinator tests share (``test_coordinator_landing*.py``, ``test_coordinator_load_hold.py``).

What is real: the coordinator (the plain class ``create_coordinator`` wraps as a Ray actor), its
scheduler and our ``DoraLLMServerClient``. What stands in, in-process instead of over Ray: the
actor handles (``.remote`` calls the method and returns an awaitable) and a scripted rollout
server that speaks verl's server interface (``generate`` returning a ``TokenOutput``).
"""

from __future__ import annotations

import asyncio

from dora_ext.verl.coordinator import DoraCoordinator

ONE = {"mode": "dora", "max_staleness": 2, "batch_size": 2, "group_size": 2, "instances": 2, "capacity": 4}


def started(cfg: dict) -> DoraCoordinator:
    """A started coordinator with two servers, s0 and s1, whose handles are ``None``."""
    coord = DoraCoordinator(cfg, {"s0": None, "s1": None}, use_plugins=False)
    asyncio.run(coord.start())
    return coord


def before_the_move(cfg: dict = ONE) -> DoraCoordinator:
    """Two instances of 4 slots, K=2, B=2, n=2 (``ONE``): version 0's last two trajectories run
    one on each instance (g1/1 on instance 1) and step 1 is ready to publish, which moves g1/1
    onto instance 0 (R5)."""
    coord = started(cfg)
    coord.offer([f"g{i}" for i in range(10)])
    all_but_the_last_two_done(coord)
    assert coord.step_batch(0) == ["g2", "g3"]
    return coord


def all_but_the_last_two_done(coord: DoraCoordinator) -> None:
    """With g0..g9 offered to a coordinator of ``ONE``'s shape, end every trajectory of version 0
    but g0/0 (instance 0) and g1/1 (instance 1)."""
    for g in ("g2", "g3", "g4", "g5"):
        for i in range(2):
            coord.trajectory_done(g, i, 5, 1.0)
    coord.trajectory_done("g0", 1, 5, 1.0)
    coord.trajectory_done("g1", 0, 5, 1.0)


async def waiting_then_offered(coord: DoraCoordinator) -> asyncio.Future:
    """Start an acquire for g1/1 that waits for its Dispatch, then offer groups g0..g9 (which
    dispatches g1/1 and resolves the waiter). No await after the waiter is seen: the caller runs
    before the acquiring task resumes."""
    task = asyncio.ensure_future(coord.acquire_server("r", dora_group="g1", dora_index=1))
    await asyncio.sleep(0)
    assert not task.done() and ("g1", 1) in coord.waiters
    # Everything below runs before the task resumes: no await in between.
    coord.offer([f"g{i}" for i in range(10)])
    return task


class Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        if asyncio.iscoroutine(out):
            return out
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(out)
        return fut


class Handle:
    """An actor handle stand-in: ``handle.method.remote(...)`` runs ``obj.method`` in this loop."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        return Method(getattr(self._obj, name))


class Server:
    """A scripted rollout server: one token id per step; a held request returns ``aborted`` with
    `done` tokens when the test aborts it, else the request generates its whole budget."""

    def __init__(self):
        self.active = 0
        self.prompts: list[int] = []  # prompt length of each request (a resume re-prefills more)
        self.hold = False
        self.arrived = asyncio.Event()
        self.aborted = asyncio.Event()

    async def generate(self, request_id, prompt_ids, sampling_params, **_):
        from verl.workers.rollout.replica import TokenOutput

        self.active += 1
        self.prompts.append(len(prompt_ids))
        self.arrived.set()
        try:
            if self.hold:
                await self.aborted.wait()
                self.aborted.clear()
                tokens, reason = [5, 5, 5], "aborted"
            else:
                tokens, reason = [6] * int(sampling_params["max_tokens"]), "length"
        finally:
            self.active -= 1
        return TokenOutput(token_ids=tokens, log_probs=[0.0] * len(tokens), stop_reason=reason, num_preempted=0,
                           extra_fields={"global_steps": 0})

    async def next_arrival(self):
        await self.arrived.wait()
        self.arrived.clear()


def client_of(coord: DoraCoordinator, handle=None):
    """Our ``DoraLLMServerClient`` (on verl's real client) balanced by `coord` through a handle
    (`handle`, else an in-process ``Handle``)."""
    from omegaconf import OmegaConf

    from dora_ext.verl.manager import DoraLLMServerClient

    return DoraLLMServerClient(config=OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm"}}}),
                               load_balancer_handle=handle if handle is not None else Handle(coord))


class RayLikeHandle:
    """An actor handle stand-in closer to Ray's for cancellation: ``handle.method.remote(...)`` runs
    the method as its own task (an actor task) and returns a separate future for its answer (an
    ``ObjectRef``); cancelling that future, or the task awaiting it, does not cancel the method
    (Ray's ``ObjectRef.future()``: "the future cancellation will not cancel the corresponding
    task"). ``hold(name)`` keeps the answers of `name` on their way back until ``deliver(name)``;
    ``await finished(name, n)`` returns once `n` calls of `name` have run (answered or not)."""

    def __init__(self, obj):
        self._obj = obj
        self._gates: dict[str, asyncio.Event] = {}
        self.runs: dict[str, int] = {}
        self._ran = asyncio.Condition()
        self._tasks: set = set()

    def hold(self, name: str) -> None:
        self._gates[name] = asyncio.Event()

    def deliver(self, name: str) -> None:
        self._gates.pop(name).set()

    async def finished(self, name: str, n: int) -> None:
        async with self._ran:
            await self._ran.wait_for(lambda: self.runs.get(name, 0) >= n)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return _RayLikeMethod(self, name)


class _RayLikeMethod:
    def __init__(self, handle: RayLikeHandle, name: str):
        self.handle, self.name = handle, name

    def remote(self, *args, **kwargs):
        handle, name = self.handle, self.name
        answer = asyncio.get_running_loop().create_future()
        gate = handle._gates.get(name)

        async def run():
            try:
                out = getattr(handle._obj, name)(*args, **kwargs)
                if asyncio.iscoroutine(out):
                    out = await out
                result = (out, None)
            except Exception as exc:  # noqa: BLE001 - handed to the caller, as Ray does
                result = (None, exc)
            async with handle._ran:
                handle.runs[name] = handle.runs.get(name, 0) + 1
                handle._ran.notify_all()
            if gate is not None:
                await gate.wait()
            if not answer.done():  # (the caller may have cancelled its future)
                if result[1] is not None:
                    answer.set_exception(result[1])
                else:
                    answer.set_result(result[0])

        task = asyncio.ensure_future(run())
        handle._tasks.add(task)
        task.add_done_callback(handle._tasks.discard)
        return answer

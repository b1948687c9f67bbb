"""The workers of the embedded runtime: one per rollout instance, one for the trainer.

Each worker owns its torch objects (an engine, or the trainer), takes commands from its own inbox
and reports on its own pipe; only the coordinator (`runtime.Runtime`) touches the scheduler, so
ownership replaces locking.

Hosting (`runtime.backend`): processes on CPU (a small model's decode loop is Python glue that
holds the GIL, so threads would slow the trainer several-fold), threads on CUDA (asynchronous
kernels overlap well). Processes come from a pre-warmed fork server (`_forkserver.py`), exit when
the coordinator dies, and share only messages: weights as one shared-memory tensor per version
(`PackedWeights`), a migrating KV cache via the coordinator in shared memory.

Every channel has one writer, so a killed worker can at worst cut its own last message (read as
the end of its pipe) and make its pending tensor messages unreadable (read as ("lost", ...)).
Each worker fixes its core share at start (`claim_cores`). Times are raw `time.perf_counter()`.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

_init_lock = threading.Lock()


def claim_cores(threads: int, cpus: Sequence[int] | None) -> int:
    """Give the calling thread `threads` torch intra-op threads, pinned to `cpus` when given.

    ATen sets a thread's OpenMP count lazily, at its first parallel kernel, from the process-wide
    value any thread set last: so set, run one kernel, set again, under a lock. Returns the count.
    """
    with _init_lock:
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(cpus))  # pid 0 = the calling thread on Linux
        torch.set_num_threads(threads)
        torch.ones(1 << 16).add_(1)
        torch.set_num_threads(threads)
        return torch.get_num_threads()


def next_command(inbox: Any, watch_pid: int | None) -> tuple:
    """Block for the next command. A worker process also checks once a second that the
    coordinator still lives, and exits at once if it does not (a killed run leaves nothing behind)."""
    while True:
        try:
            return inbox.get(timeout=1.0) if watch_pid else inbox.get()
        except queue.Empty:
            try:
                os.kill(watch_pid, 0)
            except ProcessLookupError:
                os._exit(0)  # no flushing of queues nobody reads


# ---------------------------------------------------------------------------------- reports
class PipeOutbox:
    """A worker process's own report channel: the write end of a pipe only it writes to (a shared
    `multiprocessing.Queue` lock held by a killed worker would block every other worker)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def put(self, msg: Any) -> None:
        self.conn.send(msg)


class PipeHub:
    """The coordinator's side of the workers' `PipeOutbox`es: `get(timeout)` returns the next
    report from any of them (`queue.Empty` on timeout). A pipe whose writer is gone is dropped (a
    cut last message reads as its end); `drain(name)` hands over what a gone worker still had.
    A complete message that cannot be unpickled (tensors whose dead writer held their shared
    memory) is handed over as ("lost", name, why), and the pipe is read on."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.readers: list[Any] = []
        self._names: dict[Any, str] = {}  # reader -> the worker writing to it
        self._pending: list[tuple[str, Any]] = []

    def writer(self, name: str = "") -> PipeOutbox:
        r, w = self.ctx.Pipe(duplex=False)
        self.readers.append(r)
        self._names[r] = name
        return PipeOutbox(w)

    def _drop(self, r: Any) -> None:
        self.readers.remove(r)
        self._names.pop(r, None)
        r.close()

    def get(self, timeout: float | None = None) -> Any:
        from multiprocessing.connection import wait

        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.readers:
                raise queue.Empty
            ready = wait(self.readers, timeout=left)
            if not ready and deadline is not None and time.monotonic() >= deadline:
                raise queue.Empty
            for r in ready:
                try:
                    self._pending.append((self._names.get(r, ""), self._read(r)))
                except (EOFError, OSError):
                    self._drop(r)
        return self._pending.pop(0)[1]

    def _read(self, r: Any) -> Any:
        """The next message on pipe `r`; EOFError/OSError when the pipe ended (or its last message
        was cut), ("lost", name, why) for a complete message that cannot be unpickled."""
        from multiprocessing.reduction import ForkingPickler

        buf = r.recv_bytes()
        try:
            return ForkingPickler.loads(buf)
        except Exception as exc:  # noqa: BLE001 - any failure to rebuild the message is reported as such
            return ("lost", self._names.get(r, ""), f"{type(exc).__name__}: {exc}")

    def drain(self, name: str) -> list[Any]:
        """Every report of worker `name` not returned yet, in order, up to the end of its pipe (only
        for a worker whose process is gone)."""
        out = [m for n, m in self._pending if n == name]
        self._pending = [(n, m) for n, m in self._pending if n != name]
        for r in [r for r, n in self._names.items() if n == name]:
            while True:
                try:
                    out.append(self._read(r))
                except (EOFError, OSError):
                    break
            self._drop(r)
        return out


def trainer_name(rank: int) -> str:
    """The name a trainer rank reports under: `trainer` (rank 0), `trainer-1`, ..."""
    return "trainer" if rank == 0 else f"trainer-{rank}"


def _own_outbox(outbox: Any, name: str) -> Any:
    """A worker process's report channel: its own pipe when the coordinator reads a `PipeHub`."""
    return outbox.writer(name) if isinstance(outbox, PipeHub) else outbox


def _started(handles_and_outboxes: list) -> None:
    """After the processes started: the coordinator closes its copies of their pipes' write ends,
    so that a worker's exit shows as the end of its pipe."""
    for _, out in handles_and_outboxes:
        if isinstance(out, PipeOutbox):
            out.conn.close()


# ---------------------------------------------------------------------------------- weights
@dataclass
class PackedWeights:
    """A state dict as one flat float tensor plus (name, shape, offset) specs: one shared-memory
    segment per version; `unpack()` gives views, so an instance pays only its own load copy."""

    flat: torch.Tensor
    specs: tuple[tuple[str, tuple[int, ...], int], ...]

    @classmethod
    def pack(cls, state: dict[str, torch.Tensor], *, shared: bool) -> "PackedWeights":
        total = sum(t.numel() for t in state.values())
        dtype = next(iter(state.values())).dtype
        flat = torch.empty(total, dtype=dtype)
        if shared:
            flat.share_memory_()
        specs, off = [], 0
        for name, t in state.items():
            n = t.numel()
            flat[off:off + n].copy_(t.detach().reshape(-1).to("cpu", dtype))
            specs.append((name, tuple(t.shape), off))
            off += n
        return cls(flat, tuple(specs))

    def unpack(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        flat = self.flat.to(device)
        out = {}
        for name, shape, off in self.specs:
            out[name] = flat[off:off + math.prod(shape)].view(shape)
        return out


# ---------------------------------------------------------------------------------- instances
class InstanceLoop:
    """The command loop of one rollout instance, the same whether a thread or a process hosts it.

    Commands (tuples on `inbox`):
      ("load", version, weights, preempt)   copy published weights in; `preempt` (mode partial)
                                            pauses running sequences and resumes them after
      ("submit", rid, prompt_ids, max_new_tokens, sampling, seed)
      ("migrate", rid, dst)                 export the sequence with its KV cache, reported as
                                            ("export", iid, dst, SequenceState) for `dst`
      ("import", SequenceState)             a migrated sequence; reported ("imported", iid, rid)
                                            once the engine runs it
      ("stop",)                             report ("stats", iid, {...}) and return
      ("batch", [commands])                 several of the above, in order (one wake-up)
    Other reports: ("ready", name, torch_threads, cpus, nice), ("loaded", iid, version, seconds),
    ("finished", iid, [Finished, ...], t), ("error", name, message, traceback).

    `can_decode()`, `decode()` and `handle` are what `runtime/faults.py` overrides in tests.
    `log` [(t, code)]: version while decoding, -1 loading, -2 idle; `steps` [(t0, t1, sequences)].
    """

    def __init__(self, iid: int, engine: Any, inbox: Any, outbox: Any,
                 sync: Callable[[], None] = lambda: None, watch_pid: int | None = None,
                 step_s: float = 0.0) -> None:
        self.iid = iid
        self.watch_pid = watch_pid
        self.step_s = step_s
        self.over_floor = 0  # GPU shape: iterations whose CPU work alone outlasted step_s (unshaped)
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.sync = sync
        self.log: list[tuple[float, int]] = []
        self.steps: list[tuple[float, float, int]] = []
        self.migrations_out = 0
        self.migrations_missed = 0  # the sequence finished before the move arrived (harmless)
        self.migrations_forwarded = 0  # moved on again before it arrived here (passed through)
        self._finished: set = set()  # request ids that finished here
        self._forward: dict = {}  # request id still travelling here -> where it must go next
        self._state: int | None = None

    def _mark(self, code: int) -> None:
        if code != self._state:
            self._state = code
            self.log.append((time.perf_counter(), code))

    def run(self) -> None:
        self._mark(-2)
        while True:
            if self.can_decode():
                try:
                    cmd = self.inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            else:
                self._mark(-2)
                cmd = next_command(self.inbox, self.watch_pid)
            if cmd is not None:
                if cmd[0] == "stop":
                    self.outbox.put(("stats", self.iid, self.stats()))
                    return
                self.handle(cmd)
                continue  # take every waiting command before the next decode iteration
            self.decode()

    def can_decode(self) -> bool:
        """Whether to run a decode iteration now (else block for the next command)."""
        return self.engine.has_work

    def decode(self) -> None:
        """One decode iteration; what finished in it is reported in one message."""
        engine = self.engine
        self._mark(engine.version)
        t0 = time.perf_counter()
        before = engine.stats.decode_tokens
        finished = engine.step()
        if self.step_s > 0:  # GPU-shaped: the step's floor is idle time (memory-bound decode), not CPU work
            rest = self.step_s - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
            else:
                self.over_floor += 1
        t1 = time.perf_counter()
        self.steps.append((t0, t1, engine.stats.decode_tokens - before))
        if finished:  # one message per decode iteration, however many finished in it
            self._finished.update(f.request_id for f in finished)
            self.outbox.put(("finished", self.iid, finished, t1))

    def stats(self) -> dict[str, Any]:
        import dataclasses

        # A forward still pending at the end was for a sequence that finished on its way here.
        return {"log": self.log, "steps": self.steps, "over_floor": self.over_floor,
                "engine": dataclasses.asdict(self.engine.stats),
                "migrations_out": self.migrations_out, "migrations_missed": self.migrations_missed + len(self._forward),
                "migrations_forwarded": self.migrations_forwarded}

    def handle(self, cmd: tuple) -> None:
        """Execute one command (see the class docstring); "stop" is the loop's business."""
        kind = cmd[0]
        engine = self.engine
        if kind == "batch":  # the commands one coordinator turn produced for this instance, in order
            for c in cmd[1]:
                self.handle(c)
        elif kind == "submit":
            _, rid, prompt, max_new, sampling, seed = cmd
            engine.submit(rid, prompt, max_new, sampling, seed)
        elif kind == "load":
            _, version, weights, preempt = cmd
            self._mark(-1)
            if isinstance(weights, PackedWeights):
                weights = weights.unpack()
            if preempt:
                engine.pause_all()
            seconds = engine.load_version(weights, version)
            if preempt:
                engine.resume()
            self._mark(version if engine.has_work else -2)
            self.outbox.put(("loaded", self.iid, version, seconds))
        elif kind == "migrate":
            _, rid, dst = cmd
            if rid in engine.progress():
                state = engine.export_sequence(rid, include_kv=True)
                self.sync()
                self.migrations_out += 1
                self.outbox.put(("export", self.iid, dst, state))
            elif rid in self._finished:
                self.migrations_missed += 1  # finished here first; its result is already reported
            else:
                # Still on its way here from an earlier move: send it on when it lands (the
                # runtime's coordinator never moves a trajectory before it landed).
                self._forward[rid] = dst
        elif kind == "import":
            state = cmd[1]
            dst = self._forward.pop(state.request_id, None)
            if dst is not None:
                self.migrations_out += 1
                self.migrations_forwarded += 1
                self.outbox.put(("export", self.iid, dst, state))
            else:
                engine.import_sequence(state)
                self.outbox.put(("imported", self.iid, state.request_id))
        else:
            raise ValueError(f"instance {self.iid}: unknown command {kind!r}")


@dataclass(frozen=True)
class EngineRecipe:
    """What a worker needs to build its engine (picklable, for processes). `loop`: the
    `InstanceLoop` class to run (tests pass one of `runtime/faults.py`'s; None = `InstanceLoop`)."""

    model_config: Any
    capacity: int
    stop_id: int
    device: str
    loop: Any = None
    step_s: float = 0.0  # the decode shape: an iteration lasts at least this (`EngineSpec.step_s`)


def _build_engine(iid: int, spec: EngineRecipe) -> Any:
    from ..engines import TorchEngine

    return TorchEngine(spec.model_config, spec.capacity, spec.stop_id, device=spec.device, instance_id=iid)


def _serve_instance(iid: int, spec: EngineRecipe, threads: int, cpus: Sequence[int] | None, inbox: Any,
                    outbox: Any, watch_pid: int | None = None) -> None:
    """Body of an instance worker (thread or process)."""
    name = f"instance-{iid}"
    try:
        n = claim_cores(threads, cpus)
        engine = _build_engine(iid, spec)
        stream = None
        if engine.device.type == "cuda":
            stream = torch.cuda.Stream(engine.device)
        loop = (spec.loop or InstanceLoop)(iid, engine, inbox, outbox,
                                           sync=stream.synchronize if stream else (lambda: None), watch_pid=watch_pid,
                                           step_s=spec.step_s)
        outbox.put(("ready", name, n, _affinity(), _nice()))
        if stream is not None:
            with torch.cuda.stream(stream):
                loop.run()
        else:
            loop.run()
    except BaseException as exc:  # reported to the coordinator, which stops the run
        outbox.put(("error", name, repr(exc), traceback.format_exc()))


def start_instances(specs: dict[int, EngineRecipe], threads: int, cpus: Sequence[int] | None, outbox: Any,
                    backend: str) -> tuple[dict[int, Any], list[Any]]:
    """Start one worker per instance (also a replacement later). Returns (inboxes by instance id,
    handles); each reports on its own pipe `instance-{iid}`."""
    if backend == "process":
        ctx = process_context()
        inboxes = {iid: ctx.Queue() for iid in specs}
        outs = {iid: _own_outbox(outbox, f"instance-{iid}") for iid in specs}
        handles = [ctx.Process(target=_serve_instance, name=f"dora-instance-{iid}", daemon=True,
                               args=(iid, spec, threads, cpus, inboxes[iid], outs[iid], os.getpid()))
                   for iid, spec in specs.items()]
        for h in handles:
            h.start()
        _started([(h, outs[iid]) for h, iid in zip(handles, specs)])
        return inboxes, handles
    else:
        inboxes = {iid: queue.SimpleQueue() for iid in specs}
        handles = [threading.Thread(target=_serve_instance, name=f"instance-{iid}", daemon=True,
                                    args=(iid, spec, threads, cpus, inboxes[iid], outbox))
                   for iid, spec in specs.items()]
    for h in handles:
        h.start()
    return inboxes, handles


_CTX = None


def process_context() -> Any:
    """A `forkserver` context whose server has imported torch once, so that starting an instance
    process is a fork (fast) and never a fork of a process whose OpenMP threads already run."""
    global _CTX
    if _CTX is None:
        import torch.multiprocessing as tmp  # registers the tensor reductions (shared memory)

        ctx = tmp.get_context("forkserver")
        ctx.set_forkserver_preload(["dora_ext.runtime._forkserver"])
        _CTX = ctx
    return _CTX


# ---------------------------------------------------------------------------------- trainer
@dataclass(frozen=True)
class TrainerRecipe:
    """What a worker needs to build the trainer (picklable, for processes)."""

    model_config: Any
    trainer: dict
    weights: Any  # version 0: a state dict, or `PackedWeights`
    device: str
    resume: str | None = None  # a trainer checkpoint to continue from (model, critic, optimizer, version)
    loop: Any = None  # the `TrainerLoop` class to run (tests pass one of `runtime/faults.py`'s)


def build_trainer(spec: TrainerRecipe) -> Any:
    """The policy at version 0 and its `Trainer`; SAO gets a critic: its own copy of the network
    with a scalar head (the value model SAO trains beside the policy)."""
    import dataclasses

    from torch import nn

    from ..algo import Trainer, TrainerConfig
    from ..models.tiny import TinyLM

    cfg = TrainerConfig.from_dict(spec.trainer, where="trainer")
    weights = spec.weights.unpack() if isinstance(spec.weights, PackedWeights) else spec.weights
    policy = TinyLM(spec.model_config).to(spec.device)
    policy.load_state_dict(weights)
    value_head = None
    if cfg.algorithm == "sao":
        critic = TinyLM(dataclasses.replace(spec.model_config, value_head=True)).to(spec.device)
        critic.load_state_dict(weights, strict=False)

        class Critic(nn.Module):
            def __init__(self, lm: nn.Module):
                super().__init__()
                self.lm = lm

            def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
                return self.lm.values(input_ids)

        value_head = Critic(critic)
    trainer = Trainer(policy, cfg, value_head=value_head)  # the KL reference is version 0
    if spec.resume:
        load_trainer_checkpoint(trainer, spec.resume)
    return trainer


def save_trainer_checkpoint(trainer: Any, path: str) -> None:
    """The trainer's half of a checkpoint, written atomically: weights, critic, optimizer, version."""
    state = {"version": trainer.version, "policy": trainer.policy.state_dict(),
             "value_head": trainer.value_head.state_dict() if hasattr(trainer.value_head, "state_dict") else None,
             "optimizer": trainer.optimizer.state_dict()}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_trainer_checkpoint(trainer: Any, path: str) -> None:
    state = torch.load(path, weights_only=False)
    trainer.policy.load_state_dict(state["policy"])
    if state["value_head"] is not None:
        trainer.value_head.load_state_dict(state["value_head"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.version = state["version"]


class TrainerLoop:
    """The trainer's command loop (thread or process).

    Commands: ("group", gid, trajectories, position)  forward/backward now (streamed, R7);
              ("checkpoint", path)  save model, critic, optimizer (reports ("checkpointed", version));
              ("step", step, [(gid, trajectories, position), ...])  the groups not streamed yet,
              then the optimizer step;  ("stop",)  report ("stats", "trainer", {...}).
    Reports: ("step_done", step, metrics, gids, t, weights) with version step+1's weights (packed
    when instances are processes: the trainer pays that broadcast copy). Data parallel: rank 0
    reports for all, with metrics["rank_work"] = [(tokens, compute s, collective s), ...].
    `busy` [(t0, t1)]: compute spans; `cpu`: their CPU seconds.
    """

    def __init__(self, trainer: Any, inbox: Any, outbox: Any, pack: bool, sync: Callable[[], None],
                 watch_pid: int | None = None) -> None:
        self.trainer = trainer
        self.watch_pid = watch_pid
        self.inbox = inbox
        self.outbox = outbox
        self.pack = pack
        self.sync = sync
        self.busy: list[tuple[float, float]] = []
        self.cpu = 0.0
        self._gids: list[Any] = []
        self._tokens = 0  # tokens (prompt + response) of this step's groups so far
        self._compute0 = getattr(trainer, "compute_s", 0.0)
        self._comm0 = getattr(trainer, "comm_s", 0.0)

    def _add(self, gid: Any, trajectories: Any, position: int | None = None) -> None:
        """Train one group (streamed, or with the step command); `position`: its place in the
        whole batch (data parallel, see `Trainer.add_group`)."""
        self.trainer.add_group(trajectories, position)
        self._gids.append(gid)
        self._tokens += sum(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)

    def handle_checkpoint(self, path: str) -> None:
        """Save the trainer's half of a checkpoint at `path` and report it (`runtime/faults.py`
        overrides it to kill the trainer in the middle of the write)."""
        save_trainer_checkpoint(self.trainer, path)
        self.outbox.put(("checkpointed", self.trainer.version))

    def run(self) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        name = trainer_name(rank)
        while True:
            cmd = next_command(self.inbox, self.watch_pid)
            kind = cmd[0]
            if kind == "stop":
                self.outbox.put(("stats", name, {"busy": self.busy, "cpu": self.cpu}))
                return
            t0, c0 = time.perf_counter(), time.thread_time()
            if kind == "group":
                self._add(*cmd[1:])
                self.busy.append((t0, time.perf_counter()))
                self.cpu += time.thread_time() - c0
            elif kind == "checkpoint":
                self.handle_checkpoint(cmd[1])
            elif kind == "step":
                _, step, rest = cmd
                for item in rest:
                    self._add(*item)
                metrics = self.trainer.finish_step(step)
                gids, self._gids = self._gids, []
                # This rank's tokens, compute seconds and collective seconds in the step (the
                # coordinator shares the next batches by speed).
                work = (self._tokens, self.trainer.compute_s - self._compute0, self.trainer.comm_s - self._comm0)
                self._tokens, self._compute0, self._comm0 = 0, self.trainer.compute_s, self.trainer.comm_s
                if rank > 0:  # data parallel: rank 0 reports the step for every rank
                    dist.gather_object((gids, work), None, dst=0)
                    t1 = time.perf_counter()
                    self.busy.append((t0, t1))
                    self.cpu += time.thread_time() - c0
                    continue
                if dist.is_available() and dist.is_initialized():
                    parts: list = [None] * dist.get_world_size()
                    dist.gather_object((gids, work), parts, dst=0)
                    gids = [g for part, _ in parts for g in part]
                    metrics["rank_work"] = [w for _, w in parts]
                weights = {k: v for k, v in self.trainer.publish().items() if not k.startswith("value_head.")}
                if self.pack:
                    weights = PackedWeights.pack(weights, shared=True)
                self.sync()
                t1 = time.perf_counter()
                self.busy.append((t0, t1))
                self.cpu += time.thread_time() - c0
                self.outbox.put(("step_done", step, metrics, gids, t1, weights))
            else:
                raise ValueError(f"trainer: unknown command {kind!r}")


def _serve_trainer(spec: TrainerRecipe, threads: int, cpus: Sequence[int] | None, inbox: Any, outbox: Any,
                   pack: bool, watch_pid: int | None = None, rank: int = 0, world: int = 1,
                   port: int | None = None, nice: int = 0) -> None:
    """Body of the trainer worker; rank `rank` of `world` (gloo over 127.0.0.1:`port`) when
    world > 1. `nice` > 0 (a process only) lowers its priority so it takes only idle CPU time."""
    name = trainer_name(rank)
    try:
        if nice:
            os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + nice)
        n = claim_cores(threads, cpus)
        if world > 1:
            import datetime

            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=600))
        trainer = build_trainer(spec)
        stream = torch.cuda.Stream(torch.device(spec.device)) if spec.device.startswith("cuda") else None
        loop = (spec.loop or TrainerLoop)(trainer, inbox, outbox, pack, stream.synchronize if stream else (lambda: None),
                                          watch_pid)
        outbox.put(("ready", name, n, _affinity(), _nice()))
        if stream is not None:
            with torch.cuda.stream(stream):
                loop.run()
        else:
            loop.run()
    except BaseException as exc:
        outbox.put(("error", name, repr(exc), traceback.format_exc()))


def _affinity() -> list[int]:
    """The CPUs this process (thread) may run on, as the OS reports them."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _nice() -> int:
    """The calling thread's nice value, as the OS reports it."""
    return os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_trainer(spec: TrainerRecipe, threads: int, cpus: Sequence[int] | None, outbox: Any,
                  backend: str, ranks: int = 1,
                  rank_cpus: Sequence[Sequence[int] | None] | None = None,
                  rank_threads: Sequence[int] | None = None,
                  rank_nice: Sequence[int] | None = None) -> tuple[list[Any], list[Any]]:
    """Start the trainer worker(s): `ranks` data-parallel processes, rank r pinned to
    `rank_cpus[r]` with `rank_threads[r]` (else `threads`) and `rank_nice[r]`. Returns (inboxes,
    handles), rank 0 first."""
    if backend == "process":
        ctx = process_context()
        port = _free_port() if ranks > 1 else None
        inboxes, handles = [], []
        outs = []
        for r in range(ranks):
            inbox = ctx.Queue()
            own = rank_cpus[r] if rank_cpus else cpus
            n = rank_threads[r] if rank_threads else threads
            nice = rank_nice[r] if rank_nice else 0
            outs.append(_own_outbox(outbox, trainer_name(r)))
            handles.append(ctx.Process(target=_serve_trainer, name=f"dora-trainer-{r}", daemon=True,
                                       args=(spec, n, own, inbox, outs[-1], True, os.getpid(), r, ranks, port,
                                             nice)))
            inboxes.append(inbox)
        for h in handles:
            h.start()
        _started(list(zip(handles, outs)))
        return inboxes, handles
    else:
        if ranks != 1:
            raise ValueError("a data-parallel trainer needs the process backend")
        inboxes = [queue.SimpleQueue()]
        handles = [threading.Thread(target=_serve_trainer, name="trainer", daemon=True,
                                    args=(spec, threads, cpus, inboxes[0], outbox, False))]
    for h in handles:
        h.start()
    return inboxes, handles

"""Forced orders and injected faults for the runtime's tests: `InstanceLoop` and `TrainerLoop`
subclasses, bare report writers, and `Runtime` mixins that hold instances back (`OthersWait`).

A test passes a loop class to `Runtime(..., instance_loops={instance id: class})` or
`Runtime(..., trainer_loop=class)`; the worker process then runs it instead of the plain loop. They live in the package (not in the tests)
because a worker process is started from the fork server and must import its class by name.
They place a fault or a pause at an exact point of the worker's code, so that a test checks an
order it forced, never one that timing happened to produce.
"""

from __future__ import annotations

import os
import signal
import struct
import time
from typing import Any

from .workers import InstanceLoop, TrainerLoop


def die_mid_message(conn: Any, msg: Any) -> None:
    """Write the first half of `msg` as `Connection.send` would frame it, then SIGKILL the
    calling process: the state of a writer killed in the middle of a write (its channel holds a
    length header and part of the bytes it announced)."""
    from multiprocessing.reduction import ForkingPickler

    buf = bytes(ForkingPickler.dumps(msg))
    os.write(conn.fileno(), struct.pack("!i", len(buf)) + buf[: len(buf) // 2])
    os.kill(os.getpid(), signal.SIGKILL)


class _CutOutbox:
    """Passes reports through until `loop.armed`; the first report of a kind in `loop.kinds` after
    that is cut in the middle of its write (`loop.cut`) or written in full, and the process dies
    (SIGKILL)."""

    def __init__(self, loop: "DieMidReport", outbox: Any) -> None:
        self.loop = loop
        self.outbox = outbox

    def put(self, msg: Any) -> None:
        if msg[0] == "loaded" and msg[2] >= 1:
            self.loop.armed = True
        if self.loop.armed and msg[0] in self.loop.kinds:
            if self.loop.cut:
                die_mid_message(self.outbox.conn, msg)
            self.outbox.put(msg)
            os.kill(os.getpid(), signal.SIGKILL)
        self.outbox.put(msg)


class DieMidReport(InstanceLoop):
    """An instance killed while it writes on its own channel: once it has loaded a version >= 1
    (mid-run), the first "finished" or "export" report it writes is cut in half and its process
    gets SIGKILL (process backend: the outbox is a `PipeOutbox`)."""

    kinds = ("finished", "export")
    cut = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed = False
        self.outbox = _CutOutbox(self, self.outbox)


class _HoldsAStartedSequence(InstanceLoop):
    """Once `armed`, decodes until some unfinished sequence has at least one response token, then
    holds (`holding`: a subclass stops decoding) and reports ("held", iid, request_id, tokens)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed = False
        self.holding = False

    def decode(self) -> None:
        super().decode()
        if self.armed and not self.holding:
            started = [(rid, n) for rid, n in self.engine.progress().items() if n >= 1]
            if started:
                self.holding = True
                self.outbox.put(("held", self.iid, *started[0]))


class HoldForPublish(_HoldsAStartedSequence):
    """Makes a sequence span a weight load (mode `partial`), whatever the timing.

    ("hold",) arms the hold. Once armed, the loop decodes until some unfinished sequence has at
    least one response token, then stops decoding and reports ("held", iid, request_id, tokens);
    the next ("load", ...) lifts the hold (in `partial` it pauses, loads and resumes that sequence
    under the new version); a load before the hold is in force leaves it armed. If the engine has
    no work once the commands waiting are taken, it reports ("hold_missed", iid) and disarms.
    Commands (and the load) are still taken while it holds."""

    def handle(self, cmd: tuple) -> None:
        if cmd[0] == "hold":
            self.armed = True
            return
        if cmd[0] == "load" and self.holding:  # a hold in force ends here (an armed one waits on)
            self.armed = self.holding = False
        super().handle(cmd)

    def can_decode(self) -> bool:
        if self.armed and not self.holding and not self.engine.has_work:
            self.armed = False  # every command of this turn is taken: nothing left to hold
            self.outbox.put(("hold_missed", self.iid))
        return not self.holding and super().can_decode()


class HoldAfterLoad(_HoldsAStartedSequence):
    """A victim that cannot finish its work before it is killed: once it has loaded a version >= 1
    (so after the trainer's first step), the loop decodes until some unfinished sequence has at
    least one response token, then stops decoding for good and reports ("held", iid, request_id,
    tokens). That sequence is still running there, whatever the timing, when a test that kills
    the instance on that report does so. Commands are still taken while it holds (a migrated
    sequence still leaves it)."""

    def handle(self, cmd: tuple) -> None:
        super().handle(cmd)
        if cmd[0] == "load" and cmd[1] >= 1:
            self.armed = True

    def can_decode(self) -> bool:
        return not self.holding and super().can_decode()


class LateFirstLoad:
    """An `InstanceLoop` mixin (list it first): the instance sleeps `late_s` seconds before it
    takes its first ("load", ...) command, an injected delay (a process slow to start its work, as
    under load): the other instances run ahead of it meanwhile (8 tiny steps take about half a
    second). A test whose order must not depend on who starts first runs with it on each side."""

    late_s = 0.5
    _late_done = False

    def handle(self, cmd: tuple) -> None:
        if cmd[0] == "load" and not self._late_done:
            self._late_done = True
            time.sleep(self.late_s)
        super().handle(cmd)  # type: ignore[misc]


class LateInstance(LateFirstLoad, InstanceLoop):
    """A plain instance, late to its first load (`LateFirstLoad`)."""


class LateHoldAfterLoad(LateFirstLoad, HoldAfterLoad):
    """`HoldAfterLoad`, late to its first load (`LateFirstLoad`)."""


class DieMidExport(DieMidReport):
    """Killed in the middle of writing its first "export" (the KV cache of a migrating sequence)."""

    kinds = ("export",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed = True


class DieAfterExport(DieMidReport):
    """Killed (SIGKILL) at its first ("migrate", ...) command: right after it wrote the "export" in
    full (the migrating sequence is on its pipe, unread, and its KV cache, shared memory this
    process hands over on request, can no longer be fetched), or at once when the sequence had
    finished here first (nothing to export), so that a test awaiting its exit never waits in vain."""

    kinds = ("export",)
    cut = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed = True

    def handle(self, cmd: tuple) -> None:
        super().handle(cmd)
        if cmd[0] == "migrate":
            os.kill(os.getpid(), signal.SIGKILL)


class StallUntilMigrate(InstanceLoop):
    """A straggler whatever the timing: the instance decodes while a sequence it holds has no
    response token yet (or it holds fewer than two), and once it holds at least two sequences,
    each with a token (so with a KV cache to export), it reports ("stalled", iid, [request ids])
    once and decodes nothing more until its first ("migrate", ...) command; from then on it is a
    plain instance. Its sequences' groups then gate a step while it holds them, and the
    scheduler's only way on is R5's spread: an idle instance takes an even share of them
    (`Migrate` from this instance). Commands are still taken while it stalls.

    That the stall comes before the run ends, and before any other move, is forced by the
    coordinator (`StalledFirst`): the other instances get no command until the report; a
    runtime without it does not know the report."""

    hold_at = 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.released = False
        self.reported = False

    def handle(self, cmd: tuple) -> None:
        if cmd[0] == "migrate":
            self.released = True
        super().handle(cmd)

    def can_decode(self) -> bool:
        if not self.released:
            progress = self.engine.progress()
            if len(progress) >= self.hold_at and min(progress.values()) >= 1:
                if not self.reported:
                    self.reported = True
                    self.outbox.put(("stalled", self.iid, sorted(progress, key=str)))
                return False
        return super().can_decode()


class OthersWait:
    """A `Runtime` mixin (list it before `Runtime`): every command for an instance not in `alone`
    is held back, in order, until `release()`; the scheduler meanwhile sees those instances
    loading their first version. So what the instances in `alone` do first happens before the
    others take part, whatever the timing (a test forces an order with it, it never waits)."""

    alone: tuple = (0,)
    released = False

    def release(self) -> None:
        self.released = True

    def _flush(self) -> None:
        if self.released:
            return super()._flush()  # type: ignore[misc]
        out = self._outgoing  # type: ignore[has-type]
        self._outgoing = {i: c for i, c in out.items() if i in self.alone}
        super()._flush()  # type: ignore[misc]
        for i, cmds in out.items():
            if i not in self.alone:
                self._outgoing.setdefault(i, []).extend(cmds)


class StalledFirst(OthersWait):
    """`OthersWait` until instance `alone[0]` (`StallUntilMigrate`) reports ("stalled", ...);
    `self.stalled` gets the request ids it stalls on. So that instance stalls holding sequences
    of its first dispatches, whatever the timing. Without it a late one (its process slow to take
    its first load, under load) found the run done by the other (8 tiny steps take about half a
    second: no stall, no move), or could find an old version's stragglers on the other instance,
    which R5 may consolidate onto it (a move the other way) before it stalls. Until the report
    the other instances are loading for the scheduler: no move can target them, and none can
    leave the staller (R5 consolidates only between two holders of a version and spreads only
    onto an idle instance)."""

    stalled: list | None = None

    def _on_message(self, msg: tuple) -> None:
        if msg[0] != "stalled":
            return super()._on_message(msg)  # type: ignore[misc]
        if msg[1] != self.alone[0] or self.stalled is not None:
            raise RuntimeError(f"unexpected {msg!r} (instance {self.alone[0]} stalls, once)")
        self.stalled = list(msg[2])
        self.release()


class StallUntilMigrateThenGo(StallUntilMigrate):
    """`StallUntilMigrate` stalling on four sequences (each with a token), and after its first
    ("migrate", ...) command stalling on until ("go",): it exports what it is told to (commands
    are still taken), decodes nothing. A coordinator that sends "go" decides when the sequences it
    kept finish, so when the instance runs dry and the scheduler plans it idle (R5 may spread onto
    it then); the plain loop never gets "go"."""

    hold_at = 4

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.go = False

    def handle(self, cmd: tuple) -> None:
        if cmd[0] == "go":
            self.go = True
            return
        super().handle(cmd)

    def can_decode(self) -> bool:
        return (self.go or not self.released) and super().can_decode()


class StallAfterImport(InstanceLoop):
    """A destination that keeps what it took in: once it imported a migrated sequence it decodes
    nothing until its first ("migrate", ...) command, from then on it is a plain instance.
    Commands are still taken while it stalls (a second import, the move that releases it). The
    sequences it imported then run here only, whatever the timing, until the scheduler moves one
    of them on: which R5 does only after `MigrationLanded` for it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.holding = False
        self.released = False

    def handle(self, cmd: tuple) -> None:
        if cmd[0] == "migrate":
            self.released = True
        super().handle(cmd)
        if cmd[0] == "import" and not self.released:
            self.holding = True

    def can_decode(self) -> bool:
        return (self.released or not self.holding) and super().can_decode()


class StallThenDieAfterExport(StallUntilMigrate, DieAfterExport):
    """`StallUntilMigrate`, killed (SIGKILL) right after it wrote its first export in full
    (`DieAfterExport`): the source of a forced migration dies before the coordinator reads it."""


class DieAfterImport(InstanceLoop):
    """Killed (SIGKILL) right after it took in a migrated sequence (its "imported" report is
    written): the destination of a migration dies with the sequence in its engine."""

    def handle(self, cmd: tuple) -> None:
        super().handle(cmd)
        if cmd[0] == "import":
            os.kill(os.getpid(), signal.SIGKILL)


class LateDieAfterImport(LateFirstLoad, DieAfterImport):
    """`DieAfterImport`, late to its first load (`LateFirstLoad`)."""


class LateStallUntilMigrate(LateFirstLoad, StallUntilMigrate):
    """`StallUntilMigrate`, late to its first load (`LateFirstLoad`)."""


class LateStallThenDieAfterExport(LateFirstLoad, StallThenDieAfterExport):
    """`StallThenDieAfterExport`, late to its first load (`LateFirstLoad`)."""


class _DyingTrainerOutbox:
    def __init__(self, outbox: Any, at_version: int) -> None:
        self.outbox = outbox
        self.at_version = at_version

    def put(self, msg: Any) -> None:
        self.outbox.put(msg)
        if msg[0] == "checkpointed" and msg[1] >= self.at_version:
            os.kill(os.getpid(), signal.SIGKILL)


class DieAfterCheckpoint(TrainerLoop):
    """A trainer killed (SIGKILL) right after it reported its checkpoint of a version >= 4: the
    report is complete on its pipe, the coordinator has not read it yet."""

    at_version = 4

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outbox = _DyingTrainerOutbox(self.outbox, self.at_version)


class DieMidCheckpoint(TrainerLoop):
    """A trainer killed (SIGKILL) in the middle of writing its checkpoint of a version >= 4: half
    of the file is on disk (where the atomic write puts it before renaming), nothing is reported."""

    at_version = 4

    def handle_checkpoint(self, path: str) -> None:
        import io

        import torch

        if self.trainer.version < self.at_version:
            return super().handle_checkpoint(path)
        buf = io.BytesIO()
        torch.save({"policy": self.trainer.policy.state_dict()}, buf)
        with open(path + ".tmp", "wb") as fh:
            fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        os.kill(os.getpid(), signal.SIGKILL)


class DieAfterReport(DieMidReport):
    """Killed right after it wrote its first "finished" report in full: the report is on its pipe,
    unread, when the process is gone."""

    kinds = ("finished",)
    cut = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed = True


class DieInAllreduce(TrainerLoop):
    """Data parallel: trainer rank `victim` is killed (SIGKILL) at its first gradient allreduce of
    a step >= `at_step`, right before it joins it: its peer is then in that allreduce (or about to
    enter it) and can only leave it through the failed collective. `FailInAllreduce` raises an
    error there instead (the rank reports it and exits, as a rank with a bug of its own would)."""

    victim = 1
    at_step = 2
    fail = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if rank != self.victim:
            return
        allreduce = self.trainer._allreduce

        def dying(units: float) -> float:
            if self.trainer.version >= self.at_step:
                if self.fail:
                    raise ValueError(f"injected error on trainer rank {rank} at step {self.trainer.version}")
                os.kill(os.getpid(), signal.SIGKILL)
            return allreduce(units)

        self.trainer._allreduce = dying


class DieInAllreduceRank0(DieInAllreduce):
    """`DieInAllreduce` killing rank 0 (the rank that reports every step)."""

    victim = 0


class FailInAllreduce(DieInAllreduce):
    """`DieInAllreduce` whose rank 1 raises an error of its own instead of being killed."""

    fail = True


# ---------------------------------------------------------------------------------- bare writers
def report_then_die_mid_message(outbox: Any, first: Any, cut: Any) -> None:
    """A worker process that reports `first`, then dies (SIGKILL) half-way through writing `cut`."""
    outbox.put(first)
    die_mid_message(outbox.conn, cut)


def report_when_told(outbox: Any, go: Any, messages: list) -> None:
    """A worker process that reports each of `messages` when it receives a word on `go`."""
    for msg in messages:
        go.recv()
        outbox.put(msg)


def report_then_die(outbox: Any, messages: list) -> None:
    """A worker process that reports each of `messages` in full, then dies (SIGKILL) before any is
    read. A message holding a tensor is then unreadable: its shared memory is handed over by this
    process on request, as a migrating sequence's KV cache is."""
    for msg in messages:
        outbox.put(msg)
    os.kill(os.getpid(), signal.SIGKILL)

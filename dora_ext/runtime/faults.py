"""Forced orders and injected faults for the runtime's tests: `InstanceLoop`/`TrainerLoop`
subclasses, bare report writers, and `Runtime` mixins that hold instances back (`OthersWait`).

Tests pass them as `Runtime(..., instance_loops={iid: class})` or `trainer_loop=class`. They live
in the package because the fork server's worker imports its class by name. Each places a fault or
pause at an exact point, so a test checks an order it forced, never one timing produced.
"""

from __future__ import annotations

import os
import signal
import struct
import time
from typing import Any

from .workers import InstanceLoop, TrainerLoop


def die_mid_message(conn: Any, msg: Any) -> None:
    """Write the first half of `msg` as `Connection.send` frames it, then SIGKILL the calling
    process: a writer killed mid-write (a length header and part of the bytes it announced)."""
    from multiprocessing.reduction import ForkingPickler

    buf = bytes(ForkingPickler.dumps(msg))
    os.write(conn.fileno(), struct.pack("!i", len(buf)) + buf[: len(buf) // 2])
    os.kill(os.getpid(), signal.SIGKILL)


class _CutOutbox:
    """Passes reports through until `loop.armed`; then the first report of a kind in `loop.kinds`
    is cut mid-write (`loop.cut`) or written in full, and the process is SIGKILLed."""

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
    """Once it has loaded a version >= 1, its first "finished" or "export" report is cut in half
    and its process SIGKILLed (process backend: the outbox is a `PipeOutbox`)."""

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

    ("hold",) arms it: decode until an unfinished sequence has a response token, then stop and
    report ("held", iid, request_id, tokens); the next ("load", ...) lifts the hold. With no work
    left it reports ("hold_missed", iid) and disarms. Commands are still taken while it holds."""

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
    """A victim that cannot finish before it is killed: after loading a version >= 1 it stops for
    good once a sequence has a response token, reporting ("held", iid, request_id, tokens)."""

    def handle(self, cmd: tuple) -> None:
        super().handle(cmd)
        if cmd[0] == "load" and cmd[1] >= 1:
            self.armed = True

    def can_decode(self) -> bool:
        return not self.holding and super().can_decode()


class LateFirstLoad:
    """An `InstanceLoop` mixin (list it first): sleep `late_s` seconds before the first ("load",
    ...), so the other instances run ahead; tests run it on each side to rule out start order."""

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
    """SIGKILLed at its first ("migrate", ...): right after writing the "export" in full (its KV
    cache then unfetchable), or at once if the sequence already finished here."""

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
    """A straggler whatever the timing: once it holds at least two sequences, each with a response
    token, it reports ("stalled", iid, [request ids]) and decodes nothing until its first
    ("migrate", ...), then is a plain instance. Its groups then gate a step, and R5's spread is
    the scheduler's only way on. Commands are still taken while it stalls. Pair it with
    `StalledFirst` so that the stall precedes every other move."""

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
    """A `Runtime` mixin (list it before `Runtime`): commands for instances not in `alone` are held
    back, in order, until `release()`, so what `alone` does first happens before the others join."""

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
    `self.stalled` gets its request ids. Until then the other instances are loading, so no move can
    target them or leave the staller: it stalls on its first dispatches, whatever the timing."""

    stalled: list | None = None

    def _on_message(self, msg: tuple) -> None:
        if msg[0] != "stalled":
            return super()._on_message(msg)  # type: ignore[misc]
        if msg[1] != self.alone[0] or self.stalled is not None:
            raise RuntimeError(f"unexpected {msg!r} (instance {self.alone[0]} stalls, once)")
        self.stalled = list(msg[2])
        self.release()


class StallUntilMigrateThenGo(StallUntilMigrate):
    """`StallUntilMigrate` on four sequences, and after its first ("migrate", ...) it stays
    stalled until ("go",): it exports what it is told, decodes nothing. The coordinator's "go"
    decides when it runs dry (and R5 may spread onto it)."""

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
    """A destination that keeps what it took in: after an import it decodes nothing until its
    first ("migrate", ...), then is a plain instance. Commands are still taken while it stalls."""

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
    """Data parallel: rank `victim` is SIGKILLed right before its first gradient allreduce of a
    step >= `at_step`, so its peer fails that collective. `FailInAllreduce` raises there instead."""

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
    """A worker process that reports each of `messages` in full, then is SIGKILLed before any is
    read, so a message holding a tensor (shared memory this process hands over) is unreadable."""
    for msg in messages:
        outbox.put(msg)
    os.kill(os.getpid(), signal.SIGKILL)

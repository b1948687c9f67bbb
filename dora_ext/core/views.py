"""Read-only views of the scheduler's live groups and trajectories, for hosts, tests and debugging."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._state import _LETTERS, _NO_INSTANCE, _STATES


class GroupView:
    """A read-only view of one live group (`Scheduler.groups[gid]`): `gid`, `version`, `state`
    ("active", "complete", "assigned", "trained", "failed"), `step`, `meta`, `seq`, `key`,
    `done`, `live`, `complete_seq`, `in_queue`, read from the scheduler's arrays when accessed.
    Once the group leaves the scheduler its slot is reused, so reading the view then raises
    `LookupError` naming the group (`gid` stays readable)."""

    __slots__ = ("_s", "_g", "_q", "_gid")

    def __init__(self, sched: "Scheduler", slot: int) -> None:
        # The slot and the group's admission number: a slot reused by a later group (even one
        # admitted under the same id) has another number.
        self._s, self._g, self._q, self._gid = sched, slot, sched._group_seq[slot], sched._gid_of[slot]

    def _slot(self) -> int:
        return _live_slot(self._s, self._g, self._q, f"group {self._gid!r}")

    gid = property(lambda self: self._gid)
    version = property(lambda self: self._s._group_version[self._slot()])
    seq = property(lambda self: self._s._group_seq[self._slot()])
    key = property(lambda self: self._s._key_of(self._slot()))
    meta = property(lambda self: self._s._group_meta.get(self._slot()))
    state = property(lambda self: _STATES[self._s._group_state[self._slot()]])
    step = property(lambda self: None if (x := self._s._group_step[self._slot()]) < 0 else x)
    complete_seq = property(lambda self: None if (x := self._s._group_cseq[self._slot()]) < 0 else x)
    done = property(lambda self: self._s._group_done[self._slot()])
    live = property(lambda self: self._s._group_live[self._slot()])
    in_queue = property(lambda self: bool(self._s._group_in_queue[self._slot()]))

    def __repr__(self) -> str:
        try:
            return f"GroupView(gid={self.gid!r}, version={self.version}, state={self.state!r})"
        except LookupError:
            return f"GroupView(gid={self._gid!r}, left the scheduler)"


def _live_slot(sched: "Scheduler", g: int, seq: int, what: str) -> int:
    """Slot `g` if it still holds the group admitted as number `seq`; else `LookupError`."""
    if g not in sched._gid_of or sched._group_seq[g] != seq:
        raise LookupError(f"{what} left the scheduler with its group (trained, or failed and retired): "
                          f"this view of it is no longer valid")
    return g


class _Groups(Mapping):
    """`Scheduler.groups`: the live groups by id, as read-only `GroupView`s."""

    __slots__ = ("_s",)

    def __init__(self, sched: "Scheduler") -> None:
        self._s = sched

    def __getitem__(self, gid: Any) -> GroupView:
        return GroupView(self._s, self._s._slot_of[gid])

    def __contains__(self, gid: Any) -> bool:
        return gid in self._s._slot_of

    def __iter__(self):
        return iter(self._s._slot_of)

    def __len__(self) -> int:
        return len(self._s._slot_of)


class TrajectoryView:
    """A read-only view of one live trajectory (`Scheduler.trajectory`), for tests and debugging.
    Once its group leaves the scheduler, reading it raises `LookupError` naming the trajectory."""

    __slots__ = ("_s", "_h", "_q", "_gid")

    def __init__(self, sched: "Scheduler", h: int) -> None:
        g = h // sched.n
        self._s, self._h, self._q, self._gid = sched, h, sched._group_seq[g], sched._gid_of[g]

    def _handle(self) -> int:
        s, h = self._s, self._h
        _live_slot(s, h // s.n, self._q, f"trajectory {self._gid!r}/{h % s.n}")
        return h

    status = property(lambda self: _LETTERS[self._s._traj_status[self._handle()]])
    instance = property(lambda self: None if (i := self._s._traj_instance[self._handle()]) == _NO_INSTANCE else i)
    attempt = property(lambda self: self._s._traj_attempt[self._handle()])
    tokens = property(lambda self: self._s._traj_tokens[self._handle()])
    versions = property(lambda self: self._s._versions(self._handle()))
    retries = property(lambda self: self._s._traj_retries[self._handle()])
    moved = property(lambda self: bool(self._s._traj_moved[self._handle()]))
    reward = property(lambda self: None if (r := self._s._traj_reward[self._handle()]) != r else r)

"""The live groups and trajectories as flat per-slot arrays (no object per group or trajectory)."""

from __future__ import annotations

from array import array
from typing import Any

from ._state import (_ACTIVE, _LETTERS, _MULTI, _NAN, _NO_INSTANCE, _NO_STAMP, _NO_VERSION, _RUNNING)
from .errors import ProtocolError, _brief


def _vlist(vs: int | list[int] | None, base: int) -> list[int]:
    """A trajectory's versions relative to `base`, as the snapshot stores them (a list)."""
    if vs is None:
        return []
    if type(vs) is int:
        return [vs - base]
    return [x - base for x in vs]


class _Table:
    """The live groups and trajectories (mixed into `Scheduler`)."""

    def _init_table(self) -> None:
        """The empty table (group size `self.n`)."""
        # Live groups only. A group is an integer slot `g` (per-slot arrays and dicts), its
        # trajectories the handles `g * n + index`: no object per group or trajectory for the GC
        # to walk. Slots are reused once their group leaves (`_free`); ids map to slots only at
        # the event boundary (`_slot_of`) and back in actions (`_gid_of`).
        self._slot_of: dict[Any, int] = {}  # group id -> slot
        self._gid_of: dict[int, Any] = {}  # slot -> group id
        self._group_version = array("q")  # version it was admitted under
        self._group_seq = array("q")  # admission order
        self._group_state = array("b")  # state (`_ACTIVE` ...)
        self._group_step = array("q")  # trainer step it is assigned to (-1: none)
        self._group_cseq = array("q")  # completion order (-1: not complete)
        self._group_done = array("q")  # trajectories with their reward
        self._group_live = array("q")  # trajectories running or awaiting their reward
        self._group_in_queue = array("b")  # in its version's queue heap
        # Pending trajectories (queued, in dispatch order) are `reversed(_group_retry[g]) +
        # range(_group_next[g], n)`: fresh ones in index order behind the re-queued ones (a stack,
        # the last re-queued first).
        self._group_next = array("q")
        self._group_retry: dict[int, list[int]] = {}  # slot -> re-queued trajectories (when any)
        self._group_key: dict[int, tuple] = {}  # slot -> admission key, when not the default `(seq,)`
        self._group_meta: dict[int, Any] = {}  # slot -> meta, when not None
        # Trajectory state, one entry per handle, per field.
        self._traj_status = array("b")  # status (`_QUEUED` ...)
        self._traj_attempt = array("q")  # attempt
        self._traj_retries = array("q")  # retries
        self._traj_moved = array("b")  # moved once in this attempt (never moved twice: it may be in flight)
        self._traj_reward = array("d")  # reward (NaN: none yet)
        self._traj_instance = array("q")  # instance running it (`_NO_INSTANCE`: none)
        self._traj_stamp = array("q")  # the stamp of its placement on an instance (`_Instance`; `_NO_STAMP`: none)
        self._pseq = 0  # the next placement stamp (derived state: not snapshotted)
        self._traj_tokens = array("q")  # tokens
        # The version that generated it (`_NO_VERSION`: none yet), or `_MULTI`: several, listed in `_traj_versions`
        # (`partial` only, where a preempted trajectory resumes under a newer version).
        self._traj_version = array("q")
        self._traj_versions: dict[int, list[int]] = {}
        self._free: list[int] = []  # free slots
        self._zero_b = array("b", bytes(self.n))
        self._zero_q = array("q", [0]) * self.n
        self._nan_d = array("d", [_NAN]) * self.n
        self._noi = array("q", [_NO_INSTANCE]) * self.n
        self._nov = array("q", [_NO_VERSION]) * self.n
        self._nop = array("q", [_NO_STAMP]) * self.n

    def _group(self, gid: Any, attempt: int | None = None) -> int | None:
        """The live group `gid`. A trajectory event carrying an `attempt` for a group that is no
        longer held (trained, or failed and retired) is a late report: counted and ignored."""
        g = self._slot_of.get(gid)
        if g is None:
            if attempt is not None:
                self.m["stale_events"] += 1
                return None
            raise ProtocolError(f"unknown group {gid!r} (never admitted, or already trained/failed)")
        return g

    def _traj(self, g: int, idx: int) -> int:
        """The handle of trajectory `idx` of group slot `g`."""
        if not 0 <= idx < self.n:
            raise ProtocolError(f"group {self._gid_of[g]!r} has no trajectory {idx} (group size {self.n})")
        return g * self.n + idx

    def _running_traj(self, gid: Any, idx: int, attempt: int | None) -> int | None:
        g = self._group(gid, attempt)
        if g is None:
            return None
        h = self._traj(g, idx)
        if attempt is not None and attempt != self._traj_attempt[h]:
            self.m["stale_events"] += 1
            return None
        if self._traj_status[h] != _RUNNING:
            raise ProtocolError(f"trajectory {gid!r}/{idx} is not running ({_LETTERS[self._traj_status[h]]})")
        return h

    def _key(self, h: int) -> tuple[Any, int]:
        """The runtime's name `(group_id, index)` of handle `h` (at the event boundary only)."""
        g, idx = divmod(h, self.n)
        return (self._gid_of[g], idx)

    def _key_of(self, g: int) -> tuple:
        """Group slot `g`'s admission key."""
        key = self._group_key.get(g)
        return (self._group_seq[g],) if key is None else key

    def _pending(self, g: int) -> list[int]:
        """Group slot `g`'s pending trajectories' indices, in dispatch order."""
        retry = self._group_retry.get(g)
        return (retry[::-1] if retry else []) + list(range(self._group_next[g], self.n))

    def _alloc(self) -> int:
        """A free group slot, its group fields and `n` trajectory handles in their initial
        state (version, seq, key and meta are the caller's to set)."""
        n = self.n
        if self._free:
            g = self._free.pop()
            sl = slice(g * n, g * n + n)  # (one slice object for the nine resets)
            zb, zq = self._zero_b, self._zero_q
            self._traj_status[sl] = zb
            self._traj_attempt[sl] = zq
            self._traj_retries[sl] = zq
            self._traj_moved[sl] = zb
            self._traj_reward[sl] = self._nan_d
            self._traj_instance[sl] = self._noi
            self._traj_stamp[sl] = self._nop  # (a failed instance's handles kept their stamp)
            self._traj_tokens[sl] = zq
            self._traj_version[sl] = self._nov
            self._group_state[g] = _ACTIVE
            self._group_step[g] = -1
            self._group_cseq[g] = -1
            self._group_done[g] = self._group_live[g] = self._group_in_queue[g] = self._group_next[g] = 0
            return g
        g = len(self._group_version)
        self._traj_status.extend(self._zero_b)
        self._traj_attempt.extend(self._zero_q)
        self._traj_retries.extend(self._zero_q)
        self._traj_moved.extend(self._zero_b)
        self._traj_reward.extend(self._nan_d)
        self._traj_instance.extend(self._noi)
        self._traj_stamp.extend(self._nop)
        self._traj_tokens.extend(self._zero_q)
        self._traj_version.extend(self._nov)
        for a in (self._group_version, self._group_seq, self._group_done, self._group_live, self._group_next):
            a.append(0)
        self._group_state.append(_ACTIVE)
        self._group_in_queue.append(0)
        self._group_step.append(-1)
        self._group_cseq.append(-1)
        return g

    def _release_slot(self, g: int) -> None:
        """Group slot `g` left the scheduler: it is free for the next admitted group."""
        del self._gid_of[g]
        self._group_key.pop(g, None)
        self._group_meta.pop(g, None)
        self._group_retry.pop(g, None)
        self._free.append(g)
        if self._traj_versions:
            for h in range(g * self.n, (g + 1) * self.n):
                self._traj_versions.pop(h, None)

    def _versions(self, h: int) -> int | list[int] | None:
        """Trajectory `h`'s versions: None, the one version, or a list of several."""
        v = self._traj_version[h]
        return v if v >= 0 else None if v == _NO_VERSION else self._traj_versions[h]

    def _clear_versions(self, h: int) -> None:
        if self._traj_version[h] == _MULTI:
            del self._traj_versions[h]
        self._traj_version[h] = _NO_VERSION

    def _set_tokens(self, h: int, tokens: Any) -> None:
        try:
            self._traj_tokens[h] = tokens
        except (TypeError, OverflowError):
            raise ProtocolError(f"trajectory {self._key(h)!r}: tokens must be an integer (64-bit), "
                                f"got {_brief(tokens)}") from None

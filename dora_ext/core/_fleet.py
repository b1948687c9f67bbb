"""The fleet: rollout instances, their occupancy levels per version, placement, dispatch (R6),
release, moves, and the per-instance planning of R4 (switch when drained)."""

from __future__ import annotations

import heapq
import numbers
from array import array

from . import actions as A
from ._state import _ANY, _Level, _NO_INSTANCE, _NO_STAMP, _RUNNING, _drop_one
from .errors import ProtocolError, _brief


class _Instance:
    """A rollout instance. What it runs is an append-only log of (handle, placement stamp) pairs;
    an entry is live while the handle's stamp (`_traj_stamp[h]`) is still that one, and `nrun`
    counts live entries, so a departure touches no per-instance table. The log is cleared at
    `nrun` 0 and compacted when over three times its live entries + 32 (`_place`)."""

    __slots__ = ("id", "capacity", "version", "loading", "nrun", "log", "_traj_stamp")

    def __init__(self, iid: int, capacity: int, tp: array) -> None:
        self.id = iid
        self.capacity = capacity
        self.version: int | None = None  # loaded version (None: nothing loaded yet)
        self.loading: int | None = None  # version being loaded
        self.nrun = 0  # trajectories running here
        self.log = array("q")  # placed handles and their stamps, h0, p0, h1, p1, ... (live and dead)
        self._traj_stamp = tp  # the scheduler's per-handle placement stamps

    @property
    def running(self) -> dict[int, None]:
        """The handles running here, in placement (dispatch) order (built on each access: for
        the cold paths; the hot ones read `nrun`)."""
        return dict.fromkeys(self.live())

    def live(self) -> list[int]:
        """The handles running here, in placement order, as a list."""
        tp = self._traj_stamp
        it = iter(self.log)
        return [h for h, p in zip(it, it) if tp[h] == p]

    def _drop(self) -> None:
        """One trajectory left (its `_traj_instance` changed): the log is cleared when none is left."""
        self.nrun -= 1
        if not self.nrun:
            del self.log[:]

    @property
    def target(self) -> int | None:
        return self.loading if self.loading is not None else self.version


class _Fleet:
    """The rollout instances (mixed into `Scheduler`)."""

    def _init_fleet(self) -> None:
        """No instance yet."""
        self.instances: dict[int, _Instance] = {}
        self._targets: dict[int, int] = {}  # version -> instances loaded with or loading it
        self._idle: dict[int, None] = {}  # instances running nothing and loading nothing
        self._n_loading = 0  # instances loading a version
        # Loaded instances by bucket and running count (level), each level in arrival order:
        # dispatch serves the least loaded first (R6 fair share), R5 finds holders by level.
        self._levels: dict[int, dict[int, dict[int, None]]] = {}
        self._low_level: dict[int, int] = {}  # bucket -> a level <= the lowest non-empty one
        self._holders: dict[int, int] = {}  # bucket -> loaded instances running at least one trajectory
        self._uniform = True  # every instance has the same capacity (fair share is O(1) then)
        self._cap_max = 1  # the largest instance capacity seen (R5's packing bound)

    def _stale_instance(self, iid: int) -> bool:
        """A late event from an instance declared failed: counted and ignored. An id at or below
        `_id_max` neither registered now nor on the trainer's side has failed (hosts give a
        restarted engine a fresh, larger id)."""
        if iid in self.instances or not isinstance(iid, numbers.Integral) or iid > self._id_max:
            return False
        if iid in self._trainer_side or iid in self._to_trainer or iid in self._to_rollout:
            return False  # lent to the trainer, not failed: `_instance` raises
        self.m["stale_events"] += 1
        return True

    def _instance(self, iid: int) -> _Instance:
        try:
            return self.instances[iid]
        except KeyError:
            raise ProtocolError(f"unknown (or failed) instance {iid!r}") from None

    def _bucket(self, version: int) -> int:
        return version if self._pinned else _ANY

    def _add_instance(self, iid: int, capacity: int, lend: bool = True) -> None:
        if not isinstance(iid, numbers.Integral) or not _NO_INSTANCE < iid < 2**63:
            raise ProtocolError(f"instance id {_brief(iid)}: expected a 64-bit integer")
        self.instances[iid] = inst = _Instance(iid, capacity, self._traj_stamp)
        if iid > self._id_max:
            self._id_max = iid
        if capacity != self._cap_max and self.instances.keys() - {iid}:
            self._uniform = False
        if capacity > self._cap_max:
            self._cap_max = capacity
        self._idle[iid] = None
        self._plan_instance(inst, lend=lend)

    def _start_load(self, inst: _Instance, version: int, preempt: bool = False) -> None:
        """`inst` loads `version`; `preempt` (partial): its running trajectories pause meanwhile."""
        old = inst.target
        if old is not None:
            _drop_one(self._targets, old)
            ob = self._bucket(old)
            self._cap[ob] -= inst.capacity
            self._occupied[ob] -= inst.nrun
            if inst.loading is None:
                self._set_level(ob, inst.id, inst.nrun, None)
        nb = self._bucket(version)
        self._cap[nb] = self._cap.get(nb, 0) + inst.capacity
        self._occupied[nb] = self._occupied.get(nb, 0) + inst.nrun
        self._targets[version] = self._targets.get(version, 0) + 1
        if inst.loading is None:
            self._n_loading += 1
        inst.loading = version
        self._idle.pop(inst.id, None)
        self._out.append(A.LoadVersion(inst.id, version, tuple(map(self._key, inst.running)) if preempt else ()))

    def _set_level(self, b: int, iid: int, old: int | None, new: int | None) -> None:
        """Loaded instance `iid` of bucket `b` went from `old` to `new` running trajectories
        (None: not loaded in `b`). Keeps the levels, the low-level hint and the holder count; when
        the count reaches 0, R5's records of the bucket go (`_forget_r5`; `_move` too)."""
        levels = self._levels.get(b)
        if levels is None:
            levels = self._levels[b] = {}
            self._low_level[b] = new if new is not None else 0
        if old is not None:
            d = levels[old]
            del d[iid]
            if not d:
                del levels[old]
        if new is not None:
            d = levels.get(new)
            if d is None:
                levels[new] = d = _Level()
            d[iid] = self.instances[iid]
            if new < self._low_level[b]:
                self._low_level[b] = new
        elif not levels:
            del self._levels[b], self._low_level[b]
        if bool(old) != bool(new):  # (it became a holder, or stopped being one)
            if new:
                self._holders[b] = self._holders.get(b, 0) + 1
            elif self._holders[b] > 1:
                self._holders[b] -= 1
            else:
                del self._holders[b]
                self._forget_r5(b)

    def _forget_r5(self, b: int) -> None:
        """R5's records of bucket `b` go: its holder count reached (or, in `_move`, passed through) 0."""
        self._r5_tried.pop(b, None)
        self._r5_stuck.pop(b, None)

    def _pick(self, b: int, lv: dict, work: int, share_of: int) -> _Instance | None:
        """The instance of bucket `b` that takes the next trajectory: the least loaded (first to
        arrive at its level), unless full or at its fair share of `work` (by capacity, counting
        instances still loading, so the first one loaded does not take a whole batch)."""
        lo = self._low_level[b]
        while lo not in lv:
            lo += 1
        self._low_level[b] = lo
        inst = self.instances[next(iter(lv[lo]))]
        cap = inst.capacity
        if lo < cap and lo < -(-work * cap // share_of):
            return inst
        if self._uniform:
            return None  # everyone else runs at least as much and has the same capacity and share
        for level in sorted(lv):
            for iid in lv[level]:
                inst = self.instances[iid]
                cap = inst.capacity
                if level < cap and level < -(-work * cap // share_of):
                    return inst
        return None

    def _dispatch(self, b: int) -> None:
        """Give free slots of bucket `b` to its queued trajectories, group-major (R6): the group
        at the head of the queue fills first, each trajectory going to `_pick`'s instance. (The
        one hand-tuned path: `_pick`, `_place` and `_set_level` are inlined in its loop.)"""
        heap = self._queue.get(b)
        lv = self._levels.get(b)
        if not heap or not lv:
            return
        gslot = self._slot_of
        n = self.n
        ts, ti, tm, tv, ta = self._traj_status, self._traj_instance, self._traj_moved, self._traj_version, self._traj_attempt
        gretry, gnext, glive = self._group_retry, self._group_next, self._group_live
        share_of = self._cap[b]
        work = self._occupied[b] + self._queued[b]  # constant here: each dispatch moves one over
        append = self._out.append
        Dispatch = A.Dispatch
        uniform = self._uniform
        lo_of = self._low_level
        lo = lo_of[b]
        heappop = heapq.heappop
        tp, pseq = self._traj_stamp, self._pseq
        fcap = limit = -1  # the capacity `limit` was computed for: min(capacity, fair share)
        level = up = None  # lv[lo] (None: look it up) and lv[up_of + 1] (up_of -1: look it up)
        up_of = -1
        sent = 0
        # The head group's slot (-1: read the heap's head again); its state is kept in locals
        # (`retry`, `nxt`, `added`) and written back when it leaves the head or the loop ends.
        g = -1
        retry = None
        nxt = added = 0
        while True:
            if g < 0:
                if not heap:
                    break
                gid = heap[0][2]
                g = gslot.get(gid)
                if g is None:
                    heappop(heap)
                    g = -1
                    continue
                retry = gretry.get(g)
                nxt = gnext[g]
                added = 0
            if retry is None and nxt >= n:
                heappop(heap)  # nothing left to start in this group
                self._group_in_queue[g] = 0
                gnext[g] = nxt
                glive[g] += added
                g = -1
                continue
            # `_pick`, inlined for equal capacities: the least loaded, first-arrived instance is
            # popped from its level (put back in front if it takes nothing); `level` and `up` are
            # cached across trajectories while no other code touches the levels.
            if level is None:
                while lo not in lv:
                    lo += 1
                level = lv[lo]
            iid, inst = level.popitem(False)
            cap = inst.capacity
            if cap != fcap:
                fcap = cap
                limit = min(cap, -(-work * cap // share_of))
            if lo >= limit:
                level[iid] = inst  # (back in front of its level: the levels are as they were)
                level.move_to_end(iid, False)
                if uniform:
                    break
                lo_of[b] = lo
                inst = self._pick(b, lv, work, share_of)
                if inst is None:
                    break
                iid = inst.id
                n_run = inst.nrun
                d = lv[n_run]
                del d[iid]
                if not d:
                    del lv[n_run]
                level = None  # (either cached level may be the one just emptied)
                up_of = -1
            else:
                n_run = lo
                if not level:
                    del lv[lo]
                    level = None
            if retry is not None:
                idx = retry.pop()
                if not retry:
                    del gretry[g]
                    retry = None
            else:
                idx = nxt
                nxt += 1
            h = g * n + idx
            ver = inst.version
            ts[h] = _RUNNING
            ti[h] = iid
            tm[h] = 0
            tv[h] = ver
            added += 1
            # `_place`, inlined: logged on the instance under a fresh stamp
            tp[h] = pseq
            log = inst.log
            if len(log) > 6 * n_run + 64:  # (more than 3 * n_run + 32 entries)
                self._compact(inst)
                log = inst.log
            log.append(h)
            log.append(pseq)
            inst.nrun = n_run + 1
            pseq += 1
            # one level up (`_set_level`, inlined)
            if up_of != n_run:
                up = lv.get(n_run + 1)
                if up is None:
                    lv[n_run + 1] = up = _Level()
                up_of = n_run
            up[iid] = inst
            if not n_run:
                self._idle.pop(iid, None)
                self._holders[b] = self._holders.get(b, 0) + 1
            sent += 1
            append(Dispatch(gid, idx, iid, ver, ta[h]))
        if g >= 0:
            gnext[g] = nxt
            glive[g] += added
        lo_of[b] = lo
        self._pseq = pseq
        if sent:
            self._n_sent += sent
            self._occupied[b] += sent
            self._queued[b] -= sent
        if not heap and self._queued.get(b) == 0 and b != (self.newest if self._pinned else _ANY):
            del self._queue[b], self._queued[b]  # keep per-version dicts as short as the live set

    def _release(self, h: int) -> None:
        """Running trajectory `h` left its instance (finished or failed)."""
        ti = self._traj_instance
        inst = self.instances.get(ti[h])
        ti[h] = _NO_INSTANCE
        self._traj_stamp[h] = _NO_STAMP  # its log entry is dead
        if inst is None:
            return
        inst._drop()
        if inst.loading is not None:
            # partial: preempted while loading; it stops counting against the version it loads.
            self._occupied[self._bucket(inst.loading)] -= 1
            return
        v = inst.version
        b = v if self._pinned else _ANY
        self._occupied[b] -= 1
        n_run = inst.nrun
        self._set_level(b, inst.id, n_run + 1, n_run)
        # The rest only when the instance emptied, its version has queued work, or (R5) it runs an
        # old version.
        if not n_run or self._queue.get(b) or (self._migrate and v < self.newest):
            self._release_rest(inst, v, b, n_run)

    def _release_rest(self, inst: _Instance, v: int, b: int, n_run: int) -> None:
        """`_release` once the levels are updated: dispatch into the freed slot, plan an emptied
        instance (R4), consider R5."""
        if self._queue.get(b):
            self._dispatch(b)
            n_run = inst.nrun  # (the dispatch may have given the instance new work)
        if not n_run:
            self._idle[inst.id] = None
            self._plan_instance(inst)
        elif (self._migrate and v < self.newest and v + self.K > self.step
              and self._queued.get(v, 0) <= 0 and self._holders.get(v, 0) >= 2
              and self._occupied.get(v, 0) <= self.config.migrate_threshold * self._cap.get(v, 0)
              and (self._budget_left() > 0 or self._queued.get(self._bucket(self.newest), 0) > 0)):
            # (`_maybe_consolidate`'s first O(1) tests, inlined: this runs on every old finish)
            self._maybe_consolidate(v)

    def _move(self, v: int, h: int, s: _Instance, d: _Instance) -> None:
        """R5: running trajectory `h` moves from `s` to `d`, both loaded with `v` (`s` is not `d`)."""
        ns, nd = s.nrun, d.nrun
        holders = self._holders[v]
        if holders == 1 or (holders == 2 and ns == 1 and nd):
            # Counted out at the source before in at the destination, the holder count passes
            # through 0 (a sole holder spreading; the move that empties one of two holders).
            self._forget_r5(v)
        self._traj_instance[h] = d.id
        s._drop()
        self._place(d, h)
        self._set_level(v, s.id, ns, ns - 1)
        self._set_level(v, d.id, nd, nd + 1)
        self._traj_moved[h] = 1
        if ns == 1:
            self._idle[s.id] = None
        self.m["migrations"] += 1
        g, idx = divmod(h, self.n)
        self._out.append(A.Migrate(self._gid_of[g], idx, s.id, d.id, v))

    def _place(self, inst: _Instance, h: int) -> None:
        """Trajectory `h` (`_traj_instance[h]` names `inst` already) starts running on `inst`: logged under a
        fresh stamp. A log of more than about three times its live entries is compacted first, so its
        length stays proportional to what runs there (amortised O(1))."""
        p = self._pseq
        self._pseq = p + 1
        self._traj_stamp[h] = p
        if len(inst.log) > 6 * inst.nrun + 64:  # (more than 3 * nrun + 32 entries)
            self._compact(inst)
        log = inst.log
        log.append(h)
        log.append(p)
        inst.nrun += 1

    def _compact(self, inst: _Instance) -> None:
        """Drop the dead entries of `inst`'s log (keeping the live ones in order)."""
        tp = self._traj_stamp
        log = array("q")
        for h in inst.live():
            log.append(h)
            log.append(tp[h])
        inst.log = log

    def _orphan_version(self) -> int | None:
        """The oldest version with queued work and no instance loaded with or loading it."""
        best = None
        for b, cnt in self._queued.items():
            if cnt > 0 and b != _ANY and self._cap.get(b, 0) == 0 and (best is None or b < best):
                best = b
        return best

    def _plan_instance(self, inst: _Instance, lend: bool = True) -> None:
        """An instance is idle (or new): keep it, or switch it to the version that needs it (R4),
        or (elastic) lend it to the trainer when no work is left for it."""
        if inst.loading is not None or inst.nrun:
            return
        want = self._orphan_version()
        if want is None:
            if inst.version is not None and self._queued.get(self._bucket(inst.version), 0) > 0:
                return  # its own version still has queued work
            # (`_maybe_spread`'s first O(1) test, inlined)
            if self._spread and (not self._outstanding or inst.id in self._spreading) and self._maybe_spread(inst):
                return
            if lend and self._elastic and self._should_lend():
                self._switch_to_trainer(inst)
                return
            want = self.newest
        if inst.version == want:
            return
        if not self._pinned and inst.version is not None:
            return  # partial switches on publish only
        self._start_load(inst, want)

    def _plan_all(self) -> None:
        """Something changed for every instance (a publish, a failure): plan the idle ones, and
        consider R5 for every old version that still runs somewhere."""
        instances = self.instances
        for iid in list(self._idle):
            inst = instances.get(iid)
            if inst is not None:
                self._plan_instance(inst)
        if self._migrate:
            for v in sorted(self._holders):
                if v < self.newest:
                    self._maybe_consolidate(v)

    def _plan_idle(self) -> None:
        """Work was queued for a version no instance holds (a retry or a crash re-queued a
        trajectory of an older version): switch an idle instance to it (R4). Busy instances
        switch when they drain (`_release`)."""
        instances = self.instances
        for iid in list(self._idle):
            self._plan_instance(instances[iid])
            if self._orphan_version() is None:
                return

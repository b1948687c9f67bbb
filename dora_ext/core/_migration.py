"""R5: consolidate an old version's thin running work onto fewer instances, or spread the gating
version's stragglers onto an idle one."""

from __future__ import annotations

import numbers

from ._fleet import _Instance
from ._state import _ANY
from .errors import ProtocolError


class _Migration:
    """R5 (mixed into `Scheduler`)."""

    def _init_migration(self) -> None:
        """R5's records (derived state, except `_r5_tried`)."""
        self._r5_tried: dict[int, tuple[int, int]] = {}  # R5: version -> (occupied, holders) of a fruitless try
        # R5: version -> (holder, dispatches, landings) when the holder the plan would empty first
        # ran only moved trajectories: until a dispatch or landing the plan would move nothing
        # again. Derived state: not snapshotted.
        self._r5_stuck: dict[int, tuple[int, int, int]] = {}
        self._n_sent = 0  # trajectories dispatched (only `_r5_stuck` reads it)
        self._n_landed = 0  # moves landed (only `_r5_stuck` reads it)
        self._spreading: dict[int, int] = {}  # instance -> version it loads to take stragglers

    def _maybe_consolidate(self, v: int) -> None:
        """R5: when an old version's running work is spread thin, move it onto fewer instances.

        Called on every old-version release, so every test before the plan is O(1): the version
        does not gate the step being formed, fills at most `migrate_threshold` of its slots on
        more instances than that needs (`_levels`), and the newest version can use the freed ones.
        """
        if self._queued.get(v, 0) > 0 or v + self.K <= self.step:
            # A version the step being formed must take gates the trainer: its stragglers keep
            # their instances (packing them would slow each one down).
            return
        nh = self._holders.get(v, 0)
        if nh < 2:
            return
        fill = self.config.migrate_threshold
        occ = self._occupied.get(v, 0)
        if occ > fill * self._cap.get(v, 0):
            return
        limit = max(1, int(fill * self._cap_max))
        if nh <= -(-occ // limit):
            return  # already on as few instances as the plan could use
        if self._r5_tried.get(v) == (occ, nh):
            return  # tried in this very state and could not move (trajectories already moved once)
        # Only worth it when the newest version could use the freed slots.
        if self._budget_left() <= 0 and self._queued.get(self._bucket(self.newest), 0) <= 0:
            return
        if self._builtin_r5 or not self._consolidate_plugin(v):
            self._consolidate_builtin(v)
        if self._holders.get(v, 0) == nh and self._occupied.get(v, 0) == occ:
            self._r5_tried[v] = (occ, nh)

    def _consolidate_builtin(self, v: int) -> None:
        """The built-in plan, applied incrementally: empty the least loaded holders into the most
        loaded ones that are below `migrate_threshold` of their capacity (fewest moves, as few
        instances as can hold the work, none packed tighter than the threshold)."""
        fill = self.config.migrate_threshold
        instances = self.instances
        top = max(1, int(fill * self._cap_max))  # no instance takes more than this
        emptied = []
        dst = None
        dst_full = 0  # the running count at which `dst` reaches the threshold
        lo_of = self._low_level
        while True:
            lv = self._levels.get(v)
            if not lv or self._holders.get(v, 0) <= -(-self._occupied.get(v, 0) // top):
                break
            # The lowest non-empty level above 0: a few steps up from the hint `_low_level[v]`,
            # else a min over every level (a version may have hundreds).
            low = lo_of[v]
            if not low:
                low = 1
            stop = low + 32
            while low not in lv and low < stop:
                low += 1
            if low not in lv:
                low = min(lv)
                if not low:
                    low = min(n for n in lv if n)
            src = lv[low]
            src = src[next(iter(src))]  # (a level maps id -> instance)
            stuck = (src.id, self._n_sent, self._n_landed)
            if self._r5_stuck.get(v) == stuck:
                break  # it still runs only moved trajectories: nothing to move
            progressed = False
            movable = False
            tm = self._traj_moved
            for h in src.live():
                if tm[h]:
                    continue  # its move may still be in flight: it moves again only after MigrationLanded
                movable = True
                if dst is None or dst is src or dst.nrun >= dst_full:
                    # The most loaded holder still below the threshold (the previous destination
                    # stays the best until it reaches it, so this search runs once per filled one).
                    dst = None
                    # The levels below `top`, highest first: the highest level is tried first (no
                    # sort); else they are walked down or sorted, whichever is shorter.
                    hi = max(lv)
                    if 0 < hi < top:
                        for iid, inst in lv[hi].items():  # (a level maps id -> instance)
                            if iid != src.id and hi < max(1, int(fill * inst.capacity)):
                                dst = inst
                                dst_full = max(1, int(fill * dst.capacity))
                                break
                    if dst is None:
                        if top <= 2 * len(lv):
                            levels = range(top - 1, 0, -1)
                        else:
                            levels = sorted([n for n in lv if 0 < n < top], reverse=True)
                        for level in levels:
                            if level not in lv:
                                continue
                            for iid in lv[level]:
                                if iid != src.id and level < max(1, int(fill * instances[iid].capacity)):
                                    dst = instances[iid]
                                    dst_full = max(1, int(fill * dst.capacity))
                                    break
                            if dst is not None:
                                break
                    if dst is None:
                        break
                self._move(v, h, src, dst)
                progressed = True
            if not movable:
                self._r5_stuck[v] = stuck
            if src.nrun or not progressed:
                break
            emptied.append(src)
        for i in emptied:
            self._plan_instance(i)

    def _consolidate_plugin(self, v: int) -> bool:
        """A plugin's `dora_plan_migration`: hand it the holders, validate and apply its plan
        (False: every plugin declined, the built-in plan applies).

        O(view + moves): each move is checked in O(1) against the state the earlier moves left."""
        instances = self.instances
        holders = [instances[i] for n, level in self._levels.get(v, {}).items() if n for i in level]
        holders.sort(key=lambda i: i.id)
        key = self._key
        plan = self._plan_migration(
            version=v,
            instances=[{"id": i.id, "capacity": i.capacity, "running": [key(h) for h in i.live()]}
                       for i in holders],
            newest_version=self.newest,
            fill=self.config.migrate_threshold,
        )
        if plan is None:
            return False
        n, ti, tm, gslot = self.n, self._traj_instance, self._traj_moved, self._slot_of
        for gid, idx, src, dst in plan:
            s, d = instances.get(src), instances.get(dst)
            if s is None or d is None or s.version != v or d.version != v or d.loading is not None:
                raise ProtocolError(f"migration plan moves {gid!r}/{idx} between instances not holding version {v}")
            g = gslot.get(gid) if isinstance(gid, (int, str)) else None  # (a list is unhashable)
            ok = g is not None and isinstance(idx, numbers.Integral) and 0 <= idx < n
            h = g * n + int(idx) if ok else None
            if s is d or h is None or ti[h] != s.id or d.nrun >= d.capacity:
                # (a move onto its own instance left the occupancy levels wrong: a KeyError later)
                raise ProtocolError(f"migration plan for {gid!r}/{idx} from {src} to {dst} is not feasible")
            if tm[h]:
                continue  # its move may still be in flight: it moves again only after MigrationLanded
            self._move(v, h, s, d)
        for i in holders:
            if not i.nrun:
                self._plan_instance(i)
        return True

    def _gating_crowd(self) -> tuple[int, int] | None:
        """(version, most running on one of its instances) of the crowded gating version: the
        oldest version that the step being formed must take (`v + K <= step`) and whose running
        trajectories share an instance (at least two on one)."""
        best = None
        for v, lv in self._levels.items():
            if v == _ANY or v + self.K > self.step or not lv:
                continue
            most = max(lv)
            if most >= 2 and (best is None or v < best[0]):
                best = (v, most)
        return best

    def _maybe_spread(self, inst: _Instance) -> bool:
        """R5 the other way: spread the gating version's stragglers onto an idle instance.

        Only when the instance has nothing else to do (budget spent, nothing queued): stragglers
        decode faster when fewer share an instance. The idle instance loads the gating version if
        needed (R4: it runs nothing) and takes an even share of its running trajectories. It loads
        only when it would take at least one trajectory (`_spread_plan`, counting instances already
        loading to spread), so a load that moves nothing cannot cause a switch thrash.
        """
        chosen = self._spreading.pop(inst.id, None)
        if chosen is None:
            if self._budget_left() > 0 or self._outstanding or any(self._queued.values()):
                return False
        crowd = self._gating_crowd()
        if crowd is None:
            return False
        v = crowd[0]
        plan = self._spread_plan(v, inst)
        if not plan:
            return False
        if inst.version != v:
            self._spreading[inst.id] = v
            self._start_load(inst, v)  # it spreads when loaded (`_plan_instance` again)
            return True
        for src, h in plan:
            self._move(v, h, src, inst)
        self._idle.pop(inst.id, None)
        return True

    def _spread_plan(self, v: int, inst: _Instance) -> list:
        """The moves (holder, trajectory handle) that give idle `inst` its even share of
        version `v`'s running trajectories: from the most loaded holders, only what they run
        above the even share, never a trajectory that moved and has not landed.

        The even share counts `inst` and the instances already loading `v` to spread; those come
        first, so `inst` gets the candidates after theirs (maybe none: then it does not load)."""
        nh = self._holders.get(v, 0)
        if nh == 0:
            return []
        pending = 0
        for iid, u in self._spreading.items():
            if u == v and iid != inst.id:
                pending += 1
        total = self._occupied.get(v, 0)
        keep = -(-total // (nh + pending + 1))  # each instance's even share
        lv = self._levels.get(v, {})
        if max(lv) <= keep:
            return []  # O(1): no holder runs more than its share
        room = min(inst.capacity, keep)
        want = (pending + 1) * room
        # The holders above the share, most loaded first, then by id, level by level (only the
        # levels the plan reaches are sorted).
        plan = []
        tm = self._traj_moved
        instances = self.instances
        for level in sorted([lvl for lvl in lv if lvl > keep], reverse=True):
            for iid in sorted(lv[level]):
                if iid == inst.id:
                    continue
                src = instances[iid]
                excess = src.nrun - keep
                tp = self._traj_stamp
                it = iter(src.log)
                for h, p in zip(it, it):  # (`src.live()`, lazily: the plan stops early)
                    if tp[h] != p:
                        continue  # a dead log entry
                    if len(plan) >= want or excess <= 0:
                        break
                    if tm[h]:
                        continue  # it moves again only after MigrationLanded (it may be in flight)
                    excess -= 1
                    plan.append((src, h))
                if len(plan) >= want:
                    return plan[pending * room:]
        return plan[pending * room:]

"""`snapshot()` and `restore()`: the live state as JSON data, and back."""

from __future__ import annotations

import heapq
from typing import Any

from ..config import DoraConfig
from ._fleet import _Instance
from ._json import _json_data
from ._state import _CODES, _LETTERS, _Level, _MULTI, _NAN, _NO_INSTANCE, _NO_VERSION, _STATE_CODES, _STATES
from ._table import _vlist
from .errors import ProtocolError

#: The format `snapshot()` writes and `restore()` reads.
SNAPSHOT_FORMAT = 3


class _Snapshot:
    """`snapshot()` and `restore()` (mixed into `Scheduler`)."""

    def snapshot(self) -> dict[str, Any]:
        """The whole live state as JSON-serialisable data; `restore` rebuilds an identical
        scheduler (same actions for the same events from then on).

        It holds live groups and instances only, so its size does not grow with the steps.
        `format` is `SNAPSHOT_FORMAT`. Runtimes store it in their checkpoints and resume from it.
        """
        self._check_broken()  # (a halted scheduler's state may be half changed)
        groups = []
        n = self.n
        ts, ti, ta, tt, tr, tn, tm = self._traj_status, self._traj_instance, self._traj_attempt, self._traj_tokens, self._traj_reward, self._traj_retries, self._traj_moved
        gst, gstep, gcseq = self._group_state, self._group_step, self._group_cseq
        for gid, g in self._slot_of.items():
            v = self._group_version[g]
            b0 = g * n
            key = self._group_key.get(g)
            # Delta-coded against the scheduler's counters and the group's version; the admission
            # key only when it is not the default `(seq,)`.
            groups.append([
                gid, self.newest - v, self._seq - self._group_seq[g], None if key is None else list(key), _json_data(self._group_meta.get(g), "meta"),
                _STATES[gst[g]], None if gstep[g] < 0 else self.step - gstep[g],
                None if gcseq[g] < 0 else self._complete_seq - gcseq[g],
                bool(self._group_in_queue[g]), self._pending(g), self._group_done[g], self._group_live[g],
                [[_LETTERS[ts[h]], None if ti[h] == _NO_INSTANCE else ti[h], ta[h], tt[h], _vlist(self._versions(h), v),
                  None if tr[h] != tr[h] else tr[h], tn[h],
                  bool(tm[h])] for h in range(b0, b0 + n)],
            ])
        insts = [[i.id, i.capacity, i.version, i.loading, [list(self._key(h)) for h in i.running]]
                 for i in self.instances.values()]
        live = self._slot_of

        def heap(h):
            return [[list(e[0]), e[1], e[2]] for e in h if e[2] in live]

        return {
            "format": SNAPSHOT_FORMAT,
            "config": self.config.to_dict(),
            "scalars": {
                "newest": self.newest, "step": self.step, "trainer_busy": self._trainer_busy,
                "started": self._started, "exhausted": self._exhausted,
                "outstanding": self._outstanding, "admitted": self._admitted, "seq": self._seq,
                "complete_seq": self._complete_seq, "n_active": self._n_active,
                "halted": self._halted, "orphaned": self._orphaned, "form_dirty": self._form_dirty,
                "cap_max": self._cap_max, "uniform": self._uniform, "id_max": self._id_max,
                **self._adm.snapshot(),
            },
            "idle": list(self._idle),
            "levels": [[b, self._low_level[b], [[n, list(d)] for n, d in lv.items()]] for b, lv in self._levels.items()],
            "forming": list(self._forming),
            "groups": groups,
            "instances": insts,
            "unassigned": [[v, c] for v, c in self._unassigned.items()],
            "queue": [[b, heap(h)] for b, h in self._queue.items()],
            "queued": [[b, c] for b, c in self._queued.items()],
            "pools": [[v, heap(h)] for v, h in self._pools.items()],
            "r5_tried": [[v, list(x)] for v, x in self._r5_tried.items()],
            "elastic": [[[i, c] for i, c in d.items()]
                        for d in (self._trainer_side, self._to_trainer, self._to_rollout, self._spreading)],
            "trainer_idle": self._trainer_idle,
            "metrics": {**self.m, "staleness_hist": [[k, v] for k, v in self.m["staleness_hist"].items()]},
        }

    @classmethod
    def restore(cls, snap: dict[str, Any], plugins: Any = None) -> "Scheduler":
        """Rebuild a scheduler from `snapshot()` output (possibly after a JSON round trip)."""
        fmt = snap.get("format") if isinstance(snap, dict) else None
        if fmt != SNAPSHOT_FORMAT or type(fmt) is not int:
            raise ProtocolError(f"snapshot format {fmt!r} is not supported: this dora-ext reads format "
                                f"{SNAPSHOT_FORMAT} (a snapshot from another dora-ext version cannot be resumed)")
        self = cls(DoraConfig.from_dict(snap["config"]), plugins=plugins)
        sc = snap["scalars"]
        self.newest, self.step, self._trainer_busy = sc["newest"], sc["step"], sc["trainer_busy"]
        self._started, self._exhausted = sc["started"], sc["exhausted"]
        self._outstanding, self._admitted = sc["outstanding"], sc["admitted"]
        self._seq, self._complete_seq, self._n_active = sc["seq"], sc["complete_seq"], sc["n_active"]
        self._halted, self._orphaned = sc["halted"], sc["orphaned"]
        self._form_dirty, self._uniform = sc["form_dirty"], sc["uniform"]
        self._adm.restore(sc)
        self._id_max = sc["id_max"]
        self._forming = list(snap["forming"])
        for (gid, dv, dseq, key, meta, state, dstep, dcseq, in_queue, pending, done, live, trajs) in snap["groups"]:
            version, seq = self.newest - dv, self._seq - dseq
            step = None if dstep is None else self.step - dstep
            cseq = None if dcseq is None else self._complete_seq - dcseq
            if len(trajs) != self.n:
                raise ProtocolError(f"snapshot group {gid!r} has {len(trajs)} trajectories, group_size is {self.n}")
            g = self._alloc()
            self._slot_of[gid], self._gid_of[g], self._group_version[g], self._group_seq[g] = g, gid, version, seq
            if key is not None and tuple(key) != (seq,):
                self._group_key[g] = tuple(key)
            if meta is not None:
                # (a copy in JSON form: the same meta whether `snap` went through JSON or not)
                self._group_meta[g] = _json_data(meta, f"snapshot group {gid!r} meta")
            self._group_state[g], self._group_in_queue[g] = _STATE_CODES[state], 1 if in_queue else 0
            self._group_step[g] = -1 if step is None else step
            self._group_cseq[g] = -1 if cseq is None else cseq
            # Pending: re-queued ones first (the retry stack), then the fresh tail `next .. n - 1`.
            j, n_p = len(pending), len(pending)
            while j > 0 and pending[j - 1] == self.n - (n_p - j) - 1:
                j -= 1
            self._group_next[g] = self.n - (n_p - j)
            if j:
                self._group_retry[g] = list(reversed(pending[:j]))
            self._group_done[g], self._group_live[g] = done, live
            for h, (status, inst, attempt, tokens, versions, reward, retries, moved) in enumerate(trajs, g * self.n):
                self._traj_status[h], self._traj_instance[h], self._traj_attempt[h], self._traj_tokens[h] = _CODES[status], _NO_INSTANCE if inst is None else inst, attempt, tokens
                self._traj_moved[h] = 1 if moved else 0
                vs = [x + version for x in versions]
                self._traj_version[h] = _NO_VERSION if not vs else vs[0] if len(vs) == 1 else _MULTI
                if len(vs) > 1:
                    self._traj_versions[h] = vs
                self._traj_reward[h] = _NAN if reward is None else reward
                self._traj_retries[h] = retries
        for iid, cap, version, loading, running in snap["instances"]:
            inst = _Instance(iid, cap, self._traj_stamp)
            inst.version, inst.loading = version, loading
            for gid, idx in running:
                self._place(inst, self._slot_of[gid] * self.n + idx)
            self.instances[iid] = inst
            target = inst.target
            if target is not None:
                b = self._bucket(target)
                self._cap[b] = self._cap.get(b, 0) + cap
                self._occupied[b] = self._occupied.get(b, 0) + inst.nrun
                self._targets[target] = self._targets.get(target, 0) + 1
            if loading is not None:
                self._n_loading += 1
        self._cap_max = sc["cap_max"]
        # Insertion orders matter (round robin, R5's choice among equals): restored as saved.
        self._idle = dict.fromkeys(snap["idle"])
        insts = self.instances
        self._levels = {b: {n: _Level((i, insts[i]) for i in d) for n, d in lv} for b, _, lv in snap["levels"]}
        self._low_level = {b: lo for b, lo, _ in snap["levels"]}
        self._holders = {b: sum(len(d) for n, d in lv.items() if n) for b, lv in self._levels.items()}
        self._holders = {b: c for b, c in self._holders.items() if c}
        self._unassigned = {v: c for v, c in snap["unassigned"]}
        self._queue = {b: [(tuple(k), s, gid) for k, s, gid in h] for b, h in snap["queue"]}
        for h in self._queue.values():
            heapq.heapify(h)
        self._queued = {b: c for b, c in snap["queued"]}
        self._pools = {v: [(tuple(k), s, gid) for k, s, gid in h] for v, h in snap["pools"]}
        for h in self._pools.values():
            heapq.heapify(h)
        self._pool_n = sum(len(h) for h in self._pools.values())
        self._r5_tried = {v: tuple(x) for v, x in snap["r5_tried"]}
        self._trainer_side, self._to_trainer, self._to_rollout, self._spreading = (
            {i: c for i, c in d} for d in snap["elastic"])
        self._trainer_idle = snap["trainer_idle"]
        m = dict(snap["metrics"])
        m["staleness_hist"] = {int(k): v for k, v in m["staleness_hist"]}
        self.m = m
        return self

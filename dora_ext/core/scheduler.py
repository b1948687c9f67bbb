"""Everything in dora-ext revolves around this: one `Scheduler` owns the scheduling state.

It is a pure state machine in the sans-I/O style of h11: a runtime feeds it events
(`handle(event)` or `handle_many(events)`) and executes the actions it returns. It never touches
a thread, socket, clock, tensor or host, so the simulator, the embedded runtime and the
verl/slime adapters all run this same code, and what the simulator measures is what users run.

The five modes are policies over one state (see `docs/design.md`):

| mode         | admission                          | versions on instances        | trainer          |
|--------------|------------------------------------|------------------------------|------------------|
| sync         | a whole batch per version (K=0)    | switch when drained          | per batch        |
| one_step_off | a whole batch when the fleet is idle, one version behind (K=1) | switch when drained | per batch |
| partial      | keep slots full within R2          | all switch on publish, running work is preempted and resumed (C1 broken, metered) | per batch |
| pipeline     | a whole batch per version (K=0)    | switch when drained          | streamed (R7)    |
| dora         | keep slots full within R2          | R1 pinning, R4 drain-then-switch, R5 migration | streamed (R7) |

Only live state is kept: a group leaves the scheduler when its trainer step finishes (or, once
reported failed, when none of its trajectories runs any more); totals live on in `metrics()`.
So memory, snapshot size and per-event cost do not grow with the length of a run.

Every per-event path is O(1) amortised in groups and instances, except where a whole fleet must
act (a publish in `partial`): queued work is one heap per version (R6, group-major); loaded
instances are bucketed per version by load (`_levels`), so dispatch and R5 are O(1); completed
groups are one heap per version, formed only when an input changed (`_form_dirty`); idle
instances are a set, so a publish plans only those.

R3: "the mandatory set, then the oldest completed groups" can break C3 (a newer group taken now
can leave the next step more mandatory groups than slots). Each group is due by `version + K`; a
group is taken only if, for every future step `k + j`, the unassigned groups due by then still fit
in `r + j * B` slots (earliest-deadline-first). R2 guarantees such a schedule exists.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Mapping
from typing import Any, Callable, Iterable

from ..config import DoraConfig
from . import actions as A
from . import events as E
from ._elastic import _Elastic
from .admission import Admission
from ._fleet import _Fleet
from ._json import _json_data, _json_key
from ._migration import _Migration
from ._snapshot import SNAPSHOT_FORMAT, _Snapshot
from ._state import (_ACTIVE, _ANY, _ASSIGNED, _AWAIT_REWARD, _COMPLETE, _DEAD, _DONE, _FAILED, _LETTERS,
                     _MULTI, _NAN, _NO_INSTANCE, _QUEUED, _RUNNING, _TRAINED, _drop_one)
from ._table import _Table
from .errors import FailureStorm, ProtocolError, _brief
from .views import GroupView, TrajectoryView, _Groups

__all__ = ["FailureStorm", "GroupView", "ProtocolError", "SNAPSHOT_FORMAT", "Scheduler", "TrajectoryView"]


class Scheduler(_Table, _Fleet, _Migration, _Elastic, _Snapshot):
    """The sans-I/O scheduler. See the module docstring and `dora_ext.core.events/actions`.

    One facade over the modules that hold its parts: `_table` (live groups and trajectories),
    `_fleet` (instances, occupancy levels, dispatch, R4), `_migration` (R5), `_elastic`,
    `_snapshot`; admission (R2), batch formation (R3, R7) and the event handlers live here."""

    def __init__(self, config: DoraConfig, plugins: Any = None) -> None:
        self.config = config
        self.mode = config.mode
        self.K = config.max_staleness
        self.B = config.batch_size
        self.n = config.group_size
        self._pinned = self.mode != "partial"
        self._cgp = self.mode in ("pipeline", "dora")
        self._admission = {"sync": "batch", "pipeline": "batch", "one_step_off": "fleet",
                           "partial": "fill", "dora": "fill"}[self.mode]
        self._adm = Admission(config.admission_policy, self.B, self.K)  # how far `fill` runs ahead
        self._migrate = self.mode == "dora" and config.migrate
        self._spread = self._migrate and config.spread
        self._set_plugins(plugins)

        self.newest = 0  # newest published version
        self.step = 0  # the trainer step being formed (or running)
        self._trainer_busy: int | None = None
        self._forming: list[Any] = []
        self._started = False
        self._exhausted = False
        self._outstanding = 0  # groups requested and not yet admitted/declined
        self._admitted = 0  # admitted and not failed
        self._seq = 0
        self._complete_seq = 0
        self._n_active = 0  # admitted groups neither complete nor failed
        # The largest instance id ever registered: a report from an id at or below it that is not
        # registered now is from a failed instance and stale (`_stale_instance`).
        self._id_max = _NO_INSTANCE
        self._orphaned = False  # work was queued for a version no instance holds
        self._halted: str | None = None  # the circuit breaker's message once it tripped
        self._broken: str | None = None  # the error that halted the scheduler (`_run`)
        self._form_dirty = True  # an input of batch formation changed since it last ran

        self._init_table()
        self._init_fleet()
        self._init_migration()
        self._init_elastic(config)
        self._unassigned: dict[int, int] = {}  # version -> admitted groups not yet in a step
        self._queue: dict[int, list] = {}  # bucket -> heap of (key, seq, gid)
        self._queued: dict[int, int] = {}  # bucket -> queued trajectories
        self._cap: dict[int, int] = {}  # bucket -> capacity of instances loaded or loading it
        self._occupied: dict[int, int] = {}  # bucket -> running on instances targeting it
        self._pools: dict[int, list] = {}  # version -> heap of (batch key, complete_seq, gid)
        self._pool_n = 0  # completed groups not yet in a step
        # `_form` takes the smallest key among the versions that can be taken now; dora with the
        # built-in keys (oldest first) waits for the global head (EDF). A plugin's key may order a
        # newer version first, where waiting for the head would deadlock.
        self._pool_fifo = self.mode != "dora" or not self._builtin_batch
        self.m = {
            "staleness_hist": {}, "trajectories_trained": 0, "multi_version_trajectories": 0,
            "groups_trained": 0, "dropped": 0, "truncated": 0, "duplicated": 0, "failed_groups": 0,
            "retries": 0, "redispatched": 0, "invalid_rewards": 0, "stale_events": 0,
            "migrations": 0, "weight_loads": 0, "live_versions_max": 0, "c1_violations": 0,
            "c3_violations": 0, "trainer_waits_for_older": 0, "tokens_trained": 0,
            "switches_to_trainer": 0, "switches_to_rollout": 0,
            "groups_admitted": 0, "groups_completed": 0,
        }
        self._out: list = []

    # ------------------------------------------------------------------ plugins
    def _set_plugins(self, plugins: Any) -> None:
        """The fast path is chosen per hook: a hook that only the built-ins implement
        (`dora_ext.defaults`) is computed inline, so a plugin implementing another hook (say only
        `dora_metrics`) changes no decision."""
        from .. import defaults

        def own(name: str) -> bool:
            return plugins is not None and any(
                i.plugin is not defaults for i in getattr(plugins.hook, name).get_hookimpls())

        hook = plugins.hook if plugins is not None else None
        self._builtin_admission = not own("dora_admission_key")
        self._builtin_batch = not own("dora_batch_key")
        self._builtin_r5 = not own("dora_plan_migration")
        self._admission_key = None if self._builtin_admission else hook.dora_admission_key
        self._batch_key = None if self._builtin_batch else hook.dora_batch_key
        self._plan_migration = None if self._builtin_r5 else hook.dora_plan_migration
        self._plugins = plugins

    # ------------------------------------------------------------------ public API
    def start(self) -> list:
        """Register the configured instances and emit the first actions."""
        return self._run(self._start, None)

    def _start(self, _: Any) -> None:
        if self._started:
            raise ProtocolError("start() called twice")
        self._started = True
        for spec in self.config.instances:
            self._add_instance(spec.id, spec.capacity)

    def handle(self, event: Any) -> list:
        """Feed one event; returns the actions to execute, in order."""
        return self._run(self._handle_each, (event,))

    def handle_many(self, events: Iterable[Any]) -> list:
        """Feed events in order; returns the actions for all of them.

        Like `handle` on each event, except that admission, batch formation and idle-instance
        planning run once at the end. A batch that fails instances may return actions for them
        decided before their failure (void); hosts drop those with `actions.without_failed`.
        """
        return self._run(self._handle_each, events)

    def _handle_each(self, events: Iterable[Any]) -> None:
        if not self._started:
            raise ProtocolError("an event before start()")
        handlers = self._handlers
        for event in events:
            try:
                method = handlers[type(event)]
            except KeyError:
                raise ProtocolError(f"unknown event {event!r}") from None
            method(self, event)

    def _run(self, work: Callable, arg: Any) -> list:
        """`work(arg)`, then the end-of-call pump. An error halts the scheduler, as h11's
        ProtocolError does: its state may be half changed, so every later call raises and the host
        resumes from its last snapshot. (`FailureStorm`, the circuit breaker, leaves it consistent.)"""
        self._check_broken()
        if self._halted is not None:
            raise self._storm([])
        try:
            work(arg)
            return self._finish()
        except FailureStorm:
            raise
        except Exception as exc:
            self._broken = str(exc) if isinstance(exc, ProtocolError) else f"{type(exc).__name__}: {exc}"
            self._out = []
            raise

    def _check_broken(self) -> None:
        if self._broken is not None:
            raise ProtocolError(f"the scheduler halted after a protocol error: {self._broken}; "
                                f"resume from the last snapshot taken before it")

    def _storm(self, actions: list) -> FailureStorm:
        return FailureStorm(self._halted or "", failed=self.m["failed_groups"],
                            completed=self.m["groups_completed"], retries=self.m["retries"], actions=actions)

    @property
    def done(self) -> bool:
        if self._trainer_busy is not None:
            return False
        if self.config.max_steps is not None and self.step >= self.config.max_steps:
            return True
        return self._exhausted and self._n_active == 0 and not self._pool_n and not self._forming

    @property
    def newest_version(self) -> int:
        return self.newest

    @property
    def groups(self) -> Mapping[Any, GroupView]:
        """The live groups by id (read-only views)."""
        return _Groups(self)

    @property
    def trainer_busy(self) -> int | None:
        return self._trainer_busy

    def live_versions(self) -> list[int]:
        """Versions loaded (or loading) on at least one instance."""
        return sorted(v for v, c in self._targets.items() if c > 0)

    def metrics(self) -> dict[str, Any]:
        m = dict(self.m)
        hist = {int(k): v for k, v in m.pop("staleness_hist").items()}
        total = sum(hist.values())
        trained = m["trajectories_trained"]
        m["staleness_hist"] = dict(sorted(hist.items()))
        m["staleness_max"] = max(hist) if hist else 0
        m["staleness_mean"] = (sum(k * v for k, v in hist.items()) / total) if total else 0.0
        m["multi_version_trajectory_share"] = (m["multi_version_trajectories"] / trained) if trained else 0.0
        m["live_versions"] = len(self.live_versions())
        m["newest_version"] = self.newest
        m["steps"] = self.step
        # Dropped: admitted groups that are neither trained, nor reported failed, nor still held.
        # Counted from the group table itself, so a group lost from it shows up here.
        gst = self._group_state
        held = sum(1 for g in self._slot_of.values() if gst[g] in (_ACTIVE, _COMPLETE))
        if self._trainer_busy is None:
            held += len(self._forming)
        m["dropped"] = m["groups_admitted"] - m["groups_trained"] - m["failed_groups"] - held
        m["live_groups"] = len(self._slot_of)
        m["halted"] = self._halted or ""
        m["c1_ok"] = m["c1_violations"] == 0 and m["multi_version_trajectories"] == 0
        m["c2_ok"] = m["dropped"] == 0 and m["truncated"] == 0 and m["duplicated"] == 0
        m["c3_ok"] = m["c3_violations"] == 0
        return m

    # ------------------------------------------------------------------ event handlers
    def _on_instance_ready(self, ev: E.InstanceReady) -> None:
        if ev.instance_id in self.instances:
            raise ProtocolError(f"instance {ev.instance_id} is already registered")
        if ev.capacity < 1:
            raise ProtocolError(f"instance {ev.instance_id}: capacity must be >= 1")
        if ev.instance_id in self._trainer_side or ev.instance_id in self._to_trainer:
            raise ProtocolError(f"instance {ev.instance_id} reported ready while its accelerators serve the trainer")
        # An instance back from the trainer (SwitchToRollout) loads a version before anything else.
        back = self._to_rollout.pop(ev.instance_id, None) is not None
        if back and self._spread:
            self._spreading[ev.instance_id] = -1  # it came for the tail: it may take stragglers
        self._add_instance(ev.instance_id, ev.capacity, lend=not back)

    def _on_migration_landed(self, ev: E.MigrationLanded) -> None:
        g = self._slot_of.get(ev.group_id)
        idx = ev.index
        if g is not None and 0 <= idx < self.n:
            h = g * self.n + idx  # (`_group` and `_traj` of a live group and a valid index, inlined)
        else:
            g = self._group(ev.group_id, ev.attempt)  # a group no longer held: stale with an attempt
            if g is None:
                return
            h = self._traj(g, idx)  # raises ProtocolError
        if (ev.attempt is not None and ev.attempt != self._traj_attempt[h]) or self._traj_status[h] != _RUNNING:
            self.m["stale_events"] += 1  # it finished, failed or was re-dispatched meanwhile
            return
        self._traj_moved[h] = 0  # it runs on its destination: it may move again (R5)
        self._n_landed += 1

    def _on_trainer_idle(self, ev: E.TrainerIdle) -> None:
        self._trainer_idle = self._trainer_busy is None

    def _on_switched_to_trainer(self, ev: E.SwitchedToTrainer) -> None:
        cap = self._to_trainer.pop(ev.instance_id, None)
        if cap is None:
            raise ProtocolError(f"instance {ev.instance_id} switched to the trainer without a SwitchToTrainer")
        self._trainer_side[ev.instance_id] = cap

    def _on_instance_loaded(self, ev: E.InstanceLoaded) -> None:
        if self._stale_instance(ev.instance_id):
            return
        inst = self._instance(ev.instance_id)
        if inst.loading != ev.version:
            raise ProtocolError(
                f"instance {inst.id} reported version {ev.version} loaded, but was asked for {inst.loading}"
            )
        # The scheduler's own int, not the event's value (a host may report a numpy integer).
        v = inst.loading
        inst.version = v
        self.m["weight_loads"] += 1
        if not self._pinned:
            # partial: preempted trajectories resume under the new version (C1 broken, metered).
            tv, tvm = self._traj_version, self._traj_versions
            for h in inst.running:
                vs = tv[h]
                if vs >= 0:
                    if vs != v:
                        tv[h] = _MULTI
                        tvm[h] = [vs, v]
                elif (vs := tvm[h])[-1] != v:
                    vs.append(v)
            if v < self.newest:
                # A newer version was published while this one loaded: load it too.
                self._start_load(inst, self.newest, preempt=True)
                return
        inst.loading = None
        self._n_loading -= 1
        b = self._bucket(v)
        self._set_level(b, inst.id, None, inst.nrun)
        if not inst.nrun:
            self._idle[inst.id] = None
        if self._queue.get(b):  # (`_dispatch`'s first test, inlined: mostly nothing is queued)
            self._dispatch(b)
        if not inst.nrun:
            self._plan_instance(inst)
        live = len(self._targets)  # (its counts are all positive: `_drop_one` drops a zero)
        if live > self.m["live_versions_max"]:
            self.m["live_versions_max"] = live

    def _on_instance_failed(self, ev: E.InstanceFailed) -> None:
        if self._stale_instance(ev.instance_id):
            return
        inst = self._instance(ev.instance_id)
        target = inst.target
        if target is not None:
            b = self._bucket(target)
            self._cap[b] -= inst.capacity
            self._occupied[b] -= inst.nrun
            _drop_one(self._targets, target)
        if inst.loading is not None:
            self._n_loading -= 1
        elif inst.version is not None:
            self._set_level(self._bucket(inst.version), inst.id, inst.nrun, None)
        self._idle.pop(inst.id, None)
        # Left behind, it would count as a holder of the gating version's share (`_spread_plan`).
        self._spreading.pop(inst.id, None)
        del self.instances[inst.id]  # from now on its id reads as failed (`_stale_instance`)
        touched = set()
        n = self.n
        for h in inst.running:
            g = h // n
            self._traj_instance[h] = _NO_INSTANCE
            self._traj_attempt[h] += 1
            self._traj_tokens[h] = 0
            self._traj_moved[h] = 0  # a new attempt: no move of it can be in flight
            self._clear_versions(h)
            if self._group_state[g] == _FAILED:
                self._retire(g, h)  # its group was reported failed: retired, not re-dispatched
                continue
            self.m["redispatched"] += 1
            self._traj_status[h] = _QUEUED
            self._group_live[g] -= 1
            self._requeue(g, h - g * n)
            self._enqueue(g, 1)
            touched.add(self._bucket(self._group_version[g]))
        for bb in touched:
            self._dispatch(bb)
        self._plan_all()

    def _on_group_admitted(self, ev: E.GroupAdmitted) -> None:
        gid = ev.group_id
        if not isinstance(gid, (int, str)) or isinstance(gid, bool):
            # The id must survive the snapshot's JSON round trip (True is the same key as 1).
            raise ProtocolError(
                f"GroupAdmitted.group_id {_brief(gid)} ({type(gid).__name__}): a group id must be an int "
                f"or a str (a JSON scalar that survives the snapshot's JSON round trip), not a bool"
            )
        if self._outstanding <= 0:
            raise ProtocolError(f"group {ev.group_id!r} admitted without a RequestGroups outstanding")
        if ev.group_id in self._slot_of:
            raise ProtocolError(f"group id {ev.group_id!r} admitted twice")
        meta = ev.meta  # (a copy, if JSON gives it back: a resumed run sees the same meta)
        if meta is not None:
            meta = _json_data(meta, "GroupAdmitted.meta")
        v = self.newest
        seq = self._seq
        if self._builtin_admission:
            key = None  # `defaults.dora_admission_key`: `(seq,)`, the default, which is not stored
        else:
            key = _json_key(self._admission_key(group_id=ev.group_id, version=v, seq=seq, meta=meta, mode=self.mode),
                            "dora_admission_key")
        self._outstanding -= 1
        self._seq = seq + 1
        g = self._alloc()
        self._slot_of[ev.group_id] = g
        self._gid_of[g] = ev.group_id
        self._group_version[g] = v
        self._group_seq[g] = seq
        if key is not None and key != (seq,):
            self._group_key[g] = key
        if meta is not None:
            self._group_meta[g] = meta
        self._admitted += 1
        self.m["groups_admitted"] += 1
        self._unassigned[v] = self._unassigned.get(v, 0) + 1
        self._n_active += 1
        self._form_dirty = True
        # `_enqueue(g, n)` and `_bucket`, inlined: a fresh group joins its version's queue
        n = self.n
        b = v if self._pinned else _ANY
        self._queued[b] = self._queued.get(b, 0) + n
        if self._pinned and not self._cap.get(b):
            self._orphaned = True  # no instance holds or loads this version: see `_finish`
        heapq.heappush(self._queue.setdefault(b, []), ((seq,) if key is None else self._key_of(g), seq, gid))
        self._group_in_queue[g] = 1
        self._dispatch(b)

    def _on_groups_declined(self, ev: E.GroupsDeclined) -> None:
        if ev.count < 0 or ev.count > self._outstanding:
            raise ProtocolError(f"declined {ev.count} groups but {self._outstanding} are outstanding")
        self._outstanding -= ev.count

    def _on_data_exhausted(self, ev: E.DataExhausted) -> None:
        self._exhausted = True
        self._outstanding = 0
        self._form_dirty = True

    def _on_progressed(self, ev: E.TrajectoryProgressed) -> None:
        h = self._running_traj(ev.group_id, ev.index, ev.attempt)
        if h is not None:
            self._set_tokens(h, ev.tokens)

    def _on_finished(self, ev: E.TrajectoryFinished) -> None:
        g = self._slot_of.get(ev.group_id)
        idx = ev.index
        n = self.n
        ts = self._traj_status
        if (g is None or not 0 <= idx < n or ts[h := g * n + idx] != _RUNNING
                or ((a := ev.attempt) is not None and a != self._traj_attempt[h])):
            # the general path: errors and stale reports
            h = self._running_traj(ev.group_id, idx, ev.attempt)
            if h is None:
                return
            g = h // n
        try:
            self._traj_tokens[h] = ev.tokens
        except (TypeError, OverflowError):
            self._set_tokens(h, ev.tokens)
        if ev.truncated_early:
            self.m["truncated"] += 1
        self._release(h)
        reward = ev.reward
        if self._group_state[g] == _FAILED:
            if reward is not None:
                self._retire(g, h)
                return
            # (A trajectory of a failed group without its reward yet stays until the runtime
            # sends the reward or a failure for it, so that those events are still understood.)
            ts[h] = _AWAIT_REWARD
            return
        if reward is None:
            ts[h] = _AWAIT_REWARD
        elif type(reward) is float and reward - reward == 0.0 and self._group_done[g] + 1 < n:
            # `_set_reward`'s common case, inlined: a finite float that does not complete its group
            self._traj_reward[h] = reward
            ts[h] = _DONE
            self._group_live[g] -= 1
            self._group_done[g] += 1
        else:
            ts[h] = _AWAIT_REWARD
            self._set_reward(g, h, reward)

    def _on_reward(self, ev: E.RewardReady) -> None:
        g = self._group(ev.group_id, ev.attempt)
        if g is None:
            return
        h = self._traj(g, ev.index)
        if ev.attempt is not None and ev.attempt != self._traj_attempt[h]:
            self.m["stale_events"] += 1
            return
        if self._group_state[g] == _FAILED:
            self._retire(g, h)
            return
        if self._traj_status[h] != _AWAIT_REWARD:
            raise ProtocolError(f"reward for trajectory {ev.group_id!r}/{ev.index}, which is not awaiting one "
                                f"({_LETTERS[self._traj_status[h]]})")
        self._set_reward(g, h, ev.reward)

    def _on_failed(self, ev: E.TrajectoryFailed) -> None:
        g = self._group(ev.group_id, ev.attempt)
        if g is None:
            return
        h = self._traj(g, ev.index)
        if ev.attempt is not None and ev.attempt != self._traj_attempt[h]:
            self.m["stale_events"] += 1
            return
        st = self._traj_status[h]
        if st == _RUNNING:
            self._release(h)
        elif st != _AWAIT_REWARD:
            raise ProtocolError(f"trajectory {ev.group_id!r}/{ev.index} failed but is not running ({_LETTERS[st]})")
        if self._group_state[g] == _FAILED:
            self._retire(g, h)  # its group was already reported failed
            return
        self._fail_traj(g, h, ev.reason)

    def _on_step_started(self, ev: E.TrainerStepStarted) -> None:
        if self._trainer_busy != ev.step:
            raise ProtocolError(f"trainer started step {ev.step}, but the running step is {self._trainer_busy}")

    def _on_step_finished(self, ev: E.TrainerStepFinished) -> None:
        if self._trainer_busy != ev.step:
            raise ProtocolError(f"trainer finished step {ev.step}, but the running step is {self._trainer_busy}")
        gslot = self._slot_of
        for gid in self._forming:
            g = gslot.pop(gid)  # trained: it leaves the scheduler (its totals are in the metrics)
            self._group_state[g] = _TRAINED
            self._release_slot(g)
        self._forming = []
        self._trainer_busy = None
        self.step += 1
        self._form_dirty = True
        self._adm.step_finished()

    def _on_published(self, ev: E.VersionPublished) -> None:
        if not isinstance(ev.version, numbers.Integral):
            # (a float would pass the test below, then fail the int arrays that hold versions)
            raise ProtocolError(f"version {ev.version!r} published: expected an integer")
        if ev.version != self.newest + 1:
            raise ProtocolError(f"version {ev.version} published, expected {self.newest + 1}")
        if ev.version > self.step:
            raise ProtocolError(f"version {ev.version} published before trainer step {ev.version - 1} finished")
        self.newest = int(ev.version)
        for b in [b for b, c in self._queued.items() if not c and not self._queue.get(b) and b != _ANY]:
            del self._queued[b]  # versions with nothing queued leave (live state only)
            self._queue.pop(b, None)
        for b in [b for b, c in self._cap.items() if not c and not self._occupied.get(b)]:
            del self._cap[b]  # versions no instance holds any more
            self._occupied.pop(b, None)
        if not self._pinned:
            # partial: every instance switches now; running work is preempted and resumed.
            for inst in list(self.instances.values()):
                if inst.version is None or inst.loading is not None or inst.version == ev.version:
                    continue
                self._start_load(inst, ev.version, preempt=True)
            return
        self._plan_all()

    _handlers: dict[type, Callable] = {
        E.InstanceReady: _on_instance_ready,
        E.InstanceLoaded: _on_instance_loaded,
        E.InstanceFailed: _on_instance_failed,
        E.SwitchedToTrainer: _on_switched_to_trainer,
        E.TrainerIdle: _on_trainer_idle,
        E.MigrationLanded: _on_migration_landed,
        E.GroupAdmitted: _on_group_admitted,
        E.GroupsDeclined: _on_groups_declined,
        E.DataExhausted: _on_data_exhausted,
        E.TrajectoryProgressed: _on_progressed,
        E.TrajectoryFinished: _on_finished,
        E.RewardReady: _on_reward,
        E.TrajectoryFailed: _on_failed,
        E.TrainerStepStarted: _on_step_started,
        E.TrainerStepFinished: _on_step_finished,
        E.VersionPublished: _on_published,
    }

    # ------------------------------------------------------------------ lookups
    def trajectory(self, group_id: Any, index: int) -> TrajectoryView:
        """A read-only view of a live trajectory's state (status letter, instance, attempt,
        tokens, versions, retries, moved, reward), for tests and debugging."""
        return TrajectoryView(self, self._traj(self._group(group_id), index))

    def running_on(self, instance_id: int) -> list[tuple[Any, int]]:
        """The trajectories `(group_id, index)` running on a live instance, in dispatch order."""
        return [self._key(h) for h in self._instance(instance_id).running]

    def trajectories(self, group_id: Any) -> list[TrajectoryView]:
        g = self._group(group_id)
        return [TrajectoryView(self, g * self.n + i) for i in range(self.n)]

    # ------------------------------------------------------------------ state changes
    def _requeue(self, g: int, idx: int) -> None:
        """Trajectory `idx` of group slot `g` is pending again, first in line (it ran before)."""
        retry = self._group_retry.get(g)
        if retry is None:
            self._group_retry[g] = [idx]
        else:
            retry.append(idx)

    def _enqueue(self, g: int, added: int) -> None:
        """`added` trajectories of group slot `g` joined its pending list; make sure the group is
        queued."""
        b = self._bucket(self._group_version[g])
        self._queued[b] = self._queued.get(b, 0) + added
        if self._pinned and not self._cap.get(b):
            self._orphaned = True  # no instance holds or loads this version: see `_finish`
        if not self._group_in_queue[g] and (g in self._group_retry or self._group_next[g] < self.n):
            heapq.heappush(self._queue.setdefault(b, []), (self._key_of(g), self._group_seq[g], self._gid_of[g]))
            self._group_in_queue[g] = 1

    def _retire(self, g: int, h: int) -> None:
        """A trajectory of a failed group stopped running (or got its late reward): once none of
        them runs, the group leaves the scheduler."""
        if self._traj_status[h] in (_RUNNING, _AWAIT_REWARD):
            self._group_live[g] -= 1
        self._traj_status[h] = _DEAD
        if self._group_live[g] == 0 and self._slot_of.get(gid := self._gid_of[g]) == g:
            del self._slot_of[gid]
            self._release_slot(g)

    @staticmethod
    def _bad_reward(reward: Any) -> bool:
        # Any real number (numpy/torch scalars register as `numbers.Real`), finite.
        try:
            return (reward is None or (type(reward) is not float and not isinstance(reward, numbers.Real))
                    or not math.isfinite(reward))
        except OverflowError:  # an int (or Fraction) too large for a float
            return True

    def _set_reward(self, g: int, h: int, reward: Any) -> None:
        if self._bad_reward(reward):
            self.m["invalid_rewards"] += 1
            idx = h - g * self.n
            gid = self._gid_of[g]
            msg = f"invalid reward {_brief(reward)} for trajectory {gid!r}/{idx} (version {self._group_version[g]})"
            self._out.append(A.ReportError(gid, idx, msg))
            self._fail_traj(g, h, msg)
            return
        completes = self._group_done[g] + 1 == self.n
        if completes:
            cseq = self._complete_seq
            gid, v = self._gid_of[g], self._group_version[g]
            if self._builtin_batch:  # `defaults.dora_batch_key`
                key = (v, cseq) if self.mode == "dora" else (cseq,)
            else:
                key = _json_key(self._batch_key(group_id=gid, version=v, complete_seq=cseq, mode=self.mode),
                                "dora_batch_key")
        self._traj_reward[h] = float(reward)
        self._traj_status[h] = _DONE
        self._group_live[g] -= 1
        self._group_done[g] += 1
        if completes:
            self._group_state[g] = _COMPLETE
            self.m["groups_completed"] += 1
            self._n_active -= 1
            self._group_cseq[g] = cseq
            self._complete_seq = cseq + 1
            heapq.heappush(self._pools.setdefault(v, []), (key, cseq, gid))
            self._pool_n += 1
            self._form_dirty = True

    def _fail_traj(self, g: int, h: int, reason: str) -> None:
        """Trajectory `h` (running before, already released, or awaiting its reward) failed."""
        n = self.n
        idx = h - g * n
        v = self._group_version[g]
        if self._traj_retries[h] < self.config.max_retries:
            self._traj_retries[h] += 1
            self._traj_attempt[h] += 1
            self._traj_status[h], self._traj_tokens[h], self._traj_reward[h], self._traj_moved[h] = _QUEUED, 0, _NAN, 0
            self._clear_versions(h)
            self._group_live[g] -= 1
            self.m["retries"] += 1
            self._requeue(g, idx)
            self._enqueue(g, 1)
            self._dispatch(self._bucket(v))
            return
        # Retries exhausted: the group is reported, never silently dropped (C2).
        self._group_state[g] = _FAILED
        self._admitted -= 1
        self._n_active -= 1
        _drop_one(self._unassigned, v)
        self._form_dirty = True
        b = self._bucket(v)
        pending = self._pending(g)
        self._queued[b] = self._queued.get(b, 0) - len(pending)
        for i in pending:
            self._traj_status[g * n + i] = _DEAD
        self._group_retry.pop(g, None)
        self._group_next[g] = n
        self.m["failed_groups"] += 1
        self._out.append(A.ReportGroupFailed(self._gid_of[g], f"trajectory {idx} failed {self._traj_retries[h] + 1} times: {reason}"))
        self._retire(g, h)
        self._check_storm(reason)

    def _check_storm(self, reason: str) -> None:
        """The circuit breaker: stop a failure storm instead of replacing failed groups forever."""
        failed, completed = self.m["failed_groups"], self.m["groups_completed"]
        share = self.config.max_failed_group_share
        if self._halted is None and failed >= max(self.B, 4) and failed > share * (failed + completed):
            self._halted = (
                f"failure storm: {failed} groups failed and {completed} completed "
                f"(failed share {failed / (failed + completed):.2f} > max_failed_group_share {share}); "
                f"{self.m['retries']} retries, {self.m['invalid_rewards']} invalid rewards; "
                f"last failure: {reason}"
            )

    # ------------------------------------------------------------------ admission (R2)
    def _budget_left(self) -> int:
        left = self._adm.limit(self.newest) - self._admitted - self._outstanding
        if self.config.max_steps is not None:
            left = min(left, self.config.max_steps * self.B - self._admitted - self._outstanding)
        return left

    def _admit(self) -> None:
        """R2: request groups when the mode's admission wants some (`_groups_wanted`)."""
        if self._exhausted or self._halted is not None:
            return
        left = self._budget_left()
        if left <= 0:
            return
        want = self._groups_wanted(left)
        if want > 0:
            self._outstanding += want
            self._out.append(A.RequestGroups(want, self.newest))

    def _groups_wanted(self, left: int) -> int:
        """How many groups to request now, `left` (> 0) being what the staleness budget allows:
        the one place R2's request count is computed (`admission`'s look-ahead already lowered
        `left`, in `_budget_left`: `dora_ext.core.admission`)."""
        if self._admission == "batch":
            return left
        if self._admission == "fleet":
            if self._outstanding or any(self._occupied.values()) or any(self._queued.values()):
                return 0
            # The whole fleet holds the newest version and nothing loads.
            if self._n_loading or not self.instances or self._targets.get(self.newest, 0) != len(self.instances):
                return 0
            return min(self.B, left)
        b = self._bucket(self.newest)
        free = self._cap.get(b, 0) - self._occupied.get(b, 0) - self._queued.get(b, 0) - self._outstanding * self.n
        return min(left, -(-free // self.n)) if free > 0 else 0

    # ------------------------------------------------------------------ batch selection (R3, R7)
    def _feasible(self, vg: int, r: int) -> bool:
        """EDF test: after taking a group of version `vg` with `r` slots left (before taking), can
        every unassigned group still be trained within its staleness deadline?"""
        k, K, B = self.step, self.K, self.B
        cum = 0
        for v in sorted(self._unassigned):
            c = self._unassigned[v] - (1 if v == vg else 0)
            if c <= 0:
                continue
            cum += c
            j = v + K - k
            if j < 0:
                j = 0
            if cum > (r - 1) + j * B:
                return False
        return True

    def _form(self) -> None:
        """Fill the step being formed from the completed groups (R3); start it when full, or
        short when nothing more can come. Runs only when one of its inputs changed."""
        if not self._form_dirty or self._trainer_busy is not None:
            return
        self._form_dirty = False
        if (not self._pool_n and not self._exhausted) or self.done:
            return
        k = self.step
        r = self.B - len(self._forming)
        pools = self._pools
        fifo = self._pool_fifo
        dora = self.mode == "dora"
        # A version whose next group passes `_feasible` without the test: it passed for the oldest
        # unassigned `vg`, and taking its group lowers `cum` and `r` by one alike (None: test).
        sure = None
        while r > 0 and self._pool_n:
            # Each version's pool is ordered by the batch key, and feasibility depends only on
            # the version: the candidates are the heads of the live versions' pools.
            best = None
            waited = False
            if fifo:
                # The smallest key among the versions that can be taken now.
                low = None  # the smallest head found untakeable
                for v, heap in pools.items():
                    if best is not None and heap[0] >= best[0]:
                        continue
                    if self._feasible(v, r):
                        best = (heap[0], v)
                    elif low is None or heap[0] < low:
                        low = heap[0]
                # A wait: in dora, when the smallest key of all cannot be taken; the other modes
                # count any head found untakeable.
                waited = low is not None and (not dora or best is None or low < best[0])
            else:
                # dora with the built-in keys: the global head (oldest version first), or wait for it.
                if len(pools) == 1:
                    v = next(iter(pools))  # (the only pooled version: nothing to compare)
                else:
                    v = min(pools, key=lambda u: pools[u][0])
                if v == sure and v in self._unassigned:
                    best = (pools[v][0], v)
                elif self._feasible(v, r):
                    best = (pools[v][0], v)
                    sure = v if v == min(self._unassigned) else None
                else:
                    waited = True
            if waited:
                self.m["trainer_waits_for_older"] += 1
            if best is None:
                break
            v = best[1]
            if v != sure:
                sure = None
            heap = pools[v]
            _, _, gid = heapq.heappop(heap)
            if not heap:
                del pools[v]
            self._pool_n -= 1
            self._assign(self._slot_of[gid], k)
            r -= 1
        r = self.B - len(self._forming)
        if r == 0 or (r > 0 and self._forming and self._nothing_more_coming()):
            self._start_step(k)

    def _nothing_more_coming(self) -> bool:
        return self._exhausted and not self._pool_n and self._n_active == 0

    def _assign(self, g: int, k: int) -> None:
        self._group_state[g] = _ASSIGNED
        self._group_step[g] = k
        _drop_one(self._unassigned, self._group_version[g])
        gid = self._gid_of[g]
        self._forming.append(gid)
        self._trainer_idle = False
        if self._cgp:
            self._out.append(A.DeliverGroup(gid, k))

    def _start_step(self, k: int) -> None:
        gids = tuple(self._forming)
        hist = self.m["staleness_hist"]
        m = self.m
        seen: set = set()
        pinned = self._pinned
        n, tt, tv = self.n, self._traj_tokens, self._traj_version
        trajs = tokens = multi = c1 = 0
        for gid in gids:
            g = self._slot_of[gid]
            v = self._group_version[g]
            s = k - v
            hist[s] = hist.get(s, 0) + 1
            if s > self.K or s < 0:
                m["c3_violations"] += 1
            # Trained twice: twice in this batch, or not in the state of a group assigned to it.
            if gid in seen or self._group_state[g] != _ASSIGNED or self._group_step[g] != k:
                m["duplicated"] += 1
            seen.add(gid)
            base = g * n
            tokens += sum(tt[base:base + n])
            vs_g = tv[base:base + n]
            if vs_g.count(v) != n:  # (all generated by the group's version: nothing to count)
                for vs in vs_g:  # several only when a resume appended a different one
                    if vs == _MULTI:
                        multi += 1
                    elif pinned and vs != v:
                        c1 += 1
            trajs += n
        m["trajectories_trained"] += trajs
        m["tokens_trained"] += tokens
        m["multi_version_trajectories"] += multi
        m["c1_violations"] += c1
        m["groups_trained"] += len(gids)
        self._trainer_busy = k
        self._trainer_idle = False
        self._out.append(A.StartStep(k, gids))
        if self._elastic:
            # The trainer has work now: instances that drained while it waited may be lent.
            for iid in list(self._idle):
                inst = self.instances.get(iid)
                if inst is not None and not inst.nrun and inst.loading is None:
                    self._plan_instance(inst)

    # ------------------------------------------------------------------ pump
    def _finish(self) -> list:
        if self._orphaned:
            self._orphaned = False
            self._plan_idle()
        self._admit()
        self._form()
        if self._adm.watch:
            self._adm.step_formed(self._trainer_busy is not None, len(self._forming), self._pool_n)
        if self._trainer_side:
            self._maybe_switch_to_rollout()
        out, self._out = self._out, []
        if self._halted is not None:
            raise self._storm(out)
        return out

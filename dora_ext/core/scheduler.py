"""Everything in dora-ext revolves around this: one `Scheduler` owns the scheduling state.

It is a pure state machine in the sans-I/O style of h11: a runtime feeds it events
(`handle(event)`) and executes the actions it returns. It never touches a thread, socket, clock,
tensor or host, so the simulator, the embedded runtime and the verl/slime adapters all run this
same code, and what the simulator measures is what users run.

The five modes of design.md are policies over one state:

| mode         | admission                          | versions on instances        | trainer          |
|--------------|------------------------------------|------------------------------|------------------|
| sync         | a whole batch per version (K=0)    | switch when drained          | per batch        |
| one_step_off | a whole batch when the fleet is idle, one version behind (K=1) | switch when drained | per batch |
| partial      | keep slots full within R2          | all switch on publish, running work is preempted and resumed (C1 broken, metered) | per batch |
| pipeline     | a whole batch per version (K=0)    | switch when drained          | streamed (R7)    |
| dora         | keep slots full within R2          | R1 pinning, R4 drain-then-switch, R5 migration | streamed (R7) |

Invariants are checked where state changes: a group trained twice, a group trained beyond the
staleness bound or a trajectory spanning versions outside `partial` would flip `c2_ok`/`c3_ok`/
`c1_ok` in `metrics()`; the property tests assert they never do.

A note on R3. Taking "the mandatory set, then the oldest completed groups" is not enough to keep
C3: a step that takes a newer group while two older ones still run can leave the next step with
more mandatory groups than slots. Each group has a deadline (`version + K`); the scheduler takes a
group only if, afterwards, for every future step `k + j` the unassigned groups due by then still
fit into the remaining slots (`r + j * B`), an earliest-deadline-first feasibility test. R2
guarantees such a schedule exists, so waiting always ends when the engines make progress.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any, Callable, Iterable

from ..config import DoraConfig
from . import actions as A
from . import events as E

_QUEUED, _RUNNING, _AWAIT_REWARD, _DONE, _DEAD = "Q", "R", "F", "D", "X"
_ACTIVE, _COMPLETE, _ASSIGNED, _TRAINED, _FAILED = "active", "complete", "assigned", "trained", "failed"
_ANY = -1  # the single queue/instance bucket of mode `partial`, where nothing is pinned


class ProtocolError(RuntimeError):
    """The runtime broke the event protocol (unknown id, event in the wrong state, ...).

    Like h11's ProtocolError it is raised, never swallowed: a runtime that keeps going on a broken
    protocol would lose or duplicate data silently.
    """


class FailureStorm(RuntimeError):
    """The circuit breaker tripped: too many groups failed (`max_failed_group_share`).

    Raised by `handle()` on the event that tripped it and on every event after; the scheduler's
    state stays consistent (`snapshot()`, `metrics()` still work) but it admits nothing more.
    `actions` holds what the tripping event produced (e.g. the `ReportGroupFailed`).
    """

    def __init__(self, message: str, *, failed: int, completed: int, retries: int, actions: list | None = None):
        super().__init__(message)
        self.failed = failed
        self.completed = completed
        self.retries = retries
        self.actions = list(actions or [])


class _Traj:
    __slots__ = ("status", "instance", "attempt", "tokens", "versions", "reward", "retries", "moved")

    def __init__(self) -> None:
        self.status = _QUEUED
        self.instance: int | None = None
        self.attempt = 0
        self.tokens = 0
        self.versions: list[int] = []
        self.reward: float | None = None
        self.retries = 0
        self.moved = False  # migrated once in this attempt (never moved twice: it may be in flight)


class _Group:
    __slots__ = ("gid", "version", "seq", "key", "meta", "trajs", "pending", "done", "state",
                 "step", "complete_seq", "in_queue")

    def __init__(self, gid: Any, version: int, seq: int, key: tuple, meta: Any, n: int) -> None:
        self.gid = gid
        self.version = version
        self.seq = seq
        self.key = key
        self.meta = meta
        self.trajs = [_Traj() for _ in range(n)]
        self.pending: deque[int] = deque(range(n))
        self.done = 0
        self.state = _ACTIVE
        self.step: int | None = None
        self.complete_seq: int | None = None
        self.in_queue = False


class _Instance:
    __slots__ = ("id", "capacity", "version", "loading", "running")

    def __init__(self, iid: int, capacity: int) -> None:
        self.id = iid
        self.capacity = capacity
        self.version: int | None = None  # loaded version (None: nothing loaded yet)
        self.loading: int | None = None  # version being loaded
        self.running: dict[tuple, None] = {}  # (gid, index) in dispatch order

    @property
    def target(self) -> int | None:
        return self.loading if self.loading is not None else self.version


class Scheduler:
    """The sans-I/O scheduler. See the module docstring and `dora_ext.core.events/actions`."""

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
        self._dead: set[int] = set()  # instances declared failed (late events from them are stale)
        self._orphaned = False  # work was queued for a version no instance holds
        self._halted: str | None = None  # the circuit breaker's message once it tripped

        self.groups: dict[Any, _Group] = {}
        self.instances: dict[int, _Instance] = {}
        self._unassigned: dict[int, int] = {}  # version -> admitted groups not yet in a step
        self._queue: dict[int, list] = {}  # bucket -> heap of (key, seq, gid)
        self._queued: dict[int, int] = {}  # bucket -> queued trajectories
        self._free: dict[int, dict[int, None]] = {}  # bucket -> instances with a free slot
        self._cap: dict[int, int] = {}  # bucket -> capacity of instances loaded or loading it
        self._occupied: dict[int, int] = {}  # bucket -> running on instances targeting it
        self._pool: list = []  # heap of (batch key, complete_seq, gid)
        self._by_version: dict[int, dict[int, None]] = {}  # version -> loaded instances (pinned modes)
        self._targets: dict[int, int] = {}  # version -> instances loaded with or loading it
        self._churn = 0  # deletions from `_free` dicts since they were last compacted
        self._pool_fifo = self.mode != "dora"
        # Elastic colocation: instance id -> capacity of instances on the trainer side (switchable
        # to rollout), switching to the trainer, and switching to rollout.
        self._elastic = config.elastic
        self._trainer_side: dict[int, int] = {}
        self._to_trainer: dict[int, int] = {}
        self._to_rollout: dict[int, int] = {}
        if self._elastic:
            first = max(s.id for s in config.instances) + 1
            cap0 = config.instances[0].capacity
            self._trainer_side = {first + i: cap0 for i in range(config.elastic_spare)}
        self._trainer_idle = False  # reported by TrainerIdle, cleared by the next delivery
        self._spreading: dict[int, int] = {}  # instance -> version it loads to take stragglers
        self._min_rollout = max(1, math.ceil(len(config.instances) * (1.0 - config.elastic_max_lent)))
        self.step_log: list[tuple[int, tuple]] = []
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
        from .. import defaults

        if plugins is None or [p for p in plugins.get_plugins() if p is not defaults] == []:
            # Only the built-ins: call them directly, no dispatch overhead on the hot path.
            self._admission_key = defaults.dora_admission_key
            self._batch_key = defaults.dora_batch_key
            self._plan_migration = defaults.dora_plan_migration
        else:
            hook = plugins.hook
            self._admission_key = lambda **kw: hook.dora_admission_key(**kw)
            self._batch_key = lambda **kw: hook.dora_batch_key(**kw)
            self._plan_migration = lambda **kw: hook.dora_plan_migration(**kw)
        self._plugins = plugins

    # ------------------------------------------------------------------ public API
    def start(self) -> list:
        """Register the configured instances and emit the first actions."""
        if self._started:
            raise ProtocolError("start() called twice")
        self._started = True
        for spec in self.config.instances:
            self._add_instance(spec.id, spec.capacity)
        return self._finish()

    def handle(self, event: Any) -> list:
        """Feed one event; returns the actions to execute, in order."""
        if not self._started:
            raise ProtocolError("handle() before start()")
        if self._halted is not None:
            raise self._storm([])
        try:
            method = self._handlers[type(event)]
        except KeyError:
            raise ProtocolError(f"unknown event {event!r}") from None
        method(self, event)
        return self._finish()

    def _storm(self, actions: list) -> FailureStorm:
        return FailureStorm(self._halted or "", failed=self.m["failed_groups"],
                            completed=self.m["groups_completed"], retries=self.m["retries"], actions=actions)

    @property
    def done(self) -> bool:
        if self._trainer_busy is not None:
            return False
        if self.config.max_steps is not None and self.step >= self.config.max_steps:
            return True
        return self._exhausted and self._n_active == 0 and not self._pool and not self._forming

    @property
    def newest_version(self) -> int:
        return self.newest

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
        live = sum(1 for g in self.groups.values() if g.state in (_ACTIVE, _COMPLETE))
        if self._trainer_busy is None:
            live += len(self._forming)
        m["dropped"] = m["groups_admitted"] - m["groups_trained"] - m["failed_groups"] - live
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
        self._dead.discard(ev.instance_id)
        self._add_instance(ev.instance_id, ev.capacity, lend=not back)

    def _on_migration_landed(self, ev: E.MigrationLanded) -> None:
        g = self._group(ev.group_id)
        t = self._traj(g, ev.index)
        if (ev.attempt is not None and ev.attempt != t.attempt) or t.status != _RUNNING:
            self.m["stale_events"] += 1  # it finished, failed or was re-dispatched meanwhile
            return
        t.moved = False  # it runs on its destination: it may move again (R5)

    def _on_trainer_idle(self, ev: E.TrainerIdle) -> None:
        self._trainer_idle = self._trainer_busy is None

    def _on_switched_to_trainer(self, ev: E.SwitchedToTrainer) -> None:
        cap = self._to_trainer.pop(ev.instance_id, None)
        if cap is None:
            raise ProtocolError(f"instance {ev.instance_id} switched to the trainer without a SwitchToTrainer")
        self._trainer_side[ev.instance_id] = cap

    def _stale_instance(self, iid: int) -> bool:
        """A late event from an instance declared failed: counted and ignored."""
        if iid in self._dead and iid not in self.instances:
            self.m["stale_events"] += 1
            return True
        return False

    def _on_instance_loaded(self, ev: E.InstanceLoaded) -> None:
        if self._stale_instance(ev.instance_id):
            return
        inst = self._instance(ev.instance_id)
        if inst.loading != ev.version:
            raise ProtocolError(
                f"instance {inst.id} reported version {ev.version} loaded, but was asked for {inst.loading}"
            )
        inst.loading = None
        inst.version = ev.version
        self.m["weight_loads"] += 1
        if not self._pinned:
            # partial: preempted trajectories resume under the new version (C1 broken, metered).
            for gid, idx in inst.running:
                t = self.groups[gid].trajs[idx]
                if t.versions[-1] != ev.version:
                    t.versions.append(ev.version)
        if self._pinned:
            self._by_version.setdefault(ev.version, {})[inst.id] = None
        elif ev.version < self.newest:
            # partial: a newer version was published while this one loaded; load it too.
            self._start_load(inst, self.newest, preempt=tuple(inst.running))
            return
        b = self._bucket(ev.version)
        first = None
        if len(inst.running) < inst.capacity:
            self._free.setdefault(b, {})[inst.id] = None
            first = inst.id  # the freshly loaded instance is the emptiest: serve it first
        self._dispatch(b, first)
        if not inst.running:
            self._plan_instance(inst)
        live = sum(1 for c in self._targets.values() if c > 0)
        if live > self.m["live_versions_max"]:
            self.m["live_versions_max"] = live

    def _on_instance_failed(self, ev: E.InstanceFailed) -> None:
        if self._stale_instance(ev.instance_id):
            return
        inst = self._instance(ev.instance_id)
        b = self._bucket(inst.target) if inst.target is not None else None
        if b is not None:
            self._cap[b] -= inst.capacity
            self._occupied[b] -= len(inst.running)
            self._free.get(b, {}).pop(inst.id, None)
        if inst.version is not None:
            self._by_version.get(inst.version, {}).pop(inst.id, None)
        if inst.target is not None:
            self._targets[inst.target] -= 1
        del self.instances[inst.id]
        self._dead.add(inst.id)
        touched = set()
        for gid, idx in inst.running:
            g = self.groups[gid]
            t = g.trajs[idx]
            t.status, t.instance = _QUEUED, None
            t.attempt += 1
            t.tokens = 0
            t.versions = []
            self.m["redispatched"] += 1
            if g.state == _FAILED:
                continue
            g.pending.appendleft(idx)
            self._enqueue(g, 1)
            touched.add(self._bucket(g.version))
        for bb in touched:
            self._dispatch(bb)
        self._plan_all()

    def _on_group_admitted(self, ev: E.GroupAdmitted) -> None:
        if self._outstanding <= 0:
            raise ProtocolError(f"group {ev.group_id!r} admitted without a RequestGroups outstanding")
        if ev.group_id in self.groups:
            raise ProtocolError(f"group id {ev.group_id!r} admitted twice")
        self._outstanding -= 1
        v = self.newest
        seq = self._seq
        self._seq += 1
        key = tuple(self._admission_key(group_id=ev.group_id, version=v, seq=seq, meta=ev.meta, mode=self.mode))
        g = _Group(ev.group_id, v, seq, key, ev.meta, self.n)
        self.groups[ev.group_id] = g
        self._admitted += 1
        self.m["groups_admitted"] += 1
        self._unassigned[v] = self._unassigned.get(v, 0) + 1
        self._n_active += 1
        self._enqueue(g, self.n)
        self._dispatch(self._bucket(v))

    def _on_groups_declined(self, ev: E.GroupsDeclined) -> None:
        if ev.count < 0 or ev.count > self._outstanding:
            raise ProtocolError(f"declined {ev.count} groups but {self._outstanding} are outstanding")
        self._outstanding -= ev.count

    def _on_data_exhausted(self, ev: E.DataExhausted) -> None:
        self._exhausted = True
        self._outstanding = 0

    def _on_progressed(self, ev: E.TrajectoryProgressed) -> None:
        t = self._running_traj(ev.group_id, ev.index, ev.attempt)
        if t is not None:
            t.tokens = ev.tokens

    def _on_finished(self, ev: E.TrajectoryFinished) -> None:
        t = self._running_traj(ev.group_id, ev.index, ev.attempt)
        if t is None:
            return
        g = self.groups[ev.group_id]
        t.tokens = ev.tokens
        if ev.truncated_early:
            self.m["truncated"] += 1
        self._release(g, ev.index, t)
        if g.state == _FAILED:
            return
        t.status = _AWAIT_REWARD
        if ev.reward is not None:
            self._set_reward(g, ev.index, t, ev.reward)

    def _on_reward(self, ev: E.RewardReady) -> None:
        g = self._group(ev.group_id)
        t = self._traj(g, ev.index)
        if ev.attempt is not None and ev.attempt != t.attempt:
            self.m["stale_events"] += 1
            return
        if g.state == _FAILED:
            return
        if t.status != _AWAIT_REWARD:
            raise ProtocolError(f"reward for trajectory {g.gid!r}/{ev.index}, which is not awaiting one ({t.status})")
        self._set_reward(g, ev.index, t, ev.reward)

    def _on_failed(self, ev: E.TrajectoryFailed) -> None:
        g = self._group(ev.group_id)
        t = self._traj(g, ev.index)
        if ev.attempt is not None and ev.attempt != t.attempt:
            self.m["stale_events"] += 1
            return
        if t.status == _RUNNING:
            self._release(g, ev.index, t)
        elif t.status != _AWAIT_REWARD:
            raise ProtocolError(f"trajectory {g.gid!r}/{ev.index} failed but is not running ({t.status})")
        if g.state == _FAILED:
            t.status = _DEAD  # its group was already reported failed
            return
        self._fail_traj(g, ev.index, t, ev.reason)

    def _on_step_started(self, ev: E.TrainerStepStarted) -> None:
        if self._trainer_busy != ev.step:
            raise ProtocolError(f"trainer started step {ev.step}, but the running step is {self._trainer_busy}")

    def _on_step_finished(self, ev: E.TrainerStepFinished) -> None:
        if self._trainer_busy != ev.step:
            raise ProtocolError(f"trainer finished step {ev.step}, but the running step is {self._trainer_busy}")
        for gid in self._forming:
            self.groups[gid].state = _TRAINED
        self._forming = []
        self._trainer_busy = None
        self.step += 1

    def _on_published(self, ev: E.VersionPublished) -> None:
        if ev.version != self.newest + 1:
            raise ProtocolError(f"version {ev.version} published, expected {self.newest + 1}")
        if ev.version > self.step:
            raise ProtocolError(f"version {ev.version} published before trainer step {ev.version - 1} finished")
        self.newest = ev.version
        if not self._pinned:
            # partial: every instance switches now; running work is preempted and resumed.
            for inst in self.instances.values():
                if inst.version is None or inst.loading is not None or inst.version == ev.version:
                    continue
                self._start_load(inst, ev.version, preempt=tuple(inst.running))
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
    def _instance(self, iid: int) -> _Instance:
        try:
            return self.instances[iid]
        except KeyError:
            raise ProtocolError(f"unknown (or failed) instance {iid!r}") from None

    def _group(self, gid: Any) -> _Group:
        try:
            return self.groups[gid]
        except KeyError:
            raise ProtocolError(f"unknown group {gid!r}") from None

    def _traj(self, g: _Group, idx: int) -> _Traj:
        if not 0 <= idx < len(g.trajs):
            raise ProtocolError(f"group {g.gid!r} has no trajectory {idx} (group size {len(g.trajs)})")
        return g.trajs[idx]

    def _running_traj(self, gid: Any, idx: int, attempt: int | None) -> _Traj | None:
        g = self._group(gid)
        t = self._traj(g, idx)
        if attempt is not None and attempt != t.attempt:
            self.m["stale_events"] += 1
            return None
        if t.status != _RUNNING:
            raise ProtocolError(f"trajectory {gid!r}/{idx} is not running ({t.status})")
        return t

    def _bucket(self, version: int) -> int:
        return version if self._pinned else _ANY

    # ------------------------------------------------------------------ state changes
    def _add_instance(self, iid: int, capacity: int, lend: bool = True) -> None:
        self.instances[iid] = _Instance(iid, capacity)
        self._plan_instance(self.instances[iid], lend=lend)

    def _start_load(self, inst: _Instance, version: int, preempt: tuple = ()) -> None:
        if inst.version is not None and inst.loading is None:
            self._by_version.get(inst.version, {}).pop(inst.id, None)
        old = inst.target
        if old is not None:
            c = self._targets[old] - 1
            if c:
                self._targets[old] = c
            else:
                del self._targets[old]
            ob = self._bucket(old)
            self._cap[ob] -= inst.capacity
            self._occupied[ob] -= len(inst.running)
            self._free.get(ob, {}).pop(inst.id, None)
        nb = self._bucket(version)
        self._cap[nb] = self._cap.get(nb, 0) + inst.capacity
        self._occupied[nb] = self._occupied.get(nb, 0) + len(inst.running)
        self._targets[version] = self._targets.get(version, 0) + 1
        inst.loading = version
        self._out.append(A.LoadVersion(inst.id, version, preempt))

    def _enqueue(self, g: _Group, added: int) -> None:
        """`added` trajectories of `g` joined its pending list; make sure the group is queued."""
        b = self._bucket(g.version)
        self._queued[b] = self._queued.get(b, 0) + added
        if self._pinned and not self._cap.get(b):
            self._orphaned = True  # no instance holds or loads this version: see `_finish`
        if not g.in_queue and g.pending:
            heapq.heappush(self._queue.setdefault(b, []), (g.key, g.seq, g.gid))
            g.in_queue = True

    def _dispatch(self, b: int, first: int | None = None) -> None:
        """Give free slots of bucket `b` to its queued trajectories, group-major (R6).

        Instances take work round robin, each up to its fair share of the bucket's work
        (running + queued, in proportion to its capacity, counting instances still loading the
        version). Otherwise the first instance to finish loading would take a whole batch and
        leave the others idle: a colocated `sync` fleet would run at half width. `first` (a
        freshly loaded instance, the emptiest) is served before the round robin.
        """
        heap = self._queue.get(b)
        free = self._free.get(b)
        if not heap or not free:
            return
        out = self.groups
        share_of = self._cap[b]
        work = self._occupied[b] + self._queued[b]
        skips = 0
        while heap and free:
            gid = heap[0][2]
            g = out[gid]
            if not g.pending:
                heapq.heappop(heap)
                g.in_queue = False
                continue
            iid = first if first is not None else next(iter(free))
            inst = self.instances[iid]
            if len(inst.running) >= -(-work * inst.capacity // share_of):
                if first is not None:
                    first = None  # the fresh instance has its share; on to the round robin
                    continue
                del free[iid]  # at its fair share: rotate it to the back
                free[iid] = None
                self._churn += 1
                skips += 1
                if skips >= len(free):
                    break
                continue
            skips = 0
            idx = g.pending.popleft()
            t = g.trajs[idx]
            t.status, t.instance, t.moved = _RUNNING, iid, False
            t.versions = [inst.version]
            inst.running[(gid, idx)] = None
            self._occupied[b] += 1
            self._queued[b] -= 1
            if len(inst.running) >= inst.capacity:
                del free[iid]  # full
                first = None
            elif first is None:
                del free[iid]  # round robin: move the instance to the back
                free[iid] = None
            self._churn += 1
            self._out.append(A.Dispatch(gid, idx, iid, inst.version, t.attempt))
        if self._churn > 4 * len(free) + 64:
            # Deleted dict entries stay as dummies at the front until the dict is rebuilt, and
            # `next(iter(free))` walks over them: compact now and then (order is kept).
            self._free[b] = dict(free)
            self._churn = 0
        if not heap and self._queued.get(b) == 0 and b != self._bucket(self.newest):
            del self._queue[b], self._queued[b]  # keep per-version dicts as short as the live set

    def _release(self, g: _Group, idx: int, t: _Traj) -> None:
        """A running trajectory left its instance (finished or failed)."""
        inst = self.instances.get(t.instance)
        t.instance = None
        if inst is None:
            return
        del inst.running[(g.gid, idx)]
        if inst.target is not None:
            b = self._bucket(inst.target)
            self._occupied[b] -= 1
            if inst.loading is None:
                self._free.setdefault(b, {})[inst.id] = None
                self._dispatch(b)
        if not inst.running:
            self._plan_instance(inst)
        elif self._migrate and inst.version is not None and inst.version < self.newest:
            self._maybe_consolidate(inst.version)

    def _set_reward(self, g: _Group, idx: int, t: _Traj, reward: Any) -> None:
        if reward is None or not isinstance(reward, (int, float)) or math.isnan(reward) or math.isinf(reward):
            self.m["invalid_rewards"] += 1
            msg = f"invalid reward {reward!r} for trajectory {g.gid!r}/{idx} (version {g.version})"
            self._out.append(A.ReportError(g.gid, idx, msg))
            self._fail_traj(g, idx, t, msg)
            return
        t.reward = float(reward)
        t.status = _DONE
        g.done += 1
        if g.done == len(g.trajs):
            g.state = _COMPLETE
            self.m["groups_completed"] += 1
            self._n_active -= 1
            g.complete_seq = self._complete_seq
            self._complete_seq += 1
            key = tuple(self._batch_key(group_id=g.gid, version=g.version, complete_seq=g.complete_seq, mode=self.mode))
            heapq.heappush(self._pool, (key, g.complete_seq, g.gid))

    def _fail_traj(self, g: _Group, idx: int, t: _Traj, reason: str) -> None:
        if t.retries < self.config.max_retries:
            t.retries += 1
            t.attempt += 1
            t.status, t.tokens, t.versions, t.reward = _QUEUED, 0, [], None
            self.m["retries"] += 1
            g.pending.appendleft(idx)
            self._enqueue(g, 1)
            self._dispatch(self._bucket(g.version))
            return
        # Retries exhausted: the group is reported, never silently dropped (C2).
        t.status = _DEAD
        g.state = _FAILED
        self._admitted -= 1
        self._n_active -= 1
        self._dec_unassigned(g.version)
        b = self._bucket(g.version)
        self._queued[b] = self._queued.get(b, 0) - len(g.pending)
        g.pending.clear()
        self.m["failed_groups"] += 1
        self._out.append(A.ReportGroupFailed(g.gid, f"trajectory {idx} failed {t.retries + 1} times: {reason}"))
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

    # ------------------------------------------------------------------ instance planning (R4, R5)
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
        if inst.loading is not None or inst.running:
            return
        want = self._orphan_version()
        if want is None:
            if inst.version is not None and self._queued.get(self._bucket(inst.version), 0) > 0:
                return  # its own version still has queued work
            if self._spread and self._maybe_spread(inst):
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
        for inst in list(self.instances.values()):
            self._plan_instance(inst)
        if self._migrate:
            for v in sorted({i.version for i in self.instances.values() if i.version is not None}):
                if v < self.newest:
                    self._maybe_consolidate(v)

    def _maybe_consolidate(self, v: int) -> None:
        """R5: when an old version's running work is spread thin, move it onto fewer instances."""
        if self._queued.get(v, 0) > 0 or v + self.K <= self.step:
            # A version the step being formed must take gates the trainer: its stragglers keep
            # their instances (packing them would slow each one down).
            return
        occ, cap = self._occupied.get(v, 0), self._cap.get(v, 0)
        if occ == 0 or occ > self.config.migrate_threshold * cap:
            return
        # Only worth it when the newest version could use the freed slots.
        demand = self._budget_left() > 0 or self._queued.get(self._bucket(self.newest), 0) > 0
        if not demand:
            return
        holders = [self.instances[i] for i in self._by_version.get(v, ()) if self.instances[i].running]
        if len(holders) < 2:
            return
        plan = self._plan_migration(
            version=v,
            instances=[{"id": i.id, "capacity": i.capacity, "running": list(i.running)} for i in holders],
            newest_version=self.newest,
            fill=self.config.migrate_threshold,
        )
        for gid, idx, src, dst in plan or ():
            s, d = self.instances.get(src), self.instances.get(dst)
            if s is None or d is None or s.version != v or d.version != v or d.loading is not None:
                raise ProtocolError(f"migration plan moves {gid!r}/{idx} between instances not holding version {v}")
            if (gid, idx) not in s.running or len(d.running) >= d.capacity:
                raise ProtocolError(f"migration plan for {gid!r}/{idx} from {src} to {dst} is not feasible")
            t = self.groups[gid].trajs[idx]
            if t.moved:
                continue  # its first move may still be in flight: a trajectory moves at most once
            t.moved = True
            del s.running[(gid, idx)]
            d.running[(gid, idx)] = None
            t.instance = dst
            if len(d.running) >= d.capacity:
                self._free.get(v, {}).pop(dst, None)
            self._free.setdefault(v, {})[src] = None
            self.m["migrations"] += 1
            self._out.append(A.Migrate(gid, idx, src, dst, v))
        for i in holders:
            if not i.running:
                self._plan_instance(i)

    def _gating_crowd(self) -> tuple[int, int] | None:
        """(version, most running on one of its instances) of the crowded gating version: the
        oldest version that the step being formed must take (`v + K <= step`) and whose running
        trajectories share an instance (at least two on one)."""
        best = None
        for v, holders in self._by_version.items():
            if v + self.K > self.step:
                continue
            most = max((len(self.instances[i].running) for i in holders), default=0)
            if most >= 2 and (best is None or v < best[0]):
                best = (v, most)
        return best

    def _maybe_spread(self, inst: _Instance) -> bool:
        """R5 the other way: spread the gating version's stragglers onto an idle instance.

        Only when the instance has nothing else to do (the staleness budget is spent and no work
        is queued). A decode iteration costs more with every running sequence and every context
        token on the instance, so stragglers the trainer waits for finish sooner when fewer share
        an instance. The idle instance loads the gating version if it holds another (R4 allows
        it: it runs nothing), and takes an even share of that version's running trajectories.
        """
        chosen = self._spreading.pop(inst.id, None)
        if chosen is None:
            if self._budget_left() > 0 or self._outstanding or any(self._queued.values()):
                return False
        crowd = self._gating_crowd()
        if crowd is None:
            return False
        v = crowd[0]
        if inst.version != v:
            self._spreading[inst.id] = v
            self._start_load(inst, v)  # it spreads when loaded (`_plan_instance` again)
            return True
        holders = [self.instances[i] for i in self._by_version.get(v, ()) if i != inst.id and self.instances[i].running]
        total = sum(len(h.running) for h in holders)
        keep = -(-total // (len(holders) + 1))  # each instance's even share, this one included
        room = min(inst.capacity, keep)
        moved = 0
        for h in sorted(holders, key=lambda h: (-len(h.running), h.id)):
            excess = len(h.running) - keep
            for gid, idx in list(h.running):
                if moved >= room or excess <= 0:
                    break
                t = self.groups[gid].trajs[idx]
                if t.moved:
                    continue  # a trajectory moves at most once (its first move may be in flight)
                t.moved = True
                excess -= 1
                del h.running[(gid, idx)]
                inst.running[(gid, idx)] = None
                t.instance = inst.id
                self._free.setdefault(v, {})[h.id] = None
                self.m["migrations"] += 1
                self._out.append(A.Migrate(gid, idx, h.id, inst.id, v))
                moved += 1
        if len(inst.running) >= inst.capacity:
            self._free.get(v, {}).pop(inst.id, None)
        return moved > 0

    # ------------------------------------------------------------------ admission (R2)
    def _budget_left(self) -> int:
        left = (self.newest + self.K + 1) * self.B - self._admitted - self._outstanding
        if self.config.max_steps is not None:
            left = min(left, self.config.max_steps * self.B - self._admitted - self._outstanding)
        return left

    def _admit(self) -> None:
        if self._exhausted or self._halted is not None:
            return
        left = self._budget_left()
        if left <= 0:
            return
        if self._admission == "batch":
            want = left
        elif self._admission == "fleet":
            if self._outstanding or any(self._occupied.values()) or any(self._queued.values()):
                return
            if any(i.target != self.newest or i.loading is not None for i in self.instances.values()):
                return
            if not self.instances:
                return
            want = min(self.B, left)
        else:
            b = self._bucket(self.newest)
            free = self._cap.get(b, 0) - self._occupied.get(b, 0) - self._queued.get(b, 0)
            free -= self._outstanding * self.n
            if free <= 0:
                return
            want = min(left, -(-free // self.n))
        if want > 0:
            self._outstanding += want
            self._out.append(A.RequestGroups(want, self.newest))

    # ------------------------------------------------------------------ batch selection (R3, R7)
    def _dec_unassigned(self, v: int) -> None:
        c = self._unassigned[v] - 1
        if c:
            self._unassigned[v] = c
        else:
            del self._unassigned[v]

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
        if self._trainer_busy is not None or (not self._pool and not self._exhausted) or self.done:
            return
        k = self.step
        r = self.B - len(self._forming)
        if r > 0 and self._pool:
            if self._pool_fifo:
                self._take_fifo(k, r)
            else:
                while r > 0 and self._pool:
                    _, _, gid = self._pool[0]
                    g = self.groups[gid]
                    if not self._feasible(g.version, r):
                        self.m["trainer_waits_for_older"] += 1
                        break
                    heapq.heappop(self._pool)
                    self._assign(g, k)
                    r -= 1
        r = self.B - len(self._forming)
        if r == 0 or (r > 0 and self._forming and self._nothing_more_coming()):
            self._start_step(k)

    def _take_fifo(self, k: int, r: int) -> None:
        skipped = []
        while r > 0 and self._pool:
            item = heapq.heappop(self._pool)
            g = self.groups[item[2]]
            if self._feasible(g.version, r):
                self._assign(g, k)
                r -= 1
            else:
                skipped.append(item)
        if skipped:
            self.m["trainer_waits_for_older"] += 1
            for item in skipped:
                heapq.heappush(self._pool, item)

    def _nothing_more_coming(self) -> bool:
        return self._exhausted and not self._pool and self._n_active == 0

    def _assign(self, g: _Group, k: int) -> None:
        g.state = _ASSIGNED
        g.step = k
        self._dec_unassigned(g.version)
        self._forming.append(g.gid)
        self._trainer_idle = False
        if self._cgp:
            self._out.append(A.DeliverGroup(g.gid, k))

    def _start_step(self, k: int) -> None:
        gids = tuple(self._forming)
        hist = self.m["staleness_hist"]
        seen: set = set()
        for gid in gids:
            g = self.groups[gid]
            s = k - g.version
            hist[s] = hist.get(s, 0) + 1
            if s > self.K or s < 0:
                self.m["c3_violations"] += 1
            # Trained twice: twice in this batch, or not in the state of a group assigned to it.
            if gid in seen or g.state != _ASSIGNED or g.step != k:
                self.m["duplicated"] += 1
            seen.add(gid)
            for t in g.trajs:
                self.m["trajectories_trained"] += 1
                self.m["tokens_trained"] += t.tokens
                if len(set(t.versions)) > 1:
                    self.m["multi_version_trajectories"] += 1
                elif self._pinned and t.versions != [g.version]:
                    self.m["c1_violations"] += 1
        self.m["groups_trained"] += len(gids)
        self.step_log.append((k, gids))
        self._trainer_busy = k
        self._trainer_idle = False
        self._out.append(A.StartStep(k, gids))
        if self._elastic:
            # The trainer has work now: instances that drained while it waited may be lent.
            for inst in list(self.instances.values()):
                if not inst.running and inst.loading is None:
                    self._plan_instance(inst)

    # ------------------------------------------------------------------ snapshot / restore
    def snapshot(self) -> dict[str, Any]:
        """The whole state as JSON-serialisable data; `restore` rebuilds an identical scheduler."""
        groups = []
        for g in self.groups.values():
            groups.append([
                g.gid, g.version, g.seq, list(g.key), g.meta, g.state, g.step, g.complete_seq,
                g.in_queue, list(g.pending), g.done,
                [[t.status, t.instance, t.attempt, t.tokens, list(t.versions), t.reward, t.retries, t.moved]
                 for t in g.trajs],
            ])
        insts = [[i.id, i.capacity, i.version, i.loading, [list(k) for k in i.running]]
                 for i in self.instances.values()]

        def heap(h):
            return [[list(e[0]), e[1], e[2]] for e in h]

        return {
            "format": 1,
            "config": self.config.to_dict(),
            "scalars": {
                "newest": self.newest, "step": self.step, "trainer_busy": self._trainer_busy,
                "started": self._started, "exhausted": self._exhausted,
                "outstanding": self._outstanding, "admitted": self._admitted, "seq": self._seq,
                "complete_seq": self._complete_seq, "n_active": self._n_active,
                "halted": self._halted, "orphaned": self._orphaned,
            },
            "dead": sorted(self._dead),
            "forming": list(self._forming),
            "groups": groups,
            "instances": insts,
            "unassigned": [[v, c] for v, c in self._unassigned.items()],
            "queue": [[b, heap(h)] for b, h in self._queue.items()],
            "queued": [[b, c] for b, c in self._queued.items()],
            "free": [[b, list(d)] for b, d in self._free.items()],
            "cap": [[b, c] for b, c in self._cap.items()],
            "occupied": [[b, c] for b, c in self._occupied.items()],
            "by_version": [[b, list(d)] for b, d in self._by_version.items()],
            "targets": [[b, c] for b, c in self._targets.items()],
            "pool": heap(self._pool),
            "step_log": [[k, list(g)] for k, g in self.step_log],
            "elastic": [[[i, c] for i, c in d.items()]
                        for d in (self._trainer_side, self._to_trainer, self._to_rollout, self._spreading)],
            "trainer_idle": self._trainer_idle,
            "metrics": {**self.m, "staleness_hist": [[k, v] for k, v in self.m["staleness_hist"].items()]},
        }

    @classmethod
    def restore(cls, snap: dict[str, Any], plugins: Any = None) -> "Scheduler":
        """Rebuild a scheduler from `snapshot()` output (possibly after a JSON round trip)."""
        if snap.get("format") != 1:
            raise ProtocolError(f"unknown snapshot format {snap.get('format')!r}")
        self = cls(DoraConfig.from_dict(snap["config"]), plugins=plugins)
        sc = snap["scalars"]
        self.newest, self.step, self._trainer_busy = sc["newest"], sc["step"], sc["trainer_busy"]
        self._started, self._exhausted = sc["started"], sc["exhausted"]
        self._outstanding, self._admitted = sc["outstanding"], sc["admitted"]
        self._seq, self._complete_seq, self._n_active = sc["seq"], sc["complete_seq"], sc["n_active"]
        self._halted, self._orphaned = sc.get("halted"), sc.get("orphaned", False)
        self._dead = set(snap.get("dead", ()))
        self._forming = list(snap["forming"])
        for (gid, version, seq, key, meta, state, step, cseq, in_queue, pending, done, trajs) in snap["groups"]:
            g = _Group(gid, version, seq, tuple(key), meta, len(trajs))
            g.state, g.step, g.complete_seq, g.in_queue = state, step, cseq, in_queue
            g.pending = deque(pending)
            g.done = done
            for t, (status, inst, attempt, tokens, versions, reward, retries, moved) in zip(g.trajs, trajs):
                t.status, t.instance, t.attempt, t.tokens, t.moved = status, inst, attempt, tokens, moved
                t.versions, t.reward, t.retries = list(versions), reward, retries
            self.groups[gid] = g
        for iid, cap, version, loading, running in snap["instances"]:
            inst = _Instance(iid, cap)
            inst.version, inst.loading = version, loading
            inst.running = {(gid, idx): None for gid, idx in running}
            self.instances[iid] = inst
        self._unassigned = {v: c for v, c in snap["unassigned"]}
        self._queue = {b: [(tuple(k), s, gid) for k, s, gid in h] for b, h in snap["queue"]}
        self._queued = {b: c for b, c in snap["queued"]}
        self._free = {b: dict.fromkeys(d) for b, d in snap["free"]}
        self._cap = {b: c for b, c in snap["cap"]}
        self._occupied = {b: c for b, c in snap["occupied"]}
        self._by_version = {b: dict.fromkeys(d) for b, d in snap["by_version"]}
        self._targets = {b: c for b, c in snap["targets"]}
        self._pool = [(tuple(k), s, gid) for k, s, gid in snap["pool"]]
        self.step_log = [(k, tuple(g)) for k, g in snap["step_log"]]
        if "elastic" in snap:
            self._trainer_side, self._to_trainer, self._to_rollout, self._spreading = (
                {i: c for i, c in d} for d in snap["elastic"])
        self._trainer_idle = snap.get("trainer_idle", False)
        m = dict(snap["metrics"])
        m["staleness_hist"] = {int(k): v for k, v in m["staleness_hist"]}
        self.m = m
        return self

    # ------------------------------------------------------------------ pump
    def _finish(self) -> list:
        if self._orphaned:
            self._orphaned = False
            self._plan_idle()
        self._admit()
        self._form()
        if self._trainer_side:
            self._maybe_switch_to_rollout()
        out, self._out = self._out, []
        if self._halted is not None:
            raise self._storm(out)
        return out

    # ------------------------------------------------------------------ elastic colocation
    def _should_lend(self) -> bool:
        """Rollout -> trainer: the staleness budget is spent and no work waits for a slot, so the
        trainer is the bottleneck and an idle instance's accelerators serve it better."""
        if len(self.instances) <= self._min_rollout:
            return False
        if self._budget_left() > 0 or self._outstanding or any(self._queued.values()):
            return False
        # ... and the trainer has work (a step runs, or groups of the step being formed were
        # delivered and it has not reported running dry): a trainer stalled on stragglers would
        # gain nothing from more accelerators.
        return not self._trainer_idle and (self._trainer_busy is not None or bool(self._forming))

    def _switch_to_trainer(self, inst: _Instance) -> None:
        """Take the idle instance out of the rollout pool and lend its accelerators to the trainer."""
        if inst.version is not None:
            b = self._bucket(inst.version)
            self._cap[b] -= inst.capacity
            self._free.get(b, {}).pop(inst.id, None)
            self._by_version.get(inst.version, {}).pop(inst.id, None)
            c = self._targets[inst.version] - 1
            if c:
                self._targets[inst.version] = c
            else:
                del self._targets[inst.version]
        del self.instances[inst.id]
        self._to_trainer[inst.id] = inst.capacity
        self.m["switches_to_trainer"] += 1
        self._out.append(A.SwitchToTrainer(inst.id))

    def _maybe_switch_to_rollout(self) -> None:
        """Trainer -> rollout: the trainer waits for trajectories (no step runs and none can be
        formed) while the rollout has more work than slots: the long tail."""
        if not self._trainer_idle or self._trainer_busy is not None or self.done:
            return
        b = self._bucket(self.newest)
        demand = self._queued.get(b, 0) + (self._outstanding + max(0, self._budget_left())) * self.n
        need = demand - (self._cap.get(b, 0) - self._occupied.get(b, 0)) - sum(self._to_rollout.values())
        if need <= 0 and self._spread and not self._to_rollout and self._gating_crowd() is not None:
            need = 1  # the stragglers the trainer waits for share instances: spread them (R5)
        while need > 0 and self._trainer_side:
            iid = min(self._trainer_side)
            cap = self._trainer_side.pop(iid)
            self._to_rollout[iid] = cap
            need -= cap
            self.m["switches_to_rollout"] += 1
            self._out.append(A.SwitchToRollout(iid, cap))
    def _plan_idle(self) -> None:
        """Work was queued for a version no instance holds (a retry or a crash re-queued a
        trajectory of an older version): switch an idle instance to it (R4). Busy instances
        switch when they drain (`_release`)."""
        for inst in list(self.instances.values()):
            if inst.loading is None and not inst.running:
                self._plan_instance(inst)
                if self._orphan_version() is None:
                    return

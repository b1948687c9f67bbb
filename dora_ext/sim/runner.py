"""The discrete-event executor: runs the real `dora_ext.core.Scheduler` on a virtual clock.

The simulator decides nothing a mode decides: it feeds the scheduler events, executes the actions
it returns with the cost models of `presets.py`, and turns their costs into future events on one
heap, so what it measures is the scheduling code users run.

It also checks the scheduler from the outside: an action the hardware could not execute raises
`SimError`, a run that stops making progress `SimDeadlock`, and C1-C3 are measured from what the
simulator itself executed (`sim_checks`), independently of the scheduler's own counters.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..config import ADMISSION_MODES, MODES, DEFAULT_STALENESS, DoraConfig
from ..core import actions as A
from ..core import events as E
from ..core import Scheduler
from .engine import STATE_EMPTY, SimInstance
from .hosts import HostProfile, get_host
from .presets import Preset
from .workload import LengthSampler, WorkloadError

_FINISH, _LOADED, _ARRIVE, _TRAINER, _ROLE, _SPEED, _HANDOFF = 0, 1, 2, 3, 4, 5, 6

#: `Simulation.save` writes this checkpoint format; `Simulation.load` reads only this one.
CHECKPOINT_FORMAT = 1


class SimError(RuntimeError):
    """The scheduler asked for something the simulated hardware cannot do (a core bug)."""


class SimDeadlock(SimError):
    """Nothing is left to happen on the virtual clock, yet the run is not done."""


@dataclass(frozen=True)
class Layout:
    """How the G accelerators are used by one mode: rollout instances and trainer accelerators."""

    instances: int
    trainer_accelerators: int
    colocated: bool
    accelerators_per_instance: int = 1
    share: int = 1  # instances time-sharing one instance's accelerators (a preset's fixed `instances`)

    @property
    def rollout_accelerators(self) -> int:
        return self.instances // self.share * self.accelerators_per_instance

    @property
    def total_accelerators(self) -> int:
        if self.colocated:
            return self.trainer_accelerators
        return self.rollout_accelerators + self.trainer_accelerators

    @property
    def split(self) -> str:
        """`"colocated"` or `"R:T"` (rollout:trainer accelerators)."""
        return "colocated" if self.colocated else f"{self.rollout_accelerators}:{self.trainer_accelerators}"


def parse_split(text: str | None) -> tuple[int, int] | str | None:
    """`None`, `"auto"`, or `"R:T"` (rollout:trainer accelerators) -> the split setting."""
    if text is None or text == "auto":
        return text
    parts = str(text).split(":")
    try:
        r, t = (int(p) for p in parts)
    except ValueError:
        raise WorkloadError(f"split: expected 'R:T' (two integers) or 'auto', got {text!r}") from None
    if r < 1 or t < 1:
        raise WorkloadError(f"split: both sides must be >= 1, got {text!r}")
    return (r, t)


def layout_for(preset: Preset, mode: str, split: tuple[int, int] | None) -> Layout:
    """Equal hardware (design.md): `sync` colocated unless the preset says otherwise; others split.

    `split` as `(R, T)` accelerators; when `R + T` differs from the preset's G it is read as a
    ratio of G. The rollout side is rounded down to whole instances.
    """
    g, tp = preset.accelerators, preset.engine.accelerators
    if mode == "sync" and preset.sync_colocated:
        n = g // tp
        return Layout(max(n, preset.instances), g, True, tp, max(1, preset.instances // n))
    r, t = split if split is not None else preset.default_split
    if r + t != g:
        r = round(g * r / (r + t))
    n = max(1, r // tp)
    trainer = g - n * tp
    if trainer < 1:
        n = (g - 1) // tp
        trainer = g - n * tp
    if n < 1:
        raise WorkloadError(f"split: {preset.name} has {g} accelerators, too few for a rollout instance of {tp} and a trainer")
    share = max(1, preset.instances // n)
    return Layout(n * share, trainer, False, tp, share)


@dataclass
class RunResult:
    """One mode's run: the design.md metrics plus what a plot needs."""

    mode: str
    layout: Layout
    max_staleness: int
    metrics: dict[str, Any]
    core_metrics: dict[str, Any]
    sim_checks: dict[str, Any]
    t_end: float
    step_end: list[float]
    trainer_busy: list[tuple[float, float]] = field(default_factory=list)
    trainer_kinds: list[str] = field(default_factory=list)  # per trainer_busy span: group, opt, publish, load
    instance_logs: list[list[tuple[float, int]]] | None = None
    events: int = 0
    tail10_time_share: float | None = None


class Simulation:
    """One mode on one preset. `run()` returns a `RunResult`."""

    def __init__(
        self,
        preset: Preset,
        mode: str,
        *,
        steps: int,
        seed: int = 0,
        max_staleness: int | None = None,
        split: tuple[int, int] | None = None,
        records: list[tuple[int, int | None]] | None = None,
        instances: int | None = None,
        timeline: bool = False,
        plugins: Any = None,
        config: dict[str, Any] | None = None,
        host: HostProfile | str | None = None,
    ) -> None:
        if mode not in MODES:
            raise WorkloadError(f"modes: unknown mode {mode!r}; accepted: {', '.join(MODES)}")
        if steps < 1:
            raise WorkloadError(f"steps: expected an integer >= 1, got {steps!r}")
        self.preset = preset
        self.mode = mode
        self.layout = layout_for(preset, mode, split)
        if instances is not None:
            # Scale runs: a rollout pool of `instances` with the trainer sized to keep the ratio.
            scale = instances / self.layout.instances
            lay = self.layout
            tp = lay.accelerators_per_instance
            trainer = instances * tp if lay.colocated else max(1, round(lay.trainer_accelerators * scale))
            self.layout = Layout(instances, trainer, lay.colocated, tp)
        k = _staleness(mode, max_staleness)
        self.K = k
        self.steps = steps
        self.seed = seed
        ec = preset.engine
        self.host = host = get_host(host)
        self._publish_s, self._load_s = host.publish_s(preset), host.load_s(preset)
        self._migrate_bw = ec.migrate_bytes_per_s if host.migrate_kv else 0.0
        self._kv = ec.kv_budget_tokens if host.kv_memory else 0
        w = preset.workload
        if self._kv and self._kv < w.prompt_cap + w.response_cap + 1:
            raise WorkloadError(f"kv_budget_tokens: {preset.name}'s {self._kv} cannot hold one sequence "
                                f"(prompt_cap + response_cap = {w.prompt_cap + w.response_cap})")
        self.weight_sync_s = 0.0  # trainer seconds spent publishing and loading weights
        self.migration_reprefill = 0.0  # context re-prefilled by migrations
        extra = dict(config or {})  # other scheduler settings, e.g. {"migrate": False}
        if mode not in ADMISSION_MODES:  # (one config serves the modes `compare` runs side by side)
            extra.pop("admission", None)
        if extra.get("elastic") and "elastic_spare" not in extra:
            if self.layout.colocated:
                raise WorkloadError(f"elastic: mode {mode!r} runs colocated here; elastic colocation needs split pools")
            # The trainer's accelerators may form instances up to half of them (it keeps the rest).
            extra["elastic_spare"] = (self.layout.trainer_accelerators // 2) // self.layout.accelerators_per_instance
        self.config = DoraConfig.from_dict(
            {
                "mode": mode,
                "max_staleness": k,
                "batch_size": preset.batch_size,
                "group_size": preset.workload.group_size,
                "instances": self.layout.instances,
                "capacity": ec.capacity,
                "max_steps": steps,
                **extra,
            }
        )
        self.sched = Scheduler(self.config, plugins)
        self.sampler = LengthSampler(preset.workload, seed, records)
        self.engine = ec
        self.tc = preset.trainer
        self.timeline = timeline

        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self._pending: deque = deque()
        self._dirty: dict[int, SimInstance] = {}
        self.inst: dict[int, SimInstance] = {}
        for spec in self.config.instances:
            si = SimInstance(spec.id, ec, self._kv)
            si.capacity = spec.capacity
            if timeline:
                si.log = []
            self.inst[spec.id] = si

        # groups: gid -> (version, prompt tokens, response lengths)
        self._next_gid = 0
        self.groups: dict[int, tuple[int, int, tuple[int, ...]]] = {}
        self.cut: dict[int, int] = {}  # gid -> responses cut at the response cap (when any)
        self.first_dispatch: dict[int, float] = {}
        self.last_finish: dict[int, float] = {}
        self.finish_log: list[tuple[float, int]] | None = [] if timeline else None
        self.traj: dict[tuple[int, int], tuple[int, int]] = {}  # key -> (attempt, version at dispatch)
        self.multi: dict[tuple[int, int], list[int]] = {}  # key -> versions, once resumed under another
        self._transit: dict[tuple[int, int], int] = {}  # migrating trajectory -> destination
        self.finished: set[tuple[int, int]] = set()  # trajectories that finished on an instance
        self.migrations_after_finish = 0
        self.trained_step: dict[int, int] = {}
        self.duplicated = 0
        self.events = 0

        # elastic colocation: instances whose accelerators serve the trainer (or are switching)
        self.off_rollout: dict[int, str] = {}  # id -> "trainer" | "to_trainer" | "to_rollout"
        if self.config.elastic:
            first = max(self.inst) + 1
            for i in range(self.config.elastic_spare):
                si = SimInstance(first + i, ec, self._kv)
                if timeline:
                    si.log = []
                self.inst[first + i] = si
                self.off_rollout[first + i] = "trainer"
        self.role_switch_s = 0.0  # accelerator-seconds spent changing role
        self.tacc_log: list[tuple[float, int]] = [(0.0, self.layout.trainer_accelerators)]
        self._rcap = sum(si.capacity for i, si in self.inst.items() if i not in self.off_rollout)
        self._rcap_int = 0.0  # integral of rollout capacity over time (bubble ratio)
        self._rcap_t = 0.0
        self._cap_marks: dict[int, float] = {}

        # trainer
        self.tacc = self.layout.trainer_accelerators
        self._tbusy_until = 0.0
        self._idle_report = False  # report TrainerIdle when the trainer next runs dry
        self._tq: deque = deque()
        self._tbusy = False
        self._tbusy_since = 0.0
        self.trainer_busy: list[tuple[float, float]] = []
        self.trainer_kinds: list[str] = []
        self._delivered: set[int] = set()
        self._processed: set[int] = set()
        self._step_left: int | None = None
        self._step_running: int | None = None
        self.step_end: list[float] = []
        self.step_groups: list[tuple[int, ...]] = []
        self._slot_marks: dict[int, float] = {}
        self.migration_s = 0.0
        self.reprefill_tokens = 0.0  # context re-prefilled: partial's resumes, KV-less migrations
        self.reports: list[str] = []

    # ------------------------------------------------------------------ main loop
    def run(self, stop_after_events: int | None = None) -> RunResult | None:
        """Run to the end and return the result; or, with `stop_after_events`, stop once that
        many scheduler events were handled and return None (`save` the state, `load` it and
        `run()` again to resume: the run is deterministic, so it ends exactly as it would have)."""
        if not self.sched._started:
            if self.engine.moe_imbalance > 0:
                self._seed = self.sampler.seed
                self._on_speed(0)
            self._execute(self.sched.start())
            self._drain()
        heap = self._heap
        pop = heapq.heappop
        sched = self.sched
        while not sched.done:
            if stop_after_events is not None and self.events >= stop_after_events:
                return None
            if not heap:
                raise SimDeadlock(self._deadlock_report())
            t, _, kind, x, y = pop(heap)
            self.now = t
            if kind == _FINISH:
                si = self.inst[x]
                if si.gen != y:
                    continue
                self._on_finish(si)
            elif kind == _LOADED:
                self._on_loaded(x, y)
            elif kind == _ARRIVE:
                self._on_arrive(x, y)
            elif kind == _ROLE:
                self._on_role(x, y)
            elif kind == _SPEED:
                self._on_speed(x)
            elif kind == _HANDOFF:
                self._tq.append(("group", x))
            else:
                self._on_trainer_done(x)
            self._drain()
        return self._result()

    # ------------------------------------------------------------------ stop / resume
    def save(self, path: str) -> None:
        """Write a checkpoint: the scheduler as `Scheduler.snapshot()` (JSON data, what every
        runtime resumes from) and the simulator's own state (its virtual clock, event heap,
        engines, sampler). The simulator part is pickled: load checkpoints you wrote yourself."""
        import pickle

        state = dict(self.__dict__)
        state.pop("sched")
        with open(path, "wb") as fh:
            pickle.dump({"format": CHECKPOINT_FORMAT, "scheduler": self.sched.snapshot(), "simulation": state}, fh)

    @classmethod
    def load(cls, path: str, plugins: Any = None) -> "Simulation":
        """Read a checkpoint written by `save`; `run()` continues where it stopped."""
        import pickle

        with open(path, "rb") as fh:
            try:
                data = pickle.load(fh)
            except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as exc:
                raise WorkloadError(f"--resume: {path} is not a simulator checkpoint ({exc})") from None
        fmt = data.get("format") if isinstance(data, dict) else None
        if fmt != CHECKPOINT_FORMAT:
            raise WorkloadError(f"--resume: {path} is not a simulator checkpoint of format {CHECKPOINT_FORMAT} (format {fmt!r})")
        self = cls.__new__(cls)
        self.__dict__.update(data["simulation"])
        self.sched = Scheduler.restore(data["scheduler"], plugins)
        return self

    def _push(self, t: float, kind: int, x: Any, y: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, x, y))

    def _drain(self) -> None:
        pending, handle = self._pending, self.sched.handle
        while True:
            while pending:
                self.events += 1
                self._execute(handle(pending.popleft()))
            if self._dirty:
                now = self.now
                if self.layout.share > 1:
                    self._share_cores()
                timeline = self.timeline
                for si in self._dirty.values():
                    if timeline:
                        si.record(now)
                    if si.gen != si.sched_gen:
                        si.sched_gen = si.gen
                        nf = si.next_finish()
                        if nf is not None:
                            self._push(nf, _FINISH, si.id, si.gen)
                self._dirty.clear()
            if not self._tbusy and self._tq:
                self._trainer_next()
            if self._idle_report and not self._tbusy and not self._tq:
                # Everything delivered is processed: the trainer waits (elastic colocation).
                self._idle_report = False
                pending.append(E.TrainerIdle())
                continue
            return

    def _share_cores(self) -> None:
        """Instances time-sharing accelerators (`Layout.share`): each of the `k` decoding on one
        runs at `1 / (k + c)` of its speed, `c` the preset's `coordinator_share` (processor
        sharing, as the OS shares a CPU core)."""
        share = self.layout.share
        for core in {iid // share for iid in self._dirty}:
            members = [self.inst[i] for i in range(core * share, core * share + share) if i in self.inst]
            k = max(1, sum(1 for si in members if si.r)) + self.preset.coordinator_share
            for si in members:
                if si.a != si.base[0] * k:
                    si.set_speed(k, self.now)
                    self._dirty[si.id] = si

    # ------------------------------------------------------------------ actions
    def _execute(self, actions: list) -> None:
        for act in actions:
            kind = type(act)
            if kind is A.Dispatch:
                self._dispatch(act)
            elif kind is A.RequestGroups:
                self._request(act)
            elif kind is A.LoadVersion:
                self._load(act)
            elif kind is A.Migrate:
                self._migrate(act)
            elif kind is A.DeliverGroup:
                self._deliver(act.group_id)
            elif kind is A.StartStep:
                self._start_step(act)
            elif kind is A.SwitchToTrainer:
                self._switch_to_trainer(act)
            elif kind is A.SwitchToRollout:
                self._switch_to_rollout(act)
            elif kind is A.ReportGroupFailed:
                self.reports.append(f"group {act.group_id!r} failed: {act.reason}")
            elif kind is A.ReportError:
                self.reports.append(act.message)
            else:
                raise SimError(f"unknown action {act!r}")

    def _request(self, act: A.RequestGroups) -> None:
        for _ in range(act.count):
            gid = self._next_gid
            self._next_gid += 1
            draw = self.sampler.draw(gid)
            self.groups[gid] = (act.version, draw.prompt_tokens, draw.response_tokens)
            if draw.truncated:
                self.cut[gid] = draw.truncated
            self._pending.append(E.GroupAdmitted(gid, {"prompt_tokens": draw.prompt_tokens}))

    def _dispatch(self, act: A.Dispatch) -> None:
        si = self.inst.get(act.instance_id)
        if si is None or si.loading is not None or si.version != act.version:
            raise SimError(
                f"dispatch of {act.group_id!r}/{act.index} (version {act.version}) to instance "
                f"{act.instance_id}, which holds {getattr(si, 'version', None)} (loading {getattr(si, 'loading', None)})"
            )
        if si.occupied >= si.capacity:
            raise SimError(f"dispatch to instance {si.id} beyond its capacity {si.capacity}")
        if act.instance_id in self.off_rollout:
            raise SimError(f"dispatch to instance {si.id}, whose accelerators serve the trainer")
        if self._tbusy and self.layout.colocated:
            raise SimError("colocated sync: a dispatch while the trainer holds the accelerators")
        gid = act.group_id
        key = (gid, act.index)
        _, prompt, lengths = self.groups[gid]
        si.add(key, lengths[act.index], prompt, self.now, prompt)
        self._dirty[si.id] = si
        if gid not in self.first_dispatch:
            self.first_dispatch[gid] = self.now
        self.traj[key] = (act.attempt, act.version)

    def _load(self, act: A.LoadVersion) -> None:
        si = self.inst[act.instance_id]
        now = self.now
        if act.preempt:
            if self.mode != "partial":
                raise SimError(f"LoadVersion with preempted trajectories in mode {self.mode}")
            for key in act.preempt:
                if si.holds(key):
                    si.paused[key] = si.remove(key, now)
                elif key not in si.paused:
                    raise SimError(f"preempt of {key!r}, which is not running on instance {si.id}")
        if si.r or si.inbound or si.waiting:
            raise SimError(
                f"LoadVersion({si.id}, {act.version}) while {si.r} trajectories run there and are not preempted"
            )
        if self.layout.colocated and self._tbusy:
            raise SimError("colocated sync: a weight load while the trainer holds the accelerators")
        si.advance(now)
        si.busy_until = min(si.busy_until, now)  # a prefill in progress is abandoned (re-done on resume)
        si.loading = act.version
        si.load_token += 1
        si.gen += 1
        self._dirty[si.id] = si
        if self.host.load_on_trainer:
            # The trainer gathers and broadcasts them, next after its current work item; loads
            # asked for before it starts share that one gather + broadcast (a subset load).
            if self._tq and self._tq[0][0] == "load":
                self._tq[0][1].append((si.id, act.version, si.load_token))
            else:
                self._tq.appendleft(("load", [(si.id, act.version, si.load_token)]))
        else:
            self._push(now + self._load_s, _LOADED, si.id, (act.version, si.load_token))

    # ------------------------------------------------------------------ MoE imbalance
    def _on_speed(self, period: int) -> None:
        """Redraw every instance's decode cost factor for `period` (see `EngineCost.moe_imbalance`)."""
        m = self.engine.moe_imbalance
        for iid, si in self.inst.items():
            rng = random.Random((self._seed * 1_000_003 + iid) * 1_000_033 + period)
            si.set_speed(1.0 + m * abs(rng.gauss(0.0, 1.0)), self.now)
            self._dirty[iid] = si
        if period == 0 or self._heap or self._pending or self._tbusy:
            # (with nothing else left to happen the run is stuck: let SimDeadlock say so)
            self._push((period + 1) * self.engine.moe_period_s, _SPEED, period + 1, None)

    # ------------------------------------------------------------------ elastic colocation
    def _cap_advance(self) -> None:
        self._rcap_int += self._rcap * (self.now - self._rcap_t)
        self._rcap_t = self.now

    def _switch_to_trainer(self, act: A.SwitchToTrainer) -> None:
        iid = act.instance_id
        si = self.inst.get(iid)
        if si is None or iid in self.off_rollout:
            raise SimError(f"SwitchToTrainer({iid}): not a rollout instance")
        if si.occupied or si.loading is not None:
            raise SimError(f"SwitchToTrainer({iid}) while it runs {si.r} trajectories or loads weights")
        si.advance(self.now)
        self._cap_advance()
        self._rcap -= si.capacity
        if si.log is not None and si.state != STATE_EMPTY:
            si.log.append((self.now, STATE_EMPTY))  # drawn as "no rollout instance" while lent
        si.state = STATE_EMPTY
        self.off_rollout[iid] = "to_trainer"
        # Its weights and KV are dropped; the trainer loads its optimizer-state shard and rebuilds
        # the data-parallel group: the accelerators do nothing meanwhile.
        join = self.tc.join_s
        self.role_switch_s += join * self.layout.accelerators_per_instance
        self._push(self.now + join, _ROLE, iid, "trainer")

    def _switch_to_rollout(self, act: A.SwitchToRollout) -> None:
        iid = act.instance_id
        if self.off_rollout.get(iid) != "trainer":
            raise SimError(f"SwitchToRollout({iid}): its accelerators are not on the trainer ({self.off_rollout.get(iid)})")
        tp = self.layout.accelerators_per_instance
        if self.tacc - tp < 1:
            raise SimError(f"SwitchToRollout({iid}) would leave the trainer without accelerators")
        # The accelerators leave after the trainer's current work item, then offload their
        # optimizer-state shard; the instance then loads weights like any other (LoadVersion).
        start = max(self.now, self._tbusy_until) if self._tbusy else self.now
        self.tacc -= tp
        self.tacc_log.append((start, self.tacc))
        self.off_rollout[iid] = "to_rollout"
        leave = self.tc.leave_s
        self.role_switch_s += (start - self.now + leave) * tp
        self._push(start + leave, _ROLE, iid, ("rollout", act.capacity))

    def _on_role(self, iid: int, payload: Any) -> None:
        tp = self.layout.accelerators_per_instance
        if payload == "trainer":
            self.off_rollout[iid] = "trainer"
            self.tacc += tp
            self.tacc_log.append((self.now, self.tacc))
            self._pending.append(E.SwitchedToTrainer(iid))
            return
        _, cap = payload
        del self.off_rollout[iid]
        old = self.inst[iid]
        si = SimInstance(iid, self.engine, self._kv)
        si.a, si.b, si.c = old.a, old.b, old.c  # the period's speed factor carries over
        si.capacity = cap
        si.t_last = self.now
        si.slot_time = old.slot_time
        si.log = old.log
        # Stale events of its earlier life are told apart by `gen` and `load_token`, so both carry
        # on (restarting at 0 could let a stale finish match the new counter).
        si.gen = old.gen + 1
        si.load_token = old.load_token
        si.preemptions, si.recomputed = old.preemptions, old.recomputed
        self.inst[iid] = si
        self._cap_advance()
        self._rcap += cap
        self._dirty[iid] = si
        self._pending.append(E.InstanceReady(iid, cap))

    def _migrate(self, act: A.Migrate) -> None:
        src, dst = self.inst[act.src], self.inst[act.dst]
        key = (act.group_id, act.index)
        for si in (src, dst):
            if si.loading is not None or si.version != act.version:
                raise SimError(f"migration of {key!r} between instances not both holding version {act.version}")
        if key in self._transit:
            # The scheduler moves a trajectory again only after `MigrationLanded`.
            raise SimError(f"migration of {key!r} from instance {src.id} while its previous move is in flight")
        if not src.holds(key):
            if key in self.finished:
                # It finished on `src` at this instant and its report is still queued (a host sees
                # the same race): it simply finished where it was.
                self.migrations_after_finish += 1
                return
            raise SimError(f"migration of {key!r} from instance {src.id}, where it does not run")
        if dst.occupied >= dst.capacity:
            raise SimError(f"migration of {key!r} to instance {dst.id} beyond its capacity")
        remaining, context = src.remove(key, self.now)
        self._dirty[src.id] = src
        bw = self._migrate_bw
        if bw > 0:
            delay = context * self.engine.kv_bytes_per_token / bw
            self.migration_s += delay
            dst.inbound += 1
            self._transit[key] = dst.id
            self._push(self.now + delay, _ARRIVE, key, (dst.id, remaining, context))
        else:
            # The engine cannot move KV: the destination re-prefills the whole context.
            self.migration_s += context * self.engine.prefill_s_per_token
            self.reprefill_tokens += context
            self.migration_reprefill += context
            dst.add(key, remaining, context, self.now, context)
            self._dirty[dst.id] = dst
            self._pending.append(E.MigrationLanded(act.group_id, act.index, self.traj[key][0]))

    # ------------------------------------------------------------------ engine events
    def _on_finish(self, si: SimInstance) -> None:
        now = self.now
        traj, groups, last, append = self.traj, self.groups, self.last_finish, self._pending.append
        finished = E.TrajectoryFinished
        done = self.finished
        for key in si.pop_finished(now):
            done.add(key)
            gid, idx = key
            # The reward's value does not matter to scheduling; it only has to be a number.
            append(finished(gid, idx, groups[gid][2][idx], float((gid + idx) & 1), traj[key][0]))
            last[gid] = now
            if self.finish_log is not None:
                self.finish_log.append((now, gid))
        self._dirty[si.id] = si

    def _on_loaded(self, iid: int, payload: tuple[int, int]) -> None:
        version, token = payload
        si = self.inst[iid]
        if token != si.load_token:
            return  # superseded by a newer LoadVersion
        si.advance(self.now)
        si.loading = None
        si.version = version
        if si.paused:
            reprefill = self.engine.resume_reprefill
            for key, (remaining, context) in si.paused.items():
                si.add(key, remaining, context, self.now, context if reprefill else 0)
                if reprefill:
                    self.reprefill_tokens += context
                versions = self.multi.setdefault(key, [self.traj[key][1]])
                if versions[-1] != version:
                    versions.append(version)
            si.paused.clear()
        si.gen += 1
        self._dirty[iid] = si
        self._pending.append(E.InstanceLoaded(iid, version))

    def _on_arrive(self, key: tuple[int, int], payload: tuple[int, float, float]) -> None:
        _, remaining, context = payload
        iid = self._transit.pop(key)
        si = self.inst[iid]
        si.inbound -= 1
        if si.loading is not None:
            raise SimError(f"migration of {key!r} landed on instance {iid}, which started loading meanwhile")
        si.add(key, remaining, context, self.now, 0)
        self._dirty[iid] = si
        self._pending.append(E.MigrationLanded(key[0], key[1], self.traj[key][0]))

    # ------------------------------------------------------------------ trainer
    def _deliver(self, gid: int) -> None:
        if gid in self._delivered:
            self.duplicated += 1
            return
        self._delivered.add(gid)
        if self.tc.report_s:  # it reaches the trainer through the coordinator too
            self._push(self.now + self.tc.report_s, _HANDOFF, gid, None)
        else:
            self._tq.append(("group", gid))

    def _start_step(self, act: A.StartStep) -> None:
        k = act.step
        if k != len(self.step_end) or self._step_running is not None:
            raise SimError(f"StartStep({k}) while step {self._step_running} runs / {len(self.step_end)} finished")
        for gid in act.group_ids:
            if gid in self.trained_step:
                self.duplicated += 1
            self.trained_step[gid] = k
            if gid not in self._delivered:
                self._deliver(gid)
        self.step_groups.append(tuple(act.group_ids))
        self._step_running = k
        self._step_left = sum(1 for g in act.group_ids if g not in self._processed)
        if self._step_left == 0:
            self._tq.append(("opt", k))

    def _trainer_next(self) -> None:
        kind, x = self._tq.popleft()
        tc = self.tc
        if kind == "group":
            _, prompt, lengths = self.groups[x]
            dur = (prompt * len(lengths) + sum(lengths)) * tc.train_acc_s_per_token / self.tacc
        elif kind == "opt":
            dur = tc.optimizer_acc_s / self.tacc
            if tc.step_acc_s_per_token or tc.dp_comm_s:
                tokens = sum(self.groups[g][1] * len(self.groups[g][2]) + sum(self.groups[g][2])
                             for g in self.step_groups[x])
                dur += tokens * tc.step_acc_s_per_token / self.tacc + (tc.dp_comm_s if self.tacc > 1 else 0.0)
        elif kind == "relay":
            dur = tc.report_s
        else:
            dur = self._publish_s if kind == "publish" else self._load_s
            self.weight_sync_s += dur
        if self.layout.colocated and kind != "load":
            busy = [si.id for si in self.inst.values() if si.r or si.waiting or si.loading is not None or si.paused]
            if busy:
                raise SimError(f"colocated sync: trainer work while instances {busy[:5]} still roll out or load")
        self._tbusy = True
        self._idle_report = self.config.elastic
        self._tbusy_since = self.now
        self._tbusy_until = self.now + dur
        self._push(self.now + dur, _TRAINER, (kind, x), None)

    def _on_trainer_done(self, item: tuple[str, int]) -> None:
        kind, x = item
        self._tbusy = False
        if kind != "relay":  # (waiting for the coordinator is not work)
            self.trainer_busy.append((self._tbusy_since, self.now))
            self.trainer_kinds.append(kind)
        if kind == "group":
            self._processed.add(x)
            if self._step_running is not None and self.trained_step.get(x) == self._step_running:
                self._step_left -= 1
                if self._step_left == 0:
                    self._tq.append(("opt", self._step_running))
        elif kind == "load":
            for iid, version, token in x:
                self._push(self.now, _LOADED, iid, (version, token))
        elif kind == "opt":
            self._step_running = None
            self.step_end.append(self.now)
            self._mark_slots(len(self.step_end) - 1)
            # Publishing comes before any work of the next step that this event unlocks.
            self._tq.appendleft(("publish", x + 1))
            if not self.tc.report_s:
                self._pending.append(E.TrainerStepFinished(x))
        elif kind == "publish" and self.tc.report_s:
            self._tq.appendleft(("relay", x))  # the step's report still has to reach the scheduler
        else:
            if kind == "relay":
                self._pending.append(E.TrainerStepFinished(x - 1))
            self._pending.append(E.VersionPublished(x))

    def _mark_slots(self, step: int) -> None:
        now = self.now
        total = 0.0
        for si in self.inst.values():
            si.advance(now)
            total += si.slot_time
        self._slot_marks[step] = total
        self._cap_advance()
        self._cap_marks[step] = self._rcap_int

    # ------------------------------------------------------------------ results
    def _deadlock_report(self) -> str:
        s = self.sched
        running = {i: si.r for i, si in self.inst.items() if si.r}
        versions = sorted({(si.version, si.loading) for si in self.inst.values()}, key=str)
        return (
            f"mode {self.mode}: no event left at t={self.now:.1f}s, step {s.step}/{self.steps}, "
            f"newest version {s.newest_version}, trainer queue {len(self._tq)}, running {running}, "
            f"(version, loading) on instances {versions}, groups admitted {self._next_gid}"
        )

    def _result(self) -> RunResult:
        core = self.sched.metrics()
        checks = self._checks()
        metrics = summarize(self, core, checks)
        return RunResult(
            mode=self.mode,
            layout=self.layout,
            max_staleness=self.K,
            metrics=metrics,
            core_metrics=core,
            sim_checks=checks,
            t_end=self.now,
            step_end=list(self.step_end),
            trainer_busy=self.trainer_busy,
            trainer_kinds=self.trainer_kinds,
            instance_logs=[si.log for si in self.inst.values()] if self.timeline else None,
            events=self.events,
            tail10_time_share=self._tail10(),
        )

    def _tail10(self) -> float | None:
        """Mean over steps of the share of the rollout span taken by its last 10% of trajectories."""
        if self.finish_log is None:
            return None
        by_step: dict[int, list[float]] = {}
        for t, gid in self.finish_log:
            k = self.trained_step.get(gid)
            if k is not None:
                by_step.setdefault(k, []).append(t)
        shares = []
        for k, times in by_step.items():
            start = min(self.first_dispatch[g] for g in self.step_groups[k])
            span = times[-1] - start
            if span > 0:
                shares.append((times[-1] - times[int(0.9 * len(times))]) / span)
        return sum(shares) / len(shares) if shares else None

    def _checks(self) -> dict[str, Any]:
        """C1-C3 as executed by the simulator, independent of the scheduler's counters."""
        hist: dict[int, int] = {}
        c3 = 0
        for gid, k in self.trained_step.items():
            s = k - self.groups[gid][0]
            hist[s] = hist.get(s, 0) + 1
            if s < 0 or s > self.K:
                c3 += 1
        dropped = sum(1 for gid in self.groups if gid not in self.trained_step)
        trained_traj = sum(len(self.groups[g][2]) for g in self.trained_step)
        multi_trained = sum(
            1 for (gid, _), vs in self.multi.items() if gid in self.trained_step and len(vs) > 1
        )
        return {
            "multi_version_trajectories": multi_trained,
            "multi_version_trajectory_share": multi_trained / trained_traj if trained_traj else 0.0,
            "staleness_hist": dict(sorted(hist.items())),
            "c3_violations": c3,
            "dropped": dropped,
            # Responses cut at the response cap (the run's max length, the same in every mode:
            # no C2 break).
            "truncated": sum(self.cut.get(g, 0) for g in self.trained_step),
            "duplicated": self.duplicated,
            "c1_ok": multi_trained == 0,
            "c2_ok": dropped == 0 and self.duplicated == 0,
            "c3_ok": c3 == 0,
        }


def _staleness(mode: str, k: int | None) -> int:
    """K for `mode`: fixed for sync/pipeline (0) and one_step_off (1), else `k` or the default."""
    fixed = {"sync": 0, "pipeline": 0, "one_step_off": 1}
    if mode in fixed:
        return fixed[mode]
    if k is None:
        return DEFAULT_STALENESS[mode]
    if mode == "dora" and k < 1:
        raise WorkloadError("max_staleness: mode 'dora' needs K >= 1 (K=0 is mode 'pipeline')")
    return k


# --------------------------------------------------------------------------- metrics
def default_steps(preset: Preset, max_staleness: int) -> int:
    """The preset's step count, or more for a large K: the steady-state window (`window`) skips
    K + 1 warm-up and K + 2 drain steps and keeps at least as many in between."""
    return max(preset.default_steps, min_steps(max_staleness))


def min_steps(max_staleness: int) -> int:
    """The fewest steps whose steady-state window measures a steady state for staleness `K`.

    With fewer, the window may hold the burst of groups trained back to back after a gating
    straggler, and its throughput can exceed `ideal_throughput`; `optimise_split` and
    `recommend` refuse such runs."""
    return 5 * (max_staleness + 2)


def window(steps: int, max_staleness: int = 0) -> tuple[int, int]:
    """Steady-state steps `[w, e)`: the first fifth (at least K + 1 steps, while the rollout builds
    its lead) is warm-up, the last fifth (at least the last `K + 2` steps) is drain: admission
    stops at `max_steps * B` groups, so the rollout runs dry in the last K + 1 steps.
    """
    w = max(steps // 5, max_staleness + 1) if max_staleness else steps // 5
    e = steps - max(steps // 5, max_staleness + 2) if max_staleness else steps - w
    if e - w < 1:
        w, e = steps // 5, steps - steps // 5
    if e - w < 1:
        return 0, steps
    return w, e


def ideal_step_work(preset: Preset, groups: list[tuple[int, int, tuple[int, ...]]]) -> tuple[float, float, int]:
    """(rollout accelerator-seconds at full occupancy, training accelerator-seconds, response tokens).

    At full occupancy an instance runs `capacity` sequences; a sequence's share of an iteration
    is `a / capacity + b + c * its context`, so a response of `L` tokens after a prompt of `P`
    costs `L * (a / cap + b) + c * (L * P + L * (L - 1) / 2)` plus its prefill, times the
    instance's accelerators. Weight loads and broadcasts are left out: the ideal is a bound.
    """
    ec, tc = preset.engine, preset.trainer
    per_tok = ec.decode_a_s / ec.capacity + ec.decode_b_s
    c, p, tp = ec.decode_c_s, ec.prefill_s_per_token, ec.accelerators
    roll = train = 0.0
    tokens = 0
    for _, prompt, lengths in groups:
        for L in lengths:
            roll += L * per_tok + c * (L * prompt + 0.5 * L * (L - 1)) + p * prompt
            tokens += L
        train += (prompt * len(lengths) + sum(lengths)) * tc.train_acc_s_per_token
    return roll * tp, train, tokens


def _time_mean(log: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Time average over [t0, t1] of a step function given as (time, value) changes."""
    if t1 <= t0:
        return float(log[-1][1])
    pts = sorted(log, key=lambda p: p[0])
    total, cur = 0.0, pts[0][1]
    prev = t0
    for t, v in pts:
        if t <= t0:
            cur = v
            continue
        if t >= t1:
            break
        total += cur * (t - prev)
        prev, cur = t, v
    total += cur * (t1 - prev)
    return total / (t1 - t0)


def summarize(sim: Simulation, core: dict[str, Any], checks: dict[str, Any]) -> dict[str, Any]:
    """The design.md metrics of one run over its steady-state window."""
    steps = len(sim.step_end)
    w, e = window(steps, sim.K)
    t0 = sim.step_end[w - 1] if w > 0 else 0.0
    t1 = sim.step_end[e - 1]
    span = max(t1 - t0, 1e-12)
    win_groups = [g for k in range(w, e) for g in sim.step_groups[k]]
    tokens = sum(sum(sim.groups[g][2]) for g in win_groups)
    busy = 0.0
    for a, b in sim.trainer_busy:
        lo, hi = max(a, t0), min(b, t1)
        if hi > lo:
            busy += hi - lo
    slots0 = sim._slot_marks.get(w - 1, 0.0) if w > 0 else 0.0
    slots1 = sim._slot_marks[e - 1]
    caps = sim._cap_marks[e - 1] - (sim._cap_marks.get(w - 1, 0.0) if w > 0 else 0.0)
    r2t = []
    for k in range(w, e):
        first = min(sim.first_dispatch[g] for g in sim.step_groups[k])
        r2t.append(sim.step_end[k] - first)
    # The ideal is a property of the workload: all trained groups (the same in every mode).
    roll, train, tok_ideal = ideal_step_work(sim.preset, [sim.groups[g] for g in sim.trained_step])
    train += steps * sim.tc.optimizer_acc_s
    rollout_s = [
        max(sim.last_finish[g] for g in sim.step_groups[k]) - min(sim.first_dispatch[g] for g in sim.step_groups[k])
        for k in range(w, e)
    ]
    ideal = tok_ideal / ((roll + train) / sim.layout.total_accelerators)
    thr = tokens / span
    hist = checks["staleness_hist"]
    n_hist = sum(hist.values())
    return {
        "throughput_tokens_per_s": thr,
        "speedup_vs_sync": None,
        "ideal_throughput": ideal,
        "efficiency": thr / ideal,
        "trainer_wait_ratio": max(0.0, 1.0 - busy / span),
        "rollout_bubble_ratio": 1.0 - (slots1 - slots0) / max(caps, 1e-12),
        "rollout_to_train_end_s": sum(r2t) / len(r2t),
        "step_time_s": span / (e - w),
        "rollout_s": sum(rollout_s) / len(rollout_s),
        "rollout_share": sum(rollout_s) / len(rollout_s) / (span / (e - w)),
        "staleness_hist": hist,
        "staleness_max": max(hist) if hist else 0,
        "staleness_mean": sum(k * v for k, v in hist.items()) / n_hist if n_hist else 0.0,
        "multi_version_trajectory_share": checks["multi_version_trajectory_share"],
        "multi_version_trajectories": checks["multi_version_trajectories"],
        "c3_violations": checks["c3_violations"],
        "dropped": checks["dropped"],
        "truncated": checks["truncated"],
        "duplicated": checks["duplicated"],
        "c1_ok": checks["c1_ok"],
        "c2_ok": checks["c2_ok"],
        "c3_ok": checks["c3_ok"],
        "migrations": core.get("migrations", 0),
        "weight_loads": core.get("weight_loads", 0),
        "live_versions_max": core.get("live_versions_max", 0),
        "migration_s": sim.migration_s,
        "elastic": sim.config.elastic,
        "role_switches": core.get("switches_to_trainer", 0) + core.get("switches_to_rollout", 0),
        "role_switch_s": sim.role_switch_s,
        "trainer_accelerators_mean": _time_mean(sim.tacc_log, t0, t1),
        "reprefill_tokens": round(sim.reprefill_tokens),
        "host": sim.host.name,
        "trainer_weight_sync_s_per_step": sim.weight_sync_s / steps,
        "reprefilled_tokens": round(sim.migration_reprefill),
        "preemptions": sum(si.preemptions for si in sim.inst.values()),
        "preemption_recomputed_tokens": round(sum(si.recomputed for si in sim.inst.values())),
        "max_staleness": sim.K,
        "split": sim.layout.split,
        "window_steps": [w, e],
    }


def simulate(
    preset: Preset,
    mode: str,
    *,
    steps: int | None = None,
    seed: int = 0,
    max_staleness: int | None = None,
    split: tuple[int, int] | None = None,
    records: list[tuple[int, int | None]] | None = None,
    instances: int | None = None,
    timeline: bool = False,
    plugins: Any = None,
    config: dict[str, Any] | None = None,
    host: HostProfile | str | None = None,
) -> RunResult:
    """Run one mode on `preset`; see `Simulation`. `config` adds `DoraConfig` fields (`admission`
    in the modes that take one); `host` a host profile (`hosts.py`; default `ideal`).

    `steps` defaults to `default_steps(preset, K)`."""
    return Simulation(
        preset, mode, steps=steps or default_steps(preset, _staleness(mode, max_staleness)), seed=seed, max_staleness=max_staleness,
        split=split, records=records, instances=instances, timeline=timeline, plugins=plugins,
        config=config, host=host,
    ).run()


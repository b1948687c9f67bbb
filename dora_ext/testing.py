"""A seeded, clock-free driver that executes scheduler actions with random event orders.

It is how the property tests (and plugin authors) exercise `dora_ext.core.Scheduler` without an
engine: every action is executed faithfully (dispatches run, loads complete, the trainer steps and
publishes), while the *order* in which things happen is chosen by a random generator: arbitrary
completion order, long tails, trajectory failures, instance crashes and recoveries, publishes at
any time after a step. The driver also keeps its own ledger (which version generated each token
of each trajectory, which groups each step trained) so the tests check the scheduler against an
independent record rather than against the scheduler's own counters.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from .config import DoraConfig
from .core import actions as A
from .core import events as E
from .core.scheduler import Scheduler


@dataclass
class DriverStats:
    events: int = 0
    steps: list[tuple[int, tuple]] = field(default_factory=list)  # (step, group ids)
    step_versions: dict[int, dict[Any, int]] = field(default_factory=dict)  # step -> gid -> group version
    traj_versions: dict[tuple, list[int]] = field(default_factory=dict)  # (gid, idx) -> versions seen
    admitted: dict[Any, int] = field(default_factory=dict)  # gid -> admission version
    failed_groups: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    migrations: int = 0
    delivered: dict[Any, int] = field(default_factory=dict)


class RandomDriver:
    """Drive a scheduler to `target_steps` steps with random (but fair) event orders.

    Fairness is what "engines keep progressing" means: every running trajectory eventually
    finishes, every load completes, the trainer eventually finishes its step. The driver stops
    with an error if it runs out of things to do before the target (a deadlock).
    """

    def __init__(
        self,
        config: DoraConfig,
        seed: int,
        *,
        fail_prob: float = 0.0,
        crash_prob: float = 0.0,
        nan_prob: float = 0.0,
        long_tail: float = 0.2,
        plugins: Any = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.config = config
        self.sched = scheduler or Scheduler(config, plugins=plugins)
        self.fail_prob, self.crash_prob, self.nan_prob, self.long_tail = fail_prob, crash_prob, nan_prob, long_tail
        self.stats = DriverStats()
        self.running: dict[tuple, list] = {}  # (gid, idx) -> [instance, version, attempt, tokens_left]
        self.loading: dict[int, int] = {}  # instance -> version
        self.loaded: dict[int, int] = {}
        self.paused: set[tuple] = set()
        self.trainer: int | None = None
        self.to_publish: list[int] = []
        self.requested = 0
        self.next_gid = 0
        # new ids for revived instances, after those the trainer's spare instances use
        self.next_instance = max(s.id for s in config.instances) + 1 + config.elastic_spare
        self.dead_instances: list[tuple[int, int]] = []
        # elastic colocation: instances switching role, and those whose accelerators train
        self.to_trainer: set[int] = set()
        self.to_rollout: dict[int, int] = {}
        self.on_trainer: set[int] = set()
        self.switches = 0

    # ------------------------------------------------------------------ executing actions
    def execute(self, actions: list) -> None:
        queue = list(actions)
        while queue:
            act = queue.pop(0)
            if isinstance(act, A.RequestGroups):
                for _ in range(act.count):
                    gid = self.next_gid
                    self.next_gid += 1
                    self.stats.admitted[gid] = self.sched.newest_version
                    queue.extend(self._feed(E.GroupAdmitted(gid, {"len": self.rng.randint(1, 100)})))
            elif isinstance(act, A.Dispatch):
                key = (act.group_id, act.index)
                assert self.loaded.get(act.instance_id) == act.version, (act, self.loaded)
                tokens = self.rng.randint(1, 3) if self.rng.random() > self.long_tail else self.rng.randint(10, 30)
                self.running[key] = [act.instance_id, act.version, act.attempt, tokens]
                self.stats.traj_versions[key] = [act.version]
            elif isinstance(act, A.LoadVersion):
                self.loading[act.instance_id] = act.version
                self.loaded.pop(act.instance_id, None)
                for key in act.preempt:
                    self.paused.add(key)
            elif isinstance(act, A.Migrate):
                r = self.running[(act.group_id, act.index)]
                assert r[0] == act.src and self.loaded.get(act.dst) == act.version == r[1]
                r[0] = act.dst
                self.stats.migrations += 1
            elif isinstance(act, A.DeliverGroup):
                self.stats.delivered[act.group_id] = act.step
            elif isinstance(act, A.StartStep):
                assert self.trainer is None
                self.trainer = act.step
                self.stats.steps.append((act.step, tuple(act.group_ids)))
                self.stats.step_versions[act.step] = {g: self.stats.admitted[g] for g in act.group_ids}
            elif isinstance(act, A.SwitchToTrainer):
                iid = act.instance_id
                assert not [k for k, r in self.running.items() if r[0] == iid], f"lent instance {iid} runs work"
                assert iid not in self.loading, f"lent instance {iid} is loading"
                self.loaded.pop(iid, None)
                self.to_trainer.add(iid)
                self.switches += 1
            elif isinstance(act, A.SwitchToRollout):
                iid = act.instance_id
                assert iid not in self.loaded and iid not in self.loading and iid not in self.to_trainer
                self.on_trainer.discard(iid)
                self.to_rollout[iid] = act.capacity
                self.switches += 1
            elif isinstance(act, A.ReportGroupFailed):
                self.stats.failed_groups.append(act.group_id)
            elif isinstance(act, A.ReportError):
                self.stats.errors.append(act.message)

    def _feed(self, event: Any) -> list:
        self.stats.events += 1
        return self.sched.handle(event)

    # ------------------------------------------------------------------ choosing the next event
    def _choices(self) -> list[tuple[str, Any]]:
        c: list[tuple[str, Any]] = []
        for key, r in self.running.items():
            if key not in self.paused and self.loaded.get(r[0]) is not None:
                c.append(("run", key))
        for iid in self.loading:
            c.append(("load", iid))
        if self.trainer is not None:
            c.append(("train", self.trainer))
        if self.to_publish:
            c.append(("publish", self.to_publish[0]))
        if self.dead_instances:
            c.append(("revive", None))
        for iid in self.to_trainer:
            c.append(("join", iid))
        for iid in self.to_rollout:
            c.append(("leave", iid))
        if self.config.elastic and self.trainer is None:
            c.append(("idle", None))
        return c

    def tick(self) -> bool:
        choices = self._choices()
        if not choices:
            return False
        kind, arg = self.rng.choice(choices)
        if kind == "run":
            inst, version, attempt, left = self.running[arg]
            if self.crash_prob and self.rng.random() < self.crash_prob and len(self.loaded) > 1:
                self._crash(inst)
                return True
            if self.fail_prob and self.rng.random() < self.fail_prob:
                del self.running[arg]
                self.execute(self._feed(E.TrajectoryFailed(arg[0], arg[1], "injected", attempt)))
                return True
            if left > 1:
                self.running[arg][3] = left - 1
                return True
            del self.running[arg]
            reward = float("nan") if self.nan_prob and self.rng.random() < self.nan_prob else self.rng.random()
            self.execute(self._feed(E.TrajectoryFinished(arg[0], arg[1], tokens=1, reward=reward, attempt=attempt)))
        elif kind == "load":
            v = self.loading.pop(arg)
            self.loaded[arg] = v
            for key, r in self.running.items():
                if r[0] == arg and key in self.paused:
                    self.paused.discard(key)
                    r[1] = v
                    if self.stats.traj_versions[key][-1] != v:
                        self.stats.traj_versions[key].append(v)
            self.execute(self._feed(E.InstanceLoaded(arg, v)))
        elif kind == "train":
            step = self.trainer
            self.trainer = None
            self.to_publish.append(step + 1)
            self.execute(self._feed(E.TrainerStepFinished(step)))
        elif kind == "publish":
            v = self.to_publish.pop(0)
            self.execute(self._feed(E.VersionPublished(v)))
        elif kind == "revive":
            iid, cap = self.dead_instances.pop(0)
            self.execute(self._feed(E.InstanceReady(iid, cap)))
        elif kind == "join":
            self.to_trainer.discard(arg)
            self.on_trainer.add(arg)
            self.execute(self._feed(E.SwitchedToTrainer(arg)))
        elif kind == "leave":
            cap = self.to_rollout.pop(arg)
            self.execute(self._feed(E.InstanceReady(arg, cap)))
        elif kind == "idle":
            self.execute(self._feed(E.TrainerIdle()))
        return True

    def _crash(self, inst: int) -> None:
        for key in [k for k, r in self.running.items() if r[0] == inst]:
            del self.running[key]
            self.paused.discard(key)
        self.loaded.pop(inst, None)
        self.loading.pop(inst, None)
        cap = next((s.capacity for s in self.config.instances if s.id == inst), 2)
        self.dead_instances.append((self.next_instance, cap))
        self.next_instance += 1
        self.execute(self._feed(E.InstanceFailed(inst, "injected crash")))

    def start(self) -> None:
        self.execute(self.sched.start())

    def run(self, target_steps: int, max_events: int = 200_000) -> DriverStats:
        """Run until `target_steps` steps finished; raise on deadlock or runaway."""
        ticks = 0
        while self.sched.step < target_steps:
            if not self.tick():
                raise AssertionError(f"deadlock at step {self.sched.step}: nothing can progress")
            ticks += 1
            if ticks > max_events:
                raise AssertionError(f"no progress after {max_events} ticks at step {self.sched.step}")
        return self.stats

"""A seeded, clock-free driver that executes scheduler actions with random event orders.

The property tests (and plugin authors) exercise `dora_ext.core.Scheduler` with it, no engine
needed: every action is executed faithfully, only the order is random. It sends what the hosts
send: any completion order, `TrajectoryProgressed`, late and NaN rewards, `TrajectoryFailed`
(running or awaiting reward), instance crashes at any point (replacements join under a fresh id
above every earlier one, as every host does), stale events from dead instances at any later
moment (each must count in `stale_events` and change nothing else), `GroupsDeclined`,
`DataExhausted`, and publishes at any time after a step. Its own ledger (token versions, trained
and failed groups) lets tests check the scheduler against an independent record.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from typing import Any

from .config import DoraConfig
from .core import actions as A
from .core import events as E
from .core.scheduler import FailureStorm, Scheduler


def stable_seed(name: str) -> int:
    """A seed derived from `name` that is the same in every process (`hash(str)` is salted per
    process unless PYTHONHASHSEED is set, so a run seeded from it cannot be replayed)."""
    return zlib.crc32(name.encode())


def feed_twinned(shadow: Any, feed: Any, event: Any) -> list:
    """Feed `event` to a twin scheduler (`shadow.handle`) and to the driver (`feed`): both must
    answer with the same actions, or raise the same error (re-raised). Returns the actions."""
    try:
        twin = shadow.handle(event)
    except Exception as exc:  # noqa: BLE001 - compared below
        twin = exc
    try:
        out = feed(event)
    except Exception as exc:
        assert type(twin) is type(exc) and str(twin) == str(exc), (event, twin, exc)
        raise
    assert twin == out, (event, twin, out)
    return out


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
    late_rewards: int = 0
    stale_sent: int = 0
    stale_after_replacement: int = 0  # stale reports of a dead instance sent after its replacement joined
    stale_uncounted: list = field(default_factory=list)  # stale reports the scheduler did not count as stale
    crashes: int = 0
    truncated_sent: int = 0
    halted: str | None = None  # the FailureStorm message, when the breaker tripped
    exhausted: bool = False


class Deadlock(AssertionError):
    """No event can be sent, yet the scheduler is not done (work remains)."""


class RandomDriver:
    """Drive a scheduler to `target_steps` steps with random but fair event orders (every
    trajectory, load, migration, reward and step eventually completes); `Deadlock` if nothing can
    be sent while work remains.

    Probabilities (0 by default): `fail_prob`/`crash_prob`/`progress_prob` per tick, `nan_prob`
    per reward, `late_reward` share of finishes rewarded later, `fail_awaiting` per late reward,
    `stale_prob` per crash, `decline_prob` per requested group, `truncate_prob` per finish.
    `data_limit`: prompts in the dataset. `group_id(n)` names the n-th group (default `n`).
    """

    #: Check that each stale report reaches the scheduler as one counted stale event (a driver
    #: whose `_feed` queues events for a later batch cannot check it per event).
    counts_stale = True

    def __init__(
        self,
        config: DoraConfig,
        seed: int,
        *,
        fail_prob: float = 0.0,
        crash_prob: float = 0.0,
        nan_prob: float = 0.0,
        long_tail: float = 0.2,
        late_reward: float = 0.0,
        fail_awaiting: float = 0.0,
        stale_prob: float = 0.0,
        decline_prob: float = 0.0,
        data_limit: int | None = None,
        progress_prob: float = 0.0,
        truncate_prob: float = 0.0,
        landed_prob: float = 0.0,
        plugins: Any = None,
        scheduler: Scheduler | None = None,
        group_id: Any = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.config = config
        self.sched = scheduler or Scheduler(config, plugins=plugins)
        self.fail_prob, self.crash_prob, self.nan_prob, self.long_tail = fail_prob, crash_prob, nan_prob, long_tail
        self.late_reward, self.fail_awaiting, self.stale_prob = late_reward, fail_awaiting, stale_prob
        self.decline_prob, self.data_limit = decline_prob, data_limit
        self.progress_prob, self.truncate_prob = progress_prob, truncate_prob
        self.landed_prob = landed_prob  # chance a landed migration is reported (MigrationLanded)
        self.stats = DriverStats()
        self.running: dict[tuple, list] = {}  # (gid, idx) -> [instance, version, attempt, tokens_left, done]
        self.awaiting: dict[tuple, int] = {}  # (gid, idx) -> attempt, reward not sent yet
        self.migrating: dict[tuple, int] = {}  # (gid, idx) -> source instance, not landed yet
        self.loading: dict[int, int] = {}  # instance -> version
        self.loaded: dict[int, int] = {}
        self.capacity: dict[int, int] = {s.id: s.capacity for s in config.instances}
        self.paused: set[tuple] = set()
        self.trainer: int | None = None
        self.to_publish: list[int] = []
        self.next_gid = 0
        self.group_id = group_id or (lambda n: n)  # the n-th admitted group's id (hosts: ints or uids)
        # new ids for revived instances, after those the trainer's spare instances use
        self.next_instance = max(s.id for s in config.instances) + 1 + config.elastic_spare
        self.dead_instances: list[tuple[int, int]] = []
        # elastic colocation: instances switching role, and those whose accelerators train
        self.to_trainer: set[int] = set()
        self.to_rollout: dict[int, int] = {}
        self.on_trainer: set[int] = set()
        self.switches = 0
        self.ghosts: list[Any] = []  # stale events a dead instance may still send
        self.replaced: set[int] = set()  # dead instances whose replacement has joined
        self.replacement_of: dict[int, int] = {}  # replacement id -> the dead instance it replaces

    # ------------------------------------------------------------------ executing actions
    def execute(self, actions: list) -> None:
        queue = list(actions)
        while queue:
            act = queue.pop(0)
            if isinstance(act, A.RequestGroups):
                give = act.count
                if self.data_limit is not None:
                    give = min(give, self.data_limit - self.next_gid)
                # A host declines only while something else is going on (a finish will make the
                # scheduler ask again); a host with nothing running would wait for prompts instead.
                declined = 0
                if self.decline_prob and self.running:
                    declined = sum(1 for _ in range(give) if self.rng.random() < self.decline_prob)
                for _ in range(give - declined):
                    gid = self.group_id(self.next_gid)
                    self.next_gid += 1
                    self.stats.admitted[gid] = self.sched.newest_version
                    queue.extend(self._feed(E.GroupAdmitted(gid, {"len": self.rng.randint(1, 100)})))
                if self.data_limit is not None and self.next_gid >= self.data_limit:
                    if not self.stats.exhausted:
                        self.stats.exhausted = True
                        queue.extend(self._feed(E.DataExhausted()))
                elif declined or give < act.count:
                    queue.extend(self._feed(E.GroupsDeclined(declined + act.count - give)))
            elif isinstance(act, A.Dispatch):
                key = (act.group_id, act.index)
                assert self.loaded.get(act.instance_id) == act.version, (act, self.loaded)
                assert key not in self.running and key not in self.awaiting, (act, "dispatched twice")
                assert sum(1 for r in self.running.values() if r[0] == act.instance_id) < self.capacity[act.instance_id]
                tokens = self.rng.randint(1, 3) if self.rng.random() > self.long_tail else self.rng.randint(10, 30)
                self.running[key] = [act.instance_id, act.version, act.attempt, tokens, 0]
                self.stats.traj_versions[key] = [act.version]
            elif isinstance(act, A.LoadVersion):
                on = [k for k, r in self.running.items() if r[0] == act.instance_id]
                assert set(on) == set(act.preempt), (act, on, "load over running work")
                # A weight store keeping the newest K + 2 versions (verl's dora_store) still holds it.
                assert act.version >= self.sched.newest_version - self.sched.K - 1, (act, "older than newest - K - 1")
                self.loading[act.instance_id] = act.version
                self.loaded.pop(act.instance_id, None)
                for key in act.preempt:
                    self.paused.add(key)
            elif isinstance(act, A.Migrate):
                key = (act.group_id, act.index)
                r = self.running[key]
                assert r[0] == act.src and self.loaded.get(act.dst) == act.version == r[1], (act, r)
                assert key not in self.migrating
                r[0] = act.dst
                self.migrating[key] = act.src
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
            if key not in self.paused and key not in self.migrating and self.loaded.get(r[0]) is not None:
                c.append(("run", key))
        for key in self.migrating:
            c.append(("land", key))
        for key in self.awaiting:
            c.append(("reward", key))
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
        if self.ghosts:
            c.append(("ghost", None))
        return c

    def tick(self) -> bool:
        choices = self._choices()
        if not choices:
            return False
        kind, arg = self.rng.choice(choices)
        rng = self.rng
        if kind == "run":
            inst, version, attempt, left, done = self.running[arg]
            if self.crash_prob and rng.random() < self.crash_prob and len(self.loaded) + len(self.loading) > 1:
                self._crash(self._crash_target(inst))
                return True
            if self.fail_prob and rng.random() < self.fail_prob:
                del self.running[arg]
                self.execute(self._feed(E.TrajectoryFailed(arg[0], arg[1], "injected", attempt)))
                return True
            if left > 1:
                self.running[arg][3] = left - 1
                self.running[arg][4] = done + 1
                if self.progress_prob and rng.random() < self.progress_prob:
                    self.execute(self._feed(E.TrajectoryProgressed(arg[0], arg[1], done + 1, attempt)))
                return True
            del self.running[arg]
            trunc = bool(self.truncate_prob) and rng.random() < self.truncate_prob
            self.stats.truncated_sent += trunc
            if self.late_reward and rng.random() < self.late_reward:
                self.awaiting[arg] = attempt
                self.stats.late_rewards += 1
                self.execute(self._feed(E.TrajectoryFinished(arg[0], arg[1], tokens=done + 1, attempt=attempt,
                                                             truncated_early=trunc)))
            else:
                self.execute(self._feed(E.TrajectoryFinished(arg[0], arg[1], tokens=done + 1, reward=self._reward(),
                                                             attempt=attempt, truncated_early=trunc)))
        elif kind == "reward":
            attempt = self.awaiting.pop(arg)
            if self.fail_awaiting and rng.random() < self.fail_awaiting:
                self.execute(self._feed(E.TrajectoryFailed(arg[0], arg[1], "reward model failed", attempt)))
            else:
                self.execute(self._feed(E.RewardReady(arg[0], arg[1], self._reward(), attempt)))
        elif kind == "land":
            src = self.migrating.pop(arg)
            if src not in self.loaded and src not in self.loading:
                # The source crashed before the KV cache left it: the engine lost the trajectory.
                r = self.running.pop(arg)
                self.execute(self._feed(E.TrajectoryFailed(arg[0], arg[1], "migration source lost", r[2])))
            elif arg in self.running and self.landed_prob and rng.random() < self.landed_prob:
                # The runtime may say the move landed: the scheduler may then move it again.
                self.execute(self._feed(E.MigrationLanded(arg[0], arg[1], self.running[arg][2])))
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
            self.capacity[iid] = cap
            dead = self.replacement_of.pop(iid, None)
            if dead is not None:
                self.replaced.add(dead)
            self.execute(self._feed(E.InstanceReady(iid, cap)))
        elif kind == "join":
            self.to_trainer.discard(arg)
            self.on_trainer.add(arg)
            self.execute(self._feed(E.SwitchedToTrainer(arg)))
        elif kind == "leave":
            cap = self.to_rollout.pop(arg)
            self.capacity[arg] = cap
            self.execute(self._feed(E.InstanceReady(arg, cap)))
        elif kind == "idle":
            self.execute(self._feed(E.TrainerIdle()))
        elif kind == "ghost":
            ev = self.ghosts.pop(rng.randrange(len(self.ghosts)))
            self.stats.stale_sent += 1
            if getattr(ev, "instance_id", None) in self.replaced:
                self.stats.stale_after_replacement += 1
            before = self.sched.m["stale_events"]
            self.execute(self._feed(ev))
            if self.counts_stale and self.sched.m["stale_events"] != before + 1:
                self.stats.stale_uncounted.append(ev)
        return True

    def _reward(self) -> float:
        return float("nan") if self.nan_prob and self.rng.random() < self.nan_prob else self.rng.random()

    def _crash_target(self, inst: int) -> int:
        """Usually the trajectory's instance; sometimes one that is loading or mid-migration."""
        r = self.rng.random()
        if r < 0.25 and self.loading:
            return self.rng.choice(sorted(self.loading))
        if r < 0.5 and self.migrating:
            key = self.rng.choice(sorted(self.migrating, key=repr))
            return self.rng.choice([self.migrating[key], self.running[key][0]])
        return inst

    def _crash(self, inst: int) -> None:
        self.stats.crashes += 1
        stale = self.stale_prob and self.rng.random() < self.stale_prob
        for key in [k for k, r in self.running.items() if r[0] == inst]:
            r = self.running.pop(key)
            self.paused.discard(key)
            self.migrating.pop(key, None)
            if stale:
                self.ghosts.append(E.TrajectoryProgressed(key[0], key[1], r[4] + 1, r[2]))
                self.ghosts.append(E.TrajectoryFinished(key[0], key[1], tokens=r[4] + 1, reward=0.5, attempt=r[2]))
        if stale:
            if inst in self.loading:
                self.ghosts.append(E.InstanceLoaded(inst, self.loading[inst]))
            self.ghosts.append(E.InstanceFailed(inst, "reported twice"))
        self.loaded.pop(inst, None)
        self.loading.pop(inst, None)
        # Its replacement: a fresh id, above every earlier one (as every host does).
        self.dead_instances.append((self.next_instance, self.capacity[inst]))
        self.replacement_of[self.next_instance] = inst
        self.next_instance += 1
        self.execute(self._feed(E.InstanceFailed(inst, "injected crash")))

    def start(self) -> None:
        self.execute(self.sched.start())

    def run(self, target_steps: int, max_events: int = 200_000) -> DriverStats:
        """Run until `target_steps` steps or the scheduler is done; `Deadlock` when stuck, and a
        `FailureStorm` from the circuit breaker ends the run (`stats.halted`)."""
        ticks = 0
        try:
            while self.sched.step < target_steps and not self.sched.done:
                if not self.tick():
                    raise Deadlock(
                        f"deadlock at step {self.sched.step}: nothing can progress "
                        f"(metrics {self.sched.metrics()})"
                    )
                ticks += 1
                if ticks > max_events:
                    raise AssertionError(f"no progress after {max_events} ticks at step {self.sched.step}")
        except FailureStorm as exc:
            self.stats.halted = str(exc)
            self.execute(exc.actions)
        return self.stats

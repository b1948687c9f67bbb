"""Actions: what the scheduler asks a runtime to do. Small, immutable records.

A runtime executes each action and reports back with events (see `events.py`):

| action          | the runtime answers with                                            |
|-----------------|---------------------------------------------------------------------|
| RequestGroups   | `GroupAdmitted` per prompt bound (or `GroupsDeclined`/`DataExhausted`) |
| Dispatch        | `TrajectoryProgressed`*, then `TrajectoryFinished` or `TrajectoryFailed` |
| LoadVersion     | `InstanceLoaded` (preempted trajectories then continue under the new version) |
| Migrate         | optionally `MigrationLanded` once it runs on `dst`; it reports as before |
| DeliverGroup    | nothing: the trainer may start forward/backward on the group (R7)     |
| SwitchToTrainer | `SwitchedToTrainer` once the trainer computes on its accelerators     |
| SwitchToRollout | `InstanceReady` once its accelerators left the trainer (then a `LoadVersion`) |
| StartStep       | `TrainerStepFinished`, then `VersionPublished(step + 1)`              |
| ReportGroupFailed / ReportError | nothing: surface it to the user                       |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .events import GroupId


@dataclass(frozen=True, slots=True)
class RequestGroups:
    """Admit up to `count` new prompts; their groups get `version` (the newest published)."""

    count: int
    version: int


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Generate trajectory `(group_id, index)` on `instance_id`, which holds `version`."""

    group_id: GroupId
    index: int
    instance_id: int
    version: int
    attempt: int


@dataclass(frozen=True, slots=True)
class LoadVersion:
    """Load `version` on `instance_id`.

    `preempt` (mode `partial` only) lists trajectories running there: the runtime pauses them,
    loads the weights and resumes them under the new version (their tokens span versions).
    In every other mode `preempt` is empty: the instance has drained first (R4).
    """

    instance_id: int
    version: int
    preempt: tuple[tuple[GroupId, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Migrate:
    """Move running trajectory `(group_id, index)` from `src` to `dst`; both hold `version` (R5)."""

    group_id: GroupId
    index: int
    src: int
    dst: int
    version: int


@dataclass(frozen=True, slots=True)
class DeliverGroup:
    """Group `group_id` is complete and belongs to trainer step `step` (streamed, R7)."""

    group_id: GroupId
    step: int


@dataclass(frozen=True, slots=True)
class StartStep:
    """Run trainer step `step` over `group_ids` (groups not yet delivered are delivered now)."""

    step: int
    group_ids: tuple[GroupId, ...]


@dataclass(frozen=True, slots=True)
class SwitchToTrainer:
    """Elastic colocation: lend idle instance `instance_id`'s accelerators to the trainer.

    The instance runs nothing and the staleness budget is spent (the trainer is the bottleneck).
    The runtime drops its weights and KV cache, has the trainer take the accelerators and answers
    `SwitchedToTrainer`.
    """

    instance_id: int


@dataclass(frozen=True, slots=True)
class SwitchToRollout:
    """Elastic colocation: give the trainer's accelerators of `instance_id` to the rollout.

    The trainer waits while the rollout has more work than slots (the long tail). The runtime
    answers `InstanceReady(instance_id, capacity)`; the scheduler then loads a version.
    """

    instance_id: int
    capacity: int


@dataclass(frozen=True, slots=True)
class ReportGroupFailed:
    """A group exhausted its retries: it is not trained, and the user must hear of it (C2)."""

    group_id: GroupId
    reason: str


@dataclass(frozen=True, slots=True)
class ReportError:
    """A trajectory produced an invalid result (e.g. a NaN reward); it is being retried."""

    group_id: GroupId
    index: int
    message: str


Action = Union[
    RequestGroups,
    Dispatch,
    LoadVersion,
    Migrate,
    DeliverGroup,
    StartStep,
    SwitchToTrainer,
    SwitchToRollout,
    ReportGroupFailed,
    ReportError,
]


def without_failed(actions: list, failed: set) -> list:
    """The actions of a `handle_many` batch that failed the instances `failed`, less those it
    decided for them before they failed (void: their trajectories were re-queued): a `Dispatch`
    or `LoadVersion` to one, a `Migrate` between two. (Hosts give a restarted engine a fresh id.)"""
    return [a for a in actions
            if not ((type(a) is Dispatch or type(a) is LoadVersion) and a.instance_id in failed)
            and not (type(a) is Migrate and a.src in failed and a.dst in failed)]

"""Events: what a runtime tells the scheduler. Small, immutable records.

Group ids are JSON scalars (int or str, not bool) chosen by the runtime (verl's `uid`, slime's
group index, a counter in the simulator and the embedded runtime): they travel in snapshots, which
are JSON data. `GroupAdmitted` with any other id (a tuple, a float, None) is a `ProtocolError`. A trajectory is named by `(group_id, index)` with `0 <= index < n`.
`attempt` on trajectory events lets the scheduler ignore reports from an earlier attempt (an
instance that was declared failed but still answers); leave it `None` when the runtime has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

GroupId = Union[int, str]


@dataclass(frozen=True, slots=True)
class InstanceReady:
    """A rollout instance exists (or came back after a failure) with no version loaded."""

    instance_id: int
    capacity: int


@dataclass(frozen=True, slots=True)
class InstanceLoaded:
    """The instance finished loading `version` (answer to `LoadVersion`)."""

    instance_id: int
    version: int


@dataclass(frozen=True, slots=True)
class InstanceFailed:
    """The instance is gone; its running trajectories are re-dispatched to the same version."""

    instance_id: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SwitchedToTrainer:
    """Elastic colocation: the trainer now computes on `instance_id`'s accelerators (answer to
    `SwitchToTrainer`). Until then the scheduler does not move them back."""

    instance_id: int


@dataclass(frozen=True, slots=True)
class GroupAdmitted:
    """The runtime bound a prompt to a new group (answer to `RequestGroups`).

    `meta` is optional JSON data (e.g. prompt length) handed to admission hooks; it must survive
    a JSON round trip unchanged, else it is a `ProtocolError` naming `GroupAdmitted.meta`.
    """

    group_id: GroupId
    meta: Any = None


@dataclass(frozen=True, slots=True)
class GroupsDeclined:
    """The runtime cannot admit `count` of the requested groups now (no prompts ready)."""

    count: int


@dataclass(frozen=True, slots=True)
class DataExhausted:
    """No prompts will ever come again: train what is admitted (a last short batch if needed)."""


@dataclass(frozen=True, slots=True)
class TrajectoryProgressed:
    """`tokens` response tokens generated so far (cumulative)."""

    group_id: GroupId
    index: int
    tokens: int
    attempt: int | None = None


@dataclass(frozen=True, slots=True)
class TrajectoryFinished:
    """Generation ended (stop token or max length). `reward` may come here or in `RewardReady`.

    `truncated_early` marks a trajectory the runtime cut before its stop token or max length
    (a C2 violation that is counted, never hidden).
    """

    group_id: GroupId
    index: int
    tokens: int
    reward: float | None = None
    attempt: int | None = None
    truncated_early: bool = False


@dataclass(frozen=True, slots=True)
class TrajectoryFailed:
    """Generation (or its reward) failed; retried up to `max_retries`, then the group fails."""

    group_id: GroupId
    index: int
    reason: str = ""
    attempt: int | None = None


@dataclass(frozen=True, slots=True)
class RewardReady:
    """The reward of a finished trajectory. None or NaN is an error naming the trajectory."""

    group_id: GroupId
    index: int
    reward: float | None
    attempt: int | None = None


@dataclass(frozen=True, slots=True)
class TrainerStepStarted:
    """The trainer began the optimizer work of `step` (informational)."""

    step: int


@dataclass(frozen=True, slots=True)
class TrainerStepFinished:
    """The optimizer step `step` is done; the trainer holds version `step + 1`."""

    step: int


@dataclass(frozen=True, slots=True)
class MigrationLanded:
    """The migrated trajectory `(group_id, index)` runs on its destination (answer to `Migrate`).

    Optional: until it arrives the scheduler never moves the trajectory again (its transfer may be
    in flight); a runtime that never sends it gets at most one move per trajectory attempt.
    """

    group_id: GroupId
    index: int
    attempt: int | None = None


@dataclass(frozen=True, slots=True)
class TrainerIdle:
    """The trainer has processed everything delivered to it and waits for groups.

    Only elastic colocation uses it: `SwitchToRollout` comes only after this report, forgotten at
    the next `DeliverGroup` or `StartStep`. Without it no accelerators leave the trainer.
    """


@dataclass(frozen=True, slots=True)
class VersionPublished:
    """Version `version` may now be loaded by instances (its weights are broadcast)."""

    version: int


Event = Union[
    InstanceReady,
    InstanceLoaded,
    InstanceFailed,
    SwitchedToTrainer,
    GroupAdmitted,
    GroupsDeclined,
    DataExhausted,
    TrajectoryProgressed,
    TrajectoryFinished,
    TrajectoryFailed,
    RewardReady,
    TrainerStepStarted,
    TrainerStepFinished,
    TrainerIdle,
    MigrationLanded,
    VersionPublished,
]

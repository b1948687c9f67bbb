"""The sans-I/O scheduler: events in, actions out. See `scheduler.py`."""

from .actions import (
    Action, DeliverGroup, Dispatch, LoadVersion, Migrate, ReportError, ReportGroupFailed,
    RequestGroups, StartStep, SwitchToRollout, SwitchToTrainer,
)
from .events import (
    DataExhausted, Event, GroupAdmitted, GroupsDeclined, InstanceFailed, InstanceLoaded,
    InstanceReady, MigrationLanded, RewardReady, SwitchedToTrainer, TrainerIdle, TrainerStepFinished, TrainerStepStarted, TrajectoryFailed,
    TrajectoryFinished, TrajectoryProgressed, VersionPublished,
)
from .scheduler import FailureStorm, ProtocolError, Scheduler

__all__ = [
    "Action", "DataExhausted", "DeliverGroup", "Dispatch", "Event", "FailureStorm", "GroupAdmitted",
    "GroupsDeclined", "InstanceFailed", "InstanceLoaded", "InstanceReady", "LoadVersion",
    "Migrate", "MigrationLanded", "ProtocolError", "ReportError", "ReportGroupFailed", "RequestGroups",
    "RewardReady", "Scheduler", "StartStep", "SwitchToRollout", "SwitchToTrainer",
    "SwitchedToTrainer", "TrainerIdle", "TrainerStepFinished", "TrainerStepStarted",
    "TrajectoryFailed", "TrajectoryFinished", "TrajectoryProgressed", "VersionPublished",
]

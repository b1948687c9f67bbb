"""The scheduler's state codes and sentinels, shared by its modules."""

from collections import OrderedDict

# Trajectory states, kept as small ints in a byte array (`_traj_status`); the letters name them in
# snapshots and error messages.
_QUEUED, _RUNNING, _AWAIT_REWARD, _DONE, _DEAD = 0, 1, 2, 3, 4
_LETTERS = "QRFDX"
_CODES = {c: i for i, c in enumerate(_LETTERS)}
# Group states, kept as small ints in a byte array (`_group_state`); `_STATES` names them.
_ACTIVE, _COMPLETE, _ASSIGNED, _TRAINED, _FAILED = 0, 1, 2, 3, 4
_STATES = ("active", "complete", "assigned", "trained", "failed")
_STATE_CODES = {c: i for i, c in enumerate(_STATES)}
# One occupancy level's instances in arrival order (`_levels`): instance id -> its `_Instance`.
# An OrderedDict: dispatch takes the first one (`popitem(last=False)`) in O(1).
_Level = OrderedDict
_ANY = -1  # the single queue/instance bucket of mode `partial`, where nothing is pinned
_NAN = float("nan")  # `_traj_reward`: no reward yet
_NO_INSTANCE = -(2**63)  # `_traj_instance`: running on no instance
_NO_VERSION, _MULTI = -1, -2  # `_traj_version`: no version yet; several versions (in `_traj_versions`)
_NO_STAMP = -1  # `_traj_stamp`: placed on no instance


def _drop_one(counts: dict, key: int) -> None:
    """One fewer of `key` in `counts`, whose counts are all positive: a zero is dropped."""
    c = counts[key] - 1
    if c:
        counts[key] = c
    else:
        del counts[key]

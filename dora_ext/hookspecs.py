"""Every policy a user may replace, declared once as a pluggy hook specification.

The built-in behaviour is itself a plugin (`dora_ext.defaults`, registered `trylast`), so a
user's plugin replaces it the same way: implement the hook with `@dora_ext.hookimpl` and either
register the object on the plugin manager or publish it in the entry-point group `dora_ext`::

    [project.entry-points.dora_ext]
    shortest_first = "my_pkg.my_plugin"

Hooks marked *firstresult* stop at the first implementation that returns something other than
None, so a plugin may also decline (return None) and let the default decide.

The scheduler calls these hooks only at decision points (once per group admitted or completed,
once per consolidation), never per token, so a plugin costs nothing on the hot path.
"""

from __future__ import annotations

from typing import Any, Sequence

import pluggy

hookspec = pluggy.HookspecMarker("dora_ext")
hookimpl = pluggy.HookimplMarker("dora_ext")


@hookspec(firstresult=True)
def dora_admission_key(group_id: Any, version: int, seq: int, meta: Any, mode: str) -> Sequence[Any]:
    """Priority of an admitted group's trajectories in the dispatch queue (R6: frontier admission).

    Called once when a group is admitted. Lower keys are dispatched first, group-major (all
    pending trajectories of the first group, then the next group). Queues are per version, so
    the key orders groups of the same version only; older versions are always served by their own
    instances first (R1). Must return a tuple (or list) of JSON scalars (None, bools, ints of at
    most 4,300 decimal digits, finite floats, strings), because the key is part of the scheduler's
    snapshot: anything else (a tuple inside, a numpy integer, NaN, a longer int, which Python's
    JSON refuses by default) is a ``ProtocolError`` naming the hook. Keys are compared position
    by position, None before numbers before strings (so a key may hold None at a position where
    another holds an int).

    Default: ``(seq,)``, the admission order, so the group admitted first (the one closest to
    completing the next batch) gets free capacity first.

    :param group_id: the runtime's id of the group.
    :param version: the policy version the group is pinned to.
    :param seq: admission counter (0, 1, 2, ...).
    :param meta: the ``meta`` the runtime gave in ``GroupAdmitted`` (e.g. prompt length), as its
        JSON round trip gives it back (a tuple is a list), or None.
    :param mode: the scheduling mode.
    """


@hookspec(firstresult=True)
def dora_batch_key(group_id: Any, version: int, complete_seq: int, mode: str) -> Sequence[Any]:
    """Order in which completed groups are taken into trainer steps (R3 batch selection).

    Called once when a group completes. Lower keys are taken first. Whatever the key, the
    scheduler only takes a group when the bounded-staleness deadlines of all remaining groups stay
    feasible (C3), and it waits for a running group rather than drop it (C2).

    Must return a tuple (or list) of JSON scalars, as ``dora_admission_key``. A key may put a
    newer version first: the scheduler then takes the smallest key it can take.

    Default: ``(version, complete_seq)`` in mode ``dora`` (oldest version first, then completion
    order), ``(complete_seq,)`` in the other modes (completion order, as the hosts do).
    """


@hookspec(firstresult=True)
def dora_plan_migration(
    version: int, instances: list[dict[str, Any]], newest_version: int, fill: float
) -> list[tuple[Any, int, int, int]] | None:
    """Plan R5 same-version migration for an old `version` whose running work is spread thin.

    Called only when the version's running trajectories fill at most ``migrate_threshold`` of the
    slots of the instances holding it, run on more instances than they would need at
    ``migrate_threshold`` of the largest capacity, and the version does not gate the step being
    formed. `instances` lists the instances running that version as dicts with keys ``id``,
    ``capacity`` and ``running`` (a list of ``(group_id, index)``). A move of a trajectory that
    was already moved once in its attempt is skipped (its first move may still be in flight).

    Return a list of ``(group_id, index, src_instance, dst_instance)`` moves (each destination must
    hold `version` and have room), an empty list for no migration, or None to leave the plan to
    the built-in one. Instances emptied by the moves switch to `newest_version` (R4).

    `fill` is the configured ``migrate_threshold``: the built-in plan packs the kept instances to
    at most that share of their capacity, so that consolidation never makes the stragglers of the
    version the trainer waits for decode much slower.

    Default: None, the scheduler's built-in plan, applied incrementally on its occupancy levels:
    empty the least loaded holders into the most loaded ones still below `fill` (fewest moves,
    as few instances as can hold the work). It is the same whatever other plugins are registered.
    """


@hookspec(historic=True)
def dora_metrics(step: int, metrics: dict[str, Any]) -> None:
    """Metric sink: called by runtimes once per trainer step with the design.md metric names."""

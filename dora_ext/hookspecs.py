"""Every policy a user may replace, declared once as a pluggy hook specification.

The built-in behaviour is itself a plugin (`dora_ext.defaults`, registered `trylast`). Implement
a hook with `@dora_ext.hookimpl` and register the object on the plugin manager, or publish it in
the entry-point group `dora_ext`::

    [project.entry-points.dora_ext]
    shortest_first = "my_pkg.my_plugin"

*firstresult* hooks stop at the first implementation that returns non-None, so a plugin may
decline. Hooks run only at decision points, never per token.
"""

from __future__ import annotations

from typing import Any, Sequence

import pluggy

hookspec = pluggy.HookspecMarker("dora_ext")
hookimpl = pluggy.HookimplMarker("dora_ext")


@hookspec(firstresult=True)
def dora_admission_key(group_id: Any, version: int, seq: int, meta: Any, mode: str) -> Sequence[Any]:
    """Priority of an admitted group's trajectories in the dispatch queue (R6: frontier admission).

    Called once per admitted group; lower keys are dispatched first, group-major, within one
    version's queue (older versions are served by their own instances first, R1). Must return a
    tuple (or list) that survives a JSON round trip (it is snapshotted), else a ``ProtocolError``
    naming the hook halts the scheduler; keys must compare with each other.

    Default: ``(seq,)``, admission order (the group closest to completing the next batch first).

    :param group_id: the runtime's id of the group.
    :param version: the policy version the group is pinned to.
    :param seq: admission counter (0, 1, 2, ...).
    :param meta: a copy of the ``meta`` the runtime gave in ``GroupAdmitted`` (e.g. prompt length), or None.
    :param mode: the scheduling mode.
    """


@hookspec(firstresult=True)
def dora_batch_key(group_id: Any, version: int, complete_seq: int, mode: str) -> Sequence[Any]:
    """Order in which completed groups are taken into trainer steps (R3 batch selection).

    Called once per completed group; the smallest key that keeps every remaining group's
    staleness deadline feasible (C3) is taken, and a running group is waited for, never dropped
    (C2). Must return a tuple (or list), as ``dora_admission_key``.

    Default: ``(version, complete_seq)`` in mode ``dora`` (oldest version first), else
    ``(complete_seq,)`` (completion order, as the hosts do).
    """


@hookspec(firstresult=True)
def dora_plan_migration(
    version: int, instances: list[dict[str, Any]], newest_version: int, fill: float
) -> list[tuple[Any, int, int, int]] | None:
    """Plan R5 same-version migration for an old `version` whose running work is spread thin.

    Called only when the version's running trajectories fill at most ``migrate_threshold`` (`fill`)
    of its holders' slots, use more instances than needed, and do not gate the step being formed.
    `instances`: dicts with ``id``, ``capacity`` and ``running`` (a list of ``(group_id, index)``)
    for the instances running that version. A trajectory already moved in its attempt is skipped.

    Return ``(group_id, index, src_instance, dst_instance)`` moves (destinations hold `version` and
    have room), an empty list for none, or None for the built-in plan. Emptied instances switch to
    `newest_version` (R4).

    Default: None, the built-in incremental plan: empty the least loaded holders into the most
    loaded ones still below `fill` (fewest moves, fewest instances, stragglers not slowed).
    """


@hookspec(historic=True)
def dora_metrics(step: int, metrics: dict[str, Any]) -> None:
    """Metric sink: called by runtimes once per trainer step with the design.md metric names."""

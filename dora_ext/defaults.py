"""The built-in policies, shipped as an ordinary plugin (registered `trylast`)."""

from __future__ import annotations

from typing import Any

from .hookspecs import hookimpl


@hookimpl(trylast=True)
def dora_admission_key(group_id: Any, version: int, seq: int, meta: Any, mode: str) -> tuple:
    return (seq,)


@hookimpl(trylast=True)
def dora_batch_key(group_id: Any, version: int, complete_seq: int, mode: str) -> tuple:
    if mode == "dora":
        return (version, complete_seq)
    return (complete_seq,)


@hookimpl(trylast=True)
def dora_plan_migration(
    version: int, instances: list[dict[str, Any]], newest_version: int, fill: float
) -> None:
    # None: the scheduler applies its built-in plan incrementally on its occupancy levels.
    return None

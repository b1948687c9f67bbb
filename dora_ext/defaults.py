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
) -> list[tuple[Any, int, int, int]]:
    # Keep the instances that already run the most (fewest moves), as few as can hold the work
    # while staying at most `fill` full: packing stragglers tighter would slow every one of them
    # (a decode iteration costs more with more running sequences and context), and the oldest
    # version is the one the trainer waits for.
    order = sorted(instances, key=lambda d: (-len(d["running"]), d["id"]))
    total = sum(len(d["running"]) for d in order)
    limit = {d["id"]: max(len(d["running"]), int(fill * d["capacity"]), 1) for d in order}
    kept, room = [], 0
    for d in order:
        if room >= total:
            break
        kept.append(d)
        room += limit[d["id"]]
    if len(kept) == len(order):
        return []
    free = {d["id"]: limit[d["id"]] - len(d["running"]) for d in kept}
    moves = []
    targets = [d["id"] for d in kept]
    t = 0
    for d in order[len(kept):]:
        for gid, idx in d["running"]:
            while free[targets[t]] <= 0:
                t += 1
            moves.append((gid, idx, d["id"], targets[t]))
            free[targets[t]] -= 1
    return moves

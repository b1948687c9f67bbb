"""Scheduler events per second with 1k, 100k and 1M trajectories in flight.

A minimal synchronous driver keeps the scheduler (mode `dora`) saturated: it answers every action
at once and finishes the oldest running trajectory each tick, so every finish frees a slot that
the scheduler refills (dispatch, admission, batch formation, steps, publishes and version switches
all happen in the measured window). Only the time spent inside `Scheduler.handle` is counted.

    python benchmarks/core_events.py            # the full table (1M in flight takes a while)
    python benchmarks/core_events.py --quick    # 1k and 100k only
    python benchmarks/core_events.py --json     # {"rows": [{"in_flight", "instances", "events_per_s"}]}

The goal (not asserted anywhere): per-event cost flat within 2x from 1k to 1M in flight, and at
least 200k events/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque

from dora_ext.config import DoraConfig
from dora_ext.core import (
    DeliverGroup, Dispatch, GroupAdmitted, InstanceLoaded, LoadVersion, Migrate, RequestGroups,
    Scheduler, StartStep, TrainerStepFinished, TrajectoryFinished, VersionPublished,
)

N = 8  # trajectories per group


def measure(in_flight: int, instances: int, events: int) -> dict:
    cap = max(1, in_flight // instances)
    # K=1: R2 lets (K+1)*B groups be admitted ahead, so B is sized to keep `in_flight` running.
    batch = max(1, in_flight // N // 2)
    cfg = DoraConfig.from_dict(
        {"mode": "dora", "max_staleness": 1, "batch_size": batch, "group_size": N,
         "instances": instances, "capacity": cap}
    )
    sched = Scheduler(cfg)
    running: deque = deque()
    todo: deque = deque()
    next_gid = 0
    spent = 0.0
    counted = 0

    def execute(actions):
        nonlocal next_gid
        for a in actions:
            t = type(a)
            if t is Dispatch:
                running.append((a.group_id, a.index))
            elif t is RequestGroups:
                for _ in range(a.count):
                    todo.append(GroupAdmitted(next_gid))
                    next_gid += 1
            elif t is LoadVersion:
                todo.append(InstanceLoaded(a.instance_id, a.version))
            elif t is StartStep:
                todo.append(TrainerStepFinished(a.step))
                todo.append(VersionPublished(a.step + 1))
            elif t in (DeliverGroup, Migrate):
                pass

    execute(sched.start())
    # Fill: answer everything until the engines are full (not timed).
    while todo:
        execute(sched.handle(todo.popleft()))
    handle = sched.handle
    while counted < events:
        if todo:
            ev = todo.popleft()
        else:
            gid, idx = running.popleft()
            ev = TrajectoryFinished(gid, idx, tokens=100, reward=1.0)
        t0 = time.perf_counter()
        acts = handle(ev)
        spent += time.perf_counter() - t0
        counted += 1
        execute(acts)
    m = sched.metrics()
    return {
        "in_flight": in_flight,
        "instances": instances,
        "events_per_s": round(counted / spent),
        "us_per_event": round(1e6 * spent / counted, 2),
        "steps": m["steps"],
        "c2_ok": m["c2_ok"],
        "c3_ok": m["c3_ok"],
    }


GRID = [(1_000, 10), (1_000, 1_000), (100_000, 10), (100_000, 1_000), (100_000, 10_000),
        (1_000_000, 1_000), (1_000_000, 10_000)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="skip the 1M-in-flight rows")
    p.add_argument("--events", type=int, default=300_000, help="events measured per row")
    args = p.parse_args(argv)
    rows = []
    for in_flight, instances in GRID:
        if args.quick and in_flight > 100_000:
            continue
        rows.append(measure(in_flight, instances, args.events))
        if not args.json:
            r = rows[-1]
            print(f"in_flight={r['in_flight']:>9,}  instances={r['instances']:>6,}  "
                  f"events/s={r['events_per_s']:>9,}  us/event={r['us_per_event']:>6}  "
                  f"steps={r['steps']}", flush=True)
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        lo = min(r["us_per_event"] for r in rows)
        hi = max(r["us_per_event"] for r in rows)
        print(f"per-event cost spread (max/min): {hi / lo:.2f}x (goal <= 2x); "
              f"slowest row {min(r['events_per_s'] for r in rows):,} events/s (goal >= 200,000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

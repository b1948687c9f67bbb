"""Scheduler events per second of CPU time, K = 1..3, 1k .. 1M trajectories in flight.

A synchronous driver keeps the scheduler (mode `dora`) saturated: it answers every action at
once (groups admitted, loads done, trainer steps finished and published) and finishes running
trajectories oldest first, except that 3% of them are stragglers that run two to three times
longer. Stragglers spread old versions thin over the instances that hold them, so R5
migrations and R4 version switches happen; `B` is sized so that the R2 budget,
`(K + 1) * B` groups, keeps the fleet full, and the measured window is long enough to hold
several trainer steps. What happens inside the window (events, steps, publishes, version
switches, migrations) is counted and printed: a row whose window holds no step measured nothing
of R3/R4/R5 and says so.

Only the CPU time (`time.process_time`) spent inside `Scheduler.handle_many` is counted; the
driver feeds events in batches of up to 256, as a runtime draining its inbox would. Memory per
in-flight trajectory is what `dora_ext/core` allocated and still holds after the fill
(tracemalloc, traced from core's own source lines), divided by the trajectories in flight.
Flatness is the dearest row's cost per event over the cheapest row's.

    python benchmarks/core_events.py            # the full table (the 1M rows take a while)
    python benchmarks/core_events.py --quick    # up to 100k in flight
    python benchmarks/core_events.py --json     # {"rows": [...], "flatness": ...}

Goals (not asserted anywhere): >= 200k events/s in every row and flatness <= 1.5x.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from collections import deque

from dora_ext.config import DoraConfig
from dora_ext.core import (
    Dispatch, GroupAdmitted, InstanceLoaded, LoadVersion, Migrate, RequestGroups, Scheduler,
    StartStep, TrainerStepFinished, TrajectoryFinished, VersionPublished,
)

N = 8  # trajectories per group
BATCH = 256  # events per handle_many call
STRAGGLERS = 0.03


class Bench:
    def __init__(self, K: int, in_flight: int, instances: int, seed: int = 0) -> None:
        cap = max(1, in_flight // instances)
        self.batch = max(1, in_flight // N // (K + 1))
        cfg = DoraConfig.from_dict(
            {"mode": "dora", "max_staleness": K, "batch_size": self.batch, "group_size": N,
             "instances": instances, "capacity": cap}
        )
        self.sched = Scheduler(cfg)
        self.rng = random.Random(seed)
        self.running: deque = deque()  # [gid, idx, laps left] oldest first
        self.todo: deque = deque()
        self.next_gid = 0
        self.count = {"steps": 0, "publishes": 0, "switches": 0, "migrations": 0, "dispatches": 0}

    def execute(self, actions) -> None:
        count = self.count
        for a in actions:
            t = type(a)
            if t is Dispatch:
                laps = 0 if self.rng.random() >= STRAGGLERS else self.rng.randint(1, 2)
                self.running.append((a.group_id, a.index, laps))
                count["dispatches"] += 1
            elif t is RequestGroups:
                for _ in range(a.count):
                    self.todo.append(GroupAdmitted(self.next_gid))
                    self.next_gid += 1
            elif t is LoadVersion:
                count["switches"] += 1
                self.todo.append(InstanceLoaded(a.instance_id, a.version))
            elif t is StartStep:
                count["steps"] += 1
                count["publishes"] += 1
                self.todo.append(TrainerStepFinished(a.step))
                self.todo.append(VersionPublished(a.step + 1))
            elif t is Migrate:
                count["migrations"] += 1

    def next_batch(self) -> list:
        out = []
        todo, running = self.todo, self.running
        while todo and len(out) < BATCH:
            out.append(todo.popleft())
        while len(out) < BATCH and running:
            gid, idx, laps = running.popleft()
            if laps:
                running.append((gid, idx, laps - 1))  # a straggler: it finishes a lap later
                continue
            out.append(TrajectoryFinished(gid, idx, tokens=100, reward=1.0))
        return out


def measure(K: int, in_flight: int, instances: int, events: int | None = None) -> dict:
    gc.collect()
    tracemalloc.start()
    b = Bench(K, in_flight, instances)
    sched = b.sched
    b.execute(sched.start())
    # Fill (not timed): answer everything until the engines are full and the pool is primed.
    while b.todo:
        b.execute(sched.handle_many(b.next_batch()))
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*dora_ext/core/*")])
    core_bytes = sum(s.size for s in snap.statistics("filename"))
    tracemalloc.stop()
    del snap
    filled = len(b.running)
    # Long enough for several steps: a step takes B * N finishes.
    window = events or max(200_000, 4 * b.batch * N)
    # Warm-up (not timed): one step's worth, so the window starts in steady state.
    warm = b.batch * N
    done = 0
    while done < warm:
        evs = b.next_batch()
        done += len(evs)
        b.execute(sched.handle_many(evs))
    before = dict(b.count)
    groups_before = sched.metrics()["live_groups"] if "live_groups" in sched.metrics() else len(sched.groups)
    handle_many = sched.handle_many
    clock = time.process_time
    spent = 0.0
    counted = 0
    gc_was = gc.isenabled()
    while counted < window:
        evs = b.next_batch()
        if not evs:
            raise RuntimeError("the driver ran dry: the scheduler stopped dispatching")
        t0 = clock()
        acts = handle_many(evs)
        spent += clock() - t0
        counted += len(evs)
        b.execute(acts)
    in_window = {k: b.count[k] - before[k] for k in b.count}
    m = sched.metrics()
    groups_after = m["live_groups"] if "live_groups" in m else len(sched.groups)
    assert gc_was == gc.isenabled()
    return {
        "K": K,
        "in_flight": filled,
        "instances": instances,
        "batch_size": b.batch,
        "events": counted,
        "events_per_s": round(counted / spent),
        "us_per_event": round(1e6 * spent / counted, 3),
        "core_bytes_per_in_flight": round(core_bytes / max(filled, 1)),
        "live_groups_start": groups_before,
        "live_groups_end": groups_after,
        **{f"window_{k}": v for k, v in in_window.items()},
        "c2_ok": m["c2_ok"],
        "c3_ok": m["c3_ok"],
    }


GRID = [(1_000, 1_000), (10_000, 1_000), (100_000, 1_000), (100_000, 10_000), (1_000_000, 1_000),
        (1_000_000, 10_000)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="skip the 1M-in-flight rows")
    p.add_argument("--events", type=int, default=None, help="events measured per row (default: >= 4 steps)")
    p.add_argument("--k", default="1,2,3", help="comma-separated K values")
    args = p.parse_args(argv)
    rows = []
    for K in [int(k) for k in args.k.split(",")]:
        for in_flight, instances in GRID:
            if args.quick and in_flight > 100_000:
                continue
            rows.append(measure(K, in_flight, instances, args.events))
            if not args.json:
                r = rows[-1]
                print(f"K={r['K']} in_flight={r['in_flight']:>9,} instances={r['instances']:>6,} "
                      f"events/s={r['events_per_s']:>9,} us/event={r['us_per_event']:>7} "
                      f"bytes/traj={r['core_bytes_per_in_flight']:>5} | window: events={r['events']:,} "
                      f"steps={r['window_steps']} publishes={r['window_publishes']} "
                      f"switches={r['window_switches']} migrations={r['window_migrations']} "
                      f"live groups {r['live_groups_start']:,}->{r['live_groups_end']:,}", flush=True)
    lo = min(r["us_per_event"] for r in rows)
    hi = max(r["us_per_event"] for r in rows)
    summary = {"flatness": round(hi / lo, 2), "slowest_events_per_s": min(r["events_per_s"] for r in rows)}
    if args.json:
        print(json.dumps({"rows": rows, **summary}))
    else:
        print(f"flatness (dearest/cheapest per-event cost): {summary['flatness']}x (goal <= 1.5x); "
              f"slowest row {summary['slowest_events_per_s']:,} events/s (goal >= 200,000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

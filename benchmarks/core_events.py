"""Scheduler events per second of CPU time, K = 1..3, 1k .. 1M slots over 1k .. 10k instances.

A synchronous driver keeps the scheduler (mode `dora`) busy: it answers every action at once
(groups admitted, loads done, trainer steps finished and published, migrations landed: a
`MigrationLanded` in the next batch, as the simulator sends once the KV cache has moved, after
which R5 may move the trajectory again) and finishes running trajectories oldest first,
except that 3% of them are stragglers that run two to three times longer. Stragglers spread
old versions thin over the instances that hold them, so R5 migrations and R4 version switches
happen. Each row is named by its slots (instances x
capacity, the `slots` column: 1k .. 1M); `B` is sized so that the R2 budget, `(K + 1) * B`
groups, equals the slots. The trajectories actually in flight are counted by the driver before
every batch of the measured window and printed (mean and minimum): pinned versions (R1, R4)
keep slots of instances that still run old-version stragglers empty, so the mean is below the
slots (about a quarter to three quarters of them with this driver); a row is as large as its
`in flight mean` says, not as its slots. The window is long enough to hold several trainer
steps where the slots allow (at least 200k events, at least four steps' worth); what happens
inside it (events, steps, publishes, version switches, migrations, and of those the moves of a
trajectory that had moved before in its attempt, each one more KV transfer) is counted and
printed: a row whose window holds no step measured nothing of R3/R4/R5 and says so. The 1k-slot
row over 1k instances has capacity 1 per instance: R5 cannot move a trajectory there (a move
needs a free slot on another instance holding the same version), so its window holds no
migration and its line says so; every other row's window holds migrations.

Only the CPU time (`time.process_time`) spent inside `Scheduler.handle_many` is counted, with
the garbage collector on (its cost grows with the objects the scheduler keeps, so it is part
of the measurement); the driver feeds events in batches of up to 256, as a runtime draining its
inbox would. Memory per in-flight trajectory is what `dora_ext/core` allocated and still holds
after the fill (tracemalloc, traced from core's own source lines), divided by the trajectories
running then. Flatness is the dearest row's cost per event over the cheapest row's.

    python benchmarks/core_events.py            # the full table (the 1M rows take a while)
    python benchmarks/core_events.py --quick    # up to 100k slots
    python benchmarks/core_events.py --json     # {"rows": [...], "flatness": ...}
    python benchmarks/core_events.py --no-landings   # no MigrationLanded answers (a host that
        # sends none): a trajectory moves at most once per attempt

The guard (exit status 1 when missed, `guard_ok` in the JSON): >= 100k events per CPU second in
every row and flatness <= 1.5x. The largest host sends a few thousand events per second.
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
    Dispatch, GroupAdmitted, InstanceLoaded, LoadVersion, Migrate, MigrationLanded, RequestGroups, Scheduler,
    StartStep, TrainerStepFinished, TrajectoryFinished, VersionPublished,
)

N = 8  # trajectories per group
BATCH = 256  # events per handle_many call
STRAGGLERS = 0.03
BUDGET_X = 1.0  # the R2 budget over the slots


class Bench:
    def __init__(self, K: int, in_flight: int, instances: int, seed: int = 0, scheduler: type = Scheduler,
                 landings: bool = True) -> None:
        self.landings = landings
        cap = max(1, in_flight // instances)
        # The R2 budget, (K + 1) * B groups, is 1.5x the slots: completed groups waiting for their
        # step hold budget too, and with a budget of exactly the slots the fleet ran ~15% empty.
        self.batch = max(1, int(-(-BUDGET_X * cap * instances // (N * (K + 1)))))
        cfg = DoraConfig.from_dict(
            {"mode": "dora", "max_staleness": K, "batch_size": self.batch, "group_size": N,
             "instances": instances, "capacity": cap}
        )
        self.sched = scheduler(cfg)
        self.rng = random.Random(seed)
        self.running: deque = deque()  # [gid, idx, laps left] oldest first
        self.todo: deque = deque()
        self.next_gid = 0
        self.count = {"steps": 0, "publishes": 0, "switches": 0, "migrations": 0, "remigrations": 0, "dispatches": 0}
        self.moved: set = set()  # (gid, idx) of running trajectories that moved at least once

    def execute(self, actions) -> None:
        count = self.count
        for a in actions:
            t = type(a)
            if t is Dispatch:
                assert a.attempt == 0  # the driver fails nothing: every attempt is the first
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
                # As the simulator does once the KV cache has moved: the trajectory runs on its
                # destination (it keeps its place among the running: its remaining work moved
                # with it), and R5 may move it again.
                count["migrations"] += 1
                key = (a.group_id, a.index)
                if key in self.moved:
                    count["remigrations"] += 1  # a move of a trajectory that moved before (a KV transfer more)
                else:
                    self.moved.add(key)
                if self.landings:  # without: as a host that sends none
                    self.todo.append(MigrationLanded(a.group_id, a.index, 0))

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
            self.moved.discard((gid, idx))
            out.append(TrajectoryFinished(gid, idx, tokens=100, reward=1.0))
        return out


def measure(K: int, in_flight: int, instances: int, events: int | None = None, scheduler: type = Scheduler,
            landings: bool = True) -> dict:
    gc.collect()
    tracemalloc.start()
    b = Bench(K, in_flight, instances, scheduler=scheduler, landings=landings)
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
    flight_sum = flight_n = 0
    flight_min = len(b.running)
    while counted < window:
        n_run = len(b.running)
        flight_sum += n_run
        flight_n += 1
        if n_run < flight_min:
            flight_min = n_run
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
        "in_flight": filled,  # running after the fill
        "in_flight_mean": round(flight_sum / max(flight_n, 1)),  # over the measured window
        "in_flight_min": flight_min,
        "instances": instances,
        "capacity": max(1, in_flight // instances),
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


def _no_moves(r: dict) -> str:
    """Why a window holds no migration, where the row cannot have one."""
    if r["window_migrations"] == 0 and r.get("capacity") == 1:
        return "[capacity 1: R5 has no free slot to move a trajectory into, so this row measures no R5 move] "
    return ""


def _line(r: dict, tag: str = "") -> str:
    return (f"{tag}K={r['K']} slots={r['slots']:>9,} instances={r['instances']:>6,} in flight mean={r['in_flight_mean']:>9,} "
            f"min={r['in_flight_min']:>9,} events/s={r['events_per_s']:>9,} us/event={r['us_per_event']:>7} "
            f"bytes/traj={r['core_bytes_per_in_flight']:>5} | window: events={r['events']:,} "
            f"steps={r['window_steps']} switches={r['window_switches']} migrations={r['window_migrations']} "
            f"(of a trajectory moved before: {r['window_remigrations']}) "
            f"{_no_moves(r)}"
            f"live groups {r['live_groups_start']:,}->{r['live_groups_end']:,}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="skip the 1M-in-flight rows")
    p.add_argument("--events", type=int, default=None, help="events measured per row (default: >= 4 steps)")
    p.add_argument("--k", default="1,2,3", help="comma-separated K values")
    p.add_argument("--no-landings", dest="landings", action="store_false",
                   help="answer no Migrate with MigrationLanded (as a host that sends none: a "
                        "trajectory then moves at most once per attempt)")
    args = p.parse_args(argv)
    rows = []
    for K in [int(k) for k in args.k.split(",")]:
        for in_flight, instances in GRID:
            if args.quick and in_flight > 100_000:
                continue
            rows.append(measure(K, in_flight, instances, args.events, landings=args.landings))
            rows[-1]["slots"] = in_flight
            if not args.json:
                print(_line(rows[-1]), flush=True)
    lo = min(r["us_per_event"] for r in rows)
    hi = max(r["us_per_event"] for r in rows)
    summary = {"flatness": round(hi / lo, 2), "slowest_events_per_s": min(r["events_per_s"] for r in rows),
               "quick": args.quick}
    summary["guard_ok"] = summary["flatness"] <= 1.5 and summary["slowest_events_per_s"] >= 100_000
    if args.json:
        print(json.dumps({"rows": rows, **summary}))
    else:
        print(f"flatness (dearest/cheapest per-event cost): {summary['flatness']}x (guard <= 1.5x); "
              f"slowest row {summary['slowest_events_per_s']:,} events/s (guard >= 100,000)")
    return 0 if summary["guard_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

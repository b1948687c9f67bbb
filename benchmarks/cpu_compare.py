"""sync vs dora (K=1 and K=2) on the default CPU recipe: reward, time to reward, throughput, in one run.

    python benchmarks/cpu_compare.py [--recipe recipes/cpu/long-tail.yaml] [--seeds 3] [--steps N]
                                     [--repeats 2] [--out DIR] [--set section.key=value ...]
                                     [--borrow recipe|on|off|both]

For each seed the three modes run from the same warm-started version 0 on the same prompt stream,
with the same algorithm settings (only `dora.mode` and `dora.max_staleness` differ). The order is
interleaved ABBA: seed 0 runs sync, K=1, K=2; seed 1 runs K=2, K=1, sync; and so on, so that a
load drifting during the benchmark weighs on every mode alike. With `--repeats 2` every seed runs
each mode twice (sync, K=1, K=2, K=2, K=1, sync) and the seed's throughput ratio is
sum(dora) / sum(sync) over its runs; rewards and curves come from each mode's first run.

Equal hardware: every mode gets the recipe's cores. sync trains on all of them (a data-parallel
trainer, one gloo rank per core) and generates on all of them; the asynchronous modes split them,
pinned with CPU affinity when the recipe says `runtime.pin: true`. The core assignment each worker
reported is printed. `--borrow on|off` sets the dora runs' `runtime.trainer_borrow` (a second,
low-priority trainer rank on the rollout cores; sync already trains on every core, so the option
does not apply to it); `both` runs dora K=1 and K=2 without and with it ("dora K=2 borrow"), in
the same ABBA order; `recipe` (the default) keeps the recipe's setting.

Reported:
- held-out reward of the final policy per seed and mode; whether dora K=1 and K=2 each end within
  sync's seed spread (min..max);
- time to sync's final reward: the wall time at which each run's training-batch reward (moving
  average) first reaches sync's final smoothed training reward (mean over seeds); a training-batch
  proxy, since the held-out reward is only measured at the end; and, less sensitive to the noise
  of a plateau, the time to 90% of sync's gain (its first full window to its final value);
- throughput: trained response tokens per second in the steady-state window; dora/sync per seed
  (the table's "speedup vs sync" is its median over seeds).
Caveat of the time-to-reward proxy: dora fills its first batches with the groups that finish
first, i.e. short answers, whose reward is higher, so its early training-batch reward is biased
upwards; compare the held-out finals and the reward-vs-time plot's later part.
- `reward_vs_time.png` (every seed), `rewards.png` (per step), `timeline.png`, `cpu_compare.json`.

Nothing is asserted: the script reports what it measured, and the machine's load average, since a
shared machine moves wall-clock ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=os.path.join(here, "..", "recipes", "cpu", "long-tail.yaml"))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", default=os.path.join("runs", "cpu_compare"))
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per mode and seed (default 1; the order alternates from seed to seed)")
    p.add_argument("--window", type=int, default=20, help="moving-average window of the reward curves (steps)")
    p.add_argument("--borrow", choices=("recipe", "on", "off", "both"), default="recipe",
                   help="runtime.trainer_borrow of the dora runs (default: the recipe's); both = each dora K twice")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    from dora_ext.runtime import load_recipe, prepare, run
    from dora_ext.runtime.compare import Progress, dump_json, write_steps
    from dora_ext.runtime.report import (aggregate, plot_reward_vs_time, plot_rewards, plot_timeline, smoothed,
                                         table, time_to_reward)

    base_recipe = load_recipe(args.recipe, args.set)
    if args.steps:
        base_recipe = base_recipe.with_steps(args.steps)
    def dora(k: int, borrow: str) -> object:
        extra = [] if borrow == "recipe" else [f"runtime.trainer_borrow={'true' if borrow == 'on' else 'false'}"]
        r = load_recipe(args.recipe, [*args.set, f"dora.max_staleness={k}", *extra])
        return (r.with_steps(args.steps) if args.steps else r).with_mode("dora")

    variants = {"sync": base_recipe.with_mode("sync")}
    for k in (1, 2):
        if args.borrow == "both":
            variants[f"dora K={k}"] = dora(k, "off")
            variants[f"dora K={k} borrow"] = dora(k, "on")
        else:
            variants[f"dora K={k}"] = dora(k, args.borrow)
    labels = list(variants)
    os.makedirs(args.out, exist_ok=True)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    results: dict[str, list] = {m: [] for m in labels}
    throughput: dict[str, list[list[float]]] = {m: [] for m in labels}  # per seed, per repeat
    bar = Progress(not args.no_progress)
    t_start = time.perf_counter()
    seeds = list(range(base_recipe.seed, base_recipe.seed + args.seeds))
    orders = []
    for i, seed in enumerate(seeds):
        first = labels if i % 2 == 0 else labels[::-1]  # ABBA across seeds ...
        orders.append([m for k in range(args.repeats) for m in (first if k % 2 == 0 else first[::-1])])  # ... and within
    for seed, order in zip(seeds, orders):
        prepared = prepare(base_recipe.with_seed(seed))
        per_seed: dict[str, list[float]] = {m: [] for m in labels}
        for label in order:
            r = variants[label].with_seed(seed)
            try:
                res = run(r, prepared, on_step=bar.start(f"{label:>8} seed {seed}", r.steps))
            finally:
                bar.close()
            per_seed[label].append(res.metrics["throughput_tokens_per_s"])
            if len(per_seed[label]) == 1:
                results[label].append(res)
                write_steps(os.path.join(args.out, f"{label.replace(' ', '').replace('=', '')}-seed{seed}.jsonl"), res)
        for label in labels:
            throughput[label].append(per_seed[label])
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None

    ratios = {m: [sum(d) / sum(s) for s, d in zip(throughput["sync"], throughput[m])] for m in labels}
    for m in labels:
        for res, ratio in zip(results[m], ratios[m]):
            res.metrics["speedup_vs_sync"] = ratio
    init = [r.metrics["initial_reward"] for r in results["sync"]]
    final = {m: [r.metrics["final_reward"] for r in runs] for m, runs in results.items()}
    spread = [min(final["sync"]), max(final["sync"])]
    within = {m: spread[0] <= statistics.mean(final[m]) <= spread[1] for m in labels if m != "sync"}
    # sync's final training reward (smoothed, mean over seeds): the target every mode is timed to
    target = statistics.mean(smoothed([s["reward_mean"] for s in r.steps], args.window)[-1] for r in results["sync"])
    reach = {m: [time_to_reward(r, target, args.window) for r in runs] for m, runs in results.items()}
    # The training reward plateaus and fluctuates, so the crossing of sync's final value is partly
    # noise; the time to 90% of sync's gain (first full window -> final) is also reported.
    start = statistics.mean(smoothed([s["reward_mean"] for s in r.steps], args.window)[min(args.window, len(r.steps)) - 1]
                            for r in results["sync"])
    target90 = start + 0.9 * (target - start)
    reach90 = {m: [time_to_reward(r, target90, args.window) for r in runs] for m, runs in results.items()}
    wall = {m: [r.metrics["wall_s"] for r in runs] for m, runs in results.items()}
    summary = {
        "recipe": base_recipe.name, "steps": base_recipe.steps, "seeds": seeds, "repeats": args.repeats,
        "order_per_seed": orders,
        "throughput_tokens_per_s": throughput,
        "speedup_vs_sync": {m: {"per_seed": v, "median": statistics.median(v)} for m, v in ratios.items()},
        "reward": {"initial_per_seed": init, "final_per_seed": final,
                   "final_mean": {m: statistics.mean(v) for m, v in final.items()}, "sync_spread": spread},
        "dora_within_sync_spread": within,
        "time_to_sync_final_reward_s": {"target_train_reward": target, "per_seed": reach},
        "time_to_90pct_of_sync_gain_s": {"target_train_reward": target90, "per_seed": reach90},
        "wall_s_per_run": wall,
        "core_assignment": {m: runs[0].metrics.get("core_assignment") for m, runs in results.items()},
        "constraints": {m: {k: all(r.metrics[k] for r in runs) for k in ("c1_ok", "c2_ok", "c3_ok")}
                        for m, runs in results.items()},
        "load_average_before_after": [load_before, load_after],
        "wall_s": time.perf_counter() - t_start,
        "modes": aggregate(results),
    }
    for m in labels:  # the table's speedup: the ABBA ratio (median over seeds), not the first runs' alone
        summary["modes"][m]["speedup_vs_sync"] = statistics.median(ratios[m])
    dump_json(os.path.join(args.out, "cpu_compare.json"), summary)
    title = f"{base_recipe.name}: {' vs '.join(labels)}; {args.seeds} seeds, {base_recipe.steps} steps"
    plot_reward_vs_time(results, os.path.join(args.out, "reward_vs_time.png"), title=title, window=args.window)
    plot_rewards(results, os.path.join(args.out, "rewards.png"), title=title)
    plot_timeline({m: runs[0] for m, runs in results.items()}, os.path.join(args.out, "timeline.png"),
                  title=f"{base_recipe.name}, seed {seeds[0]}")
    print(table(summary["modes"]))

    def fmt(xs: list) -> str:
        return ", ".join("never" if x is None else f"{x:.1f}" for x in xs)

    print("\norder of the runs per seed (ABBA): " + "; ".join(f"seed {s}: {', '.join(o)}" for s, o in zip(seeds, orders)))

    def spread_of(xs: list) -> str:
        xs = [x for x in xs if x is not None]
        if not xs:
            return "never"
        return f"mean {statistics.mean(xs):.3f}, min {min(xs):.3f}, max {max(xs):.3f}"

    print(f"\nheld-out reward (same {base_recipe.eval.prompts} prompts x {base_recipe.eval.samples} samples for every run):")
    print(f"  {'initial':>8}: {spread_of(init)} (seeds {', '.join(f'{x:.3f}' for x in init)})")
    for m in labels:
        extra = "" if m == "sync" else f"; mean within sync's spread {spread[0]:.3f}..{spread[1]:.3f}: {within[m]}"
        print(f"  {m:>8}: final {spread_of(final[m])} (seeds {', '.join(f'{x:.3f}' for x in final[m])}){extra}")
    print(f"time to sync's final training reward {target:.3f} ({args.window}-step mean), seconds per seed:")
    for m in labels:
        print(f"  {m:>8}: {fmt(reach[m])}   (run wall time {fmt(wall[m])})")
    print(f"time to 90% of sync's training-reward gain ({start:.3f} -> {target:.3f}: {target90:.3f}), seconds per seed:")
    for m in labels:
        print(f"  {m:>8}: {fmt(reach90[m])}")
    print("throughput, trained response tokens/s in the steady-state window, per seed (first run):")
    for m in labels:
        tps = [r.metrics["throughput_tokens_per_s"] for r in results[m]]
        print(f"  {m:>8}: {', '.join(f'{x:.0f}' for x in tps)}; mean {statistics.mean(tps):.0f}")
    print("throughput dora/sync per seed" + (" (ABBA sums):" if args.repeats > 1 else ":"))
    for m in labels[1:]:
        print(f"  {m:>8}: {', '.join(f'{x:.2f}' for x in ratios[m])}; median {statistics.median(ratios[m]):.2f}x, "
              f"min {min(ratios[m]):.2f}x, max {max(ratios[m]):.2f}x")
    print("core assignment (as each worker reported it; trainer ranks: rank 0 first) and the share of the "
          "trained tokens each trainer rank trained:")
    for m in labels:
        shares = [r.metrics.get("trainer_rank_token_share") for r in results[m]]
        share = "; ".join("-" if x is None else "/".join(f"{v:.2f}" for v in x) for x in shares)
        secs = [r.metrics.get("trainer_rank_seconds") for r in results[m]]
        sec = "; ".join("-" if x is None else " ".join(f"{a:.0f}/{b:.0f}" for a, b in x) for x in secs)
        print(f"  {m:>8}: {results[m][0].metrics.get('core_assignment')}; rank token shares per seed: {share}; "
              f"per rank seconds computing/in collectives: {sec}")
    print(f"load average before/after: {load_before} / {load_after}")
    print(f"files: {args.out}/cpu_compare.json, reward_vs_time.png, rewards.png, timeline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

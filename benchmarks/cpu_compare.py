"""dora vs sync on the default CPU recipe: throughput ratio and convergence parity, in one run.

    python benchmarks/cpu_compare.py [--recipe recipes/cpu/long-tail.yaml] [--seeds 3] [--steps N]
                                     [--out DIR] [--set section.key=value ...]

For each seed both modes run from the same warm-started version 0 on the same prompt stream, one
right after the other. With `--repeats 2` (the default) each seed runs sync, dora, dora, sync
(ABBA): a load that drifts during the seed's runs then weighs on both modes alike, and the seed's
ratio is sum(dora) / sum(sync) over its runs. Rewards come from each mode's first run. Reported:

- throughput: trained response tokens per second in the steady-state window, per run; the ratio
  dora/sync per seed, its median and mean. Goal: >= 1.5x.
- convergence parity: the held-out reward of the final policy per seed; dora's mean over seeds
  should lie within sync's seed spread (min..max), and both means should clearly exceed the
  initial policy's (by more than twice the standard error of the seeds' final rewards).
- curves: `rewards.png` (training reward per step, band over seeds, held-out finals) and
  `timeline.png` (seed 0, both modes), plus `cpu_compare.json` with every number.

Nothing is asserted: the script reports what it measured (and the machine's load average, since
a shared machine moves wall-clock ratios).
"""

from __future__ import annotations

import argparse
import json
import math
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
    p.add_argument("--repeats", type=int, default=2, help="runs per mode and seed, in ABBA order (default 2)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    from dora_ext.runtime import load_recipe, prepare, run
    from dora_ext.runtime.compare import Progress, dump_json, write_steps
    from dora_ext.runtime.report import aggregate, plot_rewards, plot_timeline, table

    recipe = load_recipe(args.recipe, args.set)
    if args.steps:
        recipe = recipe.with_steps(args.steps)
    os.makedirs(args.out, exist_ok=True)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    results: dict[str, list] = {"sync": [], "dora": []}
    throughput: dict[str, list[list[float]]] = {"sync": [], "dora": []}  # per seed, per repeat
    bar = Progress(not args.no_progress)
    t_start = time.perf_counter()
    order = [("sync", "dora", "dora", "sync")[k % 4] for k in range(2 * args.repeats)]
    for seed in range(recipe.seed, recipe.seed + args.seeds):
        base = recipe.with_seed(seed)
        prepared = prepare(base)
        per_seed: dict[str, list[float]] = {"sync": [], "dora": []}
        for mode in order:
            r = base.with_mode(mode)
            try:
                res = run(r, prepared, on_step=bar.start(f"{mode:>4} seed {seed}", r.steps))
            finally:
                bar.close()
            per_seed[mode].append(res.metrics["throughput_tokens_per_s"])
            if len(per_seed[mode]) == 1:
                results[mode].append(res)
                write_steps(os.path.join(args.out, f"{mode}-seed{seed}.jsonl"), res)
        for mode in per_seed:
            throughput[mode].append(per_seed[mode])
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None

    ratios = [sum(d) / sum(s) for s, d in zip(throughput["sync"], throughput["dora"])]
    for s, d, ratio in zip(results["sync"], results["dora"], ratios):
        d.metrics["speedup_vs_sync"] = ratio
        s.metrics["speedup_vs_sync"] = 1.0
    init = [r.metrics["initial_reward"] for r in results["sync"]]
    final = {m: [r.metrics["final_reward"] for r in runs] for m, runs in results.items()}

    def sem(xs: list[float]) -> float:
        return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")

    init_mean = statistics.mean(init)
    improved = {m: statistics.mean(v) - init_mean > 2 * (sem(v) if len(v) > 1 else 0.0) and statistics.mean(v) > init_mean
                for m, v in final.items()}
    within = min(final["sync"]) <= statistics.mean(final["dora"]) <= max(final["sync"])
    summary = {
        "recipe": recipe.name,
        "steps": recipe.steps,
        "seeds": list(range(recipe.seed, recipe.seed + args.seeds)),
        "throughput_tokens_per_s": throughput,
        "repeats": args.repeats,
        "speedup_dora_vs_sync": {"per_seed": ratios, "median": statistics.median(ratios), "mean": statistics.mean(ratios)},
        "goal_speedup_1_5x": statistics.median(ratios) >= 1.5,
        "reward": {"initial_per_seed": init, "final_per_seed": final,
                   "final_mean": {m: statistics.mean(v) for m, v in final.items()},
                   "sync_spread": [min(final["sync"]), max(final["sync"])]},
        "goal_dora_within_sync_spread": within,
        "goal_both_improve": improved,
        "constraints": {m: {k: all(r.metrics[k] for r in runs) for k in ("c1_ok", "c2_ok", "c3_ok")}
                        for m, runs in results.items()},
        "load_average_before_after": [load_before, load_after],
        "wall_s": time.perf_counter() - t_start,
        "modes": aggregate(results),
    }
    dump_json(os.path.join(args.out, "cpu_compare.json"), summary)
    plot_rewards(results, os.path.join(args.out, "rewards.png"),
                 title=f"{recipe.name}: sync vs dora, {args.seeds} seeds, {recipe.steps} steps")
    plot_timeline({m: runs[0] for m, runs in results.items()}, os.path.join(args.out, "timeline.png"),
                  title=f"{recipe.name}, seed {recipe.seed}")
    print(table(summary["modes"]))
    print(f"\nspeedup dora/sync per seed: {', '.join(f'{x:.2f}' for x in ratios)}; median "
          f"{summary['speedup_dora_vs_sync']['median']:.2f}x (goal 1.5x: {'met' if summary['goal_speedup_1_5x'] else 'NOT met'})")
    print(f"held-out reward: initial {init_mean:.3f}; final sync {statistics.mean(final['sync']):.3f} "
          f"(seeds {', '.join(f'{x:.3f}' for x in final['sync'])}), dora {statistics.mean(final['dora']):.3f} "
          f"(seeds {', '.join(f'{x:.3f}' for x in final['dora'])}); dora within sync's spread: {within}; "
          f"both clearly above initial: {improved}")
    print(f"load average before/after: {load_before} / {load_after}")
    print(f"files: {args.out}/cpu_compare.json, rewards.png, timeline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

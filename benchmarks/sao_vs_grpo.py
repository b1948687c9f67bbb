"""SAO (n=1 with a value model, recipes/cpu/sao-n1.yaml) against GRPO (recipes/cpu/long-tail.yaml)
at the same staleness K, in one reward-vs-wall-time plot.

    python benchmarks/sao_vs_grpo.py [--k 2] [--seeds 2] [--steps N] [--out DIR]

Both recipes use the same task, model and warm start; each runs in mode dora with
`max_staleness = K`. Stability is reported from evidence: the spread of the final held-out reward
over seeds, the largest drop of the smoothed training reward from its running best, and the
entropy at the end. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--out", default=os.path.join("runs", "sao_vs_grpo"))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    from dora_ext.runtime import load_recipe, prepare, run
    from dora_ext.runtime.compare import Progress, dump_json
    from dora_ext.runtime.report import plot_reward_vs_time, smoothed

    recipes = {f"GRPO (n=16) K={args.k}": os.path.join(here, "..", "recipes", "cpu", "long-tail.yaml"),
               f"SAO (n=1) K={args.k}": os.path.join(here, "..", "recipes", "cpu", "sao-n1.yaml")}
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, list] = {k: [] for k in recipes}
    bar = Progress(not args.no_progress)
    for label, path in recipes.items():
        recipe = load_recipe(path, [f"dora.max_staleness={args.k}"]).with_mode("dora")
        if args.steps:
            recipe = recipe.with_steps(args.steps)
        for seed in range(recipe.seed, recipe.seed + args.seeds):
            r = recipe.with_seed(seed)
            try:
                results[label].append(run(r, prepare(r), on_step=bar.start(f"{label} seed {seed}", r.steps)))
            finally:
                bar.close()
    summary = {}
    for label, runs in results.items():
        drops, ents = [], []
        for res in runs:
            ys = smoothed([s["reward_mean"] for s in res.steps], args.window)
            best, drop = -1.0, 0.0
            for y in ys:
                best = max(best, y)
                drop = max(drop, best - y)
            drops.append(drop)
            ents.append(res.steps[-1]["entropy"])
        final = [res.metrics["final_reward"] for res in runs]
        summary[label] = {"initial": [res.metrics["initial_reward"] for res in runs], "final": final,
                          "final_std": statistics.stdev(final) if len(final) > 1 else 0.0,
                          "max_drop_from_best": drops, "final_entropy": ents,
                          "wall_s": [res.metrics["wall_s"] for res in runs]}
        print(f"{label}: held-out {', '.join(f'{a:.3f}->{b:.3f}' for a, b in zip(summary[label]['initial'], final))}; "
              f"largest drop of the smoothed training reward from its best {', '.join(f'{d:.3f}' for d in drops)}; "
              f"final entropy {', '.join(f'{e:.2f}' for e in ents)}")
    dump_json(os.path.join(args.out, "sao_vs_grpo.json"), summary)
    plot_reward_vs_time(results, os.path.join(args.out, "reward_vs_time.png"), window=args.window,
                        title=f"SAO (n=1, value model) vs GRPO (n=16), dora K={args.k}")
    print(f"files: {args.out}/sao_vs_grpo.json, reward_vs_time.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

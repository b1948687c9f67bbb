"""SAO's stability claim, tested: GRPO, GRPO with SAO's mask, and SAO (n=1 + value model) under
dora at K = 1, 2, 4, each at its own best learning rate from the same sweep.

    python benchmarks/sao_vs_grpo.py [--json] [--ks 1,2,4] [--seeds 3] [--lrs 2e-4,5e-4,1e-3]
                                     [--sweep-k 2] [--lr METHOD=LR,...] [--steps N] [--out DIR]
                                     [--set section.key=value ...]

Methods: `grpo` is recipes/cpu/long-tail.yaml (n=16, decoupled PPO); `grpo_sao_mask` the same with
`trainer.correction: sao` (SAO's double-side mask on pi_theta / pi_rollout instead of the clip);
`sao` is recipes/cpu/sao-n1.yaml (n=1, a value model, GAE, the mask) with GRPO's entropy bonus
(0.01, as every earlier result used it); `sao_no_entropy` (not in the default --methods) without
it, as the recipe now ships. Same task, model, warm start
and trajectories per step (128). Equal tuning budget: every method gets the same sweep of
`trainer.lr` (`--lrs`, seed 0, K = `--sweep-k`); its best lr (highest final held-out reward) is
then run on `--seeds` seeds at every K (the sweep's run is reused as seed 0 at `--sweep-k`). The
sweep runs the largest lr first, every method (the setting where SAO was seen to collapse). `--lr`
skips the sweep and gives each method its lr (e.g. the best lrs of an earlier sweep's JSON);
`best_lr_from` then says so.

Per method and K: per seed, the final held-out reward, the largest drop of the smoothed training
reward (`--window` steps) from its running best, `collapse_step` (the trainer step at which that
drop began: the first step below the running best it fell from), the final entropy (mean of the last `--window`
steps) and `collapsed` (defined in the JSON: from the rewards the run measured). The JSON is
rewritten after every run (`--out`/sao_vs_grpo.json), so a run cut short keeps what it measured;
`not_run` lists the cells left. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

COLLAPSE_BELOW_INITIAL = 0.05
COLLAPSE_DROP = 0.15
DEFINITION = (f"collapsed: the final held-out reward is more than {COLLAPSE_BELOW_INITIAL} below the initial "
              f"policy's, or the smoothed training reward fell {COLLAPSE_DROP} or more below its running best")


def max_drop(ys: list[float]) -> float:
    """The largest fall of `ys` below its running maximum."""
    best, drop = float("-inf"), 0.0
    for y in ys:
        best = max(best, y)
        drop = max(drop, best - y)
    return drop


def drop_start(ys: list[float]) -> int | None:
    """The index at which the largest fall of `ys` below its running maximum began (the first point
    below the maximum it fell from), or None if `ys` never falls."""
    best, peak, drop, start = float("-inf"), 0, 0.0, None
    for i, y in enumerate(ys):
        if y > best:
            best, peak = y, i
        if best - y > drop:
            drop, start = best - y, peak + 1
    return start


FIELDS = ("seeds", "initial_reward", "final_reward", "max_drop", "collapse_step", "final_entropy", "collapsed", "staleness_mean",
          "masked_frac", "wall_s")


def record(r, window: int) -> dict:
    """One run's row of a cell (the per-seed values)."""
    from dora_ext.runtime.report import smoothed

    ys = smoothed([s["reward_mean"] for s in r.steps], window)[min(window, len(r.steps)) - 1:]
    ent = [s["entropy"] for s in r.steps[-window:]]
    masked = [s["masked_frac"] for s in r.steps[-window:] if "masked_frac" in s]
    drop, init, final = max_drop(ys), r.metrics["initial_reward"], r.metrics["final_reward"]
    start = drop_start(ys)  # ys[i] ends at trainer step i + window (1-based)
    return {"seeds": r.seed, "initial_reward": init, "final_reward": final, "max_drop": drop,
            "collapse_step": None if start is None else start + min(window, len(r.steps)),
            "final_entropy": sum(ent) / len(ent), "staleness_mean": r.metrics["staleness_mean"],
            "collapsed": final < init - COLLAPSE_BELOW_INITIAL or drop >= COLLAPSE_DROP,
            "masked_frac": sum(masked) / len(masked) if masked else None, "wall_s": r.metrics["wall_s"]}


def summary(records: list[dict]) -> dict:
    out: dict = {k: [rec[k] for rec in records] for k in FIELDS}
    out["final_reward_mean"] = statistics.mean(out["final_reward"])
    out["final_reward_sd"] = statistics.stdev(out["final_reward"]) if len(records) > 1 else None
    out["any_collapsed"] = any(out["collapsed"])
    return out


def cell(runs: list, window: int) -> dict:
    return summary([record(r, window) for r in runs])


def records_of(c: dict) -> list[dict]:
    """The per-seed rows of a saved cell (the inverse of `summary`)."""
    return [{k: c[k][i] if k in c else None for k in FIELDS} for i in range(len(c["seeds"]))]


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    cpu = os.path.join(here, "..", "recipes", "cpu")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", default="1,2,4")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--lrs", default="2e-4,5e-4,1e-3", help="the learning rates every method is swept over")
    p.add_argument("--sweep-k", type=int, default=2)
    p.add_argument("--methods", default="grpo,grpo_sao_mask,sao")
    p.add_argument("--lr", default=None, metavar="METHOD=LR,...",
                   help="skip the sweep: each method's lr (every method of --methods), e.g. from an earlier sweep")
    p.add_argument("--steps", type=int, default=None, help="trainer steps per run (default: the recipes')")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe value for every run (repeatable)")
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--out", default=os.path.join("runs", "sao_vs_grpo"))
    p.add_argument("--json", action="store_true", help="print the JSON object at the end")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--resume", action="store_true",
                   help="reuse the runs of an earlier --out JSON made with the same steps, window, eval and --set")
    args = p.parse_args(argv)

    from dora_ext.runtime import load_recipe, prepare, run
    from dora_ext.runtime.compare import Progress, dump_json

    recipes = {"grpo": (os.path.join(cpu, "long-tail.yaml"), []),
               "grpo_sao_mask": (os.path.join(cpu, "long-tail.yaml"), ["trainer.correction=sao"]),
               "sao": (os.path.join(cpu, "sao-n1.yaml"), ["trainer.entropy_coef=0.01"]),
               "sao_no_entropy": (os.path.join(cpu, "sao-n1.yaml"), ["trainer.entropy_coef=0"])}
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in recipes:
            p.error(f"--methods: unknown method {m!r}; accepted: {', '.join(recipes)}")
    ks = [int(k) for k in args.ks.split(",")]
    lrs = [float(x) for x in args.lrs.split(",")]
    given: dict[str, float] = {}
    for item in (args.lr or "").split(","):
        m, eq, lr = item.partition("=")
        if not item:
            continue
        if not eq or m not in methods:
            p.error(f"--lr: {item!r} is not METHOD=LR with METHOD one of --methods ({', '.join(methods)})")
        try:
            given[m] = float(lr)
        except ValueError:
            p.error(f"--lr: {item!r}: the lr must be a number")
    if args.lr is not None and set(given) != set(methods):
        p.error(f"--lr: give every method of --methods an lr; missing: {', '.join(m for m in methods if m not in given)}")
    if given:
        lrs = sorted(set(given.values()))

    def recipe(method: str, k: int, lr: float, seed: int):
        path, extra = recipes[method]
        r = load_recipe(path, [*args.set, *extra, f"dora.max_staleness={k}", f"trainer.lr={lr}"]).with_mode("dora")
        return (r.with_steps(args.steps) if args.steps else r).with_seed(seed)

    os.makedirs(args.out, exist_ok=True)
    bar = Progress(not args.no_progress)
    t0 = time.perf_counter()
    first = recipe(methods[0], args.sweep_k, lrs[0], 0)
    sweep = {} if given else {"k": args.sweep_k, "seed": 0}
    out: dict = {"definition": DEFINITION, "methods": {m: recipes[m][0].rsplit(os.sep, 1)[-1] + (
        f" + {' '.join(recipes[m][1])}" if recipes[m][1] else "") for m in methods},
        "steps": first.steps, "ks": ks, "lrs": lrs, "sweep": sweep,
        "seeds": args.seeds, "window": args.window, "overrides": args.set,
        "eval": {"prompts": first.eval.prompts, "samples": first.eval.samples},
        "sweep_final_reward": {m: {} for m in methods}, "sweep_runs": {m: {} for m in methods},
        "best_lr": dict(given), "results": {m: {} for m in methods},
        "not_run": []}
    if given:
        out["best_lr_from"] = "given with --lr (not swept in this run)"
    done: dict = {}  # (method, k, lr, seed) -> record
    runs: dict = {}  # the same keys -> RunResult, for the runs of this invocation (the plots)
    path = os.path.join(args.out, "sao_vs_grpo.json")
    if args.resume and os.path.exists(path):
        with open(path) as f:
            prev = json.load(f)
        for key in ("steps", "window", "overrides", "eval"):
            if prev.get(key) != out[key]:
                p.error(f"--resume: {path} has {key}={prev.get(key)!r}, this run {out[key]!r}; accepted: the same")
        for m, by_lr in prev.get("sweep_runs", {}).items():
            for lr, c in by_lr.items():
                done.update({(m, args.sweep_k, float(lr), rec["seeds"]): rec for rec in records_of(c)})
        for m, by_k in prev.get("results", {}).items():
            for k, c in by_k.items():
                done.update({(m, int(k[2:]), c["lr"], rec["seeds"]): rec for rec in records_of(c)})
        out["resumed"] = len(done)

    def go(method: str, k: int, lr: float, seed: int) -> dict:
        key = (method, k, lr, seed)
        if key not in done:
            r = recipe(method, k, lr, seed)
            try:
                runs[key] = run(r, prepare(r), on_step=bar.start(f"{method} K={k} lr={lr:g} seed {seed}", r.steps))
            finally:
                bar.close()
            done[key] = record(runs[key], args.window)
        return done[key]

    def save() -> None:
        planned = [f"{m} K={k} seed {s}" for m in methods for k in ks for s in range(args.seeds)]
        got = {f"{m} K={k} seed {s}" for (m, k, lr, s) in done if out["best_lr"].get(m) == lr}
        out["not_run"] = [c for c in planned if c not in got]
        out["wall_s"] = time.perf_counter() - t0
        dump_json(path, out)

    for lr in [] if given else sorted(lrs, reverse=True):  # the sweep: same lrs, seed 0, K = sweep_k; the largest lr first
        for m in methods:
            out["sweep_final_reward"][m][f"{lr:g}"] = go(m, args.sweep_k, lr, 0)["final_reward"]
            out["sweep_runs"][m][f"{lr:g}"] = summary([done[(m, args.sweep_k, lr, 0)]])
            save()
    for m in [] if given else methods:
        out["best_lr"][m] = max(lrs, key=lambda lr: out["sweep_final_reward"][m][f"{lr:g}"])
    for seed in range(args.seeds):  # seed-major: a partial run has every cell's first seeds
        for k in ks:
            for m in methods:
                go(m, k, out["best_lr"][m], seed)
                lr = out["best_lr"][m]
                recs = [done[(m, k, lr, s)] for s in range(args.seeds) if (m, k, lr, s) in done]
                out["results"][m][f"K={k}"] = {"lr": lr, **summary(recs)}
                save()
    from dora_ext.runtime.report import plot_reward_vs_time

    for k in ks:
        res = {m: [runs[(m, k, out["best_lr"][m], s)] for s in range(args.seeds)
                   if (m, k, out["best_lr"][m], s) in runs] for m in methods}
        if not any(res.values()):
            continue
        plot_reward_vs_time(res, os.path.join(args.out, f"reward_vs_time_k{k}.png"), window=args.window,
                            title=f"GRPO, GRPO + SAO mask, SAO (n=1): dora K={k}, each at its best lr")
    for m in methods:
        for k in ks:
            c = out["results"][m][f"K={k}"]
            print(f"{m:>13} K={k} lr {c['lr']:g}: final {', '.join(f'{x:.3f}' for x in c['final_reward'])}; "
                  f"drop {', '.join(f'{x:.3f}' for x in c['max_drop'])}; entropy "
                  f"{', '.join(f'{x:.2f}' for x in c['final_entropy'])}; collapsed {c['collapsed']}", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

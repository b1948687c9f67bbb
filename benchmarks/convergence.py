"""Does dora train as well as sync? sync and dora (its default K, and K=1, K=2; and its default K
with each admission policy) over several seeds, with statistics.

    python benchmarks/convergence.py [--seeds 5] [--steps N] [--json] [--plot PATH] [--out DIR]
                                     [--admission POLICY] [--eval-repeats 4] [--dora-steps-factor F]
                                     [--modes sync,dora,...]
                                     [--set section.key=value ...]

For each seed every mode starts from the same warm-started version 0 on the same prompt stream;
only `dora.mode`, `dora.max_staleness` and `dora.admission` differ. The
order is ABBA-interleaved: even seeds run the modes in order, odd seeds in reverse, so that a load
drifting on a shared machine weighs on every mode alike. A mode whose config equals another's
(dora at its default K = dora_k2 when that K is 2; dora = dora_adaptive when it admits with
`adaptive`) is run once and reported under both names.

Reported per mode (`--json` prints it, `--out` also writes it):
- `final_reward`: held-out reward of the final policy per seed (the same prompts for every run);
  `final_reward_mean` and `final_reward_ci95`, the t-distribution's 95% interval of the mean;
- `time_to_target_s`: per seed, the wall time at which the run's training-batch reward (moving
  average over `--window` steps, full windows only) first reaches sync's mean final training
  reward (None = never; a run ends after its steps, so a mode that learns less per step may never
  get there however far ahead it was until then); `time_to_target_median_s` ranks never above
  any time (so it is None when half the seeds or more never reach it; low median for an even
  count), `time_to_target_reached` counts the seeds that reach it. Sync reaches its own mean
  final level in about half its seeds by construction: the target is where sync ends, not a
  level chosen for this comparison;
- `train_reward_at_equal_time`: per seed, the training-batch reward of the run's policies around
  `equal_time_s`, the latest policy time every mode of that seed reaches. Each batch counts at the
  time its generating version was published (a stale batch for the older policy that produced
  it), and the curve is averaged over the same span of time for every mode, `equal_time_span_s`
  (the `--window` step intervals of sync's last batches), so neither staleness nor step length
  favours a mode to first order (what remains is the curve's curvature between batches: < 1e-3
  at this benchmark's density, tests/runtime/test_report_curves.py).
  `train_reward_at_equal_time_minus_sync` pairs it with sync's, `..._mean` averages the
  `..._seeds` seeds that have both;
- `staleness_mean`: the mean over seeds of each run's mean trained staleness, counted from the
  versions of the groups the trainer trained (the runtime's ledger, not the config);
- `tokens_per_s` (mean over seeds), per seed, and `tokens_per_s_ratio_to_sync`: the paired
  per-seed ratios to sync (side by side on one seed, ABBA), and their median;
- `c1_ok`, `c2_ok`, `c3_ok`: the runtime's own checks, over every run.
`eval_noise_sd`: the standard deviation of `--eval-repeats` evaluations of one final policy (seed
0's sync run) with different sampling seeds: the part of a final reward that is measurement.
Equal steps and equal time (`--dora-steps-factor F`, F > 1): the dora modes run F x `--steps`
steps (`dora_steps`; sync runs `--steps`) and keep their versions; each is then read twice:
`final_reward` (and its mean and interval) is the held-out reward of its version at `--steps` steps,
the equal-step comparison, and `reward_at_sync_end` that of the newest version it had published
when the seed's sync run published its final one, the equal-time comparison (`_mean`, `_ci95`,
`_minus_sync` paired per seed and its `_mean`, `version_at_sync_end`, `covers_sync_end`: False if
the run ended sooner, F too small, so its last version stands in). `final_reward_last` is the
held-out reward at its last step, `steps_run` its steps. Both are evaluated as the runtime evaluates
a final policy (the same prompts and sampling seeds). A version at `--steps` of a longer run trained
like one that ends there, except the last few batches, which the end of a run drains with less
staleness. `time_to_target_s`, `final_train_reward`, `wall_s`, throughput (the runtime's middle 60%
of the run: a longer window than sync's) and staleness then come from the longer runs;
`time_to_target_reached_by_sync_end` counts only the seeds that reached the target by the time
their sync run ended.
`dora_fill`, `dora_ahead`, `dora_adaptive`: dora at its default K with `admission: fill` (R2
alone), `ahead` and `adaptive`. `dora` and the K modes admit with `--admission`, else with the
recipe's own policy, else the mode's default (`adaptive`); each mode's `admission` names the policy
it ran. The variant that equals `dora` is not run twice and gets no ratio; to each other one `dora`
gets `tokens_per_s_ratio_to_fill` (`_ahead`, `_adaptive`: paired per seed), its mean and median.
`decode_shape`: `cpu`, or `gpu-shaped` with `--set engine.step_s=S` (a decode iteration lasts at
least S seconds, idle, as memory-bound GPU decode; recipe.py's `EngineSpec`).
Throughput on a machine shared with other jobs is noisy: only ratios of runs side by side mean
anything. Nothing is asserted; the plot (`--plot`) is reward against wall time, every seed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Sequence

# Two-sided 95% quantiles of Student's t by degrees of freedom (1..30); beyond: the normal's.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError(f"df: expected >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.960


def ci95(xs: Sequence[float]) -> list[float] | None:
    """[low, high]: mean -/+ t(0.975, n-1) * sd / sqrt(n); None for fewer than 2 values."""
    if len(xs) < 2:
        return None
    m, half = statistics.mean(xs), t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return [m - half, m + half]


def median_or_none(xs: Sequence[float | None]) -> float | None:
    """The median with None (never reached) ranked above every time; None if that is where it falls."""
    m = statistics.median_low([math.inf if x is None else x for x in xs]) if xs else math.inf
    return None if m == math.inf else m


def final_train_reward(run: Any, window: int) -> float:
    """The mean training-batch reward of the run's last `window` steps (where it ends)."""
    from dora_ext.runtime.report import smoothed

    return smoothed([s["reward_mean"] for s in run.steps], window)[-1]


def equal_times(results: dict[str, list[Any]]) -> list[float]:
    """Per seed, the latest policy time that every mode's curve reaches (`policy_rewards`: the
    publication time of the version behind its last batch)."""
    from dora_ext.runtime.report import policy_rewards

    n = min(len(runs) for runs in results.values())
    return [min(policy_rewards(runs[i])[-1][0] if runs[i].steps else 0.0 for runs in results.values())
            for i in range(n)]


def equal_span(sync_run: Any, t: float, window: int) -> float | None:
    """The policy time that sync's last `window` step intervals up to `t` cover (between its batch
    `window` before the last and its last): every mode's reward at `t` averages its curve over
    that same span (None if sync has `window` batches or fewer by then)."""
    from dora_ext.runtime.report import policy_rewards

    times = [x for x, _ in policy_rewards(sync_run) if x <= t]
    return times[-1] - times[-1 - window] if len(times) > window else None


def version_at(run: Any, t: float) -> int:
    """The newest version of `run` published at or before wall time `t` (`published_times`)."""
    from dora_ext.runtime.report import published_times

    return max(v for v, when in published_times(run).items() if when <= t)


def held_out(recipe: Any, prepared: Any, weights: dict, seed_offset: int = 0) -> float:
    """The held-out reward of `weights`, evaluated as the runtime evaluates a run's final policy
    (`seed_offset` 0: the same sampling seeds)."""
    from dora_ext.engines import default_device
    from dora_ext.runtime.runtime import evaluate_policy, torch_threads

    dev = default_device(recipe.engine.device)
    with torch_threads(recipe.runtime.threads(recipe.runtime.cores)):
        return evaluate_policy(prepared.task, prepared.model_config, weights, prepared.eval_prompts, recipe, dev,
                               seed_offset=seed_offset)


def read_longer_run(run: Any, recipe: Any, prepared: Any, steps: int, sync_end_s: float) -> None:
    """A run longer than `steps` steps (`--dora-steps-factor`), its versions kept: its held-out
    reward at `steps` steps (`final_reward_at_steps`, the equal-step comparison) and of the policy
    it had at `sync_end_s`, when sync published its final version (`reward_at_sync_end`, the
    equal-time one), into its metrics; then its versions are dropped."""
    if len(run.steps) < steps:
        raise ValueError(f"run: expected >= {steps} steps (--steps), got {len(run.steps)}")
    known = {len(run.steps): run.metrics["final_reward"]}  # the runtime evaluated its last version

    def reward_of(version: int) -> float:
        if version not in known:
            known[version] = held_out(recipe, prepared, run.versions[version])
        return known[version]

    v = version_at(run, sync_end_s)
    run.metrics["final_reward_at_steps"] = reward_of(steps)
    run.metrics["reward_at_sync_end"] = reward_of(v)
    run.metrics["version_at_sync_end"] = v
    # False: the run ended before sync's end time, so its last policy stands in (a factor too small)
    run.metrics["covers_sync_end"] = run.steps[-1]["time_s"] >= sync_end_s
    run.versions = None


def summarise(runs: list[Any], sync_runs: list[Any], target: float, window: int,
              at_times: Sequence[float] | None = None) -> dict[str, Any]:
    """One mode's entry of the JSON from its runs (one per seed, in seed order, paired with
    `sync_runs` by position). `at_times`: per seed, the wall time of `train_reward_at_equal_time`."""
    from dora_ext.runtime.report import mean_over, policy_rewards, time_to_reward

    final = [r.metrics.get("final_reward_at_steps", r.metrics["final_reward"]) for r in runs]
    tps = [r.metrics["throughput_tokens_per_s"] for r in runs]
    ratio = [a / b for a, b in zip(tps, (s.metrics["throughput_tokens_per_s"] for s in sync_runs))]
    reach = [time_to_reward(r, target, window) for r in runs]
    # reached by the time the seed's sync run ended (a longer run can reach it only later)
    reach_in = [None if t is None or t > s.metrics["wall_s"] else t for t, s in zip(reach, sync_runs)]
    at_times = list(at_times) if at_times is not None else []
    spans = [equal_span(s, t, window) for s, t in zip(sync_runs, at_times)]

    def at(rs: list[Any]) -> list[float | None]:
        return [None if span is None else mean_over(policy_rewards(r), t - span, t)
                for r, t, span in zip(rs, at_times, spans)]

    mine = at(runs)
    diff = [None if a is None or b is None else a - b for a, b in zip(mine, at(sync_runs))]
    known = [d for d in diff if d is not None]
    longer = {}
    if any("reward_at_sync_end" in r.metrics for r in runs):
        at_end = [r.metrics["reward_at_sync_end"] for r in runs]
        longer = {
            "steps_run": [len(r.steps) for r in runs],
            "final_reward_last": [r.metrics["final_reward"] for r in runs],
            "reward_at_sync_end": at_end,
            "reward_at_sync_end_mean": statistics.mean(at_end),
            "reward_at_sync_end_ci95": ci95(at_end),
            # sync's policy at its own end is its final one
            "reward_at_sync_end_minus_sync": [a - s.metrics["final_reward"] for a, s in zip(at_end, sync_runs)],
            "version_at_sync_end": [r.metrics["version_at_sync_end"] for r in runs],
            "covers_sync_end": [r.metrics["covers_sync_end"] for r in runs],
        }
        longer["reward_at_sync_end_minus_sync_mean"] = statistics.mean(longer["reward_at_sync_end_minus_sync"])
    return {
        "max_staleness": runs[0].max_staleness,
        "seeds": [r.seed for r in runs],
        "final_reward": final,
        "final_reward_mean": statistics.mean(final),
        "final_reward_sd": statistics.stdev(final) if len(final) > 1 else None,
        "final_reward_ci95": ci95(final),
        "initial_reward": [r.metrics["initial_reward"] for r in runs],
        "final_train_reward": [final_train_reward(r, window) for r in runs],
        "time_to_target_s": reach,
        "time_to_target_median_s": median_or_none(reach),
        "time_to_target_reached": sum(x is not None for x in reach),
        "time_to_target_reached_by_sync_end": sum(x is not None for x in reach_in),
        "wall_s": [r.metrics["wall_s"] for r in runs],
        "equal_time_s": at_times,
        "equal_time_span_s": spans,
        "train_reward_at_equal_time": mine,
        "train_reward_at_equal_time_minus_sync": diff,
        "train_reward_at_equal_time_minus_sync_mean": statistics.mean(known) if known else None,
        "train_reward_at_equal_time_seeds": len(known),
        "staleness_mean": statistics.mean(r.metrics["staleness_mean"] for r in runs),
        "staleness_mean_per_seed": [r.metrics["staleness_mean"] for r in runs],
        "staleness_hist": _sum_hists(r.metrics["staleness_hist"] for r in runs),
        "tokens_per_s": statistics.mean(tps),
        "tokens_per_s_per_seed": tps,
        "tokens_per_s_ratio_to_sync": ratio,
        "tokens_per_s_ratio_to_sync_median": statistics.median(ratio),
        "trainer_wait_ratio": statistics.mean(r.metrics["trainer_wait_ratio"] for r in runs),
        "c1_ok": all(r.metrics["c1_ok"] for r in runs),
        "c2_ok": all(r.metrics["c2_ok"] for r in runs),
        "c3_ok": all(r.metrics["c3_ok"] for r in runs),
        **longer,
    }


def _sum_hists(hists: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for h in hists:
        for k, v in h.items():
            out[str(k)] = out.get(str(k), 0) + v
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def eval_noise(recipe: Any, prepared: Any, weights: dict, repeats: int) -> list[float]:
    """`repeats` held-out evaluations of `weights`, each with other sampling seeds."""
    return [held_out(recipe, prepared, weights, seed_offset=1_000_003 * (i + 1)) for i in range(repeats)]


#: every mode this benchmark can run (`--modes`), in the order it reports them
MODES = ("sync", "dora", "dora_k1", "dora_k2", "dora_fill", "dora_ahead", "dora_adaptive")
#: the modes that are dora at its default K with a given `admission` policy (one of them is dora's own)
ADMISSION_MODES = {"dora_fill": "fill", "dora_ahead": "ahead", "dora_adaptive": "adaptive"}


def main(argv: list[str] | None = None) -> int:
    from dora_ext.config import ADMISSIONS, DEFAULT_STALENESS

    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=os.path.join(here, "..", "recipes", "cpu", "long-tail.yaml"))
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=None, help="trainer steps per run (default: the recipe's)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe value for every mode (repeatable)")
    p.add_argument("--admission", default=None, choices=ADMISSIONS,
                   help="dora.admission of dora and the K modes (default: the recipe's, else adaptive)")
    p.add_argument("--dora-steps-factor", type=float, default=1.0, metavar="F",
                   help="the dora modes run F x --steps steps (sync: --steps), read at --steps steps and at "
                        "sync's end time (default 1: every mode runs --steps)")
    p.add_argument("--modes", default=None, metavar="M,M,...",
                   help=f"run only these of {', '.join(MODES)} (sync, the reference, always runs; default: all)")
    p.add_argument("--window", type=int, default=20, help="moving-average window of the training reward (steps)")
    p.add_argument("--eval-repeats", type=int, default=4, help="evaluations of one policy for eval_noise_sd")
    p.add_argument("--json", action="store_true", help="print the JSON object (else a short table)")
    p.add_argument("--out", default=None, help="also write convergence.json there")
    p.add_argument("--plot", default=None, help="reward-vs-wall-time PNG (every seed)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if not (math.isfinite(args.dora_steps_factor) and args.dora_steps_factor >= 1.0):
        p.error(f"--dora-steps-factor: expected a number >= 1, got {args.dora_steps_factor}")

    from dora_ext.runtime import load_recipe, prepare, run
    from dora_ext.runtime.compare import Progress, jsonable

    base = load_recipe(args.recipe, args.set)
    if args.steps:
        base = base.with_steps(args.steps)
    default_k = DEFAULT_STALENESS["dora"]
    dora_steps = math.ceil(base.steps * args.dora_steps_factor)
    longer = dora_steps > base.steps

    # the policy dora and the K modes run, made explicit: a recipe without the key runs the same
    # config as `adaptive` (dora_adaptive), and the two are run once
    own = args.admission or base.with_mode("dora").dora.admission_policy

    def dora(k: int, admission: str) -> Any:
        return load_recipe(args.recipe, [*args.set, f"dora.max_staleness={k}", f"dora.admission={admission}"]
                           ).with_steps(dora_steps).with_mode("dora")

    variants = {"sync": base.with_mode("sync"), "dora": dora(default_k, own),
                "dora_k1": dora(1, own), "dora_k2": dora(2, own)}
    variants.update({m: dora(default_k, pol) for m, pol in ADMISSION_MODES.items()})
    notes = []
    if args.modes:
        wanted = [m.strip() for m in args.modes.split(",") if m.strip()]
        unknown = [m for m in wanted if m not in MODES]
        if unknown:
            p.error(f"--modes: unknown {', '.join(unknown)}; accepted: {', '.join(MODES)}")
        left_out = [m for m in variants if m != "sync" and m not in wanted]
        variants = {m: r for m, r in variants.items() if m not in left_out}
        if left_out:
            notes.append(f"not run (--modes): {', '.join(left_out)}")
    # a variant whose config equals an earlier one's is run once and reported under both names
    same: dict[str, str] = {}
    for name, r in variants.items():
        for other in variants:
            if other == name:
                break
            if other not in same and variants[other].to_dict() == r.to_dict():
                same[name] = other
                break
    labels = [m for m in variants if m not in same]
    for name, other in same.items():
        notes.append(f"{name} is the same config as {other}: the same runs")

    seeds = list(range(base.seed, base.seed + args.seeds))
    results: dict[str, list] = {m: [] for m in labels}
    orders = []
    noise: list[float] = []
    bar = Progress(not args.no_progress)
    t_start = time.perf_counter()
    load_before = os.getloadavg()

    def summary() -> dict[str, Any]:
        target = statistics.mean(final_train_reward(r, args.window) for r in results["sync"])
        at_times = equal_times(results)
        modes = {m: {"admission": None if m == "sync" else variants[m].dora.admission_policy,
                     **summarise(results[m], results["sync"], target, args.window, at_times)} for m in labels}
        for name, other in same.items():
            modes[name] = modes[other]
        for other, pol in ADMISSION_MODES.items():
            if other in modes and "dora" in modes and other not in same:
                modes["dora"][f"tokens_per_s_ratio_to_{pol}"] = r = [
                    a / b for a, b in zip(modes["dora"]["tokens_per_s_per_seed"],
                                          modes[other]["tokens_per_s_per_seed"])]
                modes["dora"][f"tokens_per_s_ratio_to_{pol}_mean"] = statistics.mean(r)
                modes["dora"][f"tokens_per_s_ratio_to_{pol}_median"] = statistics.median(r)
        return {
            "default_k": default_k,
            "modes": {m: modes[m] for m in variants},
            "target_train_reward": target,
            "eval_noise_sd": statistics.stdev(noise) if len(noise) > 1 else None,
            "eval_repeats": noise,
            "eval": {"prompts": base.eval.prompts, "samples": base.eval.samples},
            "recipe": base.name, "steps": base.steps, "dora_steps": dora_steps,
            "dora_steps_factor": args.dora_steps_factor, "seeds": seeds[:len(orders)], "window": args.window,
            "overrides": args.set, "admission": args.admission,
            "decode_shape": base.engine.decode_shape, "step_s": base.engine.step_s,
            "order_per_seed": orders, "notes": notes,
            "load_average_before_after": [load_before, os.getloadavg()],
            "wall_s": time.perf_counter() - t_start,
        }

    for i, seed in enumerate(seeds):
        order = labels if i % 2 == 0 else labels[::-1]
        prepared = prepare(base.with_seed(seed))
        for label in order:
            r = variants[label].with_seed(seed)
            noise_here = i == 0 and label == "sync" and args.eval_repeats > 1
            keep = noise_here or (longer and label != "sync")
            try:
                res = run(r, prepared, keep_versions=keep, on_step=bar.start(f"{label:>9} seed {seed}", r.steps))
            finally:
                bar.close()
            if noise_here:
                noise = eval_noise(r, prepared, res.versions[max(res.versions)], args.eval_repeats)
                res.versions = None
            results[label].append(res)
        if longer:  # read once the seed's sync run (first or last, ABBA) has set the end time
            sync_end = results["sync"][-1].steps[-1]["time_s"]
            for label in labels:
                if label != "sync":
                    read_longer_run(results[label][-1], variants[label].with_seed(seed), prepared, base.steps,
                                    sync_end)
        orders.append(order)
        if args.out:  # after every seed, so that a run cut short keeps its complete seeds
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "convergence.json"), "w", encoding="utf-8") as fh:
                json.dump(jsonable(summary()), fh, indent=2)
                fh.write("\n")
        if args.plot:
            from dora_ext.runtime.report import plot_reward_vs_time

            plot_reward_vs_time(results, args.plot, window=args.window,
                                title=f"{base.name}: {len(orders)} seeds, {base.steps} steps"
                                + (f" (dora modes {dora_steps})" if longer else "") + ", every seed")
    out = summary()
    target = out["target_train_reward"]
    modes = out["modes"]
    if args.json:
        print(json.dumps(jsonable(out)))
    else:
        for m in variants:
            a = modes[m]
            lo, hi = a["final_reward_ci95"] or (float("nan"), float("nan"))
            print(f"{m:>9}: final {a['final_reward_mean']:.3f} [{lo:.3f}, {hi:.3f}], time to {target:.3f} "
                  f"median {a['time_to_target_median_s']}, staleness {a['staleness_mean']:.2f}, "
                  f"x{a['tokens_per_s_ratio_to_sync_median']:.2f} sync, C1-C3 {a['c1_ok']}/{a['c2_ok']}/{a['c3_ok']}"
                  + (f", at sync's end time {a['reward_at_sync_end_mean']:.3f}" if "reward_at_sync_end" in a else ""))
        print(f"eval noise sd {out['eval_noise_sd']}; " + "; ".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())

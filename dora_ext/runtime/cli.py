"""`dora-ext train` and `dora-ext compare`: the embedded runtime from the command line.

    dora-ext train RECIPE [--mode M] [--steps N] [--seed S] [--out DIR] [--set section.key=value ...]
                          [--checkpoint-every N]
    dora-ext train --resume DIR        continue a run that broke (or was killed) from its last checkpoint
    dora-ext compare RECIPE --modes sync,dora[,...] [--seeds K] [--steps N] [--seed S] [--json] [--out DIR]

`train` runs one mode, writing `metrics.jsonl` (one line per trainer step), `report.json` (also
printed), `reward.png` and `timeline.png`. `compare` runs the modes on the same seeds and prints a
table, or with `--json` `{"recipe": ..., "modes": {MODE: {throughput_tokens_per_s,
speedup_vs_sync, final_reward_mean, final_reward_std, staleness_max, c1_ok, c2_ok, c3_ok}}}`;
its files go to `--out` (default `runs/<recipe>-compare`). No torch import until a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..config import MODES, ConfigError


def register(subparsers: Any) -> None:
    t = subparsers.add_parser("train", help="train with the embedded runtime (real engines, real trainer)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("recipe", nargs="?", default=None, help="recipe YAML, e.g. recipes/cpu/long-tail.yaml")
    t.add_argument("--mode", choices=MODES, default=None, help="override the recipe's dora.mode")
    t.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="write a checkpoint every N trainer steps to OUT/checkpoint (0 = never; default 50, "
                        "or with --resume the interval the run started with)")
    t.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run whose output folder is DIR from its last checkpoint "
                        "(model, optimizer, prompt stream, scheduler; in-flight work re-issued at its version)")
    t.add_argument("--steps", type=int, default=None, help="trainer steps (default: the recipe's)")
    t.add_argument("--seed", type=int, default=None, help="seed (default: the recipe's)")
    t.add_argument("--out", default=None, help="output folder (default: runs/<recipe>-<mode>)")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe value, e.g. --set dora.capacity=16 (repeatable)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)

    c = subparsers.add_parser("compare", help="run modes side by side on the same seeds (real engines)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("recipe", help="recipe YAML, e.g. recipes/cpu/long-tail.yaml")
    c.add_argument("--modes", default="sync,dora", help=f"comma-separated modes (default sync,dora; any of {','.join(MODES)})")
    c.add_argument("--seeds", type=int, default=1, help="number of seeds, starting at --seed (default 1)")
    c.add_argument("--seed", type=int, default=None, help="first seed (default: the recipe's)")
    c.add_argument("--steps", type=int, default=None, help="trainer steps per run (default: the recipe's)")
    c.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    c.add_argument("--out", default=None, help="output folder (default: runs/<recipe>-compare)")
    c.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe value, e.g. --set dora.capacity=16 (repeatable)")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_compare)


def _recipe(args: argparse.Namespace) -> Any:
    from .recipe import load_recipe

    return _adjusted(load_recipe(args.recipe, args.set), getattr(args, "mode", None), args.steps, args.seed)


def _adjusted(recipe: Any, mode: str | None, steps: int | None, seed: int | None) -> Any:
    """`recipe` with the command line's mode, steps and seed, where given."""
    if mode:
        recipe = recipe.with_mode(mode)
    if steps is not None:
        recipe = recipe.with_steps(steps)
    if seed is not None:
        recipe = recipe.with_seed(seed)
    return recipe


def _fail(command: str, exc: Exception) -> int:
    kind = "recipe error" if isinstance(exc, ConfigError) else "error"
    print(f"dora-ext {command}: {kind}: {exc}", file=sys.stderr)
    return 2 if isinstance(exc, ConfigError) else 1


def _run_spec(args: argparse.Namespace) -> dict:
    """What `--resume` needs to rebuild the recipe: the recipe's data with the overrides applied,
    and the command line's mode, steps and seed."""
    import yaml

    from .recipe import apply_overrides

    with open(args.recipe, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    return {"recipe_path": args.recipe, "recipe_data": apply_overrides(data, args.set), "mode": args.mode,
            "steps": args.steps, "seed": args.seed}


def _resumed_recipe(spec: dict) -> Any:
    from .recipe import recipe_from_dict

    path = spec["recipe_path"]
    recipe = recipe_from_dict(spec["recipe_data"], path=path,
                              default_name=os.path.splitext(os.path.basename(path))[0])
    return _adjusted(recipe, spec["mode"], spec["steps"], spec["seed"])


def cmd_train(args: argparse.Namespace) -> int:
    resume = args.resume is not None
    try:
        if resume:
            if args.recipe or args.set or args.mode or args.steps is not None or args.seed is not None:
                raise ConfigError("--resume", "takes the run's folder only; the recipe, mode, steps and seed "
                                  "are the ones the run started with (OUT/run.json)")
            spec_path = os.path.join(args.resume, "run.json")
            if not os.path.exists(spec_path):
                raise ConfigError("--resume", f"{args.resume} is not a run folder of dora-ext train (no run.json)")
            with open(spec_path, encoding="utf-8") as fh:
                spec = json.load(fh)
            recipe = _resumed_recipe(spec)
            out = args.resume
            every = spec.get("checkpoint_every", 50) if args.checkpoint_every is None else args.checkpoint_every
        else:
            if not args.recipe:
                raise ConfigError("recipe", "give a recipe YAML file, or --resume DIR")
            recipe = _recipe(args)
            spec = _run_spec(args)
            out = args.out or os.path.join("runs", f"{recipe.name}-{recipe.dora.mode}")
            every = 50 if args.checkpoint_every is None else args.checkpoint_every
            spec["checkpoint_every"] = every
        if every < 0:
            raise ConfigError("--checkpoint-every", f"expected an integer >= 0, got {every}")
    except ConfigError as exc:
        return _fail("train", exc)
    from .compare import Progress, dump_json, jsonable
    from .report import plot_rewards, plot_timeline
    from .runtime import Runtime, WorkerDied, prepare

    mode = recipe.dora.mode
    os.makedirs(out, exist_ok=True)
    ckpt_dir = os.path.join(out, "checkpoint")
    if not resume:
        dump_json(os.path.join(out, "run.json"), spec)
    try:
        prepared = prepare(recipe)
    except ImportError as exc:  # e.g. the optional SmolLM2 weights
        return _fail("train", exc)
    metrics_path = os.path.join(out, "metrics.jsonl")
    try:
        runtime = Runtime(recipe, prepared, checkpoint_dir=ckpt_dir, checkpoint_every=every,
                          resume=resume,
                          on_checkpoint=lambda v: print(f"checkpoint: version {v} in {ckpt_dir}", file=sys.stderr,
                                                        flush=True))
    except (FileNotFoundError, ValueError) as exc:
        return _fail("train", exc)
    start = f"resumed at step {runtime.resumed_from}" if resume else (
        f"version 0 after {recipe.warm_start.steps} warm-start steps ({prepared.warm_start_s:.1f}s)")
    print(f"dora-ext train: {recipe.name}, mode {mode} (K={recipe.dora.max_staleness}), seed {recipe.seed}, "
          f"{recipe.steps} steps; {start}, held-out reward {prepared.initial_reward:.3f}", file=sys.stderr,
          flush=True)
    bar = Progress(not args.no_progress)
    show = bar.start(f"{mode} seed {recipe.seed}", recipe.steps)
    with open(metrics_path, "w", encoding="utf-8") as fh:
        for rec in runtime.step_records:  # a resumed run keeps the lines up to its checkpoint
            fh.write(json.dumps(jsonable(rec)) + "\n")

        def on_step(rec: dict) -> None:
            fh.write(json.dumps(jsonable(rec)) + "\n")
            fh.flush()
            show(rec)

        runtime.on_step = on_step
        try:
            result = runtime.run()
        except WorkerDied as exc:
            bar.close()
            print(f"dora-ext train: error: {exc}", file=sys.stderr)
            return 1
        finally:
            bar.close()
    report = {"recipe": recipe.to_dict(), **result.summary(), "steps": result.steps,
              "resumed_from": runtime.resumed_from,
              "ledger": {"admitted": sorted(result.ledger["prompts"]),
                         "trained": {str(g): s for g, s in sorted(result.ledger["trained"].items())},
                         "failed": [[str(g), r] for g, r in runtime.failed_groups],
                         "failed_instances": {str(i): c for i, c in runtime.failed_instances.items()},
                         "instance_restarts": [list(r) for r in runtime.instance_restarts]}}
    for dead, new in runtime.instance_restarts:
        print(f"dora-ext train: instance {dead} exited (exit code {runtime.failed_instances.get(dead)}); "
              f"instance {new} took its place", file=sys.stderr)
    dump_json(os.path.join(out, "report.json"), report)
    plot_rewards({mode: [result]}, os.path.join(out, "reward.png"), title=f"{recipe.name}: {mode}, seed {recipe.seed}")
    plot_timeline({mode: result}, os.path.join(out, "timeline.png"), title=f"{recipe.name}: {mode}, seed {recipe.seed}")
    print(format_report(recipe.name, result))
    print(f"files: {metrics_path}, {os.path.join(out, 'report.json')}, {os.path.join(out, 'reward.png')}, "
          f"{os.path.join(out, 'timeline.png')}")
    return 0


def format_report(name: str, result: Any) -> str:
    m = result.metrics
    w0, w1 = m["window_steps"]
    last = m["train_reward_last"]
    lines = [
        f"{name}: mode {result.mode} (K={result.max_staleness}, cores {result.split}), seed {result.seed}, "
        f"{m['steps']} steps in {m['wall_s']:.1f}s",
        f"  throughput             {m['throughput_tokens_per_s']:.0f} trained tokens/s (steps {w0}..{w1 - 1})",
        f"  reward                 held-out {m['initial_reward']:.3f} -> {m['final_reward']:.3f}"
        + (f"; last training batches {last:.3f}" if last is not None else ""),
        f"  trainer wait ratio     {m['trainer_wait_ratio']:.2f}; rollout bubble ratio {m['rollout_bubble_ratio']:.2f}",
        f"  staleness              max {m['staleness_max']}, mean {m['staleness_mean']:.2f}; live versions max "
        f"{m['live_versions_max']}; migrations {m['migrations']} ({m.get('migrations_landed', 0)} landed); "
        f"weight loads {m['weight_loads']} "
        f"({m['weight_load_s'] * 1e3:.0f} ms)",
        f"  multi-version trajectories {m['multi_version_trajectory_share']:.1%}; dropped {m['dropped']}, "
        f"truncated {m['truncated']}, duplicated {m['duplicated']}",
        f"  C1 {'yes' if m['c1_ok'] else 'NO'}   C2 {'yes' if m['c2_ok'] else 'NO'}   C3 {'yes' if m['c3_ok'] else 'NO'}",
    ]
    return "\n".join(lines)


def cmd_compare(args: argparse.Namespace) -> int:
    from .compare import parse_modes

    try:
        recipe = _recipe(args)
        modes = parse_modes(args.modes)
        if args.seeds < 1:
            raise ConfigError("seeds", f"expected an integer >= 1, got {args.seeds}")
    except ConfigError as exc:
        return _fail("compare", exc)
    from .compare import compare_modes, dump_json
    from .report import aggregate, json_view, plot_reward_vs_time, plot_rewards, plot_timeline, table

    out = args.out or os.path.join("runs", f"{recipe.name}-compare")
    os.makedirs(out, exist_ok=True)
    seeds = list(range(recipe.seed, recipe.seed + args.seeds))
    try:
        results = compare_modes(recipe, modes, seeds, progress=not args.no_progress, out_dir=out)
    except ImportError as exc:
        return _fail("compare", exc)
    agg = aggregate(results)
    sync = {r.seed: r.metrics["throughput_tokens_per_s"] for r in results.get("sync", [])}
    for runs in results.values():
        for r in runs:
            if sync.get(r.seed):
                r.metrics["speedup_vs_sync"] = r.metrics["throughput_tokens_per_s"] / sync[r.seed]
    dump_json(os.path.join(out, "compare.json"), {
        **json_view(recipe.name, agg), "details": agg, "recipe_config": recipe.to_dict(),
        "runs": [r.summary() for runs in results.values() for r in runs],
    })
    title = f"{recipe.name}: {', '.join(modes)}; seeds {seeds[0]}..{seeds[-1]}, {recipe.steps} steps"
    rewards_png, timeline_png = os.path.join(out, "rewards.png"), os.path.join(out, "timeline.png")
    plot_rewards(results, rewards_png, title=title)
    time_png = os.path.join(out, "reward_vs_time.png")
    plot_reward_vs_time(results, time_png, title=title)
    plot_timeline({m: runs[0] for m, runs in results.items()}, timeline_png, title=f"{recipe.name}, seed {seeds[0]}")
    where = f"plots: {time_png}, {rewards_png}, {timeline_png}; data: {os.path.join(out, 'compare.json')}"
    if args.json:
        print(json.dumps(json_view(recipe.name, agg)))
        print(where, file=sys.stderr)
    else:
        print(table(agg))
        print(where)
    return 0

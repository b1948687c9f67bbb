"""`dora-ext simulate`: every mode side by side on a calibrated (or replayed) workload.

    dora-ext simulate --preset dapo-28k --modes sync,one_step_off,partial,pipeline,dora \
        --steps 20 --seed 0 [--max-staleness K] [--split R:T|auto] [--lengths FILE] [--json] [--plot FILE.png]
    dora-ext simulate --preset dapo-28k --recommend [--lengths FILE] [--max-staleness K] [--elastic] [--json]
    dora-ext simulate --list-presets
    dora-ext simulate --preset dapo-28k --host verl|slime|embedded|ideal[:field=value,...] ...

`--recommend` answers "which mode, K and split": for every mode and every K up to the staleness
budget (`--max-staleness`, default 2) it optimises the rollout:trainer split on full-length runs
and prints the choice with the highest efficiency that keeps C1-C3, the runner-up, and what each
costs. `--elastic` also evaluates elastic colocation (accelerators lent between the roles).

`--host` (default `ideal`, the presets' cost model alone) charges what a host's implementation
pays (see dora_ext/sim/hosts.py and docs/simulator.md).

Imports no torch: the simulator is pure Python; matplotlib is imported only for `--plot`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..config import ADMISSIONS, MODES, ConfigError

#: per-mode keys of `--json`
JSON_KEYS = (
    "throughput_tokens_per_s", "speedup_vs_sync", "efficiency", "trainer_wait_ratio",
    "rollout_bubble_ratio", "rollout_to_train_end_s", "staleness_max", "staleness_mean",
    "multi_version_trajectory_share", "dropped", "truncated", "duplicated", "c1_ok", "c2_ok",
    "c3_ok", "migrations", "weight_loads",
)
#: extra keys that say what was run (the ideal it is measured against, K, the split) and the
#: trained staleness's distribution (groups per `k - version`)
JSON_EXTRA = ("ideal_throughput", "max_staleness", "split", "staleness_hist")
#: added for a host other than `ideal` (whose output stays as it was before hosts existed)
JSON_HOST = ("trainer_weight_sync_s_per_step", "reprefilled_tokens", "preemptions",
             "preemption_recomputed_tokens")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="compare modes on a simulated cluster (discrete-event, real scheduler)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default=None, help="workload and hardware preset (see --list-presets)")
    p.add_argument("--list-presets", action="store_true", help="list the presets with their sources")
    p.add_argument("--lengths", metavar="FILE", help="replay response lengths: one integer per line or JSONL with response_length")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated modes (default: {','.join(MODES)})")
    p.add_argument("--steps", type=int, default=None, help="trainer steps per mode (default: the preset's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-staleness", type=int, default=None, metavar="K",
                   help="K for the modes that take one (partial, dora); sync/pipeline use 0, one_step_off 1")
    p.add_argument("--split", default=None, metavar="R:T|auto",
                   help="rollout:trainer accelerators of the asynchronous modes, or auto (best per mode)")
    p.add_argument("--instances", type=int, default=None, help="override the rollout instance count (scale runs)")
    p.add_argument("--recommend", action="store_true",
                   help="recommend mode, K (up to --max-staleness, default 2) and split for these lengths")
    p.add_argument("--elastic", action="store_true",
                   help="elastic colocation: lend accelerators between rollout and trainer (dora, pipeline)")
    p.add_argument("--admission", choices=ADMISSIONS, default=None,
                   help="admission policy of dora and partial (default: the mode's; docs/design.md, R2)")
    p.add_argument("--host", default=None, metavar="NAME[:field=value,...]",
                   help="host profile: ideal (default), verl, verl-gather, slime, embedded (dora_ext/sim/hosts.py)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--checkpoint", metavar="FILE", help="with --stop-after-events: write a checkpoint there (one mode)")
    p.add_argument("--stop-after-events", type=int, default=None, metavar="N",
                   help="stop after N scheduler events and write --checkpoint (one mode)")
    p.add_argument("--resume", metavar="FILE", help="continue a run from a --checkpoint file and print its result")
    p.add_argument("--plot", metavar="FILE.png", help="write a timeline plot (needs matplotlib)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..core import ProtocolError
    from . import PRESETS, SimError, WorkloadError, get_preset, load_lengths
    from .compare import compare
    from .hosts import get_host
    from .runner import parse_split

    if args.list_presets:
        print(list_presets(PRESETS))
        return 0
    if args.resume or args.checkpoint or args.stop_after_events is not None:
        return _stop_or_resume(args)
    try:
        if args.preset is None:
            raise WorkloadError(f"--preset: required; accepted: {', '.join(PRESETS)}")
        preset = get_preset(args.preset)
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise WorkloadError(f"--modes: unknown mode(s) {', '.join(bad) or '(none)'}; accepted: {', '.join(MODES)}")
        if args.steps is not None and args.steps < 1:
            raise WorkloadError(f"--steps: expected an integer >= 1, got {args.steps}")
        if args.max_staleness is not None and args.max_staleness < 0:
            raise WorkloadError(f"--max-staleness: expected an integer >= 0, got {args.max_staleness}")
        if args.instances is not None and args.instances < 1:
            raise WorkloadError(f"--instances: expected an integer >= 1, got {args.instances}")
        split = parse_split(args.split)
        host = get_host(args.host)
        records = load_lengths(args.lengths) if args.lengths else None
        if args.recommend:
            return _recommend(args, preset, modes, records, host)
        config = _config(args)
        if args.elastic:
            from .optimize import ELASTIC_MODES

            bad = [m for m in modes if m not in ELASTIC_MODES]
            if bad:
                raise WorkloadError(f"--elastic: mode(s) {', '.join(bad)} do not take it; accepted: {', '.join(ELASTIC_MODES)}")
        if args.instances is not None:
            from .runner import simulate

            results = {m: simulate(preset, m, steps=args.steps, seed=args.seed, max_staleness=args.max_staleness,
                                   split=split if isinstance(split, tuple) else None, records=records,
                                   instances=args.instances, timeline=bool(args.plot), config=config, host=host)
                       for m in modes}
            if "sync" in results:
                base = results["sync"].metrics["throughput_tokens_per_s"]
                for r in results.values():
                    r.metrics["speedup_vs_sync"] = r.metrics["throughput_tokens_per_s"] / base
        else:
            results = compare(preset, modes, steps=args.steps, seed=args.seed, max_staleness=args.max_staleness,
                              split=split, records=records, timeline=bool(args.plot), config=config, host=host)
    except (WorkloadError, ConfigError) as exc:
        print(f"dora-ext simulate: error: {exc}", file=sys.stderr)
        return 2
    except (SimError, ProtocolError) as exc:
        # A core bug, not a user error: say what happened so that it can be reported.
        print(f"dora-ext simulate: the scheduler misbehaved: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    steps = len(next(iter(results.values())).step_end)
    if args.json:
        print(json.dumps(to_json(preset.name, args.seed, steps, results), indent=2))
    else:
        print(format_table(preset.name, args.seed, steps, results))
    _warn_short(args, modes)
    if args.plot:
        from .plot import plot_timelines

        plot_timelines(results, args.plot, title=f"{preset.name}, seed {args.seed}, {steps} steps")
        if not args.json:
            print(f"timeline written to {args.plot}")
    return 0


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """The scheduler settings the flags give (`--elastic`, `--admission`), on every path that runs."""
    config: dict[str, Any] = {"elastic": True} if args.elastic else {}
    if args.admission:
        config["admission"] = args.admission
    return config


def _recommend(args: argparse.Namespace, preset: Any, modes: list[str], records: Any, host: Any) -> int:
    from .optimize import format_recommendation, recommend

    budget = 2 if args.max_staleness is None else args.max_staleness
    if args.split is not None:
        print("dora-ext simulate: error: --split: not with --recommend (the split is what it chooses)", file=sys.stderr)
        return 2
    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    rec = recommend(preset, max_staleness=budget, modes=modes, steps=args.steps, seed=args.seed,
                    records=records, elastic=args.elastic, progress=progress, host=host,
                    config={"admission": args.admission} if args.admission else None)
    if args.json:
        extra = {} if host.name == "ideal" else {"host": host.name, "weight_paths": weight_paths(preset, rec.pick)}
        print(json.dumps({"preset": preset.name, "seed": args.seed, "max_staleness_budget": budget,
                          **extra, **rec.to_json()}, indent=2))
    else:
        print(format_recommendation(rec, preset.name, budget))
        if host.name != "ideal":
            print(format_weight_paths(preset, rec.pick, host.name))
    return 0


def _warn_short(args: argparse.Namespace, modes: list[str]) -> None:
    """Too few steps for a steady state: the measured window may be a burst of groups trained back
    to back after a gating straggler, so throughput and efficiency can exceed the ideal."""
    from .runner import _staleness, min_steps

    need = max(min_steps(_staleness(m, args.max_staleness)) for m in modes)
    if args.steps is not None and args.steps < need:
        print(f"dora-ext simulate: note: --steps {args.steps} is fewer than {need}, the fewest whose "
              f"steady-state window measures a steady state here; throughput and efficiency may "
              f"exceed the ideal (use the default or --steps >= {need})", file=sys.stderr)


def to_json(preset: str, seed: int, steps: int, results: dict) -> dict[str, Any]:
    """The `--json` object (with `host` and `JSON_HOST` for a host but `ideal`)."""
    host = next(iter(results.values())).metrics.get("host", "ideal")
    keys = JSON_KEYS + JSON_EXTRA + (() if host == "ideal" else JSON_HOST)
    out = {"preset": preset, "seed": seed, "steps": steps}
    if host != "ideal":
        out["host"] = host
    out["modes"] = {m: {k: r.metrics[k] for k in keys} for m, r in results.items()}
    return out


def weight_paths(preset: Any, pick: Any) -> dict[str, dict[str, float]]:
    """What each host's weight path costs per step at the pick's weight loads per step: trainer
    seconds (publishing, and loads where the trainer sends them) and instance-seconds of loads."""
    from .hosts import HOSTS

    m = pick.metrics
    loads = m["weight_loads"] / max(1, len(pick.search.result.step_end))
    out = {}
    for name, h in HOSTS.items():
        load = h.load_s(preset)
        out[name] = {"trainer_s_per_step": h.publish_s(preset) + (load if h.load_on_trainer else 0.0) * (
            1 if pick.search.result.layout.colocated else loads), "load_s": load,
            "loads_per_step": loads, "instance_load_s_per_step": load * loads}
    return out


def format_weight_paths(preset: Any, pick: Any, host: str) -> str:
    lines = [f"  weight paths at the pick's {weight_paths(preset, pick)['ideal']['loads_per_step']:.1f} loads per step "
             f"(this run: host {host}, trainer {pick.metrics['trainer_weight_sync_s_per_step']:.2f} s/step on weights):"]
    from .hosts import HOSTS

    for name, w in weight_paths(preset, pick).items():
        bound = "<=" if HOSTS[name].load_on_trainer else "  "  # loads asked together share a gather
        lines.append(f"    {name:<12} trainer {bound}{w['trainer_s_per_step']:6.2f} s/step, a load {w['load_s']:5.2f} s "
                     f"({w['instance_load_s_per_step']:6.1f} instance-s/step)")
    return "\n".join(lines)


def format_table(preset: str, seed: int, steps: int, results: dict) -> str:
    cols = [
        ("mode", "{}"), ("K", "{}"), ("split", "{}"), ("tok/s", "{:.0f}"), ("vs sync", "{}"),
        ("eff", "{:.2f}"), ("wait", "{:.2f}"), ("bubble", "{:.2f}"), ("r2t s", "{:.1f}"),
        ("stale max/mean", "{}"), ("multi-v", "{:.3f}"), ("C1", "{}"), ("C2", "{}"), ("C3", "{}"),
        ("migr", "{}"), ("loads", "{}"),
    ]
    host = next(iter(results.values())).metrics.get("host", "ideal")
    if host != "ideal":
        cols += [("sync s/st", "{:.2f}"), ("reprefill", "{}"), ("preempt", "{}")]
    rows = []
    for mode, r in results.items():
        m = r.metrics
        sp = m["speedup_vs_sync"]
        vals = [
            mode, m["max_staleness"], m["split"], m["throughput_tokens_per_s"],
            "-" if sp is None else f"{sp:.2f}x", m["efficiency"], m["trainer_wait_ratio"],
            m["rollout_bubble_ratio"], m["rollout_to_train_end_s"],
            f"{m['staleness_max']}/{m['staleness_mean']:.2f}", m["multi_version_trajectory_share"],
            _ok(m["c1_ok"]), _ok(m["c2_ok"]), _ok(m["c3_ok"]), m["migrations"], m["weight_loads"],
        ]
        if host != "ideal":
            vals += [m["trainer_weight_sync_s_per_step"], m["reprefilled_tokens"], m["preemptions"]]
        rows.append([fmt.format(v) for (_, fmt), v in zip(cols, vals)])
    head = [c for c, _ in cols]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = [
        f"preset {preset}, seed {seed}, {steps} steps; ideal {next(iter(results.values())).metrics['ideal_throughput']:.0f} tok/s"
        + ("" if host == "ideal" else f"; host {host}"),
        "  ".join(h.rjust(w) for h, w in zip(head, widths)),
    ]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _ok(flag: bool) -> str:
    return "ok" if flag else "NO"


def list_presets(presets: dict) -> str:
    out = []
    for p in presets.values():
        out.append(f"{p.name}: {p.summary}")
        w = p.workload
        out.append(
            f"  G={p.accelerators} ({p.engine.accelerators} per instance, capacity {p.engine.capacity}), "
            f"batch {p.batch_size} x n={w.group_size}, response median {w.response_median:.0f} cv {w.response_cv} "
            f"cap {w.response_cap}, sync {'colocated' if p.sync_colocated else 'on split pools'}, default split "
            f"{p.default_split[0]}:{p.default_split[1]}"
        )
        for s in p.sources:
            out.append(f"  source: {s}")
    return "\n".join(out)


def _stop_or_resume(args: argparse.Namespace) -> int:
    """`--stop-after-events N --checkpoint FILE` and `--resume FILE` (one mode at a time)."""
    from ..core import ProtocolError
    from . import SimError, WorkloadError, get_preset, load_lengths
    from ..config import ELASTIC_MODES
    from .runner import Simulation, _staleness, default_steps, parse_split

    try:
        if args.resume:
            if args.checkpoint or args.stop_after_events is not None:
                raise WorkloadError("--resume: runs to the end; it takes no --checkpoint/--stop-after-events")
            sim = Simulation.load(args.resume)
            result = sim.run()
        else:
            if not args.checkpoint or args.stop_after_events is None:
                raise WorkloadError("--checkpoint and --stop-after-events go together")
            if args.stop_after_events < 0:
                raise WorkloadError(f"--stop-after-events: expected an integer >= 0, got {args.stop_after_events}")
            if args.preset is None:
                raise WorkloadError("--preset: required")
            modes = [m.strip() for m in args.modes.split(",") if m.strip()]
            if len(modes) != 1 or modes[0] not in MODES:
                raise WorkloadError(f"--modes: a checkpointed run takes exactly one mode of {', '.join(MODES)}")
            if args.elastic and modes[0] not in ELASTIC_MODES:
                raise WorkloadError(f"--elastic: mode {modes[0]} does not take it; accepted: {', '.join(ELASTIC_MODES)}")
            split = parse_split(args.split)
            preset = get_preset(args.preset)
            # The same run as without a checkpoint: the default steps for this K, elastic if asked.
            steps = args.steps or default_steps(preset, _staleness(modes[0], args.max_staleness))
            sim = Simulation(preset, modes[0], steps=steps, seed=args.seed,
                             max_staleness=args.max_staleness, split=split if isinstance(split, tuple) else None,
                             records=load_lengths(args.lengths) if args.lengths else None,
                             instances=args.instances, config=_config(args) or None,
                             host=args.host)
            result = sim.run(stop_after_events=args.stop_after_events)
            if result is None:
                sim.save(args.checkpoint)
                print(f"stopped after {sim.events} scheduler events at step {sim.sched.step}; "
                      f"checkpoint written to {args.checkpoint} (continue with --resume {args.checkpoint})")
                return 0
    except (WorkloadError, ConfigError, OSError) as exc:
        print(f"dora-ext simulate: error: {exc}", file=sys.stderr)
        return 2
    except (SimError, ProtocolError) as exc:
        print(f"dora-ext simulate: the scheduler misbehaved: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    results = {result.mode: result}
    if args.json:
        print(json.dumps(to_json(sim.preset.name, getattr(sim, "seed", args.seed), sim.steps, results), indent=2))
    else:
        print(format_table(sim.preset.name, getattr(sim, "seed", args.seed), sim.steps, results))
    return 0

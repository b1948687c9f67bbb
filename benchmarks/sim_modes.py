"""Issue 3 benchmark: every simulator preset, all five modes side by side, and the goal ratios.

    python benchmarks/sim_modes.py [--seed 0] [--steps N] [--quick] [--k-sweep] [--json OUT.json]

Every preset runs all modes on the same workload and seed with one cost model (a baseline is
never given other constants). `dapo-28k` and `agentic-long-tail` search the rollout/trainer split
per mode (`split="auto"`, design.md "Equal hardware") and use colocated `sync`;
`rolloutpipe-8k` keeps its stated 4:4 pools for every mode, `sync` included, because RolloutPipe
compares against slime on the same disaggregated pools.

For `dapo-28k` it also runs `dora` with R5 migration switched off (same search), an ablation
that shows what the migration policy costs or gains under this cost model.

The goals are targets that this script reports, never asserts; every number is a ratio measured
side by side in this run. Finally it times a 1,000-instance, 100-step `dapo-28k` run of `dora`
(wall and CPU seconds; the CPU time is the figure that other load on the machine does not move).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dora_ext.config import MODES
from dora_ext.sim import PRESETS, get_preset, simulate
from dora_ext.sim.cli import format_table
from dora_ext.sim.compare import compare

#: how each preset is compared: the split setting and why
SPLITS = {"dapo-28k": "auto", "rolloutpipe-8k": None, "agentic-long-tail": "auto"}


def _goal(value: float, target: float, text: str, *, below: bool = False) -> str:
    met = value <= target if below else value >= target
    return f"  {text}: {value:.3f} (goal {'<=' if below else '>='} {target}) -> {'met' if met else 'MISSED'}"


def ratios(name: str, res: dict) -> tuple[list[str], dict]:
    m = {k: r.metrics for k, r in res.items()}
    out: dict = {}
    lines = []
    sync = m["sync"]["throughput_tokens_per_s"]
    ideal = m["sync"]["ideal_throughput"]
    out["ideal_vs_sync"] = ideal / sync
    lines.append(f"  ideal / sync throughput (the physical limit of the speedup): {ideal / sync:.3f}")
    d = m["dora"]
    base = max(m["one_step_off"]["throughput_tokens_per_s"], m["partial"]["throughput_tokens_per_s"])
    out["dora_speedup_vs_sync"] = d["speedup_vs_sync"]
    out["dora_vs_best_of_one_step_off_partial"] = d["throughput_tokens_per_s"] / base
    out["dora_efficiency"] = d["efficiency"]
    out["dora_share_of_ideal_speedup"] = d["speedup_vs_sync"] / (ideal / sync)
    out["dora_constraints_ok"] = bool(d["c1_ok"] and d["c2_ok"] and d["c3_ok"] and d["dropped"] == 0)
    if name == "dapo-28k":
        lines.append(_goal(d["speedup_vs_sync"], 2.0, "dora speedup_vs_sync"))
        lines.append(_goal(out["dora_vs_best_of_one_step_off_partial"], 1.3,
                           f"dora / best of one_step_off, partial (K={res['partial'].max_staleness})"))
        lines.append(_goal(d["efficiency"], 0.9, "dora efficiency"))
        lines.append(f"  dora share of the ideal speedup: {out['dora_share_of_ideal_speedup']:.3f}")
        lines.append(f"  dora C1-C3 hold with no drops: {out['dora_constraints_ok']}")
    else:
        lines.append(f"  dora speedup_vs_sync {d['speedup_vs_sync']:.3f}, vs best of one_step_off/partial "
                     f"{out['dora_vs_best_of_one_step_off_partial']:.3f}, efficiency {d['efficiency']:.3f}")
    p, s = m["pipeline"], m["sync"]
    out["pipeline_r2t_reduction"] = 1 - p["rollout_to_train_end_s"] / s["rollout_to_train_end_s"]
    out["pipeline_wait_reduction"] = 1 - p["trainer_wait_ratio"] / s["trainer_wait_ratio"] if s["trainer_wait_ratio"] else 0.0
    if name == "rolloutpipe-8k":
        lines.append(_goal(out["pipeline_r2t_reduction"], 0.30, "pipeline vs sync: rollout_to_train_end_s reduction"))
        lines.append(_goal(out["pipeline_wait_reduction"], 0.37, "pipeline vs sync: trainer_wait_ratio reduction"))
    else:
        lines.append(f"  pipeline vs sync: r2t reduction {out['pipeline_r2t_reduction']:.3f}, "
                     f"trainer_wait reduction {out['pipeline_wait_reduction']:.3f}")
    return lines, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: each preset's)")
    ap.add_argument("--quick", action="store_true", help="6 steps, fixed default splits, no scale run")
    ap.add_argument("--k-sweep", action="store_true", help="also run dora and partial at K=1..4 on dapo-28k")
    ap.add_argument("--scale-steps", type=int, default=100)
    ap.add_argument("--json", metavar="OUT", help="write every metric and ratio to this file")
    args = ap.parse_args(argv)
    report: dict = {"seed": args.seed, "presets": {}}
    for name, preset in PRESETS.items():
        steps = 6 if args.quick else (args.steps or preset.default_steps)
        split = None if args.quick else SPLITS[name]
        t0 = time.perf_counter()
        res = compare(preset, MODES, steps=steps, seed=args.seed, split=split)
        wall = time.perf_counter() - t0
        how = "best split per mode (auto)" if split == "auto" else f"split {preset.default_split[0]}:{preset.default_split[1]} for all"
        print(f"\n== {name}: {how}; sync {'colocated' if preset.sync_colocated else 'on the same split pools'} ({wall:.0f} s)")
        print(format_table(name, args.seed, steps, res))
        lines, out = ratios(name, res)
        print("\n".join(lines))
        report["presets"][name] = {
            "steps": steps,
            "modes": {m: {k: v for k, v in r.metrics.items()} for m, r in res.items()},
            "ratios": out,
        }
        if name == "dapo-28k" and not args.quick:
            # R5 ablation: the same core with migration off, split searched the same way.
            abl = compare(preset, ["dora"], steps=steps, seed=args.seed, split=split, config={"migrate": False})["dora"]
            a = abl.metrics
            sync = res["sync"].metrics["throughput_tokens_per_s"]
            print(f"  ablation dora migrate=False ({a['split']}): speedup_vs_sync {a['throughput_tokens_per_s'] / sync:.3f}, "
                  f"efficiency {a['efficiency']:.3f}, trainer_wait {a['trainer_wait_ratio']:.3f}, "
                  f"C1-C3 {a['c1_ok'] and a['c2_ok'] and a['c3_ok']}")
            report["presets"][name]["ablation_dora_no_migration"] = dict(a)
        if args.k_sweep and name == "dapo-28k":
            dsplit = res["dora"].layout
            sp = (dsplit.instances * preset.engine.accelerators, dsplit.trainer_accelerators)
            sweep = {}
            for k in (1, 2, 3, 4):
                row = {}
                for mode in ("partial", "dora"):
                    r = simulate(preset, mode, steps=steps, seed=args.seed, max_staleness=k, split=sp)
                    row[mode] = r.metrics["throughput_tokens_per_s"]
                sync = res["sync"].metrics["throughput_tokens_per_s"]
                sweep[k] = {m: v / sync for m, v in row.items()}
                print(f"  K={k} at split {sp[0]}:{sp[1]}: speedup vs sync partial {sweep[k]['partial']:.3f}, "
                      f"dora {sweep[k]['dora']:.3f}")
            report["presets"][name]["k_sweep_speedup_vs_sync"] = sweep
    if not args.quick:
        preset = get_preset("dapo-28k")
        t0, c0 = time.perf_counter(), time.process_time()
        r = simulate(preset, "dora", steps=args.scale_steps, seed=args.seed, instances=1000)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        trajectories = args.scale_steps * preset.batch_size * preset.workload.group_size
        print(f"\n== scale: dapo-28k, dora, 1,000 instances, {args.scale_steps} steps, {trajectories} trajectories, "
              f"{r.events} scheduler events: {wall:.1f} s wall, {cpu:.1f} s CPU (goal < 60 s) -> "
              f"{'met' if wall < 60 else 'MISSED'}; C1-C3 {r.metrics['c1_ok'] and r.metrics['c2_ok'] and r.metrics['c3_ok']}")
        report["scale"] = {"instances": 1000, "steps": args.scale_steps, "wall_s": wall, "cpu_s": cpu,
                           "events": r.events, "trajectories": trajectories}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

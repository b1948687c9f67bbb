"""Admission on the real CPU job: dora at its default K with its default admission (`adaptive`)
against `admission: fill`, in adjacent pairs.

    python benchmarks/admission_cpu.py [--pairs 6] [--steps 30] [--json OUT.json] [--set section.key=value ...]

`benchmarks/convergence.py` runs both once per seed among the other modes; on a machine shared
with other jobs the load moves between two runs minutes apart. Here the two run back to back,
ABBA (even pairs adaptive first, odd pairs fill first), on the same seed and warm start, and each
pair gives one throughput ratio adaptive / fill; the median of those is the estimate. Also per
run: trainer wait (the share of the steady window the trainer had nothing to train: what
admission can cost), mean trained staleness and C1-C3. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=os.path.join(here, "..", "recipes", "cpu", "long-tail.yaml"))
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--json", default=None, help="write the JSON object there (it is always printed)")
    args = p.parse_args(argv)

    from dora_ext.config import DEFAULT_ADMISSION, DEFAULT_STALENESS
    from dora_ext.runtime import load_recipe, prepare, run
    from dora_ext.runtime.compare import jsonable

    k = DEFAULT_STALENESS["dora"]
    policies = {"adaptive": DEFAULT_ADMISSION["dora"], "fill": "fill"}
    recipes = {name: load_recipe(args.recipe, [*args.set, "dora.mode=dora", f"dora.max_staleness={k}",
                                               f"dora.admission={pol}"]).with_steps(args.steps).with_seed(args.seed)
               for name, pol in policies.items()}
    prepared = prepare(recipes["fill"])
    keys = ("throughput_tokens_per_s", "trainer_wait_ratio", "staleness_mean", "c1_ok", "c2_ok", "c3_ok")
    runs: dict[str, list[dict]] = {name: [] for name in policies}
    orders, t0, load_before = [], time.perf_counter(), os.getloadavg()

    def summary() -> dict:
        ratio = [a["throughput_tokens_per_s"] / f["throughput_tokens_per_s"]
                 for a, f in zip(runs["adaptive"], runs["fill"])]
        return {
            "recipe": recipes["fill"].name, "steps": args.steps, "seed": args.seed, "max_staleness": k,
            "policies": policies, "overrides": args.set, "pairs": len(orders), "order_per_pair": orders,
            "tokens_per_s_ratio_adaptive_to_fill": ratio,
            "tokens_per_s_ratio_median": statistics.median(ratio),
            "summary": {name: {key: statistics.mean(r[key] for r in rs) for key in keys[:3]}
                        | {key: all(r[key] for r in rs) for key in keys[3:]} for name, rs in runs.items()},
            "runs": runs,
            "load_average_before_after": [load_before, os.getloadavg()],
            "wall_s": time.perf_counter() - t0,
        }

    for i in range(args.pairs):
        order = list(policies) if i % 2 == 0 else list(policies)[::-1]
        for name in order:
            m = run(recipes[name], prepared).metrics
            runs[name].append({key: m[key] for key in keys})
            print(f"pair {i} {name}: {m['throughput_tokens_per_s']:.0f} tokens/s, trainer wait "
                  f"{m['trainer_wait_ratio']:.3f}, staleness {m['staleness_mean']:.2f}", file=sys.stderr)
        orders.append(order)
        if args.json:  # after every pair, so that a run cut short keeps its complete pairs
            with open(args.json, "w", encoding="utf-8") as fh:
                fh.write(json.dumps(jsonable(summary()), indent=2) + "\n")
    print(json.dumps(jsonable(summary()), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

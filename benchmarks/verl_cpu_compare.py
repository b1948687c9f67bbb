"""verl 0.9.1 on this CPU machine: dora vs verl's separate_async and sync, side by side in one run.

Not a test. Runs ``recipes/verl/tiny_cpu.sh`` (``python -m verl.trainer.main_ppo`` with the tiny
local model and task) once per mode with the same settings, then reads each run's own evidence
(verl's logged metrics and the replica / weight-store reports, ``dora_ext.verl.cpu.evidence``) and
prints steps/s and tokens/s (mean over steps 2..N of verl's ``timing_s/step`` and
``perf/total_num_tokens``) with the constraint checks. On 2 CPU cores no speedup is expected: the
trainer and the replicas share the cores.

    .venv/bin/python benchmarks/verl_cpu_compare.py [--steps 6] [--k 1] [--token-delay 0.02] [--json]

``--json`` prints ``{"modes": {"dora": {...}, "separate_async": {...}, "sync": {...}}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "verl", "tiny_cpu.sh")
MODES = ("dora", "separate_async", "sync")


def run_mode(work: str, mode: str, args: argparse.Namespace) -> dict:
    from dora_ext.verl.cpu.evidence import analyze, load_run

    env = dict(os.environ)
    env.update({"PYTHON": sys.executable, "WORK": work, "MODE": mode, "K": str(args.k), "STEPS": str(args.steps),
                "OMP_NUM_THREADS": "1", "DORA_CPU_TOKEN_DELAY_S": str(args.token_delay)})
    log = os.path.join(work, f"{mode}.log")
    with open(log, "w") as f:
        rc = subprocess.run(["bash", RECIPE], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=work,
                            timeout=args.timeout).returncode
    metrics, reports = load_run(work, mode)
    res = analyze(metrics, reports, mode=mode, max_staleness=0 if mode == "sync" else args.k)
    res["exit_code"] = rc
    res["log"] = log
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--k", type=int, default=1, help="max staleness of dora and separate_async")
    ap.add_argument("--token-delay", type=float, default=0.02, help="seconds per decoded token on the replicas")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--work", default=None, help="folder for assets and logs (default: a temporary one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="verl_cpu_compare_")
    from dora_ext.verl.cpu.tiny import build_dataset, build_model

    if not os.path.exists(os.path.join(work, "model", "config.json")):
        build_model(os.path.join(work, "model"))
        build_dataset(work)
    results = {mode: run_mode(work, mode, args) for mode in MODES}
    if args.json:
        print(json.dumps({"modes": results, "work": work, "steps": args.steps, "k": args.k}, indent=2))
        return 0 if all(r["exit_code"] == 0 for r in results.values()) else 1
    base = results["sync"]
    print(f"verl 0.9.1 main_ppo on CPU, {args.steps} steps, K={args.k}, token delay {args.token_delay}s (work: {work})")
    print(f"{'mode':<15}{'steps':>6}{'steps/s':>9}{'tokens/s':>10}{'vs sync':>9}{'live':>6}"
          f"{'C1':>5}{'C2':>5}{'C3':>5}{'weights':>9}{'rc':>4}")
    for mode, r in results.items():
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else float("nan")
        print(f"{mode:<15}{r['steps']:>6}{r['steps_per_s']:>9.3f}{r['tokens_per_s']:>10.1f}{ratio:>8.2f}x"
              f"{r['max_live_versions']:>6}{'ok' if r['c1_ok'] else 'NO':>5}{'ok' if r['c2_ok'] else 'NO':>5}"
              f"{'ok' if r['c3_ok'] else 'NO':>5}{'ok' if r['weights_checksum_ok'] else 'NO':>9}{r['exit_code']:>4}")
    return 0 if all(r["exit_code"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

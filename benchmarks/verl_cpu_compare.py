"""verl 0.9.1 on this CPU machine: dora vs verl's separate_async and sync, side by side in one run.

Not a test. Runs ``recipes/verl/tiny_cpu.sh`` (``python -m verl.trainer.main_ppo`` with the tiny
local model and task) once per mode with the same settings, then reads each run's own evidence
(verl's logged metrics and the replica / weight-store reports, ``dora_ext.verl.cpu.evidence``) and
prints steps/s and tokens/s (mean over steps 2..N of verl's ``timing_s/step`` and
``perf/total_num_tokens``) with the constraint checks. On 2 CPU cores no speedup is expected: the
trainer and the replicas share the cores.

Two decode shapes, each run for every mode: ``gpu-shaped`` (``DORA_CPU_STEP_S``: a decode step of
a replica's whole batch costs at least ``--step-s`` seconds, as memory-bound decode on a GPU) and
``cpu`` (no floor: a step costs its CPU compute, one batched forward, which on CPU still grows
with the batch).

``--slow-replicas "<rank>:<factor>,..."`` (``DORA_CPU_SLOW_REPLICAS``, as the CPU end-to-end tests
use it) makes those replica ranks stragglers in every mode: their decode step floor is `factor`
times ``--step-s`` (so a factor acts in the ``gpu-shaped`` shape only: the ``cpu`` shape has no
floor to scale), or, with ``hold``, the replica advances a request only while it runs no other (in
both shapes). Replicas then drain at different times, which is what dora's subset loads,
old-version loads and migrations act on. verl's ``sync`` is colocated, one replica per trainer
rank (rank 0 with one trainer rank): a rank >= 1 slows only the standalone pools of ``dora`` and
``separate_async``, rank 0 every mode (sync's whole rollout). Each mode reports the ranks that were
slowed in it (``slowed_replicas``).

    .venv/bin/python benchmarks/verl_cpu_compare.py [--steps 6] [--k 1] [--replicas 3] [--step-s 0.05]
        [--shapes gpu-shaped,cpu] [--slow-replicas 2:10] [--json]

``--json`` prints ``{"modes": {"dora": {...}, "separate_async": {...}, "sync": {...},
"dora@cpu": {...}, ...}}``: the first shape under the plain mode names, the others as
``<mode>@<shape>``. Each entry has ``replicas`` and ``weight_backend`` (read from the run's
reports, ``evidence.observed_setup``: the replicas that loaded or served, the backend whose code
published the weights), ``slowed_replicas``, ``subset_loads``, ``old_version_loads``,
``migrations_landed``, ``trainer_weight_sync_s_per_step`` (verl's ``timing_s/update_weights``: the
trainer's time on weights per step) and ``decode_shape``.
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


def run_mode(work: str, mode: str, shape: str, args: argparse.Namespace) -> dict:
    from dora_ext.verl.cpu.evidence import analyze, observed_setup, read_metrics
    from dora_ext.verl.cpu.report import read_reports

    tag = f"{mode}_{shape}"
    metrics_path, reports_dir = os.path.join(work, f"metrics_{tag}.jsonl"), os.path.join(work, f"reports_{tag}")
    env = dict(os.environ)
    env.update({"PYTHON": sys.executable, "WORK": work, "MODE": mode, "K": str(args.k), "STEPS": str(args.steps),
                "NREPLICAS": str(args.replicas), "OMP_NUM_THREADS": "1",
                "DORA_CPU_STEP_S": str(args.step_s if shape == "gpu-shaped" else 0),
                "DORA_CPU_SLOW_REPLICAS": args.slow_replicas,
                "VERL_FILE_LOGGER_PATH": metrics_path, "DORA_CPU_REPORT_DIR": reports_dir})
    log = os.path.join(work, f"{tag}.log")
    with open(log, "w") as f:
        rc = subprocess.run(["bash", RECIPE], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=work,
                            timeout=args.timeout).returncode
    metrics, reports = read_metrics(metrics_path), read_reports(reports_dir)
    res = analyze(metrics, reports, mode=mode, max_staleness=0 if mode == "sync" else args.k)
    sync_s = [float(m["timing_s/update_weights"]) for m in metrics if "timing_s/update_weights" in m]
    setup = observed_setup(reports)
    res.update({
        **setup,
        "slowed_replicas": sorted(rank for rank, factor in stragglers(args.slow_replicas).items()
                                  if rank in setup["replica_ranks"]
                                  and (factor == "hold" or (shape == "gpu-shaped" and args.step_s > 0))),
        "trainer_weight_sync_s_per_step": sum(sync_s) / len(sync_s) if sync_s else 0.0,
        "decode_shape": shape, "exit_code": rc, "log": os.path.basename(log),  # in the work folder
    })
    return res


def stragglers(spec: str) -> dict[int, str]:
    """Replica rank -> factor of ``--slow-replicas`` ("<rank>:<factor>,...": factor > 0 or ``hold``)."""
    out = {}
    for item in filter(None, spec.split(",")):
        rank, _, factor = item.partition(":")
        try:
            ok = rank.strip().isdigit() and (factor == "hold" or float(factor) > 0)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--slow-replicas: {item!r} is not <rank>:<factor> (factor > 0 or hold)")
        out[int(rank)] = factor
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--k", type=int, default=1, help="max staleness of dora and separate_async")
    ap.add_argument("--replicas", type=int, default=3, help="rollout replicas of dora and separate_async")
    ap.add_argument("--step-s", type=float, default=0.05, help="gpu-shaped: least seconds of one decode step")
    ap.add_argument("--shapes", default="gpu-shaped,cpu", help="decode shapes to run, comma-separated")
    ap.add_argument("--slow-replicas", default="", help='stragglers in every mode, "<rank>:<factor>,..." '
                    "(factor > 0 or hold; DORA_CPU_SLOW_REPLICAS); default none")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--work", default=None, help="folder for assets and logs (default: a temporary one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        stragglers(args.slow_replicas)
    except ValueError as exc:
        ap.error(str(exc))
    work = args.work or tempfile.mkdtemp(prefix="verl_cpu_compare_")
    from dora_ext.verl.cpu.tiny import build_dataset, build_model

    if not os.path.exists(os.path.join(work, "model", "config.json")):
        build_model(os.path.join(work, "model"))
        build_dataset(work)
    shapes = [x for x in args.shapes.split(",") if x]
    bad = [x for x in shapes if x not in ("gpu-shaped", "cpu")]
    if bad:
        ap.error(f"--shapes: {bad} not accepted; use gpu-shaped and/or cpu")
    results = {}
    for n, shape in enumerate(shapes):
        for mode in MODES:
            results[mode if n == 0 else f"{mode}@{shape}"] = run_mode(work, mode, shape, args)
    ok = all(r["exit_code"] == 0 for r in results.values())
    if args.json:
        # No machine path in the JSON (it is committed to benchmarks/results): the folder goes to stderr.
        print(f"work folder (logs, metrics, reports): {work}", file=sys.stderr)
        print(json.dumps({"modes": results, "work": args.work or "<temporary folder>", "steps": args.steps, "k": args.k,
                          "replicas": args.replicas, "step_s": args.step_s, "slow_replicas": args.slow_replicas},
                         indent=2))
        return 0 if ok else 1
    print(f"verl 0.9.1 main_ppo on CPU, {args.steps} steps, K={args.k}, {args.replicas} replicas, "
          f"gpu-shaped step {args.step_s}s, stragglers {args.slow_replicas or 'none'} (work: {work})")
    print(f"{'mode':<26}{'steps/s':>9}{'tokens/s':>10}{'vs sync':>9}{'repl':>5}{'backend':>11}{'slow':>6}"
          f"{'live':>6}{'subset':>7}{'old':>5}{'moved':>6}{'sync_s':>8}{'C1':>4}{'C2':>4}{'C3':>4}{'wts':>5}{'rc':>4}")
    for key, r in results.items():
        base = results["sync" if "@" not in key else "sync@" + key.split("@")[1]]
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else float("nan")
        yes = {True: "ok", False: "NO"}
        print(f"{key + ' (' + r['decode_shape'] + ')':<26}{r['steps_per_s']:>9.3f}{r['tokens_per_s']:>10.1f}"
              f"{ratio:>8.2f}x{r['replicas']:>5}{str(r['weight_backend']):>11}"
              f"{','.join(map(str, r['slowed_replicas'])) or '-':>6}"
              f"{r['max_live_versions']:>6}{r['subset_loads']:>7}{r['old_version_loads']:>5}"
              f"{r['migrations_landed']:>6}{r['trainer_weight_sync_s_per_step']:>8.3f}{yes[r['c1_ok']]:>4}"
              f"{yes[r['c2_ok']]:>4}{yes[r['c3_ok']]:>4}{yes[r['weights_checksum_ok']]:>5}{r['exit_code']:>4}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

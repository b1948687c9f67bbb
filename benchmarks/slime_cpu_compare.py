"""slime's own loops on this CPU machine: `train_async.py` alone, `train_async.py` with dora, and
`train.py` (synchronous), side by side in one run at recipe-scale concurrency.

Not a test. Each mode is one job of the harness `tests/slime/harness/slime_cpu/run.py` (slime's
loop, RolloutManager, router and train group; CPU stand-ins for SGLang and the Megatron actor)
with the same settings: engines, slots per engine (= `--sglang-server-concurrency`, so slime's
pool holds exactly the connections generation uses), response length and a GPU-shaped decode
step (`--step-s`: one step of the whole running batch, as SGLang's scheduler decodes). The
numbers are read from each job's own evidence (engine logs, slime's rollout log, the trainer's
log). The slime modes use slime's default rollout through its router and its disk weight sync
(pause, reload every engine, continue): the harness has no NCCL, so all three modes use the disk
transport. On 2 shared CPU cores the train actor and the stand-ins compete for the cores; the
ratios, not the absolute numbers, are the result.

    DORA_SLIME_PATH=<slime checkout> python benchmarks/slime_cpu_compare.py [--json] [--num-rollout 3]

`--json` prints `{"modes": {"slime_async": {...}, "dora": {...}, "slime_sync": {...}}}`.

The weight path: `--weights-dir-kind shm` puts `--update-weight-disk-dir` on /dev/shm (tmpfs,
node-local memory) instead of the disk; `both` runs each mode with both, side by side, `--repeats
2` in ABBA order (modes then named `<mode>_<kind><run>`, and `weights_dir` gives the means and
the shm / disk ratios). `--checkpoint-mb` makes each version that many MB larger (the trainer
writes them, every engine load reads them), so the write and the reads weigh as a model's do.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"slime_async": ("train_async", True), "dora": ("train_async", False), "slime_sync": ("train", True)}


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def run_mode(slime: Path, work: Path, mode: str, o: argparse.Namespace, weights: str | None = None) -> dict:
    loop, plain = MODES[mode]
    k = 0 if loop == "train" else 1
    flags = ["--workdir", str(work), "--loop", loop, "--mode", "dora", "--k", str(max(k, 1) if not plain else 1),
             "--engines", str(o.engines), "--capacity", str(o.capacity), "--batch", str(o.batch), "--n", str(o.n),
             "--num-rollout", str(o.num_rollout), "--response-len", str(o.response_len), "--step-s", str(o.step_s),
             "--load-s", str(o.load_s), "--cheap-tokens", "--eval-interval", str(o.num_rollout),
             "--eval-prompts", str(o.capacity), "--save-interval", str(10**6), "--checkpoint-mb", str(o.checkpoint_mb)]
    if weights:
        flags += ["--weights-dir", weights]
    if plain:
        flags.append("--no-dora")
    from slime_helpers import harness_env

    env = harness_env(slime)
    work.mkdir(parents=True)
    with open(work.parent / f"{mode}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "slime_cpu.run", *flags], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(o.timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    result = json.loads((work / "result.json").read_text()) if (work / "result.json").exists() else {"status": "no result"}
    return analyze(work, result, mode, k=1 if loop == "train_async" else 0, o=o)


def analyze(work: Path, result: dict, mode: str, *, k: int, o: argparse.Namespace) -> dict:
    engine_logs = [e for p in sorted(work.glob("engine*.jsonl")) for e in _lines(p)]
    produced = defaultdict(set)
    for r in engine_logs:
        if r["kind"] == "generate":
            produced[tuple(r["input_ids"] + r["output_ids"])].add((r["version_start"], r["version_end"]))
    rollouts = {e["rollout_id"]: e for e in _lines(work / "rollouts.jsonl")}
    trained = {e["rollout_id"]: e for e in _lines(work / "train.jsonl")}
    tokens = sum(len(t) for e in trained.values() for t in e["tokens"])  # prompt + response, as trained
    response_tokens = sum(s["response_length"] for rid in trained for s in rollouts.get(rid, {}).get("samples", []))
    c1 = c2 = c3 = bool(trained)
    seen: set = set()
    offsets = []
    for rid, e in rollouts.items():
        groups = defaultdict(set)
        for s in e["samples"]:
            c1 &= len(s["weight_versions"]) == 1 and produced[tuple(s["tokens"])] == {(s["weight_versions"][0],) * 2}
            groups[s["prompt"]].update(s["weight_versions"])
        for prompt, versions in groups.items():
            c1 &= len(versions) == 1
            c2 &= prompt not in seen
            seen.add(prompt)
            offsets += [rid - int(v) for v in versions if str(v).lstrip("-").isdigit()]
    # slime numbers its weight versions from its first push, dora from rollout ids: staleness is
    # measured from the freshest batch (offset 0 = on-policy for that loop)
    if offsets:
        c3 &= max(offsets) - min(offsets) <= k
    loads = [e for e in engine_logs if e["kind"] == "load" and e.get("path") and "read_s" in e]
    live, current = 1, {}
    for ev in sorted((e for e in engine_logs if e["kind"] == "load"), key=lambda e: e["t"]):
        current[ev["port"]] = ev["version"]
        if len(current) == o.engines:
            live = max(live, len(set(current.values())))
    metrics = [e.get("metrics", {}) for e in rollouts.values()]
    p99 = [m["dora/health_check_p99_s"] for m in metrics if "dora/health_check_p99_s" in m]
    syncs = result.get("weight_sync_s") or []
    wall = result.get("wall_s") or float("nan")
    return {
        "status": result.get("status"), "error": result.get("error", "")[-300:] or None,
        "tokens_per_s": response_tokens / wall if wall == wall and wall > 0 else None,
        "trained_tokens_per_s": tokens / wall if wall == wall and wall > 0 else None,
        "wall_s": wall, "steps": len(trained), "engines": o.engines, "concurrency_per_engine": o.capacity,
        "engines_retired_while_healthy": max([m.get("dora/engines_retired", 0) for m in metrics] or [0])
        if not result.get("engine_events") else None,
        "health_check_p99_s": max(p99) if p99 else None,
        "max_live_versions": live, "c1_ok": c1, "c2_ok": c2, "c3_ok": c3, "weight_transport": "disk",
        "trainer_weight_sync_s_per_step": sum(syncs[1:]) / len(syncs[1:]) if len(syncs) > 1 else None,
        "engine_loads": len(loads), "checkpoint_mb": o.checkpoint_mb,
        "engine_load_s_mean": sum(e["t"] - e["t0"] for e in loads) / len(loads) if loads else None,
        "engine_read_s_mean": sum(e["read_s"] for e in loads) / len(loads) if loads else None,
    }


def weights_dir_summary(out: dict, modes: list[str], kinds: list[str]) -> dict:
    """Per mode and weights-dir kind, the means over its runs; with both kinds, shm / disk."""
    fields = ("trainer_weight_sync_s_per_step", "engine_load_s_mean", "engine_read_s_mean", "tokens_per_s")
    means: dict = {}
    for mode in modes:
        for kind in kinds:
            runs = [r for name, r in out.items() if name.startswith(f"{mode}_{kind}") and r["status"] == "finished"]
            means[f"{mode}_{kind}"] = {f: sum(r[f] for r in runs) / len(runs) if runs and all(r[f] is not None for r in runs)
                                       else None for f in fields} | {"runs": len(runs)}
    ratios = {}
    for mode in modes:
        disk, shm = means.get(f"{mode}_disk"), means.get(f"{mode}_shm")
        if disk and shm:
            ratios.update({f"{mode}_shm_over_disk_{f}": shm[f] / disk[f] for f in fields if shm[f] and disk[f]})
    return {"means": means, "ratios": ratios}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--capacity", type=int, default=24)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--num-rollout", type=int, default=3)
    ap.add_argument("--response-len", type=int, default=200)
    ap.add_argument("--step-s", type=float, default=0.03, help="decode step of a whole batch (GPU-shaped)")
    ap.add_argument("--load-s", type=float, default=1.0, help="one engine's weight load")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--weights-dir-kind", choices=("disk", "shm", "both"), default="disk",
                    help="where --update-weight-disk-dir lives: the disk (a temporary dir), /dev/shm, or both")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each (mode, kind); 2 with both: ABBA")
    ap.add_argument("--checkpoint-mb", type=int, default=0, help="MB added to every version's checkpoint")
    o = ap.parse_args()
    for name in ("engines", "capacity", "batch", "n", "num_rollout", "response_len", "repeats"):
        if getattr(o, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(o, name)}")
    for name, low in (("checkpoint_mb", 0), ("step_s", 0), ("load_s", 0), ("timeout", 1e-9)):
        if not math.isfinite(getattr(o, name)) or getattr(o, name) < low:
            ap.error(f"--{name.replace('_', '-')}: expected a finite number {'>= 0' if low == 0 else '> 0'}, "
                     f"got {getattr(o, name)}")
    slime = os.environ.get("DORA_SLIME_PATH")
    if not slime:
        print("set DORA_SLIME_PATH to a slime checkout (624b824)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / "tests" / "slime"))
    from slime_helpers import patched_slime_copy

    kinds = ["disk", "shm"] if o.weights_dir_kind == "both" else [o.weights_dir_kind]
    order = [k for r in range(o.repeats) for k in (kinds if r % 2 == 0 else kinds[::-1])]  # ABBA
    plain = order == ["disk"]
    if "shm" in kinds and shutil.disk_usage("/dev/shm").free < 4 * o.checkpoint_mb << 20:
        print(f"/dev/shm has {shutil.disk_usage('/dev/shm').free >> 20} MB free: too little for 4 versions of "
              f"--checkpoint-mb {o.checkpoint_mb}", file=sys.stderr)
        return 2
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        patched = patched_slime_copy(Path(tmp) / "slime")
        for mode in o.modes.split(","):
            for i, kind in enumerate(order):
                name = mode if plain else f"{mode}_{kind}{order[:i + 1].count(kind)}"
                with tempfile.TemporaryDirectory(dir="/dev/shm" if kind == "shm" else tmp) as weights:
                    out[name] = run_mode(patched, Path(tmp) / name / "job", mode, o, weights=weights)
                out[name]["weights_dir_kind"] = kind
    report = {"modes": out, "settings": {k: getattr(o, k) for k in ("engines", "capacity", "batch", "n", "num_rollout",
                                                                   "response_len", "step_s", "load_s", "checkpoint_mb")}}
    if not plain:
        report["weights_dir"] = weights_dir_summary(out, o.modes.split(","), kinds)
    if "dora" in out and "slime_async" in out and out["dora"]["tokens_per_s"] and out["slime_async"]["tokens_per_s"]:
        report["ratios"] = {"dora_over_slime_async_tokens_per_s": out["dora"]["tokens_per_s"] / out["slime_async"]["tokens_per_s"]}
        if out.get("slime_sync", {}).get("tokens_per_s"):
            report["ratios"]["dora_over_slime_sync_tokens_per_s"] = out["dora"]["tokens_per_s"] / out["slime_sync"]["tokens_per_s"]
    print(json.dumps(report, indent=None if o.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

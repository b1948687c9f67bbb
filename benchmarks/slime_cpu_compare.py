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
transport. All three train one algorithm (`--loss`): by default slime's policy loss with slime's
truncated IS (`--use-tis --tis-clip 2.0 --tis-clip-low 0`, what `dora-ext slime-args` prints for
the dora twin), and each job reports the loss and correction settings slime parsed from its
argv and the loss its trainer ran (`same_algorithm` compares them). On 2 shared CPU cores the
train actor and the stand-ins compete for the cores; the ratios, not the absolute numbers, are
the result.

`tokens_per_s` is the trained steps' response tokens over the loop's wall time, start-up (Ray
actors, engine discovery, the first weight push) and the final evaluation included: with few
steps it weighs. `steady_tokens_per_s` leaves it out: the response tokens of the steps after the
first over the time from the first trained step's end to the last one's.

What each mode reports is read from what its job did, not from the settings: `engines` (those
that served training requests), `concurrency_per_engine` (per engine, the most requests the
stand-in server ran at once), `weight_transport` (the endpoints the engines' loads came
through), `engines_retired_while_healthy` (dora's count over training and every evaluation),
and C1-C3 checked on every trained sample (`violations` lists the first of each):

  C1: each trained sample came from one engine request at the one version it reports; no group
      mixes versions;
  C2: the trainer trained exactly what slime handed over, each sample once, every group whole
      in one step, no response its engine aborted (truncated); every prompt that started
      generating was trained or reported failed;
  C3: 0 <= step - steps(version) <= K for every trained sample (K = 1 for train_async.py, 0 for
      train.py; slime tags its first push, the loaded checkpoint, 1 and dora tags it 0).

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
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mode:
    loop: str  # slime's loop file
    dora: bool
    k: int  # the staleness bound the loop keeps: train_async.py trains one step behind, train.py none
    # The tag of the weights before any step. slime tags its disk pushes 1, 2, ... (the first push is the
    # loaded checkpoint, before step 0); dora's tags count trained steps (0: the launch checkpoint).
    first_version: int


MODES = {"slime_async": Mode("train_async", False, 1, 1), "dora": Mode("train_async", True, 1, 0),
         "slime_sync": Mode("train", False, 0, 1)}
# The algorithm flags (loss, correction) of every mode: those `dora-ext slime-args` prints for the
# dora twin's K; the harness passes the same ones to slime alone (`--no-dora`).
ALGORITHM_K = MODES["dora"].k


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def run_mode(slime: Path, work: Path, mode: str, o: argparse.Namespace, weights: str | None = None) -> dict:
    m = MODES[mode]
    flags = ["--workdir", str(work), "--loop", m.loop, "--mode", "dora", "--k", str(ALGORITHM_K), "--loss", o.loss,
             "--engines", str(o.engines), "--capacity", str(o.capacity), "--batch", str(o.batch), "--n", str(o.n),
             "--num-rollout", str(o.num_rollout), "--response-len", str(o.response_len), "--step-s", str(o.step_s),
             "--load-s", str(o.load_s), "--cheap-tokens", "--eval-interval", str(o.num_rollout),
             "--eval-prompts", str(o.capacity), "--save-interval", str(10**6), "--checkpoint-mb", str(o.checkpoint_mb)]
    if weights:
        flags += ["--weights-dir", weights]
    if not m.dora:
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
    return analyze(read_evidence(work), result, m, n=o.n, engines=o.engines)


# ------------------------------------------------------------------ the evidence a job leaves
def read_evidence(work: Path) -> dict:
    """The job's logs: what every engine served and loaded (the stand-in server's own log), what
    slime handed to the trainer and what the final evaluation saw (the harness's log hooks), what
    the trainer trained (the train actor's log)."""
    from slime_cpu.model import SYMBOLS

    engine_logs = [e for p in sorted(work.glob("engine*.jsonl")) for e in _lines(p)]
    eval_texts = {json.loads(x)["text"] for x in (work / "eval.jsonl").read_text().splitlines()} \
        if (work / "eval.jsonl").exists() else set()
    requests = [dict(r, prompt=" ".join(SYMBOLS[i] for i in r["input_ids"]))
                for r in engine_logs if r["kind"] == "generate"]
    return {
        "requests": [r for r in requests if r["prompt"] not in eval_texts],  # training requests
        "eval_requests": [r for r in requests if r["prompt"] in eval_texts],
        "loads": [e for e in engine_logs if e["kind"] == "load"],
        "rollouts": {e["rollout_id"]: e for e in _lines(work / "rollouts.jsonl")},
        "evals": _lines(work / "evals.jsonl"),
        "trained": _trained_by_step(_lines(work / "train.jsonl")),
    }


def _trained_by_step(entries: list[dict]) -> dict:
    """The train log per rollout id, every entry kept: the train actor logs one entry per train
    call, so a step trained twice has two, whose samples count twice (C2)."""
    out: dict = {}
    for e in entries:
        if e["rollout_id"] not in out:
            out[e["rollout_id"]] = dict(e, tokens=list(e["tokens"]), sample_indices=list(e["sample_indices"]))
            continue
        t = out[e["rollout_id"]]
        t["tokens"] += e["tokens"]
        t["sample_indices"] += e["sample_indices"]
        t["t_end"] = max(t["t_end"], e["t_end"])
    return out


# ------------------------------------------------------------------ checks: each returns its violations
def c1_violations(ev: dict) -> list[str]:
    """C1: every trained sample came from one engine request that started and ended at the one
    version the sample reports, and no group mixes versions."""
    produced: dict = defaultdict(set)
    for r in ev["requests"]:
        produced[tuple(r["input_ids"] + r["output_ids"])].add((r["version_start"], r["version_end"]))
    out = []
    for rid in ev["trained"]:
        groups: dict = defaultdict(set)
        for s in ev["rollouts"].get(rid, {}).get("samples", []):
            made = produced.get(tuple(s["tokens"]), set())
            if len(s["weight_versions"]) != 1 or made != {(s["weight_versions"][0],) * 2}:
                out.append(f"step {rid}: a sample of {s['prompt']!r} reports {s['weight_versions']}, "
                           f"engines produced it at {sorted(made)}")
            groups[s["prompt"]].update(s["weight_versions"])
        out += [f"step {rid}: group {p!r} mixes versions {sorted(v)}" for p, v in groups.items() if len(v) > 1]
    return out


def c2_violations(ev: dict, n: int) -> list[str]:
    """C2: the trainer trained exactly the samples slime handed over, each once; every group
    trained whole (n samples) in one step, no sample from a request its engine aborted (a
    truncated response); every prompt that started generating was trained or reported failed,
    never both."""
    out = []
    finished: dict = defaultdict(set)  # a response's tokens: how its requests finished
    for r in ev["requests"]:
        finished[tuple(r["input_ids"] + r["output_ids"])].add(r.get("finish") == "abort")
    trained_in: dict = defaultdict(list)
    indices: Counter = Counter()
    for rid, t in ev["trained"].items():
        samples = ev["rollouts"].get(rid, {}).get("samples", [])
        if sorted(map(tuple, t["tokens"])) != sorted(tuple(s["tokens"]) for s in samples):
            out.append(f"step {rid}: the trainer did not train what slime handed over")
        indices.update(t["sample_indices"])
        out += [f"step {rid}: a sample of {s['prompt']!r} trained from a request its engine aborted (a truncated "
                "trajectory)" for s in samples if finished.get(tuple(s["tokens"])) == {True}]
        for prompt, size in Counter(s["prompt"] for s in samples).items():
            trained_in[prompt].append(rid)
            if size != n:
                out.append(f"step {rid}: group {prompt!r} trained {size} samples of {n}")
    out += [f"sample {i} trained {c} times" for i, c in sorted(indices.items()) if c > 1]
    out += [f"group {p!r} trained in steps {steps}" for p, steps in trained_in.items() if len(steps) > 1]
    failed = {p for e in ev["rollouts"].values() for p in e.get("failed_prompts", [])}
    out += [f"group {p!r} trained and reported failed" for p in sorted(failed & set(trained_in))]
    admitted = {r["prompt"] for r in ev["requests"]}
    out += [f"group {p!r} started generating, was neither trained nor reported failed"
            for p in sorted(admitted - set(trained_in) - failed)]
    return out


def c3_violations(ev: dict, k: int, first_version: int) -> list[str]:
    """C3: every trained sample's weights were at most K steps behind the step that trained it
    (0 <= step - steps(version) <= K; a version that is no trainer's push, such as SGLang's launch
    tag, fails)."""
    out = []
    for rid in ev["trained"]:
        for s in ev["rollouts"].get(rid, {}).get("samples", []):
            for v in s["weight_versions"] or [None]:
                try:
                    behind = rid - (int(v) - first_version)
                except (TypeError, ValueError):
                    out.append(f"step {rid}: a sample of {s['prompt']!r} at version {v!r}, no trainer's push")
                    continue
                if not 0 <= behind <= k:
                    out.append(f"step {rid}: a sample of {s['prompt']!r} at version {v}: {behind} steps behind (K={k})")
    return out


# ------------------------------------------------------------------ what the run observed
def engines_retired(ev: dict, engine_events: list) -> int | None:
    """Engines dora retired, in training and in every evaluation (its counter is cumulative, and a
    retirement during the last evaluation shows only there). None where it cannot be told: no dora
    metrics (slime alone retires engines only through its health monitor, for the engines it
    launched) or an engine really died (then a retirement is no healthy engine's)."""
    metrics = [e.get("metrics", {}) for e in [*ev["rollouts"].values(), *ev["evals"]]]
    counts = [m["dora/engines_retired"] for m in metrics if "dora/engines_retired" in m]
    return max(counts) if counts and not engine_events else None


def engines_served(ev: dict) -> int:
    """Engines that served training requests."""
    return len({r["port"] for r in ev["requests"]})


def peak_concurrency(ev: dict) -> dict[int, int]:
    """Per engine, the most generate requests it ran at once (training and evaluation), from the
    start and end times the server logged."""
    edges: dict = defaultdict(list)
    for r in [*ev["requests"], *ev["eval_requests"]]:
        edges[r["port"]] += [(r["t0"], 1), (r["t1"], -1)]
    peaks = {}
    for port, es in edges.items():
        live = peak = 0
        for _, d in sorted(es):  # at equal times an end (-1) sorts before a start
            live += d
            peak = max(peak, live)
        peaks[port] = peak
    return peaks


TRANSPORTS = {"update_weights_from_disk": "disk", "update_weights_from_distributed": "nccl",
              "update_weights_from_tensor": "tensor"}


def weight_transport(ev: dict) -> str:
    """How the engines got new weights, from the endpoints their loads came through (a tag-only
    `/update_weight_version` moves no weights)."""
    used = sorted({TRANSPORTS.get(e.get("endpoint"), str(e.get("endpoint"))) for e in ev["loads"]
                   if e.get("endpoint") != "update_weight_version"})
    return "+".join(used) or "none"


def trained_loss(ev: dict) -> str | None:
    """The loss the trainer ran (slime's --loss-type), with TIS when slime's loss reported its weights."""
    kinds = {t["custom_loss"] + ("+tis" if "tis" in t["metrics"] else "") for t in ev["trained"].values()}
    return "/".join(sorted(kinds)) or None


def same_algorithm(modes: dict) -> bool:
    """One algorithm in every mode: the loss and correction settings slime parsed in each job
    (`algorithm`) and the loss each trainer ran; a mode that reported neither is no evidence."""
    runs = {(r.get("algorithm"), r.get("loss")) for r in modes.values()}
    return len(runs) == 1 and None not in next(iter(runs))


def analyze(ev: dict, result: dict, m: Mode, *, n: int, engines: int) -> dict:
    rollouts, trained = ev["rollouts"], ev["trained"]
    tokens = sum(len(t) for e in trained.values() for t in e["tokens"])  # prompt + response, as trained
    response_tokens = sum(s["response_length"] for rid in trained for s in rollouts.get(rid, {}).get("samples", []))
    violations = {"c1": c1_violations(ev), "c2": c2_violations(ev, n), "c3": c3_violations(ev, m.k, m.first_version)}
    loads = [e for e in ev["loads"] if e.get("path") and "read_s" in e]
    live, current = 1, {}
    for e in sorted(ev["loads"], key=lambda e: e["t"]):
        current[e["port"]] = e["version"]
        if len(current) == engines:
            live = max(live, len(set(current.values())))
    p99 = [e["metrics"]["dora/health_check_p99_s"] for e in [*rollouts.values(), *ev["evals"]]
           if "dora/health_check_p99_s" in e.get("metrics", {})]
    peaks = peak_concurrency(ev)
    ends = sorted((rid, t["t_end"]) for rid, t in trained.items())
    steady = None  # from the end of the first trained step to the end of the last: start-up left out
    if len(ends) > 1 and ends[-1][1] > ends[0][1]:
        later = sum(s["response_length"] for rid, _ in ends[1:] for s in rollouts.get(rid, {}).get("samples", []))
        steady = later / (ends[-1][1] - ends[0][1])
    syncs = result.get("weight_sync_s") or []
    wall = result.get("wall_s") or float("nan")
    return {
        "status": result.get("status"), "error": result.get("error", "")[-300:] or None,
        "tokens_per_s": response_tokens / wall if wall == wall and wall > 0 else None,
        "trained_tokens_per_s": tokens / wall if wall == wall and wall > 0 else None,
        "steady_tokens_per_s": steady,
        "wall_s": wall, "steps": len(trained), "engines": engines_served(ev),
        "concurrency_per_engine": [peaks[p] for p in sorted(peaks)],
        "engines_retired_while_healthy": engines_retired(ev, result.get("engine_events") or []),
        "health_check_p99_s": max(p99) if p99 else None,
        "max_live_versions": live,
        "c1_ok": bool(trained) and not violations["c1"], "c2_ok": bool(trained) and not violations["c2"],
        "c3_ok": bool(trained) and not violations["c3"], "k": m.k,
        "weight_transport": weight_transport(ev),
        "trainer_weight_sync_s_per_step": sum(syncs[1:]) / len(syncs[1:]) if len(syncs) > 1 else None,
        "loss": trained_loss(ev), "algorithm_flags": " ".join(result.get("algorithm_flags", [])) or None,
        "algorithm": result.get("algorithm"),
        "engine_loads": len(loads),
        "engine_load_s_mean": sum(e["t"] - e["t0"] for e in loads) / len(loads) if loads else None,
        "engine_read_s_mean": sum(e["read_s"] for e in loads) / len(loads) if loads else None,
        "violations": [f"{c}: {v}" for c, vs in violations.items() for v in vs[:3]],
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
    ap.add_argument("--loss", choices=("slime", "sao"), default="slime",
                    help="every mode's loss: slime's policy loss (with slime's TIS, cap 2) or SAO's (no TIS)")
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
    unknown = [m for m in o.modes.split(",") if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown mode(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(MODES)}")
    slime = os.environ.get("DORA_SLIME_PATH")
    if not slime:
        print("set DORA_SLIME_PATH to a slime checkout (624b824)", file=sys.stderr)
        return 2
    sys.path[:0] = [str(ROOT / "tests" / "slime"), str(ROOT / "tests" / "slime" / "harness")]
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
                                                                   "response_len", "step_s", "load_s", "checkpoint_mb",
                                                                   "loss")}}
    report["same_algorithm"] = same_algorithm(out)
    if not plain:
        report["weights_dir"] = weights_dir_summary(out, o.modes.split(","), kinds)
    ratios = {f"dora_over_{base}_{field}": out["dora"][field] / out[base][field]
              for base in ("slime_async", "slime_sync") for field in ("tokens_per_s", "steady_tokens_per_s")
              if "dora" in out and out["dora"][field] and out.get(base, {}).get(field)}
    if ratios:
        report["ratios"] = ratios
    print(json.dumps(report, indent=None if o.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Checks of a verl run from its own evidence: verl's logged metrics (``trainer.logger`` ``file``,
one JSON line per step) and the run reports (``dora_ext.verl.cpu.report``).

Used by ``tests/verl/test_main_ppo_cpu.py`` and ``benchmarks/verl_cpu_compare.py``; nothing here
trusts the scheduler's own bookkeeping:

* ``max_live_versions``: the most weight versions generating at the same moment on the replicas
  (from each request's start and end and the version the replica reported for it);
  (timing-dependent: two versions generate at once only while one replica still serves the old
  version when another starts the new one);
* ``trained_staleness_max``: the largest staleness of a trained group in the train reports (the
  version the actor had when it trained the group minus the version the group was generated
  under): K means a group of version v was trained after version v + 1 was published, i.e. two
  versions were live in the run at once (v's trajectories and v + 1), whatever the timing;
* ``c1_ok``: every trained trajectory spans one engine-reported version (verl's
  ``training/off_policy/trajectory_spans/max`` == 1, computed from the TransferQueue tags that
  carry the versions the servers returned) and, in mode ``dora``, the sampler's ``dora/c1_ok``;
* ``c2_ok``: mode ``dora``: the sampler's ``dora/c2_ok`` (duplicates, truncations and vanished
  groups counted from TransferQueue) on every step and no group trained twice in the train
  reports; verl's modes: no metric reporting dropped or evicted samples;
* ``c3_ok``: verl's ``training/off_policy/trajectory_staleness_worst/max`` <= K on every step
  (and ``dora/c3_ok`` in mode ``dora``);
* ``weights_checksum_ok``: every load a replica reported holds the checksum published for that
  version, and at least one version after the first was loaded;
* ``engine_checksum_ok``: every load the coordinator checked (``load_checked``: the engine's own
  checksum after the load) equals the publication's; ``subset_loads``: those checked loads made
  while a replica with no load running kept serving another version (a partial subset);
  ``old_version_loads``: those of a version older than the newest published then;
  ``requests_aborted_alone``: per-request aborts (R5 moves, a failed group's siblings); ``aborted_unasked``:
  requests that came back aborted though no per-request abort named them (0: co-resident
  requests of a migration's source were not aborted).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from .report import read_reports


def read_metrics(path: str) -> list[dict]:
    """verl's file-logger lines as ``[{"step": n, **metrics}]`` (validation lines skipped)."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            data = rec.get("data", {})
            if "timing_s/step" in data:
                out.append({"step": rec.get("step"), **data})
    return out


def max_live_versions(reports: list[dict]) -> int:
    events = []
    for r in reports:
        if r.get("kind") == "generate" and r.get("version") is not None and r.get("start") is not None:
            events.append((float(r["start"]), 1, r["version"]))
            events.append((float(r["time"]), -1, r["version"]))
    events.sort(key=lambda e: (e[0], e[1]))  # ends before starts at the same instant
    active: dict[Any, int] = {}
    best = 0
    for _, delta, version in events:
        active[version] = active.get(version, 0) + delta
        if active[version] <= 0:
            active.pop(version)
        best = max(best, len(active))
    return best


def checksum_check(reports: list[dict]) -> tuple[bool, list[str]]:
    published: dict[Any, str] = {}
    problems: list[str] = []
    loads = []
    for r in reports:
        if r.get("kind") == "publish":
            prev = published.setdefault(r["version"], r["checksum"])
            if prev != r["checksum"]:
                problems.append(f"version {r['version']} published twice with different weights")
        elif r.get("kind") == "load":
            loads.append(r)
    for r in loads:
        want = published.get(r["version"])
        if want is None:
            problems.append(f"replica {r['replica']} loaded version {r['version']}, never published")
        elif want != r["checksum"]:
            problems.append(f"replica {r['replica']} version {r['version']}: checksum {r['checksum']} != published {want}")
    versions = {r["version"] for r in loads}
    if len(versions) < 2:
        problems.append(f"loads of only {sorted(versions, key=str)}")
    return not problems, problems


def published_checksums(reports: list[dict]) -> dict[Any, str]:
    """Version -> checksum of its first publication (what the replicas must hold)."""
    out: dict[Any, str] = {}
    for r in reports:
        if r.get("kind") == "publish":
            out.setdefault(r["version"], r["checksum"])
    return out


def reference_checksum(path: str) -> str:
    """:func:`dora_ext.verl.weights.checksum` of weights written to disk by someone else than the
    publisher: a Hugging Face model folder (``*.safetensors``) or verl's FSDP actor checkpoint
    folder (``model_world_size_1_rank_0.pt``; one trainer rank only, whose DTensors hold whole
    tensors). A reference the published checksums can be compared with: the publisher's own
    checksum is taken from what it sends, so it would match wrong weights it sent."""
    import glob

    import torch

    from ..weights import checksum

    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if shards:
        from safetensors.torch import load_file

        named: dict[str, Any] = {}
        for shard in shards:
            named.update(load_file(shard))
        return checksum(named)
    ckpt = os.path.join(path, "model_world_size_1_rank_0.pt")
    if not os.path.exists(ckpt):
        raise FileNotFoundError(f"no *.safetensors and no model_world_size_1_rank_0.pt under {path}")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    named = {}
    for name, t in state.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        if tuple(local.shape) != tuple(t.shape):
            raise ValueError(f"{ckpt}: {name} is a shard {tuple(local.shape)} of {tuple(t.shape)}")
        named[name] = local
    return checksum(named)


def _all(metrics: list[dict], key: str, pred) -> bool | None:
    vals = [m[key] for m in metrics if key in m]
    if not vals:
        return None
    return all(pred(v) for v in vals)


def analyze(metrics: list[dict], reports: list[dict], *, mode: str, max_staleness: int) -> dict[str, Any]:
    """The per-run numbers and checks (see the module docstring)."""
    steps = len(metrics)
    timed = metrics[1:] if steps > 1 else metrics  # the first step includes warm-up
    step_s = sum(float(m["timing_s/step"]) for m in timed)
    tokens = sum(float(m.get("perf/total_num_tokens", 0)) for m in timed)
    spans_ok = _all(metrics, "training/off_policy/trajectory_spans/max", lambda v: int(v) == 1)
    c1 = bool(spans_ok) and all(r.get("version") is not None for r in reports if r.get("kind") == "generate")
    stale_ok = _all(metrics, "training/off_policy/trajectory_staleness_worst/max", lambda v: int(v) <= max_staleness)
    c3 = bool(stale_ok)
    if mode in ("dora", "pipeline"):
        c1 = c1 and bool(_all(metrics, "dora/c1_ok", lambda v: v == 1.0))
        c3 = c3 and bool(_all(metrics, "dora/c3_ok", lambda v: v == 1.0))
        trained = [g for r in reports if r.get("kind") == "train" for g in r["groups"]]
        c2 = bool(_all(metrics, "dora/c2_ok", lambda v: v == 1.0)) and len(trained) == len(set(trained))
    else:
        lossy = [k for m in metrics for k, v in m.items()
                 if any(w in k for w in ("dropped", "evicted", "drop_")) and isinstance(v, (int, float)) and v > 0]
        c2 = not lossy
    ok, problems = checksum_check(reports)
    losses = [m["actor/pg_loss"] for m in metrics if "actor/pg_loss" in m]
    return {
        "mode": mode,
        "steps": steps,
        "steps_per_s": (len(timed) / step_s) if step_s > 0 else 0.0,
        "tokens_per_s": (tokens / step_s) if step_s > 0 else 0.0,
        "max_live_versions": max_live_versions(reports),
        "trained_staleness_max": max((int(v) for r in reports if r.get("kind") == "train"
                                      for v in r.get("staleness", ())), default=None),
        "c1_ok": c1,
        "c2_ok": c2,
        "c3_ok": c3,
        "weights_checksum_ok": ok,
        "checksum_problems": problems[:10],
        "finite_loss": bool(losses) and all(math.isfinite(float(v)) for v in losses),
        "loads": sum(1 for r in reports if r.get("kind") == "load"),
        **load_checks(reports),
    }


def load_checks(reports: list[dict]) -> dict[str, Any]:
    checked = [r for r in reports if r.get("kind") == "load_checked"]
    asked = {r["request_id"] for r in reports if r.get("kind") == "abort_request" and "replica" in r}
    base = min((r["version"] for r in reports if r.get("kind") == "publish"), default=None)
    held: dict[Any, Any] = {}
    at_once = subset = 0
    for r in checked:  # in report order: the versions the replicas hold after each checked load
        if not held:  # before it, every replica holds the base version verl's first sync loaded
            held = {i: base for i in range(int(r["replicas"]))}
        # A partial-subset load: some replica not loading then keeps serving another version (not
        # the check of verl's first sync, which loaded every replica).
        subset += not r.get("initial") and any(i not in r["loading"] and v != r["version"] for i, v in held.items())
        held[r["instance"]] = r["version"]
        at_once = max(at_once, len(set(held.values())))
    return {
        "subset_loads": subset,
        "versions_loaded_at_once": at_once,
        "requests_aborted_alone": sum(1 for r in reports if r.get("kind") == "abort_request"
                                      and r.get("aborted") and "instance" in r),
        # Requests that came back aborted though no per-request abort named them (an abort-all).
        "aborted_unasked": sum(1 for r in reports if r.get("kind") == "generate" and r.get("stop") == "aborted"
                               and r["request_id"] not in asked),
        "checked_loads": len(checked),
        "engine_checksum_ok": bool(checked) and all(r["checksum"] == r["published"] for r in checked),
        "old_version_loads": sum(1 for r in checked if int(r["version"]) < int(r["newest"])),
        "migrations_landed": sum(1 for r in reports if r.get("kind") == "landed"),
    }


def observed_setup(reports: list[dict]) -> dict[str, Any]:
    """What a run ran on, read from its reports rather than from its settings: ``replica_ranks`` /
    ``replicas``, the replicas that loaded weights or served a request; ``weight_backend``, the
    backend whose code published the versions (``dora_store``'s weight stores, or the colocated
    handover of verl's ``naive``; several joined by ``+``, ``unknown`` for a report that does not
    say, None when nothing was published)."""
    ranks = sorted({int(r["replica"]) for r in reports if r.get("kind") in ("load", "generate") and "replica" in r})
    backends = sorted({str(r.get("backend", "unknown")) for r in reports if r.get("kind") == "publish"})
    return {"replicas": len(ranks), "replica_ranks": ranks, "weight_backend": "+".join(backends) or None}


def load_run(work: str, mode: str) -> tuple[list[dict], list[dict]]:
    """Metrics and reports of a ``recipes/verl/tiny_cpu.sh`` run in `work` (its default paths)."""
    return read_metrics(os.path.join(work, f"metrics_{mode}.jsonl")), read_reports(os.path.join(work, f"reports_{mode}"))

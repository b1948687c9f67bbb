"""The harness's own plug-ins, given to slime through slime's flags (they are the user's side of a
slime run, not stand-ins): a rule reward (`--custom-rm-path`) and evidence loggers
(`--custom-rollout-log-function-path`, `--custom-eval-rollout-log-function-path`) that record
what slime handed to the trainer, with the weight versions the engines reported."""

from __future__ import annotations

import json
from pathlib import Path


async def reward(args, sample) -> float:
    """1 when the response contains the label's symbol, else 0 (a learnable signal)."""
    return 1.0 if str(sample.label) in (sample.response or "").split() else 0.0


def _sample(s) -> dict:
    return {"index": s.index, "group_index": s.group_index, "prompt": s.prompt, "label": s.label,
            "weight_versions": [str(v) for v in s.weight_versions], "tokens": list(s.tokens),
            "response_length": s.response_length, "status": s.status.value, "reward": s.reward,
            "dora_version": (s.metadata or {}).get("dora_version")}


def log_rollout(rollout_id, args, samples, metrics, rollout_time) -> bool:
    from dora_ext.slime import rollout as dora_rollout

    session = dora_rollout._session
    failed = [] if session is None else session._failed
    flat = [s for g in samples for s in (g if isinstance(g, list) else [g])]
    entry = {"rollout_id": rollout_id, "samples": [_sample(s) for s in flat],
             "failed_groups": [str(g) for g, *_ in failed], "failed_prompts": [p for *_, p in failed],
             "metrics": {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float, str, bool))}}
    with open(Path(args.harness_dir) / "rollouts.jsonl", "a") as fh:
        fh.write(json.dumps(entry) + "\n")
    crash = getattr(args, "harness_crash_at_rollout", None)
    if crash is not None and rollout_id == crash:
        import os

        os._exit(3)  # the job dies: batch `crash` was generated, never trained
    return False


def log_eval(rollout_id, args, data, extra_metrics) -> bool:
    entry = {"rollout_id": rollout_id, "metrics": {k: v for k, v in (extra_metrics or {}).items()
                                                   if isinstance(v, (int, float, str, bool))},
             "datasets": {name: [_sample(s) for s in d["samples"]] for name, d in data.items()}}
    with open(Path(args.harness_dir) / "evals.jsonl", "a") as fh:
        fh.write(json.dumps(entry) + "\n")
    return False

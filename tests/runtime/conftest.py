"""Shared helpers for the embedded-runtime tests: a tiny recipe (a one-layer, 32-wide model, a few
steps) so that every mode runs end to end in about a second on two CPU cores."""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip("torch", reason="the embedded runtime needs torch (pip install 'dora-ext[torch]')")

TINY: dict[str, Any] = {
    "name": "tiny",
    "seed": 0,
    "steps": 4,
    "task": {"name": "long_tail", "median": 4, "cap": 12, "cv": 1.0},
    "model": {"type": "tiny", "d_model": 32, "n_layer": 1, "n_head": 2},
    "warm_start": {"steps": 10, "batch_size": 8},
    "trainer": {"algorithm": "grpo", "lr": 0.002},
    "engine": {"temperature": 1.0},
    "runtime": {"max_threads": 1, "pin": False, "stall_timeout_s": 60},
    "eval": {"prompts": 4, "samples": 1},
    "dora": {"mode": "dora", "max_staleness": 2, "batch_size": 2, "group_size": 2, "instances": 2, "capacity": 3},
}


def tiny(**sections: Any) -> dict[str, Any]:
    """A copy of TINY with some sections updated (`dora={"capacity": 4}` merges into `dora`)."""
    data = copy.deepcopy(TINY)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    return data

"""Run modes side by side (same recipe, same seeds) and write what a run leaves behind.

Modes run one after the other, seed-major: for each seed every mode starts from the same version 0
and prompt stream, so a ratio of two modes compares scheduling only and drifts hit every mode alike.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Sequence

from ..config import MODES, ConfigError
from .recipe import Recipe
from .runtime import RunResult, prepare, run


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise ConfigError("modes", f"expected a comma-separated list of modes ({', '.join(MODES)})")
    for m in modes:
        if m not in MODES:
            raise ConfigError("modes", f"unknown mode {m!r}; accepted: {', '.join(MODES)}")
    if len(set(modes)) != len(modes):
        raise ConfigError("modes", f"a mode is listed twice: {text!r}")
    return modes


class Progress:
    """A tqdm bar per run on stderr: steps, reward, tokens/s, live versions, staleness."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None

    def start(self, label: str, total: int) -> Callable[[dict], None]:
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="step", file=sys.stderr, dynamic_ncols=True, leave=True)

        def on_step(rec: dict) -> None:
            if self.bar is not None:
                self.bar.set_postfix_str(
                    f"reward {rec['reward_mean']:.3f}, {rec['throughput_tokens_per_s']:.0f} tok/s, "
                    f"versions live {rec['live_versions']}, staleness {rec['staleness_mean']:.1f}/{rec['staleness_max']}",
                    refresh=False)
                self.bar.update(1)

        return on_step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def write_steps(path: str, result: RunResult) -> None:
    """One JSON line per trainer step (design.md metric names)."""
    with open(path, "w", encoding="utf-8") as fh:
        for rec in result.steps:
            fh.write(json.dumps(jsonable(rec)) + "\n")


def jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and x != x:
        return None
    return x


def dump_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(jsonable(data), fh, indent=2)
        fh.write("\n")


def compare_modes(recipe: Recipe, modes: Sequence[str], seeds: Sequence[int], *, progress: bool = False,
                  out_dir: str | None = None,
                  on_result: Callable[[RunResult], None] | None = None) -> dict[str, list[RunResult]]:
    """Every mode on every seed (seed-major). Writes `<mode>-seed<k>.jsonl` into `out_dir` if given."""
    results: dict[str, list[RunResult]] = {m: [] for m in modes}
    bar = Progress(progress)
    for seed in seeds:
        base = recipe.with_seed(seed)
        prepared = prepare(base)
        for mode in modes:
            r = base.with_mode(mode)
            try:
                result = run(r, prepared, on_step=bar.start(f"{mode:>12} seed {seed}", r.steps))
            finally:
                bar.close()
            results[mode].append(result)
            if out_dir:
                write_steps(os.path.join(out_dir, f"{mode}-seed{seed}.jsonl"), result)
            if on_result is not None:
                on_result(result)
    return results

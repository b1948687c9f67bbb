"""Several modes side by side on one workload and seed, at equal hardware.

`compare` runs each mode with the same preset, seed and steps, fills `speedup_vs_sync` when
`sync` is among them, and with `split="auto"` optimises the rollout/trainer split per mode
(`optimize.optimise_split`: integer search from the balance point, full-length runs), as
design.md's "Equal hardware" asks of a benchmark, so no mode is stuck with a split that suits
another.
"""

from __future__ import annotations

from typing import Any, Sequence

from .presets import Preset
from .optimize import optimise_split
from .runner import RunResult, _staleness, default_steps, layout_for, simulate
from .workload import LengthSampler


def compare(
    preset: Preset,
    modes: Sequence[str],
    *,
    steps: int | None = None,
    seed: int = 0,
    max_staleness: int | None = None,
    split: tuple[int, int] | str | None = None,
    records: Any = None,
    timeline: bool = False,
    plugins: Any = None,
    config: dict[str, Any] | None = None,
    host: Any = None,
) -> dict[str, RunResult]:
    """Run `modes` side by side; returns mode -> RunResult with `speedup_vs_sync` filled.

    With `split="auto"` each split mode's rollout:trainer split is optimised (`optimise_split`,
    every candidate a full-length run); `metrics["split_search"]` lists every split evaluated
    with its throughput and `metrics["split_unimodal"]` whether they rose then fell."""
    if steps is None:  # one step count for all: long enough for the largest K among them
        steps = max(default_steps(preset, _staleness(m, max_staleness)) for m in modes)
    results: dict[str, RunResult] = {}
    for mode in modes:
        if split == "auto" and not layout_for(preset, mode, None).colocated:
            s = optimise_split(preset, mode, steps=steps, seed=seed, max_staleness=max_staleness,
                               records=records, plugins=plugins, config=config, host=host)
            res = s.result
            if timeline:
                res = simulate(preset, mode, steps=steps, seed=seed, max_staleness=max_staleness, split=s.split,
                               records=records, timeline=True, plugins=plugins, config=config, host=host)
            res.metrics["split_search"] = {f"{r}:{t}": v for (r, t), v in s.evaluated.items()}
            res.metrics["split_unimodal"] = s.unimodal
        else:
            chosen = None if split == "auto" else split
            res = simulate(preset, mode, steps=steps, seed=seed, max_staleness=max_staleness,
                           split=chosen, records=records, timeline=timeline, plugins=plugins, config=config,
                           host=host)
        results[mode] = res
    if "sync" in results:
        base = results["sync"].metrics["throughput_tokens_per_s"]
        for res in results.values():
            res.metrics["speedup_vs_sync"] = res.metrics["throughput_tokens_per_s"] / base
    return results


def calibration(preset: Preset, *, seed: int = 0, steps: int = 3, groups: int = 2000) -> dict[str, float]:
    """Measure the figures a preset is calibrated against (design.md, "Workloads").

    `rollout_share_sync` (rollout / step time of `sync`), `p99_over_median` (response lengths),
    `longest_of_group_over_mean` (a group's longest response / the mean response) and
    `tail10_time_share` (share of a sync rollout taken by its last 10% of trajectories).
    """
    sampler = LengthSampler(preset.workload, seed)
    lengths: list[int] = []
    longest = []
    for g in range(groups):
        d = sampler.draw(g)
        lengths.extend(d.response_tokens)
        longest.append(max(d.response_tokens))
    lengths.sort()
    mean = sum(lengths) / len(lengths)
    p99 = lengths[min(len(lengths) - 1, int(0.99 * len(lengths)))]
    median = lengths[len(lengths) // 2]
    res = simulate(preset, "sync", steps=steps, seed=seed, timeline=True)
    m = res.metrics
    return {
        "rollout_share_sync": m["rollout_share"],
        "sync_step_s": m["step_time_s"],
        "sync_rollout_s": m["rollout_s"],
        "p99_over_median": p99 / median,
        "longest_of_group_over_mean": sum(longest) / len(longest) / mean,
        "tail10_time_share": res.tail10_time_share,
        "mean_response": mean,
    }

"""Several modes side by side on one workload and seed, at equal hardware.

`compare` runs each mode with the same preset, seed and steps, fills `speedup_vs_sync` when
`sync` is among them, and with `split="auto"` searches the rollout/trainer split per mode and keeps
the best, as design.md's "Equal hardware" asks of a benchmark. The search starts at the split
where the rollout pool at full occupancy and the trainer finish a step's work in the same time
(the ideal's balance point) and tries splits around it, so no mode is stuck with a split that
suits another.
"""

from __future__ import annotations

from typing import Any, Sequence

from .presets import Preset
from .runner import RunResult, layout_for, simulate, ideal_step_work
from .workload import LengthSampler


def balanced_rollout_accelerators(preset: Preset, seed: int = 0, groups: int = 256, records: Any = None) -> float:
    """Rollout accelerators at which full-occupancy rollout and training take equally long."""
    sampler = LengthSampler(preset.workload, seed, records)
    draws = [sampler.draw(g) for g in range(groups)]
    roll, train, _ = ideal_step_work(preset, [(0, d.prompt_tokens, d.response_tokens) for d in draws])
    train += preset.trainer.optimizer_acc_s * groups / preset.batch_size
    return preset.accelerators * roll / (roll + train)


def candidate_splits(preset: Preset, seed: int = 0, records: Any = None) -> list[tuple[int, int]]:
    """Splits `(R, T)` to try: from 0.85x to 2.1x the balance point, in whole instances.

    Above the balance point because a long tail needs spare rollout slots; `search_split`
    refines between the best of these and its neighbours."""
    g, tp = preset.accelerators, preset.engine.accelerators
    if g // tp <= 8:  # a small cluster: try every whole-instance split
        return [(r, g - r) for r in range(tp, g, tp)]
    base = balanced_rollout_accelerators(preset, seed, records=records)
    out: list[tuple[int, int]] = []
    for f in (0.85, 1.0, 1.2, 1.45, 1.75, 2.1):
        r = max(tp, min(g - 1, round(base * f / tp) * tp))
        r = (r // tp) * tp
        if r >= tp and g - r >= 1 and (r, g - r) not in out:
            out.append((r, g - r))
    return out


def search_split(
    preset: Preset,
    mode: str,
    *,
    steps: int,
    seed: int,
    max_staleness: int | None,
    records: Any = None,
    plugins: Any = None,
    config: dict[str, Any] | None = None,
) -> tuple[tuple[int, int], dict[str, float]]:
    """The split with the highest throughput for `mode`, and every split's throughput."""
    tried: dict[tuple[int, int], float] = {}

    def run(split: tuple[int, int]) -> float:
        if split not in tried:
            res = simulate(preset, mode, steps=steps, seed=seed, max_staleness=max_staleness,
                           split=split, records=records, plugins=plugins, config=config)
            tried[split] = res.metrics["throughput_tokens_per_s"]
        return tried[split]

    grid = candidate_splits(preset, seed, records)
    for s in grid:
        run(s)
    # Refine between the best grid point and its neighbours.
    best = max(tried, key=tried.get)
    i = grid.index(best)
    tp = preset.engine.accelerators
    for j in (i - 1, i + 1):
        if 0 <= j < len(grid):
            mid = ((best[0] + grid[j][0]) // (2 * tp)) * tp
            if mid >= tp and (mid, preset.accelerators - mid) not in tried:
                run((mid, preset.accelerators - mid))
    best = max(tried, key=tried.get)
    return best, {f"{r}:{t}": v for (r, t), v in sorted(tried.items())}


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
    search_steps: int | None = None,
    plugins: Any = None,
    config: dict[str, Any] | None = None,
) -> dict[str, RunResult]:
    """Run `modes` side by side; returns mode -> RunResult with `speedup_vs_sync` filled.

    The split search runs `search_steps` steps per candidate: all `steps` when the workload is
    small (up to 60,000 trajectories a run), else 8, enough to pass the warm-up."""
    steps = steps or preset.default_steps
    if search_steps is None:
        small = preset.batch_size * preset.workload.group_size * steps <= 60_000
        search_steps = steps if small else min(steps, 8)
    results: dict[str, RunResult] = {}
    for mode in modes:
        chosen = split
        searched = None
        if split == "auto":
            if layout_for(preset, mode, None).colocated:
                chosen = None
            else:
                chosen, searched = search_split(
                    preset, mode, steps=search_steps, seed=seed, max_staleness=max_staleness,
                    records=records, plugins=plugins, config=config,
                )
        res = simulate(preset, mode, steps=steps, seed=seed, max_staleness=max_staleness,
                       split=chosen, records=records, timeline=timeline, plugins=plugins, config=config)
        if searched is not None:
            res.metrics["split_search"] = searched
        results[mode] = res
    if "sync" in results:
        base = results["sync"].metrics["throughput_tokens_per_s"]
        for res in results.values():
            res.metrics["speedup_vs_sync"] = res.metrics["throughput_tokens_per_s"] / base
    return results


def calibration(preset: Preset, *, seed: int = 0, steps: int = 3, groups: int = 2000) -> dict[str, float]:
    """Measure the figures a preset is calibrated against (design.md, "Workloads").

    - `rollout_share_sync`: rollout time / step time of mode `sync` (DORA: 50-80%; verl DAPO-32B
      ~70%; Seer 63-84%).
    - `p99_over_median`: response-length p99 / median (design.md: about 10x).
    - `longest_of_group_over_mean`: mean over groups of the group's longest response / the
      mean response (design.md: ~5x for 16 samples).
    - `tail10_time_share`: share of a sync rollout taken by its last 10% of trajectories (Seer:
      up to 50%).
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

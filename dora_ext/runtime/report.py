"""Reports of the embedded runtime: the side-by-side table, the JSON of `compare`, and the plots.

The timeline is drawn like the simulator's (`dora_ext.sim.plot`, whose helpers it reuses), with
one lane per instance (real runs have few).
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Sequence

from .runtime import RunResult

#: per-mode keys of `compare --json`
JSON_KEYS = ("throughput_tokens_per_s", "speedup_vs_sync", "final_reward_mean", "final_reward_std",
             "staleness_max", "staleness_mean", "c1_ok", "c2_ok", "c3_ok")


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _std(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _sum_hists(hists: Any) -> dict[int, int]:
    out: dict[int, int] = {}
    for h in hists:
        for k, c in h.items():
            out[int(k)] = out.get(int(k), 0) + c
    return dict(sorted(out.items()))


def aggregate(results: dict[str, list[RunResult]]) -> dict[str, dict[str, Any]]:
    """Per mode over its seeds. `speedup_vs_sync` is the mean over seeds of the per-seed ratio to
    `sync` on the same seed (the runs of one seed share their start weights and prompts), None
    without a `sync` run."""
    sync = {r.seed: r.metrics["throughput_tokens_per_s"] for r in results.get("sync", [])}
    out: dict[str, dict[str, Any]] = {}
    for mode, runs in results.items():
        thr = [r.metrics["throughput_tokens_per_s"] for r in runs]
        ratios = [r.metrics["throughput_tokens_per_s"] / sync[r.seed] for r in runs if sync.get(r.seed)]
        final = [r.metrics["final_reward"] for r in runs]
        hist = _sum_hists(r.metrics["staleness_hist"] for r in runs)
        out[mode] = {
            "throughput_tokens_per_s": _mean(thr),
            "speedup_vs_sync": _mean(ratios) if ratios else None,
            "final_reward_mean": _mean(final),
            "final_reward_std": _std(final),
            "staleness_max": max(r.metrics["staleness_max"] for r in runs),
            # trained staleness over every seed's groups (`k - version` of each group trained in step k)
            "staleness_mean": sum(k * c for k, c in hist.items()) / max(1, sum(hist.values())),
            "staleness_hist": hist,
            "c1_ok": all(r.metrics["c1_ok"] for r in runs),
            "c2_ok": all(r.metrics["c2_ok"] for r in runs),
            "c3_ok": all(r.metrics["c3_ok"] for r in runs),
            # context for the table and compare.json (not in the --json line)
            "initial_reward_mean": _mean([r.metrics["initial_reward"] for r in runs]),
            "final_rewards": final,
            "trainer_wait_ratio": _mean([r.metrics["trainer_wait_ratio"] for r in runs]),
            "rollout_bubble_ratio": _mean([r.metrics["rollout_bubble_ratio"] for r in runs]),
            "multi_version_trajectory_share": _mean([r.metrics["multi_version_trajectory_share"] for r in runs]),
            "live_versions_max": max(r.metrics["live_versions_max"] for r in runs),
            "migrations": sum(r.metrics["migrations"] for r in runs),
            # of those, the sequences their destination took in (the rest finished first, or were lost)
            "migrations_landed": sum(r.metrics.get("migrations_landed", 0) for r in runs),
            "weight_loads": sum(r.metrics["weight_loads"] for r in runs),
            "max_staleness": runs[0].max_staleness,
            "split": runs[0].split,
            "core_assignment": runs[0].metrics.get("core_assignment", ""),
            "seeds": [r.seed for r in runs],
        }
    return out


def json_view(recipe_name: str, agg: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Exactly the object `compare --json` prints."""
    return {"recipe": recipe_name, "modes": {m: {k: a[k] for k in JSON_KEYS} for m, a in agg.items()}}


def table(agg: dict[str, dict[str, Any]]) -> str:
    """The side-by-side table (one column per mode)."""
    rows = [
        ("split (rollout:trainer cores)", lambda a: a["split"]),
        ("K (max staleness)", lambda a: str(a["max_staleness"])),
        ("throughput (tokens/s)", lambda a: f"{a['throughput_tokens_per_s']:.0f}"),
        ("speedup vs sync", lambda a: "-" if a["speedup_vs_sync"] is None else f"{a['speedup_vs_sync']:.2f}x"),
        ("trainer wait ratio", lambda a: f"{a['trainer_wait_ratio']:.2f}"),
        ("rollout bubble ratio", lambda a: f"{a['rollout_bubble_ratio']:.2f}"),
        ("reward: initial", lambda a: f"{a['initial_reward_mean']:.3f}"),
        ("reward: final (mean)", lambda a: f"{a['final_reward_mean']:.3f}"),
        ("reward: final (std)",
         lambda a: f"{a['final_reward_std']:.3f}" if len(a["final_rewards"]) > 1 else "n/a (1 seed)"),
        ("staleness max", lambda a: str(a["staleness_max"])),
        ("staleness mean (trained)", lambda a: f"{a['staleness_mean']:.2f}"),
        ("staleness: groups per value", lambda a: " ".join(f"{k}:{c}" for k, c in a["staleness_hist"].items())),
        ("multi-version trajectories", lambda a: f"{a['multi_version_trajectory_share']:.1%}"),
        ("live versions (max)", lambda a: str(a["live_versions_max"])),
        ("migrations (landed)", lambda a: f"{a['migrations']} ({a.get('migrations_landed', 0)})"),
        ("weight loads", lambda a: str(a["weight_loads"])),
        ("C1 one version per trajectory", lambda a: _ok(a["c1_ok"])),
        ("C2 every group trained once", lambda a: _ok(a["c2_ok"])),
        ("C3 staleness <= K", lambda a: _ok(a["c3_ok"])),
    ]
    modes = list(agg)
    width = max(len(r[0]) for r in rows)
    cols = [max(len(m), *(len(f(agg[m])) for _, f in rows)) for m in modes]
    lines = [" " * width + "  " + "  ".join(m.rjust(c) for m, c in zip(modes, cols))]
    for name, f in rows:
        lines.append(name.ljust(width) + "  " + "  ".join(f(agg[m]).rjust(c) for m, c in zip(modes, cols)))
    lines.append("core assignment (CPU affinity the workers reported):")
    for m in modes:
        lines.append(f"  {m}: {agg[m].get('core_assignment') or '?'}")
    return "\n".join(lines)


def _ok(v: bool) -> str:
    return "yes" if v else "NO"


# ---------------------------------------------------------------------------------- plots
def plot_rewards(results: dict[str, list[RunResult]], path: str, *, title: str = "") -> None:
    """Training reward per step (mean over seeds, band = min..max), and the held-out reward of the
    initial and final policies as markers at the ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (mode, runs) in enumerate(results.items()):
        colour = plt.get_cmap("tab10").colors[i % 10]
        n = min(len(r.steps) for r in runs)
        if n == 0:
            continue
        per_step = [[r.steps[k]["reward_mean"] for r in runs] for k in range(n)]
        xs = list(range(n))
        ax.plot(xs, [_mean(v) for v in per_step], color=colour, label=f"{mode} (train batch)")
        if len(runs) > 1:
            ax.fill_between(xs, [min(v) for v in per_step], [max(v) for v in per_step], color=colour, alpha=0.15)
        final = [r.metrics["final_reward"] for r in runs]
        ax.errorbar([n - 1 + 0.3 + 0.2 * i], [_mean(final)], yerr=[_std(final)], fmt="s", color=colour,
                    label=f"{mode} held-out, final")
    init = [r.metrics["initial_reward"] for runs in results.values() for r in runs]
    ax.axhline(_mean(init), color="grey", ls="--", lw=1, label="held-out, initial policy")
    _finish_reward_plot(plt, fig, ax, "trainer step", title, path)


def _finish_reward_plot(plt: Any, fig: Any, ax: Any, xlabel: str, title: str | None, path: str) -> None:
    """Labels, legend and title of a reward plot, then write it to `path` and close the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("reward")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def smoothed(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what there is)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def time_to_reward(result: RunResult, target: float, window: int) -> float | None:
    """Wall time at which the run's smoothed training-batch reward first reaches `target` (None if
    never). Only full windows count: the first batches of an asynchronous mode hold the groups
    that finished first (short answers, higher reward), which a partial window would overweight."""
    ys = smoothed([s["reward_mean"] for s in result.steps], window)
    for i, (s, y) in enumerate(zip(result.steps, ys)):
        if i + 1 >= min(window, len(ys)) and y >= target:
            return s["time_s"]
    return None


def published_times(result: RunResult) -> dict[int, float]:
    """Version -> the wall time it was published: version 0 at 0, version v + 1 when step v ended."""
    published = {0: 0.0}
    for s in result.steps:
        published[s["step"] + 1] = s["time_s"]
    return published


def policy_rewards(result: RunResult) -> list[tuple[float, float]]:
    """(time, reward) per trainer step (whose generating version's publication is in the run),
    sorted by time: the batch's mean reward, placed at the wall time at which the version that
    generated it was published (version 0 at 0, version v + 1 when step v ended; a batch of mean
    staleness s trained at step k came from version k - s, interpolated). A stale batch thus
    counts for the policy that produced it, not for the step that trained it, and every mode's
    curve reads "reward of the policy of time t"."""
    published = published_times(result)
    points = []
    for s in result.steps:
        v = s["step"] - s.get("staleness_mean", 0.0)
        lo = math.floor(v)
        if lo not in published or (v > lo and lo + 1 not in published):
            continue
        t = published[lo] + (v - lo) * (published[lo + 1] - published[lo]) if v > lo else published[lo]
        points.append((t, s["reward_mean"]))
    return sorted(points)


def mean_over(points: Sequence[tuple[float, float]], t0: float, t1: float) -> float | None:
    """The time-average over [t0, t1] of the piecewise-linear curve through `points` ((time, value),
    sorted; values at one time are averaged): the same span weighs the same for a mode that steps
    twice as often. None unless the points cover [t0, t1] (t0 < t1)."""
    merged: dict[float, list[float]] = {}
    for t, y in points:
        merged.setdefault(t, []).append(y)
    xs = sorted(merged)
    if not xs or t1 <= t0 or xs[0] > t0 or xs[-1] < t1:
        return None
    ys = [sum(merged[x]) / len(merged[x]) for x in xs]

    def at(t: float) -> float:
        i = bisect.bisect_left(xs, t)
        if xs[i] == t:
            return ys[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (t - xs[i - 1]) / (xs[i] - xs[i - 1])

    knots = [t0] + [x for x in xs if t0 < x < t1] + [t1]
    vals = [at(x) for x in knots]
    area = sum((knots[i + 1] - knots[i]) * (vals[i] + vals[i + 1]) / 2 for i in range(len(knots) - 1))
    return area / (t1 - t0)


def plot_reward_vs_time(results: dict[str, list[RunResult]], path: str, *, title: str = "",
                        window: int = 20) -> None:
    """The users' question, "does it reach the same reward sooner?": training-batch reward
    (moving average over `window` steps) against wall time, one line per seed, one colour per
    mode; the held-out reward of each run's final policy as a marker at its end time, the initial
    policy's as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (mode, runs) in enumerate(results.items()):
        colour = plt.get_cmap("tab10").colors[i % 10]
        for j, r in enumerate(runs):
            if not r.steps:
                continue
            ts = [s["time_s"] for s in r.steps]
            ys = smoothed([s["reward_mean"] for s in r.steps], window)
            ax.plot(ts, ys, color=colour, lw=1.2, alpha=0.85,
                    label=f"{mode} (train batch, {window}-step mean)" if j == 0 else None)
            ax.plot([ts[-1]], [r.metrics["final_reward"]], "s", color=colour, ms=6,
                    label=f"{mode} held-out, final" if j == 0 else None)
    init = [r.metrics["initial_reward"] for runs in results.values() for r in runs]
    if init:
        ax.axhline(_mean(init), color="grey", ls="--", lw=1, label="held-out, initial policy")
    _finish_reward_plot(plt, fig, ax, "wall time (s)", title, path)


def plot_timeline(results: dict[str, RunResult], path: str, *, title: str = "", bins: int = 1200) -> None:
    """One panel per mode: instance lanes by version, trainer lane, staleness histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Patch

    from ..sim.plot import _BUSY, _EMPTY, _IDLE, _LOADING, lane_states, trainer_states

    palette = [tuple(c[:3]) for c in plt.get_cmap("tab10").colors]
    lut = {-3: _EMPTY, -2: _IDLE, -1: _LOADING, **{v: palette[v] for v in range(10)}}
    t_max = max(r.t_end for r in results.values()) or 1.0
    modes = list(results)
    fig, axes = plt.subplots(len(modes), 2, figsize=(14, 1.2 + 1.1 * len(modes) * 2), squeeze=False,
                             gridspec_kw={"width_ratios": [6, 1]})
    top = 0
    for row, mode in enumerate(modes):
        r = results[mode]
        ax, hx = axes[row]
        logs = r.instance_logs or [[]]
        states = lane_states(logs, t_max, bins, len(logs))
        lanes = states.shape[0]
        after = (np.arange(bins) + 0.5) * (t_max / bins) > r.t_end
        states[:, after] = -3
        img = np.ones((lanes + 2, bins, 3))
        for code, colour in lut.items():
            img[:lanes][states == code] = colour
        tb = trainer_states(r.trainer_busy, t_max, bins)
        img[lanes + 1, :] = np.where(tb[:, None], np.array(_BUSY), np.array(_IDLE))
        img[lanes + 1, after] = _EMPTY
        ax.imshow(img, aspect="auto", interpolation="nearest", origin="lower", extent=(0, t_max, 0, img.shape[0]))
        ax.axvline(r.t_end, color="red", lw=1)
        ax.set_yticks([i + 0.5 for i in range(lanes)] + [lanes + 1.5])
        ax.set_yticklabels([f"instance {i}" for i in range(lanes)] + ["trainer"], fontsize=7)
        m = r.metrics
        sp = m.get("speedup_vs_sync")
        ax.set_title(f"{mode} (K={r.max_staleness}, cores {r.split}): {m['throughput_tokens_per_s']:.0f} tok/s"
                     + (f", {sp:.2f}x sync" if sp else "")
                     + f", trainer waits {m['trainer_wait_ratio']:.0%}, bubble {m['rollout_bubble_ratio']:.0%}",
                     fontsize=9, loc="left")
        ax.set_xlim(0, t_max)
        hist = m["staleness_hist"]
        ks = sorted(int(k) for k in hist)
        hx.bar(ks, [hist[k] for k in ks], color="tab:purple")
        hx.set_xticks(range(0, (max(ks) if ks else 0) + 1))
        hx.set_title("staleness (groups)", fontsize=8)
        hx.tick_params(labelsize=7)
        top = max(top, *(c for log in logs for _, c in log), 0)
    axes[-1][0].set_xlabel("wall time (s)")
    handles = [Patch(color=_LOADING, label="loading weights"), Patch(color=_IDLE, label="idle"),
               Patch(color=_BUSY, label="trainer busy")]
    handles += [Patch(color=palette[v], label=f"version = {v} mod 10") for v in range(min(10, top + 1))]
    fig.legend(handles=handles, loc="lower center", ncol=min(7, len(handles)), fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)

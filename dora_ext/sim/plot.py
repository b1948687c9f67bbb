"""Timeline plot of a comparison: one panel per mode, read at a glance.

Each panel shows one lane per rollout instance, coloured by the version it serves (ten colours
cycling), black while loading weights, grey while idle; a trainer lane on top; the staleness
histogram of the trained groups to the right. All panels share the time axis.

The data are downsampled: time into `bins` columns and instances into at most `max_lanes` lanes
(each the most common state of its instances), so 1,000 instances plot as fast as ten.
"""

from __future__ import annotations

from typing import Any

_IDLE = (0.82, 0.82, 0.82)
_LOADING = (0.0, 0.0, 0.0)
_EMPTY = (1.0, 1.0, 1.0)
_BUSY = (0.10, 0.45, 0.20)


def lane_states(logs: list[list[tuple[float, int]]], t_max: float, bins: int, max_lanes: int):
    """(lanes x bins) array of display codes: -3 empty, -2 idle, -1 loading, 0..9 version mod 10."""
    import numpy as np

    centres = (np.arange(bins) + 0.5) * (t_max / bins)
    per_inst = np.full((len(logs), bins), -3, dtype=np.int16)
    for i, log in enumerate(logs):
        if not log:
            continue
        times = np.fromiter((t for t, _ in log), dtype=float, count=len(log))
        codes = np.fromiter((c for _, c in log), dtype=np.int64, count=len(log))
        codes = np.where(codes >= 0, codes % 10, codes)
        idx = np.searchsorted(times, centres, side="right") - 1
        per_inst[i] = np.where(idx >= 0, codes[np.clip(idx, 0, None)], -3)
    n = len(logs)
    lanes = min(n, max_lanes)
    edges = np.linspace(0, n, lanes + 1).astype(int)
    out = np.empty((lanes, bins), dtype=np.int16)
    values = np.arange(-3, 10)
    for j in range(lanes):
        block = per_inst[edges[j]:edges[j + 1]]
        counts = np.stack([(block == v).sum(axis=0) for v in values])
        out[j] = values[counts.argmax(axis=0)]
    return out


def trainer_states(busy: list[tuple[float, float]], t_max: float, bins: int):
    """Boolean array: is the trainer busy at each column's centre."""
    import numpy as np

    centres = (np.arange(bins) + 0.5) * (t_max / bins)
    if not busy:
        return np.zeros(bins, dtype=bool)
    starts = np.array([a for a, _ in busy])
    ends = np.array([b for _, b in busy])
    idx = np.searchsorted(starts, centres, side="right") - 1
    return (idx >= 0) & (centres < ends[np.clip(idx, 0, None)])


def plot_timelines(results: dict[str, Any], path: str, *, title: str = "", bins: int = 800, max_lanes: int = 64) -> None:
    """Write the comparison's timeline PNG to `path` (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Patch

    palette = [tuple(c[:3]) for c in plt.get_cmap("tab10").colors]
    lut = {-3: _EMPTY, -2: _IDLE, -1: _LOADING, **{v: palette[v] for v in range(10)}}
    t_max = max(r.t_end for r in results.values()) or 1.0
    modes = list(results)
    fig, axes = plt.subplots(
        len(modes), 2, figsize=(14, 2.6 * len(modes) + 0.8), squeeze=False,
        gridspec_kw={"width_ratios": [6, 1]},
    )
    for row, mode in enumerate(modes):
        r = results[mode]
        ax, hx = axes[row]
        logs = r.instance_logs or []
        if logs:
            states = lane_states(logs, t_max, bins, max_lanes)
        else:
            states = np.full((1, bins), -3, dtype=np.int16)
        lanes = states.shape[0]
        after = (np.arange(bins) + 0.5) * (t_max / bins) > r.t_end
        states[:, after] = -3  # nothing happens after this mode's last step
        trainer_rows = max(1, lanes // 8)
        img = np.ones((lanes + 1 + trainer_rows, bins, 3))
        for code, colour in lut.items():
            img[:lanes][states == code] = colour
        tb = trainer_states(r.trainer_busy, t_max, bins)
        img[lanes + 1:, :] = np.where(tb[None, :, None], np.array(_BUSY), np.array(_IDLE))
        img[lanes + 1:, after] = _EMPTY
        ax.imshow(img, aspect="auto", interpolation="nearest", origin="lower",
                  extent=(0, t_max, 0, img.shape[0]))
        ax.axvline(r.t_end, color="red", lw=1)
        ax.set_yticks([lanes / 2, lanes + 1 + trainer_rows / 2])
        n = len(logs)
        ax.set_yticklabels([f"{n} instances" + (f"\n({lanes} lanes)" if lanes < n else ""), "trainer"])
        m = r.metrics
        sp = m.get("speedup_vs_sync")
        ax.set_title(
            f"{mode} (K={r.max_staleness}, {r.layout.split}): {m['throughput_tokens_per_s']:.0f} tok/s"
            + (f", {sp:.2f}x sync" if sp else "") + f", efficiency {m['efficiency']:.2f}",
            fontsize=9, loc="left",
        )
        hist = m["staleness_hist"]
        ks = sorted(hist)
        hx.bar(ks, [hist[k] for k in ks], color="tab:purple")
        hx.set_xticks(range(0, (max(ks) if ks else 0) + 1))
        hx.set_title("staleness (groups)", fontsize=8)
        hx.tick_params(labelsize=7)
    axes[-1][0].set_xlabel("virtual time (s)")
    for row in range(len(modes)):
        axes[row][0].set_xlim(0, t_max)
    handles = [Patch(color=_LOADING, label="loading"), Patch(color=_IDLE, label="idle"),
               Patch(color=_BUSY, label="trainer busy")]
    handles += [Patch(color=palette[v], label=f"version = {v} mod 10") for v in range(min(10, _max_version(results) + 1))]
    fig.legend(handles=handles, loc="lower center", ncol=min(7, len(handles)), fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _max_version(results: dict[str, Any]) -> int:
    best = 0
    for r in results.values():
        for log in r.instance_logs or []:
            for _, c in log:
                if c > best:
                    best = c
    return best

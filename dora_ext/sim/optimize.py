"""The rollout:trainer split and K as an answer: an integer split optimiser and a recommender.

`optimise_split` finds the integer split (whole rollout instances; the trainer gets the rest of
the G accelerators) with the highest throughput for one mode and K, every candidate evaluated by
a full-length simulation of the real scheduler (`steps` as given, by default the preset's).

It assumes throughput is unimodal in the rollout instance count (rollout-bound below the balance,
trainer-bound above): it brackets the maximum by doubling steps from the balance point, narrows it
by golden-section search, then climbs among the best point's neighbours (two instances, or 1/32
of the range) to catch a small wiggle. `SplitSearch.unimodal` says whether the evaluated points
rise then fall (within `tolerance`); the tests compare it with a brute-force scan.

`recommend` answers "which mode, K and split": for each candidate (mode, K) up to a staleness
budget it optimises the split, keeps the runs that hold C1-C3, and ranks them by efficiency
(throughput over the preset's physical limit); among those within `EFFICIENCY_TIE` (1%) of the
best it picks the lowest mean trained staleness. Modes that break C1 by construction (`partial`,
`UNPICKED_MODES`) are evaluated and shown with their costs but never picked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..config import ELASTIC_MODES, MODES
from .presets import Preset
from .runner import RunResult, _staleness, layout_for, min_steps, simulate
from .workload import LengthSampler, WorkloadError

_GOLD = 0.3819660112501051  # 2 - golden ratio

#: Modes evaluated and shown but never recommended: they do not keep C1 by construction.
UNPICKED_MODES = ("partial",)
#: `recommend`: candidates this close to the best efficiency are ranked by mean staleness.
EFFICIENCY_TIE = 0.01


@dataclass
class SplitSearch:
    """The result of `optimise_split`: the best split, its run, and every split evaluated."""

    mode: str
    max_staleness: int
    split: tuple[int, int] | None  # (R, T) accelerators; None when the mode is colocated
    result: RunResult
    evaluated: dict[tuple[int, int], float] = field(default_factory=dict)  # split -> throughput
    results: dict[tuple[int, int], RunResult] = field(default_factory=dict)
    unimodal: bool = True

    @property
    def runs(self) -> int:
        return len(self.evaluated)


def balanced_instances(preset: Preset, seed: int = 0, records: Any = None, groups: int = 256) -> float:
    """Rollout instances at which full-occupancy rollout and training of a step take equally long."""
    from .runner import ideal_step_work

    sampler = LengthSampler(preset.workload, seed, records)
    draws = [sampler.draw(g) for g in range(groups)]
    roll, train, _ = ideal_step_work(preset, [(0, d.prompt_tokens, d.response_tokens) for d in draws])
    train += preset.trainer.optimizer_acc_s * groups / preset.batch_size
    return preset.accelerators * roll / (roll + train) / preset.engine.accelerators


def latency_floor(preset: Preset, max_staleness: int, seed: int = 0, records: Any = None,
                  batches: int = 8) -> dict[str, float]:
    """How far a staleness bound `K` lets any schedule get on this workload: a step-time floor.

    A group admitted at version `v` must be trained by step `v + K`, so the `K + 1` steps from
    publishing `v` to `v + K + 1` last at least its longest trajectory run alone on an instance
    (prefill, then `a + b + c * context` per token), plus an optimizer step and a broadcast. Over
    the first `batches` versions of `B` groups, the mean step lasts at least the mean of
    `(longest lone latency + optimizer + broadcast) / (K + 1)`. `ideal_step_s` is the step time at
    `ideal_throughput`; `efficiency_cap` = `min(1, ideal / floor)`. An estimate for reading
    results, not a metric of a run.
    """
    from .runner import ideal_step_work

    ec, tc = preset.engine, preset.trainer
    sampler = LengthSampler(preset.workload, seed, records)
    floors, ideal = [], []
    gid = 0
    for _ in range(batches):
        draws = [sampler.draw(gid + i) for i in range(preset.batch_size)]
        gid += preset.batch_size
        worst = 0.0
        for d in draws:
            p = d.prompt_tokens
            for L in d.response_tokens:
                lone = p * ec.prefill_s_per_token + L * (ec.decode_a_s + ec.decode_b_s) + ec.decode_c_s * (
                    L * p + 0.5 * L * (L - 1))
                worst = max(worst, lone)
        floors.append((worst + tc.optimizer_acc_s / preset.accelerators + tc.broadcast_s) / (max_staleness + 1))
        roll, train, _ = ideal_step_work(preset, [(0, d.prompt_tokens, d.response_tokens) for d in draws])
        ideal.append((roll + train + tc.optimizer_acc_s) / preset.accelerators)
    floor = sum(floors) / len(floors)
    ideal_s = sum(ideal) / len(ideal)
    return {"max_staleness": max_staleness, "step_floor_s": floor, "ideal_step_s": ideal_s,
            "efficiency_cap": min(1.0, ideal_s / floor)}


def is_unimodal(points: dict[int, float], tolerance: float = 0.002) -> bool:
    """Do `points` (x -> value) rise to their maximum and fall after it, within `tolerance`?"""
    xs = sorted(points)
    if len(xs) < 3:
        return True
    best = max(xs, key=lambda x: points[x])
    for a, b in zip(xs, xs[1:]):
        if b <= best and points[b] < points[a] * (1 - tolerance):
            return False
        if a >= best and points[b] > points[a] * (1 + tolerance):
            return False
    return True


def optimise_split(
    preset: Preset,
    mode: str,
    *,
    steps: int | None = None,
    seed: int = 0,
    max_staleness: int | None = None,
    records: Any = None,
    config: dict[str, Any] | None = None,
    start: int | None = None,
    plugins: Any = None,
    runner: Callable[..., RunResult] | None = None,
    exhaustive: int = 8,
    cache: dict | None = None,
    host: Any = None,
) -> SplitSearch:
    """The integer split with the highest throughput for `mode` (see the module docstring).

    `start` (rollout instances) seeds the search (default: the workload's balance point). A
    cluster with at most `exhaustive` rollout instance counts is scanned whole (exact). A
    colocated mode has no split: it runs once. `cache` (a caller's dict) reuses identical runs.
    """
    run_one = runner or simulate
    tp, g = preset.engine.accelerators, preset.accelerators
    if steps is not None:
        k = _staleness(mode, max_staleness)
        if steps < min_steps(k):
            raise WorkloadError(
                f"steps: {steps} is too few to rank {mode} K={k} splits; expected >= {min_steps(k)} "
                f"(5 * (K + 2): shorter runs measure a burst after a long tail, not a steady state), "
                f"or leave it unset for the default")
    kw = dict(steps=steps, seed=seed, max_staleness=max_staleness, records=records, config=config, plugins=plugins)
    if host is not None:
        kw["host"] = host
    if layout_for(preset, mode, None).colocated:
        res = run_one(preset, mode, split=None, **kw)
        return SplitSearch(mode, res.max_staleness, None, res)
    n_max = (g - 1) // tp  # the trainer keeps at least one accelerator
    if n_max < 1:
        raise WorkloadError(f"split: {preset.name} has {g} accelerators, too few for a rollout instance of {tp} and a trainer")
    thr: dict[int, float] = {}
    res_by_n: dict[int, RunResult] = {}

    memo = None
    if cache is not None and runner is None and records is None and plugins is None:
        memo = (id(preset), mode, steps, seed, max_staleness, tuple(sorted((config or {}).items())), str(host))

    def f(n: int) -> float:
        if n not in thr:
            key = None if memo is None else (*memo, n)
            r = cache.get(key) if key is not None else None
            if r is None:
                r = run_one(preset, mode, split=(n * tp, g - n * tp), **kw)
                if key is not None:
                    cache[key] = r
            res_by_n[n] = r
            thr[n] = r.metrics["throughput_tokens_per_s"]
        return thr[n]

    if n_max <= exhaustive:
        for n in range(1, n_max + 1):
            f(n)
        start = 1
    if start is None:
        start = round(balanced_instances(preset, seed, records))
    x = min(n_max, max(1, start))
    # Bracket: step towards the better neighbour with doubling steps until the value falls.
    lo, hi = max(1, x - 1), min(n_max, x + 1)
    if f(hi) >= f(x) and hi > x:
        direction = 1
    elif f(lo) > f(x) and lo < x:
        direction = -1
    else:
        direction = 0
    if direction:
        prev, cur, step = x, x + direction, 1
        while True:
            nxt = min(n_max, max(1, cur + direction * step * 2))
            if nxt == cur or f(nxt) < f(cur):
                lo, hi = sorted((prev, nxt))
                break
            prev, cur, step = cur, nxt, step * 2
    # Golden-section search on the integers of [lo, hi].
    a, b = lo, hi
    while b - a > 3:
        c = a + max(1, round(_GOLD * (b - a)))
        d = b - max(1, round(_GOLD * (b - a)))
        if c >= d:
            d = c + 1
        if f(c) < f(d):
            a = c + 1
        else:
            b = d - 1 if f(c) > f(d) else d
    for n in range(a, b + 1):
        f(n)
    # Verify: climb while a neighbour (within `radius` instances: 2, or 1/32 of the range on
    # large clusters, where run-to-run wiggles span more than two instances) beats the best.
    radius = max(2, n_max // 32)
    while True:
        best = max(thr, key=lambda n: (thr[n], -n))
        better = [n for n in range(best - radius, best + radius + 1)
                  if n != best and 1 <= n <= n_max and f(n) > thr[best]]
        if not better:
            break
    best = max(thr, key=lambda n: (thr[n], -n))
    evaluated = {(n * tp, g - n * tp): v for n, v in sorted(thr.items())}
    results = {(n * tp, g - n * tp): r for n, r in sorted(res_by_n.items())}
    return SplitSearch(mode, res_by_n[best].max_staleness, (best * tp, g - best * tp), res_by_n[best],
                       evaluated, results, is_unimodal(thr))


def brute_force_split(preset: Preset, mode: str, **kw: Any) -> dict[tuple[int, int], float]:
    """Throughput of every whole-instance split (for checking `optimise_split` on small presets)."""
    tp, g = preset.engine.accelerators, preset.accelerators
    out = {}
    for n in range(1, (g - 1) // tp + 1):
        out[(n * tp, g - n * tp)] = simulate(preset, mode, split=(n * tp, g - n * tp), **kw).metrics[
            "throughput_tokens_per_s"]
    return out


# --------------------------------------------------------------------------- recommender
@dataclass
class Candidate:
    """One (mode, K, option) evaluated by the recommender, at its best split."""

    mode: str
    max_staleness: int
    elastic: bool
    search: SplitSearch

    @property
    def metrics(self) -> dict[str, Any]:
        return self.search.result.metrics

    @property
    def ok(self) -> bool:
        m = self.metrics
        return bool(m["c1_ok"] and m["c2_ok"] and m["c3_ok"])

    @property
    def eligible(self) -> bool:
        """May it be picked? It kept C1-C3, and its mode keeps C1 by construction: `partial`
        resumes preempted trajectories under a newer version, so a replay where that happened
        not to occur (it held C1 on these lengths) says nothing about the user's next run."""
        return self.ok and self.mode not in UNPICKED_MODES

    @property
    def label(self) -> str:
        return f"{self.mode} K={self.max_staleness}" + (" elastic" if self.elastic else "")

    def summary(self) -> dict[str, Any]:
        m = self.metrics
        return {
            "mode": self.mode, "max_staleness": self.max_staleness, "elastic": self.elastic,
            "split": m["split"], "efficiency": m["efficiency"],
            "throughput_tokens_per_s": m["throughput_tokens_per_s"], "ok": self.ok, "eligible": self.eligible,
            "c1_ok": m["c1_ok"], "c2_ok": m["c2_ok"], "c3_ok": m["c3_ok"],
            "trainer_wait_ratio": m["trainer_wait_ratio"], "staleness_mean": m["staleness_mean"],
            "multi_version_trajectory_share": m["multi_version_trajectory_share"],
            "reprefill_tokens": m["reprefill_tokens"], "weight_loads": m["weight_loads"],
            "migrations": m["migrations"], "role_switches": m.get("role_switches", 0),
            "split_runs": self.search.runs, "unimodal": self.search.unimodal,
            "splits_evaluated": {f"{r}:{t}": v for (r, t), v in self.search.evaluated.items()},
        }


@dataclass
class Recommendation:
    """`recommend`'s answer: the pick, the runner-up and every candidate considered."""

    pick: Candidate
    runner_up: Candidate | None
    candidates: list[Candidate]

    def considered(self) -> list[tuple[str, int, bool, str, float, bool]]:
        """Every (mode, K, elastic, split, efficiency, C1-C3 held) run, all splits included."""
        out = []
        for c in self.candidates:
            if c.search.split is None:
                out.append((c.mode, c.max_staleness, c.elastic, "colocated", c.metrics["efficiency"], c.ok))
                continue
            for sp, r in c.search.results.items():
                m = r.metrics
                out.append((c.mode, c.max_staleness, c.elastic, f"{sp[0]}:{sp[1]}", m["efficiency"],
                            bool(m["c1_ok"] and m["c2_ok"] and m["c3_ok"])))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "pick": self.pick.summary(),
            "runner_up": self.runner_up.summary() if self.runner_up else None,
            "candidates": [c.summary() for c in self.candidates],
        }


def candidates_for(max_staleness: int, modes: Sequence[str] = MODES, elastic: bool = False) -> list[tuple[str, int, bool]]:
    """(mode, K, elastic) to evaluate within a staleness budget `max_staleness`."""
    if max_staleness < 0:
        raise WorkloadError(f"max_staleness: expected an integer >= 0, got {max_staleness}")
    out = []
    for mode in modes:
        if mode not in MODES:
            raise WorkloadError(f"modes: unknown mode {mode!r}; accepted: {', '.join(MODES)}")
        if mode in ("sync", "pipeline"):
            ks = [0]
        elif mode == "one_step_off":
            ks = [1] if max_staleness >= 1 else []
        elif mode == "dora":
            ks = list(range(1, max_staleness + 1))
        else:
            ks = list(range(0, max_staleness + 1))
        for k in ks:
            out.append((mode, k, False))
            if elastic and mode in ELASTIC_MODES:
                out.append((mode, k, True))
    return out




def recommend(
    preset: Preset,
    *,
    max_staleness: int = 2,
    modes: Sequence[str] = MODES,
    steps: int | None = None,
    seed: int = 0,
    records: Any = None,
    elastic: bool = False,
    progress: Callable[[str], None] | None = None,
    cache: dict | None = None,
    start: dict[tuple[str, bool], int] | None = None,
    exhaustive: int = 8,
    host: Any = None,
    config: dict[str, Any] | None = None,
) -> Recommendation:
    """The (mode, K, split) with the highest efficiency that keeps C1-C3, within `max_staleness`;
    within `EFFICIENCY_TIE` of it, the one with the lowest mean trained staleness.

    Every candidate's split is optimised (`optimise_split`), starting from the best split of the
    previous K of the same mode. With `elastic`, `ELASTIC_MODES` are also evaluated elastic.
    `exhaustive`: as in `optimise_split`. `config` adds `DoraConfig` fields to every candidate
    (`admission` in the modes that take one).
    """
    cands: list[Candidate] = []
    hint: dict[tuple[str, bool], int] = dict(start or {})
    tp = preset.engine.accelerators
    todo = candidates_for(max_staleness, modes, elastic)
    if steps is not None:  # refuse before any run, not at the first K that is too large
        worst = max(k for _, k, _ in todo) if todo else 0
        if steps < min_steps(worst):
            raise WorkloadError(
                f"steps: {steps} is too few for a staleness budget of {max_staleness}; expected >= "
                f"{min_steps(worst)} (5 * (K + 2): shorter runs measure a burst after a long tail, "
                f"not a steady state), or leave it unset for the default")
    for mode, k, el in todo:
        cfg = {**(config or {}), **({"elastic": True} if el else {})} or None
        s = optimise_split(preset, mode, steps=steps, seed=seed, max_staleness=k, records=records,
                           config=cfg, start=hint.get((mode, el)), cache=cache, exhaustive=exhaustive, host=host)
        if s.split is not None:
            hint[(mode, el)] = s.split[0] // tp
        c = Candidate(mode, s.max_staleness, el, s)
        cands.append(c)
        if progress:
            m = c.metrics
            progress(f"  {c.label}: split {m['split']}, efficiency {m['efficiency']:.3f}, "
                     f"C1-C3 {'held' if c.ok else 'broken'} ({s.runs} runs)")
    ranked = sorted((c for c in cands if c.eligible), key=lambda c: -c.metrics["efficiency"])
    if not ranked:
        raise WorkloadError("recommend: no candidate kept C1-C3 (see the candidates)")
    near = [c for c in ranked if c.metrics["efficiency"] >= ranked[0].metrics["efficiency"] * (1 - EFFICIENCY_TIE)]
    ranked = sorted(near, key=lambda c: (c.metrics["staleness_mean"], -c.metrics["efficiency"])) + ranked[len(near):]
    return Recommendation(ranked[0], ranked[1] if len(ranked) > 1 else None, cands)


def format_recommendation(rec: Recommendation, preset: str, max_staleness: int) -> str:
    """The `dora-ext simulate --recommend` text."""

    def line(c: Candidate) -> str:
        m = c.metrics
        costs = [f"staleness max {m['staleness_max']} mean {m['staleness_mean']:.2f}",
                 f"trainer wait {m['trainer_wait_ratio']:.3f}", f"{m['weight_loads']} weight loads",
                 f"{m['migrations']} migrations"]
        if c.elastic:
            costs.append(f"{m.get('role_switches', 0)} role switches ({m.get('role_switch_s', 0.0):.0f} s)")
        if m["multi_version_trajectory_share"]:
            costs.append(f"multi-version share {m['multi_version_trajectory_share']:.3f}")
        if m["reprefill_tokens"]:
            costs.append(f"{m['reprefill_tokens']} re-prefilled tokens")
        if m.get("preemptions"):
            costs.append(f"{m['preemptions']} KV preemptions")
        if m.get("host", "ideal") != "ideal":
            costs.append(f"weight path {m['trainer_weight_sync_s_per_step']:.2f} s/step on the trainer")
        return (f"{c.label}, split {m['split']}: efficiency {m['efficiency']:.3f}, "
                f"{m['throughput_tokens_per_s']:.0f} tok/s; costs: " + ", ".join(costs))

    out = [f"recommendation for {preset}, staleness budget K <= {max_staleness}:",
           f"  pick:      {line(rec.pick)}"]
    if rec.runner_up:
        gap = 1 - rec.runner_up.metrics["efficiency"] / rec.pick.metrics["efficiency"]
        out.append(f"  runner-up: {line(rec.runner_up)} ({abs(gap):.1%} {'below' if gap >= 0 else 'above'} the pick)")
    out.append("  all candidates (best split each):")
    for c in sorted(rec.candidates, key=lambda c: -c.metrics["efficiency"]):
        m = c.metrics
        if not c.ok:
            flag = "  (breaks " + ",".join(x for x in ("C1", "C2", "C3") if not m[f"{x.lower()}_ok"]) + ": not picked)"
        elif not c.eligible:
            flag = "  (held C1 on this run, but does not keep it by construction: not picked)"
        else:
            flag = ""
        out.append(f"    {c.label:<22} split {m['split']:>9}  efficiency {m['efficiency']:.3f}  "
                   f"staleness mean {m['staleness_mean']:.2f}  "
                   f"({c.search.runs} split runs{'' if c.search.unimodal else ', NOT unimodal'}){flag}")
    return "\n".join(out)

"""Simulated workloads: how long each prompt and each response is.

Reasoning-RL response lengths are long-tailed (design.md): a capped log-normal with a coefficient
of variation near 1. Samples of one group share a per-prompt *difficulty* factor (a hard prompt
makes all its samples long); `difficulty_share` is the part of the log-variance it explains.

Every trajectory's length is a pure function of `(seed, group_id, index)`, so all modes see the
same workload for a seed whatever order they run in: `speedup_vs_sync` is like for like.

A user replays a real run with `lengths_file`: one integer per line, or JSONL objects with a
`response_length` field (and optionally `prompt_length`). Trajectory `(g, i)` takes record
`(g * n + i) mod len(records)`, so consecutive records form a group as they did in the run.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


class WorkloadError(ValueError):
    """A workload setting or a lengths file is invalid; the message names the field or line."""


@dataclass(frozen=True)
class Workload:
    """Length distributions of one workload.

    Fields:
      response_median: median response length in tokens (before the cap).
      response_cv: coefficient of variation of the uncapped log-normal (0 = constant lengths).
      response_cap: maximum response length; longer draws stop at the cap (reported as
        `truncated`, the same in every mode).
      prompt_median, prompt_cv, prompt_cap: the same for prompt lengths (one per group).
      group_size: n, trajectories per group.
      difficulty_share: share of the response log-variance shared by a group (0..1).
    """

    response_median: float = 3000.0
    response_cv: float = 1.0
    response_cap: int = 28672
    prompt_median: float = 256.0
    prompt_cv: float = 0.5
    prompt_cap: int = 2048
    group_size: int = 16
    difficulty_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("response_median", "prompt_median"):
            if not getattr(self, name) >= 1:
                raise WorkloadError(f"{name}: expected a number >= 1, got {getattr(self, name)!r}")
        for name in ("response_cv", "prompt_cv"):
            if not getattr(self, name) >= 0:
                raise WorkloadError(f"{name}: expected a number >= 0, got {getattr(self, name)!r}")
        for name in ("response_cap", "prompt_cap", "group_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise WorkloadError(f"{name}: expected an integer >= 1, got {v!r}")
        if not 0.0 <= self.difficulty_share <= 1.0:
            raise WorkloadError(f"difficulty_share: expected a number in [0, 1], got {self.difficulty_share!r}")


@dataclass(frozen=True, slots=True)
class GroupDraw:
    """The lengths of one admitted group: its prompt and each trajectory's response.

    `truncated`: how many of its responses were cut at the response cap.
    """

    prompt_tokens: int
    response_tokens: tuple[int, ...]
    truncated: int = 0


def _sigma(cv: float) -> float:
    # A log-normal's coefficient of variation is sqrt(exp(sigma^2) - 1).
    return math.sqrt(math.log1p(cv * cv))


class LengthSampler:
    """Draws `GroupDraw`s for `(seed, group_id)`; replays `records` when given."""

    def __init__(self, workload: Workload, seed: int, records: list[tuple[int, int | None]] | None = None):
        self.w = workload
        self.seed = int(seed)
        self.records = records
        s2 = _sigma(workload.response_cv) ** 2
        self._sd = math.sqrt(workload.difficulty_share * s2)
        self._sw = math.sqrt((1.0 - workload.difficulty_share) * s2)
        self._sp = _sigma(workload.prompt_cv)
        self._mu = math.log(workload.response_median)
        self._mup = math.log(workload.prompt_median)

    def draw(self, group_id: int) -> GroupDraw:
        w = self.w
        # One generator per group, keyed by (seed, group): independent of admission order.
        rng = random.Random(self.seed * 1_000_003 + group_id * 7919 + 17)
        prompt = max(1, min(w.prompt_cap, round(math.exp(self._mup + self._sp * rng.gauss(0.0, 1.0)))))
        n = w.group_size
        if self.records is not None:
            recs = self.records
            out = []
            for i in range(n):
                resp, p = recs[(group_id * n + i) % len(recs)]
                out.append(resp)
                if i == 0 and p is not None:
                    prompt = p
            # A replayed length at or above the preset's cap is cut there and counted as cut.
            cap = w.response_cap
            return GroupDraw(prompt, tuple(min(cap, x) for x in out), sum(1 for x in out if x >= cap))
        base = self._mu + self._sd * rng.gauss(0.0, 1.0)
        cap = w.response_cap
        raw = [max(1, round(math.exp(base + self._sw * rng.gauss(0.0, 1.0)))) for _ in range(n)]
        return GroupDraw(prompt, tuple(min(cap, x) for x in raw), sum(1 for x in raw if x > cap))


def load_lengths(path: str | Path) -> list[tuple[int, int | None]]:
    """Read a lengths file: one positive integer per line, or JSONL with `response_length`.

    Blank lines and lines starting with `#` are skipped. Returns `(response, prompt or None)`
    records. Raises `WorkloadError` naming the file and line of the first bad record.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"lengths file {str(p)!r}: cannot read it ({exc.strerror or exc})") from None
    records: list[tuple[int, int | None]] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"lengths file {str(p)!r} line {lineno}"
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{where}: invalid JSON ({exc.msg})") from None
            if "response_length" not in obj:
                raise WorkloadError(f"{where}: JSON object has no 'response_length' field")
            resp = _positive(obj["response_length"], f"{where}: response_length")
            prompt = obj.get("prompt_length")
            prompt = None if prompt is None else _positive(prompt, f"{where}: prompt_length")
            records.append((resp, prompt))
        else:
            try:
                value = int(line)
            except ValueError:
                raise WorkloadError(
                    f"{where}: expected a positive integer or a JSON object with 'response_length', got {line[:40]!r}"
                ) from None
            records.append((_positive(value, where), None))
    if not records:
        raise WorkloadError(f"lengths file {str(p)!r}: no lengths found (one integer per line, or JSONL)")
    return records


def _positive(value: object, where: str) -> int:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and value == int(value)
        and value >= 1
    )
    if not ok:
        raise WorkloadError(f"{where}: expected a positive integer, got {value!r}")
    return int(value)

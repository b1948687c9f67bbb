"""The default task: continue a short pattern for exactly L tokens, L long-tailed by construction.

Prompt: ``<bos> #L | p_0 .. p_{k-1} =`` (`#L` one token naming the length, `p` k distinct
letters, left-padded so every response starts at one position). The answer repeats the pattern
for L tokens, then ``<eos>``; style ``"counter"`` precedes each token by the count still due
(L=3, ``a c``: ``#3 a #2 c #1 a <eos>``), ``"count_up"`` counts the other way, ``"plain"`` has no
counters. Counters are single tokens so a decrement is one lookup, and a briefly warm-started
policy already stops near 2L. Counting up (the CPU recipes' style) puts the common small counters
first, so long answers earn partial credit that differs between samples (a gradient signal).

L is log-normal (median, cv), capped: reasoning RL's lengths are long-tailed (design.md), which
is what makes synchronous rollout wait for stragglers.

``reward = (1 - w) * prefix + w * length``: T the answer's length without its stop token,
`prefix` the share of T right before the first mistake, `length` = max(0, 1 - |n - T| / T) for
n tokens before the stop token (0 without one). 1.0 exactly for the correct answer.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from dora_ext.config import ConfigError
from dora_ext.models.tiny import TinyConfig, TinyLM
from dora_ext.tasks.tokenizer import Tokenizer

LETTERS = "abcdefghijklmnopqrstuvwxyz"
STYLES = ("count_up", "counter", "plain")


@dataclass(frozen=True)
class Prompt:
    """One task instance. `target` is the correct response including the stop token."""

    id: int
    ids: tuple[int, ...]
    target: tuple[int, ...]
    length: int
    text: str


def lognormal_length(rng: random.Random, median: float, cv: float, cap: int, min_len: int = 1) -> int:
    """A response length drawn from a log-normal with this median and coefficient of variation,
    clipped to [min_len, cap]: most answers are short, a few are many times longer."""
    sigma = math.sqrt(math.log1p(cv**2))  # cv^2 = exp(sigma^2) - 1
    return min(cap, max(min_len, round(rng.lognormvariate(math.log(median), sigma))))


@dataclass(frozen=True)
class LongTailConfig:
    """Task settings (recipe key `task`).

    median, cv: of L (cv = std / mean); cap/min_len: L's range (cap also sizes the `#L`
    vocabulary); alphabet: letters to draw from (2..26); pattern_min/pattern_max: pattern length;
    length_weight: w above; max_new_tokens: budget, default 1.25x the longest answer + 1 (so an
    over-long answer is penalised, not cut); style: "count_up", "counter" or "plain".
    """

    median: float = 8.0
    cv: float = 1.2
    cap: int = 96
    min_len: int = 1
    alphabet: int = 6
    pattern_min: int = 1
    pattern_max: int = 3
    length_weight: float = 0.5
    max_new_tokens: int | None = None
    style: str = "counter"

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ConfigError(f"task.{name}", f"expected {what}, got {getattr(self, name)!r}")

        need(isinstance(self.median, (int, float)) and self.median >= 1, "median", "a number >= 1")
        need(isinstance(self.cv, (int, float)) and self.cv > 0, "cv", "a number > 0")
        need(isinstance(self.cap, int) and self.cap >= self.median, "cap", f"an integer >= median ({self.median})")
        need(isinstance(self.min_len, int) and 1 <= self.min_len <= self.cap, "min_len", "an integer in [1, cap]")
        need(isinstance(self.alphabet, int) and 2 <= self.alphabet <= 26, "alphabet", "an integer in [2, 26]")
        need(isinstance(self.pattern_min, int) and 1 <= self.pattern_min, "pattern_min", "an integer >= 1")
        need(isinstance(self.pattern_max, int) and self.pattern_min <= self.pattern_max <= self.alphabet,
             "pattern_max", "an integer in [pattern_min, alphabet]")
        need(isinstance(self.length_weight, (int, float)) and 0 <= self.length_weight <= 1,
             "length_weight", "a number in [0, 1]")
        need(self.style in STYLES, "style", f"one of {STYLES}")
        need(self.max_new_tokens is None
             or (isinstance(self.max_new_tokens, int) and self.max_new_tokens > self.target_cap),
             "max_new_tokens", f"None or an integer > {self.target_cap} (the longest answer without its stop token)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LongTailConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(f"task.{key}", f"unknown key; accepted: {', '.join(sorted(known))}")
        return cls(**dict(data))

    @property
    def target_cap(self) -> int:
        """Tokens of the longest correct answer, stop token excluded."""
        return self.cap * (1 if self.style == "plain" else 2)

    @property
    def sigma(self) -> float:
        """Log-normal shape: cv^2 = exp(sigma^2) - 1 (as in `lognormal_length`)."""
        return math.sqrt(math.log1p(self.cv**2))


class LongTailTask:
    """Prompts, the correct answers and the reward of the long-tail pattern task."""

    name = "long_tail"

    def __init__(self, config: LongTailConfig | None = None):
        self.config = cfg = config or LongTailConfig()
        numbers = [f"#{n}" for n in range(1, cfg.cap + 1)]
        self.tokenizer = Tokenizer(["|", "=", *LETTERS[: cfg.alphabet], *numbers])
        self.stop_id = self.tokenizer.stop_id
        self.max_new_tokens = cfg.max_new_tokens or cfg.target_cap + cfg.target_cap // 4 + 1
        self.max_prompt_len = 4 + cfg.pattern_max

    def model_config(self, **overrides: Any) -> TinyConfig:
        """A `TinyConfig` sized for this task (vocab, max_len); other fields from `overrides`."""
        return TinyConfig(**{"vocab_size": self.tokenizer.vocab_size,
                             "max_len": self.max_prompt_len + self.max_new_tokens, **overrides})

    def sample_length(self, rng: random.Random) -> int:
        cfg = self.config
        return lognormal_length(rng, cfg.median, cfg.cv, cfg.cap, cfg.min_len)

    def make_prompt(self, prompt_id: int, length: int, pattern: Sequence[str]) -> Prompt:
        pad = "<pad> " * (self.config.pattern_max - len(pattern))
        text = f"{pad}<bos> #{length} | {' '.join(pattern)} ="
        body = [pattern[i % len(pattern)] for i in range(length)]
        if self.config.style == "counter":
            body = [tok for i, letter in enumerate(body) for tok in (f"#{length - i}", letter)]
        elif self.config.style == "count_up":
            body = [tok for i, letter in enumerate(body) for tok in (f"#{i + 1}", letter)]
        target = (*self.tokenizer.encode(" ".join(body)), self.stop_id)
        return Prompt(prompt_id, tuple(self.tokenizer.encode(text)), target, length, text)

    def prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """Endless, reproducible prompts with ids start, start+1, ...; prompt `i` depends only on
        `(seed, i)`, so a resumed run continues the stream."""
        i = start
        letters = LETTERS[: self.config.alphabet]
        while True:
            rng = random.Random(f"{seed}:{i}")
            length = self.sample_length(rng)
            k = rng.randint(self.config.pattern_min, self.config.pattern_max)
            yield self.make_prompt(i, length, rng.sample(letters, k))
            i += 1

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float:
        """1.0 for the exact answer, else the partial credit described in the module docstring."""
        body = list(response_ids)
        stopped = self.stop_id in body
        if stopped:
            body = body[: body.index(self.stop_id)]
        L = len(prompt.target) - 1
        prefix = 0
        for got, want in zip(body, prompt.target[:L]):
            if got != want:
                break
            prefix += 1
        length_score = max(0.0, 1.0 - abs(len(body) - L) / L) if stopped else 0.0
        w = self.config.length_weight
        return (1 - w) * prefix / L + w * length_score


# ---------------------------------------------------------------------- supervised warm start
def _batch(task: LongTailTask, prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `prompt + target` ids and labels (-100 outside the response)."""
    rows = [list(p.ids) + list(p.target) for p in prompts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), task.tokenizer.pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for r, (p, row) in enumerate(zip(prompts, rows)):
        ids[r, : len(row)] = torch.tensor(row)
        # position t predicts token t+1: label the positions whose next token is a response token
        start = len(p.ids) - 1
        labels[r, start : start + len(p.target)] = torch.tensor(p.target)
    return ids, labels


def warm_start(model: TinyLM, task: LongTailTask, steps: int, seed: int, *, batch_size: int = 16,
               lr: float = 3e-3) -> list[float]:
    """Train `model` in place on correct answers for `steps` AdamW steps; return the losses.
    RL starts from a partly tuned policy; deterministic for a seed (data from `task.prompts`)."""
    if not (isinstance(steps, int) and steps >= 0):
        raise ValueError(f"warm_start: steps must be an integer >= 0, got {steps!r}")
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    stream = task.prompts(seed=10_000 + seed)  # disjoint from the RL stream of the same seed
    losses: list[float] = []
    model.train()
    for _ in range(steps):
        ids, labels = _batch(task, [next(stream) for _ in range(batch_size)])
        ids, labels = ids.to(device), labels.to(device)
        logits, _ = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def evaluate(model: TinyLM, task: LongTailTask, prompts: Sequence[Prompt], *, capacity: int = 16) -> dict[str, Any]:
    """Greedy answers of `model` on `prompts`: mean reward, exact-match share, response lengths."""
    from dora_ext.engines.torch_engine import GREEDY, TorchEngine
    from dora_ext.models.tiny import policy_state

    device = next(model.parameters()).device
    engine = TorchEngine(model.config, capacity, task.stop_id, device=device)
    engine.load_version(policy_state(model), 0)
    for p in prompts:
        engine.submit(p.id, p.ids, task.max_new_tokens, GREEDY)
    by_id = {f.request_id: f for f in engine.run_until_done()}
    rewards = [task.reward(p, by_id[p.id].response_ids) for p in prompts]
    return {
        "reward_mean": sum(rewards) / len(rewards),
        "exact": sum(r == 1.0 for r in rewards) / len(rewards),
        "lengths": [len(by_id[p.id].response_ids) for p in prompts],
        "rewards": rewards,
    }

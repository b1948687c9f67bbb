"""Everything a CPU run of verl needs, made locally (nothing is downloaded).

* :func:`build_model` -- a word-level tokenizer with a chat template and a tiny Llama-architecture
  model (random weights, saved with ``save_pretrained``): verl's actor (FSDP2) and the
  ``dora_cpu`` rollout load the same directory.
* :func:`build_dataset` -- verl-format parquet files of one-digit additions
  (``prompt`` as chat messages, ``reward_model.ground_truth``, ``extra_info.index``).
* :func:`compute_score` -- the verifiable reward (``reward.custom_reward_function``): 1.0 when the
  response's first digit token is the sum's last digit, else 0.0. For failure-injection tests,
  ``DORA_TINY_FAIL_ONCE=<index>`` makes it raise once for that prompt index (a marker file in
  ``DORA_TINY_FAIL_DIR`` remembers it across processes) and ``DORA_TINY_FAIL_ALWAYS=<index>``
  every time.

``python -m dora_ext.verl.cpu.tiny OUT_DIR`` writes ``OUT_DIR/model``, ``OUT_DIR/train.parquet``
and ``OUT_DIR/val.parquet`` (used by ``recipes/verl/tiny_cpu.sh``).
"""

from __future__ import annotations

import os
import sys

WORDS = "system user assistant what is plus equals answer the ? :".split()
DIGITS = [str(i) for i in range(10)]


def build_model(out: str, *, hidden: int = 32, layers: int = 2, vocab: int = 64, seed: int = 0) -> str:
    import tokenizers
    import torch
    import transformers

    os.makedirs(out, exist_ok=True)
    table = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in WORDS + DIGITS:
        table.setdefault(w, len(table))
    while len(table) < vocab:
        table[f"t{len(table)}"] = len(table)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=table, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} \n{% endfor %}"
                          "{% if add_generation_prompt %}assistant : {% endif %}")
    fast.save_pretrained(out)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out)
    return out


def build_dataset(out: str, *, n_train: int = 64, n_val: int = 8, seed: int = 0) -> tuple[str, str]:
    import random

    import pandas as pd

    rng = random.Random(seed)
    os.makedirs(out, exist_ok=True)

    def rows(n: int, split: str) -> list[dict]:
        res = []
        for i in range(n):
            a, b = rng.randrange(10), rng.randrange(10)
            res.append({
                "data_source": "dora_tiny_add",
                "prompt": [{"role": "user", "content": f"what is {a} plus {b} ?"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str((a + b) % 10)},
                "extra_info": {"index": i, "split": split},
            })
        return res

    train = os.path.join(out, "train.parquet")
    val = os.path.join(out, "val.parquet")
    pd.DataFrame(rows(n_train, "train")).to_parquet(train)
    pd.DataFrame(rows(n_val, "val")).to_parquet(val)
    return train, val


class InjectedRewardError(RuntimeError):
    """Raised by :func:`compute_score` when failure injection asks for it."""


def _maybe_fail(extra_info: dict | None) -> None:
    index = None if not extra_info else extra_info.get("index")
    if index is None or (extra_info or {}).get("split") != "train":
        return
    always = os.environ.get("DORA_TINY_FAIL_ALWAYS")
    if always is not None and int(always) == int(index):
        raise InjectedRewardError(f"injected reward failure (always) for prompt {index}")
    once = os.environ.get("DORA_TINY_FAIL_ONCE")
    if once is not None and int(once) == int(index):
        marker = os.path.join(os.environ.get("DORA_TINY_FAIL_DIR", "."), f"dora_tiny_failed_once_{index}")
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        raise InjectedRewardError(f"injected reward failure (once) for prompt {index}")


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **_: object) -> float:
    _maybe_fail(extra_info)
    for word in str(solution_str).split():
        if word in DIGITS:
            return 1.0 if word == str(ground_truth) else 0.0
    return 0.0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m dora_ext.verl.cpu.tiny OUT_DIR", file=sys.stderr)
        return 2
    out = argv[0]
    build_model(os.path.join(out, "model"))
    build_dataset(out)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

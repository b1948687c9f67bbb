"""The tiny policy both sides use: dora-ext's TinyLM (llama shape), a word-level HF tokenizer
built locally (nothing downloaded), and the checkpoint layout slime's disk transport writes:
one directory per version with `config.json` and `model.safetensors` (an HF checkpoint)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dora_ext.models.tiny import TinyConfig, TinyLM

_BASE = ["<pad>", "<bos>", "<eos>"] + list("abcdefghijklmnopqrstuvwxyz0123456789") + ["+", "=", "zz"]
SYMBOLS = _BASE + [f"w{i}" for i in range(64 - len(_BASE))]  # one symbol per model token id
EOS_ID = 2
CONFIG = TinyConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_len=512, seed=0, arch="llama",
                    d_ff=64, tie_embeddings=True)


def hf_config() -> dict:
    c = CONFIG
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head, "num_key_value_heads": c.kv_heads, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_len, "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": 1, "eos_token_id": EOS_ID, "pad_token_id": 0, "torch_dtype": "float32",
    }


def write_tokenizer(d: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {s: i for i, s in enumerate(SYMBOLS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>",
        "bos_token": "<bos>", "model_max_length": CONFIG.max_len, "clean_up_tokenization_spaces": False,
    }))


def save(model: TinyLM, d: Path) -> None:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf_config()))
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if CONFIG.tie_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(d / "model.safetensors"))



def pad(d: Path, mb: int) -> None:
    """`mb` MB more in the checkpoint `d` (`padding.bin`): a version as large as a real model's,
    for the weight-path benchmark (the engine stand-in reads every file of a checkpoint it loads)."""
    if not mb:
        return
    block = os.urandom(1 << 20)
    with open(Path(d) / "padding.bin", "wb") as fh:
        for _ in range(mb):
            fh.write(block)


def load_into(model: TinyLM, d: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(Path(d) / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise ValueError(f"{d}: checkpoint does not fit the tiny model (missing {missing}, unexpected {unexpected})")


def new_model() -> TinyLM:
    torch.manual_seed(CONFIG.seed)
    return TinyLM(CONFIG)


def make_hf_checkpoint(d: Path) -> None:
    """The initial HF checkpoint (`--hf-checkpoint`): config, tokenizer, weights of version 0."""
    d.mkdir(parents=True, exist_ok=True)
    save(new_model(), d)
    write_tokenizer(d)

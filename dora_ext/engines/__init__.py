"""Rollout engines the embedded runtime drives: `TorchEngine` (one instance = one loaded version)."""

from dora_ext.engines.torch_engine import (
    GREEDY,
    EngineError,
    EngineStats,
    Finished,
    SamplingParams,
    SequenceState,
    TorchEngine,
    default_device,
)

__all__ = ["GREEDY", "EngineError", "EngineStats", "Finished", "SamplingParams", "SequenceState",
           "TorchEngine", "default_device"]

"""The what-if simulator: every mode, driven by the real `dora_ext.core.Scheduler`, on a virtual clock.

    from dora_ext.sim import get_preset, simulate, compare
    result = simulate(get_preset("dapo-28k"), "dora", steps=20, seed=0)
    result.metrics["throughput_tokens_per_s"], result.metrics["efficiency"]

`compare` runs several modes side by side and fills `speedup_vs_sync`; `optimize.optimise_split`
finds the best split, `optimize.recommend` the best mode, K and split. CLI: `dora-ext simulate`.
"""

from .presets import PRESETS, EngineCost, Preset, TrainerCost, get_preset
from .runner import Layout, RunResult, SimDeadlock, SimError, Simulation, simulate
from .workload import LengthSampler, Workload, WorkloadError, load_lengths

__all__ = [
    "PRESETS", "EngineCost", "Layout", "LengthSampler", "Preset", "RunResult", "SimDeadlock",
    "SimError", "Simulation", "TrainerCost", "Workload", "WorkloadError", "get_preset",
    "load_lengths", "simulate",
]

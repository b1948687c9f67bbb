"""Shared helpers of the simulator tests: a tiny hand-made preset whose numbers are easy to check."""

from __future__ import annotations

import pytest

from dora_ext.sim import EngineCost, Preset, TrainerCost, Workload


def make_tiny(
    *,
    accelerators: int = 1,
    split: tuple[int, int] = (1, 1),
    colocated: bool = True,
    length: int = 100,
    prompt: int = 20,
    cv: float = 0.0,
    n: int = 2,
    batch: int = 4,
    capacity: int = 8,
    train: float = 1e-3,
    optimizer: float = 0.5,
    broadcast: float = 0.25,
    load: float = 0.75,
    difficulty: float = 0.0,
) -> Preset:
    return Preset(
        name="tiny",
        summary="test",
        accelerators=accelerators,
        engine=EngineCost(
            decode_a_s=0.01, decode_b_s=0.001, decode_c_s=1e-5, prefill_s_per_token=1e-4,
            weight_load_s=load, kv_bytes_per_token=1000.0, migrate_bytes_per_s=1e9, capacity=capacity,
        ),
        trainer=TrainerCost(train_acc_s_per_token=train, optimizer_acc_s=optimizer, broadcast_s=broadcast),
        workload=Workload(
            response_median=length, response_cv=cv, response_cap=100 * length, prompt_median=prompt,
            prompt_cv=0.0, prompt_cap=10 * prompt, group_size=n, difficulty_share=difficulty,
        ),
        batch_size=batch,
        default_split=split,
        sync_colocated=colocated,
    )


@pytest.fixture
def tiny():
    """Factory of tiny presets: `tiny(accelerators=2, cv=1.0, ...)`."""
    return make_tiny

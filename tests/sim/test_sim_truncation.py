"""The simulator's `truncated` is computed from what its engines generated (review of issue 9).

Before, `truncated` was the constant 0, so C2 could not fail on truncation in a simulation.
"""

from __future__ import annotations

import pytest

from dora_ext.sim import Simulation
from dora_ext.sim.engine import SimInstance


@pytest.mark.parametrize("mode", ["sync", "dora", "partial"])
def test_a_sequence_cut_short_by_the_engine_is_counted_truncated(tiny, monkeypatch, mode):
    ref = Simulation(tiny(accelerators=3, colocated=False, split=(2, 1), batch=2, n=2, capacity=4), mode, steps=2).run()
    assert ref.metrics["truncated"] == 0 and ref.metrics["c2_ok"]

    real_add = SimInstance.add
    cut: list = []

    def add(self, key, remaining, context, t, prefill_tokens):
        # A faulty engine: the first trajectory it starts stops after half of its tokens.
        if not cut and key == (0, 0):
            cut.append(key)
            remaining = remaining / 2
        return real_add(self, key, remaining, context, t, prefill_tokens)

    monkeypatch.setattr(SimInstance, "add", add)
    res = Simulation(tiny(accelerators=3, colocated=False, split=(2, 1), batch=2, n=2, capacity=4), mode, steps=2).run()
    assert cut == [(0, 0)]
    assert res.metrics["truncated"] == 1 and not res.metrics["c2_ok"]
    assert res.core_metrics["truncated"] == 1  # the core heard of it too (truncated_early=True)

"""The split optimiser against a brute-force scan, and the recommender's pick."""

from __future__ import annotations

import pytest

from dora_ext.sim.optimize import (
    brute_force_split, candidates_for, is_unimodal, optimise_split, recommend,
)
from dora_ext.sim.workload import WorkloadError


def _small(tiny, accelerators, train):
    return tiny(accelerators=accelerators, split=(accelerators // 2, accelerators // 2), colocated=False,
                cv=1.0, batch=16, n=4, capacity=8, length=200, train=train, optimizer=0.2,
                broadcast=0.05, load=0.1)


@pytest.mark.parametrize("accelerators,train", [(12, 3e-3), (16, 2e-3), (10, 5e-3)])
@pytest.mark.parametrize("mode,k", [("dora", 2), ("dora", 1), ("pipeline", None), ("one_step_off", None)])
def test_search_finds_the_brute_force_maximum(tiny, accelerators, train, mode, k):
    p = _small(tiny, accelerators, train)
    scan = brute_force_split(p, mode, steps=20, seed=0, max_staleness=k)
    best = max(scan, key=scan.get)
    # exhaustive=0 forces the bracketing + golden-section path even on a small cluster.
    s = optimise_split(p, mode, steps=20, seed=0, max_staleness=k, exhaustive=0)
    assert s.split == best, (s.evaluated, scan)
    assert s.runs < len(scan)  # it did not scan everything
    for sp, v in s.evaluated.items():
        assert v == scan[sp]  # the same full-length runs
    # The exhaustive path is the scan itself.
    full = optimise_split(p, mode, steps=20, seed=0, max_staleness=k, exhaustive=16)
    assert full.split == best and full.runs == len(scan)


def test_unimodality_check():
    assert is_unimodal({1: 1.0, 2: 3.0, 3: 2.0, 4: 1.0})
    assert is_unimodal({1: 1.0, 2: 2.0})
    assert not is_unimodal({1: 1.0, 2: 3.0, 3: 2.0, 4: 2.5})  # rises again after the maximum
    assert not is_unimodal({1: 2.0, 2: 1.0, 3: 3.0})  # dips before it
    assert is_unimodal({1: 1.0, 2: 3.0, 3: 2.999, 4: 3.0}, tolerance=0.01)


def test_recommender_pick_beats_everything_it_considered(tiny):
    p = tiny(accelerators=12, split=(6, 6), colocated=True, cv=1.0, batch=16, n=4, capacity=8,
             length=200, train=3e-3, optimizer=0.2, broadcast=0.05, load=0.1)
    rec = recommend(p, max_staleness=3, steps=10, seed=0)
    considered = rec.considered()
    labels = {(c.mode, c.max_staleness) for c in rec.candidates}
    assert labels == {(m, k) for m, k, _ in candidates_for(3)}
    assert len(considered) > 40  # every split of every candidate
    pick = rec.pick.metrics["efficiency"]
    assert rec.pick.ok
    for mode, k, elastic, split, eff, ok in considered:
        if ok:
            assert pick >= eff - 1e-12, (mode, k, split, eff, pick)
    assert rec.pick.mode != "partial"  # partial breaks C1: shown, never picked
    assert any(not ok for *_, ok in considered)  # ... and it was considered
    assert rec.runner_up is not None and rec.runner_up.metrics["efficiency"] <= pick
    assert rec.runner_up is not rec.pick


def test_candidates_and_errors():
    assert ("dora", 0, False) not in candidates_for(2)
    assert [k for m, k, _ in candidates_for(2) if m == "partial"] == [0, 1, 2]
    assert not [m for m, k, _ in candidates_for(0) if m in ("dora", "one_step_off")]
    with pytest.raises(WorkloadError, match="max_staleness"):
        candidates_for(-1)
    with pytest.raises(WorkloadError, match="unknown mode 'fast'"):
        candidates_for(1, ["fast"])

"""``dora_ext.verl.cpu.evidence.analyze``'s ``trained_staleness_max``: the number
``test_main_ppo_cpu.py::test_dora_k1_six_steps`` asserts equals K (old and new versions overlap)
must be able to show a run in which they do not.

The sampler's ``train`` reports carry, per trained group, ``(global_steps - 1) - version`` where
the version is the oldest engine-reported ``min_global_steps`` of its trajectories (TransferQueue
tags). Evidence written here in the reports' own format (``dora_ext.verl.cpu.report``): a K=1 run
whose step 2 trains version-0 groups, an on-policy run (mode ``pipeline``, K=0: every group
trained at the version it was generated under) and a run of verl's own modes (no ``train``
reports: DoraReplayBuffer is not in use).
"""

from __future__ import annotations

from dora_ext.verl.cpu.evidence import analyze


def _metrics(steps: int) -> list[dict]:
    return [{"step": s, "timing_s/step": 1.0, "training/off_policy/trajectory_spans/max": 1,
             "training/off_policy/trajectory_staleness_worst/max": 0, "dora/c1_ok": 1.0, "dora/c2_ok": 1.0,
             "dora/c3_ok": 1.0, "actor/pg_loss": 0.1} for s in range(1, steps + 1)]


def _trained(versions_by_step: dict[int, list[int]]) -> list[dict]:
    return [{"kind": "train", "global_steps": step, "groups": [f"g{step}_{i}" for i in range(len(vs))],
             "staleness": [(step - 1) - v for v in vs], "versions": vs}
            for step, vs in versions_by_step.items()]


def test_trained_staleness_max_tells_an_overlapping_run_from_an_on_policy_one():
    overlapping = _trained({1: [0, 0], 2: [0, 0], 3: [1, 1]})  # K=1: step 2 trains version 0
    on_policy = _trained({1: [0, 0], 2: [1, 1], 3: [2, 2]})  # each step trains the version it holds
    assert analyze(_metrics(3), overlapping, mode="dora", max_staleness=1)["trained_staleness_max"] == 1
    # The K=1 test's assertion (trained_staleness_max == K) fails on on-policy evidence ...
    assert analyze(_metrics(3), on_policy, mode="pipeline", max_staleness=0)["trained_staleness_max"] == 0
    # ... and on a run with no train reports (verl's own modes): None, not a passing default.
    assert analyze(_metrics(3), [], mode="sync", max_staleness=0)["trained_staleness_max"] is None
    # A group staler than K shows as more than K (the K=1 test's `== K` fails on it too).
    beyond = _trained({1: [0, 0], 2: [0, 0], 3: [0, 1]})
    assert analyze(_metrics(3), beyond, mode="dora", max_staleness=1)["trained_staleness_max"] == 2

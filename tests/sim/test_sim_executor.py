"""The simulator's executor: races between its own reports and the scheduler's actions."""

from __future__ import annotations

import pytest

from dora_ext.core import actions as A
from dora_ext.sim.runner import SimError, Simulation


def _two_instances_on_version_0(tiny):
    sim = Simulation(tiny(accelerators=3, split=(2, 1), colocated=False), "dora", steps=2, seed=0)
    for si in sim.inst.values():
        si.version = 0
    return sim


def test_migrate_of_a_trajectory_that_just_finished_is_a_no_op(tiny):
    # Order 1: the trajectory finished on src and its report is queued when the scheduler,
    # handling an earlier event of the same instant, plans to migrate it. The host sees the
    # trajectory finish where it was: nothing moves, the destination gets no sequence.
    sim = _two_instances_on_version_0(tiny)
    src, dst = sim.inst[0], sim.inst[1]
    src.add((7, 0), 1.0, 20.0, 0.0, 0)
    assert src.pop_finished(src.next_finish()) == [(7, 0)]
    sim.finished.add((7, 0))
    sim._migrate(A.Migrate(7, 0, 0, 1, 0))
    assert sim.migrations_after_finish == 1
    assert dst.r == 0 and dst.inbound == 0


def test_migrate_of_a_trajectory_that_never_ran_there_is_an_error(tiny):
    # Order 2 (the report came first, or the trajectory never ran on src): a real core bug.
    sim = _two_instances_on_version_0(tiny)
    with pytest.raises(SimError, match="does not run"):
        sim._migrate(A.Migrate(7, 0, 0, 1, 0))

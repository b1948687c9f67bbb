"""Faults on real worker processes: a rollout instance killed with SIGKILL mid-run.

Nothing is simulated: the instance is a real process of the runtime and `kill -9` really ends it.
What is checked comes from the trainer's own ledger (the group ids each step reports having
trained) and from recomputing each trajectory's log-probs under the version it claims.
"""

from __future__ import annotations

import os
import signal

import pytest

from dora_ext.runtime import prepare, recipe_from_dict
from dora_ext.runtime.runtime import Runtime, WorkerDied

from .conftest import tiny
from .test_runtime_modes import _check_ledger


class KillingRuntime(Runtime):
    """The real runtime; after step 1, at the first finished trajectory after which the scheduler
    has trajectories running on instance `victim`, that instance's process gets SIGKILL (so the
    kill really interrupts generation, in every mode)."""

    victim = 0

    def _on_finished(self, iid, f, t):
        super()._on_finished(iid, f, t)
        if getattr(self, "killed", False) or len(self.step_end) < 1:
            return
        inst = self.sched.instances.get(self.victim)
        if inst is not None and inst.running:
            self.running_at_kill = len(inst.running)
            os.kill(self.instance_pids[self.victim], signal.SIGKILL)
            self.killed = True


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dora", "sync"])
def test_a_killed_instance_process_loses_nothing(mode):
    data = tiny(steps=8, task={"median": 8, "cap": 16, "cv": 1.0},
                dora={"batch_size": 2, "group_size": 4, "instances": 2, "capacity": 4})
    recipe = recipe_from_dict(data).with_mode(mode)
    prepared = prepare(recipe)
    rt = KillingRuntime(recipe, prepared, keep_versions=True)
    result = rt.run()
    if not getattr(rt, "killed", False):
        pytest.fail("instance 0 never had running trajectories after step 1; the kill did not happen")
    assert rt.failed_instances.keys() == {0}
    # The scheduler re-dispatched what ran there, to the same version, on the surviving instance.
    assert result.core_metrics["redispatched"] >= 1
    led = result.ledger
    attempts = [t for gid in led["trained"] for t in led["results"][gid]]
    assert len(attempts) == recipe.steps * recipe.dora.batch_size * recipe.dora.group_size
    # From the trainer's ledger: every admitted group trained exactly once, none lost or doubled,
    # and every trajectory's log-probs reproduce under its pinned version.
    m = result.metrics
    assert m["dropped"] == m["duplicated"] == 0 and m["c1_ok"] and m["c2_ok"] and m["c3_ok"]
    _check_ledger(result, recipe, prepared)


@pytest.mark.slow
def test_a_killed_trainer_is_a_clean_error_naming_resume():
    recipe = recipe_from_dict(tiny(steps=6))
    prepared = prepare(recipe)
    holder: list = []

    def kill(rec: dict) -> None:
        if rec["step"] == 1:
            os.kill(holder[0].trainer_pid, signal.SIGKILL)

    rt = Runtime(recipe, prepared, on_step=kill)
    holder.append(rt)
    with pytest.raises(WorkerDied, match="trainer process exited.*--resume"):
        rt.run()

"""Faults on real worker processes: a rollout instance killed with SIGKILL mid-run.

Nothing is simulated: the instance is a real process of the runtime and `kill -9` really ends it.
What is checked comes from the trainer's own ledger (the group ids each step reports having
trained) and from recomputing each trajectory's log-probs under the version it claims.
"""

from __future__ import annotations

import os
import signal

import pytest

from dora_ext.core.events import InstanceFailed
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
    """Whether the victim's sequences are still unfinished when the coordinator learns of the death
    is up to real timing (it may report them just before the kill lands), so up to three seeds are
    tried until one run re-dispatches work; every run must keep the books."""
    redispatched = 0
    for seed in range(3):
        data = tiny(steps=8, seed=seed, task={"median": 8, "cap": 16, "cv": 1.0},
                    dora={"batch_size": 2, "group_size": 4, "instances": 2, "capacity": 4})
        recipe = recipe_from_dict(data).with_mode(mode)
        prepared = prepare(recipe)
        rt = KillingRuntime(recipe, prepared, keep_versions=True)
        at_failure: list = []
        handle = rt.sched.handle

        def spy(event, rt=rt, at_failure=at_failure, handle=handle):
            if isinstance(event, InstanceFailed):  # what the scheduler still had running there
                at_failure.append(len(rt.sched.instances[event.instance_id].running))
            return handle(event)

        rt.sched.handle = spy
        result = rt.run()
        if not getattr(rt, "killed", False):
            pytest.fail("instance 0 never had running trajectories after step 1; the kill did not happen")
        assert rt.failed_instances.keys() == {0} and len(at_failure) == 1
        # What ran there was re-dispatched, to the same version, on the surviving instance.
        assert result.core_metrics["redispatched"] == at_failure[0]
        led = result.ledger
        attempts = [t for gid in led["trained"] for t in led["results"][gid]]
        assert len(attempts) == recipe.steps * recipe.dora.batch_size * recipe.dora.group_size
        # From the trainer's ledger: every admitted group trained exactly once, none lost or doubled,
        # and every trajectory's log-probs reproduce under its pinned version.
        m = result.metrics
        assert m["dropped"] == m["duplicated"] == 0 and m["c1_ok"] and m["c2_ok"] and m["c3_ok"]
        _check_ledger(result, recipe, prepared)
        redispatched += at_failure[0]
        if redispatched:
            break
    assert redispatched > 0


@pytest.mark.slow
@pytest.mark.parametrize("checkpoints", [False, True])
def test_a_killed_trainer_is_a_clean_error_naming_resume(checkpoints, tmp_path):
    recipe = recipe_from_dict(tiny(steps=6))
    prepared = prepare(recipe)
    holder: list = []

    def kill(rec: dict) -> None:
        # the trainer reports "checkpointed" (version 2) before step 2's end: by step 3 it is complete
        if rec["step"] == 3:
            os.kill(holder[0].trainer_pid, signal.SIGKILL)

    kw = dict(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2) if checkpoints else {}
    rt = Runtime(recipe, prepared, on_step=kill, **kw)
    holder.append(rt)
    with pytest.raises(WorkerDied, match="trainer process exited.*--resume|trainer process exited.*resume=True") as info:
        rt.run()
    if checkpoints:
        assert "can continue from its last checkpoint" in str(info.value)
        # version 2 was complete before the kill; version 4's was requested at the end of step 3,
        # just before the kill, and is complete only if the trainer wrote it before dying
        assert (tmp_path / "ckpt" / "latest").read_text().strip() in ("2", "4")
    else:
        assert "No checkpoint was completed yet" in str(info.value)


@pytest.mark.slow
def test_kill_the_whole_process_tree_and_resume(tmp_path):
    """`dora-ext train` in its own process group is killed with SIGKILL (coordinator, fork server,
    trainer and instances at once) right after its second checkpoint; `train --resume` finishes the
    run. From the resumed run's ledger (the checkpoint's ledger plus what ran after it): every
    admitted group trained exactly once (or reported failed), every step trained a full batch."""
    import json
    import subprocess
    import sys

    import yaml

    data = tiny(steps=10, task={"median": 6, "cap": 12, "cv": 1.0},
                dora={"batch_size": 2, "group_size": 2, "capacity": 3})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dora_ext.cli", "train", str(path), "--out", str(out),
           "--checkpoint-every", "2", "--no-progress"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    seen = []
    try:
        for line in proc.stderr:  # blocks on the run's own reports: no timing guesses
            if line.startswith("checkpoint: version"):
                seen.append(int(line.split()[2]))
                if len(seen) == 2:
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert seen == [2, 4], seen
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "report.json").exists()  # it really died before finishing
    assert (out / "checkpoint" / "latest").read_text().strip() == "4"

    done = subprocess.run([sys.executable, "-m", "dora_ext.cli", "train", "--resume", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "resumed at step 4" in done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["resumed_from"] == 4
    ledger = report["ledger"]
    failed = {g for g, _ in ledger["failed"]}
    trained = ledger["trained"]
    assert {str(g) for g in ledger["admitted"]} == set(trained) | failed
    assert all(len(steps) == 1 for steps in trained.values())  # exactly once
    per_step = {}
    for steps in trained.values():
        per_step[steps[0]] = per_step.get(steps[0], 0) + 1
    assert per_step == {k: 2 for k in range(10)}
    assert report["checks"]["c1_ok"] and report["checks"]["c2_ok"] and report["checks"]["c3_ok"]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(10))


# ----------------------------------------------------------------- checkpoints without processes
# The coordinator's half of a checkpoint is written by the real `_save_state` of a runtime whose
# scheduler has started (no worker processes needed to test what a resume accepts and restores).
def _coordinator_checkpoint(recipe, prepared, folder, *, fail=None):
    from dora_ext.core import events as E

    rt = Runtime(recipe, prepared, checkpoint_dir=str(folder))
    rt._execute(rt.sched.start())
    if fail is not None:
        rt._execute(rt.sched.handle(E.InstanceFailed(fail, "killed before the checkpoint")))
    rt._save_state(1)
    rt._checkpoint_complete(1)
    assert (folder / "latest").read_text().strip() == "1"
    return rt


def test_resume_refuses_a_checkpoint_of_another_recipe(tmp_path):
    from dora_ext.config import ConfigError

    recipe = recipe_from_dict(tiny())
    prepared = prepare(recipe)
    _coordinator_checkpoint(recipe, prepared, tmp_path)
    other = recipe_from_dict(tiny(trainer={"lr": 0.5}))
    with pytest.raises(ConfigError, match=r"trainer\.lr.*0\.002.*0\.5"):
        Runtime(other, prepared, checkpoint_dir=str(tmp_path), resume=True)
    with pytest.raises(ConfigError, match=r"steps"):  # the restored scheduler would stop at the old count
        Runtime(recipe.with_steps(recipe.steps + 4), prepared, checkpoint_dir=str(tmp_path), resume=True)
    Runtime(recipe, prepared, checkpoint_dir=str(tmp_path), resume=True)  # the run's own recipe resumes


def test_a_fresh_run_never_leaves_an_earlier_runs_checkpoint_to_resume(tmp_path):
    recipe = recipe_from_dict(tiny())
    prepared = prepare(recipe)
    _coordinator_checkpoint(recipe, prepared, tmp_path)
    (tmp_path / "notes.txt").write_text("not ours")
    Runtime(recipe.with_seed(7), prepared, checkpoint_dir=str(tmp_path))  # a new run into the same folder
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        Runtime(recipe.with_seed(7), prepared, checkpoint_dir=str(tmp_path), resume=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # only checkpoint files removed


def test_resume_registers_every_instance_again_also_one_that_failed_before(tmp_path):
    """The resumed run starts a fresh process for every configured instance; an instance that had
    failed before the checkpoint must not stay unused for the rest of the run."""
    recipe = recipe_from_dict(tiny())
    prepared = prepare(recipe)
    _coordinator_checkpoint(recipe, prepared, tmp_path, fail=1)
    rt = Runtime(recipe, prepared, checkpoint_dir=str(tmp_path), resume=True)
    assert set(rt.sched.instances) == {0}  # what the snapshot holds
    rt._restart_from_checkpoint()
    assert set(rt.sched.instances) == {0, 1}

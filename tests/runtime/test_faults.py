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
from dora_ext.runtime import faults
from dora_ext.runtime.faults import HoldAfterLoad, OthersWait, StalledFirst
from dora_ext.runtime.runtime import Runtime, WorkerDied

from .conftest import tiny
from .test_runtime_modes import _check_ledger


def _sigkill(rt, *iids, notice=True):
    """SIGKILL the processes of instances `iids`, wait until they are gone, and (`notice`) have the coordinator look
    at its workers at once, as its periodic look would (left to that look, a kill near the end of a run could go
    unnoticed until the last step was trained, seen under CI load)."""
    for iid in iids:
        os.kill(rt.instance_pids[iid], signal.SIGKILL)
    for iid in iids:
        rt.instance_handles[iid].join(timeout=60)
    if notice:
        rt._watch(rt.trainer_handles)


class KillingRuntime(Runtime):
    """The real runtime; after step 1, at the first finished trajectory after which the scheduler has trajectories
    running on instance `victim`, that instance's process gets SIGKILL (so the kill really interrupts generation, in
    every mode). While its replacement process starts, the trainer's next step command waits (an order forced so that
    the replacement joins while work is left for it; the run itself never waits for a replacement)."""

    victim = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._steps_waiting: list = []

    def _on_finished(self, iid, f, t):
        super()._on_finished(iid, f, t)
        if getattr(self, "killed", False) or len(self.step_end) < 1:
            return
        inst = self.sched.instances.get(self.victim)
        if inst is not None and inst.running:
            self.running_at_kill = len(inst.running)
            self.killed = True
            _sigkill(self, self.victim)

    def _send_step(self, step, rest):
        if self.starting:
            self._steps_waiting.append((step, rest))
        else:
            super()._send_step(step, rest)

    def _on_ready(self, *args):
        super()._on_ready(*args)
        waiting, self._steps_waiting = self._steps_waiting, []
        for step, rest in waiting:
            super()._send_step(step, rest)


def _kill_recipe(mode, seed, restarts, capacity=4):
    data = tiny(steps=8, seed=seed, task={"median": 8, "cap": 16, "cv": 1.0},
                dora={"batch_size": 2, "group_size": 4, "instances": 2, "capacity": capacity},
                runtime={"max_instance_restarts": restarts})
    return recipe_from_dict(data).with_mode(mode)


def _check_books(result, recipe, prepared):
    """From the trainer's own ledger: every admitted group trained exactly once, none lost or
    doubled, every trajectory of a full batch; re-dispatched trajectories (attempt >= 1) generated
    under their group's pinned version, and every log-prob reproduces under its version."""
    led = result.ledger
    attempts = [t for gid in led["trained"] for t in led["results"][gid]]
    assert len(attempts) == recipe.steps * recipe.dora.batch_size * recipe.dora.group_size
    m = result.metrics
    assert m["dropped"] == m["duplicated"] == 0 and m["c1_ok"] and m["c2_ok"] and m["c3_ok"]
    redone = [k for k, (_, _, attempt) in led["dispatch"].items() if attempt >= 1]
    for gid, idx in redone:
        assert set(led["token_versions"][(gid, idx)]) == {led["group_version"][gid]}
    _check_ledger(result, recipe, prepared)
    return redone


def _running_at_each_failure(rt) -> list:
    """A list that gets, for each `InstanceFailed` the runtime feeds its scheduler, the (group,
    index) keys the scheduler still had running on that instance (what must be re-dispatched)."""
    at_failure: list = []
    handle = rt.sched.handle

    def spy(event):
        if isinstance(event, InstanceFailed):
            at_failure.append(set(rt.sched.running_on(event.instance_id)))
        return handle(event)

    rt.sched.handle = spy
    return at_failure


class KillsWhenHeld(OthersWait, KillingRuntime):
    """KillingRuntime whose kill cannot come too late: the victims run `faults.HoldAfterLoad` (after the trainer's first
    step each stops decoding once an unfinished sequence of it has a token, and reports it "held"), and they get SIGKILL
    when every victim has reported one. A held sequence cannot finish there. The other instances get no command until
    the kill (`faults.OthersWait`): they cannot run the whole run while a victim is late, and no R5 move can take a held
    sequence off its victim first (R5 moves only between instances that hold or have loaded a version, and the others
    have loaded nothing). The coordinator waits for the victims' exits and looks at its workers at once, so the deaths
    are handled before anything else (a move onto a released instance used to take a held sequence off a dead victim not
    yet found dead: retried, not re-dispatched). A held sequence is re-dispatched, forced, not hoped for. `moved`: the
    (group, index) of every move before the kill."""

    victims = (0,)

    @property
    def alone(self):
        return self.victims

    def __init__(self, *args, instance_loops=None, **kwargs):
        from dora_ext.core.actions import Migrate

        super().__init__(*args, instance_loops={**{v: HoldAfterLoad for v in self.victims}, **(instance_loops or {})},
                         **kwargs)
        self.held: dict = {}  # victim -> (group, index, attempt) it held
        self.moved: set = set()
        handle = self.sched.handle

        def spy(event):
            out = handle(event)
            if not getattr(self, "killed", False):
                self.moved.update((a.group_id, a.index) for a in out if isinstance(a, Migrate))
            return out

        self.sched.handle = spy

    def _on_finished(self, iid, f, t):
        Runtime._on_finished(self, iid, f, t)  # the kill comes with the "held" reports

    def _on_message(self, msg):
        if msg[0] != "held":
            return super()._on_message(msg)
        self.held[msg[1]] = msg[2]
        if len(self.held) == len(self.victims):
            self._kill()

    def _kill(self):
        self.killed = True
        _sigkill(self, *self.victims)  # the deaths are found at once, before anything can move
        self.release()


# Late: which instance's process takes its first load late (an injected delay, `faults.LateFirstLoad`):
# the forced order must not depend on who starts first.
LATE = {None: {}, "victim": {0: faults.LateHoldAfterLoad}, "other": {1: faults.LateInstance}}


@pytest.mark.slow
@pytest.mark.parametrize("mode,restarts,late", [("dora", 0, None), ("sync", 0, None), ("dora", 1, None),
                                                ("sync", 1, None), ("dora", 1, "victim"), ("dora", 1, "other")])
def test_a_killed_instance_process_loses_nothing(mode, restarts, late):
    """With `max_instance_restarts: 0` the run goes on with one instance; with 1 a fresh process
    (a new instance id) takes the dead one's place and serves trajectories. Instance 0 is killed
    while it holds an unfinished sequence (`KillsWhenHeld`): one run, and what ran there (that
    sequence among it) is re-dispatched to its pinned version, nothing lost or doubled."""
    recipe = _kill_recipe(mode, 0, restarts)
    prepared = prepare(recipe)
    rt = KillsWhenHeld(recipe, prepared, keep_versions=True, instance_loops=LATE[late])
    at_failure = _running_at_each_failure(rt)
    result = rt.run()
    assert getattr(rt, "killed", False), "instance 0 never held an unfinished sequence; the kill did not happen"
    assert rt.failed_instances.keys() == {0} and len(at_failure) == 1
    served = set(result.ledger["served_by"].values())
    if restarts:
        # the replacement joined under a fresh id, loaded a version and served trajectories
        assert result.ledger["instance_restarts"] == [(0, 2)]
        assert 2 in served and 2 in result.ledger["engine_stats"]
        assert result.ledger["engine_stats"][2]["weight_loads"] >= 1
    else:
        assert result.ledger["instance_restarts"] == [] and served <= {0, 1}
    # What ran there was re-dispatched, to the same version, on the other instances: exactly
    # that (nothing else failed, nothing was retried), the held sequence among it.
    gid, idx, attempt = rt.held[0]
    assert not rt.moved and attempt == 0 and (gid, idx) in at_failure[0], (rt.moved, rt.held, at_failure)
    assert result.core_metrics["redispatched"] == len(at_failure[0]) and result.core_metrics["retries"] == 0
    redone = _check_books(result, recipe, prepared)
    assert set(redone) == at_failure[0]
    for key in redone:
        assert result.ledger["dispatch"][key][2] == 1 and result.ledger["served_by"][key] != 0, key


class KillsUnnoticed(KillsWhenHeld):
    """KillsWhenHeld whose coordinator does not look at its workers after the kill until the scheduler, which still sees
    the dead victim holding its sequences, has moved some of them off it (R5 spreads them onto instance 1, released at
    the kill, once their groups gate a step and instance 1 has nothing else to do): the other order of a death and a
    move off the dead instance, forced. `unnoticed`: the (group, index, src, dst) of every move from the kill to the
    failure."""

    def __init__(self, *args, **kwargs):
        from dora_ext.core.actions import Migrate

        super().__init__(*args, **kwargs)
        self.unnoticed: list = []
        self.noticed = False
        handle = self.sched.handle

        def spy(event):
            if isinstance(event, InstanceFailed):
                self.noticed = True
            out = handle(event)
            if getattr(self, "killed", False) and not self.noticed:
                self.unnoticed.extend((a.group_id, a.index, a.src, a.dst) for a in out if isinstance(a, Migrate))
            return out

        self.sched.handle = spy

    def _kill(self):
        victim = self.victims[0]
        if len(self.sched.running_on(victim)) < 2:  # R5 spreads only an instance running two or more
            pytest.fail(f"instance {victim} held {self.sched.running_on(victim)}: too few for R5 to move")
        self.killed = True
        _sigkill(self, victim, notice=False)
        self.release()

    def _watch(self, trainer):
        if getattr(self, "killed", False) and not self.unnoticed:
            return  # not yet: the scheduler moves first
        super()._watch(trainer)


@pytest.mark.slow
def test_moves_off_an_instance_that_died_unnoticed_are_retried():
    """Instance 0 dies holding unfinished sequences (`KillsUnnoticed`), and before its death is noticed the scheduler
    moves some of them off it (the moves go to a dead process). Once the death is noticed each moved sequence is retried
    (lost in a migration from a failed instance), what the scheduler still had there is re-dispatched, each exactly
    once, to its pinned version; nothing else is redone. (The other order, the death noticed first, is
    `test_a_killed_instance_process_loses_nothing`.)"""
    recipe = _kill_recipe("dora", 0, 1)
    prepared = prepare(recipe)
    rt = KillsUnnoticed(recipe, prepared, keep_versions=True)
    at_failure = _running_at_each_failure(rt)
    result = rt.run()
    assert rt.killed and not rt.moved and rt.unnoticed, (rt.moved, rt.unnoticed)
    assert all((src, dst) == (0, 1) for *_, src, dst in rt.unnoticed), rt.unnoticed
    assert rt.failed_instances == {0: -signal.SIGKILL} and result.ledger["instance_restarts"] == [(0, 2)]
    moved = {(gid, idx) for gid, idx, *_ in rt.unnoticed}
    assert len(at_failure) == 1 and not moved & at_failure[0]
    m = result.core_metrics
    assert m["retries"] == len(moved) and m["redispatched"] == len(at_failure[0])
    redone = _check_books(result, recipe, prepared)
    assert set(redone) == moved | at_failure[0]
    for key in redone:
        assert result.ledger["dispatch"][key][2] == 1 and result.ledger["served_by"][key] != 0, key
    gid, idx, attempt = rt.held[0]
    assert attempt == 0 and (gid, idx) in redone


class KillsTheReplacementToo(KillingRuntime):
    """KillingRuntime, and once the replacement (instance 2) has reported a trajectory and has more
    running, instance 2 gets SIGKILL as well: after the whole report is read (an instance reports
    what finished in one decode step as one message), and noticed at once, as the first kill is (a
    kill near the end of the run could otherwise go unnoticed until the last step was trained, seen
    in CI)."""

    def _on_message(self, msg):
        super()._on_message(msg)
        if msg[0] != "finished":
            return
        inst = self.sched.instances.get(2)
        if (not getattr(self, "killed_again", False) and 2 in self.served_by.values()
                and inst is not None and inst.running):
            self.killed_again = True
            _sigkill(self, 2)


@pytest.mark.slow
def test_after_the_last_restart_the_run_goes_on_with_fewer_instances():
    """`max_instance_restarts: 1`: instance 0 is killed and replaced by instance 2, then instance 2
    is killed: no restart is left, the run finishes on instance 1 alone and keeps the books."""
    recipe = _kill_recipe("dora", 0, 1)
    prepared = prepare(recipe)
    rt = KillsTheReplacementToo(recipe, prepared, keep_versions=True)
    result = rt.run()
    if not getattr(rt, "killed_again", False):
        pytest.fail("the replacement never had running trajectories after its first report; no second kill")
    assert rt.failed_instances.keys() == {0, 2} and result.ledger["instance_restarts"] == [(0, 2)]
    assert not rt.starting and set(rt.instance_handles) == {1}
    _check_books(result, recipe, prepared)


@pytest.mark.slow
def test_an_instance_killed_in_the_middle_of_a_report_blocks_nothing():
    """Instance 0 dies (SIGKILL) with half of a report written on its pipe (`faults.DieMidReport`: its first "finished"
    or "export" after loading version 1). The coordinator reads the cut message as the end of that pipe, the
    trajectories it carried are re-dispatched, a replacement joins, and the books are kept."""
    from dora_ext.runtime.faults import DieMidReport

    recipe = _kill_recipe("dora", 0, 1)
    prepared = prepare(recipe)
    rt = Runtime(recipe, prepared, keep_versions=True, instance_loops={0: DieMidReport})
    result = rt.run()
    assert rt.failed_instances == {0: -signal.SIGKILL}
    assert result.ledger["instance_restarts"] == [(0, 2)]
    # what the cut report carried (finished trajectories, or a migrating one) is generated again
    assert result.core_metrics["redispatched"] + result.core_metrics["retries"] >= 1
    _check_books(result, recipe, prepared)


class WatchesTheDeadInstance(Runtime):
    """Right after the coordinator sends instance 0 its first trajectories, it waits for that
    process to exit (`faults.DieAfterReport`: killed right after its first "finished" report) and
    only then looks at its workers: the death is noticed before the report is read, forced."""

    drained: list = []

    def _flush(self):
        first = not self.drained and any(c[0] == "submit" for c in self._outgoing.get(0, ())
                                         for c in (c[1] if c[0] == "batch" else [c]))
        super()._flush()
        if first:
            self.instance_handles[0].join(timeout=120)
            drain = self.outbox.drain
            self.outbox.drain = lambda name: self.drained.extend(drain(name)) or list(self.drained)
            self._watch(self.trainer_handles)
            self.outbox.drain = drain


@pytest.mark.slow
def test_what_a_dead_instance_reported_before_it_died_counts():
    """The trajectories instance 0 reported finished just before it was killed are taken from its pipe when its death is
    noticed: trained as generated there (attempt 0, served by instance 0), not re-dispatched."""
    from dora_ext.runtime.faults import DieAfterReport

    recipe = _kill_recipe("dora", 0, 0)
    prepared = prepare(recipe)
    rt = WatchesTheDeadInstance(recipe, prepared, keep_versions=True, instance_loops={0: DieAfterReport})
    rt.drained = []
    result = rt.run()
    assert rt.failed_instances == {0: -signal.SIGKILL}
    finished = [f for msg in rt.drained if msg[0] == "finished" for f in msg[2]]
    assert finished, rt.drained
    led = result.ledger
    for f in finished:
        gid, idx, attempt = f.request_id
        assert attempt == 0 and led["dispatch"][(gid, idx)][2] == 0 and led["served_by"][(gid, idx)] == 0
        assert led["results"][gid][idx].response_ids == f.response_ids
    _check_books(result, recipe, prepared)


@pytest.mark.slow
def test_no_instance_left_is_a_clean_error_naming_the_restart_bound():
    from dora_ext.runtime.faults import DieMidReport

    recipe = _kill_recipe("dora", 0, 0)
    rt = Runtime(recipe, prepare(recipe), instance_loops={0: DieMidReport, 1: DieMidReport})
    with pytest.raises(WorkerDied, match=r"no rollout instance is left.*max_instance_restarts is 0"):
        rt.run()


def test_a_peer_killed_while_exporting_to_an_instance_blocks_nobody():
    """Two real instance processes; instance 0 is told to migrate a sequence to instance 1 and dies (SIGKILL) half-way
    through writing it (`faults.DieMidExport`). Instance 1's inbox has one writer, the coordinator (here: the test), so
    it still takes commands and serves, and the cut message reads as the end of instance 0's pipe. (With peers writing
    straight into each other's inbox, the cut message, or a queue lock the dead writer held, would block instance 1.)"""
    import dataclasses
    import queue

    from dora_ext.engines import GREEDY
    from dora_ext.models.tiny import TinyConfig, TinyLM, policy_state
    from dora_ext.runtime.faults import DieMidExport
    from dora_ext.runtime.workers import EngineRecipe, PackedWeights, PipeHub, process_context, start_instances

    cfg = TinyConfig(vocab_size=16, d_model=32, n_layer=1, n_head=2, max_len=48, seed=5)
    hub = PipeHub(process_context())
    spec = EngineRecipe(cfg, 4, None, "cpu")
    inboxes, handles = start_instances({0: dataclasses.replace(spec, loop=DieMidExport), 1: spec}, 1, None, hub,
                                       "process")
    try:
        assert sorted(hub.get(timeout=120)[0] for _ in range(2)) == ["ready", "ready"]
        weights = PackedWeights.pack(policy_state(TinyLM(cfg)), shared=True)
        for q in inboxes.values():
            q.put(("load", 1, weights, False))
        assert sorted(hub.get(timeout=60)[:3] for _ in range(2)) == [("loaded", 0, 1), ("loaded", 1, 1)]
        inboxes[0].put(("batch", [("submit", "r", [1, 2, 3], 20, GREEDY, 0), ("migrate", "r", 1)]))
        handles[0].join(timeout=60)  # it dies in the middle of writing the export
        assert handles[0].exitcode == -signal.SIGKILL
        assert hub.drain("instance-0") == []  # nothing complete was left: the cut message is dropped
        inboxes[1].put(("submit", "s", [1, 2], 5, GREEDY, 0))
        kind, iid, finished, _ = hub.get(timeout=60)
        assert (kind, iid, [f.request_id for f in finished]) == ("finished", 1, ["s"])
        inboxes[1].put(("stop",))
        assert hub.get(timeout=60)[:2] == ("stats", 1)
    finally:
        for h in handles:
            h.join(timeout=10)
            if h.is_alive():
                h.terminate()
        for q in inboxes.values():
            q.cancel_join_thread()
    with pytest.raises(queue.Empty):
        hub.get(timeout=5)  # both pipes ended


@pytest.mark.parametrize("first", ["killed writer", "live writer"])
def test_a_worker_killed_mid_write_does_not_block_the_pipe_hub(first):
    """`PipeHub`, the coordinator's side of every worker's report pipe: worker A reports, then dies
    (SIGKILL) half-way through its next message; worker B reports before and after that, the order
    forced both ways (B's writes wait for a word from the test, A's death is awaited by join). Every
    complete message arrives, the cut one reads as the end of A's pipe, nothing blocks."""
    import queue

    from dora_ext.runtime import faults
    from dora_ext.runtime.workers import PipeHub, process_context

    ctx = process_context()
    hub = PipeHub(ctx)
    go_r, go_w = ctx.Pipe(duplex=False)
    wa, wb = hub.writer("a"), hub.writer("b")
    a = ctx.Process(target=faults.report_then_die_mid_message, args=(wa, ("a", 1), ("a", "cut", b"x" * 40_000)),
                    daemon=True)
    b = ctx.Process(target=faults.report_when_told, args=(wb, go_r, [("b", 1), ("b", 2)]), daemon=True)

    def start(p, w):
        p.start()
        w.conn.close()  # as the runtime does: the worker holds the only write end of its pipe

    got = []
    try:
        if first == "live writer":
            start(b, wb)
            go_w.send(1)
            got.append(hub.get(timeout=60))
            start(a, wa)
        else:
            start(a, wa)
            start(b, wb)
        a.join(timeout=60)
        assert a.exitcode == -signal.SIGKILL
        if first == "live writer":
            go_w.send(1)
        else:
            go_w.send(1)
            go_w.send(1)
        while len(got) < 3:
            got.append(hub.get(timeout=60))
        b.join(timeout=60)
        assert sorted(got, key=str) == [("a", 1), ("b", 1), ("b", 2)] and got.index(("b", 1)) < got.index(("b", 2))
        with pytest.raises(queue.Empty):
            hub.get(timeout=5)
        assert hub.readers == []  # both pipes ended and were dropped
    finally:
        for p in (a, b):
            if p.is_alive():
                p.terminate()


def _borrow(borrow: bool) -> dict:
    """The runtime section of a recipe whose trainer borrows the rollout cores (a second,
    low-priority rank there, `runtime.trainer_borrow`), or of one whose trainer does not."""
    if borrow and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("runtime.trainer_borrow needs 2 cores")
    return {"trainer_borrow": True, "cores": 2} if borrow else {}


@pytest.mark.slow
@pytest.mark.parametrize("checkpoints,victim", [(False, None), (True, None), (False, 0), (True, 1)],
                         ids=["no-ckpt", "ckpt", "borrow-no-ckpt-kill-rank0", "borrow-ckpt-kill-borrowed-rank"])
def test_a_killed_trainer_is_a_clean_error_naming_resume(checkpoints, victim, tmp_path):
    """A trainer process killed at step 3 ends the run with `WorkerDied` naming `--resume`; with
    `runtime.trainer_borrow` (victim = the rank killed) a killed borrowed rank (rank 1, on the rollout cores) or a
    killed rank 0 is handled alike, although its peer may report a failed collective first."""
    recipe = recipe_from_dict(tiny(steps=6, runtime=_borrow(victim is not None)))
    prepared = prepare(recipe)
    holder: list = []

    def kill(rec: dict) -> None:
        # the trainer reports "checkpointed" (version 2) before step 2's end: by step 3 it is complete
        if rec["step"] == 3:
            if victim is not None:
                assert len(holder[0].trainer_handles) == 2
            os.kill(holder[0].trainer_handles[victim or 0].pid, signal.SIGKILL)

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


class WatchesTheDeadTrainer(Runtime):
    """After step 3's end (which asks the trainer for checkpoint 4) the coordinator waits for the
    trainer process to exit and only then looks at its workers: the order in which a trainer that
    died right after reporting its checkpoint is noticed before its report is read, forced."""

    def _on_step_done(self, step, *rest):
        super()._on_step_done(step, *rest)
        if step == 3:
            for t in self.trainer_handles:
                t.join(timeout=120)
            self._watch(self.trainer_handles)


@pytest.mark.slow
@pytest.mark.parametrize("borrow", [False, True], ids=["one-rank", "borrow"])
def test_a_checkpoint_reported_by_a_trainer_that_then_died_counts(borrow, tmp_path):
    """`faults.DieAfterCheckpoint`: the trainer writes checkpoint 4, reports it and is killed; the coordinator notices
    the death before reading the report. The report is still taken (the dead trainer's pipe is drained first), so the
    error names checkpoint 4, and the resumed run trains every admitted group exactly once across both runs."""
    from dora_ext.runtime.faults import DieAfterCheckpoint

    recipe = recipe_from_dict(tiny(steps=6, runtime=_borrow(borrow)))
    prepared = prepare(recipe)
    ckpt = str(tmp_path / "ckpt")
    rt = WatchesTheDeadTrainer(recipe, prepared, checkpoint_dir=ckpt, checkpoint_every=2,
                               trainer_loop=DieAfterCheckpoint)
    with pytest.raises(WorkerDied, match="trainer process exited .* at step 4. The run can continue from its last"):
        rt.run()
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "4"
    resumed = Runtime(recipe, prepared, checkpoint_dir=ckpt, resume=True, keep_versions=True)
    result = resumed.run()
    led = result.ledger
    assert set(led["trained"]) == set(led["prompts"]) and all(len(s) == 1 for s in led["trained"].values())
    assert [len(g) for g in led["step_groups"]] == [recipe.dora.batch_size] * recipe.steps
    assert result.metrics["c1_ok"] and result.metrics["c2_ok"] and result.metrics["c3_ok"]
    # the order each step's groups were handed to the trainer (their PPO minibatches), for every
    # step of both runs: the checkpoint carries it, and a step handed over again replaces its entry
    assert [sorted(o) for o in led["step_order"]] == [sorted(g) for g in led["step_groups"]]
    if borrow:  # each rank's trained tokens over both runs (the checkpoint carries the counts too)
        assert resumed.rank_tokens == [sum(rec["rank_tokens"][r] for rec in result.steps) for r in (0, 1)]


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
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)
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


def test_an_unreadable_report_of_a_dead_worker_is_named_and_the_rest_of_its_pipe_counts():
    """A worker reports a message holding a tensor (as an instance's "export" holds a migrating sequence's KV cache),
    then a plain one, and dies (SIGKILL) before either is read. The tensor's shared memory was to be handed over by the
    dead process, so the first message cannot be rebuilt: the hub hands over ("lost", name, why) in its place and still
    delivers the complete report after it (it used to stop reading the pipe there, losing it)."""
    import queue

    import torch

    from dora_ext.runtime import faults
    from dora_ext.runtime.workers import PipeHub, process_context

    ctx = process_context()
    for how in ("drain", "get"):
        hub = PipeHub(ctx)
        w = hub.writer("a")
        p = ctx.Process(target=faults.report_then_die,
                        args=(w, [("export", 0, 1, torch.arange(8.0)), ("finished", 0, ["r"], 1.0)]), daemon=True)
        p.start()
        w.conn.close()
        p.join(timeout=60)
        assert p.exitcode == -signal.SIGKILL
        got = hub.drain("a") if how == "drain" else [hub.get(timeout=60), hub.get(timeout=60)]
        assert [m[:2] for m in got] == [("lost", "a"), ("finished", 0)], got
        assert "Error" in got[0][2]
        with pytest.raises(queue.Empty):
            hub.get(timeout=5)
        assert hub.readers == []


class KillsTheFirstReplacementAtOnce(KillingRuntime):
    """KillingRuntime, and the first replacement process (instance 2) gets SIGKILL as soon as
    `start()` returns its pid, and the coordinator waits for its exit: it dies before it has built
    its engine, so before it can report ready. (A ready report written just before a death would be
    drained and ignored, see `_watch`; that order is not what this test forces.)"""

    def _restart(self, dead):
        super()._restart(dead)
        if len(self.instance_restarts) == 1 and 2 in self.starting:
            h = self.starting[2][1]
            os.kill(h.pid, signal.SIGKILL)
            h.join(timeout=60)


@pytest.mark.slow
def test_a_replacement_killed_before_it_is_ready_is_replaced_in_turn():
    recipe = _kill_recipe("dora", 0, 2)
    prepared = prepare(recipe)
    rt = KillsTheFirstReplacementAtOnce(recipe, prepared, keep_versions=True)
    result = rt.run()
    assert getattr(rt, "killed", False), "instance 0 never had running trajectories after step 1"
    assert rt.failed_instances == {0: -signal.SIGKILL, 2: -signal.SIGKILL}
    assert result.ledger["instance_restarts"] == [(0, 2), (2, 3)]
    # instance 2 never joined; instance 3 joined and loaded a version (whether work was left for it
    # once it was up is up to timing)
    assert 2 not in result.ledger["served_by"].values() and 2 not in rt.sched.instances
    assert 2 not in rt.instance_pids and 3 in rt.instance_pids
    assert result.ledger["engine_stats"][3]["weight_loads"] >= 1
    _check_books(result, recipe, prepared)
    assert not any(h.is_alive() for h in [*rt._handles, *rt.trainer_handles])  # nothing left running


class KillsBothAtOnce(KillsWhenHeld):
    """KillsWhenHeld with both instances as victims, both killed at once; the coordinator waits for
    both exits, then finds both dead in one pass and hands the scheduler one failure after the
    other: the first re-queues its work while the other (its peer), dead, is still live there.
    Until the kill the trainer gets no step past the first, so both load version 1 (not 2).
    `room` forces what that work does. False (capacity 2: a group of 4 fills both): the kill
    comes once both hold; the peer is full, the work waits for the replacements. True (capacity
    24): the kill comes once one holds and its peer (which may have nothing to run) has loaded
    version 1; R2 admits at most 6 groups at version 1, so the peer has free slots: some of the
    work is dispatched onto it (`placed`), re-queued again at the peer's failure."""

    victims = (0, 1)
    room = False

    def __init__(self, *args, **kwargs):
        from dora_ext.core.actions import Dispatch

        super().__init__(*args, **kwargs)
        self.placed: set = set()
        handle = self.sched.handle

        def spy(event):
            out = handle(event)
            if isinstance(event, InstanceFailed):
                self.placed.update((a.group_id, a.index) for a in out
                                   if isinstance(a, Dispatch) and a.instance_id in self.victims)
            return out

        self.sched.handle = spy

    def _send_step(self, step, rest):
        if self.step_end and not getattr(self, "killed", False):
            self._steps_waiting.append((step, rest))  # sent once a replacement is ready (`_on_ready`)
        else:
            super()._send_step(step, rest)

    def _on_message(self, msg):
        super()._on_message(msg)
        if self.room and self.held:
            self._kill()

    def _kill(self):
        if getattr(self, "killed", False):
            return  # (a "held" the peer wrote just before it died, drained)
        s = self.sched
        first = next(iter(self.held))
        peer = 1 - first
        if self.room and (s.instances[peer].version != s.instances[first].version or s.instances[peer].loading):
            return  # not yet: the peer loads version 1 first
        free = {v: self.capacity_of[v] - len(s.running_on(v)) for v in self.victims}
        if (free[peer] > 0) != self.room:
            pytest.fail(f"room={self.room}, but the victims have {free} free slots")
        handles = self.instance_handles
        handles[peer] = handles.pop(peer)  # `_watch` handles the other one first
        super()._kill()


@pytest.mark.slow
@pytest.mark.parametrize("room", [False, True])
def test_two_instances_killed_at_once_are_both_replaced(room):
    """Both instances die at once, one (`room`) or both holding an unfinished sequence (no instance is left in the
    scheduler until a replacement is ready); their trajectories wait, re-dispatched to their pinned version once
    instances 2 and 3 join; the books are kept (the run could not finish without the replacements). What the first
    failure dispatched onto the other one (`room`) is re-dispatched twice (attempt 2)."""
    recipe = _kill_recipe("dora", 0, 2, capacity=24 if room else 2)
    prepared = prepare(recipe)
    rt = KillsBothAtOnce(recipe, prepared, keep_versions=True)
    rt.room = room
    at_failure = _running_at_each_failure(rt)
    result = rt.run()
    assert getattr(rt, "killed", False), "the two instances never both held an unfinished sequence"
    first, second = rt.failed_instances  # in the order handled
    assert {first, second} == {0, 1} and len(at_failure) == 2
    assert result.ledger["instance_restarts"] == [(first, 2), (second, 3)]
    # what ran on each at its failure (less what it had reported finished before dying) was
    # re-dispatched, what the first failure placed on the other instance twice; what was moving
    # between them (R5 may move while only one of them holds) was retried; nothing else redone.
    ran = at_failure[0] | at_failure[1]
    twice = at_failure[0] & at_failure[1]
    assert bool(twice) == room and twice == rt.placed & at_failure[0] and rt.placed <= at_failure[1], (at_failure, rt.placed)
    m = result.core_metrics
    assert m["redispatched"] == sum(map(len, at_failure)) == len(ran) + len(twice)
    assert set(result.ledger["served_by"].values()) <= {0, 1, 2, 3}
    redone = set(_check_books(result, recipe, prepared))
    retried = redone - ran
    assert ran <= redone and retried <= rt.moved and m["retries"] == len(retried), (ran, retried, rt.moved)
    for key in redone:
        assert result.ledger["dispatch"][key][2] == 1 + (key in twice), key
        assert result.ledger["served_by"][key] in (2, 3), key
    for gid, idx, attempt in rt.held.values():
        assert attempt == 0 and (gid, idx) in redone


class WaitsForTheExporter(StalledFirst, Runtime):
    """Instance 0 stalls first (`faults.StalledFirst`). Right after the coordinator tells an instance (`faults.DieAfterExport`) to migrate a
    sequence, it waits for that process to exit (it dies right after writing the export, or at once
    if the sequence finished there first) before it reads anything more: an export is read after
    its source is gone (forced)."""

    def _flush(self):
        srcs = [iid for iid, cmds in self._outgoing.items() if any(c[0] == "migrate" for c in cmds)]
        super()._flush()
        for iid in srcs:
            if not getattr(self, "waited", False):
                self.instance_handles[iid].join(timeout=120)
                self.waited = True


def _moves_until_the_first_failure(rt) -> tuple[list, list]:
    """Two lists that get, as the scheduler emits them, each `Migrate` it emits before the first
    `InstanceFailed` the runtime feeds it, and for each `InstanceFailed` (failed instance, the
    (group, index) keys the scheduler still had running there)."""
    from dora_ext.core import actions as A

    moves: list = []
    holding: list = []
    handle = rt.sched.handle

    def spy(event):
        if isinstance(event, InstanceFailed):
            holding.append((event.instance_id, set(rt.sched.running_on(event.instance_id))))
        out = handle(event)
        if not holding:
            moves.extend(a for a in out if isinstance(a, A.Migrate))
        return out

    rt.sched.handle = spy
    return moves, holding


def _run_killed_while_moving(rt, killed):
    """Run `rt`, whose instance 0 stalls while R5 moves its sequences onto instance 1 and instance `killed` (the source
    0 or the destination 1) is killed meanwhile, and check what every such run shares: only moves 0 -> 1, only of
    sequences instance 0 stalled on, instance `killed` killed once and restarted. Returns the moves and, for each
    failure, what ran on the failed instance (`_moves_until_the_first_failure`), and the result."""
    moves, holding = _moves_until_the_first_failure(rt)
    result = rt.run()
    assert moves and all((m.src, m.dst) == (0, 1) for m in moves), moves
    # only sequences instance 0 stalled on moved
    assert {(m.group_id, m.index, 0) for m in moves} <= set(rt.stalled), (moves, rt.stalled)
    assert rt.failed_instances == {killed: -signal.SIGKILL}
    assert result.ledger["instance_restarts"] == [(killed, 2)]
    return moves, holding, result


@pytest.mark.slow
@pytest.mark.parametrize("late", [None, "staller", "other"])
def test_a_source_that_dies_right_after_exporting_loses_nothing(late):
    """The source of a migration writes the sequence (with its KV cache) in full and dies before
    the coordinator reads it. The export cannot be rebuilt (its shared memory went with its
    process): the coordinator names it (`reports_lost`), fails the source, retries every sequence
    that was moving off it (the exported one and any it never got to) at its pinned version
    (`TrajectoryFailed`), re-dispatches what still ran there, and keeps the books.

    The migration is forced, one run: instance 0 (`faults.StallThenDieAfterExport`) stops
    decoding once it holds two sequences with a token each, before instance 1 gets any command
    (`faults.StalledFirst`), so their groups gate step K and R5 spreads them onto idle instance 1
    (`Migrate` 0 -> 1, the only move the scheduler can make while instance 0 stalls); instance 0
    dies right after writing the first export, and the coordinator reads on only once it is gone
    (`WaitsForTheExporter`). Whichever instance takes its first load late (`late`, an injected
    delay), the same order."""
    loops = {None: {0: faults.StallThenDieAfterExport},
             "staller": {0: faults.LateStallThenDieAfterExport},
             "other": {0: faults.StallThenDieAfterExport, 1: faults.LateInstance}}[late]
    recipe = _kill_recipe("dora", 0, 1)
    prepared = prepare(recipe)
    rt = WaitsForTheExporter(recipe, prepared, keep_versions=True, instance_loops=loops)
    moves, holding, result = _run_killed_while_moving(rt, killed=0)
    lost = result.ledger["reports_lost"]
    assert len(lost) == 1 and lost[0][0] == "instance-0" and "Connection" in lost[0][1], lost
    # every sequence moving off the dead source was retried once; what still ran there was
    # re-dispatched once; nothing else was redone
    moved = {(m.group_id, m.index) for m in moves}
    assert [iid for iid, _ in holding] == [0] and not moved & holding[0][1]
    m = result.core_metrics
    assert m["retries"] == len(moved) and m["redispatched"] == len(holding[0][1])
    led = result.ledger
    for key in moved | holding[0][1]:
        assert led["dispatch"][key][2] == 1 and led["served_by"][key] != 0, key
    redone = _check_books(result, recipe, prepared)
    assert set(redone) == moved | holding[0][1]


class KillsTheSourceOnceForwarded(StalledFirst, Runtime):
    """Instance 0 stalls first (`faults.StalledFirst`); right after the coordinator has read the first export and passed
    it on to its destination, the source gets SIGKILL and the coordinator waits for its exit and looks at its workers at
    once: the source dies after its export was read (the other order than `WaitsForTheExporter`'s), and before any
    export after it (on its pipe, unread: their KV cache went with the process) is read."""

    forwarded = None

    def _on_export(self, src, dst, state):
        super()._on_export(src, dst, state)
        if self.forwarded is None:
            self.forwarded = state.request_id
            _sigkill(self, src)


@pytest.mark.slow
def test_a_source_that_dies_once_its_export_was_read_redoes_only_what_it_lost():
    """The other order of `test_a_source_that_dies_right_after_exporting_loses_nothing`: the
    source dies right after the coordinator read its first export and passed it on. That sequence
    is out of the source (its KV cache was fetched): it lands and finishes on its destination as
    attempt 0, never retried. The exports still unread on the dead source's pipe are lost and
    retried (so are moves it had not exported yet), what still ran there is re-dispatched;
    nothing else is redone.

    Forced, one run: instance 0 (`faults.StallUntilMigrate`) stalls first (`faults.StalledFirst`),
    R5 spreads its sequences onto instance 1 in one batch of moves, which instance 0 exports at
    once; the kill comes with the first export read (`KillsTheSourceOnceForwarded`)."""
    recipe = _kill_recipe("dora", 0, 1)
    prepared = prepare(recipe)
    rt = KillsTheSourceOnceForwarded(recipe, prepared, keep_versions=True, instance_loops={0: faults.StallUntilMigrate})
    moves, holding, result = _run_killed_while_moving(rt, killed=0)
    gid, idx, attempt = rt.forwarded
    moved = {(m.group_id, m.index) for m in moves}
    lost = moved - {(gid, idx)}
    assert attempt == 0 and (gid, idx) in moved and [i for i, _ in holding] == [0] and not moved & holding[0][1]
    # (each later move was exported before the kill, its report unreadable, or not yet: either way
    # it was moving off the dead source, and is retried)
    lost_reports = result.ledger["reports_lost"]
    assert len(lost_reports) <= len(lost) and all(n == "instance-0" for n, _ in lost_reports), lost_reports
    led = result.ledger
    # it landed on instance 1 as attempt 0 and finished there or, landed, so R5 may move it again,
    # further on (each later move from where it had landed), still attempt 0
    assert led["dispatch"][(gid, idx)][2] == 0
    log = [e for e in led["migration_log"] if e[1:3] == (gid, idx)]
    assert log[:2] == [("move", gid, idx, 0, 0, 1), ("imported", gid, idx, 0, 1, "landed")], log
    for before, move in zip(log[1:], log[2:]):
        if move[0] == "move":
            assert before == ("imported", gid, idx, 0, move[4], "landed"), log
    assert led["served_by"][(gid, idx)] in {e[5] for e in log if e[0] == "move"}, log
    m = result.core_metrics
    assert m["retries"] == len(lost) and m["redispatched"] == len(holding[0][1])
    for key in lost | holding[0][1]:
        assert led["dispatch"][key][2] == 1 and led["served_by"][key] != 0, key
    redone = _check_books(result, recipe, prepared)
    assert set(redone) == lost | holding[0][1]


class RecordsExports(StalledFirst, Runtime):
    """Instance 0 stalls first (`faults.StalledFirst`); every export read is recorded. An "imported" report read before
    its writer's death was noticed is followed at once by a look at the workers (after waiting for the writer's exit
    when `victim` is it, `faults.DieAfterImport`): its landing is applied and the death handled with no other report
    between them (left to the coordinator's periodic look, an instance running dry meanwhile could have R5 spread the
    landed sequence off the dead destination: a move to a dead process, retried). A death noticed first takes the report
    from the dead worker's pipe (`_drain`): no landing is sent."""

    exported: list = []
    victim = 1

    def _on_export(self, src, dst, state):
        self.exported.append((state.request_id, src, dst, dst in self.inboxes))
        super()._on_export(src, dst, state)

    def _on_message(self, msg):
        super()._on_message(msg)
        if msg[0] == "imported" and msg[1] == self.victim and self.victim not in self.failed_instances:
            self.instance_handles[self.victim].join(timeout=60)
            self._watch(self.trainer_handles)


@pytest.mark.slow
@pytest.mark.parametrize("late", [None, "staller", "other"])
def test_a_destination_that_dies_right_after_importing_gets_the_sequence_redone_once(late):
    """The destination of a migration (`faults.DieAfterImport`) dies right after it took the
    sequence in. Every sequence moved to it is re-dispatched exactly once for that death (as the
    scheduler saw them at the failure: on the destination) and generated again under its group's
    pinned version elsewhere; none is retried as lost on the way; the books are kept.

    The migration is forced, one run: instance 0 (`faults.StallUntilMigrate`) stops decoding
    once it holds two sequences with a token each, before instance 1 gets any command
    (`faults.StalledFirst`), so their groups gate step K and R5 spreads them onto idle instance 1
    (`Migrate` 0 -> 1, the only move the scheduler can make while instance 0 stalls); instance 0
    then decodes on, instance 1 dies at its first import. Whichever instance takes its first load
    late (`late`, an injected delay), the same order."""
    loops = {None: {0: faults.StallUntilMigrate, 1: faults.DieAfterImport},
             "staller": {0: faults.LateStallUntilMigrate, 1: faults.DieAfterImport},
             "other": {0: faults.StallUntilMigrate, 1: faults.LateDieAfterImport}}[late]
    recipe = _kill_recipe("dora", 0, 1)
    prepared = prepare(recipe)
    rt = RecordsExports(recipe, prepared, keep_versions=True, instance_loops=loops)
    rt.exported = []
    moves, holding, result = _run_killed_while_moving(rt, killed=1)
    (gid, idx, attempt), src, dst, forwarded = rt.exported[0]
    assert (attempt, src, dst, forwarded) == (0, 0, 1, True)
    # at its death the destination ran exactly what had been moved there (nothing else was left
    # to dispatch while the moved groups gated the step): each is redone once, none retried
    moved = {(m.group_id, m.index) for m in moves}
    assert (gid, idx) in moved and holding == [(1, moved)], holding
    m = result.core_metrics
    assert m["redispatched"] == len(moved) and m["retries"] == 0
    led = result.ledger
    for key in moved:
        assert led["dispatch"][key][2] == 1, key
        assert set(led["token_versions"][key]) == {led["group_version"][key[0]]}
        assert led["served_by"][key] != 1
    redone = _check_books(result, recipe, prepared)
    assert set(redone) == moved


@pytest.mark.slow
@pytest.mark.parametrize("borrow", [False, True], ids=["one-rank", "borrow"])
def test_a_trainer_killed_in_the_middle_of_a_checkpoint_write_resumes_from_the_one_before(borrow, tmp_path):
    """`faults.DieMidCheckpoint`: the trainer dies half-way through writing checkpoint 4 (its temporary file cut,
    nothing reported). `latest` still names checkpoint 2, the error says so, and the resumed run trains every admitted
    group exactly once, a full batch every step, counted from the trainer's own ledger. The resume removes the cut file
    and checkpoint 4's other half (they used to stay on disk for good)."""
    from dora_ext.runtime.faults import DieMidCheckpoint

    recipe = recipe_from_dict(tiny(steps=6, runtime=_borrow(borrow)))
    prepared = prepare(recipe)
    ckpt = tmp_path / "ckpt"
    rt = Runtime(recipe, prepared, checkpoint_dir=str(ckpt), checkpoint_every=2, trainer_loop=DieMidCheckpoint)
    with pytest.raises(WorkerDied, match="trainer process exited .* The run can continue from its last checkpoint"):
        rt.run()
    assert (ckpt / "latest").read_text().strip() == "2"
    assert (ckpt / "trainer-000004.pt.tmp").exists()  # the cut write
    result = Runtime(recipe, prepared, checkpoint_dir=str(ckpt), resume=True, keep_versions=True).run()
    led = result.ledger
    assert set(led["trained"]) == set(led["prompts"]) and all(len(s) == 1 for s in led["trained"].values())
    assert [len(g) for g in led["step_groups"]] == [recipe.dora.batch_size] * recipe.steps
    assert result.metrics["c1_ok"] and result.metrics["c2_ok"] and result.metrics["c3_ok"]
    # the resume removed what the killed run left half-done (the cut file, checkpoint 4's other half)
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "state-000002.pt", "trainer-000002.pt"]


def test_a_live_worker_whose_report_cannot_be_read_is_ended():
    """An unreadable report ("lost") from a worker that still lives: nothing it said can be taken into the books, so the
    coordinator ends it (the watcher then handles it as dead); one from a worker already gone is only named. (Handles
    stand in for the processes here: what is checked is the coordinator's decision.)"""

    class Handle:
        def __init__(self, alive):
            self.alive, self.killed = alive, False

        def is_alive(self):
            return self.alive

        def kill(self):
            self.killed, self.alive = True, False

    recipe = recipe_from_dict(tiny())
    rt = Runtime(recipe, prepare(recipe))
    rt.instance_handles = {0: Handle(True), 1: Handle(False)}
    rt.starting = {2: (None, Handle(True))}
    rt.trainer_handles = [Handle(True)]
    for name in ("instance-0", "instance-1", "instance-2", "trainer"):
        rt._on_message(("lost", name, "ConnectionRefusedError: [Errno 111] Connection refused"))
    assert rt.instance_handles[0].killed and not rt.instance_handles[1].killed
    assert rt.starting[2][1].killed and rt.trainer_handles[0].killed
    assert [n for n, _ in rt.reports_lost] == ["instance-0", "instance-1", "instance-2", "trainer"]


def test_resume_sends_a_fresh_instance_no_void_attempt():
    """`Runtime._restart_from_checkpoint` on a restored snapshot in which instance 0 runs three
    trajectories and instance 1 has room. No processes: the commands stay in the coordinator's
    outgoing lists, exactly what each fresh instance process would receive.

    Failing the snapshot's instances one by one re-dispatched instance 0's trajectories onto
    instance 1 (still listed), which then failed too and was registered again under its id: its
    fresh process got a `submit` of the void attempt before its `load`, ran it, and refused a later
    load of an older version while it held that sequence's KV (seen once in the resumed run of
    `test_a_checkpoint_reported_by_a_trainer_that_then_died_counts`: "instance 1: cannot load
    version 3 while 1 sequences hold KV of version 4 (e.g. (11, 0, 1))")."""
    import json
    import queue

    from dora_ext.core import Scheduler
    from dora_ext.core import events as E

    recipe = recipe_from_dict(tiny(steps=6))
    rt = Runtime(recipe, prepare(recipe))
    rt.trainer_inboxes = [queue.SimpleQueue()]  # DeliverGroup lands here
    rt._execute(rt.sched.start())
    for iid in list(rt.sched.instances):
        rt._execute(rt.sched.handle(E.InstanceLoaded(iid, 0)))
    while True:  # instance 1's trajectories finish until it has room (nothing refills it)
        inst = rt.sched.instances[1]
        if len(inst.running) < inst.capacity:
            break
        gid, idx = rt.sched.running_on(1)[0]
        rt.results[gid][idx] = "finished"  # the ledger entry a finish writes (never trained here)
        rt._execute(rt.sched.handle(E.TrajectoryFinished(gid, idx, tokens=3, reward=0.5, attempt=0)))
    assert len(rt.sched.instances[0].running) == 3 and rt.sched.instances[1].running
    rt.sched = Scheduler.restore(json.loads(json.dumps(rt.sched.snapshot())))
    rt._outgoing = {}
    rt._restart_from_checkpoint()
    for iid in (0, 1):
        cmds = rt._outgoing.get(iid, [])
        assert cmds and cmds[0][0] == "load", (iid, cmds)  # a fresh engine gets its weights first
        assert [c[0] for c in cmds].count("load") == 1, (iid, cmds)
        for c in cmds:
            if c[0] == "submit":
                gid, idx, attempt = c[1]
                assert rt.sched.trajectory(gid, idx).attempt == attempt, (iid, c[1], "a void attempt")
    # Every trajectory that ran at the checkpoint is queued again, under a new attempt.
    assert all(t.status == "Q" for g in rt.sched.groups for t in rt.sched.trajectories(g) if t.attempt), rt.sched.snapshot()


@pytest.mark.slow
@pytest.mark.parametrize("mode,loop", [("dora", "DieInAllreduce"), ("dora", "DieInAllreduceRank0"),
                                       ("sync", "DieInAllreduce")],
                         ids=["borrow-kill-rank1", "borrow-kill-rank0", "sync-2-ranks-kill-rank1"])
def test_a_rank_killed_in_the_allreduce_is_a_dead_trainer_and_the_run_resumes(mode, loop, tmp_path):
    """Data parallel (dora with `runtime.trainer_borrow`, or sync's 2-rank trainer): one rank is killed (SIGKILL) right
    before it joins its first gradient allreduce of step 2 (`faults.DieInAllreduce`), so its peer is in that allreduce
    and fails with it. Whichever the coordinator notices first (the peer's failed collective or the dead process), the
    run ends as a dead trainer naming the killed rank and how to resume; the resumed run (checkpoint 2) trains every
    admitted group exactly once across both runs, a full batch per step, and each version it publishes is a single
    trainer's step from checkpoint 2 (model and optimizer) on the groups in the order they were handed out (two PPO
    minibatches): both ranks resumed from the checkpoint."""
    import shutil

    import torch

    from dora_ext.runtime import faults
    from dora_ext.runtime.workers import TrainerRecipe, build_trainer

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a 2-rank trainer needs 2 cores (runtime.cores <= available cores)")
    rt_section = {"trainer_borrow": True, "cores": 2} if mode == "dora" else {"sync_trainer_ranks": 2, "cores": 2}
    recipe = recipe_from_dict(tiny(steps=5, runtime=rt_section, trainer={"ppo_minibatches": 2, "lr": 0.01},
                                   dora={"batch_size": 4, "capacity": 4})).with_mode(mode)
    prepared = prepare(recipe)
    ckpt = str(tmp_path / "ckpt")
    victim = getattr(faults, loop).victim
    rt = Runtime(recipe, prepared, checkpoint_dir=ckpt, checkpoint_every=2, trainer_loop=getattr(faults, loop))
    with pytest.raises(WorkerDied, match=rf"trainer process exited \(rank {victim}, exit code -9\).* at step 2\. "
                                         r"The run can continue from its last checkpoint") as info:
        rt.run()
    assert len(rt.trainer_handles) == 2
    assert "trainer process exited (rank" in str(info.value)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "2"
    shutil.copytree(ckpt, tmp_path / "ckpt-2")  # the resumed run replaces checkpoint 2 by its own 4
    result = Runtime(recipe, prepared, checkpoint_dir=ckpt, resume=True, keep_versions=True).run()
    led = result.ledger
    assert set(led["trained"]) == set(led["prompts"]) and all(len(s) == 1 for s in led["trained"].values())
    assert [len(g) for g in led["step_groups"]] == [recipe.dora.batch_size] * recipe.steps
    assert [sorted(o) for o in led["step_order"]] == [sorted(g) for g in led["step_groups"]]
    single = build_trainer(TrainerRecipe(prepared.model_config, dict(recipe.trainer), prepared.weights, "cpu",
                                         resume=str(tmp_path / "ckpt-2" / "trainer-000002.pt")))
    assert single.version == 2
    for step in range(2, recipe.steps):
        for gid in led["step_order"][step]:
            single.add_group(led["results"][gid])
        single.finish_step(step)
        for k, w in single.publish().items():
            if k.endswith("k_proj.bias"):
                continue  # its true gradient is 0 (test_runtime_modes): rounding noise scaled by Adam
            torch.testing.assert_close(result.versions[step + 1][k], w, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_rank_that_raises_its_own_error_is_not_a_dead_trainer(tmp_path):
    """`faults.FailInAllreduce`: trainer rank 1 (borrowing) raises an error of its own at step 2 and
    exits; rank 0 then fails its allreduce. No process was killed, so this is not a dead trainer
    to resume (a resume would only meet the same error): the run ends with the rank's own error,
    whichever of the two reports (or exits) the coordinator sees first."""
    from dora_ext.runtime.faults import FailInAllreduce

    recipe = recipe_from_dict(tiny(steps=4, runtime=_borrow(True)))
    rt = Runtime(recipe, prepare(recipe), trainer_loop=FailInAllreduce)
    with pytest.raises(RuntimeError, match=r"injected error on trainer rank 1 at step 2") as info:
        rt.run()
    assert not isinstance(info.value, WorkerDied)


class _Handle:
    """A trainer rank's process as `Runtime._ranks_failed` sees it: alive until it has been asked
    `alive_for` times, then exited with `exitcode`."""

    def __init__(self, exitcode, alive_for=0):
        self.exitcode_when_dead, self.alive_for = exitcode, alive_for

    def is_alive(self):
        self.alive_for -= 1
        return self.alive_for >= 0

    @property
    def exitcode(self):
        return None if self.alive_for >= 0 else self.exitcode_when_dead


class _Pipes:
    """What each worker left on its pipe (`outbox.drain(name)`)."""

    def __init__(self, left):
        self.left = left

    def drain(self, name):
        return self.left.pop(name, [])


CLOSED = ("error", "trainer", "RuntimeError('[gloo] Connection closed by peer')", "tb0")
OWN = ("error", "trainer-1", "ValueError('a bug of rank 1')", "tb1")


@pytest.mark.parametrize("first,handles,pipes,want", [
    # rank 1 raised its own error, which was read first; rank 0 failed its collective, then exited
    ("own", [(0, 0), (0, 0)], {"trainer": [CLOSED]}, RuntimeError),
    # the same, rank 0's failed collective read first: rank 1's own error is on its pipe
    ("closed", [(0, 0), (0, 0)], {"trainer-1": [OWN]}, RuntimeError),
    # rank 1 was killed: it reported nothing; seen dead only after a few polls
    ("closed", [(0, 0), (-9, 3)], {}, WorkerDied),
    # the dead processes noticed first (`_watch`): rank 0 exited after its failed collective,
    # rank 1 was killed; the killed one is named
    (None, [(0, 0), (-9, 0)], {"trainer": [CLOSED]}, WorkerDied),
    # rank 0 was killed; rank 1's failed collective read first
    ("closed-1", [(-9, 0), (0, 5)], {}, WorkerDied),
])
def test_which_rank_failed_does_not_depend_on_what_is_read_first(first, handles, pipes, want):
    """`Runtime._ranks_failed` (no processes: the ranks' process states and pipes are given): a rank
    that exited without a word was killed, and the run ends as a dead trainer naming it; when
    every exited rank reported an error, the ranks' own errors end the run (a rank's bug is not a
    crash to resume from), in either order of reading the reports."""
    recipe = recipe_from_dict(tiny())
    rt = Runtime(recipe, prepare(recipe))
    rt.trainer_handles = [_Handle(*h) for h in handles]
    rt.outbox = _Pipes(dict(pipes))
    reports = {"own": {1: ["trainer-1: " + OWN[2]]}, "closed": {0: ["trainer: " + CLOSED[2]]},
               "closed-1": {1: ["trainer-1: " + CLOSED[2]]}, None: {}}[first]
    with pytest.raises(want) as info:
        rt._ranks_failed(reports, "tb", wait_s=5.0)
    msg = str(info.value)
    if want is WorkerDied:
        killed = [r for r, (code, _) in enumerate(handles) if code]
        assert f"trainer process exited (rank {killed[0]}, exit code -9)" in msg
        assert "--resume" in msg
    else:
        assert type(info.value) is RuntimeError
        assert "a bug of rank 1" in msg and "Connection closed by peer" in msg


class DiesBeforeItsStop(Runtime):
    """The real runtime; instance 0's process gets SIGKILL (and is joined) at the moment the coordinator puts its
    "stop": after the run counted it among the workers that will report their logs, before it could read the stop.
    Each read of the report pipe while the logs are collected is counted."""

    def _collect_stats(self, *args):
        self.stats_reads = 0
        get = self.outbox.get

        def counted(*args, **kwargs):
            self.stats_reads += 1
            return get(*args, **kwargs)

        self.outbox.get = counted
        super()._collect_stats(*args)

    def _wait_ready(self, count, handles):
        super()._wait_ready(count, handles)
        inbox = self.inboxes[0]
        put = inbox.put

        def put_or_kill_first(msg):
            if msg == ("stop",):
                _sigkill(self, 0, notice=False)
            put(msg)

        inbox.put = put_or_kill_first


def test_a_worker_that_dies_after_the_last_step_ends_the_log_collection_at_once():
    """The logs of the live workers are collected, the dead one's are not waited for: without the check of which
    workers are still alive the coordinator read its (by then empty) report pipe until a 60 s deadline."""
    recipe = recipe_from_dict(tiny(steps=3)).with_mode("dora")
    prepared = prepare(recipe)
    rt = DiesBeforeItsStop(recipe, prepared)
    result = rt.run()
    assert result.metrics["c1_ok"] and result.metrics["dropped"] == 0
    assert 1 in rt.instance_stats and 0 not in rt.instance_stats
    # A read per live worker's logs, then one per second until the live ones have exited (under a second each
    # unless the machine is loaded); waiting for the dead one took a read a second for 60 s, or many more once
    # every pipe was closed.
    assert rt.stats_reads < 30, rt.stats_reads

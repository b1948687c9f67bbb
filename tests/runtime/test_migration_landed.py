"""The embedded runtime answers each R5 `Migrate` with `MigrationLanded` once the destination's
worker reports it took the sequence in ("imported"), so a trajectory may move again in its attempt.

Real worker processes, real engines (the KV cache moves between them), real SIGKILLs. Every
order is forced with the loops of `dora_ext/runtime/faults.py` and the coordinator hooks below,
never left to timing. What is checked comes from the runtime's own ledger (`migration_log`: each
move it executed, each "imported" report it read and what it did with it), the engines' own
import counters and the trainer's ledger (`_check_books`), not from the scheduler's counters alone.
"""

from __future__ import annotations

import signal
from collections import defaultdict

import pytest

from dora_ext.core import ProtocolError
from dora_ext.core import events as E
from dora_ext.runtime import faults, prepare, recipe_from_dict
from dora_ext.runtime.faults import StalledFirst
from dora_ext.runtime.runtime import Runtime

from .conftest import tiny
from .test_faults import _check_books, _kill_recipe, _moves_until_the_first_failure


def _spy_landings(rt) -> list:
    """A list that gets, for each `MigrationLanded` the runtime feeds its scheduler: (the event, the trajectory's
    `moved` flag before and after it, the stale events it added, whether an `InstanceFailed` had been fed before it)."""
    seen: list = []
    failed: list = []
    handle = rt.sched.handle

    def spy(event):
        if isinstance(event, E.InstanceFailed):
            failed.append(event.instance_id)
        if not isinstance(event, E.MigrationLanded):
            return handle(event)
        view = rt.sched.trajectory(event.group_id, event.index)
        before, stale = view.moved, rt.sched.metrics()["stale_events"]
        out = handle(event)
        seen.append((event, before, view.moved, rt.sched.metrics()["stale_events"] - stale, list(failed)))
        return out

    rt.sched.handle = spy
    return seen


def _by_key(log: list) -> dict:
    out: dict = defaultdict(list)
    for entry in log:
        out[(entry[1], entry[2])].append(entry)
    return out


def _check_landing_counts(result, dead_imports: int = 0) -> None:
    """`migrations_landed` is the number of "imported" reports read, and equals what the engines
    themselves imported (`dead_imports`: those of engines that died, whose stats never came back);
    `landings_sent` the reports answered with `MigrationLanded`."""
    led = result.ledger
    imported = [e for e in led["migration_log"] if e[0] == "imported"]
    assert led["migrations_landed"] == len(imported) == result.metrics["migrations_landed"]
    engines = sum(s["imports"] for s in led["engine_stats"].values())
    assert led["migrations_landed"] == engines + dead_imports, (led["migrations_landed"], engines, dead_imports)
    assert led["landings_sent"] == sum(1 for e in imported if e[5] == "landed")
    # every move executed was exported, or its sequence had finished first
    assert led["migrations_executed"] + led["migrations_missed"] == result.metrics["migrations"]
    # and none reached a source that did not hold its sequence yet (a worker's `_forward`): the
    # scheduler moves a trajectory again only after `MigrationLanded`, sent once its destination
    # reported "imported"
    assert led["migrations_forwarded"] == 0


class GoOnceLanded(StalledFirst, Runtime):
    """Instance 0 (`faults.StallUntilMigrateThenGo`) stalls first on four sequences with a token each
    (`faults.StalledFirst`): their groups gate step K, and R5 spreads two of them onto idle instance 1
    (`faults.StallAfterImport`, which then keeps them: it decodes nothing until it is told to move one on). Once every
    sequence moved to instance 1 was read "imported" there (and answered with `MigrationLanded`), instance 0 gets
    ("go",): it finishes the two it kept and runs dry, and the scheduler plans it idle while instance 1 still holds its
    two. R5's spread then moves one of them back to instance 0, a second move in the same attempt, possible only because
    both landed. Without landings nothing can move and the run stalls (`RuntimeStall`)."""

    went = False

    def _on_message(self, msg):
        super()._on_message(msg)
        if msg[0] == "imported" and not self.went:
            to_1 = sum(1 for e in self.migration_log if e[0] == "move" and e[5] == 1)
            in_1 = sum(1 for e in self.migration_log if e[0] == "imported" and e[4] == 1)
            if to_1 and in_1 == to_1:
                self.went = True
                self._send(0, ("go",))


def _landing_recipe():
    data = tiny(steps=8, seed=0, task={"median": 8, "cap": 16, "cv": 1.0},
                dora={"batch_size": 2, "group_size": 4, "instances": 2, "capacity": 4},
                runtime={"max_instance_restarts": 0, "stall_timeout_s": 30})
    return recipe_from_dict(data).with_mode("dora")


@pytest.mark.slow
def test_a_trajectory_that_landed_moves_again_in_its_attempt():
    """A trajectory moved 0 -> 1, landed on 1, moved 1 -> 0 and landed on 0, all in attempt 0, as the runtime's own log
    of what it executed and what the workers reported shows; each landing the scheduler got cleared the trajectory's
    `moved` flag (a stale landing would not); the engines imported exactly what the coordinator read as "imported";
    nothing was redone and every admitted group was trained exactly once (the forced order: `GoOnceLanded`)."""
    recipe = _landing_recipe()
    prepared = prepare(recipe)
    rt = GoOnceLanded(recipe, prepared, keep_versions=True,
                      instance_loops={0: faults.StallUntilMigrateThenGo, 1: faults.StallAfterImport})
    landings = _spy_landings(rt)
    result = rt.run()
    led = result.ledger
    log = led["migration_log"]
    assert rt.went, log
    # the spread: four on instance 0, R5's even share for idle instance 1 is two
    assert [e[0] for e in log[:4]] == ["move", "move", "imported", "imported"], log
    assert {(e[4], e[5]) for e in log[:2]} == {(0, 1)} and {e[1:3] for e in log[:2]} == {e[1:3] for e in log[2:4]}
    # then instance 1's two, evenly shared with idle instance 0: one moves again
    assert log[4][0] == "move" and log[4][4:] == (1, 0), log
    key = log[4][1:3]
    by_key = _by_key(log)
    assert by_key[key] == [("move", *key, 0, 0, 1), ("imported", *key, 0, 1, "landed"),
                           ("move", *key, 0, 1, 0), ("imported", *key, 0, 0, "landed")], by_key[key]
    assert led["dispatch"][key] == [0, 0, 0] and led["served_by"][key] == 0
    # every landing fed was applied: the trajectory was moved before, may move again after
    assert landings and all(before and not after and stale == 0 for _, before, after, stale, _ in landings), landings
    assert len(landings) == led["landings_sent"] >= 3
    _check_landing_counts(result)
    assert led["migrations_forwarded"] == 0  # (a second move waits for the landing: nothing is passed on)
    assert result.core_metrics["retries"] == result.core_metrics["redispatched"] == 0
    assert not result.ledger["failed_instances"]
    assert _check_books(result, recipe, prepared) == []  # nothing redone


def test_runtime_sends_a_landing_for_each_import():
    """The default forced move (`faults.StallUntilMigrate` stalls first, R5 spreads onto idle
    instance 1): every sequence instance 1 imported is answered with `MigrationLanded`, applied
    by the scheduler (its `moved` flag cleared); the landings counted are the engines' imports."""
    data = tiny(steps=6, seed=0, task={"median": 5, "cv": 1.5},
                dora={"capacity": 8, "batch_size": 4, "group_size": 4, "instances": 2, "max_staleness": 2})
    recipe = recipe_from_dict(data)

    class StallsFirst(StalledFirst, Runtime):
        pass

    rt = StallsFirst(recipe, prepare(recipe), instance_loops={0: faults.StallUntilMigrate})
    landings = _spy_landings(rt)
    result = rt.run()
    led = result.ledger
    imported = [e for e in led["migration_log"] if e[0] == "imported"]
    assert imported and all(e[5] == "landed" for e in imported), led["migration_log"]
    assert [(ev.group_id, ev.index, ev.attempt) for ev, *_ in landings] == [tuple(e[1:4]) for e in imported]
    assert all(before and not after and stale == 0 for _, before, after, stale, _ in landings), landings
    _check_landing_counts(result)
    assert result.metrics["c1_ok"] and result.metrics["c2_ok"] and result.metrics["c3_ok"]
    # what `dora-ext train` prints and `dora-ext compare`'s table shows: the moves, and how many landed
    from dora_ext.runtime.cli import format_report
    from dora_ext.runtime.report import aggregate, table

    moves, landed = result.metrics["migrations"], len(imported)
    assert 0 < landed <= moves == sum(1 for e in led["migration_log"] if e[0] == "move")
    assert f"migrations {moves} ({landed} landed)" in format_report("tiny", result)
    agg = aggregate({"dora": [result]})
    assert (agg["dora"]["migrations"], agg["dora"]["migrations_landed"]) == (moves, landed)
    assert any(line.startswith("migrations (landed)") and line.endswith(f"{moves} ({landed})")
               for line in table(agg).splitlines()), table(agg)


class DestinationDiesAtImport(StalledFirst, Runtime):
    """Instance 0 (`faults.StallUntilMigrate`) stalls first (`faults.StalledFirst`); R5 spreads
    onto idle instance 1 (`faults.DieAfterImport`), which dies (SIGKILL) right after it took in
    the first sequence and wrote "imported". `order`:

    "imported first": the coordinator reads the "imported" report before it notices the death
    (it looks at its workers only once it has handled that report, then at once);
    "death first": right after passing the first export on to instance 1 the coordinator waits
    for its exit and looks at its workers: the report is taken from the dead worker's pipe."""

    order = "imported first"
    victim = 1
    looked = False

    def _watch(self, trainer):
        if self.order == "imported first" and not self.looked:
            return  # no look at the workers before the victim's "imported" is handled
        super()._watch(trainer)

    def _on_message(self, msg):
        super()._on_message(msg)
        if self.order == "imported first" and msg[0] == "imported" and msg[1] == self.victim and not self.looked:
            self.looked = True
            self.instance_handles[self.victim].join(timeout=60)
            self._watch(self.trainer_handles)

    def _on_export(self, src, dst, state):
        super()._on_export(src, dst, state)
        if self.order == "death first" and dst == self.victim and not self.looked:
            self.looked = True
            self._flush()  # the import goes out now
            self.instance_handles[dst].join(timeout=60)
            self._watch(self.trainer_handles)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["imported first", "death first"])
def test_a_destination_killed_right_after_importing_in_both_orders(order):
    """The destination dies right after its "imported" report. Read before the death is noticed, the landing is sent and
    applied (the sequence is no longer `moved`), then the failure re-dispatches it; noticed first, the report is read
    from the dead worker's pipe and no landing is sent (the failure re-dispatches it). Either way: no crash, every
    sequence moved there is re-dispatched exactly once under its pinned version, none retried, the books balanced."""
    recipe = _kill_recipe("dora", 0, 1)
    prepared = prepare(recipe)
    rt = DestinationDiesAtImport(recipe, prepared, keep_versions=True,
                                 instance_loops={0: faults.StallUntilMigrate, 1: faults.DieAfterImport})
    rt.order = order
    landings = _spy_landings(rt)
    moves, holding = _moves_until_the_first_failure(rt)
    result = rt.run()
    assert rt.looked and rt.failed_instances == {1: -signal.SIGKILL}
    assert result.ledger["instance_restarts"] == [(1, 2)]
    led = result.ledger
    (imp,) = [e for e in led["migration_log"] if e[0] == "imported" and e[4] == 1]
    _, gid, idx, attempt, _, outcome = imp
    assert attempt == 0
    to_victim = [(ev, failed) for ev, *_, failed in landings if (ev.group_id, ev.index, ev.attempt) == (gid, idx, 0)]
    if order == "imported first":
        assert outcome == "landed"
        (ev, before, after, stale, failed), = [x for x in landings if x[0] is to_victim[0][0]]
        assert before and not after and stale == 0 and failed == []  # applied, before the failure
    else:
        assert outcome == "instance failed" and to_victim == []  # never sent
    moved = {(m.group_id, m.index) for m in moves}
    assert all((m.src, m.dst) == (0, 1) for m in moves) and (gid, idx) in moved
    assert holding[0] == (1, moved), holding  # on instance 1 at its failure: re-dispatched
    m = result.core_metrics
    assert m["redispatched"] == len(moved) and m["retries"] == 0
    for key in moved:
        assert led["dispatch"][key][2] == 1 and led["served_by"][key] != 1, key
        assert set(led["token_versions"][key]) == {led["group_version"][key[0]]}
    _check_landing_counts(result, dead_imports=1)  # the victim's import is counted, its stats died with it
    assert set(_check_books(result, recipe, prepared)) == moved


class RetriesTheFirstExport(StalledFirst, Runtime):
    """Instance 0 (`faults.StallUntilMigrate`) stalls first (`faults.StalledFirst`) and R5 spreads onto idle instance 1.
    The first export read is held back: the coordinator reports its trajectory failed (`TrajectoryFailed` of the attempt
    that was moving, as a host whose transfer failed would), and passes the export on only once the scheduler
    re-dispatched the trajectory under a new attempt. So an export arrives whose attempt is over while its destination
    lives: only the attempt check can drop it (forwarded, the destination would run a void attempt)."""

    held = None
    passed = None  # (request id, destination alive) of the held export once passed on

    def _on_export(self, src, dst, state):
        if self.held is None:
            self.held = (src, dst, state)
            gid, idx, attempt = state.request_id
            self._execute(self.sched.handle(E.TrajectoryFailed(gid, idx, "forced: its transfer failed", attempt)))
            self._pass_held()
            return
        super()._on_export(src, dst, state)

    def _on_message(self, msg):
        super()._on_message(msg)
        self._pass_held()

    def _pass_held(self):
        if self.held is None or self.passed is not None:
            return
        src, dst, state = self.held
        gid, idx, attempt = state.request_id
        if self.dispatch[(gid, idx)][2] != attempt:  # re-dispatched: its attempt is over
            self.passed = (state.request_id, dst in self.inboxes)
            super()._on_export(src, dst, state)


@pytest.mark.slow
def test_an_export_whose_attempt_is_over_is_dropped():
    """An exported sequence reaching the coordinator after its trajectory was re-dispatched
    (forced: `RetriesTheFirstExport`) is dropped, not imported on its (live) destination; the
    new attempt runs and is trained; nothing else is redone."""
    recipe = _kill_recipe("dora", 0, 0)
    prepared = prepare(recipe)
    rt = RetriesTheFirstExport(recipe, prepared, keep_versions=True, instance_loops={0: faults.StallUntilMigrate})
    result = rt.run()
    assert rt.passed is not None, "the held export was never passed on"
    (gid, idx, attempt), dst_alive = rt.passed
    assert attempt == 0 and dst_alive
    led = result.ledger
    assert led["exports_dropped"] == 1
    assert not [e for e in led["migration_log"] if e[0] == "imported" and (e[1], e[2], e[3]) == (gid, idx, 0)]
    assert led["dispatch"][(gid, idx)][2] == 1 and result.core_metrics["retries"] == 1
    _check_landing_counts(result)
    assert _check_books(result, recipe, prepared) == [(gid, idx)]


class HoldsLandingsPastCheckpoint4(StalledFirst, Runtime):
    """Instance 0 (`faults.StallUntilMigrate`) stalls first (`faults.StalledFirst`), so R5 spreads its sequences onto
    idle instance 1 before step 2 can start (their groups gate it). Every "imported" report is held back until the
    coordinator has written its half of checkpoint 4 (after step 3), then handled in order: so checkpoint 4 holds moves
    that have not landed (`held_at_save`: the reports held when it was written, `running_at_save`: those whose sequence
    still ran, most of them finished), whatever the timing. The trainer (`faults.DieAfterCheckpoint`) is killed right
    after it reported checkpoint 4."""

    held: list
    held_at_save = None

    def _on_message(self, msg):
        if self.held_at_save is None and msg[0] == "imported":
            self.held = getattr(self, "held", []) + [msg]
            return
        if self.held_at_save is not None and getattr(self, "held", None):
            held, self.held = self.held, []
            for m in held:
                super()._on_message(m)
        super()._on_message(msg)

    def _save_state(self, version):
        super()._save_state(version)
        if version == 4:
            self.held_at_save = list(getattr(self, "held", []))
            self.running_at_save = set()  # of those, the moved trajectories still running
            for _, _, (gid, idx, attempt) in self.held_at_save:
                try:
                    view = self.sched.trajectory(gid, idx)
                    if view.status == "R" and view.attempt == attempt and view.moved:
                        self.running_at_save.add((gid, idx, attempt))
                except ProtocolError:
                    pass  # its group was trained and left the scheduler


@pytest.mark.slow
def test_a_checkpoint_with_a_move_in_flight_resumes_without_double_counting(tmp_path):
    """Checkpoint 4 is written while moved sequences have not landed (forced: `HoldsLandingsPastCheckpoint4`), the
    trainer dies right after it, the run is resumed. The resumed run starts from the checkpoint's own record of the
    moves (`migration_log`, its counters) and adds to it: nothing of what the killed run did after the checkpoint
    counts, the checkpoint's moves are not counted twice, a landing for a move made before the resume never arrives
    (fresh processes; those trajectories run again under a new attempt), and the scheduler's count of moves equals the
    moves the runtime executed across both runs."""
    import torch

    from dora_ext.runtime import WorkerDied

    recipe = _kill_recipe("dora", 0, 0)
    prepared = prepare(recipe)
    ckpt = str(tmp_path / "ckpt")
    rt = HoldsLandingsPastCheckpoint4(recipe, prepared, checkpoint_dir=ckpt, checkpoint_every=2,
                                      instance_loops={0: faults.StallUntilMigrate},
                                      trainer_loop=faults.DieAfterCheckpoint)
    with pytest.raises(WorkerDied, match="The run can continue from its last checkpoint"):
        rt.run()
    assert rt.held_at_save, "no landing was in flight when checkpoint 4 was written"
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "4"
    saved = torch.load(str(tmp_path / "ckpt" / "state-000004.pt"), weights_only=False)
    slog = saved["ledger"]["migration_log"]
    moved = {tuple(e[1:4]) for e in slog if e[0] == "move"}
    landed = {tuple(e[1:4]) for e in slog if e[0] == "imported"}
    in_flight = {tuple(m[2]) for m in rt.held_at_save}
    assert in_flight and in_flight <= moved and not in_flight & landed, (slog, in_flight)
    assert saved["ledger"]["migrations_landed"] == len([e for e in slog if e[0] == "imported"])
    assert saved["scheduler"] is not None

    resumed = Runtime(recipe, prepared, checkpoint_dir=ckpt, resume=True)
    landings = _spy_landings(resumed)
    result = resumed.run()
    led = result.ledger
    log = led["migration_log"]
    assert log[:len(slog)] == slog, "the resumed run's record of moves must extend the checkpoint's"
    after = log[len(slog):]
    # no landing for a move made before the resume: one still running ran again under a new attempt
    assert not [e for e in after if e[0] == "imported" and tuple(e[1:4]) in in_flight], after
    for gid, idx, attempt in rt.running_at_save:
        assert led["dispatch"][(gid, idx)][2] > attempt
    assert all(stale == 0 for *_, stale, _ in landings), landings
    imported = [e for e in log if e[0] == "imported"]
    assert led["migrations_landed"] == len(imported) == result.metrics["migrations_landed"]
    assert led["landings_sent"] == sum(1 for e in imported if e[5] == "landed")
    # the scheduler's moves (its snapshot's count, then this run's) are the moves the runtime executed
    assert result.core_metrics["migrations"] == result.metrics["migrations"] == sum(1 for e in log if e[0] == "move")
    assert set(led["trained"]) == set(led["prompts"]) and all(len(s) == 1 for s in led["trained"].values())
    assert [len(g) for g in led["step_groups"]] == [recipe.dora.batch_size] * recipe.steps
    assert result.metrics["c1_ok"] and result.metrics["c2_ok"] and result.metrics["c3_ok"]

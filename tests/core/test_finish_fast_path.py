"""The fast path of `TrajectoryFinished` carrying the current attempt (c9) against the general
path every attempt-carrying finish took before: both schedulers get the same adversarial event
streams (stale attempts from crashed instances, finishes of trajectories whose migration has not
landed, finishes after a failure re-queued them, NaN and integer rewards, finishes for groups
already reported failed, events without attempts) and must answer every event alike, raise alike,
and end with equal snapshots."""

import random

import pytest

from dora_ext.config import MODES
from dora_ext.core import Scheduler
from dora_ext.core import events as E
from dora_ext.core import _state as S

from .test_adversarial import RUNS, AdversarialDriver, _config, _ks
from .test_properties import check_run


class GeneralPathScheduler(Scheduler):
    """The scheduler with `_on_finished` as it was before the fast path: any finish carrying an
    attempt goes through `_running_traj` (on the group slots and trajectory handles of `_slot_of`, `_traj_status`, `_traj_tokens`, ...)."""

    def _on_finished_general(self, ev):
        g = self._slot_of.get(ev.group_id)
        idx = ev.index
        if g is None or ev.attempt is not None or not 0 <= idx < self.n or self._traj_status[g * self.n + idx] != S._RUNNING:
            h = self._running_traj(ev.group_id, idx, ev.attempt)
            if h is None:
                return
            g = self._slot_of[ev.group_id]
        else:
            h = g * self.n + idx
        self._traj_tokens[h] = ev.tokens
        if ev.truncated_early:
            self.m["truncated"] += 1
        self._release(h)
        if self._group_state[g] == S._FAILED and ev.reward is not None:
            self._retire(g, h)
            return
        self._traj_status[h] = S._AWAIT_REWARD
        if self._group_state[g] == S._FAILED:
            return
        if ev.reward is not None:
            self._set_reward(g, h, ev.reward)

    _handlers = {**Scheduler._handlers, E.TrajectoryFinished: _on_finished_general}


def test_the_general_path_copy_matches_the_scheduler_state_names():
    assert (S._LETTERS[S._RUNNING], S._LETTERS[S._AWAIT_REWARD], S._STATES[S._FAILED]) == ("R", "F", "failed")


@pytest.mark.parametrize("mode", MODES)
def test_fast_path_answers_like_the_general_path(mode):
    rng = random.Random(len(mode) * 7919)
    twin_events = stale = migrations = 0
    for _ in range(RUNS // 2):
        K = rng.choice(_ks(mode))
        cfg = _config(mode, K, rng, 6)
        trunc = rng.choice([0.0, 0.05])  # truncated finishes break C2 on purpose: checked only without
        d = AdversarialDriver(
            cfg, rng.randrange(2**31), fail_prob=rng.choice([0, 0.05]), crash_prob=rng.choice([0.01, 0.04]),
            nan_prob=rng.choice([0, 0.05]), long_tail=0.3, late_reward=rng.choice([0.0, 0.3]),
            fail_awaiting=rng.choice([0, 0.1]), stale_prob=1.0, decline_prob=0.1, progress_prob=0.1,
            truncate_prob=trunc, landed_prob=rng.choice([0.0, 0.5]), restore_prob=0.0, resume_prob=0.01,
        )
        d.shadow = GeneralPathScheduler(cfg)
        out = d.sched.start()
        assert d.shadow.start() == out
        d.execute(out)
        try:
            d.run(6)
            if not trunc:
                check_run(mode, d, 6)
        except BaseException as exc:
            raise AssertionError(f"mode {mode} K={K} cfg={cfg}: {exc!r}") from exc
        assert d.shadow.snapshot() == d.sched.snapshot()
        twin_events += d.twin_events
        m = d.sched.metrics()
        stale += m["stale_events"]
        migrations += m["migrations"]
    assert twin_events > 1000 and stale > 0, (twin_events, stale)
    if mode == "dora":
        assert migrations > 0

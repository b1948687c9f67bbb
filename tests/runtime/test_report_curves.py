"""The reward-vs-time helpers used by `compare` and the CPU benchmark."""

from types import SimpleNamespace

from dora_ext.runtime.report import smoothed, time_to_reward


def _run(rewards):
    return SimpleNamespace(steps=[{"reward_mean": r, "time_s": 10.0 * (i + 1)} for i, r in enumerate(rewards)])


def test_smoothed_is_a_trailing_mean():
    assert smoothed([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5]
    assert smoothed([4.0], 3) == [4.0]


def test_time_to_reward_counts_full_windows_only():
    # high first batch (an asynchronous mode's short answers first), then a climb
    run = _run([0.9, 0.2, 0.2, 0.4, 0.6, 0.8])
    assert time_to_reward(run, 0.5, 3) == 60.0  # (0.4 + 0.6 + 0.8) / 3 = 0.6 at step 6
    assert time_to_reward(run, 0.7, 3) is None
    assert time_to_reward(run, 0.5, 1) == 10.0

"""Data-parallel `Trainer` over real gloo process groups: an uneven share of the groups between two
ranks takes the single trainer's step, because each group's position in the whole batch (not its
rank's share) decides its PPO minibatch.

Two real processes (fork) join a gloo group on 127.0.0.1; the single trainer runs in the test
process on the same groups.
"""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch

from dora_ext.algo.trainer import Trainer, TrainerConfig, minibatch_bounds, minibatch_of

from .test_algo_trainer import make, mixed_groups

CONFIG = dict(algorithm="grpo", correction="decoupled", lr=0.02, ppo_minibatches=2, ppo_epochs=2,
              micro_tokens=12, entropy_coef=0.01)
#: rank 0 gets six groups, rank 1 two, both in the second minibatch (positions 0-3 and 4-7)
SHARES = {0: [0, 1, 2, 3, 4, 6], 1: [5, 7]}


def _groups(policy):
    return mixed_groups(policy, 5, seed=8) + mixed_groups(policy, 4, seed=9)


def _rank(rank: int, port: int, positions: bool, policy, out) -> None:
    import datetime

    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        groups = _groups(policy)
        tr = Trainer(policy, TrainerConfig(**CONFIG), version=2)
        for p in SHARES[rank]:
            tr.add_group(groups[p], p if positions else None)
        metrics = tr.finish_step(2)
        out.put((rank, {k: v.clone() for k, v in tr.policy.state_dict().items()}, metrics))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, repr(exc), None))


def _two_ranks(policy, positions: bool) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, positions, copy.deepcopy(policy), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, state, metrics = out.get(timeout=120)
            assert metrics is not None, state
            results[rank] = (state, metrics)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return results


def test_minibatch_of_follows_the_single_trainers_chunks():
    assert minibatch_bounds(8, 2) == [0, 4, 8]
    assert [minibatch_of(p, 8, 2) for p in range(8)] == [0] * 4 + [1] * 4
    assert [minibatch_of(p, 5, 2) for p in range(5)] == [0, 0, 1, 1, 1]  # round(2.5) = 2
    assert [minibatch_of(p, 3, 4) for p in range(3)] == [0, 1, 2]  # never more chunks than groups
    assert minibatch_of(9, 8, 2) == 1  # a position beyond the expected batch: the last minibatch


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork for the two gloo ranks")
def test_an_uneven_data_parallel_split_takes_the_single_trainers_step():
    """Rank 0 trains six groups, rank 1 two (both of the second minibatch, so rank 1 has nothing in
    the first: an empty share still joins every allreduce); two minibatches, two epochs,
    length-sorted micro-batches. The parameters after the step equal the single trainer's on the
    eight groups in position order (float summation order aside), on both ranks. Without the
    positions each rank chunks its own share (rank 0: 0 1 2 | 3 4 6, rank 1: 5 | 7), so the first
    minibatch would be groups 0 1 2 5, one the single trainer never forms, and the parameters
    differ: the check can fail."""
    policy, _ = make(8)
    ref = Trainer(copy.deepcopy(policy), TrainerConfig(**CONFIG), version=2)
    for g in _groups(policy):
        ref.add_group(g)
    ref_metrics = ref.finish_step(2)
    expected = ref.policy.state_dict()

    dp = _two_ranks(policy, positions=True)
    for rank in (0, 1):
        state, metrics = dp[rank]
        for k, w in expected.items():
            torch.testing.assert_close(state[k], w, rtol=1e-5, atol=1e-5)
        for k in ("loss", "entropy", "reward_mean", "tokens", "grad_norm", "updates"):
            assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-6), k
    assert any(not torch.equal(expected[k], w) for k, w in policy.state_dict().items())  # the step moved

    old = _two_ranks(policy, positions=False)[0][0]
    assert any(not torch.allclose(old[k], w, rtol=1e-5, atol=1e-5) for k, w in expected.items())


def test_positions_are_all_or_none_and_cover_the_batch():
    policy, _ = make(8)
    groups = _groups(policy)
    tr = Trainer(copy.deepcopy(policy), TrainerConfig(**CONFIG), version=2)
    tr.add_group(groups[0], 0)
    with pytest.raises(ValueError, match="position: give one for every group of a step or for none"):
        tr.add_group(groups[1])
    tr = Trainer(copy.deepcopy(policy), TrainerConfig(**CONFIG), version=2)
    tr.add_group(groups[0], 0)
    tr.add_group(groups[1], 2)
    with pytest.raises(ValueError, match=r"positions to be 0\.\.1, got \[0, 2\]"):
        tr.finish_step(2)
    with pytest.raises(ValueError, match="position: expected an integer >= 0"):
        Trainer(copy.deepcopy(policy), TrainerConfig(**CONFIG), version=2).add_group(groups[0], -1)

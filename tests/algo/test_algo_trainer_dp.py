"""Data-parallel `Trainer` over real gloo process groups: an uneven share of the groups between two
ranks takes the single trainer's step, because each group's position in the whole batch (not its
rank's share) decides its PPO minibatch.

Two real processes (fork) join a gloo group on 127.0.0.1; the single trainer runs in the test
process on the same groups.
"""

from __future__ import annotations

import copy
import io
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
        # As bytes: a tensor put on the queue travels as a shared-memory file descriptor that the
        # parent fetches from this process, which may have exited by then (ConnectionResetError).
        buf = io.BytesIO()
        torch.save(tr.policy.state_dict(), buf)
        out.put((rank, buf.getvalue(), metrics))
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
            results[rank] = (torch.load(io.BytesIO(state), weights_only=True), metrics)
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
    """Rank 0 trains six groups, rank 1 two (both of the second minibatch, so rank 1 has nothing in the first: an empty
    share still joins every allreduce); two minibatches, two epochs, length-sorted micro-batches. The parameters after
    the step equal the single trainer's on the eight groups in position order (float summation order aside), on both
    ranks. Without the positions each rank chunks its own share (rank 0: 0 1 2 | 3 4 6, rank 1: 5 | 7), so the first
    minibatch would be groups 0 1 2 5, one the single trainer never forms, and the parameters differ: the check can
    fail."""
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


#: Trainer configurations and, per step, each rank's share of the 8 groups (positions). Every case
#: runs two steps from version 2 on the same two gloo ranks; the single trainer runs in the test
#: process. Uneven shares everywhere; "rank 1 idle" gets no group at all in a step.
DP_CASES = {
    "none-token-mean-one-update-rank1-idle": (
        dict(algorithm="grpo", correction="none", lr=0.02),
        [{0: list(range(8)), 1: []}, {0: [0, 2], 1: [1, 3, 4, 5, 6, 7]}]),
    "tis-seq-mean-3-minibatches-2-epochs": (
        dict(algorithm="grpo", correction="tis", loss_agg_mode="seq-mean-token-mean", lr=0.02,
             ppo_minibatches=3, ppo_epochs=2, clip_high=0.28),
        [{0: [0, 1, 2, 7], 1: [3, 4, 5, 6]}, {0: [5], 1: [0, 1, 2, 3, 4, 6, 7]}]),
    "decoupled-mask-dr-grpo-kl-micro": (
        dict(algorithm="grpo", correction="decoupled", is_cap_mode="mask", norm_adv_by_std=False,
             kl_coef=0.05, micro_tokens=10, lr=0.02, ppo_minibatches=2),
        [{0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}, {0: [], 1: list(range(8))}]),
    "sao-correction-entropy-more-minibatches-than-groups": (
        dict(algorithm="grpo", correction="sao", entropy_coef=0.01, lr=0.02, ppo_minibatches=16,
             weight_decay=0.1),
        [{0: [1, 3, 5], 1: [0, 2, 4, 6, 7]}, {0: [6], 1: [0, 1, 2, 3, 4, 5, 7]}]),
    # SAO with a value model; step 2 is the critic's warm-up (the policy gets no gradient at all,
    # on every rank), step 3 moves the policy: its AdamW state must be the single trainer's
    "sao-value-critic-warmup": (
        dict(algorithm="sao", critic_warmup=3, lr=0.02, value_lr=0.05, ppo_minibatches=2),
        [{0: [0, 1, 2, 3, 4, 5], 1: [6, 7]}, {0: [7], 1: [0, 1, 2, 3, 4, 5, 6]}]),
    "sao-value-critic-warmup-weight-decay-seq-mean": (
        dict(algorithm="sao", critic_warmup=3, lr=0.02, weight_decay=0.5,
             loss_agg_mode="seq-mean-token-mean", entropy_coef=0.01),
        [{0: [0, 5], 1: [1, 2, 3, 4, 6, 7]}, {0: list(range(8)), 1: []}]),
}


def _case_trainer(name: str, policy, value):
    cfg, _ = DP_CASES[name]
    return Trainer(copy.deepcopy(policy), TrainerConfig(**cfg),
                   value_head=copy.deepcopy(value) if cfg["algorithm"] == "sao" else None, version=2)


def _states(tr) -> dict:
    out = {f"policy.{k}": v.clone() for k, v in tr.policy.state_dict().items()}
    if tr.value_params:
        out.update({f"value.{k}": v.clone() for k, v in tr.value_head.state_dict().items()})
    return out


def _rank_cases(rank: int, port: int, policy, value, out) -> None:
    import datetime

    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        groups = _groups(policy)
        results = {}
        for name, (_, shares) in DP_CASES.items():
            tr = _case_trainer(name, policy, value)
            steps = []
            for step, share in enumerate(shares, start=2):
                for p in share[rank]:
                    tr.add_group(groups[p], p)
                metrics = tr.finish_step(step)
                steps.append((_states(tr), metrics))
            results[name] = steps
        buf = io.BytesIO()  # plain bytes: tensors sent as such would need this process alive to be read
        torch.save(results, buf)
        out.put((rank, buf.getvalue()))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        out.put((rank, traceback.format_exc() + repr(exc)))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork for the two gloo ranks")
def test_every_trainer_configuration_takes_the_single_trainers_steps_data_parallel():
    """Each correction, both loss aggregations, Dr.GRPO's unnormalised advantages, minibatch counts that do not divide
    the batch (and exceed it), micro-batches, a KL reference, the entropy bonus, weight decay, SAO with a value model
    and its critic warm-up, groups of 5 and 4 trajectories of varied lengths; a rank that gets no group in a minibatch
    or in a whole step. Two steps each, so that the optimizer's state after the first is compared too: every parameter
    (policy and value model) on both ranks equals the single trainer's after each step, and so do the metrics."""
    import multiprocessing as mp

    policy, value = make(8, value=True)
    groups = _groups(policy)
    ctx = mp.get_context("fork")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_cases, args=(r, port, copy.deepcopy(policy), copy.deepcopy(value), out))
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        dp = {}
        for _ in procs:
            rank, res = out.get(timeout=300)
            assert isinstance(res, bytes), res
            dp[rank] = torch.load(io.BytesIO(res))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    failures = []
    for name, (_, shares) in DP_CASES.items():
        ref = _case_trainer(name, policy, value)
        for i, step in enumerate(range(2, 2 + len(shares))):
            for p in range(8):
                ref.add_group(groups[p])
            ref_metrics = ref.finish_step(step)
            want = _states(ref)
            for rank in (0, 1):
                state, metrics = dp[rank][name][i]
                for k, w in want.items():
                    if not torch.allclose(state[k], w, rtol=1e-5, atol=1e-5):
                        failures.append(f"{name} step {step} rank {rank}: {k} differs by "
                                        f"{float((state[k] - w).abs().max()):.2e}")
                for k, v in ref_metrics.items():
                    if metrics.get(k) != pytest.approx(v, rel=1e-5, abs=1e-6):
                        failures.append(f"{name} step {step} rank {rank}: metric {k} {metrics.get(k)} != {v}")
        assert any(not torch.equal(want[k], w) for k, w in _states(_case_trainer(name, policy, value)).items())
    assert not failures, "\n".join(failures)

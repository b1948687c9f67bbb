"""``DoraReplayBuffer`` over a real TransferQueue: the scheduler's batches, and C1/C2/C3 counted
from what TransferQueue shows (engine-reported versions, vanished, truncated, duplicated groups)."""

from __future__ import annotations

import pytest

from dora_ext.verl.sampler import DoraReplayBuffer, group_version


def test_group_version_is_the_oldest_engine_reported_version():
    assert group_version({"global_steps": 5}, [{"min_global_steps": 4}, {"min_global_steps": 3}]) == 3
    assert group_version({"global_steps": 5}, []) == 4


def test_sampler_needs_the_scheduler():
    buffer = DoraReplayBuffer("dora", {}, None, "wait", {"max_staleness": 1})
    with pytest.raises(RuntimeError, match="trainer_mode=dora"):
        buffer._from_scheduler(0, 2, [])


# --------------------------------------------------------------------------- real TransferQueue
def _put_prompts(tq, uids, global_steps):
    tq.kv_batch_put(keys=uids, partition_id="train",
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": global_steps} for _ in uids])


def _finish(tq, uid, version, n, failed=False, versions=None, sessions=None):
    """What ``AgentLoopWorkerTQ`` writes when a group's n sessions end (the generation itself is
    the part that stands in for a GPU rollout server: token ids are random)."""
    import torch
    from tensordict import TensorDict

    m = n if sessions is None else sessions
    keys = [f"{uid}_{s}_0" for s in range(m)]
    lo, hi = versions or (version, version)
    fields = TensorDict({"responses": torch.randint(0, 100, (m, 4))}, batch_size=m)
    tags = [{"status": "success", "global_steps": version + 1, "min_global_steps": lo,
             "max_global_steps": hi, "seq_len": 8} for _ in keys]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=fields, tags=tags)
    tq.kv_put(key=uid, partition_id="train", tag={"status": "failure" if failed else "finished"})


@pytest.mark.slow
def test_sampler_counts_constraints_from_transfer_queue(ray_tq):
    tq = ray_tq
    n = 2
    batches = {0: ["a0", "a1"], 1: ["b0", "b1"], 2: ["c0", "c1"]}
    buffer = DoraReplayBuffer("dora", {}, None, "wait",
                              {"max_staleness": 1, "step_batch_size": 2, "group_size": n, "poll_interval": 0.0})
    buffer.step_source = lambda step: batches.get(step)
    pending = []
    buffer.on_wait = lambda: pending and pending.pop(0)()  # one group finishes per poll

    # Step 1: waits for both groups of the scheduler's batch, then hands them out.
    _put_prompts(tq, ["a0", "a1", "x"], 1)
    _finish(tq, "a0", 0, n)
    pending.append(lambda: _finish(tq, "a1", 0, n))
    meta, m = buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert sorted({k.split("_", 1)[0] for k in meta.keys}) == ["a0", "a1"] and len(meta.keys) == 4
    assert m["dora/c1_ok"] == m["dora/c2_ok"] == m["dora/c3_ok"] == 1.0 and m["dora/waited_for_older"] >= 1
    tq.kv_clear(keys=list(meta.keys), partition_id="train")

    # Step 2: b0 spans two engine versions (C1), b1 lost a trajectory (C2 truncated), and the
    # prompt "x" vanished from TransferQueue untrained and unreported (C2 dropped).
    _put_prompts(tq, ["b0", "b1"], 2)
    _finish(tq, "b0", 1, n, versions=(0, 1))
    _finish(tq, "b1", 1, n, sessions=1)
    tq.kv_clear(keys=["x"], partition_id="train")
    meta, m = buffer.sample(global_steps=2, partition_id="train", batch_size=2)
    assert m["dora/c1_violations"] == 2 and m["dora/c1_ok"] == 0.0
    assert m["dora/truncated"] == 1 and m["dora/dropped"] == 1 and m["dora/c2_ok"] == 0.0
    tq.kv_clear(keys=list(meta.keys), partition_id="train")

    # Step 3: a failed group is evicted and replaced through refill_fn, not counted as dropped.
    refills = []
    buffer.refill_fn = refills.append
    _put_prompts(tq, ["c0", "c1", "f"], 3)
    _finish(tq, "f", 2, n, failed=True)
    _finish(tq, "c0", 2, n)
    _finish(tq, "c1", 2, n)
    meta, m = buffer.sample(global_steps=3, partition_id="train", batch_size=2)
    assert refills == [1] and m["dora/failed_groups"] == 1 and m["dora/dropped"] == 1
    assert buffer.trained_uids() == {"a0", "a1", "b0", "b1", "c0", "c1"}
    left = sorted((tq.kv_list("train") or {}).get("train", {}))
    tq.kv_clear(keys=left + list(meta.keys), partition_id="train")


@pytest.mark.slow
def test_a_group_handed_out_again_is_counted_duplicated_not_waited_for(ray_tq):
    """C2 ``dora/duplicated`` must be able to move. A group the scheduler lists again after it was
    trained (its prompt key is gone from TransferQueue: it can never be complete again), or twice
    in one batch, is counted and skipped; before, the sampler waited for it forever (a hang, no
    counter) or trained it twice in one batch uncounted."""
    tq = ray_tq
    n = 2
    batches = {0: ["a0", "a1"], 1: ["a0", "b0", "b1", "b1"]}
    buffer = DoraReplayBuffer("dora", {}, None, "wait",
                              {"max_staleness": 1, "step_batch_size": 2, "group_size": n, "poll_interval": 0.0,
                               "max_wait_s": 5})
    buffer.step_source = lambda step: batches.get(step)
    _put_prompts(tq, ["a0", "a1"], 1)
    _finish(tq, "a0", 0, n)
    _finish(tq, "a1", 0, n)
    meta, m = buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert m["dora/duplicated"] == 0 and m["dora/c2_ok"] == 1.0
    tq.kv_clear(keys=list(meta.keys), partition_id="train")

    _put_prompts(tq, ["b0", "b1"], 2)
    _finish(tq, "b0", 1, n)
    _finish(tq, "b1", 1, n)
    meta, m = buffer.sample(global_steps=2, partition_id="train", batch_size=2)
    assert sorted({k.split("_", 1)[0] for k in meta.keys}) == ["b0", "b1"] and len(meta.keys) == 2 * n
    assert m["dora/duplicated"] == 2 and m["dora/c2_ok"] == 0.0
    left = sorted((tq.kv_list("train") or {}).get("train", {}))
    tq.kv_clear(keys=left + list(meta.keys), partition_id="train")

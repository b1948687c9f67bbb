"""R3 batch selection (``select_groups``) and ``DoraReplayBuffer`` over a real TransferQueue."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_ext.verl.sampler import DoraReplayBuffer, GroupState, group_version, select_groups


def _simulate(seed: int, K: int, B: int, steps: int) -> list[list[tuple[str, int]]]:
    """Admission as verl's dora trainer does it (K warm-up batches, then B per step) with groups
    completing in random order; returns per step the (uid, version) trained."""
    rng = random.Random(seed)
    groups: dict[str, GroupState] = {}
    running: list[str] = []
    done_order = 0
    admitted = iter(range(1_000_000))

    def admit(count: int, version: int) -> None:
        for _ in range(count):
            seq = next(admitted)
            uid = f"g{seq}"
            groups[uid] = GroupState(uid, version, False, seq)
            running.append(uid)

    admit(K * B, 0)
    out = []
    for k in range(steps):
        admit(B, k)  # prepare_step of step k runs with version k published
        while True:
            sel = select_groups(groups.values(), step=k, K=K, size=B, slots_left=B, step_size=B)
            if sel.uids:
                break
            assert running, "waiting with nothing running: a deadlock"
            # the engines make progress: some running group completes (random order)
            uid = running.pop(rng.randrange(len(running)))
            groups[uid] = GroupState(uid, groups[uid].version, True, done_order)
            done_order += 1
        out.append([(u, groups[u].version) for u in sel.uids])
        for u in sel.uids:
            del groups[u]
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), K=st.integers(0, 3), B=st.integers(1, 5))
def test_r3_never_exceeds_staleness_and_trains_each_group_once(seed, K, B):
    steps = 8
    batches = _simulate(seed, K, B, steps)
    seen = set()
    for k, batch in enumerate(batches):
        assert len(batch) == B
        for uid, v in batch:
            assert 0 <= k - v <= K  # C3
            assert uid not in seen  # C2: no duplicate
            seen.add(uid)


def test_mandatory_group_is_waited_for_not_skipped():
    # K=1, step 3: g0 (version 2) is due; newer complete groups must not take its slot.
    groups = [GroupState("old", 2, False, 0), GroupState("new1", 3, True, 0), GroupState("new2", 3, True, 1)]
    sel = select_groups(groups, step=3, K=1, size=2, slots_left=2, step_size=2)
    assert sel.uids == () and sel.waiting_for[0] == "old" and sel.mandatory == 1
    groups[0] = GroupState("old", 2, True, 2)
    sel = select_groups(groups, step=3, K=1, size=2, slots_left=2, step_size=2)
    assert sel.uids == ("old", "new1")  # mandatory first, then completion order


def test_edf_waits_for_older_group_that_is_due_next_step():
    # K=1, B=2, step 0: four version-0 groups (the R2 budget) are due by step 1; taking the newer
    # complete group now would leave three for the two slots of step 1.
    groups = [GroupState(f"a{i}", 0, i == 0, i) for i in range(4)] + [GroupState("b", 1, True, 9)]
    sel = select_groups(groups, step=0, K=1, size=2, slots_left=2, step_size=2)
    assert sel.uids == ()
    assert set(sel.waiting_for) <= {"a1", "a2", "a3"}
    # with one more version-0 group complete the step is a0 + a1, never b
    groups[1] = GroupState("a1", 0, True, 1)
    assert select_groups(groups, step=0, K=1, size=2, slots_left=2, step_size=2).uids == ("a0", "a1")


def test_group_version_sources():
    assert group_version({"global_steps": 5, "dora_version": 2}, [{"min_global_steps": 4}]) == 2
    assert group_version({"global_steps": 5}, [{"min_global_steps": 4}, {"min_global_steps": 3}]) == 3
    assert group_version({"global_steps": 5}, []) == 4


# --------------------------------------------------------------------------- real TransferQueue
def _put_prompts(tq, uids, global_steps):
    tq.kv_batch_put(keys=uids, partition_id="train",
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": global_steps} for _ in uids])


def _finish(tq, uid, version, n, failed=False):
    """What ``AgentLoopWorkerTQ`` writes when a group's n sessions end (the generation itself is
    the part that stands in for a GPU rollout server: token ids are random)."""
    import torch
    from tensordict import TensorDict

    keys = [f"{uid}_{s}_0" for s in range(n)]
    fields = TensorDict({"responses": torch.randint(0, 100, (n, 4))}, batch_size=n)
    tags = [{"status": "success", "global_steps": version + 1, "min_global_steps": version,
             "max_global_steps": version, "seq_len": 8} for _ in keys]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=fields, tags=tags)
    tq.kv_put(key=uid, partition_id="train", tag={"status": "failure" if failed else "finished"})


@pytest.mark.slow
def test_sampler_on_transfer_queue_mixed_versions_random_order(ray_tq):
    tq = ray_tq
    K, B, n, steps = 1, 3, 2, 6
    rng = random.Random(7)
    version_of: dict[str, int] = {}
    running: list[str] = []
    refills: list[int] = []
    counter = iter(range(10_000))

    def submit(count, global_steps):
        uids = [f"u{next(counter):04d}" for _ in range(count)]
        _put_prompts(tq, uids, global_steps)
        for u in uids:
            version_of[u] = global_steps - 1
        running.extend(uids)
        return count

    failing = {"u0004"}  # this group's rollout fails once: evicted, reported and replaced

    def progress():  # the sampler's wait hook stands for time passing: one group finishes
        if running:
            uid = running.pop(rng.randrange(len(running)))
            _finish(tq, uid, version_of[uid], n, failed=uid in failing)

    kwargs = {"max_staleness": K, "step_batch_size": B, "poll_interval": 0.0}
    buffer = DoraReplayBuffer("dora", {}, None, "wait", kwargs,
                              refill_fn=lambda c: refills.append(c) or submit(c, current["g"]))
    buffer.on_wait = progress
    current = {"g": 1}
    submit(K * B, 1)  # warm-up, as the dora trainer's on_train_begin
    trained: list[str] = []
    for g in range(1, steps + 1):
        current["g"] = g
        submit(B, g)  # prepare_step
        meta, metrics = buffer.sample(global_steps=g, partition_id="train", batch_size=B)
        uids = sorted({k.split("_", 1)[0] for k in meta.keys})
        assert len(uids) == B and len(meta.keys) == B * n
        k = g - 1
        # R3: every group due at this step (version <= k - K) that is still untrained is in it.
        due = {u for u, v in version_of.items() if v <= k - K and u not in trained and u not in failing}
        assert due <= set(uids)
        assert all(0 <= k - version_of[u] <= K for u in uids)  # C3
        assert metrics["dora/staleness_max"] <= K and metrics["dora/c3_ok"] == 1.0
        trained.extend(uids)
        tq.kv_clear(keys=list(meta.keys), partition_id="train")  # as PPOTrainer.fit does after a step
    assert len(trained) == len(set(trained))  # C2: nothing twice
    assert refills == [1] and metrics["dora/failed_groups"] == 1 and metrics["dora/dropped"] == 0
    # C2: nothing dropped -- every admitted group is trained, failed (and reported) or still in TQ.
    left = {u for u, t in (tq.kv_list("train") or {}).get("train", {}).items() if t.get("is_prompt")}
    assert set(version_of) == set(trained) | failing | left
    tq.kv_clear(keys=sorted(left | {k for k in (tq.kv_list("train") or {}).get("train", {})}), partition_id="train")

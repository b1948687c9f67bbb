"""The rollout side of trainer mode ``dora`` with verl's real agent-loop code, several steps.

Real: verl 0.9.1's ``AgentLoopManagerTQ``/``AgentLoopWorkerTQ`` (through our subclasses),
its single-turn agent loop and chat templating (a tokenizer made in the test), TransferQueue,
Ray, our client/coordinator/scheduler, ``DoraReplayBuffer`` reading what the workers wrote.
Stand-ins: ``EngineServer`` (a tiny torch model with continuous batching) for the vLLM servers;
the test body plays the trainer's loop (submit a batch, sample, publish a version, load it on
the replicas the scheduler names) without an FSDP actor.
"""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def _verl_config(model_dir: str, *overrides: str):
    from hydra import compose, initialize_config_dir

    import verl

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[
            "trainer.v1.trainer_mode=dora", f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.agent.num_workers=1",
            "actor_rollout_ref.rollout.prompt_length=64", "actor_rollout_ref.rollout.response_length=24",
            *overrides])


def test_dora_rollout_side_over_several_steps(ray_tq, tiny_hf_dir):
    import ray
    from verl.utils import tensordict_utils as tu

    from dora_ext.verl.coordinator import create_coordinator
    from dora_ext.verl.engine_server import EngineServer
    from dora_ext.verl.manager import DoraAgentLoopManager, DoraLLMServerClient
    from dora_ext.verl.sampler import DoraReplayBuffer
    from dora_ext.verl.settings import dora_config
    from dora_ext.verl.trainer import configure

    tq = ray_tq
    K, B, n, steps = 1, 2, 2, 4
    cfg = _verl_config(tiny_hf_dir, f"data.train_batch_size={B}", f"actor_rollout_ref.rollout.n={n}",
                       f"+dora.max_staleness={K}", "+dora.instances=2", "+dora.capacity=3",
                       "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2",
                       "actor_rollout_ref.rollout.tensor_model_parallel_size=1",  # 2 replicas, as served below
                       "actor_rollout_ref.rollout.checkpoint_engine.backend=dora_store",
                       f"actor_rollout_ref.actor.ppo_mini_batch_size={B}", "trainer.v1.separate_async.parameter_sync_step=1")
    configure(cfg)
    dcfg = dora_config(cfg)
    servers = {f"srv{i}": ray.remote(EngineServer).options(num_cpus=0).remote(
        {"vocab_size": 64, "d_model": 16, "n_layer": 1, "n_head": 2, "max_len": 128}, 3, i, 24) for i in range(2)}
    ray.get([s.load_version.remote(0) for s in servers.values()])
    coord = create_coordinator(dcfg, servers)
    ray.get(coord.start.remote(0))
    client = DoraLLMServerClient(config=cfg, load_balancer_handle=coord)
    manager = DoraAgentLoopManager.create(config=cfg, llm_client=client, teacher_client=None,
                                          reward_loop_worker_handles=None)

    def service():  # what DoraTrainer._service does with the replicas' checkpoint engines
        work = ray.get(coord.take_work.remote())
        for src in work["abort"]:
            ray.get(servers[f"srv{src}"].abort_all_requests.remote())
            ray.get(servers[f"srv{src}"].resume_generation.remote())
        for iid, v in work["load"]:
            ray.get(servers[f"srv{iid}"].load_version.remote(v))
            ray.get(coord.loaded.remote([iid], v))

    buffer = DoraReplayBuffer("dora", {}, None, "wait", dict(cfg.trainer.v1.sampler.sampler_kwargs) | {
        "poll_interval": 0.02, "max_wait_s": 240})
    buffer.step_source = lambda step: (service(), ray.get(coord.step_batch.remote(step)))[1]
    buffer.on_wait = service

    def submit(count: int, global_steps: int) -> list[str]:  # PPOTrainer._submit_batch_to_rollout
        uids = [str(uuid.uuid4()) for _ in range(count)]
        batch = tu.get_tensordict({
            "raw_prompt": np.array([[{"role": "user", "content": "what is one plus two ?"}]] * count, dtype=object),
            "uid": np.array(uids, dtype=object), "index": np.arange(count),
            "data_source": np.array(["toy"] * count, dtype=object)})
        tu.assign_non_tensor_data(batch, "global_steps", global_steps)
        tq.kv_batch_put(keys=uids, partition_id="train",
                        tags=[{"is_prompt": True, "status": "pending", "global_steps": global_steps}] * count)
        manager.generate_sequences(batch)
        return uids

    submitted = submit(K * B, 1)  # on_train_begin: K warm-up batches
    trained = []
    for g in range(1, steps + 1):
        submitted += submit(B, g)  # prepare_step
        meta, metrics = buffer.sample(global_steps=g, partition_id="train", batch_size=B)
        uids = sorted({k.split("_", 1)[0] for k in meta.keys})
        assert len(uids) == B and len(meta.keys) == B * n
        # What verl's workers wrote: every trajectory from one version, within the bound (C1, C3).
        for tag in meta.tags:
            assert tag["min_global_steps"] == tag["max_global_steps"]
            assert 0 <= (g - 1) - tag["min_global_steps"] <= K
        data = tq.kv_batch_get(keys=list(meta.keys), partition_id="train", select_fields=["responses", "prompts"])
        assert len(data["responses"]) == B * n
        trained += uids
        tq.kv_clear(keys=list(meta.keys), partition_id="train")
        ray.get(coord.step_finished.remote(g))  # DoraTrainer.on_step_end publishes version g
        service()
    # The K*B groups submitted beyond the last step still run; the core starts step steps+1 from them
    # when they complete (groups_trained counts a group when its step starts). Wait for that step
    # (step_batch takes the 0-based index, as the sampler passes it) so the books are read in one
    # state: every submitted group is in a started step.
    deadline = time.monotonic() + 240
    while (last := ray.get(coord.step_batch.remote(steps))) is None:
        assert time.monotonic() < deadline, ray.get(coord.metrics.remote())
        service()
        time.sleep(0.02)
    assert sorted(last) == sorted(set(submitted) - set(trained))
    m = ray.get(coord.metrics.remote())
    assert m["c1_ok"] and m["c2_ok"] and m["c3_ok"] and m["groups_trained"] == (steps + K) * B, m
    assert len(set(trained)) == len(trained) == steps * B and set(trained) <= set(submitted)
    left = [k for k in (tq.kv_list("train") or {}).get("train", {})]
    if left:
        tq.kv_clear(keys=left, partition_id="train")
    for w in manager.agent_loop_workers:
        ray.kill(w)

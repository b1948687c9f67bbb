"""``DoraTrainer``'s weight handling: subset loads, old versions from CPU copies, R5 aborts.

Real: ``DoraTrainer`` methods, verl's config and ``omega_conf_to_dataclass``, Ray. Stand-ins
(they need GPUs in verl): the actor worker group (records which weights it holds; verl's is a
``DetachActorWorker`` group with the same ``save_model_to_cpu`` / ``restore_model_from_cpu`` /
``clear_cpu_model`` calls), ``CheckpointEngineManager`` (records which replicas it syncs with
which actor weights; verl's does an NCCL broadcast), and a scripted coordinator actor.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow


class _ActorGroup:
    def __init__(self, version: int) -> None:
        self.current = f"w{version}"
        self.saved: dict = {}
        self.calls: list = []

    def save_model_to_cpu(self, key):
        self.saved[key] = self.current
        self.calls.append(("save", key))

    def restore_model_from_cpu(self, key):
        self.current = self.saved[key]
        self.calls.append(("restore", key))

    def clear_cpu_model(self, key):
        self.saved.pop(key, None)
        self.calls.append(("clear", key))


def _trainer(ray, monkeypatch, work, actor_version, kept):
    from hydra import compose, initialize_config_dir

    import verl
    import verl.checkpoint_engine as ce

    from dora_ext.config import DoraConfig
    from dora_ext.verl.trainer import DoraTrainer

    syncs = []

    class _Coordinator:  # defined here so that Ray ships it by value to the actor process
        def __init__(self, work):
            self.work, self.loads = work, []

        def take_work(self):
            work, self.work = self.work, {"load": [], "abort": []}
            return work

        def loaded(self, instances, version):
            self.loads.append((list(instances), version))

        def get_loads(self):
            return self.loads

        def pending_load_versions(self):
            return sorted({v for _, v in self.work["load"]})

    class _Sync:  # stands in for CheckpointEngineManager over a subset of replicas
        def __init__(self, config, actor_wg, replicas):
            self.actor_wg, self.replicas = actor_wg, replicas

        def update_weights(self, version):
            syncs.append(("update", [r for r in self.replicas], version, self.actor_wg.current))

        def abort_replicas(self):
            syncs.append(("abort", list(self.replicas)))

        def resume_generation_replicas(self):
            syncs.append(("resume", list(self.replicas)))

    monkeypatch.setattr(ce, "CheckpointEngineManager", _Sync)
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"])
    t = DoraTrainer.__new__(DoraTrainer)  # no GPUs: skip __init__/init, set what the methods read
    t.config = cfg
    t.dora = DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "instances": 2})
    t.actor_rollout_wg = _ActorGroup(actor_version)
    for v in kept:
        t.actor_rollout_wg.saved[f"dora_v{v}"] = f"w{v}"
    t._cpu_versions = list(kept)
    t._actor_version = actor_version
    t._live_version = actor_version
    t._publishes = False
    t.standalone_server_manager = type("M", (), {"rollout_replicas": ["rep0", "rep1"]})()
    t.coordinator = ray.remote(_Coordinator).remote(work)
    return t, syncs


def test_subset_loads_and_old_version_from_cpu_copy(ray_tq, monkeypatch):
    import ray

    t, syncs = _trainer(ray, monkeypatch, {"load": [(0, 3), (1, 2)], "abort": [1]}, 3, [2, 3])
    t._service()
    # R5 first: the migrated-from replica is aborted (its requests resume elsewhere), then loads.
    assert syncs[0] == ("abort", ["rep1"]) and syncs[1] == ("resume", ["rep1"])
    # Version 2 is synced from the restored CPU copy, each replica alone, nothing else touched.
    assert ("update", ["rep1"], 2, "w2") in syncs and ("update", ["rep0"], 3, "w3") in syncs
    assert t.actor_rollout_wg.current == "w3" and "dora_current" not in t.actor_rollout_wg.saved
    assert sorted(ray.get(t.coordinator.get_loads.remote())) == [([0], 3), ([1], 2)]


def test_published_version_loads_from_its_copy_after_an_optimizer_step(ray_tq, monkeypatch):
    """Defect 1: with parameter_sync_step > 1 the sampler's wait loop runs between mini-batches, when
    the actor has already taken an optimizer step; a load of the published version must come from
    the copy taken at publish time, not from the live parameters."""
    import ray

    t, syncs = _trainer(ray, monkeypatch, {"load": [(0, 3)], "abort": []}, 3, [2, 3])
    t.actor_rollout_wg.current = "w3+minibatch0"  # what _update_actor did to the live parameters
    t._live_version = None  # DoraTrainer._update_actor marks it
    t._service()
    assert ("update", ["rep0"], 3, "w3") in syncs
    assert t.actor_rollout_wg.current == "w3+minibatch0"  # the live parameters are put back


def test_update_actor_marks_live_parameters(monkeypatch):
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    from dora_ext.verl.trainer import DoraTrainer

    monkeypatch.setattr(PPOTrainerSeparateAsync, "_update_actor", lambda self, batch, metrics: batch)
    t = DoraTrainer.__new__(DoraTrainer)
    t._live_version = 3
    assert t._update_actor("b", {}) == "b" and t._live_version is None


def test_version_no_longer_kept_is_an_error(ray_tq, monkeypatch):
    import ray

    t, _ = _trainer(ray, monkeypatch, {"load": [(0, 1)], "abort": []}, 3, [2, 3])
    with pytest.raises(RuntimeError, match="version 1"):
        t._service()


def test_cpu_copies_keep_the_last_k_plus_one_versions(ray_tq, monkeypatch):
    import ray

    t, _ = _trainer(ray, monkeypatch, {"load": [], "abort": []}, 4, [2, 3])
    t._keep_cpu_copy(4)
    assert t._cpu_versions == [3, 4]
    assert set(t.actor_rollout_wg.saved) == {"dora_v3", "dora_v4"}


def test_a_cpu_copy_a_pending_load_asks_for_is_kept_past_k_plus_one(ray_tq, monkeypatch):
    """A load of version 2 not done yet (held by the coordinator while a request routed to its
    replica runs: ``pending_load_versions``) keeps version 2's copy past the last K + 1; the first
    publish after the load drops it. Before, the copy was cleared and the load, once handed out,
    failed with "no longer kept"."""
    import ray

    t, syncs = _trainer(ray, monkeypatch, {"load": [(1, 2)], "abort": []}, 4, [2, 3])
    t._keep_cpu_copy(4)
    assert t._cpu_versions == [2, 3, 4]
    t._service()  # the load, handed out later: version 2 from its copy
    assert ("update", ["rep1"], 2, "w2") in syncs
    t._keep_cpu_copy(5)
    assert t._cpu_versions == [4, 5]
    assert set(t.actor_rollout_wg.saved) == {"dora_v4", "dora_v5"}

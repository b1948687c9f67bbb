"""verl's own Hydra config (``ppo_trainer.yaml`` of the installed wheel) with the one dora flag."""

from __future__ import annotations

import os
import sys

import pytest

from dora_ext.config import ConfigError

hydra = pytest.importorskip("hydra")


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    import verl

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    base = [
        "trainer.v1.trainer_mode=dora",
        "data.train_batch_size=16",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=base + list(overrides))


def test_dora_keys_compose_and_validate():
    from dora_ext.verl.settings import dora_config

    cfg = _compose("+dora.max_staleness=3", "+dora.migrate=false")
    assert cfg.trainer.v1.trainer_mode == "dora"
    d = dora_config(cfg)
    assert (d.mode, d.max_staleness, d.batch_size, d.group_size, d.migrate) == ("dora", 3, 16, 4, False)
    # 4 rollout GPUs at tensor parallel 2 are two replicas; capacity is verl's max_num_seqs.
    assert [(s.id, s.capacity) for s in d.instances] == [(0, 256), (1, 256)]


def test_instances_given_must_be_the_replicas_verl_starts():
    """`dora.instances` equal to verl's replica count is kept; at run time the trainer passes the
    servers verl really started, and a given count that differs is refused (it used to win, giving
    the scheduler instances no server stood behind)."""
    from dora_ext.verl.settings import dora_config

    cfg = _compose("+dora.instances=2")
    assert len(dora_config(cfg).instances) == 2
    with pytest.raises(ConfigError) as err:
        dora_config(cfg, instances=3)
    assert err.value.field == "dora.instances" and "verl starts 3" in str(err.value)


def test_flag_alone_uses_defaults():
    from dora_ext.verl.settings import dora_config

    d = dora_config(_compose())
    assert (d.mode, d.max_staleness) == ("dora", 2)


@pytest.mark.parametrize(
    "override, field",
    [
        ("+dora.max_stalenes=2", "dora.max_stalenes"),  # a typo in a key
        ("+dora.max_staleness=0", "dora.max_staleness"),  # dora needs K >= 1
        ("+dora.max_staleness=two", "dora.max_staleness"),
        ("+dora.batch_size=3", "dora.batch_size"),  # contradicts data.train_batch_size
        ("+dora.instances=3", "dora.instances"),  # contradicts the 2 replicas verl starts
        ("+dora.mode=partial", "dora.mode"),  # verl's own trainers are that baseline
        ("+dora.migrate_threshold=2.0", "dora.migrate_threshold"),
    ],
)
def test_bad_key_or_value_names_it(override, field):
    from dora_ext.verl.settings import dora_config

    with pytest.raises(ConfigError) as err:
        dora_config(_compose(override))
    assert err.value.field == field
    assert field in str(err.value)


@pytest.mark.parametrize("override, field", [
    ("actor_rollout_ref.rollout.max_num_seqs=2.5", "actor_rollout_ref.rollout.max_num_seqs"),
    ("actor_rollout_ref.rollout.max_num_seqs=true", "actor_rollout_ref.rollout.max_num_seqs"),
    ("trainer.total_training_steps=3.5", "trainer.total_training_steps"),
])
def test_a_verl_value_that_is_not_an_integer_is_refused_not_truncated(override, field):
    """verl's max_num_seqs became the instances' capacity through int(): 2.5 slots gave 2, true
    gave 1; total_training_steps 3.5 gave 3 steps. The error names verl's key."""
    from dora_ext.verl.settings import dora_config

    with pytest.raises(ConfigError, match="expected an integer") as err:
        dora_config(_compose(override))
    assert err.value.field == field


def test_configure_wires_verl_plug_points_and_verl_builds_the_sampler():
    """``configure`` fills verl's own keys; verl's ``_build_replay_buffer`` then builds our sampler."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from dora_ext.verl.sampler import DoraReplayBuffer
    from dora_ext.verl.trainer import MANAGER_CLASS, configure

    cfg = _compose("actor_rollout_ref.rollout.checkpoint_engine.backend=dora_store",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=4", "+dora.max_staleness=2")
    d = configure(cfg)
    assert cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class == MANAGER_CLASS
    assert cfg.trainer.v1.sampler.custom_sampler.name == "DoraReplayBuffer"
    assert cfg.trainer.v1.dora.parameter_sync_step == cfg.trainer.v1.separate_async.parameter_sync_step

    class _Host:  # just what _build_replay_buffer reads from the trainer
        config = cfg
        trainer_mode = "dora"

        def _add_prompts_to_generate(self, n):
            return n

    buffer = PPOTrainer._build_replay_buffer(_Host())
    assert isinstance(buffer, DoraReplayBuffer)
    assert buffer.max_staleness == d.max_staleness == 2
    assert buffer.step_batch_size == 16


def test_unknown_sampler_kwarg_names_it():
    from dora_ext.verl.sampler import DoraReplayBuffer

    with pytest.raises(ConfigError, match=r"trainer.v1.sampler.sampler_kwargs.max_stale\b"):
        DoraReplayBuffer("dora", {}, None, "wait", {"max_stale": 1})


def test_foreign_agent_loop_manager_is_refused():
    from dora_ext.verl.trainer import configure

    cfg = _compose(*_trainer_overrides(), "+actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                   "verl.trainer.ppo.v1.agent_loop_tq.AgentLoopManagerTQ")
    with pytest.raises(ConfigError) as err:
        configure(cfg)
    assert err.value.field == "actor_rollout_ref.rollout.agent.agent_loop_manager_class"


def _trainer_overrides(*extra):
    return ("actor_rollout_ref.rollout.checkpoint_engine.backend=dora_store",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.v1.separate_async.parameter_sync_step=4",
            "+dora.max_staleness=1", *extra)


def test_dora_trainer_construction_on_cpu():
    """verl builds ``DoraTrainer`` from the composed config (no GPU is touched before ``init()``)."""
    from dora_ext.verl.sampler import DoraReplayBuffer
    from dora_ext.verl.trainer import DoraTrainer

    t = DoraTrainer(_compose(*_trainer_overrides()))
    assert isinstance(t.replay_buffer, DoraReplayBuffer) and t.replay_buffer.max_staleness == 1
    assert t._enable_hybrid_replicas is False and t.hybrid_rollout_config.enable_switch is False
    assert t.parameter_sync_step == 4 and t.dora.batch_size == 16


def test_dora_on_vllm_gets_the_worker_extension_its_load_checks_call(vllm_extension_stub, monkeypatch):
    """Each load on vLLM is checked by calling the workers' ``dora_checksum`` by name, a method of
    dora's worker extension: ``DoraTrainer`` puts it where verl's vLLM server reads its engine
    kwargs (the replicas' ``RolloutConfig``: ``engine_kwargs.vllm``, which verl's ``launch_server``
    spreads over its own ``worker_extension_cls``). A user's class is kept if it extends dora's,
    refused naming the key otherwise (verl's own class too: it lacks the method); SGLang is left
    alone. (``vllm_extension_stub`` stands in for verl's vLLM module, which imports vLLM.)"""
    import types

    from verl.utils.config import omega_conf_to_dataclass

    from dora_ext.verl.trainer import DoraTrainer, configure
    from dora_ext.verl.weights import VLLM_EXTENSION, VLLM_EXTENSION_KEY

    t = DoraTrainer(_compose(*_trainer_overrides("actor_rollout_ref.rollout.name=vllm")))
    rollout = omega_conf_to_dataclass(t.config.actor_rollout_ref.rollout)  # what each replica is given
    assert rollout.get("engine_kwargs", {}).get("vllm", {})["worker_extension_cls"] == VLLM_EXTENSION
    cfg = _compose(*_trainer_overrides("actor_rollout_ref.rollout.name=sglang"))
    configure(cfg)
    assert "worker_extension_cls" not in cfg.actor_rollout_ref.rollout.engine_kwargs.vllm

    from dora_ext.verl.vllm_worker import DoraWorkerExtension

    mine = types.ModuleType("my_ext")
    mine.Mine = type("Mine", (DoraWorkerExtension,), {})
    monkeypatch.setitem(sys.modules, "my_ext", mine)

    def with_ext(fqn):
        return _compose(*_trainer_overrides("actor_rollout_ref.rollout.name=vllm",
                                            f"+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls={fqn}"))

    for fqn in (VLLM_EXTENSION, "my_ext.Mine"):
        cfg = with_ext(fqn)
        configure(cfg)
        assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls == fqn
    for fqn, why in [("verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension", "or a subclass"),
                     ("my_ext.Missing", "could not be imported")]:
        with pytest.raises(ConfigError, match=why) as err:
            configure(with_ext(fqn))
        assert err.value.field == VLLM_EXTENSION_KEY and VLLM_EXTENSION in str(err.value)


def test_dora_trainer_refuses_a_foreign_sampler():
    from dora_ext.verl.trainer import DoraTrainer

    cfg = _compose(*_trainer_overrides(
        "trainer.v1.sampler.custom_sampler.path=pkg://verl.trainer.ppo.v1.replay_buffer",
        "trainer.v1.sampler.custom_sampler.name=ReplayBufferAsync"))
    with pytest.raises(ConfigError) as err:
        DoraTrainer(cfg)
    assert err.value.field == "trainer.v1.sampler.custom_sampler"


# --------------------------------------------------------------------------- defect 5: the flag alone
def _bare(*overrides):
    from hydra import compose, initialize_config_dir

    import verl

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=["trainer.v1.trainer_mode=dora", *overrides])


def test_flag_alone_fails_first_naming_the_rollout_pool_keys():
    from dora_ext.verl.trainer import DoraTrainer

    with pytest.raises(ConfigError) as err:
        DoraTrainer(_bare())
    assert err.value.field == "actor_rollout_ref.rollout.nnodes"
    assert "actor_rollout_ref.rollout.n_gpus_per_node" in str(err.value)


_POOL = ("actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2",
         "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "data.train_batch_size=4",
         "actor_rollout_ref.actor.ppo_mini_batch_size=1")


@pytest.mark.parametrize("platform", ["", "cpu"])
def test_unset_or_naive_backend_becomes_the_one_weight_path_on_every_platform(monkeypatch, platform):
    from dora_ext.verl.trainer import configure

    monkeypatch.setenv("VERL_PLATFORM", platform)
    for extra in ((), ("actor_rollout_ref.rollout.checkpoint_engine.backend=naive",)):
        cfg = _bare(*_POOL, *extra)
        configure(cfg)
        ce = cfg.actor_rollout_ref.rollout.checkpoint_engine
        assert ce.backend == "dora_store" and ce.custom_backend_module == "dora_ext.verl.weights"
        # Checksums round to the engine's dtype: a vLLM/SGLang engine holds rollout.dtype (bfloat16).
        assert ce.engine_kwargs.dora_store.dtype == cfg.actor_rollout_ref.rollout.dtype == "bfloat16"


@pytest.mark.parametrize("backend, why", [("nccl", "fixed membership"), ("delta_sharded", "diffs against the last"),
                                          ("nixl", "fixed membership")])
def test_other_backends_are_refused_naming_the_key_and_the_fix(backend, why):
    """nccl fails its world-size assert at the first subset load; a delta backend would apply a diff
    to another base after a subset or old-version load: refused at launch, naming what to set."""
    from dora_ext.verl.trainer import configure

    with pytest.raises(ConfigError) as err:
        configure(_bare(*_POOL, f"actor_rollout_ref.rollout.checkpoint_engine.backend={backend}"))
    assert err.value.field == "actor_rollout_ref.rollout.checkpoint_engine.backend"
    assert why in str(err.value) and "checkpoint_engine.backend=dora_store" in str(err.value)
    with pytest.raises(ConfigError) as err:
        configure(_bare(*_POOL, "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=my.mod"))
    assert err.value.field == "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module"


def test_dora_with_one_replica_is_refused_at_launch():
    from dora_ext.verl.trainer import configure

    one = tuple(o.replace("n_gpus_per_node=2", "n_gpus_per_node=1") for o in _POOL)
    with pytest.raises(ConfigError) as err:
        configure(_bare(*one))
    assert err.value.field == "actor_rollout_ref.rollout.n_gpus_per_node"
    assert "sync plus staleness" in str(err.value)
    configure(_bare(*_POOL))  # two replicas: accepted
    # Fewer rollout GPUs than one replica's tensor-parallel size start no replica at all; dora_config
    # alone falls back to its default of 4 instances, which passed this check.
    zero = tuple(o.replace("tensor_model_parallel_size=1", "tensor_model_parallel_size=4") for o in _POOL)
    with pytest.raises(ConfigError) as err:
        configure(_bare(*zero))
    assert err.value.field == "actor_rollout_ref.rollout.n_gpus_per_node" and "gives 0 rollout" in str(err.value)


def test_batch_split_mismatch_names_the_keys():
    from dora_ext.verl.trainer import configure

    cfg = _bare("actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2",
                "data.train_batch_size=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=1")
    with pytest.raises(ConfigError) as err:
        configure(cfg)
    assert err.value.field == "actor_rollout_ref.actor.ppo_mini_batch_size"
    assert "parameter_sync_step" in str(err.value)


def _cpu_pool(*extra):
    return ("actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=dora_store",
            "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=dora_ext.verl.weights", *extra)


def test_weight_store_keeps_every_version_the_staleness_bound_can_ask_for():
    """The weight store keeps ``keep_versions`` (default K + 2) versions; the scheduler may load any
    of the newest K + 1. With K >= 8 and the default, a load of version newest-8 raised KeyError in
    the middle of training (``dora: weight loads failed``). The default now covers K + 1 (plus the
    version being published), and a user's smaller value fails first, naming the key."""
    from dora_ext.verl.weights import WeightStore
    from dora_ext.verl.trainer import configure

    cfg = _bare(*_cpu_pool("+dora.max_staleness=9"))
    configure(cfg)
    keep = int(cfg.actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.dora_store.keep_versions)
    assert keep >= 9 + 1
    # The store with that setting still holds version newest-K after newest is published.
    import asyncio

    store = WeightStore(keep)

    async def run():
        for v in range(12):
            await store.publish(v, [{}], f"c{v}")
        return await store.fetch(11 - 9)

    assert asyncio.run(run())[0] == 2

    cfg = _bare(*_cpu_pool("+dora.max_staleness=9",
                           "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.dora_store.keep_versions=4"))
    with pytest.raises(ConfigError) as err:
        configure(cfg)
    assert err.value.field == "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.dora_store.keep_versions"
    # Unset, it keeps exactly K + 2 (not 8 full copies: ~224 GB of host memory per node for a 7B model).
    cfg = _bare(*_cpu_pool("+dora.max_staleness=1"))
    configure(cfg)
    assert int(cfg.actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.dora_store.keep_versions) == 3
    cfg = _bare(*_cpu_pool("+dora.max_staleness=1",
                           "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.dora_store.fetch_timeout_s=0"))
    with pytest.raises(ConfigError, match="expected seconds > 0"):
        configure(cfg)


def test_resume_reads_dora_state_from_the_folder_verl_resumed_from(tmp_path, monkeypatch):
    """``trainer.resume_mode=resume_path`` resumes from ``trainer.resume_from_path``, not from
    ``default_local_dir``: the dora state must be read there (it was looked up in
    ``default_local_dir/global_step_N``, missing, and the lost-group check silently skipped)."""
    from dora_ext.verl.trainer import _resume_folder

    monkeypatch.chdir(tmp_path)
    cfg = _bare("trainer.default_local_dir=ckpts", "trainer.resume_mode=resume_path",
                f"trainer.resume_from_path={tmp_path / 'elsewhere' / 'global_step_7'}")
    assert _resume_folder(cfg, 7) == str(tmp_path / "elsewhere" / "global_step_7")
    cfg = _bare("trainer.default_local_dir=ckpts", "trainer.resume_mode=resume_path",
                "trainer.resume_from_path=rel/global_step_7")
    assert _resume_folder(cfg, 7) == str(tmp_path / "rel" / "global_step_7")
    cfg = _bare("trainer.default_local_dir=ckpts", "trainer.resume_mode=auto")
    assert _resume_folder(cfg, 7) == str(tmp_path / "ckpts" / "global_step_7")


@pytest.mark.parametrize("migrate", [True, False])
def test_partial_rollout_off_is_refused_while_r5_moves_by_aborting(migrate):
    """verl's ``FullyAsyncLLMServerClient.generate`` resumes an aborted request only when
    ``async_training.partial_rollout`` is absent or true. R5 moves a trajectory by aborting its
    source replica: without the resume every request there (the moved one and the others) would end
    at the abort and be trained cut short, silently. Refused unless ``dora.migrate`` is off."""
    import inspect

    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    from dora_ext.verl.trainer import configure

    # The key the check names is the one verl's client reads (a canary for a verl upgrade).
    assert "async_training.partial_rollout" in inspect.getsource(FullyAsyncLLMServerClient.generate)
    extra = () if migrate else ("+dora.migrate=false",)
    cfg = _compose(*_trainer_overrides(*extra), "+async_training.partial_rollout=false")
    if migrate:
        with pytest.raises(ConfigError) as err:
            configure(cfg)
        assert err.value.field == "async_training.partial_rollout"
        assert "dora.migrate=false" in str(err.value)
    else:
        assert configure(cfg).migrate is False
    configure(_compose(*_trainer_overrides(*extra), "+async_training.partial_rollout=true"))


def test_the_coordinator_is_verls_router_plug_in():
    """``configure`` points verl's ``rollout.router_config_path`` at dora's router file (verl then
    starts the coordinator as the pool's router itself); another router is refused, naming the key."""
    from verl.workers.rollout.router import _load_router_yaml, _resolve_router_class

    from dora_ext.verl.router import CONFIG_PATH, DoraRouter
    from dora_ext.verl.trainer import configure

    cfg = _bare(*_POOL)
    configure(cfg)
    assert cfg.actor_rollout_ref.rollout.router_config_path == CONFIG_PATH
    assert _resolve_router_class(_load_router_yaml(CONFIG_PATH)["router_class"]) is DoraRouter
    with pytest.raises(ConfigError) as err:
        configure(_bare(*_POOL, "actor_rollout_ref.rollout.router_config_path=/elsewhere.yaml"))
    assert err.value.field == "actor_rollout_ref.rollout.router_config_path"


def _compose_raw(overrides):
    from hydra import compose, initialize_config_dir

    import verl

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def test_readme_quick_start_turns_a_separate_async_launch_into_dora():
    """The README's verl one-liner, appended to a separate_async launch as a user has it: with a
    checkpoint backend other than ``naive`` (verl's separate_async asserts that), here verl's own
    ``nccl``, which dora refuses. What the README appends must compose and pass ``configure``."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"), encoding="utf-8").read()
    block = readme.split("python -m verl.trainer.main_ppo <your separate_async overrides>")[1].split("```")[0]
    appended = block.replace("\\\n", " ").split()
    assert "trainer.v1.trainer_mode=dora" in appended  # (the block was found)
    separate_async = [*_POOL, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.hybrid_engine=False",
                      "trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=4",
                      "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"]
    assert _compose_raw(separate_async).actor_rollout_ref.rollout.checkpoint_engine.backend != "naive"

    from dora_ext.verl.trainer import configure

    cfg = _compose_raw(separate_async + appended)
    d = configure(cfg)
    assert cfg.trainer.v1.trainer_mode == "dora" and d.max_staleness == 2
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "dora_store"


@pytest.mark.parametrize("architecture, refused", [("Qwen2ForCausalLM", True), ("LlamaForCausalLM", False)])
def test_sglang_on_a_model_it_cannot_read_weights_back_from_is_refused_at_launch(tmp_path, architecture, refused):
    """Every load on SGLang is checked through ``/get_weights_by_name``, which SGLang implements per
    model class (not for Qwen2): a model whose config names such an architecture used to be refused
    only at the first sync's check, with the cluster up. Read from the model folder at launch."""
    import json

    from dora_ext.verl.trainer import configure

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": "x"}))
    cfg = _bare(*_POOL, "actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.model.path={model}")
    if not refused:
        configure(cfg)
        return
    with pytest.raises(ConfigError) as err:
        configure(cfg)
    assert err.value.field == "actor_rollout_ref.rollout.name"
    for what in ("'sglang'", architecture, "get_weights_by_name", "actor_rollout_ref.rollout.name=vllm",
                 "Llama-architecture"):
        assert what in str(err.value), what
    # The same model on vLLM is accepted (its checks read the workers' own tensors) ...
    configure(_bare(*_POOL, "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.model.path={model}"))
    # ... and on SGLang a config that cannot be read at launch (a hub id, no config.json) leaves the
    # check to the first sync.
    (model / "config.json").unlink()
    configure(_bare(*_POOL, "actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.model.path={model}"))
    configure(_bare(*_POOL, "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B"))


def test_sglang_architecture_table_matches_the_installed_sglang():
    """A canary for an SGLang upgrade (read as source, not imported: SGLang's models import CUDA
    kernels): the classes the table's families build on define ``get_weights_by_name`` and Qwen2's
    and Qwen3's do not. If SGLang adds it for Qwen, the launch refusal must go."""
    import importlib.util

    from dora_ext.verl.weights import SGLANG_WEIGHTS_BY_NAME

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed")
    models = os.path.join(list(spec.submodule_search_locations)[0], "srt", "models")

    def source(name):
        with open(os.path.join(models, name), encoding="utf-8") as f:
            return f.read()

    for name, cls in [("llama.py", "LlamaForCausalLM"), ("granite.py", "GraniteForCausalLM"),
                      ("opt.py", "OPTForCausalLM"), ("exaone4.py", "Exaone4ForCausalLM")]:
        assert "def get_weights_by_name" in source(name) and cls in SGLANG_WEIGHTS_BY_NAME, name
    for name, cls in [("qwen2.py", "Qwen2ForCausalLM"), ("qwen3.py", "Qwen3ForCausalLM")]:
        assert "get_weights_by_name" not in source(name) and cls not in SGLANG_WEIGHTS_BY_NAME, name


def test_sglang_launch_check_reads_the_config_sglang_loads(tmp_path):
    """verl starts SGLang on ``actor_rollout_ref.model.path`` (its ``model_path``, no config
    override), so SGLang's model class comes from that folder's ``config.json``; ``hf_config_path``
    configures verl's actor only. A Llama model with a Qwen ``hf_config_path`` is one SGLang can
    check (reading ``hf_config_path`` refused it); a Qwen model with a Llama ``hf_config_path`` is
    one it cannot (reading ``hf_config_path`` let it through to the first sync)."""
    import json

    from dora_ext.verl.trainer import configure

    folders = {}
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM"):
        folders[arch] = tmp_path / arch
        folders[arch].mkdir()
        (folders[arch] / "config.json").write_text(json.dumps({"architectures": [arch]}))

    def launch(path, hf_config_path):
        configure(_bare(*_POOL, "actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.model.path={path}",
                        f"actor_rollout_ref.model.hf_config_path={hf_config_path}"))

    launch(folders["LlamaForCausalLM"], folders["Qwen2ForCausalLM"])
    with pytest.raises(ConfigError, match="Qwen2ForCausalLM") as err:
        launch(folders["Qwen2ForCausalLM"], folders["LlamaForCausalLM"])
    assert err.value.field == "actor_rollout_ref.rollout.name"


_R = "actor_rollout_ref.rollout."


@pytest.mark.parametrize("overrides", [
    (),  # 2 GPUs, TP 1: 2 replicas
    (_R + "tensor_model_parallel_size=4",),  # fewer GPUs than one replica: none
    (_R + "nnodes=2", _R + "n_gpus_per_node=8", _R + "tensor_model_parallel_size=8"),  # one node each: 2
    (_R + "nnodes=2", _R + "n_gpus_per_node=8", _R + "tensor_model_parallel_size=16"),  # TP across nodes: 1
    (_R + "n_gpus_per_node=8", _R + "tensor_model_parallel_size=2", _R + "data_parallel_size=2"),  # 2
    (_R + "name=sglang", _R + "disaggregation.enabled=true"),  # prefill + decode on 2 GPUs: 1
    (_R + "name=sglang", _R + "n_gpus_per_node=4", _R + "disaggregation.enabled=true"),  # 2
    (_R + "name=sglang", _R + "n_gpus_per_node=8", _R + "disaggregation.enabled=true",
     _R + "disaggregation.decode_replicas=3"),  # 1 + 3 GPUs per replica: 2
])
def test_replica_count_is_the_number_of_replicas_verl_starts(overrides):
    """``replica_count`` (dora's instances, and the launch refusal of a pool with fewer than 2) against
    verl 0.9.1's own ``LLMServerManager._initialize_llm_servers`` on the same config. Stand-in: the
    replica class (a GPU inference server cannot start here), which records its rank. With
    prefill/decode disaggregation a replica spans a prefill and decode servers' GPUs; counting
    tensor x data x pipeline parallel GPUs only passed a 2-GPU pool, one replica, as 2."""
    import asyncio

    from verl.workers.rollout.llm_server import LLMServerManager

    from dora_ext.verl.settings import replica_count
    from dora_ext.verl.trainer import configure

    class _Replica:  # stand-in for vLLMReplica / SGLangReplica: starts nothing
        def __init__(self, replica_rank, **_):
            self.replica_rank = replica_rank

        async def init_standalone(self):
            self._server_handle, self._server_address = None, f"replica-{self.replica_rank}"

    class _Manager(LLMServerManager):
        rollout_replica_class = _Replica

    cfg = _bare(*_POOL, *overrides)
    manager = _Manager(config=cfg)
    asyncio.run(manager._initialize_llm_servers())
    started = len(manager.rollout_replicas)
    assert replica_count(cfg) == started
    if _R + "disaggregation.enabled=true" in overrides:  # refused whatever the count
        with pytest.raises(ConfigError, match="disaggregation"):
            configure(cfg)
    elif started >= 2:
        assert len(configure(cfg).instances) == started
    else:
        with pytest.raises(ConfigError, match=f"gives {started} rollout replica"):
            configure(cfg)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_prefill_decode_disaggregation_is_refused_at_launch(engine):
    """With ``rollout.disaggregation.enabled`` verl's replica address and handle are the prefill
    server's and it sends each request on as ``<id>_P`` / ``<id>_D`` (verl 0.9.1
    ``async_sglang_server.py``, ``vllm_async_server.py``): an R5 abort of ``<id>`` there never lands
    (SGLang ignores the unknown id) and each load check reads the prefill server only. It was accepted
    (a 4-GPU pool, two replicas) and every move silently failed; refused first, also on a one-replica pool."""
    from dora_ext.verl.trainer import configure

    for gpus in (4, 2):
        cfg = _bare(*_POOL, _R + f"name={engine}", _R + f"n_gpus_per_node={gpus}", _R + "disaggregation.enabled=true")
        with pytest.raises(ConfigError) as err:
            configure(cfg)
        assert err.value.field == "actor_rollout_ref.rollout.disaggregation.enabled"
        for what in (repr(engine), "<id>_P", "never lands", "disaggregation.enabled=false"):
            assert what in str(err.value), what
    configure(_bare(*_POOL, _R + f"name={engine}", _R + "disaggregation.enabled=false"))


@pytest.mark.parametrize("engine", ["trtllm", "hf"])
def test_a_rollout_engine_dora_cannot_check_or_abort_on_is_refused_at_launch(engine):
    """dora reads every load back from the engine and aborts single requests on ``dora_cpu``, vLLM and
    SGLang only (``engine_checksum``, ``abort_request``); ``trtllm`` was accepted here and refused by
    the first load check, with the cluster up."""
    from dora_ext.verl.trainer import configure

    with pytest.raises(ConfigError) as err:
        configure(_bare(*_POOL, _R + f"name={engine}"))
    assert err.value.field == "actor_rollout_ref.rollout.name"
    for what in (repr(engine), "dora_cpu, vllm, sglang", "set actor_rollout_ref.rollout.name"):
        assert what in str(err.value), what
    for accepted in ("dora_cpu", "vllm", "sglang"):
        configure(_bare(*_POOL, _R + f"name={accepted}"))


def test_a_one_replica_pool_is_refused_before_a_dora_instances_that_differs_from_it():
    """The pool's size is the mistake to fix first: a ``dora.instances`` set for the pool the user meant to start
    (4) on a launch that starts one replica is answered with the one-replica refusal, naming the pool key, not with
    "dora.instances is 4 but verl starts 1", whose fix (instances=1) would only meet that refusal next."""
    from dora_ext.verl.trainer import configure

    cfg = _bare(*_POOL, _R + "tensor_model_parallel_size=2", "+dora.instances=4")
    with pytest.raises(ConfigError, match="gives 1 rollout replica") as err:
        configure(cfg)
    assert err.value.field == "actor_rollout_ref.rollout.n_gpus_per_node"

"""dora-ext inside verl 0.9.1: one flag, ``trainer.v1.trainer_mode=dora``.

Modules (only `plugin` is imported on ``import verl``; the rest load when verl's own modules do):

* ``plugin``   -- the ``verl.plugins`` entry point: post-import hooks that register the trainer and
                  the losses the moment verl imports the modules that hold its registries.
* ``settings`` -- the ``dora`` key of verl's Hydra config, validated by ``DoraConfig``.
* ``sampler``  -- ``DoraReplayBuffer``, the ``trainer.v1.sampler.custom_sampler`` (R3, C2, C3).
* ``coordinator`` -- the Ray actor that runs ``dora_ext.core.Scheduler`` and routes requests (R1, R6).
* ``manager``  -- the agent-loop manager/worker/client that feed the coordinator.
* ``trainer``  -- ``DoraTrainer`` (separate-async V1 trainer with multi-version replicas).
* ``losses``   -- ``dora_sao`` and ``dora_decoupled`` in verl's policy-loss registry.
* ``engine_server`` -- verl's rollout-server contract over ``dora_ext.engines.TorchEngine``
                  (stands in for vLLM in the coordinator and agent-loop tests).
* ``weights``  -- ``dora_store``, dora's one weight path on every machine: per-node weight
                  stores behind verl's ``CheckpointEngineWithCache``, engine-side checksums.
* ``vllm_worker`` -- ``DoraWorkerExtension``: verl's vLLM worker extension plus the checksum
                  method (imported only in vLLM's worker processes).
* ``cpu``      -- verl on a CPU-only machine (``VERL_PLATFORM=cpu``): platform, gloo process
                  groups, the ``dora_cpu`` rollout replica (the HF model the actor trains),
                  tiny local assets, run evidence.

Imports run one way: ``plugin`` -> ``trainer`` -> ``coordinator`` -> ``dora_ext.core``
(``cpu`` is a leaf that only verl's registries and the reports use).

verl 0.9.1 interfaces this package relies on (read from the installed wheel; a verl upgrade that
changes one of them must be re-checked here first):

* ``verl/__init__.py``: every entry point of group ``verl.plugins`` is loaded with ``ep.load()``
  at the end of ``import verl`` (``VERL_USE_EXTERNAL_PLUGINS=auto|none|name,...``); a failing
  plugin is only logged at DEBUG level.
* ``verl.trainer.ppo.v1.trainer_base``: ``register_trainer(name) -> decorator(cls)`` (raises
  ``ValueError`` if ``name`` is bound to another class), ``get_trainer_cls(name) -> type``,
  ``TRAINER_REGISTRY: dict[str, type]``. ``PPOTrainer.__init__(config)``, hooks ``init()``,
  ``_setup()``, ``on_init_end()``, ``on_train_begin()``, ``prepare_step() -> dict``,
  ``on_step_begin()``, ``on_step_end()``, ``on_sample_begin()``, ``on_sample_end()``,
  ``get_llm_client()``, ``fit(agent_loop_manager)``; ``self.global_steps`` (1-based during fit),
  ``self.replay_buffer``, ``self.checkpoint_manager``, ``self.actor_rollout_wg``,
  ``_add_prompts_to_generate(n) -> int``, ``_add_async_warmup_batches(n)``.
* ``verl.trainer.ppo.v1.trainer_separate_async.PPOTrainerSeparateAsync``:
  ``standalone_server_manager`` (``LLMServerManager``: ``rollout_replicas``, ``server_handles``,
  ``server_addresses``, ``global_load_balancer``, ``get_client(client_cls)``),
  ``standalone_checkpoint_manager`` (``CheckpointEngineManager``), ``_enable_hybrid_replicas``,
  ``hybrid_rollout_config``; the actor role is ``DetachActorWorker`` (``update_weights(global_steps,
  mode)`` sends through the checkpoint-engine backend: a publication here).
* ``verl.workers.rollout.vllm_rollout``: ``vLLMHttpServer.launch_server`` passes vLLM
  ``worker_extension_cls=<utils.vLLMColocateWorkerExtension>`` then ``**engine_kwargs.vllm`` (a
  ``worker_extension_cls`` there replaces it); ``collective_rpc(method, args=)`` goes on to vLLM's
  ``AsyncLLM.collective_rpc`` (msgpack to the engine core: a method name, not a function).
* ``verl.checkpoint_engine.base.CheckpointEngineManager(config, actor_wg, replicas)``:
  ``abort_replicas()``, ``resume_generation_replicas()`` (R5 aborts; weights never go through it).
  ``CheckpointEngineWithCache`` (declared, no implementation in verl): ``weights`` implements it.
* ``verl.trainer.ppo.v1.replay_buffer``: a custom sampler is built as
  ``cls(trainer_mode=, trainer_config=, max_off_policy_threshold=, max_off_policy_strategy=,
  sampler_kwargs=, refill_fn=)`` and called as ``sample(global_steps, partition_id, batch_size)
  -> (KVBatchMeta, metrics)``; ``get_sampleable_count(global_steps, partition_id) -> int`` and
  ``wait_for_sampleable(global_steps, partition_id, target) -> (set, metrics)`` when hybrid
  switching is on. TransferQueue layout: prompt key ``{uid}`` with tags ``is_prompt``,
  ``status`` (pending|running|finished|failure), ``global_steps``; trajectory keys
  ``{uid}_{session}_{index}`` with tags ``global_steps``, ``min_global_steps``,
  ``max_global_steps``, ``seq_len``.
* ``verl.workers.rollout.router``: a load balancer is a plain class wrapped with ``ray.remote``
  exposing ``acquire_server(request_id, **fields) -> (server_id, handle)``,
  ``release_server(server_id, request_id=None)``, ``require_acquire_fields() -> list[str]``,
  ``require_release_fields()``, ``add_servers``, ``remove_servers``, ``get_all_servers``,
  ``get_status``, ``clear_sticky_cache``, ``get_total_inflight``.
* ``verl.workers.rollout.llm_server``: ``LLMServerClient._acquire_server(request_id, **extra)``,
  ``FullyAsyncLLMServerClient.generate(...)`` (re-acquires after an abort: a resume);
  server output ``extra_fields["global_steps"]`` is the replica's weight version.
* ``verl.trainer.ppo.v1.agent_loop_tq``: ``AgentLoopManagerTQ.create(config=, llm_client=,
  teacher_client=, reward_loop_worker_handles=)``, ``generate_sequences(TensorDict)``;
  ``AgentLoopWorkerTQ._run_agent_loop(sampling_params, trajectory, *, agent_name, trace,
  session_id, uid, ...)``.
* ``verl.trainer.ppo.core_algos``: ``register_policy_loss(name)``, ``get_policy_loss_fn(name)``;
  a loss is called as ``fn(old_log_prob=, log_prob=, advantages=, response_mask=,
  loss_agg_mode=, config=ActorConfig, rollout_is_weights=)`` and returns ``(loss, metrics)``;
  ``agg_loss`` reads ``config.global_batch_info`` (``dp_size``, ``batch_num_tokens``,
  ``global_batch_size``).
"""

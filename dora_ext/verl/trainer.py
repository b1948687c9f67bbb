"""``DoraTrainer``: verl's separate-async V1 trainer with multi-version rollout replicas.

Registered as ``trainer.v1.trainer_mode=dora`` by ``plugin`` when ``verl.trainer.ppo.v1`` is
imported. It keeps verl's actor/critic/reference workers, model code, reward loop, advantage
and update code untouched and changes four things:

1. **No abort to sync weights.** verl's separate-async trainer calls ``update_weights`` on every
   standalone replica after each step, which aborts in-flight requests and resumes them under
   the new weights (a trajectory then spans versions). Here a step only *publishes* its version
   to the coordinator (``dora_ext.core.Scheduler`` in a Ray actor); the scheduler answers with
   ``LoadVersion`` for replicas that have drained (R4), and the trainer syncs exactly those
   replicas with a ``CheckpointEngineManager`` over that subset. The other replicas keep
   generating their trajectories to the end under their old version (C1).
2. **Old versions stay loadable, always as published.** A version may be needed after the actor
   moved on (its groups are queued but no replica holds it yet), and with
   ``parameter_sync_step`` > 1 loads happen between mini-batches, after optimizer steps. With a
   publishing backend (``dora_cpu``: each version copied once into a weight store at publish
   time) replicas load any kept version from the store, from the coordinator, without the actor.
   With NCCL-style backends the actor keeps a CPU copy of each of the last K + 1 versions
   (``DetachActorWorker.save_model_to_cpu``) and a load uses the live parameters only while they
   still are that version, else restores the copy for the duration of the sync.
3. **R3 sampling** (``sampler.DoraReplayBuffer``) and **version-pinned, frontier-first routing**
   (``coordinator`` + ``manager``) are wired in by setting verl's own config keys
   ``trainer.v1.sampler.custom_sampler`` and ``actor_rollout_ref.rollout.agent.
   agent_loop_manager_class`` (a user's explicit values win).
4. **Admission follows R2.** The trainer's prompt feed (K warm-up batches, then one batch per
   step) is the supply; the scheduler admits from it when it has budget and free slots.

Resume (``trainer.resume_mode``): see ``_prepare_resume``; ``dora_state.json`` is written into
each verl checkpoint. Config errors verl would raise deep inside its trainer are raised first,
naming the keys (``_check_split``).

Hybrid replicas on the trainer GPUs are disabled (verl's ``hybrid_engine=False`` path): lending
them to rollout aborts their requests on every switch back.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import replace
from typing import Any

from omegaconf import open_dict
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

from .coordinator import plugin_manager
from .settings import dora_config

logger = logging.getLogger("dora_ext.verl")

TRAINER_NAME = "dora"
SAMPLER_PATH = "pkg://dora_ext.verl.sampler"
SAMPLER_NAME = "DoraReplayBuffer"
MANAGER_CLASS = "dora_ext.verl.manager.DoraAgentLoopManager"


def _check_split(config: Any) -> None:
    """Defect 5: verl's separate-async checks, made first with our own message (or derived).

    * ``actor_rollout_ref.rollout.nnodes`` / ``n_gpus_per_node`` (the rollout pool): required,
      there is nothing sensible to derive them from;
    * ``actor_rollout_ref.rollout.checkpoint_engine.backend``: ``naive`` only works colocated; on the
      CPU platform (``VERL_PLATFORM=cpu``) it becomes ``dora_cpu`` (with its module), elsewhere
      the user must name a transport;
    * ``data.train_batch_size == parameter_sync_step * actor.ppo_mini_batch_size``.
    """
    from dora_ext.config import ConfigError

    from .cpu import BACKEND as CPU_BACKEND
    from .cpu import BACKEND_MODULE, cpu_platform_selected

    rollout = config.actor_rollout_ref.rollout
    missing = [k for k in ("nnodes", "n_gpus_per_node") if int(rollout.get(k) or 0) <= 0]
    if missing:
        raise ConfigError(
            "actor_rollout_ref.rollout." + missing[0],
            "trainer_mode=dora runs rollout on its own pool: add actor_rollout_ref.rollout.nnodes=<nodes> "
            "actor_rollout_ref.rollout.n_gpus_per_node=<rollout GPUs per node> (and trainer.n_gpus_per_node "
            "for the trainer's GPUs)",
        )
    ce = rollout.checkpoint_engine
    if ce.get("backend") in (None, "", "naive"):
        if cpu_platform_selected():
            ce.backend = CPU_BACKEND
            if not ce.get("custom_backend_module"):
                ce.custom_backend_module = BACKEND_MODULE
            logger.info("dora: checkpoint_engine.backend=naive -> %s on the CPU platform", CPU_BACKEND)
        else:
            raise ConfigError(
                "actor_rollout_ref.rollout.checkpoint_engine.backend",
                f"is {ce.get('backend')!r}; trainer_mode=dora syncs weights to a separate rollout pool: add "
                "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl (or nixl, mooncake, hccl; "
                f"{CPU_BACKEND} with VERL_PLATFORM=cpu)",
            )
    sync_step = int(config.trainer.v1[TRAINER_NAME].parameter_sync_step)
    mini = int(config.actor_rollout_ref.actor.ppo_mini_batch_size)
    batch = int(config.data.train_batch_size)
    if batch != sync_step * mini:
        raise ConfigError(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"is {mini} but data.train_batch_size={batch} must equal "
            f"trainer.v1.separate_async.parameter_sync_step ({sync_step}) x ppo_mini_batch_size",
        )


def configure(config: Any) -> Any:
    """Validate the ``dora`` key and point verl's plug-in keys at dora-ext (in place).

    Returns the ``DoraConfig``. Keys a user set explicitly are kept (with a log line).
    """
    v1 = config.trainer.v1
    with open_dict(config):
        # The base trainer reads trainer.v1.<mode>.parameter_sync_step; dora shares separate_async's.
        sep = v1.get("separate_async") or {}
        v1[TRAINER_NAME] = {"parameter_sync_step": int(sep.get("parameter_sync_step", 1))}
        _check_split(config)
    dcfg = dora_config(config)
    _check_resume(config, dcfg.migrate)
    with open_dict(config):
        _check_weight_store(config, dcfg.max_staleness)
        sampler = v1.sampler
        custom = sampler.get("custom_sampler") or {}
        if custom.get("path") or custom.get("name"):
            # Checked in DoraTrainer.__init__: it must be DoraReplayBuffer or a subclass.
            logger.info("dora: keeping the user's custom sampler %s:%s", custom.get("path"), custom.get("name"))
        else:
            sampler.custom_sampler = {"path": SAMPLER_PATH, "name": SAMPLER_NAME}
            kwargs = dict(sampler.get("sampler_kwargs") or {})
            kwargs.setdefault("max_staleness", dcfg.max_staleness)
            kwargs.setdefault("step_batch_size", dcfg.batch_size)
            kwargs.setdefault("group_size", dcfg.group_size)
            sampler.sampler_kwargs = kwargs
        agent = config.actor_rollout_ref.rollout.agent
        if agent.get("agent_loop_manager_class"):
            _check_manager(str(agent.agent_loop_manager_class))
            logger.info("dora: keeping the user's agent_loop_manager_class %s", agent.agent_loop_manager_class)
        else:
            agent.agent_loop_manager_class = MANAGER_CLASS
    return dcfg


def _check_resume(config: Any, migrate: bool) -> None:
    """R5 moves a trajectory by aborting its source replica's requests (``_service``) and relies on
    verl's ``FullyAsyncLLMServerClient`` resuming each aborted request (on the destination for the
    moved one). With ``async_training.partial_rollout=false`` verl's client does not resume: every
    request on the source would end at the abort and be trained cut short, with no failure
    reported. Refused while ``dora.migrate`` is on (the default)."""
    from dora_ext.config import ConfigError

    async_training = config.get("async_training")
    if not migrate or async_training is None:
        return
    partial = async_training.get("partial_rollout", True)
    if partial is None or bool(partial):
        return
    raise ConfigError(
        "async_training.partial_rollout",
        "is false; trainer_mode=dora moves trajectories (R5) by aborting their replica's requests, which "
        "verl's client resumes only with partial rollout: remove the key or set it to true, or set "
        "+dora.migrate=false",
    )


def _check_weight_store(config: Any, max_staleness: int) -> None:
    """The ``dora_cpu`` store must keep every version a load can ask for: the newest K + 1 and the
    one being published (K + 2). Unset: ``max(8, K + 2)``; a smaller user value fails here."""
    from dora_ext.config import ConfigError

    from .cpu import BACKEND as CPU_BACKEND

    ce = config.actor_rollout_ref.rollout.checkpoint_engine
    if ce.get("backend") != CPU_BACKEND:
        return
    need = int(max_staleness) + 2
    if ce.get("engine_kwargs") is None:
        ce.engine_kwargs = {}
    kwargs = ce.engine_kwargs.get(CPU_BACKEND) or {}
    keep = kwargs.get("keep_versions")
    if keep is None:
        ce.engine_kwargs[CPU_BACKEND] = {**kwargs, "keep_versions": max(8, need)}
    elif isinstance(keep, bool) or not isinstance(keep, int) or keep < need:
        raise ConfigError(
            f"actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.{CPU_BACKEND}.keep_versions",
            f"is {keep!r}; with dora.max_staleness={max_staleness} the weight store must keep at least "
            f"{need} versions (K + 1 loadable and the one being published): set it to >= {need} or leave it unset",
        )


def _check_manager(fqn: str) -> None:
    """A user's manager must offer prompts to the coordinator, i.e. extend DoraAgentLoopManager."""
    from verl.utils.import_utils import load_class_from_fqn

    from dora_ext.config import ConfigError

    from .manager import DoraAgentLoopManager

    cls = load_class_from_fqn(fqn, "AgentLoopManager")
    if not (isinstance(cls, type) and issubclass(cls, DoraAgentLoopManager)):
        raise ConfigError(
            "actor_rollout_ref.rollout.agent.agent_loop_manager_class",
            f"{fqn} must be {MANAGER_CLASS} or a subclass in trainer_mode=dora (it offers prompts to the scheduler)",
        )


@contextlib.contextmanager
def _quiet_info(logger_name: str):
    """verl 0.9.1's separate-async ``_setup`` calls ``logger.info(..., flush=True)`` when
    ``hybrid_engine=False``, a TypeError whenever INFO is enabled; raise that logger to WARNING
    while it runs."""
    lg = logging.getLogger(logger_name)
    level = lg.level
    if lg.isEnabledFor(logging.INFO):
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        lg.setLevel(level)


def _checkpoint_folder(config: Any, global_steps: int) -> str:
    folder = config.trainer.default_local_dir
    if not os.path.isabs(folder):
        folder = os.path.join(os.getcwd(), folder)
    return os.path.join(folder, f"global_step_{global_steps}")


def _resume_folder(config: Any, global_steps: int) -> str:
    """The checkpoint folder verl resumed from (``PPOTrainer._load_checkpoint``'s choice)."""
    trainer = config.trainer
    if trainer.get("resume_mode") == "resume_path" and isinstance(trainer.get("resume_from_path"), str):
        folder = trainer.resume_from_path
        return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)
    return _checkpoint_folder(config, global_steps)


STATE_FILE = "dora_state.json"


class DoraTrainer(PPOTrainerSeparateAsync):
    """See the module docstring."""

    def __init__(self, config: Any) -> None:
        self.dora = configure(config)
        super().__init__(config)
        from dora_ext.config import ConfigError

        from .sampler import DoraReplayBuffer

        if not isinstance(self.replay_buffer, DoraReplayBuffer):
            raise ConfigError(
                "trainer.v1.sampler.custom_sampler",
                f"{type(self.replay_buffer).__name__} is not {SAMPLER_NAME} or a subclass; trainer_mode=dora takes "
                "each step's batch from the scheduler through it",
            )
        if self._enable_hybrid_replicas:
            logger.info("dora: hybrid rollout replicas on trainer GPUs are disabled (they abort requests on switch)")
        self._enable_hybrid_replicas = False
        self.hybrid_rollout_config = replace(self.hybrid_rollout_config, enable_switch=False)
        self.coordinator = None
        self._base_version = 0
        self._actor_version = 0
        # The version the actor's live parameters are exactly (None once an optimizer step ran
        # since the last publish: mini-batches 2..N of a step with parameter_sync_step > 1).
        self._live_version: int | None = None
        self._cpu_versions: list[int] = []
        self._publishes = False
        self._resume_info: dict[str, Any] = {}
        self._plugins = plugin_manager()

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        with _quiet_info("verl.trainer.ppo.v1.trainer_separate_async"):
            super()._setup()
        import ray
        from verl.checkpoint_engine import CheckpointEngineRegistry

        from .coordinator import create_coordinator

        backend_cls = CheckpointEngineRegistry.get(self.config.actor_rollout_ref.rollout.checkpoint_engine.backend)
        self._publishes = bool(getattr(backend_cls, "publishes_versions", False))
        manager = self.standalone_server_manager
        servers = dict(zip(manager.server_addresses, manager.server_handles, strict=True))
        old = manager.global_load_balancer
        if len(servers) != len(self.dora.instances):
            self.dora = dora_config(self.config, instances=len(servers))
        if self.dora.max_steps is not None and self.global_steps:
            # Resumed from a checkpoint: the scheduler counts the steps still to run.
            self.dora = replace(self.dora, max_steps=max(1, self.dora.max_steps - int(self.global_steps)))
        self.coordinator = create_coordinator(self.dora, servers)
        if self._publishes:
            # Loads of published versions run in the coordinator, off the trainer thread.
            loaders = {i: list(r.workers) for i, r in enumerate(manager.rollout_replicas)}
            ray.get(self.coordinator.set_loaders.remote(loaders))
        manager.global_load_balancer = self.coordinator
        try:
            ray.kill(old)
        except Exception:  # the default balancer holds no state we need
            pass
        self.replay_buffer.step_source = self._scheduler_batch
        self.replay_buffer.on_wait = self._service
        if self.global_steps:
            self._prepare_resume()

    def _prepare_resume(self) -> None:
        """Defect 3: resumed from verl's checkpoint at step ``global_steps``.

        The checkpoint holds the actor at version ``global_steps`` only, so groups that were
        admitted under older versions and not trained cannot continue under their version. verl
        restored them into TransferQueue (finished ones with their trajectories; pending and
        running ones are re-issued by ``fit``). Here finished-but-untrained groups are turned back
        into pending prompts (their old trajectories cleared), so that ``fit`` re-issues them too:
        every admitted group is then offered to the new scheduler (version ``global_steps``),
        generated once more and trained exactly once. Groups the saved dora state lists as
        admitted and untrained but that verl did not restore are reported (``dora/resume_lost``).
        """
        import json

        import transfer_queue as tq

        data = tq.kv_list("train") or {}
        items = data.get("train", {})
        prompts = {k: t for k, t in items.items() if t.get("is_prompt", False)}
        finished = [k for k, t in prompts.items() if t.get("status") == "finished"]
        if finished:
            fin = set(finished)
            old = [k for k, t in items.items() if not t.get("is_prompt", False) and k.split("_", 1)[0] in fin]
            if old:
                tq.kv_clear(keys=old, partition_id="train")
            tags = [{"is_prompt": True, "status": "pending", "global_steps": int(self.global_steps)} for _ in finished]
            tq.kv_batch_put(keys=finished, partition_id="train", tags=tags)
        state_path = os.path.join(_resume_folder(self.config, int(self.global_steps)), STATE_FILE)
        lost: list[str] = []
        if os.path.exists(state_path):
            with open(state_path) as f:
                state = json.load(f)
            lost = [u for u in state.get("untrained", []) if u not in prompts]
            if lost:
                logger.warning("dora resume: %d admitted, untrained group(s) not in verl's checkpoint: %s",
                               len(lost), lost[:8])
        else:
            logger.warning("dora resume: %s not found; groups of the first run are not accounted", state_path)
        self._resume_info = {"regenerated": len(finished), "lost": lost, "restored": len(prompts)}
        from .cpu.report import report

        report("resume", global_steps=int(self.global_steps), regenerated=finished, lost=lost,
               restored=sorted(prompts))

    def on_init_end(self) -> None:
        import ray

        # verl loads the checkpoint's weights on every replica once; that is version 0 to the scheduler.
        super().on_init_end()
        self._base_version = self._actor_version = int(self.global_steps)
        self._live_version = self._actor_version
        if not self._publishes:
            self._keep_cpu_copy(self._base_version)
        ray.get(self.coordinator.start.remote(self._base_version))
        self._service()

    def on_train_begin(self) -> None:
        # The R2 budget at version 0 is (K + 1) batches: K now, one more in the first prepare_step.
        self._add_async_warmup_batches(self.dora.max_staleness)

    def get_llm_client(self):
        from .manager import DoraLLMServerClient

        return self.standalone_server_manager.get_client(client_cls=DoraLLMServerClient)

    # ------------------------------------------------------------------ steps
    def _scheduler_batch(self, step: int):
        import ray

        self._service()
        return ray.get(self.coordinator.step_batch.remote(step))

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        self._live_version = None  # the live parameters are no published version any more
        return super()._update_actor(batch, metrics)

    def _save_checkpoint(self) -> None:
        """verl's checkpoint plus ``dora_state.json`` (admitted groups not trained yet, the
        scheduler's snapshot), written first so that a checkpoint verl marks complete has it."""
        import json

        import ray

        folder = _checkpoint_folder(self.config, int(self.global_steps))
        os.makedirs(folder, exist_ok=True)
        state = ray.get(self.coordinator.checkpoint_state.remote())
        trained = self.replay_buffer.trained_uids()
        state["untrained"] = [u for u in state.pop("admitted") if u not in trained]
        state["global_steps"] = int(self.global_steps)
        with open(os.path.join(folder, STATE_FILE), "w") as f:
            json.dump(state, f)
        super()._save_checkpoint()

    def on_step_end(self) -> None:
        import ray

        from verl.utils.debug import marked_timer

        if self.prev_step_profile:
            self._stop_rollout_profiling()
        self._actor_version = int(self.global_steps)
        self._live_version = self._actor_version
        sync_metrics: dict[str, float] = {}
        with marked_timer("update_weights", self.timing_raw, color="red"):
            if self._publishes:
                sync_metrics.update(self._publish(self._actor_version))
            else:
                self._keep_cpu_copy(self._actor_version)
            ray.get(self.coordinator.step_finished.remote(self._actor_version))
            self._service()
        metrics = ray.get(self.coordinator.metrics.remote())
        if metrics.get("load_errors"):
            raise RuntimeError(f"dora: weight loads failed: {metrics.get('load_error_text')}")
        # The sampler logs dora/<name> per batch; the scheduler's run totals go under dora/scheduler/.
        self._pending_sync_metrics = {
            f"dora/scheduler/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))
        }
        self._pending_sync_metrics.update(sync_metrics)
        if self._resume_info:
            self._pending_sync_metrics["dora/resume_regenerated"] = float(self._resume_info["regenerated"])
            self._pending_sync_metrics["dora/resume_lost"] = float(len(self._resume_info["lost"]))
        if self._plugins is not None:
            step = int(self.global_steps)
            self._plugins.hook.dora_metrics.call_historic(kwargs={"step": step, "metrics": dict(metrics)})

    # ------------------------------------------------------------------ weights
    def _publish(self, version: int) -> dict:
        """Publish the actor's weights as `version` through a publishing backend (``dora_cpu``)."""
        import ray

        backend = self.config.actor_rollout_ref.rollout.checkpoint_engine.backend
        results = ray.get(self.actor_rollout_wg.update_weights(global_steps=version, mode=backend))
        out: dict[str, float] = {}
        for r in results:
            if isinstance(r, dict):
                out.update({k: float(v) for k, v in r.items() if isinstance(v, (int, float))})
        return out

    def _keep_cpu_copy(self, version: int) -> None:
        """Keep the last K + 1 versions restorable on the actor (CPU memory), and any older one a
        load the coordinator has not done yet asks for: a load held while a request routed to its
        replica is in flight waits for that request, which may outlast K + 1 steps when the load
        is of an older version than the request's (R4 switching a drained replica to a version
        whose work was re-queued). Such a copy is dropped at the first publish after its load."""
        import ray

        self.actor_rollout_wg.save_model_to_cpu(f"dora_v{version}")
        self._cpu_versions.append(version)
        excess = len(self._cpu_versions) - (self.dora.max_staleness + 1)
        if excess <= 0:
            return
        pending = set(ray.get(self.coordinator.pending_load_versions.remote()))
        for old in self._cpu_versions[:excess]:
            if old not in pending:
                self.actor_rollout_wg.clear_cpu_model(f"dora_v{old}")
                self._cpu_versions.remove(old)

    def _service(self) -> None:
        """Execute the coordinator's pending R5 aborts and (backends that cannot publish) loads.

        Loads are always of the weights taken when the version was published: straight from the
        live parameters only while they still are that version (``_live_version``), otherwise from
        the CPU copy kept at publish time (defect 1: with ``parameter_sync_step`` > 1 this runs
        between mini-batches, after an optimizer step).

        A load the coordinator holds (requests routed to the replica still in flight) is not in
        this ``take_work``; it is in the first one after the last of those requests is released
        (the sampler calls this on every poll while it waits for a batch).
        """
        import ray

        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.utils.config import omega_conf_to_dataclass

        work = ray.get(self.coordinator.take_work.remote())
        replicas = self.standalone_server_manager.rollout_replicas
        cfg = omega_conf_to_dataclass(self.config.actor_rollout_ref.rollout.checkpoint_engine)
        if work["abort"]:
            # R5 migration: the requests running on these replicas are aborted; the client re-acquires
            # and the coordinator sends each to its new same-version instance (re-prefill, C1 kept).
            moved = CheckpointEngineManager(cfg, self.actor_rollout_wg, [replicas[i] for i in work["abort"]])
            moved.abort_replicas()
            moved.resume_generation_replicas()
        by_version: dict[int, list[int]] = {}
        for instance, version in work["load"]:
            by_version.setdefault(version, []).append(instance)
        if not by_version:
            return
        for version, instances in sorted(by_version.items()):
            manager = CheckpointEngineManager(cfg, self.actor_rollout_wg, [replicas[i] for i in instances])
            if version == self._live_version:
                manager.update_weights(version)
            elif version in self._cpu_versions:
                self.actor_rollout_wg.save_model_to_cpu("dora_current")
                self.actor_rollout_wg.restore_model_from_cpu(f"dora_v{version}")
                manager.update_weights(version)
                self.actor_rollout_wg.restore_model_from_cpu("dora_current")
                self.actor_rollout_wg.clear_cpu_model("dora_current")
            else:
                raise RuntimeError(f"dora: version {version} requested for replicas {instances} is no longer kept")
            ray.get(self.coordinator.loaded.remote(instances, version))


def register() -> None:
    """Register ``DoraTrainer`` as verl trainer ``dora`` (idempotent)."""
    register_trainer(TRAINER_NAME)(DoraTrainer)


# Also when this module is imported first (its import of verl's v1 package ran the plugin hook
# while this body was still executing).
register()

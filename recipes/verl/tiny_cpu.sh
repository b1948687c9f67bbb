#!/usr/bin/env bash
# Try any mode of the plugin on a laptop (CPU only) with verl's own entry point, before booking
# GPUs: `python -m verl.trainer.main_ppo`, the V1 trainer, a tiny Llama-architecture model and a
# one-digit addition task built locally (nothing is downloaded), the same MODE switch and
# overrides as the GPU recipes.
#
#   MODE=dora bash recipes/verl/tiny_cpu.sh                  # dora-ext, K (default 1)
#   MODE=separate_async bash recipes/verl/tiny_cpu.sh        # verl's V1 separate-async twin
#   MODE=sync bash recipes/verl/tiny_cpu.sh                  # verl's V1 colocated sync trainer
#   MODE=pipeline bash recipes/verl/tiny_cpu.sh              # dora-ext K=0 (RolloutPipe rules)
#
# What makes it run on a CPU (all dora-ext code behind verl's plug points, see
# dora_ext/verl/cpu/__init__.py): VERL_PLATFORM=cpu (platform, gloo process groups, FSDP2 engine),
# rollout.name=dora_cpu (a replica serving the HF model the actor trains),
# checkpoint_engine.backend=dora_store (dora's one weight path: per-node weight stores), sdpa attention,
# logical Ray GPUs (+ray_kwargs.ray_init.num_gpus, one per trainer rank).
# Knobs: MODE, K, STEPS, WORK (assets and logs; default a temporary folder), NREPLICAS (rollout
# replicas, default 3), NTRAIN (trainer ranks, default 1), SYNC_STEP (parameter_sync_step),
# MAX_SEQS (requests a replica runs at once, default 4).
# Extra Hydra overrides can be appended.
set -euo pipefail

MODE=${MODE:-dora}
K=${K:-1}
STEPS=${STEPS:-6}
NREPLICAS=${NREPLICAS:-3}
NTRAIN=${NTRAIN:-1}
SYNC_STEP=${SYNC_STEP:-1}
PY=${PYTHON:-python3}
WORK=${WORK:-"$(mktemp -d)"}
BATCH=${BATCH:-4}

export VERL_PLATFORM=cpu
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TOKENIZERS_PARALLELISM=false
# verl 0.9.1 passes flush=True to logger.info when hybrid_engine=False (TypeError at INFO level).
export VERL_LOGGING_LEVEL=${VERL_LOGGING_LEVEL:-WARN}
export VERL_FILE_LOGGER_PATH=${VERL_FILE_LOGGER_PATH:-"${WORK}/metrics_${MODE}.jsonl"}
export DORA_CPU_REPORT_DIR=${DORA_CPU_REPORT_DIR:-"${WORK}/reports_${MODE}"}

[ -e "${WORK}/model/config.json" ] || "${PY}" -m dora_ext.verl.cpu.tiny "${WORK}" >/dev/null
REWARD_FILE=$("${PY}" -c "import dora_ext.verl.cpu.tiny as t; print(t.__file__)")

common=(
    trainer.use_v1=True
    transfer_queue.enable=True
    transfer_queue.backend.SimpleStorage.num_data_storage_units=1
    transfer_queue.backend.SimpleStorage.total_storage_size=20000
    data.train_files="${WORK}/train.parquet"
    data.val_files="${WORK}/val.parquet"
    data.prompt_key=prompt
    data.return_raw_chat=True
    data.max_prompt_length=32
    data.max_response_length=8
    data.train_batch_size=${BATCH}
    data.dataloader_num_workers=0
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    actor_rollout_ref.model.path="${WORK}/model"
    actor_rollout_ref.model.use_remove_padding=False
    +actor_rollout_ref.model.override_config.attn_implementation=sdpa
    actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.actor.optim.lr=1e-3
    actor_rollout_ref.actor.ppo_mini_batch_size=$((BATCH / SYNC_STEP))
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
    actor_rollout_ref.actor.use_dynamic_bsz=False
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2
    actor_rollout_ref.rollout.name=dora_cpu
    actor_rollout_ref.rollout.mode=async
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.n=2
    actor_rollout_ref.rollout.max_num_seqs=${MAX_SEQS:-4}
    actor_rollout_ref.rollout.calculate_log_probs=True
    actor_rollout_ref.rollout.agent.num_workers=1
    reward.num_workers=1
    reward.custom_reward_function.path="${REWARD_FILE}"
    reward.custom_reward_function.name=compute_score
    trainer.device=cpu
    trainer.logger="['console','file']"
    trainer.project_name=dora-tiny-cpu
    trainer.experiment_name="tiny_${MODE}"
    trainer.default_local_dir="${WORK}/ckpt_${MODE}"
    trainer.val_before_train=False
    trainer.test_freq=-1
    trainer.save_freq=-1
    trainer.resume_mode=disable
    trainer.total_epochs=100
    trainer.total_training_steps=${STEPS}
    trainer.nnodes=1
    trainer.n_gpus_per_node=${NTRAIN}
    +ray_kwargs.ray_init.num_gpus=${NTRAIN}
    +ray_kwargs.ray_init.num_cpus=16
    +ray_kwargs.ray_init.include_dashboard=False
)
separate=(
    actor_rollout_ref.hybrid_engine=False
    actor_rollout_ref.rollout.nnodes=1
    actor_rollout_ref.rollout.n_gpus_per_node=${NREPLICAS}
    actor_rollout_ref.rollout.checkpoint_engine.backend=dora_store
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=dora_ext.verl.weights
    trainer.v1.separate_async.parameter_sync_step=${SYNC_STEP}
)

case "${MODE}" in
    pipeline) mode_args=("${separate[@]}" trainer.v1.trainer_mode=dora +dora.mode=pipeline) ;;
    dora) mode_args=("${separate[@]}" trainer.v1.trainer_mode=dora +dora.max_staleness=${K}) ;;
    separate_async)
        mode_args=("${separate[@]}" trainer.v1.trainer_mode=separate_async
                   trainer.v1.separate_async.num_warmup_batches=${K}
                   trainer.v1.sampler.max_off_policy_threshold=$((K + 1))
                   trainer.v1.sampler.max_off_policy_strategy=wait) ;;
    sync) mode_args=(trainer.v1.trainer_mode=sync) ;;
    *) echo "MODE must be dora, pipeline, separate_async or sync, got ${MODE}" >&2; exit 2 ;;
esac

echo "tiny_cpu: MODE=${MODE} work=${WORK} metrics=${VERL_FILE_LOGGER_PATH}" >&2
exec "${PY}" -m verl.trainer.main_ppo "${common[@]}" "${mode_args[@]}" "$@"

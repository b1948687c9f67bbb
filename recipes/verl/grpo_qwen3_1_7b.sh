#!/usr/bin/env bash
# GRPO on Qwen3-1.7B for the RolloutPipe comparison (on-policy complete-group pipelining and
# frontier-group dispatch against a synchronous baseline), with verl's V1 trainer. Twins at equal
# hardware (G = (NNODES_TRAIN + NNODES_ROLLOUT) x NGPUS_PER_NODE):
#
#   MODE=pipeline        dora-ext mode `pipeline` (K=0, on-policy): RolloutPipe's CGP + FGD rules
#   MODE=dora            dora-ext mode `dora` with K (default 1): bounded-staleness multi-version
#   MODE=separate_async  verl's V1 separate-async trainer, same split, staleness bound K + 1 versions
#   MODE=sync            verl's V1 synchronous trainer, colocated on all G GPUs (verl's default)
#
# RolloutPipe measured against slime on split pools; verl has no synchronous split-pool trainer,
# so the synchronous twin here is colocated (what verl users run) and the split-pool twin is
# verl's async trainer. Needs: pip install "dora-ext[verl]" vllm.
set -xeuo pipefail

MODE=${MODE:-pipeline}
K=${K:-1}
RAY_DATA_HOME=${RAY_DATA_HOME:-"${HOME}/verl"}
MODEL_PATH=${MODEL_PATH:-"${RAY_DATA_HOME}/models/Qwen3-1.7B"}
TRAIN_FILE=${TRAIN_FILE:-"${RAY_DATA_HOME}/data/dapo-math-17k.parquet"}
TEST_FILE=${TEST_FILE:-"${RAY_DATA_HOME}/data/aime-2024.parquet"}
NNODES_TRAIN=${NNODES_TRAIN:-1}
NNODES_ROLLOUT=${NNODES_ROLLOUT:-1}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-4}

max_prompt_length=1024
max_response_length=$((1024 * 8))
train_batch_size=64
n_resp_per_prompt=8
max_token_len=$(((max_prompt_length + max_response_length) * 2))

common=(
    trainer.use_v1=True
    transfer_queue.enable=True
    data.train_files="${TRAIN_FILE}"
    data.val_files="${TEST_FILE}"
    data.prompt_key=prompt
    data.truncation=left
    data.filter_overlong_prompts=True
    data.return_raw_chat=True
    data.max_prompt_length=${max_prompt_length}
    data.max_response_length=${max_response_length}
    data.train_batch_size=${train_batch_size}
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    actor_rollout_ref.model.path="${MODEL_PATH}"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.ppo_mini_batch_size=${train_batch_size}
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${max_token_len}
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=${max_token_len}
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.mode=async
    actor_rollout_ref.rollout.n=${n_resp_per_prompt}
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.8
    actor_rollout_ref.rollout.calculate_log_probs=True
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=${max_token_len}
    reward.reward_manager.name=dapo
    trainer.logger="['console','tensorboard']"
    trainer.project_name=rolloutpipe-compare
    trainer.experiment_name="grpo_qwen3-1.7b_${MODE}"
    trainer.val_before_train=False
    trainer.test_freq=-1
    trainer.save_freq=-1
    trainer.resume_mode=disable
    trainer.total_epochs=1
    trainer.total_training_steps=${TOTAL_TRAINING_STEPS:-100}
)
separate=(
    actor_rollout_ref.hybrid_engine=False
    actor_rollout_ref.rollout.nnodes=${NNODES_ROLLOUT}
    actor_rollout_ref.rollout.n_gpus_per_node=${NGPUS_PER_NODE}
    trainer.v1.separate_async.parameter_sync_step=1
    trainer.nnodes=${NNODES_TRAIN}
    trainer.n_gpus_per_node=${NGPUS_PER_NODE}
)

# Weights: dora's one path is backend dora_store (each version published once into one weight
# store per rollout node, drained replicas load from their node's store; nccl is refused for
# dora: its fixed group breaks at the first load of a subset). verl's own twin keeps nccl. Each
# load is checked against vLLM's own checksum through dora's worker extension (verl's plus one
# method; DoraTrainer sets it when unset, spelled out here as the backend is).
dora_weights=(
    actor_rollout_ref.rollout.checkpoint_engine.backend=dora_store
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=dora_ext.verl.weights
    +actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=dora_ext.verl.vllm_worker.DoraWorkerExtension
)

case "${MODE}" in
    pipeline) mode_args=("${separate[@]}" "${dora_weights[@]}" trainer.v1.trainer_mode=dora +dora.mode=pipeline) ;;
    dora) mode_args=("${separate[@]}" "${dora_weights[@]}" trainer.v1.trainer_mode=dora +dora.max_staleness=${K}) ;;
    separate_async)
        mode_args=("${separate[@]}" actor_rollout_ref.rollout.checkpoint_engine.backend=nccl
                   trainer.v1.trainer_mode=separate_async
                   trainer.v1.separate_async.num_warmup_batches=${K}
                   trainer.v1.sampler.max_off_policy_threshold=$((K + 1))
                   trainer.v1.sampler.max_off_policy_strategy=wait) ;;
    sync)
        mode_args=(trainer.v1.trainer_mode=sync trainer.nnodes=$((NNODES_TRAIN + NNODES_ROLLOUT))
                   trainer.n_gpus_per_node=${NGPUS_PER_NODE}) ;;
    *) echo "MODE must be pipeline, dora, separate_async or sync, got ${MODE}" >&2; exit 2 ;;
esac

${PYTHON:-python3} -m verl.trainer.main_ppo "${common[@]}" "${mode_args[@]}" "$@"

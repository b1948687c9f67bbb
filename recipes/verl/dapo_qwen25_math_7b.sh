#!/usr/bin/env bash
# DAPO on Qwen2.5-Math-7B (28K responses), the workload of verl's fully-async benchmark
# (verl/experimental/fully_async_policy/shell/dapo_7b_math_fsdp2_64_64.sh), run with verl's own
# V1 trainer (`python -m verl.trainer.main_ppo`). One script, three twins at equal hardware:
#
#   MODE=dora            dora-ext: multi-version replicas, R3 sampling, no abort on weight sync
#   MODE=separate_async  verl's V1 separate-async trainer (partial rollout), the baseline twin
#   MODE=sync            verl's V1 synchronous colocated trainer on all GPUs
#
# Async modes split the GPUs: NNODES_TRAIN nodes train, NNODES_ROLLOUT nodes generate; sync
# colocates on NNODES_TRAIN + NNODES_ROLLOUT nodes. Needs: pip install "dora-ext[verl]" vllm.
set -xeuo pipefail

MODE=${MODE:-dora}
K=${K:-1}                       # dora: max_staleness (a version trains at most K steps late)
LOSS_MODE=${LOSS_MODE:-vanilla} # or dora_decoupled (decoupled PPO with verl's token-level IS weights)

project_name='DAPO'
exp_name="dapo_qwen2.5-math-7b_28k_v1_${MODE}"
RAY_DATA_HOME=${RAY_DATA_HOME:-"${HOME}/verl"}
# As in verl's recipe: set max_position_embeddings to 32768 in the model's config.json.
MODEL_PATH=${MODEL_PATH:-"${RAY_DATA_HOME}/models/Qwen2.5-Math-7B"}
CKPTS_DIR=${CKPTS_DIR:-"${RAY_DATA_HOME}/ckpts/${project_name}/${exp_name}"}
TRAIN_FILE=${TRAIN_FILE:-"${RAY_DATA_HOME}/data/dapo-math-17k.parquet"}
TEST_FILE=${TEST_FILE:-"${RAY_DATA_HOME}/data/aime-2024.parquet"}

NNODES_TRAIN=${NNODES_TRAIN:-8}
NNODES_ROLLOUT=${NNODES_ROLLOUT:-8}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}

max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 28))
n_resp_per_prompt=16
# 512 prompts per weight version, 4 optimizer steps per version (verl's 64_64 benchmark:
# mini-batch 32 x require_batches 4 x trigger_parameter_sync_step 4).
parameter_sync_step=4
ppo_mini_batch_size=128
train_batch_size=$((parameter_sync_step * ppo_mini_batch_size))
total_training_steps=${TOTAL_TRAINING_STEPS:-400}
actor_ppo_max_token_len=$(((max_prompt_length + max_response_length) * 2))
infer_ppo_max_token_len=$(((max_prompt_length + max_response_length) * 3))

common=(
    trainer.use_v1=True
    transfer_queue.enable=True
    data.train_files="${TRAIN_FILE}"
    data.val_files="${TEST_FILE}"
    data.prompt_key=prompt
    data.truncation=left
    data.max_prompt_length=${max_prompt_length}
    data.max_response_length=${max_response_length}
    data.train_batch_size=${train_batch_size}
    data.return_raw_chat=True
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    algorithm.kl_ctrl.kl_coef=0.0
    actor_rollout_ref.model.path="${MODEL_PATH}"
    actor_rollout_ref.model.use_remove_padding=True
    +actor_rollout_ref.model.override_config.max_position_embeddings=32768
    actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.actor.policy_loss.loss_mode=${LOSS_MODE}
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.kl_loss_coef=0.0
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.clip_ratio_c=10.0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${actor_ppo_max_token_len}
    actor_rollout_ref.actor.ppo_mini_batch_size=${ppo_mini_batch_size}
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.optim.lr_warmup_steps=10
    actor_rollout_ref.actor.optim.weight_decay=0.1
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.grad_clip=1.0
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=4
    actor_rollout_ref.actor.fsdp_config.fsdp_size=8
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    actor_rollout_ref.ref.ulysses_sequence_parallel_size=4
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=${infer_ppo_max_token_len}
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.mode=async
    actor_rollout_ref.rollout.n=${n_resp_per_prompt}
    actor_rollout_ref.rollout.tensor_model_parallel_size=4
    actor_rollout_ref.rollout.gpu_memory_utilization=0.80
    actor_rollout_ref.rollout.enable_chunked_prefill=True
    actor_rollout_ref.rollout.max_num_batched_tokens=$((max_prompt_length + max_response_length))
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.top_p=1.0
    actor_rollout_ref.rollout.top_k=-1
    actor_rollout_ref.rollout.calculate_log_probs=True
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=${infer_ppo_max_token_len}
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0
    actor_rollout_ref.rollout.val_kwargs.top_p=0.7
    actor_rollout_ref.rollout.val_kwargs.top_k=-1
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    actor_rollout_ref.rollout.val_kwargs.n=1
    reward.reward_manager.name=dapo
    +reward.reward_kwargs.overlong_buffer_cfg.enable=True
    +reward.reward_kwargs.overlong_buffer_cfg.len=$((1024 * 4))
    +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0
    +reward.reward_kwargs.overlong_buffer_cfg.log=False
    +reward.reward_kwargs.max_resp_len=${max_response_length}
    trainer.logger="['console','tensorboard']"
    trainer.project_name="${project_name}"
    trainer.experiment_name="${exp_name}"
    trainer.val_before_train=True
    trainer.test_freq=20
    trainer.save_freq=-1
    trainer.default_local_dir="${CKPTS_DIR}"
    trainer.resume_mode=auto
    trainer.total_epochs=10
    trainer.total_training_steps=${total_training_steps}
)

# The async twins: separate trainer / rollout pools, NCCL weight sync.
separate=(
    actor_rollout_ref.hybrid_engine=False
    actor_rollout_ref.rollout.nnodes=${NNODES_ROLLOUT}
    actor_rollout_ref.rollout.n_gpus_per_node=${NGPUS_PER_NODE}
    actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1024
    trainer.v1.separate_async.parameter_sync_step=${parameter_sync_step}
    trainer.nnodes=${NNODES_TRAIN}
    trainer.n_gpus_per_node=${NGPUS_PER_NODE}
)
if [ "${LOSS_MODE}" = dora_decoupled ]; then
    common+=(algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=2.0)
fi

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
    dora)
        mode_args=("${separate[@]}" "${dora_weights[@]}" trainer.v1.trainer_mode=dora +dora.max_staleness=${K}) ;;
    separate_async)
        # verl's own async baseline: staleness bound (in versions spanned) K + 1, stale groups dropped.
        mode_args=("${separate[@]}" actor_rollout_ref.rollout.checkpoint_engine.backend=nccl
                   trainer.v1.trainer_mode=separate_async
                   trainer.v1.separate_async.num_warmup_batches=${K}
                   trainer.v1.sampler.max_off_policy_threshold=$((K + 1))
                   trainer.v1.sampler.max_off_policy_strategy=drop) ;;
    sync)
        mode_args=(trainer.v1.trainer_mode=sync
                   trainer.nnodes=$((NNODES_TRAIN + NNODES_ROLLOUT)) trainer.n_gpus_per_node=${NGPUS_PER_NODE}) ;;
    *) echo "MODE must be dora, separate_async or sync, got ${MODE}" >&2; exit 2 ;;
esac

${PYTHON:-python3} -m verl.trainer.main_ppo "${common[@]}" "${mode_args[@]}" "$@"

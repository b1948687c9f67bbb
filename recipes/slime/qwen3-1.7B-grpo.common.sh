# Qwen3-1.7B GRPO on math, as RolloutPipe evaluates it: on-policy GRPO on disaggregated pools
# (ACTOR_GPUS train, ROLLOUT_GPUS generate). Sourced by qwen3-1.7B-grpo-dora.sh and by its
# unmodified twin qwen3-1.7B-grpo-baseline.sh, so both run exactly these settings on the same GPUs.
#
# Environment (defaults follow slime's own scripts):
#   SLIME_DIR     slime checkout (patched with patches/slime for the dora twin)     [required]
#   MODEL_ROOT    holds Qwen3-1.7B (HF) and Qwen3-1.7B_torch_dist                   [/root]
#   DATA_ROOT     holds dapo-math-17k/dapo-math-17k.jsonl and aime-2024/aime-2024.jsonl [/root]
#   RUN_DIR       checkpoints (and dora's shared weights directory)                 [/root/runs/qwen3-1.7B-grpo-$RUN_NAME]
#   WEIGHTS_DIR   one checkpoint per version; on one node /dev/shm is faster (README) [$RUN_DIR/weights]
#   ACTOR_GPUS, ROLLOUT_GPUS                                                        [4, 4]

: "${SLIME_DIR:?set SLIME_DIR to a slime checkout}"
MODEL_ROOT=${MODEL_ROOT:-/root}
DATA_ROOT=${DATA_ROOT:-/root}
ACTOR_GPUS=${ACTOR_GPUS:-4}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}
RUN_DIR=${RUN_DIR:-/root/runs/qwen3-1.7B-grpo-${RUN_NAME:?}}
WEIGHTS_DIR=${WEIGHTS_DIR:-${RUN_DIR}/weights}
export PYTHONUNBUFFERED=1
source "$(dirname "${BASH_SOURCE[0]}")/weights-dir.sh"

source "${SLIME_DIR}/scripts/models/qwen3-1.7B.sh"   # MODEL_ARGS (architecture flags)

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_ROOT}/Qwen3-1.7B"
   --ref-load "${MODEL_ROOT}/Qwen3-1.7B_torch_dist"
   --load "${RUN_DIR}/ckpt"
   --save "${RUN_DIR}/ckpt"
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data "${DATA_ROOT}/dapo-math-17k/dapo-math-17k.jsonl"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 200
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --rollout-temperature 1
   --global-batch-size 256
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data aime "${DATA_ROOT}/aime-2024/aime-2024.jsonl"
   --n-samples-per-eval-prompt 16
   --eval-max-response-len 16384
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

PERF_ARGS=(
   --tensor-model-parallel-size 1
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 16384
)

# Both twins: the same weight transport (dora-ext loads each version onto one engine at a time,
# which needs a checkpoint per version: disk) and, where the dora twin corrects staleness, the
# same correction (slime's own truncated IS, cap 2, which the dora twin's flags also select).
# The directory must be on a filesystem every node sees (single-node here).
WEIGHT_ARGS=(
   --update-weight-transport disk
   --update-weight-disk-dir "${WEIGHTS_DIR}"
)

SGLANG_ARGS=(
   --rollout-num-gpus "${ROLLOUT_GPUS}"
   --rollout-num-gpus-per-engine 1
   --sglang-mem-fraction-static 0.8
   --sglang-server-concurrency 64
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
)

# launch TRAIN_PY [extra flags...]: start a single-node Ray head and submit slime's loop.
launch() {
   local train_py=$1; shift
   mkdir -p "${RUN_DIR}"
   check_weights_dir "${WEIGHTS_DIR}" "${MODEL_ROOT}/Qwen3-1.7B"
   cd "${SLIME_DIR}"   # slime's loops are run from its checkout, as its own scripts do
   ray start --head --node-ip-address "${MASTER_ADDR:-127.0.0.1}" --num-gpus $((ACTOR_GPUS + ROLLOUT_GPUS)) \
      --disable-usage-stats --dashboard-port=8265
   ray job submit --address="http://127.0.0.1:8265" \
      --runtime-env-json="{\"env_vars\": {\"PYTHONPATH\": \"/root/Megatron-LM/:${SLIME_DIR}\", \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\"}}" \
      -- python3 "${train_py}" \
      --actor-num-nodes 1 \
      --actor-num-gpus-per-node "${ACTOR_GPUS}" \
      "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${GRPO_ARGS[@]}" \
      "${OPTIMIZER_ARGS[@]}" "${PERF_ARGS[@]}" "${SGLANG_ARGS[@]}" "${MISC_ARGS[@]}" "${WEIGHT_ARGS[@]}" \
      "$@"
}

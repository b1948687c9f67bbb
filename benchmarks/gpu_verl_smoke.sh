#!/usr/bin/env bash
# GPU smoke test of trainer mode `dora` inside verl 0.9.1 (`python -m verl.trainer.main_ppo`), with
# its baseline twin (verl's own `separate_async`) on the same split, a few steps each.
#
# Not runnable without GPUs. Needs on the machine: >= 2 NVIDIA GPUs (one trains, the rest
# generate), `pip install "dora-ext[verl]" vllm`, a small chat model and a GSM8K-style parquet
# pair already on disk (nothing is downloaded):
#
#   MODEL_PATH=/models/Qwen2.5-0.5B-Instruct TRAIN_FILES=/data/gsm8k/train.parquet \
#   VAL_FILES=/data/gsm8k/test.parquet bash benchmarks/gpu_verl_smoke.sh
#
# It checks, from each run's own evidence (verl's file logger, read by dora_ext.verl.cpu.evidence,
# the same checks as the CPU tests): the run finished its steps; C1 from the engines (verl's
# training/off_policy/trajectory_spans/max == 1, computed from the versions vLLM returned with the
# tokens, and for `dora` the sampler's dora/c1_ok); C2 counted from TransferQueue (dora/c2_ok:
# nothing duplicated, truncated or vanished); C3 (verl's trajectory_staleness_worst/max <= K and
# dora/c3_ok). The weight checksum check (a replica's checksum after each load equals the
# published one) needs replicas that report checksums: the `dora_cpu` rollout does, vLLM does not,
# so with vLLM it prints "n/a"; run `MODE=dora bash recipes/verl/tiny_cpu.sh` on the same machine
# for that check. It prints the mean step time of both runs side by side (a ratio from one
# machine, one run). verl's separate_async twin resumes aborted requests under new weights
# (partial rollout), so its C1 is printed, not required.
set -uo pipefail

NUM_GPUS=${NUM_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
MODEL_PATH=${MODEL_PATH:-"${HOME}/models/Qwen2.5-0.5B-Instruct"}
TRAIN_FILES=${TRAIN_FILES:-"${HOME}/data/gsm8k/train.parquet"}
VAL_FILES=${VAL_FILES:-"${HOME}/data/gsm8k/test.parquet"}
STEPS=${STEPS:-6}
K=${K:-1}
OUT=${OUT:-"$(mktemp -d)"}

fail() { echo "SMOKE FAIL: $*" >&2; exit 1; }
[ "${NUM_GPUS}" -ge 2 ] || fail "needs >= 2 GPUs (found ${NUM_GPUS}): trainer and rollout pools are separate"
for p in "${MODEL_PATH}" "${TRAIN_FILES}" "${VAL_FILES}"; do [ -e "$p" ] || fail "missing $p (set MODEL_PATH/TRAIN_FILES/VAL_FILES)"; done
python3 -c "import vllm, verl, dora_ext.verl.plugin" || fail "python needs vllm, verl and dora-ext"

N_TRAIN=${N_TRAIN:-$((NUM_GPUS / 2))}
N_ROLLOUT=$((NUM_GPUS - N_TRAIN))
common=(
    trainer.use_v1=True transfer_queue.enable=True
    data.train_files="${TRAIN_FILES}" data.val_files="${VAL_FILES}" data.prompt_key=prompt
    data.truncation=left data.filter_overlong_prompts=True data.return_raw_chat=True
    data.max_prompt_length=512 data.max_response_length=512 data.train_batch_size=8
    algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False
    actor_rollout_ref.model.path="${MODEL_PATH}" actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.hybrid_engine=False
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=8
    actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096
    actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.mode=async
    actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=${N_ROLLOUT}
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.5
    actor_rollout_ref.rollout.n=4 actor_rollout_ref.rollout.calculate_log_probs=True
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096
    actor_rollout_ref.rollout.checkpoint_engine.backend=nccl
    trainer.v1.separate_async.parameter_sync_step=1
    reward.reward_manager.name=naive
    trainer.logger="['console','file']" trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=-1
    trainer.resume_mode=disable trainer.nnodes=1 trainer.n_gpus_per_node=${N_TRAIN}
    trainer.total_epochs=1 trainer.total_training_steps=${STEPS} trainer.project_name=dora-smoke
)

run() {  # $1 name, rest: overrides
    local name=$1; shift
    echo "== ${name} ==" >&2
    VERL_FILE_LOGGER_PATH="${OUT}/metrics_${name}.jsonl" DORA_CPU_REPORT_DIR="${OUT}/reports_${name}" \
    timeout "${RUN_TIMEOUT:-1800}" python3 -m verl.trainer.main_ppo "${common[@]}" trainer.experiment_name="smoke_${name}" "$@" \
        > "${OUT}/${name}.log" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || { tail -50 "${OUT}/${name}.log" >&2; fail "${name} exited ${rc} (log: ${OUT}/${name}.log)"; }
}

run dora trainer.v1.trainer_mode=dora +dora.max_staleness=${K}
run separate_async trainer.v1.trainer_mode=separate_async trainer.v1.separate_async.num_warmup_batches=${K} \
    trainer.v1.sampler.max_off_policy_threshold=$((K + 1)) trainer.v1.sampler.max_off_policy_strategy=drop

python3 - "${OUT}" "${STEPS}" "${K}" <<'PY'
import sys
from dora_ext.verl.cpu.evidence import analyze, load_run

out, steps, K = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
bad, res = [], {}
for name in ("dora", "separate_async"):
    metrics, reports = load_run(out, name)
    r = res[name] = analyze(metrics, reports, mode=name, max_staleness=K)
    if r["steps"] < steps:
        bad.append(f"{name}: {r['steps']} of {steps} steps logged")
    if not r["finite_loss"]:
        bad.append(f"{name}: actor loss not finite")
    checks = ("c1_ok", "c2_ok", "c3_ok") if name == "dora" else ("c2_ok", "c3_ok")
    bad += [f"{name}: {c} false" for c in checks if not r[c]]
    cs = "ok" if r["weights_checksum_ok"] else ("n/a" if not r["loads"] else "FAIL " + "; ".join(r["checksum_problems"]))
    if cs.startswith("FAIL"):
        bad.append(f"{name}: weights {cs}")
    print(f"{name:<15} steps={r['steps']} tokens/s={r['tokens_per_s']:.1f} C1={r['c1_ok']} C2={r['c2_ok']} "
          f"C3={r['c3_ok']} weights={cs}")
if bad:
    sys.exit("SMOKE FAIL: " + "; ".join(bad))
d, s = res["dora"], res["separate_async"]
print(f"SMOKE OK  steps/s dora {d['steps_per_s']:.3f}, separate_async {s['steps_per_s']:.3f}, "
      f"ratio {d['steps_per_s'] / max(s['steps_per_s'], 1e-9):.2f}x")
PY

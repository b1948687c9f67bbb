#!/usr/bin/env bash
# GPU smoke test of trainer mode `dora` inside verl 0.9.1 (`python -m verl.trainer.main_ppo`) with
# vLLM and with SGLang, each next to verl's own `separate_async` twin on the same split.
#
# Not runnable without GPUs. Needs on the machine: >= 3 NVIDIA GPUs (1 trains, >= 2 rollout
# replicas: with one replica every load is the full set and nothing below could be seen),
# `pip install "dora-ext[verl]" vllm sglang`, a small chat model and a GSM8K-style parquet pair on
# disk (nothing is downloaded). A single GPU or two GPUs cannot run it.
#
#   MODEL_PATH=/models/Qwen2.5-0.5B-Instruct SGLANG_MODEL_PATH=/models/Llama-3.2-1B-Instruct \
#   TRAIN_FILES=/data/gsm8k/train.parquet VAL_FILES=/data/gsm8k/test.parquet bash benchmarks/gpu_verl_smoke.sh
#
# The SGLang leg runs on SGLANG_MODEL_PATH, a Llama-architecture model (config.json's architectures:
# LlamaForCausalLM or another SGLang class with get_weights_by_name, dora_ext.verl.weights.
# SGLANG_WEIGHTS_BY_NAME): dora checks every load on SGLang through /get_weights_by_name, which SGLang
# implements per model class (not for Qwen2/Qwen3), so dora refuses SGLang on MODEL_PATH's default Qwen
# model at launch. With sglang in ENGINES and SGLANG_MODEL_PATH unset the smoke fails at once (an
# unrun leg is not a passed one): set it, or ENGINES=vllm. The last line names the runs checked.
#
# Knobs: ENGINES (default "vllm sglang"), SGLANG_MODEL_PATH, STEPS (6), K (2), N_TRAIN (1),
# RUN_TIMEOUT (s per run), OUT (logs and reports), SKIP_TWIN=1 (dora only).
#
# Checked for dora, from each run's own evidence (verl's file logger and the run reports, read by
# dora_ext.verl.cpu.evidence, the same code as the CPU tests):
#   (a) >= 2 loads of partial subsets (a replica loaded while others kept serving), none failed;
#   (b) two versions held by replicas at once, and a trained staleness of K;
#   (c) every load's engine-side checksum (vLLM: collective_rpc("dora_checksum") into the workers,
#       a method of dora's worker extension, which DoraTrainer sets itself here; SGLang:
#       /get_weights_by_name; over the sampled norm tensors) equal to the published one;
#   (d) >= 1 load of a version older than the newest published then (from the node's store);
#   (e) >= 1 landed migration, aborted alone on its source (abort_request), none left unlanded,
#       no load held or failed at the end;
#   (f) C1 from the engines (trajectory_spans/max == 1, dora/c1_ok), C2 from TransferQueue
#       (dora/c2_ok), C3 (staleness <= K, dora/c3_ok), finite loss, all STEPS logged.
# (d) and (e) depend on stragglers: the workload (n=8, 1024-token responses) is sized for them; a
# run without one fails naming the check, not silently. The twin's C1 is printed, not required
# (verl's partial rollout resumes requests under new weights). Mean step times are printed side
# by side (one machine, one run).
set -uo pipefail

NUM_GPUS=${NUM_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
MODEL_PATH=${MODEL_PATH:-"${HOME}/models/Qwen2.5-0.5B-Instruct"}
TRAIN_FILES=${TRAIN_FILES:-"${HOME}/data/gsm8k/train.parquet"}
VAL_FILES=${VAL_FILES:-"${HOME}/data/gsm8k/test.parquet"}
ENGINES=${ENGINES:-"vllm sglang"}
SGLANG_MODEL_PATH=${SGLANG_MODEL_PATH:-}
STEPS=${STEPS:-6}
K=${K:-2}
OUT=${OUT:-"$(mktemp -d)"}

fail() { echo "SMOKE FAIL: $*" >&2; exit 1; }
N_TRAIN=${N_TRAIN:-1}
N_ROLLOUT=$((NUM_GPUS - N_TRAIN))
[ "${N_ROLLOUT}" -ge 2 ] || fail "needs >= 2 rollout GPUs besides ${N_TRAIN} trainer GPU(s) (found ${NUM_GPUS} GPUs)"
for p in "${MODEL_PATH}" "${TRAIN_FILES}" "${VAL_FILES}"; do [ -e "$p" ] || fail "missing $p (set MODEL_PATH/TRAIN_FILES/VAL_FILES)"; done
[ -n "${ENGINES// /}" ] || fail "ENGINES is empty (vllm, sglang or both)"
if [[ " ${ENGINES} " == *" sglang "* ]]; then
    # Not skipped: a leg that did not run is not a leg that passed.
    [ -n "${SGLANG_MODEL_PATH}" ] || fail "ENGINES has sglang and SGLANG_MODEL_PATH is unset: set it to a Llama-architecture model (dora on SGLang checks loads through /get_weights_by_name, which SGLang has not for Qwen), or run ENGINES=vllm"
    [ -e "${SGLANG_MODEL_PATH}/config.json" ] || fail "missing ${SGLANG_MODEL_PATH}/config.json (set SGLANG_MODEL_PATH)"
fi
for e in ${ENGINES}; do python3 -c "import ${e}, verl, dora_ext.verl.plugin" || fail "python needs ${e}, verl and dora-ext"; done

common=(
    trainer.use_v1=True transfer_queue.enable=True
    data.train_files="${TRAIN_FILES}" data.val_files="${VAL_FILES}" data.prompt_key=prompt
    data.truncation=left data.filter_overlong_prompts=True data.return_raw_chat=True
    data.max_prompt_length=512 data.max_response_length=1024 data.train_batch_size=8
    algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False
    actor_rollout_ref.model.path="${MODEL_PATH}" actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.hybrid_engine=False
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=8
    actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192
    actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.rollout.mode=async
    actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=${N_ROLLOUT}
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.5
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.calculate_log_probs=True
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192
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
    DORA_CHECKSUM_DIR="${OUT}" \
    timeout "${RUN_TIMEOUT:-1800}" python3 -m verl.trainer.main_ppo "${common[@]}" trainer.experiment_name="smoke_${name}" "$@" \
        > "${OUT}/${name}.log" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || { tail -50 "${OUT}/${name}.log" >&2; fail "${name} exited ${rc} (log: ${OUT}/${name}.log)"; }
}

names=()
for e in ${ENGINES}; do
    model=("actor_rollout_ref.model.path=${MODEL_PATH}")
    [ "${e}" != sglang ] || model=("actor_rollout_ref.model.path=${SGLANG_MODEL_PATH}")
    # dora's weight path is dora_store (set by DoraTrainer; spelled out here as the recipes do). Its
    # vLLM worker extension (engine_kwargs.vllm.worker_extension_cls) is left to DoraTrainer.
    run "dora_${e}" "${model[@]}" actor_rollout_ref.rollout.name="${e}" trainer.v1.trainer_mode=dora +dora.max_staleness=${K} \
        actor_rollout_ref.rollout.checkpoint_engine.backend=dora_store \
        actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=dora_ext.verl.weights
    names+=("dora_${e}")
    if [ "${SKIP_TWIN:-0}" != 1 ]; then
        run "separate_async_${e}" "${model[@]}" actor_rollout_ref.rollout.name="${e}" trainer.v1.trainer_mode=separate_async \
            actor_rollout_ref.rollout.checkpoint_engine.backend=nccl trainer.v1.separate_async.num_warmup_batches=${K} \
            trainer.v1.sampler.max_off_policy_threshold=$((K + 1)) trainer.v1.sampler.max_off_policy_strategy=drop
        names+=("separate_async_${e}")
    fi
done

python3 - "${OUT}" "${STEPS}" "${K}" "${names[@]}" <<'PY'
import sys
from dora_ext.verl.cpu.evidence import analyze, load_run

out, steps, K, names = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
bad, res = [], {}
for name in names:
    dora = name.startswith("dora_")
    metrics, reports = load_run(out, name)
    r = res[name] = analyze(metrics, reports, mode="dora" if dora else "separate_async", max_staleness=K)
    need = {"all steps logged": r["steps"] >= steps, "finite loss": r["finite_loss"],
            "C2": r["c2_ok"], "C3": r["c3_ok"]}
    if dora:
        last = {k.rsplit("/", 1)[1]: v for k, v in (metrics[-1] if metrics else {}).items()
                if k.startswith("dora/scheduler/")}
        need.update({
            "C1": r["c1_ok"],
            "(a) >= 2 partial-subset loads": r["subset_loads"] >= 2,
            "(a) no failed load": last.get("load_errors", 1) == 0,
            "(b) two versions held at once": r["versions_loaded_at_once"] >= 2,
            f"(b) trained staleness {K}": r["trained_staleness_max"] == K,
            "(c) engine checksum == published on every load": r["engine_checksum_ok"],
            "(d) an old-version load": r["old_version_loads"] >= 1,
            "(e) a landed migration": r["migrations_landed"] >= 1,
            "(e) its request aborted alone": r["requests_aborted_alone"] >= 1,
            "(e) nothing unlanded or held at the end": last.get("moves_not_landed", 1) == 0
                                                      and last.get("loads_held_now", 1) == 0,
        })
    bad += [f"{name}: {what}" for what, ok in need.items() if not ok]
    print(f"{name:<22} steps={r['steps']} tokens/s={r['tokens_per_s']:.1f} C1={r['c1_ok']} C2={r['c2_ok']} "
          f"C3={r['c3_ok']} checked_loads={r['checked_loads']} subset={r['subset_loads']} "
          f"old={r['old_version_loads']} at_once={r['versions_loaded_at_once']} landed={r['migrations_landed']}")
if bad:
    sys.exit("SMOKE FAIL: " + "; ".join(bad))
for name in names:
    twin = name.replace("dora_", "separate_async_")
    if name.startswith("dora_") and twin in res:
        d, s = res[name], res[twin]
        print(f"{name}: steps/s {d['steps_per_s']:.3f} vs {twin} {s['steps_per_s']:.3f}, "
              f"ratio {d['steps_per_s'] / max(s['steps_per_s'], 1e-9):.2f}x")
print(f"SMOKE OK ({', '.join(names)})")
PY

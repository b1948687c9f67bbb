#!/usr/bin/env bash
# dora-ext twin: the baseline's settings plus the flags `dora-ext slime-args` prints.
# DORA_CONFIG defaults to mode `pipeline` (RolloutPipe: on-policy, CGP + FGD, K=0, train.py);
# with a K >= 1 config (e.g. dora-k2.yaml) set TRAIN_PY=train_async.py.
# Needs: `pip install dora-ext` in the Ray job's Python, and patches/slime applied to SLIME_DIR.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN_NAME=${RUN_NAME:-dora}
source "${here}/qwen3-1.7B-grpo.common.sh"
DORA_CONFIG=${DORA_CONFIG:-${here}/dora-pipeline.yaml}
TRAIN_PY=${TRAIN_PY:-train.py}
if ! "${here}/../../patches/slime/check.sh" "${SLIME_DIR}" | grep -q "already applied"; then
   echo "apply patches/slime to ${SLIME_DIR} first (patches/slime/check.sh ${SLIME_DIR})" >&2
   exit 1
fi
DORA_ARGS=($(dora-ext slime-args --config "${DORA_CONFIG}" --weights-dir "${WEIGHTS_DIR}"))
launch "${TRAIN_PY}" "${DORA_ARGS[@]}"

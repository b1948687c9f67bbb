#!/usr/bin/env bash
# dora-ext twin: the baseline's settings and loop plus the flags `dora-ext slime-args` prints
# for DORA_CONFIG (default dora-k2.yaml: multi-version rollout, K=2, truncated IS correction).
# Needs: `pip install dora-ext` in the Ray job's Python, and patches/slime applied to SLIME_DIR.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN_NAME=${RUN_NAME:-dora}
source "${here}/qwen3-4B-dapo.common.sh"
DORA_CONFIG=${DORA_CONFIG:-${here}/dora-k2.yaml}
if ! "${here}/../../patches/slime/check.sh" "${SLIME_DIR}" | grep -q "already applied"; then
   echo "apply patches/slime to ${SLIME_DIR} first (patches/slime/check.sh ${SLIME_DIR})" >&2
   exit 1
fi
DORA_ARGS=($(dora-ext slime-args --config "${DORA_CONFIG}" --weights-dir "${WEIGHTS_DIR}"))
launch train_async.py "${DORA_ARGS[@]}"

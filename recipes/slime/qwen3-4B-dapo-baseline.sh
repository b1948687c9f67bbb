#!/usr/bin/env bash
# Baseline twin: slime unmodified, its own asynchronous loop (train_async.py: one step
# off-policy, every engine reloaded at each update) on the same disaggregated GPUs.
set -euo pipefail
RUN_NAME=${RUN_NAME:-baseline}
source "$(dirname "${BASH_SOURCE[0]}")/qwen3-4B-dapo.common.sh"
launch train_async.py

#!/usr/bin/env bash
# Baseline twin: slime unmodified (its synchronous train.py) on the same disaggregated GPUs.
# This is the "Slime" RolloutPipe compares against. SLIME_DIR may be patched or not: without
# dora's YAML the patch changes nothing.
set -euo pipefail
RUN_NAME=${RUN_NAME:-baseline}
source "$(dirname "${BASH_SOURCE[0]}")/qwen3-1.7B-grpo.common.sh"
launch train.py

#!/usr/bin/env bash
# Baseline twin: verl's V1 synchronous colocated trainer on all GPUs (see dapo_qwen25_math_7b.sh).
exec env MODE=sync "$(dirname "$0")/dapo_qwen25_math_7b.sh" "$@"

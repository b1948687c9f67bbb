#!/usr/bin/env bash
# Baseline twin: verl's own V1 separate-async trainer on the same split (see dapo_qwen25_math_7b.sh).
exec env MODE=separate_async "$(dirname "$0")/dapo_qwen25_math_7b.sh" "$@"

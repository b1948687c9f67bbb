#!/usr/bin/env bash
# dora-ext twin of the DAPO Qwen2.5-Math-7B recipe (see dapo_qwen25_math_7b.sh).
exec env MODE=dora "$(dirname "$0")/dapo_qwen25_math_7b.sh" "$@"

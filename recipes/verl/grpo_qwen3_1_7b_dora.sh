#!/usr/bin/env bash
# Twin MODE=dora of grpo_qwen3_1_7b.sh (see that file).
exec env MODE=dora "$(dirname "$0")/grpo_qwen3_1_7b.sh" "$@"

#!/usr/bin/env bash
# Twin MODE=sync of grpo_qwen3_1_7b.sh (see that file).
exec env MODE=sync "$(dirname "$0")/grpo_qwen3_1_7b.sh" "$@"

#!/usr/bin/env bash
# Twin MODE=separate_async of grpo_qwen3_1_7b.sh (see that file).
exec env MODE=separate_async "$(dirname "$0")/grpo_qwen3_1_7b.sh" "$@"

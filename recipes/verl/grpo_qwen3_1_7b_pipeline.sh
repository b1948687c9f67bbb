#!/usr/bin/env bash
# Twin MODE=pipeline of grpo_qwen3_1_7b.sh (see that file).
exec env MODE=pipeline "$(dirname "$0")/grpo_qwen3_1_7b.sh" "$@"

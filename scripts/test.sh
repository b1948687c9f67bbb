#!/usr/bin/env bash
# Set up a virtual environment (CPU torch first, then dora-ext with verl 0.9.1 and the test tools)
# and run the whole test suite. This is the README's test command; .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e ".[torch,verl,test]"
# slime's client-side dependencies, for the tests that run slime's own code (slime itself is not
# on PyPI: those tests need DORA_SLIME_PATH, which .ci/run sets, and skip with the reason
# otherwise). sglang and megatron-core come without their dependencies: only their client side
# (argument classes, megatron-core's parallel state over gloo) runs on CPU.
.venv/bin/python -m pip install --quiet --no-deps "sglang==0.5.23" "megatron-core==0.16.1"
.venv/bin/python -m pip install --quiet -e ".[slime-test]"
# Two cores: one torch thread per process keeps tests from oversubscribing them.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
# pytest's 5 means "no tests collected": that is a failure here, not a pass.
exit $rc

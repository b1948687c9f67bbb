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
# Two cores: one torch thread per process keeps tests from oversubscribing them.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
# pytest's 5 means "no tests collected": that is a failure here, not a pass.
exit $rc

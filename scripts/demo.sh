#!/usr/bin/env bash
# Set up a virtual environment and run the main job: `sync` against `dora` on the default
# long-tail recipe (a tiny transformer, real generation, rewards and gradient steps), side by side,
# with reward and timeline plots. A few minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e ".[torch]"
.venv/bin/dora-ext compare recipes/cpu/long-tail.yaml --modes sync,dora "$@"

#!/usr/bin/env bash
# Set up a virtual environment and run the main job: the what-if simulator, all five modes side
# by side on the DAPO-28K long-tail workload, with a timeline plot.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e ".[torch]"
mkdir -p runs
.venv/bin/dora-ext simulate --preset dapo-28k --modes sync,one_step_off,partial,pipeline,dora \
  --steps 20 --seed 0 --plot runs/sim-dapo-28k.png "$@"
echo "timeline plot: runs/sim-dapo-28k.png"

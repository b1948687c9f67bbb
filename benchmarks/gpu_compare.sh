#!/usr/bin/env bash
# dora vs sync on one GPU with the embedded runtime: a larger random-initialised model (about 25M
# parameters, built on the machine: nothing is downloaded), the long-tail task with longer answers,
# both modes on the same seeds, and the same JSON as `dora-ext compare --json`:
#   {"recipe": ..., "modes": {"sync": {...}, "dora": {...}}}
#
#   bash benchmarks/gpu_compare.sh                 # on the accelerator machine
#   DEVICE=cpu STEPS=2 D_MODEL=64 N_LAYER=2 WARM=20 BATCH=2 GROUP=2 CAP=4 bash benchmarks/gpu_compare.sh   # dry run anywhere
#
# Equal hardware: both modes use the one GPU (sync colocated: generate, then train; dora: the
# instances and the trainer overlap, each on its own CUDA stream). Instances are threads on CUDA
# (runtime.backend auto). The JSON goes to stdout and to $OUT/compare.json; plots to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-40}
SEEDS=${SEEDS:-2}
OUT=${OUT:-runs/gpu_compare}
D_MODEL=${D_MODEL:-512}
N_LAYER=${N_LAYER:-8}
N_HEAD=${N_HEAD:-8}
WARM=${WARM:-300}
BATCH=${BATCH:-16}
GROUP=${GROUP:-8}
INSTANCES=${INSTANCES:-4}
CAP=${CAP:-32}

"$PY" -c "import torch, sys; sys.exit(0 if '$DEVICE' == 'cpu' or torch.cuda.is_available() else 'no CUDA device: set DEVICE=cpu for a dry run')"

"$PY" -m dora_ext.cli compare recipes/cpu/long-tail.yaml --modes sync,dora \
  --seeds "$SEEDS" --steps "$STEPS" --json --no-progress --out "$OUT" \
  --set name=long-tail-gpu \
  --set engine.device="$DEVICE" \
  --set model.d_model="$D_MODEL" --set model.n_layer="$N_LAYER" --set model.n_head="$N_HEAD" \
  --set task.median=16 --set task.cap=96 \
  --set warm_start.steps="$WARM" --set warm_start.batch_size=64 \
  --set trainer.lr=0.0001 \
  --set dora.batch_size="$BATCH" --set dora.group_size="$GROUP" \
  --set dora.instances="$INSTANCES" --set dora.capacity="$CAP" \
  --set runtime.max_threads=0 --set runtime.stall_timeout_s=900 \
  --set eval.prompts=128

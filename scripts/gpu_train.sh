#!/usr/bin/env bash
# The shipped default models, trained concurrently on one GPU from the packed data in .gpu/ (pack_gpu_data.py).
# Run from the repository root. Outputs (best/ checkpoints, metrics, logs) go to $RUNS (default runs/gpu).
# A CPU dry run of this exact script: RUNS=runs/dry BUDGET=15 VAL=200 DEVICE=cpu SMALL=1 scripts/gpu_train.sh
set -u
RUNS=${RUNS:-runs/gpu}
BUDGET=${BUDGET:-420}       # seconds of training per model (both run at the same time)
VAL=${VAL:-5000}
DEVICE=${DEVICE:-auto}
SMALL=${SMALL:-0}           # 1: shrink the models (CPU dry run only)
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$RUNS"
small_c=(); small_m=()
if [ "$SMALL" = 1 ]; then
  small_c=(--set backbone_channels=16 --batch-size 64 --eval-batch-size 100)
  small_m=(--set backbone_channels=16 --batch-size 64 --eval-batch-size 100)
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
start=$(date +%s)
python3 -m capserve.cli train --model cifar10-resnet --data .gpu/cifar10 --out "$RUNS/cifar10" \
  --epochs 200 --batch-size 512 --lr 0.3 --schedule onecycle --amp bf16 --channels-last \
  --time-budget "$BUDGET" --val-size "$VAL" --eval-batch-size 1000 --no-test --device "$DEVICE" "${small_c[@]}" \
  >"$RUNS/cifar10.log" 2>&1 &
pc=$!
python3 -m capserve.cli train --model multimnist-matrix-small --data .gpu/mnist --out "$RUNS/multimnist" \
  --epochs 400 --batch-size 512 --lr 0.2 --schedule onecycle --amp bf16 --channels-last \
  --time-budget "$BUDGET" --val-size "$VAL" --eval-batch-size 1000 --no-test --device "$DEVICE" "${small_m[@]}" \
  >"$RUNS/multimnist.log" 2>&1 &
pm=$!
wait $pc; rc_c=$?
wait $pm; rc_m=$?
echo "cifar10 rc=$rc_c multimnist rc=$rc_m wall=$(( $(date +%s) - start ))s"
tail -n 25 "$RUNS/cifar10.log"; tail -n 25 "$RUNS/multimnist.log"
# everything that matters in one archive, to copy back from the GPU machine in one file
tar -czf "$RUNS/runs.tar.gz" -C "$RUNS" --exclude='last' cifar10 multimnist 2>/dev/null
ls -la "$RUNS"

#!/bin/bash
# On one GPU: train/compare rank lines on CUDA; pytest -m gpu at HEAD.
set -u
export PYTHONPATH=.
step() { echo; echo "=== $* ($(date +%T))"; }
step env
nvidia-smi -L
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())"
nvidia-smi --query-gpu=pci.bus_id,uuid --format=csv,noheader
step "train nccl ws1 cuda"
timeout 90 python -m commbench train --strategy ddp --device cuda --world-size 1 --steps-per-epoch 5 --no-eval \
  --samples 4000 --json "$OUT/train_ws1.jsonl" 2>&1 | head -12
echo "rc=${PIPESTATUS[0]}"
step "compare gloo ws2 cuda"
timeout 120 python -m commbench compare --device cuda --backend gloo --world-size 2 --steps-per-epoch 5 --no-eval \
  --samples 4000 --json "$OUT/compare_ws2.jsonl" 2>&1 | head -16
echo "rc=${PIPESTATUS[0]}"
python - "$OUT/train_ws1.jsonl" "$OUT/compare_ws2.jsonl" <<'PY'
import json, sys
for p in sys.argv[1:]:
    try:
        h = json.loads(open(p).readline())
        print(p.rsplit("/", 1)[-1], "ranks:", h.get("ranks"))
    except Exception as e:
        print(p, "unreadable:", e)
PY
step "pytest -m gpu"
timeout 240 python -m pytest -m gpu -q -p no:cacheprovider -rs 2>&1 | tail -25 | tee "$OUT/pytest_gpu.txt"
step done

#!/bin/bash
# GPU checks of the twenty-third session: a backbone's huge image_size on CUDA (the input refusal is
# for the CPU only); a probed gloo+CUDA sweep and its report (one table per sweep); pytest -m gpu at HEAD.
set -u
export PYTHONPATH=.
step() { echo; echo "=== $* ($(date +%T))"; }
step env
nvidia-smi -L
python -c "import torch; print(torch.__version__, torch.version.cuda)"
step "train resnet18 image_size=100000 cuda ws1"
timeout 120 python -m commbench train --strategy ddp --device cuda --world-size 1 --model resnet18 \
  --model-opt image_size=100000 --batch-size 8 --steps-per-epoch 2 --no-eval --samples 256 2>&1 | tail -6
echo "rc=${PIPESTATUS[0]}"
step "train resnet18 image_size=100000 cuda ws1, batch searched"
timeout 120 python -m commbench train --strategy ddp --device cuda --world-size 1 --model resnet18 \
  --model-opt image_size=100000 --steps-per-epoch 2 --no-eval --samples 256 2>&1 | tail -6
echo "rc=${PIPESTATUS[0]}"
step "sweep gloo cuda ws2 probed, then report"
timeout 150 python -m commbench sweep --device cuda --backend gloo --world-size 2 -b 64K -e 16M -f 4 -n 10 \
  --json "$OUT/sweep_ws2.jsonl" --plot "$OUT/sweep_ws2.png" 2>&1 | tail -22
echo "rc=${PIPESTATUS[0]}"
timeout 60 python -m commbench report -o "$OUT/report" "$OUT/sweep_ws2.jsonl" 2>&1 | tail -3
echo "rc=${PIPESTATUS[0]}"
ls "$OUT" "$OUT/report"
grep -n "^#" "$OUT/report/report.md" | head -20
step "pytest -m gpu"
timeout 220 python -m pytest -m gpu -q -p no:cacheprovider -rs 2>&1 | tail -8 | tee "$OUT/pytest_gpu.txt"
step done

#!/bin/bash
# The in-place forms on one GPU: pytest -m gpu, NCCL at one rank in both forms, gloo with CUDA tensors
# at two ranks in place. From the repository root, with OUT set to a directory for the records.
set -u
export PYTHONPATH=.
step() { echo; echo "=== $* ($(date +%T))"; }
step env
nvidia-smi -L
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())"
step pytest -m gpu
timeout 220 python -m pytest -m gpu -q -p no:cacheprovider -rs 2>&1 | tail -25 | tee "$OUT/pytest_gpu.txt"
for c in reduce_scatter all_gather; do
  for form in "" "--in-place"; do
    step "sweep nccl ws1 $c $form"
    timeout 45 python -m commbench sweep --collective $c --device cuda --world-size 1 -a builtin,ring \
      -b 1M -e 64M -f 8 -n 5 -w 2 $form --json "$OUT/nccl_ws1_${c}${form:+_inplace}.jsonl" 2>&1 | tail -14
    echo "rc=${PIPESTATUS[0]}"
  done
done
for c in reduce_scatter all_gather; do
  step "sweep gloo cuda ws2 $c in place"
  timeout 60 python -m commbench sweep --collective $c --device cuda --backend gloo --world-size 2 \
    -a builtin,naive,ring -b 1M -e 16M -f 4 -n 5 -w 2 --in-place --json "$OUT/gloo_ws2_${c}_inplace.jsonl" 2>&1 | tail -16
  echo "rc=${PIPESTATUS[0]}"
done
step done

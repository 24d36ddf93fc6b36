#!/bin/bash
# GPU checks of the twenty-eighth session: what changed since the last GPU run (a1dbbd2): the
# syncs' start_alike (NCCL's branch, gloo with CUDA models), bucketed's accumulation on CUDA,
# unpack's checks on CUDA tensors; the whole gpu-marked suite; a probed compare on CUDA.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date +%T))"; }
step env
nvidia-smi -L
python -c "import torch; print(torch.__version__, torch.version.cuda)"
step "pytest, the new gpu tests first"
NEW="tests/test_bucketing.py::test_tensors_unpacked_over_one_another_are_refused_before_a_copy
  tests/test_bucketing.py::test_a_view_that_autograd_would_record_the_copy_in_is_refused_before_a_copy
  tests/test_gpu.py::test_the_hand_written_syncs_with_cuda_models_match_ddp_at_two_ranks
  tests/test_gpu.py::test_start_alike_and_the_syncs_on_one_nccl_rank
  tests/test_gpu.py::test_every_strategy_trains_a_model_with_batchnorm_on_cuda_as_ddp"
timeout 180 python -m pytest -q -p no:cacheprovider -rs --durations=8 \
  $NEW 2>&1 | tee "$OUT/pytest_new.txt" | tail -30
step "compare on CUDA, gloo, 2 ranks, resnet18_cifar"
timeout 110 python -m commbench compare --device cuda --backend gloo --world-size 2 --model resnet18_cifar \
  --samples 2048 --batch-size 64 --steps-per-epoch 12 --epochs 2 --json "$OUT/compare_ws2.jsonl" 2>&1 | tee "$OUT/compare_ws2.txt" | tail -30
echo "rc=${PIPESTATUS[0]}"
step "pytest -m gpu (all)"
timeout 240 python -m pytest -m gpu -q -p no:cacheprovider -rs --durations=10 $(printf -- "--deselect %s " $NEW) 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -25
step done

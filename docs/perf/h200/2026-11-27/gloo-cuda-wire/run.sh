#!/bin/bash
# gloo with CUDA tensors: the interface's count beside the computed bytes, sweeps of five collectives and a compare.
set -u
export PYTHONPATH=.
nvidia-smi -L
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k gloos_traffic > "$OUT/pytest_wire.txt" 2>&1; grep -E "^E  |passed|failed" "$OUT/pytest_wire.txt" | head -20

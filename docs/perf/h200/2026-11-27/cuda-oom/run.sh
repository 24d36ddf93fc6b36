#!/bin/bash
# pytest -m gpu at HEAD, the new tests among them.
set -u
export PYTHONPATH=.
nvidia-smi -L
timeout 330 python -m pytest -m gpu -q -p no:cacheprovider -rs 2>&1 | tail -6 | tee "$OUT/pytest_gpu.txt"

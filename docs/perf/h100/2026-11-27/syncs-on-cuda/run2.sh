#!/bin/bash
# The second call: the gpu-marked tests that run.sh's last step (cut at 240 s) had not reached.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 60 python -m pytest -m gpu -v -p no:cacheprovider -rs --durations=5 tests/test_kernels.py \
  tests/test_probes_nvml.py 2>&1 | tail -12 | tee $OUT/pytest_rest.txt
timeout 200 python -m pytest -v -p no:cacheprovider -rs --durations=5 \
  tests/test_gpu.py::test_gloos_traffic_with_cuda_tensors_is_counted_on_the_wire 2>&1 | tail -40 | tee $OUT/pytest_wire.txt

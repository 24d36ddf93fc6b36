#!/bin/bash
# GPU checks of the twenty-third session's fix: a resized input past the GPU, and CUDA's
# out-of-memory error in training, each one line and exit 2; the mutations each test must catch.
set -u
export PYTHONPATH=.
step() { echo; echo "=== $* ($(date +%T))"; }
K="resized_input_larger or activations_pass"
step "as committed"
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "$K" 2>&1 | tail -3 | tee "$OUT/pytest_new.txt"
m=/tmp/mut; rm -rf $m; cp -r . $m; cd $m; cp commbench/trainers/loop.py /tmp/loop_orig.py
step "mutation: no GPU check of the resized input"
sed -i 's/^        check_input_fits_gpu(config, device, world)$/        pass/' commbench/trainers/loop.py
grep -c "^        pass$" commbench/trainers/loop.py
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "resized_input_larger and given" 2>&1 | grep -E "^E  |passed|failed" | head -3
cp /tmp/loop_orig.py commbench/trainers/loop.py
step "mutation: CUDA's error not taken for a refusal"
sed -i 's/^        refuse_out_of_memory(config, batch, exc)$/        pass/' commbench/trainers/loop.py
grep -c "^        pass$" commbench/trainers/loop.py
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "activations_pass" 2>&1 | grep -E "^E  |passed|failed" | head -3
true
step done

#!/usr/bin/env bash
# The H200 run behind benchmarks/results/: decode benchmark, then the GPU tests (stream stress, ops, kernels).
# Run on the device machine from the repository root after `source .device/bootstrap.sh`; logs go to $OUT.
set -u
out=${OUT:-/tmp/dsv41_out}
mkdir -p "$out/results"
python3 -m dsv41.cli bench decode --layers 2,3,20,24 --batch "${BATCHES:-1,8,32,64}" --context 4096 \
  --out "$out/results" > "$out/bench_decode.log" 2>&1
echo "bench decode rc $?"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/streams tests/lowerings ${GPU_TESTS:-} > "$out/gpu_tests.log" 2>&1
echo "gpu tests rc $?"
tail -5 "$out/gpu_tests.log"
grep -v Warning "$out/bench_decode.log" | grep -v warn | tail -30

# The H200 run behind benchmarks/results/decode.*: `bash benchmarks/run_h200.sh` on the device machine.
# BATCHES (default 1,8,32,64), INDUCTOR_MODE (default: Inductor's default mode; max-autotune-no-cudagraphs trips a
# _grouped_mm device assert in its autotuning on torch 2.11), GPU_TESTS=1 to run the GPU tests afterwards.
source .device/bootstrap.sh >/dev/null 2>&1
export DSV41_CACHE_DIR=/tmp/dsv41-kernels
mkdir -p $OUT/results
timeout ${BENCH_TIMEOUT:-540} python3 -m dsv41.cli bench decode --layers 2,3,20,24 --batch ${BATCHES:-1,8,32,64} \
  --context 4096 --inductor-mode ${INDUCTOR_MODE:-default} --out $OUT/results > $OUT/bench_decode.log 2>&1
echo "bench rc $?"
grep "^\[bench\|^ *[0-9]\|^layers\|^batch\|^dsv41 step" $OUT/bench_decode.log | tail -40
if [ -n "${GPU_TESTS:-}" ]; then
  timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider tests/streams tests/kernels/test_backend_uses_kernels.py \
    > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc $?"; tail -5 $OUT/gpu_tests.log
fi

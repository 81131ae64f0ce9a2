# The H200 run behind benchmarks/results/decode.*: `bash benchmarks/run_h200.sh` on the device machine.
source .device/bootstrap.sh >/dev/null 2>&1
export DSV41_CACHE_DIR=/tmp/dsv41-kernels
mkdir -p $OUT/results
timeout 440 python3 -m dsv41.cli bench decode --layers 2,3,20,24 --batch ${BATCHES:-1,8} --context 4096 \
  --inductor-mode ${INDUCTOR_MODE:-default} --out $OUT/results > $OUT/bench_decode.log 2>&1
echo "bench rc $?"
grep "^\[bench\|^ *[0-9]\|^layers\|^batch\|^dsv41 step" $OUT/bench_decode.log | tail -40

# The H200 run for the side-stream schedule, on a 2-GPU machine (nvidia-h200-x2) in one call of under 10 minutes:
# run_h200.sh's decode benchmark at batch 1 and 8 (one GPU each) with streams on, off, and the mHC coefficients alone
# on a side stream (VARIANTS to change), then the stress tests (10,000 replays: streams vs the same kernels
# serialised, and vs streams off), inductor mode on GPU 0 and fx mode on GPU 1. Writes to $OUT: streams.json / .png,
# the replay traces, logs.tgz, stress_{inductor,fx}.log.
source .device/bootstrap.sh >/dev/null 2>&1
export DSV41_CACHE_DIR=/tmp/dsv41-kernels PYTHONUNBUFFERED=1
BATCH_GROUPS="1 8" TAG=streams BENCH_TIMEOUT=330 WORK=/tmp/bench_streams \
  VARIANTS=${VARIANTS:-dsv41,dsv41-nostreams,dsv41-streams=mhc_coeffs} bash benchmarks/run_h200.sh
gpu=0
for mode in inductor fx; do
  ( CUDA_VISIBLE_DEVICES=$gpu timeout $(( SECONDS < 530 ? 560 - SECONDS : 30 )) python3 -m pytest -q -s -m gpu \
      -p no:cacheprovider tests/streams/test_streams_gpu.py -k "$mode" > "$OUT/stress_$mode.log" 2>&1
    echo "exit $?" >> "$OUT/stress_$mode.log" ) &
  gpu=$((gpu + 1))
done
wait
for mode in inductor fx; do echo "-- stress $mode"; grep -E "streams on vs off|passed|failed|^E |exit" "$OUT/stress_$mode.log" | tail -6; done

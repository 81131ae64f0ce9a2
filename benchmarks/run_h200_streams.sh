# The H200 run for the side-stream schedule, on a 2-GPU machine (nvidia-h200-x2). PARTS (default "decode stress")
# picks what runs; the two parts together need about 15 minutes, so run them as two calls of under 10 minutes.
# - decode: run_h200.sh's decode benchmark at batch 1 and 8 (one GPU each) with streams on, off, and the mHC
#   coefficients alone on a side stream (VARIANTS to change). Writes streams.json / .png, the replay traces, logs.tgz.
# - stress: tests/streams/test_streams_gpu.py (10,000 replays: streams vs the same kernels serialised, and vs streams
#   off, and in inductor mode vs eager), one process per lane of STRESS_LANES (MODE:BUCKETS), all at once, dealt
#   round-robin over the GPUs (a GPU shared by two lanes only slows them). The inductor lanes split the captured
#   sizes in two. Writes stress_MODE_BUCKETS.log.
source .device/bootstrap.sh >/dev/null 2>&1
export DSV41_CACHE_DIR=/tmp/dsv41-kernels PYTHONUNBUFFERED=1
if [[ " ${PARTS:-decode stress} " == *" decode "* ]]; then
  BATCH_GROUPS="1 8" TAG=streams BENCH_TIMEOUT=330 WORK=/tmp/bench_streams \
    VARIANTS=${VARIANTS:-dsv41,dsv41-nostreams,dsv41-streams=mhc_coeffs} bash benchmarks/run_h200.sh
fi
if [[ " ${PARTS:-decode stress} " == *" stress "* ]]; then
  ngpu=$(nvidia-smi -L | wc -l)
  lanes=(${STRESS_LANES:-inductor:1,2 inductor:4,8 fx:1,2,4,8})
  for i in "${!lanes[@]}"; do
    mode=${lanes[i]%%:*} buckets=${lanes[i]#*:}
    log="$OUT/stress_${mode}_${buckets//,/-}.log"
    ( CUDA_VISIBLE_DEVICES=$((i % ngpu)) DSV41_STRESS_BUCKETS=$buckets timeout "${STRESS_TIMEOUT:-560}" \
        python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/streams/test_streams_gpu.py -k "$mode" > "$log" 2>&1
      echo "exit $?" >> "$log" ) &
  done
  wait
  for log in "$OUT"/stress_*.log; do
    echo "-- $log"; grep -E "compiled and captured|streams o[nf]f? vs|replays: relative|passed|failed|^E |exit" "$log" | tail -8
  done
fi

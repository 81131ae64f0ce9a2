# The H200 run for the side-stream schedule, on a 2-GPU machine (nvidia-h200-x2) in one call of under 10 minutes:
#   GPU 0: decode at batch 1, then the inductor-mode stress test (10,000 replays: streams vs the same kernels
#          serialised, and vs streams off);
#   GPU 1: decode at batch 8, then the fx-mode stress test.
# The decode variants: streams on, off, and the mHC coefficients alone on a side stream (VARIANTS to change). Writes to $OUT:
# streams.json / .png (merged), the replay traces, stress_{fx,inductor}.log, logs.tgz.
source .device/bootstrap.sh >/dev/null 2>&1
export DSV41_CACHE_DIR=/tmp/dsv41-kernels PYTHONUNBUFFERED=1
work=${WORK:-/tmp/bench_streams}
mkdir -p "$work"
python3 -m dsv41.cli precompile --config flash > "$work/precompile.log" 2>&1
variants=${VARIANTS:-dsv41,dsv41-nostreams,dsv41-streams=mhc_coeffs}  # about 70 s of compiling each
lane() {  # GPU, batch, stress mode
  CUDA_VISIBLE_DEVICES=$1 timeout 330 python3 -m dsv41.cli bench decode --layers 2,3,20,24 --batch "$2" --context 4096 \
    --variants "$variants" --out "$work" --tag "streams_b$2" > "$work/bench_b$2.log" 2>&1
  echo "exit $?" >> "$work/bench_b$2.log"
  CUDA_VISIBLE_DEVICES=$1 timeout $(( SECONDS < 530 ? 560 - SECONDS : 30 )) python3 -m pytest -q -s -m gpu -p no:cacheprovider \
    tests/streams/test_streams_gpu.py -k "$3" > "$OUT/stress_$3.log" 2>&1
  echo "exit $?" >> "$OUT/stress_$3.log"
}
lane 0 1 inductor &
lane 1 8 fx &
wait
for log in "$work"/bench_b*.log; do echo "-- $log"; grep "^\[bench\|^exit" "$log" | tail -10; done
for mode in inductor fx; do echo "-- stress $mode"; grep -E "streams on vs off|passed|failed|^E |exit" "$OUT/stress_$mode.log" | tail -6; done
python3 -m dsv41.cli bench decode --merge "$work"/streams_b1.json "$work"/streams_b8.json --out "$OUT" --tag streams
for trace in "$work"/streams_b*_trace_b*.json; do
  [ -f "$trace" ] && xz -T0 -c "$trace" > "$OUT/streams_trace_b${trace##*_trace_b}.xz"
done
tar czf "$OUT/logs.tgz" -C "$work" --exclude='*.json' --exclude='*.png' .

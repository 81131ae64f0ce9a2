# The H200 run behind benchmarks/results/decode.*: `bash benchmarks/run_h200.sh` on the device machine, writing to
# $OUT (decode.json, decode.png, the replayed-graph traces as .json.xz, logs.tgz).
# BATCH_GROUPS: batch-size groups run as separate processes, one GPU each, as many at a time as there are GPUs
# (default "1,32 8,64": two GPUs finish the four batch sizes in one call); the parts are merged into decode.json.
# VARIANTS (default: bench decode's four) and TAG (default decode: the names of the merged files), e.g. the stream
# branch study: BATCH_GROUPS="1 8" TAG=streams VARIANTS=dsv41,dsv41-nostreams,dsv41-streams=mhc_coeffs,...
# INDUCTOR_MODE (default: Inductor's default mode; max-autotune-no-cudagraphs trips a _grouped_mm device assert in
# its autotuning on torch 2.11).
source .device/bootstrap.sh >/dev/null 2>&1
export DSV41_CACHE_DIR=/tmp/dsv41-kernels PYTHONUNBUFFERED=1
work=${WORK:-/tmp/bench_decode}
mkdir -p "$work"
python3 -m dsv41.cli precompile --config flash > "$work/precompile.log" 2>&1
ngpu=$(nvidia-smi -L | wc -l)
i=0
for group in ${BATCH_GROUPS:-1,32 8,64}; do
  ( CUDA_VISIBLE_DEVICES=$((i % ngpu)) timeout "${BENCH_TIMEOUT:-560}" python3 -m dsv41.cli bench decode \
      --layers 2,3,20,24 --batch "$group" --context 4096 --inductor-mode "${INDUCTOR_MODE:-default}" --out "$work" \
      ${VARIANTS:+--variants "$VARIANTS"} --tag "decode_part$i" > "$work/bench_decode_part$i.log" 2>&1
    echo "exit $?" >> "$work/bench_decode_part$i.log" ) &
  i=$((i + 1))
  (( i % ngpu == 0 )) && wait
done
wait
for log in "$work"/bench_decode_part*.log; do echo "-- $log"; grep "^\[bench\|^exit" "$log" | tail -14; done
python3 -m dsv41.cli bench decode --merge "$work"/decode_part[0-9].json --out "$OUT" --tag "${TAG:-decode}"
for trace in "$work"/decode_part*_trace_b*.json; do
  [ -f "$trace" ] && xz -T0 -c "$trace" > "$OUT/${TAG:-decode}_trace_b${trace##*_trace_b}.xz"
done
tar czf "$OUT/logs.tgz" -C "$work" --exclude='*.json' --exclude='*.png' .

#!/bin/bash
# session 14, call B (after the session's merges): the GPU tests outside the indexer file (size specialisation,
# the lowerings' CUDA tests, streams, kernels in the backend, the MoE kernels' files) holding the GPU lock shared,
# beside two decode processes (layers 2,3,20,24, batch 1: Inductor + dsv41 at 4096, dsv41 at 524288; cold caches),
# whose measurements take the lock exclusively, so no timing overlaps the tests
set -u
source .device/bootstrap.sh >/dev/null 2>&1
export PYTHONUNBUFFERED=1
lock=/tmp/s14.gpu.lock; touch $lock
start=$SECONDS
mkdir -p $OUT/decode
(flock -s $lock timeout 260 python3 -m pytest -m gpu tests/backend/test_size_specialization.py tests/lowerings/test_cuda.py \
   tests/kernels/test_moe_experts.py tests/kernels/test_moe_finalize.py tests/streams/test_streams_gpu.py \
   tests/kernels/test_backend_uses_kernels.py -q -p no:cacheprovider -rfE > $OUT/gpu_tests.log 2>&1;
 echo "exit $? ($((SECONDS - start)) s)" >> $OUT/gpu_tests.log) &
sleep 5
bench() {  # NAME ARGS...
  local name=$1; shift
  mkdir -p /tmp/s14_$name
  TORCHINDUCTOR_CACHE_DIR=/tmp/s14_$name/inductor DSV41_CACHE_DIR=/tmp/s14_$name/kernels timeout 500 \
    python3 -m dsv41.cli bench decode --gpu-lock $lock --out $OUT/decode --tag truth_4layers_$name "$@" \
    > $OUT/decode/$name.log 2>&1
  echo "exit $? after $((SECONDS - start)) s" >> $OUT/decode/$name.log
}
bench b1_ctx4096_s14_final --layers 2,3,20,24 --batch 1 --context 4096 --variants inductor,dsv41 &
bench b1_ctx524288_s14_final --layers 2,3,20,24 --batch 1 --context 524288 --variants dsv41 --no-profile &
wait
grep -E "passed|failed|^FAILED|^ERROR|^exit" $OUT/gpu_tests.log | tail -8
for f in $OUT/decode/*.log; do echo "-- $f"; grep -v ": [0-9]* s$" $f | grep "^\[bench decode\|^exit\|^ *[0-9]* *\(inductor\|dsv41\)\|^batch\|Error" | tail -8; done
for t in $OUT/decode/*_trace_b*.json; do [ -f "$t" ] && xz -T0 "$t"; done

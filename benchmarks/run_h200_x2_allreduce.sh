#!/bin/bash
# The 2 x H200 run (nvidia-h200-x2) of the one-shot all-reduce + mHC kernel (dsv41.kernels.allreduce_mhc):
#   tests     the gpu (1 rank) and multi_gpu (2 ranks) tests of tests/kernels/test_allreduce_mhc.py (against NCCL + mhc_post_pre bit for bit,
#             T growing and shrinking, one rank delayed; the op's choice; CUDA-graph replay) and the stress test at
#             its suite size
#   memcheck  compute-sanitizer memcheck, then synccheck, on the 2-rank NCCL comparison (3 token counts) and replay
#   stress    tests/kernels/test_allreduce_mhc_stress.py (2 ranks) at STRESS_REPLAYS (default 1,000,000) replays; writes
#             stress.rank{0,1}.json (bad-word counts)
#   bench     `dsv41 bench kernels --op allreduce_mhc` (T = 1..64): allreduce_mhc.json
# From the repository root:
#   bash benchmarks/run_h200_x2_allreduce.sh OUT_DIR [STAGES]
# STAGES: comma-separated subset of tests,memcheck,stress,bench (default: all). Each stage runs under its own timeout;
# together they need more than one 10-minute call, so give one or two stages per call (e.g. "tests,memcheck", then
# "stress", then "bench"). Logs go to OUT_DIR; each ends with "exit N".
set -u
out=${1:?usage: run_h200_x2_allreduce.sh OUT_DIR [STAGES]}
stages=${2:-tests,memcheck,stress,bench}
source .device/bootstrap.sh >/dev/null 2>&1
export DSV41_CACHE_DIR=${DSV41_CACHE_DIR:-/tmp/dsv41-kernels} PYTHONUNBUFFERED=1
mkdir -p "$out"
start=$SECONDS
has() { [[ ",$stages," == *",$1,"* ]]; }
note() { echo "== $1 ($((SECONDS - start)) s)"; }
summary() { echo "-- $1"; grep -E "SUMMARY|ERROR SUMMARY|passed|failed|^FAILED|^E |stress rank|speedup|^attention|^moe|^exit" \
  "$out/$1.log" | tail -"${2:-12}"; }
pytest_mg() { python3 -m pytest -q -s -p no:cacheprovider -m "gpu or multi_gpu" "$@"; }
# --report-api-errors no: cuda-python's driver probes are API errors, not memory errors (benchmarks/device_kernels.sh)
sanitize() { compute-sanitizer --tool "$1" --report-api-errors no --target-processes all python3 -m pytest -q -s \
  -p no:cacheprovider -m multi_gpu tests/kernels/test_allreduce_mhc.py -k "2ranks and (matches_nccl or captured)"; }

nvidia-smi topo -m > "$out/topology.log" 2>&1
if has tests; then
  note "tests"
  timeout 300 bash -c "$(declare -f pytest_mg); pytest_mg tests/kernels/test_allreduce_mhc.py \
    tests/kernels/test_allreduce_mhc_stress.py" > "$out/tests.log" 2>&1
  echo "exit $?" >> "$out/tests.log"; summary tests
fi
if has memcheck; then
  for tool in memcheck synccheck; do
    note "$tool"
    DSV41_TEST_TOKENS=1,64,3 timeout 270 bash -c "$(declare -f sanitize); sanitize $tool" > "$out/$tool.log" 2>&1
    echo "exit $?" >> "$out/$tool.log"; summary "$tool"
  done
fi
if has stress; then
  note "stress"
  DSV41_ALLREDUCE_STRESS_REPLAYS=${STRESS_REPLAYS:-1000000} DSV41_ALLREDUCE_STRESS_JSON="$out/stress" \
    timeout "${STRESS_TIMEOUT:-560}" bash -c "$(declare -f pytest_mg); pytest_mg \
    tests/kernels/test_allreduce_mhc_stress.py -k 2ranks" > "$out/stress.log" 2>&1
  echo "exit $?" >> "$out/stress.log"; summary stress
fi
if has bench; then
  note "bench"
  timeout "${BENCH_TIMEOUT:-500}" python3 -c "import sys; from dsv41.tools.bench_kernels import main; \
    sys.exit(main(sys.argv[1:]))" --op allreduce_mhc --tokens 1,2,4,8,16,32,64 --out "$out" > "$out/bench.log" 2>&1
  echo "exit $?" >> "$out/bench.log"; summary bench 20
fi
note done

#!/bin/bash
# The H200 run behind benchmarks/results/kernels.{json,png} and post_pre_layouts.json: mhc_post_pre's launch layouts
# timed (alone), the kernels' GPU tests with compute-sanitizer memcheck and racecheck on them (the three side by
# side: they barely load the GPU), then `dsv41 bench kernels` alone.
# From the repository root, after `source .device/bootstrap.sh`:
#   bash benchmarks/device_kernels.sh OUT_DIR [STAGES] [BENCH_ARGS...]
# STAGES: comma-separated subset of layouts,tests,memcheck,racecheck,bench (default: all). Logs go to OUT_DIR.
# KERNEL_TESTS: the test files (default tests/kernels: more than 330 s on the H200 beside the sanitizers, 2026-12-01);
# SANITIZE_K: the -k expression the sanitizers run (default the reference and graph-replay tests);
# CHECK_TIMEOUT: each check's limit in seconds (default 360).
set -u
tests=${KERNEL_TESTS:-tests/kernels}
select=${SANITIZE_K:-matches_reference or graph or pdl}
limit=${CHECK_TIMEOUT:-360}
out=${1:?usage: device_kernels.sh OUT_DIR [STAGES] [BENCH_ARGS...]}
stages=${2:-layouts,tests,memcheck,racecheck,bench}
shift $(( $# < 2 ? $# : 2 ))
export DSV41_CACHE_DIR=${DSV41_CACHE_DIR:-/tmp/dsv41-kernels}
start=$SECONDS
has() { [[ ",$stages," == *",$1,"* ]]; }
note() { echo "== $1 ($((SECONDS - start)) s)"; }
gpu_pytest() { python3 -m pytest -m gpu $tests -q -p no:cacheprovider -rfE "$@"; }
# --report-api-errors no: cuda-python probes driver entry points with cuGetProcAddress, and each probe the driver
# lacks is an API error (34 of them on the H200's driver 580), not a memory error of a kernel
sanitize() { compute-sanitizer --tool "$1" --report-api-errors no --target-processes all python3 -m pytest -m gpu \
  $tests -q -p no:cacheprovider -k "$2"; }

bench() { timeout "$1" python3 -c "import sys; from dsv41.tools.bench_kernels import main; sys.exit(main(sys.argv[1:]))" \
  --out "$out" "${@:2}"; }

if has layouts; then
  note "layouts"
  bench 120 --post-pre-layouts > "$out/layouts.log" 2>&1; echo "exit $?" >> "$out/layouts.log"; tail -10 "$out/layouts.log"
fi
note "checks"
export tests
has tests && { timeout $limit bash -c "$(declare -f gpu_pytest); gpu_pytest" > "$out/gpu_tests.log" 2>&1;
               echo "exit $?" >> "$out/gpu_tests.log"; } &
has memcheck && { DSV41_TEST_TOKENS=1,31 DSV41_TEST_MAX_COLUMNS=65536 DSV41_TEST_REPLAYS=2 timeout $limit bash -c \
               "$(declare -f sanitize); sanitize memcheck '$select'" > "$out/memcheck.log" 2>&1
               echo "exit $?" >> "$out/memcheck.log"; } &
has racecheck && { DSV41_TEST_TOKENS=3,64 DSV41_TEST_MAX_COLUMNS=65536 DSV41_TEST_REPLAYS=2 timeout $limit bash -c \
               "$(declare -f sanitize); sanitize racecheck 'matches_reference'" > "$out/racecheck.log" 2>&1
               echo "exit $?" >> "$out/racecheck.log"; } &
wait
for log in gpu_tests memcheck racecheck; do
  [ -f "$out/$log.log" ] && { echo "-- $log"; grep -E "SUMMARY|passed|failed|^FAILED|^exit" "$out/$log.log" | tail -8; }
done
if has bench; then
  note "bench"
  bench 330 "$@" > "$out/bench.log" 2>&1
  echo "exit $?" >> "$out/bench.log"; tail -22 "$out/bench.log"
fi
note done

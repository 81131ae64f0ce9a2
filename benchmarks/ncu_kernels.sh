#!/bin/bash
# Nsight Compute profiles of the CuTe DSL kernels at Flash's decode sizes, to say where a kernel's time goes (its
# fixed cost against its memory floor): `dsv41 bench kernels --profiler-launches` launches each kernel once per T
# between cudaProfilerStart/Stop after a warm-up, and ncu (--profile-from-start off, caches flushed) profiles exactly
# those launches with the full section set. From the repository root, after `source .device/bootstrap.sh`:
#   bash benchmarks/ncu_kernels.sh OUT_DIR [BENCH_ARGS...]     e.g. --op mhc_coeffs --tokens 1,16
# Writes OUT_DIR/kernels.ncu-rep (open it in ncu-ui), summary.csv (per launch: duration, DRAM and SM throughput,
# grid, block, registers, achieved occupancy) and details.txt (speed of light, warp-state and launch sections).
set -u
out=${1:?usage: ncu_kernels.sh OUT_DIR [BENCH_ARGS...]}
shift
mkdir -p "$out"
export DSV41_CACHE_DIR=${DSV41_CACHE_DIR:-/tmp/dsv41-kernels}
ncu --profile-from-start off --set full --import-source no -f -o "$out/kernels" \
  python3 -m dsv41.cli bench kernels --profiler-launches "$@" > "$out/ncu.log" 2>&1
echo "ncu exit $?" >> "$out/ncu.log"
tail -5 "$out/ncu.log"
[ -f "$out/kernels.ncu-rep" ] || exit 1
ncu --import "$out/kernels.ncu-rep" --page raw --csv --metrics gpu__time_duration.sum,\
gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,\
gpc__cycles_elapsed.max,sm__cycles_active.avg,launch__grid_size,launch__block_size,launch__registers_per_thread,\
sm__warps_active.avg.pct_of_peak_sustained_active > "$out/summary.csv"
ncu --import "$out/kernels.ncu-rep" --page details --section SpeedOfLight --section WarpStateStats \
  --section LaunchStats > "$out/details.txt"
# active / elapsed: the share of the kernel's cycles an average SM works; a small share with a short grid is a
# serial tail (a last CTA's epilogue, a ticket chain), not bandwidth
python3 - "$out/summary.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
units = rows[0]  # the row after the header: each metric's unit


def num(r, metric):  # a metric this ncu did not report prints as nan
    text = r.get(metric, "")
    return float(text.replace(",", "")) if text else float("nan")


print(f"{'kernel':<44}{'us':>9}{'dram %':>8}{'sm %':>7}{'active/elapsed':>16}{'grid':>8}{'block':>7}{'regs':>6}"
      f"{'occ %':>7}")
for r in rows[1:]:
    name = r["Kernel Name"].replace("kernel_cutlass_kernel_dsv41kernels", "")[:43]
    scale = 1e-3 if units["gpu__time_duration.sum"] == "nsecond" else 1.0
    cycles = f"{num(r, 'sm__cycles_active.avg'):.0f}/{num(r, 'gpc__cycles_elapsed.max'):.0f}"
    print(f"{name:<44}{num(r, 'gpu__time_duration.sum') * scale:>9.2f}"
          f"{num(r, 'gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed'):>8.1f}"
          f"{num(r, 'sm__throughput.avg.pct_of_peak_sustained_elapsed'):>7.1f}{cycles:>16}{r['launch__grid_size']:>8}"
          f"{r['launch__block_size']:>7}{r['launch__registers_per_thread']:>6}"
          f"{num(r, 'sm__warps_active.avg.pct_of_peak_sustained_active'):>7.1f}")
PY

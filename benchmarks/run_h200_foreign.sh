#!/bin/bash
# The device run behind benchmarks/results/foreign.*: `bash benchmarks/run_h200_foreign.sh` on the device machine
# (one GPU, H200 or H100), writing foreign.json, foreign.png and foreign.log to $OUT. One process runs
# `dsv41 bench foreign` at Flash sizes (batch 1, 4096 index-key rows) over the blocks of $BLOCKS in order: each block
# is built on the GPU (~27.5 GB of parameters; by arithmetic the draws peak near 72 GB while the routed experts'
# fp32 values are drawn and scaled, within an H100's 80 GB), run eagerly, then compiled cold by plain Inductor and by dsv41 (fresh cache directories per variant),
# profiled, captured in a CUDA graph and replayed $REPLAYS times, and freed before the next.
#   BLOCKS   default export,megatron,ref,jax,sglang: blocks that on the CPU (TINY sizes, 2026-12-07) compiled without
#            a fallback and that can run on a GPU. hf, module, titan and vllm create tensors without naming a device
#            (torch.arange / torch.zeros in forward), so on a GPU the bench runs them under torch.device('cuda'), where
#            Dynamo (torch 2.13 on the CPU image) cannot trace Tensor.unflatten: name them to see whether that holds
#            here. gptfast, export_gathered and tutorial fell back to plain Inductor on the CPU (int64 offsets into
#            dsv41::moe_experts in the default mode); libfn is listed as not built (its sizes are module constants).
#   REPLAYS  default 100 timed replays per variant (~0.1 s at Flash sizes; the compiles are the cost).
#   BENCH_TIMEOUT  default 450: the bench process's limit; it starts no block that the longest block so far would
#            carry past BENCH_TIMEOUT - 30 s (--budget-s; such blocks are listed as not run), so with the bootstrap
#            (~30 s on a fresh machine) and the copies the call ends well inside the device's 600 s per command.
# Budget, estimated (nothing measured on a GPU yet): Inductor ~20 s per cold Flash block, dsv41 longer (its passes,
# Inductor, and the CuTe kernels the first block compiles), so ~60-100 s a block: about 4-5 of the default blocks.
# $OUT gets the JSON, plot and log, refreshed every 30 s so that a call cut short still brings back what was measured
# (the bench rewrites its JSON and plot after each block); the log's last lines, the table, are printed at the end.
source .device/bootstrap.sh >/dev/null 2>&1
export PYTHONUNBUFFERED=1
work=/tmp/foreign
rm -rf "$work" && mkdir -p "$work/out"
blocks=${BLOCKS:-export,megatron,ref,jax,sglang}
replays=${REPLAYS:-100}
limit=${BENCH_TIMEOUT:-450}
start=$SECONDS
pack() { for f in "$work"/out/foreign*.json "$work"/out/foreign*.png "$work"/out/foreign.log; do
  [ -f "$f" ] && cp "$f" "$OUT/"; done; }
( while sleep 30; do pack; done ) & packer=$!

echo "[run_h200_foreign] bench foreign: blocks $blocks, $replays replays, limit $limit s"
# one process a block: a block's parameters and compiled graphs are gone with its process (in one process the
# first Flash block's 26 GiB stayed allocated and the next build ran out of an H100's memory)
for block in ${blocks//,/ }; do
  left=$((limit - (SECONDS - start)))
  [ "$left" -gt 60 ] || { echo "$block: not run (no time left)" >> "$work/out/foreign.log"; continue; }
  TORCHINDUCTOR_CACHE_DIR=$work/inductor_$block DSV41_CACHE_DIR=$work/kernels timeout "$left" \
    python3 -m dsv41.cli bench foreign --sizes flash --device cuda --blocks "$block" --replays "$replays" \
    --budget-s $((left - 10)) --out "$work/out" --tag "foreign_$block" >> "$work/out/foreign.log" 2>&1
  echo "$block: exit $? after $((SECONDS - start)) s" >> "$work/out/foreign.log"
done
kill $packer; pack
grep "^\[bench foreign" "$work/out/foreign.log" | grep -v ": [0-9]* s$"
sed -n '/^foreign blocks at /,$p' "$work/out/foreign.log"
tail -3 "$work/out/foreign.log"
ls -la "$OUT"

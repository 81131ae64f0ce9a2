#!/bin/bash
# The device call behind benchmarks/results/kernels_s18_qkv_norm_h100.json and foreign_s18/foreign_export_h100.*:
# `bash benchmarks/run_h200_qkv_norm_foreign.sh` on the device machine (one GPU). The qkv_norm kernel's GPU tests
# with moe_experts' (they share the FP8 helper), the CUDA lowering and backend kernel tests (logs under $OUT/logs),
# then `dsv41 bench kernels --op qkv_norm` (120 s at most) and `benchmarks/run_h200_foreign.sh` over $BLOCKS
# (default export,trtllm) with the rest of a 545 s budget.
source .device/bootstrap.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
start=$SECONDS
timeout 200 python3 -m pytest -q -x tests/kernels/test_qkv_norm.py tests/kernels/test_moe_experts.py tests/lowerings/test_cuda.py tests/kernels/test_backend_uses_kernels.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$? in $((SECONDS-start)) s"; tail -15 $OUT/logs/gpu_tests.log | grep -E "passed|failed|Error|assert" | head -12
timeout 120 python3 -m dsv41.cli bench kernels --op qkv_norm --tokens 1,2,4,8,16,64 --out $OUT/kernels > $OUT/logs/bench_kernels.log 2>&1
echo "bench kernels rc=$? at $((SECONDS-start)) s"; tail -12 $OUT/logs/bench_kernels.log
left=$((545 - SECONDS))
BLOCKS=${BLOCKS:-export,trtllm} BENCH_TIMEOUT=$left bash benchmarks/run_h200_foreign.sh 2>&1 | tail -12

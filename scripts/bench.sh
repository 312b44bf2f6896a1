#!/usr/bin/env bash
# bench.sh -- GPU benchmarks (run by `make bench` from the build directory, or
# by hand: scripts/bench.sh [build dir]). Prints markdown tables for
# docs/PERF.md. Needs one GPU; exits 77 without one.
#   BENCH_ARGS  extra arguments for bench_moe_compute (e.g. "--M 256,1024")
set -euo pipefail
build=${1:-${MEGAMOE_BUILDDIR:-$PWD}}
export LD_LIBRARY_PATH=${CUDA_LIBDIR:-/usr/local/cuda/lib64}:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench: no GPU"; exit 77
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
date -u +"# %Y-%m-%d %H:%M UTC"

## Fused expert compute (one EP8 rank of GLM-5: E_loc 32, H 6144, I 2048)
b="$build/kernels/bench_moe_compute"
if [ -x "$b" ]; then
  for args in "--gran-k 32" "--gran-k 32 --compute bf16-exact" "--gran-k 16 --compute bf16-exact" \
    "--gran-k 16 --compute fp8"; do
    echo "## bench_moe_compute $args ${BENCH_ARGS:-}"
    # shellcheck disable=SC2086
    "$b" $args ${BENCH_ARGS:-}
  done
fi

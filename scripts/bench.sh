#!/usr/bin/env bash
# bench.sh -- GPU benchmarks (run by `make bench` from the build directory, or
# by hand: scripts/bench.sh [build dir]). Prints markdown tables for
# docs/PERF.md. Needs a GPU; exits 77 without one. Uses every visible GPU
# for the expert-parallel parts.
#   BENCH_ARGS     extra arguments for bench_moe_compute (e.g. "--M 256,1024", or
#                  "--warmup-ms 1500" for the sustained state, where the H200 runs
#                  at its power cap: docs/PERF.md, version 17)
#   BENCH_SUSTAINED=0  skip the sustained prefill rows (M = 32768 after 1.5 s of
#                  warm-up per measurement, every mode)
#   BENCH_PROBE=0  skip the prefill-structure probe (kernels/bench_prefill_probe)
#   BENCH_EP_ARGS  arguments for bench_ep (default: --tokens 4096 --ll-tokens 1,32,128)
#   BENCH_LAYER=0  skip the whole-layer run (it synthesizes a 5.4 GB GLM-5 layer
#                  in BENCH_WORK, default a temp dir, unless BENCH_LAYER_CKPT names one)
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
  # Mode 1's prefill path (the default from mm_sm90_prefill_min_rows rows per
  # expert) against the WGMMA kernels at the same shapes (docs/PERF.md,
  # version 21)
  echo "## bench_moe_compute --gran-k 32 --path wgmma --M 24576,32768,65536 --loads uniform"
  "$b" --gran-k 32 --path wgmma --M 24576,32768,65536 --loads uniform
  # Each FP8 mode's two paths around its prefill threshold, sustained, ours
  # only (the thresholds' measurement: docs/PERF.md, version 26).
  # MEGAMOE_SM90_PREFILL=1: the workspace holds the prefill region below the
  # threshold too.
  for gm in "32 24576,28672,32768" "16 12288,14336,16384"; do
    set -- $gm
    for p in prefill wgmma; do
      echo "## bench_moe_compute --gran-k $1 --path $p --profile-only --warmup-ms 1000 --M $2 --loads uniform,random"
      MEGAMOE_SM90_PREFILL=1 "$b" --gran-k "$1" --path $p --profile-only --iters 20 --warmup-ms 1000 \
        --M "$2" --loads uniform,random
    done
  done
  # Prefill in the sustained state: each measurement (ceilings included) runs
  # 1.5 s first, so that ours and cuBLASLt both run at the power cap
  # (docs/PERF.md, version 17). BENCH_SUSTAINED=0 skips it.
  if [ "${BENCH_SUSTAINED:-1}" != 0 ]; then
    for args in "--gran-k 32" "--gran-k 32 --compute bf16-exact" "--gran-k 16 --compute bf16-exact" \
      "--gran-k 16 --compute fp8"; do
      echo "## bench_moe_compute $args --warmup-ms 1500 --M 32768 --loads uniform (sustained)"
      # shellcheck disable=SC2086
      "$b" $args --warmup-ms 1500 --M 32768 --loads uniform
    done
    echo "## bench_moe_compute --gran-k 32 --path wgmma --warmup-ms 1500 --M 32768 --loads uniform (sustained)"
    "$b" --gran-k 32 --path wgmma --warmup-ms 1500 --M 32768 --loads uniform
    # the prefill path with 32 experts per launch pair (compute.prefill-experts;
    # the default is 16: half the workspace, docs/PERF.md, version 22)
    echo "## bench_moe_compute --gran-k 32 --prefill-experts 32 --warmup-ms 1500 --M 32768 --loads uniform (sustained)"
    "$b" --gran-k 32 --prefill-experts 32 --warmup-ms 1500 --M 32768 --loads uniform
  fi
fi

## The prefill-structure probe (docs/PERF.md, version 20): tokens as the A
## operand, weights decoded from FP4 inside the GEMM kernel, against cuBLASLt.
## BENCH_PROBE=0 skips it.
b="$build/kernels/bench_prefill_probe"
if [ "${BENCH_PROBE:-1}" != 0 ] && [ -x "$b" ]; then
  echo "## bench_prefill_probe"
  "$b"
fi

## Weight preparation on the GPU and the CPU load path
for b in "$build/bench/bench_prep" "$build/bench/bench_pack_sm90" "$build/bench/bench_load"; do
  if [ -x "$b" ]; then echo "## $(basename "$b")"; "$b"; fi
done

## Dispatch / combine (every visible GPU, both low-latency transports) beside a
## plain same-bytes NCCL all-to-all
b="$build/tests/bench_ep"
if [ -x "$b" ]; then
  echo "## bench_ep ${BENCH_EP_ARGS:---tokens 4096 --ll-tokens 1,32,128}"
  # shellcheck disable=SC2086
  "$b" ${BENCH_EP_ARGS:---tokens 4096 --ll-tokens 1,32,128}
fi

## Whole layer through the plugin ABI (megamoe-host, ep-size = visible GPUs)
if [ "${BENCH_LAYER:-1}" != 0 ] && [ -x "$build/host/megamoe-host" ]; then
  ck=${BENCH_LAYER_CKPT:-}
  if [ -z "$ck" ]; then
    work=${BENCH_WORK:-$(mktemp -d)}
    ck=$work/ckpt
    [ -e "$ck" ] || "$build/host/megamoe-synth" --out "$ck" --layers 1 --hidden 6144 \
      --intermediate 2048 --experts 256 --format nvfp4 --seed 7 --fast
  fi
  src=$(cd "$(dirname "$0")/.." && pwd)
  plugin=$build/plugin/.libs/libmegamoe_plugin.so
  for policy in none group16-to-group32; do
    echo "## whole layer, requant $policy"
    "$build/host/megamoe-host" --plugin "$plugin" --config "$src/conf/megamoe.yaml" \
      --checkpoint "$ck" --set requant.policy=$policy --set model.hidden-size=6144 \
      --set model.moe-intermediate-size=2048 --set model.num-experts=256 --set model.top-k=8 \
      --set num-max-tokens-per-rank=8192 --tokens 8,128,1024,8192 --iters 20 --warmup 3 \
      --check-tokens 4 2>&1 | grep -E 'phases|PASS|FAIL' || true
  done
  if [ -z "${BENCH_LAYER_CKPT:-}" ] && [ -z "${BENCH_WORK:-}" ]; then rm -rf "$work"; fi
fi

#!/usr/bin/env bash
# device_ep.sh -- the expert-parallel GPU checks and timings in one device run.
# Expects, next to it (copied by the caller into .dev/ep/): gpu_test_ep, bench_ep,
# libyaml-0.so.2, libuv.so.1. Logs go to $OUT (or ./out). Usage on the device:
#   cd .dev/ep && ./device_ep.sh [quick]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
export LD_LIBRARY_PATH="$here:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
echo "== gpu_test_ep"
timeout 80 "$here/gpu_test_ep" 2>&1 | tee "$out/gpu_test_ep.log" | grep -vE '^ok ' | tail -40
grep -cE '^ok ' "$out/gpu_test_ep.log" | sed 's/^/ok cases: /'
echo "== bench_ep"
timeout 60 "$here/bench_ep" --iters 20 2>&1 | tee "$out/bench_ep.log"
if [ "${1:-}" != quick ] && command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer (memcheck) on the engine tests"
  MEGAMOE_EP_TEST_ONLY=engine timeout 60 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    "$here/gpu_test_ep" >"$out/memcheck.log" 2>&1
  echo "memcheck rc $?"; grep -E 'ERROR SUMMARY|Invalid|not ok' "$out/memcheck.log" | head -10
fi

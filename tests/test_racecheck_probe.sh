#!/bin/sh
# scripts/racecheck_probe.cu (the racecheck false-positive reproducer that
# docs/RELIABILITY.md cites) still builds for sm_90a, and refuses bad
# arguments before it touches a GPU. Running it needs a GPU and
# compute-sanitizer (scripts/gpu_suite.sh's sanitizer step). Skips without nvcc.
. "${MEGAMOE_SRCDIR:-$(dirname "$0")/..}/tests/tap.sh"
nvcc=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
if [ ! -x "$nvcc" ]; then
  echo "1..0 # SKIP no nvcc"
  exit 0
fi
tap_start 3 "$s/scripts/racecheck_probe.cu"
tap_show=$dir/log
"$nvcc" -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o "$dir/probe" \
  "$s/scripts/racecheck_probe.cu" >"$dir/log" 2>&1
check "racecheck_probe.cu builds for sm_90a" $?
"$dir/probe" 32 >"$dir/log" 2>&1
rc=$?
check "a flag mask past 31 is refused with usage (exit $rc)" $([ $rc = 2 ] && grep -q usage "$dir/log" && echo 0 || echo 1)
"$dir/probe" 16 0 >"$dir/log" 2>&1
rc=$?
check "zero units are refused with usage (exit $rc)" $([ $rc = 2 ] && grep -q usage "$dir/log" && echo 0 || echo 1)

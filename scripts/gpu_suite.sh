#!/usr/bin/env bash
# gpu_suite.sh -- everything that needs a GPU, in one call (the device lease
# is short): GPU tests, compute-sanitizer on them (optional), the end-to-end
# smoke run and the benchmarks, from a build made elsewhere.
#
#   scripts/gpu_suite.sh PACK_DIR [OUT_DIR]
#
# PACK_DIR is made by `scripts/gpu_pack.sh` on the build machine: the build's
# binaries (tests/, host/, plugin .so, bench programs), libyaml/libuv, the
# golden vectors. Prints a summary table last; full logs go to OUT_DIR.
#   GPU_SUITE_STEPS="tests sanitizer e2e bench"   which steps to run
#   GPU_SUITE_TESTS=GLOB   test binaries to run (default gpu_test_*; "*" for all)
set -uo pipefail
pack=$(cd "${1:?usage: gpu_suite.sh PACK_DIR [OUT_DIR]}" && pwd)
out=${2:-${OUT:-/tmp/gpu_suite}}
mkdir -p "$out"
src=$(cd "$(dirname "$0")/.." && pwd)
steps=${GPU_SUITE_STEPS:-tests e2e bench}
export LD_LIBRARY_PATH="$pack/lib:${LD_LIBRARY_PATH:-}"
export MEGAMOE_BUILDDIR=$pack MEGAMOE_SRCDIR=$src MEGAMOE_GOLDEN_DIR=$pack/golden
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
rows=()
row() { rows+=("$(printf '%-40s %s' "$1" "$2")"); }

nvidia-smi -L 2>&1 | tee "$out/gpus.txt" || true
if [[ " $steps " == *" tests "* ]]; then
  for t in "$pack"/tests/${GPU_SUITE_TESTS:-gpu_test_*}; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    start=$(date +%s)
    timeout 300 "$t" >"$out/$name.log" 2>&1
    rc=$?
    secs=$(($(date +%s) - start))
    okc=$(grep -c '^ok ' "$out/$name.log")
    bad=$(grep -c '^not ok' "$out/$name.log")
    skip=$(grep -c '# SKIP' "$out/$name.log")
    row "$name" "rc=$rc ok=$okc not_ok=$bad skip=$skip ${secs}s"
    [ "$bad" -gt 0 ] || [ $rc -ne 0 ] && grep -E '^(not ok|#)' "$out/$name.log" | head -20
  done
fi
if [[ " $steps " == *" sanitizer "* ]]; then
  for t in "$pack"/tests/gpu_test_*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    for tool in memcheck racecheck; do
      timeout 400 compute-sanitizer --tool $tool --error-exitcode 99 "$t" >"$out/$name.$tool.log" 2>&1
      row "$name ($tool)" "rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$name.$tool.log" | tail -1)"
    done
  done
fi
if [[ " $steps " == *" e2e "* ]]; then
  E2E_PREBUILT=$pack E2E_WORK=/tmp/e2e timeout 900 "$src/scripts/e2e_smoke.sh" 2>&1 | tee "$out/e2e.log" | tail -12
  row "e2e_smoke" "$(tail -1 "$out/e2e.log")"
fi
if [[ " $steps " == *" bench "* ]]; then
  for b in "$pack"/bench/*; do
    [ -x "$b" ] || continue
    name=$(basename "$b")
    timeout 400 "$b" >"$out/$name.log" 2>&1
    row "$name" "rc=$? (see $name.log)"
    tail -30 "$out/$name.log"
  done
fi
echo
echo "==== gpu_suite summary ===="
printf '%s\n' "${rows[@]}"

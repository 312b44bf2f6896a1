#!/usr/bin/env bash
# gpu_kernels_check.sh -- device-side checks of the sm90 expert compute, run
# from a folder holding the built binaries (copied from build/tests and
# build/kernels): the GPU test, optionally under compute-sanitizer, the SASS
# instruction check and the benchmark. Logs go to $OUT (or ./out).
#   scripts/gpu_kernels_check.sh test sass sanitize bench [bench args...]
set -u
out=${OUT:-$PWD/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
status=0
step() { echo "== $*"; }
while [ $# -gt 0 ]; do
  what=$1; shift
  case $what in
    test)
      step "gpu_test_moe_compute"
      timeout 150 ./gpu_test_moe_compute > "$out/test.log" 2>&1; rc=$?
      grep -E "^(ok|not ok|#.*(rel|seed|wgmma|fold|CHECK|fail))" "$out/test.log" | head -80
      echo "rc=$rc"; [ $rc = 0 ] || status=1 ;;
    sass)
      step "SASS instruction mix (wgmma kernels)"
      cuobjdump -sass ./gpu_test_moe_compute > "$out/sass.txt" 2>&1
      grep -oE "\b(QGMMA|HGMMA|LDL|STL)[.A-Z0-9x]*" "$out/sass.txt" | sort | uniq -c ;;
    sanitize)
      for tool in memcheck racecheck; do
        step "compute-sanitizer $tool"
        MEGAMOE_TEST_QUICK=1 timeout 400 compute-sanitizer --tool $tool --error-exitcode 9 \
          ./gpu_test_moe_compute > "$out/sanitize_$tool.log" 2>&1; rc=$?
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^not ok|Invalid|Race" "$out/sanitize_$tool.log" | sort | uniq -c | head -20
        echo "rc=$rc"; [ $rc = 0 ] || status=1
      done ;;
    bench)
      step "bench_moe_compute $*"
      timeout 240 ./bench_moe_compute "$@" 2>&1 | tee "$out/bench.log"
      shift $# ;;
    *) echo "unknown step $what"; status=2 ;;
  esac
done
exit $status

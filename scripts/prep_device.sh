#!/bin/sh
# prep_device.sh -- weight-preparation checks and benchmark on a GPU machine.
# Run from a folder holding gpu_test_prep, bench_prep, golden/ (a copy of
# ../shared/golden) and the shared libraries the machine lacks:
#   cd .dev/prep && OUT=/some/dir sh prep_device.sh
# Prints a short table last; full logs go to $OUT.
set -u
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
out=${OUT:-$here/out}
mkdir -p "$out"
export LD_LIBRARY_PATH="$here${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MEGAMOE_GOLDEN_DIR="$here/golden"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
./gpu_test_prep >"$out/gpu_test_prep.log" 2>&1
echo "gpu_test_prep rc=$?"
grep -E '^(ok|not ok)|GPU|CHECK|failed' "$out/gpu_test_prep.log" | head -40
timeout 60 compute-sanitizer --tool memcheck --print-limit 5 ./gpu_test_prep \
  >"$out/memcheck.log" 2>&1
echo "memcheck rc=$? (124 = timed out)"
grep -E 'ERROR SUMMARY|Invalid|not ok' "$out/memcheck.log" | head -10
./bench_prep --reps 30 2>&1 | tee "$out/bench_prep.txt"
./bench_prep --reps 30 --experts 8 2>&1 | tail -8 | tee "$out/bench_prep_e8.txt"

#!/usr/bin/env bash
# check.sh -- the test command: bootstrap (installs missing packages, builds),
# `make check` on the main build (CUDA when the toolkit is present; GPU tests
# skip without a GPU), then the host-side code again under
# -fsanitize=address,undefined (CPU-only build) with its `make check`.
# Ends with "N passed, N failed, N skipped" over both builds.
#   CHECK_SANITIZERS=0  skip the sanitizer build
#   CHECK_DISTCHECK=1   also run `make distcheck` (always on in CI)
set -uo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
jobs=${JOBS:-$(nproc)}
status=0

run_suite() { # build_dir
  local dir=$1
  echo "check: make check in $dir"
  if ! make -C "$dir" -j"$jobs" check >"$dir/check.log" 2>&1; then
    status=1
    grep -E '^(FAIL|ERROR|XPASS)' "$dir/check.log" | head -40
    for f in $(grep -lE '^(not ok|Bail out)' $(find "$dir/tests" -name '*.log' 2>/dev/null) 2>/dev/null); do
      echo "---- $f"; grep -E '^(not ok|#)' "$f" | head -30
    done
  fi
  grep -E '^# (TOTAL|PASS|SKIP|XFAIL|FAIL|XPASS|ERROR):' "$dir/check.log" | sed "s|^|  |"
}

BUILD_DIR="$src/build" "$src/scripts/bootstrap.sh" || exit 1
run_suite "$src/build"
if [ "${CHECK_SANITIZERS:-1}" != 0 ]; then
  BUILD_DIR="$src/build-asan" "$src/scripts/bootstrap.sh" --without-cuda --enable-sanitizers \
    CFLAGS="-O1 -g" || exit 1
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 run_suite "$src/build-asan"
fi

# The release tarball builds and passes its own tests (CI, or on request).
if [ "${CI:-}" = true ] || [ "${CHECK_DISTCHECK:-0}" = 1 ]; then
  echo "check: make distcheck"
  if ! make -C "$src/build" -j"$jobs" distcheck >"$src/build/distcheck.log" 2>&1; then
    status=1
    tail -30 "$src/build/distcheck.log"
    echo "check: make distcheck FAILED"
  fi
fi

# One closing line over every build that ran.
awk '/^# PASS:/ {p+=$3} /^# SKIP:/ {s+=$3} /^# (FAIL|XPASS|ERROR):/ {f+=$3}
     END {printf "%d passed, %d failed, %d skipped\n", p, f, s}' \
  "$src/build/check.log" $( [ -f "$src/build-asan/check.log" ] && [ "${CHECK_SANITIZERS:-1}" != 0 ] && echo "$src/build-asan/check.log")
exit $status

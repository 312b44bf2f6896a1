#!/bin/sh
# fuzz_brief.sh -- TAP test: a short libFuzzer run of every fuzz target with
# ASan+UBSan (scripts/fuzz.sh). Runs in the --enable-sanitizers build (CI's
# second build) or wherever MEGAMOE_FUZZ_SECONDS is set; skips elsewhere and
# where clang cannot link libFuzzer. A fixed seed (MEGAMOE_FUZZ_SEED, default
# 1) keeps CI reproducible; long local runs use random seeds.
#   MEGAMOE_FUZZ_SECONDS  seconds per target (default 8)
build=${MEGAMOE_BUILDDIR:-.}
src=${MEGAMOE_SRCDIR:-..}
if [ -z "${MEGAMOE_FUZZ_SECONDS:-}" ] && ! grep -q '^SANITIZER_FLAGS = .*-fsanitize' "$build/Makefile" 2>/dev/null; then
  echo "1..0 # SKIP brief fuzzing runs in the --enable-sanitizers build (or set MEGAMOE_FUZZ_SECONDS)"
  exit 0
fi
secs=${MEGAMOE_FUZZ_SECONDS:-8}
"$src/scripts/fuzz.sh" --build-only --build-dir "$build/fuzz" >"$build/fuzz-build.log" 2>&1
rc=$?
sed 's/^/# /' "$build/fuzz-build.log"
if [ $rc = 77 ]; then
  echo "1..0 # SKIP clang cannot link libFuzzer targets on this machine"
  exit 0
fi
if [ $rc != 0 ]; then
  echo "not ok 1 - build the fuzz targets"
  echo "1..1"
  exit 1
fi
n=0
bad=0
for t in config safetensors abi_tensors; do
  n=$((n + 1))
  out=$(FUZZ_SEED=${MEGAMOE_FUZZ_SEED:-1} "$src/scripts/fuzz.sh" --seconds "$secs" \
        --build-dir "$build/fuzz" "$t" 2>&1)
  rc=$?
  echo "$out" | sed 's/^/# /'
  if [ $rc = 0 ]; then
    echo "ok $n - fuzz $t for ${secs}s"
  else
    echo "not ok $n - fuzz $t (reproducer and log in $build/fuzz/$t/)"
    bad=1
  fi
done
echo "1..$n"
exit $bad

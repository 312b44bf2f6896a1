#!/usr/bin/env bash
# fuzz.sh -- builds the libFuzzer targets (tests/fuzz/fuzz_*.c) with clang
# -fsanitize=fuzzer,address,undefined straight from the sources (CPU-only,
# no CUDA) and runs each one for a while on a copy of its seed corpus.
#
#   scripts/fuzz.sh                     every target, 8 s each (the CI run)
#   scripts/fuzz.sh --seconds 30 config safetensors
#   scripts/fuzz.sh --minutes 10 abi_tensors   long local run
#   scripts/fuzz.sh --build-only
#
# Options:
#   --seconds N / --minutes N   time per target (default 8 s)
#   --jobs N                    parallel fuzzing processes per target (default 1)
#   --build-dir DIR             where binaries, the working corpus and logs go
#                               (default build-fuzz/ in the source tree)
#   --merge                     after the run, copy new corpus entries that add
#                               coverage into tests/fuzz/corpus/<target>/ (use
#                               sparingly: the committed corpora stay small)
#   --build-only                build, do not run
#   --coverage                  instead of fuzzing: build with source-based
#                               coverage, run the committed and the working
#                               corpus once, print llvm-cov's per-file report
# Environment: FUZZ_SEED=N (libFuzzer -seed, default random), FUZZ_CC=clang-N.
# Exit status: 0 all targets ran clean, 1 a target crashed/leaked/timed out
# (the reproducer is build-fuzz/<target>/crash-* and its log), 77 when clang
# cannot build fuzzers here (after trying to install clang via apt as root).
# Every crash becomes a regression input: copy the reproducer into
# tests/fuzz/corpus/<target>/ (the replay tests in `make check` run it).
set -uo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
seconds=8
jobs=1
build=$src/build-fuzz
build_only=0
merge=0
coverage=0
targets=()
while [ $# -gt 0 ]; do
  case $1 in
    --seconds) seconds=$2; shift ;;
    --minutes) seconds=$(( $2 * 60 )); shift ;;
    --jobs) jobs=$2; shift ;;
    --build-dir) build=$2; shift ;;
    --build-only) build_only=1 ;;
    --merge) merge=1 ;;
    --coverage) coverage=1 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1") ;;
  esac
  shift
done
[ ${#targets[@]} -gt 0 ] || targets=(config safetensors abi_tensors)

# ---- a clang that can link libFuzzer ------------------------------------------
CC=${FUZZ_CC:-}
probe() { # compiler -> 0 if it links a fuzzer with ASan+UBSan
  local d
  d=$(mktemp -d) || return 1
  printf '#include <stdint.h>\n#include <stddef.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { return 0; }\n' >"$d/p.c"
  "$1" -fsanitize=fuzzer,address,undefined "$d/p.c" -o "$d/p" >/dev/null 2>&1
  local rc=$?
  rm -rf "$d"
  return $rc
}
find_cc() {
  for c in ${FUZZ_CC:-} clang clang-19 clang-18 clang-17 clang-16 clang-15 clang-14; do
    command -v "$c" >/dev/null 2>&1 && probe "$c" && { CC=$c; return 0; }
  done
  return 1
}
if ! find_cc; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "fuzz.sh: installing clang (libFuzzer) with apt"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends clang libclang-rt-dev ||
      apt-get install -y -qq --no-install-recommends clang libclang-rt-14-dev; } >/dev/null 2>&1
  fi
  if ! find_cc; then
    echo "fuzz.sh: no clang that links -fsanitize=fuzzer (install clang and libclang-rt-dev)"
    exit 77
  fi
fi

# ---- build ----------------------------------------------------------------------
mkdir -p "$build"
# CPU-only build: an empty configuration header (no CUDA, no NCCL).
cfg_h=$build/mm_build_config.h
[ -f "$cfg_h" ] || printf '/* fuzz build: CPU only */\n#define PACKAGE_VERSION "fuzz"\n' >"$cfg_h"
cflags=(-std=c11 -g -O1 -D_GNU_SOURCE -include "$cfg_h" -I"$src/abi" -I"$src/plugin"
        -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
        -fno-omit-frame-pointer -pthread -Wall -Wno-unused-parameter
        $(pkg-config --cflags yaml-0.1 libuv 2>/dev/null))
libs=($(pkg-config --libs yaml-0.1 libuv 2>/dev/null || echo -lyaml -luv) -lm)
common=(status.c formats.c parallel.c cpu_simd.c json.c spelling.c config.c env_knobs.c)
declare -A sources=(
  [config]="${common[*]}"
  [safetensors]="${common[*]} safetensors.c safetensors_ckpt.c requant.c weights_load.c layout_sm100.c"
  [abi_tensors]="${common[*]} entry.c op.c op_registry.c dltensor.c backend_cpu.c ref_moe.c requant.c weights_load.c layout_sm100.c routing.c"
)
# Number crunching without coverage instrumentation (still ASan+UBSan): its
# loops would dominate the run time and add no interesting coverage.
nocov=" formats.c ref_moe.c requant.c layout_sm100.c parallel.c "
build_target() { # name
  local t=$1 out=$build/fuzz_$1 srcs=() objs=()
  for s in ${sources[$1]}; do
    if [[ $nocov == *" $s "* ]]; then objs+=("$build/nocov_${s%.c}.o")
    else srcs+=("$src/plugin/$s"); fi
  done
  # Rebuild when any input is newer than the binary.
  if [ -x "$out" ] && [ -z "$(find "$src/plugin" "$src/abi" "$src/tests/fuzz" "$src/tests/abi_fixture.h" -newer "$out" -name '*.[ch]' | head -1)" ]; then
    return 0
  fi
  echo "fuzz.sh: building fuzz_$t with $CC"
  : >"$build/fuzz_$t.build.log"
  local o
  for o in "${objs[@]}"; do
    s=$(basename "$o" .o); s=${s#nocov_}.c
    "$CC" "${cflags[@]/-fsanitize=fuzzer,address,undefined/-fsanitize=address,undefined}" -O2 \
      -c "$src/plugin/$s" -o "$o" >>"$build/fuzz_$t.build.log" 2>&1 || { cat "$build/fuzz_$t.build.log"; return 1; }
  done
  "$CC" "${cflags[@]}" "$src/tests/fuzz/fuzz_$t.c" "${srcs[@]}" "${objs[@]}" "${libs[@]}" -o "$out" \
    >>"$build/fuzz_$t.build.log" 2>&1 || { cat "$build/fuzz_$t.build.log"; return 1; }
}
if [ $coverage = 1 ]; then
  pd=$(command -v llvm-profdata || command -v llvm-profdata-14) || { echo "fuzz.sh: no llvm-profdata"; exit 77; }
  lc=$(command -v llvm-cov || command -v llvm-cov-14) || { echo "fuzz.sh: no llvm-cov"; exit 77; }
  for t in "${targets[@]}"; do
    [ -n "${sources[$t]:-}" ] || { echo "fuzz.sh: unknown target $t"; exit 2; }
    srcs=()
    for s in ${sources[$t]}; do srcs+=("$src/plugin/$s"); done
    "$CC" -std=c11 -g -O1 -D_GNU_SOURCE -include "$cfg_h" -I"$src/abi" -I"$src/plugin" -pthread \
      -fsanitize=fuzzer -fprofile-instr-generate -fcoverage-mapping $(pkg-config --cflags yaml-0.1 libuv) \
      "$src/tests/fuzz/fuzz_$t.c" "${srcs[@]}" "${libs[@]}" -o "$build/cov_$t" || exit 1
    mkdir -p "$build/$t/corpus"
    (cd "$build" && LLVM_PROFILE_FILE="$build/cov_$t.profraw" "$build/cov_$t" -runs=0 \
       "$src/tests/fuzz/corpus/$t" "$build/$t/corpus" >"$build/cov_$t.log" 2>&1)
    "$pd" merge -sparse "$build/cov_$t.profraw" -o "$build/cov_$t.profdata"
    echo "fuzz.sh: $t: coverage of the corpus ($(ls "$src/tests/fuzz/corpus/$t" "$build/$t/corpus" | wc -l) files)"
    "$lc" report "$build/cov_$t" -instr-profile="$build/cov_$t.profdata" "${srcs[@]}" 2>/dev/null |
      awk 'NR <= 2 || /TOTAL/ || $1 ~ /\.c$/' | sed "s|$src/||" | cut -c1-140
  done
  exit 0
fi
for t in "${targets[@]}"; do
  [ -n "${sources[$t]:-}" ] || { echo "fuzz.sh: unknown target $t (config, safetensors, abi_tensors)"; exit 2; }
  build_target "$t" || exit 1
done
[ $build_only = 1 ] && exit 0

# ---- run ------------------------------------------------------------------------
status=0
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
for t in "${targets[@]}"; do
  work=$build/$t
  mkdir -p "$work/corpus"
  cp -n "$src/tests/fuzz/corpus/$t/"* "$work/corpus/" 2>/dev/null
  dict=()
  [ -f "$src/tests/fuzz/$t.dict" ] && dict=(-dict="$src/tests/fuzz/$t.dict")
  log=$work/fuzz.log
  start=$(date +%s)
  # -rss_limit_mb: a request that makes the plugin allocate gigabytes is a bug too.
  (cd "$work" && "$build/fuzz_$t" corpus "${dict[@]}" -max_total_time="$seconds" \
      -timeout=20 -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 ${FUZZ_SEED:+-seed=$FUZZ_SEED} \
      $( [ "$jobs" -gt 1 ] && echo "-jobs=$jobs -workers=$jobs" ) -artifact_prefix="$work/" >"$log" 2>&1)
  rc=$?
  for f in "$work"/fuzz-*.log; do [ -f "$f" ] && cat "$f" >>"$log" && rm -f "$f"; done
  took=$(( $(date +%s) - start ))
  runs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | awk '{s+=$2} END {print s+0}')
  cov=$(grep -Eo 'cov: [0-9]+' "$log" | tail -1 | awk '{print $2}')
  crashes=$(ls "$work" | grep -cE '^(crash|leak|timeout|oom|slow-unit)-' || true)
  echo "fuzz.sh: $t: ${took}s, $runs runs, cov ${cov:-?}, corpus $(ls "$work/corpus" | wc -l), exit $rc, artifacts $crashes"
  if [ $rc -ne 0 ]; then
    status=1
    grep -E 'ERROR|runtime error|SUMMARY|Test unit written|deadly signal|==[0-9]+==' "$log" | head -20
  fi
  if [ $merge = 1 ] && [ $rc -eq 0 ]; then
    "$build/fuzz_$t" -merge=1 "$src/tests/fuzz/corpus/$t" "$work/corpus" >/dev/null 2>&1
  fi
done
exit $status

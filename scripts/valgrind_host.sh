#!/usr/bin/env bash
# valgrind_host.sh -- valgrind memcheck of megamoe-host on the CPU path:
# a small synthetic checkpoint (megamoe-synth), the plugin dlopened, layers
# prepared, planned, executed (two token counts, several iterations, the
# cpu-reference check), plus the error paths a host hits most (config
# --validate, a bad config, a missing checkpoint, a checkpoint with a missing
# expert), then tests/test_hostile_inputs and the abi_tensors corpus replay
# when built. Every run must show no invalid access, no uninitialised use and
# no leak (definite, indirect or possible): --error-exitcode makes any of
# them fail the script.
#
#   scripts/valgrind_host.sh            uses build/ (a build WITHOUT sanitizers)
# Environment:
#   BUILD_DIR       build folder (default build/); must not be --enable-sanitizers
#   SYNTH           megamoe-synth to use (default $BUILD_DIR/host/megamoe-synth)
#   VALGRIND_WORK   scratch folder (default: a temp dir, removed at exit)
# Exit: 0 clean, 1 valgrind found something (logs printed), 77 cannot run here.
set -uo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${BUILD_DIR:-$src/build}" 2>/dev/null && pwd) || { echo "valgrind_host: no build folder ${BUILD_DIR:-$src/build}"; exit 77; }
host=$build/host/megamoe-host
plugin=$build/plugin/.libs/libmegamoe_plugin.so
synth=${SYNTH:-$build/host/megamoe-synth}

if ! command -v valgrind >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends valgrind >/dev/null 2>&1
  fi
  command -v valgrind >/dev/null 2>&1 || { echo "valgrind_host: valgrind is not installed"; exit 77; }
fi
for f in "$host" "$plugin" "$synth"; do
  [ -x "$f" ] || [ -f "$f" ] || { echo "valgrind_host: $f missing (build first)"; exit 77; }
done
if grep -q '^SANITIZER_FLAGS = .*-fsanitize' "$build/Makefile" 2>/dev/null; then
  echo "valgrind_host: $build is a sanitizer build; valgrind needs a plain one"
  exit 77
fi

work=${VALGRIND_WORK:-}
if [ -z "$work" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work"
H=256 I=256 E=8 K=2
"$synth" --out "$work/ckpt" --layers 2 --hidden $H --intermediate $I --experts $E \
  --format nvfp4 --seed 7 --threads 2 --quiet || { echo "valgrind_host: megamoe-synth failed"; exit 1; }
cat >"$work/cfg.yaml" <<EOF
schema-version: 1
backend: cpu-reference
model: {hidden-size: $H, moe-intermediate-size: $I, num-experts: $E, top-k: $K}
num-max-tokens-per-rank: 64
cpu: {threads: 2}
EOF
printf 'schema-version: 1\nmodel: {top-k: 99}\n' >"$work/bad.yaml"
# a checkpoint without expert 5 (the op must name it, and free everything)
mkdir -p "$work/missing"
"$synth" --out "$work/missing" --layers 1 --hidden $H --intermediate $I --experts 5 \
  --format nvfp4 --seed 7 --threads 1 --quiet || exit 1

vg=(valgrind --tool=memcheck --leak-check=full --show-leak-kinds=definite,indirect,possible
    --errors-for-leak-kinds=definite,indirect,possible --track-origins=yes
    --error-exitcode=99 --num-callers=30)
status=0
run() { # name want_rc args...
  local name=$1 want=$2
  shift 2
  local log=$work/valgrind-$name.log
  local t0=$(date +%s)
  "${vg[@]}" --log-file="$log" "$host" --plugin "$plugin" "$@" >"$work/$name.out" 2>&1
  local rc=$?
  local took=$(( $(date +%s) - t0 ))
  local errs=$(grep -Eo 'ERROR SUMMARY: [0-9]+ errors' "$log" | grep -Eo '[0-9]+' | head -1)
  local lost=$(grep -E '(definitely|indirectly|possibly) lost:' "$log" | grep -Eo 'lost: [0-9,]+' |
               tr -d , | awk '{s+=$2} END {print s+0}')
  echo "valgrind_host: $name: exit $rc (want $want), ${took}s, ${errs:-?} errors, $lost bytes lost"
  if [ $rc -eq 99 ] || [ "${errs:-1}" != 0 ]; then
    status=1
    grep -E '^==[0-9]+== (Invalid|Conditional|Use of|Syscall|Mismatched|.*lost in|   (at|by) )' "$log" | head -60
  elif [ $rc -ne "$want" ]; then
    status=1
    tail -20 "$work/$name.out"
  fi
}
run forward 0 --config "$work/cfg.yaml" --checkpoint "$work/ckpt" --cpu --tokens 16,5 \
  --iters 2 --warmup 1 --check-tokens 4 --dump-check "$work/check.st"
run validate 0 --config "$work/cfg.yaml" --validate
run bad-config 1 --config "$work/bad.yaml" --validate
run no-checkpoint 1 --config "$work/cfg.yaml" --checkpoint "$work/nope" --cpu
run missing-expert 1 --config "$work/cfg.yaml" --checkpoint "$work/missing" --cpu --tokens 4 \
  --iters 1 --warmup 1
grep -h 'megamoe-host: PASS\|missing' "$work"/forward.out "$work"/missing-expert.out | head -3
# The hostile-input test program (built by `make check`), when present: every
# misuse of the ABI and the error paths of prepare/execute under memcheck.
for t in tests/test_hostile_inputs tests/fuzz/replay_abi_tensors; do
  [ -x "$build/$t" ] || continue
  name=$(basename "$t")
  log=$work/valgrind-$name.log
  (cd "$build" && MEGAMOE_BUILDDIR=$build MEGAMOE_SRCDIR=$src "${vg[@]}" --log-file="$log" "./$t" \
     >"$work/$name.out" 2>&1)
  rc=$?
  errs=$(grep -Eo 'ERROR SUMMARY: [0-9]+ errors' "$log" | grep -Eo '[0-9]+' | head -1)
  echo "valgrind_host: $name: exit $rc, ${errs:-?} errors, $(grep -c '^ok' "$work/$name.out") TAP ok"
  if [ $rc -ne 0 ] || [ "${errs:-1}" != 0 ]; then
    status=1
    grep -E '^==[0-9]+== (Invalid|Conditional|Use of|Syscall|.*lost in|   (at|by) )' "$log" | head -40
    grep -E '^not ok|Bail' "$work/$name.out" | head
  fi
done
[ $status = 0 ] && echo "valgrind_host: clean" || echo "valgrind_host: FAILED (logs in $work)"
exit $status

#!/usr/bin/env bash
# bench_ab.sh -- A/B of two bench_moe_compute builds on one GPU, interleaved
# (base, new, base, new) so that both see the same machine: H200s of the same
# kind differ by 3-8% from one lease to the next, more than most single
# kernel changes gain.
#   scripts/bench_ab.sh BASE_BINARY NEW_BINARY [REPS] ["ARGS" ...]
# ARGS: one bench_moe_compute argument set per word-split string (default
# "--gran-k 32 --M 256,1024,32768"); --iters 10 is appended.
set -uo pipefail
base=${1:?usage: bench_ab.sh BASE NEW [REPS] [ARGS...]}
new=${2:?usage: bench_ab.sh BASE NEW [REPS] [ARGS...]}
reps=${3:-2}
shift $(($# < 3 ? $# : 3))
[ $# -gt 0 ] || set -- "--gran-k 32 --M 256,1024,32768"
for ((rep = 1; rep <= reps; rep++)); do
  for v in base new; do
    b=$base
    [ $v = new ] && b=$new
    for args in "$@"; do
      echo "### $v rep $rep: $args"
      # shellcheck disable=SC2086
      "$b" $args --iters 10 2>&1 | grep -E '^\| [0-9]|ceilings'
    done
  done
done

#!/bin/sh
# scripts/padding_by_count.py (docs/PERF.md, version 40): the benchmark's
# counts add up to M, uniform loads pay nothing, and the rows that version
# 40 states come out as stated (random loads at M = 1024: +11.7% at steps of
# 8, +18.0% in the 32-wide kernels; at 32768 +3.5% on the prefill path; the
# columns of paths that do not run at that average are "-"; with --narrow
# 16,32, version 41's narrow last tiles +2.1%), and its copy
# of the benchmark's count generator gives the benchmark's counts
# (bench/expert_counts.c, printed by tests/expert_counts_dump). Skips
# without python3.
s=${MEGAMOE_SRCDIR:-$(dirname "$0")/..}
if ! command -v python3 >/dev/null 2>&1; then
  echo "1..0 # SKIP no python3"
  exit 0
fi
out=$(python3 "$s/scripts/padding_by_count.py" --M 1024,32768) || { echo "1..1"; echo "not ok 1 - script failed"; exit 0; }
echo "1..8"
n=0
check() { # check NAME LINE-PATTERN
  n=$((n + 1))
  if printf '%s\n' "$out" | grep -q -- "$2"; then echo "ok $n - $1"; else echo "not ok $n - $1"; printf '%s\n' "$out" | sed 's/^/# /'; fi
}
check "uniform 1024 pays nothing" '^| 1024 | uniform | 32-32 | +0.0% | +0.0% | - |$'
check "random 1024: floor and the 32-wide kernels" '^| 1024 | random | 21-41 | +11.7% | +18.0% | - |$'
check "random 32768: the prefill path" '^| 32768 | random | 962-1104 | +0.3% | - | +3.5% |$'
check "skewed 32768: expert 0 takes half" '^| 32768 | skewed | 528-16384 |'
# the prefill path with narrow last tiles (docs/PERF.md, version 41): L1's
# of at most 16 rows, L2's of at most 32
out=$(python3 "$s/scripts/padding_by_count.py" --M 32768 --narrow 16,32) || out=
check "narrow last tiles: random 32768" '^| 32768 | random | 962-1104 | +0.3% | - | +3.5% | +2.1% |$'
check "narrow last tiles: uniform 32768 pays nothing" '^| 32768 | uniform | 1024-1024 | +0.0% | - | +0.0% | +0.0% |$'
# the counts of every load add up to M (the script's own sums, through a
# module import)
n=$((n + 1))
if python3 - "$s/scripts" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
sys.dont_write_bytecode = True
from padding_by_count import counts
for M in (1, 31, 1024, 4097):
    for load in ("uniform", "random", "skewed", "zipf"):
        c = counts(M, 32, load)
        assert len(c) == 32 and sum(c) == M and min(c) >= 0, (M, load)
PY
then echo "ok $n - counts sum to M"; else echo "not ok $n - counts sum to M"; fi
# the script's counts are the benchmark's: every load, several M and E
n=$((n + 1))
dump=${MEGAMOE_BUILDDIR:-.}/tests/expert_counts_dump
Ms=0,1,7,31,256,1024,1025,4097,32768
got=$(mktemp) || exit 1
trap 'rm -f "$got"' EXIT
bad=
for E in 1 3 32 256; do
  if ! "$dump" $E $Ms > "$got" 2>&1; then
    bad="E $E: $dump failed"
    break
  fi
  if ! python3 - "$s/scripts" $E $Ms <<'PY' | cmp -s - "$got"
import sys
sys.path.insert(0, sys.argv[1])
sys.dont_write_bytecode = True
from padding_by_count import counts
E = int(sys.argv[2])
for M in map(int, sys.argv[3].split(",")):
    for load in ("uniform", "skewed", "random", "zipf"):
        print(M, load, *counts(M, E, load))
PY
  then
    bad="E $E differs"
    break
  fi
done
if [ -z "$bad" ]; then echo "ok $n - counts are the benchmark's (E 1, 3, 32, 256; M $Ms)"
else echo "not ok $n - counts are the benchmark's ($bad)"; fi

#!/usr/bin/env bash
# bench_ab.sh -- A/B of two bench_moe_compute builds on one GPU, in one
# call: rounds in ABBA order (base new, new base, ...), so that both builds
# see the same machine and the same drift of its clocks (GPUs of the same
# kind differ by 3-8% from one lease to the next, more than most single
# kernel changes gain), then one table: per argument set and table row, the
# mean of each build's medians over the rounds, their range, and the new
# build's change.
#   scripts/bench_ab.sh BASE_BINARY NEW_BINARY [ROUNDS] ["ARGS" ...]
# ROUNDS: default 4 (even, so each build runs first as often). ARGS: one
# bench_moe_compute argument set per word-split string (default "--gran-k 32
# --M 256,1024,32768"); BENCH_AB_EXTRA is appended to each (default
# "--iters 20 --warmup-ms 500 --profile-only": medians only, no same-run
# ceilings). The runs' own rows go to stderr.
set -uo pipefail
base=${1:?usage: bench_ab.sh BASE NEW [ROUNDS] [ARGS...]}
new=${2:?usage: bench_ab.sh BASE NEW [ROUNDS] [ARGS...]}
rounds=${3:-4}
shift $(($# < 3 ? $# : 3))
[ $# -gt 0 ] || set -- "--gran-k 32 --M 256,1024,32768"
read -r -a extra <<< "${BENCH_AB_EXTRA---iters 20 --warmup-ms 500 --profile-only}"
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for ((r = 1; r <= rounds; r++)); do
  order="base new"
  case $((r % 4)) in 2 | 3) order="new base" ;; esac
  for v in $order; do
    b=$base
    [ "$v" = new ] && b=$new
    for ((a = 1; a <= $#; a++)); do
      args=${!a}
      echo "bench_ab: round $r, $v: $args" >&2
      # shellcheck disable=SC2086
      out=$("$b" $args "${extra[@]}" 2>&1)
      rc=$?
      grep -E '^\| [0-9]' <<< "$out" >&2
      if [ $rc != 0 ]; then
        # its message: the last line that is not the table's (stdout comes
        # after stderr's message when the bench exits)
        msg=$(grep -vE '^[|#]' <<< "$out" | tail -1)
        echo "bench_ab: $v failed (rc $rc): ${msg:-$(tail -1 <<< "$out")}" >&2
      fi
      awk -F'|' -v v="$v" -v a="$a" '/^\| [0-9]/ { gsub(/^ +| +$/, "", $2); print a "|" $2 "|" v "|" $4 + 0 }' \
        <<< "$out" >> "$results"
    done
  done
done
# set|row|build|us lines -> one row per argument set and table row
if [ $# -gt 1 ]; then
  for ((a = 1; a <= $#; a++)); do echo "set $a: ${!a}${extra[*]:+ ${extra[*]}}"; done
fi
awk -F'|' -v nsets=$# '
  { k = $1 "|" $2; s[k, $3] += $4; n[k, $3]++
    if (!((k, $3, "lo") in m) || $4 < m[k, $3, "lo"]) m[k, $3, "lo"] = $4
    if (!((k, $3, "hi") in m) || $4 > m[k, $3, "hi"]) m[k, $3, "hi"] = $4
    if (!(k in seen)) { seen[k] = 1; keys[++nk] = k } }
  function cell(k, v) {
    return n[k, v] ? sprintf("%.1f (%.1f-%.1f, %d)", s[k, v] / n[k, v], m[k, v, "lo"], m[k, v, "hi"], n[k, v]) : "-"
  }
  END {
    print "| " (nsets > 1 ? "set: " : "") "M, load | base: mean (range, runs) | new | change |"
    print "|---|---|---|---|"
    for (j = 1; j <= nk; j++) {
      k = keys[j]; split(k, p, "|")
      ch = n[k, "base"] && n[k, "new"] ? sprintf("%+.1f%%", 100 * (s[k, "new"] / n[k, "new"]) / (s[k, "base"] / n[k, "base"]) - 100) : "-"
      printf "| %s%s | %s | %s | %s |\n", (nsets > 1 ? p[1] ": " : ""), p[2], cell(k, "base"), cell(k, "new"), ch
    }
  }' "$results"

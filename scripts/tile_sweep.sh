#!/usr/bin/env bash
# tile_sweep.sh -- does the WGMMA path's launch rule (mm_sm90_launch_rule) still pick the fastest
# token tiles? Runs bench_moe_compute (WGMMA path) once per launch shape
# (the MEGAMOE_SM90_* overrides of docs/CONFIG.md, "auto" = the rule's own
# choice), each in its own process, rounds in alternating order, and prints
# per M and load the mean time of each shape and its difference to auto.
# Version 35 found the FP8 modes' rule 11-16% off at 34-40 rows per expert
# this way: re-run it when the kernels change.
#   scripts/tile_sweep.sh BENCH [ROUNDS] [BENCH ARGS...]
#   TILE_SWEEP_SHAPES="auto TOKEN_TILE=32 TOKEN_TILE=64,MIXED_TILES=0"
# BENCH ARGS default to "--gran-k 32 --compute fp8 --M 768,1024,1280,1536
# --loads uniform,random,skewed"; --path wgmma --profile-only --iters 20
# --warmup-ms 500 are added.
set -uo pipefail
bench=${1:?usage: tile_sweep.sh BENCH [ROUNDS] [BENCH ARGS...]}
rounds=${2:-2}
shift $(($# < 2 ? $# : 2))
[ $# -gt 0 ] || set -- --gran-k 32 --compute fp8 --M 768,1024,1280,1536 --loads uniform,random,skewed
read -r -a shapes <<< "${TILE_SWEEP_SHAPES:-auto TOKEN_TILE=16 TOKEN_TILE=32 TOKEN_TILE=64}"
[ "${shapes[0]}" = auto ] || shapes=(auto "${shapes[@]}")
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for ((r = 1; r <= rounds; r++)); do
  order=("${shapes[@]}")
  if ((r % 2 == 0)); then # every other round backwards
    order=()
    for ((i = ${#shapes[@]} - 1; i >= 0; i--)); do order+=("${shapes[i]}"); done
  fi
  for shape in "${order[@]}"; do
    envs=()
    if [ "$shape" != auto ]; then
      IFS=, read -r -a kvs <<< "$shape"
      for kv in "${kvs[@]}"; do envs+=("MEGAMOE_SM90_$kv"); done
    fi
    echo "tile_sweep: round $r, $shape" >&2
    env "${envs[@]}" "$bench" "$@" --path wgmma --profile-only --iters 20 --warmup-ms 500 2>&1 |
      awk -F'|' -v s="$shape" '/^\| [0-9]/ { gsub(/ +/, " ", $2); print s "|" $2 "|" $4 + 0 }' \
        >> "$results" || echo "tile_sweep: $shape failed" >&2
  done
done
# shape|M load|us lines -> one row per M and load: mean us per shape, % to auto
awk -F'|' -v list="${shapes[*]}" '
  BEGIN { ns = split(list, sh, " ") }
  { k = $2; sum[$1, k] += $3; n[$1, k]++; if (!(k in seen)) { seen[k] = 1; keys[++nk] = k } }
  END {
    printf "| M, load |"; for (i = 1; i <= ns; i++) printf " %s |", sh[i]; print " fastest |"
    printf "|---|"; for (i = 1; i <= ns; i++) printf "---|"; print "---|"
    for (j = 1; j <= nk; j++) {
      k = keys[j]; a = n["auto", k] ? sum["auto", k] / n["auto", k] : 0
      best = "auto"; bt = a
      printf "|%s|", k
      for (i = 1; i <= ns; i++) {
        if (!n[sh[i], k]) { printf " - |"; continue }
        t = sum[sh[i], k] / n[sh[i], k]
        if (i == 1 || a == 0) printf " %.1f |", t
        else printf " %.1f (%+.0f%%) |", t, 100 * (t / a - 1)
        if (t < bt) { bt = t; best = sh[i] }
      }
      print " " best " |"
    }
  }' "$results"

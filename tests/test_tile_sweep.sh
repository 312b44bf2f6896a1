#!/bin/sh
# scripts/tile_sweep.sh without a GPU: a stand-in bench prints the table
# rows bench_moe_compute prints (a row copied from an H200 run, its time
# set by the launch override it was given and by the round), and the sweep
# must run every shape in its own process with its MEGAMOE_SM90_* variables,
# rounds in alternating order, pass the fixed bench arguments, average the
# rounds per M and load, and name the fastest shape; a bench that fails
# is reported, and its shape's cells stay empty. Skips without bash.
s=${MEGAMOE_SRCDIR:-$(dirname "$0")/..}
if ! command -v bash >/dev/null 2>&1; then
  echo "1..0 # SKIP no bash"
  exit 0
fi
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
log=$tmp/calls
FAKE_LOG=$log
export FAKE_LOG
cat > "$tmp/bench" <<'EOF'
#!/bin/sh
tile=${MEGAMOE_SM90_TOKEN_TILE:-auto}
echo "$tile ${MEGAMOE_SM90_MIXED_TILES:--} | $*" >> "$FAKE_LOG"
[ "$tile" = 128 ] && { echo "cuda error: out of memory" >&2; exit 3; }
n=$(grep -c "^$tile " "$FAKE_LOG")
case $tile in
  auto) t1=200.0 t2=300.0 ;;
  16) t1=$([ "$n" = 1 ] && echo 170.0 || echo 190.0) t2=330.0 ;;
  *) t1=250.0 t2=250.0 ;;
esac
echo "# device NVIDIA H200, 132 SMs; mode g32 fp8 (FP8 QGMMA); E_loc 32 H 6144 I 2048"
echo "| M | rows/expert | time us | TFLOP/s | weight TB/s | % HBM read |"
echo "|---|---|---|---|---|---|"
echo "| 512 uniform | 16 | $t1 | 169.3 | 2.98 | n/a |"
echo "| 512 random | 16 (max 29) | $t2 | 160.6 | 2.83 | n/a |"
EOF
chmod +x "$tmp/bench"
echo "1..5"

TILE_SWEEP_SHAPES="auto TOKEN_TILE=16" \
  bash "$s/scripts/tile_sweep.sh" "$tmp/bench" 2 > "$tmp/out" 2> "$tmp/err"
want='| M, load | auto | TOKEN_TILE=16 | fastest |
|---|---|---|---|
| 512 uniform | 200.0 | 180.0 (-10%) | TOKEN_TILE=16 |
| 512 random | 300.0 | 330.0 (+10%) | auto |'
if [ "$(cat "$tmp/out")" = "$want" ]; then
  echo "ok 1 - the means of two rounds, their differences to auto, the fastest shape"
else
  echo "not ok 1 - the sweep's table"
  sed 's/^/# /' "$tmp/out"
fi

order=$(cut -d' ' -f1 "$log" | tr '\n' ' ')
if [ "$order" = "auto 16 16 auto " ]; then
  echo "ok 2 - one process per shape and round, every other round backwards"
else
  echo "not ok 2 - the order of the runs: $order"
fi

fixed='--gran-k 32 --compute fp8 --M 768,1024,1280,1536 --loads uniform,random,skewed --path wgmma --profile-only --iters 20 --warmup-ms 500'
if [ "$(cut -d'|' -f2- "$log" | sort -u)" = " $fixed" ]; then
  echo "ok 3 - the default bench arguments and the fixed ones"
else
  echo "not ok 3 - the bench's arguments"
  sed 's/^/# /' "$log"
fi

: > "$log"
TILE_SWEEP_SHAPES="TOKEN_TILE=64,MIXED_TILES=0" \
  bash "$s/scripts/tile_sweep.sh" "$tmp/bench" 1 --gran-k 16 --M 512 > "$tmp/out" 2> "$tmp/err"
calls=$(tr '\n' ';' < "$log") # in run order: auto first
want_calls="auto - | --gran-k 16 --M 512 --path wgmma --profile-only --iters 20 --warmup-ms 500;64 0 | --gran-k 16 --M 512 --path wgmma --profile-only --iters 20 --warmup-ms 500;"
if [ "$calls" = "$want_calls" ] && grep -q '^| 512 uniform | 200.0 | 250.0 (+25%) | auto |$' "$tmp/out"; then
  echo "ok 4 - auto added first, a shape of two overrides, the caller's bench arguments"
else
  echo "not ok 4 - shapes and arguments: $calls"
  sed 's/^/# /' "$tmp/out"
fi

: > "$log"
TILE_SWEEP_SHAPES="auto TOKEN_TILE=128" \
  bash "$s/scripts/tile_sweep.sh" "$tmp/bench" 1 > "$tmp/out" 2> "$tmp/err"
if grep -q '^tile_sweep: TOKEN_TILE=128 failed$' "$tmp/err" &&
  grep -q '^| 512 uniform | 200.0 | - | auto |$' "$tmp/out"; then
  echo "ok 5 - a failing bench is reported and leaves its cells empty"
else
  echo "not ok 5 - a failing bench"
  sed 's/^/# /' "$tmp/err" "$tmp/out"
fi

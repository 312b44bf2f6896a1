#!/bin/sh
# scripts/bench_ab.sh without a GPU: two stand-in benches print the table
# rows bench_moe_compute prints, their times set by the build and the round;
# the A/B must run them in ABBA order with the extra arguments appended,
# and print per argument set and row the mean, range and count of each
# build's times and the new build's change; a failing run is reported.
# Skips without bash.
. "${MEGAMOE_SRCDIR:-$(dirname "$0")/..}/tests/tap.sh"
if ! command -v bash >/dev/null 2>&1; then
  echo "1..0 # SKIP no bash"
  exit 0
fi
tap_start 4 "$s/scripts/bench_ab.sh"
FAKE_LOG=$dir/calls
export FAKE_LOG
for v in base new; do
  cat > "$dir/$v" <<EOF2
#!/bin/sh
echo "$v | \$*" >> "\$FAKE_LOG"
n=\$(grep -c "^$v " "\$FAKE_LOG")
case "$v \$n" in
  "base 1") u=200.0 ;; "base 2") u=204.0 ;; base*) u=202.0 ;;
  "new 3") # as bench_moe_compute fails: its table's head (stdout, flushed
    # at exit) lands after the message (stderr) in the combined output
    echo "cuda error: launch failed" >&2
    printf '# device NVIDIA H200\n| M | time us |\n|---|---|\n'; exit 2 ;;
  *) u=190.0 ;;
esac
echo "# device NVIDIA H200, 132 SMs"
echo "| M | rows/expert | time us | TFLOP/s |"
echo "|---|---|---|---|"
echo "| 256 uniform | 8 | \$u | 75.0 |"
echo "| 1024 random | 32 (max 41) | 300.0 | 260.0 |"
EOF2
  chmod +x "$dir/$v"
done

BENCH_AB_EXTRA="--iters 5" bash "$s/scripts/bench_ab.sh" "$dir/base" "$dir/new" 4 "--gran-k 16" \
  > "$dir/out" 2> "$dir/err"
want='| M, load | base: mean (range, runs) | new | change |
|---|---|---|---|
| 256 uniform | 202.0 (200.0-204.0, 4) | 190.0 (190.0-190.0, 3) | -5.9% |
| 1024 random | 300.0 (300.0-300.0, 4) | 300.0 (300.0-300.0, 3) | +0.0% |'
tap_show=$dir/out
[ "$(cat "$dir/out")" = "$want" ]
check "means, ranges and counts per build, the change of the means" $?

tap_show=$FAKE_LOG
[ "$(cut -d' ' -f1 "$FAKE_LOG" | tr '\n' ' ')" = "base new new base new base base new " ]
check "rounds in ABBA order" $?
[ "$(cut -d'|' -f2- "$FAKE_LOG" | sort -u)" = " --gran-k 16 --iters 5" ]
check "the argument set with BENCH_AB_EXTRA appended" $?

tap_show=$dir/err
grep -q "bench_ab: new failed (rc 2): cuda error: launch failed" "$dir/err"
check "a failed run is named with its message, not its table's last line" $?

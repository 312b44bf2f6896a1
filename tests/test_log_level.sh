#!/bin/sh
# The plugin's log through a real host (megamoe-host, cpu-reference): the
# config key log-level filters each op's messages, MEGAMOE_LOG_LEVEL
# overrides it, and misspelt or out-of-range MEGAMOE_* environment
# variables are reported at init (plugin/env_knobs.c).
. "${MEGAMOE_SRCDIR:-..}/tests/tap.sh"
host=$b/host/megamoe-host
synth=$b/host/megamoe-synth
plugin=$b/plugin/.libs/libmegamoe_plugin.so
tap_start 4 "$host" "$synth" "$plugin"
tap_show=$dir/err
"$synth" --out "$dir/ck" --layers 1 --hidden 256 --intermediate 256 --experts 16 --quiet \
  >"$dir/err" 2>&1 || { sed 's/^/# /' "$dir/err"; echo "Bail out! megamoe-synth failed"; exit 1; }
run() { # extra megamoe-host arguments; its stderr in $dir/err, exit code returned
  "$host" --plugin "$plugin" --config "$s/conf/megamoe.yaml" --checkpoint "$dir/ck" --cpu \
    --set model.hidden-size=256 --set model.moe-intermediate-size=256 --set model.num-experts=16 \
    --iters 1 --warmup 0 --tokens 4 "$@" >"$dir/out" 2>"$dir/err"
}
# strip what a developer's shell may hold, so that only this test's settings count
for v in $(env | sed -n 's/^\(MEGAMOE_[A-Z0-9_]*\)=.*/\1/p'); do
  case $v in MEGAMOE_BUILDDIR | MEGAMOE_SRCDIR) ;; *) unset "$v" ;; esac
done

run
[ $? = 0 ] && grep -q '^\[plugin info\] plan: 4 tokens per rank' "$dir/err" &&
  ! grep -q '^\[plugin warn\]' "$dir/err"
check "default (log-level info): the op's info lines, no warnings" $?

run --set log-level=warn
[ $? = 0 ] && ! grep -q '^\[plugin' "$dir/err" && grep -q 'PASS' "$dir/out"
check "log-level: warn drops every info line of the op" $?

MEGAMOE_LOG_LEVEL=info run --set log-level=error
[ $? = 0 ] && grep -q '^\[plugin info\] plan: 4 tokens per rank' "$dir/err"
check "MEGAMOE_LOG_LEVEL overrides the op's log-level" $?

MEGAMOE_SM90_TOKEN_TILES=32 MEGAMOE_SM90_GRID=-3 MEGAMOE_NCCL_BLOCKING=yes \
  MEGAMOE_TEST_QUICK=1 run
[ $? = 0 ] &&
  grep -q '^\[plugin warn\] MEGAMOE_SM90_TOKEN_TILES is not a megamoe environment variable; did you mean MEGAMOE_SM90_TOKEN_TILE?' "$dir/err" &&
  grep -q '^\[plugin warn\] MEGAMOE_SM90_GRID=-3 is not one of its values' "$dir/err" &&
  grep -q '^\[plugin warn\] MEGAMOE_NCCL_BLOCKING=yes is not one of its values (0 1)' "$dir/err" &&
  [ "$(grep -c '^\[plugin warn\]' "$dir/err")" = 3 ]
check "bad MEGAMOE_* variables are reported once each at init, others pass" $?

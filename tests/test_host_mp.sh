#!/bin/sh
# test_host_mp.sh -- megamoe-host's multi-process mode on the CPU (loopback
# only, bounded): a synthetic checkpoint, then
#   1. --world 1 --rendezvous 127.0.0.1:0 (rank 0 serves on a free port)
#      passes, with the same result line as the threaded mode;
#   2. two processes, --world 2 --set ep-size=1 (two cpu-reference replicas:
#      the backend runs ep-size 1 only), rank 1 told the port rank 0 serves
#      on: both pass, rank 0's last line is the world's;
#   3. rank 1 with a missing checkpoint: both fail fast, rank 0 names it;
#   4. rank 1 killed mid-run: rank 0 fails fast (the store's will);
#   5. bad option combinations are refused.
b=${MEGAMOE_BUILDDIR:-.}
s=${MEGAMOE_SRCDIR:-.}
host=$b/host/megamoe-host
synth=$b/host/megamoe-synth
plugin=$b/plugin/.libs/libmegamoe_plugin.so
for f in "$host" "$synth" "$plugin"; do
  if [ ! -x "$f" ] && [ ! -f "$f" ]; then echo "1..0 # SKIP $f not built"; exit 0; fi
done
w=$(mktemp -d)
pids=
cleanup() { for p in $pids; do kill -9 "$p" 2>/dev/null; done; rm -rf "$w"; }
trap cleanup EXIT
echo "1..9"
n=0
ok() { n=$((n + 1)); echo "ok $n - $1"; }
notok() { n=$((n + 1)); echo "not ok $n - $1"; shift; for f in "$@"; do sed 's/^/# /' "$f" | grep -v '\[plugin' | tail -15; done; }
# t: a command's wall time must stay bounded in CI
t() { timeout 120 "$@"; }

"$synth" --out "$w/ckpt" --layers 2 --hidden 256 --intermediate 256 --experts 16 --format nvfp4 \
  --seed 11 >"$w/synth.log" 2>&1 || { echo "Bail out! megamoe-synth failed"; cat "$w/synth.log"; exit 1; }
common="--plugin $plugin --config $s/conf/megamoe.yaml --checkpoint $w/ckpt --cpu
  --set model.hidden-size=256 --set model.moe-intermediate-size=256 --set model.num-experts=16
  --set model.top-k=4 --tokens 16,4 --iters 3 --warmup 1 --check-tokens 6 --rendezvous-timeout 60"

# Waits (bounded) for rank 0 to say where it serves; prints the port.
served_port() {
  i=0
  while [ $i -lt 600 ]; do
    p=$(sed -n 's/.*serves the key-value store on 127\.0\.0\.1:\([0-9]*\).*/\1/p' "$1" 2>/dev/null)
    if [ -n "$p" ]; then echo "$p"; return 0; fi
    sleep 0.05
    i=$((i + 1))
  done
  return 1
}
strip() { sed -e 's/ T[0-9]*=[0-9.]*ms\/layer//g' -e 's/ wall=[0-9.]*s//' -e 's/ prepare=[0-9.]*s//'; }

# 1. one process, threaded vs multi-process
t "$host" $common >"$w/thr.out" 2>"$w/thr.err"
rc1=$?
t "$host" $common --rank 0 --world 1 --rendezvous 127.0.0.1:0 >"$w/mp1.out" 2>"$w/mp1.err"
rc2=$?
if [ $rc1 = 0 ] && [ $rc2 = 0 ] && grep -q '^megamoe-host: PASS rank=0 ' "$w/mp1.out" &&
  [ "$(tail -1 "$w/thr.out" | strip)" = "$(tail -1 "$w/mp1.out" | strip)" ]; then
  ok "--world 1 --rendezvous 127.0.0.1:0 passes like the threaded mode"
else
  notok "--world 1 --rendezvous 127.0.0.1:0 passes like the threaded mode (rc $rc1/$rc2)" \
    "$w/thr.out" "$w/mp1.out" "$w/mp1.err"
fi

# 2. two processes
mp2() { # rank0-extra rank1-extra [kill -9 rank 1 this many seconds into its run]; sets rc0 rc1 took
  rm -f "$w"/r0.* "$w"/r1.* # no stale port from the previous run
  "$host" $common --world 2 --set ep-size=1 --rank 0 --rendezvous 127.0.0.1:0 $1 \
    >"$w/r0.out" 2>"$w/r0.err" &
  p0=$!
  pids="$pids $p0"
  port=$(served_port "$w/r0.err") || { kill -9 $p0; wait $p0; rc0=99; rc1=99; took=0; return; }
  "$host" $common --world 2 --set ep-size=1 --rank 1 --rendezvous 127.0.0.1:$port $2 \
    >"$w/r1.out" 2>"$w/r1.err" &
  p1=$!
  pids="$pids $p1"
  (sleep 120; kill -9 $p0 $p1) 2>/dev/null & # a hang fails, it does not stall CI
  wd=$!
  if [ -n "$3" ]; then # once rank 1 runs (it joined the store before that), kill it
    i=0
    while [ $i -lt 600 ] && ! grep -q 'rank 1 of 2' "$w/r1.err" 2>/dev/null; do sleep 0.05; i=$((i + 1)); done
    sleep "$3"
    kill -9 $p1 2>/dev/null
  fi
  start=$(date +%s)
  { wait $p1; } 2>/dev/null; rc1=$? # no "Killed" notice
  wait $p0; rc0=$?
  took=$(($(date +%s) - start))
  kill $wd 2>/dev/null
  wait $wd 2>/dev/null
}
mp2 "" ""
if [ $rc0 = 0 ] && [ $rc1 = 0 ]; then ok "two processes pass"; else
  notok "two processes pass (rc $rc0/$rc1)" "$w/r0.err" "$w/r1.err"; fi
if tail -1 "$w/r0.out" | grep -q '^megamoe-host: PASS backend=cpu-reference world=2 layers=2 rel_err=' &&
  grep -q '^megamoe-host: PASS rank=0 ' "$w/r0.out" && tail -1 "$w/r1.out" | grep -q '^megamoe-host: PASS rank=1 backend=cpu-reference world=2 '; then
  ok "each rank prints its line, rank 0 the world's last"
else
  notok "each rank prints its line, rank 0 the world's last" "$w/r0.out" "$w/r1.out"
fi
if grep -q 'rank 1: 6 sampled tokens vs cpu-reference' "$w/r1.err" &&
  grep -q 'rank 0: 6 sampled tokens vs cpu-reference' "$w/r0.err"; then
  ok "each rank checks its own sampled tokens"
else
  notok "each rank checks its own sampled tokens" "$w/r0.err" "$w/r1.err"
fi

# 3. a rank whose setup fails
mp2 "" "--checkpoint $w/missing"
if [ $rc0 = 1 ] && [ $rc1 = 1 ] && [ $took -lt 20 ] && tail -1 "$w/r0.out" | grep -q '^megamoe-host: FAIL' &&
  grep -q 'rank 1: setup failed' "$w/r0.err" && grep -q 'rank 1 reported FAIL' "$w/r0.err"; then
  ok "a rank's setup failure fails both, fast (${took}s)"
else
  notok "a rank's setup failure fails both, fast (rc $rc0/$rc1, ${took}s)" "$w/r0.out" "$w/r0.err" "$w/r1.err"
fi

# 4. a rank killed mid-run (long run: it cannot finish first)
mp2 "--iters 1024 --warmup 1000" "--iters 1024 --warmup 1000" 1
if [ $rc0 = 1 ] && [ $took -lt 20 ] && tail -1 "$w/r0.out" | grep -q '^megamoe-host: FAIL' &&
  grep -q 'rank 1 lost its connection' "$w/r0.err"; then
  ok "a killed rank fails rank 0 fast (${took}s)"
else
  notok "a killed rank fails rank 0 fast (rc $rc0, ${took}s)" "$w/r0.out" "$w/r0.err"
fi

# 5. refused option combinations (exit 2, nothing started)
bad=0
for args in "--rank 0" "--rendezvous 127.0.0.1:0" "--rendezvous 127.0.0.1:0 --rank 2 --world 2" \
  "--local-device 0" "--rendezvous-serve" "--rendezvous 127.0.0.1:0 --rank 0 --world 1 --list"; do
  t "$host" $common $args >"$w/bad.out" 2>&1
  rc=$?
  if [ $rc != 2 ]; then bad=1; echo "# '$args' exited $rc"; fi
done
[ $bad = 0 ] && ok "bad option combinations exit 2" || notok "bad option combinations exit 2"
t "$host" $common --rank 1 --world 2 --rendezvous 127.0.0.1:0 >"$w/bad.out" 2>&1
rc=$?
[ $rc = 1 ] && grep -q 'port 0 only for the serving process' "$w/bad.out" &&
  ok "port 0 is refused to a client" || notok "port 0 is refused to a client (rc $rc)" "$w/bad.out"
start=$(date +%s)
t "$host" $common --rank 1 --world 2 --rendezvous 127.0.0.1:1 --rendezvous-timeout 1 >"$w/bad.out" 2>&1
rc=$?
took=$(($(date +%s) - start))
[ $rc = 1 ] && [ $took -lt 10 ] && grep -q 'no key-value store at 127.0.0.1:1 within 1000 ms' "$w/bad.out" &&
  ok "no server: bounded by --rendezvous-timeout" ||
  notok "no server: bounded by --rendezvous-timeout (rc $rc, ${took}s)" "$w/bad.out"

#!/usr/bin/env bash
# mp_launch.sh -- runs megamoe-host's multi-process mode on this node: N
# processes (rank r on GPU r % visible GPUs, or the CPU with --cpu), rank 0
# serving the key-value store on a free loopback port, one log per rank.
# Prints each rank's result line, then rank 0's world line last; exits with
# rank 0's code (the world's).
#
#   scripts/mp_launch.sh -n 8 [-d LOGDIR] [-t SECONDS] -- build/host/megamoe-host \
#       --plugin build/plugin/.libs/libmegamoe_plugin.so --config conf/megamoe.yaml \
#       --checkpoint /data/ckpt --tokens 128,4096
#
# -n N   ranks (--world N)          -d DIR  logs (default: a temp dir, kept)
# -t S   --rendezvous-timeout S (default 600)
# For several nodes run megamoe-host directly (see docs/HOST.md).
set -uo pipefail
n=1 dir= tmo=600
while [ $# -gt 0 ]; do
  case $1 in
    -n) n=$2; shift 2 ;;
    -d) dir=$2; shift 2 ;;
    -t) tmo=$2; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || { sed -n '2,15p' "$0"; exit 2; }
case $n in '' | *[!0-9]* | 0*) echo "mp_launch: -n needs a rank count >= 1, not '$n'" >&2; exit 2 ;; esac
case $tmo in '' | *[!0-9]* | 0*) echo "mp_launch: -t needs seconds >= 1, not '$tmo'" >&2; exit 2 ;; esac
export NCCL_NVLS_ENABLE=0 # never NVLink multicast
dir=${dir:-$(mktemp -d)}
mkdir -p "$dir"
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done' INT TERM

"$@" --rank 0 --world "$n" --rendezvous 127.0.0.1:0 --rendezvous-timeout "$tmo" \
  >"$dir/rank0.out" 2>"$dir/rank0.err" &
pids+=($!)
port=
for _ in $(seq 600); do
  port=$(sed -n 's/.*serves the key-value store on 127\.0\.0\.1:\([0-9]*\).*/\1/p' "$dir/rank0.err" 2>/dev/null)
  [ -n "$port" ] && break
  kill -0 "${pids[0]}" 2>/dev/null || break
  sleep 0.1
done
if [ -z "$port" ]; then
  echo "mp_launch: rank 0 did not start its store; $dir/rank0.err:"
  tail -20 "$dir/rank0.err"
  exit 1
fi
for r in $(seq 1 $((n - 1))); do
  "$@" --rank "$r" --world "$n" --rendezvous "127.0.0.1:$port" --rendezvous-timeout "$tmo" \
    >"$dir/rank$r.out" 2>"$dir/rank$r.err" &
  pids+=($!)
done
rc0=0
for r in "${!pids[@]}"; do
  wait "${pids[$r]}"
  rc=$?
  [ "$r" = 0 ] && rc0=$rc
done
for r in $(seq 1 $((n - 1))); do grep -E '^megamoe-host: (PASS|FAIL)' "$dir/rank$r.out"; done
grep -E '^megamoe-host: (PASS|FAIL)' "$dir/rank0.out"
echo "mp_launch: $n rank(s), logs in $dir, rank 0 exit $rc0"
exit $rc0

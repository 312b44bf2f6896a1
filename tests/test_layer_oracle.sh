#!/bin/sh
# scripts/layer_oracle.py, the independent numpy model e2e_smoke.sh checks
# the operator with: its formats and requant against the golden vectors;
# megamoe-host --cpu --dump-check runs (NVFP4 with both requant policies,
# MXFP4, a routed scaling factor and an activation clamp, two ranks) that it
# passes; and that it fails a wrong setting and a changed output. Skips where
# no python3 has numpy (scripts/bootstrap.sh installs python3-numpy).
. "${MEGAMOE_SRCDIR:-..}/tests/tap.sh"
py=$("$s/scripts/numpy_python.sh")
[ -n "$py" ] || { echo "1..0 # SKIP no python3 with numpy"; exit 0; }
host=$b/host/megamoe-host
synth=$b/host/megamoe-synth
plugin=$b/plugin/.libs/libmegamoe_plugin.so
oracle=$s/scripts/layer_oracle.py
golden=${MEGAMOE_GOLDEN_DIR:-$s/../shared/golden}
tap_start 9 "$host" "$synth" "$plugin" "$oracle"
tap_show=$dir/log

if [ -e "$golden/codecs.safetensors" ]; then
  "$py" "$oracle" --self-test "$golden" >"$dir/log" 2>&1
  check "self-test against the golden vectors" $?
else
  echo "ok 1 # SKIP no golden vectors at $golden"
  n=1
fi

# run FORMAT NAME [--set K=V]...: one small layer on the cpu-reference
# backend, its checked tokens dumped to $dir/NAME.st.
run() {
  fmt=$1 name=$2
  shift 2
  [ -d "$dir/ck-$fmt" ] || "$synth" --out "$dir/ck-$fmt" --layers 1 --hidden 256 \
    --intermediate 256 --experts 8 --format "$fmt" --seed 3 --quiet >"$dir/log" 2>&1 || return 1
  "$host" --plugin "$plugin" --config "$s/conf/megamoe.yaml" --checkpoint "$dir/ck-$fmt" --cpu \
    --set model.hidden-size=256 --set model.moe-intermediate-size=256 \
    --set model.num-experts=8 --set model.top-k=4 "$@" --tokens 16 --iters 1 --warmup 0 \
    --check-tokens 16 --dump-check "$dir/$name.st" >"$dir/log" 2>&1
}
# oracle FORMAT NAME [ARGS...]: the oracle's exit code on that dump
oracle() {
  fmt=$1 name=$2
  shift 2
  "$py" "$oracle" --checkpoint "$dir/ck-$fmt" --dump "$dir/$name.st" --tolerance 1e-3 "$@" \
    >"$dir/log" 2>&1
}

run nvfp4 plain && oracle nvfp4 plain
check "nvfp4, requant none: operator and reference match the model" $?

run nvfp4 rq --set requant.policy=group16-to-group32 &&
  oracle nvfp4 rq --requant group16-to-group32
check "nvfp4, requant group16-to-group32: match" $?

run mxfp4 mx && oracle mxfp4 mx
check "mxfp4 (UE8M0 group 32): match" $?

run nvfp4 sc --set model.routed-scaling-factor=2.5 --set model.activation-clamp=0.75 &&
  oracle nvfp4 sc --routed-scaling-factor 2.5 --activation-clamp 0.75
check "routed scaling factor and activation clamp: match" $?

# Two ranks (threads, ep-size 1 each): one file per rank, each checks out.
run nvfp4 w2 --world 2 --set ep-size=1 && [ ! -e "$dir/w2.st" ] &&
  mv "$dir/w2.st.rank1" "$dir/w2b.st" && mv "$dir/w2.st.rank0" "$dir/w2.st" &&
  oracle nvfp4 w2 && oracle nvfp4 w2b
check "two ranks: FILE.rank0 and FILE.rank1, both match" $?

# It can fail: the requant run judged as if not requantized, and the same
# run judged with the clamp left out.
oracle nvfp4 rq
r1=$?
oracle nvfp4 sc --routed-scaling-factor 2.5
r2=$?
[ $r1 = 1 ] && [ $r2 = 1 ]
check "fails a dump made with other settings" $?

# ... and a changed output: the largest BF16 word of out_bf16, doubled
"$py" - "$dir/sc.st" <<'PY' >"$dir/log" 2>&1
import json, struct, sys
import numpy as np
p = sys.argv[1]
with open(p, "r+b") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    h = json.loads(f.read(n))
    b, e = h["out_bf16"]["data_offsets"]
    f.seek(8 + n + b)
    w = np.frombuffer(f.read(e - b), np.uint16).copy()
    i = int(np.argmax(w & 0x7FFF))
    w[i] += 0x0080  # exponent + 1
    f.seek(8 + n + b)
    f.write(w.tobytes())
PY
oracle nvfp4 sc --routed-scaling-factor 2.5 --activation-clamp 0.75
rc=$?
ref_rel=$(sed -n 's/.*cpu-reference rel \([^ ]*\) .*/\1/p' "$dir/log")
[ $rc = 1 ] && awk -v r="$ref_rel" 'BEGIN { exit !(r != "" && r + 0 <= 1e-3) }'
check "fails a changed output, the reference's still within tolerance" $?

# Inputs it cannot use are an error (exit 2), not a verdict.
"$py" "$oracle" --checkpoint "$dir/ck-nvfp4" --dump "$dir/missing.st" >"$dir/log" 2>&1
r1=$?
"$py" "$oracle" --checkpoint "$dir/nowhere" --dump "$dir/plain.st" >"$dir/log" 2>&1
r2=$?
[ $r1 = 2 ] && [ $r2 = 2 ]
check "a missing dump or checkpoint: exit 2" $?

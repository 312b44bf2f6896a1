#!/usr/bin/env bash
# gpu_suite.sh -- everything that needs a GPU, in one call (the device lease
# is short): GPU tests, compute-sanitizer on them (optional), the end-to-end
# smoke run and the benchmarks, from a build made elsewhere.
#
#   scripts/gpu_suite.sh PACK_DIR [OUT_DIR]
#
# PACK_DIR is made by `scripts/gpu_pack.sh` on the build machine: the build's
# binaries (tests/, host/, plugin .so, bench programs), libyaml/libuv, the
# golden vectors. Prints a summary table last; full logs go to OUT_DIR.
#   GPU_SUITE_STEPS="tests sanitizer e2e layer requant mp bench"   which steps to run
#   GPU_SUITE_TESTS=GLOB   test binaries to run (default gpu_test_*; "*" for all)
#   GPU_SUITE_BENCH_ARGS="prog=ARGS;prog=ARGS"   arguments per bench program
#                          (default: none); GPU_SUITE_BENCHES=GLOB which ones
#   GPU_SUITE_LAYER_TOKENS=8,128,1024,8192   tokens per rank of the layer step
#                          (whole-layer latency on the e2e checkpoint)
#   MEGAMOE_TEST_REPLAYS=1000   graph replays of gpu_test_ep_ranks
#   GPU_SUITE_SANITIZE="GLOB ..."   test binaries under compute-sanitizer (the
#                          sanitizer step also runs megamoe-host under memcheck)
#   GPU_SUITE_SANITIZE_TOOLS="memcheck racecheck synccheck"   its tools
# The sanitizer step with every test and tool took longer than one 10-minute
# device call on an H100 (forty-ninth stop): name the tests or the tools per
# call, e.g. GPU_SUITE_SANITIZE=gpu_test_moe_compute GPU_SUITE_SANITIZE_TOOLS=racecheck.
set -uo pipefail
pack=$(cd "${1:?usage: gpu_suite.sh PACK_DIR [OUT_DIR]}" && pwd)
out=${2:-${OUT:-/tmp/gpu_suite}}
mkdir -p "$out"
src=$(cd "$(dirname "$0")/.." && pwd)
steps=${GPU_SUITE_STEPS:-tests e2e bench}
export LD_LIBRARY_PATH="$pack/lib:${LD_LIBRARY_PATH:-}"
export MEGAMOE_BUILDDIR=$pack MEGAMOE_SRCDIR=$src MEGAMOE_GOLDEN_DIR=$pack/golden
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export MEGAMOE_TEST_REPLAYS=${MEGAMOE_TEST_REPLAYS:-1000}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
rows=()
row() { rows+=("$(printf '%-40s %s' "$1" "$2")"); }
# The layer and mp steps run megamoe-host on a one-layer GLM-5 checkpoint: the
# e2e step's, else synthesized here once.
ck=/tmp/e2e/ckpt
glm_ckpt() {
  mkdir -p "$(dirname "$ck")" # the e2e step makes it, when it runs first
  [ -e "$ck" ] || "$pack/host/megamoe-synth" --out "$ck" --layers 1 --hidden 6144 \
    --intermediate 2048 --experts 256 --format nvfp4 --seed 7 --fast >"$out/synth.log" 2>&1
}
# host_cmd CKPT H I E TOPK: megamoe-host with the plugin and a checkpoint of
# that shape, in the array host_cmd.
host_cmd() {
  host_cmd=("$pack/host/megamoe-host" --plugin "$pack/plugin/.libs/libmegamoe_plugin.so"
    --config "$src/conf/megamoe.yaml" --checkpoint "$1" --set model.hidden-size="$2"
    --set model.moe-intermediate-size="$3" --set model.num-experts="$4" --set model.top-k="$5")
}
host_cmd "$ck" 6144 2048 256 8
glm_host=("${host_cmd[@]}")

nvidia-smi -L 2>&1 | tee "$out/gpus.txt" || true
# run_test NAME LOG BINARY [ENV...]: one test program, one summary row.
run_test() {
  local name=$1 log=$2 bin=$3 start rc secs okc bad skip
  shift 3
  start=$(date +%s)
  env "$@" timeout "${GPU_SUITE_TEST_TIMEOUT:-300}" "$bin" >"$log" 2>&1
  rc=$?
  secs=$(($(date +%s) - start))
  okc=$(grep -c '^ok ' "$log")
  bad=$(grep -c '^not ok' "$log")
  skip=$(grep -c '# SKIP' "$log")
  row "$name" "rc=$rc ok=$okc not_ok=$bad skip=$skip ${secs}s"
  if [ "$bad" -gt 0 ] || [ $rc -ne 0 ]; then
    grep -E '^(not ok|#)' "$log" | head -20
    # the seed and the first failure in the summary too: the summary is
    # what a caller reading only the output's tail sees, and the log may
    # not come back from the GPU machine
    row "  $(grep -m1 '^# seed' "$log" | cut -c3-)" "$(grep -m1 -E '^not ok|CHECK' "$log" | cut -c1-100)"
  fi
}
if [[ " $steps " == *" tests "* ]]; then
  for t in "$pack"/tests/${GPU_SUITE_TESTS:-gpu_test_*}; do
    [ -x "$t" ] || continue
    run_test "$(basename "$t")" "$out/$(basename "$t").log" "$t"
  done
  # The compute kernels' launch shapes that the test's own sizes do not
  # choose, forced (quick set): every token tile (128+160: the launch pair
  # at every size), mixed tiles off, one and
  # two CTAs per SM, and a 3-CTA grid (each CTA walks many units, so its
  # pipeline ring wraps; the test's sizes alone never wrap it; with 64- and
  # 128-wide tiles the consumer warpgroups' turns run through many units),
  # the prefill path's decode tasks of 1 and of 16 K blocks (the test's
  # shapes take 2 by the rule), and its decode ahead off and one expert deep.
  t=$pack/tests/gpu_test_moe_compute
  # shellcheck disable=SC2053 # the right side is the test glob
  if [ -x "$t" ] && [[ gpu_test_moe_compute == ${GPU_SUITE_TESTS:-gpu_test_*} ]]; then
    for v in TOKEN_TILE=16 TOKEN_TILE=32 TOKEN_TILE=64 TOKEN_TILE=128 "TOKEN_TILE=16 MIXED_TILES=0" \
      "TOKEN_TILE=16 CTAS_PER_SM=2" "TOKEN_TILE=16 CTAS_PER_SM=1" GRID=3 "TOKEN_TILE=64 GRID=3" \
      "TOKEN_TILE=128 GRID=3" TOKEN_TILE=160 TOKEN_TILE=128+160 "TOKEN_TILE=128+160 GRID=3" \
      TOKEN_TILE=64+128 "TOKEN_TILE=64+128 GRID=3" TOKEN_TILE=32+128 "TOKEN_TILE=32+128 GRID=3" \
      "TOKEN_TILE=32 GRID=3" \
      "TOKEN_TILE=16 CTAS_PER_SM=1 GRID=3" PREFILL_TASK_KB=1 "PREFILL_TASK_KB=16 GRID=3" \
      PREFILL_AHEAD=0 "PREFILL_AHEAD=1 GRID=3" PREFILL_OVERLAP=0 "PREFILL_OVERLAP=1 GRID=2"; do
      envs=()
      for kv in $v; do envs+=("MEGAMOE_SM90_$kv"); done
      # log names without '=': the device tool does not bring those back
      run_test "gpu_test_moe_compute ${v// /,}" "$out/gpu_test_moe_compute.${v//[ =+]/_}.log" "$t" \
        MEGAMOE_TEST_QUICK=1 "${envs[@]}"
    done
  fi
fi
if [[ " $steps " == *" sanitizer "* ]]; then
  # The quick compute set and the engine-only EP tests: NCCL's own kernels
  # under racecheck take minutes and are not ours to check. API errors are
  # not reported: NCCL probes kernel images with cudaFuncGetAttributes and
  # takes the "no kernel image" answers in its stride.
  # sanitize LABEL LOG [VAR=VALUE ...]: test binary $t under $tool, one row
  sanitize() {
    local label=$1 log=$2
    shift 2
    env MEGAMOE_TEST_QUICK=1 MEGAMOE_EP_TEST_ONLY=engine MEGAMOE_TEST_REPLAYS=3 "$@" \
      timeout 400 compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 \
      "$t" >"$log" 2>&1
    row "$label ($tool)" "rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
  }
  for t in $(for pat in ${GPU_SUITE_SANITIZE:-gpu_test_*}; do echo "$pack"/tests/$pat; done); do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    for tool in ${GPU_SUITE_SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
      sanitize "$name" "$out/$name.$tool.log"
      # The prefill path with one cluster walking every unit (its ring
      # wraps, narrow units follow wide ones): where racecheck's false
      # positive on a named barrier showed until the narrow units' exchange
      # moved to mbarriers (docs/RELIABILITY.md).
      if [ "$name" = gpu_test_moe_compute ] && [ "$tool" = racecheck ]; then
        sanitize "$name prefill GRID=3" "$out/$name.racecheck.prefill_grid3.log" \
          MEGAMOE_TEST_PATH=prefill MEGAMOE_SM90_GRID=3
      fi
    done
  done
  # That false positive in a probe built here (scripts/racecheck_probe.cu):
  # mask 8 (equal barrier counts per warpgroup) is clean and mask 24 was
  # reported with every value right; the rows say what this
  # compute-sanitizer does with it.
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  if [[ " ${GPU_SUITE_SANITIZE_TOOLS:-memcheck racecheck synccheck} " == *" racecheck "* ]] &&
    [ -x "$nvcc" ]; then
    probe=$out/racecheck_probe
    "$nvcc" -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o "$probe" \
      "$src/scripts/racecheck_probe.cu" >"$probe.build.log" 2>&1 || row "racecheck_probe" "build failed"
    for mask in 8 24; do
      [ -x "$probe" ] || break
      timeout 120 compute-sanitizer --tool racecheck "$probe" $mask >"$probe.$mask.log" 2>&1
      row "racecheck_probe $mask (racecheck)" "rc=$? $(grep -oE '[0-9]+ of [0-9]+ values wrong' "$probe.$mask.log") $(grep 'RACECHECK SUMMARY' "$probe.$mask.log" | tail -1)"
    done
  fi
  # The op's whole path through the ABI (load, GPU packing and requant,
  # plan, dispatch, compute, combine) under memcheck: megamoe-host on a
  # small checkpoint (16 experts, H 1024, I 512), both requant policies.
  small=/tmp/gpu_suite_small/ckpt
  mkdir -p "$(dirname "$small")"
  [ -e "$small" ] || "$pack/host/megamoe-synth" --out "$small" --layers 1 --hidden 1024 \
    --intermediate 512 --experts 16 --format nvfp4 --seed 3 --fast >"$out/small_synth.log" 2>&1
  host_cmd "$small" 1024 512 16 4
  for policy in none group16-to-group32; do
    timeout 300 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 99 \
      "${host_cmd[@]}" --set requant.policy=$policy --set num-max-tokens-per-rank=256 \
      --tokens 7,200 --iters 2 --warmup 1 --check-tokens 4 >"$out/host-$policy.memcheck.log" 2>&1
    row "megamoe-host $policy (memcheck)" "rc=$? $(grep 'ERROR SUMMARY' "$out/host-$policy.memcheck.log" | tail -1) $(grep -oE 'PASS|FAIL' "$out/host-$policy.memcheck.log" | tail -1)"
  done
fi
if [[ " $steps " == *" e2e "* ]]; then
  E2E_PREBUILT=$pack E2E_WORK=/tmp/e2e timeout ${GPU_SUITE_E2E_TIMEOUT:-900} "$src/scripts/e2e_smoke.sh" 2>&1 | tee "$out/e2e.log" | tail -12
  row "e2e_smoke" "$(tail -1 "$out/e2e.log")"
fi
if [[ " $steps " == *" layer "* ]]; then
  # Whole-layer latency per tokens-per-rank on the GLM-5 checkpoint.
  glm_ckpt
  lt=${GPU_SUITE_LAYER_TOKENS:-8,128,1024,8192}
  maxt=$(tr ',' '\n' <<<"$lt" | sort -n | tail -1)
  for policy in ${GPU_SUITE_LAYER_POLICIES:-none}; do
    timeout 600 "${glm_host[@]}" --set requant.policy=$policy --set num-max-tokens-per-rank=$maxt \
      --tokens "$lt" --iters 20 --warmup 3 --check-tokens 4 >"$out/layer-$policy.log" 2>&1
    row "layer latency ($policy, $gpus GPU)" "rc=$? $(grep -E 'PASS|FAIL' "$out/layer-$policy.log" | tail -1 | sed 's/.*rel_err/rel_err/')"
  done
fi
if [[ " $steps " == *" requant "* ]]; then
  # requant.policy group16-to-group32 on the GLM-5 checkpoint, the requant on
  # the host's cores and on the GPU (MEGAMOE_SM90_REQUANT): load time
  # (prepare=) and the check against the reference, each.
  # Rank 0's checked tokens also go to scripts/layer_oracle.py (2 of them).
  glm_ckpt
  for where in host gpu; do
    rm -f "$out/requant-$where.st" "$out/requant-$where.st.rank0"
    MEGAMOE_SM90_REQUANT=$where MEGAMOE_LOG_LEVEL=info timeout 600 "${glm_host[@]}" \
      --set requant.policy=group16-to-group32 --set num-max-tokens-per-rank=1024 --tokens 128,1024 \
      --iters 5 --warmup 1 --check-tokens 4 --dump-check "$out/requant-$where.st" \
      >"$out/requant-$where.log" 2>&1
    row "requant on the $where" "rc=$? $(grep -o 'prepare=[0-9.]*s' "$out/requant-$where.log" | head -1) $(grep -E 'PASS|FAIL' "$out/requant-$where.log" | tail -1 | sed 's/.*rel_err/rel_err/')"
    grep -m2 'requantized' "$out/requant-$where.log" | cut -c1-240
    st=$out/requant-$where.st
    [ -e "$st" ] || st=$st.rank0
    if [ -e "$st" ] && py=$("$src/scripts/numpy_python.sh"); then
      timeout 300 "$py" "$src/scripts/layer_oracle.py" --checkpoint "$ck" --dump "$st" \
        --requant group16-to-group32 --tolerance 0.02 --tokens 2 >"$out/requant-$where.oracle" 2>&1
      row "  layer_oracle ($where requant)" "rc=$? $(sed -n 's/.*\(operator rel [^,]*\).*/\1/p' "$out/requant-$where.oracle")"
    fi
  done
fi
if [[ " $steps " == *" mp "* ]]; then
  # The multi-process host: one process per GPU, rendezvous over loopback
  # (ranks in other processes: the CUDA IPC transport opens IPC handles).
  glm_ckpt
  timeout 300 "$src/scripts/mp_launch.sh" -n "$gpus" -d "$out/mp" -t 120 -- "${glm_host[@]}" \
    --set num-max-tokens-per-rank=4096 --set comm.timeout-ms=60000 --tokens 128,4096 \
    --iters 5 --warmup 1 --check-tokens 4 >"$out/mp.log" 2>&1
  row "multi-process host ($gpus ranks)" "rc=$? $(grep -E 'PASS|FAIL' "$out/mp.log" | tail -1 | cut -c1-150)"
fi
if [[ " $steps " == *" bench "* ]]; then
  for b in "$pack"/bench/${GPU_SUITE_BENCHES:-*}; do
    [ -x "$b" ] || continue
    name=$(basename "$b")
    args=$(tr ';' '\n' <<<"${GPU_SUITE_BENCH_ARGS:-}" | sed -n "s/^$name=//p")
    # shellcheck disable=SC2086
    timeout 400 "$b" $args >"$out/$name.log" 2>&1
    row "$name" "rc=$? (see $name.log)"
    tail -30 "$out/$name.log"
  done
fi
echo
echo "==== gpu_suite summary ===="
printf '%s\n' "${rows[@]}"

#!/bin/sh
# The command-line tools refuse a bad option value with exit code 2 and a
# message naming the option, instead of clamping it, ignoring it or running
# something other than what was asked; and megamoe-host checks a nonempty
# batch even when the first --tokens size is 0.
. "${MEGAMOE_SRCDIR:-..}/tests/tap.sh"
host=$b/host/megamoe-host
prep=$b/host/megamoe-prep
synth=$b/host/megamoe-synth
plugin=$b/plugin/.libs/libmegamoe_plugin.so
tap_start 7 "$host" "$prep" "$synth" "$plugin"
# refused PATTERN CMD...: exit code 2 and PATTERN on stderr
refused() {
  pat=$1
  shift
  "$@" >"$dir/out" 2>"$dir/err"
  rc=$?
  if [ $rc = 2 ] && grep -q -e "$pat" "$dir/err"; then return 0; fi
  echo "# rc=$rc for: $*"
  sed 's/^/#   /' "$dir/err" | head -3
  return 1
}

"$synth" --out "$dir/ck" --layers 2 --hidden 256 --intermediate 256 --experts 16 --quiet \
  >"$dir/out" 2>&1 || { sed 's/^/# /' "$dir/out"; echo "Bail out! megamoe-synth failed"; exit 1; }
run="$host --plugin $plugin --config $s/conf/megamoe.yaml --checkpoint $dir/ck --cpu
  --set model.hidden-size=256 --set model.moe-intermediate-size=256 --set model.num-experts=16
  --iters 1 --warmup 0"

bad=0
refused "tokens.*'-5'" $run --tokens -5 || bad=1
refused "tokens.*'7,abc'" $run --tokens 7,abc || bad=1
refused "tokens.*1 to 8" $run --tokens 1,2,3,4,5,6,7,8,9 || bad=1
refused "layers.*'0'" $run --layers 0 || bad=1
refused "iters.*'0'" $run --iters 0 || bad=1
refused "iters.*'5000'" $run --iters 5000 || bad=1
refused "warmup.*'-1'" $run --warmup -1 || bad=1
refused "world.*'0'" $run --world 0 || bad=1
refused "check-tokens.*'-1'" $run --check-tokens -1 || bad=1
refused "seed.*'x'" $run --seed x || bad=1
refused "tolerance.*'nan'" $run --tolerance nan || bad=1
refused "tolerance.*'abc'" $run --tolerance abc || bad=1
refused "tolerance.*'-1'" $run --tolerance -1 || bad=1
refused "set needs KEY=VALUE.*'foo'" $run --set foo || bad=1
refused "unknown argument '--bogus'" $run --bogus || bad=1
refused "unknown argument 'stray'" $run stray || bad=1
refused "--plugin needs a value" "$host" --plugin || bad=1
refused "dump-check .* needs --check-tokens" $run --check-tokens 0 --dump-check "$dir/d.st" || bad=1
refused "dump-check .* needs --check-tokens" $run --tokens 0 --dump-check "$dir/d.st" || bad=1
check "megamoe-host refuses bad option values, naming the option" $bad

refused "layers 3, but .* holds 2 layer" $run --layers 3
check "megamoe-host refuses --layers beyond the checkpoint's layers" $?

$run --tokens 0,16 >"$dir/out" 2>"$dir/err"
rc=$?
[ $rc = 0 ] && grep -q "rank 0: 8 sampled tokens vs cpu-reference" "$dir/err" &&
  grep -q "PASS .* rel_err=0 .*T0=.*T16=" "$dir/out"
st=$?
[ $st = 0 ] || sed 's/^/# /' "$dir/out" "$dir/err"
check "--tokens 0,16: the 16-token batch is the one checked" $st

# The check's tolerance: without --tolerance the larger of 0.02 and the
# bound the op reports (get_info, ABI 1.3; the reference's is 0); with it,
# the value given, said so.
grep -q "weight mode reference, error bound 0; the check's tolerance 0.02$" "$dir/err" &&
  grep -q "rel_err=0 (tol 0.02)" "$dir/out"
bad=$?
$run --tokens 16 --tolerance 0 >"$dir/out" 2>"$dir/err"
rc=$?
[ $rc = 0 ] && grep -q "error bound 0; the check's tolerance 0 (--tolerance)" "$dir/err" &&
  grep -q "PASS .* rel_err=0 (tol 0)" "$dir/out" || bad=1
[ $bad = 0 ] || sed 's/^/# /' "$dir/out" "$dir/err"
check "the check's tolerance: the op's reported bound, at least 0.02, unless --tolerance" $bad

$run --tokens 0 >"$dir/out" 2>"$dir/err"
rc=$?
[ $rc = 0 ] && grep -q "no token is checked" "$dir/err" && ! grep -q "rel_err" "$dir/out"
st=$?
[ $st = 0 ] || sed 's/^/# /' "$dir/out" "$dir/err"
check "--tokens 0: says nothing is checked, and the result line claims no error figure" $st

st="$dir/ck/model.safetensors"
bad=0
refused "unknown command 'frob'" "$prep" frob --in "$st" --out "$dir/o" || bad=1
refused "requant does not take '--gran'" "$prep" requant --in "$st" --out "$dir/o" --gran 16 || bad=1
refused "convert does not take '--bogus'" "$prep" convert --in "$dir/ck" --out "$dir/o" --bogus 1 || bad=1
refused "max-rel-error: bad value 'nan'" "$prep" requant --in "$st" --out "$dir/o" --max-rel-error nan || bad=1
refused "max-rel-error: bad value '-1'" "$prep" requant --in "$st" --out "$dir/o" --max-rel-error -1 || bad=1
refused "threads: bad value '-2'" "$prep" requant --in "$st" --out "$dir/o" --threads -2 || bad=1
refused "gran: bad value '8'" "$prep" sm100-layout --in "$st" --out "$dir/o" --gran 8 || bad=1
refused "--out needs a value" "$prep" requant --in "$st" --out || bad=1
[ -e "$dir/o" ] && { echo "# megamoe-prep wrote $dir/o although refused"; bad=1; }
check "megamoe-prep refuses unknown commands, foreign options and bad values" $bad

bad=0
refused "-n needs a rank count >= 1, not 'abc'" bash "$s/scripts/mp_launch.sh" -n abc -- true || bad=1
refused "-n needs a rank count >= 1, not '0'" bash "$s/scripts/mp_launch.sh" -n 0 -- true || bad=1
refused "-t needs seconds >= 1, not 'x'" bash "$s/scripts/mp_launch.sh" -n 2 -t x -- true || bad=1
check "mp_launch.sh refuses a bad rank count or timeout before starting anything" $bad

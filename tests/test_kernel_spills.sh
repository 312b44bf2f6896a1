#!/bin/sh
# No kernel keeps registers in local memory, apart from the listed ones:
# every ptxas report of the build (kernels/*.ptxas.log, -Xptxas -v) shows 0
# bytes of spill stores for each function except those that
# tests/kernel_spills.allow names, each with its most bytes and why (a spill
# outside every K loop, seen in the SASS). Issue 4 asks for no spills in
# the hot loops; a new spill fails here until its SASS is looked at.
# An allowed function that no longer spills fails too: drop its line.
# Where cuobjdump and python3 are found, the SASS of the kernel objects is
# read too (scripts/sass_check.py loops): no K loop may hold a local-memory
# instruction. No report may hold ptxas's notes of WGMMA serialization or
# injected warpgroup waits and arrives ((C75xx): C7511, C7514, C7517 and
# C7519 each marked a build tried and not kept, serialized or slower;
# docs/PERF.md, versions 3, 29, 31 and 37). Skips without the CUDA backend.
# MEGAMOE_PTXAS_LOGS: other logs to read.
b=${MEGAMOE_BUILDDIR:-.}
s=${MEGAMOE_SRCDIR:-$(dirname "$0")/..}
allow="$s/tests/kernel_spills.allow"
if ! grep -q '^#define MM_HAVE_CUDA 1' "$b/mm_build_config.h" 2>/dev/null; then
  echo "1..0 # SKIP built without the CUDA backend"
  exit 0
fi
logs=${MEGAMOE_PTXAS_LOGS:-$(ls "$b"/kernels/*.ptxas.log 2>/dev/null)}
echo "1..5"
if [ -z "$logs" ] || [ ! -f "$allow" ]; then
  echo "not ok 1 - ptxas reports in $b/kernels and $allow"
  exit 1
fi
n=$(cat $logs | grep -c 'Function properties for')
echo "ok 1 - ptxas reports: $n functions in $(echo $logs | wc -w) files"
# "name bytes" for every function with spill stores, against the allowed
# list in one pass: "bad NAME BYTES" for a spill it does not allow, "stale
# PATTERN" for an entry that matches no spill
spills=$(cat $logs | awk '/Function properties for/ { f = $NF }
  /bytes spill stores/ { if ($5 + 0 > 0) print f, $5 }' | sort -u)
verdict=$(echo "$spills" | awk -v allow="$allow" '
  BEGIN { while ((getline l < allow) > 0) if (l !~ /^#/ && split(l, a, " ") >= 2) most[a[1]] = a[2] }
  NF == 2 { ok = 0
            for (p in most) if (index($1, p)) { used[p] = 1; if ($2 + 0 <= most[p] + 0) ok = 1 }
            if (!ok) print "bad", $1, $2 }
  END { for (p in most) if (!(p in used)) print "stale", p }')
bad=$(echo "$verdict" | awk '$1 == "bad" { print "#   " $2 ": " $3 " bytes of spill stores" }')
if [ -n "$bad" ]; then
  echo "$bad"
  echo "not ok 2 - no spills outside tests/kernel_spills.allow"
  exit 1
fi
echo "ok 2 - no spills outside tests/kernel_spills.allow ($(echo "$spills" | grep -c .) allowed)"
stale=$(echo "$verdict" | awk '$1 == "stale" { print "#   " $2 }')
if [ -n "$stale" ]; then
  echo "$stale"
  echo "not ok 3 - every allowed entry still spills (drop the others)"
  exit 1
fi
echo "ok 3 - every allowed entry still spills"
objs=$(ls "$b"/kernels/.libs/*.o 2>/dev/null)
if ! command -v python3 >/dev/null; then
  echo "ok 4 # SKIP no python3 for the SASS"
elif [ -z "$objs" ]; then
  echo "not ok 4 - kernel objects in $b/kernels/.libs"
  exit 1
else
  # sass_check.py exits 77 without cuobjdump, 1 on local memory in a K loop
  out=$(for o in $objs; do
    python3 "$s/scripts/sass_check.py" loops "$o"; rc=$?
    echo "EXIT $rc $o"; [ $rc != 77 ] || break
  done)
  nk=$(echo "$out" | grep -c 'K loop')
  if echo "$out" | grep -q '^EXIT 77 '; then
    echo "ok 4 # SKIP no cuobjdump for the SASS"
  elif echo "$out" | grep -q '^EXIT [1-9]'; then
    echo "$out" | awk '/^EXIT/ { next } /^[^ ]/ { f = $1 } /local:/ { print "#   " f; print "#   " $0 }' |
      cut -c1-300
    echo "$out" | grep '^EXIT [1-9]' | sed 's/^/#   /'
    echo "not ok 4 - no local memory in the $nk K loops (SASS)"
    exit 1
  else
    echo "ok 4 - no local memory in the $nk K loops of $(echo $objs | wc -w) objects (SASS)"
  fi
fi
# ptxas's performance notes on the WGMMA pipeline, one line per function
notes=$(cat $logs | grep -o '(C75[0-9][0-9]).*' |
  sed -E "s/^\((C75[0-9][0-9])\).* in (the )?function '([^']*)'.*/\1 \3/" | sort | uniq -c)
if [ -n "$notes" ]; then
  echo "$notes" | cut -c1-300 | sed 's/^/#   /'
  echo "not ok 5 - no WGMMA serialization notes (C75xx) in the ptxas reports"
  exit 1
fi
echo "ok 5 - no WGMMA serialization notes (C75xx) in the ptxas reports"

#!/bin/sh
# megamoe-host as an engine would use it: plugin discovery from a directory
# (a broken and a foreign lib*_plugin.so are reported and skipped, a second
# copy of the op is refused), MEGAMOE_PLUGIN_PATH, and --validate with its
# FILE:LINE:COL errors.
. "${MEGAMOE_SRCDIR:-..}/tests/tap.sh"
host=$b/host/megamoe-host
plugin=$b/plugin/.libs/libmegamoe_plugin.so
tap_start 5 "$host" "$plugin"
mkdir "$dir/plugins"
cp "$plugin" "$dir/plugins/libmegamoe_plugin.so"
cp "$plugin" "$dir/plugins/libmegamoe2_plugin.so"
echo "not an ELF file" >"$dir/plugins/libbroken_plugin.so"
foreign=$(ldd "$host" | awk '/libuv|libyaml/ {print $3; exit}')
[ -n "$foreign" ] && cp "$foreign" "$dir/plugins/libforeign_plugin.so"

"$host" --plugin-dir "$dir/plugins" --list >"$dir/out" 2>"$dir/err"
rc=$?
ok=1
[ $rc = 0 ] && [ "$(grep -c '^megamoe_fp4 ' "$dir/out")" = 1 ] &&
  grep -q 'skipping .*libbroken_plugin.so' "$dir/err" &&
  grep -q 'already registered' "$dir/err" && ok=0
if [ -n "$foreign" ]; then grep -q 'skipping .*libforeign_plugin.so' "$dir/err" || ok=1; fi
[ $ok = 0 ] || { sed 's/^/# /' "$dir/out" "$dir/err"; }
check "plugin dir: op listed once, broken/foreign/duplicate reported and skipped" $ok

MEGAMOE_PLUGIN_PATH="/nonexistent:$dir/plugins" "$host" --list >"$dir/out" 2>"$dir/err"
grep -q '^megamoe_fp4 ' "$dir/out"
check "MEGAMOE_PLUGIN_PATH is scanned" $?

"$host" --plugin "$plugin" --config "$s/conf/megamoe.yaml" --validate >"$dir/out" 2>&1
check "--validate accepts conf/megamoe.yaml" $?

printf 'schema-version: 1\nmodel:\n  hidden-size: 6144\nep-sise: 2\n' >"$dir/bad.yaml"
"$host" --plugin "$plugin" --config "$dir/bad.yaml" --validate >"$dir/out" 2>&1
rc=$?
[ $rc != 0 ] && grep -q "bad.yaml:4:1: .*ep-sise.*ep-size" "$dir/out"
st=$?
[ $st = 0 ] || sed 's/^/# /' "$dir/out"
check "--validate reports FILE:LINE:COL and a suggestion" $st

"$host" --plugin "$plugin" --config "$dir/bad.yaml" --validate --set ep-size=3 >"$dir/out" 2>&1
[ $? != 0 ]
check "--validate fails on a bad override too" $?

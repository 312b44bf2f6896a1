# tap.sh -- sourced by the shell tests that drive the built programs:
#   . "${MEGAMOE_SRCDIR:-..}/tests/tap.sh"
#   tap_start N FILE...   prints the plan "1..N"; bails out unless every FILE exists
#   check DESCRIPTION STATUS   one TAP line (STATUS 0: ok); on failure the file
#                         named by $tap_show, if set and not empty, as comments
# Sets b (build directory), s (source directory) and dir (a temporary
# directory removed at exit).
b=${MEGAMOE_BUILDDIR:-.}
s=${MEGAMOE_SRCDIR:-..}
tap_show=
n=0
tap_start() {
  echo "1..$1"
  shift
  for f in "$@"; do
    [ -e "$f" ] || { echo "Bail out! $f is not built"; exit 1; }
  done
  dir=$(mktemp -d) || { echo "Bail out! mktemp failed"; exit 1; }
  trap 'rm -rf "$dir"' EXIT
}
check() {
  n=$((n + 1))
  if [ "$2" = 0 ]; then
    echo "ok $n - $1"
  else
    echo "not ok $n - $1"
    if [ -n "$tap_show" ] && [ -s "$tap_show" ]; then sed 's/^/# /' "$tap_show" | head -20; fi
  fi
}

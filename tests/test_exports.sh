#!/bin/sh
# The plugin exports its versioned entry point(s) and nothing else.
so="${MEGAMOE_BUILDDIR:-.}/plugin/.libs/libmegamoe_plugin.so"
echo "1..2"
if [ ! -f "$so" ]; then echo "not ok 1 - plugin built ($so missing)"; exit 1; fi
echo "ok 1 - plugin built"
syms=$(nm -D --defined-only "$so" | awk '{print $3}' | grep -v '^$' | sort)
extra=$(echo "$syms" | grep -v '^megamoe_plugin_init_v[0-9]*$' | grep -v '^$')
if [ -n "$extra" ] || ! echo "$syms" | grep -q '^megamoe_plugin_init_v1$'; then
  echo "# exported: $syms" | head -20
  echo "not ok 2 - only megamoe_plugin_init_v* exported"
  exit 1
fi
echo "ok 2 - only megamoe_plugin_init_v* exported ($syms)"

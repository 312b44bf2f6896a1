#!/bin/sh
# numpy_python.sh -- prints the first python3 that imports numpy (the one on
# PATH, then the system's /usr/bin/python3, where apt's python3-numpy goes);
# exit 1 when none does. For scripts/layer_oracle.py's callers.
for p in python3 /usr/bin/python3; do
  if "$p" -c 'import numpy' 2>/dev/null; then
    echo "$p"
    exit 0
  fi
done
exit 1

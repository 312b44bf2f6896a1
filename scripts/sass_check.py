#!/usr/bin/env python3
"""sass_check.py -- read the SASS of built kernels (a cubin, or an object such
as build/kernels/.libs/moe_sm90_wgmma.o) with cuobjdump.

  scripts/sass_check.py loops FILE [NAME_PART ...]
      per function: instructions, local-memory instructions (STL/LDL), and
      each innermost MMA loop (a backward branch over GMMAs that holds no
      other: the K loops) with the local-memory instructions inside it;
      issue 4 asks for none there. Exit status 1 when a K loop has any.
  scripts/sass_check.py diff FILE_A FILE_B
      which functions' SASS differs between two builds (addresses, encodings
      and the anonymous namespace's hash ignored): "SASS identical" claims of
      refactors, checked without a GPU.

cuobjdump comes with the CUDA toolkit; where it is missing, PyPI's
nvidia-cuda-cuobjdump wheel holds it (nvidia/cu13/bin/cuobjdump). Without
one, sass_check.py exits 77 (tests/test_kernel_spills.sh skips).
"""
import os
import re
import shutil
import subprocess
import sys

INSTR = re.compile(r'/\*([0-9a-f]{4,})\*/\s+([^;]*);')
BRANCH = re.compile(r'\bBRA(?:\.\w+)* (?:\w+, )?0x([0-9a-f]+)')
LOCAL = re.compile(r'\b(STL|LDL)\b')
# the anonymous namespace's mangled prefix differs with the source path
ANON = re.compile(r'_ZN\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}')


def cuobjdump():
    for c in (shutil.which('cuobjdump'), '/usr/local/cuda/bin/cuobjdump'):
        if c and os.access(c, os.X_OK):
            return c
    print('sass_check: no cuobjdump (CUDA toolkit, or PyPI nvidia-cuda-cuobjdump)',
          file=sys.stderr)
    sys.exit(77)  # the test suites' skip


def functions(path):
    """{name: [(address, instruction), ...]} of every function in path."""
    out = subprocess.run([cuobjdump(), '-sass', path], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f'sass_check: cuobjdump {path}: {out.stderr.strip()}')
    funcs = {}
    for chunk in re.split(r'\n\s*Function : ', out.stdout)[1:]:
        name = chunk.split('\n', 1)[0].strip()
        funcs[name] = [(int(a, 16), re.sub(r'\s+', ' ', t.strip()))
                       for a, t in INSTR.findall(chunk)]
    return funcs


def k_loops(ins):
    """(start, end, body) of each innermost MMA loop: a backward branch whose
    body holds a GMMA, and no smaller such loop inside or overlapping it (a
    back edge into the middle of a K loop is not another K loop)."""
    found = []
    for addr, text in ins:
        m = BRANCH.search(text)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            body = [x for x in ins if start <= x[0] <= addr]
            if any('GMMA' in t for _, t in body):
                found.append((start, addr, body))
    def smaller_overlap(o, l):
        return o is not l and len(o[2]) < len(l[2]) and o[0] <= l[1] and l[0] <= o[1]
    return [l for l in found if not any(smaller_overlap(o, l) for o in found)]


def loops(path, parts):
    bad = 0
    for name, ins in sorted(functions(path).items()):
        if parts and not any(p in name for p in parts):
            continue
        nlocal = sum(1 for _, t in ins if LOCAL.search(t))
        print(f'{name}: {len(ins)} instructions, {nlocal} local')
        for start, end, body in k_loops(ins):
            local = [f'{a:#x} {t}' for a, t in body if LOCAL.search(t)]
            mmas = sum(1 for _, t in body if 'GMMA' in t)
            print(f'  K loop {start:#x}-{end:#x}: {len(body)} instructions, {mmas} MMA'
                  + (', local: ' + '; '.join(local) if local else ''))
            bad += bool(local)
    return bad


def diff(path_a, path_b):
    def norm(funcs):
        return {ANON.sub('ANON', n): [re.sub(r'0x[0-9a-f]+', 'X', t) for _, t in ins]
                for n, ins in funcs.items()}
    a, b = norm(functions(path_a)), norm(functions(path_b))
    same = [n for n in a if a[n] == b.get(n)]
    print(f'{len(a)} / {len(b)} functions, {len(same)} identical')
    for n in sorted(set(a) | set(b)):
        if a.get(n) != b.get(n):
            print(f'  differs: {n} ({len(a.get(n, []))} -> {len(b.get(n, []))} instructions)')
    return len(set(a) | set(b)) - len(same)


def main(argv):
    if len(argv) >= 2 and argv[0] == 'loops':
        return 1 if loops(argv[1], argv[2:]) else 0
    if len(argv) == 3 and argv[0] == 'diff':
        return 1 if diff(argv[1], argv[2]) else 0
    sys.exit(__doc__)


if __name__ == '__main__':
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # piped into head
        sys.exit(0)

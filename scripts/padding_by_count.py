#!/usr/bin/env python3
"""padding_by_count.py -- how much MMA work the tile shapes add to the rows of
bench_moe_compute's loads, by count (no GPU; docs/PERF.md, version 40).

WGMMA's shapes pad an expert's rows: on the WGMMA path a tile's token columns
come in steps of 8 (the N of m64nNk32), and the FP8 modes' 32-wide mixed
kernels (21-59 rows per expert) run 32, 40 or 64 of them (Kern::kNarrow); on
the prefill path tokens are the M side, 64 rows per consumer warpgroup, so an
expert's last token tile costs 64 or 128 rows whatever it holds. This prints,
per M and load, the rows those shapes pay for over the rows there are, for
one EP8 rank of GLM-5 (32 local experts): the floor (steps of 8), and the
shapes of the path that runs at that average (the 32-wide mixed kernels at
21-49 rows per expert, where no pair runs; the prefill path from 704 rows,
mode 3's threshold; "-" elsewhere). The counts are the benchmark's own,
drawn as bench/expert_counts.c draws them (uniform, skewed, random: each
row's expert drawn by xorshift seeded with M, zipf: weight 1 / (e + 1));
tests/test_padding_by_count.sh checks this copy against that file's.

  scripts/padding_by_count.py [--M 1024,32768] [--experts 32] [--narrow 16,32]
"""
import argparse


def counts(M, E, load):
    if load == "uniform":
        return [M // E + (e < M % E) for e in range(E)]
    if load == "skewed":
        if E == 1:
            return [M]
        rest = M - M // 2
        return [M // 2] + [rest // (E - 1) + (e - 1 < rest % (E - 1)) for e in range(1, E)]
    zsum = sum(1.0 / (e + 1) for e in range(E))
    cnt = [0] * E
    rng = (0x9E3779B9 ^ M) & 0xFFFFFFFF
    for _ in range(M):
        rng ^= (rng << 13) & 0xFFFFFFFF
        rng ^= rng >> 17
        rng ^= (rng << 5) & 0xFFFFFFFF
        e = (rng * E) >> 32
        if load == "zipf":
            u = rng / 4294967296.0 * zsum
            acc, e = 1.0, 0
            while e < E - 1 and acc <= u:
                e += 1
                acc += 1.0 / (e + 1)
        cnt[e] += 1
    return cnt


def step8(m):
    """the fewest token columns an MMA can run for m rows"""
    return (m + 7) // 8 * 8


def mixed32(m):
    """the FP8 modes' 32-wide mixed kernels: an expert of at most 32 rows
    takes one 32-wide tile, a larger one 64-wide tiles (its last one, or its
    only one, with m64n40 MMAs when it holds at most 40 rows)"""
    if m <= 32:
        return 32 if m > 0 else 0
    cols = 0
    while m > 0:
        t = min(m, 64)
        cols, m = cols + (40 if t <= 40 else 64), m - t
    return cols


def prefill(m):
    """the prefill path: 128-row token tiles, a last tile of at most 64 rows
    on one warpgroup"""
    full, rest = divmod(m, 128)
    return 128 * full + (0 if rest == 0 else 64 if rest <= 64 else 128)


def prefill_narrow(most):
    """the prefill path with a last tile of at most `most` rows on m64n16
    (or, above 16 rows, m64n32) MMAs with the operands turned around, both
    warpgroups (docs/PERF.md, version 41: branch proto/pf-swap-tail)"""
    def f(m):
        full, rest = divmod(m, 128)
        if 0 < rest <= most:
            return 128 * full + (16 if rest <= 16 else 32)
        return prefill(m)
    return f


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--M", default="1024,32768", help="pool rows, comma-separated")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--narrow", metavar="L1,L2",
                    help="a further column: the prefill path with narrow last tiles of at most "
                         "L1 / L2 rows in the two GEMMs (16 or 32), weighted by their FLOPs "
                         "(L1 two thirds)")
    a = ap.parse_args()
    narrow = [int(x) for x in a.narrow.split(",")] if a.narrow else None
    if narrow and (len(narrow) != 2 or any(n not in (0, 16, 32) for n in narrow)):
        ap.error("--narrow takes two of 0, 16, 32")
    extra = " prefill, narrow last tiles |" if narrow else ""
    print("| M | load | rows per expert (min-max) | steps of 8 | 32-wide mixed kernels | prefill path |"
          + extra)
    print("|---|---|---|---|---|---|" + ("---|" if narrow else ""))
    for M in (int(x) for x in a.M.split(",")):
        for load in ("uniform", "random", "skewed", "zipf"):
            c = counts(M, a.experts, load)
            avg = M / a.experts

            def pct(f, runs=True):
                return "%+.1f%%" % (100.0 * (sum(f(m) for m in c) / M - 1)) if runs else "-"

            line = "| %d | %s | %d-%d | %s | %s | %s |" % (
                M, load, min(c), max(c), pct(step8), pct(mixed32, 21 <= avg <= 49),
                pct(prefill, avg >= 704))
            if narrow:
                n1, n2 = (prefill_narrow(n) for n in narrow)
                line += " %s |" % pct(lambda m: (2 * n1(m) + n2(m)) / 3, avg >= 704)
            print(line)


if __name__ == "__main__":
    main()

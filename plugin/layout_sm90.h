/* layout_sm90.h -- the weight layout of the sm_90a fused expert kernels
 * (kernels/moe_sm90*.cu) and its CPU reference transform from the canonical
 * mm_qmat. Index formulas: docs/LAYOUTS.md ("sm90 kernel layout").
 *
 * A matrix [rows, cols] is cut into 64-row x 128-column records. A record is
 * what one consumer warpgroup needs for one K-block of one WGMMA m64 tile:
 * 4096 bytes of packed E2M1 codes permuted so that thread t of the warpgroup
 * reads 2 x 16 contiguous bytes (its A-fragment rows, already in register
 * order), then the per-group scale bytes, then (FP8 modes) one power-of-two
 * reference exponent per row. FP4 stays packed: 0.5 byte per weight.
 *
 * The inline slot functions below are shared by the C transform and the CUDA
 * kernels, so both agree on every bit. */
#ifndef MM_LAYOUT_SM90_H
#define MM_LAYOUT_SM90_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "qmat.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  MM_WMODE_G32_FP8 = 1,        /* gran 32 UE8M0 folded exactly into E4M3, QGMMA */
  MM_WMODE_G16_BF16_EXACT = 2, /* gran 16 E4M3 scales, decode exact to 16 bit, HGMMA */
  MM_WMODE_G16_FP8 = 3,        /* gran 16, scale folded into E4M3 (lossy), QGMMA */
  MM_WMODE_G32_F16_EXACT = 4   /* gran 32 UE8M0, mode 1's records decoded to F16, HGMMA */
} mm_weight_mode;

#define MM_SM90_TILE_ROWS 64
#define MM_SM90_KBLOCK 128
#define MM_SM90_CODE_BYTES 4096
/* FP8 fold table: entry (k, j), k in [KMIN, KMAX], j in [0, 8): 8 bytes, byte
 * i = E4M3(RNE(e2m1 magnitude i * (1 + j/8) * 2^k)). Entry 0 (k = KMIN, j = 0)
 * is all zeros. */
#define MM_SM90_LUT_KMIN (-16)
#define MM_SM90_LUT_KMAX 9
#define MM_SM90_LUT_ENTRIES ((MM_SM90_LUT_KMAX - MM_SM90_LUT_KMIN + 1) * 8)
#define MM_SM90_LUT_INDEX(k, j) ((((k) - MM_SM90_LUT_KMIN) << 3) | (j))

#if defined(__CUDACC__)
#define MM_SM90_HD __host__ __device__ static inline
#else
#define MM_SM90_HD static inline
#endif

/* Mode 4 uses mode 1's records bit for bit (same packer, same slots); only
 * the kernels' MMA type differs. This is the mode whose records to build. */
MM_SM90_HD mm_weight_mode mm_sm90_record_mode(mm_weight_mode mode) {
  return mode == MM_WMODE_G32_F16_EXACT ? MM_WMODE_G32_FP8 : mode;
}
/* Scale bytes per row of a record: modes 1 / 4 one LUT index per 32-group
 * (4), mode 2 one E4M3 byte per 16-group (8), mode 3 one LUT index per
 * 16-group. */
MM_SM90_HD int mm_sm90_groups_per_row(mm_weight_mode mode) {
  return mm_sm90_record_mode(mode) == MM_WMODE_G32_FP8 ? 4 : 8;
}
MM_SM90_HD int mm_sm90_has_ref(mm_weight_mode mode) { return mode != MM_WMODE_G16_BF16_EXACT; }
/* codes + scales [64][groups] + (FP8 modes) int16 reference exponents [64];
 * as a constant expression for the kernels' compile-time strides. */
#define MM_SM90_RECORD_BYTES(groups, has_ref) \
  (MM_SM90_CODE_BYTES + 64 * (groups) + ((has_ref) ? 128 : 0))
MM_SM90_HD size_t mm_sm90_record_bytes(mm_weight_mode mode) {
  return (size_t)MM_SM90_RECORD_BYTES(mm_sm90_groups_per_row(mode), mm_sm90_has_ref(mode));
}
MM_SM90_HD size_t mm_sm90_scale_offset(void) { return MM_SM90_CODE_BYTES; }
MM_SM90_HD size_t mm_sm90_ref_offset(mm_weight_mode mode) {
  return MM_SM90_CODE_BYTES + 64u * (size_t)mm_sm90_groups_per_row(mode);
}
/* Records are ordered [row tile][K-block]. */
MM_SM90_HD size_t mm_sm90_matrix_bytes(mm_weight_mode mode, int rows, int cols) {
  return (size_t)(rows / 64) * (size_t)(cols / 128) * mm_sm90_record_bytes(mode);
}

/* The K order of modes 2, 3 and 4 inside each 32-column block: position p
 * of the WGMMA B operand (the activation copy, the intermediate) and of the
 * A fragments holds column mm_sm90_kperm_src(mode, p).
 *
 * Mode 2: the two F16 halves b of every A register hold a column of each
 * of the block's two 16-column groups (b = the group), so the scale pair of
 * a register is the pair of the block's two group scales: one conversion of
 * two adjacent scale bytes (instead of a byte permute and a conversion per
 * group). Thread q's positions 16t + 8j + 2q + b (k16 step t, register pair
 * j) hold column k = 16b + 4q + 2t + j: the two columns of a source byte
 * (4q + 2t + {0, 1}) stay in one thread's code word, as the packers need.
 * (Mode 4's order with the roles of bits 0 and 4 of k swapped.)
 *
 * Mode 4. Its A fragments are mode 1's FP8 k32 fragments converted
 * pairwise to F16 (cvt.rn.f16x2.e4m3x2) without moving data between threads:
 * FP8 register rr + 2h of thread q (row r, columns 16h + 4q .. +3) gives the
 * F16 registers rr + 2h of the two k16 HGMMA steps t = 0, 1 (columns 16h +
 * 4q + 2t, +1). In the k16 steps' own order those registers hold positions
 * 16t + 8h + 2q + b, b = 0, 1. So inside each 32-column block position p of
 * the F16 B operand (the activation copy, the intermediate) holds column
 *   k = 16h + 4q + 2t + b   for   p = 16t + 8h + 2q + b,
 * a bit permutation of the 5-bit index (p bits t h q1 q0 b, k bits h q1 q0 t
 * b).
 *
 * Mode 3 (FP8, 16-column groups): thread q's code word of a k32 step holds
 * its positions 4q .. 4q + 3 (low half) and 16 + 4q .. + 3 (high half);
 * position p = 16h + 4q + b holds column k = 8q + 4h + b, so that a word's
 * 8 columns, 8q .. 8q + 7, are one group's (q / 2): one fold-table entry
 * per word instead of one per half (p bits h q1 q0 b1 b0, k bits q1 q0 h b1
 * b0). Mode 1 (one 32-column group per k32 step): the identity. */
MM_SM90_HD int mm_sm90_kperm_src(mm_weight_mode mode, int p) {
  if (mode == MM_WMODE_G16_BF16_EXACT) {
    const int t = (p >> 4) & 1, j = (p >> 3) & 1, q = (p >> 1) & 3, b = p & 1;
    return (p & ~31) | (b << 4) | (q << 2) | (t << 1) | j;
  }
  if (mode == MM_WMODE_G16_FP8) {
    const int h = (p >> 4) & 1, q = (p >> 2) & 3;
    return (p & ~31) | (q << 3) | (h << 2) | (p & 3);
  }
  if (mode != MM_WMODE_G32_F16_EXACT) return p;
  const int t = (p >> 4) & 1, h = (p >> 3) & 1, q = (p >> 1) & 3, b = p & 1;
  return (p & ~31) | (h << 4) | (q << 2) | (t << 1) | b;
}
/* Inverse: the position of column k. */
MM_SM90_HD int mm_sm90_kperm_pos(mm_weight_mode mode, int k) {
  if (mode == MM_WMODE_G16_BF16_EXACT) {
    const int b = (k >> 4) & 1, q = (k >> 2) & 3, t = (k >> 1) & 1, j = k & 1;
    return (k & ~31) | (t << 4) | (j << 3) | (q << 1) | b;
  }
  if (mode == MM_WMODE_G16_FP8) {
    const int q = (k >> 3) & 3, h = (k >> 2) & 1;
    return (k & ~31) | (h << 4) | (q << 2) | (k & 3);
  }
  if (mode != MM_WMODE_G32_F16_EXACT) return k;
  const int h = (k >> 4) & 1, q = (k >> 2) & 3, t = (k >> 1) & 1, b = k & 1;
  return (k & ~31) | (t << 4) | (h << 3) | (q << 1) | b;
}

/* Where the code of (local row lr in [0,64), column kk in [0,128)) lives in
 * a record: byte offset of its 32-bit word, bit of the 3 magnitude bits,
 * bit of the sign. Thread t = 32w + 4g + q of the warpgroup owns rows
 * 16w+g and 16w+g+8 (A fragment rows) and 8 words: word u at
 * (u/4)*2048 + t*16 + (u%4)*4.
 *  FP8 modes and mode 4 (k32 step s = kk/32, MMA position kp = kk, in
 *    mode 3 mm_sm90_kperm_pos(mode, kk)): u = 2s + (row is
 *    the +8 one); the word holds positions 4q+b (+16 for the high half h); element b
 *    of the low half: magnitude at 4b, sign at 8b+7; of the high half:
 *    16+4b, sign 8b+3
 *    (decode: prmt(lut, w & 0x7777) | (w & 0x80808080), and the same on
 *    w >> 16 with (w << 4) & 0x80808080).
 *  mode 2 (MMA position kp = mm_sm90_kperm_pos(mode, kk), k16 step
 *    s = kp/16): u = 2*(s/2) + (row +8); lane hh (the word's 16-bit half)
 *    holds position 2q + hh + 8*jh of step s in slot o = 2*(s%2) + jh:
 *    magnitude at 16hh + {0, 3, 6, 9}[o], sign at 16hh + {13, 14, 12,
 *    15}[o], so that one or two shifts and masks of the word put both
 *    lanes' codes of slot o at F16 bits 9-11 and 15
 *    (mm_sm90_dec_f16_pair: 3, 3, 2 and 1 instructions for slots 0-3).
 *    Lane hh holds a column of the 32-column block's group hh
 *    (mm_sm90_kperm_pos), so a word's F16 pairs all take the scale pair of
 *    the block's two groups. */
MM_SM90_HD void mm_sm90_code_slot(mm_weight_mode mode, int lr, int kk, int *word_off,
                                  int *mag_bit, int *sign_bit) {
  int w = lr >> 4, g = lr & 7, rr = (lr >> 3) & 1, u, q;
  if (mode == MM_WMODE_G16_BF16_EXACT) {
    const int kp = mm_sm90_kperm_pos(mode, kk);
    int s = kp >> 4, kr = kp & 15, jh = kr >> 3, q8 = kr & 7, hh = q8 & 1;
    q = q8 >> 1;
    u = 2 * (s >> 1) + rr;
    int o = 2 * (s & 1) + jh;
    *mag_bit = 16 * hh + 3 * o;                        /* 0, 3, 6, 9 */
    *sign_bit = 16 * hh + ((0xFCED >> (4 * o)) & 15); /* 13, 14, 12, 15 */
  } else {
    /* mode 4's records are mode 1's (its K order is the HGMMA's view of them) */
    const int kp = mode == MM_WMODE_G16_FP8 ? mm_sm90_kperm_pos(mode, kk) : kk;
    int s = kp >> 5, kq = kp & 31, h = kq >> 4, kr = kq & 15, b = kr & 3;
    q = kr >> 2;
    u = 2 * s + rr;
    *mag_bit = h ? 16 + 4 * b : 4 * b;
    *sign_bit = h ? 8 * b + 3 : 8 * b + 7;
  }
  int t = 32 * w + 4 * g + q;
  *word_off = (u >> 2) * 2048 + t * 16 + (u & 3) * 4;
}

/* Mode 2's decode of slot o (0-3) of a code word: both 16-bit lanes'
 * codes as the F16 pair of e2m1 * 2^-14 (magnitude at bits 9-11, sign at
 * 15; mm_sm90_code_slot places them). Slots 2 and 3 take one shift and a
 * mask, or the mask alone. Slots 0 and 1 move magnitude and sign by
 * different amounts (9 and 2, 6 and 1): their bits, masked, times 2^a + 2^b
 * make both shifted copies in one multiply-add, and a second mask keeps the
 * wanted bits, 3 instructions where two shifts and two masks took 4 (mode 2
 * up to 3.7% faster at 256-4096 tokens on an H100: docs/PERF.md, version
 * 43). No two set bits of the copies meet in slot 0; in slot 1 one pair
 * does (bit 20), and its carry ends by bit 23, below every kept bit.
 * test_layout_sm90 checks every code of every slot against
 * mm_sm90_code_slot. */
MM_SM90_HD uint32_t mm_sm90_dec_f16_pair(uint32_t w, int o) {
  switch (o) {
    case 0: return ((w & 0x20072007u) * ((1u << 9) + (1u << 2))) & 0x8E008E00u;
    case 1: return ((w & 0x40384038u) * ((1u << 6) + (1u << 1))) & 0x8E008E00u;
    case 2: return (w << 3) & 0x8E008E00u;
    default: return w & 0x8E008E00u;
  }
}

/* Scale byte index (within the row's bytes) of column kk of a record. */
MM_SM90_HD int mm_sm90_group_of(mm_weight_mode mode, int kk) {
  return mm_sm90_record_mode(mode) == MM_WMODE_G32_FP8 ? kk >> 5 : kk >> 4;
}

/* Canonical row of layout row r. gate_up: w13 ([gate; up], rows = 2I):
 * layout tile t (64 rows) holds channels 32t..32t+31, gate and up rows
 * alternating in blocks of 8, so an accumulator thread owns a channel's gate
 * (row 16w+g) and up (row 16w+g+8). Otherwise the identity. */
MM_SM90_HD int mm_sm90_src_row(int r, int rows, int gate_up) {
  if (!gate_up) return r;
  int t = r >> 6, i = r & 63;
  int c = 32 * t + (i >> 4) * 8 + (i & 7);
  return ((i >> 3) & 1) ? rows / 2 + c : c;
}
/* Inverse for w13: layout row of channel c's gate (up = +8). */
MM_SM90_HD int mm_sm90_gate_row(int c) { return 64 * (c >> 5) + 16 * ((c >> 3) & 3) + (c & 7); }

/* 2^e as FP32 for e in [-149, 127] (exact, subnormals included); 0 below,
 * +inf above (as the WGMMA kernels' branchless form). */
MM_SM90_HD float mm_sm90_pow2(int e) {
  union { uint32_t u; float f; } v;
  if (e > 127) v.u = 0x7F800000u;
  else if (e >= -126) v.u = (uint32_t)(e + 127) << 23;
  else if (e >= -149) v.u = 1u << (e + 149);
  else v.u = 0;
  return v.f;
}

/* The compute workspace of the sm90 kernels for a pool of num_rows_max rows
 * (Mp = rows rounded up to 64, at least 64): byte offsets of its arrays,
 * each 256-aligned. The exact mode's F16 copy of the pool rows is not here:
 * it lives in the pool's output buffer (moe_compute.h, mm_expert_pool). */
typedef struct mm_sm90_ws_plan {
  int Mp;
  size_t xs_t;  /* FP32 [H/128][Mp] token scales, transposed */
  size_t act;   /* [Mp][I] intermediate: FP8 (modes 1, 3) or F16 (modes 2, 4,
                 * in mm_sm90_kperm order) */
  size_t as_t;  /* FP32 [I/128][Mp] intermediate scales, transposed */
  size_t bytes; /* total */
} mm_sm90_ws_plan;

/* Modes whose MMAs run in F16 (F16 activations and intermediate). */
MM_SM90_HD int mm_sm90_f16_mma(mm_weight_mode mode) {
  return mode == MM_WMODE_G16_BF16_EXACT || mode == MM_WMODE_G32_F16_EXACT;
}

MM_SM90_HD size_t mm_sm90_align256(size_t x) { return (x + 255) & ~(size_t)255; }

/* Mp: the pool's rows rounded up to 64, at least 64 */
MM_SM90_HD int mm_sm90_rows_padded(int num_rows_max) {
  const int mp = (num_rows_max + 63) / 64 * 64;
  return mp > 0 ? mp : 64;
}
MM_SM90_HD mm_sm90_ws_plan mm_sm90_workspace_plan(mm_weight_mode mode, int H, int I,
                                                  int num_rows_max) {
  mm_sm90_ws_plan w;
  w.Mp = mm_sm90_rows_padded(num_rows_max);
  const size_t Mp = (size_t)w.Mp;
  size_t off = 0;
  w.xs_t = off;
  off += mm_sm90_align256(sizeof(float) * (size_t)(H / 128) * Mp);
  w.act = off;
  off += mm_sm90_align256((mm_sm90_f16_mma(mode) ? 2u : 1u) * Mp * (size_t)I);
  w.as_t = off;
  off += mm_sm90_align256(sizeof(float) * (size_t)(I / 128) * Mp);
  w.bytes = off;
  return w;
}

/* The FP8 modes' prefill path (kernels/moe_sm90_prefill.cu): the average
 * rows per local expert from which it runs (AUTO) and from which a plan
 * holds its workspace region, each mode's crossover with the WGMMA kernels
 * (H200, sustained, GLM-5 at EP8, uniform and random loads; docs/PERF.md,
 * versions 26, 34 and 39). Mode 1: 2-4% slower than the WGMMA kernels at
 * 768, 4-8% faster at 896; since version 39's split of the 128+160 pair
 * level at 800-832 rows (2% slower on uniform loads of 800), 1.5-3.3%
 * faster at 896. Mode 3: since version 39 2.6-3% slower at 640 rows and
 * 1-3% at 672, level at 704 (version 34, before the split: at 640 5%
 * slower on uniform loads and 4% faster on random ones). */
#define MM_SM90_PREFILL_MIN_ROWS_G32 800
#define MM_SM90_PREFILL_MIN_ROWS_G16 704
MM_SM90_HD int mm_sm90_prefill_min_rows(mm_weight_mode mode) {
  return mode == MM_WMODE_G16_FP8 ? MM_SM90_PREFILL_MIN_ROWS_G16 : MM_SM90_PREFILL_MIN_ROWS_G32;
}
/* the most experts per launch pair */
#define MM_SM90_PREFILL_CHUNK 32
/* compute.prefill-experts' default: half the region of 32 (428 MB for
 * GLM-5 with the decode ahead's two w2 slots), 0.7-2% slower sustained on
 * the H200, and a plan at EP8 with 4096 tokens per rank stays at 1.36 GiB
 * per rank (1.73 with 32; docs/PERF.md, version 22 and "Memory per
 * rank"). */
#define MM_SM90_PREFILL_EXPERTS_DEFAULT 16
/* Decode ahead: once a launch's decoder warps have claimed all of its own
 * decode tasks, they take those of the next launch's first experts (at most
 * MM_SM90_PREFILL_AHEAD_MAX), so that the next launch starts on decoded
 * weights instead of every CTA waiting for its first expert. The slots
 * below keep what they write clear of what the running launch reads. */
#define MM_SM90_PREFILL_AHEAD_MAX 2
/* Where expert e (of a launch's chunk) keeps its decoded matrix in the
 * region, in slots of that matrix's size: w13 (2 I x H bytes) in slot
 * (e + ceil(chunk / 2)) % chunk, so that the first chunk / 2 experts sit
 * in the region's upper half, which no w2 slot overlaps (an L2 launch
 * decodes the next chunk's first w13 matrices there); w2 (I x H bytes, half
 * a w13 slot) in slot e, below that half, except experts below
 * MM_SM90_PREFILL_AHEAD_MAX, in slots 2 chunk + e past the w13 slots (an L1
 * launch, reading every w13 slot, decodes them). */
MM_SM90_HD int mm_sm90_prefill_slot(int gemm, int e, int chunk) {
  if (gemm == 1) return (e + (chunk + 1) / 2) % chunk;
  return e < MM_SM90_PREFILL_AHEAD_MAX ? 2 * chunk + e : e;
}
/* How many of the next launch's experts a launch may decode ahead into
 * free slots (next_gemm: the next launch's GEMM). */
MM_SM90_HD int mm_sm90_prefill_ahead_max(int next_gemm, int chunk) {
  return next_gemm == 1 ? chunk / 2 : MM_SM90_PREFILL_AHEAD_MAX;
}
/* The path's region after the plan's arrays, for E local experts, `chunk`
 * (1..MM_SM90_PREFILL_CHUNK) of them per launch pair: their decoded E4M3
 * weights (the w13 slots, 2 I x H bytes each, and the w2 slots past them,
 * I x H bytes each: mm_sm90_prefill_slot) and, per launch (two per chunk),
 * a finished-task count per expert and two claim counters (its own
 * decoders', and the previous launch's, which decodes ahead); then, per
 * pool row (Mp of them) that may start a token tile, the L1 warpgroup
 * units stored of that tile (an L2 launch, which may start before its L1
 * ends, reads a tile once all 2 x I / 128 of them are counted). */
MM_SM90_HD size_t mm_sm90_prefill_weight_bytes(int H, int I, int chunk) {
  return mm_sm90_align256(((size_t)chunk * 2 + MM_SM90_PREFILL_AHEAD_MAX) * (size_t)I *
                          (size_t)H);
}
MM_SM90_HD size_t mm_sm90_prefill_count_bytes(int E, int chunk) {
  const int chunks = (E + chunk - 1) / chunk;
  return sizeof(int) * 2 * (size_t)chunks * (MM_SM90_PREFILL_CHUNK + 2);
}
MM_SM90_HD size_t mm_sm90_prefill_tile_count_bytes(int num_rows_max) {
  return mm_sm90_align256(sizeof(int) * (size_t)mm_sm90_rows_padded(num_rows_max));
}
/* the region's parts as byte offsets from its start (the weights at 0) */
typedef struct {
  size_t count; /* the decode counts */
  size_t tiles; /* the token tiles' unit counts */
  size_t bytes; /* the whole region */
} mm_sm90_prefill_region;
MM_SM90_HD mm_sm90_prefill_region mm_sm90_prefill_region_layout(int E, int H, int I, int chunk,
                                                                int num_rows_max) {
  mm_sm90_prefill_region r;
  r.count = mm_sm90_prefill_weight_bytes(H, I, chunk);
  r.tiles = r.count + mm_sm90_align256(mm_sm90_prefill_count_bytes(E, chunk));
  r.bytes = r.tiles + mm_sm90_prefill_tile_count_bytes(num_rows_max);
  return r;
}
MM_SM90_HD size_t mm_sm90_prefill_region_bytes(int E, int H, int I, int chunk, int num_rows_max) {
  return mm_sm90_prefill_region_layout(E, H, I, chunk, num_rows_max).bytes;
}

/* The prefill path's work units of one expert of `tiles` token tiles, nt
 * column tiles, in clusters of cs CTAs (kernels/moe_sm90_prefill.cu;
 * docs/PERF.md, versions 23 and 28). The full sets (cs consecutive token
 * tiles, one per CTA, sharing one column tile whose weights each CTA
 * multicasts a 1 / cs of) go in raster groups of MM_SM90_PREFILL_RASTER_SETS
 * sets, each group walked set by set for every column tile in turn, so that
 * the units in flight share a few token and column tiles in L2. The last
 * tiles may be split: every CTA takes the tile with its own column tile,
 * copied whole. A last set of one tile is split; so is the last set when
 * the expert's last tile is small (small_last: at most half a tile of rows,
 * which one consumer warpgroup computes alone, in about half the time, when
 * no other CTA's copies hold it to a full tile's pace). Otherwise a last set
 * of more tiles (cs > 2) runs as a full set. */
#define MM_SM90_PREFILL_RASTER_SETS 8
/* the trailing tiles taken split */
MM_SM90_HD int mm_sm90_prefill_split_tiles(int tiles, int cs, int small_last) {
  const int rem = tiles % cs;
  if (cs == 1 || tiles == 0) return 0;
  if (rem == 1) return 1;
  return small_last ? (rem ? rem : cs) : 0;
}
MM_SM90_HD int mm_sm90_prefill_units(int tiles, int cs, int nt, int small_last) {
  const int ns = mm_sm90_prefill_split_tiles(tiles, cs, small_last), rest = tiles - ns;
  return rest / cs * nt + (rest % cs ? nt : 0) + ns * ((nt + cs - 1) / cs);
}
/* Unit v (0 .. mm_sm90_prefill_units - 1) of the expert for the CTA of
 * cluster rank `rank`: its token tile *mt and column tile *ct, and whether
 * it is split. A tile past the expert (*mt >= tiles) or a column past the
 * matrix (*ct >= nt) is work for nobody: the kernel re-reads a valid tile
 * and stores nothing. Every (token tile, column tile) pair is one unit's
 * for exactly one CTA (test_layout_sm90, test_prefill_units). */
MM_SM90_HD void mm_sm90_prefill_unit(int tiles, int cs, int nt, int small_last, int rank, int v,
                                     int *mt, int *ct, int *split) {
  const int ns = mm_sm90_prefill_split_tiles(tiles, cs, small_last);
  const int sets = (tiles - ns) / cs, g = MM_SM90_PREFILL_RASTER_SETS;
  *split = 0;
  if (v < sets * nt) {
    const int first = v / (g * nt) * g, gs = sets - first < g ? sets - first : g;
    const int w = v - first * nt;
    *mt = cs * (first + w % gs) + rank;
    *ct = w / gs;
  } else if (ns > 0) {
    const int w = v - sets * nt, cu = (nt + cs - 1) / cs;
    *mt = cs * sets + w / cu;
    *ct = cs * (w % cu) + rank;
    *split = 1;
  } else {
    *mt = cs * sets + rank;
    *ct = v - sets * nt;
  }
}

/* K blocks per decode task of the prefill path: a task decodes that many
 * K blocks of one 64-row tile of one expert (kernels/moe_sm90_prefill.cu).
 * A CTA copies none of an expert's weights before all of its tasks are
 * done, so each launch starts with every CTA waiting for its first
 * expert's decode, and a decoder warp walks its task's blocks one after
 * another. Tasks as many as the launch's `decoders` warps (rounded up to
 * whole K blocks, 2 to 16) let all of them decode the first expert at
 * once: GLM-5 at EP8 on 132 SMs (396 decoder warps) takes 8 for L1 (384
 * tasks an expert; 192 with 16, which left half the warps on the second
 * expert) and 4 for L2 (384; 96 with 16): 3.4-4% faster at M = 32768 on
 * even loads, 0.8-2.6% on routed ones. 4 in both ran level with it, 12
 * 2-3% slower, 2 up to 2% in mode 1; counts per K group, which let the
 * GEMM start on an expert's first blocks, 13-15% slower (docs/PERF.md,
 * version 44; the waits, not their proxy fences: the fifty-second stop). */
#define MM_SM90_PREFILL_TASK_KB_MAX 16
MM_SM90_HD int mm_sm90_prefill_task_kblocks(int kblocks, int row_tiles, int decoders) {
  if (decoders < 1) decoders = 1;
  const long work = (long)kblocks * row_tiles;
  const long kt = (work + decoders - 1) / decoders;
  return kt < 2 ? 2 : kt > MM_SM90_PREFILL_TASK_KB_MAX ? MM_SM90_PREFILL_TASK_KB_MAX : (int)kt;
}

/* The 128+160 launch pair's token tiles of an expert of m rows: how many
 * are 160 wide. They take the expert's first 160 a rows, and 128-wide
 * tiles the rest (mm_sm90_narrow_count), so one expert may take both
 * widths: 520 rows run as 160 + 3 x 128 instead of 5 x 128, whose last
 * tile of 8 rows decodes the weights once more for almost nothing. A
 * 160-wide work unit costs about 1.21 of a 128-wide one on the H200
 * (MM_SM90_COST_160; docs/PERF.md, version 10). a is the cheapest of 0-3
 * (four 160-wide tiles cover what five 128-wide ones do at 3% less, within
 * the estimate's error), taken where it saves at least MM_SM90_WIDE_SAVING
 * percent of the 128-wide tiles' cost: 129-160 rows take one 160-wide
 * tile, 257-288 160 + 128, 289-320 two 160-wide tiles, 520 160 + 3 x 128,
 * 1025-1056 160 + 7 x 128; 128, 256, 512 or 1024 rows 128-wide tiles
 * alone. Against whole experts of one width (version 38: 520 rows in 5 x
 * 128), routed loads at 384-512 rows per expert run 6-8% faster in modes
 * 1 and 2 and at 1024 3% (mode 2; modes 1 and 3 take the prefill path
 * there); a 10% threshold left that 3% out (docs/PERF.md, version 39). */
#define MM_SM90_COST_160 121
#define MM_SM90_WIDE_SAVING 5
MM_SM90_HD int mm_sm90_narrow_count(int m, int a) {
  const int rest = m - 160 * a;
  return rest > 0 ? (rest + 127) / 128 : 0;
}
MM_SM90_HD int mm_sm90_wide_count(int m) {
  if (m <= 0) return 0;
  const int n128 = (m + 127) / 128;
  int best = 0, cost = 100 * n128;
  for (int a = 1; a <= 3; a++) {
    const int c = MM_SM90_COST_160 * a + 100 * mm_sm90_narrow_count(m, a);
    if (c < cost) {
      best = a;
      cost = c;
    }
  }
  return 100 * cost <= (100 - MM_SM90_WIDE_SAVING) * 100 * n128 ? best : 0;
}

/* The WGMMA path's launch shape (mm_sm90_run_wgmma) for an average of avg
 * rows per local expert: the small experts' token tile, the second tile of
 * a launch pair (0: one launch; 128: 128-wide tiles for the experts above
 * 64 rows; 160: the 128+160 pair) and CTAs per SM. docs/CONFIG.md's table
 * of launch shapes is this function's (tests/test_layout_sm90.c). Small
 * tiles in the decode regime waste no MMA and promotion work; experts with
 * more rows than the tile get larger ones (mixed tiles,
 * kernels/moe_sm90_wgmma.cu's Kern::kBig, kMid). By average rows per
 * expert (docs/PERF.md, versions 3, 10, 14, 18, 35-37):
 * - FP8 modes and mode 2, <= 12: 16-wide tiles at two CTAs per SM (twice
 *   the warps to hide the decode's latency; FP8 modes 2-7% faster than one
 *   CTA on even and routed loads, 6-10% slower when one expert takes half
 *   of the rows; mode 2 7-9% faster even and routed, 4-11% slower skewed
 *   at 4-12 rows; mode 4 keeps one CTA: 2-5% faster, skewed up to 18%
 *   slower);
 * - FP8 modes, 13-20: 16-wide tiles at one CTA, 32-wide ones for the
 *   experts above 16 rows. Routed loads put a sixth to half of the experts
 *   there, whose weights the two-CTA kernels decode twice: at 14-16 rows
 *   routed 16-22% faster, skewed 4-11%, even loads 2-4% slower; at 17-20
 *   against 32-wide tiles routed 1-3% and skewed 9-13% faster;
 * - mode 2 at 13-22 and mode 4 at <= 22: 16-wide tiles at one CTA, 32-wide
 *   ones for the larger experts (mode 2's with m64n24 MMAs up to 24 rows;
 *   mode 4's as middle tiles). Against the 32-wide kernels at 17-22 rows
 *   mode 2 5-7% faster on even loads, 2-10% routed and 5-12% skewed; mode
 *   4 level on even loads, 1% slower to 5% faster routed and 9-13% faster
 *   skewed; at 23-24 rows mode 2 routed 6-9% slower (docs/PERF.md,
 *   version 36);
 * - FP8 modes 21-59, F16 modes 23-59: 32-wide tiles, 64-wide ones for the
 *   larger experts (in the F16 modes 48-wide middle tiles first: at 34-48
 *   rows 11-12% faster than 64-wide tiles on even loads, 13-16% skewed;
 *   at 49-56, whose large tiles run m64n56 MMAs, 4-7% even, 1-6% routed
 *   and 13-19% skewed, at 59 up to 4% slower on even loads; in the FP8
 *   modes, whose large tiles of 33-40 rows run m64n40 MMAs, at 34-40 rows
 *   11-16% faster on even loads and 7-15% routed, at 44-60 within 1% even
 *   and 1% slower to 4% faster routed, skewed loads 13-17% faster
 *   throughout; against the 64+128 pair at 60-64 routed loads 6-9%
 *   slower in all modes: docs/PERF.md, version 35), from 50 rows in the
 *   32+128 pair (below);
 * - 60-64 and 77-112: the 64+128 launch pair, 128-wide tiles for the
 *   experts above 64 rows (at 60-64 routed 6-11% faster than 64-wide
 *   alone, even loads 1-4% slower: the empty launch; at 66-104 against the 128+160 pair
 *   routed -9 to +3%, even loads -4 to +2%, skewed 17-26% faster: its
 *   small experts take 64-wide tiles, not 128; at 105-112 skewed 23-26%
 *   faster, even and routed loads within 2% (version 36); at 116-128
 *   routed 10-43% slower, where experts above 128 rows take two 128-wide
 *   tiles and decode their weights twice; with narrow second halves
 *   still 11-27% at 120-128, version 37);
 * - 50-59 and 65-76: the 32+128 pair, the experts of at most 64 rows on
 *   the 32-wide kernels, the others on 128-wide tiles. At 65-76 the
 *   32-wide tiles and m64n40 MMAs fit the small experts of a skewed load
 *   (about 30-40 rows): skewed loads 4-9% faster than on the 64+128 pair,
 *   even loads level (every expert is on the 128-wide launch), routed
 *   ones 0-2% slower; at 60-64 even loads 1-4% slower (their experts take
 *   the mixed kernels' 64-wide tiles), at 80 skewed loads in the FP8 modes
 *   1-3% slower (small experts of 41 rows take 64-wide tiles there too;
 *   docs/PERF.md, version 37). At 50-59 against the 32-wide kernels alone
 *   routed loads 4-7% faster (their experts above 64 rows take one
 *   128-wide tile, not two 64-wide ones that decode the weights twice),
 *   skewed 1-5%, even loads 0-2% slower (the empty launch), in the F16
 *   modes at 57-59 (were 64-wide tiles) routed 5-6%, skewed 10-11%
 *   faster, even loads 3-4% slower; at 40-48 routed loads 1-3% slower
 *   (version 38);
 * - above 112: the 128+160 pair (run_mode's BS2): each expert's rows go to
 *   160- and 128-wide tiles, whichever cover them with less waste
 *   (mm_sm90_wide_count); 128-wide tiles halve the decode work per MMA
 *   against 64-wide ones, 17-24% faster from 96 rows per expert up. */
typedef struct mm_sm90_launch {
  int tile;        /* the small experts' token tile: 16, 32, 64 or 128 */
  int pair;        /* the launch pair's second tile: 0, 128 or 160 */
  int ctas_per_sm; /* 1, or 2 (16-wide tiles only) */
} mm_sm90_launch;
MM_SM90_HD mm_sm90_launch mm_sm90_launch_rule(mm_weight_mode mode, int avg) {
  const int fp8 = mode == MM_WMODE_G32_FP8 || mode == MM_WMODE_G16_FP8;
  mm_sm90_launch s;
  s.tile = avg <= (fp8 ? 20 : 22)                 ? 16
           : avg <= 59 || (avg >= 65 && avg <= 76) ? 32
           : avg <= 112                            ? 64
                                                   : 128;
  s.ctas_per_sm = (fp8 || mode == MM_WMODE_G16_BF16_EXACT) && avg <= 12 ? 2 : 1;
  /* 64-wide tiles always with the 128-wide launch, 32-wide ones from 50 */
  s.pair = s.tile == 128 ? 160 : s.tile == 64 || avg >= 50 ? 128 : 0;
  return s;
}

/* Builds the fold table (MM_SM90_LUT_ENTRIES x 8 bytes). */
void mm_sm90_lut_table(uint8_t table[MM_SM90_LUT_ENTRIES][8]);

/* Packs m into dst (mm_sm90_matrix_bytes bytes) and writes the FP32 row
 * factor of every layout row into row_scale (rows floats). gate_up selects
 * the w13 row order. Modes 1 / 4 need gran 32 UE8M0 (same records), modes
 * 2 / 3 gran 16 E4M3.
 * Mode 1 is exact or fails (naming row and K-block) when a 128-column block
 * of a row holds groups whose exponents are too far apart for one FP8 fold.
 * Mode 1's row anchor: a row whose groups all fold against one reference
 * exponent R (and whose factor times 2^R is exact in FP32) gets reference 0
 * in every block and row factor = source factor * 2^R; other rows keep a
 * reference per block and the source factor.
 * If fold_err is not NULL it receives, for mode 3, sum (w_folded - w)^2 and
 * sum w^2 over the matrix (mode 1/2: the same sums, which are 0 / exact). */
/* The shape/format checks of the packers (same messages for every path). */
mm_err *mm_sm90_check_matrix(const mm_qmat *m, mm_weight_mode mode, int gate_up);

mm_err *mm_sm90_pack_matrix(const mm_qmat *m, mm_weight_mode mode, int gate_up, uint8_t *dst,
                            float *row_scale, double fold_err[2]);

/* Whether a row factor can carry a row anchor 2^R: row_scale * 2^R finite
 * and exact in FP32 (every packer's row anchors, modes 1 and 3). */
MM_SM90_HD int mm_sm90_anchor_fits(float row_scale, int R) {
  const float f = ldexpf(row_scale, R);
  return isfinite(f) && ldexpf(f, -R) == row_scale;
}

/* The weight the kernels use at layout row r, column k, without the row
 * factor: mode 1/3 E4M3 fold byte * 2^ref, mode 2 e2m1 * E4M3 scale. */
float mm_sm90_weight(const uint8_t *blob, mm_weight_mode mode, int rows, int cols, int r, int k);

#ifdef __cplusplus
}
#endif
#endif

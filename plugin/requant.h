/* requant.h -- group-16 -> group-32 UE8M0 requantization of FP4 weights, the
 * CPU reference (the GPU kernel in kernels/prep.h produces the same bytes).
 *
 * Semantics (../shared/golden/README.md, bit for bit):
 *   source value  v = f32(f32(e2m1(c) * s16) * row_scale)
 *                 s16 = e4m3(b) (NVFP4) or 2^(b-127) (UE8M0), row_scale = the
 *                 NVFP4 global weight_scale_2 of the row (1 otherwise);
 *                 a non-finite v is an error, never an output.
 *   per 32 k:     amax = max|v|; amax == 0 -> byte 127, codes 0; else E = the
 *                 smallest integer with amax / 2^E <= 6, clamped to [-127, 127],
 *                 byte = E + 127, code = e2m1 RNE of v / 2^E (zero -> code 0).
 * The requant is lossy; every call measures the error of the dequantized
 * result against v (double precision sums, row order: deterministic for any
 * thread count). */
#ifndef MM_REQUANT_H
#define MM_REQUANT_H

#include <stddef.h>
#include <stdint.h>

#include "qmat.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mm_requant_stats {
  double src_sq;  /* sum of v^2 */
  double err_sq;  /* sum of (v - dequant)^2 */
  double max_abs; /* max |v - dequant| */
  double rel_rms; /* sqrt(err_sq / src_sq); 0 for an all-zero source */
  int64_t count;  /* elements */
} mm_requant_stats;

/* acc += s (sums, max, count), then recomputes acc->rel_rms. */
void mm_requant_stats_merge(mm_requant_stats *acc, const mm_requant_stats *s);

/* NULL when st's relative RMS is at most max_rel_error (requant.max-rel-error),
 * else INVALID_ARGUMENT naming `name` ("experts.3.up_proj"): the loader's
 * words, wherever the requant ran. */
mm_err *mm_requant_limit_error(const char *name, const mm_requant_stats *st,
                               double max_rel_error);

/* A group-16 source matrix, rows x cols (cols % 32 == 0), raw arrays. */
typedef struct mm_g16_source {
  int rows, cols;
  mm_scale_format sf;     /* MM_SF_E4M3 (NVFP4) or MM_SF_UE8M0 */
  const uint8_t *codes;   /* [rows, cols/2], element 2j in the low nibble */
  const uint8_t *scales;  /* [rows, cols/16] */
  const float *row_scale; /* [rows]; NULL = all 1 */
} mm_g16_source;

/* Rows row0 .. row0 + rows - 1 of a canonical group-16 matrix (gran 16) as
 * a source: a whole matrix, or one projection of w13 (gate: 0, I; up: I, I). */
static inline mm_g16_source mm_g16_rows(const mm_qmat *m, int row0, int rows) {
  const size_t r0 = (size_t)row0;
  const mm_g16_source s = {rows,
                           m->cols,
                           m->sf,
                           m->codes + r0 * (size_t)(m->cols / 2),
                           m->scales + r0 * (size_t)(m->cols / 16),
                           m->row_scale ? m->row_scale + r0 : NULL};
  return s;
}

/* Requantizes `src` into codes_out [rows, cols/2] and scales_out
 * [rows, cols/32] (UE8M0 bytes). threads: 0 = all cores. stats may be NULL.
 * INVALID_ARGUMENT for bad shapes or a non-finite source value (the message
 * names row and element range); outputs are then unspecified. */
mm_err *mm_requant_g16_to_g32(const mm_g16_source *src, uint8_t *codes_out,
                              uint8_t *scales_out, int threads,
                              mm_requant_stats *stats);

/* Same on a canonical matrix (gran 16, E4M3 or UE8M0, any row_scale):
 * allocates *dst (gran 32, UE8M0, row_scale 1). On error *dst is left empty
 * (all pointers NULL). */
mm_err *mm_requant_qmat(const mm_qmat *src, int threads, mm_qmat *dst,
                        mm_requant_stats *stats);

/* The kernel of the requant: 32 source values -> UE8M0 byte (returned) and
 * 16 packed code bytes. Values must be finite. */
uint8_t mm_requant_group32(const float v[32], uint8_t codes[16]);

/* UE8M0 exponent byte for a group maximum amax > 0 (finite): E + 127 with E
 * the smallest integer such that amax / 2^E <= 6, clamped to [0, 254]. */
static inline uint8_t mm_requant_exp_byte(uint32_t amax_bits) {
  int ex = (int)((amax_bits >> 23) & 0xFF);
  uint32_t man = amax_bits & 0x7FFFFF;
  if (ex == 0) return 0; /* subnormal amax: E < -127, clamped */
  /* amax = 1.m * 2^(ex-127): <= 1.5 * 2^e -> 6 * 2^(e-2), else 6 * 2^(e-1). */
  int b = man <= 0x400000 ? ex - 2 : ex - 1;
  return (uint8_t)(b < 0 ? 0 : b > 254 ? 254 : b);
}

/* E2M1 code of x (|x| <= 6 expected), round to nearest, ties to even code;
 * a zero magnitude gives code 0. Same comparisons as mm_float_to_e2m1. */
static inline uint8_t mm_requant_e2m1_rne(float x) {
  float m = x < 0.0f ? -x : x;
  uint8_t c = (uint8_t)((m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) +
                        (m > 2.5f) + (m >= 3.5f) + (m > 5.0f));
  return (uint8_t)(c != 0 && x < 0.0f ? c | 8 : c);
}

#ifdef __cplusplus
}
#endif
#endif

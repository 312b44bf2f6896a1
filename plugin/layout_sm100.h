/* layout_sm100.h -- DeepGEMM's SM100 MegaMoE weight layout (export for
 * Blackwell users) and its inverse, CPU reference. docs/LAYOUTS.md has the
 * formulas; kernels/prep.h has the GPU version (same bytes).
 *
 * Per layer of E experts, hidden H, intermediate I, group size g (16 or 32):
 *   canonical in:  w13 U8 [E, 2I, H/2] (rows [gate | up]), s13 UE8M0 bytes
 *                  [E, 2I, ceil(H/g)], w2 U8 [E, H, I/2], s2 [E, H, ceil(I/g)]
 *   sm100 out:     w13 rows interleaved by 8 (gate 0-7, up 0-7, gate 8-15, ...),
 *                  w2 unchanged, scales as int32 words of 4 UE8M0 bytes (byte j
 *                  = group 4p+j, missing groups 0), MN-major and TMA-aligned:
 *                  word (e, q, p) at e*P*MNa + p*MNa + q, P = ceil(SFK/4),
 *                  MNa = align(MN, 4); L1 rows interleaved like w13, then (L1
 *                  and L2) the UTCCP transpose inside 128-row chunks: row r
 *                  moves to 128*(r/128) + 4*(r%32) + (r%128)/32.
 * Requirements (DeepGEMM's): I % 64 == 0 (2I % 128 for the transpose, I % 8
 * for the interleave), H % 128 == 0. */
#ifndef MM_LAYOUT_SM100_H
#define MM_LAYOUT_SM100_H

#include <stddef.h>
#include <stdint.h>

#include "qmat.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mm_sm100_shape {
  int E, H, I, gran;
} mm_sm100_shape;

/* Canonical arrays of one layer (see above). Scale bytes are UE8M0. */
typedef struct mm_sm100_canon {
  uint8_t *w13, *s13, *w2, *s2;
} mm_sm100_canon;

/* The exported layer: weights as bytes, scales as flat int32 word storage. */
typedef struct mm_sm100_packed {
  uint8_t *w13;
  int32_t *s13;
  uint8_t *w2;
  int32_t *s2;
} mm_sm100_packed;

/* INVALID_ARGUMENT naming the first violated requirement. */
mm_err *mm_sm100_check_shape(const mm_sm100_shape *s);

static inline int mm_sm100_sfk(int k, int gran) { return (k + gran - 1) / gran; }
static inline int mm_sm100_packed_k(int sfk) { return (sfk + 3) / 4; }
static inline int mm_sm100_tma_mn(int mn) { return (mn + 3) & ~3; }
/* Element counts of the arrays. */
size_t mm_sm100_w13_bytes(const mm_sm100_shape *s); /* E * 2I * H/2 */
size_t mm_sm100_w2_bytes(const mm_sm100_shape *s);  /* E * H * I/2 */
size_t mm_sm100_s13_bytes(const mm_sm100_shape *s); /* canonical: E * 2I * SFK13 */
size_t mm_sm100_s2_bytes(const mm_sm100_shape *s);
size_t mm_sm100_s13_words(const mm_sm100_shape *s); /* packed: E * P13 * MNa13 */
size_t mm_sm100_s2_words(const mm_sm100_shape *s);

/* Interleaved L1 position of canonical row r (rows [gate | up], I each). */
static inline int mm_sm100_interleave_pos(int r, int I) {
  int up = r >= I, rr = up ? r - I : r;
  return 16 * (rr / 8) + 8 * up + rr % 8;
}
/* Destination row of row r in the UTCCP 4x32 transpose (128-row chunks). */
static inline int mm_sm100_utccp_row(int r) {
  return (r & ~127) + 4 * (r % 32) + (r % 128) / 32;
}

/* Canonical -> sm100 (all outputs fully written, padding 0). threads: 0 =
 * all cores. */
mm_err *mm_sm100_export(const mm_sm100_shape *s, const mm_sm100_canon *in,
                        const mm_sm100_packed *out, int threads);
/* sm100 -> canonical; INVALID_ARGUMENT if a padding byte is not 0. */
mm_err *mm_sm100_import(const mm_sm100_shape *s, const mm_sm100_packed *in,
                        const mm_sm100_canon *out, int threads);

/* FP32 scales (powers of two, as DeepGEMM's transform takes them) -> UE8M0
 * bytes: the exponent field. A value with the sign or any mantissa bit set,
 * or an exponent of 255 (inf/NaN), is an error naming `what` and the index
 * (DeepGEMM's kernel traps on those). 0.0 maps to byte 0 like DeepGEMM. */
mm_err *mm_f32_scales_to_ue8m0(const float *in, size_t n, uint8_t *out, const char *what);

/* Gathers num_local canonical experts (UE8M0 scales, row_scale all 1, equal
 * shapes) into freshly allocated layer arrays (free with
 * mm_sm100_canon_free) and fills *shape. */
mm_err *mm_sm100_canon_from_experts(const mm_expert_q *experts, int num_local,
                                    mm_sm100_shape *shape, mm_sm100_canon *out);
void mm_sm100_canon_free(mm_sm100_canon *c);

#ifdef __cplusplus
}
#endif
#endif

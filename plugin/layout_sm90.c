/* layout_sm90.c -- CPU reference transform: canonical mm_qmat -> sm90 kernel
 * records (see layout_sm90.h and docs/LAYOUTS.md ("sm90 kernel layout")). */
#include "layout_sm90.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "formats.h"
#include "parallel.h"

static const float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

void mm_sm90_lut_table(uint8_t table[MM_SM90_LUT_ENTRIES][8]) {
  for (int k = MM_SM90_LUT_KMIN; k <= MM_SM90_LUT_KMAX; k++)
    for (int j = 0; j < 8; j++)
      for (int i = 0; i < 8; i++)
        table[MM_SM90_LUT_INDEX(k, j)][i] =
            mm_float_to_e4m3(kMag[i] * (1.0f + (float)j / 8.0f) * ldexpf(1.0f, k));
}

static int code_at(const mm_qmat *m, int r, int k) {
  return mm_fp4_get(m->codes + (size_t)r * (size_t)(m->cols / 2), (size_t)k);
}

/* Mode 1: is every nonzero code of (row r, group gi) exact at shift s? */
static int g32_group_exact(const mm_qmat *m, const uint8_t lut[][8], int r, int gi, int s) {
  if (s < MM_SM90_LUT_KMIN || s > MM_SM90_LUT_KMAX) return 0;
  const uint8_t *e = lut[MM_SM90_LUT_INDEX(s, 0)];
  for (int k = gi * 32; k < gi * 32 + 32; k++) {
    int c = code_at(m, r, k) & 7;
    if (c && mm_e4m3_to_float(e[c]) != ldexpf(kMag[c], s)) return 0;
  }
  return 1;
}

static int group_nonzero(const mm_qmat *m, int r, int gi) {
  for (int k = gi * m->gran; k < (gi + 1) * m->gran; k++)
    if (code_at(m, r, k) & 7) return 1;
  return 0;
}

/* Mode 1: the smallest reference exponent of K block kb of source row r for
 * which every nonzero group folds exactly (the largest anchor shift s_top);
 * returns 1 with *ref, 0 when the block has no nonzero group, -1 when no
 * shift folds every group. */
static int g32_block_ref(const mm_qmat *m, const uint8_t lut[][8], int r, int kb, int *ref) {
  const uint8_t *sc = m->scales + (size_t)r * (size_t)(m->cols / 32);
  int emax = -1;
  for (int gi = kb * 4; gi < kb * 4 + 4; gi++)
    if (group_nonzero(m, r, gi) && sc[gi] > emax) emax = sc[gi];
  if (emax < 0) return 0;
  for (int s = MM_SM90_LUT_KMAX; s >= 0; s--) {
    int ok = 1;
    for (int gi = kb * 4; gi < kb * 4 + 4 && ok; gi++)
      if (group_nonzero(m, r, gi)) ok = g32_group_exact(m, lut, r, gi, s - (emax - sc[gi]));
    if (ok) {
      *ref = (emax - 127) - s;
      return 1;
    }
  }
  return -1;
}

/* Mode 1 row anchor: one reference exponent for all K blocks of source row
 * r, the largest of the blocks' own (so the smallest that can serve them
 * all), if every nonzero group of the row folds exactly relative to it and
 * the row factor times 2^ref is exact in FP32. The row factor then carries
 * 2^ref and every block's stored reference is 0, which lets the kernels
 * skip the per-block reference multiply. Returns 1 with *R, else 0 (the
 * blocks keep their own references). */
static int g32_row_anchor(const mm_qmat *m, const uint8_t lut[][8], int r, int *R) {
  const uint8_t *sc = m->scales + (size_t)r * (size_t)(m->cols / 32);
  for (int gi = 0; gi < m->cols / 32; gi++)
    if (sc[gi] == 0xFF) return 0; /* NaN: the per-block path reports it */
  int best = 0, any = 0;
  for (int kb = 0; kb < m->cols / 128; kb++) {
    int ref, st = g32_block_ref(m, lut, r, kb, &ref);
    if (st < 0) return 0;
    if (st > 0 && (!any || ref > best)) best = ref;
    any |= st > 0;
  }
  for (int gi = 0; gi < m->cols / 32; gi++)
    if (group_nonzero(m, r, gi) && !g32_group_exact(m, lut, r, gi, sc[gi] - 127 - best)) return 0;
  if (!mm_sm90_anchor_fits(m->row_scale[r], best)) return 0;
  *R = best;
  return 1;
}

/* Mode 3: the scale magnitudes of K block kb of source row r (0 for a group
 * with no nonzero code) and their sign flips; -1 at a NaN scale (group in
 * *bad). */
static int g16_block_scales(const mm_qmat *m, int r, int kb, float sabs[8], uint8_t flip[8],
                            int *bad) {
  for (int g = 0; g < 8; g++) {
    const int gi = kb * 8 + g;
    const uint8_t b = m->scales[(size_t)r * (size_t)(m->cols / 16) + (size_t)gi];
    if (mm_e4m3_is_nan(b)) {
      *bad = gi;
      return -1;
    }
    sabs[g] = group_nonzero(m, r, gi) ? fabsf(mm_e4m3_to_float(b)) : 0.0f;
    flip[g] = (b & 0x80) ? 8 : 0;
  }
  return 0;
}

/* Mode 3: a block's reference exponent, the smallest r with
 * max_g |s_g| * 6 <= 448 * 2^r (0 for a block without nonzero groups). */
static int g16_block_rexp(const float sabs[8]) {
  float smax = 0.0f;
  for (int g = 0; g < 8; g++)
    if (sabs[g] > smax) smax = sabs[g];
  if (smax == 0.0f) return 0;
  int rexp = -40;
  while (ldexpf(448.0f, rexp) < smax * 6.0f) rexp++;
  return rexp;
}

/* Mode 3: the fold-table index of a group of scale magnitude sabs > 0
 * against 2^rexp (0, the zero entry, below the table); -1 above it. */
static int g16_fold_index(float sabs, int rexp) {
  int e;
  const float f = frexpf(sabs, &e); /* sabs = 2f * 2^(e-1), 2f in [1, 2) */
  const int jm = (int)((2.0f * f - 1.0f) * 8.0f), k = (e - 1) - rexp;
  if (k > MM_SM90_LUT_KMAX) return -1;
  return k < MM_SM90_LUT_KMIN ? 0 : MM_SM90_LUT_INDEX(k, jm);
}

/* Mode 3 row anchor: one reference exponent for all K blocks of source row
 * r, the largest of the blocks' own, if every nonzero weight of the row
 * folds against it to the same value as against its block's own (the E4M3
 * rounding is the same unless a value falls among the subnormals or off
 * the table) and the row factor times 2^R is exact in FP32. The row factor
 * then carries 2^R and every block's stored reference is 0: the weights
 * are the same numbers, and the prefill path (references 0 only) can take
 * the layer. Returns 1 with *R, else 0. */
static int g16_row_anchor(const mm_qmat *m, const uint8_t lut[][8], int r, int *R) {
  const int KB = m->cols / 128;
  float sabs[8];
  uint8_t flip[8];
  int bad, best = 0, any = 0;
  for (int kb = 0; kb < KB; kb++) {
    if (g16_block_scales(m, r, kb, sabs, flip, &bad)) return 0; /* the per-block path reports it */
    float smax = 0.0f;
    for (int g = 0; g < 8; g++) smax = sabs[g] > smax ? sabs[g] : smax;
    if (smax == 0.0f) continue;
    const int rexp = g16_block_rexp(sabs);
    if (!any || rexp > best) best = rexp;
    any = 1;
  }
  for (int kb = 0; kb < KB; kb++) {
    g16_block_scales(m, r, kb, sabs, flip, &bad);
    const int rexp = g16_block_rexp(sabs);
    for (int g = 0; g < 8; g++) {
      if (sabs[g] == 0.0f) continue;
      const int ib = g16_fold_index(sabs[g], rexp), ir = g16_fold_index(sabs[g], best);
      if (ib < 0 || ir < 0) return 0;
      for (int k = (kb * 8 + g) * 16; k < (kb * 8 + g + 1) * 16; k++) {
        const int c = code_at(m, r, k) & 7;
        if (c && ldexpf(mm_e4m3_to_float(lut[ib][c]), rexp) != ldexpf(mm_e4m3_to_float(lut[ir][c]), best))
          return 0;
      }
    }
  }
  if (!mm_sm90_anchor_fits(m->row_scale[r], best)) return 0;
  *R = best;
  return 1;
}

typedef struct {
  const mm_qmat *m;
  mm_weight_mode mode;
  int gate_up;
  uint8_t *dst;
  float *row_scale;
  uint8_t (*lut)[8];
  /* per row tile results (errors: first failing row tile wins) */
  char (*msg)[256];
  double *err2, *ref2;
} pack_job;

/* Packs row tiles [begin, end). */
static void pack_tiles(void *ctx, size_t begin, size_t end) {
  pack_job *j = ctx;
  const mm_qmat *m = j->m;
  const mm_weight_mode mode = j->mode;
  const int KB = m->cols / 128;
  const size_t rec = mm_sm90_record_bytes(mode);
  for (size_t t = begin; t < end; t++) {
    double e2 = 0.0, r2 = 0.0;
    int anchored[64], anchor[64] = {0}; /* modes 1 and 3: the row anchor of each row */
    for (int lr = 0; lr < 64; lr++) {
      const int src = mm_sm90_src_row((int)t * 64 + lr, m->rows, j->gate_up);
      const uint8_t(*lut)[8] = (const uint8_t(*)[8])j->lut;
      anchored[lr] = mode == MM_WMODE_G32_FP8   ? g32_row_anchor(m, lut, src, &anchor[lr])
                     : mode == MM_WMODE_G16_FP8 ? g16_row_anchor(m, lut, src, &anchor[lr])
                                                : 0;
    }
    for (int kb = 0; kb < KB; kb++) {
      uint8_t *R = j->dst + (t * (size_t)KB + (size_t)kb) * rec;
      memset(R, 0, rec);
      uint8_t *sc = R + mm_sm90_scale_offset();
      int16_t ref[64];
      for (int lr = 0; lr < 64; lr++) {
        const int r = (int)t * 64 + lr;
        const int src = mm_sm90_src_row(r, m->rows, j->gate_up);
        if (kb == 0)
          j->row_scale[r] = anchored[lr] ? ldexpf(m->row_scale[src], anchor[lr]) : m->row_scale[src];
        uint8_t flip[8] = {0}; /* per group: negate codes (negative E4M3 scale, mode 3) */
        ref[lr] = 0;
        if (mode == MM_WMODE_G16_BF16_EXACT) {
          for (int g = 0; g < 8; g++) {
            uint8_t b = m->scales[(size_t)src * (size_t)(m->cols / 16) + (size_t)(kb * 8 + g)];
            if (mm_e4m3_is_nan(b)) {
              snprintf(j->msg[t], 256, "row %d group %d: E4M3 scale byte 0x%02X is NaN", src,
                       kb * 8 + g, b);
              return;
            }
            sc[lr * 8 + g] = b;
          }
        } else if (mode == MM_WMODE_G32_FP8) {
          const uint8_t *sr = m->scales + (size_t)src * (size_t)(m->cols / 32);
          for (int gi = kb * 4; gi < kb * 4 + 4; gi++)
            if (sr[gi] == 0xFF) {
              snprintf(j->msg[t], 256, "row %d group %d: UE8M0 scale byte 0xFF is NaN", src, gi);
              return;
            }
          /* the row's anchor (reference 0 here, 2^anchor in the row factor),
           * else the block's own reference */
          int bref = 0;
          const int st = anchored[lr] ? 0 : g32_block_ref(m, (const uint8_t(*)[8])j->lut, src, kb, &bref);
          if (st < 0) {
            int emin = 255, emax = -1;
            for (int gi = kb * 4; gi < kb * 4 + 4; gi++)
              if (group_nonzero(m, src, gi)) {
                if (sr[gi] < emin) emin = sr[gi];
                if (sr[gi] > emax) emax = sr[gi];
              }
            snprintf(j->msg[t], 256,
                     "row %d columns %d..%d: UE8M0 group exponents 2^%d..2^%d are too far apart "
                     "to fold exactly into FP8 E4M3 under one FP32 scale (2^%d apart at most "
                     "per 128 columns guaranteed); requantize this tensor or use gran_k 16 bf16-exact",
                     src, kb * 128, kb * 128 + 127, emin - 127, emax - 127, 14);
            return;
          }
          const int fold_ref = anchored[lr] ? anchor[lr] : bref; /* the weights' 2^ref */
          ref[lr] = (int16_t)(anchored[lr] ? 0 : bref);
          for (int g = 0; g < 4; g++) { /* the group's shift: e_g - 127 - ref */
            const int gi = kb * 4 + g;
            sc[lr * 4 + g] = group_nonzero(m, src, gi)
                                 ? (uint8_t)MM_SM90_LUT_INDEX(sr[gi] - 127 - fold_ref, 0)
                                 : (uint8_t)MM_SM90_LUT_INDEX(0, 0);
          }
        } else { /* mode 3: lossy fold relative to a power-of-two reference */
          float sabs[8];
          int bad;
          if (g16_block_scales(m, src, kb, sabs, flip, &bad)) {
            const uint8_t b = m->scales[(size_t)src * (size_t)(m->cols / 16) + (size_t)bad];
            snprintf(j->msg[t], 256, "row %d group %d: E4M3 scale byte 0x%02X is NaN", src, bad, b);
            return;
          }
          /* the row's anchor (reference 0 here, 2^anchor in the row factor),
           * else the block's own reference */
          const int rexp = anchored[lr] ? anchor[lr] : g16_block_rexp(sabs);
          ref[lr] = (int16_t)(anchored[lr] ? 0 : rexp);
          for (int g = 0; g < 8; g++) {
            const int idx = sabs[g] > 0.0f ? g16_fold_index(sabs[g], rexp) : 0;
            if (idx < 0) {
              snprintf(j->msg[t], 256, "row %d group %d: internal fold range error", src,
                       kb * 8 + g);
              return;
            }
            sc[lr * 8 + g] = (uint8_t)idx;
          }
        }
        /* codes */
        for (int kk = 0; kk < 128; kk++) {
          int k = kb * 128 + kk;
          int c = code_at(m, src, k);
          if (mode == MM_WMODE_G16_FP8 && (c & 7)) c ^= flip[kk >> 4];
          int off, mb, sb;
          mm_sm90_code_slot(mode, lr, kk, &off, &mb, &sb);
          uint32_t word;
          memcpy(&word, R + off, 4);
          word |= (uint32_t)(c & 7) << mb;
          word |= (uint32_t)((c >> 3) & 1) << sb;
          memcpy(R + off, &word, 4);
        }
      }
      if (mm_sm90_has_ref(mode)) memcpy(R + mm_sm90_ref_offset(mode), ref, sizeof(ref));
      /* Fold error of this record: only mode 3 is lossy; modes 1 and 2 are
       * exact by construction (and tested so), so skip the per-weight pass
       * that would dominate load time. */
      for (int lr = 0; mode == MM_WMODE_G16_FP8 && lr < 64; lr++) {
        const int r = (int)t * 64 + lr;
        const int src = mm_sm90_src_row(r, m->rows, j->gate_up);
        for (int kk = 0; kk < 128; kk++) {
          double w = (double)mm_qmat_weight(m, src, kb * 128 + kk);
          /* an anchored row's 2^R is in its row factor */
          double v = (double)ldexpf(mm_sm90_weight(j->dst, mode, m->rows, m->cols, r, kb * 128 + kk),
                                    anchored[lr] ? anchor[lr] : 0);
          e2 += (v - w) * (v - w);
          r2 += w * w;
        }
      }
    }
    j->err2[t] = e2;
    j->ref2[t] = r2;
  }
}

mm_err *mm_sm90_check_matrix(const mm_qmat *m, mm_weight_mode mode, int gate_up) {
  if (mode < MM_WMODE_G32_FP8 || mode > MM_WMODE_G32_F16_EXACT)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "sm90 layout: unknown weight mode %d",
                    (int)mode);
  if (m->rows <= 0 || m->rows % 64 || m->cols <= 0 || m->cols % 128)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "sm90 layout: matrix [%d, %d] must have rows %% 64 == 0 and cols %% 128 == 0",
                    m->rows, m->cols);
  const int g32 = mm_sm90_record_mode(mode) == MM_WMODE_G32_FP8;
  if (g32 && (m->gran != 32 || m->sf != MM_SF_UE8M0))
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "sm90 layout: mode %s needs gran 32 UE8M0 scales (got gran %d, %s)",
                    mode == MM_WMODE_G32_FP8 ? "g32-fp8" : "g32-f16-exact", m->gran,
                    m->sf == MM_SF_E4M3 ? "E4M3" : "UE8M0");
  if (!g32 && (m->gran != 16 || m->sf != MM_SF_E4M3))
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "sm90 layout: gran-16 modes need gran 16 E4M3 scales (got gran %d, %s)",
                    m->gran, m->sf == MM_SF_E4M3 ? "E4M3" : "UE8M0");
  if (gate_up && m->rows % 128)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "sm90 layout: w13 rows %d must be a multiple of 128 (2 x 64 channels)",
                    m->rows);
  return NULL;
}

mm_err *mm_sm90_pack_matrix(const mm_qmat *m, mm_weight_mode mode, int gate_up, uint8_t *dst,
                            float *row_scale, double fold_err[2]) {
  MM_TRY(mm_sm90_check_matrix(m, mode, gate_up));
  mode = mm_sm90_record_mode(mode); /* mode 4: mode 1's records */
  const size_t tiles = (size_t)(m->rows / 64);
  uint8_t lut[MM_SM90_LUT_ENTRIES][8];
  mm_sm90_lut_table(lut);
  char(*msg)[256] = calloc(tiles, sizeof(*msg));
  double *err2 = calloc(tiles, sizeof(double)), *ref2 = calloc(tiles, sizeof(double));
  mm_err *err = NULL;
  if (!msg || !err2 || !ref2) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "sm90 layout: out of host memory");
    goto done;
  }
  pack_job job = {m, mode, gate_up, dst, row_scale, lut, msg, err2, ref2};
  mm_parallel_for(tiles, 0, pack_tiles, &job);
  double e2 = 0.0, r2 = 0.0;
  for (size_t t = 0; t < tiles; t++) {
    if (msg[t][0]) {
      err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "sm90 layout: %s", msg[t]);
      goto done;
    }
    e2 += err2[t];
    r2 += ref2[t];
  }
  if (fold_err) {
    fold_err[0] = e2;
    fold_err[1] = r2;
  }
done:
  free(msg);
  free(err2);
  free(ref2);
  return err;
}

float mm_sm90_weight(const uint8_t *blob, mm_weight_mode mode, int rows, int cols, int r, int k) {
  (void)rows;
  const int KB = cols / 128, lr = r & 63, kk = k & 127, G = mm_sm90_groups_per_row(mode);
  const uint8_t *R = blob + ((size_t)(r >> 6) * (size_t)KB + (size_t)(k >> 7)) * mm_sm90_record_bytes(mode);
  int off, mb, sb;
  mm_sm90_code_slot(mode, lr, kk, &off, &mb, &sb);
  uint32_t word;
  memcpy(&word, R + off, 4);
  int mag = (int)((word >> mb) & 7), neg = (int)((word >> sb) & 1);
  uint8_t sbyte = R[mm_sm90_scale_offset() + (size_t)(lr * G + mm_sm90_group_of(mode, kk))];
  if (mode == MM_WMODE_G16_BF16_EXACT) {
    float v = kMag[mag] * mm_e4m3_to_float(sbyte);
    return neg ? -v : v;
  }
  /* the fold table entry, computed in place (same formula as the table) */
  int lk = (sbyte >> 3) + MM_SM90_LUT_KMIN, lj = sbyte & 7;
  uint8_t lb = mm_float_to_e4m3(kMag[mag] * (1.0f + (float)lj / 8.0f) * ldexpf(1.0f, lk));
  int16_t ref;
  memcpy(&ref, R + mm_sm90_ref_offset(mode) + 2 * (size_t)lr, 2);
  uint8_t b = (uint8_t)(lb | (neg << 7));
  return mm_e4m3_to_float(b) * mm_sm90_pow2(ref);
}

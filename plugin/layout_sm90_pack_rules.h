/* layout_sm90_pack_rules.h -- the steps of the fast sm90 packing, shared by
 * the host packer (layout_sm90_pack.c: threads over 64-row tiles) and the
 * GPU packer (kernels/pack_sm90.cu: a thread per row, a block per record).
 * One copy of every decision, restated over tables from the reference's own
 * functions (layout_sm90.c stays the specification), so that the host
 * tests of the fast packer against the reference (test_sm90_pack) cover
 * the GPU's logic too:
 *  - codes: the two codes of a source byte always land in one 32-bit word of
 *    the record, at bit positions that depend only on the byte's column
 *    (mod 32), so a word is the OR of bits[class][byte] over its 4 bytes;
 *  - mode 1: "magnitude c of a group folds exactly at shift k" as a bit
 *    mask per k, so the anchor search tests a group with one AND;
 *  - mode 3: the reference exponent and the fold index of an E4M3 scale
 *    depend only on its magnitude byte (E4M3 order is value order).
 * Plain C and CUDA. A step that meets bad data fills a fault record, which
 * the host turns into the reference's message (mm_sm90p_fault_message). */
#ifndef MM_LAYOUT_SM90_PACK_RULES_H
#define MM_LAYOUT_SM90_PACK_RULES_H

#include <math.h>
#include <stdint.h>

#include "layout_sm90.h"
#include "qmat.h"

/* The anchor and fold decisions compare floats and scale them by powers of
 * two: IEEE behaviour (no flush to zero, exact ldexpf) is assumed. */
#if defined(__CUDA_ARCH__) && defined(__USE_FAST_MATH__)
#error "layout_sm90_pack_rules.h needs IEEE float behaviour: build without --use_fast_math"
#endif

#define MM_SM90P_KRANGE (MM_SM90_LUT_KMAX - MM_SM90_LUT_KMIN + 1)
/* a row without a row anchor */
#define MM_SM90P_NO_ANCHOR (-0x7fffffff - 1)
/* mode 1: a block no shift folds exactly */
#define MM_SM90P_NO_STOP 99

/* Built on the host (mm_sm90_pack_tables_build), read by both packers; the
 * GPU's is a byte copy, so every field has a fixed size. */
typedef struct mm_sm90_pack_tables {
  int32_t mode;             /* the record mode (mm_sm90_record_mode) */
  uint8_t lut[MM_SM90_LUT_ENTRIES][8];
  uint32_t bits[16][256];   /* word bits of source byte v in column class j & 15 */
  uint16_t gather[1024][4]; /* the 4 source bytes (64 * row + byte) of each word */
  uint8_t mags[256];        /* bit m: a code of the byte has magnitude m */
  uint8_t flip[256];        /* the byte with both codes negated where nonzero */
  uint8_t exact[MM_SM90P_KRANGE]; /* mode 1: bit c: magnitude c folds exactly at shift k */
  int8_t rexp[128];         /* mode 3, per E4M3 magnitude byte: reference exponent */
  int8_t ex[128], jm[128];  /* mode 3: binary exponent and 1/8 mantissa step */
  float e4m3[256], e2m1[16];
} mm_sm90_pack_tables;

typedef enum {
  MM_SM90P_FAULT_NONE = 0,
  MM_SM90P_FAULT_NAN_E4M3,   /* group, byte */
  MM_SM90P_FAULT_NAN_UE8M0,  /* group */
  MM_SM90P_FAULT_SPREAD,     /* kb, emin, emax: mode 1 cannot fold the block */
  MM_SM90P_FAULT_FOLD_RANGE  /* group: mode 3 above the fold table (never, by the rules) */
} mm_sm90p_fault_kind;

/* What went wrong at one record row; kind NONE: nothing. */
typedef struct mm_sm90p_fault {
  int32_t kind, src, group, byte, kb, emin, emax, lr;
} mm_sm90p_fault;

/* ---- mode 1 (gran 32, UE8M0) ---------------------------------------------- */

/* The nonzero magnitudes of each group of 32 of a row (bit c: magnitude c). */
MM_SM90_HD void mm_sm90p_g32_row_mags(const mm_sm90_pack_tables *T, const uint8_t *codes,
                                      int groups, uint8_t *nz) {
  for (int g = 0; g < groups; g++) {
    uint8_t mask = 0;
    for (int i = 0; i < 16; i++) mask |= T->mags[codes[16 * g + i]];
    nz[g] = (uint8_t)(mask & 0xFE); /* zero not counted */
  }
}
/* The largest exponent of a block row's nonzero groups (-1: none). */
MM_SM90_HD int mm_sm90p_g32_block_emax(const uint8_t *s, const uint8_t nz[4]) {
  int emax = -1;
  for (int g = 0; g < 4; g++)
    if (nz[g] && s[g] > emax) emax = s[g];
  return emax;
}
/* Does group magnitude set nz fold exactly at shift k? */
MM_SM90_HD int mm_sm90p_g32_exact(const mm_sm90_pack_tables *T, uint8_t nz, int k) {
  return k >= MM_SM90_LUT_KMIN && k <= MM_SM90_LUT_KMAX &&
         !(nz & ~T->exact[k - MM_SM90_LUT_KMIN]);
}
/* The reference's anchor search of one block row: the largest shift s_top
 * in [0, KMAX] folding every nonzero group exactly, or MM_SM90P_NO_STOP. */
MM_SM90_HD int mm_sm90p_g32_block_stop(const mm_sm90_pack_tables *T, const uint8_t *s,
                                       const uint8_t nz[4], int emax) {
  for (int st = MM_SM90_LUT_KMAX; st >= 0; st--) {
    int ok = 1;
    for (int g = 0; g < 4 && ok; g++)
      if (nz[g]) ok = mm_sm90p_g32_exact(T, nz[g], st - (emax - s[g]));
    if (ok) return st;
  }
  return MM_SM90P_NO_STOP;
}
/* The row anchor (the reference's g32_row_anchor) of a row with scales s
 * (cols / 32), magnitude sets nz and row factor row_scale: every block's
 * search goes to stops[kb] (kept for its record); returns the anchor R, or
 * MM_SM90P_NO_ANCHOR. */
MM_SM90_HD int32_t mm_sm90p_g32_row_anchor(const mm_sm90_pack_tables *T, const uint8_t *s,
                                           int KB, float row_scale, const uint8_t *nz,
                                           uint8_t *stops) {
  int best = 0, any = 0, ok = 1;
  for (int kb = 0; kb < KB; kb++) {
    const int emax = mm_sm90p_g32_block_emax(s + 4 * kb, nz + 4 * kb);
    stops[kb] = (uint8_t)(emax < 0 ? 0 : mm_sm90p_g32_block_stop(T, s + 4 * kb, nz + 4 * kb, emax));
    if (emax < 0) continue;
    if (stops[kb] == MM_SM90P_NO_STOP) ok = 0;
    const int ref = (emax - 127) - stops[kb];
    if (!any || ref > best) best = ref;
    any = 1;
  }
  for (int gi = 0; gi < 4 * KB && ok; gi++)
    if (s[gi] == 0xFF) ok = 0; /* NaN: the record reports it */
  if (!ok) return MM_SM90P_NO_ANCHOR;
  for (int gi = 0; gi < 4 * KB; gi++)
    if (nz[gi] && !mm_sm90p_g32_exact(T, nz[gi], s[gi] - 127 - best)) return MM_SM90P_NO_ANCHOR;
  return mm_sm90_anchor_fits(row_scale, best) ? best : MM_SM90P_NO_ANCHOR;
}
/* The scale bytes sc[4] and reference of one row of a record: the block's
 * anchor search (stop), or with a row anchor its folds against 2^R and
 * reference 0. Returns 0, or -1 with *f. */
MM_SM90_HD int mm_sm90p_g32_row_scales(const uint8_t *s, const uint8_t nz[4], int stop,
                                       int32_t anchor, int src, int kb, uint8_t *sc,
                                       int16_t *ref, mm_sm90p_fault *f) {
  for (int g = 0; g < 4; g++)
    if (s[g] == 0xFF) {
      f->kind = MM_SM90P_FAULT_NAN_UE8M0;
      f->src = src;
      f->group = kb * 4 + g;
      f->byte = 0xFF;
      return -1;
    }
  const int emax = mm_sm90p_g32_block_emax(s, nz);
  *ref = 0;
  if (anchor != MM_SM90P_NO_ANCHOR) {
    for (int g = 0; g < 4; g++)
      sc[g] = nz[g] ? (uint8_t)MM_SM90_LUT_INDEX(s[g] - 127 - anchor, 0)
                    : (uint8_t)MM_SM90_LUT_INDEX(0, 0);
    return 0;
  }
  if (emax >= 0) {
    if (stop == MM_SM90P_NO_STOP) {
      int emin = 255;
      for (int g = 0; g < 4; g++)
        if (nz[g] && s[g] < emin) emin = s[g];
      f->kind = MM_SM90P_FAULT_SPREAD;
      f->src = src;
      f->kb = kb;
      f->emin = emin;
      f->emax = emax;
      return -1;
    }
    *ref = (int16_t)((emax - 127) - stop);
  }
  for (int g = 0; g < 4; g++)
    sc[g] = (emax >= 0 && nz[g]) ? (uint8_t)MM_SM90_LUT_INDEX(stop - (emax - s[g]), 0)
                                 : (uint8_t)MM_SM90_LUT_INDEX(0, 0);
  return 0;
}

/* ---- mode 3 (gran 16, E4M3 folded) ---------------------------------------- */

/* The scale magnitude bytes of a block row's 8 groups (0 for a group
 * without nonzero codes) and the magnitudes present in each (bit c); -1
 * with *bad at a NaN scale. */
MM_SM90_HD int mm_sm90p_g16_block_mags(const mm_sm90_pack_tables *T, const uint8_t *s,
                                       const uint8_t *codes, uint8_t mag[8], uint8_t mask[8],
                                       int *bad) {
  for (int g = 0; g < 8; g++) {
    if (mm_e4m3_is_nan(s[g])) {
      *bad = g;
      return -1;
    }
    uint8_t m = 0;
    for (int i = 0; i < 8; i++) m |= T->mags[codes[8 * g + i]];
    mask[g] = (uint8_t)(m & 0xFE);                  /* zero not counted */
    mag[g] = mask[g] ? (uint8_t)(s[g] & 0x7F) : 0; /* an all-zero group does not count */
  }
  return 0;
}
/* The reference exponent of a block row: its largest magnitude byte's. */
MM_SM90_HD int mm_sm90p_g16_block_rexp(const mm_sm90_pack_tables *T, const uint8_t mag[8]) {
  int mmax = 0;
  for (int g = 0; g < 8; g++)
    if (mag[g] > mmax) mmax = mag[g];
  return T->rexp[mmax];
}
/* The fold index of magnitude byte mag > 0 against 2^rexp (0, the zero
 * entry, below the table); -1 above it. */
MM_SM90_HD int mm_sm90p_g16_index(const mm_sm90_pack_tables *T, int mag, int rexp) {
  const int k = T->ex[mag] - rexp;
  if (k > MM_SM90_LUT_KMAX) return -1;
  return k < MM_SM90_LUT_KMIN ? 0 : MM_SM90_LUT_INDEX(k, T->jm[mag]);
}
/* The row anchor (the reference's g16_row_anchor) of a row with scales s
 * (cols / 16), codes (cols / 2 bytes) and row factor row_scale: one
 * reference exponent for all blocks where every nonzero weight folds to
 * the same value as against its block's own. R, or MM_SM90P_NO_ANCHOR. */
MM_SM90_HD int32_t mm_sm90p_g16_row_anchor(const mm_sm90_pack_tables *T, const uint8_t *s,
                                           const uint8_t *codes, int KB, float row_scale) {
  uint8_t mag[8], mask[8];
  int bad, best = 0, any = 0;
  for (int kb = 0; kb < KB; kb++) {
    if (mm_sm90p_g16_block_mags(T, s + 8 * kb, codes + 64 * kb, mag, mask, &bad))
      return MM_SM90P_NO_ANCHOR; /* the record reports it */
    int nonzero = 0;
    for (int g = 0; g < 8; g++) nonzero |= mag[g];
    if (!nonzero) continue;
    const int rexp = mm_sm90p_g16_block_rexp(T, mag);
    if (!any || rexp > best) best = rexp;
    any = 1;
  }
  for (int kb = 0; kb < KB; kb++) {
    mm_sm90p_g16_block_mags(T, s + 8 * kb, codes + 64 * kb, mag, mask, &bad);
    const int rexp = mm_sm90p_g16_block_rexp(T, mag);
    for (int g = 0; g < 8; g++) {
      if (!mag[g]) continue;
      const int ib = mm_sm90p_g16_index(T, mag[g], rexp), ir = mm_sm90p_g16_index(T, mag[g], best);
      if (ib < 0 || ir < 0) return MM_SM90P_NO_ANCHOR;
      for (int c = 1; c < 8; c++)
        if ((mask[g] >> c & 1) &&
            ldexpf(T->e4m3[T->lut[ib][c]], rexp) != ldexpf(T->e4m3[T->lut[ir][c]], best))
          return MM_SM90P_NO_ANCHOR;
    }
  }
  return mm_sm90_anchor_fits(row_scale, best) ? best : MM_SM90P_NO_ANCHOR;
}
/* The scale bytes sc[8] (fold indexes relative to a power-of-two
 * reference, the block's own or with a row anchor 2^R and reference 0) of
 * one row of a record; *fold: the exponent its folded values are relative
 * to. Returns 0, or -1 with *f. */
MM_SM90_HD int mm_sm90p_g16_row_scales(const mm_sm90_pack_tables *T, const uint8_t *s,
                                       const uint8_t *codes, int src, int kb, int32_t anchor,
                                       uint8_t *sc, int16_t *ref, int *fold, mm_sm90p_fault *f) {
  uint8_t mag[8], mask[8];
  int bad;
  if (mm_sm90p_g16_block_mags(T, s, codes, mag, mask, &bad)) {
    f->kind = MM_SM90P_FAULT_NAN_E4M3;
    f->src = src;
    f->group = kb * 8 + bad;
    f->byte = s[bad];
    return -1;
  }
  const int anchored = anchor != MM_SM90P_NO_ANCHOR;
  const int rexp = anchored ? anchor : mm_sm90p_g16_block_rexp(T, mag);
  *ref = (int16_t)(anchored ? 0 : rexp);
  *fold = rexp;
  for (int g = 0; g < 8; g++) {
    const int idx = mag[g] ? mm_sm90p_g16_index(T, mag[g], rexp) : 0;
    if (idx < 0) {
      f->kind = MM_SM90P_FAULT_FOLD_RANGE;
      f->src = src;
      f->group = kb * 8 + g;
      return -1;
    }
    sc[g] = (uint8_t)idx;
  }
  return 0;
}
/* The fold error of one record row, added to *e2 and *r2 in column order;
 * fold: the exponent its values are relative to. */
MM_SM90_HD void mm_sm90p_fold_error_row(const mm_sm90_pack_tables *T, const uint8_t *codes,
                                        const uint8_t *s, const uint8_t *sc, int fold, double *e2,
                                        double *r2) {
  const float p2 = mm_sm90_pow2(fold);
  for (int kk = 0; kk < 128; kk++) {
    const int g = kk >> 4;
    int c = (codes[kk >> 1] >> ((kk & 1) * 4)) & 15;
    const float wf = T->e2m1[c] * T->e4m3[s[g]];
    if ((c & 7) && (s[g] & 0x80)) c ^= 8;
    const float vf = T->e4m3[T->lut[sc[g]][c & 7] | ((c >> 3) << 7)] * p2;
    const double w = (double)wf, v = (double)vf;
    *e2 += (v - w) * (v - w);
    *r2 += w * w;
  }
}

/* ---- the steps both packers run ------------------------------------------- */

/* Row work before the records, for layout row r of m (gate_up: the w13
 * order): mode 1 the magnitude sets of the row's groups (nz_row, cols / 32
 * bytes) and each block's anchor shift (stops_row, cols / 128); modes 1 and
 * 3 the row anchor, returned (MM_SM90P_NO_ANCHOR: none; always for mode
 * 2). */
MM_SM90_HD int32_t mm_sm90p_row_anchor(const mm_sm90_pack_tables *T, const mm_qmat *m,
                                       int gate_up, int r, uint8_t *nz_row, uint8_t *stops_row) {
  const int src = mm_sm90_src_row(r, m->rows, gate_up), KB = m->cols / 128;
  const uint8_t *codes = m->codes + (size_t)src * (size_t)(m->cols / 2);
  const uint8_t *s = m->scales + (size_t)src * (size_t)(m->cols / m->gran);
  if (T->mode == MM_WMODE_G32_FP8) {
    mm_sm90p_g32_row_mags(T, codes, m->cols / 32, nz_row);
    return mm_sm90p_g32_row_anchor(T, s, KB, m->row_scale[src], nz_row, stops_row);
  }
  if (T->mode == MM_WMODE_G16_FP8) return mm_sm90p_g16_row_anchor(T, s, codes, KB, m->row_scale[src]);
  return MM_SM90P_NO_ANCHOR;
}

/* Row lr of record (tile t, K-block kb) of m: its 64 source code bytes to
 * in_row (mode 3: negated where the group's scale is negative), its scale
 * bytes to sc (mm_sm90_groups_per_row), its reference exponent to *ref,
 * mode 3's fold exponent to *fold and, in K-block 0, its row factor to
 * *row_factor. nz_row, stops_row and anchor: mm_sm90p_row_anchor's for the
 * row. Returns 0, or -1 with *f. */
MM_SM90_HD int mm_sm90p_record_row(const mm_sm90_pack_tables *T, const mm_qmat *m, int gate_up,
                                   int t, int kb, int lr, const uint8_t *nz_row,
                                   const uint8_t *stops_row, int32_t anchor, uint8_t *in_row,
                                   uint8_t *sc, int16_t *ref, int *fold, float *row_factor,
                                   mm_sm90p_fault *f) {
  const int r = 64 * t + lr, src = mm_sm90_src_row(r, m->rows, gate_up);
  const int G = mm_sm90_groups_per_row((mm_weight_mode)T->mode);
  const uint8_t *codes = m->codes + (size_t)src * (size_t)(m->cols / 2) + 64 * (size_t)kb;
  const uint8_t *s = m->scales + (size_t)src * (size_t)(m->cols / m->gran) + (size_t)(G * kb);
  f->lr = lr;
  if (kb == 0)
    *row_factor = anchor != MM_SM90P_NO_ANCHOR ? ldexpf(m->row_scale[src], anchor)
                                               : m->row_scale[src];
  for (int i = 0; i < 64; i++) in_row[i] = codes[i];
  *ref = 0;
  *fold = 0;
  if (T->mode == MM_WMODE_G16_BF16_EXACT) {
    for (int g = 0; g < 8; g++) {
      if (mm_e4m3_is_nan(s[g])) {
        f->kind = MM_SM90P_FAULT_NAN_E4M3;
        f->src = src;
        f->group = kb * 8 + g;
        f->byte = s[g];
        return -1;
      }
      sc[g] = s[g];
    }
    return 0;
  }
  if (T->mode == MM_WMODE_G32_FP8)
    return mm_sm90p_g32_row_scales(s, nz_row + 4 * kb, stops_row[kb], anchor, src, kb, sc, ref, f);
  if (mm_sm90p_g16_row_scales(T, s, codes, src, kb, anchor, sc, ref, fold, f)) return -1;
  for (int g = 0; g < 8; g++) /* a negative scale negates the group's codes */
    if (s[g] & 0x80)
      for (int i = 0; i < 8; i++) in_row[8 * g + i] = T->flip[in_row[8 * g + i]];
  return 0;
}

/* Code word w (0..1023) of a record whose rows' code bytes are in (64 x 64,
 * row-major, mm_sm90p_record_row's in_row). */
MM_SM90_HD uint32_t mm_sm90p_word(const mm_sm90_pack_tables *T, const uint8_t *in, int w) {
  const uint16_t *gi = T->gather[w];
  return T->bits[gi[0] & 15][in[gi[0]]] | T->bits[gi[1] & 15][in[gi[1]]] |
         T->bits[gi[2] & 15][in[gi[2]]] | T->bits[gi[3] & 15][in[gi[3]]];
}

/* Mode 3's fold error of record row lr (after mm_sm90p_record_row), added
 * to *e2, *r2; other modes are exact and add nothing. */
MM_SM90_HD void mm_sm90p_record_row_error(const mm_sm90_pack_tables *T, const mm_qmat *m,
                                          int gate_up, int t, int kb, int lr, const uint8_t *sc,
                                          int fold, double *e2, double *r2) {
  if (T->mode != MM_WMODE_G16_FP8) return;
  const int src = mm_sm90_src_row(64 * t + lr, m->rows, gate_up);
  mm_sm90p_fold_error_row(T, m->codes + (size_t)src * (size_t)(m->cols / 2) + 64 * (size_t)kb,
                          m->scales + (size_t)src * (size_t)(m->cols / 16) + (size_t)(8 * kb), sc,
                          fold, e2, r2);
}

#endif

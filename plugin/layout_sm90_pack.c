/* layout_sm90_pack.c -- fast host packing of the sm90 kernel layout (see
 * layout_sm90_pack.h). Every decision is the reference's (layout_sm90.c),
 * restated over tables:
 *  - codes: the two codes of a source byte always land in one 32-bit word of
 *    the record, at bit positions that depend only on the byte's column
 *    (mod 32), so a word is the OR of bits[class][byte] over its 4 bytes;
 *    tables are filled from mm_sm90_code_slot and checked against it;
 *  - mode 1: "magnitude c of a group folds exactly at shift k" as a bit
 *    mask per k, so the anchor search tests a group with one AND;
 *  - mode 3: the reference exponent and the fold index of an E4M3 scale
 *    depend only on its magnitude byte (E4M3 order is value order).
 * Per 64-row tile the work and the sums are in the reference's order, so
 * the fold sums are bit-identical too. */
#include "layout_sm90_pack.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "formats.h"
#include "parallel.h"

#define KRANGE (MM_SM90_LUT_KMAX - MM_SM90_LUT_KMIN + 1)

static const float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
static const char kOutOfMemory[] = "out of host memory";

typedef struct pack_tables {
  mm_weight_mode mode;
  uint8_t lut[MM_SM90_LUT_ENTRIES][8];
  uint32_t bits[16][256];   /* word bits of source byte v in column class j & 15 */
  uint16_t gather[1024][4]; /* the 4 source bytes (64 * row + byte) of each word */
  uint8_t mags[256];        /* bit m: a code of the byte has magnitude m */
  uint8_t flip[256];        /* the byte with both codes negated where nonzero */
  uint8_t exact[KRANGE];    /* mode 1: bit c: magnitude c folds exactly at shift k */
  int8_t rexp[128];         /* mode 3, per E4M3 magnitude byte: reference exponent */
  int8_t ex[128], jm[128];  /* mode 3: binary exponent and 1/8 mantissa step */
  float e4m3[256], e2m1[16];
} pack_tables;

/* Fills the tables for `mode`; -1 if the slot functions break the
 * one-word-per-byte property the gather relies on (never, by the layout). */
static int build_tables(pack_tables *T, mm_weight_mode mode) {
  T->mode = mode;
  mm_sm90_lut_table(T->lut);
  int fill[1024] = {0};
  int mb[32], sb[32];
  for (int kk = 0; kk < 32; kk++) {
    int off;
    mm_sm90_code_slot(mode, 0, kk, &off, &mb[kk], &sb[kk]);
  }
  for (int lr = 0; lr < 64; lr++)
    for (int j = 0; j < 64; j++) {
      int off[2], m, s;
      for (int h = 0; h < 2; h++) {
        int kk = 2 * j + h;
        mm_sm90_code_slot(mode, lr, kk, &off[h], &m, &s);
        if (m != mb[kk & 31] || s != sb[kk & 31]) return -1;
      }
      int w = off[0] / 4;
      if (off[0] != off[1] || fill[w] == 4) return -1;
      T->gather[w][fill[w]++] = (uint16_t)(64 * lr + j);
    }
  for (int p = 0; p < 16; p++)
    for (int v = 0; v < 256; v++) {
      uint32_t lo = (uint32_t)v & 15, hi = (uint32_t)v >> 4;
      T->bits[p][v] = ((lo & 7) << mb[2 * p]) | ((lo >> 3) << sb[2 * p]) |
                      ((hi & 7) << mb[2 * p + 1]) | ((hi >> 3) << sb[2 * p + 1]);
    }
  for (int v = 0; v < 256; v++) {
    int lo = v & 15, hi = v >> 4;
    T->mags[v] = (uint8_t)((1 << (lo & 7)) | (1 << (hi & 7)));
    if (lo & 7) lo ^= 8;
    if (hi & 7) hi ^= 8;
    T->flip[v] = (uint8_t)(lo | hi << 4);
    T->e4m3[v] = mm_e4m3_to_float((uint8_t)v);
  }
  for (int c = 0; c < 16; c++) T->e2m1[c] = mm_e2m1_to_float((uint8_t)c);
  for (int k = MM_SM90_LUT_KMIN; k <= MM_SM90_LUT_KMAX; k++) {
    const uint8_t *e = T->lut[MM_SM90_LUT_INDEX(k, 0)];
    uint8_t ok = 0;
    for (int c = 1; c < 8; c++)
      if (mm_e4m3_to_float(e[c]) == ldexpf(kMag[c], k)) ok |= (uint8_t)(1 << c);
    T->exact[k - MM_SM90_LUT_KMIN] = ok;
  }
  for (int b = 0; b < 128; b++) {
    float sabs = b == 0x7F ? 0.0f : fabsf(mm_e4m3_to_float((uint8_t)b));
    int rexp = 0, e = 0;
    if (sabs > 0.0f) {
      rexp = -40;
      while (ldexpf(448.0f, rexp) < sabs * 6.0f) rexp++;
      float f = frexpf(sabs, &e);
      T->jm[b] = (int8_t)(int)((2.0f * f - 1.0f) * 8.0f);
    } else {
      T->jm[b] = 0;
    }
    T->rexp[b] = (int8_t)rexp;
    T->ex[b] = (int8_t)(e - 1);
  }
  return 0;
}


/* ---- one record ------------------------------------------------------------ */

/* Mode 1: the nonzero magnitudes of each group of 32 of a row (bit c:
 * magnitude c present). */
static void g32_row_mags(const pack_tables *T, const uint8_t *codes, int groups, uint8_t *nz) {
  for (int g = 0; g < groups; g++) {
    uint8_t mask = 0;
    for (int i = 0; i < 16; i++) mask |= T->mags[codes[16 * g + i]];
    nz[g] = mask & 0xFE; /* zero not counted */
  }
}
/* Mode 1: the largest exponent of a block row's nonzero groups (-1: none). */
static int g32_block_emax(const uint8_t *s, const uint8_t nz[4]) {
  int emax = -1;
  for (int g = 0; g < 4; g++)
    if (nz[g] && s[g] > emax) emax = s[g];
  return emax;
}
/* Mode 1: does group magnitude set nz fold exactly at shift k? */
static int g32_exact(const pack_tables *T, uint8_t nz, int k) {
  return k >= MM_SM90_LUT_KMIN && k <= MM_SM90_LUT_KMAX && !(nz & ~T->exact[k - MM_SM90_LUT_KMIN]);
}
/* Mode 1: the reference's anchor search of one block row: the largest shift
 * s_top in [0, KMAX] folding every nonzero group exactly, or 99 if none. */
static int g32_block_stop(const pack_tables *T, const uint8_t *s, const uint8_t nz[4], int emax) {
  for (int st = MM_SM90_LUT_KMAX; st >= 0; st--) {
    int ok = 1;
    for (int g = 0; g < 4 && ok; g++)
      if (nz[g]) ok = g32_exact(T, nz[g], st - (emax - s[g]));
    if (ok) return st;
  }
  return 99;
}

/* Mode 1 row anchor (the reference's g32_row_anchor): one reference
 * exponent for all K blocks of source row src, carried by the row factor.
 * Returns 1 with *R, else 0. */
static int g32_row_anchor(const pack_tables *T, const mm_qmat *m, int src, const uint8_t *nz,
                          uint8_t *stops, int *R) {
  const uint8_t *s = m->scales + (size_t)src * (size_t)(m->cols / 32);
  const int KB = m->cols / 128;
  int best = 0, any = 0, ok = 1;
  for (int kb = 0; kb < KB; kb++) { /* every block's search, kept for its record */
    const int emax = g32_block_emax(s + 4 * kb, nz + 4 * kb);
    stops[kb] = (uint8_t)(emax < 0 ? 0 : g32_block_stop(T, s + 4 * kb, nz + 4 * kb, emax));
    if (emax < 0) continue;
    if (stops[kb] == 99) ok = 0;
    const int ref = (emax - 127) - stops[kb];
    if (!any || ref > best) best = ref;
    any = 1;
  }
  for (int gi = 0; gi < 4 * KB && ok; gi++)
    if (s[gi] == 0xFF) ok = 0;
  if (!ok) return 0;
  for (int gi = 0; gi < 4 * KB; gi++)
    if (nz[gi] && !g32_exact(T, nz[gi], s[gi] - 127 - best)) return 0;
  if (!mm_sm90_anchor_fits(m->row_scale[src], best)) return 0;
  *R = best;
  return 1;
}

/* Mode 1 scales of one row of a record (4 groups of 32): the reference's
 * anchor search, or with a row anchor (anchored) its folds against 2^R and
 * reference 0. Returns 0, or -1 with msg set. */
static int row_scales_g32(const uint8_t *s, const uint8_t nz[4], int stop, int src, int kb,
                          int anchored, int R, uint8_t *sc, int16_t *ref, char *msg) {
  for (int g = 0; g < 4; g++)
    if (s[g] == 0xFF) {
      snprintf(msg, 256, "row %d group %d: UE8M0 scale byte 0xFF is NaN", src, kb * 4 + g);
      return -1;
    }
  const int emax = g32_block_emax(s, nz);
  *ref = 0;
  if (anchored) {
    for (int g = 0; g < 4; g++)
      sc[g] = nz[g] ? (uint8_t)MM_SM90_LUT_INDEX(s[g] - 127 - R, 0) : (uint8_t)MM_SM90_LUT_INDEX(0, 0);
    return 0;
  }
  if (emax >= 0) {
    if (stop == 99) {
      int emin = 255;
      for (int g = 0; g < 4; g++)
        if (nz[g] && s[g] < emin) emin = s[g];
      snprintf(msg, 256,
               "row %d columns %d..%d: UE8M0 group exponents 2^%d..2^%d are too far apart "
               "to fold exactly into FP8 E4M3 under one FP32 scale (2^%d apart at most "
               "per 128 columns guaranteed); requantize this tensor or use gran_k 16 bf16-exact",
               src, kb * 128, kb * 128 + 127, emin - 127, emax - 127, 14);
      return -1;
    }
    *ref = (int16_t)((emax - 127) - stop);
  }
  for (int g = 0; g < 4; g++)
    sc[g] = (emax >= 0 && nz[g]) ? (uint8_t)MM_SM90_LUT_INDEX(stop - (emax - s[g]), 0)
                                 : (uint8_t)MM_SM90_LUT_INDEX(0, 0);
  return 0;
}

/* Mode 3: the scale magnitude bytes of a block row's 8 groups (0 for a
 * group without nonzero codes) and the magnitudes present in each (bit c);
 * -1 with *bad at a NaN scale. */
static int g16_block_mags(const pack_tables *T, const uint8_t *s, const uint8_t *codes,
                          uint8_t mag[8], uint8_t mask[8], int *bad) {
  for (int g = 0; g < 8; g++) {
    if (mm_e4m3_is_nan(s[g])) {
      *bad = g;
      return -1;
    }
    uint8_t m = 0;
    for (int i = 0; i < 8; i++) m |= T->mags[codes[8 * g + i]];
    mask[g] = m & 0xFE; /* zero not counted */
    mag[g] = mask[g] ? (uint8_t)(s[g] & 0x7F) : 0; /* an all-zero group does not count */
  }
  return 0;
}
/* Mode 3: the reference exponent of a block row (E4M3 order is value
 * order, so its largest magnitude byte's). */
static int g16_block_rexp(const pack_tables *T, const uint8_t mag[8]) {
  int mmax = 0;
  for (int g = 0; g < 8; g++)
    if (mag[g] > mmax) mmax = mag[g];
  return T->rexp[mmax];
}
/* Mode 3: the fold index of magnitude byte mag > 0 against 2^rexp (0, the
 * zero entry, below the table); -1 above it. */
static int g16_index(const pack_tables *T, int mag, int rexp) {
  const int k = T->ex[mag] - rexp;
  if (k > MM_SM90_LUT_KMAX) return -1;
  return k < MM_SM90_LUT_KMIN ? 0 : MM_SM90_LUT_INDEX(k, T->jm[mag]);
}

/* Mode 3 row anchor (the reference's g16_row_anchor): one reference
 * exponent for all K blocks of source row src where every nonzero weight
 * folds to the same value as against its block's own, carried by the row
 * factor. Returns 1 with *R, else 0. */
static int g16_row_anchor(const pack_tables *T, const mm_qmat *m, int src, int *R) {
  const int KB = m->cols / 128, ng = m->cols / 16;
  const uint8_t *s = m->scales + (size_t)src * (size_t)ng;
  const uint8_t *codes = m->codes + (size_t)src * (size_t)(m->cols / 2);
  uint8_t mag[8], mask[8];
  int bad, best = 0, any = 0;
  for (int kb = 0; kb < KB; kb++) {
    if (g16_block_mags(T, s + 8 * kb, codes + 64 * kb, mag, mask, &bad)) return 0;
    int nonzero = 0;
    for (int g = 0; g < 8; g++) nonzero |= mag[g];
    if (!nonzero) continue;
    const int rexp = g16_block_rexp(T, mag);
    if (!any || rexp > best) best = rexp;
    any = 1;
  }
  for (int kb = 0; kb < KB; kb++) {
    g16_block_mags(T, s + 8 * kb, codes + 64 * kb, mag, mask, &bad);
    const int rexp = g16_block_rexp(T, mag);
    for (int g = 0; g < 8; g++) {
      if (!mag[g]) continue;
      const int ib = g16_index(T, mag[g], rexp), ir = g16_index(T, mag[g], best);
      if (ib < 0 || ir < 0) return 0;
      for (int c = 1; c < 8; c++)
        if ((mask[g] >> c & 1) &&
            ldexpf(T->e4m3[T->lut[ib][c]], rexp) != ldexpf(T->e4m3[T->lut[ir][c]], best))
          return 0;
    }
  }
  if (!mm_sm90_anchor_fits(m->row_scale[src], best)) return 0;
  *R = best;
  return 1;
}

/* Mode 3 scales of one row of a record (8 groups of 16): fold indexes
 * relative to a power-of-two reference, the block's own or with a row
 * anchor (anchored) 2^R with reference 0; *fold: the exponent the folded
 * values are relative to. Returns 0, or -1 with msg set. */
static int row_scales_g16_fp8(const pack_tables *T, const uint8_t *s, const uint8_t *codes,
                              int src, int kb, int anchored, int R, uint8_t *sc, int16_t *ref,
                              int *fold, char *msg) {
  uint8_t mag[8], mask[8];
  int bad;
  if (g16_block_mags(T, s, codes, mag, mask, &bad)) {
    snprintf(msg, 256, "row %d group %d: E4M3 scale byte 0x%02X is NaN", src, kb * 8 + bad, s[bad]);
    return -1;
  }
  const int rexp = anchored ? R : g16_block_rexp(T, mag);
  *ref = (int16_t)(anchored ? 0 : rexp);
  *fold = rexp;
  for (int g = 0; g < 8; g++) {
    const int idx = mag[g] ? g16_index(T, mag[g], rexp) : 0;
    if (idx < 0) {
      snprintf(msg, 256, "row %d group %d: internal fold range error", src, kb * 8 + g);
      return -1;
    }
    sc[g] = (uint8_t)idx;
  }
  return 0;
}

/* Mode 3 fold error of one record row, in the reference's order; fold: the
 * exponent its values are relative to. */
static void fold_error_row(const pack_tables *T, const uint8_t *codes, const uint8_t *s,
                           const uint8_t *sc, int fold, double *e2, double *r2) {
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

/* Packs record (tile t, K-block kb) of m into R. Returns 0, or -1 with msg. */
static int pack_record(const pack_tables *T, const mm_qmat *m, int gate_up, int t, int kb,
                       const uint8_t *nz, const uint8_t *stops, const int *anchored,
                       const int *anchor, uint8_t *R, float *row_scale, double *e2, double *r2,
                       char *msg) {
  const mm_weight_mode mode = T->mode;
  const size_t cb = (size_t)m->cols / 2, ng = (size_t)(m->cols / m->gran);
  const int G = mm_sm90_groups_per_row(mode);
  uint8_t in[64 * 64]; /* the record's source code bytes, row-major, signs flipped (mode 3) */
  int16_t ref[64];
  int fold[64]; /* mode 3: the exponent of each row's folded values */
  uint8_t *sc = R + mm_sm90_scale_offset();
  for (int lr = 0; lr < 64; lr++) {
    const int r = 64 * t + lr;
    const int src = mm_sm90_src_row(r, m->rows, gate_up);
    if (kb == 0)
      row_scale[r] = anchored[lr] ? ldexpf(m->row_scale[src], anchor[lr]) : m->row_scale[src];
    const uint8_t *codes = m->codes + (size_t)src * cb + 64 * (size_t)kb;
    const uint8_t *s = m->scales + (size_t)src * ng + (size_t)(G * kb);
    uint8_t *row = in + 64 * lr;
    memcpy(row, codes, 64);
    ref[lr] = 0;
    if (mode == MM_WMODE_G16_BF16_EXACT) {
      for (int g = 0; g < 8; g++) {
        if (mm_e4m3_is_nan(s[g])) {
          snprintf(msg, 256, "row %d group %d: E4M3 scale byte 0x%02X is NaN", src, kb * 8 + g,
                   s[g]);
          return -1;
        }
        sc[lr * 8 + g] = s[g];
      }
    } else if (mode == MM_WMODE_G32_FP8) {
      const int KB = m->cols / 128;
      if (row_scales_g32(s, nz + (size_t)lr * ng + 4 * (size_t)kb, stops[lr * KB + kb], src, kb,
                         anchored[lr], anchor[lr], sc + lr * 4, &ref[lr], msg))
        return -1;
    } else {
      if (row_scales_g16_fp8(T, s, codes, src, kb, anchored[lr], anchor[lr], sc + lr * 8, &ref[lr],
                             &fold[lr], msg))
        return -1;
      for (int g = 0; g < 8; g++) /* a negative scale negates the group's codes */
        if (s[g] & 0x80)
          for (int i = 0; i < 8; i++) row[8 * g + i] = T->flip[row[8 * g + i]];
    }
  }
  for (int w = 0; w < 1024; w++) {
    const uint16_t *gi = T->gather[w];
    uint32_t word = T->bits[gi[0] & 15][in[gi[0]]] | T->bits[gi[1] & 15][in[gi[1]]] |
                    T->bits[gi[2] & 15][in[gi[2]]] | T->bits[gi[3] & 15][in[gi[3]]];
    memcpy(R + 4 * w, &word, 4);
  }
  if (mm_sm90_has_ref(mode)) memcpy(R + mm_sm90_ref_offset(mode), ref, sizeof(ref));
  /* Only mode 3 is lossy; modes 1 and 2 have no fold error (as the reference). */
  for (int lr = 0; mode == MM_WMODE_G16_FP8 && lr < 64; lr++) {
    const int src = mm_sm90_src_row(64 * t + lr, m->rows, gate_up);
    fold_error_row(T, m->codes + (size_t)src * cb + 64 * (size_t)kb,
                   m->scales + (size_t)src * ng + (size_t)(8 * kb), sc + lr * 8, fold[lr], e2,
                   r2);
  }
  return 0;
}

/* ---- many matrices on one set of threads ----------------------------------- */

typedef struct {
  const mm_qmat *m;
  int gate_up;
  uint8_t *dst;
  float *row_scale;
} pack_mat;

typedef struct {
  const pack_tables *T;
  const pack_mat *mats;
  const int *item_mat; /* item -> matrix; items of a matrix are its tiles in order */
  const size_t *first_item;
  double *err2, *ref2; /* per item */
  char (*msg)[256];    /* per item; "" = fine */
} pack_run;

static void pack_item(void *ctx, size_t item) {
  pack_run *p = ctx;
  const pack_mat *pm = &p->mats[p->item_mat[item]];
  const int t = (int)(item - p->first_item[p->item_mat[item]]);
  const int KB = pm->m->cols / 128;
  const size_t rec = mm_sm90_record_bytes(p->T->mode);
  double e2 = 0.0, r2 = 0.0;
  /* mode 1: the groups' magnitude sets of the tile's rows, once, and the
   * row anchors from them; mode 3: the row anchors */
  const int g32 = p->T->mode == MM_WMODE_G32_FP8, ng = pm->m->cols / 32;
  int anchored[64] = {0}, anchor[64] = {0};
  uint8_t *nz = g32 ? malloc((size_t)64 * (size_t)(ng + KB)) : NULL;
  uint8_t *stops = nz ? nz + 64 * (size_t)ng : NULL; /* [64][KB]: each block's anchor shift */
  if (g32 && !nz) {
    snprintf(p->msg[item], 256, "%s", kOutOfMemory);
    return;
  }
  for (int lr = 0; g32 && lr < 64; lr++) {
    const int src = mm_sm90_src_row(64 * t + lr, pm->m->rows, pm->gate_up);
    g32_row_mags(p->T, pm->m->codes + (size_t)src * (size_t)(pm->m->cols / 2), ng, nz + (size_t)lr * ng);
    anchored[lr] = g32_row_anchor(p->T, pm->m, src, nz + (size_t)lr * ng, stops + lr * KB, &anchor[lr]);
  }
  for (int lr = 0; p->T->mode == MM_WMODE_G16_FP8 && lr < 64; lr++)
    anchored[lr] = g16_row_anchor(p->T, pm->m, mm_sm90_src_row(64 * t + lr, pm->m->rows, pm->gate_up),
                                  &anchor[lr]);
  for (int kb = 0; kb < KB; kb++) {
    uint8_t *R = pm->dst + ((size_t)t * (size_t)KB + (size_t)kb) * rec;
    if (pack_record(p->T, pm->m, pm->gate_up, t, kb, nz, stops, anchored, anchor, R, pm->row_scale,
                    &e2, &r2, p->msg[item])) {
      free(nz);
      return;
    }
  }
  free(nz);
  p->err2[item] = e2;
  p->ref2[item] = r2;
}

/* Packs mats[0..n). fe[2i], fe[2i+1]: matrix i's fold sums. On error returns
 * the reference's error for the first failing matrix and sets *failed. */
static mm_err *pack_mats(const pack_mat *mats, int n, mm_weight_mode mode, int threads,
                         double *fe, int *failed) {
  *failed = -1;
  /* A matrix the reference would refuse: pack only the ones before it. */
  int n_ok = n;
  mm_err *check_err = NULL;
  for (int i = 0; i < n && !check_err; i++)
    if ((check_err = mm_sm90_check_matrix(mats[i].m, mode, mats[i].gate_up))) n_ok = i;
  mm_err *err = NULL;
  pack_tables *T = malloc(sizeof *T);
  size_t *first_item = malloc(sizeof(size_t) * ((size_t)n_ok + 1));
  size_t items = 0;
  for (int i = 0; first_item && i < n_ok; i++) {
    first_item[i] = items;
    items += (size_t)(mats[i].m->rows / 64);
  }
  int *item_mat = malloc(sizeof(int) * (items + 1));
  double *err2 = calloc(items + 1, sizeof(double)), *ref2 = calloc(items + 1, sizeof(double));
  char(*msg)[256] = calloc(items + 1, sizeof(*msg));
  if (!T || !first_item || !item_mat || !err2 || !ref2 || !msg) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "sm90 layout: out of host memory");
    goto done;
  }
  if (n_ok > 0 && build_tables(T, mm_sm90_record_mode(mode)) != 0) { /* mode 4: mode 1's */
    err = mm_error(MEGAMOE_CODE_INTERNAL, "sm90 layout: code slots are not byte-aligned words");
    goto done;
  }
  for (int i = 0; i < n_ok; i++)
    for (int t = 0; t < mats[i].m->rows / 64; t++) item_mat[first_item[i] + (size_t)t] = i;
  pack_run run = {T, mats, item_mat, first_item, err2, ref2, msg};
  mm_parallel_items(items, mm_thread_count(threads), pack_item, &run);
  /* Sums per matrix in tile order; the first failing tile names the error. */
  for (int i = 0; i < n_ok && !err; i++) {
    double e2 = 0.0, r2 = 0.0;
    for (int t = 0; t < mats[i].m->rows / 64; t++) {
      size_t it = first_item[i] + (size_t)t;
      if (msg[it][0]) {
        const int oom = strcmp(msg[it], kOutOfMemory) == 0;
        err = mm_error(oom ? MEGAMOE_CODE_RESOURCE_EXHAUSTED : MEGAMOE_CODE_INVALID_ARGUMENT,
                       "sm90 layout: %s", msg[it]);
        *failed = i;
        break;
      }
      e2 += err2[it];
      r2 += ref2[it];
    }
    fe[2 * i] = e2;
    fe[2 * i + 1] = r2;
  }
  if (!err && check_err) {
    err = check_err;
    check_err = NULL;
    *failed = n_ok;
  }
done:
  mm_error_free(check_err);
  free(T);
  free(first_item);
  free(item_mat);
  free(err2);
  free(ref2);
  free(msg);
  return err;
}

mm_err *mm_sm90_pack_matrix_fast(const mm_qmat *m, mm_weight_mode mode, int gate_up,
                                 uint8_t *dst, float *row_scale, double fold_err[2],
                                 int threads) {
  pack_mat pm = {m, gate_up, dst, row_scale};
  double fe[2] = {0.0, 0.0};
  int failed;
  MM_TRY(pack_mats(&pm, 1, mode, threads, fe, &failed));
  if (fold_err) {
    fold_err[0] = fe[0];
    fold_err[1] = fe[1];
  }
  return NULL;
}

mm_err *mm_sm90_pack_experts(const mm_expert_q *experts, int count, int index_base,
                             mm_weight_mode mode, int threads, uint8_t *dst, float *rs13,
                             float *rs2, double fold_err[2]) {
  MM_ARG_CHECK(experts && count > 0 && dst && rs13 && rs2, "sm90 pack: %d experts", count);
  const mm_qmat *w13 = &experts[0].w13, *w2 = &experts[0].w2;
  const size_t b13 = mm_sm90_matrix_bytes(mode, w13->rows, w13->cols);
  const size_t b2 = mm_sm90_matrix_bytes(mode, w2->rows, w2->cols);
  for (int e = 1; e < count; e++)
    MM_ARG_CHECK(experts[e].w13.rows == w13->rows && experts[e].w13.cols == w13->cols &&
                     experts[e].w2.rows == w2->rows && experts[e].w2.cols == w2->cols,
                 "sm90 pack: local expert %d has other shapes than expert %d", index_base + e,
                 index_base);
  pack_mat *mats = malloc(sizeof(pack_mat) * 2 * (size_t)count);
  double *fe = calloc(2 * (size_t)count, 2 * sizeof(double));
  if (!mats || !fe) {
    free(mats);
    free(fe);
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "sm90 pack: out of host memory");
  }
  for (int e = 0; e < count; e++) {
    uint8_t *d = dst + (size_t)e * (b13 + b2);
    pack_mat a = {&experts[e].w13, 1, d, rs13 + (size_t)e * (size_t)w13->rows};
    pack_mat b = {&experts[e].w2, 0, d + b13, rs2 + (size_t)e * (size_t)w2->rows};
    mats[2 * e] = a;
    mats[2 * e + 1] = b;
  }
  int failed;
  mm_err *err = pack_mats(mats, 2 * count, mode, threads, fe, &failed);
  if (err && failed >= 0) {
    err = mm_error_wrap(err, failed % 2 ? "local expert %d w2 (down)" : "local expert %d w13 (gate/up)",
                        index_base + failed / 2);
  } else if (!err && fold_err) {
    for (int i = 0; i < 2 * count; i++) {
      fold_err[0] += fe[2 * i];
      fold_err[1] += fe[2 * i + 1];
    }
  }
  free(mats);
  free(fe);
  return err;
}

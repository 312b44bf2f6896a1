/* layout_sm90_pack.c -- fast host packing of the sm90 kernel layout (see
 * layout_sm90_pack.h): the steps of layout_sm90_pack_rules.h on threads
 * over 64-row tiles. Per tile the work and the sums are in the reference's
 * order, so the fold sums are bit-identical too. */
#include "layout_sm90_pack.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "formats.h"
#include "layout_sm90_pack_rules.h"
#include "parallel.h"

static const float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
static const char kOutOfMemory[] = "out of host memory";

int mm_sm90_pack_tables_build(mm_sm90_pack_tables *T, mm_weight_mode mode) {
  memset(T, 0, sizeof *T);
  T->mode = (int32_t)mode;
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

void mm_sm90p_fault_message(const mm_sm90p_fault *f, char msg[256]) {
  switch (f->kind) {
  case MM_SM90P_FAULT_NAN_E4M3:
    snprintf(msg, 256, "row %d group %d: E4M3 scale byte 0x%02X is NaN", f->src, f->group,
             (unsigned)f->byte);
    break;
  case MM_SM90P_FAULT_NAN_UE8M0:
    snprintf(msg, 256, "row %d group %d: UE8M0 scale byte 0xFF is NaN", f->src, f->group);
    break;
  case MM_SM90P_FAULT_SPREAD:
    snprintf(msg, 256,
             "row %d columns %d..%d: UE8M0 group exponents 2^%d..2^%d are too far apart "
             "to fold exactly into FP8 E4M3 under one FP32 scale (2^%d apart at most "
             "per 128 columns guaranteed); requantize this tensor or use gran_k 16 bf16-exact",
             f->src, f->kb * 128, f->kb * 128 + 127, f->emin - 127, f->emax - 127, 14);
    break;
  case MM_SM90P_FAULT_FOLD_RANGE:
    snprintf(msg, 256, "row %d group %d: internal fold range error", f->src, f->group);
    break;
  default:
    snprintf(msg, 256, "row %d: unknown packing fault %d", f->src, f->kind);
  }
}

/* ---- one record ------------------------------------------------------------ */

/* Packs record (tile t, K-block kb) of m into R; nz, stops, anchor: the
 * tile's rows' mm_sm90p_row_anchor results. Returns 0, or -1 with msg. */
static int pack_record(const mm_sm90_pack_tables *T, const mm_qmat *m, int gate_up, int t, int kb,
                       const uint8_t *nz, const uint8_t *stops, const int32_t *anchor, uint8_t *R,
                       float *row_scale, double *e2, double *r2, char *msg) {
  const int G = mm_sm90_groups_per_row((mm_weight_mode)T->mode);
  const size_t ng = (size_t)(m->cols / 32), KB = (size_t)(m->cols / 128); /* mode 1's nz, stops */
  uint8_t in[64 * 64]; /* the record's source code bytes, row-major, signs flipped (mode 3) */
  int16_t ref[64];
  int fold[64]; /* mode 3: the exponent of each row's folded values */
  uint8_t *sc = R + mm_sm90_scale_offset();
  for (int lr = 0; lr < 64; lr++) {
    mm_sm90p_fault f;
    if (mm_sm90p_record_row(T, m, gate_up, t, kb, lr, nz ? nz + (size_t)lr * ng : NULL,
                            stops ? stops + (size_t)lr * KB : NULL, anchor[lr], in + 64 * lr,
                            sc + lr * G, &ref[lr], &fold[lr], &row_scale[64 * t + lr], &f)) {
      mm_sm90p_fault_message(&f, msg);
      return -1;
    }
  }
  for (int w = 0; w < 1024; w++) {
    const uint32_t word = mm_sm90p_word(T, in, w);
    memcpy(R + 4 * w, &word, 4);
  }
  const mm_weight_mode mode = (mm_weight_mode)T->mode;
  if (mm_sm90_has_ref(mode)) memcpy(R + mm_sm90_ref_offset(mode), ref, sizeof(ref));
  /* Only mode 3 is lossy; modes 1 and 2 have no fold error (as the reference). */
  for (int lr = 0; lr < 64; lr++)
    mm_sm90p_record_row_error(T, m, gate_up, t, kb, lr, sc + lr * G, fold[lr], e2, r2);
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
  const mm_sm90_pack_tables *T;
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
  const size_t rec = mm_sm90_record_bytes((mm_weight_mode)p->T->mode);
  double e2 = 0.0, r2 = 0.0;
  /* the rows' work before the records: mode 1 the groups' magnitude sets
   * and each block's search; modes 1 and 3 the row anchors */
  const int g32 = p->T->mode == MM_WMODE_G32_FP8, ng = pm->m->cols / 32;
  int32_t anchor[64];
  uint8_t *nz = g32 ? malloc((size_t)64 * (size_t)(ng + KB)) : NULL;
  uint8_t *stops = nz ? nz + 64 * (size_t)ng : NULL; /* [64][KB] */
  if (g32 && !nz) {
    snprintf(p->msg[item], 256, "%s", kOutOfMemory);
    return;
  }
  for (int lr = 0; lr < 64; lr++)
    anchor[lr] = mm_sm90p_row_anchor(p->T, pm->m, pm->gate_up, 64 * t + lr,
                                     nz ? nz + (size_t)lr * ng : NULL,
                                     stops ? stops + (size_t)lr * KB : NULL);
  for (int kb = 0; kb < KB; kb++) {
    uint8_t *R = pm->dst + ((size_t)t * (size_t)KB + (size_t)kb) * rec;
    if (pack_record(p->T, pm->m, pm->gate_up, t, kb, nz, stops, anchor, R, pm->row_scale, &e2,
                    &r2, p->msg[item])) {
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
  mm_sm90_pack_tables *T = malloc(sizeof *T);
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
  if (n_ok > 0 && mm_sm90_pack_tables_build(T, mm_sm90_record_mode(mode)) != 0) { /* mode 4: mode 1's */
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

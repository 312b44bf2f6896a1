/* layout_sm100.c -- DeepGEMM SM100 MegaMoE layout export / import (CPU).
 * Both directions walk canonical rows; a row's scale bytes land in one
 * column q of the MN-major word matrix, byte g%4 of word g/4. */
#include "layout_sm100.h"

#include <string.h>

#include "parallel.h"

mm_err *mm_sm100_check_shape(const mm_sm100_shape *s) {
  MM_ARG_CHECK(s->E >= 1, "sm100 layout: E = %d experts, need >= 1", s->E);
  MM_ARG_CHECK(s->gran == 16 || s->gran == 32, "sm100 layout: gran_k = %d, need 16 or 32",
               s->gran);
  MM_ARG_CHECK(s->H > 0 && s->H % 128 == 0,
               "sm100 layout: H = %d is not a positive multiple of 128 (UTCCP 128-row chunks)",
               s->H);
  MM_ARG_CHECK(s->I > 0 && s->I % 64 == 0,
               "sm100 layout: I = %d is not a positive multiple of 64 (2I rows in 128-row "
               "chunks, gate/up blocks of 8)",
               s->I);
  return NULL;
}

size_t mm_sm100_w13_bytes(const mm_sm100_shape *s) {
  return (size_t)s->E * 2 * (size_t)s->I * (size_t)(s->H / 2);
}
size_t mm_sm100_w2_bytes(const mm_sm100_shape *s) {
  return (size_t)s->E * (size_t)s->H * (size_t)(s->I / 2);
}
size_t mm_sm100_s13_bytes(const mm_sm100_shape *s) {
  return (size_t)s->E * 2 * (size_t)s->I * (size_t)mm_sm100_sfk(s->H, s->gran);
}
size_t mm_sm100_s2_bytes(const mm_sm100_shape *s) {
  return (size_t)s->E * (size_t)s->H * (size_t)mm_sm100_sfk(s->I, s->gran);
}
size_t mm_sm100_s13_words(const mm_sm100_shape *s) {
  return (size_t)s->E * (size_t)mm_sm100_packed_k(mm_sm100_sfk(s->H, s->gran)) *
         (size_t)mm_sm100_tma_mn(2 * s->I);
}
size_t mm_sm100_s2_words(const mm_sm100_shape *s) {
  return (size_t)s->E * (size_t)mm_sm100_packed_k(mm_sm100_sfk(s->I, s->gran)) *
         (size_t)mm_sm100_tma_mn(s->H);
}

/* One direction over the rows of one matrix kind (L1 or L2) of all experts. */
typedef struct {
  const mm_sm100_shape *s;
  int l1;            /* 1: w13/s13 (interleave + transpose), 0: w2/s2 */
  int mn, sfk, row_bytes;
  int export_dir;    /* 1: canonical -> sm100 */
  uint8_t *w_canon, *s_canon;
  uint8_t *w_sm, *s_sm_bytes; /* word storage viewed as bytes (little endian) */
} rows_ctx;

static void do_rows(void *arg, size_t begin, size_t end) {
  rows_ctx *c = arg;
  int P = mm_sm100_packed_k(c->sfk), mna = mm_sm100_tma_mn(c->mn);
  for (size_t idx = begin; idx < end; idx++) {
    int e = (int)(idx / (size_t)c->mn), r = (int)(idx % (size_t)c->mn);
    int n = c->l1 ? mm_sm100_interleave_pos(r, c->s->I) : r; /* weight row */
    int q = mm_sm100_utccp_row(n);                             /* scale column */
    size_t wc = idx * (size_t)c->row_bytes;
    size_t ws = ((size_t)e * (size_t)c->mn + (size_t)n) * (size_t)c->row_bytes;
    size_t sc = idx * (size_t)c->sfk;
    uint8_t *wd = c->s_sm_bytes + 4 * ((size_t)e * (size_t)P * (size_t)mna + (size_t)q);
    if (c->export_dir) {
      memcpy(c->w_sm + ws, c->w_canon + wc, (size_t)c->row_bytes);
      for (int p = 0; p < P; p++)
        for (int j = 0; j < 4; j++) {
          int g = 4 * p + j;
          wd[4 * (size_t)p * (size_t)mna + (size_t)j] = g < c->sfk ? c->s_canon[sc + (size_t)g] : 0;
        }
    } else {
      memcpy(c->w_canon + wc, c->w_sm + ws, (size_t)c->row_bytes);
      for (int p = 0; p < P; p++)
        for (int j = 0; j < 4; j++) {
          int g = 4 * p + j;
          if (g < c->sfk) c->s_canon[sc + (size_t)g] = wd[4 * (size_t)p * (size_t)mna + (size_t)j];
        }
    }
  }
}

/* Import: the bytes of the last word past SFK, and the TMA padding columns,
 * must be 0 (DeepGEMM writes 0 there; anything else is not this layout). */
static mm_err *check_padding(const rows_ctx *c) {
  int P = mm_sm100_packed_k(c->sfk), mna = mm_sm100_tma_mn(c->mn);
  const char *what = c->l1 ? "s13" : "s2";
  for (int e = 0; e < c->s->E; e++)
    for (int q = 0; q < mna; q++)
      for (int p = 0; p < P; p++)
        for (int j = 0; j < 4; j++) {
          if (q < c->mn && 4 * p + j < c->sfk) continue;
          uint8_t b = c->s_sm_bytes[4 * (((size_t)e * (size_t)P + (size_t)p) * (size_t)mna + (size_t)q) + (size_t)j];
          if (b != 0)
            return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                            "sm100 layout: %s expert %d word (%d, %d) byte %d is 0x%02x, "
                            "expected 0 padding (not DeepGEMM sm100 layout data)",
                            what, e, q, p, j, b);
        }
  return NULL;
}

static int host_is_little_endian(void) {
  uint32_t one = 1;
  uint8_t b;
  memcpy(&b, &one, 1);
  return b == 1;
}

static mm_err *run_dir(const mm_sm100_shape *s, const mm_sm100_canon *cn,
                       const mm_sm100_packed *pk, int export_dir, int threads) {
  MM_TRY(mm_sm100_check_shape(s));
  MM_ARG_CHECK(host_is_little_endian(), "sm100 layout: big-endian hosts are not supported");
  MM_ARG_CHECK(cn->w13 && cn->s13 && cn->w2 && cn->s2 && pk->w13 && pk->s13 && pk->w2 && pk->s2,
               "sm100 layout: NULL array");
  int nt = mm_thread_count(threads);
  for (int l1 = 1; l1 >= 0; l1--) {
    rows_ctx c = {0};
    c.s = s;
    c.l1 = l1;
    c.mn = l1 ? 2 * s->I : s->H;
    c.sfk = mm_sm100_sfk(l1 ? s->H : s->I, s->gran);
    c.row_bytes = (l1 ? s->H : s->I) / 2;
    c.export_dir = export_dir;
    c.w_canon = l1 ? cn->w13 : cn->w2;
    c.s_canon = l1 ? cn->s13 : cn->s2;
    c.w_sm = l1 ? pk->w13 : pk->w2;
    c.s_sm_bytes = (uint8_t *)(l1 ? pk->s13 : pk->s2);
    if (export_dir) /* padding rows of the TMA-aligned storage stay 0 */
      memset(c.s_sm_bytes, 0, 4 * (l1 ? mm_sm100_s13_words(s) : mm_sm100_s2_words(s)));
    if (!export_dir) MM_TRY(check_padding(&c));
    mm_parallel_for((size_t)s->E * (size_t)c.mn, nt, do_rows, &c);
  }
  return NULL;
}

mm_err *mm_sm100_export(const mm_sm100_shape *s, const mm_sm100_canon *in,
                        const mm_sm100_packed *out, int threads) {
  return run_dir(s, in, out, 1, threads);
}

mm_err *mm_sm100_import(const mm_sm100_shape *s, const mm_sm100_packed *in,
                        const mm_sm100_canon *out, int threads) {
  return run_dir(s, out, in, 0, threads);
}

mm_err *mm_f32_scales_to_ue8m0(const float *in, size_t n, uint8_t *out, const char *what) {
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, &in[i], 4);
    uint32_t ex = (u >> 23) & 0xFF;
    if ((u & 0x807FFFFFu) != 0 || ex == 0xFF)
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                      "%s: element %zu = %g (bits 0x%08x) is not a positive power of two "
                      "(UE8M0 scales need sign and mantissa bits clear)",
                      what, i, (double)in[i], u);
    out[i] = (uint8_t)ex;
  }
  return NULL;
}

void mm_sm100_canon_free(mm_sm100_canon *c) {
  free(c->w13);
  free(c->s13);
  free(c->w2);
  free(c->s2);
  memset(c, 0, sizeof(*c));
}

mm_err *mm_sm100_canon_from_experts(const mm_expert_q *experts, int num_local,
                                    mm_sm100_shape *shape, mm_sm100_canon *out) {
  memset(out, 0, sizeof(*out));
  MM_ARG_CHECK(num_local >= 1, "sm100 export: no experts");
  const mm_qmat *a = &experts[0].w13;
  mm_sm100_shape s = {num_local, a->cols, a->rows / 2, a->gran};
  for (int e = 0; e < num_local; e++) {
    const mm_qmat *m[2] = {&experts[e].w13, &experts[e].w2};
    for (int k = 0; k < 2; k++) {
      const mm_qmat *x = m[k];
      int rows = k ? s.H : 2 * s.I, cols = k ? s.I : s.H;
      MM_ARG_CHECK(x->rows == rows && x->cols == cols && x->gran == s.gran,
                   "sm100 export: expert %d %s is [%d, %d] gran %d, expected [%d, %d] gran %d", e,
                   k ? "w2" : "w13", x->rows, x->cols, x->gran, rows, cols, s.gran);
      MM_ARG_CHECK(x->sf == MM_SF_UE8M0,
                   "sm100 export: expert %d %s has E4M3 scales; the DeepGEMM sm100 layout takes "
                   "UE8M0 (use requant.policy group16-to-group32 or an MXFP4 checkpoint)",
                   e, k ? "w2" : "w13");
      for (int r = 0; r < x->rows; r++)
        MM_ARG_CHECK(x->row_scale[r] == 1.0f,
                     "sm100 export: expert %d %s row %d has a row scale %g != 1 (the layout has "
                     "no place for it)",
                     e, k ? "w2" : "w13", r, (double)x->row_scale[r]);
    }
  }
  MM_TRY(mm_sm100_check_shape(&s));
  out->w13 = malloc(mm_sm100_w13_bytes(&s));
  out->s13 = malloc(mm_sm100_s13_bytes(&s));
  out->w2 = malloc(mm_sm100_w2_bytes(&s));
  out->s2 = malloc(mm_sm100_s2_bytes(&s));
  if (!out->w13 || !out->s13 || !out->w2 || !out->s2) {
    mm_sm100_canon_free(out);
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "sm100 export: out of memory");
  }
  size_t w13b = mm_sm100_w13_bytes(&s) / (size_t)num_local, s13b = mm_sm100_s13_bytes(&s) / (size_t)num_local;
  size_t w2b = mm_sm100_w2_bytes(&s) / (size_t)num_local, s2b = mm_sm100_s2_bytes(&s) / (size_t)num_local;
  for (int e = 0; e < num_local; e++) {
    memcpy(out->w13 + (size_t)e * w13b, experts[e].w13.codes, w13b);
    memcpy(out->s13 + (size_t)e * s13b, experts[e].w13.scales, s13b);
    memcpy(out->w2 + (size_t)e * w2b, experts[e].w2.codes, w2b);
    memcpy(out->s2 + (size_t)e * s2b, experts[e].w2.scales, s2b);
  }
  *shape = s;
  return NULL;
}

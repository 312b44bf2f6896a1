/* test_load_fast.c -- the fast CPU load path against what it replaced:
 *  - the requant (planned per magnitude, plugin/requant.c) against the
 *    previous per-element loop, kept here as the oracle: identical code and
 *    scale bytes and bit-identical error sums, on random data with negative,
 *    subnormal and extreme scales and row factors, zero and -0 codes, and
 *    non-finite values (same row and group refused);
 *  - the parallel layer loader: identical experts and report for 1, 2 and 5
 *    threads in every scale encoding (with and without requant), the
 *    converted-scale requant path against decode + requant of each tensor,
 *    and with faults in several experts the error a sequential load meets
 *    first. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"
#include "harness.h"
#include "requant.h"
#include "weights_load.h"

/* ---- the previous per-element requant (oracle) ----------------------------- */

static const float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Returns -1 and the first bad row (its first bad group) on a non-finite
 * value, else 0 with the stats. */
static int old_requant(const mm_g16_source *s, uint8_t *codes_out, uint8_t *scales_out,
                       mm_requant_stats *stats, int *bad_row, int *bad_group) {
  size_t cb = (size_t)s->cols / 2, g16 = (size_t)s->cols / 16, g32 = (size_t)s->cols / 32;
  mm_requant_stats acc = {0};
  for (size_t r = 0; r < (size_t)s->rows; r++) {
    const uint8_t *in = s->codes + r * cb, *sc = s->scales + r * g16;
    uint8_t *out = codes_out + r * cb, *so = scales_out + r * g32;
    float rs = s->row_scale ? s->row_scale[r] : 1.0f;
    double src_sq = 0.0, err_sq = 0.0, max_abs = 0.0;
    for (size_t g = 0; g < g32; g++) {
      float v[32];
      uint32_t nonfinite = 0;
      for (int h = 0; h < 2; h++) {
        float s16 = s->sf == MM_SF_E4M3 ? mm_e4m3_to_float(sc[2 * g + (size_t)h])
                                        : mm_ue8m0_to_float(sc[2 * g + (size_t)h]);
        const uint8_t *p = in + 16 * g + 8 * (size_t)h;
        for (int j = 0; j < 8; j++) {
          float a = kE2M1[p[j] & 0xF] * s16, b = kE2M1[p[j] >> 4] * s16;
          v[16 * h + 2 * j] = a * rs;
          v[16 * h + 2 * j + 1] = b * rs;
        }
      }
      for (int i = 0; i < 32; i++) {
        uint32_t u;
        memcpy(&u, &v[i], 4);
        nonfinite |= (u & 0x7F800000u) == 0x7F800000u;
      }
      if (nonfinite) {
        *bad_row = (int)r;
        *bad_group = (int)g;
        return -1;
      }
      uint8_t b = mm_requant_group32(v, out + 16 * g);
      so[g] = b;
      double step = ldexp(1.0, (int)b - 127), gs = 0.0, ge = 0.0, gm = 0.0;
      for (int i = 0; i < 32; i++) {
        uint8_t code = (uint8_t)((out[16 * g + (size_t)i / 2] >> ((i & 1) * 4)) & 0xF);
        double x = (double)v[i], d = x - (double)kE2M1[code] * step;
        gs += x * x;
        ge += d * d;
        gm = fabs(d) > gm ? fabs(d) : gm;
      }
      src_sq += gs;
      err_sq += ge;
      if (gm > max_abs) max_abs = gm;
    }
    mm_requant_stats one = {src_sq, err_sq, max_abs, 0.0, s->cols};
    mm_requant_stats_merge(&acc, &one);
  }
  *stats = acc;
  return 0;
}

static int same_bits(double a, double b) { return memcmp(&a, &b, sizeof a) == 0; }

static uint8_t rand_e4m3_signed(void) {
  for (;;) {
    uint8_t b = (uint8_t)mm_test_rand_u64();
    if (!mm_e4m3_is_nan(b)) return b;
  }
}

typedef struct {
  mm_g16_source s;
  uint8_t *codes, *scales;
  float *rs;
} src_t;

static void make_src(src_t *x, int rows, int cols, mm_scale_format sf, int with_rs, int kind) {
  x->codes = malloc((size_t)rows * (size_t)cols / 2 + 1);
  x->scales = malloc((size_t)rows * (size_t)cols / 16 + 1);
  x->rs = with_rs ? malloc(sizeof(float) * (size_t)rows) : NULL;
  size_t n16 = (size_t)rows * (size_t)cols / 16;
  for (size_t i = 0; i < (size_t)rows * (size_t)cols / 2; i++)
    x->codes[i] = (uint8_t)mm_test_rand_u64();
  for (size_t k = 0; k < n16; k++) {
    uint64_t u = mm_test_rand_u64();
    if (sf == MM_SF_E4M3)
      x->scales[k] = kind ? rand_e4m3_signed() : (uint8_t)(0x30 + u % 0x20);
    else
      x->scales[k] = (uint8_t)(!kind ? 110 + u % 30 : u % 7 == 0 ? u % 3 : u % 5 == 0 ? 250 - u % 3 : 90 + u % 60);
    if (u % 13 == 0) memset(x->codes + 8 * k, (int)(u >> 8) & 0x88, 8); /* zeros, -0 */
    if (u % 31 == 0) memset(x->codes + 8 * k, 0x77, 8);                 /* all max */
  }
  for (int r = 0; with_rs && r < rows; r++) {
    uint64_t u = mm_test_rand_u64();
    x->rs[r] = (kind && u % 3 == 0 ? -1.0f : 1.0f) *
               (sf == MM_SF_UE8M0 ? ldexpf(1.0f, (int)(u % 5) - 2) : mm_test_uniform(1e-6f, 8.0f));
    if (kind && u % 11 == 0) x->rs[r] = 1e-38f; /* subnormal products */
  }
  mm_g16_source s = {rows, cols, sf, x->codes, x->scales, x->rs};
  x->s = s;
}

static void free_src(src_t *x) { free(x->codes), free(x->scales), free(x->rs); }

/* New requant (threads 1 and 3, with and without stats) against the oracle. */
static void compare_requant(const mm_g16_source *s) {
  size_t cb = (size_t)s->rows * (size_t)s->cols / 2, sb = (size_t)s->rows * (size_t)s->cols / 32;
  uint8_t *oc = malloc(cb + 1), *os = malloc(sb + 1), *nc = malloc(cb + 1), *ns = malloc(sb + 1);
  mm_requant_stats ost = {0};
  int bad_row = -1, bad_group = -1;
  int old_bad = old_requant(s, oc, os, &ost, &bad_row, &bad_group) != 0;
  for (int t = 1; t <= 3; t += 2)
    for (int want = 0; want < 2; want++) {
      memset(nc, 0xC3, cb + 1);
      memset(ns, 0xC3, sb + 1);
      mm_requant_stats nst;
      mm_err *e = mm_requant_g16_to_g32(s, nc, ns, t, want ? &nst : NULL);
      CHECK_MSG(!e == !old_bad, "[%d, %d] sf %d: old %s, new %s", s->rows, s->cols, (int)s->sf,
                old_bad ? "refused" : "ok", e ? e->message : "ok");
      if (e && old_bad) {
        char want_msg[64];
        snprintf(want_msg, sizeof want_msg, "row %d, elements %d..%d:", bad_row, 32 * bad_group,
                 32 * bad_group + 31);
        CHECK_MSG(strstr(e->message, want_msg) != NULL, "'%s' lacks '%s'", e->message, want_msg);
      }
      if (!e && !old_bad) {
        CHECK_MSG(memcmp(nc, oc, cb) == 0, "codes differ [%d, %d] sf %d", s->rows, s->cols,
                  (int)s->sf);
        CHECK_MSG(memcmp(ns, os, sb) == 0, "scales differ [%d, %d] sf %d", s->rows, s->cols,
                  (int)s->sf);
        CHECK(nc[cb] == 0xC3 && ns[sb] == 0xC3);
        if (want)
          CHECK_MSG(same_bits(nst.src_sq, ost.src_sq) && same_bits(nst.err_sq, ost.err_sq) &&
                        same_bits(nst.max_abs, ost.max_abs) && same_bits(nst.rel_rms, ost.rel_rms) &&
                        nst.count == ost.count,
                    "stats differ: %.17g %.17g %.17g vs %.17g %.17g %.17g", nst.src_sq,
                    nst.err_sq, nst.max_abs, ost.src_sq, ost.err_sq, ost.max_abs);
      }
      mm_error_free(e);
    }
  free(oc), free(os), free(nc), free(ns);
}

static void test_requant_vs_per_element(void) {
  static const int shapes[][2] = {{1, 32}, {3, 96}, {7, 160}, {5, 224}, {33, 2048}, {8, 6144}};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
    for (int sf = 1; sf <= 2; sf++)
      for (int kind = 0; kind < 2; kind++) {
        src_t x;
        make_src(&x, shapes[i][0], shapes[i][1], (mm_scale_format)sf, kind || sf == 1, kind);
        compare_requant(&x.s);
        /* non-finite values: NaN scale, overflowing product, infinite row factor */
        size_t n16 = (size_t)shapes[i][0] * (size_t)shapes[i][1] / 16;
        size_t k = (size_t)(mm_test_rand_u64() % n16);
        uint8_t keep = x.scales[k];
        x.scales[k] = sf == 1 ? 0x7F : 0xFF;
        compare_requant(&x.s);
        x.scales[k] = keep;
        if (x.rs) {
          int r = (int)(mm_test_rand_u64() % (uint64_t)shapes[i][0]);
          float kr = x.rs[r];
          x.rs[r] = 3e38f; /* overflows unless the row's codes are all zero */
          if (sf == 1) memset(x.scales + (size_t)r * (size_t)(shapes[i][1] / 16), 0x7E, 2);
          compare_requant(&x.s);
          x.rs[r] = INFINITY;
          compare_requant(&x.s);
          x.rs[r] = kr;
        }
        free_src(&x);
      }
}

/* All zero codes with any scales; a single nonzero code among zeros. */
static void test_requant_sparse(void) {
  src_t x;
  make_src(&x, 4, 256, MM_SF_E4M3, 1, 1);
  memset(x.codes, 0, 4 * 128);
  compare_requant(&x.s);
  x.codes[77] = 0x90; /* one -0.5 beside a -0 */
  x.codes[200] = 0x07;
  compare_requant(&x.s);
  free_src(&x);
}

/* ---- the parallel loader ------------------------------------------------- */

#define H 256
#define I 128
#define NEXP 8
#define MAXT (NEXP * 3 * 4)

#include "tensor_list.h"

#include "layer_builder.h"

typedef lb_fmt fmt;

static uint8_t lf_scale_byte(lb_fmt f) {
  return f == LB_NVFP4 ? (uint8_t)(0x28 + mm_test_rand_u64() % 0x30)
                       : (uint8_t)(112 + mm_test_rand_u64() % 24);
}
static float lf_global_scale(const layer_t *L, int e, int p) {
  (void)L, (void)e, (void)p;
  return mm_test_uniform(1e-4f, 1e-2f);
}
static float lf_input_scale(int e, int p) {
  (void)p;
  return 0.25f * (float)(e + 1);
}

static void make_layer(layer_t *L, fmt f) {
  const lb_opts o = {"model.layers.1.", NEXP, H, I, lf_scale_byte, lf_global_scale,
                     lf_input_scale};
  lb_make_layer(L, f, &o);
}


static mm_tensor_view *V(layer_t *L, const char *name) {
  char nm[80];
  snprintf(nm, sizeof nm, "model.layers.1.mlp.experts.%s", name);
  for (int i = 0; i < L->n; i++)
    if (strcmp(L->v[i].name, nm) == 0) return &L->v[i];
  printf("# test bug: no tensor %s\n", nm);
  exit(2);
}

static void base_cfg(mm_config *c, int threads) {
  mm_config_defaults(c);
  c->model.hidden_size = H;
  c->model.moe_intermediate_size = I;
  c->model.num_experts = NEXP;
  c->cpu_threads = threads;
}

static int same_qmat(const mm_qmat *a, const mm_qmat *b) {
  if (a->rows != b->rows || a->cols != b->cols || a->gran != b->gran || a->sf != b->sf) return 0;
  size_t n = (size_t)a->rows * (size_t)a->cols;
  return memcmp(a->codes, b->codes, n / 2) == 0 &&
         memcmp(a->scales, b->scales, n / (size_t)a->gran) == 0 &&
         memcmp(a->row_scale, b->row_scale, sizeof(float) * (size_t)a->rows) == 0;
}

static void free_experts(mm_expert_q *x, int n) {
  for (int i = 0; i < n; i++) mm_qmat_free(&x[i].w13), mm_qmat_free(&x[i].w2);
}

/* Loads experts 1..6 with 1, 2 and 5 threads: identical results. */
static void threads_agree(layer_t *L, int requant, int gran_k) {
  mm_expert_q x[3][6];
  mm_requant_report rep[3];
  static const int threads[3] = {1, 2, 5};
  for (int t = 0; t < 3; t++) {
    mm_config cfg;
    base_cfg(&cfg, threads[t]);
    cfg.requant_policy = requant ? MM_REQUANT_G16_TO_G32 : MM_REQUANT_NONE;
    cfg.gran_k = gran_k;
    CHECK_OK(mm_weights_load_layer(&cfg, L->v, (size_t)L->n, 1, 6, x[t], &rep[t]));
  }
  for (int t = 1; t < 3; t++) {
    for (int e = 0; e < 6; e++)
      CHECK_MSG(same_qmat(&x[0][e].w13, &x[t][e].w13) && same_qmat(&x[0][e].w2, &x[t][e].w2),
                "expert %d differs with %d threads", 1 + e, threads[t]);
    CHECK(rep[t].num_tensors == 18 && rep[0].num_tensors == 18);
    CHECK(memcmp(rep[0].tensors, rep[t].tensors, sizeof(mm_tensor_report) * 18) == 0);
    CHECK(strcmp(rep[0].summary, rep[t].summary) == 0);
    CHECK(same_bits(rep[0].total.rel_rms, rep[t].total.rel_rms) &&
          rep[0].worst_tensor == rep[t].worst_tensor);
  }
  printf("# %s\n", rep[0].summary);
  for (int t = 0; t < 3; t++) {
    free_experts(x[t], 6);
    mm_requant_report_free(&rep[t]);
  }
}

static void test_loader_threads(void) {
  static const fmt fs[] = {LB_NVFP4, LB_MX_U8, LB_MX_I32, LB_MX_F32, LB_UE8M0_G16, LB_G16_I32, LB_G16_F32};
  for (size_t i = 0; i < sizeof fs / sizeof fs[0]; i++) {
    layer_t L;
    make_layer(&L, fs[i]);
    int g16 = lb_group(fs[i]) == 16;
    threads_agree(&L, 0, 0);
    if (g16) threads_agree(&L, 1, 32);
    free_layer(&L);
  }
}

/* Requant from converted scales (I32, F32): each tensor decoded, then
 * requantized on its own, gives the same bytes. */
static void test_loader_requant_converted(void) {
  static const fmt fs[] = {LB_G16_I32, LB_G16_F32, LB_NVFP4};
  static const char *pn[3] = {"gate_proj", "up_proj", "down_proj"};
  for (int k = 0; k < 3; k++) {
    layer_t L;
    make_layer(&L, fs[k]);
    mm_config cfg;
    base_cfg(&cfg, 3);
    cfg.requant_policy = MM_REQUANT_G16_TO_G32;
    mm_expert_q x[NEXP];
    CHECK_OK(mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 0, NEXP, x, NULL));
    for (int e = 0; e < NEXP; e += 3)
      for (int p = 0; p < 3; p++) {
        char nm[64];
        snprintf(nm, sizeof nm, "%d.%s.weight", e, pn[p]);
        mm_tensor_view *w = V(&L, nm);
        snprintf(nm, sizeof nm, "%d.%s.weight_scale", e, pn[p]);
        mm_tensor_view *s = V(&L, nm), *g = NULL;
        if (fs[k] == LB_NVFP4) {
          snprintf(nm, sizeof nm, "%d.%s.weight_scale_2", e, pn[p]);
          g = V(&L, nm);
        }
        mm_proj_views pv = {w, s, g, NULL};
        mm_qmat q, d;
        CHECK_OK(mm_weights_decode_proj("t", &pv, 0, 0, 0, 1, &q, NULL));
        CHECK_OK(mm_requant_qmat(&q, 1, &d, NULL));
        const mm_qmat *m = p == 2 ? &x[e].w2 : &x[e].w13;
        size_t r0 = p == 1 ? I : 0, K = (size_t)q.cols;
        CHECK(memcmp(m->codes + r0 * K / 2, d.codes, (size_t)q.rows * K / 2) == 0);
        CHECK(memcmp(m->scales + r0 * K / 32, d.scales, (size_t)q.rows * K / 32) == 0);
        mm_qmat_free(&q);
        mm_qmat_free(&d);
      }
    free_experts(x, NEXP);
    free_layer(&L);
  }
}

/* Faults in several experts: the error is the one a sequential load meets
 * first (lowest expert; within an expert gate, up, down, then the requant). */
typedef void (*mutate_fn)(layer_t *, mm_config *);

static void expect_first(const char *what, fmt f, mutate_fn mutate, megamoe_code code,
                         const char *needle) {
  for (int threads = 1; threads <= 4; threads += 3) {
    layer_t L;
    make_layer(&L, f);
    mm_config cfg;
    base_cfg(&cfg, threads);
    mutate(&L, &cfg);
    mm_expert_q x[6];
    memset(x, 0x55, sizeof x);
    mm_requant_report rep;
    mm_err *e = mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 1, 6, x, &rep);
    CHECK_MSG(e != NULL, "%s: loaded", what);
    if (e) {
      CHECK_MSG(e->code == code, "%s: code %d (%s)", what, (int)e->code, e->message);
      CHECK_MSG(strstr(e->message, needle) != NULL, "%s: '%s' lacks '%s'", what, e->message,
                needle);
      if (threads == 1) printf("# %s: %s\n", what, e->message);
      mm_error_free(e);
    }
    for (int i = 0; i < 6; i++) CHECK(!x[i].w13.codes && !x[i].w2.codes && !x[i].w2.scales);
    CHECK(rep.tensors == NULL);
    free_layer(&L);
  }
}

static void m_nan_late_and_global_early(layer_t *L, mm_config *c) {
  ((uint8_t *)V(L, "5.gate_proj.weight_scale")->data)[3] = 0x7F;
  *(float *)V(L, "3.down_proj.weight_scale_2")->data = -1.0f;
}
static void m_shape_late_nan_early(layer_t *L, mm_config *c) {
  V(L, "6.up_proj.weight")->shape[1] = 7;
  ((uint8_t *)V(L, "2.down_proj.weight_scale")->data)[40] = 0xFF;
}
static void m_up_nan_vs_down_format(layer_t *L, mm_config *c) {
  ((uint8_t *)V(L, "4.up_proj.weight_scale")->data)[0] = 0x7F; /* met first */
  V(L, "4.down_proj.weight_scale")->dtype = MM_DT_U8;          /* a second format */
}
static void m_down_format_vs_later_nan(layer_t *L, mm_config *c) {
  V(L, "4.down_proj.weight_scale")->dtype = MM_DT_U8;
  ((uint8_t *)V(L, "5.up_proj.weight_scale")->data)[0] = 0x7F;
}
static void m_other_format_with_nan(layer_t *L, mm_config *c) {
  V(L, "3.gate_proj.weight_scale")->dtype = MM_DT_U8;
  ((uint8_t *)V(L, "3.gate_proj.weight_scale")->data)[9] = 0xFF; /* its own data error first */
}
static void m_requant_limit_vs_later_nan(layer_t *L, mm_config *c) {
  c->requant_policy = MM_REQUANT_G16_TO_G32;
  c->requant_max_rel_error = 0.01; /* every tensor exceeds it: expert 1's gate is first */
  ((uint8_t *)V(L, "2.gate_proj.weight_scale")->data)[1] = 0x7F;
}
static void m_requant_limit_vs_same_expert_nan(layer_t *L, mm_config *c) {
  c->requant_policy = MM_REQUANT_G16_TO_G32;
  c->requant_max_rel_error = 0.01;
  ((uint8_t *)V(L, "1.down_proj.weight_scale")->data)[1] = 0x7F; /* checked before any requant */
}
static void m_policy_vs_first_nan(layer_t *L, mm_config *c) {
  c->gran_k = 32; /* group-16 checkpoint without requant: refused ... */
  ((uint8_t *)V(L, "1.gate_proj.weight_scale")->data)[2] = 0xFF; /* ... after this */
}
static void m_policy_only(layer_t *L, mm_config *c) { c->gran_k = 32; }
static void m_missing_late_first(layer_t *L, mm_config *c) {
  V(L, "6.down_proj.weight")->name = "removed.tensor";
  V(L, "1.up_proj.weight_scale")->name = "removed.tensor.too"; /* expert 1 checks presence first */
}
static void m_f32_zero_scale(layer_t *L, mm_config *c) {
  c->requant_policy = MM_REQUANT_G16_TO_G32;
  ((float *)V(L, "4.up_proj.weight_scale")->data)[5] = 0.0f;
  ((float *)V(L, "5.gate_proj.weight_scale")->data)[5] = 0.75f;
}

static void test_loader_first_error(void) {
  expect_first("NaN in expert 5, bad global in expert 3", LB_NVFP4, m_nan_late_and_global_early,
               MEGAMOE_CODE_INVALID_ARGUMENT, "experts.3.down_proj.weight_scale_2");
  expect_first("shape in expert 6, NaN in expert 2", LB_NVFP4, m_shape_late_nan_early,
               MEGAMOE_CODE_INVALID_ARGUMENT, "experts.2.down_proj.weight_scale: NaN");
  expect_first("up NaN vs down format", LB_NVFP4, m_up_nan_vs_down_format,
               MEGAMOE_CODE_INVALID_ARGUMENT, "experts.4.up_proj.weight_scale: NaN");
  expect_first("down format vs later NaN", LB_NVFP4, m_down_format_vs_later_nan,
               MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.4.down_proj.weight_scale: format ue8m0-g16 differs from "
               "experts.1.gate_proj (nvfp4-g16)");
  expect_first("other format with a NaN", LB_NVFP4, m_other_format_with_nan,
               MEGAMOE_CODE_INVALID_ARGUMENT, "experts.3.gate_proj.weight_scale: NaN");
  expect_first("requant limit vs later NaN", LB_NVFP4, m_requant_limit_vs_later_nan,
               MEGAMOE_CODE_INVALID_ARGUMENT, "experts.1.gate_proj: group16 -> group32");
  expect_first("requant limit vs same expert NaN", LB_NVFP4, m_requant_limit_vs_same_expert_nan,
               MEGAMOE_CODE_INVALID_ARGUMENT, "experts.1.down_proj.weight_scale: NaN");
  expect_first("policy vs NaN in the first tensor", LB_NVFP4, m_policy_vs_first_nan,
               MEGAMOE_CODE_INVALID_ARGUMENT, "experts.1.gate_proj.weight_scale: NaN");
  expect_first("policy", LB_NVFP4, m_policy_only, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.1.gate_proj.weight_scale: the checkpoint has group-16");
  expect_first("missing in experts 6 and 1", LB_NVFP4, m_missing_late_first,
               MEGAMOE_CODE_NOT_FOUND, "experts.1.up_proj.weight_scale: missing");
  expect_first("F32 zero scale vs not a power of two", LB_G16_F32, m_f32_zero_scale,
               MEGAMOE_CODE_INVALID_ARGUMENT, "experts.4.up_proj.weight_scale");
}

int main(void) {
  mm_test_seed();
  RUN(test_requant_vs_per_element);
  RUN(test_requant_sparse);
  RUN(test_loader_threads);
  RUN(test_loader_requant_converted);
  RUN(test_loader_first_error);
  return mm_test_done();
}

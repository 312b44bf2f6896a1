/* test_weights_load.c -- the layer loader on synthetic NVFP4 / MXFP4 /
 * UE8M0 layers: what it builds (compared with the tensors it was given and
 * with the requant routine), scale encodings that must load identically, and
 * every malformed case (error naming the tensor, nothing left allocated). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"
#include "harness.h"
#include "weights_load.h"

#define H 128
#define I 64
#define NEXP 8
#define MAXT (NEXP * 3 * 4)

#include "tensor_list.h"


static mm_tensor_view *find(layer_t *L, const char *name) {
  for (int i = 0; i < L->n; i++)
    if (strcmp(L->v[i].name, name) == 0) return &L->v[i];
  return NULL;
}

static void drop(layer_t *L, const char *name) {
  mm_tensor_view *t = find(L, name);
  if (t) t->name = "removed.tensor";
}


#include "layer_builder.h"

typedef lb_fmt fmt;

static uint8_t rand_e4m3(void) {
  for (;;) {
    uint8_t b = (uint8_t)(mm_test_rand_u64() & 0x7F);
    if (!mm_e4m3_is_nan(b) && b) return b;
  }
}
static uint8_t wl_scale_byte(lb_fmt f) {
  return f == LB_NVFP4 ? rand_e4m3() : (uint8_t)(110 + mm_test_rand_u64() % 30);
}
/* every other expert's up projection shares the gate's global scale */
static float wl_global_scale(const layer_t *L, int e, int p) {
  float gs = mm_test_uniform(1e-4f, 1e-2f);
  if (p == 1 && e % 2 == 0) gs = ((const float *)L->v[L->n - 4].data)[0]; /* gate's */
  return gs;
}
static float wl_input_scale(int e, int p) {
  (void)p;
  return 0.5f + (float)e;
}

/* The same random codes/scale bytes for every encoding (reseeded per layer). */
static void make_layer(layer_t *L, fmt f, uint64_t seed) {
  const lb_opts o = {"", NEXP, H, I, wl_scale_byte, wl_global_scale, wl_input_scale};
  uint64_t keep = mm_test_rng_state_;
  mm_test_rng_state_ = seed;
  lb_make_layer(L, f, &o);
  mm_test_rng_state_ = keep;
}

static void base_cfg(mm_config *c) {
  memset(c, 0, sizeof(*c));
  c->schema_version = 1;
  c->requant_max_rel_error = 0.25;
  c->model.hidden_size = H;
  c->model.moe_intermediate_size = I;
  c->model.num_experts = NEXP;
  c->model.top_k = 2;
  c->ep_size = 1;
  c->cpu_threads = 2;
}

static void free_experts(mm_expert_q *x, int n) {
  for (int i = 0; i < n; i++) mm_qmat_free(&x[i].w13), mm_qmat_free(&x[i].w2);
}

static int all_null(const mm_expert_q *x, int n) {
  for (int i = 0; i < n; i++)
    if (x[i].w13.codes || x[i].w13.scales || x[i].w2.codes || x[i].w2.row_scale) return 0;
  return 1;
}

static const mm_tensor_view *tv(layer_t *L, int e, const char *proj, const char *field) {
  char nm[64];
  snprintf(nm, sizeof nm, "mlp.experts.%d.%s.%s", e, proj, field);
  return find(L, nm);
}

static void test_nvfp4_plain(void) {
  layer_t L;
  make_layer(&L, LB_NVFP4, mm_test_rand_u64());
  mm_config cfg;
  base_cfg(&cfg);
  mm_expert_q x[4];
  mm_requant_report rep;
  CHECK_OK(mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 2, 4, x, &rep));
  for (int le = 0; le < 4; le++) {
    int e = 2 + le;
    CHECK(x[le].w13.rows == 2 * I && x[le].w13.cols == H && x[le].w13.gran == 16 &&
          x[le].w13.sf == MM_SF_E4M3);
    CHECK(x[le].w2.rows == H && x[le].w2.cols == I && x[le].w2.gran == 16);
    CHECK(memcmp(x[le].w13.codes, tv(&L, e, "gate_proj", "weight")->data, I * H / 2) == 0);
    CHECK(memcmp(x[le].w13.codes + I * H / 2, tv(&L, e, "up_proj", "weight")->data, I * H / 2) == 0);
    CHECK(memcmp(x[le].w13.scales + I * H / 16, tv(&L, e, "up_proj", "weight_scale")->data,
                 I * H / 16) == 0);
    CHECK(memcmp(x[le].w2.scales, tv(&L, e, "down_proj", "weight_scale")->data, H * I / 16) == 0);
    float gg = *(const float *)tv(&L, e, "gate_proj", "weight_scale_2")->data;
    float ug = *(const float *)tv(&L, e, "up_proj", "weight_scale_2")->data;
    float dg = *(const float *)tv(&L, e, "down_proj", "weight_scale_2")->data;
    for (int r = 0; r < I; r++) CHECK(x[le].w13.row_scale[r] == gg && x[le].w13.row_scale[I + r] == ug);
    for (int r = 0; r < H; r++) CHECK(x[le].w2.row_scale[r] == dg);
    CHECK(rep.tensors[3 * le + 1].global_scale == ug);
    CHECK(rep.tensors[3 * le + 2].input_scale == 0.5f + (float)e);
  }
  CHECK(rep.num_tensors == 12 && !rep.requantized && rep.gran == 16 && rep.source_gran == 16);
  CHECK_EQ_INT(rep.globals_differ, 2); /* odd experts 3 and 5 */
  CHECK(rep.globals_max_ratio > 1.0);
  CHECK(strstr(rep.summary, "differ in 2/4") && strstr(rep.summary, "per-row"));
  printf("# %s\n", rep.summary);
  mm_requant_report_free(&rep);
  free_experts(x, 4);
  free_layer(&L);
}

static void test_nvfp4_requant(void) {
  layer_t L;
  make_layer(&L, LB_NVFP4, mm_test_rand_u64());
  mm_config cfg;
  base_cfg(&cfg);
  cfg.requant_policy = MM_REQUANT_G16_TO_G32;
  cfg.gran_k = 32;
  mm_expert_q x[3];
  mm_requant_report rep;
  CHECK_OK(mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 5, 3, x, &rep));
  for (int le = 0; le < 3; le++) {
    int e = 5 + le;
    CHECK(x[le].w13.gran == 32 && x[le].w13.sf == MM_SF_UE8M0 && x[le].w2.gran == 32);
    static const char *pn[3] = {"gate_proj", "up_proj", "down_proj"};
    for (int p = 0; p < 3; p++) {
      int N = p == 2 ? H : I, K = p == 2 ? I : H;
      float *rs = malloc(sizeof(float) * (size_t)N);
      float gs = *(const float *)tv(&L, e, pn[p], "weight_scale_2")->data;
      for (int r = 0; r < N; r++) rs[r] = gs;
      mm_g16_source s = {N, K, MM_SF_E4M3, tv(&L, e, pn[p], "weight")->data,
                         tv(&L, e, pn[p], "weight_scale")->data, rs};
      uint8_t *c = malloc((size_t)N * K / 2), *sc = malloc((size_t)N * K / 32);
      mm_requant_stats st;
      CHECK_OK(mm_requant_g16_to_g32(&s, c, sc, 1, &st));
      const mm_qmat *m = p == 2 ? &x[le].w2 : &x[le].w13;
      size_t r0 = p == 1 ? I : 0;
      CHECK(memcmp(m->codes + r0 * (size_t)K / 2, c, (size_t)N * K / 2) == 0);
      CHECK(memcmp(m->scales + r0 * (size_t)K / 32, sc, (size_t)N * K / 32) == 0);
      for (int r = 0; r < N; r++) CHECK(m->row_scale[r0 + (size_t)r] == 1.0f);
      CHECK(rep.tensors[3 * le + p].rel_rms == st.rel_rms && st.rel_rms > 0.01);
      CHECK(rep.tensors[3 * le + p].max_abs == st.max_abs);
      free(rs), free(c), free(sc);
    }
  }
  CHECK(rep.requantized && rep.gran == 32 && rep.source_gran == 16 && rep.worst_tensor >= 0);
  CHECK(rep.total.rel_rms > 0.01 && rep.total.rel_rms < 0.25);
  CHECK(strstr(rep.summary, "requantized") && strstr(rep.summary, "folded"));
  printf("# %s\n", rep.summary);
  mm_requant_report_free(&rep);
  free_experts(x, 3);

  /* Over the limit: the first tensor is named. */
  cfg.requant_max_rel_error = 0.01;
  mm_err *e = mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 5, 3, x, &rep);
  CHECK(e && strstr(e->message, "experts.5.gate_proj") && strstr(e->message, "max-rel-error"));
  if (e) printf("# %s\n", e->message);
  mm_error_free(e);
  CHECK(all_null(x, 3) && rep.tensors == NULL);
  free_layer(&L);
}

/* The host's requant of a deferred load's experts, each projection as the
 * loader runs it; checks the bytes against a requantizing load's and
 * returns the statistics [3 * n]. */
static void requant_deferred(const mm_expert_q *def, const mm_expert_q *ref, int n,
                             mm_requant_stats *st) {
  uint8_t *c = malloc((size_t)H * I / 2), *sc = malloc((size_t)H * I / 32);
  for (int le = 0; le < n; le++)
    for (int p = 0; p < 3; p++) {
      const mm_qmat *m = p == 2 ? &def[le].w2 : &def[le].w13, *o = p == 2 ? &ref[le].w2 : &ref[le].w13;
      const int N = p == 2 ? H : I, K = m->cols;
      const size_t r0 = p == 1 ? I : 0;
      const mm_g16_source src = mm_g16_rows(m, (int)r0, N);
      CHECK_OK(mm_requant_g16_to_g32(&src, c, sc, 1, &st[3 * le + p]));
      if (o->codes)
        CHECK(!memcmp(o->codes + r0 * (size_t)K / 2, c, (size_t)N * K / 2) &&
              !memcmp(o->scales + r0 * (size_t)K / 32, sc, (size_t)N * K / 32));
    }
  free(c), free(sc);
}

/* MM_LOAD_DEFER_REQUANT: the experts come back as a group-16 load would
 * build them, the report waits for the requant's statistics and, given the
 * host's, reads as a requantizing load's; errors are a sequential load's,
 * an earlier expert's requant over the limit included. */
static void test_deferred_requant(void) {
  layer_t L;
  make_layer(&L, LB_NVFP4, mm_test_rand_u64());
  mm_config cfg, keep;
  base_cfg(&cfg);
  cfg.requant_policy = MM_REQUANT_G16_TO_G32;
  cfg.gran_k = 32;
  keep = cfg;
  keep.requant_policy = MM_REQUANT_NONE;
  keep.gran_k = 16;
  mm_expert_q ref[3], def[3], g16[3];
  mm_requant_report rref, rdef;
  CHECK_OK(mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 5, 3, ref, &rref));
  CHECK_OK(mm_weights_load_layer_ex(&cfg, L.v, (size_t)L.n, 5, 3, MM_LOAD_DEFER_REQUANT, def,
                                    &rdef));
  CHECK_OK(mm_weights_load_layer(&keep, L.v, (size_t)L.n, 5, 3, g16, NULL));
  CHECK(rdef.requant_pending && !rdef.requantized && rdef.gran == 32 && rdef.sf == MM_SF_UE8M0 &&
        rdef.source_gran == 16 && rdef.source_sf == MM_SF_E4M3 && rdef.worst_tensor == -1);
  for (int le = 0; le < 3; le++)
    CHECK(mm_qmat_equal(&def[le].w13, &g16[le].w13) && mm_qmat_equal(&def[le].w2, &g16[le].w2));
  mm_requant_stats st[9];
  requant_deferred(def, ref, 3, st);
  CHECK_OK(mm_requant_report_finish(&rdef, &cfg, st, 0));
  CHECK(rdef.requantized && !rdef.requant_pending && rdef.worst_tensor == rref.worst_tensor);
  for (int t = 0; t < 9; t++)
    CHECK(rdef.tensors[t].rel_rms == rref.tensors[t].rel_rms &&
          rdef.tensors[t].max_abs == rref.tensors[t].max_abs &&
          rdef.tensors[t].global_scale == rref.tensors[t].global_scale);
  CHECK(rdef.total.rel_rms == rref.total.rel_rms && rdef.total.count == rref.total.count);
  CHECK_MSG(!strcmp(rdef.summary, rref.summary), "summaries:\n#  %s\n#  %s", rdef.summary,
            rref.summary);
  CHECK_ERR(mm_requant_report_finish(&rdef, &cfg, st, 1), MEGAMOE_CODE_INVALID_ARGUMENT);
  rdef.requant_pending = 1; /* the GPU's words */
  CHECK_OK(mm_requant_report_finish(&rdef, &cfg, st, 1));
  CHECK(strstr(rdef.summary, "requantized on the GPU: rel RMS"));
  printf("# %s\n", rdef.summary);
  mm_requant_report_free(&rdef);
  mm_requant_report_free(&rref);
  free_experts(ref, 3), free_experts(def, 3), free_experts(g16, 3);
  CHECK_ERR(mm_weights_load_layer_ex(&cfg, L.v, (size_t)L.n, 5, 3, MM_LOAD_DEFER_REQUANT, def,
                                     NULL),
            MEGAMOE_CODE_INVALID_ARGUMENT);

  /* Expert 5 requantizes exactly (scales and globals 1): a limit below
   * expert 6's errors refuses its gate_proj first. With a missing tensor in
   * expert 7 both loads name that requant; in expert 5 both name the
   * missing tensor. Deferred without an error before it, the load passes
   * (the limit is the requant's to apply). */
  static const char *pn[3] = {"gate_proj", "up_proj", "down_proj"};
  for (int p = 0; p < 3; p++) {
    const int n = (p == 2 ? H * I : I * H) / 16;
    memset((void *)tv(&L, 5, pn[p], "weight_scale")->data, 0x38, (size_t)n);
    *(float *)tv(&L, 5, pn[p], "weight_scale_2")->data = 1.0f;
  }
  mm_requant_stats st2[9];
  CHECK_OK(mm_weights_load_layer_ex(&cfg, L.v, (size_t)L.n, 5, 3, MM_LOAD_DEFER_REQUANT, def,
                                    &rdef));
  mm_expert_q none[3];
  memset(none, 0, sizeof none); /* no bytes to compare */
  requant_deferred(def, none, 3, st2);
  CHECK(st2[0].rel_rms == 0.0 && st2[1].rel_rms == 0.0 && st2[2].rel_rms == 0.0);
  CHECK(st2[3].rel_rms > 0.0);
  cfg.requant_max_rel_error = 0.5 * st2[3].rel_rms;
  mm_requant_report_free(&rdef);
  free_experts(def, 3);
  for (int miss = 7; miss >= 5; miss -= 2) {
    char nm[64];
    snprintf(nm, sizeof nm, "mlp.experts.%d.down_proj.weight", miss);
    mm_tensor_view *t = find(&L, nm);
    const char *name = t->name;
    t->name = "removed.tensor";
    mm_err *a = mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 5, 3, ref, &rref);
    mm_err *b = mm_weights_load_layer_ex(&cfg, L.v, (size_t)L.n, 5, 3, MM_LOAD_DEFER_REQUANT, def,
                                         &rdef);
    t->name = name;
    CHECK(a && b && all_null(ref, 3) && all_null(def, 3));
    if (a && b) {
      CHECK_MSG(a->code == b->code && !strcmp(a->message, b->message), "\n#  %s\n#  %s",
                a->message, b->message);
      CHECK(strstr(b->message, miss == 7 ? "experts.6.gate_proj: group16 -> group32 requant error"
                                         : "experts.5.down_proj.weight: missing"));
      printf("# missing in expert %d: %s\n", miss, b->message);
    }
    mm_error_free(a);
    mm_error_free(b);
  }
  CHECK_OK(mm_weights_load_layer_ex(&cfg, L.v, (size_t)L.n, 5, 3, MM_LOAD_DEFER_REQUANT, def,
                                    &rdef));
  CHECK_ERR(mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 5, 3, ref, NULL),
            MEGAMOE_CODE_INVALID_ARGUMENT);
  mm_err *over = mm_requant_limit_error("t", &st2[3], cfg.requant_max_rel_error);
  CHECK(over && !mm_requant_limit_error("t", &st2[0], cfg.requant_max_rel_error));
  mm_error_free(over);
  mm_requant_report_free(&rdef);
  free_experts(def, 3);
  free_layer(&L);
}

/* MXFP4 in four encodings of the same bytes loads to identical matrices. */
static void test_mxfp4_encodings(void) {
  uint64_t seed = mm_test_rand_u64();
  mm_config cfg;
  base_cfg(&cfg);
  mm_expert_q ref[2];
  layer_t L;
  make_layer(&L, LB_MX_U8, seed);
  CHECK_OK(mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 0, 2, ref, NULL));
  CHECK(ref[0].w13.gran == 32 && ref[0].w13.sf == MM_SF_UE8M0 && ref[0].w13.row_scale[3] == 1.0f);
  free_layer(&L);
  static const fmt others[] = {LB_MX_E8M0, LB_MX_I32, LB_MX_F32};
  for (int k = 0; k < 3; k++) {
    make_layer(&L, others[k], seed);
    mm_expert_q x[2];
    mm_requant_report rep;
    cfg.requant_policy = k == 1 ? MM_REQUANT_G16_TO_G32 : MM_REQUANT_NONE; /* no-op on g32 */
    cfg.gran_k = k == 1 ? 32 : 0; /* I32 [64 rows, 1 word] fits group 16 and 32 */
    CHECK_OK(mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 0, 2, x, &rep));
    for (int e = 0; e < 2; e++) {
      CHECK(memcmp(x[e].w13.scales, ref[e].w13.scales, 2 * I * H / 32) == 0);
      CHECK(memcmp(x[e].w2.scales, ref[e].w2.scales, H * I / 32) == 0);
      CHECK(memcmp(x[e].w13.codes, ref[e].w13.codes, I * H) == 0);
    }
    CHECK(!rep.requantized && rep.gran == 32);
    if (k == 1) CHECK(strstr(rep.summary, "already group 32") != NULL);
    mm_requant_report_free(&rep);
    free_experts(x, 2);
    free_layer(&L);
  }
  free_experts(ref, 2);
  cfg.requant_policy = MM_REQUANT_NONE;
  cfg.gran_k = 0;

  /* UE8M0 group 16: plain, and requantized (row_scale 1 source). */
  make_layer(&L, LB_UE8M0_G16, seed);
  mm_expert_q x[1];
  CHECK_OK(mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 7, 1, x, NULL));
  CHECK(x[0].w13.gran == 16 && x[0].w13.sf == MM_SF_UE8M0);
  free_experts(x, 1);
  cfg.requant_policy = MM_REQUANT_G16_TO_G32;
  CHECK_OK(mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 7, 1, x, NULL));
  CHECK(x[0].w13.gran == 32);
  free_experts(x, 1);
  free_layer(&L);
}

/* Applies `mutate` to a fresh NVFP4 (or MXFP4) layer and expects an error
 * whose message names `needle`. */
static void expect_error(const char *what, fmt f, void (*mutate)(layer_t *, mm_config *),
                         megamoe_code code, const char *needle) {
  layer_t L;
  make_layer(&L, f, mm_test_rand_u64());
  mm_config cfg;
  base_cfg(&cfg);
  mutate(&L, &cfg);
  mm_expert_q x[4];
  memset(x, 0x77, sizeof x); /* poison: must come back zeroed */
  mm_requant_report rep;
  mm_err *e = mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 2, 4, x, &rep);
  CHECK_MSG(e != NULL, "%s: loaded", what);
  if (e) {
    CHECK_MSG(e->code == code, "%s: code %d (%s)", what, (int)e->code, e->message);
    CHECK_MSG(strstr(e->message, needle) != NULL, "%s: '%s' lacks '%s'", what, e->message, needle);
    printf("# %s: %s\n", what, e->message);
    mm_error_free(e);
  }
  CHECK(all_null(x, 4) && rep.tensors == NULL);
  free_layer(&L);
}

static mm_tensor_view *V(layer_t *L, const char *name) {
  char nm[64];
  snprintf(nm, sizeof nm, "mlp.experts.%s", name);
  mm_tensor_view *t = find(L, nm);
  if (!t) {
    printf("# test bug: no tensor %s\n", nm);
    exit(2);
  }
  return t;
}

static void m_shape(layer_t *L, mm_config *c) { V(L, "4.down_proj.weight")->shape[1] = I / 2 - 16; }
static void m_dtype_w(layer_t *L, mm_config *c) { V(L, "3.gate_proj.weight")->dtype = MM_DT_BF16; }
static void m_dtype_s(layer_t *L, mm_config *c) { V(L, "3.down_proj.weight_scale")->dtype = MM_DT_BF16; }
static void m_scale_shape(layer_t *L, mm_config *c) { V(L, "2.down_proj.weight_scale")->shape[1] = 3; }
static void m_nan7f(layer_t *L, mm_config *c) {
  ((uint8_t *)V(L, "5.up_proj.weight_scale")->data)[37] = 0x7F;
}
static void m_nanff(layer_t *L, mm_config *c) {
  ((uint8_t *)V(L, "2.down_proj.weight_scale")->data)[100] = 0xFF;
}
static void m_nan_ue8m0(layer_t *L, mm_config *c) {
  ((uint8_t *)V(L, "3.up_proj.weight_scale")->data)[5] = 0xFF;
}
static void m_global_nan(layer_t *L, mm_config *c) {
  *(float *)V(L, "4.up_proj.weight_scale_2")->data = NAN;
}
static void m_global_inf(layer_t *L, mm_config *c) {
  *(float *)V(L, "2.gate_proj.weight_scale_2")->data = INFINITY;
}
static void m_global_zero(layer_t *L, mm_config *c) {
  *(float *)V(L, "2.gate_proj.weight_scale_2")->data = 0.0f;
}
static void m_global_overflow(layer_t *L, mm_config *c) {
  *(float *)V(L, "3.gate_proj.weight_scale_2")->data = 3e37f;
}
static void m_input_inf(layer_t *L, mm_config *c) {
  *(float *)V(L, "5.down_proj.input_scale")->data = -INFINITY;
}
static void m_global_shape(layer_t *L, mm_config *c) {
  V(L, "5.down_proj.weight_scale_2")->ndim = 2;
}
static void m_missing(layer_t *L, mm_config *c) { drop(L, "mlp.experts.4.up_proj.weight_scale"); }
static void m_missing_w(layer_t *L, mm_config *c) { drop(L, "mlp.experts.5.down_proj.weight"); }
static void m_missing_g(layer_t *L, mm_config *c) { drop(L, "mlp.experts.3.down_proj.weight_scale_2"); }
static void m_gate_up(layer_t *L, mm_config *c) {
  V(L, "3.up_proj.weight")->shape[0] = I / 2;
  V(L, "3.up_proj.weight_scale")->shape[0] = I / 2;
}
static void m_on_device(layer_t *L, mm_config *c) { V(L, "2.up_proj.weight")->on_device = 1; }
static void m_duplicate(layer_t *L, mm_config *c) {
  V(L, "2.up_proj.weight")->name = "mlp.experts.2.gate_proj.weight";
}
static void m_mixed(layer_t *L, mm_config *c) {
  /* expert 4's down scales relabelled as UE8M0 group 16: a second format */
  V(L, "4.down_proj.weight_scale")->dtype = MM_DT_U8;
}
static void m_gran16_vs_32(layer_t *L, mm_config *c) { c->gran_k = 32; }
static void m_g32_vs_16(layer_t *L, mm_config *c) { c->gran_k = 16; }
static void m_requant_vs_16(layer_t *L, mm_config *c) {
  c->gran_k = 16;
  c->requant_policy = MM_REQUANT_G16_TO_G32;
}
static void m_f32_not_pow2(layer_t *L, mm_config *c) {
  ((float *)V(L, "3.gate_proj.weight_scale")->data)[9] = 0.75f;
}

static void test_malformed(void) {
  expect_error("wrong shape", LB_NVFP4, m_shape, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.4.down_proj.weight");
  expect_error("wrong weight dtype", LB_NVFP4, m_dtype_w, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.3.gate_proj.weight");
  expect_error("wrong scale dtype", LB_NVFP4, m_dtype_s, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.3.down_proj.weight_scale");
  expect_error("wrong scale shape", LB_NVFP4, m_scale_shape, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.2.down_proj.weight_scale");
  expect_error("NaN scale 0x7F", LB_NVFP4, m_nan7f, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.5.up_proj.weight_scale: NaN scale byte 0x7f");
  expect_error("NaN scale 0xFF", LB_NVFP4, m_nanff, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.2.down_proj.weight_scale: NaN scale byte 0xff");
  expect_error("NaN UE8M0 0xFF", LB_MX_U8, m_nan_ue8m0, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.3.up_proj.weight_scale");
  expect_error("NaN global", LB_NVFP4, m_global_nan, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.4.up_proj.weight_scale_2");
  expect_error("inf global", LB_NVFP4, m_global_inf, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.2.gate_proj.weight_scale_2");
  expect_error("zero global", LB_NVFP4, m_global_zero, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.2.gate_proj.weight_scale_2");
  expect_error("overflowing global", LB_NVFP4, m_global_overflow, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.3.gate_proj.weight_scale_2");
  expect_error("inf input_scale", LB_NVFP4, m_input_inf, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.5.down_proj.input_scale");
  expect_error("global not scalar", LB_NVFP4, m_global_shape, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.5.down_proj.weight_scale_2");
  expect_error("missing scale", LB_NVFP4, m_missing, MEGAMOE_CODE_NOT_FOUND,
               "experts.4.up_proj.weight_scale");
  expect_error("missing weight", LB_NVFP4, m_missing_w, MEGAMOE_CODE_NOT_FOUND,
               "experts.5.down_proj.weight");
  expect_error("missing global", LB_NVFP4, m_missing_g, MEGAMOE_CODE_NOT_FOUND,
               "experts.3.down_proj.weight_scale_2");
  expect_error("gate/up mismatch", LB_NVFP4, m_gate_up, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.3.up_proj.weight");
  expect_error("device tensor", LB_NVFP4, m_on_device, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.2.up_proj.weight");
  expect_error("duplicate", LB_NVFP4, m_duplicate, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.2.gate_proj.weight");
  expect_error("mixed formats", LB_NVFP4, m_mixed, MEGAMOE_CODE_INVALID_ARGUMENT,
               "experts.4.down_proj.weight_scale");
  expect_error("group16 with gran-k 32", LB_NVFP4, m_gran16_vs_32, MEGAMOE_CODE_INVALID_ARGUMENT,
               "gran-k");
  expect_error("group32 with gran-k 16", LB_MX_U8, m_g32_vs_16, MEGAMOE_CODE_INVALID_ARGUMENT,
               "gran-k is 16");
  expect_error("requant with gran-k 16", LB_NVFP4, m_requant_vs_16, MEGAMOE_CODE_INVALID_ARGUMENT,
               "requant.policy");
  expect_error("F32 scale not a power of two", LB_MX_F32, m_f32_not_pow2,
               MEGAMOE_CODE_INVALID_ARGUMENT, "experts.3.gate_proj.weight_scale");
}

/* Tensors of experts that are not local are never looked at. */
static void test_non_local_ignored(void) {
  layer_t L;
  make_layer(&L, LB_NVFP4, mm_test_rand_u64());
  V(&L, "0.gate_proj.weight")->dtype = MM_DT_BF16;
  drop(&L, "mlp.experts.7.down_proj.weight");
  ((uint8_t *)V(&L, "1.up_proj.weight_scale")->data)[0] = 0x7F;
  mm_config cfg;
  base_cfg(&cfg);
  mm_expert_q x[5];
  CHECK_OK(mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 2, 5, x, NULL));
  free_experts(x, 5);
  CHECK_ERR(mm_weights_load_layer(&cfg, L.v, (size_t)L.n, 6, 3, x, NULL),
            MEGAMOE_CODE_INVALID_ARGUMENT); /* 6 + 3 > 8 experts */
  free_layer(&L);
}

/* Single projection decode: K not a multiple of 128, single row, F4_E2M1 codes. */
static void test_decode_proj(void) {
  uint8_t codes[48], sc[6];
  for (int i = 0; i < 48; i++) codes[i] = (uint8_t)mm_test_rand_u64();
  for (int i = 0; i < 6; i++) sc[i] = rand_e4m3();
  float g = 0.25f;
  mm_tensor_view w = {"w", MM_DT_F4_E2M1, 2, {1, 96}, codes, 0};
  mm_tensor_view s = {"s", MM_DT_F8_E4M3, 2, {1, 6}, sc, 0};
  mm_tensor_view s2 = {"s2", MM_DT_F32, 0, {0}, &g, 0};
  mm_proj_views v = {&w, &s, &s2, NULL};
  mm_qmat q;
  float in;
  CHECK_OK(mm_weights_decode_proj("p", &v, 0, 0, 0, 1, &q, &in));
  CHECK(q.rows == 1 && q.cols == 96 && q.gran == 16 && q.row_scale[0] == 0.25f && isnan(in));
  CHECK(memcmp(q.codes, codes, 48) == 0 && memcmp(q.scales, sc, 6) == 0);
  mm_qmat_free(&q);
  v.scale_2 = NULL;
  CHECK_ERR(mm_weights_decode_proj("p", &v, 0, 0, 0, 1, &q, &in), MEGAMOE_CODE_NOT_FOUND);
  CHECK_OK(mm_weights_decode_proj("p", &v, 0, 0, 0, 0, &q, &in)); /* global optional */
  CHECK(q.row_scale[0] == 1.0f);
  mm_qmat_free(&q);
  /* I32 packed with K = 64: ambiguous without gran-k. */
  int32_t words[1] = {0x7F7E7D7C};
  mm_tensor_view w64 = {"w", MM_DT_U8, 2, {1, 32}, codes, 0};
  mm_tensor_view si = {"s", MM_DT_I32, 2, {1, 1}, words, 0};
  mm_proj_views vi = {&w64, &si, NULL, NULL};
  CHECK_ERR(mm_weights_decode_proj("p", &vi, 0, 0, 0, 1, &q, NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_OK(mm_weights_decode_proj("p", &vi, 0, 0, 16, 1, &q, NULL));
  CHECK(q.gran == 16 && q.scales[0] == 0x7C && q.scales[3] == 0x7F);
  mm_qmat_free(&q);
  CHECK_OK(mm_weights_decode_proj("p", &vi, 0, 0, 32, 1, &q, NULL));
  CHECK(q.gran == 32 && q.scales[0] == 0x7C && q.scales[1] == 0x7D);
  mm_qmat_free(&q);
}

int main(void) {
  mm_test_seed();
  RUN(test_nvfp4_plain);
  RUN(test_nvfp4_requant);
  RUN(test_deferred_requant);
  RUN(test_mxfp4_encodings);
  RUN(test_malformed);
  RUN(test_non_local_ignored);
  RUN(test_decode_proj);
  return mm_test_done();
}

/* megamoe-prep -- offline FP4 weight preparation.
 *
 *   megamoe-prep requant --in FILE --out FILE [--max-rel-error X] [--threads N]
 *   megamoe-prep sm100-layout --in FILE --out FILE [--gran 16|32] [--threads N]
 *   megamoe-prep convert --in CKPT --out DIR --layout canonical|sm100-deepgemm
 *                        [--requant] [--max-rel-error X] [--threads N]
 *
 * requant: for every prefix P with P.weight and a group-16 P.weight_scale,
 * writes P.weight (U8 codes) and P.weight_scale (U8 UE8M0 [N, K/32]); the
 * NVFP4 global P.weight_scale_2 is folded into the values and left out (it
 * would otherwise be applied twice); every other tensor is copied unchanged.
 * sm100-layout: w13, s13, w2, s2 -> sm100.* (DeepGEMM sm100 MegaMoE layout).
 * convert: a whole (sharded) checkpoint, one MoE layer at a time, keeping the
 * shard files and model.safetensors.index.json semantics. See docs/LAYOUTS.md.
 * Exit status 0 on success, 1 on any error (the output file is not left
 * behind), 2 on a usage error. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "config.h"
#include "layout_sm100.h"
#include "parallel.h"
#include "requant.h"
#include "safetensors.h"
#include "weights_load.h"

#define CHUNK ((size_t)64 << 20)

static const char *kUsage =
    "usage: megamoe-prep requant --in FILE --out FILE [--max-rel-error X] [--threads N]\n"
    "       megamoe-prep sm100-layout --in FILE --out FILE [--gran 16|32] [--threads N]\n"
    "       megamoe-prep convert --in CKPT --out DIR --layout canonical|sm100-deepgemm\n"
    "                            [--requant] [--max-rel-error X] [--threads N]\n";

typedef struct {
  const char *cmd, *in, *out, *layout;
  double max_rel;  /* < 0: no limit (requant), default 0.25 (convert) */
  int threads, gran, requant;
} opts;

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int fail(mm_err *e) {
  fprintf(stderr, "megamoe-prep: %s\n", e->message);
  mm_error_free(e);
  return 1;
}

/* ---- small helpers -------------------------------------------------------- */

static mm_err *read_whole(const mm_st_file *f, const mm_st_tensor *t, void **out) {
  *out = malloc(t->nbytes ? t->nbytes : 1);
  if (!*out) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory", t->name);
  mm_err *e = mm_st_read(f, t, *out, t->nbytes);
  if (e) {
    free(*out);
    *out = NULL;
  }
  return e;
}

static mm_tensor_view view_of(const mm_st_tensor *t, const void *data) {
  mm_tensor_view v;
  memset(&v, 0, sizeof v);
  v.name = t->name;
  v.dtype = mm_st_to_mm_dtype(t->dtype);
  v.ndim = t->ndim > 4 ? 4 : t->ndim;
  for (int i = 0; i < v.ndim; i++) v.shape[i] = t->shape[i];
  v.data = data;
  return v;
}

/* Copies a tensor's bytes into the streaming writer in chunks. */
static mm_err *append_tensor(mm_st_writer *w, const mm_st_file *f, const mm_st_tensor *t,
                             void *buf) {
  for (uint64_t o = 0; o < t->nbytes; o += CHUNK) {
    size_t n = (size_t)(t->nbytes - o < CHUNK ? t->nbytes - o : CHUNK);
    MM_TRY(mm_st_read_range(f, t, o, buf, n));
    MM_TRY(mm_st_writer_append(w, buf, n));
  }
  return NULL;
}

static mm_err *add_decl(mm_st_writer *w, const char *name, mm_st_dtype dt, int ndim,
                        int64_t a, int64_t b, int64_t c) {
  int64_t shape[3] = {a, b, c};
  int ok = 1;
  uint64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= (uint64_t)shape[i];
  uint64_t bytes = mm_st_nbytes(dt, n, &ok);
  if (!ok) return mm_error(MEGAMOE_CODE_INTERNAL, "%s: size overflow", name);
  return mm_st_writer_add(w, name, dt, ndim, shape, NULL, bytes);
}

/* ---- requant ----------------------------------------------------------------- */

typedef struct {
  char prefix[512];
  const mm_st_tensor *w, *s, *s2, *in;
  int done_w, done_s;
  uint8_t *codes, *scales;  /* requantized, until both are written */
} rq_group;

static mm_err *requant_group(const mm_st_file *f, rq_group *g, const opts *o, int *count,
                             mm_requant_stats *total) {
  void *dw = NULL, *ds = NULL, *dg = NULL;
  mm_qmat q = {0}, d = {0};
  mm_err *err = NULL;
  MM_TRY_GOTO(read_whole(f, g->w, &dw), err, out);
  MM_TRY_GOTO(read_whole(f, g->s, &ds), err, out);
  if (g->s2) MM_TRY_GOTO(read_whole(f, g->s2, &dg), err, out);
  mm_tensor_view vw = view_of(g->w, dw), vs = view_of(g->s, ds), vg;
  if (g->s2) vg = view_of(g->s2, dg);
  mm_proj_views pv = {&vw, &vs, g->s2 ? &vg : NULL, NULL};
  MM_TRY_GOTO(mm_weights_decode_proj(g->prefix, &pv, 0, 0, 0, 0, &q, NULL), err, out);
  mm_requant_stats st;
  MM_TRY_GOTO(mm_error_wrap(mm_requant_qmat(&q, o->threads, &d, &st), "%s", g->prefix), err, out);
  printf("%s: [%d, %d] %s -> ue8m0-g32: rel RMS %.6f, max abs err %.6g%s\n", g->prefix, q.rows,
         q.cols, q.sf == MM_SF_E4M3 ? "nvfp4-g16" : "ue8m0-g16", st.rel_rms, st.max_abs,
         g->s2 ? " (weight_scale_2 folded in, not written)" : "");
  if (o->max_rel >= 0 && st.rel_rms > o->max_rel) {
    err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                   "%s: requant error %.6f (relative RMS) exceeds --max-rel-error %g", g->prefix,
                   st.rel_rms, o->max_rel);
    goto out;
  }
  mm_requant_stats_merge(total, &st);
  (*count)++;
  g->codes = d.codes;
  g->scales = d.scales;
  d.codes = d.scales = NULL;
out:
  mm_qmat_free(&q);
  mm_qmat_free(&d);
  free(dw), free(ds), free(dg);
  return err;
}

/* Is `t` the P.weight_scale of a group-16 prefix? (dtype/shape only) */
static int is_group16(const mm_st_tensor *w, const mm_st_tensor *s) {
  if (w->ndim != 2 || s->ndim < 2) return 0;
  int64_t K = w->dtype == MM_ST_F4 ? w->shape[1] : 2 * w->shape[1];
  if (w->dtype != MM_ST_U8 && w->dtype != MM_ST_F4) return 0;
  switch (s->dtype) {
    case MM_ST_F8_E4M3:
    case MM_ST_U8:
    case MM_ST_F8_E8M0:
    case MM_ST_F32:
      return s->ndim == 2 && K % 32 == 0 && s->shape[1] == K / 16;
    case MM_ST_I32:
      return s->ndim == 2 && K % 32 == 0 && K > 64 && s->shape[1] == (K / 16 + 3) / 4;
    default:
      return 0;
  }
}

static int cmd_requant(const opts *o) {
  mm_st_file *f = NULL;
  mm_st_writer *w = NULL;
  rq_group *groups = NULL;
  void *buf = NULL;
  int ngroups = 0, count = 0;
  mm_requant_stats total = {0};
  mm_err *err = mm_st_open(o->in, &f);
  if (err) return fail(err);
  size_t n = mm_st_count(f);
  groups = calloc(n + 1, sizeof(rq_group));
  buf = malloc(CHUNK);
  if (!groups || !buf) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of memory");
    goto out;
  }
  /* Find the prefixes: P.weight + group-16 P.weight_scale. */
  for (size_t i = 0; i < n; i++) {
    const mm_st_tensor *t = mm_st_tensor_at(f, i);
    size_t l = strlen(t->name);
    if (l < 7 || strcmp(t->name + l - 7, ".weight") != 0 || l - 7 >= sizeof groups[0].prefix)
      continue;
    char nm[600];
    rq_group *g = &groups[ngroups];
    memcpy(g->prefix, t->name, l - 7);
    g->prefix[l - 7] = 0;
    snprintf(nm, sizeof nm, "%s.weight_scale", g->prefix);
    const mm_st_tensor *s = mm_st_find(f, nm);
    if (!s || !is_group16(t, s)) continue;
    g->w = t;
    g->s = s;
    snprintf(nm, sizeof nm, "%s.weight_scale_2", g->prefix);
    g->s2 = mm_st_find(f, nm);
    ngroups++;
  }
  MM_TRY_GOTO(mm_st_writer_new(&w), err, out);
  for (size_t i = 0; i < mm_st_metadata_count(f); i++)
    MM_TRY_GOTO(mm_st_writer_set_metadata(w, mm_st_metadata_key_at(f, i),
                                          mm_st_metadata_value_at(f, i)),
                err, out);
  MM_TRY_GOTO(mm_st_writer_set_metadata(w, "megamoe.requant", "group16-to-group32"), err, out);
  /* Declare in input order; converted tensors change shape/dtype. */
  for (size_t i = 0; i < n; i++) {
    const mm_st_tensor *t = mm_st_tensor_at(f, i);
    int role = 0; /* 1 weight, 2 scale, 3 dropped global */
    rq_group *g = NULL;
    for (int k = 0; k < ngroups && !role; k++) {
      g = &groups[k];
      role = t == g->w ? 1 : t == g->s ? 2 : t == g->s2 ? 3 : 0;
    }
    if (role == 3) continue;
    if (role == 1) {
      int64_t K = g->w->dtype == MM_ST_F4 ? g->w->shape[1] : 2 * g->w->shape[1];
      MM_TRY_GOTO(add_decl(w, t->name, MM_ST_U8, 2, t->shape[0], K / 2, 0), err, out);
    } else if (role == 2) {
      int64_t K = g->w->dtype == MM_ST_F4 ? g->w->shape[1] : 2 * g->w->shape[1];
      MM_TRY_GOTO(add_decl(w, t->name, MM_ST_U8, 2, g->w->shape[0], K / 32, 0), err, out);
    } else {
      MM_TRY_GOTO(mm_st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, NULL, t->nbytes),
                  err, out);
    }
  }
  MM_TRY_GOTO(mm_st_writer_begin(w, o->out), err, out);
  for (size_t i = 0; i < n; i++) {
    const mm_st_tensor *t = mm_st_tensor_at(f, i);
    rq_group *g = NULL;
    int role = 0;
    for (int k = 0; k < ngroups && !role; k++) {
      g = &groups[k];
      role = t == g->w ? 1 : t == g->s ? 2 : t == g->s2 ? 3 : 0;
    }
    if (role == 3) continue;
    if (role == 0) {
      MM_TRY_GOTO(append_tensor(w, f, t, buf), err, out);
      continue;
    }
    if (!g->codes) MM_TRY_GOTO(requant_group(f, g, o, &count, &total), err, out);
    int64_t K = g->w->dtype == MM_ST_F4 ? g->w->shape[1] : 2 * g->w->shape[1];
    size_t rows = (size_t)g->w->shape[0];
    if (role == 1) {
      MM_TRY_GOTO(mm_st_writer_append(w, g->codes, rows * (size_t)K / 2), err, out);
      g->done_w = 1;
    } else {
      MM_TRY_GOTO(mm_st_writer_append(w, g->scales, rows * (size_t)K / 32), err, out);
      g->done_s = 1;
    }
    if (g->done_w && g->done_s) {
      free(g->codes), free(g->scales);
      g->codes = g->scales = NULL;
    }
  }
  MM_TRY_GOTO(mm_st_writer_finish(w), err, out);
  printf("requant: %d tensors requantized, overall rel RMS %.6f, max abs err %.6g -> %s\n", count,
         total.rel_rms, total.max_abs, o->out);
out:
  for (int k = 0; groups && k < ngroups; k++) free(groups[k].codes), free(groups[k].scales);
  free(groups);
  free(buf);
  mm_st_writer_free(w);
  mm_st_close(f);
  return err ? fail(err) : 0;
}

/* ---- sm100-layout -------------------------------------------------------------- */

static mm_err *scales_to_bytes(const mm_st_file *f, const char *name, size_t n, uint8_t **out) {
  const mm_st_tensor *t;
  MM_TRY(mm_st_get(f, name, &t));
  void *d;
  MM_TRY(read_whole(f, t, &d));
  mm_err *e = NULL;
  if (t->nelems != n) {
    e = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: %llu elements, expected %zu", name,
                 (unsigned long long)t->nelems, n);
  } else if (t->dtype == MM_ST_F32) {
    *out = malloc(n ? n : 1);
    e = *out ? mm_f32_scales_to_ue8m0(d, n, *out, name)
             : mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of memory");
    if (e) free(*out), *out = NULL;
  } else if (t->dtype == MM_ST_U8 || t->dtype == MM_ST_F8_E8M0) {
    *out = d;
    d = NULL;
    for (size_t i = 0; i < n && !e; i++)
      if ((*out)[i] == 0xFF)
        e = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: element %zu is the UE8M0 NaN 0xff",
                     name, i);
    if (e) free(*out), *out = NULL;
  } else {
    e = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                 "%s: dtype %s, expected F32 (powers of two) or U8/F8_E8M0 UE8M0 bytes", name,
                 mm_st_dtype_name(t->dtype));
  }
  free(d);
  return e;
}

static mm_err *write_sm100(mm_st_writer *w, const char *prefix, const mm_sm100_shape *s,
                           int declare_only, const mm_sm100_packed *p) {
  char nm[600];
  int P13 = mm_sm100_packed_k(mm_sm100_sfk(s->H, s->gran));
  int P2 = mm_sm100_packed_k(mm_sm100_sfk(s->I, s->gran));
  int M13 = mm_sm100_tma_mn(2 * s->I), M2 = mm_sm100_tma_mn(s->H);
  if (declare_only) {
    snprintf(nm, sizeof nm, "%ssm100.w13", prefix);
    MM_TRY(add_decl(w, nm, MM_ST_U8, 3, s->E, 2 * s->I, s->H / 2));
    snprintf(nm, sizeof nm, "%ssm100.s13", prefix);
    MM_TRY(add_decl(w, nm, MM_ST_I32, 1, (int64_t)mm_sm100_s13_words(s), 0, 0));
    snprintf(nm, sizeof nm, "%ssm100.w2", prefix);
    MM_TRY(add_decl(w, nm, MM_ST_U8, 3, s->E, s->H, s->I / 2));
    snprintf(nm, sizeof nm, "%ssm100.s2", prefix);
    MM_TRY(add_decl(w, nm, MM_ST_I32, 1, (int64_t)mm_sm100_s2_words(s), 0, 0));
    char k[640], v[128];
    snprintf(k, sizeof k, "%ss13_shape", prefix);
    snprintf(v, sizeof v, "[%d, %d, %d]", s->E, 2 * s->I, P13);
    MM_TRY(mm_st_writer_set_metadata(w, k, v));
    snprintf(k, sizeof k, "%ss13_strides", prefix);
    snprintf(v, sizeof v, "[%lld, 1, %d]", (long long)P13 * M13, M13);
    MM_TRY(mm_st_writer_set_metadata(w, k, v));
    snprintf(k, sizeof k, "%ss2_shape", prefix);
    snprintf(v, sizeof v, "[%d, %d, %d]", s->E, s->H, P2);
    MM_TRY(mm_st_writer_set_metadata(w, k, v));
    snprintf(k, sizeof k, "%ss2_strides", prefix);
    snprintf(v, sizeof v, "[%lld, 1, %d]", (long long)P2 * M2, M2);
    MM_TRY(mm_st_writer_set_metadata(w, k, v));
    return NULL;
  }
  MM_TRY(mm_st_writer_append(w, p->w13, mm_sm100_w13_bytes(s)));
  MM_TRY(mm_st_writer_append(w, p->s13, 4 * mm_sm100_s13_words(s)));
  MM_TRY(mm_st_writer_append(w, p->w2, mm_sm100_w2_bytes(s)));
  MM_TRY(mm_st_writer_append(w, p->s2, 4 * mm_sm100_s2_words(s)));
  return NULL;
}

static void packed_free(mm_sm100_packed *p) {
  free(p->w13), free(p->s13), free(p->w2), free(p->s2);
  memset(p, 0, sizeof(*p));
}

static mm_err *packed_alloc(const mm_sm100_shape *s, mm_sm100_packed *p) {
  p->w13 = malloc(mm_sm100_w13_bytes(s));
  p->s13 = malloc(4 * mm_sm100_s13_words(s));
  p->w2 = malloc(mm_sm100_w2_bytes(s));
  p->s2 = malloc(4 * mm_sm100_s2_words(s));
  if (p->w13 && p->s13 && p->w2 && p->s2) return NULL;
  packed_free(p);
  return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "sm100 layout: out of memory");
}

static int cmd_sm100(const opts *o) {
  mm_st_file *f = NULL;
  mm_st_writer *w = NULL;
  mm_sm100_canon c = {0};
  mm_sm100_packed p = {0};
  mm_err *err = mm_st_open(o->in, &f);
  if (err) return fail(err);
  const mm_st_tensor *t13, *t2, *ts13, *ts2;
  MM_TRY_GOTO(mm_st_get(f, "w13", &t13), err, out);
  MM_TRY_GOTO(mm_st_get(f, "w2", &t2), err, out);
  MM_TRY_GOTO(mm_st_get(f, "s13", &ts13), err, out);
  MM_TRY_GOTO(mm_st_get(f, "s2", &ts2), err, out);
  if (t13->ndim != 3 || t2->ndim != 3 || ts13->ndim != 3 || t13->dtype != MM_ST_U8 ||
      t2->dtype != MM_ST_U8) {
    err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                   "%s: expected w13 U8 [E, 2I, H/2], w2 U8 [E, H, I/2], s13 [E, 2I, SFK]", o->in);
    goto out;
  }
  mm_sm100_shape s = {(int)t13->shape[0], (int)(2 * t13->shape[2]), (int)(t13->shape[1] / 2), 0};
  s.gran = o->gran ? o->gran
           : ts13->shape[2] == mm_sm100_sfk(s.H, 32) ? 32
           : ts13->shape[2] == mm_sm100_sfk(s.H, 16) ? 16 : 0;
  if (!s.gran) {
    err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                   "s13: %lld groups per row fit neither group 16 nor 32 for H = %d",
                   (long long)ts13->shape[2], s.H);
    goto out;
  }
  if (t2->shape[0] != s.E || t2->shape[1] != s.H || 2 * t2->shape[2] != s.I) {
    err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "w2: shape does not match w13 (E %d, H %d, I %d)",
                   s.E, s.H, s.I);
    goto out;
  }
  MM_TRY_GOTO(mm_sm100_check_shape(&s), err, out);
  c.w13 = malloc(mm_sm100_w13_bytes(&s));
  c.w2 = malloc(mm_sm100_w2_bytes(&s));
  if (!c.w13 || !c.w2) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of memory");
    goto out;
  }
  MM_TRY_GOTO(mm_st_read(f, t13, c.w13, mm_sm100_w13_bytes(&s)), err, out);
  MM_TRY_GOTO(mm_st_read(f, t2, c.w2, mm_sm100_w2_bytes(&s)), err, out);
  MM_TRY_GOTO(scales_to_bytes(f, "s13", mm_sm100_s13_bytes(&s), &c.s13), err, out);
  MM_TRY_GOTO(scales_to_bytes(f, "s2", mm_sm100_s2_bytes(&s), &c.s2), err, out);
  MM_TRY_GOTO(packed_alloc(&s, &p), err, out);
  MM_TRY_GOTO(mm_sm100_export(&s, &c, &p, o->threads), err, out);
  MM_TRY_GOTO(mm_st_writer_new(&w), err, out);
  char v[32];
  MM_TRY_GOTO(mm_st_writer_set_metadata(w, "kind", "deepgemm_sm100_megamoe_layout"), err, out);
  snprintf(v, sizeof v, "%d", s.E);
  MM_TRY_GOTO(mm_st_writer_set_metadata(w, "E", v), err, out);
  snprintf(v, sizeof v, "%d", s.H);
  MM_TRY_GOTO(mm_st_writer_set_metadata(w, "H", v), err, out);
  snprintf(v, sizeof v, "%d", s.I);
  MM_TRY_GOTO(mm_st_writer_set_metadata(w, "I", v), err, out);
  snprintf(v, sizeof v, "%d", s.gran);
  MM_TRY_GOTO(mm_st_writer_set_metadata(w, "gran_k", v), err, out);
  MM_TRY_GOTO(write_sm100(w, "", &s, 1, NULL), err, out);
  MM_TRY_GOTO(mm_st_writer_begin(w, o->out), err, out);
  MM_TRY_GOTO(write_sm100(w, "", &s, 0, &p), err, out);
  MM_TRY_GOTO(mm_st_writer_finish(w), err, out);
  printf("sm100-layout: E %d, H %d, I %d, gran_k %d -> %s\n", s.E, s.H, s.I, s.gran, o->out);
out:
  free(c.w13), free(c.s13), free(c.w2), free(c.s2);
  packed_free(&p);
  mm_st_writer_free(w);
  mm_st_close(f);
  return err ? fail(err) : 0;
}

/* ---- convert ----------------------------------------------------------------------- */

typedef struct {
  char prefix[512];   /* "model.layers.3.mlp." */
  int num_experts, H, I;
  int out_gran;
  mm_st_dtype out_sf; /* F8_E4M3 or U8 */
  size_t first;       /* index of its first tensor (checkpoint order) */
  size_t *members;    /* its tensor indices */
  size_t nmembers;
} layer_info;

typedef struct {
  const mm_st_ckpt *ck;
  size_t n;              /* tensors */
  int *layer_of;         /* tensor -> layer index, -1 for pass-through */
  layer_info *layers;
  int nlayers;
} ckpt_plan;

static void plan_free(ckpt_plan *p) {
  for (int i = 0; i < p->nlayers; i++) free(p->layers[i].members);
  free(p->layers);
  free(p->layer_of);
}

static mm_err *plan_layers(const mm_st_ckpt *ck, const opts *o, ckpt_plan *p) {
  memset(p, 0, sizeof(*p));
  p->ck = ck;
  p->n = mm_st_ckpt_count(ck);
  p->layer_of = malloc(sizeof(int) * (p->n + 1));
  p->layers = calloc(p->n + 1, sizeof(layer_info));
  if (!p->layer_of || !p->layers) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of memory");
  for (size_t i = 0; i < p->n; i++) {
    const mm_st_tensor *t = mm_st_ckpt_tensor_at(ck, i, NULL);
    size_t pl;
    long e;
    mm_proj pr;
    int fld;
    p->layer_of[i] = -1;
    if (mm_weights_parse_name(t->name, &pl, &e, &pr, &fld) != 0) continue;
    if (pl >= sizeof p->layers[0].prefix)
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: name too long", t->name);
    int L = -1;
    for (int k = 0; k < p->nlayers && L < 0; k++)
      if (strlen(p->layers[k].prefix) == pl && strncmp(p->layers[k].prefix, t->name, pl) == 0) L = k;
    if (L < 0) {
      L = p->nlayers++;
      memcpy(p->layers[L].prefix, t->name, pl);
      p->layers[L].prefix[pl] = 0;
      p->layers[L].first = i;
      p->layers[L].members = malloc(sizeof(size_t) * p->n);
      if (!p->layers[L].members) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of memory");
    }
    layer_info *li = &p->layers[L];
    li->members[li->nmembers++] = i;
    if (e + 1 > li->num_experts) li->num_experts = (int)e + 1;
    p->layer_of[i] = L;
  }
  /* Shapes and output format of each layer, from expert 0's gate projection. */
  for (int L = 0; L < p->nlayers; L++) {
    layer_info *li = &p->layers[L];
    char nm[640];
    const mm_st_tensor *w, *s, *s2;
    const mm_st_file *fw, *fs, *f2;
    snprintf(nm, sizeof nm, "%sexperts.0.gate_proj.weight", li->prefix);
    MM_TRY(mm_st_ckpt_get(ck, nm, &w, &fw));
    snprintf(nm, sizeof nm, "%sexperts.0.gate_proj.weight_scale", li->prefix);
    MM_TRY(mm_st_ckpt_get(ck, nm, &s, &fs));
    snprintf(nm, sizeof nm, "%sexperts.0.gate_proj.weight_scale_2", li->prefix);
    s2 = mm_st_ckpt_find(ck, nm, &f2);
    if (w->ndim != 2)
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: expected a 2-d weight", w->name);
    li->I = (int)w->shape[0];
    li->H = (int)(w->dtype == MM_ST_F4 ? w->shape[1] : 2 * w->shape[1]);
    void *dw = NULL, *ds = NULL, *d2 = NULL;
    mm_qmat q = {0};
    mm_err *e = read_whole(fw, w, &dw);
    if (!e) e = read_whole(fs, s, &ds);
    if (!e && s2) e = read_whole(f2, s2, &d2);
    if (!e) {
      mm_tensor_view vw = view_of(w, dw), vs = view_of(s, ds), v2;
      if (s2) v2 = view_of(s2, d2);
      mm_proj_views pv = {&vw, &vs, s2 ? &v2 : NULL, NULL};
      char pn[600];
      snprintf(pn, sizeof pn, "%sexperts.0.gate_proj", li->prefix);
      e = mm_weights_decode_proj(pn, &pv, 0, 0, o->gran, 1, &q, NULL);
    }
    free(dw), free(ds), free(d2);
    if (e) return e;
    int rq = o->requant && q.gran == 16;
    li->out_gran = rq ? 32 : q.gran;
    li->out_sf = (rq || q.sf == MM_SF_UE8M0) ? MM_ST_U8 : MM_ST_F8_E4M3;
    mm_qmat_free(&q);
    if (!strcmp(o->layout, "sm100-deepgemm") && li->out_sf != MM_ST_U8)
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                      "%sexperts: NVFP4 (E4M3 scales) cannot be exported to the sm100-deepgemm "
                      "layout (UE8M0 only); add --requant",
                      li->prefix);
  }
  return NULL;
}

/* Declares (declare = 1) or writes the output tensors of one layer. */
static mm_err *layer_out(mm_st_writer *w, const layer_info *li, const opts *o, int declare,
                         const mm_expert_q *x) {
  char nm[640];
  int E = li->num_experts, H = li->H, I = li->I, g = li->out_gran;
  if (!strcmp(o->layout, "sm100-deepgemm")) {
    snprintf(nm, sizeof nm, "%sexperts.", li->prefix);
    mm_sm100_shape s = {E, H, I, g};
    if (declare) return write_sm100(w, nm, &s, 1, NULL);
    mm_sm100_canon c;
    mm_sm100_packed p = {0};
    MM_TRY(mm_sm100_canon_from_experts(x, E, &s, &c));
    mm_err *e = packed_alloc(&s, &p);
    if (!e) e = mm_sm100_export(&s, &c, &p, o->threads);
    if (!e) e = write_sm100(w, nm, &s, 0, &p);
    mm_sm100_canon_free(&c);
    packed_free(&p);
    return e;
  }
  static const char *const kMat[2] = {"w13", "w2"};
  for (int m = 0; m < 2; m++) {
    int rows = m ? H : 2 * I, cols = m ? I : H;
    if (declare) {
      snprintf(nm, sizeof nm, "%sexperts.%s_weight", li->prefix, kMat[m]);
      MM_TRY(add_decl(w, nm, MM_ST_U8, 3, E, rows, cols / 2));
      snprintf(nm, sizeof nm, "%sexperts.%s_weight_scale", li->prefix, kMat[m]);
      MM_TRY(add_decl(w, nm, li->out_sf, 3, E, rows, cols / g));
      snprintf(nm, sizeof nm, "%sexperts.%s_row_scale", li->prefix, kMat[m]);
      MM_TRY(add_decl(w, nm, MM_ST_F32, 2, E, rows, 0));
      continue;
    }
    for (int e = 0; e < E; e++) {
      const mm_qmat *q = m ? &x[e].w2 : &x[e].w13;
      MM_TRY(mm_st_writer_append(w, q->codes, (size_t)rows * (size_t)cols / 2));
    }
    for (int e = 0; e < E; e++) {
      const mm_qmat *q = m ? &x[e].w2 : &x[e].w13;
      MM_TRY(mm_st_writer_append(w, q->scales, (size_t)rows * (size_t)(cols / g)));
    }
    for (int e = 0; e < E; e++) {
      const mm_qmat *q = m ? &x[e].w2 : &x[e].w13;
      MM_TRY(mm_st_writer_append(w, q->row_scale, sizeof(float) * (size_t)rows));
    }
  }
  return NULL;
}

/* Reads every tensor of one layer, loads it (validation, requant), writes it. */
static mm_err *convert_layer(mm_st_writer *w, const ckpt_plan *p, int L, const opts *o,
                             const mm_config *base, int *done) {
  const layer_info *li = &p->layers[L];
  double t0 = now_s();
  mm_tensor_view *v = calloc(li->nmembers, sizeof(mm_tensor_view));
  void **data = calloc(li->nmembers, sizeof(void *));
  mm_expert_q *x = calloc((size_t)li->num_experts, sizeof(mm_expert_q));
  mm_requant_report rep = {0};
  mm_err *err = NULL;
  uint64_t bytes = 0;
  if (!v || !data || !x) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of memory");
    goto out;
  }
  for (size_t k = 0; k < li->nmembers; k++) {
    const mm_st_file *f;
    const mm_st_tensor *t = mm_st_ckpt_tensor_at(p->ck, li->members[k], &f);
    MM_TRY_GOTO(read_whole(f, t, &data[k]), err, out);
    v[k] = view_of(t, data[k]);
    bytes += t->nbytes;
  }
  mm_config cfg = *base;
  cfg.model.hidden_size = li->H;
  cfg.model.moe_intermediate_size = li->I;
  cfg.model.num_experts = li->num_experts;
  err = mm_weights_load_layer(&cfg, v, li->nmembers, 0, li->num_experts, x, &rep);
  if (err) { /* the loader names "experts.E...": give the full tensor name */
    mm_err *full = mm_error(err->code, "%s%s", li->prefix, err->message);
    mm_error_free(err);
    err = full;
    goto out;
  }
  if (rep.gran != li->out_gran) {
    err = mm_error(MEGAMOE_CODE_INTERNAL, "%s: format changed between planning and loading",
                   li->prefix);
    goto out;
  }
  MM_TRY_GOTO(layer_out(w, li, o, 0, x), err, out);
  (*done)++;
  double dt = now_s() - t0;
  printf("[%d/%d] %s%s (%.1f MB in %.2f s, %.0f MB/s)\n", *done, p->nlayers, li->prefix,
         rep.summary, (double)bytes / 1e6, dt, (double)bytes / 1e6 / (dt > 0 ? dt : 1e-9));
  fflush(stdout);
out:
  for (int e = 0; x && e < li->num_experts; e++) mm_qmat_free(&x[e].w13), mm_qmat_free(&x[e].w2);
  for (size_t k = 0; data && k < li->nmembers; k++) free(data[k]);
  free(x), free(data), free(v);
  mm_requant_report_free(&rep);
  return err;
}

static const char *base_name(const char *path) {
  const char *s = strrchr(path, '/');
  return s ? s + 1 : path;
}

static void json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c < 0x20) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
}

static mm_err *copy_file(const char *from, const char *to) {
  FILE *a = fopen(from, "rb");
  if (!a) return NULL; /* optional */
  FILE *b = fopen(to, "wb");
  if (!b) {
    fclose(a);
    return mm_error(MEGAMOE_CODE_UNAVAILABLE, "%s: %s", to, strerror(errno));
  }
  char buf[65536];
  size_t n;
  int bad = 0;
  while ((n = fread(buf, 1, sizeof buf, a)) > 0) bad |= fwrite(buf, 1, n, b) != n;
  bad |= ferror(a);
  fclose(a);
  bad |= fclose(b) != 0;
  return bad ? mm_error(MEGAMOE_CODE_UNAVAILABLE, "copying %s to %s failed", from, to) : NULL;
}

static int cmd_convert(const opts *o) {
  if (strcmp(o->layout, "canonical") && strcmp(o->layout, "sm100-deepgemm")) {
    fprintf(stderr, "megamoe-prep: --layout must be canonical or sm100-deepgemm\n%s", kUsage);
    return 2;
  }
  mm_st_ckpt *ck = NULL;
  ckpt_plan plan = {0};
  mm_st_writer *w = NULL;
  void *buf = malloc(CHUNK);
  FILE *idx = NULL;
  char path[4096], tmp_idx[4096];
  int done = 0;
  uint64_t total = 0;
  double t0 = now_s();
  mm_err *err = buf ? NULL : mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of memory");
  if (err) goto out;
  MM_TRY_GOTO(mm_st_ckpt_open(o->in, &ck), err, out);
  if (mkdir(o->out, 0777) != 0 && errno != EEXIST) {
    err = mm_error(MEGAMOE_CODE_UNAVAILABLE, "%s: %s", o->out, strerror(errno));
    goto out;
  }
  MM_TRY_GOTO(plan_layers(ck, o, &plan), err, out);
  printf("convert: %s: %zu tensors in %zu shards, %d MoE layers -> %s (%s%s)\n", o->in, plan.n,
         mm_st_ckpt_shard_count(ck), plan.nlayers, o->out, o->layout,
         o->requant ? ", requant group16-to-group32" : "");
  mm_config base;
  mm_config_defaults(&base);
  base.requant_policy = o->requant ? MM_REQUANT_G16_TO_G32 : MM_REQUANT_NONE;
  base.requant_max_rel_error = o->max_rel >= 0 ? o->max_rel : 0.25;
  base.cpu_threads = o->threads;
  base.gran_k = o->gran;

  snprintf(tmp_idx, sizeof tmp_idx, "%s/model.safetensors.index.json.tmp", o->out);
  idx = fopen(tmp_idx, "w");
  if (!idx) {
    err = mm_error(MEGAMOE_CODE_UNAVAILABLE, "%s: %s", tmp_idx, strerror(errno));
    goto out;
  }
  fprintf(idx, "{\n  \"weight_map\": {");
  int first_entry = 1;
  /* One output shard per input shard, same file name. A layer goes to the
   * shard holding its first tensor, at that tensor's position. */
  for (size_t sh = 0; sh < mm_st_ckpt_shard_count(ck); sh++) {
    const mm_st_file *sf = mm_st_ckpt_shard(ck, sh);
    snprintf(path, sizeof path, "%s/%s", o->out, base_name(mm_st_path(sf)));
    MM_TRY_GOTO(mm_st_writer_new(&w), err, out);
    for (size_t i = 0; i < mm_st_metadata_count(sf); i++)
      MM_TRY_GOTO(mm_st_writer_set_metadata(w, mm_st_metadata_key_at(sf, i),
                                            mm_st_metadata_value_at(sf, i)),
                  err, out);
    MM_TRY_GOTO(mm_st_writer_set_metadata(w, "megamoe.layout", o->layout), err, out);
    MM_TRY_GOTO(mm_st_writer_set_metadata(w, "megamoe.requant",
                                          o->requant ? "group16-to-group32" : "none"),
                err, out);
    for (int pass = 0; pass < 2; pass++) {
      if (pass == 1) MM_TRY_GOTO(mm_st_writer_begin(w, path), err, out);
      for (size_t i = 0; i < plan.n; i++) {
        const mm_st_file *f;
        const mm_st_tensor *t = mm_st_ckpt_tensor_at(ck, i, &f);
        if (f != sf) continue;
        int L = plan.layer_of[i];
        if (L >= 0 && plan.layers[L].first != i) continue; /* consumed by its layer */
        if (L >= 0) {
          if (pass == 0) MM_TRY_GOTO(layer_out(w, &plan.layers[L], o, 1, NULL), err, out);
          else MM_TRY_GOTO(convert_layer(w, &plan, L, o, &base, &done), err, out);
        } else if (pass == 0) {
          MM_TRY_GOTO(mm_st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, NULL, t->nbytes),
                      err, out);
        } else {
          MM_TRY_GOTO(append_tensor(w, f, t, buf), err, out);
        }
      }
    }
    total += mm_st_writer_data_size(w);
    MM_TRY_GOTO(mm_st_writer_finish(w), err, out);
    /* Index entries: every tensor written to this shard. */
    mm_st_file *outf = NULL;
    MM_TRY_GOTO(mm_st_open(path, &outf), err, out);
    for (size_t i = 0; i < mm_st_count(outf); i++) {
      fprintf(idx, "%s\n    ", first_entry ? "" : ",");
      first_entry = 0;
      json_str(idx, mm_st_tensor_at(outf, i)->name);
      fprintf(idx, ": ");
      json_str(idx, base_name(path));
    }
    mm_st_close(outf);
    mm_st_writer_free(w);
    w = NULL;
  }
  fprintf(idx, "\n  },\n  \"metadata\": {\"total_size\": %llu}\n}\n", (unsigned long long)total);
  if (fclose(idx) != 0) {
    idx = NULL;
    err = mm_error(MEGAMOE_CODE_UNAVAILABLE, "%s: write failed", tmp_idx);
    goto out;
  }
  idx = NULL;
  snprintf(path, sizeof path, "%s/model.safetensors.index.json", o->out);
  if (rename(tmp_idx, path) != 0) {
    err = mm_error(MEGAMOE_CODE_UNAVAILABLE, "%s: %s", path, strerror(errno));
    goto out;
  }
  /* The model config travels along when the input is a directory. */
  struct stat st;
  if (stat(o->in, &st) == 0 && S_ISDIR(st.st_mode)) {
    char from[4096];
    snprintf(from, sizeof from, "%s/config.json", o->in);
    snprintf(path, sizeof path, "%s/config.json", o->out);
    MM_TRY_GOTO(copy_file(from, path), err, out);
  }
  printf("convert: %d layers, %.1f MB written in %.1f s\n", done, (double)total / 1e6,
         now_s() - t0);
out:
  if (idx) {
    fclose(idx);
    remove(tmp_idx);
  }
  mm_st_writer_free(w);
  plan_free(&plan);
  mm_st_ckpt_close(ck);
  free(buf);
  return err ? fail(err) : 0;
}

/* ---- main ---------------------------------------------------------------------------- */

/* The options each command takes; any other is refused rather than ignored. */
static int command_takes(const char *cmd, const char *a) {
  static const struct {
    const char *cmd, *opts;
  } table[] = {
      {"requant", " --in --out --max-rel-error --threads "},
      {"sm100-layout", " --in --out --gran --threads "},
      {"convert", " --in --out --layout --requant --max-rel-error --threads "},
  };
  char key[40];
  if (strlen(a) + 3 > sizeof key) return 0;
  snprintf(key, sizeof key, " %s ", a);
  for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
    if (!strcmp(cmd, table[i].cmd)) return strstr(table[i].opts, key) != NULL;
  return 0;
}

int main(int argc, char **argv) {
  opts o = {0};
  o.max_rel = -1;
  o.layout = "";
  if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
    fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  o.cmd = argv[1];
  if (!command_takes(o.cmd, "--in")) {
    fprintf(stderr, "megamoe-prep: unknown command '%s'\n%s", o.cmd, kUsage);
    return 2;
  }
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!command_takes(o.cmd, a)) {
      fprintf(stderr, "megamoe-prep: %s does not take '%s'\n%s", o.cmd, a, kUsage);
      return 2;
    }
    if (!strcmp(a, "--requant")) {
      o.requant = 1;
      continue;
    }
    if (!v) {
      fprintf(stderr, "megamoe-prep: %s needs a value\n%s", a, kUsage);
      return 2;
    }
    i++;
    char *end = NULL;
    int bad = 0;
    if (!strcmp(a, "--in")) o.in = v;
    else if (!strcmp(a, "--out")) o.out = v;
    else if (!strcmp(a, "--layout")) o.layout = v;
    else if (!strcmp(a, "--max-rel-error")) {
      o.max_rel = strtod(v, &end);
      bad = !isfinite(o.max_rel) || o.max_rel < 0; /* a negative limit means none, inside */
    } else if (!strcmp(a, "--threads")) {
      long t = strtol(v, &end, 10);
      bad = t < 0 || t > 4096;
      o.threads = (int)t;
    } else if (!strcmp(a, "--gran")) {
      o.gran = (int)strtol(v, &end, 10);
      bad = o.gran != 16 && o.gran != 32;
    }
    if (bad || (end && (*end || end == v))) {
      fprintf(stderr, "megamoe-prep: %s: bad value '%s' (%s)\n", a, v,
              !strcmp(a, "--gran")      ? "16 or 32"
              : !strcmp(a, "--threads") ? "0 to 4096; 0: all cores"
                                        : "a finite number >= 0");
      return 2;
    }
  }
  if (!o.in || !o.out) {
    fprintf(stderr, "megamoe-prep: --in and --out are required\n%s", kUsage);
    return 2;
  }
  if (!strcmp(o.cmd, "requant")) return cmd_requant(&o);
  if (!strcmp(o.cmd, "sm100-layout")) return cmd_sm100(&o);
  return cmd_convert(&o);
}

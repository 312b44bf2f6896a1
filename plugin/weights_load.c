/* weights_load.c -- raw expert tensors of one layer -> canonical matrices.
 * Order of work: index the names; the first local expert's gate_proj fixes
 * the layer's format (checked against the policy); then every local expert
 * at once (cpu.threads), each checking its projections and writing w13/w2
 * directly (codes copied once, scale bytes checked while copied, or the
 * requant reading the source tensors). Errors are those a sequential load
 * would meet first: each expert checks in the sequential order and the
 * lowest failing expert wins. Every failure frees what was built. */
#include "weights_load.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "formats.h"
#include "layout_sm100.h"
#include "parallel.h"

static const char *const kProjNames[3] = {"gate_proj", "up_proj", "down_proj"};
static const char *const kFieldNames[4] = {"weight", "weight_scale", "weight_scale_2",
                                           "input_scale"};
enum { F_WEIGHT = 0, F_SCALE = 1, F_SCALE2 = 2, F_INPUT = 3 };

const char *mm_proj_name(mm_proj p) {
  return (p >= MM_PROJ_GATE && p <= MM_PROJ_DOWN) ? kProjNames[p] : "?";
}

void mm_requant_report_free(mm_requant_report *r) {
  if (!r) return;
  free(r->tensors);
  memset(r, 0, sizeof(*r));
  r->worst_tensor = -1;
}

/* ---- one projection ------------------------------------------------------ */

/* Local (mm_dtype_name lives with the op; the loader also links into tools). */
static const char *dtype_str(mm_dtype dt) {
  switch (dt) {
    case MM_DT_U8: return "U8";
    case MM_DT_I32: return "I32";
    case MM_DT_F32: return "F32";
    case MM_DT_BF16: return "BF16";
    case MM_DT_F8_E4M3: return "F8_E4M3";
    case MM_DT_F8_E8M0: return "F8_E8M0";
    case MM_DT_F4_E2M1: return "F4_E2M1";
    default: return "invalid dtype";
  }
}

static void shape_str(const mm_tensor_view *t, char *buf, size_t n) {
  size_t o = (size_t)snprintf(buf, n, "[");
  for (int i = 0; i < t->ndim && o < n; i++)
    o += (size_t)snprintf(buf + o, n - o, i ? ", %lld" : "%lld", (long long)t->shape[i]);
  if (o < n) snprintf(buf + o, n - o, "]");
}

static mm_err *check_host(const char *name, const char *field, const mm_tensor_view *t) {
  if (t->on_device)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s.%s: device tensor given to the host loader (copy it to the host first)",
                    name, field);
  if (!t->data)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s.%s: no data", name, field);
  return NULL;
}

/* F32 scalar ([] or [1]); finite. */
static mm_err *read_scalar(const char *name, const char *field, const mm_tensor_view *t,
                           float *out) {
  MM_TRY(check_host(name, field, t));
  char sh[96];
  shape_str(t, sh, sizeof sh);
  if (t->dtype != MM_DT_F32 || !(t->ndim == 0 || (t->ndim == 1 && t->shape[0] == 1)))
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s.%s: expected an F32 scalar, got %s %s", name, field,
                    dtype_str(t->dtype), sh);
  float v;
  memcpy(&v, t->data, 4);
  if (!isfinite(v))
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s.%s: non-finite value %g", name, field,
                    (double)v);
  *out = v;
  return NULL;
}

/* F32 group scales must be exact powers of two (UE8M0); 0 is not one. */
static mm_err *f32_pow2_scales(const float *in, size_t n, uint8_t *out, const char *what) {
  MM_TRY(mm_f32_scales_to_ue8m0(in, n, out, what));
  for (size_t i = 0; i < n; i++)
    if (in[i] == 0.0f)
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                      "%s: element %zu is 0, not a power of two (UE8M0 has no zero)", what, i);
  return NULL;
}

static int is_2d(const mm_tensor_view *t, int64_t a, int64_t b) {
  return t->ndim == 2 && t->shape[0] == a && t->shape[1] == b;
}

/* What the weight and scale tensors of a projection say, before any data is
 * read: shape, group size and scale format. */
typedef struct {
  int64_t N, K;
  int gran;
  mm_scale_format sf;
  size_t ng; /* scale bytes per row: K / gran */
} proj_header;

static mm_err *decode_header(const char *name, const mm_proj_views *v, int rows, int cols,
                             int gran_k, proj_header *h) {
  const mm_tensor_view *w = v->weight, *s = v->scale;
  if (!w) return mm_error(MEGAMOE_CODE_NOT_FOUND, "%s.weight: missing", name);
  if (!s) return mm_error(MEGAMOE_CODE_NOT_FOUND, "%s.weight_scale: missing", name);
  MM_TRY(check_host(name, "weight", w));
  MM_TRY(check_host(name, "weight_scale", s));
  char wsh[96], ssh[96];
  shape_str(w, wsh, sizeof wsh);
  shape_str(s, ssh, sizeof ssh);

  /* Codes. */
  int64_t N, K;
  if (w->dtype == MM_DT_U8 && w->ndim == 2) {
    N = w->shape[0];
    K = 2 * w->shape[1];
  } else if (w->dtype == MM_DT_F4_E2M1 && w->ndim == 2 && w->shape[1] % 2 == 0) {
    N = w->shape[0];
    K = w->shape[1];
  } else {
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s.weight: expected U8 [N, K/2] packed E2M1 codes (or F4_E2M1 [N, K]), "
                    "got %s %s",
                    name, dtype_str(w->dtype), wsh);
  }
  if (N < 1 || K < 16 || N > INT_MAX / 2 || K > INT_MAX / 2)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s.weight: unusable shape %s", name, wsh);
  if (rows > 0 && (N != rows || K != cols))
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s.weight: shape %s %s is a [%lld, %lld] matrix, expected [%d, %d] "
                    "(model shapes)",
                    name, dtype_str(w->dtype), wsh, (long long)N, (long long)K, rows, cols);
  if (K % 16 != 0)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s.weight: K = %lld is not a multiple of 16 (the smallest scale group)",
                    name, (long long)K);

  /* Scales: the dtype and the shape give the format. */
  int gran = 0;
  mm_scale_format sf = MM_SF_UE8M0;
  int64_t g16 = K / 16, g32 = K % 32 == 0 ? K / 32 : -1;
  switch (s->dtype) {
    case MM_DT_F8_E4M3:
      if (is_2d(s, N, g16)) gran = 16, sf = MM_SF_E4M3;
      break;
    case MM_DT_U8:
    case MM_DT_F8_E8M0:
    case MM_DT_F32:
      if (is_2d(s, N, g16)) gran = 16;
      else if (is_2d(s, N, g32)) gran = 32;
      break;
    case MM_DT_I32: {
      int64_t w16 = (g16 + 3) / 4, w32 = g32 > 0 ? (g32 + 3) / 4 : -1;
      int f16 = is_2d(s, N, w16), f32 = is_2d(s, N, w32);
      if (f16 && f32) {
        if (gran_k != 16 && gran_k != 32)
          return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                          "%s.weight_scale: packed I32 %s fits both group 16 and group 32 for "
                          "K = %lld; set gran-k",
                          name, ssh, (long long)K);
        gran = gran_k;
      } else if (f16) {
        gran = 16;
      } else if (f32) {
        gran = 32;
      }
      break;
    }
    default:
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                      "%s.weight_scale: dtype %s is not a scale type (F8_E4M3, U8/F8_E8M0, "
                      "I32 packed UE8M0, F32 powers of two)",
                      name, dtype_str(s->dtype));
  }
  if (!gran) {
    if (s->dtype == MM_DT_F8_E4M3)
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                      "%s.weight_scale: F8_E4M3 shape %s, expected [%lld, %lld] (one per 16 "
                      "of K = %lld)",
                      name, ssh, (long long)N, (long long)g16, (long long)K);
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s.weight_scale: %s shape %s fits neither group 16 [%lld, %lld%s] nor "
                    "group 32 for K = %lld",
                    name, dtype_str(s->dtype), ssh, (long long)N,
                    (long long)(s->dtype == MM_DT_I32 ? (g16 + 3) / 4 : g16),
                    s->dtype == MM_DT_I32 ? " words" : "", (long long)K);
  }
  h->N = N;
  h->K = K;
  h->gran = gran;
  h->sf = sf;
  h->ng = (size_t)(K / gran);
  return NULL;
}

/* Scale bytes one per byte in the tensor (U8, F8): readable where they are. */
static int scales_in_place(const mm_tensor_view *s) {
  return s->dtype == MM_DT_U8 || s->dtype == MM_DT_F8_E8M0 || s->dtype == MM_DT_F8_E4M3;
}

/* Checks scale bytes for NaN (naming the first) while copying them to dst
 * (NULL: check only); *smax gets the largest |scale|. Magnitudes are in byte
 * order in both formats, so the largest byte gives the largest value. */
static mm_err *check_scales(const char *name, const uint8_t *b, uint8_t *dst, size_t n,
                            size_t ng, mm_scale_format sf, float *smax) {
  const uint8_t nan = sf == MM_SF_E4M3 ? 0x7F : 0xFF; /* NaN: all magnitude bits set */
  uint8_t top = 0;
  for (size_t i0 = 0; i0 < n; i0 += 4096) {
    const size_t n1 = n - i0 < 4096 ? n - i0 : 4096;
    const uint8_t *p = b + i0;
    if (dst) memcpy(dst + i0, p, n1);
    uint8_t hi = 0, any_nan = 0;
    for (size_t i = 0; i < n1; i++) {
      const uint8_t m = p[i] & nan;
      hi = m > hi ? m : hi;
      any_nan |= m == nan;
    }
    if (any_nan)
      for (size_t i = 0; i < n1; i++)
        if ((p[i] & nan) == nan)
          return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                          "%s.weight_scale: NaN scale byte 0x%02x at [%zu, %zu]", name, p[i],
                          (i0 + i) / ng, (i0 + i) % ng);
    top = hi > top ? hi : top;
  }
  *smax = sf == MM_SF_E4M3 ? mm_e4m3_to_float(top) : mm_ue8m0_to_float(top);
  return NULL;
}

/* The scale bytes [N, ng] of a projection into dst (NULL: byte-typed scales
 * only, checked where they are), checked; *smax as above. */
static mm_err *decode_scales(const char *name, const mm_tensor_view *s, const proj_header *h,
                             uint8_t *dst, float *smax) {
  const size_t N = (size_t)h->N, ng = h->ng;
  if (s->dtype == MM_DT_I32) {
    size_t words = (ng + 3) / 4;
    const uint8_t *src = s->data; /* little-endian: byte j of word = group 4w+j */
    for (size_t r = 0; r < N; r++) memcpy(dst + r * ng, src + r * words * 4, ng);
    return check_scales(name, dst, NULL, N * ng, ng, h->sf, smax);
  }
  if (s->dtype == MM_DT_F32) {
    char what[160];
    snprintf(what, sizeof what, "%s.weight_scale", name);
    MM_TRY(f32_pow2_scales(s->data, N * ng, dst, what));
    return check_scales(name, dst, NULL, N * ng, ng, h->sf, smax);
  }
  return check_scales(name, s->data, dst, N * ng, ng, h->sf, smax);
}

/* weight_scale_2 and input_scale; the global times the largest group scale
 * must stay finite. */
static mm_err *decode_globals(const char *name, const mm_proj_views *v, mm_scale_format sf,
                              float smax, int require_global, float *global_out,
                              float *input_scale) {
  float global = 1.0f;
  if (v->scale_2) {
    MM_TRY(read_scalar(name, "weight_scale_2", v->scale_2, &global));
    if (!(global > 0.0f))
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                      "%s.weight_scale_2: global scale %g is not positive", name, (double)global);
  } else if (sf == MM_SF_E4M3 && require_global) {
    return mm_error(MEGAMOE_CODE_NOT_FOUND,
                    "%s.weight_scale_2: missing (NVFP4 E4M3 scales need the global scale)", name);
  }
  if (!isfinite(6.0f * smax * global))
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s.weight_scale_2: global %g times the largest group scale %g overflows "
                    "FP32",
                    name, (double)global, (double)smax);
  *global_out = global;
  if (v->input_scale) {
    float is;
    MM_TRY(read_scalar(name, "input_scale", v->input_scale, &is));
    if (input_scale) *input_scale = is;
  }
  return NULL;
}

mm_err *mm_weights_decode_proj(const char *name, const mm_proj_views *v, int rows, int cols,
                               int gran_k, int require_global, mm_qmat *out,
                               float *input_scale) {
  memset(out, 0, sizeof(*out));
  if (input_scale) *input_scale = NAN;
  proj_header h;
  MM_TRY(decode_header(name, v, rows, cols, gran_k, &h));
  if (mm_qmat_alloc(out, (int)h.N, (int)h.K, h.gran, h.sf) != 0) {
    mm_qmat_free(out);
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory for [%lld, %lld]", name,
                    (long long)h.N, (long long)h.K);
  }
  memcpy(out->codes, v->weight->data, (size_t)h.N * (size_t)(h.K / 2));
  float smax = 0.0f, global = 1.0f;
  mm_err *err = decode_scales(name, v->scale, &h, out->scales, &smax);
  if (!err) err = decode_globals(name, v, h.sf, smax, require_global, &global, input_scale);
  if (err) {
    mm_qmat_free(out);
    memset(out, 0, sizeof(*out));
    return err;
  }
  for (int r = 0; r < out->rows; r++) out->row_scale[r] = global;
  return NULL;
}

/* ---- one layer ------------------------------------------------------------ */

int mm_weights_parse_name(const char *name, size_t *prefix_len, long *expert, mm_proj *proj,
                          int *field) {
  const char *s = name;
  for (;;) {
    const char *hit = strstr(s, "experts.");
    if (!hit) return -1;
    if (hit == name || hit[-1] == '.') {
      if (prefix_len) *prefix_len = (size_t)(hit - name);
      s = hit + 8;
      break;
    }
    s = hit + 1;
  }
  if (*s < '0' || *s > '9') return -1;
  char *end;
  long e = strtol(s, &end, 10);
  if (*end != '.' || e < 0 || e > INT_MAX) return -1;
  s = end + 1;
  int p = -1;
  for (int i = 0; i < 3; i++) {
    size_t n = strlen(kProjNames[i]);
    if (strncmp(s, kProjNames[i], n) == 0 && s[n] == '.') {
      p = i;
      s += n + 1;
      break;
    }
  }
  if (p < 0) return -1;
  for (int i = 0; i < 4; i++)
    if (strcmp(s, kFieldNames[i]) == 0) {
      *expert = e;
      *proj = (mm_proj)p;
      *field = i;
      return 0;
    }
  return -1;
}

typedef struct {
  const mm_tensor_view *t[3][4];
} expert_views;

static mm_err *same_view(const char *ename, int field, const mm_tensor_view *g,
                         const mm_tensor_view *u) {
  int same = g->dtype == u->dtype && g->ndim == u->ndim;
  for (int i = 0; same && i < g->ndim; i++) same = g->shape[i] == u->shape[i];
  if (same) return NULL;
  char gs[96], us[96];
  shape_str(g, gs, sizeof gs);
  shape_str(u, us, sizeof us);
  return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                  "%s.up_proj.%s: %s %s does not match %s.gate_proj.%s %s %s (gate and up "
                  "must have the same shape)",
                  ename, kFieldNames[field], dtype_str(u->dtype), us, ename,
                  kFieldNames[field], dtype_str(g->dtype), gs);
}

static void free_experts(mm_expert_q *x, int n) {
  for (int i = 0; i < n; i++) {
    mm_qmat_free(&x[i].w13);
    mm_qmat_free(&x[i].w2);
  }
  memset(x, 0, sizeof(*x) * (size_t)n);
}

static const char *format_name(mm_scale_format sf, int gran) {
  if (sf == MM_SF_E4M3) return gran == 16 ? "nvfp4-g16" : "e4m3-g32";
  return gran == 16 ? "ue8m0-g16" : "ue8m0-g32";
}

/* ---- the experts of a layer, in parallel -------------------------------- */

/* The layer's format, fixed by its first tensor (the first local expert's
 * gate_proj, the first one a sequential load meets), and what every
 * expert's job reads and writes. Each expert writes only its own slots. */
typedef struct {
  const mm_config *cfg;
  const expert_views *ev;
  int first_expert, H, I;
  int requant;  /* group16 -> group32 here, on the host */
  int deferred; /* the same requant, left to the caller (MM_LOAD_DEFER_REQUANT) */
  int src_gran, out_gran, inner_threads;
  mm_scale_format src_sf, out_sf;
  const char *first_name;
  mm_expert_q *out;        /* [num_local] */
  mm_tensor_report *trep;  /* [3 * num_local] */
  mm_requant_stats *stats; /* [3 * num_local] */
  mm_err **errs;           /* [num_local] */
} layer_job;

static void proj_names(int eid, char ename[48], char pname[3][96]) {
  snprintf(ename, 48, "experts.%d", eid);
  for (int p = 0; p < 3; p++) snprintf(pname[p], 96, "%s.%s", ename, kProjNames[p]);
}

static mm_err *check_present(const expert_views *v, int eid, char pname[3][96]) {
  for (int p = 0; p < 3; p++)
    for (int f = 0; f < 2; f++)
      if (!v->t[p][f])
        return mm_error(MEGAMOE_CODE_NOT_FOUND, "%s.%s: missing (local expert %d)", pname[p],
                        kFieldNames[f], eid);
  return NULL;
}

/* A tensor in another format than the layer's first: finish checking it as
 * a sequential load would (its own data errors come first), then refuse. */
static mm_err *other_format(const layer_job *j, const char *pname, const mm_proj_views *v,
                            int rows, int cols) {
  mm_qmat q;
  MM_TRY(mm_weights_decode_proj(pname, v, rows, cols, j->cfg->gran_k, 1, &q, NULL));
  mm_err *err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                         "%s.weight_scale: format %s differs from %s (%s); one layer needs one "
                         "format",
                         pname, format_name(q.sf, q.gran), j->first_name,
                         format_name(j->src_sf, j->src_gran));
  mm_qmat_free(&q);
  return err;
}

/* Loads local expert le: checks all three projections (codes copied and
 * scales checked straight into the result when the format stays), then
 * requantizes them from the source tensors. Same checks in the same order
 * as one expert of a sequential load, so its first error is the same. */
static mm_err *load_expert(const layer_job *j, int le) {
  const expert_views *ev = &j->ev[le];
  const int eid = j->first_expert + le, H = j->H, I = j->I;
  char ename[48], pname[3][96];
  proj_names(eid, ename, pname);
  MM_TRY(check_present(ev, eid, pname));
  mm_expert_q *x = &j->out[le];
  if (mm_qmat_alloc(&x->w13, 2 * I, H, j->out_gran, j->out_sf) != 0 ||
      mm_qmat_alloc(&x->w2, H, I, j->out_gran, j->out_sf) != 0)
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory", ename);
  mm_err *err = NULL;
  const uint8_t *codes[3] = {NULL, NULL, NULL}, *scales[3] = {NULL, NULL, NULL};
  uint8_t *scale_buf[3] = {NULL, NULL, NULL}; /* converted scales (I32, F32 sources) */
  float global[3] = {1.0f, 1.0f, 1.0f};
  for (int p = 0; p < 3 && !err; p++) {
    if (p == 1) /* gate checked fine: up must look exactly like it */
      for (int f = 0; f < 4 && !err; f++) {
        const mm_tensor_view *g = ev->t[0][f], *u = ev->t[1][f];
        if (g && u) err = same_view(ename, f, g, u);
      }
    if (err) break;
    const mm_proj_views v = {ev->t[p][F_WEIGHT], ev->t[p][F_SCALE], ev->t[p][F_SCALE2],
                             ev->t[p][F_INPUT]};
    const int rows = p == 2 ? H : I, cols = p == 2 ? I : H;
    mm_tensor_report *tr = &j->trep[3 * le + p];
    tr->expert = eid;
    tr->proj = (mm_proj)p;
    tr->input_scale = NAN;
    proj_header h;
    if ((err = decode_header(pname[p], &v, rows, cols, j->cfg->gran_k, &h))) break;
    if (h.gran != j->src_gran || h.sf != j->src_sf) {
      err = other_format(j, pname[p], &v, rows, cols);
      break;
    }
    mm_qmat *dst = p == 2 ? &x->w2 : &x->w13;
    const size_t row0 = p == 1 ? (size_t)I : 0, n = (size_t)h.N;
    float smax = 0.0f;
    if (!j->requant) {
      memcpy(dst->codes + row0 * (size_t)(h.K / 2), v.weight->data, n * (size_t)(h.K / 2));
      err = decode_scales(pname[p], v.scale, &h, dst->scales + row0 * h.ng, &smax);
    } else if (scales_in_place(v.scale)) {
      scales[p] = v.scale->data;
      err = decode_scales(pname[p], v.scale, &h, NULL, &smax);
    } else {
      scales[p] = scale_buf[p] = malloc(n * h.ng + 1);
      err = scale_buf[p] ? decode_scales(pname[p], v.scale, &h, scale_buf[p], &smax)
                         : mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory", ename);
    }
    codes[p] = v.weight->data;
    if (!err)
      err = decode_globals(pname[p], &v, h.sf, smax, 1, &global[p], &tr->input_scale);
    if (err) break;
    tr->global_scale = global[p];
    if (!j->requant)
      for (size_t r = 0; r < n; r++) dst->row_scale[row0 + r] = global[p];
  }
  float *rs = j->requant && !err ? malloc(sizeof(float) * (size_t)(H > I ? H : I)) : NULL;
  if (j->requant && !err && !rs)
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory", ename);
  for (int p = 0; p < 3 && j->requant && !err; p++) {
    const int rows = p == 2 ? H : I, cols = p == 2 ? I : H;
    mm_qmat *dst = p == 2 ? &x->w2 : &x->w13;
    const size_t row0 = p == 1 ? (size_t)I : 0;
    for (int r = 0; r < rows; r++) rs[r] = global[p];
    mm_g16_source src = {rows, cols, j->src_sf, codes[p], scales[p], rs};
    mm_requant_stats *st = &j->stats[3 * le + p];
    err = mm_requant_g16_to_g32(&src, dst->codes + row0 * (size_t)(cols / 2),
                                dst->scales + row0 * (size_t)(cols / 32), j->inner_threads, st);
    if (err) {
      err = mm_error_wrap(err, "%s", pname[p]);
      break;
    }
    mm_tensor_report *tr = &j->trep[3 * le + p];
    tr->rel_rms = st->rel_rms;
    tr->max_abs = st->max_abs;
    err = mm_requant_limit_error(pname[p], st, j->cfg->requant_max_rel_error);
  }
  free(rs);
  for (int p = 0; p < 3; p++) free(scale_buf[p]);
  return err;
}

static void load_one(void *ctx, size_t le) {
  layer_job *j = ctx;
  j->errs[le] = load_expert(j, (int)le);
}

/* The layer's output format from its first tensor and the policy; an error
 * when they contradict each other (naming that tensor). */
static mm_err *layer_policy(const mm_config *cfg, unsigned flags, const char *pname,
                            const proj_header *h, layer_job *j) {
  const int H = cfg->model.hidden_size, I = cfg->model.moe_intermediate_size;
  const int want_requant = cfg->requant_policy == MM_REQUANT_G16_TO_G32;
  j->src_gran = h->gran;
  j->src_sf = h->sf;
  if (h->gran == 16 && want_requant && cfg->gran_k == 16)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s.weight_scale: requant.policy group16-to-group32 contradicts gran-k 16",
                    pname);
  if (h->gran == 16 && !want_requant && cfg->gran_k == 32)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s.weight_scale: the checkpoint has group-16 scales (%s) but gran-k is "
                    "32; set requant.policy: group16-to-group32 or gran-k: 16",
                    pname, format_name(h->sf, 16));
  if (h->gran == 32 && cfg->gran_k == 16)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s.weight_scale: the checkpoint has group-32 scales but gran-k is 16 "
                    "(group 32 cannot be refined)",
                    pname);
  const int requant = h->gran == 16 && want_requant;
  j->deferred = requant && (flags & MM_LOAD_DEFER_REQUANT);
  j->requant = requant && !j->deferred;
  j->out_gran = j->requant ? 32 : h->gran;
  j->out_sf = j->requant ? MM_SF_UE8M0 : h->sf;
  if (requant && H % 32 != 0)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s: requant to group 32 needs hidden size %% 32 == 0 (H = %d)", pname, H);
  if (requant && I % 32 != 0)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s: requant to group 32 needs moe-intermediate-size %% 32 == 0 (I = %d)",
                    pname, I);
  return NULL;
}

mm_err *mm_requant_expert(const mm_config *cfg, int eid, const mm_expert_q *src,
                          mm_expert_q *dst, mm_requant_stats st[3]) {
  MM_ARG_CHECK(cfg && src && st && src->w13.gran == 16 && src->w2.gran == 16 &&
                   src->w13.rows % 2 == 0 && src->w13.cols % 32 == 0 && src->w2.cols % 32 == 0,
               "requant of expert %d: needs a canonical group-16 expert", eid);
  const int H = src->w2.rows, I = src->w2.cols;
  mm_expert_q out = {0};
  mm_err *err = NULL;
  if (dst ? mm_qmat_alloc(&out.w13, 2 * I, H, 32, MM_SF_UE8M0) ||
                mm_qmat_alloc(&out.w2, H, I, 32, MM_SF_UE8M0)
          : mm_qmat_alloc(&out.w13, H > I ? H : I, H > I ? H : I, 32, MM_SF_UE8M0))
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "weights load: out of memory");
  char ename[48], pname[3][96];
  proj_names(eid, ename, pname);
  for (int p = 0; p < 3 && !err; p++) {
    const mm_qmat *m = p == 2 ? &src->w2 : &src->w13;
    /* without dst every projection goes to the front of one scratch matrix */
    mm_qmat *o = dst && p == 2 ? &out.w2 : &out.w13;
    const size_t row0 = dst && p == 1 ? (size_t)I : 0;
    const mm_g16_source g = mm_g16_rows(m, p == 1 ? I : 0, p == 2 ? H : I);
    err = mm_requant_g16_to_g32(&g, o->codes + row0 * (size_t)(m->cols / 2),
                                o->scales + row0 * (size_t)(m->cols / 32), cfg->cpu_threads,
                                &st[p]);
    err = err ? mm_error_wrap(err, "%s", pname[p])
              : mm_requant_limit_error(pname[p], &st[p], cfg->requant_max_rel_error);
  }
  if (err || !dst) {
    mm_qmat_free(&out.w13);
    mm_qmat_free(&out.w2);
    return err;
  }
  *dst = out; /* row_scale 1 from mm_qmat_alloc */
  return NULL;
}

/* In a deferred load, the error a sequential load would have met before
 * local expert le_err's: the requant of an earlier expert over the limit.
 * Their canonical group-16 matrices hold the source values (codes, scale
 * bytes, row_scale = the global), so the requant from them is the one the
 * load would have run. Runs only on the way to an error. */
static mm_err *earlier_requant_error(const layer_job *j, int le_err) {
  mm_err *err = NULL;
  for (int le = 0; le < le_err && !err; le++) {
    mm_requant_stats st[3];
    err = mm_requant_expert(j->cfg, j->first_expert + le, &j->out[le], NULL, st);
  }
  return err;
}

/* Totals and the worst tensor of a requantized layer's report. */
static void requant_totals(mm_requant_report *r, const mm_requant_stats *stats) {
  r->total = (mm_requant_stats){0};
  r->worst_tensor = -1;
  for (int i = 0; i < r->num_tensors; i++) {
    mm_requant_stats_merge(&r->total, &stats[i]);
    if (r->worst_tensor < 0 || r->tensors[i].rel_rms > r->tensors[r->worst_tensor].rel_rms)
      r->worst_tensor = i;
  }
}

/* The report's one-line summary, from its fields. */
static void write_summary(mm_requant_report *r, const mm_config *cfg) {
  const int num_local = r->num_tensors / 3, first = r->tensors[0].expert;
  int o = snprintf(r->summary, sizeof r->summary, "experts %d..%d: %s", first,
                   first + num_local - 1, r->source_format);
  if (r->requantized && o > 0 && (size_t)o < sizeof r->summary) {
    const mm_tensor_report *w = &r->tensors[r->worst_tensor];
    o += snprintf(r->summary + o, sizeof r->summary - (size_t)o,
                  " -> ue8m0-g32 requantized%s: rel RMS %.4f (worst %.4f experts.%d.%s), max "
                  "abs err %.4g",
                  r->requant_on_device ? " on the GPU" : "", r->total.rel_rms, w->rel_rms,
                  w->expert, mm_proj_name(w->proj), r->total.max_abs);
  } else if (r->source_gran == 32 && cfg->requant_policy == MM_REQUANT_G16_TO_G32 && o > 0 &&
             (size_t)o < sizeof r->summary) {
    o += snprintf(r->summary + o, sizeof r->summary - (size_t)o,
                  " (already group 32, no requant)");
  }
  if (o <= 0 || (size_t)o >= sizeof r->summary) return;
  const int requant = r->requantized || r->requant_pending;
  if (r->source_sf != MM_SF_E4M3 && r->globals_differ == 0)
    snprintf(r->summary + o, sizeof r->summary - (size_t)o, "; no global scales");
  else if (r->globals_differ == 0)
    snprintf(r->summary + o, sizeof r->summary - (size_t)o,
             "; gate/up global scales equal in all %d experts", num_local);
  else
    snprintf(r->summary + o, sizeof r->summary - (size_t)o,
             "; gate/up global scales differ in %d/%d experts (max ratio %.3g): %s",
             r->globals_differ, num_local, r->globals_max_ratio,
             requant ? "each folded into its own projection's values before requant"
                     : "kept as per-row scales (gate rows x gate global, up rows x up global)");
}

mm_err *mm_weights_load_layer(const mm_config *cfg, const mm_tensor_view *tensors, size_t n,
                              int first_expert, int num_local, mm_expert_q *experts_out,
                              mm_requant_report *report_out) {
  return mm_weights_load_layer_ex(cfg, tensors, n, first_expert, num_local, 0, experts_out,
                                  report_out);
}

mm_err *mm_weights_load_layer_ex(const mm_config *cfg, const mm_tensor_view *tensors, size_t n,
                                 int first_expert, int num_local, unsigned flags,
                                 mm_expert_q *experts_out, mm_requant_report *report_out) {
  MM_ARG_CHECK(cfg && experts_out && (tensors || n == 0), "weights load: NULL argument");
  MM_ARG_CHECK(num_local >= 1 && first_expert >= 0 &&
                   first_expert + num_local <= cfg->model.num_experts,
               "weights load: experts %d..%d outside model.num-experts %d", first_expert,
               first_expert + num_local - 1, cfg->model.num_experts);
  MM_ARG_CHECK(!(flags & MM_LOAD_DEFER_REQUANT) || report_out,
               "weights load: a deferred requant needs the report");
  const int H = cfg->model.hidden_size, I = cfg->model.moe_intermediate_size;
  MM_ARG_CHECK(H > 0 && I > 0, "weights load: model shapes H = %d, I = %d", H, I);
  memset(experts_out, 0, sizeof(*experts_out) * (size_t)num_local);
  if (report_out) {
    memset(report_out, 0, sizeof(*report_out));
    report_out->worst_tensor = -1;
  }

  mm_err *err = NULL;
  mm_tensor_report *trep = calloc((size_t)num_local * 3, sizeof(mm_tensor_report));
  mm_requant_stats *stats = calloc((size_t)num_local * 3, sizeof(mm_requant_stats));
  expert_views *ev = calloc((size_t)num_local, sizeof(expert_views));
  mm_err **errs = calloc((size_t)num_local, sizeof(mm_err *));
  if (!trep || !stats || !ev || !errs) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "weights load: out of memory");
    goto fail;
  }

  /* Index the names of local experts. */
  for (size_t i = 0; i < n; i++) {
    long e;
    mm_proj p;
    int f;
    if (!tensors[i].name || mm_weights_parse_name(tensors[i].name, NULL, &e, &p, &f) != 0)
      continue;
    if (e < first_expert || e >= first_expert + num_local) continue;
    const mm_tensor_view **slot = &ev[e - first_expert].t[p][f];
    if (*slot) {
      err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: tensor given twice", tensors[i].name);
      goto fail;
    }
    *slot = &tensors[i];
  }

  /* The first local expert's gate_proj fixes the layer's format. */
  char ename0[48], pname0[3][96];
  proj_names(first_expert, ename0, pname0);
  MM_TRY_GOTO(check_present(&ev[0], first_expert, pname0), err, fail);
  const mm_proj_views v0 = {ev[0].t[0][F_WEIGHT], ev[0].t[0][F_SCALE], ev[0].t[0][F_SCALE2],
                            ev[0].t[0][F_INPUT]};
  proj_header h0;
  MM_TRY_GOTO(decode_header(pname0[0], &v0, I, H, cfg->gran_k, &h0), err, fail);
  const int threads = mm_thread_count(cfg->cpu_threads);
  layer_job job = {cfg, ev, first_expert, H, I, 0, 0, 0, 0, 1, MM_SF_E4M3, MM_SF_E4M3, pname0[0],
                   experts_out, trep, stats, errs};
  job.inner_threads = threads > num_local ? threads / num_local : 1;
  if ((err = layer_policy(cfg, flags, pname0[0], &h0, &job))) {
    /* A sequential load finishes checking that tensor first. */
    mm_qmat q;
    mm_err *data_err = mm_weights_decode_proj(pname0[0], &v0, I, H, cfg->gran_k, 1, &q, NULL);
    mm_qmat_free(&q);
    if (data_err) {
      mm_error_free(err);
      err = data_err;
    }
    goto fail;
  }

  /* All experts at once; the first failing one (in expert order) names the error. */
  mm_parallel_items((size_t)num_local, threads, load_one, &job);
  int le_err = -1;
  for (int le = 0; le < num_local; le++) {
    if (errs[le] && !err) {
      err = errs[le];
      le_err = le;
    } else {
      mm_error_free(errs[le]);
    }
  }
  if (err && job.deferred) {
    mm_err *earlier = earlier_requant_error(&job, le_err);
    if (earlier) {
      mm_error_free(err);
      err = earlier;
    }
  }
  if (err) goto fail;

  int differ = 0;
  double max_ratio = 1.0;
  for (int le = 0; le < num_local; le++) {
    float gg = trep[3 * le].global_scale, ug = trep[3 * le + 1].global_scale;
    if (gg != ug) {
      differ++;
      double ratio = gg > ug ? (double)gg / ug : (double)ug / gg;
      if (ratio > max_ratio) max_ratio = ratio;
    }
  }

  if (report_out) {
    mm_requant_report *r = report_out;
    r->num_tensors = 3 * num_local;
    r->tensors = trep;
    trep = NULL;
    r->source_format = format_name(job.src_sf, job.src_gran);
    r->source_gran = job.src_gran;
    r->source_sf = job.src_sf;
    r->gran = job.deferred ? 32 : job.out_gran;
    r->sf = job.deferred ? MM_SF_UE8M0 : job.out_sf;
    r->requantized = job.requant;
    r->requant_pending = job.deferred;
    r->globals_differ = differ;
    r->globals_max_ratio = max_ratio;
    if (job.requant) requant_totals(r, stats);
    write_summary(r, cfg);
  }
  free(trep);
  free(stats);
  free(ev);
  free(errs);
  return NULL;

fail:
  free_experts(experts_out, num_local);
  free(trep);
  free(stats);
  free(ev);
  free(errs);
  if (report_out) mm_requant_report_free(report_out);
  return err;
}

mm_err *mm_requant_report_finish(mm_requant_report *r, const mm_config *cfg,
                                 const mm_requant_stats *stats, int on_device) {
  MM_ARG_CHECK(r && cfg && stats && r->requant_pending && r->num_tensors > 0,
               "requant report: nothing pending");
  for (int i = 0; i < r->num_tensors; i++) {
    r->tensors[i].rel_rms = stats[i].rel_rms;
    r->tensors[i].max_abs = stats[i].max_abs;
  }
  requant_totals(r, stats);
  r->requantized = 1;
  r->requant_pending = 0;
  r->requant_on_device = on_device;
  write_summary(r, cfg);
  return NULL;
}

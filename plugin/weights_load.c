/* weights_load.c -- raw expert tensors of one layer -> canonical matrices.
 * Order of work: index the names, then per local expert decode and check
 * each projection (source format), then build w13/w2 (copy or requant).
 * Every failure frees what was built so far. */
#include "weights_load.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "formats.h"
#include "layout_sm100.h"

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

mm_err *mm_weights_decode_proj(const char *name, const mm_proj_views *v, int rows, int cols,
                               int gran_k, int require_global, mm_qmat *out,
                               float *input_scale) {
  memset(out, 0, sizeof(*out));
  if (input_scale) *input_scale = NAN;
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

  if (mm_qmat_alloc(out, (int)N, (int)K, gran, sf) != 0) {
    mm_qmat_free(out);
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory for [%lld, %lld]", name,
                    (long long)N, (long long)K);
  }
  size_t ng = (size_t)(K / gran);
  mm_err *err = NULL;
  if (w->dtype == MM_DT_U8 || w->dtype == MM_DT_F4_E2M1)
    memcpy(out->codes, w->data, (size_t)N * (size_t)(K / 2));
  if (s->dtype == MM_DT_I32) {
    size_t words = (ng + 3) / 4;
    const uint8_t *src = s->data; /* little-endian: byte j of word = group 4w+j */
    for (size_t r = 0; r < (size_t)N; r++)
      memcpy(out->scales + r * ng, src + r * words * 4, ng);
  } else if (s->dtype == MM_DT_F32) {
    const float *src = s->data;
    char what[160];
    snprintf(what, sizeof what, "%s.weight_scale", name);
    err = f32_pow2_scales(src, (size_t)N * ng, out->scales, what);
  } else {
    memcpy(out->scales, s->data, (size_t)N * ng);
  }
  if (err) goto fail;

  /* NaN scale bytes, and the largest scale for the overflow check. */
  float smax = 0.0f;
  for (size_t i = 0; i < (size_t)N * ng; i++) {
    uint8_t b = out->scales[i];
    int nan = sf == MM_SF_E4M3 ? mm_e4m3_is_nan(b) : b == 0xFF;
    if (nan) {
      err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                     "%s.weight_scale: NaN scale byte 0x%02x at [%zu, %zu]", name, b, i / ng,
                     i % ng);
      goto fail;
    }
    float a = fabsf(sf == MM_SF_E4M3 ? mm_e4m3_to_float(b) : mm_ue8m0_to_float(b));
    if (a > smax) smax = a;
  }

  float global = 1.0f;
  if (v->scale_2) {
    MM_TRY_GOTO(read_scalar(name, "weight_scale_2", v->scale_2, &global), err, fail);
    if (!(global > 0.0f)) {
      err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                     "%s.weight_scale_2: global scale %g is not positive", name, (double)global);
      goto fail;
    }
  } else if (sf == MM_SF_E4M3 && require_global) {
    err = mm_error(MEGAMOE_CODE_NOT_FOUND,
                   "%s.weight_scale_2: missing (NVFP4 E4M3 scales need the global scale)", name);
    goto fail;
  }
  if (!isfinite(6.0f * smax * global)) {
    err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                   "%s.weight_scale_2: global %g times the largest group scale %g overflows "
                   "FP32",
                   name, (double)global, (double)smax);
    goto fail;
  }
  for (int r = 0; r < out->rows; r++) out->row_scale[r] = global;
  if (v->input_scale) {
    float is;
    MM_TRY_GOTO(read_scalar(name, "input_scale", v->input_scale, &is), err, fail);
    if (input_scale) *input_scale = is;
  }
  return NULL;
fail:
  mm_qmat_free(out);
  memset(out, 0, sizeof(*out));
  return err;
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

/* Copies (or requantizes) `src` into rows [row0, row0 + src->rows) of dst. */
static mm_err *place(const mm_qmat *src, mm_qmat *dst, int row0, int requant, int threads,
                     mm_requant_stats *st) {
  size_t cb = (size_t)src->cols / 2;
  memset(st, 0, sizeof(*st));
  if (requant) {
    mm_g16_source s = {src->rows, src->cols, src->sf, src->codes, src->scales, src->row_scale};
    return mm_requant_g16_to_g32(&s, dst->codes + (size_t)row0 * cb,
                                 dst->scales + (size_t)row0 * (size_t)(dst->cols / 32), threads,
                                 st);
  }
  size_t ng = (size_t)(src->cols / src->gran);
  memcpy(dst->codes + (size_t)row0 * cb, src->codes, (size_t)src->rows * cb);
  memcpy(dst->scales + (size_t)row0 * ng, src->scales, (size_t)src->rows * ng);
  memcpy(dst->row_scale + row0, src->row_scale, sizeof(float) * (size_t)src->rows);
  return NULL;
}

static const char *format_name(mm_scale_format sf, int gran) {
  if (sf == MM_SF_E4M3) return gran == 16 ? "nvfp4-g16" : "e4m3-g32";
  return gran == 16 ? "ue8m0-g16" : "ue8m0-g32";
}

mm_err *mm_weights_load_layer(const mm_config *cfg, const mm_tensor_view *tensors, size_t n,
                              int first_expert, int num_local, mm_expert_q *experts_out,
                              mm_requant_report *report_out) {
  MM_ARG_CHECK(cfg && experts_out && (tensors || n == 0), "weights load: NULL argument");
  MM_ARG_CHECK(num_local >= 1 && first_expert >= 0 &&
                   first_expert + num_local <= cfg->model.num_experts,
               "weights load: experts %d..%d outside model.num-experts %d", first_expert,
               first_expert + num_local - 1, cfg->model.num_experts);
  const int H = cfg->model.hidden_size, I = cfg->model.moe_intermediate_size;
  MM_ARG_CHECK(H > 0 && I > 0, "weights load: model shapes H = %d, I = %d", H, I);
  memset(experts_out, 0, sizeof(*experts_out) * (size_t)num_local);
  if (report_out) {
    memset(report_out, 0, sizeof(*report_out));
    report_out->worst_tensor = -1;
  }

  mm_err *err = NULL;
  int built = 0;
  mm_qmat src[3];
  memset(src, 0, sizeof src);
  mm_tensor_report *trep = calloc((size_t)num_local * 3, sizeof(mm_tensor_report));
  expert_views *ev = calloc((size_t)num_local, sizeof(expert_views));
  if (!trep || !ev) {
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

  const int threads = cfg->cpu_threads;
  int requant = 0, src_gran = 0, out_gran = 0;
  mm_scale_format src_sf = MM_SF_E4M3, out_sf = MM_SF_E4M3;
  const char *first_name = NULL;
  char first_buf[96];
  mm_requant_stats total = {0};
  int worst = -1, differ = 0;
  double max_ratio = 1.0;

  for (int le = 0; le < num_local; le++) {
    int eid = first_expert + le;
    char ename[48], pname[3][96];
    snprintf(ename, sizeof ename, "experts.%d", eid);
    for (int p = 0; p < 3; p++) {
      snprintf(pname[p], sizeof pname[p], "%s.%s", ename, kProjNames[p]);
      for (int f = 0; f < 2; f++)
        if (!ev[le].t[p][f]) {
          err = mm_error(MEGAMOE_CODE_NOT_FOUND, "%s.%s: missing (local expert %d)", pname[p],
                         kFieldNames[f], eid);
          goto fail;
        }
    }
    for (int p = 0; p < 3; p++) {
      if (p == 1) /* gate decoded fine: up must look exactly like it */
        for (int f = 0; f < 4; f++) {
          const mm_tensor_view *g = ev[le].t[0][f], *u = ev[le].t[1][f];
          if (g && u) MM_TRY_GOTO(same_view(ename, f, g, u), err, fail);
        }
      mm_proj_views v = {ev[le].t[p][F_WEIGHT], ev[le].t[p][F_SCALE], ev[le].t[p][F_SCALE2],
                         ev[le].t[p][F_INPUT]};
      int rows = p == 2 ? H : I, cols = p == 2 ? I : H;
      mm_tensor_report *tr = &trep[3 * le + p];
      tr->expert = eid;
      tr->proj = (mm_proj)p;
      MM_TRY_GOTO(mm_weights_decode_proj(pname[p], &v, rows, cols, cfg->gran_k, 1, &src[p],
                                         &tr->input_scale),
                  err, fail);
      tr->global_scale = src[p].row_scale[0];
      if (!first_name) {
        /* The first tensor fixes the layer's format; check it against the policy. */
        memcpy(first_buf, pname[p], sizeof first_buf);
        first_name = first_buf;
        src_gran = src[p].gran;
        src_sf = src[p].sf;
        int want_requant = cfg->requant_policy == MM_REQUANT_G16_TO_G32;
        if (src_gran == 16 && want_requant && cfg->gran_k == 16) {
          err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                         "%s.weight_scale: requant.policy group16-to-group32 contradicts gran-k "
                         "16",
                         pname[p]);
          goto fail;
        }
        if (src_gran == 16 && !want_requant && cfg->gran_k == 32) {
          err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                         "%s.weight_scale: the checkpoint has group-16 scales (%s) but gran-k is "
                         "32; set requant.policy: group16-to-group32 or gran-k: 16",
                         pname[p], format_name(src_sf, 16));
          goto fail;
        }
        if (src_gran == 32 && cfg->gran_k == 16) {
          err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                         "%s.weight_scale: the checkpoint has group-32 scales but gran-k is 16 "
                         "(group 32 cannot be refined)",
                         pname[p]);
          goto fail;
        }
        requant = src_gran == 16 && want_requant;
        out_gran = requant ? 32 : src_gran;
        out_sf = requant ? MM_SF_UE8M0 : src_sf;
        if (requant && H % 32 != 0) {
          err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                         "%s: requant to group 32 needs hidden size %% 32 == 0 (H = %d)",
                         pname[p], H);
          goto fail;
        }
        if (requant && I % 32 != 0) {
          err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                         "%s: requant to group 32 needs moe-intermediate-size %% 32 == 0 (I = %d)",
                         pname[p], I);
          goto fail;
        }
      } else if (src[p].gran != src_gran || src[p].sf != src_sf) {
        err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                       "%s.weight_scale: format %s differs from %s (%s); one layer needs one "
                       "format",
                       pname[p], format_name(src[p].sf, src[p].gran), first_name,
                       format_name(src_sf, src_gran));
        goto fail;
      }
    }

    float gg = src[0].row_scale[0], ug = src[1].row_scale[0];
    if (gg != ug) {
      differ++;
      double ratio = gg > ug ? (double)gg / ug : (double)ug / gg;
      if (ratio > max_ratio) max_ratio = ratio;
    }

    mm_expert_q *x = &experts_out[le];
    if (mm_qmat_alloc(&x->w13, 2 * I, H, out_gran, out_sf) != 0 ||
        mm_qmat_alloc(&x->w2, H, I, out_gran, out_sf) != 0) {
      built = le + 1;
      err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory", ename);
      goto fail;
    }
    built = le + 1;
    for (int p = 0; p < 3; p++) {
      mm_requant_stats st;
      mm_qmat *dst = p == 2 ? &x->w2 : &x->w13;
      err = place(&src[p], dst, p == 1 ? I : 0, requant, threads, &st);
      if (err) {
        err = mm_error_wrap(err, "%s", pname[p]);
        goto fail;
      }
      mm_qmat_free(&src[p]);
      if (!requant) continue;
      mm_tensor_report *tr = &trep[3 * le + p];
      tr->rel_rms = st.rel_rms;
      tr->max_abs = st.max_abs;
      mm_requant_stats_merge(&total, &st);
      if (worst < 0 || tr->rel_rms > trep[worst].rel_rms) worst = 3 * le + p;
      if (st.rel_rms > cfg->requant_max_rel_error) {
        err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                       "%s: group16 -> group32 requant error %.4f (relative RMS, max abs %.4g) "
                       "exceeds requant.max-rel-error %.4f",
                       pname[p], st.rel_rms, st.max_abs, cfg->requant_max_rel_error);
        goto fail;
      }
    }
  }

  if (report_out) {
    mm_requant_report *r = report_out;
    r->num_tensors = 3 * num_local;
    r->tensors = trep;
    trep = NULL;
    r->source_format = format_name(src_sf, src_gran);
    r->source_gran = src_gran;
    r->gran = out_gran;
    r->sf = out_sf;
    r->requantized = requant;
    r->total = total;
    r->worst_tensor = worst;
    r->globals_differ = differ;
    r->globals_max_ratio = max_ratio;
    int o = snprintf(r->summary, sizeof r->summary, "experts %d..%d: %s", first_expert,
                     first_expert + num_local - 1, r->source_format);
    if (requant && o > 0 && (size_t)o < sizeof r->summary)
      o += snprintf(r->summary + o, sizeof r->summary - (size_t)o,
                    " -> ue8m0-g32 requantized: rel RMS %.4f (worst %.4f experts.%d.%s), max "
                    "abs err %.4g",
                    total.rel_rms, r->tensors[worst].rel_rms, r->tensors[worst].expert,
                    mm_proj_name(r->tensors[worst].proj), total.max_abs);
    else if (src_gran == 32 && cfg->requant_policy == MM_REQUANT_G16_TO_G32 && o > 0 &&
             (size_t)o < sizeof r->summary)
      o += snprintf(r->summary + o, sizeof r->summary - (size_t)o,
                    " (already group 32, no requant)");
    if (o > 0 && (size_t)o < sizeof r->summary) {
      if (src_sf != MM_SF_E4M3 && differ == 0)
        snprintf(r->summary + o, sizeof r->summary - (size_t)o, "; no global scales");
      else if (differ == 0)
        snprintf(r->summary + o, sizeof r->summary - (size_t)o,
                 "; gate/up global scales equal in all %d experts", num_local);
      else
        snprintf(r->summary + o, sizeof r->summary - (size_t)o,
                 "; gate/up global scales differ in %d/%d experts (max ratio %.3g): %s", differ,
                 num_local, max_ratio,
                 requant ? "each folded into its own projection's values before requant"
                         : "kept as per-row scales (gate rows x gate global, up rows x up "
                           "global)");
    }
  }
  free(trep);
  free(ev);
  return NULL;

fail:
  for (int p = 0; p < 3; p++) mm_qmat_free(&src[p]);
  free_experts(experts_out, built);
  free(trep);
  free(ev);
  if (report_out) mm_requant_report_free(report_out);
  return err;
}

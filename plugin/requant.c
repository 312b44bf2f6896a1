/* requant.c -- group-16 -> group-32 UE8M0 requantization, CPU reference.
 * Rows are independent; each row's error sums are kept apart and added in row
 * order at the end, so results never depend on the thread count. */
#include "requant.h"

#include <math.h>
#include <string.h>

#include "formats.h"
#include "parallel.h"

static const float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

void mm_requant_stats_merge(mm_requant_stats *acc, const mm_requant_stats *s) {
  acc->src_sq += s->src_sq;
  acc->err_sq += s->err_sq;
  if (s->max_abs > acc->max_abs) acc->max_abs = s->max_abs;
  acc->count += s->count;
  acc->rel_rms = acc->src_sq > 0.0 ? sqrt(acc->err_sq / acc->src_sq) : 0.0;
}

/* 2^(127 - b) as FP32 bits: exact for every byte (254 gives the subnormal 2^-127). */
static inline float inv_scale(uint8_t b) {
  uint32_t bits = b == 254 ? 0x00400000u : (uint32_t)(254 - b) << 23;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

uint8_t mm_requant_group32(const float v[32], uint8_t codes[16]) {
  float amax = 0.0f;
  for (int i = 0; i < 32; i++) {
    float a = fabsf(v[i]);
    amax = a > amax ? a : amax;
  }
  if (amax == 0.0f) {
    memset(codes, 0, 16);
    return 127;
  }
  uint32_t bits;
  memcpy(&bits, &amax, 4);
  uint8_t b = mm_requant_exp_byte(bits);
  float inv = inv_scale(b);
  for (int j = 0; j < 16; j++) {
    uint8_t lo = mm_requant_e2m1_rne(v[2 * j] * inv);
    uint8_t hi = mm_requant_e2m1_rne(v[2 * j + 1] * inv);
    codes[j] = (uint8_t)(lo | (hi << 4));
  }
  return b;
}

typedef struct {
  double src_sq, err_sq, max_abs;
  int bad_group; /* first group of 32 holding a non-finite value, -1 = none */
} row_result;

typedef struct {
  const mm_g16_source *src;
  uint8_t *codes_out, *scales_out;
  row_result *rows;
  int want_stats;
  float scale_lut[256]; /* group-16 scale byte -> value */
} requant_ctx;

static void requant_rows(void *arg, size_t begin, size_t end) {
  requant_ctx *c = arg;
  const mm_g16_source *s = c->src;
  size_t cb = (size_t)s->cols / 2, g16 = (size_t)s->cols / 16, g32 = (size_t)s->cols / 32;
  for (size_t r = begin; r < end; r++) {
    const uint8_t *in = s->codes + r * cb;
    const uint8_t *sc = s->scales + r * g16;
    uint8_t *out = c->codes_out + r * cb;
    uint8_t *so = c->scales_out + r * g32;
    float rs = s->row_scale ? s->row_scale[r] : 1.0f;
    row_result res = {0.0, 0.0, 0.0, -1};
    for (size_t g = 0; g < g32; g++) {
      float v[32];
      uint32_t nonfinite = 0;
      for (int h = 0; h < 2; h++) {
        float s16 = c->scale_lut[sc[2 * g + (size_t)h]];
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
        res.bad_group = (int)g;
        break;
      }
      uint8_t b = mm_requant_group32(v, out + 16 * g);
      so[g] = b;
      if (c->want_stats) {
        double step = ldexp(1.0, (int)b - 127), gs = 0.0, ge = 0.0, gm = 0.0;
        for (int i = 0; i < 32; i++) {
          uint8_t code = (uint8_t)((out[16 * g + (size_t)i / 2] >> ((i & 1) * 4)) & 0xF);
          double x = (double)v[i], d = x - (double)kE2M1[code] * step;
          gs += x * x;
          ge += d * d;
          gm = fabs(d) > gm ? fabs(d) : gm;
        }
        res.src_sq += gs;
        res.err_sq += ge;
        if (gm > res.max_abs) res.max_abs = gm;
      }
    }
    c->rows[r] = res;
  }
}

mm_err *mm_requant_g16_to_g32(const mm_g16_source *src, uint8_t *codes_out,
                              uint8_t *scales_out, int threads,
                              mm_requant_stats *stats) {
  MM_ARG_CHECK(src && codes_out && scales_out, "requant: NULL argument");
  MM_ARG_CHECK(src->rows >= 0 && src->cols >= 0, "requant: negative shape [%d, %d]",
               src->rows, src->cols);
  MM_ARG_CHECK(src->cols % 32 == 0,
               "requant: K = %d is not a multiple of 32 (group-32 output needs whole groups)",
               src->cols);
  MM_ARG_CHECK(src->sf == MM_SF_E4M3 || src->sf == MM_SF_UE8M0,
               "requant: unknown source scale format %d", (int)src->sf);
  MM_ARG_CHECK(src->rows == 0 || (src->codes && src->scales), "requant: NULL source data");
  if (stats) memset(stats, 0, sizeof(*stats));
  if (src->rows == 0 || src->cols == 0) return NULL;

  row_result *rows = malloc(sizeof(row_result) * (size_t)src->rows);
  if (!rows) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "requant: out of memory");
  requant_ctx ctx = {src, codes_out, scales_out, rows, stats != NULL, {0}};
  for (int b = 0; b < 256; b++)
    ctx.scale_lut[b] = src->sf == MM_SF_E4M3 ? mm_e4m3_to_float((uint8_t)b)
                                             : mm_ue8m0_to_float((uint8_t)b);
  /* Aim for chunks of at least ~64K elements per thread. */
  int nt = mm_thread_count(threads);
  size_t per = (size_t)src->rows * (size_t)src->cols / 65536 + 1;
  if ((size_t)nt > per) nt = (int)per;
  mm_parallel_for((size_t)src->rows, nt, requant_rows, &ctx);

  mm_requant_stats acc = {0};
  for (int r = 0; r < src->rows; r++) {
    if (rows[r].bad_group >= 0) {
      int g = rows[r].bad_group;
      const uint8_t *sc = src->scales + (size_t)r * (size_t)(src->cols / 16) + 2 * (size_t)g;
      float rs = src->row_scale ? src->row_scale[r] : 1.0f;
      mm_err *e = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                           "row %d, elements %d..%d: non-finite source value "
                           "(scale bytes 0x%02x 0x%02x, global %g)",
                           r, 32 * g, 32 * g + 31, sc[0], sc[1], (double)rs);
      free(rows);
      return e;
    }
    mm_requant_stats one = {rows[r].src_sq, rows[r].err_sq, rows[r].max_abs, 0.0, src->cols};
    mm_requant_stats_merge(&acc, &one);
  }
  free(rows);
  if (stats) *stats = acc;
  return NULL;
}

mm_err *mm_requant_qmat(const mm_qmat *src, int threads, mm_qmat *dst,
                        mm_requant_stats *stats) {
  memset(dst, 0, sizeof(*dst));
  MM_ARG_CHECK(src->gran == 16, "requant: source group size is %d, expected 16", src->gran);
  mm_qmat out;
  if (mm_qmat_alloc(&out, src->rows, src->cols, 32, MM_SF_UE8M0) != 0) {
    mm_qmat_free(&out);
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "requant: out of memory for [%d, %d]",
                    src->rows, src->cols);
  }
  mm_g16_source s = {src->rows, src->cols, src->sf, src->codes, src->scales, src->row_scale};
  mm_err *err = mm_requant_g16_to_g32(&s, out.codes, out.scales, threads, stats);
  if (err) {
    mm_qmat_free(&out);
    return err;
  }
  *dst = out;
  return NULL;
}

/* requant.c -- group-16 -> group-32 UE8M0 requantization, CPU reference.
 * Rows are independent; each row's error sums are kept apart and added in row
 * order at the end, so results never depend on the thread count. */
#include "requant.h"

#include <math.h>
#include <string.h>

#include "formats.h"
#include "parallel.h"


void mm_requant_stats_merge(mm_requant_stats *acc, const mm_requant_stats *s) {
  acc->src_sq += s->src_sq;
  acc->err_sq += s->err_sq;
  if (s->max_abs > acc->max_abs) acc->max_abs = s->max_abs;
  acc->count += s->count;
  acc->rel_rms = acc->src_sq > 0.0 ? sqrt(acc->err_sq / acc->src_sq) : 0.0;
}

mm_err *mm_requant_limit_error(const char *name, const mm_requant_stats *st,
                               double max_rel_error) {
  if (!(st->rel_rms > max_rel_error)) return NULL;
  return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                  "%s: group16 -> group32 requant error %.4f (relative RMS, max abs %.4g) "
                  "exceeds requant.max-rel-error %.4f",
                  name, st->rel_rms, st->max_abs, max_rel_error);
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
  uint8_t mags[256];    /* bit m: a code of the byte has magnitude m */
} requant_ctx;

/* One group of 32, worked out per magnitude instead of per element: within
 * a half-group (one group-16 scale) an element's value, requantized code and
 * error terms depend only on its source code, and on the magnitude up to the
 * sign (rounding to nearest is symmetric). Same values, decisions and
 * per-element error terms as mm_requant_group32 on the 32 values. */
typedef struct {
  uint8_t code[2][16];      /* per half: source code -> requantized code */
  double xx[2][8], dd[2][8]; /* per half and magnitude: v^2, (v - dequant)^2 */
  double max_d;             /* max |v - dequant| over the magnitudes present */
} group_plan;

static const float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

/* Plans the group at `in` (16 code bytes) with scale bytes sc[0..1] and row
 * factor rs. Returns the UE8M0 byte, or -1 if a value is not finite. */
static int plan_group(const requant_ctx *c, const uint8_t *in, const uint8_t *sc, float rs,
                      int want_stats, group_plan *p) {
  uint8_t present[2] = {0, 0}; /* bit m: magnitude m occurs in the half */
  for (int j = 0; j < 8; j++) present[0] |= c->mags[in[j]];
  for (int j = 8; j < 16; j++) present[1] |= c->mags[in[j]];
  float va[2][8]; /* |v| per half and magnitude */
  uint32_t top[2];
  for (int h = 0; h < 2; h++) {
    const float s16 = c->scale_lut[sc[h]];
    for (int m = 0; m < 8; m++) va[h][m] = fabsf(kMag[m] * s16 * rs);
    /* |v| grows with the magnitude: the largest one present holds the
     * half's maximum, and is non-finite if any value of the half is. */
    memcpy(&top[h], &va[h][31 - __builtin_clz(present[h])], 4);
  }
  if ((top[0] & 0x7F800000u) == 0x7F800000u || (top[1] & 0x7F800000u) == 0x7F800000u) return -1;
  const uint32_t amax_bits = top[0] > top[1] ? top[0] : top[1]; /* >= 0: bits order as values */
  const uint8_t b = amax_bits ? mm_requant_exp_byte(amax_bits) : 127;
  const float inv = inv_scale(b);
  const uint64_t step_bits = (uint64_t)(b - 127 + 1023) << 52; /* 2^(b-127), exact */
  double step;
  memcpy(&step, &step_bits, 8);
  p->max_d = 0.0;
  for (int h = 0; h < 2; h++) {
    /* Requantized magnitude: mm_requant_e2m1_rne of |v| / 2^E, its
     * comparisons on the bits (non-negative floats order as integers). */
    int32_t u[8];
    for (int m = 0; m < 8; m++) {
      const float x = va[h][m] * inv;
      memcpy(&u[m], &x, 4);
    }
    int32_t qi[8]; /* 32-bit lanes throughout: the compiler keeps this loop in vectors */
    for (int m = 0; m < 8; m++)
      qi[m] = (u[m] > 0x3E800000) + (u[m] >= 0x3F400000) + (u[m] > 0x3FA00000) +
              (u[m] >= 0x3FE00000) + (u[m] > 0x40200000) + (u[m] >= 0x40600000) +
              (u[m] > 0x40A00000);
    uint8_t q[8];
    for (int m = 0; m < 8; m++) q[m] = (uint8_t)qi[m];
    if (!amax_bits) memset(q, 0, sizeof q); /* an all-zero group: codes 0, byte 127 */
    /* Codes 0..7 and 8..15 (negative): the new magnitude, and the sign of
     * the value (code sign ^ scale sign ^ row sign) unless it is zero. */
    uint64_t mags, nz;
    memcpy(&mags, q, 8);
    nz = ((mags | mags >> 1 | mags >> 2) & 0x0101010101010101ull) << 3; /* 8 per nonzero byte */
    const int flip = (signbit(c->scale_lut[sc[h]]) != 0) != (signbit(rs) != 0);
    const uint64_t pos = mags | (flip ? nz : 0), neg = mags | (flip ? 0 : nz);
    memcpy(p->code[h], &pos, 8);
    memcpy(p->code[h] + 8, &neg, 8);
    if (!want_stats) continue;
    for (int m = 0; m < 8; m++) {
      const double x = (double)va[h][m], d = x - (double)kMag[q[m]] * step;
      p->xx[h][m] = x * x;
      p->dd[h][m] = d * d;
      const double ad = (present[h] >> m & 1) ? fabs(d) : 0.0; /* branch-free: unpredictable */
      p->max_d = ad > p->max_d ? ad : p->max_d;
    }
  }
  return b;
}

/* Adds the error terms of code byte v (elements 2j, 2j+1 of half h) in
 * element order. */
static inline void add_byte(const group_plan *p, int h, uint8_t v, double *gs, double *ge) {
  *gs += p->xx[h][v & 7];
  *ge += p->dd[h][v & 7];
  *gs += p->xx[h][v >> 4 & 7];
  *ge += p->dd[h][v >> 4 & 7];
}

/* The error sums of one group (16 code bytes at in). */
static void group_sums(const group_plan *p, const uint8_t *in, double *gs, double *ge) {
  for (int j = 0; j < 16; j++) add_byte(p, j >> 3, in[j], gs, ge);
}

/* The same for 4 consecutive groups side by side: each group's sums start
 * at 0, so the 8 chains are independent (one group alone would wait on the
 * adder's latency at every element). Same order within each group. */
static void block_sums4(const group_plan *p, const uint8_t *in, double gs[4], double ge[4]) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0, e0 = 0.0, e1 = 0.0, e2 = 0.0, e3 = 0.0;
  for (int j = 0; j < 16; j++) {
    add_byte(&p[0], j >> 3, in[j], &s0, &e0);
    add_byte(&p[1], j >> 3, in[16 + j], &s1, &e1);
    add_byte(&p[2], j >> 3, in[32 + j], &s2, &e2);
    add_byte(&p[3], j >> 3, in[48 + j], &s3, &e3);
  }
  gs[0] = s0, gs[1] = s1, gs[2] = s2, gs[3] = s3;
  ge[0] = e0, ge[1] = e1, ge[2] = e2, ge[3] = e3;
}

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
    /* Blocks of 4 groups: the error sums of a group start at 0, so the four
     * groups' sums run side by side (each in element order), then add to the
     * row's in group order. */
    for (size_t g0 = 0; g0 < g32 && res.bad_group < 0; g0 += 4) {
      const int nb = g32 - g0 < 4 ? (int)(g32 - g0) : 4;
      group_plan p[4];
      for (int k = 0; k < nb; k++) {
        const size_t g = g0 + (size_t)k;
        int b = plan_group(c, in + 16 * g, sc + 2 * g, rs, c->want_stats, &p[k]);
        if (b < 0) {
          res.bad_group = (int)g;
          break;
        }
        so[g] = (uint8_t)b;
        for (int h = 0; h < 2; h++) {
          const uint8_t *t = p[k].code[h], *v = in + 16 * g + 8 * (size_t)h;
          uint8_t *o = out + 16 * g + 8 * (size_t)h;
          for (int j = 0; j < 8; j++) o[j] = (uint8_t)(t[v[j] & 15] | (t[v[j] >> 4] << 4));
        }
      }
      if (res.bad_group >= 0 || !c->want_stats) continue;
      double gs[4] = {0.0, 0.0, 0.0, 0.0}, ge[4] = {0.0, 0.0, 0.0, 0.0};
      if (nb == 4)
        block_sums4(p, in + 16 * g0, gs, ge);
      else
        for (int k = 0; k < nb; k++) group_sums(&p[k], in + 16 * (g0 + (size_t)k), &gs[k], &ge[k]);
      for (int k = 0; k < nb; k++) {
        res.src_sq += gs[k];
        res.err_sq += ge[k];
        if (p[k].max_d > res.max_abs) res.max_abs = p[k].max_d;
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
  requant_ctx ctx = {src, codes_out, scales_out, rows, stats != NULL, {0}, {0}};
  for (int b = 0; b < 256; b++) {
    ctx.scale_lut[b] = src->sf == MM_SF_E4M3 ? mm_e4m3_to_float((uint8_t)b)
                                             : mm_ue8m0_to_float((uint8_t)b);
    ctx.mags[b] = (uint8_t)((1 << (b & 7)) | (1 << ((b >> 4) & 7)));
  }
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
  const mm_g16_source s = mm_g16_rows(src, 0, src->rows);
  mm_err *err = mm_requant_g16_to_g32(&s, out.codes, out.scales, threads, stats);
  if (err) {
    mm_qmat_free(&out);
    return err;
  }
  *dst = out;
  return NULL;
}

/* test_requant.c -- group16 -> group32 requant: the CPU path against a naive
 * re-statement of ../shared/golden/README.md (double precision, brute-force
 * exponent search and nearest-value rounding), on random data of several
 * shapes and on edge cases; then against the golden files. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"
#include "harness.h"
#include "prep_golden.h"
#include "prep_lut.h"
#include "requant.h"
#include "weights_load.h"

static const double kMag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};

/* Nearest E2M1 code by enumeration; a tie goes to the even code index. */
static uint8_t naive_e2m1(double x) {
  double m = fabs(x);
  int best = 0;
  for (int i = 1; i < 8; i++) {
    double d = fabs(m - kMag[i]), db = fabs(m - kMag[best]);
    if (d < db || (d == db && i % 2 == 0)) best = i;
  }
  return (uint8_t)(best && x < 0 ? best | 8 : best);
}

static double naive_scale16(mm_scale_format sf, uint8_t b) {
  return sf == MM_SF_E4M3 ? (double)mm_e4m3_to_float(b) : ldexp(1.0, (int)b - 127);
}

/* Reference requant of one matrix; returns 0, or -1 on a non-finite value. */
static int naive_requant(const mm_g16_source *s, uint8_t *codes, uint8_t *scales, double *src_sq,
                         double *err_sq, double *max_abs) {
  int K = s->cols;
  *src_sq = *err_sq = *max_abs = 0;
  float *v = malloc(sizeof(float) * (size_t)K);
  for (int r = 0; r < s->rows; r++) {
    const uint8_t *row = s->codes + (size_t)r * (size_t)(K / 2);
    float rs = s->row_scale ? s->row_scale[r] : 1.0f;
    for (int k = 0; k < K; k++) {
      float a = (float)((double)mm_e2m1_to_float(mm_fp4_get(row, (size_t)k)) *
                        naive_scale16(s->sf, s->scales[(size_t)r * (size_t)(K / 16) + (size_t)k / 16]));
      v[k] = a * rs;
      if (!isfinite(v[k])) {
        free(v);
        return -1;
      }
    }
    for (int g = 0; g < K / 32; g++) {
      double amax = 0;
      for (int i = 0; i < 32; i++) amax = fmax(amax, fabs((double)v[32 * g + i]));
      int E = 127;
      if (amax == 0) {
        scales[(size_t)r * (size_t)(K / 32) + (size_t)g] = 127;
        E = 0;
      } else {
        for (int e = -127; e <= 127; e++)
          if (amax / ldexp(1.0, e) <= 6.0) {
            E = e;
            break;
          }
        scales[(size_t)r * (size_t)(K / 32) + (size_t)g] = (uint8_t)(E + 127);
      }
      for (int i = 0; i < 32; i++) {
        int k = 32 * g + i;
        uint8_t c = amax == 0 ? 0 : naive_e2m1((double)v[k] / ldexp(1.0, E));
        mm_fp4_set(codes + (size_t)r * (size_t)(K / 2), (size_t)k, c);
        double d = (double)mm_e2m1_to_float(c) * ldexp(1.0, E), e = (double)v[k] - d;
        *src_sq += (double)v[k] * v[k];
        *err_sq += e * e;
        *max_abs = fmax(*max_abs, fabs(e));
      }
    }
  }
  free(v);
  return 0;
}

static uint8_t rand_e4m3_scale(void) {
  for (;;) {
    uint8_t b = (uint8_t)(mm_test_rand_u64() & 0x7F);
    if (!mm_e4m3_is_nan(b)) return b;
  }
}

typedef struct {
  mm_g16_source s;
  uint8_t *codes, *scales;
  float *rs;
} rand_src;

static void make_src(rand_src *x, int rows, int cols, mm_scale_format sf, int with_rs) {
  x->codes = malloc((size_t)rows * (size_t)cols / 2 + 1);
  x->scales = malloc((size_t)rows * (size_t)cols / 16 + 1);
  x->rs = with_rs ? malloc(sizeof(float) * (size_t)rows) : NULL;
  for (size_t i = 0; i < (size_t)rows * (size_t)cols / 2; i++)
    x->codes[i] = (uint8_t)mm_test_rand_u64();
  for (size_t i = 0; i < (size_t)rows * (size_t)cols / 16; i++)
    x->scales[i] = sf == MM_SF_E4M3 ? rand_e4m3_scale()
                                    : (uint8_t)(100 + mm_test_rand_u64() % 50);
  for (int r = 0; with_rs && r < rows; r++) x->rs[r] = mm_test_uniform(1e-4f, 3.0f);
  mm_g16_source s = {rows, cols, sf, x->codes, x->scales, x->rs};
  x->s = s;
}

static void free_src(rand_src *x) {
  free(x->codes);
  free(x->scales);
  free(x->rs);
}

/* Runs the CPU requant (1 and 3 threads) and the naive one; all must agree. */
static void compare_one(const mm_g16_source *s) {
  size_t cb = (size_t)s->rows * (size_t)s->cols / 2, sb = (size_t)s->rows * (size_t)s->cols / 32;
  uint8_t *c1 = malloc(cb + 1), *s1 = malloc(sb + 1), *c3 = malloc(cb + 1), *s3 = malloc(sb + 1);
  uint8_t *cn = calloc(cb + 1, 1), *sn = calloc(sb + 1, 1);
  memset(c1, 0xAB, cb + 1);
  memset(s1, 0xAB, sb + 1);
  memset(c3, 0xCD, cb + 1);
  memset(s3, 0xCD, sb + 1);
  mm_requant_stats st1, st3;
  CHECK_OK(mm_requant_g16_to_g32(s, c1, s1, 1, &st1));
  CHECK_OK(mm_requant_g16_to_g32(s, c3, s3, 3, &st3));
  double src_sq, err_sq, max_abs;
  CHECK(naive_requant(s, cn, sn, &src_sq, &err_sq, &max_abs) == 0);
  CHECK_MSG(memcmp(c1, cn, cb) == 0, "codes differ from the naive reference [%d, %d]", s->rows,
            s->cols);
  CHECK_MSG(memcmp(s1, sn, sb) == 0, "scales differ from the naive reference [%d, %d]", s->rows,
            s->cols);
  CHECK(memcmp(c1, c3, cb) == 0 && memcmp(s1, s3, sb) == 0);
  CHECK(st1.rel_rms == st3.rel_rms && st1.max_abs == st3.max_abs); /* thread-count independent */
  CHECK(c1[cb] == 0xAB && s1[sb] == 0xAB);                          /* no write past the end */
  double rel = src_sq > 0 ? sqrt(err_sq / src_sq) : 0;
  CHECK_NEAR(st1.rel_rms, rel, 1e-9 * (1 + rel));
  CHECK(st1.max_abs == max_abs);
  CHECK_EQ_INT(st1.count, (long long)s->rows * s->cols);
  free(c1), free(s1), free(c3), free(s3), free(cn), free(sn);
}

static void test_e2m1_rne(void) {
  /* README ties, and every code's neighbourhood. */
  static const float in[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, -0.25f, -0.0f, 0.0f,
                             6.0f, -6.0f, 0.2500001f, 0.7499999f, 5.0000005f, 4.9999995f};
  static const float want[] = {0, 1, 1, 2, 2, 4, 4, 0, 0, 0, 6, -6, 0.5f, 0.5f, 6, 4};
  for (size_t i = 0; i < sizeof in / sizeof in[0]; i++) {
    uint8_t c = mm_requant_e2m1_rne(in[i]);
    CHECK_MSG(mm_e2m1_to_float(c) == want[i], "%g -> %g", (double)in[i],
              (double)mm_e2m1_to_float(c));
    if (want[i] == 0) CHECK_EQ_INT(c, 0); /* never -0 */
  }
  for (int i = 0; i < 200000; i++) {
    float x = mm_test_uniform(-6.0f, 6.0f);
    if (i % 4 == 0) x = (float)(mm_test_rand_u64() % 49) * 0.125f * (i % 8 ? 1 : -1);
    CHECK_EQ_INT(mm_requant_e2m1_rne(x), naive_e2m1(x));
    CHECK_EQ_INT(mm_requant_e2m1_rne(x), mm_float_to_e2m1(x));
  }
}

static void test_exp_byte(void) {
  for (int i = 0; i < 200000; i++) {
    float a;
    uint32_t u = (uint32_t)mm_test_rand_u64() & 0x7F7FFFFFu; /* finite, positive */
    if (i % 5 == 0) u = (uint32_t)(mm_test_rand_u64() % 0x800000u); /* subnormal */
    if (i % 7 == 0) { /* 6 * 2^k and neighbours */
      float b = ldexpf(6.0f, (int)(mm_test_rand_u64() % 250) - 127);
      memcpy(&u, &b, 4);
      u += (uint32_t)(mm_test_rand_u64() % 3) - 1;
    }
    memcpy(&a, &u, 4);
    if (!(a > 0.0f) || !isfinite(a)) continue;
    int E = 127;
    for (int e = -127; e <= 127; e++)
      if ((double)a / ldexp(1.0, e) <= 6.0) {
        E = e;
        break;
      }
    CHECK_MSG(mm_requant_exp_byte(u) == E + 127, "amax %a: byte %d, want %d", (double)a,
              mm_requant_exp_byte(u), E + 127);
  }
}

static void test_random_shapes(void) {
  static const int shapes[][2] = {{1, 32}, {1, 6144}, {3, 96}, {7, 160}, {64, 256},
                                  {33, 2048}, {5, 4128}, {128, 512}};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
    for (int sf = 1; sf <= 2; sf++) {
      rand_src x;
      make_src(&x, shapes[i][0], shapes[i][1], (mm_scale_format)sf, sf == 1 || i % 2);
      compare_one(&x.s);
      free_src(&x);
    }
}

static void test_edge_cases(void) {
  rand_src x;
  make_src(&x, 6, 128, MM_SF_E4M3, 1);
  memset(x.codes, 0, 64);                      /* row 0: all zero */
  memset(x.codes + 64, 0x88, 64);              /* row 1: all -0 */
  for (int g = 0; g < 8; g++) x.scales[16 + g] = 0x01; /* row 2: subnormal scales */
  memset(x.scales + 24, 0x7E, 8);              /* row 3: max scale 448 */
  x.rs[3] = 1e30f;                             /* large but finite */
  memset(x.codes + 4 * 64, 0x77, 64);          /* row 4: all +6 */
  x.scales[4 * 8] = 0x00;                      /* with a zero scale in one half-group */
  compare_one(&x.s);
  uint8_t c[6 * 64], s[6 * 4];
  mm_requant_stats st;
  CHECK_OK(mm_requant_g16_to_g32(&x.s, c, s, 0, &st));
  for (int i = 0; i < 64; i++) CHECK(c[i] == 0 && c[64 + i] == 0);
  for (int g = 0; g < 4; g++) CHECK(s[g] == 127 && s[4 + g] == 127);
  free_src(&x);

  /* UE8M0 extremes: bytes 0 (2^-127, subnormal values), 1, 250, 252. */
  make_src(&x, 4, 64, MM_SF_UE8M0, 0);
  static const uint8_t ex[4] = {0, 1, 250, 252}; /* 6 * 2^127 would overflow */
  for (int r = 0; r < 4; r++)
    for (int g = 0; g < 4; g++) x.scales[4 * r + g] = ex[(r + g) % 4];
  compare_one(&x.s);
  free_src(&x);
}

static void test_errors(void) {
  rand_src x;
  make_src(&x, 4, 64, MM_SF_E4M3, 1);
  uint8_t c[4 * 32], s[4 * 2];
  x.scales[2 * 4 + 3] = 0x7F; /* row 2, group16 3 -> elements 32..63 */
  mm_err *e = mm_requant_g16_to_g32(&x.s, c, s, 2, NULL);
  CHECK(e && strstr(e->message, "row 2") && strstr(e->message, "32..63"));
  if (e) printf("# %s\n", e->message);
  mm_error_free(e);
  x.scales[2 * 4 + 3] = 0xFF;
  CHECK_ERR(mm_requant_g16_to_g32(&x.s, c, s, 2, NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  x.scales[2 * 4 + 3] = 0x30;
  x.rs[1] = INFINITY;
  CHECK_ERR(mm_requant_g16_to_g32(&x.s, c, s, 2, NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  x.rs[1] = 3e38f; /* finite global, product overflows */
  memset(x.codes + 32, 0x77, 32);
  x.scales[4] = 0x7E;
  CHECK_ERR(mm_requant_g16_to_g32(&x.s, c, s, 2, NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  x.rs[1] = 1.0f;
  x.s.cols = 48; /* not whole groups of 32 */
  CHECK_ERR(mm_requant_g16_to_g32(&x.s, c, s, 2, NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  free_src(&x);
}

static void test_qmat(void) {
  mm_qmat q, d;
  CHECK(mm_qmat_alloc(&q, 9, 96, 16, MM_SF_E4M3) == 0);
  for (size_t i = 0; i < 9 * 48; i++) q.codes[i] = (uint8_t)mm_test_rand_u64();
  for (size_t i = 0; i < 9 * 6; i++) q.scales[i] = rand_e4m3_scale();
  for (int r = 0; r < 9; r++) q.row_scale[r] = mm_test_uniform(0.01f, 2.0f);
  mm_requant_stats st;
  CHECK_OK(mm_requant_qmat(&q, 0, &d, &st));
  CHECK(d.gran == 32 && d.sf == MM_SF_UE8M0 && d.rows == 9 && d.cols == 96);
  for (int r = 0; r < 9; r++) CHECK(d.row_scale[r] == 1.0f);
  /* Dequantized result is close to the source value (requant error bound:
   * half a code step of the group's 2^E * 6 range). */
  for (int r = 0; r < 9; r++)
    for (int k = 0; k < 96; k++) {
      double src = (double)(mm_qmat_weight(&q, r, k) * q.row_scale[r]);
      double got = mm_qmat_weight(&d, r, k);
      double step = mm_qmat_group_scale(&d, r, k / 32);
      CHECK(fabs(src - got) <= step + 1e-30);
    }
  mm_qmat_free(&d);
  q.gran = 32;
  CHECK_ERR(mm_requant_qmat(&q, 0, &d, NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK(d.codes == NULL);
  mm_qmat_free(&q);
}

/* The GPU kernel's lookup-table formulation (kernels/prep_lut.h), run here on
 * the CPU: same bytes as the reference on random data with negative scales
 * and row factors, subnormal and extreme scales, zeros; stats close. */
static void lut_compare(const mm_g16_source *s) {
  size_t cb = (size_t)s->rows * (size_t)s->cols / 2, sb = (size_t)s->rows * (size_t)s->cols / 32;
  uint8_t *rc = malloc(cb), *rsb = malloc(sb), *lc = malloc(cb), *ls = malloc(sb);
  mm_requant_stats ref;
  mm_err *e = mm_requant_g16_to_g32(s, rc, rsb, 1, &ref);
  int ref_bad = e != NULL, lut_bad = 0;
  mm_error_free(e);
  double xs = 0, es = 0, em = 0, res = 0;
  for (int r = 0; r < s->rows && !lut_bad; r++) {
    float rs = s->row_scale ? s->row_scale[r] : 1.0f;
    for (int g = 0; g < s->cols / 32 && !lut_bad; g++) {
      const uint8_t *in = s->codes + (size_t)r * (size_t)(s->cols / 2) + 16 * (size_t)g;
      const uint8_t *sc = s->scales + (size_t)r * (size_t)(s->cols / 16) + 2 * (size_t)g;
      uint32_t w[4], out[4];
      memcpy(w, in, 16); /* little-endian: element 8k+i in nibble i of word k */
      float st[3] = {0, 0, 0};
      int bad;
      uint32_t b = mm_lut_requant_group(w, (uint32_t)sc[0] | ((uint32_t)sc[1] << 8),
                                        s->sf == MM_SF_E4M3, rs, out, 1, st, &bad);
      if (bad) {
        lut_bad = 1;
        break;
      }
      memcpy(lc + (size_t)r * (size_t)(s->cols / 2) + 16 * (size_t)g, out, 16);
      ls[(size_t)r * (size_t)(s->cols / 32) + (size_t)g] = (uint8_t)b;
      int E = (int)b - 127;
      xs += ldexp((double)st[0], 2 * E);
      es += ldexp((double)st[1], 2 * E);
      em = fmax(em, ldexp((double)st[2], E));
      /* Stats in units of 2^E are FP32: errors below its smallest
       * subnormal there (2^(E-149)) are lost or rounded. */
      res = fmax(res, ldexp(1.0, E - 148));
    }
  }
  CHECK_EQ_INT(lut_bad, ref_bad);
  if (!ref_bad && !lut_bad) {
    CHECK_MSG(memcmp(lc, rc, cb) == 0, "LUT codes differ [%d, %d] sf %d", s->rows, s->cols, (int)s->sf);
    CHECK_MSG(memcmp(ls, rsb, sb) == 0, "LUT scales differ [%d, %d]", s->rows, s->cols);
    double rel = xs > 0 ? sqrt(es / xs) : 0;
    /* Errors of subnormal-range values are lost in the GPU's 2^E units. */
    CHECK_NEAR(rel, ref.rel_rms, 1e-5 * ref.rel_rms + 1e-12);
    CHECK_NEAR(em, ref.max_abs, 1e-6 * ref.max_abs + res);
  }
  free(rc), free(rsb), free(lc), free(ls);
}

static void test_lut_formulation(void) {
  static const int shapes[][2] = {{1, 32}, {3, 96}, {7, 160}, {33, 2048}, {16, 6144}};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
    for (int sf = 1; sf <= 2; sf++) {
      rand_src x;
      make_src(&x, shapes[i][0], shapes[i][1], (mm_scale_format)sf, 1);
      int n16 = shapes[i][0] * shapes[i][1] / 16;
      for (int k = 0; k < n16; k++) {
        uint64_t u = mm_test_rand_u64();
        if (sf == 1) x.scales[k] = (uint8_t)(rand_e4m3_scale() | (u % 4 == 0 ? 0x80 : 0)); /* signs */
        else x.scales[k] = (uint8_t)(u % 7 == 0 ? u % 3 : u % 5 == 0 ? 250 - u % 3 : 90 + u % 60);
        if (u % 13 == 0) memset(x.codes + 8 * (size_t)k, (int)(u >> 8) & 0x88, 8); /* zeros, -0 */
      }
      for (int r = 0; r < shapes[i][0]; r++) {
        uint64_t u = mm_test_rand_u64();
        x.rs[r] = (u % 3 == 0 ? -1.0f : 1.0f) * (sf == 2 ? ldexpf(1.0f, (int)(u % 5) - 2)
                                                          : mm_test_uniform(1e-6f, 8.0f));
        if (u % 11 == 0) x.rs[r] = 1e-38f; /* subnormal products */
      }
      lut_compare(&x.s);
      x.scales[0] = sf == 1 ? 0xFF : 0xFF; /* NaN: both must refuse */
      lut_compare(&x.s);
      free_src(&x);
    }
}

/* ---- golden files ---------------------------------------------------------- */

static int same_float_bits(float a, float b) {
  uint32_t x, y;
  memcpy(&x, &a, 4);
  memcpy(&y, &b, 4);
  return x == y || (isnan(a) && isnan(b));
}

static void test_golden_codecs(void) {
  mm_st_file *f = golden_open("codecs.safetensors");
  CHECK(f != NULL);
  if (!f) return;
  const mm_st_tensor *t = NULL;
  uint8_t *c = golden_read(f, "e2m1.code", &t);
  float *v = golden_read(f, "e2m1.value", NULL);
  CHECK(c && v);
  for (uint64_t i = 0; c && v && i < t->nelems; i++)
    CHECK_MSG(same_float_bits(mm_e2m1_to_float(c[i]), v[i]), "e2m1 code %u", c[i]);
  free(c), free(v);
  c = golden_read(f, "e4m3.code", &t);
  v = golden_read(f, "e4m3.value", NULL);
  CHECK(c && v && t->nelems == 256);
  for (uint64_t i = 0; c && v && i < t->nelems; i++)
    CHECK_MSG(same_float_bits(mm_e4m3_to_float(c[i]), v[i]), "e4m3 byte 0x%02x", c[i]);
  free(c), free(v);
  float *in = golden_read(f, "e2m1_rne.input", &t);
  c = golden_read(f, "e2m1_rne.code", NULL);
  CHECK(in && c);
  int bad = 0;
  for (uint64_t i = 0; in && c && i < t->nelems; i++) {
    float x = in[i] > 6.0f ? 6.0f : in[i] < -6.0f ? -6.0f : in[i]; /* README: clipped first */
    if (mm_requant_e2m1_rne(x) != c[i] && bad++ < 5)
      printf("# e2m1_rne(%a) = %u, golden %u\n", (double)in[i], mm_requant_e2m1_rne(x), c[i]);
  }
  CHECK_EQ_INT(bad, 0);
  printf("# codecs: %llu rne inputs\n", (unsigned long long)(t ? t->nelems : 0));
  free(in), free(c);
  mm_st_close(f);
}

/* Every requant golden file: the loader's format detection, the source
 * values (src.dequant), the requantized bytes (dst.*), the dequantized result
 * (dst.dequant) and the recorded relative RMS error. */
static void test_golden_requant(void) {
  for (size_t fi = 0; fi < sizeof kGoldenRequantFiles / sizeof kGoldenRequantFiles[0]; fi++) {
    mm_st_file *f = golden_open(kGoldenRequantFiles[fi]);
    CHECK(f != NULL);
    if (!f) continue;
    const mm_st_tensor *tw = NULL, *ts = NULL, *tg = NULL, *tdw = NULL, *tds = NULL;
    uint8_t *w = golden_read(f, "src.weight", &tw), *sc = golden_read(f, "src.weight_scale", &ts);
    float *g = mm_st_find(f, "src.weight_scale_2") ? golden_read(f, "src.weight_scale_2", &tg) : NULL;
    float *sdq = golden_read(f, "src.dequant", NULL), *ddq = golden_read(f, "dst.dequant", NULL);
    uint8_t *dw = golden_read(f, "dst.weight", &tdw), *ds = golden_read(f, "dst.weight_scale", &tds);
    CHECK(w && sc && sdq && ddq && dw && ds);
    if (!(w && sc && sdq && ddq && dw && ds)) goto next;
    mm_tensor_view vw = golden_view("src.weight", tw, w), vs = golden_view("src.weight_scale", ts, sc);
    mm_tensor_view vg;
    if (g) vg = golden_view("src.weight_scale_2", tg, g);
    mm_proj_views pv = {&vw, &vs, g ? &vg : NULL, NULL};
    mm_qmat q, d;
    CHECK_OK(mm_weights_decode_proj("src", &pv, 0, 0, 0, 0, &q, NULL));
    if (!q.codes) goto next;
    int N = q.rows, K = q.cols;
    CHECK(q.gran == 16 && q.sf == (ts->dtype == MM_ST_F8_E4M3 ? MM_SF_E4M3 : MM_SF_UE8M0));
    int bad = 0;
    for (int r = 0; r < N; r++)
      for (int k = 0; k < K; k++) {
        float v = mm_qmat_weight(&q, r, k) * q.row_scale[r];
        bad += !same_float_bits(v, sdq[(size_t)r * (size_t)K + (size_t)k]);
      }
    CHECK_MSG(bad == 0, "%s: %d source values differ from src.dequant", kGoldenRequantFiles[fi], bad);
    mm_requant_stats st;
    CHECK_OK(mm_requant_qmat(&q, 0, &d, &st));
    if (d.codes) {
      CHECK(tdw->nbytes == (uint64_t)N * (uint64_t)K / 2 && tds->nbytes == (uint64_t)N * (uint64_t)K / 32);
      CHECK_MSG(memcmp(d.codes, dw, (size_t)N * (size_t)K / 2) == 0, "%s: dst.weight differs",
                kGoldenRequantFiles[fi]);
      CHECK_MSG(memcmp(d.scales, ds, (size_t)N * (size_t)K / 32) == 0, "%s: dst.weight_scale differs",
                kGoldenRequantFiles[fi]);
      bad = 0;
      for (int r = 0; r < N; r++)
        for (int k = 0; k < K; k++)
          bad += !same_float_bits(mm_qmat_weight(&d, r, k), ddq[(size_t)r * (size_t)K + (size_t)k]);
      CHECK_MSG(bad == 0, "%s: %d values differ from dst.dequant", kGoldenRequantFiles[fi], bad);
      const char *m = mm_st_metadata(f, "rel_rms_error");
      if (m) CHECK_NEAR(st.rel_rms, strtod(m, NULL), 1e-6 * strtod(m, NULL));
      printf("# %s [%d, %d]: rel RMS %.6f (metadata %s), max abs %.4g\n", kGoldenRequantFiles[fi],
             N, K, st.rel_rms, m ? m : "-", st.max_abs);
    }
    mm_qmat_free(&d);
    mm_qmat_free(&q);
  next:
    free(w), free(sc), free(g), free(sdq), free(ddq), free(dw), free(ds);
    mm_st_close(f);
  }
}

int main(void) {
  mm_test_seed();
  RUN(test_e2m1_rne);
  RUN(test_exp_byte);
  RUN(test_random_shapes);
  RUN(test_edge_cases);
  RUN(test_errors);
  RUN(test_qmat);
  RUN(test_lut_formulation);
  RUN_GOLDEN(test_golden_codecs);
  RUN_GOLDEN(test_golden_requant);
  return mm_test_done();
}

/* test_formats.c -- the scalar codecs against independent definitions. */
#include <math.h>

#include "formats.h"
#include "harness.h"

/* E4M3FN by the definition, in double. */
static double e4m3_def(int b) {
  int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
  return s ? -v : v;
}

static void test_e4m3_decode_all_bytes(void) {
  for (int b = 0; b < 256; b++) {
    double want = e4m3_def(b);
    float got = mm_e4m3_to_float((uint8_t)b);
    if (isnan(want)) CHECK_MSG(isnan(got), "byte %02x", b);
    else CHECK_MSG(got == (float)want, "byte %02x: %g vs %g", b, got, want);
  }
  CHECK(mm_e4m3_to_float(0x7E) == 448.0f);
  CHECK(mm_e4m3_to_float(0x01) == ldexpf(1.0f, -9));
}

/* Round trip of every finite byte, and RNE against a brute-force nearest. */
static void test_e4m3_encode(void) {
  for (int b = 0; b < 256; b++) {
    if ((b & 0x7F) == 0x7F) continue;
    float v = mm_e4m3_to_float((uint8_t)b);
    uint8_t r = mm_float_to_e4m3(v);
    if (v == 0.0f) CHECK((r & 0x7F) == 0);
    else CHECK_MSG(r == b, "byte %02x -> %02x", b, r);
  }
  mm_test_seed();
  for (int i = 0; i < 200000; i++) {
    float x = ldexpf(mm_test_uniform(-1.0f, 1.0f), (int)(mm_test_rand_u64() % 24) - 14);
    uint8_t r = mm_float_to_e4m3(x);
    /* brute force: nearest finite, ties to even mantissa */
    double best = INFINITY;
    int best_b = -1;
    for (int b = 0; b < 128; b++) {
      if (b == 0x7F) continue;
      double d = fabs(fabs((double)x) - e4m3_def(b));
      if (d < best || (d == best && (b & 1) == 0)) { best = d; best_b = b; }
    }
    if (fabs(x) >= 448) best_b = 0x7E;
    int want = best_b | (x < 0 && best_b ? 0x80 : 0);
    int got = r;
    if ((want & 0x7F) == 0) { want &= 0x7F; got &= 0x7F; }
    CHECK_MSG(got == want, "x=%a -> %02x, want %02x", x, r, want);
    if (got != want) break;
  }
  CHECK(mm_float_to_e4m3(1e9f) == 0x7E);
  CHECK(mm_float_to_e4m3(-1e9f) == 0xFE);
  CHECK(mm_float_to_e4m3(460.0f) == 0x7E);
  CHECK(mm_float_to_e4m3(NAN) == 0x7F);
  CHECK(mm_float_to_e4m3(ldexpf(1.0f, -10)) == 0x00);      /* tie -> even (0) */
  CHECK(mm_float_to_e4m3(ldexpf(1.5f, -9)) == 0x02);       /* tie -> even (2) */
}

static void test_e2m1(void) {
  static const float mags[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; c++) {
    float v = mm_e2m1_to_float((uint8_t)c);
    CHECK(fabsf(v) == mags[c & 7]);
    CHECK((c & 8) ? signbit(v) : !signbit(v));
    uint8_t back = mm_float_to_e2m1(v);
    CHECK_EQ_INT(back, c == 8 ? 0 : c); /* -0 never produced */
  }
  /* ties to even, from the golden README */
  CHECK_EQ_INT(mm_float_to_e2m1(0.25f), 0);
  CHECK_EQ_INT(mm_float_to_e2m1(0.75f), 2);
  CHECK_EQ_INT(mm_float_to_e2m1(1.25f), 2);
  CHECK_EQ_INT(mm_float_to_e2m1(1.75f), 4);
  CHECK_EQ_INT(mm_float_to_e2m1(2.5f), 4);
  CHECK_EQ_INT(mm_float_to_e2m1(3.5f), 6);
  CHECK_EQ_INT(mm_float_to_e2m1(5.0f), 6);
  CHECK_EQ_INT(mm_float_to_e2m1(-0.1f), 0);
  CHECK_EQ_INT(mm_float_to_e2m1(-5.5f), 15);
  CHECK_EQ_INT(mm_float_to_e2m1(100.0f), 7);
  uint8_t row[4] = {0};
  mm_fp4_set(row, 0, 3);
  mm_fp4_set(row, 1, 12);
  mm_fp4_set(row, 7, 9);
  CHECK_EQ_INT(row[0], 0xC3);
  CHECK_EQ_INT(row[3], 0x90);
  CHECK_EQ_INT(mm_fp4_get(row, 1), 12);
}

static void test_bf16_and_ue8m0(void) {
  CHECK(mm_float_to_bf16(1.0f) == 0x3F80);
  CHECK(mm_round_bf16(1.0f + ldexpf(1.0f, -8)) == 1.0f);                /* tie -> even */
  CHECK(mm_round_bf16(1.0f + 3 * ldexpf(1.0f, -8)) == 1.0f + ldexpf(1.0f, -6));
  CHECK(isnan(mm_bf16_to_float(mm_float_to_bf16(NAN))));
  CHECK(mm_ue8m0_to_float(127) == 1.0f);
  CHECK(mm_ue8m0_to_float(0) == ldexpf(1.0f, -127));
  CHECK(mm_ue8m0_to_float(254) == ldexpf(1.0f, 127));
  CHECK(isnan(mm_ue8m0_to_float(255)));
}

static void test_act_quant(void) {
  float x[128];
  uint8_t q[128];
  float s;
  for (int i = 0; i < 128; i++) x[i] = mm_test_normal();
  x[17] = -9.0f;
  mm_quant_fp8_block(x, 128, q, &s);
  CHECK(s == 9.0f / 448.0f);
  CHECK(q[17] == 0xFE); /* -448 */
  for (int i = 0; i < 128; i++)
    CHECK(fabsf(mm_e4m3_to_float(q[i]) * s - x[i]) <= fabsf(x[i]) * 0.0625f + s * 0.01f);
  /* all-zero block: amax clamps, no NaN */
  memset(x, 0, sizeof x);
  mm_quant_fp8_block(x, 128, q, &s);
  CHECK(s == 1e-4f / 448.0f);
  for (int i = 0; i < 128; i++) CHECK(q[i] == 0);
}

int main(void) {
  RUN(test_e4m3_decode_all_bytes);
  RUN(test_e4m3_encode);
  RUN(test_e2m1);
  RUN(test_bf16_and_ue8m0);
  RUN(test_act_quant);
  return mm_test_done();
}

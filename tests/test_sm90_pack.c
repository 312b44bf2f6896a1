/* test_sm90_pack.c -- the fast sm90 packing (layout_sm90_pack.c) against the
 * reference mm_sm90_pack_matrix: byte-identical records (outputs poisoned
 * differently first), row factors, bit-identical fold sums and identical
 * error messages, on random matrices of every mode (mode 4: mode 1's records
 * bit for bit) with edge cases (all-zero
 * groups and rows, negative and subnormal E4M3 scales, extreme and
 * unfoldable UE8M0 exponents, NaN scales), several shapes and thread counts;
 * and the whole-layer form against the reference loop of
 * mm_sm90_layer_create, including which expert an error names. */
#include <math.h>
#include <string.h>

#include "formats.h"
#include "harness.h"
#include "layout_sm90.h"
#include "sm90_test_scales.h"
#include "layout_sm90_pack.h"
#include "sm90_pack_data.h"

static int same_bits(double a, double b) { return memcmp(&a, &b, sizeof a) == 0; }

/* Reference and fast packing of m; everything must agree. Returns 1 if both
 * failed (with the same message). */
static int compare_pack(const mm_qmat *m, mm_weight_mode mode, int gate_up, int threads) {
  size_t bytes = mm_sm90_matrix_bytes(mode, m->rows, m->cols);
  uint8_t *a = malloc(bytes + 1), *b = malloc(bytes + 1);
  float *ra = malloc(sizeof(float) * (size_t)m->rows), *rb = malloc(sizeof(float) * (size_t)m->rows);
  memset(a, 0x5A, bytes + 1);
  memset(b, 0xA5, bytes + 1);
  memset(ra, 0x11, sizeof(float) * (size_t)m->rows);
  memset(rb, 0x22, sizeof(float) * (size_t)m->rows);
  double fa[2] = {-1, -1}, fb[2] = {-2, -2};
  mm_err *ea = mm_sm90_pack_matrix(m, mode, gate_up, a, ra, fa);
  mm_err *eb = mm_sm90_pack_matrix_fast(m, mode, gate_up, b, rb, fb, threads);
  int both_failed = ea && eb;
  CHECK_MSG(!ea == !eb, "mode %d [%d, %d]: reference %s, fast %s", (int)mode, m->rows, m->cols,
            ea ? ea->message : "ok", eb ? eb->message : "ok");
  if (ea && eb) {
    CHECK_EQ_INT(ea->code, eb->code);
    CHECK_MSG(strcmp(ea->message, eb->message) == 0, "messages differ:\n#  %s\n#  %s",
              ea->message, eb->message);
  } else if (!ea && !eb) {
    CHECK_MSG(memcmp(a, b, bytes) == 0, "mode %d [%d, %d] gate_up %d: records differ", (int)mode,
              m->rows, m->cols, gate_up);
    CHECK(a[bytes] == 0x5A && b[bytes] == 0xA5);
    CHECK(memcmp(ra, rb, sizeof(float) * (size_t)m->rows) == 0);
    CHECK_MSG(same_bits(fa[0], fb[0]) && same_bits(fa[1], fb[1]),
              "fold sums %.17g %.17g vs %.17g %.17g", fa[0], fa[1], fb[0], fb[1]);
  }
  mm_error_free(ea);
  mm_error_free(eb);
  free(a), free(b), free(ra), free(rb);
  return both_failed;
}

/* Mode 4 packs mode 1's records, bit for bit (fast packer; the reference
 * against itself is in test_layout_sm90). */
static void same_as_mode1(const mm_qmat *m, int gate_up) {
  const size_t bytes = mm_sm90_matrix_bytes(MM_WMODE_G32_FP8, m->rows, m->cols);
  CHECK(mm_sm90_matrix_bytes(MM_WMODE_G32_F16_EXACT, m->rows, m->cols) == bytes);
  uint8_t *a = malloc(bytes), *b = malloc(bytes);
  float *ra = malloc(sizeof(float) * (size_t)m->rows), *rb = malloc(sizeof(float) * (size_t)m->rows);
  memset(a, 0x5A, bytes);
  memset(b, 0xA5, bytes);
  mm_err *ea = mm_sm90_pack_matrix_fast(m, MM_WMODE_G32_FP8, gate_up, a, ra, NULL, 2);
  mm_err *eb = mm_sm90_pack_matrix_fast(m, MM_WMODE_G32_F16_EXACT, gate_up, b, rb, NULL, 2);
  CHECK(!ea == !eb);
  if (ea && eb) {
    CHECK(strcmp(ea->message, eb->message) == 0);
  } else if (!ea && !eb) {
    CHECK(memcmp(a, b, bytes) == 0);
    CHECK(memcmp(ra, rb, sizeof(float) * (size_t)m->rows) == 0);
  }
  mm_error_free(ea);
  mm_error_free(eb);
  free(a), free(b), free(ra), free(rb);
}

static const int kShapes[][2] = {{64, 128}, {128, 256}, {192, 384}, {256, 640}, {384, 1024}};
#define NSHAPES (int)(sizeof kShapes / sizeof kShapes[0])

static void test_mode1_random(void) {
  int refused = 0;
  for (int s = 0; s < NSHAPES; s++)
    for (int gate_up = 0; gate_up < 2; gate_up++) {
      if (gate_up && kShapes[s][0] % 128) continue;
      mm_qmat m;
      CHECK(mm_qmat_alloc(&m, kShapes[s][0], kShapes[s][1], 32, MM_SF_UE8M0) == 0);
      rand_g32(&m, 14);
      compare_pack(&m, MM_WMODE_G32_FP8, gate_up, 1 + s % 3);
      compare_pack(&m, MM_WMODE_G32_F16_EXACT, gate_up, 1 + (s + 1) % 3);
      same_as_mode1(&m, gate_up);
      /* wider spreads: some blocks fold thanks to small codes, some are refused */
      rand_g32(&m, 16 + s);
      refused += compare_pack(&m, MM_WMODE_G32_FP8, gate_up, 2);
      mm_qmat_free(&m);
    }
  printf("# mode 1: %d of the wide-spread matrices refused by both\n", refused);
  CHECK(refused > 0);
}

static void test_mode1_extremes(void) {
  mm_qmat m;
  CHECK(mm_qmat_alloc(&m, 64, 256, 32, MM_SF_UE8M0) == 0);
  rand_codes(&m);
  mm_test_g32_extreme_scales(&m);
  compare_pack(&m, MM_WMODE_G32_FP8, 0, 2);
  /* all-zero matrix: every group's exponent is ignored */
  memset(m.codes, 0, 64 * 128);
  compare_pack(&m, MM_WMODE_G32_FP8, 0, 1);
  mm_qmat_free(&m);
}

static void test_mode23_random(void) {
  for (int s = 0; s < NSHAPES; s++)
    for (int gate_up = 0; gate_up < 2; gate_up++)
      for (int all_bytes = 0; all_bytes < 2; all_bytes++) {
        if (gate_up && kShapes[s][0] % 128) continue;
        mm_qmat m;
        CHECK(mm_qmat_alloc(&m, kShapes[s][0], kShapes[s][1], 16, MM_SF_E4M3) == 0);
        rand_g16(&m, all_bytes);
        CHECK(!compare_pack(&m, MM_WMODE_G16_BF16_EXACT, gate_up, 1 + s % 3));
        CHECK(!compare_pack(&m, MM_WMODE_G16_FP8, gate_up, 1 + (s + 1) % 3));
        mm_qmat_free(&m);
      }
}

/* Every E4M3 byte as a scale, in every group position (mode 3's tables). */
static void test_mode3_every_scale(void) {
  mm_qmat m;
  CHECK(mm_qmat_alloc(&m, 64, 512, 16, MM_SF_E4M3) == 0);
  rand_codes(&m);
  for (int i = 0; i < 64 * 32; i++) {
    uint8_t b = (uint8_t)(i % 256);
    m.scales[i] = mm_e4m3_is_nan(b) ? 0x01 : b;
  }
  CHECK(!compare_pack(&m, MM_WMODE_G16_FP8, 0, 2));
  CHECK(!compare_pack(&m, MM_WMODE_G16_BF16_EXACT, 0, 2));
  mm_qmat_free(&m);
}

static void test_errors(void) {
  mm_qmat m;
  CHECK(mm_qmat_alloc(&m, 256, 384, 16, MM_SF_E4M3) == 0);
  for (int k = 0; k < 6; k++) {
    rand_g16(&m, 1);
    size_t n = (size_t)m.rows * (size_t)(m.cols / 16);
    for (int j = 0; j < 1 + k; j++) m.scales[mm_test_rand_u64() % n] = j % 2 ? 0x7F : 0xFF;
    CHECK(compare_pack(&m, MM_WMODE_G16_BF16_EXACT, k % 2, 1 + k % 3));
    CHECK(compare_pack(&m, MM_WMODE_G16_FP8, k % 2, 1 + k % 3));
  }
  CHECK(compare_pack(&m, MM_WMODE_G32_FP8, 0, 1)); /* wrong format for the mode */
  m.rows = 192;
  CHECK(compare_pack(&m, MM_WMODE_G16_FP8, 1, 1)); /* w13 rows not a multiple of 128 */
  CHECK(compare_pack(&m, (mm_weight_mode)5, 0, 1));
  m.rows = 256;
  CHECK(compare_pack(&m, MM_WMODE_G32_F16_EXACT, 0, 1)); /* gran 16 for a gran-32 mode */
  m.rows = 256;
  m.cols = 320;
  CHECK(compare_pack(&m, MM_WMODE_G16_FP8, 0, 1)); /* cols % 128 */
  m.cols = 384;
  mm_qmat_free(&m);
  CHECK(mm_qmat_alloc(&m, 128, 256, 32, MM_SF_UE8M0) == 0);
  rand_g32(&m, 10);
  m.scales[mm_test_rand_u64() % (128 * 8)] = 0xFF;
  CHECK(compare_pack(&m, MM_WMODE_G32_FP8, 1, 2));
  CHECK(compare_pack(&m, MM_WMODE_G16_BF16_EXACT, 0, 2));
  mm_qmat_free(&m);
}

/* The whole-layer form against the per-matrix reference loop of
 * mm_sm90_layer_create (fold sums added in the same order). */
static void layer_compare(mm_expert_q *x, int E, mm_weight_mode mode, int threads) {
  const int H = x[0].w13.cols, I = x[0].w2.cols;
  const size_t b13 = mm_sm90_matrix_bytes(mode, 2 * I, H), b2 = mm_sm90_matrix_bytes(mode, H, I);
  const size_t bytes = (size_t)E * (b13 + b2), nrs = (size_t)E * (size_t)(2 * I + H);
  uint8_t *a = malloc(bytes), *b = malloc(bytes);
  float *ra = malloc(sizeof(float) * nrs), *rb = malloc(sizeof(float) * nrs);
  memset(a, 0x5A, bytes);
  memset(b, 0xA5, bytes);
  memset(ra, 0x11, sizeof(float) * nrs);
  memset(rb, 0x22, sizeof(float) * nrs);
  double e2 = 0.0, r2 = 0.0, fb[2] = {0.0, 0.0};
  mm_err *ea = NULL;
  for (int e = 0; e < E && !ea; e++) {
    double fe[2];
    ea = mm_sm90_pack_matrix(&x[e].w13, mode, 1, a + (size_t)e * (b13 + b2),
                             ra + (size_t)e * (size_t)(2 * I), fe);
    if (ea) {
      ea = mm_error_wrap(ea, "local expert %d w13 (gate/up)", 5 + e);
      break;
    }
    e2 += fe[0];
    r2 += fe[1];
    ea = mm_sm90_pack_matrix(&x[e].w2, mode, 0, a + (size_t)e * (b13 + b2) + b13,
                             ra + (size_t)E * (size_t)(2 * I) + (size_t)e * (size_t)H, fe);
    if (ea) {
      ea = mm_error_wrap(ea, "local expert %d w2 (down)", 5 + e);
      break;
    }
    e2 += fe[0];
    r2 += fe[1];
  }
  /* in two chunks, as the double-buffered upload calls it */
  int c1 = E / 2;
  mm_err *eb = mm_sm90_pack_experts(x, c1, 5, mode, threads, b, rb, rb + (size_t)E * (size_t)(2 * I), fb);
  if (!eb)
    eb = mm_sm90_pack_experts(x + c1, E - c1, 5 + c1, mode, threads, b + (size_t)c1 * (b13 + b2),
                              rb + (size_t)c1 * (size_t)(2 * I),
                              rb + (size_t)E * (size_t)(2 * I) + (size_t)c1 * (size_t)H, fb);
  CHECK_MSG(!ea == !eb, "layer mode %d: reference %s, fast %s", (int)mode, ea ? ea->message : "ok",
            eb ? eb->message : "ok");
  if (ea && eb) {
    CHECK_MSG(strcmp(ea->message, eb->message) == 0, "messages differ:\n#  %s\n#  %s", ea->message,
              eb->message);
    printf("# layer error (both): %s\n", eb->message);
  } else if (!ea && !eb) {
    CHECK_MSG(memcmp(a, b, bytes) == 0, "layer mode %d: records differ", (int)mode);
    CHECK(memcmp(ra, rb, sizeof(float) * nrs) == 0);
    CHECK(same_bits(e2, fb[0]) && same_bits(r2, fb[1]));
  }
  mm_error_free(ea);
  mm_error_free(eb);
  free(a), free(b), free(ra), free(rb);
}

static void test_layer(void) {
  const int E = 5, H = 256, I = 128;
  mm_expert_q x[5];
  for (int g = 0; g < 2; g++) {
    for (int e = 0; e < E; e++) {
      CHECK(mm_qmat_alloc(&x[e].w13, 2 * I, H, g ? 32 : 16, g ? MM_SF_UE8M0 : MM_SF_E4M3) == 0);
      CHECK(mm_qmat_alloc(&x[e].w2, H, I, g ? 32 : 16, g ? MM_SF_UE8M0 : MM_SF_E4M3) == 0);
      if (g) {
        rand_g32(&x[e].w13, 14);
        rand_g32(&x[e].w2, 14);
      } else {
        rand_g16(&x[e].w13, e % 2);
        rand_g16(&x[e].w2, e % 2);
      }
    }
    if (g) {
      layer_compare(x, E, MM_WMODE_G32_FP8, 3);
      layer_compare(x, E, MM_WMODE_G32_F16_EXACT, 2);
      x[3].w2.scales[77] = 0xFF; /* the first failing matrix is named ... */
      layer_compare(x, E, MM_WMODE_G32_FP8, 2);
      x[4].w13.scales[5] = 0xFF; /* ... not a later one */
      layer_compare(x, E, MM_WMODE_G32_FP8, 2);
      x[1].w13.scales[900] = 0xFF;
      layer_compare(x, E, MM_WMODE_G32_FP8, 1);
    } else {
      layer_compare(x, E, MM_WMODE_G16_BF16_EXACT, 2);
      layer_compare(x, E, MM_WMODE_G16_FP8, 3);
      x[2].w2.gran = 32; /* refused by the argument check, after expert 2's w13 */
      layer_compare(x, E, MM_WMODE_G16_FP8, 2);
      x[0].w2.scales[3] = 0x7F;
      layer_compare(x, E, MM_WMODE_G16_FP8, 2);
      x[2].w2.gran = 16;
    }
    for (int e = 0; e < E; e++) {
      mm_qmat_free(&x[e].w13);
      mm_qmat_free(&x[e].w2);
    }
  }
}

int main(void) {
  mm_test_seed();
  RUN(test_mode1_random);
  RUN(test_mode1_extremes);
  RUN(test_mode23_random);
  RUN(test_mode3_every_scale);
  RUN(test_errors);
  RUN(test_layer);
  return mm_test_done();
}

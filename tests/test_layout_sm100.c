/* test_layout_sm100.c -- DeepGEMM sm100 MegaMoE export against a second,
 * independent implementation of DeepGEMM's formulas written here step by
 * step on logical tensors (FP32 -> packed UE8M0 MN-major TMA-aligned words,
 * then the gate/up interleave as reshape+stack, then the UTCCP transpose as
 * reshape+transpose), on random shapes; round trip; error cases. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "layout_sm100.h"
#include "prep_golden.h"

/* ---- the second implementation -------------------------------------------
 * A logical int32 tensor [G, MN, P] of packed words (dense, row-major here);
 * storage with strides (P*MNa, 1, MNa) is written only at the end. */
typedef struct {
  int G, MN, P;
  uint32_t *w;
} words3;

static uint32_t *at(words3 *t, int g, int mn, int p) {
  return &t->w[((size_t)g * (size_t)t->MN + (size_t)mn) * (size_t)t->P + (size_t)p];
}

/* transpose_and_pack_fp32_into_ue8m0: values >> 23, >> 15, >> 7, << 1. */
static words3 pack_fp32(const float *sf, int G, int MN, int SFK) {
  words3 t = {G, MN, (SFK + 3) / 4, NULL};
  t.w = calloc((size_t)G * (size_t)MN * (size_t)t.P, 4);
  for (int g = 0; g < G; g++)
    for (int mn = 0; mn < MN; mn++)
      for (int p = 0; p < t.P; p++) {
        uint32_t v[4];
        for (int j = 0; j < 4; j++) {
          int k = 4 * p + j;
          float f = k < SFK ? sf[((size_t)g * (size_t)MN + (size_t)mn) * (size_t)SFK + (size_t)k] : 0.0f;
          memcpy(&v[j], &f, 4);
        }
        *at(&t, g, mn, p) = (v[0] >> 23) | (v[1] >> 15) | (v[2] >> 7) | (v[3] << 1);
      }
  return t;
}

/* _interleave_weights(gran=8) on the row axis of a [G, N, rowlen] byte tensor:
 * stack([gate.reshape(N/16, 8), up.reshape(N/16, 8)], dim=2).reshape(N). */
static void interleave_rows(const uint8_t *in, uint8_t *out, int G, int N, size_t rowlen) {
  int half = N / 2;
  for (int g = 0; g < G; g++)
    for (int blk = 0; blk < half / 8; blk++)
      for (int s = 0; s < 2; s++)
        for (int j = 0; j < 8; j++) {
          int dst = (blk * 2 + s) * 8 + j, src = s * half + blk * 8 + j;
          memcpy(out + ((size_t)g * (size_t)N + (size_t)dst) * rowlen,
                 in + ((size_t)g * (size_t)N + (size_t)src) * rowlen, rowlen);
        }
}

/* _transpose_sf_for_utccp: reshape(G, -1, 4, 32, P).transpose(2, 3). */
static words3 utccp(const words3 *in) {
  words3 t = *in;
  t.w = malloc((size_t)t.G * (size_t)t.MN * (size_t)t.P * 4);
  for (int g = 0; g < t.G; g++)
    for (int c = 0; c < t.MN / 128; c++)
      for (int a = 0; a < 32; a++)   /* new axis 2 (was 3) */
        for (int b = 0; b < 4; b++)  /* new axis 3 (was 2) */
          for (int p = 0; p < t.P; p++)
            *at(&t, g, c * 128 + a * 4 + b, p) = *at((words3 *)in, g, c * 128 + b * 32 + a, p);
  return t;
}

static void store_mn_major(words3 *t, int32_t *out) {
  int mna = (t->MN + 3) / 4 * 4;
  memset(out, 0, (size_t)t->G * (size_t)t->P * (size_t)mna * 4);
  for (int g = 0; g < t->G; g++)
    for (int mn = 0; mn < t->MN; mn++)
      for (int p = 0; p < t->P; p++)
        out[(size_t)g * (size_t)t->P * (size_t)mna + (size_t)p * (size_t)mna + (size_t)mn] =
            (int32_t)*at(t, g, mn, p);
}

/* ---- helpers ---------------------------------------------------------------- */

typedef struct {
  mm_sm100_shape s;
  mm_sm100_canon c;
  float *f13, *f2;
} layer;

static void make_layer(layer *L, int E, int H, int I, int gran) {
  mm_sm100_shape s = {E, H, I, gran};
  L->s = s;
  L->c.w13 = malloc(mm_sm100_w13_bytes(&s));
  L->c.w2 = malloc(mm_sm100_w2_bytes(&s));
  L->c.s13 = malloc(mm_sm100_s13_bytes(&s));
  L->c.s2 = malloc(mm_sm100_s2_bytes(&s));
  L->f13 = malloc(4 * mm_sm100_s13_bytes(&s));
  L->f2 = malloc(4 * mm_sm100_s2_bytes(&s));
  for (size_t i = 0; i < mm_sm100_w13_bytes(&s); i++) L->c.w13[i] = (uint8_t)mm_test_rand_u64();
  for (size_t i = 0; i < mm_sm100_w2_bytes(&s); i++) L->c.w2[i] = (uint8_t)mm_test_rand_u64();
  for (size_t i = 0; i < mm_sm100_s13_bytes(&s); i++) {
    L->c.s13[i] = (uint8_t)(1 + mm_test_rand_u64() % 254);
    L->f13[i] = ldexpf(1.0f, L->c.s13[i] - 127);
  }
  for (size_t i = 0; i < mm_sm100_s2_bytes(&s); i++) {
    L->c.s2[i] = (uint8_t)(1 + mm_test_rand_u64() % 254);
    L->f2[i] = ldexpf(1.0f, L->c.s2[i] - 127);
  }
}

static void free_layer(layer *L) {
  free(L->c.w13), free(L->c.w2), free(L->c.s13), free(L->c.s2), free(L->f13), free(L->f2);
}

static mm_sm100_packed alloc_packed(const mm_sm100_shape *s, uint8_t poison) {
  mm_sm100_packed p = {malloc(mm_sm100_w13_bytes(s)), malloc(4 * mm_sm100_s13_words(s)),
                       malloc(mm_sm100_w2_bytes(s)), malloc(4 * mm_sm100_s2_words(s))};
  memset(p.w13, poison, mm_sm100_w13_bytes(s));
  memset(p.s13, poison, 4 * mm_sm100_s13_words(s));
  memset(p.w2, poison, mm_sm100_w2_bytes(s));
  memset(p.s2, poison, 4 * mm_sm100_s2_words(s));
  return p;
}

static void free_packed(mm_sm100_packed *p) { free(p->w13), free(p->s13), free(p->w2), free(p->s2); }

/* ---- tests ------------------------------------------------------------------ */

static void test_against_second_impl(void) {
  static const int shapes[][4] = {{1, 128, 64, 32},  {2, 640, 192, 32}, {2, 640, 192, 16},
                                  {3, 384, 128, 16}, {1, 256, 320, 32}, {2, 128, 64, 16},
                                  {1, 1024, 512, 32}};
  for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
    layer L;
    make_layer(&L, shapes[k][0], shapes[k][1], shapes[k][2], shapes[k][3]);
    const mm_sm100_shape *s = &L.s;
    mm_sm100_packed got = alloc_packed(s, 0x5A);
    CHECK_OK(mm_sm100_export(s, &L.c, &got, (int)k % 3));

    int E = s->E, H = s->H, I = s->I;
    int sfk13 = (H + s->gran - 1) / s->gran, sfk2 = (I + s->gran - 1) / s->gran;
    /* L1: pack, interleave (weights and scales alike), transpose. */
    uint8_t *w13 = malloc(mm_sm100_w13_bytes(s));
    interleave_rows(L.c.w13, w13, E, 2 * I, (size_t)H / 2);
    words3 p13 = pack_fp32(L.f13, E, 2 * I, sfk13);
    words3 i13 = p13;
    i13.w = malloc((size_t)E * 2 * (size_t)I * (size_t)p13.P * 4);
    interleave_rows((const uint8_t *)p13.w, (uint8_t *)i13.w, E, 2 * I, (size_t)p13.P * 4);
    words3 t13 = utccp(&i13);
    int32_t *s13 = malloc(4 * mm_sm100_s13_words(s));
    store_mn_major(&t13, s13);
    /* L2: pack, transpose. */
    words3 p2 = pack_fp32(L.f2, E, H, sfk2);
    words3 t2 = utccp(&p2);
    int32_t *s2 = malloc(4 * mm_sm100_s2_words(s));
    store_mn_major(&t2, s2);

    CHECK_MSG(memcmp(got.w13, w13, mm_sm100_w13_bytes(s)) == 0, "w13 shape %zu", k);
    CHECK_MSG(memcmp(got.w2, L.c.w2, mm_sm100_w2_bytes(s)) == 0, "w2 shape %zu", k);
    CHECK_MSG(memcmp(got.s13, s13, 4 * mm_sm100_s13_words(s)) == 0, "s13 shape %zu", k);
    CHECK_MSG(memcmp(got.s2, s2, 4 * mm_sm100_s2_words(s)) == 0, "s2 shape %zu", k);
    CHECK_EQ_INT(mm_sm100_s13_words(s), (size_t)E * (size_t)p13.P * (size_t)(2 * I));

    /* Round trip. */
    layer back = L;
    back.c.w13 = malloc(mm_sm100_w13_bytes(s));
    back.c.w2 = malloc(mm_sm100_w2_bytes(s));
    back.c.s13 = malloc(mm_sm100_s13_bytes(s));
    back.c.s2 = malloc(mm_sm100_s2_bytes(s));
    CHECK_OK(mm_sm100_import(s, &got, &back.c, 2));
    CHECK(memcmp(back.c.w13, L.c.w13, mm_sm100_w13_bytes(s)) == 0);
    CHECK(memcmp(back.c.w2, L.c.w2, mm_sm100_w2_bytes(s)) == 0);
    CHECK(memcmp(back.c.s13, L.c.s13, mm_sm100_s13_bytes(s)) == 0);
    CHECK(memcmp(back.c.s2, L.c.s2, mm_sm100_s2_bytes(s)) == 0);
    /* A non-zero padding byte is not this layout. */
    if (sfk2 % 4) {
      ((uint8_t *)got.s2)[4 * ((size_t)(p2.P - 1) * (size_t)H + 5) + 3] = 1;
      CHECK_ERR(mm_sm100_import(s, &got, &back.c, 2), MEGAMOE_CODE_INVALID_ARGUMENT);
    }
    free(back.c.w13), free(back.c.w2), free(back.c.s13), free(back.c.s2);
    free(w13), free(p13.w), free(i13.w), free(t13.w), free(s13), free(p2.w), free(t2.w), free(s2);
    free_packed(&got);
    free_layer(&L);
  }
}

static void test_index_maps(void) {
  /* interleave_pos is a bijection; utccp_row too (inside each chunk). */
  int I = 192, seen[384] = {0};
  for (int r = 0; r < 2 * I; r++) seen[mm_sm100_interleave_pos(r, I)]++;
  for (int n = 0; n < 2 * I; n++) CHECK(seen[n] == 1);
  CHECK_EQ_INT(mm_sm100_interleave_pos(7, I), 7);
  CHECK_EQ_INT(mm_sm100_interleave_pos(I, I), 8);
  CHECK_EQ_INT(mm_sm100_interleave_pos(8, I), 16);
  CHECK_EQ_INT(mm_sm100_utccp_row(1), 4);
  CHECK_EQ_INT(mm_sm100_utccp_row(32), 1);
  CHECK_EQ_INT(mm_sm100_utccp_row(128 + 33), 128 + 5);
}

static void test_errors(void) {
  mm_sm100_shape bad[] = {{1, 640, 96, 32}, {1, 200, 64, 32}, {1, 128, 64, 8}, {0, 128, 64, 32}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    CHECK_ERR(mm_sm100_check_shape(&bad[i]), MEGAMOE_CODE_INVALID_ARGUMENT);
  float f[6] = {1.0f, 0.5f, 0.0f, 4.0f, 1.0f, 1.0f};
  uint8_t b[6];
  CHECK_OK(mm_f32_scales_to_ue8m0(f, 6, b, "s"));
  CHECK(b[0] == 127 && b[1] == 126 && b[2] == 0 && b[3] == 129);
  static const float bad_f[] = {1.5f, -2.0f, INFINITY, NAN, 1e-40f, -0.0f};
  for (size_t i = 0; i < sizeof bad_f / sizeof bad_f[0]; i++) {
    f[4] = bad_f[i];
    mm_err *e = mm_f32_scales_to_ue8m0(f, 6, b, "s13");
    CHECK(e && strstr(e->message, "s13") && strstr(e->message, "element 4"));
    mm_error_free(e);
  }
}

static void test_from_experts(void) {
  int E = 2, H = 128, I = 64;
  mm_expert_q x[2];
  for (int e = 0; e < E; e++) {
    CHECK(mm_qmat_alloc(&x[e].w13, 2 * I, H, 32, MM_SF_UE8M0) == 0);
    CHECK(mm_qmat_alloc(&x[e].w2, H, I, 32, MM_SF_UE8M0) == 0);
    for (int i = 0; i < 2 * I * H / 2; i++) x[e].w13.codes[i] = (uint8_t)mm_test_rand_u64();
    for (int i = 0; i < 2 * I * H / 32; i++) x[e].w13.scales[i] = (uint8_t)mm_test_rand_u64() % 255;
  }
  mm_sm100_shape s;
  mm_sm100_canon c;
  CHECK_OK(mm_sm100_canon_from_experts(x, E, &s, &c));
  CHECK(s.E == 2 && s.H == H && s.I == I && s.gran == 32);
  CHECK(c.w13 && memcmp(c.w13 + (size_t)I * H, x[1].w13.codes, (size_t)I * H) == 0);
  CHECK(c.s13 && memcmp(c.s13 + (size_t)2 * I * H / 32, x[1].w13.scales, (size_t)2 * I * H / 32) == 0);
  mm_sm100_canon_free(&c);
  x[1].w2.row_scale[3] = 2.0f;
  CHECK_ERR(mm_sm100_canon_from_experts(x, E, &s, &c), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK(c.w13 == NULL);
  x[1].w2.row_scale[3] = 1.0f;
  x[0].w13.sf = MM_SF_E4M3;
  CHECK_ERR(mm_sm100_canon_from_experts(x, E, &s, &c), MEGAMOE_CODE_INVALID_ARGUMENT);
  for (int e = 0; e < E; e++) mm_qmat_free(&x[e].w13), mm_qmat_free(&x[e].w2);
}

/* "[2, 384, 10]" -> 3 numbers. */
static int parse_list(const char *s, long v[3]) {
  return s && sscanf(s, "[%ld, %ld, %ld]", &v[0], &v[1], &v[2]) == 3;
}

/* The golden files: export equals sm100.*, the metadata shapes/strides match
 * the formulas, and the import recovers the inputs. */
static void test_golden(void) {
  for (size_t fi = 0; fi < sizeof kGoldenSm100Files / sizeof kGoldenSm100Files[0]; fi++) {
    mm_st_file *f = golden_open(kGoldenSm100Files[fi]);
    CHECK(f != NULL);
    if (!f) continue;
    const char *fn = kGoldenSm100Files[fi];
    mm_sm100_shape s = {atoi(mm_st_metadata(f, "E")), atoi(mm_st_metadata(f, "H")),
                        atoi(mm_st_metadata(f, "I")), atoi(mm_st_metadata(f, "gran_k"))};
    const mm_st_tensor *t13 = NULL, *t2 = NULL, *o13 = NULL, *o2 = NULL;
    uint8_t *w13 = golden_read(f, "w13", NULL), *w2 = golden_read(f, "w2", NULL);
    float *f13 = golden_read(f, "s13", &t13), *f2 = golden_read(f, "s2", &t2);
    uint8_t *gw13 = golden_read(f, "sm100.w13", NULL), *gw2 = golden_read(f, "sm100.w2", NULL);
    int32_t *gs13 = golden_read(f, "sm100.s13", &o13), *gs2 = golden_read(f, "sm100.s2", &o2);
    CHECK(w13 && w2 && f13 && f2 && gw13 && gw2 && gs13 && gs2);
    if (!(w13 && w2 && f13 && f2 && gw13 && gw2 && gs13 && gs2)) goto next;
    CHECK(t13->nelems == mm_sm100_s13_bytes(&s) && t2->nelems == mm_sm100_s2_bytes(&s));
    CHECK(o13->nelems == mm_sm100_s13_words(&s) && o2->nelems == mm_sm100_s2_words(&s));
    long sh[3], st[3];
    int P13 = mm_sm100_packed_k(mm_sm100_sfk(s.H, s.gran)), P2 = mm_sm100_packed_k(mm_sm100_sfk(s.I, s.gran));
    int M13 = mm_sm100_tma_mn(2 * s.I), M2 = mm_sm100_tma_mn(s.H);
    CHECK(parse_list(mm_st_metadata(f, "s13_shape"), sh) && sh[0] == s.E && sh[1] == 2 * s.I && sh[2] == P13);
    CHECK(parse_list(mm_st_metadata(f, "s13_strides"), st) && st[0] == (long)P13 * M13 && st[1] == 1 && st[2] == M13);
    CHECK(parse_list(mm_st_metadata(f, "s2_shape"), sh) && sh[0] == s.E && sh[1] == s.H && sh[2] == P2);
    CHECK(parse_list(mm_st_metadata(f, "s2_strides"), st) && st[0] == (long)P2 * M2 && st[1] == 1 && st[2] == M2);

    mm_sm100_canon c = {w13, malloc(mm_sm100_s13_bytes(&s)), w2, malloc(mm_sm100_s2_bytes(&s))};
    CHECK_OK(mm_f32_scales_to_ue8m0(f13, mm_sm100_s13_bytes(&s), c.s13, "s13"));
    CHECK_OK(mm_f32_scales_to_ue8m0(f2, mm_sm100_s2_bytes(&s), c.s2, "s2"));
    mm_sm100_packed p = alloc_packed(&s, 0xA5);
    CHECK_OK(mm_sm100_export(&s, &c, &p, 0));
    CHECK_MSG(memcmp(p.w13, gw13, mm_sm100_w13_bytes(&s)) == 0, "%s: sm100.w13", fn);
    CHECK_MSG(memcmp(p.w2, gw2, mm_sm100_w2_bytes(&s)) == 0, "%s: sm100.w2", fn);
    CHECK_MSG(memcmp(p.s13, gs13, 4 * mm_sm100_s13_words(&s)) == 0, "%s: sm100.s13", fn);
    CHECK_MSG(memcmp(p.s2, gs2, 4 * mm_sm100_s2_words(&s)) == 0, "%s: sm100.s2", fn);
    /* The golden output through the inverse gives the inputs back. */
    mm_sm100_packed g = {gw13, gs13, gw2, gs2};
    mm_sm100_canon b = {malloc(mm_sm100_w13_bytes(&s)), malloc(mm_sm100_s13_bytes(&s)),
                        malloc(mm_sm100_w2_bytes(&s)), malloc(mm_sm100_s2_bytes(&s))};
    CHECK_OK(mm_sm100_import(&s, &g, &b, 0));
    CHECK(memcmp(b.w13, w13, mm_sm100_w13_bytes(&s)) == 0 && memcmp(b.w2, w2, mm_sm100_w2_bytes(&s)) == 0);
    CHECK(memcmp(b.s13, c.s13, mm_sm100_s13_bytes(&s)) == 0 && memcmp(b.s2, c.s2, mm_sm100_s2_bytes(&s)) == 0);
    printf("# %s: E %d H %d I %d gran %d identical\n", fn, s.E, s.H, s.I, s.gran);
    mm_sm100_canon_free(&b);
    free(c.s13), free(c.s2);
    free_packed(&p);
  next:
    free(w13), free(w2), free(f13), free(f2), free(gw13), free(gw2), free(gs13), free(gs2);
    mm_st_close(f);
  }
}

int main(void) {
  mm_test_seed();
  RUN(test_index_maps);
  RUN(test_against_second_impl);
  RUN(test_errors);
  RUN(test_from_experts);
  RUN_GOLDEN(test_golden);
  return mm_test_done();
}

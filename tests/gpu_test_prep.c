/* gpu_test_prep.c -- the GPU preparation kernels against the CPU references,
 * byte for byte: requant (random data of several shapes, single rows, K not a
 * multiple of 128, edge rows), the scale NaN scan, and the sm100 export.
 * Outputs are poisoned before every run. Skips without a GPU. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"
#include "gpu_harness.h"
#include "layout_sm100.h"
#include "prep.h"
#include "prep_golden.h"
#include "requant.h"

#define CU(call)                                                                  \
  do {                                                                            \
    cudaError_t e_ = (call);                                                      \
    if (e_ != cudaSuccess) {                                                      \
      printf("# %s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

static void *dup_to_device(const void *h, size_t n) {
  void *d;
  CU(cudaMalloc(&d, n ? n : 1));
  if (n) CU(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
  return d;
}

static uint8_t rand_e4m3(void) {
  for (;;) {
    uint8_t b = (uint8_t)(mm_test_rand_u64() & 0x7F);
    if (!mm_e4m3_is_nan(b)) return b;
  }
}

/* CPU and GPU requant of one random matrix; compares bytes and stats. */
static void requant_case(int rows, int cols, mm_scale_format sf, int with_rs, int edges) {
  size_t cb = (size_t)rows * cols / 2, s16 = (size_t)rows * cols / 16, s32 = (size_t)rows * cols / 32;
  uint8_t *codes = malloc(cb), *scales = malloc(s16);
  float *rs = with_rs ? malloc(sizeof(float) * (size_t)rows) : NULL;
  for (size_t i = 0; i < cb; i++) codes[i] = (uint8_t)mm_test_rand_u64();
  for (size_t i = 0; i < s16; i++)
    scales[i] = sf == MM_SF_E4M3 ? rand_e4m3() : (uint8_t)(mm_test_rand_u64() % 240);
  for (int r = 0; with_rs && r < rows; r++)
    rs[r] = (r % 5 == 3 ? -1.0f : 1.0f) * mm_test_uniform(1e-4f, 4.0f); /* some negative */
  if (sf == MM_SF_E4M3)
    for (size_t i = 0; i < s16; i += 7) scales[i] |= 0x80; /* negative group scales */
  if (edges && rows >= 4) {
    memset(codes, 0, (size_t)cols / 2);                   /* zero row */
    memset(codes + cols / 2, 0x88, (size_t)cols / 2);     /* -0 row */
    memset(codes + cols, 0x77, (size_t)cols / 2);         /* all 6 */
    for (int g = 0; g < cols / 16; g++) scales[2 * (size_t)(cols / 16) + g] = sf == MM_SF_E4M3 ? 0x7E : with_rs ? 200 : 252;
    for (int g = 0; g < cols / 16; g++) scales[3 * (size_t)(cols / 16) + g] = g % 2 ? 0x01 : 0x00;
  }
  mm_g16_source src = {rows, cols, sf, codes, scales, rs};
  uint8_t *cc = malloc(cb), *cs = malloc(s32), *gc = malloc(cb), *gs = malloc(s32);
  mm_requant_stats cst, gst;
  CHECK_OK(mm_requant_g16_to_g32(&src, cc, cs, 0, &cst));

  uint8_t *d_codes = dup_to_device(codes, cb), *d_scales = dup_to_device(scales, s16);
  float *d_rs = rs ? dup_to_device(rs, sizeof(float) * (size_t)rows) : NULL;
  uint8_t *d_oc, *d_os;
  CU(cudaMalloc((void **)&d_oc, cb));
  CU(cudaMalloc((void **)&d_os, s32));
  CU(cudaMemset(d_oc, 0xAB, cb));
  CU(cudaMemset(d_os, 0xAB, s32));
  CHECK_OK(mm_gpu_requant(rows, cols, sf, d_codes, d_scales, d_rs, d_oc, d_os, &gst, NULL));
  CU(cudaMemcpy(gc, d_oc, cb, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(gs, d_os, s32, cudaMemcpyDeviceToHost));
  CHECK_MSG(memcmp(gc, cc, cb) == 0, "codes differ [%d, %d] sf %d", rows, cols, (int)sf);
  CHECK_MSG(memcmp(gs, cs, s32) == 0, "scales differ [%d, %d] sf %d", rows, cols, (int)sf);
  CHECK_NEAR(gst.rel_rms, cst.rel_rms, 1e-5 * cst.rel_rms + 1e-12);
  /* The GPU keeps a group's error statistics in FP32 units of its scale
   * 2^E (kernels/prep_lut.h): an error below 2^(E - 149), of an element
   * 2^149 below the group's largest one (the other half's scale), counts as
   * 0 there (seed 1796016599: 0 against the CPU's 4.6e-33). */
  int bmax = 0;
  for (size_t i = 0; i < s32; i++) bmax = cs[i] > bmax ? cs[i] : bmax;
  const double underflow = ldexp(1.0, bmax - 127 - 149), close = 1e-5 * cst.max_abs;
  if (fabs(gst.max_abs - cst.max_abs) > close) /* the slack is used (or the check fails) */
    printf("# [%d, %d] sf %d: max |error| GPU %g, CPU %g, FP32 underflow slack %g\n", rows, cols,
           (int)sf, gst.max_abs, cst.max_abs, underflow);
  CHECK_NEAR(gst.max_abs, cst.max_abs, close + underflow);
  CHECK_EQ_INT(gst.count, cst.count);

  /* Without stats, and the per-element reference kernel: same bytes. */
  for (int variant = 0; variant < 3; variant++) {
    CU(cudaMemset(d_oc, 0x5A, cb));
    CU(cudaMemset(d_os, 0x5A, s32));
    mm_requant_stats vst;
    if (variant == 0)
      CHECK_OK(mm_gpu_requant(rows, cols, sf, d_codes, d_scales, d_rs, d_oc, d_os, NULL, NULL));
    else
      CHECK_OK(mm_gpu_requant_simple(rows, cols, sf, d_codes, d_scales, d_rs, d_oc, d_os,
                                     variant == 2 ? &vst : NULL, NULL));
    CU(cudaMemcpy(gc, d_oc, cb, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(gs, d_os, s32, cudaMemcpyDeviceToHost));
    CHECK_MSG(memcmp(gc, cc, cb) == 0 && memcmp(gs, cs, s32) == 0, "variant %d [%d, %d] sf %d",
              variant, rows, cols, (int)sf);
    if (variant == 2) CHECK_NEAR(vst.rel_rms, cst.rel_rms, 1e-5 * cst.rel_rms + 1e-12);
  }

  cudaFree(d_codes), cudaFree(d_scales), cudaFree(d_rs), cudaFree(d_oc), cudaFree(d_os);
  free(codes), free(scales), free(rs), free(cc), free(cs), free(gc), free(gs);
}

static void test_requant_random(void) {
  static const int shapes[][2] = {{1, 32},    {1, 6144},  {3, 96},   {7, 160},
                                  {64, 256},  {33, 2048}, {5, 4128}, {257, 6144}};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    requant_case(shapes[i][0], shapes[i][1], MM_SF_E4M3, 1, 1);
    requant_case(shapes[i][0], shapes[i][1], MM_SF_UE8M0, (int)i % 2, 1);
  }
}

static void test_requant_errors(void) {
  int rows = 5, cols = 96;
  uint8_t codes[5 * 48], scales[5 * 6];
  for (int i = 0; i < 5 * 48; i++) codes[i] = (uint8_t)mm_test_rand_u64();
  for (int i = 0; i < 5 * 6; i++) scales[i] = rand_e4m3();
  scales[3 * 6 + 5] = 0xFF; /* row 3, elements 64..95 */
  scales[4 * 6 + 0] = 0x7F; /* row 4 too: the first one is reported */
  uint8_t *dc = dup_to_device(codes, sizeof codes), *ds = dup_to_device(scales, sizeof scales);
  uint8_t *oc, *os;
  CU(cudaMalloc((void **)&oc, sizeof codes));
  CU(cudaMalloc((void **)&os, sizeof scales));
  mm_err *e = mm_gpu_requant(rows, cols, MM_SF_E4M3, dc, ds, NULL, oc, os, NULL, NULL);
  CHECK(e && strstr(e->message, "row 3, elements 64..95"));
  if (e) printf("# %s\n", e->message);
  mm_error_free(e);
  CHECK_ERR(mm_gpu_requant(rows, 48, MM_SF_E4M3, dc, ds, NULL, oc, os, NULL, NULL),
            MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_gpu_requant(rows, cols, MM_SF_E4M3, dc + 1, ds, NULL, oc, os, NULL, NULL),
            MEGAMOE_CODE_INVALID_ARGUMENT); /* misaligned */

  /* NaN scan: first NaN byte index, or none. */
  uint32_t *st, h;
  CU(cudaMalloc((void **)&st, 4));
  for (int sf = 1; sf <= 2; sf++)
    for (int k = 0; k < 3; k++) {
      size_t n = k == 0 ? 1000 : k == 1 ? 4096 : 77;
      uint8_t *b = malloc(n);
      for (size_t i = 0; i < n; i++) b[i] = (uint8_t)(mm_test_rand_u64() % 0x7F);
      size_t at = n - 1 - (size_t)(mm_test_rand_u64() % (n / 2));
      if (k < 2) b[at] = sf == 1 ? 0xFF : 0xFF;
      if (k == 0 && sf == 1) b[at + 1 < n ? at + 1 : at] = 0x7F;
      uint8_t *d = dup_to_device(b, n);
      h = MM_GPU_STATUS_OK;
      CU(cudaMemcpy(st, &h, 4, cudaMemcpyHostToDevice));
      CHECK_OK(mm_gpu_scan_scales_launch(d, n, (mm_scale_format)sf, st, NULL));
      CU(cudaMemcpy(&h, st, 4, cudaMemcpyDeviceToHost));
      CHECK_EQ_INT(h, k < 2 ? (uint32_t)at : MM_GPU_STATUS_OK);
      cudaFree(d);
      free(b);
    }
  cudaFree(st), cudaFree(dc), cudaFree(ds), cudaFree(oc), cudaFree(os);
}

static void test_sm100_export(void) {
  static const int shapes[][4] = {{1, 128, 64, 32}, {2, 640, 192, 32}, {2, 640, 192, 16},
                                  {3, 384, 128, 16}, {4, 6144, 2048, 32}};
  for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
    mm_sm100_shape s = {shapes[k][0], shapes[k][1], shapes[k][2], shapes[k][3]};
    size_t b13 = mm_sm100_w13_bytes(&s), b2 = mm_sm100_w2_bytes(&s);
    size_t c13 = mm_sm100_s13_bytes(&s), c2 = mm_sm100_s2_bytes(&s);
    size_t n13 = 4 * mm_sm100_s13_words(&s), n2 = 4 * mm_sm100_s2_words(&s);
    mm_sm100_canon h = {malloc(b13), malloc(c13), malloc(b2), malloc(c2)};
    for (size_t i = 0; i < b13; i++) h.w13[i] = (uint8_t)mm_test_rand_u64();
    for (size_t i = 0; i < b2; i++) h.w2[i] = (uint8_t)mm_test_rand_u64();
    for (size_t i = 0; i < c13; i++) h.s13[i] = (uint8_t)mm_test_rand_u64();
    for (size_t i = 0; i < c2; i++) h.s2[i] = (uint8_t)mm_test_rand_u64();
    mm_sm100_packed cpu = {malloc(b13), malloc(n13), malloc(b2), malloc(n2)};
    CHECK_OK(mm_sm100_export(&s, &h, &cpu, 0));
    mm_sm100_canon d = {dup_to_device(h.w13, b13), dup_to_device(h.s13, c13),
                        dup_to_device(h.w2, b2), dup_to_device(h.s2, c2)};
    mm_sm100_packed g;
    CU(cudaMalloc((void **)&g.w13, b13));
    CU(cudaMalloc((void **)&g.s13, n13));
    CU(cudaMalloc((void **)&g.w2, b2));
    CU(cudaMalloc((void **)&g.s2, n2));
    CU(cudaMemset(g.w13, 0xEE, b13));
    CU(cudaMemset(g.s13, 0xEE, n13));
    CU(cudaMemset(g.w2, 0xEE, b2));
    CU(cudaMemset(g.s2, 0xEE, n2));
    CHECK_OK(mm_gpu_sm100_export_launch(&s, &d, &g, NULL));
    CU(cudaDeviceSynchronize());
    uint8_t *t = malloc(b13 > n13 ? (b13 > b2 ? b13 : b2) : (n13 > n2 ? n13 : n2));
    CU(cudaMemcpy(t, g.w13, b13, cudaMemcpyDeviceToHost));
    CHECK_MSG(memcmp(t, cpu.w13, b13) == 0, "w13 shape %zu", k);
    CU(cudaMemcpy(t, g.w2, b2, cudaMemcpyDeviceToHost));
    CHECK_MSG(memcmp(t, cpu.w2, b2) == 0, "w2 shape %zu", k);
    CU(cudaMemcpy(t, g.s13, n13, cudaMemcpyDeviceToHost));
    CHECK_MSG(memcmp(t, cpu.s13, n13) == 0, "s13 shape %zu", k);
    CU(cudaMemcpy(t, g.s2, n2, cudaMemcpyDeviceToHost));
    CHECK_MSG(memcmp(t, cpu.s2, n2) == 0, "s2 shape %zu", k);
    free(t);
    cudaFree(d.w13), cudaFree(d.s13), cudaFree(d.w2), cudaFree(d.s2);
    cudaFree(g.w13), cudaFree(g.s13), cudaFree(g.w2), cudaFree(g.s2);
    free(h.w13), free(h.s13), free(h.w2), free(h.s2);
    free(cpu.w13), free(cpu.s13), free(cpu.w2), free(cpu.s2);
  }
}

/* Golden requant files on the GPU: dst.weight / dst.weight_scale exactly. */
static void test_golden_requant(void) {
  for (size_t fi = 0; fi < sizeof kGoldenRequantFiles / sizeof kGoldenRequantFiles[0]; fi++) {
    mm_st_file *f = golden_open(kGoldenRequantFiles[fi]);
    CHECK(f != NULL);
    if (!f) continue;
    const mm_st_tensor *tw = NULL, *ts = NULL, *tg = NULL;
    uint8_t *w = golden_read(f, "src.weight", &tw), *sc = golden_read(f, "src.weight_scale", &ts);
    float *g = mm_st_find(f, "src.weight_scale_2") ? golden_read(f, "src.weight_scale_2", &tg) : NULL;
    uint8_t *dw = golden_read(f, "dst.weight", NULL), *ds = golden_read(f, "dst.weight_scale", NULL);
    CHECK(w && sc && dw && ds);
    if (w && sc && dw && ds) {
      int N = (int)tw->shape[0], K = 2 * (int)tw->shape[1];
      mm_scale_format sf = ts->dtype == MM_ST_F8_E4M3 ? MM_SF_E4M3 : MM_SF_UE8M0;
      float *rs = malloc(sizeof(float) * (size_t)N);
      for (int r = 0; r < N; r++) rs[r] = g ? g[0] : 1.0f;
      size_t cb = (size_t)N * K / 2, sb = (size_t)N * K / 32;
      uint8_t *dc = dup_to_device(w, cb), *dsc = dup_to_device(sc, (size_t)N * K / 16), *oc, *os;
      float *drs = dup_to_device(rs, sizeof(float) * (size_t)N);
      CU(cudaMalloc((void **)&oc, cb));
      CU(cudaMalloc((void **)&os, sb));
      CU(cudaMemset(oc, 0xAB, cb));
      CU(cudaMemset(os, 0xAB, sb));
      mm_requant_stats st;
      CHECK_OK(mm_gpu_requant(N, K, sf, dc, dsc, drs, oc, os, &st, NULL));
      uint8_t *hc = malloc(cb), *hs = malloc(sb);
      CU(cudaMemcpy(hc, oc, cb, cudaMemcpyDeviceToHost));
      CU(cudaMemcpy(hs, os, sb, cudaMemcpyDeviceToHost));
      CHECK_MSG(memcmp(hc, dw, cb) == 0, "%s: GPU dst.weight differs", kGoldenRequantFiles[fi]);
      CHECK_MSG(memcmp(hs, ds, sb) == 0, "%s: GPU dst.weight_scale differs", kGoldenRequantFiles[fi]);
      const char *m = mm_st_metadata(f, "rel_rms_error");
      if (m) CHECK_NEAR(st.rel_rms, strtod(m, NULL), 1e-5 * strtod(m, NULL));
      printf("# GPU %s [%d, %d]: bytes %s, rel RMS %.6f\n", kGoldenRequantFiles[fi], N, K,
             memcmp(hc, dw, cb) || memcmp(hs, ds, sb) ? "DIFFER" : "identical", st.rel_rms);
      cudaFree(dc), cudaFree(dsc), cudaFree(drs), cudaFree(oc), cudaFree(os);
      free(rs), free(hc), free(hs);
    }
    free(w), free(sc), free(g), free(dw), free(ds);
    mm_st_close(f);
  }
}

/* Golden sm100 files on the GPU. */
static void test_golden_sm100(void) {
  for (size_t fi = 0; fi < sizeof kGoldenSm100Files / sizeof kGoldenSm100Files[0]; fi++) {
    mm_st_file *f = golden_open(kGoldenSm100Files[fi]);
    CHECK(f != NULL);
    if (!f) continue;
    mm_sm100_shape s = {atoi(mm_st_metadata(f, "E")), atoi(mm_st_metadata(f, "H")),
                        atoi(mm_st_metadata(f, "I")), atoi(mm_st_metadata(f, "gran_k"))};
    uint8_t *w13 = golden_read(f, "w13", NULL), *w2 = golden_read(f, "w2", NULL);
    float *f13 = golden_read(f, "s13", NULL), *f2 = golden_read(f, "s2", NULL);
    uint8_t *gw13 = golden_read(f, "sm100.w13", NULL);
    int32_t *gs13 = golden_read(f, "sm100.s13", NULL), *gs2 = golden_read(f, "sm100.s2", NULL);
    CHECK(w13 && w2 && f13 && f2 && gw13 && gs13 && gs2);
    if (w13 && w2 && f13 && f2 && gw13 && gs13 && gs2) {
      size_t b13 = mm_sm100_w13_bytes(&s), b2 = mm_sm100_w2_bytes(&s);
      size_t c13 = mm_sm100_s13_bytes(&s), c2 = mm_sm100_s2_bytes(&s);
      size_t n13 = 4 * mm_sm100_s13_words(&s), n2 = 4 * mm_sm100_s2_words(&s);
      uint8_t *u13 = malloc(c13), *u2 = malloc(c2);
      CHECK_OK(mm_f32_scales_to_ue8m0(f13, c13, u13, "s13"));
      CHECK_OK(mm_f32_scales_to_ue8m0(f2, c2, u2, "s2"));
      mm_sm100_canon d = {dup_to_device(w13, b13), dup_to_device(u13, c13), dup_to_device(w2, b2),
                          dup_to_device(u2, c2)};
      mm_sm100_packed g;
      CU(cudaMalloc((void **)&g.w13, b13));
      CU(cudaMalloc((void **)&g.s13, n13));
      CU(cudaMalloc((void **)&g.w2, b2));
      CU(cudaMalloc((void **)&g.s2, n2));
      CU(cudaMemset(g.s13, 0xEE, n13));
      CU(cudaMemset(g.s2, 0xEE, n2));
      CHECK_OK(mm_gpu_sm100_export_launch(&s, &d, &g, NULL));
      CU(cudaDeviceSynchronize());
      uint8_t *t = malloc(b13 > n13 ? b13 : n13);
      CU(cudaMemcpy(t, g.w13, b13, cudaMemcpyDeviceToHost));
      CHECK_MSG(memcmp(t, gw13, b13) == 0, "%s: GPU sm100.w13", kGoldenSm100Files[fi]);
      CU(cudaMemcpy(t, g.s13, n13, cudaMemcpyDeviceToHost));
      CHECK_MSG(memcmp(t, gs13, n13) == 0, "%s: GPU sm100.s13", kGoldenSm100Files[fi]);
      CU(cudaMemcpy(t, g.s2, n2, cudaMemcpyDeviceToHost));
      CHECK_MSG(memcmp(t, gs2, n2) == 0, "%s: GPU sm100.s2", kGoldenSm100Files[fi]);
      printf("# GPU %s checked\n", kGoldenSm100Files[fi]);
      free(t), free(u13), free(u2);
      cudaFree(d.w13), cudaFree(d.s13), cudaFree(d.w2), cudaFree(d.s2);
      cudaFree(g.w13), cudaFree(g.s13), cudaFree(g.w2), cudaFree(g.s2);
    }
    free(w13), free(w2), free(f13), free(f2), free(gw13), free(gs13), free(gs2);
    mm_st_close(f);
  }
}

int main(void) {
  if (!mm_test_have_gpu()) return mm_test_skip_all("no GPU");
  mm_test_seed();
  RUN(test_requant_random);
  RUN(test_requant_errors);
  RUN(test_sm100_export);
  RUN_GOLDEN(test_golden_requant);
  RUN_GOLDEN(test_golden_sm100);
  return mm_test_done();
}

/* gpu_test_pack_sm90.c -- the GPU sm90 packer (kernels/pack_sm90.cu)
 * against the host packer (mm_sm90_pack_experts, itself tested against the
 * reference in test_sm90_pack): byte-identical records and row factors
 * (device outputs poisoned first), fold sums equal up to the order of
 * their additions, identical errors naming the same expert, in every mode,
 * on layers of more experts than one upload takes, with foldable and
 * unfoldable blocks, every E4M3 scale byte and NaN scales, and at GLM-5's
 * shapes; and the group16 -> group32 requant run on the GPU before the
 * packing against the host's requant and packer. Times:
 * bench/bench_pack_sm90. Skips without a GPU. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_harness.h"
#include "layout_sm90_pack.h"
#include "pack_sm90.h"
#include "sm90_pack_data.h"
#include "sm90_test_scales.h"

typedef struct {
  mm_err *err;
  uint8_t *w;
  float *rs;
  double fold[2];
} pack_out;

/* Packs experts[0 .. E) on the host (all cores) or the GPU;
 * outputs start poisoned (different bytes on each side). */
static pack_out run_pack(mm_expert_q *x, int E, mm_weight_mode mode, int gpu) {
  const int H = x[0].w13.cols, I = x[0].w2.cols;
  const mm_weight_mode rm = mm_sm90_record_mode(mode);
  const size_t bytes = (size_t)E * (mm_sm90_matrix_bytes(rm, 2 * I, H) + mm_sm90_matrix_bytes(rm, H, I));
  const size_t nrs = (size_t)E * (size_t)(2 * I + H);
  /* the sums are added to what the caller holds */
  pack_out o = {NULL, malloc(bytes), malloc(sizeof(float) * nrs), {1.5, 2.5}};
  memset(o.w, gpu ? 0xA5 : 0x5A, bytes);
  memset(o.rs, gpu ? 0x22 : 0x11, sizeof(float) * nrs);
  if (!gpu) {
    o.err = mm_sm90_pack_experts(x, E, 3, mode, 0, o.w, o.rs, o.rs + (size_t)E * (size_t)(2 * I),
                                 o.fold);
    return o;
  }
  uint8_t *dw = NULL;
  float *drs = NULL;
  if (cudaMalloc((void **)&dw, bytes) != cudaSuccess ||
      cudaMalloc((void **)&drs, sizeof(float) * nrs) != cudaSuccess) {
    cudaFree(dw);
    o.err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "test: cudaMalloc");
    return o;
  }
  cudaMemset(dw, 0xA5, bytes);
  cudaMemset(drs, 0x22, sizeof(float) * nrs);
  cudaStream_t st;
  cudaStreamCreate(&st);
  cudaDeviceSynchronize();
  o.err = mm_sm90_pack_experts_gpu(x, E, 3, mode, dw, drs, drs + (size_t)E * (size_t)(2 * I),
                                   o.fold, NULL, st);
  cudaMemcpy(o.w, dw, bytes, cudaMemcpyDeviceToHost);
  cudaMemcpy(o.rs, drs, sizeof(float) * nrs, cudaMemcpyDeviceToHost);
  cudaStreamDestroy(st);
  cudaFree(dw);
  cudaFree(drs);
  return o;
}

/* sums of up to 25M positive terms in another order: a few ulps per term at worst */
static int close_rel(double a, double b) { return fabs(a - b) <= 1e-8 * fabs(a) + 1e-300; }

/* Host and GPU packing of one layer; returns 1 if both failed alike. */
static int compare_layer(mm_expert_q *x, int E, mm_weight_mode mode, const char *what) {
  const int H = x[0].w13.cols, I = x[0].w2.cols;
  const mm_weight_mode rm = mm_sm90_record_mode(mode);
  const size_t bytes = (size_t)E * (mm_sm90_matrix_bytes(rm, 2 * I, H) + mm_sm90_matrix_bytes(rm, H, I));
  const size_t nrs = (size_t)E * (size_t)(2 * I + H);
  pack_out h = run_pack(x, E, mode, 0), g = run_pack(x, E, mode, 1);
  int both_failed = h.err && g.err;
  CHECK_MSG(!h.err == !g.err, "%s mode %d: host %s, GPU %s", what, (int)mode,
            h.err ? h.err->message : "ok", g.err ? g.err->message : "ok");
  if (h.err && g.err) {
    CHECK_EQ_INT(h.err->code, g.err->code);
    CHECK_MSG(strcmp(h.err->message, g.err->message) == 0, "messages differ:\n#  %s\n#  %s",
              h.err->message, g.err->message);
    printf("# %s mode %d: both refuse: %s\n", what, (int)mode, g.err->message);
  } else if (!h.err && !g.err) {
    size_t first = bytes;
    for (size_t i = 0; i < bytes && first == bytes; i++)
      if (h.w[i] != g.w[i]) first = i;
    CHECK_MSG(first == bytes, "%s mode %d: records differ from byte %zu of %zu", what, (int)mode,
              first, bytes);
    CHECK_MSG(memcmp(h.rs, g.rs, sizeof(float) * nrs) == 0, "%s mode %d: row factors differ",
              what, (int)mode);
    CHECK_MSG(close_rel(h.fold[0], g.fold[0]) && close_rel(h.fold[1], g.fold[1]),
              "%s mode %d: fold sums %.17g %.17g vs %.17g %.17g", what, (int)mode, h.fold[0],
              h.fold[1], g.fold[0], g.fold[1]);
    if (rm == MM_WMODE_G16_FP8) CHECK(g.fold[1] > 0.0 && g.fold[0] > 0.0);
  }
  mm_error_free(h.err);
  mm_error_free(g.err);
  free(h.w), free(h.rs), free(g.w), free(g.rs);
  return both_failed;
}

static void alloc_layer(mm_expert_q *x, int E, int H, int I, int g32) {
  for (int e = 0; e < E; e++) {
    CHECK(mm_qmat_alloc(&x[e].w13, 2 * I, H, g32 ? 32 : 16, g32 ? MM_SF_UE8M0 : MM_SF_E4M3) == 0);
    CHECK(mm_qmat_alloc(&x[e].w2, H, I, g32 ? 32 : 16, g32 ? MM_SF_UE8M0 : MM_SF_E4M3) == 0);
  }
}
static void free_layer(mm_expert_q *x, int E) {
  for (int e = 0; e < E; e++) {
    mm_qmat_free(&x[e].w13);
    mm_qmat_free(&x[e].w2);
  }
}

/* Layers of 1, 5 and 9 experts (more than one upload of 4): E, H, I. */
static const int kLayers[][3] = {{1, 128, 128}, {5, 256, 128}, {9, 384, 256}};

/* The layers of kLayers in every mode. */
static void test_random_layers(void) {
  for (int s = 0; s < 3; s++) {
    const int E = kLayers[s][0], H = kLayers[s][1], I = kLayers[s][2];
    mm_expert_q *x = calloc((size_t)E, sizeof *x);
    alloc_layer(x, E, H, I, 1);
    for (int e = 0; e < E; e++) {
      rand_g32(&x[e].w13, 14);
      rand_g32(&x[e].w2, 14);
    }
    CHECK(!compare_layer(x, E, MM_WMODE_G32_FP8, "g32"));
    CHECK(!compare_layer(x, E, MM_WMODE_G32_F16_EXACT, "g32"));
    free_layer(x, E);
    alloc_layer(x, E, H, I, 0);
    for (int e = 0; e < E; e++) {
      rand_g16(&x[e].w13, e % 2);
      rand_g16(&x[e].w2, (e + 1) % 2);
    }
    CHECK(!compare_layer(x, E, MM_WMODE_G16_BF16_EXACT, "g16"));
    CHECK(!compare_layer(x, E, MM_WMODE_G16_FP8, "g16"));
    free_layer(x, E);
    free(x);
  }
}

/* Mode 1's extremes: wide spreads (some blocks fold, some are refused),
 * the largest and smallest exponents; mode 3 with every E4M3 byte. */
static void test_extremes(void) {
  const int E = 6, H = 256, I = 128;
  mm_expert_q x[6];
  alloc_layer(x, E, H, I, 1);
  int refused = 0;
  for (int k = 0; k < 8; k++) {
    for (int e = 0; e < E; e++) { /* within 14: always foldable; 16, 17: often not */
      rand_g32(&x[e].w13, k % 2 ? 16 : 14);
      rand_g32(&x[e].w2, k % 2 ? 17 : 13);
    }
    if (k == 0) mm_test_g32_extreme_scales(&x[1].w13); /* its first 64 rows: [64, 256] */
    refused += compare_layer(x, E, MM_WMODE_G32_FP8, "g32 spread");
  }
  printf("# %d of the 4 wide-spread layers refused by both\n", refused);
  CHECK(refused > 0 && refused <= 4);
  free_layer(x, E);
  alloc_layer(x, E, H, I, 0);
  for (int e = 0; e < E; e++) {
    rand_g16(&x[e].w13, 1);
    rand_g16(&x[e].w2, 1);
    for (size_t i = 0; i < (size_t)H * (size_t)(I / 16); i++) {
      const uint8_t b = (uint8_t)((i + 37 * (size_t)e) % 256);
      x[e].w2.scales[i] = mm_e4m3_is_nan(b) ? 0x01 : b;
    }
  }
  CHECK(!compare_layer(x, E, MM_WMODE_G16_FP8, "g16 every byte"));
  CHECK(!compare_layer(x, E, MM_WMODE_G16_BF16_EXACT, "g16 every byte"));
  free_layer(x, E);
}

/* NaN scales and matrices the packers refuse: the first failing matrix,
 * in expert order, is named alike. */
static void test_errors(void) {
  const int E = 7, H = 256, I = 128;
  mm_expert_q x[7];
  alloc_layer(x, E, H, I, 0);
  for (int e = 0; e < E; e++) {
    rand_g16(&x[e].w13, 1);
    rand_g16(&x[e].w2, 1);
  }
  x[5].w2.scales[1000] = 0x7F; /* a later chunk */
  CHECK(compare_layer(x, E, MM_WMODE_G16_FP8, "NaN in expert 5"));
  x[5].w13.scales[7] = 0xFF; /* an earlier matrix of that expert */
  CHECK(compare_layer(x, E, MM_WMODE_G16_BF16_EXACT, "NaN in expert 5 w13"));
  x[1].w2.scales[2047] = 0xFF;
  CHECK(compare_layer(x, E, MM_WMODE_G16_FP8, "NaN in expert 1"));
  x[6].w2.gran = 32; /* a later format refusal: expert 1's NaN comes first */
  CHECK(compare_layer(x, E, MM_WMODE_G16_FP8, "NaN in expert 1, gran of expert 6 w2"));
  x[0].w2.gran = 32; /* refused by the format check, before expert 1's NaN */
  CHECK(compare_layer(x, E, MM_WMODE_G16_FP8, "gran of expert 0 w2"));
  x[0].w2.gran = 16;
  x[6].w2.gran = 16;
  for (int e = 0; e < E; e++) { /* no NaN left: a format refusal in the last upload only */
    rand_g16(&x[e].w13, 1);
    rand_g16(&x[e].w2, 1);
  }
  x[5].w2.gran = 32;
  CHECK(compare_layer(x, E, MM_WMODE_G16_BF16_EXACT, "gran of expert 5 w2"));
  x[5].w2.gran = 16;
  free_layer(x, E);
  alloc_layer(x, E, H, I, 1);
  for (int e = 0; e < E; e++) {
    rand_g32(&x[e].w13, 10);
    rand_g32(&x[e].w2, 10);
  }
  x[6].w13.scales[333] = 0xFF;
  CHECK(compare_layer(x, E, MM_WMODE_G32_FP8, "UE8M0 NaN in expert 6"));
  CHECK(compare_layer(x, E, MM_WMODE_G16_FP8, "gran 32 for mode 3"));
  free_layer(x, E);
}

/* GLM-5 shapes (H 6144, I 2048: 48 K-blocks per w13 row), 5 experts (two
 * uploads), every mode. */
static void test_glm_shapes(void) {
  const int E = 5, H = 6144, I = 2048;
  mm_expert_q x[5];
  for (int g = 1; g >= 0; g--) {
    alloc_layer(x, E, H, I, g);
    for (int e = 0; e < E; e++) {
      if (g) {
        rand_g32(&x[e].w13, 12);
        rand_g32(&x[e].w2, 12);
      } else {
        rand_g16(&x[e].w13, e % 2);
        rand_g16(&x[e].w2, 0);
      }
    }
    CHECK(!compare_layer(x, E, g ? MM_WMODE_G32_FP8 : MM_WMODE_G16_BF16_EXACT, "GLM-5"));
    CHECK(!compare_layer(x, E, g ? MM_WMODE_G32_F16_EXACT : MM_WMODE_G16_FP8, "GLM-5"));
    free_layer(x, E);
  }
}

/* ---- the requant on the GPU ---------------------------------------------- */

/* The host's requant of one group-16 expert into a group-32 one (row_scale
 * 1), each projection on its own as the loader runs it; stats [3]. */
static void host_requant(const mm_expert_q *src, mm_expert_q *dst, mm_requant_stats st[3]) {
  const int I = src->w2.cols, H = src->w2.rows;
  CHECK(mm_qmat_alloc(&dst->w13, 2 * I, H, 32, MM_SF_UE8M0) == 0);
  CHECK(mm_qmat_alloc(&dst->w2, H, I, 32, MM_SF_UE8M0) == 0);
  for (int p = 0; p < 3; p++) {
    const mm_qmat *m = p == 2 ? &src->w2 : &src->w13;
    mm_qmat *o = p == 2 ? &dst->w2 : &dst->w13;
    const int rows = p == 2 ? H : I;
    const size_t r0 = p == 1 ? (size_t)I : 0;
    const mm_g16_source g = mm_g16_rows(m, (int)r0, rows);
    mm_err *e = mm_requant_g16_to_g32(&g, o->codes + r0 * (size_t)(m->cols / 2),
                                      o->scales + r0 * (size_t)(m->cols / 32), 0, &st[p]);
    CHECK_MSG(!e, "host requant: %s", e ? e->message : "");
    mm_error_free(e);
  }
  for (int r = 0; r < 2 * I; r++) dst->w13.row_scale[r] = 1.0f;
  for (int r = 0; r < H; r++) dst->w2.row_scale[r] = 1.0f;
}

/* The GPU's requant and packing of experts[0 .. E) (group 16) against the
 * host's requant and the host packer: the same records and row factors,
 * statistics equal up to the order of additions within a row (relative
 * kStatsTol; the GPU adds a row's groups in another order, and the sums
 * differ in their last digits). max_abs is compared where with_max_abs (it
 * may differ where values underflow FP32 on the GPU: gpu_test_prep).
 * limit: requant.max-rel-error; returns the GPU's error (NULL: none). */
static const double kStatsTol = 1e-5;
static int g_requant_packed; /* compare_requant's calls that compared records */
static mm_err *compare_requant(mm_expert_q *x, int E, mm_weight_mode mode, double limit,
                               int with_max_abs, const char *what) {
  const int H = x[0].w13.cols, I = x[0].w2.cols;
  const size_t b13 = mm_sm90_matrix_bytes(MM_WMODE_G32_FP8, 2 * I, H),
               bytes = (size_t)E * (b13 + mm_sm90_matrix_bytes(MM_WMODE_G32_FP8, H, I));
  const size_t nrs = (size_t)E * (size_t)(2 * I + H);
  mm_expert_q *q = calloc((size_t)E, sizeof *q);
  mm_requant_stats *hst = calloc(3 * (size_t)E, sizeof *hst), *gst = calloc(3 * (size_t)E, sizeof *gst);
  for (int e = 0; e < E; e++) host_requant(&x[e], &q[e], &hst[3 * e]);
  pack_out h = run_pack(q, E, mode, 0);
  uint8_t *w = malloc(bytes), *dw = NULL;
  float *rs = malloc(sizeof(float) * nrs), *drs = NULL;
  mm_err *err = NULL;
  if (cudaMalloc((void **)&dw, bytes) != cudaSuccess ||
      cudaMalloc((void **)&drs, sizeof(float) * nrs) != cudaSuccess) {
    CHECK_MSG(0, "cudaMalloc");
    goto out;
  }
  cudaMemset(dw, 0xA5, bytes);
  cudaMemset(drs, 0x22, sizeof(float) * nrs);
  memset(gst, 0x5A, 3 * (size_t)E * sizeof *gst); /* the packer zeroes them first */
  cudaDeviceSynchronize();
  const mm_sm90_requant rq = {40, limit, gst};
  double fold[2] = {0, 0};
  err = mm_sm90_pack_experts_gpu(x, E, 3, mode, dw, drs, drs + (size_t)E * (size_t)(2 * I), fold,
                                 &rq, NULL);
  if (h.err) { /* the host packer's refusal, word for word */
    CHECK_MSG(err && h.err->code == err->code && !strcmp(h.err->message, err->message),
              "%s mode %d: host %s, GPU %s", what, (int)mode, h.err->message,
              err ? err->message : "ok");
    printf("# %s mode %d: both refuse: %s\n", what, (int)mode, h.err->message);
    mm_error_free(err);
    err = NULL;
    goto out;
  }
  if (err) goto out; /* the requant's refusal: the caller's to check */
  cudaMemcpy(w, dw, bytes, cudaMemcpyDeviceToHost);
  cudaMemcpy(rs, drs, sizeof(float) * nrs, cudaMemcpyDeviceToHost);
  size_t first = bytes;
  for (size_t i = 0; i < bytes && first == bytes; i++)
    if (w[i] != h.w[i]) first = i;
  CHECK_MSG(first == bytes, "%s mode %d: records differ from byte %zu of %zu (expert %zu)", what,
            (int)mode, first, bytes, first / (bytes / (size_t)E));
  CHECK_MSG(memcmp(rs, h.rs, sizeof(float) * nrs) == 0, "%s: row factors differ", what);
  for (int t = 0; t < 3 * E; t++) {
    CHECK_EQ_INT((int)gst[t].count, (int)hst[t].count);
    CHECK_NEAR(gst[t].src_sq, hst[t].src_sq, kStatsTol * hst[t].src_sq + 1e-300);
    CHECK_NEAR(gst[t].rel_rms, hst[t].rel_rms, kStatsTol * hst[t].rel_rms + 1e-12);
    if (with_max_abs && hst[t].max_abs > 1e-30)
      CHECK_NEAR(gst[t].max_abs, hst[t].max_abs, kStatsTol * hst[t].max_abs);
  }
  g_requant_packed++;
  printf("# %s mode %d: %d experts identical; rel RMS of expert 0 gate %.6g (host %.6g)\n", what,
         (int)mode, E, gst[0].rel_rms, hst[0].rel_rms);
out:
  cudaFree(dw);
  cudaFree(drs);
  for (int e = 0; e < E; e++) {
    mm_qmat_free(&q[e].w13);
    mm_qmat_free(&q[e].w2);
  }
  free(q), free(hst), free(gst), free(w), free(rs), free(h.w), free(h.rs);
  mm_error_free(h.err);
  return err;
}

/* NVFP4 (E4M3 scales, gate and up globals apart) and UE8M0 group-16 layers
 * of kLayers' shapes, requantized and packed on the GPU in modes 1 and
 * 4; every E4M3 scale byte (subnormal ones among them); the limit. */
static void test_requant(void) {
  for (int s = 0; s < 3; s++) {
    const int E = kLayers[s][0], H = kLayers[s][1], I = kLayers[s][2];
    mm_expert_q *x = calloc((size_t)E, sizeof *x);
    alloc_layer(x, E, H, I, 0);
    for (int e = 0; e < E; e++) {
      rand_g16(&x[e].w13, 0);
      rand_g16(&x[e].w2, 0);
      const float gate = mm_test_uniform(1e-3f, 1e-2f), up = e % 2 ? gate : 2.5f * gate;
      for (int r = 0; r < 2 * I; r++) x[e].w13.row_scale[r] = r < I ? gate : up;
      for (int r = 0; r < H; r++) x[e].w2.row_scale[r] = 7e-3f;
    }
    mm_err *err = compare_requant(x, E, MM_WMODE_G32_FP8, INFINITY, 1, "nvfp4");
    CHECK_MSG(!err, "%s", err ? err->message : "");
    mm_error_free(err);
    err = compare_requant(x, E, MM_WMODE_G32_F16_EXACT, INFINITY, 1, "nvfp4");
    CHECK_MSG(!err, "%s", err ? err->message : "");
    mm_error_free(err);
    /* UE8M0 group 16, no globals: scale bytes over 2^40 (mode 1 cannot fold
     * such rows: both packers refuse, in the same words) and over 2^8 (both
     * pack) */
    for (int spread = 40; spread >= 8; spread -= 32) {
      for (int e = 0; e < E; e++) {
        x[e].w13.sf = x[e].w2.sf = MM_SF_UE8M0;
        for (size_t i = 0; i < (size_t)(2 * I) * (size_t)(H / 16); i++)
          x[e].w13.scales[i] = (uint8_t)(100 + mm_test_rand_u64() % (uint64_t)spread);
        for (size_t i = 0; i < (size_t)H * (size_t)(I / 16); i++)
          x[e].w2.scales[i] = (uint8_t)(110 + mm_test_rand_u64() % (uint64_t)spread);
        for (int r = 0; r < 2 * I; r++) x[e].w13.row_scale[r] = 1.0f;
        for (int r = 0; r < H; r++) x[e].w2.row_scale[r] = 1.0f;
      }
      const int packed = g_requant_packed;
      err = compare_requant(x, E, MM_WMODE_G32_FP8, INFINITY, 1, "ue8m0-g16");
      CHECK_MSG(!err, "%s", err ? err->message : "");
      mm_error_free(err);
      if (spread == 8) CHECK_MSG(g_requant_packed == packed + 1, "ue8m0-g16 over 2^8 refused");
    }
    free_layer(x, E);
    free(x);
  }
  /* every E4M3 byte in w13 (one per K block, so that mode 1 folds every
   * block; the two halves of a group 32 one byte apart: negative, zero and
   * subnormal scales among them); max_abs not compared */
  const int E = 3, H = 256, I = 128;
  mm_expert_q x[3];
  alloc_layer(x, E, H, I, 0);
  for (int e = 0; e < E; e++) {
    rand_g16(&x[e].w13, 1);
    rand_g16(&x[e].w2, 0);
    for (size_t i = 0; i < (size_t)(2 * I) * (size_t)(H / 16); i++) {
      const uint8_t b = (uint8_t)((i / 8 + i % 2 + 11 * (size_t)e) % 256);
      x[e].w13.scales[i] = mm_e4m3_is_nan(b) ? 0x00 : b;
    }
  }
  mm_err *err = compare_requant(x, E, MM_WMODE_G32_FP8, INFINITY, 0, "every E4M3 byte");
  CHECK_MSG(!err, "%s", err ? err->message : "");
  mm_error_free(err);
  /* The limit: expert 0 requantizes exactly (scales and row factors 1), so
   * a limit below expert 1's gate_proj error refuses that tensor first. */
  for (int e = 0; e < E; e++) {
    rand_g16(&x[e].w13, 0);
    rand_g16(&x[e].w2, 0);
  }
  memset(x[0].w13.scales, 0x38, (size_t)(2 * I) * (size_t)(H / 16));
  memset(x[0].w2.scales, 0x38, (size_t)H * (size_t)(I / 16));
  for (int r = 0; r < 2 * I; r++) x[0].w13.row_scale[r] = 1.0f;
  for (int r = 0; r < H; r++) x[0].w2.row_scale[r] = 1.0f;
  mm_requant_stats st[3][3];
  mm_expert_q q[3];
  for (int e = 0; e < E; e++) host_requant(&x[e], &q[e], st[e]);
  CHECK(st[0][0].rel_rms == 0.0 && st[0][1].rel_rms == 0.0 && st[0][2].rel_rms == 0.0);
  CHECK(st[1][0].rel_rms > 0.0);
  const double limit = 0.5 * st[1][0].rel_rms;
  err = compare_requant(x, E, MM_WMODE_G32_FP8, limit, 1, "limit");
  char want[512];
  mm_err *host_err = mm_requant_limit_error("experts.41.gate_proj", &st[1][0], limit);
  CHECK(err && host_err);
  if (err && host_err) {
    CHECK_EQ_INT(err->code, host_err->code);
    /* the same words up to the fourth digit of the GPU's own sums */
    snprintf(want, sizeof want, "%.*s", (int)(strstr(host_err->message, "error ") - host_err->message),
             host_err->message);
    CHECK_MSG(strncmp(err->message, want, strlen(want)) == 0 &&
                  strstr(err->message, "exceeds requant.max-rel-error"),
              "GPU: %s\n#  host: %s", err->message, host_err->message);
    printf("# %s\n", err->message);
  }
  mm_error_free(err);
  mm_error_free(host_err);
  for (int e = 0; e < E; e++) {
    mm_qmat_free(&q[e].w13);
    mm_qmat_free(&q[e].w2);
  }
  free_layer(x, E);
}

int main(void) {
  if (!mm_test_have_gpu()) return mm_test_skip_all("no GPU");
  mm_test_seed();
  RUN(test_random_layers);
  RUN(test_extremes);
  RUN(test_errors);
  RUN(test_requant);
  if (!getenv("MEGAMOE_TEST_QUICK")) RUN(test_glm_shapes);
  return mm_test_done();
}

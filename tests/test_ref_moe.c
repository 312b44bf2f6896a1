/* test_ref_moe.c -- the CPU reference MoE layer against a separate, naive
 * float64 implementation written from the numerics spec (ref_moe.h), on fresh
 * random inputs of several shapes, plus edge cases. */
#include <math.h>

#include "cpu_simd.h"
#include "formats.h"
#include "harness.h"
#include "ref_moe.h"

static uint16_t rand_bf16(float scale) { return mm_float_to_bf16(mm_test_normal() * scale); }

/* Random quantized matrix: gran 16 -> E4M3 scales + per-row global,
 * gran 32 -> UE8M0 scales. */
static void make_qmat(mm_qmat *m, int rows, int cols, int gran) {
  CHECK(mm_qmat_alloc(m, rows, cols, gran, gran == 16 ? MM_SF_E4M3 : MM_SF_UE8M0) == 0);
  for (size_t i = 0; i < (size_t)rows * cols / 2; i++) m->codes[i] = (uint8_t)mm_test_rand_u64();
  for (size_t i = 0; i < (size_t)rows * (cols / gran); i++)
    m->scales[i] = gran == 16 ? (uint8_t)(0x20 + mm_test_rand_u64() % 0x30) /* 2^-3 .. 2^3 */
                              : (uint8_t)(120 + mm_test_rand_u64() % 8);
  float global = gran == 16 ? mm_test_uniform(0.001f, 0.01f) : 1.0f;
  for (int r = 0; r < rows; r++) m->row_scale[r] = global;
}

/* Naive: dequantize everything to double first. */
static double wval(const mm_qmat *m, int r, int k) {
  const uint8_t *row = m->codes + (size_t)r * (m->cols / 2);
  uint8_t c = (uint8_t)((row[k / 2] >> (4 * (k % 2))) & 15);
  double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  double v = (c & 8) ? -mag[c & 7] : mag[c & 7];
  uint8_t sb = m->scales[(size_t)r * (m->cols / m->gran) + k / m->gran];
  double s = m->sf == MM_SF_E4M3 ? (double)mm_e4m3_to_float(sb) : ldexp(1.0, sb - 127);
  return v * s;
}

static void naive_quant(const float *v, int n, double *deq) {
  for (int b = 0; b < n / 128; b++) {
    float amax = 0;
    for (int i = 0; i < 128; i++) amax = fmaxf(amax, fabsf(v[b * 128 + i]));
    if (amax < 1e-4f) amax = 1e-4f;
    float scale = amax / 448.0f, inv = 448.0f / amax;
    for (int i = 0; i < 128; i++)
      deq[b * 128 + i] = (double)mm_e4m3_to_float(mm_float_to_e4m3(v[b * 128 + i] * inv)) * scale;
  }
}

static void naive_layer(const mm_ref_layer_args *a, float *out_f32) {
  int H = a->H, I = a->I;
  double *x = calloc((size_t)H, sizeof(double)), *act = calloc((size_t)I, sizeof(double));
  float *xf = calloc((size_t)H, sizeof(float)), *af = calloc((size_t)I, sizeof(float));
  for (int t = 0; t < a->T; t++) {
    for (int c = 0; c < H; c++) xf[c] = mm_bf16_to_float(a->hidden[(size_t)t * H + c]);
    naive_quant(xf, H, x);
    for (int c = 0; c < H; c++) out_f32[(size_t)t * H + c] = 0.0f;
    for (int k = 0; k < a->top_k; k++) {
      int id = a->topk_ids[t * a->top_k + k];
      if (id < 0) continue;
      const mm_expert_q *e = &a->experts[id - a->first_expert];
      float w = a->topk_weights[t * a->top_k + k] * a->routed_scaling_factor;
      for (int c = 0; c < I; c++) {
        double g = 0, u = 0;
        for (int kk = H - 1; kk >= 0; kk--) { /* other order than the reference */
          g += x[kk] * wval(&e->w13, c, kk);
          u += x[kk] * wval(&e->w13, I + c, kk);
        }
        float gf = mm_round_bf16((float)(g * e->w13.row_scale[c]));
        float uf = mm_round_bf16((float)(u * e->w13.row_scale[I + c]));
        if (a->activation_clamp > 0) {
          gf = fminf(gf, a->activation_clamp);
          uf = fmaxf(-a->activation_clamp, fminf(uf, a->activation_clamp));
        }
        float silu = gf / (1.0f + expf(-gf));
        af[c] = (silu * uf) * w;
      }
      naive_quant(af, I, act);
      for (int n = 0; n < H; n++) {
        double y = 0;
        for (int c = I - 1; c >= 0; c--) y += act[c] * wval(&e->w2, n, c);
        out_f32[(size_t)t * H + n] += mm_round_bf16((float)(y * e->w2.row_scale[n]));
      }
    }
  }
  free(x);
  free(act);
  free(xf);
  free(af);
}

static void run_case(int T, int H, int I, int E, int K, int gran, int pattern, float clamp) {
  mm_expert_q *ex = calloc((size_t)E, sizeof *ex);
  for (int e = 0; e < E; e++) {
    make_qmat(&ex[e].w13, 2 * I, H, gran);
    make_qmat(&ex[e].w2, H, I, gran);
  }
  uint16_t *hid = malloc(sizeof(uint16_t) * (size_t)T * H + 2);
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * K + 4);
  float *tw = malloc(sizeof(float) * (size_t)T * K + 4);
  for (size_t i = 0; i < (size_t)T * H; i++) hid[i] = pattern == 2 ? 0 : rand_bf16(1.0f);
  for (size_t i = 0; i < (size_t)T * K; i++) {
    ids[i] = pattern == 1 ? 0 : (int)(mm_test_rand_u64() % (uint64_t)E);
    if (pattern == 3 && mm_test_rand_u64() % 3 == 0) ids[i] = -1; /* masked */
    tw[i] = mm_test_uniform(0.0f, 1.0f);
  }
  uint16_t *out = malloc(sizeof(uint16_t) * (size_t)T * H + 2);
  float *of = malloc(sizeof(float) * (size_t)T * H + 2), *nv = malloc(sizeof(float) * (size_t)T * H + 2);
  for (size_t i = 0; i < (size_t)T * H; i++) { out[i] = 0xFFFF; of[i] = NAN; }
  mm_ref_layer_args a = {T, H, I, K, E, 0, E, ex, hid, ids, tw, 2.5f, clamp, 2, out, of};
  CHECK_OK(mm_ref_moe_layer(&a));
  naive_layer(&a, nv);
  double num = 0, den = 0;
  int nan = 0, bf16_mismatch = 0;
  for (size_t i = 0; i < (size_t)T * H; i++) {
    if (isnan(of[i]) || out[i] == 0xFFFF) nan++;
    num += ((double)of[i] - nv[i]) * ((double)of[i] - nv[i]);
    den += (double)nv[i] * nv[i];
    if (mm_float_to_bf16(of[i]) != out[i]) bf16_mismatch++;
  }
  double rel = den > 0 ? sqrt(num / den) : sqrt(num);
  printf("# T=%d H=%d I=%d E=%d k=%d gran=%d pattern=%d clamp=%g: rel %.3g\n", T, H, I, E, K, gran,
         pattern, clamp, rel);
  CHECK_EQ_INT(nan, 0);
  CHECK_EQ_INT(bf16_mismatch, 0);
  CHECK_MSG(rel < 1e-6, "relative error %g", rel);
  if (pattern == 2) CHECK(den == 0); /* zero input -> exactly zero output */
  for (int e = 0; e < E; e++) {
    mm_qmat_free(&ex[e].w13);
    mm_qmat_free(&ex[e].w2);
  }
  free(ex); free(hid); free(ids); free(tw); free(out); free(of); free(nv);
}

static void test_random_shapes(void) {
  run_case(5, 256, 128, 4, 2, 16, 0, 0);
  run_case(7, 384, 256, 3, 3, 32, 0, 0);
  run_case(3, 128, 128, 1, 1, 32, 0, 0);
  run_case(9, 256, 128, 6, 4, 16, 0, 3.0f);
}
static void test_all_tokens_one_expert(void) { run_case(6, 256, 128, 4, 2, 32, 1, 0); }
static void test_zero_hidden(void) { run_case(4, 128, 128, 2, 2, 16, 2, 0); }
static void test_masked_and_empty_experts(void) { run_case(8, 256, 128, 8, 3, 16, 3, 0); }

static void test_bad_ids(void) {
  mm_expert_q ex;
  make_qmat(&ex.w13, 256, 128, 32);
  make_qmat(&ex.w2, 128, 128, 32);
  uint16_t hid[128] = {0}, out[128];
  int32_t ids[1] = {5};
  float tw[1] = {1};
  mm_ref_layer_args a = {1, 128, 128, 1, 4, 0, 1, &ex, hid, ids, tw, 1.0f, 0, 1, out, NULL};
  CHECK_ERR(mm_ref_moe_layer(&a), MEGAMOE_CODE_INVALID_ARGUMENT); /* not local */
  ids[0] = 4;
  CHECK_ERR(mm_ref_moe_layer(&a), MEGAMOE_CODE_INVALID_ARGUMENT); /* >= num_experts */
  ids[0] = -2;
  CHECK_ERR(mm_ref_moe_layer(&a), MEGAMOE_CODE_INVALID_ARGUMENT);
  ids[0] = -1;
  CHECK_OK(mm_ref_moe_layer(&a));
  for (int i = 0; i < 128; i++) CHECK(out[i] == 0); /* masked: zero contribution */
  a.T = 0;
  CHECK_OK(mm_ref_moe_layer(&a));
  mm_qmat_free(&ex.w13);
  mm_qmat_free(&ex.w2);
}

/* One expert with scales 2^-6 .. 2^8 and m rows of FP8 inputs without NaN. */
typedef struct {
  mm_expert_q ex;
  uint8_t *xq;
  float *xs, *rw;
} expert_case;

static void make_expert_case(expert_case *c, int H, int I, int m) {
  make_qmat(&c->ex.w13, 2 * I, H, 16);
  make_qmat(&c->ex.w2, H, I, 16);
  for (size_t i = 0; i < (size_t)2 * I * (H / 16); i++)
    c->ex.w13.scales[i] = (uint8_t)(0x08 + mm_test_rand_u64() % 0x70); /* 2^-6 .. 2^8 */
  for (size_t i = 0; i < (size_t)H * (I / 16); i++)
    c->ex.w2.scales[i] = (uint8_t)(0x08 + mm_test_rand_u64() % 0x70);
  c->xq = malloc((size_t)m * H);
  c->xs = malloc(sizeof(float) * (size_t)m * (H / 128));
  c->rw = malloc(sizeof(float) * (size_t)m);
  for (size_t i = 0; i < (size_t)m * H; i++) {
    uint8_t b = (uint8_t)mm_test_rand_u64();
    c->xq[i] = (b & 0x7F) == 0x7F ? 0x7E : b; /* no NaN */
  }
  for (int i = 0; i < m * (H / 128); i++) c->xs[i] = mm_test_uniform(1e-3f, 1.0f);
  for (int i = 0; i < m; i++) c->rw[i] = mm_test_uniform(0.1f, 1.0f);
}

static void free_expert_case(expert_case *c) {
  free(c->xq);
  free(c->xs);
  free(c->rw);
  mm_qmat_free(&c->ex.w13);
  mm_qmat_free(&c->ex.w2);
}

/* A token's output does not depend on the tokens that share its expert's
 * call (the reference takes tokens 4 at a time, then one by one), nor on
 * the thread count: a call of 7 tokens against one call per token, and 1
 * against 3 threads, bit for bit. Wide scale ranges, so that the float64
 * sums can round. */
static void test_batch_invariance(void) {
  const int H = 512, I = 256, m = 7;
  expert_case c;
  make_expert_case(&c, H, I, m);
  uint16_t *all = malloc(sizeof(uint16_t) * (size_t)m * H), *all3 = malloc(sizeof(uint16_t) * (size_t)m * H);
  uint16_t *one = malloc(sizeof(uint16_t) * (size_t)H);
  mm_ref_expert_rows_mt(&c.ex, m, c.xq, c.xs, c.rw, 0.0f, 1, all);
  mm_ref_expert_rows_mt(&c.ex, m, c.xq, c.xs, c.rw, 0.0f, 3, all3);
  int diff_threads = 0, diff_batch = 0, nan = 0;
  for (size_t i = 0; i < (size_t)m * H; i++) {
    diff_threads += all[i] != all3[i];
    nan += (all[i] & 0x7FFF) > 0x7F80;
  }
  for (int t = 0; t < m; t++) {
    mm_ref_expert_rows_mt(&c.ex, 1, c.xq + (size_t)t * H, c.xs + (size_t)t * (H / 128), &c.rw[t],
                          0.0f, 2, one);
    for (int k = 0; k < H; k++) diff_batch += one[k] != all[(size_t)t * H + k];
  }
  CHECK_EQ_INT(nan, 0);
  CHECK_EQ_INT(diff_threads, 0);
  CHECK_EQ_INT(diff_batch, 0);
  free(all); free(all3); free(one);
  free_expert_case(&c);
}

/* NaN and Inf inputs: a token's row is the same alone as in a batch, bit
 * for bit, NaN payloads included, in both builds of the dot products. The
 * sums meet NaNs of both signs, and which payload an add keeps depends on its
 * operand order, which the 4-token and the 1-token loops need not share, so
 * the reference's sums give the one quiet NaN (0x7FC0 in BF16).
 * fuzz_abi_tensors found a case where they did not, built with clang; its
 * input is in tests/fuzz/corpus/abi_tensors/. With gcc 12 and clang 14 these
 * shapes happened to pass before the fix too. */
static void test_nan_batch_invariance(void) {
  const int H = 512, I = 128, m = 6;
  expert_case c;
  make_expert_case(&c, H, I, m);
  for (int t = 0; t < m; t += 2) /* E4M3 NaN of both signs in tokens 0, 2, 4 */
    for (int k = t; k < H; k += 37) c.xq[(size_t)t * H + k] = (uint8_t)(k & 64 ? 0xFF : 0x7F);
  c.xs[3 * (H / 128) + 1] = INFINITY; /* token 3: 0 x Inf and +-Inf */
  for (int b = 0; b < H / 128; b++) c.xs[5 * (H / 128) + b] = 1e30f; /* token 5: L1 overflows */
  uint16_t *all = malloc(sizeof(uint16_t) * (size_t)m * H), *one = malloc(sizeof(uint16_t) * (size_t)H);
  for (int mode = 0; mode < 2; mode++) {
    if (mm_cpu_simd_set(mode) != mode) continue; /* no AVX2 here */
    mm_ref_expert_rows_mt(&c.ex, m, c.xq, c.xs, c.rw, 0.0f, 1, all);
    int diff = 0, nan_rows = 0, other_nans = 0;
    for (int t = 0; t < m; t++) {
      mm_ref_expert_rows_mt(&c.ex, 1, c.xq + (size_t)t * H, c.xs + (size_t)t * (H / 128), &c.rw[t],
                            0.0f, 1, one);
      for (int k = 0; k < H; k++) {
        const uint16_t v = all[(size_t)t * H + k];
        diff += one[k] != v;
        other_nans += (v & 0x7FFF) > 0x7F80 && v != 0x7FC0;
      }
      nan_rows += (all[(size_t)t * H] & 0x7FFF) > 0x7F80;
    }
    CHECK_EQ_INT(diff, 0);
    CHECK_EQ_INT(other_nans, 0); /* every NaN is the one quiet NaN */
    CHECK_EQ_INT(nan_rows, 5); /* tokens 0, 2, 3, 4 and 5 */
  }
  mm_cpu_simd_set(-1);
  free(all);
  free(one);
  free_expert_case(&c);
}

/* The AVX2 build of the dot products gives the baseline build's bits: 9 rows
 * (two blocks of 4 tokens and one alone), with and without a clamp. */
static void test_simd_identical(void) {
  const int H = 768, I = 384, m = 9;
  if (!mm_cpu_simd_set(1)) {
    printf("# this CPU has no AVX2 (or the build no x86-64 path): baseline only\n");
    mm_cpu_simd_set(-1);
    return;
  }
  expert_case c;
  make_expert_case(&c, H, I, m);
  uint16_t *v = malloc(sizeof(uint16_t) * (size_t)m * H), *base = malloc(sizeof(uint16_t) * (size_t)m * H);
  for (int clamped = 0; clamped < 2; clamped++) {
    const float clamp = clamped ? 3.0f : 0.0f;
    for (size_t i = 0; i < (size_t)m * H; i++) v[i] = base[i] = 0x7FC1; /* poison */
    CHECK_EQ_INT(mm_cpu_simd_set(1), 1);
    mm_ref_expert_rows_mt(&c.ex, m, c.xq, c.xs, c.rw, clamp, 2, v);
    CHECK_EQ_INT(mm_cpu_simd_set(0), 0);
    mm_ref_expert_rows_mt(&c.ex, m, c.xq, c.xs, c.rw, clamp, 2, base);
    int diff = 0, nan = 0;
    for (size_t i = 0; i < (size_t)m * H; i++) {
      diff += v[i] != base[i];
      nan += (v[i] & 0x7FFF) > 0x7F80;
    }
    CHECK_EQ_INT(nan, 0);
    CHECK_EQ_INT(diff, 0);
  }
  mm_cpu_simd_set(-1);
  free(v);
  free(base);
  free_expert_case(&c);
}

int main(void) {
  mm_test_seed();
  RUN(test_random_shapes);
  RUN(test_all_tokens_one_expert);
  RUN(test_zero_hidden);
  RUN(test_masked_and_empty_experts);
  RUN(test_bad_ids);
  RUN(test_batch_invariance);
  RUN(test_nan_batch_invariance);
  RUN(test_simd_identical);
  return mm_test_done();
}

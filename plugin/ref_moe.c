/* ref_moe.c -- CPU reference of the MoE layer (see ref_moe.h for the order
 * of roundings). Deliberately plain: decode a weight row to floats, take dot
 * products in float64, round where the GPU rounds. */
#include "ref_moe.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"
#include "parallel.h"

/* Code and scale-byte values, looked up instead of decoded per weight.
 * The scale too, though it changes once per group: decoding it there
 * (mm_qmat_group_scale) made a 1-token call 1.7x slower (186 against 112 ms
 * per 16-expert GLM-5 layer on 2 cores). */
typedef struct {
  float e2m1[16];
  float scale[256]; /* E4M3 or UE8M0 by the matrix's format */
} decode_tables;

static void decode_tables_init(decode_tables *t, mm_scale_format sf) {
  for (int c = 0; c < 16; c++) t->e2m1[c] = mm_e2m1_to_float((uint8_t)c);
  for (int b = 0; b < 256; b++)
    t->scale[b] = sf == MM_SF_E4M3 ? mm_e4m3_to_float((uint8_t)b) : mm_ue8m0_to_float((uint8_t)b);
}

/* Decodes row r of m (e2m1 * group scale, exact in FP32 and so in FP64)
 * into w[cols]: a 16-entry table per group, then a lookup per code. */
static inline MM_ALWAYS_INLINE void decode_row(const mm_qmat *m, const decode_tables *t, int r,
                                               double *w) {
  const uint8_t *codes = m->codes + (size_t)r * (size_t)(m->cols / 2);
  const uint8_t *scales = m->scales + (size_t)r * (size_t)(m->cols / m->gran);
  const int groups = m->cols / m->gran;
  for (int g = 0; g < groups; g++) {
    const float s = t->scale[scales[g]];
    double tab[16];
    for (int c = 0; c < 16; c++) tab[c] = (double)(t->e2m1[c] * s);
    const uint8_t *b = codes + (size_t)g * (size_t)(m->gran / 2);
    double *wg = w + (size_t)g * (size_t)m->gran;
    for (int j = 0; j < m->gran / 2; j++) {
      wg[2 * j] = tab[b[j] & 15];
      wg[2 * j + 1] = tab[b[j] >> 4];
    }
  }
}

/* out[t] = sum_k x[t][k] * w[k] for tokens t < nt (x rows ldx apart), each
 * in four partial sums (k mod 4) added as (s0 + s1) + (s2 + s3): a token's
 * result is the same whichever tokens share the call, and the same for any
 * thread count. Several tokens per pass read each weight once from the
 * cache for all of them; the partial sums are independent chains (one chain
 * would wait on the adder's latency at every element). nt is a constant at
 * each call (4, or 1 for the tail), so once inlined the token loop unrolls
 * and the sums stay in registers (a token's four in one AVX2 register). */
static inline MM_ALWAYS_INLINE void dots(const double *x, size_t ldx, int nt, const double *w,
                                         int K, double *out) {
  double acc[4][4] = {{0}};
  int k = 0;
  for (; k + 4 <= K; k += 4)
    _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)
      for (int l = 0; l < 4; l++) acc[t][l] += x[(size_t)t * ldx + (size_t)(k + l)] * w[k + l];
  for (; k < K; k++)
    for (int t = 0; t < nt; t++) acc[t][0] += x[(size_t)t * ldx + (size_t)k] * w[k];
  for (int t = 0; t < nt; t++) out[t] = (acc[t][0] + acc[t][1]) + (acc[t][2] + acc[t][3]);
}

/* y[i][n] = (float)(row_scale[n] * sum_k x[i][k] * W[n][k]) for rows n in
 * [begin, end); x is dequantized activations in double [m, K]. */
typedef struct {
  const mm_qmat *w;
  const double *x;
  int m;
  float *y; /* [m, w->rows] */
} gemm_job;

static inline MM_ALWAYS_INLINE void gemm_rows_body(void *ctx, size_t begin, size_t end) {
  gemm_job *j = ctx;
  int K = j->w->cols;
  double *wrow = malloc(sizeof(double) * (size_t)K);
  decode_tables *tabs = malloc(sizeof *tabs);
  if (!wrow || !tabs) { /* outputs stay poisoned; callers check for NaN */
    free(wrow);
    free(tabs);
    return;
  }
  decode_tables_init(tabs, j->w->sf);
  for (size_t n = begin; n < end; n++) {
    decode_row(j->w, tabs, (int)n, wrow);
    for (int i = 0; i < j->m; i += 4) {
      double acc[4];
      const double *xi = j->x + (size_t)i * (size_t)K;
      if (j->m - i >= 4)
        dots(xi, (size_t)K, 4, wrow, K, acc);
      else
        for (int t = 0; t < j->m - i; t++) dots(xi + (size_t)t * (size_t)K, (size_t)K, 1, wrow, K, &acc[t]);
      /* A NaN sum leaves as the one quiet NaN: which NaN's payload an add
       * keeps depends on its operand order, which the two builds and the
       * 1- and 4-token loops need not share (docs/RELIABILITY.md). */
      for (int t = 0; t < 4 && i + t < j->m; t++) {
        const double v = acc[t] * (double)j->w->row_scale[n];
        j->y[(size_t)(i + t) * (size_t)j->w->rows + n] = v != v ? NAN : (float)v;
      }
    }
  }
  free(wrow);
  free(tabs);
}

/* The row loop for AVX2 (a token's four partial sums in one register) and
 * for the baseline ISA (cpu_simd.h). Each product is exact in FP64 (an
 * E4M3 x FP32 activation times an e2m1 x scale weight: at most 34
 * significant bits), so FMA or not, both give the same bits
 * (test_ref_moe's test_simd_identical). */
static void gemm_rows_base(void *ctx, size_t begin, size_t end) { gemm_rows_body(ctx, begin, end); }
#if MM_HAVE_AVX2_CLONES
MM_TARGET_AVX2 static void gemm_rows_avx2(void *ctx, size_t begin, size_t end) {
  gemm_rows_body(ctx, begin, end);
}
#endif

static mm_range_fn gemm_rows_fn(void) {
#if MM_HAVE_AVX2_CLONES
  if (mm_cpu_avx2()) return gemm_rows_avx2;
#endif
  return gemm_rows_base;
}

static void dequant_act(const uint8_t *q, const float *s, int m, int K, double *x) {
  int blocks = K / MM_ACT_BLOCK;
  for (int i = 0; i < m; i++)
    for (int k = 0; k < K; k++)
      x[(size_t)i * K + k] =
          (double)mm_e4m3_to_float(q[(size_t)i * K + k]) * (double)s[(size_t)i * blocks + k / MM_ACT_BLOCK];
}

void mm_ref_expert_rows_mt(const mm_expert_q *e, int m, const uint8_t *xq,
                           const float *xs, const float *row_weight, float clamp,
                           int threads, uint16_t *out) {
  if (m <= 0) return;
  const int H = e->w13.cols, I = e->w2.cols;
  const int nthreads = mm_thread_count(threads);
  double *x = malloc(sizeof(double) * (size_t)m * (size_t)(H > I ? H : I));
  float *h = malloc(sizeof(float) * (size_t)m * 2 * (size_t)I);
  float *a = malloc(sizeof(float) * (size_t)I);
  uint8_t *aq = malloc((size_t)m * (size_t)I);
  float *as = malloc(sizeof(float) * (size_t)m * (size_t)(I / MM_ACT_BLOCK));
  float *y = malloc(sizeof(float) * (size_t)m * (size_t)H);
  if (!x || !h || !a || !aq || !as || !y) {
    for (size_t i = 0; i < (size_t)m * (size_t)H; i++) out[i] = 0x7FC0; /* NaN: visible */
    goto done;
  }
  for (size_t i = 0; i < (size_t)m * 2 * (size_t)I; i++) h[i] = NAN; /* poison */
  for (size_t i = 0; i < (size_t)m * (size_t)H; i++) y[i] = NAN;
  /* L1: [m, H] x [2I, H]^T */
  dequant_act(xq, xs, m, H, x);
  gemm_job j1 = {&e->w13, x, m, h};
  mm_parallel_for((size_t)(2 * I), nthreads, gemm_rows_fn(), &j1);
  /* SwiGLU with the top-k weight, then FP8 per 128 channels. */
  for (int i = 0; i < m; i++) {
    const float *hi = h + (size_t)i * 2 * (size_t)I;
    for (int c = 0; c < I; c++) {
      float g = mm_round_bf16(hi[c]), u = mm_round_bf16(hi[I + c]);
      if (clamp > 0.0f) {
        g = mm_clamp_gate(g, clamp);
        u = mm_clamp_up(u, clamp);
      }
      a[c] = mm_swiglu_weighted(g, u, row_weight[i]);
    }
    for (int b = 0; b < I / MM_ACT_BLOCK; b++)
      mm_quant_fp8_block(a + b * MM_ACT_BLOCK, MM_ACT_BLOCK,
                         aq + (size_t)i * I + (size_t)b * MM_ACT_BLOCK,
                         as + (size_t)i * (I / MM_ACT_BLOCK) + b);
  }
  /* L2: [m, I] x [H, I]^T */
  dequant_act(aq, as, m, I, x);
  gemm_job j2 = {&e->w2, x, m, y};
  mm_parallel_for((size_t)H, nthreads, gemm_rows_fn(), &j2);
  for (size_t i = 0; i < (size_t)m * (size_t)H; i++) out[i] = mm_float_to_bf16(y[i]);
done:
  free(x);
  free(h);
  free(a);
  free(aq);
  free(as);
  free(y);
}

void mm_ref_expert_rows(const mm_expert_q *e, int m, const uint8_t *xq,
                        const float *xs, const float *row_weight, float clamp,
                        uint16_t *out) {
  mm_ref_expert_rows_mt(e, m, xq, xs, row_weight, clamp, 0, out);
}

void mm_ref_quant_act(const uint16_t *x, int T, int H, uint8_t *xq, float *xs) {
  float block[MM_ACT_BLOCK];
  for (int t = 0; t < T; t++)
    for (int b = 0; b < H / MM_ACT_BLOCK; b++) {
      const uint16_t *src = x + (size_t)t * H + (size_t)b * MM_ACT_BLOCK;
      for (int i = 0; i < MM_ACT_BLOCK; i++) block[i] = mm_bf16_to_float(src[i]);
      mm_quant_fp8_block(block, MM_ACT_BLOCK, xq + (size_t)t * H + (size_t)b * MM_ACT_BLOCK,
                         xs + (size_t)t * (H / MM_ACT_BLOCK) + b);
    }
}

mm_err *mm_ref_moe_layer(const mm_ref_layer_args *a) {
  const int T = a->T, H = a->H, K = a->top_k;
  if (T < 0 || H <= 0 || H % MM_ACT_BLOCK || a->I <= 0 || a->I % MM_ACT_BLOCK || K <= 0)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "reference layer: bad shape T=%d H=%d I=%d k=%d",
                    T, H, a->I, K);
  for (size_t i = 0; i < (size_t)T * (size_t)K; i++) {
    int id = a->topk_ids[i];
    if (id == -1) continue;
    if (id < 0 || id >= a->num_experts)
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                      "topk_ids[%zu][%zu] = %d is outside [0, %d) and not -1 (masked)",
                      i / (size_t)K, i % (size_t)K, id, a->num_experts);
    if (id < a->first_expert || id >= a->first_expert + a->num_local)
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                      "topk_ids[%zu][%zu] = %d is not a local expert [%d, %d)", i / (size_t)K,
                      i % (size_t)K, id, a->first_expert, a->first_expert + a->num_local);
  }
  mm_err *err = NULL;
  const size_t pairs = (size_t)T * (size_t)K;
  uint8_t *xq = malloc((size_t)T * H + 1);
  float *xs = malloc(sizeof(float) * ((size_t)T * (H / MM_ACT_BLOCK) + 1));
  uint16_t *y = malloc(sizeof(uint16_t) * (pairs * H + 1));       /* row of pair (t, k) */
  uint8_t *pq = malloc(pairs * H + 1);
  float *ps = malloc(sizeof(float) * (pairs * (H / MM_ACT_BLOCK) + 1));
  float *pw = malloc(sizeof(float) * (pairs + 1));
  size_t *pidx = malloc(sizeof(size_t) * (pairs + 1));
  uint16_t *py = malloc(sizeof(uint16_t) * (pairs * H + 1));
  if (!xq || !xs || !y || !pq || !ps || !pw || !pidx || !py) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "reference layer: out of host memory (T=%d)", T);
    goto done;
  }
  mm_ref_quant_act(a->hidden, T, H, xq, xs);
  const int blocks = H / MM_ACT_BLOCK;
  for (int e = 0; e < a->num_local; e++) {
    /* Gather this expert's (t, k) pairs in ascending order into a pool. */
    size_t m = 0;
    for (size_t p = 0; p < pairs; p++) {
      if (a->topk_ids[p] != a->first_expert + e) continue;
      size_t t = p / (size_t)K;
      memcpy(pq + m * H, xq + t * H, (size_t)H);
      memcpy(ps + m * blocks, xs + t * blocks, sizeof(float) * (size_t)blocks);
      pw[m] = a->topk_weights[p] * a->routed_scaling_factor;
      pidx[m++] = p;
    }
    if (m == 0) continue;
    mm_ref_expert_rows_mt(&a->experts[e], (int)m, pq, ps, pw, a->activation_clamp, a->threads, py);
    for (size_t r = 0; r < m; r++) memcpy(y + pidx[r] * H, py + r * H, sizeof(uint16_t) * (size_t)H);
  }
  /* Combine: FP32 sum over k in ascending order, then BF16. */
  for (int t = 0; t < T; t++)
    for (int c = 0; c < H; c++) {
      float acc = 0.0f;
      for (int k = 0; k < K; k++) {
        size_t p = (size_t)t * K + k;
        if (a->topk_ids[p] < 0) continue;
        acc += mm_bf16_to_float(y[p * H + c]);
      }
      if (a->out_f32) a->out_f32[(size_t)t * H + c] = acc;
      a->out[(size_t)t * H + c] = mm_float_to_bf16(acc);
    }
done:
  free(xq);
  free(xs);
  free(y);
  free(pq);
  free(ps);
  free(pw);
  free(pidx);
  free(py);
  return err;
}

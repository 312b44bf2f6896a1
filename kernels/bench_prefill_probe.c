/* bench_prefill_probe.c -- the prefill-structure probe (probe_prefill.h;
 * docs/PERF.md, version 20) on one GPU: the two GEMM shapes of one EP8 rank
 * of GLM-5 at M = 32768 (E_loc 32, 1024 rows per expert; L1 N = 4096, K =
 * 6144; L2 N = 6144, K = 2048), every variant checked against an FP32
 * reference on every 61st row, then its median time (CUDA events after
 * warm-up) against cuBLASLt FP8 of the same M x N x K in the same run, and
 * the decode as a pass of its own.
 *
 *   bench_prefill_probe [--E n] [--Me n] [--iters n] [--warmup-ms t]
 * --warmup-ms t: each measurement first runs its operation for t ms (the
 * H200's sustained clocks under its power cap: docs/PERF.md, version 17).
 * Exits 1 when a variant's output differs from the reference (relative
 * Frobenius error above 4e-3, BF16 rounding is about 1.7e-3; for the L1
 * epilogue's FP8 outputs 4e-2, and its block scales within 1e-2) or holds a
 * non-finite value, or the in-kernel decode differs from the pass (for mode
 * 1's records: from their weights decoded one by one from the layout's
 * formulas). */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../bench/bench_args.h"
#include "../bench/bench_gpu.h"  /* CK, timing, the cuBLASLt baseline */
#include "../bench/bench_util.h" /* OK(): a failed call ends the run */
#include "layout_sm90.h" /* the fold table */
#include "probe_prefill.h"

static float bf16_to_float(uint16_t v) {
  const uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

typedef struct {
  const mm_probe_problem *p;
  mm_probe_variant v;
} gemm_call;
static void run_gemm(void *ctx, cudaStream_t st) {
  const gemm_call *c = ctx;
  OK(mm_probe_gemm(c->p, c->v, st));
}

typedef struct {
  const uint8_t *codes, *scales;
  uint8_t *w;
  size_t n;
} decode_call;
static void run_decode(void *ctx, cudaStream_t st) {
  const decode_call *c = ctx;
  OK(mm_probe_decode(c->codes, c->scales, c->w, c->n, st));
}

/* Relative Frobenius error of the sampled rows of out against ref; counts
 * non-finite outputs in *bad. */
static double check(const mm_probe_problem *p, const float *d_ref, int stride, long *bad) {
  const int rows = (p->E * p->Me + stride - 1) / stride;
  float *ref = malloc(sizeof(float) * (size_t)rows * p->N);
  uint16_t *o = malloc(2 * (size_t)p->N);
  CK(cudaMemcpy(ref, d_ref, sizeof(float) * (size_t)rows * p->N, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  *bad = 0;
  for (int ri = 0; ri < rows; ri++) {
    CK(cudaMemcpy(o, p->out + (size_t)ri * stride * p->N, 2 * (size_t)p->N, cudaMemcpyDeviceToHost));
    for (int n = 0; n < p->N; n++) {
      const double v = bf16_to_float(o[n]), r = ref[(size_t)ri * p->N + n];
      if (!isfinite(v)) {
        (*bad)++;
        continue;
      }
      num += (v - r) * (v - r);
      den += r * r;
    }
  }
  free(ref);
  free(o);
  return den > 0 ? sqrt(num / den) : 0.0;
}

static float e4m3_to_float(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
  return b & 0x80 ? -v : v;
}
static float round_bf16(float x) { /* to nearest even, finite x */
  uint32_t u;
  memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  memcpy(&x, &u, 4);
  return x;
}

/* MM_PROBE_SWIGLU against the reference rows: columns 2i, 2i + 1 of ref are
 * gate and up i. Returns the relative Frobenius error of the dequantized
 * outputs; *scale_err the largest relative difference of a block scale. */
static double check_swiglu(const mm_probe_problem *p, const float *d_ref, int stride,
                           double *scale_err) {
  const int rows = (p->E * p->Me + stride - 1) / stride, O = p->N / 2, blocks = O / 128;
  float *ref = malloc(sizeof(float) * (size_t)rows * p->N);
  uint8_t *q = malloc((size_t)O);
  CK(cudaMemcpy(ref, d_ref, sizeof(float) * (size_t)rows * p->N, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  *scale_err = 0;
  for (int ri = 0; ri < rows; ri++) {
    const size_t r = (size_t)ri * stride;
    CK(cudaMemcpy(q, p->act + r * O, (size_t)O, cudaMemcpyDeviceToHost));
    for (int b = 0; b < blocks; b++) {
      float h[128], amax = 0, s;
      for (int i = 0; i < 128; i++) {
        const float g = round_bf16(ref[(size_t)ri * p->N + 2 * (128 * b + i)]);
        const float u = round_bf16(ref[(size_t)ri * p->N + 2 * (128 * b + i) + 1]);
        h[i] = g / (1.0f + expf(-g)) * u;
        amax = fmaxf(amax, fabsf(h[i]));
      }
      CK(cudaMemcpy(&s, p->act_s + (size_t)b * p->E * p->Me + r, sizeof(float), cudaMemcpyDeviceToHost));
      const double s_ref = fmax(amax, 1e-4) / 448.0, se = fabs(s - s_ref) / s_ref;
      if (!(se <= *scale_err)) *scale_err = se; /* NaN propagates */
      for (int i = 0; i < 128; i++) {
        const double v = e4m3_to_float(q[128 * b + i]) * (double)s;
        num += (v - h[i]) * (v - h[i]);
        den += (double)h[i] * h[i];
      }
    }
  }
  free(ref);
  free(q);
  return den > 0 ? sqrt(num / den) : 0.0;
}

static long bytes_differ(const uint8_t *a, const uint8_t *b, size_t n) {
  const size_t chunk = 1 << 24;
  uint8_t *x = malloc(chunk), *y = malloc(chunk);
  long diff = 0;
  for (size_t off = 0; off < n; off += chunk) {
    const size_t m = n - off < chunk ? n - off : chunk;
    CK(cudaMemcpy(x, a + off, m, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(y, b + off, m, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < m; i++) diff += x[i] != y[i];
  }
  free(x);
  free(y);
  return diff;
}

/* One GEMM shape: every variant, checked and timed. Returns the number of
 * failed checks. */
static int run_shape(lt_ctx *lc, int E, int Me, int N, int K, int l1, int iters, cudaStream_t st) {
  mm_probe_problem p;
  memset(&p, 0, sizeof(p));
  p.E = E;
  p.Me = Me;
  p.N = N;
  p.K = K;
  const size_t rows = (size_t)E * Me, wts = (size_t)E * N * K;
  uint8_t *x, *w, *codes, *scales, *wdec;
  float *xs_t, *ref;
  CK(cudaMalloc((void **)&x, rows * K));
  CK(cudaMalloc((void **)&xs_t, sizeof(float) * rows * (K / 128)));
  CK(cudaMalloc((void **)&w, wts));
  CK(cudaMalloc((void **)&codes, wts / 2));
  CK(cudaMalloc((void **)&scales, wts / 32));
  CK(cudaMalloc((void **)&wdec, wts));
  CK(cudaMalloc((void **)&p.ready, sizeof(int) * E));
  CK(cudaMalloc((void **)&p.out, 2 * rows * N));
  CK(cudaMalloc((void **)&p.act, rows * (N / 2)));
  CK(cudaMalloc((void **)&p.act_s, sizeof(float) * rows * (N / 256)));
  const int stride = 61, ref_rows = (int)((rows + stride - 1) / stride);
  CK(cudaMalloc((void **)&ref, sizeof(float) * (size_t)ref_rows * N));
  OK(mm_probe_fill_e4m3(x, rows * K, 1, st));
  OK(mm_probe_fill_scales(xs_t, rows * (K / 128), 3, st));
  OK(mm_probe_fill_e4m3(codes, wts / 2, 5, st)); /* any byte is a code */
  OK(mm_probe_fill_e4m3(scales, wts / 32, 6, st));
  OK(mm_probe_decode(codes, scales, w, wts, st)); /* the weights of every variant */
  p.x = x;
  p.xs_t = xs_t;
  p.w = w;
  p.codes = codes;
  p.scales = scales;
  p.wdec = wdec;
  OK(mm_probe_reference(&p, w, stride, ref, st));
  /* mode 1's records, their weights decoded from the layout's formulas, and
   * that reference (the record variants) */
  const size_t rec_bytes = (size_t)E * (N / 64) * (K / 128) * 4480;
  uint8_t *records, *lut, *w_rec;
  float *ref_rec;
  CK(cudaMalloc((void **)&records, rec_bytes));
  CK(cudaMalloc((void **)&lut, 256));
  CK(cudaMalloc((void **)&w_rec, wts));
  CK(cudaMalloc((void **)&ref_rec, sizeof(float) * (size_t)ref_rows * N));
  {
    static uint8_t full[MM_SM90_LUT_ENTRIES][8];
    uint8_t compact[256] = {0};
    mm_sm90_lut_table(full);
    for (int k = MM_SM90_LUT_KMIN; k <= MM_SM90_LUT_KMAX; k++)
      memcpy(compact + 8 * (k - MM_SM90_LUT_KMIN), full[MM_SM90_LUT_INDEX(k, 0)], 8);
    CK(cudaMemcpy(lut, compact, 256, cudaMemcpyHostToDevice));
  }
  OK(mm_probe_fill_records(records, rec_bytes, 7, st));
  OK(mm_probe_decode_records(records, lut, w_rec, (size_t)E * N, K, st));
  OK(mm_probe_reference(&p, w_rec, stride, ref_rec, st));
  p.records = records;
  p.lut = lut;
  CK(cudaStreamSynchronize(st));

  const double flop = 2.0 * rows * N * K;
  double lt_ms = -1;
  {
    uint16_t *D;
    CK(cudaMalloc((void **)&D, 2 * rows * N));
    lt_ms = lt_time(lc, N, (int)rows, K, CUDA_R_8F_E4M3, w, x, D, iters, st);
    CK(cudaFree(D));
  }
  printf("## E %d, %d rows per expert, N %d, K %d: cuBLASLt FP8 same shape %.1f us (%.0f TFLOP/s)\n",
         E, Me, N, K, 1e3 * lt_ms, flop / lt_ms / 1e9);
  printf("| variant | rel err | non-finite | us | TFLOP/s | cuBLASLt / ours |\n|---|---|---|---|---|---|\n");
  int failed = 0;
  for (int v = 0; v < MM_PROBE_VARIANTS; v++) {
    const int swiglu = v == MM_PROBE_SWIGLU || v == MM_PROBE_RECORDS_SWIGLU;
    const int recs = v == MM_PROBE_RECORDS || v == MM_PROBE_RECORDS_SWIGLU;
    if (swiglu && !l1) continue; /* the L1 epilogue belongs to the gate/up GEMM */
    const float *vref = recs ? ref_rec : ref;
    CK(cudaMemsetAsync(p.out, 0xFF, 2 * rows * N, st)); /* poison: NaN */
    CK(cudaMemsetAsync(p.act, 0x7F, rows * (N / 2), st));
    CK(cudaMemsetAsync(p.act_s, 0xFF, sizeof(float) * rows * (N / 256), st));
    CK(cudaMemsetAsync(wdec, 0xFF, wts, st));
    OK(mm_probe_gemm(&p, (mm_probe_variant)v, st));
    CK(cudaStreamSynchronize(st));
    long bad = 0;
    double scale_err = 0;
    const double rel = swiglu ? check_swiglu(&p, vref, stride, &scale_err) : check(&p, vref, stride, &bad);
    const int decodes = v >= MM_PROBE_SS_DECODE;
    const long diff = decodes ? bytes_differ(wdec, recs ? w_rec : w, wts) : 0;
    /* BF16 out: about 1.7e-3; FP8 out: up to 2^-4 per value, about 2e-2 */
    const int ok = rel <= (swiglu ? 4e-2 : 4e-3) && scale_err <= 1e-2 && bad == 0 && diff == 0;
    failed += !ok;
    gemm_call call = {&p, (mm_probe_variant)v};
    const double ms = time_op(run_gemm, &call, iters, st);
    char scales[48] = "";
    if (swiglu) snprintf(scales, sizeof scales, " (scales within %.1e)", scale_err);
    printf("| %s | %.2e%s%s | %ld | %.1f | %.0f | %.3f |\n", mm_probe_variant_name((mm_probe_variant)v),
           rel, scales, ok ? "" : (diff ? " DECODE DIFFERS" : " FAIL"), bad, 1e3 * ms,
           flop / ms / 1e9, lt_ms / ms);
    fflush(stdout);
  }
  CK(cudaFree(x));
  CK(cudaFree(xs_t));
  CK(cudaFree(w));
  CK(cudaFree(codes));
  CK(cudaFree(scales));
  CK(cudaFree(wdec));
  CK(cudaFree(p.ready));
  CK(cudaFree(p.out));
  CK(cudaFree(p.act));
  CK(cudaFree(p.act_s));
  CK(cudaFree(ref));
  CK(cudaFree(records));
  CK(cudaFree(lut));
  CK(cudaFree(w_rec));
  CK(cudaFree(ref_rec));
  return failed;
}

/* The decode of both GEMMs' weights as a pass of its own. */
static void run_decode_pass(size_t weights, int iters, cudaStream_t st) {
  uint8_t *codes, *scales, *w;
  CK(cudaMalloc((void **)&codes, weights / 2));
  CK(cudaMalloc((void **)&scales, weights / 32));
  CK(cudaMalloc((void **)&w, weights));
  OK(mm_probe_fill_e4m3(codes, weights / 2, 5, st));
  OK(mm_probe_fill_e4m3(scales, weights / 32, 6, st));
  decode_call call = {codes, scales, w, weights};
  const double ms = time_op(run_decode, &call, iters, st);
  const double bytes = weights * (0.5 + 1.0 / 32 + 1.0);
  printf("## decode pass, %.0f M weights (read %.0f MB, write %.0f MB): %.1f us, %.0f GB/s\n",
         weights / 1e6, weights * (0.5 + 1.0 / 32) / 1e6, weights / 1e6, 1e3 * ms, bytes / ms / 1e6);
  CK(cudaFree(codes));
  CK(cudaFree(scales));
  CK(cudaFree(w));
}

int main(int argc, char **argv) {
  int E = 32, Me = 1024, iters = 20;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) {
      fprintf(stderr, "%s needs a value (see the header of bench_prefill_probe.c)\n", a);
      return 2;
    }
    int bad = 0;
    if (!strcmp(a, "--E")) bad = bench_arg_int(a, v, 1, 4096, &E);
    else if (!strcmp(a, "--Me")) bad = bench_arg_int(a, v, 256, 1 << 20, &Me);
    else if (!strcmp(a, "--iters")) bad = bench_arg_int(a, v, 1, 100000, &iters);
    else if (!strcmp(a, "--warmup-ms")) bad = bench_arg_double(a, v, 0, 600000, &g_warmup_ms);
    else {
      fprintf(stderr, "unknown option %s (see the header of bench_prefill_probe.c)\n", a);
      return 2;
    }
    if (bad) return 2;
    i++;
  }
  if (Me % 256) {
    fprintf(stderr, "--Me must be a multiple of 256\n");
    return 2;
  }
  if (!bench_have_gpu("bench_prefill_probe")) return 77;
  struct cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    printf("bench_prefill_probe: needs sm_90 (found sm_%d%d)\n", prop.major, prop.minor);
    return 77;
  }
  printf("# device %s; E %d, %d rows per expert; iters %d; warm-up %.0f ms\n", prop.name, E, Me,
         iters, g_warmup_ms);
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  lt_ctx lc = {0};
  if (cublasLtCreate(&lc.lt) != CUBLAS_STATUS_SUCCESS) {
    fprintf(stderr, "cublasLtCreate failed\n");
    return 1;
  }
  lc.ws_bytes = 64u << 20;
  CK(cudaMalloc(&lc.ws, lc.ws_bytes));
  int failed = run_shape(&lc, E, Me, 4096, 6144, 1, iters, st); /* L1: 2 I x H */
  failed += run_shape(&lc, E, Me, 6144, 2048, 0, iters, st);    /* L2: H x I */
  run_decode_pass((size_t)E * (4096ull * 6144 + 6144ull * 2048), iters, st); /* both GEMMs */
  cublasLtDestroy(lc.lt);
  CK(cudaFree(lc.ws));
  if (failed) printf("bench_prefill_probe: %d checks FAILED\n", failed);
  return failed ? 1 : 0;
}

/* bench_gpu.h -- shared by the GPU bench programs (kernels/bench_*.c):
 * checked CUDA calls, the warm-up clock, medians, and a cuBLASLt dense GEMM
 * timed as the same-run baseline, and the timing of an operation. Static
 * inline functions: each program includes it once and uses what it needs. */
#ifndef MM_BENCH_GPU_H
#define MM_BENCH_GPU_H

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)
/* cuBLASLt calls: a failure returns -1 (no algorithm) from the caller */
#define CKL(x)                                                                         \
  do {                                                                                 \
    cublasStatus_t s_ = (x);                                                           \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                 \
      fprintf(stderr, "%s:%d: %s: cublas status %d\n", __FILE__, __LINE__, #x, (int)s_); \
      return -1.0;                                                                     \
    }                                                                                  \
  } while (0)

/* Whether a GPU is visible; without one prints "<name>: no GPU" (the
 * caller then exits 77, the automake skip status). */
static inline int bench_have_gpu(const char *name) {
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) return 1;
  printf("%s: no GPU\n", name);
  return 0;
}

/* --warmup-ms: how long each measurement runs its operation before timing */
static double g_warmup_ms = 0.0;
static inline double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}
/* True while the warm-up that started at t0 lasts; waits for the stream, so
 * that the time counted is the device's. */
static inline int warming(double t0, cudaStream_t st) {
  if (g_warmup_ms <= 0.0) return 0;
  CK(cudaStreamSynchronize(st));
  return now_ms() - t0 < g_warmup_ms;
}

static inline int cmp_f(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return x < y ? -1 : x > y;
}
static inline float median(float *v, int n) {
  qsort(v, (size_t)n, sizeof(float), cmp_f);
  return n % 2 ? v[n / 2] : 0.5f * (v[n / 2 - 1] + v[n / 2]);
}

/* ---------------------------------------------------------- cuBLASLt ---- */

typedef struct {
  cublasLtHandle_t lt;
  void *ws;
  size_t ws_bytes;
} lt_ctx;

/* D[m, n] (col-major, BF16) = A^T B with A [k, m], B [k, n] (TN), type ab.
 * Returns the median ms of `iters` runs, or < 0 when unsupported. */
static inline double lt_time(lt_ctx *c, int m, int n, int k, cudaDataType_t ab, const void *A,
                      const void *B, void *D, int iters, cudaStream_t st) {
  cublasLtMatmulDesc_t op = NULL;
  cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL;
  CKL(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CKL(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CKL(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  CKL(cublasLtMatrixLayoutCreate(&la, ab, k, m, k));
  CKL(cublasLtMatrixLayoutCreate(&lb, ab, k, n, k));
  CKL(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, m, n, m));
  cublasLtMatmulPreference_t pref = NULL;
  CKL(cublasLtMatmulPreferenceCreate(&pref));
  CKL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &c->ws_bytes, sizeof(c->ws_bytes)));
  cublasLtMatmulHeuristicResult_t h;
  int found = 0;
  CKL(cublasLtMatmulAlgoGetHeuristic(c->lt, op, la, lb, ld, ld, pref, 1, &h, &found));
  if (!found) return -1.0;
  float alpha = 1.0f, beta = 0.0f;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  float *t = malloc(sizeof(float) * (size_t)(iters + 3));
  for (const double t0 = now_ms(); warming(t0, st);)
    CKL(cublasLtMatmul(c->lt, op, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &h.algo, c->ws,
                       c->ws_bytes, st));
  for (int i = 0; i < iters + 3; i++) {
    CK(cudaEventRecord(e0, st));
    CKL(cublasLtMatmul(c->lt, op, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &h.algo, c->ws,
                       c->ws_bytes, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    if (i >= 3) CK(cudaEventElapsedTime(&t[i - 3], e0, e1));
  }
  double ms = median(t, iters);
  free(t);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(op);
  return ms;
}

/* One operation a benchmark times: runs its work on the stream. */
typedef void (*bench_op)(void *ctx, cudaStream_t st);

/* Median ms of `iters` CUDA-event-timed runs of op(ctx), after three runs
 * and the --warmup-ms warm-up. */
static inline double time_op(bench_op op, void *ctx, int iters, cudaStream_t st) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; i++) op(ctx, st);
  for (const double t0 = now_ms(); warming(t0, st);) op(ctx, st);
  float *t = malloc(sizeof(float) * (size_t)iters);
  for (int i = 0; i < iters; i++) {
    CK(cudaEventRecord(e0, st));
    op(ctx, st);
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&t[i], e0, e1));
  }
  const double ms = median(t, iters);
  free(t);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms;
}

#endif

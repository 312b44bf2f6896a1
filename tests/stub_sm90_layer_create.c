/* stub_sm90_layer_create.c -- a host-only check of mm_sm90_layer_create's
 * packing and upload logic (chunks, staging buffers, offsets, row factors,
 * fold error) for machines without a GPU: the CUDA memory, copy, event and
 * stream calls are replaced by host stand-ins (device memory is host memory,
 * copies are synchronous; pinned allocation can be made to fail), and the
 * "device" buffers are compared with the reference per-matrix packing.
 * Not part of `make check` (it overrides libcudart_static symbols at link
 * time); run scripts/stub_layer_create.sh. It does not exercise real
 * asynchrony: a GPU run (gpu_test_moe_compute) still has to. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <cuda_runtime_api.h>
#include "moe_compute.h"
#include "layout_sm90.h"
/* as in kernels/moe_sm90_impl.h (C++ only) */
struct mm_sm90_layer { mm_weight_mode mode; int E, H, I; size_t rec, w13_bytes, w2_bytes, expert_bytes;
  uint8_t *d_w; float *d_rs13, *d_rs2; uint8_t *d_lut; int refs_zero13, refs_zero2; size_t device_bytes;
  double fold_rel; };
/* The zero_refs kernel launch is not stubbed (no GPU: it does not run); its
 * result copy is, so in modes 1 and 4 refs_zero13 / refs_zero2 come back as
 * their initial 1 (modes 2 and 3 skip the scan: 0). */
static int n_pinned, n_copies, n_events_rec, fail_pinned;
/* the silu table's fill is a kernel: nothing to fill here */
mm_err *mm_sm90_silu_table_init(void *stream) { (void)stream; return NULL; }
cudaError_t cudaMalloc(void **p, size_t n) { *p = malloc(n); return *p ? cudaSuccess : cudaErrorMemoryAllocation; }
cudaError_t cudaFree(void *p) { free(p); return cudaSuccess; }
cudaError_t cudaMallocHost(void **p, size_t n) { if (fail_pinned) return cudaErrorMemoryAllocation; n_pinned++; *p = malloc(n); return cudaSuccess; }
cudaError_t cudaFreeHost(void *p) { n_pinned--; free(p); return cudaSuccess; }
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st) { memcpy(d, s, n); n_copies++; return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned f) { *e = (cudaEvent_t)malloc(8); return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { n_events_rec++; return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { return cudaSuccess; }
cudaError_t cudaEventDestroy(cudaEvent_t e) { free(e); return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char *cudaGetErrorString(cudaError_t e) { return "stub error"; }
static uint64_t rng = 88172645463325252ull;
static uint64_t rnd(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }
static void fill(mm_qmat *m, int g32) {
  for (size_t i = 0; i < (size_t)m->rows * m->cols / 2; i++) m->codes[i] = (uint8_t)rnd();
  for (size_t i = 0; i < (size_t)m->rows * (m->cols / m->gran); i++) m->scales[i] = g32 ? (uint8_t)(120 + rnd() % 10) : (uint8_t)(0x30 + rnd() % 0x20);
  for (int r = 0; r < m->rows; r++) m->row_scale[r] = 0.001f * (1 + rnd() % 100);
}
int main(void) {
  const int H = 512, I = 256;
  int bad = 0;
  for (int E = 1; E <= 5; E++) for (int mode = 1; mode <= 4; mode++) for (fail_pinned = 0; fail_pinned < 2; fail_pinned++) {
    int g32 = mode == 1 || mode == 4;
    mm_expert_q *x = calloc(E, sizeof *x);
    for (int e = 0; e < E; e++) {
      mm_qmat_alloc(&x[e].w13, 2 * I, H, g32 ? 32 : 16, g32 ? MM_SF_UE8M0 : MM_SF_E4M3); fill(&x[e].w13, g32);
      mm_qmat_alloc(&x[e].w2, H, I, g32 ? 32 : 16, g32 ? MM_SF_UE8M0 : MM_SF_E4M3); fill(&x[e].w2, g32);
    }
    mm_sm90_layer *L;
    n_copies = n_events_rec = 0;
    mm_err *err = mm_sm90_layer_create(x, E, (mm_weight_mode)mode, NULL, &L);
    if (err) { printf("E %d mode %d: %s\n", E, mode, err->message); bad++; continue; }
    size_t b13 = mm_sm90_matrix_bytes(mode, 2 * I, H), b2 = mm_sm90_matrix_bytes(mode, H, I);
    uint8_t *ref = malloc(b13 + b2); float *r13 = malloc(4 * 2 * I), *r2 = malloc(4 * H);
    double e2 = 0, r2s = 0;
    for (int e = 0; e < E; e++) {
      double fe[2];
      mm_sm90_pack_matrix(&x[e].w13, mode, 1, ref, r13, fe); e2 += fe[0]; r2s += fe[1];
      mm_sm90_pack_matrix(&x[e].w2, mode, 0, ref + b13, r2, fe); e2 += fe[0]; r2s += fe[1];
      if (memcmp(ref, L->d_w + e * (b13 + b2), b13 + b2)) { printf("E %d mode %d: expert %d bytes differ\n", E, mode, e); bad++; }
      if (memcmp(r13, L->d_rs13 + (size_t)e * 2 * I, 4 * 2 * I) || memcmp(r2, L->d_rs2 + (size_t)e * H, 4 * H)) { printf("row factors differ\n"); bad++; }
    }
    double fr = r2s > 0 ? sqrt(e2 / r2s) : 0;
    if (memcmp(&fr, &L->fold_rel, 8)) { printf("fold %g vs %g\n", fr, L->fold_rel); bad++; }
    if (L->device_bytes != (b13 + b2) * E + 4 * (size_t)E * (2 * I + H) + MM_SM90_LUT_ENTRIES * 8) { printf("device bytes\n"); bad++; }
    printf("E %d mode %d pinned %d: ok, %d copies, %d events, fold %.4f, pinned left %d\n", E, mode, !fail_pinned, n_copies, n_events_rec, L->fold_rel, n_pinned);
    free(ref); free(r13); free(r2);
    mm_sm90_layer_destroy(L);
    for (int e = 0; e < E; e++) { mm_qmat_free(&x[e].w13); mm_qmat_free(&x[e].w2); }
    free(x);
  }
  printf("%s\n", bad ? "FAILED" : "all ok");
  return bad != 0;
}

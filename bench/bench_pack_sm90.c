/* bench_pack_sm90.c -- the load path's sm90 packing for one GLM-5 layer on
 * one rank (default 32 experts, H 6144, I 2048): the GPU packer
 * (mm_sm90_pack_experts_gpu: upload of the canonical matrices included)
 * against the host packer on all cores (mm_sm90_pack_experts, packed bytes
 * still in host memory), and against what the upload alone costs: a
 * host-to-device copy of the same source bytes from pageable and from
 * pinned memory, in the same run. Medians of --reps timings after one
 * warm-up; GB/s counts the source bytes (codes + scales + row factors).
 * The GPU packer's records are compared with the host packer's. Also mode
 * 1 from the group-16 layer: the group16 -> group32 requant and packing on
 * the host's cores against both on the GPU.
 *
 *   bench_pack_sm90 [--experts E] [--hidden H] [--inter I] [--reps N]
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_args.h"
#include "bench_gpu.h"
#include "bench_util.h"
#include "layout_sm90_pack.h"
#include "pack_sm90.h"
#include "parallel.h"
#include "requant.h"

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint8_t rnd(void) {
  g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
  return (uint8_t)(g_rng >> 56);
}

/* Random codes; scales of one moderate range (gran 16 E4M3, or gran 32
 * UE8M0 within 2^6 of each other, which mode 1 folds exactly). */
static void fill(mm_qmat *m, int g32) {
  const size_t nc = (size_t)m->rows * (size_t)m->cols / 2;
  const size_t ns = (size_t)m->rows * (size_t)(m->cols / m->gran);
  for (size_t i = 0; i < nc; i++) m->codes[i] = rnd();
  for (size_t i = 0; i < ns; i++) m->scales[i] = g32 ? (uint8_t)(120 + rnd() % 6) : (uint8_t)(0x28 + rnd() % 0x28);
  for (int r = 0; r < m->rows; r++) m->row_scale[r] = g32 ? 1.0f : 0.0025f;
}

static size_t source_bytes(const mm_qmat *m) {
  return (size_t)m->rows * ((size_t)m->cols / 2 + (size_t)(m->cols / m->gran) + sizeof(float));
}

static int cmp_d(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
static double median_d(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Mode 1 from the group-16 layer: the requant on the host's cores (as the
 * loader runs it, statistics included) then the host packer, against the
 * requant and packing on the GPU (upload included). Returns whether the
 * two wrote the same records and row factors. */
static int requant_rows(const mm_expert_q *x, int E, size_t src, int reps, double *t,
                        cudaStream_t st) {
  const int H = x[0].w13.cols, I = x[0].w2.cols;
  const mm_weight_mode mode = MM_WMODE_G32_FP8;
  const size_t bytes = (size_t)E * (mm_sm90_matrix_bytes(mode, 2 * I, H) + mm_sm90_matrix_bytes(mode, H, I));
  const size_t nrs = (size_t)E * (size_t)(2 * I + H);
  uint8_t *hw = malloc(bytes), *gw = malloc(bytes), *dw = NULL;
  float *hrs = malloc(sizeof(float) * nrs), *grs = malloc(sizeof(float) * nrs), *drs = NULL;
  mm_expert_q *q = calloc((size_t)E, sizeof *q);
  mm_requant_stats *stats = calloc(3 * (size_t)E, sizeof *stats);
  CK(cudaMalloc((void **)&dw, bytes));
  CK(cudaMalloc((void **)&drs, sizeof(float) * nrs));
  const mm_sm90_requant rq = {0, 1e30, stats};
  for (int gpu = 0; gpu < 2; gpu++) {
    for (int r = -1; r < reps; r++) {
      double fold[2] = {0.0, 0.0};
      const double t0 = now_ms();
      if (gpu) {
        OK(mm_sm90_pack_experts_gpu(x, E, 0, mode, dw, drs, drs + (size_t)E * (size_t)(2 * I), fold,
                                    &rq, st));
      } else {
        for (int e = 0; e < E; e++) {
          mm_qmat_free(&q[e].w13);
          mm_qmat_free(&q[e].w2);
          OK(mm_requant_qmat(&x[e].w13, 0, &q[e].w13, &stats[3 * e]));
          OK(mm_requant_qmat(&x[e].w2, 0, &q[e].w2, &stats[3 * e + 2]));
        }
        OK(mm_sm90_pack_experts(q, E, 0, mode, 0, hw, hrs, hrs + (size_t)E * (size_t)(2 * I), fold));
      }
      if (r >= 0) t[r] = now_ms() - t0;
    }
    const double ms = median_d(t, reps);
    printf("| 1 from group 16 | %s | %.2f | %.1f |\n",
           gpu ? "GPU requant and packer (upload included)"
               : "host requant and packer, all cores (no upload)",
           ms, src / (ms * 1e6));
  }
  CK(cudaMemcpy(gw, dw, bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(grs, drs, sizeof(float) * nrs, cudaMemcpyDeviceToHost));
  const int same = memcmp(hw, gw, bytes) == 0 && memcmp(hrs, grs, sizeof(float) * nrs) == 0;
  printf("| 1 from group 16 | records and row factors of the two | %s | |\n",
         same ? "identical" : "DIFFER");
  CK(cudaFree(dw));
  CK(cudaFree(drs));
  for (int e = 0; e < E; e++) {
    mm_qmat_free(&q[e].w13);
    mm_qmat_free(&q[e].w2);
  }
  free(q), free(stats), free(hw), free(gw), free(hrs), free(grs);
  return same;
}

int main(int argc, char **argv) {
  int E = 32, H = 6144, I = 2048, reps = 5;
  const int bad_args = bench_layer_args(argc, argv, &E, &H, &I, &reps, 1000);
  if (bad_args) return bad_args;
  if (!bench_have_gpu("bench_pack_sm90")) return 77;
  struct cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  mm_expert_q *x = calloc((size_t)E, sizeof *x);
  printf("device: %s; host: %d cores; layer: %d experts, H %d, I %d; median of %d after 1 "
         "warm-up\n",
         prop.name, mm_thread_count(0), E, H, I, reps);
  printf("| mode | step | ms | GB/s source |\n|---|---|---:|---:|\n");
  double *t = malloc(sizeof(double) * (size_t)reps);
  int all_same = 1;
  for (int g32 = 1; g32 >= 0; g32--) {
    size_t src = 0;
    for (int e = 0; e < E; e++) {
      if (mm_qmat_alloc(&x[e].w13, 2 * I, H, g32 ? 32 : 16, g32 ? MM_SF_UE8M0 : MM_SF_E4M3) ||
          mm_qmat_alloc(&x[e].w2, H, I, g32 ? 32 : 16, g32 ? MM_SF_UE8M0 : MM_SF_E4M3)) {
        fprintf(stderr, "out of host memory\n");
        return 1;
      }
      fill(&x[e].w13, g32);
      fill(&x[e].w2, g32);
      src += source_bytes(&x[e].w13) + source_bytes(&x[e].w2);
    }
    /* the upload alone: the same bytes in one buffer, pageable and pinned */
    uint8_t *hp = malloc(src), *hpin = NULL, *d = NULL;
    CK(cudaMallocHost((void **)&hpin, src));
    CK(cudaMalloc((void **)&d, src));
    memset(hp, 1, src);
    memset(hpin, 1, src);
    for (int pinned = 0; pinned < 2; pinned++) {
      for (int k = -1; k < reps; k++) {
        const double t0 = now_ms();
        CK(cudaMemcpyAsync(d, pinned ? hpin : hp, src, cudaMemcpyHostToDevice, st));
        CK(cudaStreamSynchronize(st));
        if (k >= 0) t[k] = now_ms() - t0;
      }
      const double ms = median_d(t, reps);
      printf("| %s | H2D copy of the source bytes, %s | %.2f | %.1f |\n", g32 ? "1" : "2, 3",
             pinned ? "pinned" : "pageable", ms, src / (ms * 1e6));
    }
    CK(cudaFree(d));
    CK(cudaFreeHost(hpin));
    free(hp);
    /* mode 4 packs mode 1's records */
    const mm_weight_mode modes[2] = {g32 ? MM_WMODE_G32_FP8 : MM_WMODE_G16_BF16_EXACT,
                                     MM_WMODE_G16_FP8};
    for (int k = 0; k < (g32 ? 1 : 2); k++) {
      const mm_weight_mode mode = modes[k];
      const size_t bytes = (size_t)E * (mm_sm90_matrix_bytes(mode, 2 * I, H) + mm_sm90_matrix_bytes(mode, H, I));
      const size_t nrs = (size_t)E * (size_t)(2 * I + H);
      uint8_t *hw = malloc(bytes), *gw = malloc(bytes), *dw = NULL;
      float *hrs = malloc(sizeof(float) * nrs), *grs = malloc(sizeof(float) * nrs), *drs = NULL;
      CK(cudaMalloc((void **)&dw, bytes));
      CK(cudaMalloc((void **)&drs, sizeof(float) * nrs));
      for (int gpu = 0; gpu < 2; gpu++) {
        for (int r = -1; r < reps; r++) {
          double fold[2] = {0.0, 0.0};
          const double t0 = now_ms();
          if (gpu)
            OK(mm_sm90_pack_experts_gpu(x, E, 0, mode, dw, drs, drs + (size_t)E * (size_t)(2 * I), fold,
                                        NULL, st));
          else
            OK(mm_sm90_pack_experts(x, E, 0, mode, 0, hw, hrs, hrs + (size_t)E * (size_t)(2 * I), fold));
          if (r >= 0) t[r] = now_ms() - t0;
        }
        const double ms = median_d(t, reps);
        printf("| %d | %s | %.2f | %.1f |\n", (int)mode,
               gpu ? "GPU packer (upload included)" : "host packer, all cores (no upload)", ms,
               src / (ms * 1e6));
      }
      CK(cudaMemcpy(gw, dw, bytes, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(grs, drs, sizeof(float) * nrs, cudaMemcpyDeviceToHost));
      const int same = memcmp(hw, gw, bytes) == 0 && memcmp(hrs, grs, sizeof(float) * nrs) == 0;
      all_same &= same;
      printf("| %d | records and row factors of the two packers | %s | |\n", (int)mode,
             same ? "identical" : "DIFFER");
      CK(cudaFree(dw));
      CK(cudaFree(drs));
      free(hw), free(gw), free(hrs), free(grs);
    }
    if (!g32) all_same &= requant_rows(x, E, src, reps, t, st);
    for (int e = 0; e < E; e++) {
      mm_qmat_free(&x[e].w13);
      mm_qmat_free(&x[e].w2);
    }
  }
  free(t);
  free(x);
  return all_same ? 0 : 1;
}

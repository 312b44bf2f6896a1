/* bench_prep.c -- GPU weight preparation throughput for one GLM-5 layer on
 * one rank (default 32 experts, H 6144, I 2048, gate+up+down), in GB/s of
 * source bytes (NVFP4 codes + E4M3 scales), against a device-to-device
 * cudaMemcpy of the same number of bytes measured in the same run.
 * Median of CUDA-event timings after warm-up. Also the CPU requant path
 * (all cores) on a slice, for scale.
 *
 *   bench_prep [--experts E] [--hidden H] [--inter I] [--reps N]
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_args.h"
#include "layout_sm100.h"
#include "parallel.h"
#include "prep.h"
#include "requant.h"
#include "bench_gpu.h" /* CK, time_op */
#include "bench_util.h"

typedef struct {
  int E, H, I;
  size_t src_bytes;
  /* source (NVFP4, layer-contiguous: w13 = [E, 2I] rows, w2 = [E, H] rows) */
  uint8_t *c13, *s13, *c2, *s2;
  float *rs13, *rs2;
  /* outputs */
  uint8_t *o_c13, *o_s13, *o_c2, *o_s2; /* requant / canonical copy */
  uint8_t *x_w13, *x_w2;                /* sm100 export */
  int32_t *x_s13, *x_s2;
  double *stats;
  uint32_t *status;
  void *copy_src, *copy_dst;
} layer_bufs;

static void step_copy(void *p, cudaStream_t st) {
  layer_bufs *L = p;
  CK(cudaMemcpyAsync(L->copy_dst, L->copy_src, L->src_bytes, cudaMemcpyDeviceToDevice, st));
}

static void requant_both(layer_bufs *L, cudaStream_t st, int stats) {
  OK(mm_gpu_requant_launch(L->E * 2 * L->I, L->H, MM_SF_E4M3, L->c13, L->s13, L->rs13, L->o_c13,
                           L->o_s13, stats ? L->stats : NULL, L->status, st));
  OK(mm_gpu_requant_launch(L->E * L->H, L->I, MM_SF_E4M3, L->c2, L->s2, L->rs2, L->o_c2, L->o_s2,
                           stats ? L->stats : NULL, L->status, st));
}
static void step_requant_stats(void *p, cudaStream_t st) { requant_both(p, st, 1); }
static void step_requant_nostats(void *p, cudaStream_t st) { requant_both(p, st, 0); }
static void step_requant_simple(void *p, cudaStream_t st) {
  layer_bufs *L = p;
  OK(mm_gpu_requant_launch_simple(L->E * 2 * L->I, L->H, MM_SF_E4M3, L->c13, L->s13, L->rs13,
                                  L->o_c13, L->o_s13, L->stats, L->status, st));
  OK(mm_gpu_requant_launch_simple(L->E * L->H, L->I, MM_SF_E4M3, L->c2, L->s2, L->rs2, L->o_c2,
                                  L->o_s2, L->stats, L->status, st));
}

/* Non-requant canonical prepare: validate scales (NaN scan), place codes and
 * scales into the canonical buffers. */
static void step_canonical(void *p, cudaStream_t st) {
  layer_bufs *L = p;
  size_t n13 = (size_t)L->E * 2 * L->I * L->H, n2 = (size_t)L->E * L->H * L->I;
  OK(mm_gpu_scan_scales_launch(L->s13, n13 / 16, MM_SF_E4M3, L->status, st));
  OK(mm_gpu_scan_scales_launch(L->s2, n2 / 16, MM_SF_E4M3, L->status, st));
  CK(cudaMemcpyAsync(L->o_c13, L->c13, n13 / 2, cudaMemcpyDeviceToDevice, st));
  CK(cudaMemcpyAsync(L->o_s13, L->s13, n13 / 16, cudaMemcpyDeviceToDevice, st));
  CK(cudaMemcpyAsync(L->o_c2, L->c2, n2 / 2, cudaMemcpyDeviceToDevice, st));
  CK(cudaMemcpyAsync(L->o_s2, L->s2, n2 / 16, cudaMemcpyDeviceToDevice, st));
}

/* sm100 export of the requantized (group-32) layer. */
static void step_sm100(void *p, cudaStream_t st) {
  layer_bufs *L = p;
  mm_sm100_shape s = {L->E, L->H, L->I, 32};
  mm_sm100_canon in = {L->o_c13, L->o_s13, L->o_c2, L->o_s2};
  mm_sm100_packed out = {L->x_w13, L->x_s13, L->x_w2, L->x_s2};
  OK(mm_gpu_sm100_export_launch(&s, &in, &out, st));
}
static void step_requant_sm100(void *p, cudaStream_t st) {
  requant_both(p, st, 1);
  step_sm100(p, st);
}

static void *dmalloc(size_t n) {
  void *d;
  CK(cudaMalloc(&d, n));
  return d;
}

static void fill_random(uint8_t *d, size_t n, int e4m3_scales, uint64_t seed) {
  uint8_t *h = malloc(n);
  uint64_t x = seed;
  for (size_t i = 0; i < n; i++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    uint8_t b = (uint8_t)(x >> 56);
    if (e4m3_scales) b = (uint8_t)(0x20 + (b % 0x40)); /* finite, positive */
    h[i] = b;
  }
  CK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
  free(h);
}

int main(int argc, char **argv) {
  int E = 32, H = 6144, I = 2048, reps = 20;
  const int bad_args = bench_layer_args(argc, argv, &E, &H, &I, &reps, 100000);
  if (bad_args) return bad_args;
  if (!bench_have_gpu("bench_prep")) return 77;
  struct cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  layer_bufs L;
  memset(&L, 0, sizeof L);
  L.E = E, L.H = H, L.I = I;
  size_t n13 = (size_t)E * 2 * I * H, n2 = (size_t)E * H * I;
  L.src_bytes = n13 / 2 + n13 / 16 + n2 / 2 + n2 / 16;
  L.c13 = dmalloc(n13 / 2), L.s13 = dmalloc(n13 / 16), L.c2 = dmalloc(n2 / 2), L.s2 = dmalloc(n2 / 16);
  L.rs13 = dmalloc(sizeof(float) * (size_t)E * 2 * I), L.rs2 = dmalloc(sizeof(float) * (size_t)E * H);
  L.o_c13 = dmalloc(n13 / 2), L.o_s13 = dmalloc(n13 / 16), L.o_c2 = dmalloc(n2 / 2), L.o_s2 = dmalloc(n2 / 16);
  L.x_w13 = dmalloc(n13 / 2), L.x_w2 = dmalloc(n2 / 2);
  mm_sm100_shape s = {E, H, I, 32};
  L.x_s13 = dmalloc(4 * mm_sm100_s13_words(&s)), L.x_s2 = dmalloc(4 * mm_sm100_s2_words(&s));
  L.stats = dmalloc(sizeof(double) * 3 * (size_t)E * (size_t)(2 * I > H ? 2 * I : H));
  L.status = dmalloc(4);
  L.copy_src = dmalloc(L.src_bytes), L.copy_dst = dmalloc(L.src_bytes);
  fill_random(L.c13, n13 / 2, 0, 1), fill_random(L.s13, n13 / 16, 1, 2);
  fill_random(L.c2, n2 / 2, 0, 3), fill_random(L.s2, n2 / 16, 1, 4);
  float *hrs = malloc(sizeof(float) * (size_t)E * (size_t)(2 * I > H ? 2 * I : H));
  for (size_t r = 0; r < (size_t)E * 2 * I; r++) hrs[r] = r % (2 * (size_t)I) < (size_t)I ? 0.002f : 0.003f;
  CK(cudaMemcpy(L.rs13, hrs, sizeof(float) * (size_t)E * 2 * I, cudaMemcpyHostToDevice));
  for (size_t r = 0; r < (size_t)E * H; r++) hrs[r] = 0.0025f;
  CK(cudaMemcpy(L.rs2, hrs, sizeof(float) * (size_t)E * H, cudaMemcpyHostToDevice));
  uint32_t ok = MM_GPU_STATUS_OK;
  CK(cudaMemcpy(L.status, &ok, 4, cudaMemcpyHostToDevice));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));

  struct {
    const char *name;
    bench_op fn;
  } steps[] = {{"d2d copy (ceiling)", step_copy},
               {"requant g16->g32 + stats", step_requant_stats},
               {"requant g16->g32, no stats", step_requant_nostats},
               {"requant, per-element kernel + stats", step_requant_simple},
               {"canonical, no requant (scan+place)", step_canonical},
               {"sm100 export (from g32)", step_sm100},
               {"requant + sm100 export", step_requant_sm100}};
  int nsteps = (int)(sizeof steps / sizeof steps[0]);
  float ms[8];
  for (int k = 0; k < nsteps; k++) ms[k] = (float)time_op(steps[k].fn, &L, reps, st);
  step_requant_stats(&L, st); /* the outputs checked below come from the default kernel */
  CK(cudaStreamSynchronize(st));
  uint32_t status;
  CK(cudaMemcpy(&status, L.status, 4, cudaMemcpyDeviceToHost));
  if (status != MM_GPU_STATUS_OK) fprintf(stderr, "bench_prep: unexpected non-finite data\n");

  /* Spot check: one expert's down projection against the CPU path. */
  size_t e_rows = (size_t)H, off = (size_t)(E - 1) * e_rows;
  uint8_t *hc = malloc(e_rows * (size_t)I / 2), *hs = malloc(e_rows * (size_t)I / 16);
  uint8_t *gc = malloc(e_rows * (size_t)I / 2), *gs = malloc(e_rows * (size_t)I / 32);
  uint8_t *cc = malloc(e_rows * (size_t)I / 2), *cs = malloc(e_rows * (size_t)I / 32);
  CK(cudaMemcpy(hc, L.c2 + off * (size_t)I / 2, e_rows * (size_t)I / 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hs, L.s2 + off * (size_t)I / 16, e_rows * (size_t)I / 16, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gc, L.o_c2 + off * (size_t)I / 2, e_rows * (size_t)I / 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gs, L.o_s2 + off * (size_t)I / 32, e_rows * (size_t)I / 32, cudaMemcpyDeviceToHost));
  mm_g16_source src = {(int)e_rows, I, MM_SF_E4M3, hc, hs, hrs};
  mm_requant_stats cst;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  OK(mm_requant_g16_to_g32(&src, cc, cs, 0, &cst));
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double cpu_s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
  double cpu_bytes = (double)e_rows * I * (0.5 + 1.0 / 16);
  int same = memcmp(gc, cc, e_rows * (size_t)I / 2) == 0 && memcmp(gs, cs, e_rows * (size_t)I / 32) == 0;

  printf("device: %s (%d SMs); layer: %d experts, H %d, I %d; source bytes %.1f MB "
         "(NVFP4 codes + E4M3 scales); median of %d after 3 warm-up\n",
         prop.name, prop.multiProcessorCount, E, H, I, L.src_bytes / 1e6, reps);
  printf("%-38s %10s %10s %8s\n", "step", "ms", "GB/s src", "% copy");
  for (int k = 0; k < nsteps; k++)
    printf("%-38s %10.3f %10.1f %7.1f%%\n", steps[k].name, ms[k], L.src_bytes / (ms[k] * 1e6),
           100.0 * ms[0] / ms[k]);
  printf("cpu requant (%d threads), one down proj [%d, %d]: %.3f s, %.2f GB/s src; GPU bytes %s\n",
         mm_thread_count(0), H, I, cpu_s, cpu_bytes / cpu_s / 1e9, same ? "identical" : "DIFFER");
  free(hc), free(hs), free(gc), free(gs), free(cc), free(cs), free(hrs);
  return same ? 0 : 1;
}

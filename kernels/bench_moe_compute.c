/* bench_moe_compute.c -- benchmark of the sm90 fused expert compute on one
 * GPU: one EP rank's local experts (default GLM-5 at EP8: E_loc 32, H 6144,
 * I 2048), pools of M rows (uniform, skewed or randomly routed over the
 * experts), median time of CUDA-event-timed calls after warm-up with input
 * sets rotated beyond L2.
 * Ceilings measured in the same run: HBM streaming read, cuBLASLt FP8 and
 * BF16 dense GEMM (8192^3, both on the same random values: BF16 on zeros, as
 * before version 15, ran 4-5% faster than on data, 887 against 843-850
 * TFLOP/s), and cuBLASLt FP8 and BF16 baselines with the same FLOPs (the two
 * dense GEMMs [M,H]x[H,2I], [M,I]x[I,H]): issue 4 measures the FP8 modes
 * against FP8 and bf16-exact against BF16.
 *
 *   bench_moe_compute [--gran-k 16|32] [--requant] [--compute fp8|bf16-exact]
 *     [--E n] [--H n] [--I n] [--M a,b,c] [--iters n] [--path wgmma|simt|prefill|auto]
 *     [--profile-only] [--block-refs] [--loads uniform,skewed,random,zipf] [--out-rows]
 *     [--prefill-experts n]
 * Weight mode as the backend picks it: gran 32 -> mode 1 (FP8 QGMMA), with
 * --compute bf16-exact mode 4 (F16 HGMMA on mode 1's records); gran 16 ->
 * mode 3 (fp8, the default here) or mode 2 (bf16-exact).
 * --requant: a gran-16 checkpoint requantized to gran 32 (mode 1 or 4);
 * --profile-only: only the expert compute (for ncu / nsys), no baselines;
 * --block-refs (modes 1, 3, 4): every block keeps its rows' reference exponent
 * (rows without the packer's row anchor) instead of reference 0 everywhere;
 * --loads: which expert loads to run per M (default the first three): uniform
 * (M / E rows each), skewed (expert 0 takes half), random (each row routed to
 * an expert drawn uniformly, fixed seed: the spread of real routing, where
 * about half the experts hold more than the average) and zipf (each row's
 * expert drawn with probability proportional to 1 / (e + 1), fixed seed: a
 * few hot experts between random and skewed; with 32 experts the first takes
 * about 8 times the average rows, the last a quarter of it);
 * --out-rows: the pool's rows go to out rows through a map (a fixed random
 * permutation), as the expert-parallel path has them write straight into the
 * combine's per-source segments (moe_compute.h mm_expert_pool.out_rows);
 * --path: auto (the default) runs what the product picks per call (the FP8
 * modes' prefill path from mm_sm90_prefill_min_rows rows per expert, else the
 * WGMMA kernels); wgmma, prefill and simt force one (prefill below that
 * rule's rows needs MEGAMOE_SM90_PREFILL=1 too: without it the workspace
 * is planned without the prefill path's region, and the call refuses);
 * --prefill-experts: experts per launch pair of the prefill path
 * (compute.prefill-experts, 1-32; default 16);
 * --warmup-ms t: every measurement (ceilings, ours, baselines) first runs its
 * operation for t ms, then times its iterations: the H200 reaches its 700 W
 * power cap within about a second of prefill-sized work and lowers its clocks
 * (docs/PERF.md, version 17). 0 (the default): three warm-up runs, the
 * short-burst numbers of earlier versions. */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../bench/bench_args.h"  /* strict option values */
#include "../bench/bench_gpu.h"  /* CK, timing, the cuBLASLt baseline */
#include "../bench/bench_util.h" /* OK(): a failed call ends the run */
#include "../bench/expert_counts.h"
#include "moe_compute.h"

/* The same FLOPs as the expert compute, dense, in type ab: [M,H]x[H,2I] then
 * [M,I]x[I,H] (W1 [H, 2I], W2 [I, H], X [H, M] TN operands). Milliseconds,
 * or -1 where cuBLASLt has no algorithm. */
static double same_flops_ms(lt_ctx *c, cudaDataType_t ab, const void *W1, const void *W2,
                            const void *X, void *Y, void *Z, int M, int H, int I, int iters,
                            cudaStream_t st) {
  const double a = lt_time(c, 2 * I, M, H, ab, W1, X, Y, iters, st);
  const double b = lt_time(c, H, M, I, ab, W2, X, Z, iters, st);
  return a > 0 && b > 0 ? a + b : -1;
}

/* A baseline's table cells: its time (us) and its ratio to ours. */
static void baseline_cells(double base_ms, double ms, char time[32], char ratio[32]) {
  if (base_ms <= 0) return;
  snprintf(time, 32, "%.1f", base_ms * 1e3);
  snprintf(ratio, 32, "%.2f", base_ms / ms);
}

/* ---------------------------------------------------------------- main ---- */

typedef struct {
  void *x, *xs, *rw, *out, *off, *map; /* map: out rows (--out-rows) or NULL */
} input_set;

/* One expert-compute call on input set s (pool of M rows, no rows hint). */
static void compute_set(const mm_sm90_layer *L, const input_set *s, int M, void *ws, size_t wsb,
                        cudaStream_t st, mm_sm90_path path) {
  mm_expert_pool pool = {M, s->off, s->x, s->xs, s->rw, s->out, 0, s->map};
  OK(mm_sm90_expert_compute_path(L, &pool, 0.0f, ws, wsb, st, path));
}

int main(int argc, char **argv) {
  int gran = 32, requant = 0, bf16_exact = 0, E = 32, H = 6144, I = 2048, iters = 20;
  int profile_only = 0, block_refs = 0, out_rows = 0;
  int loads[MM_LOAD_COUNT] = {1, 1, 1, 0}; /* uniform, skewed, random, zipf */
  mm_sm90_path path = MM_SM90_PATH_AUTO;
  int prefill_experts = MM_SM90_PREFILL_EXPERTS_DEFAULT;
  int Ms[16] = {256, 1024, 4096, 16384, 32768}, nM = 5;
  static const char *const path_names[] = {"wgmma", "simt", "prefill", "auto", NULL};
  static const mm_sm90_path path_of[] = {MM_SM90_PATH_WGMMA, MM_SM90_PATH_SIMT,
                                         MM_SM90_PATH_PREFILL, MM_SM90_PATH_AUTO};
  static const char *const compute_names[] = {"fp8", "bf16-exact", NULL};
  static const char *const gran_names[] = {"16", "32", NULL};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    int bad = 0, k = 0;
    if (!strcmp(a, "--requant")) requant = 1;
    else if (!strcmp(a, "--profile-only")) profile_only = 1;
    else if (!strcmp(a, "--block-refs")) block_refs = 1;
    else if (!strcmp(a, "--out-rows")) out_rows = 1;
    else if (!strcmp(a, "--gran-k")) {
      bad = bench_arg_choice(a, v, gran_names, &k), i++;
      gran = k ? 32 : 16;
    }
    else if (!strcmp(a, "--compute")) bad = bench_arg_choice(a, v, compute_names, &bf16_exact), i++;
    else if (!strcmp(a, "--E")) bad = bench_arg_int(a, v, 1, 4096, &E), i++;
    else if (!strcmp(a, "--H")) bad = bench_arg_int(a, v, 128, 65536, &H), i++;
    else if (!strcmp(a, "--I")) bad = bench_arg_int(a, v, 128, 65536, &I), i++;
    else if (!strcmp(a, "--iters")) bad = bench_arg_int(a, v, 1, 100000, &iters), i++;
    else if (!strcmp(a, "--warmup-ms")) bad = bench_arg_double(a, v, 0, 600000, &g_warmup_ms), i++;
    else if (!strcmp(a, "--prefill-experts"))
      bad = bench_arg_int(a, v, 1, MM_SM90_PREFILL_CHUNK, &prefill_experts), i++;
    else if (!strcmp(a, "--path")) {
      bad = bench_arg_choice(a, v, path_names, &k), i++;
      path = path_of[k];
    }
    else if (!strcmp(a, "--M")) bad = bench_arg_int_list(a, v, 1, 1 << 20, Ms, 16, &nM), i++;
    else if (!strcmp(a, "--loads")) {
      memset(loads, 0, sizeof(loads));
      for (char *t = strtok((char *)(v ? v : ""), ","); t; t = strtok(NULL, ",")) {
        const int l = mm_load_by_name(t);
        if (l < 0) {
          fprintf(stderr, "--loads: unknown load %s (uniform, skewed, random, zipf)\n", t);
          return 2;
        }
        loads[l] = 1;
      }
      int any = 0;
      for (int l = 0; l < MM_LOAD_COUNT; l++) any |= loads[l];
      if (!any) {
        fprintf(stderr, "--loads needs at least one of uniform, skewed, random, zipf\n");
        return 2;
      }
      i++;
    } else {
      fprintf(stderr, "unknown option %s (see the header of bench_moe_compute.c)\n", a);
      return 2;
    }
    if (bad) return 2;
  }
  /* the backend's choice (mm_cuda_weight_mode); --requant lands on gran 32 */
  const int g32 = gran == 32 || requant;
  const mm_weight_mode mode = g32 ? (bf16_exact ? MM_WMODE_G32_F16_EXACT : MM_WMODE_G32_FP8)
                              : bf16_exact ? MM_WMODE_G16_BF16_EXACT
                                           : MM_WMODE_G16_FP8;
  const char *mode_name =
      mode == MM_WMODE_G32_FP8         ? (requant ? "g16->g32 requant, fp8" : "g32 fp8")
      : mode == MM_WMODE_G32_F16_EXACT ? (requant ? "g16->g32 requant, bf16-exact (F16 HGMMA)"
                                                  : "g32 bf16-exact (F16 HGMMA)")
      : mode == MM_WMODE_G16_BF16_EXACT ? "g16 bf16-exact (F16 HGMMA)"
                                        : "g16 fp8 (folded, lossy)";
  int dev = 0;
  CK(cudaSetDevice(dev));
  struct cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  printf("# device %s, %d SMs; mode %s; E_loc %d H %d I %d; iters %d%s%s; warm-up %.0f ms; "
         "path %s; prefill experts per launch %d\n",
         prop.name, prop.multiProcessorCount, mode_name, E, H, I, iters,
         block_refs ? "; per-block references" : "", out_rows ? "; out rows mapped" : "",
         g_warmup_ms,
         path == MM_SM90_PATH_AUTO      ? "auto"
         : path == MM_SM90_PATH_PREFILL ? "prefill"
         : path == MM_SM90_PATH_SIMT    ? "simt"
                                        : "wgmma",
         prefill_experts);

  mm_sm90_layer *L = NULL;
  OK(mm_sm90_layer_create_random(E, H, I, mode, 12345, block_refs, st, &L));
  mm_sm90_layer_set_prefill(L, 1, prefill_experts);
  const double wbytes_all = (double)mm_sm90_layer_device_bytes(L);

  /* ceilings */
  double hbm_gbs = 0, lt_fp8_peak = 0, lt_bf16_peak = 0;
  lt_ctx lc = {0};
  if (!profile_only) {
    const size_t rb = (size_t)4 << 30;
    void *buf;
    float *sink;
    CK(cudaMalloc(&buf, rb));
    CK(cudaMalloc((void **)&sink, 4096 * sizeof(float)));
    CK(cudaMemset(buf, 1, rb));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float t[7];
    for (const double t0 = now_ms(); warming(t0, st);) OK(mm_sm90_bench_read(buf, rb, sink, st));
    for (int i = 0; i < 9; i++) {
      CK(cudaEventRecord(e0, st));
      OK(mm_sm90_bench_read(buf, rb, sink, st));
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      if (i >= 2) CK(cudaEventElapsedTime(&t[i - 2], e0, e1));
    }
    hbm_gbs = (double)rb / (median(t, 7) * 1e-3) / 1e9;
    CK(cudaFree(buf));
    CK(cudaFree(sink));
    if (cublasLtCreate(&lc.lt) != CUBLAS_STATUS_SUCCESS) {
      fprintf(stderr, "cublasLtCreate failed\n");
      return 1;
    }
    lc.ws_bytes = 64 << 20;
    CK(cudaMalloc(&lc.ws, lc.ws_bytes));
    const int n = 8192;
    void *A, *B, *D;
    CK(cudaMalloc(&A, (size_t)n * n * 2));
    CK(cudaMalloc(&B, (size_t)n * n * 2));
    CK(cudaMalloc(&D, (size_t)n * n * 2));
    OK(mm_sm90_bench_fill_fp8(A, (size_t)n * n, 1, st));
    OK(mm_sm90_bench_fill_fp8(B, (size_t)n * n, 2, st));
    const double fl = 2.0 * n * (double)n * n;
    double ms = lt_time(&lc, n, n, n, CUDA_R_8F_E4M3, A, B, D, 10, st);
    lt_fp8_peak = ms > 0 ? fl / (ms * 1e-3) / 1e12 : 0;
    OK(mm_sm90_bench_fill_bf16(A, (size_t)n * n, 1, st));
    OK(mm_sm90_bench_fill_bf16(B, (size_t)n * n, 2, st));
    ms = lt_time(&lc, n, n, n, CUDA_R_16BF, A, B, D, 10, st);
    lt_bf16_peak = ms > 0 ? fl / (ms * 1e-3) / 1e12 : 0;
    CK(cudaFree(A));
    CK(cudaFree(B));
    CK(cudaFree(D));
    printf("# ceilings: HBM read %.0f GB/s; cuBLASLt dense 8192^3: FP8 %.0f TFLOP/s, BF16 %.0f "
           "TFLOP/s\n",
           hbm_gbs, lt_fp8_peak, lt_bf16_peak);
  }
  printf("# weights %.1f MB (%.4f bytes/weight incl. scales)\n", wbytes_all / 1e6,
         wbytes_all / (3.0 * H * (double)I * E));
  printf("| M | rows/expert | time us | TFLOP/s | weight TB/s | %% HBM read | %% cuBLASLt FP8 peak "
         "| %% cuBLASLt BF16 peak | cuBLASLt FP8 same-FLOPs us | FP8 ratio (cuBLASLt / ours) "
         "| cuBLASLt BF16 same-FLOPs us | BF16 ratio |\n"
         "|---|---|---|---|---|---|---|---|---|---|---|---|\n");

  for (int mi = 0; mi < nM; mi++)
    for (int load = 0; load < MM_LOAD_COUNT; load++) {
      if (!loads[load]) continue;
      const int M = Ms[mi];
      int *offs = malloc(sizeof(int) * (E + 1));
      int *cnt = malloc(sizeof(int) * (size_t)E);
      if (!offs || !cnt) {
        fprintf(stderr, "out of host memory\n");
        exit(1);
      }
      mm_load_counts(load, M, E, cnt); /* bench/expert_counts.h */
      int most = 0;
      offs[0] = 0;
      for (int e = 0; e < E; e++) {
        offs[e + 1] = offs[e] + cnt[e];
        if (cnt[e] > most) most = cnt[e];
      }
      free(cnt);
      const size_t set_bytes = (size_t)M * H * 3 + (size_t)M * (H / 128 + 1) * 4;
      int nsets = (int)((2 * 50e6) / (double)set_bytes) + 1;
      if (nsets < 2) nsets = 2;
      if (nsets > 16) nsets = 16;
      input_set sets[16];
      for (int s = 0; s < nsets; s++) {
        CK(cudaMalloc(&sets[s].x, (size_t)M * H));
        CK(cudaMalloc(&sets[s].xs, sizeof(float) * (size_t)M * (H / 128)));
        CK(cudaMalloc(&sets[s].rw, sizeof(float) * (size_t)M));
        CK(cudaMalloc(&sets[s].out, 2 * (size_t)M * H));
        CK(cudaMalloc(&sets[s].off, sizeof(int) * (E + 1)));
        OK(mm_sm90_bench_fill_fp8(sets[s].x, (size_t)M * H, 100 + s, st));
        OK(mm_sm90_bench_fill_uniform(sets[s].xs, (size_t)M * (H / 128), 0.01f, 0.02f, 200 + s, st));
        OK(mm_sm90_bench_fill_uniform(sets[s].rw, (size_t)M, 0.1f, 1.0f, 300 + s, st));
        CK(cudaMemcpyAsync(sets[s].off, offs, sizeof(int) * (E + 1), cudaMemcpyHostToDevice, st));
        sets[s].map = NULL;
        if (out_rows) {
          int *map = malloc(sizeof(int) * (size_t)M);
          if (!map) {
            fprintf(stderr, "out of host memory\n");
            exit(1);
          }
          for (int r = 0; r < M; r++) map[r] = r;
          srand(400 + s);
          for (int r = M - 1; r > 0; r--) {
            const int j = rand() % (r + 1), v = map[r];
            map[r] = map[j];
            map[j] = v;
          }
          CK(cudaMalloc(&sets[s].map, sizeof(int) * (size_t)M));
          CK(cudaMemcpy(sets[s].map, map, sizeof(int) * (size_t)M, cudaMemcpyHostToDevice));
          free(map);
        }
      }
      const size_t wsb = mm_sm90_workspace_bytes(L, M);
      void *ws;
      CK(cudaMalloc(&ws, wsb));
      cudaEvent_t e0, e1;
      CK(cudaEventCreate(&e0));
      CK(cudaEventCreate(&e1));
      float *t = malloc(sizeof(float) * (size_t)iters);
      int wi = 0;
      for (const double t0 = now_ms(); warming(t0, st); wi++)
        compute_set(L, &sets[wi % nsets], M, ws, wsb, st, path);
      for (int i = 0; i < iters + 3; i++) {
        CK(cudaEventRecord(e0, st));
        compute_set(L, &sets[i % nsets], M, ws, wsb, st, path);
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        if (i >= 3) CK(cudaEventElapsedTime(&t[i - 3], e0, e1));
      }
      const double ms = median(t, iters);
      const double flops = 6.0 * M * (double)H * I;
      int active = 0;
      for (int e = 0; e < E; e++) active += offs[e + 1] > offs[e];
      const double wb = wbytes_all * active / E;
      double lt_ms = -1, lt16_ms = -1;
      if (!profile_only) {
        /* same FLOPs: dense [M,H]x[H,2I] then [M,I]x[I,H], FP8 then BF16
         * (the same values) */
        void *W1, *W2, *X, *Y, *Z;
        CK(cudaMalloc(&W1, (size_t)2 * I * H * 2));
        CK(cudaMalloc(&W2, (size_t)H * I * 2));
        CK(cudaMalloc(&X, (size_t)M * H * 2));
        CK(cudaMalloc(&Y, (size_t)M * 2 * I * 2));
        CK(cudaMalloc(&Z, (size_t)M * H * 2));
        OK(mm_sm90_bench_fill_fp8(W1, (size_t)2 * I * H, 7, st));
        OK(mm_sm90_bench_fill_fp8(W2, (size_t)H * I, 8, st));
        OK(mm_sm90_bench_fill_fp8(X, (size_t)M * H, 9, st));
        lt_ms = same_flops_ms(&lc, CUDA_R_8F_E4M3, W1, W2, X, Y, Z, M, H, I, iters, st);
        OK(mm_sm90_bench_fill_bf16(W1, (size_t)2 * I * H, 7, st));
        OK(mm_sm90_bench_fill_bf16(W2, (size_t)H * I, 8, st));
        OK(mm_sm90_bench_fill_bf16(X, (size_t)M * H, 9, st));
        lt16_ms = same_flops_ms(&lc, CUDA_R_16BF, W1, W2, X, Y, Z, M, H, I, iters, st);
        cudaFree(W1);
        cudaFree(W2);
        cudaFree(X);
        cudaFree(Y);
        cudaFree(Z);
      }
      const double tf = flops / (ms * 1e-3) / 1e12;
      const double wtbs = wb / (ms * 1e-3) / 1e12;
      char hbm[32] = "n/a", pk[32] = "n/a", pk16[32] = "n/a", lt[32] = "n/a", ratio[32] = "n/a",
           lt16[32] = "n/a", ratio16[32] = "n/a";
      if (hbm_gbs > 0) snprintf(hbm, sizeof(hbm), "%.0f%%", 100.0 * wtbs * 1e3 / hbm_gbs);
      if (lt_fp8_peak > 0) snprintf(pk, sizeof(pk), "%.0f%%", 100.0 * tf / lt_fp8_peak);
      if (lt_bf16_peak > 0) snprintf(pk16, sizeof(pk16), "%.0f%%", 100.0 * tf / lt_bf16_peak);
      baseline_cells(lt_ms, ms, lt, ratio);
      baseline_cells(lt16_ms, ms, lt16, ratio16);
      char note[32] = "";
      if (load == MM_LOAD_SKEWED) snprintf(note, sizeof note, " (e0: M/2)");
      if (load >= MM_LOAD_RANDOM) snprintf(note, sizeof note, " (max %d)", most);
      printf("| %d %s | %.0f%s | %.1f | %.1f | %.2f | %s | %s | %s | %s | %s | %s | %s |\n", M,
             mm_load_names[load], (double)M / E, note, ms * 1e3, tf, wtbs, hbm, pk, pk16, lt, ratio,
             lt16, ratio16);
      fflush(stdout);
      free(t);
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
      cudaFree(ws);
      for (int s = 0; s < nsets; s++) {
        cudaFree(sets[s].x);
        cudaFree(sets[s].xs);
        cudaFree(sets[s].rw);
        cudaFree(sets[s].out);
        cudaFree(sets[s].off);
        cudaFree(sets[s].map);
      }
      free(offs);
    }
  mm_sm90_layer_destroy(L);
  return 0;
}

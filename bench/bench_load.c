/* bench_load.c -- CPU throughput of the weight load path for one GLM-shaped
 * layer on one rank (default 32 experts, H 6144, I 2048, gate+up+down):
 *   load    mm_weights_load_layer on NVFP4 (no requant / group16 -> group32
 *           requant) and MXFP4 (UE8M0 group 32) tensors in host memory
 *   pack    the sm90 kernel layout of the loaded experts, per weight mode:
 *           mm_sm90_pack_experts on all experts (what mm_sm90_layer_create
 *           runs), and mm_sm90_pack_matrix matrix by matrix (the CPU
 *           reference, as the cuda backend called it before) on the first
 *           --ref-experts experts, whose bytes must match
 * GB/s counts source bytes (E2M1 codes + scale bytes); ns/weight is wall
 * time per weight, core-ns/weight that times the thread count. Median of
 * --reps runs. Data are synthetic (random codes, moderate scales).
 *
 *   bench_load [--experts E] [--hidden H] [--inter I] [--threads T]
 *              [--reps N] [--ref-experts R]   (R: default min(E, 2))
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_args.h"
#include "config.h"
#include "layout_sm90.h"
#include "layout_sm90_pack.h"
#include "parallel.h"
#include "weights_load.h"
#include "bench_util.h"


static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    fprintf(stderr, "out of memory (%zu bytes)\n", n);
    exit(1);
  }
  return p;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *t, int n) {
  qsort(t, (size_t)n, sizeof(double), cmp_double);
  return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next_u64(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

static void fill_random(uint8_t *p, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = next_u64();
    memcpy(p + i, &v, 8);
  }
  for (; i < n; i++) p[i] = (uint8_t)next_u64();
}

/* ---- a synthetic layer ---------------------------------------------------- */

typedef enum { FMT_NVFP4, FMT_MXFP4 } fmt;

typedef struct {
  int n;
  mm_tensor_view *v;
  char (*names)[64];
  size_t src_bytes; /* codes + group scale bytes */
} layer_t;

static mm_tensor_view *add(layer_t *L, const char *name, mm_dtype dt, int ndim, int64_t a,
                           int64_t b, size_t bytes) {
  mm_tensor_view *t = &L->v[L->n];
  snprintf(L->names[L->n], sizeof L->names[0], "%s", name);
  memset(t, 0, sizeof *t);
  t->name = L->names[L->n];
  t->dtype = dt;
  t->ndim = ndim;
  t->shape[0] = a;
  t->shape[1] = b;
  t->data = xmalloc(bytes);
  L->n++;
  return t;
}

/* NVFP4: E4M3 group-16 scales in [0.5, 7.5] (so that the requant fits
 * group 32 and every 128-column block folds exactly in mode 1), global
 * scales ~1e-3. MXFP4: UE8M0 group-32 exponents 2^-8 .. 2^2. */
static void make_layer(layer_t *L, fmt f, int E, int H, int I) {
  L->n = 0;
  L->src_bytes = 0;
  L->v = xmalloc(sizeof(*L->v) * (size_t)E * 12);
  L->names = xmalloc(sizeof(*L->names) * (size_t)E * 12);
  static const char *pn[3] = {"gate_proj", "up_proj", "down_proj"};
  for (int e = 0; e < E; e++)
    for (int p = 0; p < 3; p++) {
      int64_t N = p == 2 ? H : I, K = p == 2 ? I : H, g = f == FMT_NVFP4 ? 16 : 32;
      char nm[64];
      snprintf(nm, sizeof nm, "model.layers.3.mlp.experts.%d.%s.weight", e, pn[p]);
      mm_tensor_view *w = add(L, nm, MM_DT_U8, 2, N, K / 2, (size_t)(N * K / 2));
      fill_random((uint8_t *)w->data, (size_t)(N * K / 2));
      snprintf(nm, sizeof nm, "model.layers.3.mlp.experts.%d.%s.weight_scale", e, pn[p]);
      size_t ns = (size_t)(N * (K / g));
      mm_tensor_view *s =
          add(L, nm, f == FMT_NVFP4 ? MM_DT_F8_E4M3 : MM_DT_U8, 2, N, K / g, ns);
      uint8_t *sb = (uint8_t *)s->data;
      for (size_t i = 0; i < ns; i++)
        sb[i] = f == FMT_NVFP4 ? (uint8_t)(0x30 + next_u64() % 0x20)
                               : (uint8_t)(119 + next_u64() % 11);
      L->src_bytes += (size_t)(N * K / 2) + ns;
      if (f == FMT_NVFP4) {
        snprintf(nm, sizeof nm, "model.layers.3.mlp.experts.%d.%s.weight_scale_2", e, pn[p]);
        *(float *)add(L, nm, MM_DT_F32, 0, 0, 0, 4)->data =
            1e-3f * (1.0f + (float)(next_u64() % 100) / 100.0f);
        snprintf(nm, sizeof nm, "model.layers.3.mlp.experts.%d.%s.input_scale", e, pn[p]);
        *(float *)add(L, nm, MM_DT_F32, 0, 0, 0, 4)->data = 0.02f;
      }
    }
}

static void free_layer(layer_t *L) {
  for (int i = 0; i < L->n; i++) free((void *)L->v[i].data);
  free(L->v);
  free(L->names);
  memset(L, 0, sizeof *L);
}

static void free_experts(mm_expert_q *x, int n) {
  for (int i = 0; i < n; i++) {
    mm_qmat_free(&x[i].w13);
    mm_qmat_free(&x[i].w2);
  }
}

/* ---- report --------------------------------------------------------------- */

static int g_threads = 1;

/* threads: what the step ran on (the reference pack is single-threaded). */
static void row_t(const char *what, double s, size_t src_bytes, double weights, int threads) {
  printf("| %-46s | %8.3f | %7.3f | %7.2f | %8.2f |\n", what, s, (double)src_bytes / s * 1e-9,
         s / weights * 1e9, s / weights * 1e9 * threads);
  fflush(stdout);
}

static void row(const char *what, double s, size_t src_bytes, double weights) {
  row_t(what, s, src_bytes, weights, g_threads);
}

/* ---- steps ---------------------------------------------------------------- */

/* Loads the layer `reps` times; leaves the last result in out. */
static double time_load(const mm_config *cfg, const layer_t *L, int E, int reps,
                        mm_expert_q *out) {
  double *t = xmalloc(sizeof(double) * (size_t)reps);
  for (int r = 0; r < reps; r++) {
    if (r) free_experts(out, E);
    mm_requant_report rep;
    double t0 = now_s();
    OK(mm_weights_load_layer(cfg, L->v, (size_t)L->n, 0, E, out, &rep));
    t[r] = now_s() - t0;
    if (r == 0) printf("# %s\n", rep.summary);
    mm_requant_report_free(&rep);
  }
  double m = median(t, reps);
  free(t);
  return m;
}

static size_t qmat_src_bytes(const mm_qmat *m) {
  return (size_t)m->rows * (size_t)m->cols / 2 + (size_t)m->rows * (size_t)(m->cols / m->gran);
}

/* The reference: matrix by matrix, as mm_sm90_layer_create packed them, into
 * one staging buffer per expert (w13 then w2). */
static double time_pack_ref(const mm_expert_q *x, int n, mm_weight_mode mode, int reps,
                            uint8_t *blob, float *rs13, float *rs2) {
  const int H = x[0].w13.cols, I = x[0].w2.cols;
  const size_t b13 = mm_sm90_matrix_bytes(mode, 2 * I, H), b2 = mm_sm90_matrix_bytes(mode, H, I);
  double *t = xmalloc(sizeof(double) * (size_t)reps);
  for (int r = 0; r < reps; r++) {
    double t0 = now_s();
    for (int e = 0; e < n; e++) {
      double fe[2];
      uint8_t *dst = blob + (size_t)e * (b13 + b2);
      OK(mm_sm90_pack_matrix(&x[e].w13, mode, 1, dst, rs13 + (size_t)e * 2 * I, fe));
      OK(mm_sm90_pack_matrix(&x[e].w2, mode, 0, dst + b13, rs2 + (size_t)e * H, fe));
    }
    t[r] = now_s() - t0;
  }
  double m = median(t, reps);
  free(t);
  return m;
}

static double time_pack_fast(const mm_expert_q *x, int n, mm_weight_mode mode, int threads,
                             int reps, uint8_t *blob, float *rs13, float *rs2, double fe[2]) {
  double *t = xmalloc(sizeof(double) * (size_t)reps);
  for (int r = 0; r < reps; r++) {
    fe[0] = fe[1] = 0.0;
    double t0 = now_s();
    OK(mm_sm90_pack_experts(x, n, 0, mode, threads, blob, rs13, rs2, fe));
    t[r] = now_s() - t0;
  }
  double m = median(t, reps);
  free(t);
  return m;
}

static void bench_pack(const mm_expert_q *x, int E, int ref_E, mm_weight_mode mode, int threads,
                       int reps) {
  const int H = x[0].w13.cols, I = x[0].w2.cols;
  const size_t eb = mm_sm90_matrix_bytes(mode, 2 * I, H) + mm_sm90_matrix_bytes(mode, H, I);
  const size_t src1 = qmat_src_bytes(&x[0].w13) + qmat_src_bytes(&x[0].w2);
  const double w1 = 3.0 * (double)H * (double)I;
  uint8_t *blob = xmalloc(eb * (size_t)E);
  float *rs13 = xmalloc(sizeof(float) * (size_t)E * 2 * (size_t)I);
  float *rs2 = xmalloc(sizeof(float) * (size_t)E * (size_t)H);
  double fe[2];
  char what[96];
  snprintf(what, sizeof what, "pack mode %d, %d experts", (int)mode, E);
  row(what, time_pack_fast(x, E, mode, threads, reps, blob, rs13, rs2, fe), src1 * (size_t)E,
      w1 * E);
  if (ref_E > 0) {
    uint8_t *ref = xmalloc(eb * (size_t)ref_E);
    float *r13 = xmalloc(sizeof(float) * (size_t)ref_E * 2 * (size_t)I);
    float *r2 = xmalloc(sizeof(float) * (size_t)ref_E * (size_t)H);
    snprintf(what, sizeof what, "pack mode %d, reference, %d experts", (int)mode, ref_E);
    row_t(what, time_pack_ref(x, ref_E, mode, 1, ref, r13, r2), src1 * (size_t)ref_E, w1 * ref_E,
          1);
    int same = memcmp(ref, blob, eb * (size_t)ref_E) == 0 &&
               memcmp(r13, rs13, sizeof(float) * (size_t)ref_E * 2 * (size_t)I) == 0;
    for (int e = 0; e < ref_E; e++)
      same = same && memcmp(r2 + (size_t)e * H, rs2 + (size_t)e * H, sizeof(float) * (size_t)H) == 0;
    printf("# mode %d: fast bytes %s the reference's (%d experts)\n", (int)mode,
           same ? "equal" : "DIFFER FROM", ref_E);
    if (!same) exit(1);
    free(ref);
    free(r13);
    free(r2);
  }
  if (mode == MM_WMODE_G16_FP8) printf("# mode 3 fold error %.4f\n", sqrt(fe[0] / fe[1]));
  free(blob);
  free(rs13);
  free(rs2);
}

int main(int argc, char **argv) {
  int E = 32, H = 6144, I = 2048, threads = 1, reps = 3, ref_E = -1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    int bad;
    if (!strcmp(a, "--experts")) bad = bench_arg_int(a, v, 1, 4096, &E);
    else if (!strcmp(a, "--hidden")) bad = bench_arg_int(a, v, 128, 65536, &H);
    else if (!strcmp(a, "--inter")) bad = bench_arg_int(a, v, 128, 65536, &I);
    else if (!strcmp(a, "--threads")) bad = bench_arg_int(a, v, 1, 4096, &threads);
    else if (!strcmp(a, "--reps")) bad = bench_arg_int(a, v, 1, 100000, &reps);
    else if (!strcmp(a, "--ref-experts")) bad = bench_arg_int(a, v, 0, 4096, &ref_E);
    else {
      fprintf(stderr,
              "usage: %s [--experts E] [--hidden H] [--inter I] [--threads T] [--reps N] "
              "[--ref-experts R]\n",
              argv[0]);
      return 2;
    }
    if (bad) return 2;
    i++;
  }
  if (H % 128 || I % 128 || ref_E > E) {
    fprintf(stderr, "--hidden and --inter must be multiples of 128, --ref-experts at most --experts\n");
    return 2;
  }
  if (ref_E < 0) ref_E = E < 2 ? E : 2; /* the reference is slow */
  g_threads = mm_thread_count(threads);
  const double weights = 3.0 * (double)E * (double)H * (double)I;
  printf("# bench_load: %d experts, H %d, I %d, %d threads, median of %d\n", E, H, I, g_threads,
         reps);
  printf("| %-46s | %8s | %7s | %7s | %8s |\n", "step", "s", "GB/s", "ns/w", "core-ns/w");
  printf("|---|---:|---:|---:|---:|\n");

  mm_config cfg;
  mm_config_defaults(&cfg);
  cfg.model.hidden_size = H;
  cfg.model.moe_intermediate_size = I;
  cfg.model.num_experts = E;
  cfg.cpu_threads = threads;
  cfg.gran_k = 0;

  mm_expert_q *x16 = calloc((size_t)E, sizeof *x16), *x32 = calloc((size_t)E, sizeof *x32);
  layer_t L;
  make_layer(&L, FMT_NVFP4, E, H, I);
  cfg.requant_policy = MM_REQUANT_NONE;
  row("load NVFP4, no requant", time_load(&cfg, &L, E, reps, x16), L.src_bytes, weights);
  cfg.requant_policy = MM_REQUANT_G16_TO_G32;
  row("load NVFP4, requant g16 -> g32 (+ stats)", time_load(&cfg, &L, E, reps, x32),
      L.src_bytes, weights);
  free_layer(&L);
  bench_pack(x32, E, ref_E, MM_WMODE_G32_FP8, threads, reps);
  free_experts(x32, E);
  bench_pack(x16, E, ref_E, MM_WMODE_G16_BF16_EXACT, threads, reps);
  bench_pack(x16, E, ref_E, MM_WMODE_G16_FP8, threads, reps);
  free_experts(x16, E);

  make_layer(&L, FMT_MXFP4, E, H, I);
  cfg.requant_policy = MM_REQUANT_NONE;
  row("load MXFP4 (UE8M0 g32)", time_load(&cfg, &L, E, reps, x32), L.src_bytes, weights);
  free_layer(&L);
  bench_pack(x32, E, ref_E, MM_WMODE_G32_FP8, threads, reps);
  free_experts(x32, E);
  free(x16);
  free(x32);
  return 0;
}

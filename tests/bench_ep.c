/* bench_ep.c -- dispatch and combine time and GB/s per rank, both modes,
 * beside a plain grouped ncclSend/ncclRecv all-to-all of the same bytes in
 * the same run. One thread per GPU (any rank count), GLM-5 shapes by default,
 * random top-k routing, the stand-in expert between dispatch and combine.
 *
 *   bench_ep [--ranks R] [--tokens T,T,...] [--ll-tokens T,...] [--iters N]
 *            [--hidden H] [--experts E] [--topk k] [--transport nccl,ipc]
 * Prints one markdown row per (mode, T) from rank 0, the low-latency mode
 * once per transport of --transport (default both; "ipc" rows that fell back
 * read "ipc->nccl"): medians over N timed iterations after 3 warm-ups (CUDA
 * events). Bytes are what this rank sends (the self segment included; the
 * IPC transport moves only the used rows of a fixed segment, the bytes
 * column counts the full segments); GB/s = bytes / time. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../bench/bench_args.h"
#include "backend_cuda.h"
#include "ep_engine.h"
#include "ep_kernels.h"
#include "ep_test_util.h"

typedef struct {
  int R, H, E, K, iters;
  int T, mode;            /* this run */
  mm_ep_transport transport;
  char key[64];
  mm_ep_transport used;   /* rank 0's engine */
  /* rank 0's results */
  double disp_us, comb_us, a2a_disp_us, a2a_comb_us;
  double disp_bytes, comb_bytes;
  int failed;
  pthread_barrier_t barrier;
} bench_ctx;

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return n ? v[n / 2] : 0;
}

#define BTRY(x)                                                              \
  do {                                                                       \
    mm_err *e_ = (x);                                                        \
    if (e_) {                                                                \
      fprintf(stderr, "rank %d: %s: %s\n", rank, #x, e_->message);           \
      megamoe_error_destroy(e_);                                             \
      c->failed = 1;                                                         \
      goto out;                                                              \
    }                                                                        \
  } while (0)
#define CTRY(x)                                                              \
  do {                                                                       \
    cudaError_t e_ = (x);                                                    \
    if (e_ != cudaSuccess) {                                                 \
      fprintf(stderr, "rank %d: %s: %s\n", rank, #x, cudaGetErrorString(e_)); \
      c->failed = 1;                                                         \
      goto out;                                                              \
    }                                                                        \
  } while (0)

static void bench_rank(int rank, void *p) {
  bench_ctx *c = p;
  const int R = c->R, H = c->H, E = c->E, K = c->K, T = c->T, per = E / R;
  const int ll = c->mode == MM_EP_MODE_LOW_LATENCY;
  mm_ep_comm *comm = NULL;
  mm_ep_engine *eng = NULL;
  cudaStream_t st = NULL;
  cudaEvent_t ev[4] = {0}, a0 = 0, a1 = 0;
  uint16_t *d_x = NULL, *d_out = NULL;
  int32_t *d_ids = NULL;
  float *d_w = NULL;
  void *a2a_send = NULL, *a2a_recv = NULL;
  int64_t *off = calloc((size_t)R * 6, sizeof(int64_t));
  double *td = calloc((size_t)c->iters, sizeof(double)), *tc = calloc((size_t)c->iters, sizeof(double));
  double *ta = calloc((size_t)c->iters, sizeof(double)), *tb = calloc((size_t)c->iters, sizeof(double));
  uint16_t *x = malloc((size_t)T * H * 2);
  int32_t *ids = malloc((size_t)T * K * 4);
  float *w = malloc((size_t)T * K * 4);
  CTRY(cudaSetDevice(rank));
  CTRY(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (int i = 0; i < 4; i++) CTRY(cudaEventCreate(&ev[i]));
  CTRY(cudaEventCreate(&a0));
  CTRY(cudaEventCreate(&a1));
  const megamoe_host_services *hs = mm_host_services();
  mm_ep_comm_args ca = {rank, R, rank, NULL, c->key, 120000, NULL, hs->kv_put, hs->kv_get};
  BTRY(mm_ep_comm_create(&ca, &comm));
  mm_ep_engine_args ea = {rank, R, rank, E, K, H, 2048, T, ll ? T : 0, 0, -1, comm, NULL, NULL, NULL,
                          c->transport};
  BTRY(mm_ep_engine_create(&ea, &eng));
  if (rank == 0) c->used = mm_ep_engine_transport(eng);
  /* Per-rank random inputs (seeded by rank). */
  mm_test_rng_state_ = 0x1234567ull + (uint64_t)rank * 7919;
  ept_fill_hidden(x, T, H);
  ept_fill_ids(ids, T, K, E, EPT_IDS_RANDOM, 0);
  for (int i = 0; i < T * K; i++)
    if (ids[i] < 0) ids[i] = (int32_t)(mm_test_rand_u64() % (uint64_t)E); /* full top-k */
  ept_fill_weights(w, T, K);
  CTRY(cudaMalloc((void **)&d_x, (size_t)T * H * 2));
  CTRY(cudaMalloc((void **)&d_out, (size_t)T * H * 2));
  CTRY(cudaMalloc((void **)&d_ids, (size_t)T * K * 4));
  CTRY(cudaMalloc((void **)&d_w, (size_t)T * K * 4));
  CTRY(cudaMemcpy(d_x, x, (size_t)T * H * 2, cudaMemcpyHostToDevice));
  CTRY(cudaMemcpy(d_ids, ids, (size_t)T * K * 4, cudaMemcpyHostToDevice));
  CTRY(cudaMemcpy(d_w, w, (size_t)T * K * 4, cudaMemcpyHostToDevice));
  /* The bytes each mode moves, from the CPU plan (the same plan as the GPU's). */
  const mm_ep_sizes *sz = mm_ep_engine_sizes(eng);
  mm_route_geom g = {R, E, K};
  int *tokc = calloc((size_t)R, sizeof(int)), *pairc = calloc((size_t)R, sizeof(int));
  int32_t *ts = malloc((size_t)T * K * 4 + 4), *ps = malloc((size_t)T * K * 4 + 4);
  mm_route_send_plan(&g, T, ids, tokc, pairc, ts, ps, NULL);
  int64_t *sb = off, *so = off + R, *cb = off + 2 * R, *co = off + 3 * R;
  double db = 0, cbt = 0;
  for (int r = 0; r < R; r++) {
    sb[r] = ll ? (int64_t)T * sz->row_bytes : (int64_t)tokc[r] * sz->row_bytes;
    cb[r] = ll ? (int64_t)T * K * H * 2 : (int64_t)pairc[r] * H * 2;
    db += (double)sb[r];
    cbt += (double)cb[r];
  }
  free(tokc), free(pairc), free(ts), free(ps);
  (void)per;
  /* The plain all-to-all moves exactly the same bytes: each rank learns what
   * every peer sends it through the kv store. */
  int64_t *rb = off + 4 * R, *rc = off + 5 * R;
  int64_t *ro = calloc((size_t)R * 2, sizeof(int64_t)), *rco = ro + R;
  {
    char k[96];
    int64_t *mine = calloc((size_t)R * 2, sizeof(int64_t));
    for (int r = 0; r < R; r++) mine[r] = sb[r], mine[R + r] = cb[r];
    snprintf(k, sizeof k, "%s/bytes/%d", c->key, rank);
    int bad = hs->kv_put(NULL, k, mine, sizeof(int64_t) * 2 * (size_t)R);
    for (int r = 0; r < R && !bad; r++) {
      size_t len;
      snprintf(k, sizeof k, "%s/bytes/%d", c->key, r);
      bad = hs->kv_get(NULL, k, mine, sizeof(int64_t) * 2 * (size_t)R, &len, 60000);
      rb[r] = mine[rank];
      rc[r] = mine[R + rank];
    }
    free(mine);
    if (bad) {
      c->failed = 1;
      free(ro);
      goto out;
    }
  }
  int64_t stot = 0, rtot = 0, ctot = 0, rctot = 0;
  for (int r = 0; r < R; r++) {
    so[r] = stot, stot += sb[r];
    co[r] = ctot, ctot += cb[r];
    ro[r] = rtot, rtot += rb[r];
    rco[r] = rctot, rctot += rc[r];
  }
  int64_t big = stot > ctot ? stot : ctot;
  if (rtot > big) big = rtot;
  if (rctot > big) big = rctot;
  if (cudaMalloc(&a2a_send, (size_t)big + 16) || cudaMalloc(&a2a_recv, (size_t)big + 16)) {
    c->failed = 1;
    free(ro);
    goto out;
  }
  for (int it = -3; it < c->iters; it++) {
    mm_ep_step s = {T, d_x, d_ids, d_w, 2.5f, (mm_ep_mode)c->mode, st,
                    {ev[0], ev[1], ev[2], ev[3]}};
    mm_expert_pool pool;
    void *ws;
    size_t wsb;
    pthread_barrier_wait(&c->barrier);
    BTRY(mm_ep_dispatch(eng, &s, &pool, &ws, &wsb));
    if (mm_ep_launch_identity_compute(&pool, per, rank * per, H, st)) {
      c->failed = 1;
      goto out;
    }
    BTRY(mm_ep_combine(eng, d_out));
    CTRY(cudaStreamSynchronize(st));
    /* Same-bytes plain all-to-all: dispatch bytes, then combine bytes. */
    for (int phase = 0; phase < 2; phase++) {
      pthread_barrier_wait(&c->barrier);
      CTRY(cudaEventRecord(a0, st));
      if (phase)
        BTRY(mm_ep_comm_alltoallv(comm, a2a_send, co, cb, a2a_recv, rco, rc, st));
      else
        BTRY(mm_ep_comm_alltoallv(comm, a2a_send, so, sb, a2a_recv, ro, rb, st));
      CTRY(cudaEventRecord(a1, st));
      CTRY(cudaStreamSynchronize(st));
      float ms = 0;
      CTRY(cudaEventElapsedTime(&ms, a0, a1));
      if (it >= 0) (phase ? tb : ta)[it] = ms * 1e3;
    }
    if (it >= 0) {
      float m1 = 0, m2 = 0;
      CTRY(cudaEventElapsedTime(&m1, ev[0], ev[1]));
      CTRY(cudaEventElapsedTime(&m2, ev[2], ev[3]));
      td[it] = m1 * 1e3;
      tc[it] = m2 * 1e3;
    }
  }
  BTRY(mm_ep_take_error(eng, st, 1));
  if (rank == 0) {
    c->disp_us = median(td, c->iters);
    c->comb_us = median(tc, c->iters);
    c->a2a_disp_us = median(ta, c->iters);
    c->a2a_comb_us = median(tb, c->iters);
    c->disp_bytes = db;
    c->comb_bytes = cbt;
  }
  free(ro);
out:
  if (st) cudaStreamSynchronize(st);
  mm_ep_engine_destroy(eng);
  mm_ep_comm_destroy(comm);
  cudaFree(d_x), cudaFree(d_out), cudaFree(d_ids), cudaFree(d_w);
  cudaFree(a2a_send), cudaFree(a2a_recv);
  for (int i = 0; i < 4; i++)
    if (ev[i]) cudaEventDestroy(ev[i]);
  if (a0) cudaEventDestroy(a0);
  if (a1) cudaEventDestroy(a1);
  if (st) cudaStreamDestroy(st);
  free(off), free(td), free(tc), free(ta), free(tb), free(x), free(ids), free(w);
}

int main(int argc, char **argv) {
  int R = mm_cuda_device_count();
  int H = 6144, E = 256, K = 8, iters = 20;
  int Tn[8] = {128, 4096, 8192}, nn = 3, Tl[8] = {128, 256}, nl = 2;
  mm_ep_transport trs[4] = {MM_EP_TRANSPORT_NCCL, MM_EP_TRANSPORT_IPC};
  int ntr = 2;
  for (int i = 1; i < argc; i += 2) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    int bad = 0;
    if (!strcmp(a, "--ranks")) bad = bench_arg_int(a, v, 1, 1024, &R);
    else if (!strcmp(a, "--tokens")) bad = bench_arg_int_list(a, v, 1, 1 << 20, Tn, 8, &nn);
    else if (!strcmp(a, "--ll-tokens")) bad = bench_arg_int_list(a, v, 1, 1 << 20, Tl, 8, &nl);
    else if (!strcmp(a, "--iters")) bad = bench_arg_int(a, v, 1, 100000, &iters);
    else if (!strcmp(a, "--hidden")) bad = bench_arg_int(a, v, 128, 65536, &H);
    else if (!strcmp(a, "--experts")) bad = bench_arg_int(a, v, 1, 4096, &E);
    else if (!strcmp(a, "--topk")) bad = bench_arg_int(a, v, 1, 64, &K);
    else if (!strcmp(a, "--transport")) {
      static const char *const names[] = {"nccl", "ipc", NULL};
      ntr = 0;
      char list[64];
      snprintf(list, sizeof list, "%s", v ? v : "");
      for (char *t = strtok(list, ","); t && !bad; t = strtok(NULL, ",")) {
        int k = 0;
        bad = ntr == 4 || bench_arg_choice(a, t, names, &k);
        if (!bad) trs[ntr++] = k ? MM_EP_TRANSPORT_IPC : MM_EP_TRANSPORT_NCCL;
      }
      bad |= ntr == 0;
      if (bad) fprintf(stderr, "--transport needs 1 to 4 of nccl, ipc, comma-separated\n");
    } else {
      fprintf(stderr, "unknown option %s (see the header of bench_ep.c)\n", a);
      return 2;
    }
    if (bad) return 2;
  }
  if (R <= 0) {
    printf("bench_ep: no GPU\n");
    return 0;
  }
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  struct cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  printf("# bench_ep: %d x %s, H %d, E %d, top-%d, %d iterations (median), random routing\n", R,
         prop.name, H, E, K, iters);
  printf("| mode | tokens/rank | ranks | dispatch us | dispatch MB | dispatch GB/s | combine us | "
         "combine MB | combine GB/s | plain a2a dispatch-bytes us (GB/s) | plain a2a "
         "combine-bytes us (GB/s) |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  int status = 0;
  for (int m = MM_EP_MODE_NORMAL; m <= MM_EP_MODE_LOW_LATENCY; m++) {
    int *Ts = m == MM_EP_MODE_NORMAL ? Tn : Tl, n = m == MM_EP_MODE_NORMAL ? nn : nl;
    for (int i = 0; i < n * (m == MM_EP_MODE_NORMAL ? 1 : ntr); i++) {
      bench_ctx c;
      memset(&c, 0, sizeof c);
      const int ti = m == MM_EP_MODE_NORMAL ? 0 : i % ntr;
      c.R = R, c.H = H, c.E = E, c.K = K, c.iters = iters, c.mode = m;
      c.T = Ts[m == MM_EP_MODE_NORMAL ? i : i / ntr];
      c.transport = m == MM_EP_MODE_NORMAL ? MM_EP_TRANSPORT_NCCL : trs[ti];
      snprintf(c.key, sizeof c.key, "bench-%d-%d", m, i);
      pthread_barrier_init(&c.barrier, NULL, (unsigned)R);
      ept_run_ranks(R, bench_rank, &c);
      pthread_barrier_destroy(&c.barrier);
      char label[48];
      if (m == MM_EP_MODE_NORMAL)
        snprintf(label, sizeof label, "normal");
      else
        snprintf(label, sizeof label, "low-latency %s%s", mm_ep_transport_name(c.transport),
                 c.transport == MM_EP_TRANSPORT_IPC && c.used != MM_EP_TRANSPORT_IPC ? "->nccl" : "");
      if (c.failed) {
        printf("| %s | %d | %d | failed |\n", label, c.T, R);
        status = 1;
        continue;
      }
      printf("| %s | %d | %d | %.1f | %.2f | %.1f | %.1f | %.2f | %.1f | %.1f (%.1f) | %.1f (%.1f) |\n",
             label, c.T, R, c.disp_us, c.disp_bytes / 1e6,
             c.disp_bytes / c.disp_us / 1e3, c.comb_us, c.comb_bytes / 1e6,
             c.comb_bytes / c.comb_us / 1e3, c.a2a_disp_us, c.disp_bytes / c.a2a_disp_us / 1e3,
             c.a2a_comb_us, c.comb_bytes / c.a2a_comb_us / 1e3);
      fflush(stdout);
    }
  }
  return status;
}

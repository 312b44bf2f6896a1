/* gpu_test_ep.c -- the expert-parallel path on the GPU, over a real NCCL
 * communicator (one rank here; the rank-count test takes more GPUs when it
 * sees them). Skips without a GPU.
 *
 * Engine tests use the stand-in expert (mm_ep_launch_identity_compute), whose
 * CPU expectation is exact, so dispatch (FP8 quantization, dedup, slots,
 * arrangement) and combine (FP32 ascending-k sum) are checked bit for bit in
 * both modes. Backend tests run the whole cuda backend (sm90 expert compute)
 * against the CPU reference mm_ref_moe_layer, replay a captured CUDA graph
 * with changing inputs, and check bad ids, zero tokens, determinism, NaN/Inf
 * inputs (docs/RELIABILITY.md semantics) and the rank-count equality (ep-size R output == ep-size 1 output, bitwise). */
#include <cuda_runtime.h>

#include "backend_cuda.h"
#include "ep_engine.h"
#include "ep_kernels.h"
#include "ep_test_util.h"
#include "ep_backend_util.h"

/* ---- engine rig: one rank, stand-in expert --------------------------------------- */

typedef struct {
  int H, E, K, max_tokens, ll;
  mm_ep_comm *comm;
  mm_ep_engine *eng;
  cudaStream_t st;
  uint16_t *d_x, *d_out;
  int32_t *d_ids;
  float *d_w;
  uint16_t *x, *out, *want;
  int32_t *ids;
  float *w;
} rig;

static int rig_open_tr(rig *g, int H, int E, int K, int max_tokens, int ll, mm_ep_transport tr) {
  memset(g, 0, sizeof *g);
  g->H = H, g->E = E, g->K = K, g->max_tokens = max_tokens, g->ll = ll;
  const megamoe_host_services *hs = mm_host_services();
  char key[64];
  snprintf(key, sizeof key, "ept-engine-%d", g_key_gen++);
  mm_ep_comm_args ca = {0, 1, 0, NULL, key, 60000, NULL, hs->kv_put, hs->kv_get};
  mm_err *err = mm_ep_comm_create(&ca, &g->comm);
  if (!err) {
    mm_ep_engine_args ea = {0, 1, 0, E, K, H, 128, max_tokens, ll, 0, -1, g->comm, NULL, NULL, NULL,
                            tr};
    err = mm_ep_engine_create(&ea, &g->eng);
  }
  if (err) {
    printf("# rig: %s\n", err->message);
    megamoe_error_destroy(err);
    mm_test_case_failed_ = 1;
    return -1;
  }
  size_t tn = (size_t)max_tokens;
  if (cudaStreamCreateWithFlags(&g->st, cudaStreamNonBlocking) != cudaSuccess ||
      cudaMalloc((void **)&g->d_x, tn * H * 2 + 16) != cudaSuccess ||
      cudaMalloc((void **)&g->d_out, tn * H * 2 + 16) != cudaSuccess ||
      cudaMalloc((void **)&g->d_ids, tn * K * 4 + 16) != cudaSuccess ||
      cudaMalloc((void **)&g->d_w, tn * K * 4 + 16) != cudaSuccess) {
    mm_test_case_failed_ = 1;
    return -1;
  }
  g->x = malloc(tn * H * 2 + 2);
  g->out = malloc(tn * H * 2 + 2);
  g->want = malloc(tn * H * 2 + 2);
  g->ids = malloc(tn * K * 4 + 4);
  g->w = malloc(tn * K * 4 + 4);
  return 0;
}

/* The low-latency transport from MEGAMOE_EP_TRANSPORT (auto: CUDA IPC, a local copy here). */
static int rig_open(rig *g, int H, int E, int K, int max_tokens, int ll) {
  return rig_open_tr(g, H, E, K, max_tokens, ll, MM_EP_TRANSPORT_DEFAULT);
}

static void rig_close(rig *g) {
  mm_ep_engine_destroy(g->eng);
  mm_ep_comm_destroy(g->comm);
  if (g->st) cudaStreamDestroy(g->st);
  cudaFree(g->d_x);
  cudaFree(g->d_out);
  cudaFree(g->d_ids);
  cudaFree(g->d_w);
  free(g->x);
  free(g->out);
  free(g->want);
  free(g->ids);
  free(g->w);
}

static mm_err *rig_step(rig *g, mm_ep_mode mode, int T, float rsf) {
  mm_ep_step s = {T, g->d_x, g->d_ids, g->d_w, rsf, mode, g->st, {NULL, NULL, NULL, NULL}};
  mm_expert_pool pool;
  void *ws;
  size_t wsb;
  MM_TRY(mm_ep_dispatch(g->eng, &s, &pool, &ws, &wsb));
  int ce = mm_ep_launch_identity_compute(&pool, g->E, 0, g->H, g->st);
  mm_err *err = mm_ep_combine(g->eng, g->d_out);
  if (ce) {
    megamoe_error_destroy(err);
    return mm_error(MEGAMOE_CODE_INTERNAL, "identity compute: %s", cudaGetErrorString(ce));
  }
  return err;
}

/* One low-latency step (rsf 2.5) captured on the rig's stream and instantiated. */
static void rig_capture(rig *g, int T, cudaGraph_t *graph, cudaGraphExec_t *exec) {
  CUDA_OK(cudaStreamBeginCapture(g->st, cudaStreamCaptureModeThreadLocal));
  mm_err *err = rig_step(g, MM_EP_MODE_LOW_LATENCY, T, 2.5f);
  cudaError_t ce = cudaStreamEndCapture(g->st, graph);
  CHECK_OK(err);
  CUDA_OK(ce);
  if (*graph) CUDA_OK(cudaGraphInstantiate(exec, *graph, 0));
}

static void rig_inputs(rig *g, int T, ept_ids_kind kind) {
  ept_fill_hidden(g->x, T, g->H);
  ept_fill_ids(g->ids, T, g->K, g->E, kind, (int)(mm_test_rand_u64() % (uint64_t)g->E));
  ept_fill_weights(g->w, T, g->K);
}

static void rig_upload(rig *g, int T) {
  CUDA_OK(cudaMemcpy(g->d_x, g->x, (size_t)T * g->H * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(g->d_ids, g->ids, (size_t)T * g->K * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(g->d_w, g->w, (size_t)T * g->K * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemsetAsync(g->d_out, 0xFF, (size_t)g->max_tokens * g->H * 2, g->st)); /* poison */
}

/* Downloads out and compares it bitwise to the CPU expectation. */
static void rig_verify(rig *g, int T, float rsf, const char *what) {
  CUDA_OK(cudaStreamSynchronize(g->st));
  CUDA_OK(cudaMemcpy(g->out, g->d_out, (size_t)g->max_tokens * g->H * 2, cudaMemcpyDeviceToHost));
  ept_expected_identity(g->x, g->ids, g->w, T, g->H, g->K, g->E, rsf, g->want);
  size_t n = (size_t)T * g->H, d = count_diff(g->out, g->want, n), first = 0;
  while (first < n && g->out[first] == g->want[first]) first++;
  CHECK_MSG(d == 0, "%s: %zu of %zu outputs differ (first at %zu: %04x vs %04x)", what, d, n,
            first, first < n ? g->out[first] : 0, first < n ? g->want[first] : 0);
  /* rows past T stay poisoned */
  for (size_t i = n; i < (size_t)g->max_tokens * g->H; i += 97) CHECK(g->out[i] == 0xFFFF);
}

static void run_case(rig *g, mm_ep_mode mode, int T, ept_ids_kind kind, float rsf) {
  rig_inputs(g, T, kind);
  rig_upload(g, T);
  mm_err *err = rig_step(g, mode, T, rsf);
  char what[160];
  snprintf(what, sizeof what, "%s H %d E %d k %d T %d ids %d rsf %g",
           mode == MM_EP_MODE_NORMAL ? "normal" : "low-latency", g->H, g->E, g->K, T, (int)kind,
           (double)rsf);
  if (kind == EPT_IDS_BAD && mode == MM_EP_MODE_NORMAL) {
    CHECK_MSG(err && err->code == MEGAMOE_CODE_INVALID_ARGUMENT, "%s: expected INVALID_ARGUMENT", what);
    if (err) printf("# %s: %s\n", what, err->message);
    megamoe_error_destroy(err);
  } else {
    CHECK_OK(err);
  }
  rig_verify(g, T, rsf, what);
  if (kind == EPT_IDS_BAD && mode == MM_EP_MODE_LOW_LATENCY) {
    CHECK_ERR(mm_ep_take_error(g->eng, g->st, 1), MEGAMOE_CODE_INVALID_ARGUMENT);
  }
  CHECK_OK(mm_ep_take_error(g->eng, g->st, 1)); /* nothing left behind */
}

static const struct { int H, E, K; } kShapes[] = {
    {128, 8, 1}, {256, 16, 4}, {512, 64, 8}, {6144, 256, 8}};

static void test_engine_both_modes(void) {
  for (size_t s = 0; s < sizeof kShapes / sizeof kShapes[0]; s++) {
    rig g;
    if (rig_open(&g, kShapes[s].H, kShapes[s].E, kShapes[s].K, 96, 48)) return;
    const int Tn[] = {1, 37, 96}, Tl[] = {1, 19, 48};
    for (int i = 0; i < 3; i++) {
      run_case(&g, MM_EP_MODE_NORMAL, Tn[i], EPT_IDS_RANDOM, i == 1 ? 2.5f : 1.0f);
      run_case(&g, MM_EP_MODE_LOW_LATENCY, Tl[i], EPT_IDS_RANDOM, i == 1 ? 2.5f : 1.0f);
    }
    run_case(&g, MM_EP_MODE_NORMAL, 50, EPT_IDS_DUPLICATES, 1.0f);
    run_case(&g, MM_EP_MODE_LOW_LATENCY, 48, EPT_IDS_DUPLICATES, 1.0f);
    rig_close(&g);
  }
}

static void test_engine_edges(void) {
  rig g;
  if (rig_open(&g, 256, 32, 8, 128, 128)) return;
  for (int m = MM_EP_MODE_NORMAL; m <= MM_EP_MODE_LOW_LATENCY; m++) {
    run_case(&g, (mm_ep_mode)m, 128, EPT_IDS_ONE_EXPERT, 1.0f); /* pool full, one expert */
    run_case(&g, (mm_ep_mode)m, 64, EPT_IDS_MASKED, 1.0f);      /* nothing routed */
    run_case(&g, (mm_ep_mode)m, 0, EPT_IDS_RANDOM, 1.0f);       /* zero tokens */
    run_case(&g, (mm_ep_mode)m, 100, EPT_IDS_BAD, 1.0f);        /* invalid ids */
    run_case(&g, (mm_ep_mode)m, 7, EPT_IDS_RANDOM, 1.0f);       /* fine again */
  }
  /* Misuse is refused before any communication. */
  CHECK_ERR(rig_step(&g, MM_EP_MODE_LOW_LATENCY, 129, 1.0f), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_ep_combine(g.eng, g.d_out), MEGAMOE_CODE_FAILED_PRECONDITION);
  run_case(&g, MM_EP_MODE_LOW_LATENCY, 5, EPT_IDS_RANDOM, 1.0f);
  rig_close(&g);
}

/* Low-latency step captured once, replayed with new inputs in the same buffers. */
static void test_engine_graph_replay(void) {
  rig g;
  if (rig_open(&g, 512, 64, 8, 64, 64)) return;
  const int T = 40;
  rig_inputs(&g, T, EPT_IDS_RANDOM);
  rig_upload(&g, T);
  run_case(&g, MM_EP_MODE_LOW_LATENCY, T, EPT_IDS_RANDOM, 1.0f); /* warm-up, eager */
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  rig_capture(&g, T, &graph, &exec);
  for (int it = 0; it < 4; it++) {
    rig_inputs(&g, T, it == 2 ? EPT_IDS_DUPLICATES : EPT_IDS_RANDOM);
    rig_upload(&g, T);
    CUDA_OK(cudaGraphLaunch(exec, g.st));
    char what[64];
    snprintf(what, sizeof what, "graph replay %d", it);
    rig_verify(&g, T, 2.5f, what);
  }
  /* A bad id inside a replay is reported by the next check. */
  rig_inputs(&g, T, EPT_IDS_BAD);
  rig_upload(&g, T);
  CUDA_OK(cudaGraphLaunch(exec, g.st));
  rig_verify(&g, T, 2.5f, "graph replay with bad ids");
  CHECK_ERR(mm_ep_take_error(g.eng, g.st, 1), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_OK(mm_ep_take_error(g.eng, g.st, 1));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  rig_close(&g);
}

/* The same low-latency steps over both transports (ep-size 1: the IPC
 * exchange is the local-copy case): bit for bit equal to each other and to
 * the expectation, with normal steps in between (they keep NCCL) and a
 * graph replay on each. MEGAMOE_TEST_QUICK (the sanitizer runs) keeps the
 * small shape: racecheck on the GLM-5 one ran past gpu_suite's 400 s on an
 * H100 (forty-ninth stop). */
static void test_engine_transports(void) {
  static const struct { int H, E, K, ll; } shapes[] = {{256, 16, 4, 48}, {6144, 256, 8, 64}};
  const size_t nshapes = getenv("MEGAMOE_TEST_QUICK") ? 1 : sizeof shapes / sizeof shapes[0];
  for (size_t si = 0; si < nshapes; si++) {
    rig a, b;
    const int H = shapes[si].H, E = shapes[si].E, K = shapes[si].K, ll = shapes[si].ll;
    if (rig_open_tr(&a, H, E, K, ll, ll, MM_EP_TRANSPORT_NCCL)) return;
    if (rig_open_tr(&b, H, E, K, ll, ll, MM_EP_TRANSPORT_IPC)) {
      rig_close(&a);
      return;
    }
    CHECK_EQ_INT(mm_ep_engine_transport(a.eng), MM_EP_TRANSPORT_NCCL);
    CHECK_EQ_INT(mm_ep_engine_transport(b.eng), MM_EP_TRANSPORT_IPC);
    printf("# transports H %d: rig a %s, rig b %s\n", H,
           mm_ep_transport_name(mm_ep_engine_transport(a.eng)),
           mm_ep_transport_name(mm_ep_engine_transport(b.eng)));
    const int Ts[] = {1, ll, 0, 17, ll, 3, ll};
    const ept_ids_kind kinds[] = {EPT_IDS_RANDOM, EPT_IDS_RANDOM, EPT_IDS_RANDOM, EPT_IDS_DUPLICATES,
                                  EPT_IDS_ONE_EXPERT, EPT_IDS_MASKED, EPT_IDS_RANDOM};
    const size_t n = (size_t)ll * H;
    for (int i = 0; i < 7; i++) {
      const int T = Ts[i];
      if (i == 4) { /* a normal step in between: NCCL on both */
        run_case(&a, MM_EP_MODE_NORMAL, ll, EPT_IDS_RANDOM, 1.0f);
        run_case(&b, MM_EP_MODE_NORMAL, ll, EPT_IDS_RANDOM, 1.0f);
      }
      rig_inputs(&a, T, kinds[i]);
      memcpy(b.x, a.x, (size_t)T * H * 2);
      memcpy(b.ids, a.ids, (size_t)T * K * 4);
      memcpy(b.w, a.w, (size_t)T * K * 4);
      rig_upload(&a, T);
      rig_upload(&b, T);
      CHECK_OK(rig_step(&a, MM_EP_MODE_LOW_LATENCY, T, 2.5f));
      CHECK_OK(rig_step(&b, MM_EP_MODE_LOW_LATENCY, T, 2.5f));
      char what[96];
      snprintf(what, sizeof what, "transport nccl H %d T %d ids %d", H, T, (int)kinds[i]);
      rig_verify(&a, T, 2.5f, what);
      snprintf(what, sizeof what, "transport ipc H %d T %d ids %d", H, T, (int)kinds[i]);
      rig_verify(&b, T, 2.5f, what);
      size_t d = count_diff(a.out, b.out, n);
      CHECK_MSG(d == 0, "H %d T %d: %zu of %zu outputs differ between nccl and ipc", H, T, d, n);
      CHECK_OK(mm_ep_take_error(a.eng, a.st, 1));
      CHECK_OK(mm_ep_take_error(b.eng, b.st, 1));
    }
    /* a captured step on the IPC transport, replayed with new inputs */
    const int T = ll - 1;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    rig_capture(&b, T, &graph, &exec);
    for (int it = 0; exec && it < 5; it++) {
      rig_inputs(&b, T, it == 3 ? EPT_IDS_DUPLICATES : EPT_IDS_RANDOM);
      rig_upload(&b, T);
      CUDA_OK(cudaGraphLaunch(exec, b.st));
      char what[64];
      snprintf(what, sizeof what, "ipc graph replay %d H %d", it, H);
      rig_verify(&b, T, 2.5f, what);
      if (it == 2) run_case(&b, MM_EP_MODE_LOW_LATENCY, 5, EPT_IDS_RANDOM, 1.0f); /* eager between */
    }
    CHECK_OK(mm_ep_take_error(b.eng, b.st, 1));
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    rig_close(&a);
    rig_close(&b);
  }
}

static const layer_shape kLayers[] = {
    {256, 256, 16, 4, 32, MM_COMPUTE_AUTO},
    {256, 128, 8, 8, 16, MM_COMPUTE_BF16_EXACT},
    {256, 128, 8, 8, 32, MM_COMPUTE_BF16_EXACT},
};

static void test_backend_vs_reference(void) {
  for (size_t li = 0; li < sizeof kLayers / sizeof kLayers[0]; li++) {
    const layer_shape *s = &kLayers[li];
    mm_expert_q *ex = ept_make_experts(s->E, s->H, s->I, s->gran, mm_test_rand_u64());
    const int T = 45;
    uint16_t *x = malloc((size_t)T * s->H * 2), *got = malloc((size_t)T * s->H * 2),
             *want = malloc((size_t)T * s->H * 2), *first = malloc((size_t)T * s->H * 2);
    int32_t *ids = malloc((size_t)T * s->K * 4);
    float *w = malloc((size_t)T * s->K * 4);
    dev_io io;
    if (io_alloc(&io, T, s->H, s->K)) {
      CHECK(0);
      continue;
    }
    for (int dm = MM_DISPATCH_NORMAL; dm <= MM_DISPATCH_LOW_LATENCY; dm++) {
      char key[64];
      snprintf(key, sizeof key, "ept-op-%d", g_key_gen++);
      mm_op *op = NULL;
      mm_err *err = make_op(s, 1, 0, (mm_dispatch_mode)dm, 0, 64, ex, key, &op);
      CHECK_OK(err);
      if (err) {
        free_op(op);
        continue;
      }
      for (int rep = 0; rep < 3; rep++) {
        ept_ids_kind kind = rep == 2 ? EPT_IDS_DUPLICATES : EPT_IDS_RANDOM;
        ept_fill_hidden(x, T, s->H);
        ept_fill_ids(ids, T, s->K, s->E, kind, 0);
        ept_fill_weights(w, T, s->K);
        CHECK(io_upload(&io, x, ids, w) == 0);
        CHECK_OK(op_run(op, &io, NULL));
        CHECK(cudaDeviceSynchronize() == cudaSuccess);
        CHECK(cudaMemcpy(got, io.d_out, (size_t)T * s->H * 2, cudaMemcpyDeviceToHost) == 0);
        reference(s, ex, T, x, ids, w, want);
        double rel = rel_frob(got, want, (size_t)T * s->H);
        size_t d = count_diff(got, want, (size_t)T * s->H);
        printf("# backend %s gran %d %s H %d I %d E %d k %d T %d: rel %.2e (tol %.0e), %zu of %d "
               "bf16 differ\n",
               dm == MM_DISPATCH_NORMAL ? "normal" : "low-latency", s->gran,
               mm_compute_mode_name(s->cm), s->H, s->I, s->E, s->K, T, rel,
               backend_tolerance(s->gran, s->cm), d, T * s->H);
        CHECK(rel <= backend_tolerance(s->gran, s->cm));
        /* run to run: the same bits */
        memcpy(first, got, (size_t)T * s->H * 2);
        CHECK(cudaMemset(io.d_out, 0xFF, (size_t)T * s->H * 2) == 0);
        CHECK(cudaDeviceSynchronize() == cudaSuccess);
        CHECK_OK(op_run(op, &io, NULL));
        CHECK(cudaDeviceSynchronize() == cudaSuccess);
        CHECK(cudaMemcpy(got, io.d_out, (size_t)T * s->H * 2, cudaMemcpyDeviceToHost) == 0);
        CHECK_EQ_INT(count_diff(got, first, (size_t)T * s->H), 0);
      }
      /* zero tokens */
      dev_io z = io;
      z.T = 0;
      CHECK_OK(op_run(op, &z, NULL));
      /* bad ids: normal reports in the call, low-latency at the check */
      ept_fill_ids(ids, T, s->K, s->E, EPT_IDS_BAD, 0);
      CHECK(io_upload(&io, x, ids, w) == 0);
      if (dm == MM_DISPATCH_NORMAL) {
        CHECK_ERR(op_run(op, &io, NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
      } else {
        CHECK_OK(op_run(op, &io, NULL));
        CHECK_ERR(mm_cuda_check(op, NULL, 1), MEGAMOE_CODE_INVALID_ARGUMENT);
      }
      CHECK_OK(mm_cuda_check(op, NULL, 1));
      CHECK(cudaMemcpy(got, io.d_out, (size_t)T * s->H * 2, cudaMemcpyDeviceToHost) == 0);
      reference(s, ex, T, x, ids, w, want);
      CHECK(rel_frob(got, want, (size_t)T * s->H) <= backend_tolerance(s->gran, s->cm));
      CHECK(op->state != MM_OP_FATAL);
      free_op(op);
    }
    io_free(&io);
    mm_experts_free(ex, s->E);
    free(x), free(got), free(want), free(first), free(ids), free(w);
  }
}

/* NaN / Inf inputs through the whole cuda backend (dispatch FP8 quantization,
 * sm90 expert compute, combine), the semantics docs/RELIABILITY.md defines and
 * test_hostile_inputs checks on the CPU: a NaN/+Inf/-Inf hidden value, or a
 * NaN/Inf weight on an unmasked slot, makes that token's row NaN in every
 * channel; every other row is bit-identical to a clean batch with the same
 * ids (same tiles, same pool order); a masked slot ignores its NaN weight; an
 * all-masked token gives +0 even with NaN hidden; repeated calls give the same
 * bits, NaN payloads included; the NaN pattern equals the CPU reference's.
 * Both dispatch modes, gran 32 and gran 16, with and without the SwiGLU clamp
 * (fminf/fmaxf there used to turn a NaN token into a finite row). */
static int row_all_nan(const uint16_t *row, int H) {
  for (int c = 0; c < H; c++)
    if (!isnan(mm_bf16_to_float(row[c]))) return 0;
  return 1;
}

static void nan_inf_case(const layer_shape *s, const mm_expert_q *ex, mm_dispatch_mode dm,
                         float clamp) {
  enum { T = 29 };
  const int H = s->H, K = s->K;
  const size_t n = (size_t)T * H;
  char what[128];
  snprintf(what, sizeof what, "nan/inf %s gran %d H %d k %d clamp %g",
           dm == MM_DISPATCH_NORMAL ? "normal" : "low-latency", s->gran, H, K, (double)clamp);
  char key[64];
  snprintf(key, sizeof key, "ept-op-%d", g_key_gen++);
  mm_op *op = NULL;
  mm_err *err = make_op(s, 1, 0, dm, 0, 64, ex, key, &op);
  CHECK_OK(err);
  dev_io io;
  if (err || io_alloc(&io, T, H, K)) {
    CHECK(0);
    free_op(op);
    return;
  }
  op->cfg.model.activation_clamp = clamp; /* read at execute */
  uint16_t *x = malloc(n * 2), *xc = malloc(n * 2), *clean = malloc(n * 2), *got = malloc(n * 2),
           *again = malloc(n * 2), *want = malloc(n * 2);
  int32_t *ids = malloc((size_t)T * K * 4);
  float *w = malloc((size_t)T * K * 4), *wc = malloc((size_t)T * K * 4);
  ept_fill_hidden(xc, T, H);
  ept_fill_ids(ids, T, K, s->E, EPT_IDS_RANDOM, 0);
  ept_fill_weights(wc, T, K);
  /* Tokens 1..9 and 20 get every slot live, distinct experts; 9 then masks
   * one slot, 8 masks all (7 is an all-zero row of ept_fill_hidden, 3 a 1e3
   * row, 5 a 1e-6 row). The poisoned tokens sit between clean ones. */
  const int poisoned[] = {1, 2, 3, 4, 5, 6, 20};
  for (int t = 1; t <= 9; t++)
    for (int j = 0; j < K; j++) ids[t * K + j] = (t * 3 + j) % s->E;
  for (int j = 0; j < K; j++) ids[20 * K + j] = (j * 5 + 1) % s->E;
  ids[9 * K + K - 1] = -1;
  for (int j = 0; j < K; j++) ids[8 * K + j] = -1;
  memcpy(x, xc, n * 2);
  memcpy(w, wc, (size_t)T * K * 4);
  const int c1 = (int)(mm_test_rand_u64() % (uint64_t)H), c2 = (int)(mm_test_rand_u64() % (uint64_t)H);
  x[1 * H + c1] = 0x7FC0;             /* NaN */
  x[2 * H + c1] = 0x7F80;             /* +Inf */
  x[3 * H + c2] = 0xFF80;             /* -Inf */
  x[4 * H + c2] = 0xFFC1;             /* negative NaN with a payload */
  w[5 * K + K - 1] = NAN;             /* NaN weight on a live slot */
  w[6 * K] = INFINITY;                /* Inf weight on a live slot */
  w[20 * K + K / 2] = -INFINITY;      /* -Inf weight on a live slot */
  w[9 * K + K - 1] = NAN;             /* NaN weight on the masked slot: ignored */
  x[8 * H + c1] = 0x7FC0;             /* NaN hidden, every slot masked: +0 */
  /* clean batch: same ids, finite values */
  CHECK(io_upload(&io, xc, ids, wc) == 0);
  CHECK_OK(op_run(op, &io, NULL));
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(cudaMemcpy(clean, io.d_out, n * 2, cudaMemcpyDeviceToHost) == 0);
  reference_clamped(s, ex, T, xc, ids, wc, clamp, want);
  double rel = rel_frob(clean, want, n);
  CHECK_MSG(rel <= backend_tolerance(s->gran, s->cm), "%s: clean batch rel %.2e vs reference", what, rel);
  /* poisoned batch, twice */
  CHECK(io_upload(&io, x, ids, w) == 0);
  CHECK_OK(op_run(op, &io, NULL));
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(cudaMemcpy(got, io.d_out, n * 2, cudaMemcpyDeviceToHost) == 0);
  CHECK(cudaMemset(io.d_out, 0x33, n * 2) == 0 && cudaDeviceSynchronize() == cudaSuccess);
  CHECK_OK(op_run(op, &io, NULL));
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(cudaMemcpy(again, io.d_out, n * 2, cudaMemcpyDeviceToHost) == 0);
  CHECK_OK(mm_cuda_check(op, NULL, 1)); /* NaN is data, not an error */
  int bad_nan = 0, bad_other = 0, bad_zero = 0;
  for (size_t i = 0; i < sizeof poisoned / sizeof poisoned[0]; i++) {
    const int t = poisoned[i];
    if (!row_all_nan(got + (size_t)t * H, H)) {
      bad_nan++;
      int finite = 0;
      for (int c = 0; c < H; c++) finite += !isnan(mm_bf16_to_float(got[(size_t)t * H + c]));
      printf("# %s: token %d has %d of %d channels not NaN\n", what, t, finite, H);
    }
  }
  for (int t = 0; t < T; t++) {
    int is_poisoned = 0;
    for (size_t i = 0; i < sizeof poisoned / sizeof poisoned[0]; i++) is_poisoned |= poisoned[i] == t;
    if (is_poisoned) continue;
    if (t == 8) {
      for (int c = 0; c < H; c++) bad_zero += got[(size_t)t * H + c] != 0;
      continue;
    }
    size_t d = count_diff(got + (size_t)t * H, clean + (size_t)t * H, (size_t)H);
    if (d) printf("# %s: token %d: %zu channels differ from the clean batch\n", what, t, d);
    bad_other += d != 0;
  }
  CHECK_MSG(bad_nan == 0, "%s: %d poisoned tokens are not all NaN", what, bad_nan);
  CHECK_MSG(bad_other == 0, "%s: %d other tokens differ from the clean batch", what, bad_other);
  CHECK_MSG(bad_zero == 0, "%s: the all-masked NaN token is not +0 (%d channels)", what, bad_zero);
  CHECK_MSG(memcmp(got, again, n * 2) == 0, "%s: repeated call differs", what);
  /* the CPU reference on the same poisoned batch: the same NaN pattern */
  reference_clamped(s, ex, T, x, ids, w, clamp, want);
  size_t nan_mismatch = 0;
  for (size_t i = 0; i < n; i++)
    nan_mismatch += isnan(mm_bf16_to_float(got[i])) != isnan(mm_bf16_to_float(want[i]));
  CHECK_MSG(nan_mismatch == 0, "%s: %zu outputs NaN on one side only (GPU vs CPU reference)", what,
            nan_mismatch);
  rel = rel_frob(got, want, n);
  printf("# %s: poisoned rows all NaN %s, other rows bit-identical %s, rel %.2e vs reference\n",
         what, bad_nan ? "NO" : "yes", bad_other ? "NO" : "yes", rel);
  CHECK(rel <= backend_tolerance(s->gran, s->cm));
  /* still fine afterwards */
  CHECK(io_upload(&io, xc, ids, wc) == 0);
  CHECK_OK(op_run(op, &io, NULL));
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(cudaMemcpy(got, io.d_out, n * 2, cudaMemcpyDeviceToHost) == 0);
  CHECK_MSG(memcmp(got, clean, n * 2) == 0, "%s: clean batch after the poisoned one differs", what);
  CHECK(op->state != MM_OP_FATAL);
  io_free(&io);
  free_op(op);
  free(x), free(xc), free(clean), free(got), free(again), free(want), free(ids), free(w), free(wc);
}

static void test_backend_nan_inf(void) {
  for (size_t li = 0; li < sizeof kLayers / sizeof kLayers[0]; li++) {
    const layer_shape *s = &kLayers[li];
    mm_expert_q *ex = ept_make_experts(s->E, s->H, s->I, s->gran, mm_test_rand_u64());
    for (int dm = MM_DISPATCH_NORMAL; dm <= MM_DISPATCH_LOW_LATENCY; dm++) {
      nan_inf_case(s, ex, (mm_dispatch_mode)dm, 0.0f);
      if (dm == MM_DISPATCH_NORMAL) nan_inf_case(s, ex, (mm_dispatch_mode)dm, 0.75f);
    }
    mm_experts_free(ex, s->E);
  }
}

/* The backend's low-latency execute captured in a graph; replays with new
 * inputs must equal eager executes of the same inputs bit for bit. */
static void test_backend_graph_replay(void) {
  const layer_shape *s = &kLayers[0];
  mm_expert_q *ex = ept_make_experts(s->E, s->H, s->I, s->gran, mm_test_rand_u64());
  const int T = 24;
  mm_op *op = NULL;
  char key[64];
  snprintf(key, sizeof key, "ept-op-%d", g_key_gen++);
  mm_err *err = make_op(s, 1, 0, MM_DISPATCH_AUTO, 32, 256, ex, key, &op);
  CHECK_OK(err);
  dev_io io;
  cudaStream_t st = NULL;
  if (err || io_alloc(&io, T, s->H, s->K) || cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking)) {
    CHECK(0);
    free_op(op);
    mm_experts_free(ex, s->E);
    return;
  }
  CHECK_EQ_INT(mm_cuda_dispatch_mode(op, T), MM_EP_MODE_LOW_LATENCY);
  CHECK_EQ_INT(mm_cuda_dispatch_mode(op, 33), MM_EP_MODE_NORMAL);
  size_t n = (size_t)T * s->H;
  uint16_t *x = malloc(n * 2), *eager = malloc(n * 2), *replay = malloc(n * 2), *want = malloc(n * 2);
  int32_t *ids = malloc((size_t)T * s->K * 4);
  float *w = malloc((size_t)T * s->K * 4);
  ept_fill_hidden(x, T, s->H);
  ept_fill_ids(ids, T, s->K, s->E, EPT_IDS_RANDOM, 0);
  ept_fill_weights(w, T, s->K);
  CHECK(io_upload(&io, x, ids, w) == 0);
  CHECK_OK(op_run(op, &io, st)); /* warm-up */
  CHECK(cudaStreamSynchronize(st) == cudaSuccess);
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  err = op_run(op, &io, st);
  CHECK(cudaStreamEndCapture(st, &graph) == cudaSuccess);
  CHECK_OK(err);
  CHECK(graph && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  /* Normal mode is refused under capture before any communication. */
  CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  dev_io big = io;
  big.T = 200;
  mm_err *e2 = op_run(op, &big, st);
  cudaGraph_t g2 = NULL;
  cudaStreamEndCapture(st, &g2);
  if (g2) cudaGraphDestroy(g2);
  CHECK(e2 && e2->code == MEGAMOE_CODE_FAILED_PRECONDITION);
  megamoe_error_destroy(e2);
  for (int it = 0; exec && it < 3; it++) {
    ept_fill_hidden(x, T, s->H);
    ept_fill_ids(ids, T, s->K, s->E, it == 1 ? EPT_IDS_ONE_EXPERT : EPT_IDS_RANDOM, 3);
    ept_fill_weights(w, T, s->K);
    CHECK(io_upload(&io, x, ids, w) == 0);
    CHECK(cudaGraphLaunch(exec, st) == cudaSuccess);
    CHECK(cudaStreamSynchronize(st) == cudaSuccess);
    CHECK(cudaMemcpy(replay, io.d_out, n * 2, cudaMemcpyDeviceToHost) == 0);
    CHECK(cudaMemsetAsync(io.d_out, 0xFF, n * 2, st) == 0);
    CHECK_OK(op_run(op, &io, st));
    CHECK(cudaStreamSynchronize(st) == cudaSuccess);
    CHECK(cudaMemcpy(eager, io.d_out, n * 2, cudaMemcpyDeviceToHost) == 0);
    CHECK_EQ_INT(count_diff(replay, eager, n), 0);
    reference(s, ex, T, x, ids, w, want);
    double rel = rel_frob(replay, want, n);
    printf("# graph replay %d: rel %.2e vs reference\n", it, rel);
    CHECK(rel <= backend_tolerance(s->gran, s->cm));
  }
  CHECK_OK(mm_cuda_check(op, st, 1));
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  io_free(&io);
  free_op(op);
  mm_experts_free(ex, s->E);
  free(x), free(eager), free(replay), free(want), free(ids), free(w);
}

/* ---- communicator failures ------------------------------------------------------------ */

static void test_comm_failures(void) {
  const megamoe_host_services *hs = mm_host_services();
  mm_ep_comm *c = NULL;
  char key[64];
  snprintf(key, sizeof key, "ept-lonely-%d", g_key_gen++);
  /* rank 1 of 2: rank 0 never publishes the NCCL id -> DEADLINE_EXCEEDED */
  mm_ep_comm_args a1 = {1, 2, 0, NULL, key, 300, NULL, hs->kv_put, hs->kv_get};
  CHECK_ERR(mm_ep_comm_create(&a1, &c), MEGAMOE_CODE_DEADLINE_EXCEEDED);
  CHECK(c == NULL);
  /* more than one rank and neither a host communicator nor kv services */
  mm_ep_comm_args a0 = {0, 2, 0, NULL, key, 300, NULL, NULL, NULL};
  CHECK_ERR(mm_ep_comm_create(&a0, &c), MEGAMOE_CODE_FAILED_PRECONDITION);
  mm_ep_comm_args bad = {2, 2, 0, NULL, key, 300, NULL, NULL, NULL};
  CHECK_ERR(mm_ep_comm_create(&bad, &c), MEGAMOE_CODE_INVALID_ARGUMENT);
  /* Rank 0 of 2 publishes the id, rank 1 never joins: the non-blocking init
   * times out (2 s) and is aborted. MEGAMOE_TEST_COMM_TIMEOUT=0 skips it. */
  const char *opt = getenv("MEGAMOE_TEST_COMM_TIMEOUT");
  if (!opt || opt[0] != '0') {
    snprintf(key, sizeof key, "ept-lonely-%d", g_key_gen++);
    mm_ep_comm_args a2 = {0, 2, 0, NULL, key, 2000, NULL, hs->kv_put, hs->kv_get};
    CHECK_ERR(mm_ep_comm_create(&a2, &c), MEGAMOE_CODE_DEADLINE_EXCEEDED);
    CHECK(c == NULL);
  }
}

/* ---- rank-count equality --------------------------------------------------------------- */

typedef struct {
  const layer_shape *s;
  const mm_expert_q *ex;
  int R, T; /* tokens per rank */
  mm_dispatch_mode dm;
  const uint16_t *x;
  const int32_t *ids;
  const float *w;
  uint16_t *out; /* [R * T, H] */
  char key[64];
  int failed;
} group_ctx;

static void group_rank(int rank, void *p) {
  group_ctx *g = p;
  const layer_shape *s = g->s;
  if (cudaSetDevice(rank) != cudaSuccess) {
    g->failed = 1;
    return;
  }
  mm_op *op = NULL;
  mm_err *err = make_op(s, g->R, rank, g->dm, g->T, g->T, g->ex, g->key, &op);
  dev_io io;
  int bad = io_alloc(&io, g->T, s->H, s->K);
  if (!err && !bad) {
    size_t t0 = (size_t)rank * g->T;
    bad = io_upload(&io, g->x + t0 * s->H, g->ids + t0 * s->K, g->w + t0 * s->K);
    if (!bad) err = op_run(op, &io, NULL);
    if (!err && !bad)
      bad = cudaDeviceSynchronize() ||
            cudaMemcpy(g->out + t0 * s->H, io.d_out, (size_t)g->T * s->H * 2, cudaMemcpyDeviceToHost);
  }
  if (ept_report(rank, err)) g->failed = 1;
  if (bad) g->failed = 1;
  io_free(&io);
  free_op(op);
}

/* ep-size R output == ep-size 1 output for the same global batch. */
static void rank_equality(int R) {
  const layer_shape *s = &kLayers[0];
  mm_expert_q *ex = ept_make_experts(s->E, s->H, s->I, s->gran, mm_test_rand_u64());
  const int T = 33, G = R * T;
  uint16_t *one = malloc((size_t)G * s->H * 2), *many = malloc((size_t)G * s->H * 2);
  ept_batch in;
  ept_batch_make(&in, s, G);
  const uint16_t *x = in.x;
  const int32_t *ids = in.ids;
  const float *w = in.w;
  for (int dm = MM_DISPATCH_NORMAL; dm <= MM_DISPATCH_LOW_LATENCY; dm++) {
    group_ctx g1 = {s, ex, 1, G, (mm_dispatch_mode)dm, x, ids, w, one, "", 0};
    snprintf(g1.key, sizeof g1.key, "ept-group-%d", g_key_gen++);
    ept_run_ranks(1, group_rank, &g1);
    group_ctx gr = {s, ex, R, T, (mm_dispatch_mode)dm, x, ids, w, many, "", 0};
    snprintf(gr.key, sizeof gr.key, "ept-group-%d", g_key_gen++);
    ept_run_ranks(R, group_rank, &gr);
    CHECK(!g1.failed && !gr.failed);
    size_t d = count_diff(one, many, (size_t)G * s->H);
    printf("# rank equality R = %d (%s): %zu of %d outputs differ from ep-size 1\n", R,
           dm == MM_DISPATCH_NORMAL ? "normal" : "low-latency", d, G * s->H);
    CHECK_EQ_INT(d, 0);
  }
  mm_experts_free(ex, s->E);
  ept_batch_free(&in);
  free(one), free(many);
}

static void test_rank_equality(void) {
  int R = mm_cuda_device_count();
  const char *env = getenv("MEGAMOE_TEST_RANKS");
  if (env && atoi(env) > 0 && atoi(env) < R) R = atoi(env);
  if (R > 16) R = 16; /* E = 16 in this shape */
  while (kLayers[0].E % R) R--;
  rank_equality(R);
}

int main(void) {
  if (mm_cuda_device_count() <= 0) return mm_test_skip_all("no GPU");
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  mm_test_seed();
  /* MEGAMOE_EP_TEST_ONLY=engine: the engine tests only (for compute-sanitizer). */
  const char *only = getenv("MEGAMOE_EP_TEST_ONLY");
  RUN(test_engine_both_modes);
  RUN(test_engine_edges);
  RUN(test_engine_graph_replay);
  RUN(test_engine_transports);
  RUN(test_comm_failures);
  if (only && !strcmp(only, "engine")) return mm_test_done();
  RUN(test_backend_vs_reference);
  RUN(test_backend_nan_inf);
  RUN(test_backend_graph_replay);
  RUN(test_rank_equality);
  return mm_test_done();
}

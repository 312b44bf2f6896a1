/* gpu_test_ep_ranks.c -- the expert-parallel path over several GPUs, one
 * thread and one NCCL rank per GPU (all visible GPUs, or
 * MEGAMOE_TEST_RANKS). Skips with fewer than two GPUs.
 *
 * - A low-latency decode step captured in a CUDA graph on every rank and
 *   replayed MEGAMOE_TEST_REPLAYS times (default 50; the GPU suite asks for
 *   1000) with inputs rotating through 8 batches: every replay must equal
 *   the eager execute of the same batch bit for bit, with no error. Once
 *   over each low-latency transport (CUDA IPC, NCCL: MEGAMOE_EP_TRANSPORT);
 *   the eager results of the two must be equal bit for bit.
 * - Dispatch-mode auto: low-latency and normal steps (and T = 0) mixed, over
 *   both transports: outputs equal bit for bit. Again with ranks of
 *   different T in a step, on both sides of the threshold, each passing the
 *   step's largest T (max_tokens_any_rank, ABI 1.2).
 * - The fault path: the last rank withholds its execute (or has it refused,
 *   which also makes its own op fatal). Every other rank
 *   must return DEADLINE_EXCEEDED within comm.timeout-ms (plus slack) rather
 *   than hang, in both dispatch modes and over both low-latency transports
 *   (IPC: the device-side timeout, naming the peer); the op is then fatal.
 *   Every rank destroys its op, new ops are built on a fresh communicator,
 *   and a normal step through them matches the CPU reference. */
#include <cuda_runtime.h>
#include <sys/time.h>

#include "ep_test_util.h"
#include "ep_backend_util.h"

static const layer_shape kShape = {256, 256, 16, 4, 32, MM_COMPUTE_AUTO};

static double wall_ms(void) {
  struct timeval tv;
  gettimeofday(&tv, NULL);
  return tv.tv_sec * 1e3 + tv.tv_usec / 1e3;
}

static int test_ranks(void) {
  int R = mm_cuda_device_count();
  const char *env = getenv("MEGAMOE_TEST_RANKS");
  if (env && atoi(env) > 0 && atoi(env) < R) R = atoi(env);
  if (R > kShape.E) R = kShape.E;
  while (kShape.E % R) R--;
  return R;
}

/* Whether every pair of the R GPUs can access each other (the IPC transport
 * is then expected to be chosen). */
static int peers_ok(int R) {
  for (int a = 0; a < R; a++)
    for (int b = 0; b < R; b++) {
      int can = 0;
      if (a != b && (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess || !can)) {
        cudaGetLastError();
        return 0;
      }
    }
  return 1;
}

/* ---- graph replay at R ranks ------------------------------------------------------------ */

enum { kBatches = 8 };

typedef struct {
  int R, T, replays;
  const mm_expert_q *ex;
  /* [kBatches][R * T] global batches, made on the main thread */
  uint16_t *x;
  int32_t *ids;
  float *w;
  uint16_t *eager; /* [kBatches][R * T][H], written by the ranks */
  char key[64];
  const char *expect_transport; /* NULL: not checked */
  int failed, mismatched_replays, replay_errors, wrong_transport, replays_done;
  pthread_mutex_t lock;
} replay_ctx;

static void replay_rank(int rank, void *p) {
  replay_ctx *c = p;
  const layer_shape *s = &kShape;
  const int T = c->T, G = c->R * T;
  const size_t n = (size_t)T * s->H;
  int bad = cudaSetDevice(rank) != cudaSuccess, mism = 0, errs = 0;
  mm_op *op = NULL;
  dev_io io = {0};
  cudaStream_t st = NULL;
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  uint16_t *got = malloc(n * 2);
  mm_err *err = bad ? NULL : make_op(s, c->R, rank, MM_DISPATCH_LOW_LATENCY, T, T, c->ex, c->key, &op);
  bad = bad || err || io_alloc(&io, T, s->H, s->K) ||
        cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess;
  int wrong = 0;
  if (!bad && !err) {
    const char *tr = mm_cuda_transport(op);
    if (rank == 0) printf("# rank 0: low-latency transport %s\n", tr);
    wrong = c->expect_transport && strcmp(tr, c->expect_transport) != 0;
  }
  /* eager results of every batch (a collective step on every rank) */
  for (int b = 0; b < kBatches && !bad && !err; b++) {
    size_t t0 = (size_t)b * G + (size_t)rank * T;
    bad = io_upload(&io, c->x + t0 * s->H, c->ids + t0 * s->K, c->w + t0 * s->K);
    if (!bad) err = op_run(op, &io, st);
    if (!bad && !err) err = mm_cuda_check(op, st, 1); /* bounded: a failed peer is not a hang */
    if (!bad && !err)
      bad = cudaMemcpy(c->eager + t0 * s->H, io.d_out, n * 2, cudaMemcpyDeviceToHost) != cudaSuccess;
  }
  if (!bad && !err) {
    bad = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) != cudaSuccess;
    if (!bad) {
      err = op_run(op, &io, st);
      bad = cudaStreamEndCapture(st, &graph) != cudaSuccess || !graph ||
            cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess;
    }
  }
  int done = 0;
  for (int it = 0; it < c->replays && !bad && !err; it++, done++) {
    int b = it % kBatches;
    size_t t0 = (size_t)b * G + (size_t)rank * T;
    bad = io_upload(&io, c->x + t0 * s->H, c->ids + t0 * s->K, c->w + t0 * s->K) ||
          cudaGraphLaunch(exec, st) != cudaSuccess;
    if (!bad) { /* bounded wait, and the device-side flags of the replay */
      mm_err *e = mm_cuda_check(op, st, 1);
      if (e) {
        printf("# rank %d replay %d: %s\n", rank, it, e->message);
        megamoe_error_destroy(e);
        errs++;
        bad = op->state == MM_OP_FATAL;
      }
    }
    bad = bad || cudaMemcpy(got, io.d_out, n * 2, cudaMemcpyDeviceToHost) != cudaSuccess;
    if (!bad && count_diff(got, c->eager + t0 * s->H, n)) mism++;
  }
  bad |= ept_report(rank, err);
  pthread_mutex_lock(&c->lock);
  c->failed |= bad;
  c->mismatched_replays += mism;
  c->replay_errors += errs;
  c->wrong_transport += wrong;
  c->replays_done += done;
  pthread_mutex_unlock(&c->lock);
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  if (st) cudaStreamDestroy(st);
  io_free(&io);
  free_op(op);
  free(got);
}

static void test_graph_replay_ranks(void) {
  const layer_shape *s = &kShape;
  replay_ctx c = {0};
  c.R = test_ranks();
  c.T = 32;
  const char *env = getenv("MEGAMOE_TEST_REPLAYS");
  c.replays = env && atoi(env) > 0 ? atoi(env) : 50;
  c.ex = ept_make_experts(s->E, s->H, s->I, s->gran, mm_test_rand_u64());
  const size_t G = (size_t)c.R * c.T;
  c.x = malloc(kBatches * G * s->H * 2);
  c.ids = malloc(kBatches * G * s->K * 4);
  c.w = malloc(kBatches * G * s->K * 4);
  uint16_t *eager[2] = {malloc(kBatches * G * s->H * 2), malloc(kBatches * G * s->H * 2)};
  uint16_t *want = malloc(G * s->H * 2);
  pthread_mutex_init(&c.lock, NULL);
  for (int b = 0; b < kBatches; b++) {
    ept_fill_hidden(c.x + b * G * s->H, (int)G, s->H);
    /* random routing only: skewed batches (all to one expert, ids from 3
     * experts) exceed the plan's pool at R > 1 and are refused by design
     * (gpu_test_ep covers them at ep-size 1) */
    ept_fill_ids(c.ids + b * G * s->K, (int)G, s->K, s->E, EPT_IDS_RANDOM, b);
    ept_fill_weights(c.w + b * G * s->K, (int)G, s->K);
  }
  const char *transports[2] = {"ipc", "nccl"};
  const int p2p = peers_ok(c.R);
  int failed_any = 0;
  for (int ti = 0; ti < 2; ti++) {
    setenv("MEGAMOE_EP_TRANSPORT", transports[ti], 1);
    c.eager = eager[ti];
    memset(c.eager, 0xFF, kBatches * G * s->H * 2);
    c.failed = c.mismatched_replays = c.replay_errors = c.wrong_transport = c.replays_done = 0;
    c.expect_transport = ti == 1 || p2p ? transports[ti] : NULL;
    snprintf(c.key, sizeof c.key, "ept-replay-%d", g_key_gen++);
    double t0 = wall_ms();
    ept_run_ranks(c.R, replay_rank, &c);
    printf("# graph replay at %d ranks (transport %s): %d replays of a %d-token low-latency step "
           "per rank in %.1f s, %d replays differ from eager, %d checks reported errors, %d ranks "
           "on another transport\n",
           c.R, transports[ti], c.replays_done / c.R, c.T, (wall_ms() - t0) / 1e3, c.mismatched_replays,
           c.replay_errors, c.wrong_transport);
    CHECK(!c.failed);
    CHECK_EQ_INT(c.mismatched_replays, 0);
    CHECK_EQ_INT(c.replay_errors, 0);
    CHECK_EQ_INT(c.wrong_transport, 0);
    CHECK_EQ_INT(c.replays_done, c.replays * c.R);
    failed_any |= c.failed;
    for (int b = 0; b < kBatches && !c.failed; b++) {
      reference(s, c.ex, (int)G, c.x + b * G * s->H, c.ids + b * G * s->K, c.w + b * G * s->K,
                want);
      double rel = rel_frob(c.eager + b * G * s->H, want, G * s->H);
      printf("# batch %d: rel %.2e vs reference\n", b, rel);
      CHECK(rel <= backend_tolerance(s->gran, s->cm));
    }
  }
  unsetenv("MEGAMOE_EP_TRANSPORT");
  if (!failed_any) {
    size_t d = count_diff(eager[0], eager[1], kBatches * G * s->H);
    printf("# eager low-latency steps at %d ranks, ipc vs nccl: %zu of %zu outputs differ%s\n",
           c.R, d, kBatches * G * s->H, p2p ? "" : " (no peer access: both ran nccl)");
    CHECK_EQ_INT(d, 0);
  }
  pthread_mutex_destroy(&c.lock);
  mm_experts_free((mm_expert_q *)c.ex, s->E);
  free(c.x), free(c.ids), free(c.w), free(eager[0]), free(eager[1]), free(want);
}

/* ---- dispatch-mode auto over both transports ------------------------------------------- */

/* Low-latency steps (T <= 16) with normal ones (T = 40) and T = 0 between
 * them: the IPC epochs stay in step across NCCL steps; every output equals
 * the NCCL transport's bit for bit and the reference within tolerance. */
enum { kMixSteps = 7, kMixMax = 48, kMixLL = 16 };
static const int kMixT[kMixSteps] = {8, 40, 3, 0, 16, 1, 16};
/* Uneven steps: even and odd ranks hold different T, on both sides of the
 * threshold in some steps; each rank passes the step's largest T
 * (max_tokens_any_rank), so that all choose the same mode. Deciding by
 * their own T, the first steps' ranks would pick different modes and time
 * out. */
static const int kUnevenT[kMixSteps][2] = {{8, 40}, {40, 8}, {16, 17}, {0, 30},
                                           {3, 3},  {0, 0},  {16, 1}};
static int step_tokens(int uneven, int step, int rank) {
  return uneven ? kUnevenT[step][rank % 2] : kMixT[step];
}

typedef struct {
  int R;
  const mm_expert_q *ex;
  const uint16_t *x;
  const int32_t *ids;
  const float *w;
  uint16_t *out; /* [kMixSteps][R][kMixMax][H] */
  char key[64];
  int uneven; /* kUnevenT with max_tokens_any_rank, else kMixT */
  int failed;
  pthread_mutex_t lock;
} mix_ctx;

static void mix_rank(int rank, void *p) {
  mix_ctx *c = p;
  const layer_shape *s = &kShape;
  int bad = cudaSetDevice(rank) != cudaSuccess;
  mm_op *op = NULL;
  dev_io io = {0};
  mm_err *err = bad ? NULL
                    : make_op(s, c->R, rank, MM_DISPATCH_AUTO, kMixLL, kMixMax, c->ex, c->key, &op);
  bad = bad || err || io_alloc(&io, kMixMax, s->H, s->K);
  if (!bad && !err && rank == 0) printf("# rank 0: low-latency transport %s\n", mm_cuda_transport(op));
  for (int i = 0; i < kMixSteps && !bad && !err; i++) {
    const int T = step_tokens(c->uneven, i, rank);
    const size_t t0 = ((size_t)i * c->R + (size_t)rank) * kMixMax;
    io.T = T;
    io.max_any = c->uneven ? (kUnevenT[i][0] > kUnevenT[i][1] ? kUnevenT[i][0] : kUnevenT[i][1]) : 0;
    bad = io_upload(&io, c->x + t0 * s->H, c->ids + t0 * s->K, c->w + t0 * s->K);
    if (!bad) err = op_run(op, &io, NULL);
    if (!bad && !err) err = mm_cuda_check(op, NULL, 1);
    if (!bad && !err && T > 0)
      bad = cudaMemcpy(c->out + t0 * s->H, io.d_out, (size_t)T * s->H * 2,
                       cudaMemcpyDeviceToHost) != cudaSuccess;
  }
  bad |= ept_report(rank, err);
  pthread_mutex_lock(&c->lock);
  c->failed |= bad;
  pthread_mutex_unlock(&c->lock);
  io_free(&io);
  free_op(op);
}

static void auto_mode_transports(int uneven) {
  const layer_shape *s = &kShape;
  const int R = test_ranks();
  const size_t rows = (size_t)kMixSteps * R * kMixMax;
  mm_expert_q *ex = ept_make_experts(s->E, s->H, s->I, s->gran, mm_test_rand_u64());
  uint16_t *x = malloc(rows * s->H * 2), *want = malloc((size_t)kMixMax * s->H * 2);
  uint16_t *out[2] = {calloc(rows * s->H, 2), calloc(rows * s->H, 2)};
  int32_t *ids = malloc(rows * s->K * 4);
  float *w = malloc(rows * s->K * 4);
  ept_fill_hidden(x, (int)rows, s->H);
  ept_fill_ids(ids, (int)rows, s->K, s->E, EPT_IDS_RANDOM, 0);
  ept_fill_weights(w, (int)rows, s->K);
  const char *transports[2] = {"ipc", "nccl"};
  int failed = 0;
  for (int ti = 0; ti < 2; ti++) {
    setenv("MEGAMOE_EP_TRANSPORT", transports[ti], 1);
    mix_ctx c = {.R = R, .ex = ex, .x = x, .ids = ids, .w = w, .out = out[ti], .uneven = uneven};
    snprintf(c.key, sizeof c.key, "ept-mix-%d", g_key_gen++);
    pthread_mutex_init(&c.lock, NULL);
    ept_run_ranks(R, mix_rank, &c);
    pthread_mutex_destroy(&c.lock);
    CHECK(!c.failed);
    failed |= c.failed;
  }
  unsetenv("MEGAMOE_EP_TRANSPORT");
  if (!failed) {
    size_t d = count_diff(out[0], out[1], rows * s->H);
    printf("# dispatch-mode auto at %d ranks, %s: ipc vs nccl: %zu of %zu outputs differ\n", R,
           uneven ? "ranks of 8 and 40, 40 and 8, 16 and 17, 0 and 30, 3, 0, 16 and 1 tokens "
                    "(max_tokens_any_rank)"
                  : "steps of 8, 40 (normal), 3, 0, 16, 1, 16 tokens",
           d, rows * s->H);
    CHECK_EQ_INT(d, 0);
    double worst = 0;
    for (int i = 0; i < kMixSteps; i++)
      for (int r = 0; r < R; r++) {
        const int T = step_tokens(uneven, i, r);
        if (T == 0) continue;
        const size_t t0 = ((size_t)i * R + (size_t)r) * kMixMax;
        reference(s, ex, T, x + t0 * s->H, ids + t0 * s->K, w + t0 * s->K, want);
        double rel = rel_frob(out[0] + t0 * s->H, want, (size_t)T * s->H);
        if (rel > worst) worst = rel;
      }
    printf("# dispatch-mode auto: worst rel %.2e vs reference\n", worst);
    CHECK(worst <= backend_tolerance(s->gran, s->cm));
  }
  mm_experts_free(ex, s->E);
  free(x), free(want), free(out[0]), free(out[1]), free(ids), free(w);
}
static void test_auto_mode_transports(void) { auto_mode_transports(0); }
static void test_auto_mode_uneven_ranks(void) { auto_mode_transports(1); }

/* ---- a rank withholds its execute ------------------------------------------------------- */

typedef struct {
  int R, T, timeout_ms;
  mm_dispatch_mode dm;
  const mm_expert_q *ex;
  const uint16_t *x;
  const int32_t *ids;
  const float *w;
  uint16_t *out; /* [R * T][H], the recovery step */
  char key[64], key2[64];
  pthread_barrier_t barrier;
  pthread_mutex_t lock;
  int ipc; /* the low-latency transport asked for is CUDA IPC */
  int refuse; /* the last rank calls execute with a misaligned `out` instead of withholding it */
  int refused_fatal; /* it got INVALID_ARGUMENT and its op turned fatal */
  int failed, timeouts, ipc_reports;
  double worst_ms;
} fault_ctx;

static void fault_rank(int rank, void *p) {
  fault_ctx *c = p;
  const layer_shape *s = &kShape;
  const int withhold = rank == c->R - 1;
  int bad = cudaSetDevice(rank) != cudaSuccess, timed_out = 0, ipc_report = 0;
  double ms = 0;
  mm_op *op = NULL;
  dev_io io = {0};
  size_t t0 = (size_t)rank * c->T;
  mm_err *err = bad ? NULL : make_op(s, c->R, rank, c->dm, c->T, c->T, c->ex, c->key, &op);
  bad = bad || err || io_alloc(&io, c->T, s->H, s->K) ||
        io_upload(&io, c->x + t0 * s->H, c->ids + t0 * s->K, c->w + t0 * s->K);
  if (err) {
    printf("# rank %d setup: %s\n", rank, err->message);
    megamoe_error_destroy(err);
    err = NULL;
  }
  pthread_barrier_wait(&c->barrier);
  if (!bad && withhold && c->refuse) {
    /* refused before any exchange: the peers run the step without this rank */
    dev_io mis = io;
    mis.d_out = io.d_out + 1; /* aligned to its bf16 elements, not to 16 bytes */
    err = op_run(op, &mis, NULL);
    const int fatal = err && err->code == MEGAMOE_CODE_INVALID_ARGUMENT && op->state == MM_OP_FATAL;
    printf("# rank %d refused: %s; op %s\n", rank, err ? err->message : "no error",
           op->state == MM_OP_FATAL ? "fatal" : "usable");
    megamoe_error_destroy(err);
    err = NULL;
    pthread_mutex_lock(&c->lock);
    c->refused_fatal = fatal;
    pthread_mutex_unlock(&c->lock);
  }
  if (!bad && !withhold) {
    double a = wall_ms();
    err = op_run(op, &io, NULL);
    /* low-latency: no host sync inside execute; the check waits */
    if (!err) err = mm_cuda_check(op, NULL, 1);
    ms = wall_ms() - a;
    timed_out = err && err->code == MEGAMOE_CODE_DEADLINE_EXCEEDED && op->state == MM_OP_FATAL;
    /* the IPC exchange's own report, naming the withholding rank */
    char peer[48];
    snprintf(peer, sizeof peer, "for rank %d in a CUDA IPC exchange", c->R - 1);
    ipc_report = err && strstr(err->message, peer) != NULL;
    printf("# rank %d (%s, transport %s): %s after %.0f ms\n", rank,
           c->dm == MM_DISPATCH_NORMAL ? "normal" : "low-latency", mm_cuda_transport(op),
           err ? err->message : "no error", ms);
    megamoe_error_destroy(err);
    err = NULL;
  }
  /* the withholding rank waits for the others' verdicts, then everybody
   * destroys its op (the survivors' communicators are already aborted) */
  pthread_barrier_wait(&c->barrier);
  free_op(op);
  op = NULL;
  pthread_barrier_wait(&c->barrier);
  /* recovery: a fresh op on a fresh communicator, one normal step */
  if (!bad) err = make_op(s, c->R, rank, MM_DISPATCH_NORMAL, c->T, c->T, c->ex, c->key2, &op);
  if (!bad && !err) err = op_run(op, &io, NULL);
  if (!bad && !err)
    bad = cudaDeviceSynchronize() ||
          cudaMemcpy(c->out + t0 * s->H, io.d_out, (size_t)c->T * s->H * 2, cudaMemcpyDeviceToHost);
  if (err) {
    printf("# rank %d recovery: %s\n", rank, err->message);
    megamoe_error_destroy(err);
    bad = 1;
  }
  pthread_mutex_lock(&c->lock);
  c->failed |= bad;
  if (!withhold) {
    c->timeouts += timed_out;
    c->ipc_reports += ipc_report;
    if (ms > c->worst_ms) c->worst_ms = ms;
  }
  pthread_mutex_unlock(&c->lock);
  io_free(&io);
  free_op(op);
}

static void withheld_execute(int refuse) {
  const layer_shape *s = &kShape;
  const int R = test_ranks(), T = 24, G = R * T;
  mm_expert_q *ex = ept_make_experts(s->E, s->H, s->I, s->gran, mm_test_rand_u64());
  uint16_t *out = malloc((size_t)G * s->H * 2), *want = malloc((size_t)G * s->H * 2);
  ept_batch in;
  ept_batch_make(&in, s, G);
  const uint16_t *x = in.x;
  const int32_t *ids = in.ids;
  const float *w = in.w;
  const int saved_timeout = g_comm_timeout_ms;
  g_comm_timeout_ms = 3000;
  const int p2p = peers_ok(R);
  /* normal; low-latency over NCCL; low-latency over CUDA IPC (refused: normal only) */
  for (int variant = 0; variant < (refuse ? 1 : 3); variant++) {
    const int dm = variant == 0 ? MM_DISPATCH_NORMAL : MM_DISPATCH_LOW_LATENCY;
    setenv("MEGAMOE_EP_TRANSPORT", variant == 2 ? "ipc" : "nccl", 1);
    fault_ctx c = {.R = R, .T = T, .timeout_ms = g_comm_timeout_ms, .dm = (mm_dispatch_mode)dm,
                   .ex = ex, .x = x, .ids = ids, .w = w, .out = out, .ipc = variant == 2,
                   .refuse = refuse};
    snprintf(c.key, sizeof c.key, "ept-fault-%d", g_key_gen++);
    snprintf(c.key2, sizeof c.key2, "ept-fault-%d", g_key_gen++);
    pthread_barrier_init(&c.barrier, NULL, (unsigned)R);
    pthread_mutex_init(&c.lock, NULL);
    memset(out, 0xFF, (size_t)G * s->H * 2);
    ept_run_ranks(R, fault_rank, &c);
    printf("# %s execute at %d ranks (%s%s): %d of %d waiting ranks timed out, worst %.0f "
           "ms (limit %d ms), %d reports from the IPC exchange\n",
           refuse ? "refused" : "withheld", R, dm == MM_DISPATCH_NORMAL ? "normal" : "low-latency",
           variant == 0 ? "" : variant == 1 ? ", nccl" : ", ipc", c.timeouts, R - 1, c.worst_ms,
           c.timeout_ms, c.ipc_reports);
    CHECK(!c.failed);
    CHECK_EQ_INT(c.timeouts, R - 1);
    if (refuse) CHECK(c.refused_fatal);
    if (c.ipc && p2p) CHECK_EQ_INT(c.ipc_reports, R - 1);
    CHECK(c.worst_ms < c.timeout_ms + 5000);
    reference(s, ex, G, x, ids, w, want);
    double rel = rel_frob(out, want, (size_t)G * s->H);
    printf("# recovery step: rel %.2e vs reference\n", rel);
    CHECK(rel <= backend_tolerance(s->gran, s->cm));
    pthread_barrier_destroy(&c.barrier);
    pthread_mutex_destroy(&c.lock);
  }
  unsetenv("MEGAMOE_EP_TRANSPORT");
  g_comm_timeout_ms = saved_timeout;
  mm_experts_free(ex, s->E);
  ept_batch_free(&in);
  free(out), free(want);
}
static void test_withheld_execute(void) { withheld_execute(0); }
/* A rank refuses its execute (an `out` not 16-byte aligned): its op turns
 * fatal at once (it cannot rejoin the step its peers run), the peers time
 * out, and fresh ops recover. */
static void test_refused_execute(void) { withheld_execute(1); }

int main(void) {
  if (mm_cuda_device_count() <= 0) return mm_test_skip_all("no GPU");
  if (test_ranks() < 2) return mm_test_skip_all("fewer than two GPUs");
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  mm_test_seed();
  g_comm_timeout_ms = 20000; /* a broken peer costs seconds, not the suite */
  RUN(test_graph_replay_ranks);
  RUN(test_auto_mode_transports);
  RUN(test_auto_mode_uneven_ranks);
  RUN(test_withheld_execute);
  RUN(test_refused_execute);
  return mm_test_done();
}

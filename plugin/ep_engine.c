/* ep_engine.c -- expert-parallel dispatch / combine of one rank.
 *
 * Buffers: two large regions, each reused by three buffers whose lifetimes
 * do not overlap inside one step (everything is ordered on one stream):
 *   region x: dispatch send -> pool x + scales + compute workspace -> combine send
 *   region y: dispatch receive -> pool output -> combine receive
 * plus small index buffers (slots, ranks, offsets, counts, error words). */
#include "ep_engine.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep_kernels.h"

struct mm_ep_engine {
  mm_ep_engine_args a;
  mm_ep_sizes sz;
  mm_ep_dev dev;
  void *region_x, *region_y, *meta;
  mm_ep_ipc *ipc;        /* low-latency transport over CUDA IPC; NULL = NCCL */
  int32_t *counts_meta;  /* the count matrix of NCCL steps */
  int32_t *host_pinned; /* counts [R * L] then error words */
  int32_t *counts_h, *err_h;
  cudaEvent_t err_copied; /* recorded after the error words' copy (not under capture) */
  uint64_t ws_offset, ws_bytes;
  int64_t *send_off, *send_bytes, *recv_off, *recv_bytes; /* [R] each, bytes */
  int64_t *cs_off, *cs_bytes, *cr_off, *cr_bytes;
  /* the step between dispatch and combine */
  int dispatched;
  int T;
  const int32_t *ids;
  mm_ep_mode mode;
  void *stream;
  void *events[4];
  int64_t recv_rows, recv_pairs;
};

static mm_err *mark(void *ev, cudaStream_t st) {
  if (!ev) return NULL;
  cudaError_t ce = cudaEventRecord((cudaEvent_t)ev, st);
  return ce == cudaSuccess ? NULL : mm_error(MEGAMOE_CODE_INTERNAL, "cudaEventRecord: %s",
                                             cudaGetErrorString(ce));
}

#define CUDA_TRY(call, what)                                                              \
  do {                                                                                    \
    cudaError_t ce_ = (call);                                                             \
    if (ce_ != cudaSuccess)                                                               \
      return mm_error(MEGAMOE_CODE_INTERNAL, "%s: %s", (what), cudaGetErrorString(ce_)); \
  } while (0)
#define LAUNCH_TRY(call, name) CUDA_TRY((cudaError_t)(call), "launch of " name)

static mm_err *dev_alloc(mm_ep_engine *e, size_t bytes, void **p) {
  *p = NULL;
  if (bytes == 0) return NULL;
  if (e->a.dev_alloc) {
    if (e->a.dev_alloc(e->a.alloc_ctx, e->a.device, bytes, p) != 0 || !*p)
      return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED,
                      "the host's device_alloc failed for %zu bytes on device %d", bytes,
                      e->a.device);
    return NULL;
  }
  cudaError_t ce = cudaMalloc(p, bytes);
  if (ce != cudaSuccess) {
    *p = NULL;
    cudaGetLastError();
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "cudaMalloc(%zu bytes) on device %d: %s",
                    bytes, e->a.device, cudaGetErrorString(ce));
  }
  return NULL;
}

static void dev_free(mm_ep_engine *e, void *p) {
  if (!p) return;
  if (e->a.dev_alloc && e->a.dev_free) e->a.dev_free(e->a.alloc_ctx, e->a.device, p);
  else if (!e->a.dev_alloc) cudaFree(p);
}

static size_t align_up(size_t x) { return (x + MM_EP_ALIGN - 1) / MM_EP_ALIGN * MM_EP_ALIGN; }

/* Hands out consecutive aligned pieces of the meta buffer. */
static void *carve(char **cursor, size_t bytes) {
  void *p = *cursor;
  *cursor += align_up(bytes);
  return p;
}

static mm_err *reset_errors(mm_ep_engine *e, cudaStream_t st) {
  CUDA_TRY(cudaMemsetAsync(e->dev.err, 0, 8, st), "clearing the error words");
  CUDA_TRY(cudaMemsetAsync(e->dev.err + 2, 0xFF, 8, st), "clearing the error words");
  e->err_h[0] = 0;
  e->err_h[1] = 0;
  e->err_h[2] = e->err_h[3] = -1;
  return NULL;
}

mm_err *mm_ep_engine_create(const mm_ep_engine_args *a, mm_ep_engine **out) {
  *out = NULL;
  MM_ARG_CHECK(a->comm, "expert-parallel engine needs a communicator");
  MM_ARG_CHECK(a->ranks <= MM_EP_MAX_RANKS, "ep-size %d exceeds %d", a->ranks, MM_EP_MAX_RANKS);
  MM_ARG_CHECK(a->top_k <= 32, "top-k %d exceeds 32 (the GPU routing kernels' limit)", a->top_k);
  mm_ep_size_args sa = {a->ranks, a->num_experts, a->top_k, a->hidden, a->intermediate,
                        a->max_tokens, a->ll_tokens,
                        a->pool_factor > 0 ? a->pool_factor : MM_EP_POOL_FACTOR_DEFAULT,
                        a->workspace_bytes};
  mm_ep_sizes sz;
  MM_TRY(mm_ep_size(&sa, &sz));
  MM_ARG_CHECK(sz.pool_rows <= INT32_MAX && sz.recv_rows * a->top_k <= INT32_MAX &&
                   sz.ll_pair_rows <= INT32_MAX,
               "expert-parallel buffers too large for 32-bit row indices (pool %lld rows)",
               (long long)sz.pool_rows);
  mm_ep_engine *e = calloc(1, sizeof *e);
  if (!e) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of host memory");
  e->a = *a;
  e->sz = sz;
  mm_err *err = NULL;
  const int R = a->ranks, K = a->top_k, H = a->hidden, L = mm_ep_count_row_len(R);
  const int per = a->num_experts / R;
  const size_t P = (size_t)sz.pool_rows;
  int64_t *hb = calloc((size_t)R * 8, sizeof(int64_t));
  if (!hb) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of host memory");
    goto fail;
  }
  e->send_off = hb;
  e->send_bytes = hb + R;
  e->recv_off = hb + 2 * R;
  e->recv_bytes = hb + 3 * R;
  e->cs_off = hb + 4 * R;
  e->cs_bytes = hb + 5 * R;
  e->cr_off = hb + 6 * R;
  e->cr_bytes = hb + 7 * R;
  if (cudaSetDevice(a->device) != cudaSuccess) {
    err = mm_error(MEGAMOE_CODE_INTERNAL, "cudaSetDevice(%d) failed", a->device);
    goto fail;
  }
  MM_TRY_GOTO(dev_alloc(e, sz.region_x, &e->region_x), err, fail);
  MM_TRY_GOTO(dev_alloc(e, sz.region_y, &e->region_y), err, fail);
  MM_TRY_GOTO(dev_alloc(e, sz.meta, &e->meta), err, fail);
  cudaError_t ce = cudaHostAlloc((void **)&e->host_pinned, sz.host_total, cudaHostAllocDefault);
  if (ce != cudaSuccess) {
    e->host_pinned = NULL;
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "cudaHostAlloc(%llu bytes): %s",
                   (unsigned long long)sz.host_total, cudaGetErrorString(ce));
    goto fail;
  }
  e->counts_h = e->host_pinned;
  e->err_h = (int32_t *)((char *)e->host_pinned + align_up((size_t)R * L * 4));

  mm_ep_dev *d = &e->dev;
  d->ranks = R;
  d->rank = a->rank;
  d->num_experts = a->num_experts;
  d->experts_per_rank = per;
  d->top_k = K;
  d->hidden = H;
  d->row_bytes = sz.row_bytes;
  d->pool_cap = sz.pool_rows;
  d->recv_cap = sz.recv_rows;
  /* region x (the dispatch send, except at one rank: mm_ep_dispatch) */
  d->send = e->region_x;
  d->pool_x = e->region_x;
  d->pool_xs = (float *)((char *)e->region_x + align_up(P * (size_t)H));
  e->ws_offset = align_up(P * (size_t)H) + align_up(P * (size_t)(H / 32));
  e->ws_bytes = sz.region_x - e->ws_offset;
  /* the combine receive (NCCL), once the pool and the workspace are dead;
   * at one rank the send buffer itself (mm_ep_dispatch) */
  d->crecv = e->region_x;
  /* region y: the dispatch receive, then the expert compute's output, which
   * is the combine send buffer (the compute writes each pool row at its
   * combine row, pool_to_cs); mm_ep_size sizes y for both the pool output
   * and the combine rows, and x for the combine receive */
  d->recv = e->region_y;
  d->csend = e->region_y;
  /* small buffers, in the order of mm_ep_size's list */
  const int64_t recv_rows_any = sz.recv_rows > sz.ll_tok_rows ? sz.recv_rows : sz.ll_tok_rows;
  char *cur = e->meta;
  d->tok_slot = carve(&cur, (size_t)a->max_tokens * K * 4);
  d->pair_slot = carve(&cur, (size_t)a->max_tokens * K * 4);
  d->pool_rank = carve(&cur, (size_t)recv_rows_any * K * 4);
  d->cs_rank = carve(&cur, (size_t)recv_rows_any * K * 4);
  d->row_weight = carve(&cur, P * 4);
  d->pool_to_cs = carve(&cur, P * 4);
  d->expert_off = carve(&cur, (size_t)(per + 1) * 8);
  d->expert_off_pool = carve(&cur, (size_t)(per + 1) * 8);
  d->expert_count = carve(&cur, (size_t)per * 4);
  d->counts = e->counts_meta = carve(&cur, (size_t)R * L * 4);
  d->seg = carve(&cur, (size_t)(R + 1) * 8 * 4);
  d->err = carve(&cur, 64);
  if ((uint64_t)(cur - (char *)e->meta) > sz.meta) {
    err = mm_error(MEGAMOE_CODE_INTERNAL, "expert-parallel meta carve-up exceeds its size");
    goto fail;
  }
  ce = cudaEventCreateWithFlags(&e->err_copied, cudaEventDisableTiming);
  if (ce != cudaSuccess) {
    e->err_copied = NULL;
    err = mm_error(MEGAMOE_CODE_INTERNAL, "cudaEventCreate: %s", cudaGetErrorString(ce));
    goto fail;
  }
  MM_TRY_GOTO(reset_errors(e, 0), err, fail);
  ce = cudaMemset(d->counts, 0, (size_t)R * L * 4);
  if (ce == cudaSuccess) ce = cudaDeviceSynchronize();
  if (ce != cudaSuccess) {
    err = mm_error(MEGAMOE_CODE_INTERNAL, "initializing expert-parallel buffers: %s",
                   cudaGetErrorString(ce));
    goto fail;
  }
  if (a->ll_tokens > 0) {
    mm_ep_ipc_args ia = {a->rank, R, a->device, a->transport, a->ll_tokens, sz.row_bytes, H, K,
                         a->comm};
    MM_TRY_GOTO(mm_ep_ipc_create(&ia, &e->ipc), err, fail);
  }
  *out = e;
  return NULL;
fail:
  mm_ep_engine_destroy(e);
  return err;
}

void mm_ep_engine_destroy(mm_ep_engine *e) {
  if (!e) return;
  if (cudaSetDevice(e->a.device) == cudaSuccess) cudaDeviceSynchronize();
  mm_ep_ipc_destroy(e->ipc);
  dev_free(e, e->region_x);
  dev_free(e, e->region_y);
  dev_free(e, e->meta);
  if (e->host_pinned) cudaFreeHost(e->host_pinned);
  if (e->err_copied) cudaEventDestroy(e->err_copied);
  free(e->send_off);
  free(e);
}

const mm_ep_sizes *mm_ep_engine_sizes(const mm_ep_engine *e) { return &e->sz; }
uint64_t mm_ep_engine_device_bytes(const mm_ep_engine *e) {
  return e->sz.device_total + (e->ipc ? mm_ep_ipc_bytes(e->ipc) : 0);
}
uint64_t mm_ep_engine_host_bytes(const mm_ep_engine *e) { return e->sz.host_total; }
int mm_ep_engine_ll_tokens(const mm_ep_engine *e) { return e->a.ll_tokens; }
mm_ep_transport mm_ep_engine_transport(const mm_ep_engine *e) {
  return e->ipc ? MM_EP_TRANSPORT_IPC : MM_EP_TRANSPORT_NCCL;
}

void mm_ep_engine_step_bytes(const mm_ep_engine *e, int64_t *dispatch, int64_t *combine) {
  int64_t d = 0, c = 0;
  for (int r = 0; r < e->a.ranks; r++) d += e->send_bytes[r], c += e->cs_bytes[r];
  *dispatch = d;
  *combine = c;
}

/* Normal mode: every rank checks every rank's fan-in against its capacity,
 * so all return the same verdict and none is left waiting in a collective. */
static mm_err *check_matrix(mm_ep_engine *e) {
  const int R = e->a.ranks, L = mm_ep_count_row_len(R);
  const int32_t *M = e->counts_h;
  for (int s = 0; s < R; s++) {
    const int32_t *row = M + (int64_t)s * L;
    if (row[MM_EP_CNT_MODE(R)] != e->dev.mode_tag) {
      char why[256];
      snprintf(why, sizeof why,
               "rank %d ran a low-latency step while this rank ran a normal one (dispatch-mode "
               "auto needs every rank on the same side of dispatch.low-latency-max-tokens)", s);
      return mm_ep_comm_abort(e->a.comm, MEGAMOE_CODE_FAILED_PRECONDITION, why);
    }
  }
  for (int s = 0; s < R; s++) {
    const int32_t *row = M + (int64_t)s * L;
    int64_t tok = 0, pair = 0;
    for (int r = 0; r < R; r++) {
      tok += M[(int64_t)r * L + MM_EP_CNT_TOK(R, s)];
      pair += M[(int64_t)r * L + MM_EP_CNT_PAIR(R, s)];
    }
    if (tok > row[MM_EP_CNT_RECV_CAP(R)] || pair > row[MM_EP_CNT_POOL_CAP(R)])
      return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED,
                      "rank %d would receive %lld tokens / %lld expert rows; its plan holds %d / "
                      "%d (routing too unbalanced for the plan: raise num-max-tokens-per-rank or "
                      "split the batch); no rank ran this step", s, (long long)tok,
                      (long long)pair, row[MM_EP_CNT_RECV_CAP(R)], row[MM_EP_CNT_POOL_CAP(R)]);
  }
  return NULL;
}

static void exact_layout(mm_ep_engine *e) {
  const int R = e->a.ranks, me = e->a.rank, L = mm_ep_count_row_len(R);
  const int64_t rb = e->sz.row_bytes, ob = (int64_t)e->a.hidden * 2;
  const int32_t *M = e->counts_h, *mine = M + (int64_t)me * L;
  int64_t so = 0, ro = 0, cso = 0, cro = 0;
  for (int r = 0; r < R; r++) {
    const int32_t *src = M + (int64_t)r * L;
    e->send_off[r] = so * rb;
    e->send_bytes[r] = (int64_t)mine[MM_EP_CNT_TOK(R, r)] * rb;
    so += mine[MM_EP_CNT_TOK(R, r)];
    e->recv_off[r] = ro * rb;
    e->recv_bytes[r] = (int64_t)src[MM_EP_CNT_TOK(R, me)] * rb;
    ro += src[MM_EP_CNT_TOK(R, me)];
    e->cs_off[r] = cso * ob;
    e->cs_bytes[r] = (int64_t)src[MM_EP_CNT_PAIR(R, me)] * ob;
    cso += src[MM_EP_CNT_PAIR(R, me)];
    e->cr_off[r] = cro * ob;
    e->cr_bytes[r] = (int64_t)mine[MM_EP_CNT_PAIR(R, r)] * ob;
    cro += mine[MM_EP_CNT_PAIR(R, r)];
  }
  e->recv_rows = ro;
  e->recv_pairs = cso;
}

static void fixed_layout(mm_ep_engine *e) {
  const int R = e->a.ranks;
  const int64_t tok = (int64_t)e->a.ll_tokens * e->sz.row_bytes;
  const int64_t pair = (int64_t)e->a.ll_tokens * e->a.top_k * e->a.hidden * 2;
  for (int r = 0; r < R; r++) {
    e->send_off[r] = e->recv_off[r] = r * tok;
    e->send_bytes[r] = e->recv_bytes[r] = tok;
    e->cs_off[r] = e->cr_off[r] = r * pair;
    e->cs_bytes[r] = e->cr_bytes[r] = pair;
  }
  e->recv_rows = (int64_t)R * e->a.ll_tokens;
  e->recv_pairs = e->sz.pool_rows;
}

mm_err *mm_ep_dispatch(mm_ep_engine *e, const mm_ep_step *s, mm_expert_pool *pool, void **ws,
                       size_t *ws_bytes) {
  e->dispatched = 0;
  const int ll = s->mode == MM_EP_MODE_LOW_LATENCY;
  MM_ARG_CHECK(s->T >= 0 && s->T <= e->a.max_tokens, "T = %d tokens exceeds the plan's %d",
               s->T, e->a.max_tokens);
  MM_ARG_CHECK(!ll || s->T <= e->a.ll_tokens,
               "low-latency step with T = %d tokens; the plan's low-latency capacity is %d", s->T,
               e->a.ll_tokens);
  MM_ARG_CHECK(s->T == 0 || ((uintptr_t)s->hidden % 16 == 0),
               "hidden states must be 16-byte aligned");
  const char *failure = mm_ep_comm_failure(e->a.comm);
  if (failure) return mm_error(MEGAMOE_CODE_ABORTED, "NCCL communicator failed earlier: %s", failure);
  const int R = e->a.ranks, L = mm_ep_count_row_len(R);
  cudaStream_t st = (cudaStream_t)s->stream;
  mm_ep_dev *d = &e->dev;
  d->tok_stride = ll ? e->a.ll_tokens : 0;
  d->pair_stride = ll ? e->a.ll_tokens * e->a.top_k : 0;
  d->mode_tag = ll ? 2 | (e->a.ll_tokens << 2) : 1;
  /* The IPC transport's peers write the count matrix and the receive rows
   * straight into its buffer. At one rank its kernels copy into the rank's
   * own buffer: kept, so that one GPU runs and tests them (ep_ipc.c sets the
   * transport up at one rank for that). */
  const mm_ep_ipc_dev *x = ll && e->ipc ? mm_ep_ipc_device(e->ipc) : NULL;
  d->counts = x ? mm_ep_ipc_counts(e->ipc) : e->counts_meta;
  d->recv = x ? mm_ep_ipc_payload(e->ipc) : e->region_y;
  /* One rank over NCCL: the pack writes its rows where the arrangement reads
   * them (region y, dead since the last combine; mm_ep_size sizes y for the
   * send rows of one rank), and no copy runs. Else region x. */
  d->send = !x && R == 1 ? e->region_y : e->region_x;
  /* one rank over NCCL: the combine's send segment is its receive segment
   * (same offsets), so the combine reads it in place and skips the copy */
  d->crecv = x ? mm_ep_ipc_payload(e->ipc) : R == 1 ? e->region_y : e->region_x;

  MM_TRY(mark(s->events[0], st));
  LAUNCH_TRY(mm_ep_launch_route(d, s->T, s->ids, st), "ep route");
  if (x) {
    if (R > 1) LAUNCH_TRY(mm_ep_launch_ipc_exchange(d, x, MM_EP_IPC_COUNTS, st), "ep ipc counts");
  } else {
    MM_TRY(mm_ep_comm_allgather(e->a.comm, d->counts, (size_t)L * 4, st));
  }
  LAUNCH_TRY(mm_ep_launch_offsets(d, st), "ep offsets");
  LAUNCH_TRY(mm_ep_launch_pack(d, s->T, s->hidden, s->ids, s->weights, s->weight_scale, st),
             "ep pack");
  if (ll) {
    fixed_layout(e);
  } else {
    CUDA_TRY(cudaMemcpyAsync(e->counts_h, d->counts, (size_t)R * L * 4, cudaMemcpyDeviceToHost, st),
             "copying the count matrix");
    MM_TRY(mm_ep_comm_sync(e->a.comm, st));
    mm_err *verdict = check_matrix(e);
    if (verdict) {
      mm_err *e2 = reset_errors(e, st); /* this step did not happen */
      if (e2) megamoe_error_destroy(e2);
      return verdict;
    }
    exact_layout(e);
  }
  if (x)
    LAUNCH_TRY(mm_ep_launch_ipc_exchange(d, x, MM_EP_IPC_DISPATCH, st), "ep ipc dispatch");
  else if (d->send != d->recv) /* one rank: in place (above) */
    MM_TRY(mm_ep_comm_alltoallv(e->a.comm, d->send, e->send_off, e->send_bytes, d->recv,
                                e->recv_off, e->recv_bytes, st));
  LAUNCH_TRY(mm_ep_launch_recv_plan(d, st), "ep recv plan");
  LAUNCH_TRY(mm_ep_launch_expert_offsets(d, st), "ep expert offsets");
  LAUNCH_TRY(mm_ep_launch_arrange(d, e->recv_rows, st), "ep arrange");
  MM_TRY(mark(s->events[1], st));

  pool->num_rows_max = (int)e->sz.pool_rows;
  /* the compute's tile choice: normal mode knows the rows received; low
   * latency (no host read) expects T * top_k, its share of an even routing */
  const int64_t ll_rows = (int64_t)s->T * e->a.top_k;
  pool->rows_hint =
      (int)(ll ? (ll_rows < e->sz.pool_rows ? ll_rows : e->sz.pool_rows) : e->recv_pairs);
  pool->expert_offsets = d->expert_off_pool;
  pool->x = d->pool_x;
  pool->x_scale = d->pool_xs;
  pool->row_weight = d->row_weight;
  pool->out = d->csend;
  pool->out_rows = d->pool_to_cs;
  *ws = (char *)e->region_x + e->ws_offset;
  *ws_bytes = e->ws_bytes;
  e->dispatched = 1;
  e->T = s->T;
  e->ids = s->ids;
  e->mode = s->mode;
  e->stream = s->stream;
  memcpy(e->events, s->events, sizeof e->events);
  return NULL;
}

static mm_err *error_from_words(mm_ep_engine *e, int deferred) {
  const int32_t flags = e->err_h[0];
  if (!flags) return NULL;
  uint64_t key;
  memcpy(&key, e->err_h + 2, 8);
  const char *when = deferred ? "an earlier low-latency step" : "this step";
  if (flags & MM_EP_ERR_PEER_TIMEOUT) {
    /* The exchange gave up on the peer: like an NCCL timeout, fatal. */
    char why[256];
    snprintf(why, sizeof why,
             "%s: waited more than comm.timeout-ms = %d for rank %d in a CUDA IPC exchange (the "
             "peer is missing or hung); the transport is failed", when,
             mm_ep_comm_timeout_ms(e->a.comm), e->err_h[1] - 1);
    return mm_ep_comm_abort(e->a.comm, MEGAMOE_CODE_DEADLINE_EXCEEDED, why);
  }
  if (flags & MM_EP_ERR_MODE_MISMATCH)
    return mm_error(MEGAMOE_CODE_FAILED_PRECONDITION,
                    "%s: ranks disagreed on the dispatch mode or the low-latency capacity "
                    "(dispatch-mode auto needs every rank on the same side of "
                    "dispatch.low-latency-max-tokens); its outputs are invalid", when);
  if (flags & (MM_EP_ERR_POOL_OVERFLOW | MM_EP_ERR_RECV_OVERFLOW))
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED,
                    "%s: this rank received more %s than its plan holds (pool %lld rows); rows "
                    "past the capacity were not computed and its outputs are invalid", when,
                    (flags & MM_EP_ERR_POOL_OVERFLOW) ? "(token, expert) rows" : "tokens",
                    (long long)e->sz.pool_rows);
  if (key == UINT64_MAX)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: an expert id was outside [0, %d)", when,
                    e->a.num_experts);
  const int K = e->a.top_k;
  const uint32_t flat = (uint32_t)(key >> 32);
  const int32_t id = (int32_t)(uint32_t)(key & 0xffffffffu);
  return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                  "%s: topk_ids[%u][%u] = %d is outside [0, %d) and not -1 (masked); such "
                  "entries were treated as masked", when, flat / (uint32_t)K,
                  flat % (uint32_t)K, id, e->a.num_experts);
}

mm_err *mm_ep_combine(mm_ep_engine *e, uint16_t *out) {
  if (!e->dispatched)
    return mm_error(MEGAMOE_CODE_FAILED_PRECONDITION, "combine without a successful dispatch");
  e->dispatched = 0;
  MM_ARG_CHECK(e->T == 0 || (uintptr_t)out % 16 == 0, "output must be 16-byte aligned");
  mm_ep_dev *d = &e->dev;
  cudaStream_t st = (cudaStream_t)e->stream;
  const int ll = e->mode == MM_EP_MODE_LOW_LATENCY;
  MM_TRY(mark(e->events[2], st));
  /* the expert compute wrote its rows into d->csend's per-source segments */
  if (ll && e->ipc)
    LAUNCH_TRY(mm_ep_launch_ipc_exchange(d, mm_ep_ipc_device(e->ipc), MM_EP_IPC_COMBINE, st),
               "ep ipc combine");
  else if (d->crecv != d->csend) /* one rank: in place (mm_ep_dispatch) */
    MM_TRY(mm_ep_comm_alltoallv(e->a.comm, d->csend, e->cs_off, e->cs_bytes, d->crecv, e->cr_off,
                                e->cr_bytes, st));
  LAUNCH_TRY(mm_ep_launch_combine(d, e->T, e->ids, out, st), "ep combine");
  MM_TRY(mark(e->events[3], st));
  CUDA_TRY(cudaMemcpyAsync(e->err_h, d->err, MM_EP_ERR_WORDS * 4, cudaMemcpyDeviceToHost, st),
           "copying the error words");
  enum cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  CUDA_TRY(cudaStreamIsCapturing(st, &cap), "cudaStreamIsCapturing");
  if (cap == cudaStreamCaptureStatusNone)
    CUDA_TRY(cudaEventRecord(e->err_copied, st), "cudaEventRecord");
  if (ll) return NULL;
  MM_TRY(mm_ep_comm_sync(e->a.comm, st));
  mm_err *err = error_from_words(e, 0);
  if (err) {
    mm_err *e2 = reset_errors(e, st);
    if (e2) megamoe_error_destroy(e2);
  }
  return err;
}

mm_err *mm_ep_take_error(mm_ep_engine *e, void *stream, int wait) {
  if (wait) {
    /* The IPC exchanges time out on the device after comm.timeout-ms: wait
     * a little longer, so that their report (which names the peer) wins. */
    const int t = mm_ep_comm_timeout_ms(e->a.comm);
    const int slack = e->ipc ? (t / 10 > 1000 ? t / 10 : 1000) : 0;
    MM_TRY(mm_ep_comm_sync_for(e->a.comm, stream, t > INT32_MAX - slack ? INT32_MAX : t + slack));
  } else if (cudaEventQuery(e->err_copied) != cudaSuccess) {
    cudaGetLastError();
    return NULL; /* the last step's words are still on their way */
  }
  volatile int32_t *w = e->err_h;
  if (!w[0]) return NULL;
  mm_err *err = error_from_words(e, 1);
  mm_err *e2 = reset_errors(e, (cudaStream_t)stream);
  if (e2) megamoe_error_destroy(e2);
  return err;
}

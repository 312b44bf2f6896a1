/* ep_backend_util.h -- the whole cuda backend driven as op.c would drive it,
 * for the expert-parallel GPU tests: an op on one rank of an R-rank
 * communicator, device input/output buffers, one execute, the CPU
 * expectation, and bitwise/Frobenius comparisons. Header-only, included after
 * ep_test_util.h by one file per program. */
#ifndef MM_EP_BACKEND_UTIL_H
#define MM_EP_BACKEND_UTIL_H

#include <cuda_runtime.h>

#include "backend_cuda.h"
#include "ep_test_util.h"

/* Distinct communicator keys within one process. */
static int g_key_gen = 0;
/* comm.timeout-ms of the ops make_op builds. */
static int g_comm_timeout_ms = 60000;

static size_t count_diff(const uint16_t *a, const uint16_t *b, size_t n) {
  size_t d = 0;
  for (size_t i = 0; i < n; i++) d += a[i] != b[i];
  return d;
}

/* Whole-backend accuracy against the float64 reference, end to end. These
 * tests check the integration (dispatch, pool, combine: their bugs give O(1)
 * errors); the kernels' exactness is checked code by code in
 * gpu_test_moe_compute.c. End to end, one FP8 code of the intermediate
 * flipped at a rounding near-tie moves a small batch by ~1e-3 on its own, so
 * the bounds leave room for a few: the exact modes (gran 16 bf16-exact or
 * auto: mode 2; gran 32 bf16-exact: mode 4) 5e-3; gran 32 fp8 / auto runs
 * mode 1, FP8 QGMMA, whose ~14-bit accumulation between the FP32 promotions
 * flips more of them (measured up to 1.6e-2): 5e-2. */
static double backend_tolerance(int gran, mm_compute_mode cm) {
  /* the mode the backend picks for make_op's ops (default compute.max-rel-error) */
  mm_config d;
  mm_config_defaults(&d);
  const mm_weight_mode m = mm_cuda_weight_mode(gran, cm, d.compute_max_rel_error);
  return mm_sm90_f16_mma(m) ? 5e-3 : 5e-2;
}

static double rel_frob(const uint16_t *a, const uint16_t *ref, size_t n) {
  double e2 = 0, r2 = 0;
  for (size_t i = 0; i < n; i++) {
    double x = mm_bf16_to_float(a[i]), y = mm_bf16_to_float(ref[i]);
    if (isnan(x) != isnan(y)) return INFINITY;
    if (isnan(x)) continue;
    e2 += (x - y) * (x - y);
    r2 += y * y;
  }
  return r2 > 0 ? sqrt(e2 / r2) : sqrt(e2);
}

/* ---- whole backend ------------------------------------------------------------------ */

typedef struct {
  int H, I, E, K, gran;
  mm_compute_mode cm;
} layer_shape;

static mm_expert_q *copy_experts(const mm_expert_q *src, int n) {
  mm_expert_q *d = calloc((size_t)n, sizeof *d);
  for (int e = 0; e < n; e++) {
    const mm_qmat *s2[2] = {&src[e].w13, &src[e].w2};
    mm_qmat *d2[2] = {&d[e].w13, &d[e].w2};
    for (int m = 0; m < 2; m++) {
      const mm_qmat *a = s2[m];
      mm_qmat *b = d2[m];
      if (mm_qmat_alloc(b, a->rows, a->cols, a->gran, a->sf)) abort();
      memcpy(b->codes, a->codes, (size_t)a->rows * a->cols / 2);
      memcpy(b->scales, a->scales, (size_t)a->rows * (a->cols / a->gran));
      memcpy(b->row_scale, a->row_scale, sizeof(float) * (size_t)a->rows);
    }
  }
  return d;
}

/* An op on the cuda backend as op.c would build it; experts: all E global. */
static mm_err *make_op(const layer_shape *s, int R, int rank, mm_dispatch_mode dm, int ll_max,
                       int max_tokens, const mm_expert_q *experts, const char *key, mm_op **out) {
  *out = NULL;
  mm_op *op = calloc(1, sizeof *op);
  mm_config_defaults(&op->cfg);
  op->cfg.model.hidden_size = s->H;
  op->cfg.model.moe_intermediate_size = s->I;
  op->cfg.model.num_experts = s->E;
  op->cfg.model.top_k = s->K;
  op->cfg.model.routed_scaling_factor = 2.5;
  op->cfg.ep_size = R;
  op->cfg.dispatch_mode = dm;
  op->cfg.low_latency_max_tokens = ll_max;
  op->cfg.compute_mode = s->cm;
  op->cfg.comm_timeout_ms = g_comm_timeout_ms;
  op->backend = &mm_backend_cuda;
  op->device = rank;
  op->rank = rank;
  op->ep_size = R;
  op->num_local_experts = s->E / R;
  op->first_local_expert = rank * (s->E / R);
  snprintf(op->comm_key, sizeof op->comm_key, "%s", key);
  op->layers = calloc(1, sizeof *op->layers);
  op->num_layer_slots = 1;
  *out = op;
  MM_TRY(mm_backend_cuda.init(op));
  MM_TRY(mm_backend_cuda.prepare_layer(op, 0, copy_experts(experts + op->first_local_expert,
                                                           op->num_local_experts),
                                       op->num_local_experts, NULL));
  op->layers[0].ready = 1;
  op->resolved_gran_k = s->gran;
  uint64_t db = 0, hb = 0;
  MM_TRY(mm_backend_cuda.plan(op, max_tokens, NULL, &db, &hb));
  op->planned_tokens = max_tokens;
  op->state = MM_OP_PLANNED;
  return NULL;
}

static void free_op(mm_op *op) {
  if (!op) return;
  if (op->backend_state) {
    mm_backend_cuda.release_layer(op, 0);
    mm_backend_cuda.destroy(op);
  }
  free(op->layers);
  free(op);
}

typedef struct {
  int T, H, K;
  int max_any; /* the step's largest T of any rank (0: unknown; mm_exec_io) */
  uint16_t *d_x, *d_out;
  int32_t *d_ids;
  float *d_w;
} dev_io;

static int io_alloc(dev_io *io, int T, int H, int K) {
  memset(io, 0, sizeof *io);
  io->T = T, io->H = H, io->K = K;
  size_t t = (size_t)(T > 0 ? T : 1);
  return cudaMalloc((void **)&io->d_x, t * H * 2) || cudaMalloc((void **)&io->d_out, t * H * 2) ||
         cudaMalloc((void **)&io->d_ids, t * K * 4) || cudaMalloc((void **)&io->d_w, t * K * 4);
}

static void io_free(dev_io *io) {
  cudaFree(io->d_x);
  cudaFree(io->d_out);
  cudaFree(io->d_ids);
  cudaFree(io->d_w);
}

static int io_upload(dev_io *io, const uint16_t *x, const int32_t *ids, const float *w) {
  size_t T = (size_t)io->T;
  return cudaMemcpy(io->d_x, x, T * io->H * 2, cudaMemcpyHostToDevice) ||
         cudaMemcpy(io->d_ids, ids, T * io->K * 4, cudaMemcpyHostToDevice) ||
         cudaMemcpy(io->d_w, w, T * io->K * 4, cudaMemcpyHostToDevice) ||
         cudaMemset(io->d_out, 0xFF, T * io->H * 2) || cudaDeviceSynchronize();
}

static mm_err *op_run(mm_op *op, dev_io *io, void *stream) {
  mm_exec_io e = {.T = io->T, .max_tokens_any_rank = io->max_any, .hidden = io->d_x,
                  .topk_ids = io->d_ids, .topk_weights = io->d_w, .out = io->d_out,
                  .stream = stream, .on_device = 1};
  return mm_backend_cuda.execute(op, 0, &e);
}

/* The CPU expectation; clamp = model.activation-clamp (0: none). */
static void reference_clamped(const layer_shape *s, const mm_expert_q *ex, int T, const uint16_t *x,
                              const int32_t *ids, const float *w, float clamp, uint16_t *out) {
  int32_t *clean = malloc(sizeof(int32_t) * ((size_t)T * s->K + 1));
  for (int i = 0; i < T * s->K; i++) clean[i] = ids[i] >= 0 && ids[i] < s->E ? ids[i] : -1;
  mm_ref_layer_args a = {T, s->H, s->I, s->K, s->E, 0, s->E, ex, x, clean, w, 2.5f, clamp, 0,
                         out, NULL};
  CHECK_OK(mm_ref_moe_layer(&a));
  free(clean);
}

static void reference(const layer_shape *s, const mm_expert_q *ex, int T, const uint16_t *x,
                      const int32_t *ids, const float *w, uint16_t *out) {
  reference_clamped(s, ex, T, x, ids, w, 0.0f, out);
}

/* A global batch of G tokens with random routing (never skewed: skewed
 * batches can exceed a multi-rank plan's pool, which is refused by design). */
typedef struct {
  uint16_t *x;
  int32_t *ids;
  float *w;
} ept_batch;

static void ept_batch_make(ept_batch *b, const layer_shape *s, int G) {
  b->x = malloc((size_t)G * s->H * 2);
  b->ids = malloc((size_t)G * s->K * 4);
  b->w = malloc((size_t)G * s->K * 4);
  ept_fill_hidden(b->x, G, s->H);
  ept_fill_ids(b->ids, G, s->K, s->E, EPT_IDS_RANDOM, 0);
  ept_fill_weights(b->w, G, s->K);
}

static void ept_batch_free(ept_batch *b) {
  free(b->x), free(b->ids), free(b->w);
}

/* Prints a rank's error and destroys it; 1 if there was one. */
static int ept_report(int rank, mm_err *err) {
  if (!err) return 0;
  printf("# rank %d: %s\n", rank, err->message);
  megamoe_error_destroy(err);
  return 1;
}

#endif

/* backend_cuda.c -- the CUDA backend: one GPU per rank, experts prepared in
 * the sm90 layout (kernels/moe_compute.h), tokens moved by the expert-parallel
 * engine (ep_engine.c) over an NCCL communicator (ep_comm.c) -- a real one
 * even at ep-size 1, so the single-GPU path runs the same code. */
#include "backend_cuda.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "cuda_arch.h"
#include "dispatch_choice.h"
#include "ep_comm.h"
#include "ep_engine.h"
#include "megamoe_plugin.h"

typedef struct cuda_state {
  cudaStream_t stream; /* the op's own stream */
  mm_ep_comm *comm;
  mm_ep_engine *engine;
  /* phase marks of the last eager execute: dispatch, compute, combine */
  cudaEvent_t ev[4];
  int ev_recorded;
  /* the weight mode last logged (0 = none yet): the choice is logged once
   * per op, again only if a later layer gets another mode */
  int logged_wmode;
} cuda_state;

static cuda_state *state_of(mm_op *op) { return (cuda_state *)op->backend_state; }

int mm_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

mm_err *mm_cuda_device_usable(int device) {
  struct cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return mm_error(MEGAMOE_CODE_FAILED_PRECONDITION, "CUDA device %d cannot be queried", device);
  }
  if (mm_cuda_archs_run_on(MM_CUDA_ARCHS, prop.major, prop.minor)) return NULL;
  return mm_error(MEGAMOE_CODE_FAILED_PRECONDITION,
                  "CUDA device %d (%s, compute capability %d.%d) cannot run this plugin's "
                  "kernels, built for sm_%s (Hopper, 9.0: they use WGMMA and TMA)",
                  device, prop.name, prop.major, prop.minor, MM_CUDA_ARCHS);
}

static mm_err *cuda_err(cudaError_t ce, const char *what) {
  if (ce == cudaSuccess) return NULL;
  return mm_error(MEGAMOE_CODE_INTERNAL, "%s: %s", what, cudaGetErrorString(ce));
}

/* After a call: a failed communicator makes the op fatal. */
static mm_err *note_fatal(mm_op *op, mm_err *err) {
  cuda_state *s = state_of(op);
  const char *f = s && s->comm ? mm_ep_comm_failure(s->comm) : NULL;
  if (f && op->state != MM_OP_FATAL) {
    op->state = MM_OP_FATAL;
    snprintf(op->fatal_message, sizeof op->fatal_message, "%s", f);
  }
  return err;
}

/* This rank refuses a step before its first exchange. With peers, who run
 * the step, it cannot rejoin their exchanges in step (its next step's
 * would pair with their pending one), so the communicator is marked failed
 * (aborted when the op owns it) and the op turns fatal; the peers' step
 * times out. Alone (ep-size 1) nothing is pending: the op stays usable. */
static mm_err *refuse_step(mm_op *op, mm_err *err) {
  cuda_state *s = state_of(op);
  if (err && op->ep_size > 1 && s && s->comm && op->state != MM_OP_FATAL) {
    char why[320];
    snprintf(why, sizeof why, "rank %d refused a step its peers run (%s)", op->rank,
             megamoe_error_message(err));
    megamoe_error_destroy(mm_ep_comm_abort(s->comm, MEGAMOE_CODE_ABORTED, why));
    note_fatal(op, NULL);
  }
  return err;
}

static void cuda_refuse_step(mm_op *op, mm_err *err) { refuse_step(op, err); }

/* Errors of earlier low-latency steps still unreported when the engine goes
 * away (plan again, destroy): logged, since those calls have no step to blame. */
static void log_pending(mm_op *op, const char *when) {
  cuda_state *s = state_of(op);
  if (!s->engine || (s->comm && mm_ep_comm_failure(s->comm))) return;
  mm_err *e = mm_ep_take_error(s->engine, s->stream, 1);
  if (e) {
    mm_log(MEGAMOE_LOG_WARN, "%s: %s", when, megamoe_error_message(e));
    megamoe_error_destroy(e);
  }
}

static mm_err *cuda_init(mm_op *op) {
  const mm_config *c = &op->cfg;
  const int R = op->ep_size, E = c->model.num_experts;
  MM_ARG_CHECK(op->device >= 0, "the cuda backend needs a CUDA device (device is %d)", op->device);
  MM_ARG_CHECK(E % R == 0 && op->num_local_experts == E / R &&
                   op->first_local_expert == op->rank * (E / R),
               "rank %d of ep-size %d: local experts [%d, +%d) are not the contiguous block of "
               "num-experts %d / ep-size", op->rank, R, op->first_local_expert,
               op->num_local_experts, E);
  MM_ARG_CHECK(c->model.top_k >= 1 && c->model.top_k <= 32, "top-k %d: the cuda backend takes 1..32",
               c->model.top_k);
  int n = mm_cuda_device_count();
  MM_ARG_CHECK(op->device < n, "CUDA device %d does not exist (%d visible)", op->device, n);
  cuda_state *s = calloc(1, sizeof *s);
  if (!s) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of host memory");
  op->backend_state = s;
  MM_TRY(cuda_err(cudaSetDevice(op->device), "cudaSetDevice"));
  MM_TRY(cuda_err(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  for (int i = 0; i < 4; i++) MM_TRY(cuda_err(cudaEventCreate(&s->ev[i]), "cudaEventCreate"));
  const megamoe_host_services *hs = mm_host_services();
  mm_ep_comm_args ca = {op->rank, R, op->device, op->host_nccl_comm, op->comm_key,
                        c->comm_timeout_ms > 0 ? c->comm_timeout_ms : 300000,
                        hs ? hs->host_ctx : NULL, hs ? hs->kv_put : NULL, hs ? hs->kv_get : NULL};
  return mm_error_wrap(mm_ep_comm_create(&ca, &s->comm), "NCCL communicator");
}

static void cuda_release_layer(mm_op *op, int layer) {
  if (layer < 0 || layer >= op->num_layer_slots) return;
  mm_layer_slot *sl = &op->layers[layer];
  if (sl->backend_layer) {
    cudaSetDevice(op->device);
    mm_sm90_layer_destroy((mm_sm90_layer *)sl->backend_layer);
    sl->backend_layer = NULL;
  }
}

/* The layer's weight mode (mm_cuda_weight_mode); logs the choice and why
 * once per op, and warns when auto found no mode within the bound. */
static mm_weight_mode choose_mode(mm_op *op, int gran) {
  cuda_state *s = state_of(op);
  const mm_config *c = &op->cfg;
  const mm_mode_choice ch = mm_choose_weight_mode(gran, c->compute_mode, c->compute_max_rel_error);
  if (s->logged_wmode != (int)ch.mode) {
    s->logged_wmode = (int)ch.mode;
    char line[512];
    mm_mode_choice_describe(&ch, gran, c->compute_mode, c->compute_max_rel_error, line,
                            sizeof line);
    mm_log(ch.met_bound ? MEGAMOE_LOG_INFO : MEGAMOE_LOG_WARN, "%s", line);
  }
  return ch.mode;
}

/* prepare_layer and prepare_layer_requant (stats not NULL: group-16
 * experts, requantized to group 32 on the GPU while packed). */
static mm_err *prepare(mm_op *op, int layer, mm_expert_q *experts, int num_local,
                       mm_requant_stats *stats, void *stream) {
  cuda_state *s = state_of(op);
  mm_err *err = cuda_err(cudaSetDevice(op->device), "cudaSetDevice");
  mm_sm90_layer *L = NULL;
  if (!err) {
    int gran = stats ? 32 : experts && num_local > 0 ? experts[0].w13.gran : 0;
    const mm_weight_mode wm = choose_mode(op, gran);
    const mm_sm90_requant rq = {op->first_local_expert, op->cfg.requant_max_rel_error, stats};
    err = mm_sm90_layer_create_requant(experts, num_local, wm, stats ? &rq : NULL,
                                       stream ? stream : (void *)s->stream, &L);
    if (!err)
      mm_sm90_layer_set_prefill(L, op->cfg.compute_prefill_path != MM_PREFILL_OFF,
                                op->cfg.compute_prefill_experts);
  }
  /* The canonical copy is not needed once the device layout exists. */
  mm_experts_free(experts, num_local);
  if (err) return err;
  op->layers[layer].experts = NULL;
  op->layers[layer].backend_layer = L;
  return NULL;
}

static mm_err *cuda_prepare_layer(mm_op *op, int layer, mm_expert_q *experts, int num_local,
                                  void *stream) {
  return prepare(op, layer, experts, num_local, NULL, stream);
}

static mm_err *cuda_prepare_layer_requant(mm_op *op, int layer, mm_expert_q *experts,
                                          int num_local, mm_requant_stats *stats, void *stream) {
  return prepare(op, layer, experts, num_local, stats, stream);
}

/* The requant runs on the GPU wherever the layer is packed there, unless
 * MEGAMOE_SM90_REQUANT=host keeps it in the loader (docs/CONFIG.md). Same
 * bytes either way; the GPU's is 127 ms a GLM-5 EP8 layer against 732 on the
 * host's 16 cores (docs/PERF.md, "GPU requant"). */
static int cuda_requants_itself(mm_op *op) {
  const char *v = getenv("MEGAMOE_SM90_REQUANT");
  if (v && strcasecmp(v, "host") == 0) return 0;
  return mm_sm90_packs_on_gpu(choose_mode(op, 32));
}

static int ll_capacity(const mm_op *op, int max_tokens) {
  switch (op->cfg.dispatch_mode) {
    case MM_DISPATCH_NORMAL: return 0;
    case MM_DISPATCH_LOW_LATENCY: return max_tokens;
    default: {
      int ll = op->cfg.low_latency_max_tokens;
      return ll < 0 ? 0 : ll < max_tokens ? ll : max_tokens;
    }
  }
}

_Static_assert((int)MM_DISPATCH_RUN_NORMAL == (int)MM_EP_MODE_NORMAL &&
                   (int)MM_DISPATCH_RUN_LOW_LATENCY == (int)MM_EP_MODE_LOW_LATENCY,
               "dispatch_choice.h's values are mm_ep_mode's");

int mm_cuda_dispatch_mode(const mm_op *op, int deciding_tokens) {
  cuda_state *s = (cuda_state *)op->backend_state;
  const int ll = s && s->engine ? mm_ep_engine_ll_tokens(s->engine) : 0;
  return mm_dispatch_choose(op->cfg.dispatch_mode, ll, deciding_tokens);
}

const char *mm_cuda_transport(const mm_op *op) {
  cuda_state *s = (cuda_state *)op->backend_state;
  if (!s || !s->engine || !mm_ep_engine_ll_tokens(s->engine)) return "none";
  return mm_ep_transport_name(mm_ep_engine_transport(s->engine));
}

static mm_err *cuda_plan(mm_op *op, int max_tokens, void *stream, uint64_t *device_bytes,
                         uint64_t *host_bytes) {
  cuda_state *s = state_of(op);
  const mm_config *c = &op->cfg;
  MM_TRY(cuda_err(cudaSetDevice(op->device), "cudaSetDevice"));
  if (s->engine) log_pending(op, "plan");
  mm_ep_engine_destroy(s->engine); /* re-plan */
  s->engine = NULL;
  const int ll = ll_capacity(op, max_tokens);
  mm_ep_size_args sa = {op->ep_size, c->model.num_experts, c->model.top_k, c->model.hidden_size,
                        c->model.moe_intermediate_size, max_tokens, ll,
                        MM_EP_POOL_FACTOR_DEFAULT, -1};
  mm_ep_sizes sz;
  MM_TRY(mm_ep_size(&sa, &sz));
  /* The compute workspace of the prepared layers for this pool; layers
   * prepared later are checked at execute against what region x leaves. */
  int64_t ws = -1, region = 0;
  for (int l = 0; l < op->num_layer_slots; l++) {
    const mm_sm90_layer *L = op->layers[l].backend_layer;
    if (!L) continue;
    int64_t need = (int64_t)mm_sm90_workspace_bytes(L, (int)sz.pool_rows);
    int64_t least = (int64_t)mm_sm90_workspace_bytes_min(L, (int)sz.pool_rows);
    if (need > ws) ws = need;
    if (need - least > region) region = need - least;
  }
  if (region > 0) /* the largest single reservation a user can trade for speed */
    mm_log(MEGAMOE_LOG_INFO,
           "cuda plan: %.1f MiB of the compute workspace is the prefill path's weight region "
           "(compute.prefill-experts %d; compute.prefill-path: off reserves none)",
           region / 1048576.0, c->compute_prefill_experts);
  const megamoe_host_services *hs = mm_host_services();
  mm_ep_engine_args ea = {op->rank, op->ep_size, op->device, c->model.num_experts, c->model.top_k,
                          c->model.hidden_size, c->model.moe_intermediate_size, max_tokens, ll,
                          MM_EP_POOL_FACTOR_DEFAULT, ws, s->comm,
                          hs ? hs->host_ctx : NULL,
                          hs && hs->device_alloc && hs->device_free ? hs->device_alloc : NULL,
                          hs && hs->device_alloc && hs->device_free ? hs->device_free : NULL,
                          MM_EP_TRANSPORT_DEFAULT};
  MM_TRY(mm_ep_engine_create(&ea, &s->engine));
  (void)stream;
  *device_bytes = mm_ep_engine_device_bytes(s->engine);
  *host_bytes = mm_ep_engine_host_bytes(s->engine);
  mm_log(MEGAMOE_LOG_DEBUG,
         "cuda plan: %d tokens/rank, low-latency capacity %d, pool %lld rows, receive %lld rows, "
         "regions %.1f + %.1f MiB", max_tokens, ll, (long long)sz.pool_rows,
         (long long)sz.recv_rows, sz.region_x / 1048576.0, sz.region_y / 1048576.0);
  return NULL;
}

mm_err *mm_cuda_check(mm_op *op, void *stream, int wait) {
  cuda_state *s = state_of(op);
  if (!s || !s->comm) return NULL;
  if (cudaSetDevice(op->device) != cudaSuccess)
    return mm_error(MEGAMOE_CODE_INTERNAL, "cudaSetDevice(%d) failed", op->device);
  cudaStream_t st = stream ? (cudaStream_t)stream : s->stream;
  mm_err *err = mm_ep_comm_check(s->comm);
  if (!err && s->engine) err = mm_ep_take_error(s->engine, st, wait);
  return note_fatal(op, err);
}

static mm_err *cuda_execute(mm_op *op, int layer, const mm_exec_io *io) {
  cuda_state *s = state_of(op);
  /* Refusals come before the first exchange (refuse_step). The alignment
   * is checked here, not first where combine writes `out`, after the
   * dispatch's exchanges. */
  if (!io->on_device && io->T > 0)
    return refuse_step(op, mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                                    "the cuda backend takes device tensors"));
  if (io->T > 0 && ((uintptr_t)io->hidden % 16 || (uintptr_t)io->out % 16))
    return refuse_step(op, mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                                    "the cuda backend needs hidden and out 16-byte aligned"));
  if (!s->engine) return mm_error(MEGAMOE_CODE_FAILED_PRECONDITION, "execute before plan");
  const mm_sm90_layer *L = op->layers[layer].backend_layer;
  if (!L)
    return refuse_step(
        op, mm_error(MEGAMOE_CODE_FAILED_PRECONDITION, "layer %d is not prepared", layer));
  MM_TRY(refuse_step(op, cuda_err(cudaSetDevice(op->device), "cudaSetDevice")));
  cudaStream_t st = io->stream ? (cudaStream_t)io->stream : s->stream;
  const int mode =
      mm_cuda_dispatch_mode(op, mm_dispatch_deciding_tokens(io->T, io->max_tokens_any_rank));
  enum cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  MM_TRY(refuse_step(op, cuda_err(cudaStreamIsCapturing(st, &cap), "cudaStreamIsCapturing")));
  const int capturing = cap != cudaStreamCaptureStatusNone;
  /* not refuse_step: aborting a communicator inside a stream capture would
   * break the capture; a host captures on every rank alike, and with
   * max_tokens_any_rank every rank chooses the same mode, so all refuse */
  if (capturing && mode == MM_EP_MODE_NORMAL)
    return mm_error(MEGAMOE_CODE_FAILED_PRECONDITION,
                    "execute under CUDA graph capture needs the low-latency dispatch mode (T = %d; "
                    "set dispatch-mode: low-latency or T <= dispatch.low-latency-max-tokens)",
                    io->T);
  /* without the prefill path's region, which the compute does without when
   * the plan did not reserve it (planned before this layer was prepared) */
  const size_t ws_need =
      mm_sm90_workspace_bytes_min(L, (int)mm_ep_engine_sizes(s->engine)->pool_rows);
  mm_err *pending = capturing ? NULL : mm_cuda_check(op, st, 0);
  if (pending && op->state == MM_OP_FATAL) return pending;
  mm_ep_step step = {io->T, io->hidden, io->topk_ids, io->topk_weights,
                     (float)op->cfg.model.routed_scaling_factor, (mm_ep_mode)mode, st,
                     {NULL, NULL, NULL, NULL}};
  if (!capturing) /* graph nodes would outlive this call's meaning */
    for (int i = 0; i < 4; i++) step.events[i] = s->ev[i];
  s->ev_recorded = 0; /* until this step completes its enqueue */
  mm_expert_pool pool;
  void *ws = NULL;
  size_t ws_bytes = 0;
  mm_err *err = mm_ep_dispatch(s->engine, &step, &pool, &ws, &ws_bytes);
  if (err) {
    megamoe_error_destroy(pending);
    return note_fatal(op, err);
  }
  /* From here on every rank must reach the combine: a compute failure is
   * reported after it. */
  mm_err *cerr = NULL;
  if (ws_need > ws_bytes)
    cerr = mm_error(MEGAMOE_CODE_FAILED_PRECONDITION,
                    "layer %d needs %zu bytes of compute workspace, the plan left %zu (call plan "
                    "again after preparing the layers)", layer, ws_need, ws_bytes);
  else
    cerr = mm_sm90_expert_compute(L, &pool, (float)op->cfg.model.activation_clamp, ws, ws_bytes,
                                  st);
  err = mm_ep_combine(s->engine, io->out);
  if (err) {
    megamoe_error_destroy(cerr);
    megamoe_error_destroy(pending);
    return note_fatal(op, err);
  }
  if (cerr) {
    megamoe_error_destroy(pending);
    return cerr;
  }
  s->ev_recorded = !capturing;
  return pending;
}

static void cuda_destroy(mm_op *op) {
  cuda_state *s = state_of(op);
  if (!s) return;
  if (op->device >= 0) cudaSetDevice(op->device);
  if (s->stream && s->comm) {
    log_pending(op, "destroy");
    /* Bounded wait: a hung peer turns into an abort, not a hang here. */
    mm_err *e = mm_ep_comm_sync(s->comm, s->stream);
    if (e) {
      mm_log(MEGAMOE_LOG_WARN, "destroy: %s", megamoe_error_message(e));
      megamoe_error_destroy(e);
    }
  }
  mm_ep_engine_destroy(s->engine);
  mm_ep_comm_destroy(s->comm);
  for (int i = 0; i < 4; i++)
    if (s->ev[i]) cudaEventDestroy(s->ev[i]);
  if (s->stream) cudaStreamDestroy(s->stream);
  free(s);
  op->backend_state = NULL;
}

static void cuda_last_step(mm_op *op, mm_step_stats *out) {
  cuda_state *s = state_of(op);
  if (!s || !s->engine || !s->ev_recorded || cudaSetDevice(op->device) != cudaSuccess) return;
  if (cudaEventQuery(s->ev[3]) != cudaSuccess) { /* in flight (or never recorded) */
    cudaGetLastError();
    return;
  }
  float ms[3];
  for (int i = 0; i < 3; i++)
    if (cudaEventElapsedTime(&ms[i], s->ev[i], s->ev[i + 1]) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
  out->dispatch_us = ms[0] * 1e3;
  out->compute_us = ms[1] * 1e3;
  out->combine_us = ms[2] * 1e3;
  mm_ep_engine_step_bytes(s->engine, &out->dispatch_bytes, &out->combine_bytes);
}

/* The weight mode prepare chose for the op's gran-k (after requant), and
 * that mode's bound (plugin/mode_choice.c). */
static void cuda_numerics(const mm_op *op, const char **weight_mode, double *error_bound) {
  const mm_weight_mode m = mm_cuda_weight_mode(op->resolved_gran_k, op->cfg.compute_mode,
                                               op->cfg.compute_max_rel_error);
  *weight_mode = mm_weight_mode_name(m);
  *error_bound = mm_mode_error_bound(m);
}

const mm_backend_ops mm_backend_cuda = {
    "cuda", cuda_init, cuda_prepare_layer, cuda_plan, cuda_execute, cuda_destroy,
    cuda_release_layer, mm_cuda_check, cuda_last_step, cuda_refuse_step,
    cuda_requants_itself, cuda_prepare_layer_requant, cuda_numerics,
};

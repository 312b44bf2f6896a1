/* op.c -- the megamoe_fp4 op table: argument checks at the ABI boundary, the
 * lifecycle (create -> prepare -> plan -> execute -> destroy), the registry
 * of live handles (so stale or foreign handles are refused, not followed),
 * and dispatch to the chosen backend. */
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <uv.h>

#include "backend.h"
#include "dltensor.h"
#include "op_api.h"
#include "op_registry.h"
#include "weights_load.h"

#define MM_MAX_LAYERS 4096
#define MM_MAX_WEIGHT_TENSORS (1 << 20)

static void op_free(mm_op *op);

/* Frees op with its log-level in force (the backend may log a warning). */
static void op_free_scoped(mm_op *op) {
  const int prev = mm_log_scope_enter(op->cfg.log_level);
  op_free(op);
  mm_log_scope_leave(prev);
}

void mm_op_registry_shutdown(void) {
  for (mm_op *op; (op = mm_registry_pop_any());) {
    mm_log(MEGAMOE_LOG_WARN, "finalize: destroying an op the host did not destroy");
    op_free_scoped(op);
  }
  mm_registry_release();
}

/* ---- common checks -------------------------------------------------------- */
#define CHECK_ARGS(args, type_size, fn)                                                      \
  do {                                                                                       \
    if (!mm_plugin_initialized())                                                            \
      return mm_error(MEGAMOE_CODE_FAILED_PRECONDITION,                                      \
                      fn ": the plugin is not initialized (or was finalized)");              \
    if (!(args)) return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, fn ": args is NULL");        \
    if ((args)->struct_size < (type_size))                                                   \
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,                                         \
                      fn ": args->struct_size %zu is smaller than the ABI 1.0 size %zu",     \
                      (args)->struct_size, (size_t)(type_size));                             \
  } while (0)

/* The live op of a handle, refusing NULL, stale and fatal ones. */
static mm_err *check_op(const megamoe_op *handle, const char *fn, mm_op **out) {
  *out = NULL;
  if (!handle) return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: op is NULL", fn);
  mm_op *op = mm_registry_get(handle);
  if (!op)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s: op handle is not a live op (destroyed, or not made by this plugin)", fn);
  if (op->state == MM_OP_FATAL)
    return mm_error(MEGAMOE_CODE_ABORTED, "%s: op is in a fatal state after an earlier error (%s); "
                    "destroy and re-create it", fn, op->fatal_message);
  *out = op;
  return NULL;
}

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- get_attributes ------------------------------------------------------- */
static megamoe_error *op_get_attributes(megamoe_op_attributes_args *args) {
  CHECK_ARGS(args, MEGAMOE_OP_ATTRIBUTES_ARGS_STRUCT_SIZE, "get_attributes");
  args->capabilities = MEGAMOE_CAP_DETERMINISTIC | MEGAMOE_CAP_BACKEND_CPU;
  args->gran_k_mask = MEGAMOE_GRAN_K_16 | MEGAMOE_GRAN_K_32;
  args->compute_modes = 0x3u;
  args->num_sm_versions = 0;
  args->num_cuda_devices = 0;
#ifdef MM_HAVE_CUDA
  args->num_cuda_devices = mm_cuda_device_count();
  args->num_sm_versions = 1;
  args->sm_versions[0] = 90;
  if (args->num_cuda_devices > 0)
    args->capabilities |= MEGAMOE_CAP_BACKEND_CUDA | MEGAMOE_CAP_GRAPH_CAPTURABLE;
#endif
#ifdef MM_HAVE_NCCL
  args->capabilities |= MEGAMOE_CAP_NCCL;
#endif
  args->build_info = "megamoe 0.1.0"
#ifdef MM_HAVE_CUDA
                     " cuda sm_" MM_CUDA_ARCHS
#else
                     " cpu-only"
#endif
#ifdef MM_HAVE_NCCL
                     " nccl"
#endif
      ;
  return NULL;
}

/* ---- create --------------------------------------------------------------- */
static const mm_backend_ops *choose_backend(const mm_config *cfg, int device, mm_err **err) {
  int gpus = 0;
#ifdef MM_HAVE_CUDA
  gpus = mm_cuda_device_count();
#endif
  switch (cfg->backend) {
    case MM_BACKEND_CPU_REFERENCE:
      return &mm_backend_cpu;
    case MM_BACKEND_CUDA:
#ifdef MM_HAVE_CUDA
      if (gpus > 0 && device >= 0 && device < gpus) {
        *err = mm_cuda_device_usable(device);
        if (!*err) return &mm_backend_cuda;
        *err = mm_error_wrap(*err, "backend 'cuda' requested (backend: cpu-reference runs anywhere)");
        return NULL;
      }
      *err = mm_error(MEGAMOE_CODE_FAILED_PRECONDITION,
                      "backend 'cuda' requested, but device %d is not one of the %d visible GPUs",
                      device, gpus);
#else
      *err = mm_error(MEGAMOE_CODE_UNIMPLEMENTED,
                      "backend 'cuda' requested, but this plugin was built without CUDA");
#endif
      return NULL;
    default:
#ifdef MM_HAVE_CUDA
      if (gpus > 0 && device >= 0 && device < gpus) {
        mm_err *why = mm_cuda_device_usable(device);
        if (!why) return &mm_backend_cuda;
        mm_log(MEGAMOE_LOG_WARN, "backend auto: %s; using cpu-reference", megamoe_error_message(why));
        megamoe_error_destroy(why);
      }
#endif
      (void)gpus;
      return &mm_backend_cpu;
  }
}

/* Checks the create args and loads the config (shared by create and
 * validate_config). */
static mm_err *load_create_config(const megamoe_op_create_args *args, mm_config *cfg) {
  if ((args->config_path == NULL) == (args->config_text == NULL))
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "create: give exactly one of config_path and config_text");
  if (args->num_overrides > 0 && !args->overrides)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "create: overrides is NULL");
  if (args->num_overrides > 1024)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "create: more than 1024 overrides");
  for (size_t i = 0; i < args->num_overrides; i++)
    if (!args->overrides[i].key || !args->overrides[i].value)
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "create: override %zu has a NULL key or value", i);
  if (args->comm_key && strlen(args->comm_key) >= sizeof(((mm_op *)0)->comm_key))
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "create: comm_key is longer than %zu bytes",
                    sizeof(((mm_op *)0)->comm_key) - 1);

  MM_TRY(mm_config_load(args->config_path, args->config_text, args->config_text_len,
                        args->config_name, (const mm_config_override *)args->overrides,
                        args->num_overrides, cfg));
  if (args->rank < 0 || args->rank >= cfg->ep_size)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "create: rank %d is outside [0, ep-size %d)",
                    args->rank, cfg->ep_size);
  return NULL;
}

static megamoe_error *op_validate_config(megamoe_op_create_args *args) {
  CHECK_ARGS(args, MEGAMOE_OP_CREATE_ARGS_STRUCT_SIZE, "validate_config");
  args->op = NULL;
  mm_config cfg;
  return load_create_config(args, &cfg);
}

static megamoe_error *op_create(megamoe_op_create_args *args) {
  CHECK_ARGS(args, MEGAMOE_OP_CREATE_ARGS_STRUCT_SIZE, "create");
  args->op = NULL;
  mm_op *op = calloc(1, sizeof *op);
  if (!op) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "create: out of host memory");
  mm_err *err = load_create_config(args, &op->cfg);
  if (err) {
    free(op);
    return err;
  }
  const int log_prev = mm_log_scope_enter(op->cfg.log_level);
  op->device = args->device;
  op->rank = args->rank;
  op->ep_size = op->cfg.ep_size;
  op->num_local_experts = op->cfg.model.num_experts / op->ep_size;
  op->first_local_expert = op->rank * op->num_local_experts;
  op->host_nccl_comm = args->nccl_comm;
  snprintf(op->comm_key, sizeof op->comm_key, "%s", args->comm_key ? args->comm_key : "megamoe");
  op->backend = choose_backend(&op->cfg, op->device, &err);
  if (!op->backend) goto fail;
  if (op->backend == &mm_backend_cpu && op->ep_size != 1) {
    err = mm_error(MEGAMOE_CODE_FAILED_PRECONDITION,
                   "create: the cpu-reference backend runs one rank that owns every expert; "
                   "ep-size is %d (set ep-size: 1, or use the cuda backend)",
                   op->ep_size);
    goto fail;
  }
  if ((err = op->backend->init(op))) {
    op->backend->destroy(op);
    goto fail;
  }
  megamoe_op *handle = mm_registry_add(op);
  if (!handle) {
    op->backend->destroy(op);
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "create: out of host memory");
    goto fail;
  }
  mm_log(MEGAMOE_LOG_INFO,
         "megamoe_fp4: backend %s, rank %d/%d, experts [%d, %d), hidden %d, intermediate %d, "
         "top-%d",
         op->backend->name, op->rank, op->ep_size, op->first_local_expert,
         op->first_local_expert + op->num_local_experts, op->cfg.model.hidden_size,
         op->cfg.model.moe_intermediate_size, op->cfg.model.top_k);
  args->op = handle;
  mm_log_scope_leave(log_prev);
  return NULL;
fail:
  free(op);
  mm_log_scope_leave(log_prev);
  return mm_error_wrap(err, "create");
}

/* ---- prepare_weights ------------------------------------------------------ */
static void release_layer(mm_op *op, int layer) {
  if (layer < 0 || layer >= op->num_layer_slots) return;
  mm_layer_slot *s = &op->layers[layer];
  if (s->ready && op->backend->release_layer) op->backend->release_layer(op, layer);
  mm_experts_free(s->experts, op->num_local_experts);
  memset(s, 0, sizeof *s);
}

static megamoe_error *op_prepare_weights_body(megamoe_op_prepare_args *args) {
  CHECK_ARGS(args, MEGAMOE_OP_PREPARE_ARGS_STRUCT_SIZE, "prepare_weights");
  mm_op *op;
  MM_TRY(check_op(args->op, "prepare_weights", &op));
  double t0 = now_seconds();
  if (args->layer < 0 || args->layer >= MM_MAX_LAYERS)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "prepare_weights: layer %d is outside [0, %d)",
                    args->layer, MM_MAX_LAYERS);
  if (args->num_tensors > 0 && !args->tensors)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "prepare_weights: tensors is NULL");
  if (args->num_tensors > MM_MAX_WEIGHT_TENSORS)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "prepare_weights: %zu tensors is too many",
                    args->num_tensors);
  mm_err *err = NULL;
  mm_requant_report report;
  memset(&report, 0, sizeof report);
  mm_requant_stats *requant_stats = NULL; /* the backend's requant, when it runs one */
  mm_tensor_view *views = calloc(args->num_tensors + 1, sizeof *views);
  void **host_copies = calloc(args->num_tensors + 1, sizeof *host_copies);
  mm_expert_q *experts = calloc((size_t)op->num_local_experts, sizeof *experts);
  if (!views || !host_copies || !experts) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of host memory");
    goto done;
  }
  for (size_t i = 0; i < args->num_tensors; i++) {
    const megamoe_named_tensor *nt = &args->tensors[i];
    if (!nt->name) {
      err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "tensor %zu has no name", i);
      goto done;
    }
    int dev;
    if ((err = mm_dltensor_view(nt->name, nt->tensor, &views[i], &dev))) goto done;
    if (dev >= 0 && dev != op->device) {
      err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: on CUDA device %d, the op runs on %d",
                     nt->name, dev, op->device);
      goto done;
    }
    if (views[i].on_device) {
      /* The canonical loader works on host memory: stage device tensors. */
#ifdef MM_HAVE_CUDA
      size_t nb = mm_tensor_nbytes(&views[i]);
      host_copies[i] = malloc(nb + 1);
      if (!host_copies[i]) {
        err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of host memory", nt->name);
        goto done;
      }
      if ((err = mm_cuda_copy_to_host(host_copies[i], views[i].data, nb, op->device))) goto done;
      views[i].data = host_copies[i];
      views[i].on_device = 0;
#else
      err = mm_error(MEGAMOE_CODE_UNIMPLEMENTED, "%s: device tensors need the CUDA build", nt->name);
      goto done;
#endif
    }
  }
  /* A backend that requantizes on the GPU gets the layer unrequantized. */
  const int backend_requant = op->backend->requants_itself &&
                              op->backend->prepare_layer_requant &&
                              op->backend->requants_itself(op);
  if ((err = mm_weights_load_layer_ex(&op->cfg, views, args->num_tensors, op->first_local_expert,
                                      op->num_local_experts,
                                      backend_requant ? MM_LOAD_DEFER_REQUANT : 0, experts,
                                      &report)))
    goto done;
  double t_loaded = now_seconds();
  int gran = report.gran;
  if (op->resolved_gran_k && gran != op->resolved_gran_k) {
    mm_experts_free(experts, op->num_local_experts);
    experts = NULL;
    err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                   "layer %d has gran-k %d after preparation, earlier layers have %d", args->layer,
                   gran, op->resolved_gran_k);
    goto done;
  }
  if (args->layer >= op->num_layer_slots) {
    int n = args->layer + 1;
    mm_layer_slot *grown = realloc(op->layers, (size_t)n * sizeof *grown);
    if (!grown) {
      err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of host memory");
      goto done;
    }
    memset(grown + op->num_layer_slots, 0, (size_t)(n - op->num_layer_slots) * sizeof *grown);
    op->layers = grown;
    op->num_layer_slots = n;
  }
  if (report.requant_pending &&
      !(requant_stats = calloc((size_t)report.num_tensors, sizeof *requant_stats))) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of host memory");
    goto done;
  }
  release_layer(op, args->layer);
  err = requant_stats ? op->backend->prepare_layer_requant(op, args->layer, experts,
                                                           op->num_local_experts, requant_stats,
                                                           args->stream)
                      : op->backend->prepare_layer(op, args->layer, experts,
                                                   op->num_local_experts, args->stream);
  if (err) {
    release_layer(op, args->layer); /* nothing half-loaded stays */
    experts = NULL;                 /* the backend freed what it took */
    goto done;
  }
  op->layers[args->layer].ready = 1;
  if (requant_stats && (err = mm_requant_report_finish(&report, &op->cfg, requant_stats,
                                                       op->backend != &mm_backend_cpu))) {
    release_layer(op, args->layer); /* the backend's layer too: it is ready */
    experts = NULL;
    goto done;
  }
  experts = NULL; /* owned by the layer slot / backend now */
  op->resolved_gran_k = gran;
  double worst_rel = 0, worst_abs = 0;
  for (int i = 0; i < report.num_tensors; i++) {
    if (report.tensors[i].rel_rms > worst_rel) worst_rel = report.tensors[i].rel_rms;
    if (report.tensors[i].max_abs > worst_abs) worst_abs = report.tensors[i].max_abs;
  }
  args->requant_rel_rms_max = worst_rel;
  args->requant_abs_max = worst_abs;
  args->seconds = now_seconds() - t0;
  mm_log(MEGAMOE_LOG_INFO, "layer %d: %s (%.2f s: %.2f loading, %.2f %s)", args->layer,
         report.summary, args->seconds, t_loaded - t0, args->seconds - (t_loaded - t0),
         requant_stats ? "requant and layout" : "layout");
done:
  free(requant_stats);
  mm_requant_report_free(&report);
  if (views)
    for (size_t i = 0; i < args->num_tensors; i++) free(host_copies[i]);
  free(views);
  free(host_copies);
  mm_experts_free(experts, op->num_local_experts);
  return mm_error_wrap(err, "prepare_weights(layer %d)", args->layer);
}

/* ---- plan ------------------------------------------------------------------ */
static megamoe_error *op_plan_body(megamoe_op_plan_args *args) {
  CHECK_ARGS(args, MEGAMOE_OP_PLAN_ARGS_STRUCT_SIZE, "plan");
  mm_op *op;
  MM_TRY(check_op(args->op, "plan", &op));
  int tokens = args->max_tokens_per_rank ? args->max_tokens_per_rank : op->cfg.num_max_tokens_per_rank;
  if (tokens < 1 || tokens > (1 << 20))
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "plan: max_tokens_per_rank %d is outside [1, %d]",
                    tokens, 1 << 20);
  uint64_t dev = 0, host = 0;
  mm_err *err = op->backend->plan(op, tokens, args->stream, &dev, &host);
  if (err) {
    op->state = MM_OP_CREATED;
    op->planned_tokens = 0;
    return mm_error_wrap(err, "plan(%d tokens per rank)", tokens);
  }
  op->planned_tokens = tokens;
  op->state = MM_OP_PLANNED;
  args->device_bytes = dev;
  args->host_bytes = host;
  mm_log(MEGAMOE_LOG_INFO, "plan: %d tokens per rank, %.1f MiB device, %.1f MiB host", tokens,
         (double)dev / 1048576.0, (double)host / 1048576.0);
  return NULL;
}

/* ---- execute --------------------------------------------------------------- */
/* Byte ranges of two compact views intersect (integer arithmetic: unrelated
 * buffers must not be compared as pointers). */
static int views_overlap(const mm_tensor_view *a, const mm_tensor_view *b) {
  uintptr_t x = (uintptr_t)a->data, y = (uintptr_t)b->data;
  size_t an = mm_tensor_nbytes(a), bn = mm_tensor_nbytes(b);
  return an && bn && x < y + bn && y < x + an;
}

/* The checks of an execute on a live op, and what the backend gets. */
static mm_err *execute_io(const megamoe_op_execute_args *args, mm_op *op, mm_exec_io *out_io) {
  if (op->state != MM_OP_PLANNED)
    return mm_error(MEGAMOE_CODE_FAILED_PRECONDITION, "execute: call plan first");
  if (args->layer < 0 || args->layer >= op->num_layer_slots || !op->layers[args->layer].ready)
    return mm_error(MEGAMOE_CODE_FAILED_PRECONDITION,
                    "execute: layer %d has no prepared weights", args->layer);
  mm_tensor_view hv, iv, wv, ov;
  int dh, di, dw, dout;
  MM_TRY(mm_error_wrap(mm_dltensor_view("hidden", args->hidden, &hv, &dh), "execute"));
  MM_TRY(mm_error_wrap(mm_dltensor_view("topk_ids", args->topk_ids, &iv, &di), "execute"));
  MM_TRY(mm_error_wrap(mm_dltensor_view("topk_weights", args->topk_weights, &wv, &dw), "execute"));
  MM_TRY(mm_error_wrap(mm_dltensor_view("out", args->out, &ov, &dout), "execute"));
  const int64_t T = hv.ndim == 2 ? hv.shape[0] : -1, H = op->cfg.model.hidden_size,
                K = op->cfg.model.top_k;
  const int64_t sh[2] = {T, H}, sk[2] = {T, K};
  MM_TRY(mm_error_wrap(mm_expect_tensor("hidden", &hv, MM_DT_BF16, 2, (int64_t[]){-1, H}), "execute"));
  MM_TRY(mm_error_wrap(mm_expect_tensor("topk_ids", &iv, MM_DT_I32, 2, sk), "execute"));
  MM_TRY(mm_error_wrap(mm_expect_tensor("topk_weights", &wv, MM_DT_F32, 2, sk), "execute"));
  MM_TRY(mm_error_wrap(mm_expect_tensor("out", &ov, MM_DT_BF16, 2, sh), "execute"));
  if (T > op->planned_tokens)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "execute: %lld tokens exceed the planned %d tokens per rank (num-max-tokens-per-rank)",
                    (long long)T, op->planned_tokens);
  /* 1.2: the step's largest T of any rank (0: unknown) */
  const int max_any = args->struct_size >= MEGAMOE_OP_EXECUTE_ARGS_STRUCT_SIZE
                          ? args->max_tokens_any_rank
                          : 0;
  if (max_any != 0 && (max_any < T || max_any > op->planned_tokens))
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "execute: max_tokens_any_rank %d must be 0 (unknown) or in [T, planned] = "
                    "[%lld, %d]",
                    max_any, (long long)T, op->planned_tokens);
  const int want_dev = op->backend == &mm_backend_cpu ? -1 : op->device;
  if (dh != want_dev || di != want_dev || dw != want_dev || dout != want_dev)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "execute: tensors must be on %s%d (hidden %d, topk_ids %d, topk_weights %d, "
                    "out %d; -1 = host)",
                    want_dev < 0 ? "the host " : "CUDA device ", want_dev, dh, di, dw, dout);
  /* out is written while the inputs are read: no byte may be shared. */
  const mm_tensor_view *ins[3] = {&hv, &iv, &wv};
  for (int i = 0; T > 0 && i < 3; i++)
    if (views_overlap(&ov, ins[i]))
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "execute: out overlaps %s", ins[i]->name);
  *out_io = (mm_exec_io){.T = (int)T, .max_tokens_any_rank = max_any, .hidden = hv.data,
                         .topk_ids = iv.data, .topk_weights = wv.data,
                         .out = (uint16_t *)ov.data, .stream = args->stream,
                         .on_device = want_dev >= 0};
  return NULL;
}

static megamoe_error *op_execute_body(megamoe_op_execute_args *args) {
  CHECK_ARGS(args, MEGAMOE_OP_EXECUTE_ARGS_STRUCT_SIZE_1_0, "execute");
  mm_op *op;
  MM_TRY(check_op(args->op, "execute", &op));
  mm_exec_io io;
  mm_err *err = execute_io(args, op, &io);
  if (err) {
    /* a step this rank refuses while its peers run it (abi: "With ep-size > 1") */
    if (op->ep_size > 1 && op->backend->refuse_step) op->backend->refuse_step(op, err);
    return err;
  }
  err = op->backend->execute(op, args->layer, &io);
  return mm_error_wrap(err, "execute(layer %d)", args->layer);
}

/* ---- destroy / info -------------------------------------------------------- */
static void op_free(mm_op *op) {
  for (int l = 0; l < op->num_layer_slots; l++) release_layer(op, l);
  op->backend->destroy(op);
  free(op->layers);
  free(op);
}

static megamoe_error *op_destroy(megamoe_op_destroy_args *args) {
  CHECK_ARGS(args, MEGAMOE_OP_DESTROY_ARGS_STRUCT_SIZE, "destroy");
  if (!args->op) return NULL;
  mm_op *op = mm_registry_remove(args->op);
  if (!op)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "destroy: op handle is not a live op (already destroyed?)");
  op_free_scoped(op);
  return NULL;
}

static megamoe_error *op_get_info(megamoe_op_info_args *args) {
  CHECK_ARGS(args, MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE_1_0, "get_info");
  mm_op *op = mm_registry_get(args->op);
  if (!op)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "get_info: op handle is not a live op");
  args->backend = op->backend->name;
  args->ep_size = op->ep_size;
  args->rank = op->rank;
  args->num_local_experts = op->num_local_experts;
  args->first_local_expert = op->first_local_expert;
  args->hidden_size = op->cfg.model.hidden_size;
  args->top_k = op->cfg.model.top_k;
  args->gran_k = op->resolved_gran_k;
  int ready = 0;
  for (int l = 0; l < op->num_layer_slots; l++) ready += op->layers[l].ready;
  args->num_layers_ready = ready;
  args->planned_tokens = op->planned_tokens;
  if (args->struct_size >= MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE_1_1) {
    mm_step_stats st = {-1, -1, -1, -1, -1};
    if (op->backend->last_step && op->state == MM_OP_PLANNED) op->backend->last_step(op, &st);
    args->last_dispatch_us = st.dispatch_us;
    args->last_compute_us = st.compute_us;
    args->last_combine_us = st.combine_us;
    args->last_dispatch_bytes = st.dispatch_bytes;
    args->last_combine_bytes = st.combine_bytes;
  }
  if (args->struct_size >= MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE) { /* 1.3 */
    args->weight_mode = NULL;
    args->error_bound = -1;
    if (op->resolved_gran_k && op->backend->numerics)
      op->backend->numerics(op, &args->weight_mode, &args->error_bound);
  }
  return NULL;
}

static megamoe_error *op_check_body(megamoe_op_check_args *args) {
  CHECK_ARGS(args, MEGAMOE_OP_CHECK_ARGS_STRUCT_SIZE, "check");
  mm_op *op;
  MM_TRY(check_op(args->op, "check", &op));
  if (!op->backend->check || op->state != MM_OP_PLANNED) return NULL;
  return mm_error_wrap(op->backend->check(op, args->stream, args->wait), "check");
}

/* ---- log scope ------------------------------------------------------------- */
/* A call on an op logs at that op's log-level, in the layers below it too
 * (the backend, the expert-parallel transport): the ABI functions that take
 * an op run their bodies inside its scope. args is checked first, as the
 * bodies do, before its op field is read. */
#define WITH_OP_LOG_SCOPE(name, Args, min_size)                                \
  static megamoe_error *name(Args *args) {                                     \
    if (!mm_plugin_initialized() || !args || args->struct_size < (min_size))   \
      return name##_body(args); /* which says why */                           \
    const mm_op *op = mm_registry_get(args->op);                               \
    const int prev = mm_log_scope_enter(op ? op->cfg.log_level : -1);          \
    megamoe_error *e = name##_body(args);                                      \
    mm_log_scope_leave(prev);                                                  \
    return e;                                                                  \
  }
WITH_OP_LOG_SCOPE(op_prepare_weights, megamoe_op_prepare_args, MEGAMOE_OP_PREPARE_ARGS_STRUCT_SIZE)
WITH_OP_LOG_SCOPE(op_plan, megamoe_op_plan_args, MEGAMOE_OP_PLAN_ARGS_STRUCT_SIZE)
WITH_OP_LOG_SCOPE(op_execute, megamoe_op_execute_args, MEGAMOE_OP_EXECUTE_ARGS_STRUCT_SIZE_1_0)
WITH_OP_LOG_SCOPE(op_check, megamoe_op_check_args, MEGAMOE_OP_CHECK_ARGS_STRUCT_SIZE)

static const megamoe_op_api g_api = {
    MEGAMOE_OP_API_STRUCT_SIZE, NULL, MEGAMOE_ABI_MAJOR, MEGAMOE_ABI_MINOR, op_get_attributes,
    op_create, op_prepare_weights, op_plan, op_execute, op_destroy, op_get_info,
    op_validate_config, op_check};

const megamoe_op_api *mm_op_api(void) { return &g_api; }

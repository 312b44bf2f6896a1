/* backend.h -- what an execution backend (cpu-reference, cuda) provides to
 * the op. The op (op.c) validates every argument and the lifecycle before
 * calling in; backends trust their inputs' shapes and dtypes. */
#ifndef MM_BACKEND_H
#define MM_BACKEND_H

#include <stdint.h>

#include "config.h"
#include "qmat.h"
#include "requant.h"
#include "status.h"

typedef struct mm_op mm_op;

/* Execute inputs, already checked: shapes [T, H], [T, k], [T, k], [T, H]. */
typedef struct mm_exec_io {
  int T;
  int max_tokens_any_rank;     /* the step's largest T of any rank; 0: unknown */
  const uint16_t *hidden;      /* bf16 */
  const int32_t *topk_ids;
  const float *topk_weights;
  uint16_t *out;               /* bf16 */
  void *stream;                /* cudaStream_t or NULL */
  int on_device;               /* tensors are device pointers */
} mm_exec_io;

/* Device-timed phases of one execute; -1 = unknown. */
typedef struct mm_step_stats {
  double dispatch_us, compute_us, combine_us;
  int64_t dispatch_bytes, combine_bytes;
} mm_step_stats;

typedef struct mm_backend_ops {
  const char *name; /* "cpu-reference", "cuda" */
  /* Creates backend state (device context, communicator, streams). */
  mm_err *(*init)(mm_op *op);
  /* Takes ownership of `experts` (a malloc'd array of num_local canonical
   * experts) in every case and converts them to the backend's layout. On
   * success it either keeps the array in op->layers[layer].experts (the op
   * frees it with mm_experts_free) or frees it itself; on error it has freed
   * it and keeps no part of the layer. */
  mm_err *(*prepare_layer)(mm_op *op, int layer, mm_expert_q *experts, int num_local,
                           void *stream);
  /* Allocates all run-time buffers for max_tokens per rank; reports bytes. */
  mm_err *(*plan)(mm_op *op, int max_tokens, void *stream, uint64_t *device_bytes,
                  uint64_t *host_bytes);
  mm_err *(*execute)(mm_op *op, int layer, const mm_exec_io *io);
  /* Frees everything; called once, also after a failed init. */
  void (*destroy)(mm_op *op);
  /* Optional: frees the backend's form of one layer (before re-prepare and
   * at destroy); NULL if layers hold nothing backend-owned. */
  void (*release_layer)(mm_op *op, int layer);
  /* Optional: reports errors that asynchronous work recorded on the device
   * (bad expert ids, capacity overflow, communicator failure); wait = 1
   * first waits for the op's work on `stream`. NULL: nothing to report. */
  mm_err *(*check)(mm_op *op, void *stream, int wait);
  /* Optional: the phases of the last eager execute (see
   * megamoe_op_info_args); fields it cannot tell stay -1. Never waits. */
  void (*last_step)(mm_op *op, mm_step_stats *out);
  /* Optional: the op refused an execute (`why`) before the backend saw it;
   * with peers the backend takes the op out of the group (fatal). */
  void (*refuse_step)(mm_op *op, mm_err *why);
  /* Optional, both or neither: the backend runs requant.policy's group16 ->
   * group32 requant itself (cuda: on the GPU, while it packs the layer;
   * cpu-reference: after the load, with MEGAMOE_CPU_REQUANT=backend, so
   * that tests run this path without a GPU).
   * requants_itself says whether it will for this op's next layer; if so
   * the op loads the layer unrequantized (MM_LOAD_DEFER_REQUANT) and calls
   * prepare_layer_requant instead of prepare_layer: the same contract, for
   * group-16 experts, plus the requant, each tensor's statistics written
   * to stats[3 * num_local] (gate, up, down of each expert) and a tensor
   * above requant.max-rel-error refused with the loader's message. */
  int (*requants_itself)(mm_op *op);
  mm_err *(*prepare_layer_requant)(mm_op *op, int layer, mm_expert_q *experts, int num_local,
                                   mm_requant_stats *stats, void *stream);
  /* The prepared layers' numerics (get_info, ABI 1.3), called once a layer
   * is prepared (op->resolved_gran_k set): the weight mode's name (static
   * storage) and its bound on the output's relative error against the
   * cpu-reference backend. */
  void (*numerics)(const mm_op *op, const char **weight_mode, double *error_bound);
} mm_backend_ops;


extern const mm_backend_ops mm_backend_cpu;
#ifdef MM_HAVE_CUDA
extern const mm_backend_ops mm_backend_cuda;
/* Number of usable CUDA devices (0 when the driver or a GPU is missing). */
int mm_cuda_device_count(void);
/* NULL when the kernels built in (MM_CUDA_ARCHS) run on `device`, else
 * why not (FAILED_PRECONDITION, naming the device and its capability). */
mm_err *mm_cuda_device_usable(int device);
/* Synchronous device -> host copy on `device` (cuda_host.c). */
mm_err *mm_cuda_copy_to_host(void *dst, const void *src, size_t bytes, int device);
#endif

/* The op's state, shared with backends. */
typedef enum { MM_OP_CREATED = 0, MM_OP_PLANNED = 1, MM_OP_FATAL = 2 } mm_op_state;

typedef struct mm_layer_slot {
  int ready;
  mm_expert_q *experts; /* canonical host copy (cpu backend keeps it) */
  void *backend_layer;  /* backend-owned prepared form */
} mm_layer_slot;

struct mm_op {
  mm_config cfg;
  const mm_backend_ops *backend;
  mm_op_state state;
  int device;            /* CUDA ordinal or -1 */
  int rank, ep_size;
  int num_local_experts, first_local_expert;
  int resolved_gran_k;   /* 16 / 32 after the first prepare, else 0 */
  void *host_nccl_comm;  /* borrowed from create args, may be NULL */
  char comm_key[128];
  int planned_tokens;
  mm_layer_slot *layers;
  int num_layer_slots;
  void *backend_state;   /* owned by the backend */
  char fatal_message[512];
};

/* Logging through the host's services (entry.c). A message is dropped when
 * its level is above MEGAMOE_LOG_LEVEL if set, else above the log-level of
 * the op whose call runs on this thread (the scope below), else above info. */
void mm_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* For the duration of an op's ABI call: returns the previous scope, which
 * mm_log_scope_leave restores. */
int mm_log_scope_enter(int op_log_level);
void mm_log_scope_leave(int prev);
/* The host's services table (copied at init); fields may be NULL. */
struct megamoe_host_services;
const struct megamoe_host_services *mm_host_services(void);

#endif

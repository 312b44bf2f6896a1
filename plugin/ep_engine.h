/* ep_engine.h -- the expert-parallel data path of one rank: plan-time
 * buffers, dispatch (route + FP8 pack + NCCL + arrangement into the
 * per-expert pool) and combine (NCCL + FP32 sum over k). The expert compute
 * between them is the caller's (backend_cuda.c: moe_compute.h); the pool the
 * dispatch returns maps its rows into the combine's per-source segments
 * (mm_expert_pool.out_rows), so the compute's output is the combine's send
 * buffer and, at one rank over NCCL, also its receive buffer (no copy).
 *
 * Modes:
 *   normal       exact counts are all-gathered and read on the host (one
 *                stream sync, polled with the comm timeout); grouped
 *                ncclSend / ncclRecv of exactly the bytes needed. Capacity
 *                overflow on any rank is seen by every rank from the gathered
 *                counts: all return RESOURCE_EXHAUSTED before the dispatch.
 *   low-latency  fixed per-peer segments (ll_tokens rows; ll_tokens * k
 *                combine rows), no host sync, no allocation: capturable in a
 *                CUDA graph. Moved by NCCL, or, when the plan could set it
 *                up (every rank on this node, peer access: ep_ipc.h), by
 *                push kernels over CUDA IPC peer pointers; a peer that does
 *                not arrive within comm.timeout-ms is then reported as
 *                DEADLINE_EXCEEDED (fatal) by mm_ep_take_error. Device-side errors (invalid ids, pool overflow,
 *                ranks disagreeing on the mode) are recorded in device memory
 *                and copied to pinned memory at the end of each call; they are
 *                reported by mm_ep_take_error (the next call, or a check).
 * Invalid expert ids are treated as masked (nothing is written out of
 * bounds) and reported as INVALID_ARGUMENT. All ranks of the group must use
 * the same mode in the same step. */
#ifndef MM_EP_ENGINE_H
#define MM_EP_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "ep_comm.h"
#include "ep_ipc.h"
#include "moe_compute.h"
#include "routing.h"
#include "status.h"

typedef struct mm_ep_engine mm_ep_engine;

typedef struct mm_ep_engine_args {
  int rank, ranks, device;
  int num_experts, top_k, hidden, intermediate;
  int max_tokens;          /* per rank */
  int ll_tokens;           /* low-latency capacity per rank; 0 disables the mode */
  double pool_factor;      /* 0 = MM_EP_POOL_FACTOR_DEFAULT */
  int64_t workspace_bytes; /* compute workspace for the pool; < 0 = estimate */
  mm_ep_comm *comm;        /* borrowed */
  /* device allocator; NULL = cudaMalloc / cudaFree */
  void *alloc_ctx;
  int (*dev_alloc)(void *ctx, int device, size_t bytes, void **ptr);
  void (*dev_free)(void *ctx, int device, void *ptr);
  /* low-latency transport (ep_ipc.h); 0 = MEGAMOE_EP_TRANSPORT, else auto */
  mm_ep_transport transport;
} mm_ep_engine_args;

typedef enum { MM_EP_MODE_NORMAL = 1, MM_EP_MODE_LOW_LATENCY = 2 } mm_ep_mode;

/* Allocates every buffer (plan time). */
mm_err *mm_ep_engine_create(const mm_ep_engine_args *a, mm_ep_engine **out);
/* Frees everything; waits for the device first. NULL is fine. */
void mm_ep_engine_destroy(mm_ep_engine *e);
const mm_ep_sizes *mm_ep_engine_sizes(const mm_ep_engine *e);
uint64_t mm_ep_engine_device_bytes(const mm_ep_engine *e);
uint64_t mm_ep_engine_host_bytes(const mm_ep_engine *e);
/* Largest T the low-latency mode takes (0: disabled). */
int mm_ep_engine_ll_tokens(const mm_ep_engine *e);
/* The low-latency steps' transport: MM_EP_TRANSPORT_IPC or MM_EP_TRANSPORT_NCCL. */
mm_ep_transport mm_ep_engine_transport(const mm_ep_engine *e);
/* Bytes the last step sent (own segment included): dispatch, combine. */
void mm_ep_engine_step_bytes(const mm_ep_engine *e, int64_t *dispatch, int64_t *combine);

typedef struct mm_ep_step {
  int T;
  const uint16_t *hidden;   /* bf16 [T, H], device, 16-byte aligned */
  const int32_t *ids;       /* [T, k], device */
  const float *weights;     /* [T, k], device */
  float weight_scale;       /* routed-scaling-factor */
  mm_ep_mode mode;
  void *stream;             /* cudaStream_t */
  /* Optional cudaEvent_t recorded at: dispatch start, dispatch end (pool
   * ready), combine start, combine end (before the error-word copy). For
   * benchmarks; NULL entries are skipped. */
  void *events[4];
} mm_ep_step;

/* Dispatch: on success `pool` describes this rank's pool and ws / ws_bytes
 * the compute workspace (inside the plan-time buffers). */
mm_err *mm_ep_dispatch(mm_ep_engine *e, const mm_ep_step *s, mm_expert_pool *pool, void **ws,
                       size_t *ws_bytes);
/* Combine of the last dispatch into out (bf16 [T, H], device, 16-byte aligned).
 * Normal mode: waits and reports device errors of this step. */
mm_err *mm_ep_combine(mm_ep_engine *e, uint16_t *out);

/* Reports (and clears) device-side errors recorded by earlier low-latency
 * steps. wait = 1 synchronizes `stream` first (with the comm timeout; not
 * while capturing); wait = 0 reads what the last finished step left. */
mm_err *mm_ep_take_error(mm_ep_engine *e, void *stream, int wait);

#endif

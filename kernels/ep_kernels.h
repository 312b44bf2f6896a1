/* ep_kernels.h -- C-callable launchers of the expert-parallel kernels
 * (kernels/ep_dispatch.cu, kernels/ep_combine.cu). They implement the routing
 * plan of plugin/routing.h exactly; the communication between them is NCCL,
 * issued by plugin/ep_engine.c, or, for low-latency steps on one node, the
 * CUDA IPC exchange kernel below (kernels/ep_ipc.cu). Launchers return a cudaError_t as int (0 = OK).
 *
 * Execute sequence (one stream):
 *   route         ids -> tok_slot / pair_slot, this rank's row of the count matrix
 *   [all-gather of the count matrix]
 *   offsets       segment offsets of the four buffers, mode and capacity checks
 *   pack          FP8 quantization (formats.h mm_quant_fp8_block) of each token,
 *                 written once per destination rank with its ids and weights
 *   [dispatch: grouped ncclSend / ncclRecv]
 *   recv_plan     pool rank of every received pair (per expert), combine rank (per source)
 *   expert_offsets the pool's expert offsets (clamped to the pool capacity)
 *   arrange       received rows -> per-expert pool (x, scales, weight, back-map)
 *   [expert compute: kernels/moe_compute.h; its output rows go straight to
 *                 the combine send buffer, grouped by source (pool_to_cs as
 *                 the pool's out_rows)]
 *   [combine: grouped ncclSend / ncclRecv; none at one rank over NCCL,
 *                 where the receive buffer is the send buffer]
 *   combine       out[t] = BF16(sum over k ascending of the FP32 expert rows)
 */
#ifndef MM_EP_KERNELS_H
#define MM_EP_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Error flags in err[0] (sticky until the host clears them). err[2..3] hold a
 * uint64 (flat index << 32 | id) of the first invalid expert id (atomicMin;
 * all ones = none). */
#define MM_EP_ERR_BAD_ID 0x1
#define MM_EP_ERR_POOL_OVERFLOW 0x2
#define MM_EP_ERR_RECV_OVERFLOW 0x4
#define MM_EP_ERR_MODE_MISMATCH 0x8
/* A low-latency exchange over CUDA IPC waited longer than comm.timeout-ms for
 * a peer; err[1] holds that peer + 1 (the first one). */
#define MM_EP_ERR_PEER_TIMEOUT 0x10
#define MM_EP_ERR_WORDS 4

/* Count-matrix row (plugin/routing.h mm_ep_count_row_len): */
#define MM_EP_CNT_TOK(R, r) (r)
#define MM_EP_CNT_PAIR(R, r) ((R) + (r))
#define MM_EP_CNT_MODE(R) (2 * (R))
#define MM_EP_CNT_T(R) (2 * (R) + 1)
#define MM_EP_CNT_RECV_CAP(R) (2 * (R) + 2)
#define MM_EP_CNT_POOL_CAP(R) (2 * (R) + 3)

/* Segment-offset table seg[4][R + 1]. */
#define MM_EP_SEG_SEND 0 /* dispatch send, by destination */
#define MM_EP_SEG_RECV 1 /* dispatch receive, by source */
#define MM_EP_SEG_CSEND 2 /* combine send, by source */
#define MM_EP_SEG_CRECV 3 /* combine receive, by destination */

#define MM_EP_MAX_RANKS 1024

typedef struct mm_ep_dev {
  /* geometry */
  int ranks, rank;
  int num_experts, experts_per_rank, top_k, hidden;
  int row_bytes;   /* dispatch row: fp8 [H] | f32 scales [H/128] | i32 ids [k] | f32 weights [k] */
  int tok_stride;  /* 0: packed segments (normal); else rows per peer (low-latency) */
  int pair_stride; /* combine rows per peer (low-latency) */
  int mode_tag;    /* 1 normal, 2 | tok_stride << 2 low-latency: must agree across ranks */
  int64_t pool_cap, recv_cap;
  /* buffers (device) */
  int32_t *counts;        /* [R][2R + 4] all-gathered */
  int64_t *seg;           /* [4][R + 1] */
  int32_t *tok_slot, *pair_slot;   /* [T * k] */
  int32_t *pool_rank, *cs_rank;    /* [recv rows * k] */
  int32_t *expert_count;           /* [E_loc] */
  int64_t *expert_off;             /* [E_loc + 1] unclamped */
  int32_t *expert_off_pool;        /* [E_loc + 1] clamped to pool_cap (the compute's view) */
  float *row_weight;               /* [pool_cap] */
  int32_t *pool_to_cs;             /* [pool_cap]: pool row -> combine send row */
  uint8_t *pool_x;                 /* [pool_cap, H] */
  float *pool_xs;                  /* [pool_cap, H/128] */
  uint8_t *send, *recv;            /* dispatch rows */
  uint16_t *csend, *crecv;         /* combine rows [*, H]; csend is the expert
                                      compute's output (mm_expert_pool.out) */
  int32_t *err;                    /* [MM_EP_ERR_WORDS], 8-byte aligned */
} mm_ep_dev;

/* All take a cudaStream_t as void*. T may be 0 (nothing launched where the
 * grid would be empty). grid_rows bounds the blocks of the row-parallel
 * kernels (the exact row count in normal mode, the capacity in low-latency). */
int mm_ep_launch_route(const mm_ep_dev *d, int T, const int32_t *ids, void *stream);
int mm_ep_launch_offsets(const mm_ep_dev *d, void *stream);
int mm_ep_launch_pack(const mm_ep_dev *d, int T, const uint16_t *hidden, const int32_t *ids,
                      const float *weights, float weight_scale, void *stream);
int mm_ep_launch_recv_plan(const mm_ep_dev *d, void *stream);
int mm_ep_launch_expert_offsets(const mm_ep_dev *d, void *stream);
int mm_ep_launch_arrange(const mm_ep_dev *d, int64_t grid_rows, void *stream);
int mm_ep_launch_combine(const mm_ep_dev *d, int T, const int32_t *ids, uint16_t *out,
                         void *stream);

/* ---- low-latency transport over CUDA IPC peer pointers (kernels/ep_ipc.cu) ----
 * Every rank owns one buffer (plugin/ep_ipc.c) with the same layout on every
 * rank; peers map it and push into it:
 *   local words  [0] epoch of the last exchange, [1] blocks done in the
 *                current one, [2] failed (sticky); only this rank touches them
 *   ready[R]     ready[p] = e: rank p reached exchange e (its buffers are free)
 *   data[R]      data[p] = e: rank p's payload of exchange e is in place
 *   peer table   [R] each rank's buffer base in this address space (local)
 *   counts       [R][2R + 4] the count matrix (row p written by rank p)
 *   payload      low-latency receive rows: dispatch R * tok_stride rows, or
 *                combine R * pair_stride rows of H bf16 (aliased: the
 *                handshake orders them) */
typedef struct mm_ep_ipc_dev {
  int ranks, rank;
  uint64_t *local;                /* this rank's local words */
  uint64_t *ready, *data;         /* this rank's flag arrays [R] */
  uint8_t *const *peer_base;      /* device table [R] */
  int64_t ready_off, data_off, counts_off, payload_off; /* offsets in every buffer */
  int64_t timeout_ns;             /* comm.timeout-ms of every spin */
} mm_ep_ipc_dev;

/* One exchange of a low-latency step, replacing one NCCL transfer bit for
 * bit (the rows a receiver reads are the same; unused rows are not sent). */
#define MM_EP_IPC_COUNTS 0   /* this rank's count row to every peer's matrix */
#define MM_EP_IPC_DISPATCH 1 /* send segment r (mine[TOK r] rows) -> r's payload, slot rank */
#define MM_EP_IPC_COMBINE 2  /* combine segment r (r's PAIR[me] rows) -> r's payload, slot rank */
/* d->counts must point at x's counts area and d->recv / d->crecv at its
 * payload (ep_engine.c does). Every rank must run the same exchanges in the
 * same order: the epochs count them. */
int mm_ep_launch_ipc_exchange(const mm_ep_dev *d, const mm_ep_ipc_dev *x, int kind, void *stream);

/* Stand-in expert compute for tests and the bench (no weights):
 * out[out_rows[p]] = BF16(e4m3(x[p]) * x_scale * row_weight[p] * (1 + (first_expert + e) % 16)),
 * FP32 products in that order, for the rows of the pool (struct
 * mm_expert_pool of moe_compute.h, out_rows as there: NULL = row p);
 * num_local <= MM_EP_MAX_EXPERTS_IDENTITY. */
#define MM_EP_MAX_EXPERTS_IDENTITY 4096
struct mm_expert_pool;
int mm_ep_launch_identity_compute(const struct mm_expert_pool *pool, int num_local,
                                  int first_expert, int hidden, void *stream);

#ifdef __cplusplus
}
#endif
#endif

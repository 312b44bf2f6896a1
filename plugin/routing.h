/* routing.h -- the expert-parallel routing plan, pure C: the reference the
 * GPU kernels (kernels/ep_*.cu) implement bit for bit, and the sizing of the
 * plan-time buffers.
 *
 * Geometry: R ranks, E experts, expert e lives on rank e / (E / R). Each rank
 * has T tokens with top-k ids (-1 = masked). Everything is ordered by
 * ascending indices so the plan is deterministic:
 *
 *   source side (mm_route_send_plan), per destination rank r:
 *     tok_count[r]   distinct tokens with at least one expert on r (a token is
 *                    sent once per destination rank even if several of its
 *                    experts live there);
 *     pair_count[r]  (token, k) pairs whose expert is on r;
 *     tok_slot[t,j]  row of token t inside r's dispatch segment (rank of t
 *                    among r's tokens), equal for every j of t that goes to r;
 *     pair_slot[t,j] row of pair (t, j) inside r's combine segment (rank of
 *                    (t, j) among r's pairs in (t, j) order).
 *   receive side (mm_route_recv_plan) on rank `me`, for the tokens received
 *   from every source s (in slot order, sources ascending):
 *     pool: the local pairs grouped by local expert, inside an expert ordered
 *           by (s, slot, j); expert_offsets[E_loc + 1];
 *     pool_row[row, j]  pool row of pair j of received row `row`;
 *     cs_row[row, j]    row in the combine send buffer: source s's segment,
 *                       ranked by (slot, j) -- exactly the source's pair_slot.
 *   The source then reads pair (t, j) back at combine segment of r, row
 *   pair_slot[t, j], and sums over j ascending in FP32.
 *
 * Segments are either packed (offsets = prefix sums of the counts: normal
 * mode) or fixed-stride (offset = r * stride: low-latency mode). */
#ifndef MM_ROUTING_H
#define MM_ROUTING_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef struct mm_route_geom {
  int ranks;       /* R >= 1 */
  int num_experts; /* E, a multiple of R */
  int top_k;       /* k >= 1 */
} mm_route_geom;

static inline int mm_route_experts_per_rank(const mm_route_geom *g) {
  return g->num_experts / g->ranks;
}

/* Checks R, E, k (E % R == 0, all positive). */
mm_err *mm_route_geom_check(const mm_route_geom *g);

/* Source side for T tokens (ids [T*k]). Outputs are caller-allocated:
 * tok_count[R], pair_count[R], tok_slot[T*k], pair_slot[T*k] (-1 where the id
 * is masked or invalid). An id other than -1 outside [0, E) is invalid: it is
 * treated as masked and counted. Returns the number of invalid ids; when
 * first_bad is non-NULL it receives the flat index of the first one (-1 none). */
int mm_route_send_plan(const mm_route_geom *g, int T, const int32_t *ids, int *tok_count,
                       int *pair_count, int32_t *tok_slot, int32_t *pair_slot,
                       int64_t *first_bad);

/* Segment offsets off[R + 1]: stride 0 -> prefix sums of counts[R], else
 * off[r] = r * stride (and off[R] = R * stride). */
void mm_route_offsets(int R, const int *counts, int stride, int64_t *off);

/* Receive side on rank `me`. recv_ids holds the k ids of every received row:
 * source s's recv_tok[s] rows start at row roff[s] (from mm_route_offsets);
 * rows beyond recv_tok[s] inside a fixed-stride segment are ignored. Outputs:
 * expert_count[E_loc], pool_row / cs_row [rows_total * k] (-1 where the pair
 * is not local or the row is unused), recv_pair[R] (local pairs from each
 * source). cs_off[R + 1] are the combine-send segment offsets (packed: prefix
 * of recv_pair -- pass stride 0 and NULL to have them computed into cs_off;
 * fixed: pass cs_stride > 0). rows_total = roff[R]. */
void mm_route_recv_plan(const mm_route_geom *g, int me, const int *recv_tok,
                        const int64_t *roff, const int32_t *recv_ids, int cs_stride,
                        int *expert_count, int64_t *expert_offsets, int32_t *pool_row,
                        int64_t *cs_row, int *recv_pair, int64_t *cs_off);

/* ---- plan-time buffer sizing (shared by the CUDA backend and docs/PERF.md) ---- */

typedef struct mm_ep_size_args {
  int ranks, num_experts, top_k, hidden, intermediate;
  int max_tokens;        /* per rank (num-max-tokens-per-rank or the plan's value) */
  int ll_tokens;         /* low-latency capacity per peer segment; 0 = no low-latency */
  double pool_factor;    /* pool rows = min(worst case, pool_factor * max_tokens * k) */
  /* Bytes the expert compute needs as workspace for pool_rows rows; < 0: use
   * mm_ep_workspace_estimate (the largest weight mode's need). */
  int64_t workspace_bytes;
} mm_ep_size_args;

#define MM_EP_POOL_FACTOR_DEFAULT 1.5
#define MM_EP_ALIGN 256

typedef struct mm_ep_sizes {
  int row_bytes;        /* dispatch row: fp8 [H] | f32 scales [H/128] | ids [k] | weights [k] */
  int pair_rows_per_tok;/* k: pairs one token can bring to one rank (ids may repeat) */
  /* capacities (rows) */
  int64_t send_rows;    /* dispatch send, normal: T * min(k, R) */
  int64_t recv_rows;    /* dispatch receive, normal (overflow -> RESOURCE_EXHAUSTED) */
  int64_t pool_rows;    /* per-expert pool (overflow -> RESOURCE_EXHAUSTED) */
  int64_t combine_rows; /* combine receive at the source, normal: T * k */
  int64_t ll_tok_rows;  /* low-latency dispatch send/recv rows: R * ll_tokens */
  int64_t ll_pair_rows; /* low-latency combine send/recv rows: R * ll_tokens * k */
  /* the two aliased regions (see ep_engine.c) and the small buffers */
  uint64_t region_x;    /* dispatch send | pool x + scales + workspace | combine receive */
  uint64_t region_y;    /* dispatch receive | pool out = combine send (the compute
                           writes its rows in combine order); at one rank also
                           the combine receive, in place */
  uint64_t workspace;   /* compute workspace inside region x */
  uint64_t meta;        /* slots, counts, offsets, flags */
  uint64_t device_total;
  uint64_t host_total;  /* pinned: count matrix + flags */
} mm_ep_sizes;

/* The sm90 compute workspace for pool_rows rows in the weight mode that needs
 * the most (16-bit intermediate): what mm_sm90_workspace_plan (layout_sm90.h)
 * gives, in 64-bit arithmetic; covers every mode, so a plan made before the
 * layers are prepared fits any of them. */
int64_t mm_ep_workspace_estimate(int64_t pool_rows, int hidden, int intermediate);
mm_err *mm_ep_size(const mm_ep_size_args *a, mm_ep_sizes *out);

/* Bytes of the count matrix row each rank contributes (all-gathered):
 * [tok_count R | pair_count R | mode tag | T | recv_rows cap | pool_rows cap]. */
static inline int mm_ep_count_row_len(int R) { return 2 * R + 4; }

#endif

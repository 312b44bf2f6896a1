/* routing.c -- expert-parallel routing plan and buffer sizing (pure C). */
#include "routing.h"

#include <stdlib.h>
#include <string.h>

#include "formats.h"

mm_err *mm_route_geom_check(const mm_route_geom *g) {
  MM_ARG_CHECK(g->ranks >= 1, "ep-size %d must be >= 1", g->ranks);
  MM_ARG_CHECK(g->top_k >= 1, "top-k %d must be >= 1", g->top_k);
  MM_ARG_CHECK(g->num_experts >= g->ranks && g->num_experts % g->ranks == 0,
               "num-experts %d must be a positive multiple of ep-size %d", g->num_experts,
               g->ranks);
  return NULL;
}

int mm_route_send_plan(const mm_route_geom *g, int T, const int32_t *ids, int *tok_count,
                       int *pair_count, int32_t *tok_slot, int32_t *pair_slot,
                       int64_t *first_bad) {
  const int R = g->ranks, K = g->top_k, E = g->num_experts, per = mm_route_experts_per_rank(g);
  int bad = 0;
  if (first_bad) *first_bad = -1;
  for (int r = 0; r < R; r++) tok_count[r] = pair_count[r] = 0;
  for (int t = 0; t < T; t++) {
    for (int j = 0; j < K; j++) {
      size_t p = (size_t)t * K + (size_t)j;
      int id = ids[p];
      tok_slot[p] = pair_slot[p] = -1;
      if (id == -1) continue;
      if (id < 0 || id >= E) {
        if (bad++ == 0 && first_bad) *first_bad = (int64_t)p;
        continue;
      }
      int r = id / per;
      /* The token's row on r: the first j that goes to r opens it. */
      int opened = -1;
      for (int jj = 0; jj < j; jj++)
        if (tok_slot[(size_t)t * K + (size_t)jj] >= 0 && ids[(size_t)t * K + (size_t)jj] / per == r) {
          opened = tok_slot[(size_t)t * K + (size_t)jj];
          break;
        }
      tok_slot[p] = opened >= 0 ? opened : tok_count[r]++;
      pair_slot[p] = pair_count[r]++;
    }
  }
  return bad;
}

void mm_route_offsets(int R, const int *counts, int stride, int64_t *off) {
  off[0] = 0;
  for (int r = 0; r < R; r++) off[r + 1] = stride ? (int64_t)(r + 1) * stride : off[r] + counts[r];
}

void mm_route_recv_plan(const mm_route_geom *g, int me, const int *recv_tok,
                        const int64_t *roff, const int32_t *recv_ids, int cs_stride,
                        int *expert_count, int64_t *expert_offsets, int32_t *pool_row,
                        int64_t *cs_row, int *recv_pair, int64_t *cs_off) {
  const int R = g->ranks, K = g->top_k, per = mm_route_experts_per_rank(g);
  const int first = me * per;
  const int64_t rows = roff[R];
  for (int64_t i = 0; i < rows * K; i++) {
    pool_row[i] = -1;
    cs_row[i] = -1;
  }
  for (int e = 0; e < per; e++) expert_count[e] = 0;
  /* Pass 1: ranks inside each expert and inside each source, in (s, slot, j) order. */
  int32_t *erank = malloc(sizeof(int32_t) * (size_t)(rows * K + 1));
  int64_t *srank = malloc(sizeof(int64_t) * (size_t)(rows * K + 1));
  for (int s = 0; s < R; s++) {
    recv_pair[s] = 0;
    for (int i = 0; i < recv_tok[s]; i++) {
      int64_t row = roff[s] + i;
      for (int j = 0; j < K; j++) {
        int64_t p = row * K + j;
        int id = recv_ids[p];
        erank[p] = -1;
        if (id < first || id >= first + per) continue;
        erank[p] = expert_count[id - first]++;
        srank[p] = recv_pair[s]++;
      }
    }
  }
  expert_offsets[0] = 0;
  for (int e = 0; e < per; e++) expert_offsets[e + 1] = expert_offsets[e] + expert_count[e];
  if (cs_stride) {
    for (int s = 0; s <= R; s++) cs_off[s] = (int64_t)s * cs_stride;
  } else {
    mm_route_offsets(R, recv_pair, 0, cs_off);
  }
  /* Pass 2: absolute rows. */
  for (int s = 0; s < R; s++)
    for (int i = 0; i < recv_tok[s]; i++) {
      int64_t row = roff[s] + i;
      for (int j = 0; j < K; j++) {
        int64_t p = row * K + j;
        if (erank[p] < 0) continue;
        pool_row[p] = (int32_t)(expert_offsets[recv_ids[p] - first] + erank[p]);
        cs_row[p] = cs_off[s] + srank[p];
      }
    }
  free(erank);
  free(srank);
}

/* ---- sizing ------------------------------------------------------------------ */

static uint64_t align_up(uint64_t x) { return (x + MM_EP_ALIGN - 1) / MM_EP_ALIGN * MM_EP_ALIGN; }
static uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }
static int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

int64_t mm_ep_workspace_estimate(int64_t pool_rows, int hidden, int intermediate) {
  /* Token scales^T (FP32 per 128), the SwiGLU output (F16 in the exact modes,
   * FP8 otherwise) and its scales^T, for rows rounded up to a 64-row tile,
   * each array 256-aligned. The F16 copy of the pool rows of the exact mode
   * lives in the pool output (region y), not here. */
  const int64_t Mp = pool_rows < 64 ? 64 : (pool_rows + 63) / 64 * 64;
  const int64_t per_row = (int64_t)hidden / MM_ACT_BLOCK * 4 + 2 * (int64_t)intermediate +
                          (int64_t)intermediate / MM_ACT_BLOCK * 4;
  return Mp * per_row + 3 * 256;
}

mm_err *mm_ep_size(const mm_ep_size_args *a, mm_ep_sizes *o) {
  mm_route_geom g = {a->ranks, a->num_experts, a->top_k};
  MM_TRY(mm_route_geom_check(&g));
  MM_ARG_CHECK(a->hidden > 0 && a->hidden % MM_ACT_BLOCK == 0,
               "hidden-size %d must be a positive multiple of %d", a->hidden, MM_ACT_BLOCK);
  MM_ARG_CHECK(a->max_tokens >= 1, "max tokens per rank %d must be >= 1", a->max_tokens);
  MM_ARG_CHECK(a->ll_tokens >= 0 && a->ll_tokens <= a->max_tokens,
               "low-latency capacity %d must be in [0, max tokens %d]", a->ll_tokens,
               a->max_tokens);
  MM_ARG_CHECK(a->pool_factor >= 1.0, "pool factor %g must be >= 1", a->pool_factor);
  memset(o, 0, sizeof *o);
  const int64_t R = a->ranks, K = a->top_k, H = a->hidden, T = a->max_tokens, L = a->ll_tokens;
  const int64_t per = a->num_experts / a->ranks;
  o->row_bytes = (int)((H + H / 32 + 8 * K + 15) / 16 * 16);
  o->pair_rows_per_tok = (int)K; /* duplicate ids can bring k pairs even when E/R < k */
  const int64_t kk = o->pair_rows_per_tok, rb = o->row_bytes;
  o->send_rows = T * (K < R ? K : R);
  o->combine_rows = T * K;
  int64_t pool_worst = R * T * kk;
  int64_t pool_cap = (int64_t)(a->pool_factor * (double)(T * K) + 0.999999);
  o->pool_rows = min_i64(pool_worst, pool_cap);
  o->ll_tok_rows = R * L;
  o->ll_pair_rows = R * L * kk;
  int64_t ws = a->workspace_bytes >= 0 ? a->workspace_bytes
                                       : mm_ep_workspace_estimate(o->pool_rows, a->hidden,
                                                                  a->intermediate);
  o->workspace = align_up((uint64_t)ws);
  const uint64_t P = (uint64_t)o->pool_rows, out_row = (uint64_t)H * 2;
  const uint64_t pool_x = align_up(P * (uint64_t)H) + align_up(P * (uint64_t)(H / 32));
  uint64_t x = align_up((uint64_t)(o->send_rows * rb));
  x = max_u64(x, align_up((uint64_t)(o->ll_tok_rows * rb)));
  x = max_u64(x, pool_x + o->workspace);
  /* the combine receive (normal: T * k rows <= P; low-latency: ll_pair_rows) */
  x = max_u64(x, align_up(P * out_row));
  x = max_u64(x, align_up((uint64_t)o->ll_pair_rows * out_row));
  /* Region y: the pool output, which is the combine send (and, at one rank,
   * the combine receive read in place), sets its size; the
   * dispatch receive takes whatever that leaves, at least what is needed for
   * 2 x the average fan-in, capped at the worst case R * T. */
  uint64_t y = align_up(P * out_row);
  y = max_u64(y, align_up((uint64_t)o->combine_rows * out_row));
  y = max_u64(y, align_up((uint64_t)o->ll_pair_rows * out_row));
  y = max_u64(y, align_up((uint64_t)(o->ll_tok_rows * rb)));
  int64_t recv_min = min_i64(R * T, 2 * o->send_rows);
  y = max_u64(y, align_up((uint64_t)(recv_min * rb)));
  o->recv_rows = min_i64(R * T, (int64_t)(y / (uint64_t)rb));
  o->region_x = x;
  o->region_y = y;
  /* Small buffers; the same list as ep_engine.c's carve-up. */
  const int64_t recv_rows_any = o->recv_rows > o->ll_tok_rows ? o->recv_rows : o->ll_tok_rows;
  uint64_t m = 0;
  m += align_up((uint64_t)(T * K) * 4) * 2;                 /* tok_slot, pair_slot */
  m += align_up((uint64_t)(recv_rows_any * K) * 4) * 2;     /* pool rank, cs rank */
  m += align_up(P * 4) * 2;                                 /* row_weight, pool_to_cs */
  m += align_up((uint64_t)(per + 1) * 8) * 2 + align_up((uint64_t)per * 4); /* expert counts/offsets */
  m += align_up((uint64_t)(R * mm_ep_count_row_len((int)R)) * 4);           /* count matrix */
  m += align_up((uint64_t)(R + 1) * 8) * 4;                 /* segment offsets */
  m += align_up(64);                                        /* error words */
  o->meta = m;
  o->device_total = x + y + m;
  o->host_total = align_up((uint64_t)(R * mm_ep_count_row_len((int)R)) * 4) + align_up(64);
  return NULL;
}

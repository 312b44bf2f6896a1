/* moe_sm90_impl.h -- internals shared by the sm90 expert-compute files
 * (C++/CUDA only). */
#ifndef MM_MOE_SM90_IMPL_H
#define MM_MOE_SM90_IMPL_H

#include <cuda_runtime.h>
#include <stdlib.h>

/* status.h, qmat.h, formats.h are plain C headers */
extern "C" {
#include "moe_compute.h"
}

struct mm_sm90_layer {
  mm_weight_mode mode;
  int E, H, I;
  size_t rec;          /* record bytes */
  size_t w13_bytes;    /* one expert's w13 records */
  size_t w2_bytes;
  size_t expert_bytes; /* w13 then w2 */
  uint8_t *d_w;        /* [E][expert_bytes] */
  float *d_rs13;       /* [E][2I] row factors in layout row order */
  float *d_rs2;        /* [E][H] */
  uint8_t *d_lut;      /* [MM_SM90_LUT_ENTRIES][8] */
  int refs_zero13;     /* every reference exponent of w13 is 0 (zero_refs) */
  int refs_zero2;      /* of w2 */
  int prefill_off;     /* the prefill path turned off (mm_sm90_layer_set_prefill) */
  int prefill_chunk;   /* its experts per launch pair (compute.prefill-experts),
                          1..MM_SM90_PREFILL_CHUNK; 0: the default */
  size_t device_bytes;
  double fold_rel;     /* mode 3 relative Frobenius fold error */
};

/* Workspace carve-up for Mp = num_rows_max rounded up to 64 rows
 * (mm_sm90_workspace_plan in layout_sm90.h). The F16 copy of the pool rows
 * of the F16-MMA modes is not in it: the WGMMA path stages it in pool->out,
 * which is dead until L2 writes it (moe_compute.h). */
struct mm_sm90_ws {
  int Mp;
  float *xs_t;     /* [H/128][Mp] token scales, transposed */
  uint8_t *act;    /* [Mp][I] FP8 (modes 1/3) or F16 (modes 2/4) intermediate */
  float *as_t;     /* [I/128][Mp] intermediate scales, transposed */
  /* The prefill path's (moe_sm90_prefill.cu), where planned
   * (mm_sm90_prefill_planned), else NULL: */
  uint8_t *wdec;   /* E4M3 weights of mm_sm90_prefill_chunk experts, in
                      [2I][H] (w13) and [H][I] (w2) slots (mm_sm90_prefill_slot) */
  int *pf_count;   /* decode counts (mm_sm90_prefill_count_bytes, layout_sm90.h) */
  int *pf_tiles;   /* [Mp] L1 units done per token tile (mm_sm90_prefill_tile_count_bytes) */
  size_t bytes;
  size_t base_bytes; /* without the prefill path's region */
};

/* MEGAMOE_SM90_GRID=N (tests; docs/CONFIG.md): at most N CTAs per kernel,
 * so that each walks many work units and wraps its ring; 0: no cap. Both
 * GEMM paths read it where they launch. */
static inline int mm_sm90_grid_cap(void) {
  const char *v = getenv("MEGAMOE_SM90_GRID");
  return v ? atoi(v) : 0;
}

/* A switch that is on unless the variable starts with '0' (tests and
 * measurements' controls; docs/CONFIG.md), read where a call launches. */
static inline bool mm_sm90_env_on(const char *name) {
  const char *v = getenv(name);
  return !(v && v[0] == '0');
}

/* Experts per launch pair of layer L's prefill path. */
static inline int mm_sm90_prefill_chunk(const mm_sm90_layer *L) {
  const int c = L->prefill_chunk > 0 ? L->prefill_chunk : MM_SM90_PREFILL_EXPERTS_DEFAULT;
  return c < L->E ? c : (L->E > 0 ? L->E : 1);
}

mm_sm90_ws mm_sm90_ws_carve(const mm_sm90_layer *L, int num_rows_max, void *base);

#define MM_CUDA_TRY(call)                                                              \
  do {                                                                                 \
    cudaError_t e_ = (call);                                                           \
    if (e_ != cudaSuccess)                                                             \
      return mm_error(MEGAMOE_CODE_INTERNAL, "%s failed: %s (%s:%d)", #call,           \
                      cudaGetErrorString(e_), __FILE__, __LINE__);                     \
  } while (0)

/* Plain CUDA-core path (moe_sm90.cu). */
mm_err *mm_sm90_run_simt(const mm_sm90_layer *L, const mm_expert_pool *pool, float clamp,
                         const mm_sm90_ws *ws, cudaStream_t stream);
/* WGMMA path (moe_sm90_wgmma.cu); prep (scale transpose, F16 copy) included. */
mm_err *mm_sm90_run_wgmma(const mm_sm90_layer *L, const mm_expert_pool *pool, float clamp,
                          const mm_sm90_ws *ws, cudaStream_t stream);
/* NULL if the WGMMA path supports L's shape, else why not. */
const char *mm_sm90_wgmma_unsupported(const mm_sm90_layer *L);
/* The token scales transposed into ws->xs_t (the WGMMA path's prep kernel,
 * scales only). */
mm_err *mm_sm90_prep_token_scales(const mm_sm90_layer *L, const mm_expert_pool *pool,
                                  const mm_sm90_ws *ws, cudaStream_t stream);
/* The L1 epilogue's silu table on the current device (NULL if unknown). */
const float *mm_sm90_silu_table(void);

/* Prefill path (moe_sm90_prefill.cu): NULL if it supports L, else why not. */
const char *mm_sm90_prefill_unsupported(const mm_sm90_layer *L);
/* Whether a workspace for num_rows_max rows holds the prefill path's
 * region: L supported, and num_rows_max at least mm_sm90_prefill_min_rows
 * per expert or MEGAMOE_SM90_PREFILL=1 (docs/CONFIG.md). */
int mm_sm90_prefill_planned(const mm_sm90_layer *L, int num_rows_max);
mm_err *mm_sm90_run_prefill(const mm_sm90_layer *L, const mm_expert_pool *pool, float clamp,
                            const mm_sm90_ws *ws, cudaStream_t stream);

#endif

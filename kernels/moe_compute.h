/* moe_compute.h -- internal C API of the fused expert compute on sm_90a
 * (GEMM1 + SwiGLU + FP8 requant + GEMM2 with FP4 weights decoded in-kernel).
 * Called by the plugin's CUDA execute path. C-callable; implemented in .cu.
 *
 * DRAFT CONTRACT (owner: the Hopper compute work; refine freely, keep C).
 */
#ifndef MM_MOE_COMPUTE_H
#define MM_MOE_COMPUTE_H

#include <stddef.h>
#include <stdint.h>

#include "qmat.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  MM_WMODE_G32_FP8 = 1,        /* gran 32 UE8M0 folded into E4M3, QGMMA */
  MM_WMODE_G16_BF16_EXACT = 2, /* gran 16 E4M3 scales, decode to BF16, HGMMA */
  MM_WMODE_G16_FP8 = 3         /* gran 16, scale folded into E4M3 (lossy), QGMMA */
} mm_weight_mode;

/* Prepared weights of the E_loc local experts of one layer on one device, in
 * the sm90 kernel layout (docs/LAYOUTS.md). Opaque to callers. */
typedef struct mm_sm90_layer mm_sm90_layer;

/* Builds the device layout from canonical host matrices (one per local
 * expert), on `stream` (cudaStream_t). Fails with a clear message (naming the
 * expert and group) if a scale cannot be represented exactly in `mode`. */
mm_err *mm_sm90_layer_create(const mm_expert_q *experts, int num_local,
                             mm_weight_mode mode, void *stream,
                             mm_sm90_layer **out);
void mm_sm90_layer_destroy(mm_sm90_layer *layer);
size_t mm_sm90_layer_device_bytes(const mm_sm90_layer *layer);

/* The tokens this rank received, grouped by local expert (a contiguous pool).
 * All pointers are device pointers. */
typedef struct mm_expert_pool {
  int num_rows_max;              /* capacity M (rows allocated) */
  const int32_t *expert_offsets; /* [E_loc + 1]: rows of expert e are
                                    [offsets[e], offsets[e+1]); may be empty */
  const uint8_t *x;              /* FP8 E4M3 [M, H] */
  const float *x_scale;          /* FP32 [M, H/128] */
  const float *row_weight;       /* FP32 [M] top-k weight of each row */
  uint16_t *out;                 /* BF16 [M, H], weighted by row_weight */
} mm_expert_pool;

/* Workspace bytes needed for a pool of num_rows_max rows (intermediate FP8
 * activations, tile scheduler state). Allocated once at plan time. */
size_t mm_sm90_workspace_bytes(const mm_sm90_layer *layer, int num_rows_max);

mm_err *mm_sm90_expert_compute(const mm_sm90_layer *layer,
                               const mm_expert_pool *pool, float activation_clamp,
                               void *workspace, size_t workspace_bytes,
                               void *stream);

#ifdef __cplusplus
}
#endif
#endif

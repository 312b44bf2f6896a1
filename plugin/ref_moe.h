/* ref_moe.h -- the CPU reference of the MoE layer: the oracle for every GPU
 * kernel. Plain loops, float64 accumulation, FP32/BF16/FP8 roundings exactly
 * where the GPU path rounds (DeepGEMM's order):
 *
 *   x (bf16) -> FP8 per token per 128 channels (formats.h, mm_quant_fp8_block)
 *   L1: acc = sum_k xq*xs * w13 (float64) * row_scale -> FP32 -> BF16 (gate, up)
 *   optional clamp: gate <= c, -c <= up <= c
 *   a = silu(gate) * up * topk_weight  (FP32, in that order)
 *   a -> FP8 per 128 channels; L2: acc = sum a_q*a_s * w2 * row_scale -> FP32 -> BF16
 *   combine: out = BF16( sum over k ascending of the expert rows (FP32) )
 */
#ifndef MM_REF_MOE_H
#define MM_REF_MOE_H

#include <math.h>
#include <stdint.h>

#include "qmat.h"
#include "status.h"

/* Expert compute for `m` rows that all go to one expert (the per-expert pool
 * of the fused kernel): FP8 inputs [m, H] with FP32 scales [m, H/128], a per-row
 * top-k weight, BF16 output [m, H] (already weighted). */
void mm_ref_expert_rows(const mm_expert_q *e, int m, const uint8_t *xq,
                        const float *xs, const float *row_weight, float clamp,
                        uint16_t *out);
/* Same with an explicit thread count (0 = all cores). */
void mm_ref_expert_rows_mt(const mm_expert_q *e, int m, const uint8_t *xq,
                           const float *xs, const float *row_weight, float clamp,
                           int threads, uint16_t *out);

/* silu(g) * u * w in FP32, the exact expression every backend uses. */
static inline float mm_swiglu_weighted(float g, float u, float w) {
  float s = g / (1.0f + expf(-g));
  return (s * u) * w;
}

/* bf16 [T, H] -> FP8 [T, H] + FP32 scales [T, H/128]. H % 128 == 0. */
void mm_ref_quant_act(const uint16_t *x, int T, int H, uint8_t *xq, float *xs);

typedef struct mm_ref_layer_args {
  int T, H, I, top_k, num_experts;
  int first_expert, num_local;   /* experts [first, first+num_local) are in `experts` */
  const mm_expert_q *experts;    /* num_local entries */
  const uint16_t *hidden;        /* bf16 [T, H] */
  const int32_t *topk_ids;       /* [T, top_k], -1 = masked */
  const float *topk_weights;     /* [T, top_k] */
  float routed_scaling_factor;   /* multiplies topk weights (1 = none) */
  float activation_clamp;        /* 0 = none */
  int threads;                   /* 0 = all cores */
  uint16_t *out;                 /* bf16 [T, H] */
  float *out_f32;                /* optional [T, H]: the FP32 combine sums
                                    before the final BF16 rounding */
} mm_ref_layer_args;

/* The whole layer for one rank that owns every expert any token selects
 * (ids outside the local range are INVALID_ARGUMENT unless masked). */
mm_err *mm_ref_moe_layer(const mm_ref_layer_args *a);

#endif

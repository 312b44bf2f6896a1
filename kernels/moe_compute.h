/* moe_compute.h -- internal C API of the fused expert compute on sm_90a
 * (GEMM1 + SwiGLU + FP8 requant + GEMM2 with FP4 weights decoded in-kernel).
 * Called by the plugin's CUDA execute path. C-callable; implemented in .cu.
 *
 * Two implementations of one contract: the product path (warp-specialized
 * WGMMA kernels, kernels/moe_sm90_wgmma.cu) and a plain CUDA-core path
 * (kernels/moe_sm90.cu) kept for debugging and as a second opinion. Both
 * follow ref_moe.h's rounding order. The exact modes (2: gran 16, 4: gran 32)
 * run their MMAs in F16 instead of BF16: their decoded weights and the E4M3
 * activations are exact in both, F16 has the same HGMMA rate and an exact
 * E4M3 -> F16 convert.
 */
#ifndef MM_MOE_COMPUTE_H
#define MM_MOE_COMPUTE_H

#include <stddef.h>
#include <stdint.h>

#include "layout_sm90.h"
#include "pack_sm90.h"
#include "qmat.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* mm_weight_mode (1 g32-fp8, 2 g16-bf16-exact, 3 g16-fp8, 4 g32-f16-exact)
 * and the layout itself: plugin/layout_sm90.h. */

/* Prepared weights of the E_loc local experts of one layer on one device, in
 * the sm90 kernel layout (docs/LAYOUTS.md). Opaque to callers. */
typedef struct mm_sm90_layer mm_sm90_layer;

/* Builds the device layout from canonical host matrices (one per local
 * expert), on `stream` (cudaStream_t), packed on the GPU or on the host's
 * cores (MEGAMOE_SM90_PACK; the same bytes). Fails with a clear message
 * (naming the expert and group) if a scale cannot be represented exactly
 * in `mode`. */
mm_err *mm_sm90_layer_create(const mm_expert_q *experts, int num_local,
                             mm_weight_mode mode, void *stream,
                             mm_sm90_layer **out);
/* The same from group-16 experts that mode (1 or 4) takes after a group16
 * -> group32 requant, which runs on the GPU while the layer is packed there
 * (mm_sm90_pack_experts_gpu's `requant`: statistics, limit, messages).
 * Needs the GPU packer: FAILED_PRECONDITION where mm_sm90_packs_on_gpu(mode)
 * is 0. */
mm_err *mm_sm90_layer_create_requant(const mm_expert_q *experts, int num_local,
                                     mm_weight_mode mode, const mm_sm90_requant *requant,
                                     void *stream, mm_sm90_layer **out);
/* 1 when mm_sm90_layer_create packs mode's layers on the GPU (the default
 * for the FP8 modes and mode 4; MEGAMOE_SM90_PACK), 0 on the host. */
int mm_sm90_packs_on_gpu(mm_weight_mode mode);
void mm_sm90_layer_destroy(mm_sm90_layer *layer);
/* compute.prefill-path: allow (1, the default) or forbid (0) mode 1's
 * prefill path (moe_sm90_prefill.cu) for this layer; forbidden, its
 * workspace holds no prefill region. compute.prefill-experts: experts per
 * launch pair, whose decoded weights the region holds (1..32; 0: the
 * default, MM_SM90_PREFILL_EXPERTS_DEFAULT; more than 32: 32). Set before
 * sizing workspaces. */
void mm_sm90_layer_set_prefill(mm_sm90_layer *layer, int allow, int experts);
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
  int rows_hint;                 /* rows expected in the pool (<= M), when the
                                    caller knows more than the capacity: picks
                                    launch shapes only; 0 = use M */
  const int32_t *out_rows;       /* [M] or NULL: pool row p's result goes to
                                    out row out_rows[p] (in [0, M), distinct
                                    for distinct p) instead of row p, so that
                                    the caller's next step (the combine's
                                    per-source segments) reads it in place */
} mm_expert_pool;
/* Aliasing: `out` is scratch during a compute call. The F16-MMA modes (2, 4)
 * stage their F16 copy of the pool rows [offsets[0], offsets[E_loc]) there
 * (in pool order), mode 3 on the WGMMA path an FP8 copy in its K order
 * (its first H bytes of each row), before L2 writes the results, so `out` must not alias x,
 * x_scale, row_weight, out_rows, the offsets or the workspace, and nothing
 * else may read or write it until the call's work on the stream is done.
 * Written rows: out_rows[p] (row p without a map) for every pool row p in
 * [offsets[0], offsets[E_loc]), and, in modes 2, 3 and 4, the staging rows
 * [offsets[0], offsets[E_loc]) themselves; no others. The WGMMA path needs x
 * and out 16-byte aligned. */

/* Workspace bytes needed for a pool of num_rows_max rows (token scales,
 * the intermediate activations and their scales; mm_sm90_workspace_plan;
 * and, where planned, the prefill path's weights and counts,
 * mm_sm90_prefill_planned). Allocated once at plan time. */
size_t mm_sm90_workspace_bytes(const mm_sm90_layer *layer, int num_rows_max);
/* The least a compute call accepts: without the prefill path's weight
 * region (modes 1 and 3 from mm_sm90_prefill_min_rows rows per expert;
 * layout_sm90.h), which a call given less than mm_sm90_workspace_bytes
 * then does without. */
size_t mm_sm90_workspace_bytes_min(const mm_sm90_layer *layer, int num_rows_max);

/* Computes every row in [offsets[0], offsets[E_loc]); other rows of `out`
 * are not written (`out` is scratch during the call: see mm_expert_pool).
 * activation_clamp 0 = none. Asynchronous on `stream`;
 * errors are launch/argument errors (kernel faults show at the next sync). */
mm_err *mm_sm90_expert_compute(const mm_sm90_layer *layer,
                               const mm_expert_pool *pool, float activation_clamp,
                               void *workspace, size_t workspace_bytes,
                               void *stream);

typedef enum {
  MM_SM90_PATH_AUTO = 0,  /* WGMMA where the shape allows, else CUDA cores */
  MM_SM90_PATH_SIMT = 1,  /* plain CUDA-core kernels (debug reference) */
  MM_SM90_PATH_WGMMA = 2, /* WGMMA only; error if the shape is unsupported */
  MM_SM90_PATH_PREFILL = 3 /* the FP8 modes' prefill path only (moe_sm90_prefill.cu); error
                              if the layer or the workspace has no place for it */
} mm_sm90_path;

mm_err *mm_sm90_expert_compute_path(const mm_sm90_layer *layer, const mm_expert_pool *pool,
                                    float activation_clamp, void *workspace,
                                    size_t workspace_bytes, void *stream, mm_sm90_path path);

/* Mode 3 only: relative Frobenius error of the folded weights against the
 * canonical ones, measured at create (0 for the exact modes). */
double mm_sm90_layer_fold_error(const mm_sm90_layer *layer);
mm_weight_mode mm_sm90_layer_mode(const mm_sm90_layer *layer);

/* Benchmarks: a layer of valid random records made on the device (no host
 * packing), same layout and kernels as a real one. Modes 1, 3 and 4: each row's
 * groups share one reference exponent, which the packer moves into the row
 * factor (reference 0 in every block, its row anchor); block_refs keeps it
 * in every block instead, as for rows whose blocks need their own. */
mm_err *mm_sm90_layer_create_random(int num_local, int hidden, int intermediate,
                                    mm_weight_mode mode, uint64_t seed, int block_refs,
                                    void *stream, mm_sm90_layer **out);
/* Tests: copies the intermediate of the last compute that used `workspace`
 * (rows [0, rows)) to the host as FP8 E4M3 bytes [rows, I] and FP32 scales
 * [rows, I/128]. Synchronous. */
mm_err *mm_sm90_debug_intermediate(const mm_sm90_layer *layer, int num_rows_max,
                                   const void *workspace, int rows, uint8_t *act, float *scales);

/* The L1 epilogue's silu table (moe_sm90_wgmma.cu): filled once per device
 * on `stream` and waited for. Every layer creation calls it, so the table is
 * written before any compute of the device can read it. */
mm_err *mm_sm90_silu_table_init(void *stream);

/* Tests: the L1 epilogue's silu table and silu_n (the division's fast path
 * taken for a whole group of values at once) against the division, on every
 * BF16 gate value; *mismatches counts the results whose bits differ.
 * Synchronous. */
mm_err *mm_sm90_check_silu(unsigned long long *mismatches);

/* Benchmark helpers: random FP8 bytes (no NaN, |v| < 2), the same values as
 * BF16 (n elements), uniform floats, and a streaming read of `bytes` (for the
 * HBM read ceiling). Asynchronous. */
mm_err *mm_sm90_bench_fill_fp8(uint8_t *p, size_t n, uint64_t seed, void *stream);
mm_err *mm_sm90_bench_fill_bf16(uint16_t *p, size_t n, uint64_t seed, void *stream);
mm_err *mm_sm90_bench_fill_uniform(float *p, size_t n, float lo, float hi, uint64_t seed,
                                   void *stream);
mm_err *mm_sm90_bench_read(const void *p, size_t bytes, float *sink, void *stream);

#ifdef __cplusplus
}
#endif
#endif

/* prep.h -- GPU weight preparation: group16 -> group32 UE8M0 requant (the
 * same bytes as plugin/requant.c), scale validation, and the DeepGEMM sm100
 * MegaMoE layout (the same bytes as plugin/layout_sm100.c). C-callable,
 * implemented in kernels/prep.cu. All data pointers are device pointers of
 * the current device; `stream` is a cudaStream_t (NULL = legacy default).
 * Every function checks its launches and returns an error naming the step. */
#ifndef MM_PREP_H
#define MM_PREP_H

#include <stddef.h>
#include <stdint.h>

#include "layout_sm100.h"
#include "qmat.h"
#include "requant.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Status word of the asynchronous requant: set it to MM_GPU_STATUS_OK before
 * the launch; afterwards it holds the smallest flat group index
 * (row * cols/32 + group) that held a non-finite source value, if any. */
#define MM_GPU_STATUS_OK 0xFFFFFFFFu

/* Enqueues the requant of a rows x cols matrix (cols % 32 == 0):
 * codes [rows, cols/2], scales [rows, cols/16] (E4M3 or UE8M0), row_scale
 * [rows] or NULL (= 1) -> codes_out, scales_out [rows, cols/32] (UE8M0).
 * row_stats: NULL, or [rows][3] doubles (sum v^2, sum err^2, max |err|),
 * written per row (fixed reduction order, deterministic). status: device
 * uint32, see MM_GPU_STATUS_OK (required). Nothing is synchronized. */
mm_err *mm_gpu_requant_launch(int rows, int cols, mm_scale_format sf, const uint8_t *codes,
                              const uint8_t *scales, const float *row_scale, uint8_t *codes_out,
                              uint8_t *scales_out, double *row_stats, uint32_t *status,
                              void *stream);

/* Synchronous requant: allocates the status (and stats when `stats` is not
 * NULL), launches, waits on `stream`, sums the row statistics on the host in
 * row order. A non-finite source value is INVALID_ARGUMENT naming the row
 * and elements like the CPU path. */
mm_err *mm_gpu_requant(int rows, int cols, mm_scale_format sf, const uint8_t *codes,
                       const uint8_t *scales, const float *row_scale, uint8_t *codes_out,
                       uint8_t *scales_out, mm_requant_stats *stats, void *stream);

/* The same with the per-element reference kernel instead of the lookup-table
 * one (identical bytes; slower): for tests and benchmarks. */
mm_err *mm_gpu_requant_launch_simple(int rows, int cols, mm_scale_format sf,
                                     const uint8_t *codes, const uint8_t *scales,
                                     const float *row_scale, uint8_t *codes_out,
                                     uint8_t *scales_out, double *row_stats, uint32_t *status,
                                     void *stream);
mm_err *mm_gpu_requant_simple(int rows, int cols, mm_scale_format sf, const uint8_t *codes,
                              const uint8_t *scales, const float *row_scale, uint8_t *codes_out,
                              uint8_t *scales_out, mm_requant_stats *stats, void *stream);

/* Enqueues a scan of n scale bytes for NaN (E4M3: 0x7F/0xFF, UE8M0: 0xFF);
 * *status (device, set to MM_GPU_STATUS_OK first) gets the smallest index of
 * a NaN byte (indices >= 2^32-1 are not reported). */
mm_err *mm_gpu_scan_scales_launch(const uint8_t *scales, size_t n, mm_scale_format sf,
                                  uint32_t *status, void *stream);

/* Enqueues canonical -> DeepGEMM sm100 for one layer (see layout_sm100.h):
 * w13 rows interleaved, w2 copied, scales packed/transposed into int32 word
 * storage (padding written as 0). in/out arrays are device pointers. */
mm_err *mm_gpu_sm100_export_launch(const mm_sm100_shape *s, const mm_sm100_canon *in,
                                   const mm_sm100_packed *out, void *stream);

#ifdef __cplusplus
}
#endif
#endif

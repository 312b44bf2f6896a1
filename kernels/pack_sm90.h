/* pack_sm90.h -- the sm90 kernel layout packed on the GPU. C-callable,
 * implemented in kernels/pack_sm90.cu. */
#ifndef MM_PACK_SM90_H
#define MM_PACK_SM90_H

#include "layout_sm90.h"
#include "qmat.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* mm_sm90_pack_experts (layout_sm90_pack.h) with the packing on the current
 * GPU: the canonical matrices of experts[0 .. count) (host memory) are
 * uploaded a few experts at a time and packed by kernels running the host
 * packer's steps (layout_sm90_pack_rules.h). dst, rs13 and rs2 are device
 * pointers (4-byte aligned) laid out as mm_sm90_pack_experts lays its host
 * ones. Same records, row factors and error messages (naming local expert
 * index_base + e); mode 3's fold sums (added to fold_err, may be NULL) are
 * the same up to the order of their additions and the GPU's fused
 * multiply-adds. Runs on `stream` (cudaStream_t) and returns when the
 * packing is done. */
mm_err *mm_sm90_pack_experts_gpu(const mm_expert_q *experts, int count, int index_base,
                                 mm_weight_mode mode, uint8_t *dst, float *rs13, float *rs2,
                                 double fold_err[2], void *stream);

#ifdef __cplusplus
}
#endif
#endif

/* pack_sm90.h -- the sm90 kernel layout packed on the GPU. C-callable,
 * implemented in kernels/pack_sm90.cu. */
#ifndef MM_PACK_SM90_H
#define MM_PACK_SM90_H

#include "layout_sm90.h"
#include "qmat.h"
#include "requant.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A group16 -> group32 requant run on the GPU before the packing (the
 * loader's MM_LOAD_DEFER_REQUANT): the same bytes as requant.h's. */
typedef struct mm_sm90_requant {
  int first_expert;        /* global id of experts[0]: tensor names in messages */
  double max_rel_error;    /* requant.max-rel-error (INFINITY: no limit) */
  mm_requant_stats *stats; /* out [3 * count]: gate, up, down of each expert */
} mm_sm90_requant;

/* mm_sm90_pack_experts (layout_sm90_pack.h) with the packing on the current
 * GPU: the canonical matrices of experts[0 .. count) (host memory) are
 * uploaded a few experts at a time and packed by kernels running the host
 * packer's steps (layout_sm90_pack_rules.h). dst, rs13 and rs2 are device
 * pointers (4-byte aligned) laid out as mm_sm90_pack_experts lays its host
 * ones. Same records, row factors and error messages (naming local expert
 * index_base + e); mode 3's fold sums (added to fold_err, may be NULL) are
 * the same up to the order of their additions and the GPU's fused
 * multiply-adds. Runs on `stream` (cudaStream_t) and returns when the
 * packing is done.
 *
 * requant NULL: the experts are in the mode's format. Else they are group-16
 * matrices (E4M3 or UE8M0 scales, row_scale the global of each row) that
 * mode 1 or 4 takes after the requant: each uploaded matrix is requantized
 * on the GPU (kernels/prep.h, the CPU requant's bytes) and packed from
 * there, as if the host had requantized it (row_scale 1). Each tensor's
 * statistics (row sums added in row order; within a row the GPU kernel's
 * order of additions, so equal to the CPU's up to rounding) go to
 * requant->stats, and a tensor above max_rel_error is refused with the
 * loader's message. Errors come in expert order, an expert's requant errors
 * before its layout refusals (the host path requantizes the whole layer
 * first: with errors in two experts the two paths may name different
 * ones). */
mm_err *mm_sm90_pack_experts_gpu(const mm_expert_q *experts, int count, int index_base,
                                 mm_weight_mode mode, uint8_t *dst, float *rs13, float *rs2,
                                 double fold_err[2], const mm_sm90_requant *requant,
                                 void *stream);

#ifdef __cplusplus
}
#endif
#endif

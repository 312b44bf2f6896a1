/* layout_sm90_pack.h -- the fast host packing of the sm90 kernel layout.
 * Produces the same bytes, row factors, fold sums and error messages as the
 * plain reference mm_sm90_pack_matrix (layout_sm90.c), which stays the
 * specification (tests/test_sm90_pack.c compares the two on random data).
 * Faster by: lookup tables built once per call from the reference's own slot
 * functions (a record's 1024 code words are gathered byte-wise instead of
 * placed nibble by nibble), scale decisions from per-byte tables, and one
 * set of threads for all matrices of a layer, handing out 64-row tiles. */
#ifndef MM_LAYOUT_SM90_PACK_H
#define MM_LAYOUT_SM90_PACK_H

#include "layout_sm90.h"
#include "layout_sm90_pack_rules.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fills the tables of the packing steps for record mode `mode`
 * (mm_sm90_record_mode). 0, or -1 if the slot functions break the
 * one-word-per-byte property the gather relies on (never, by the layout). */
int mm_sm90_pack_tables_build(mm_sm90_pack_tables *T, mm_weight_mode mode);

/* The reference's message for a fault of the packing steps. */
void mm_sm90p_fault_message(const mm_sm90p_fault *f, char msg[256]);

/* mm_sm90_pack_matrix on `threads` threads (0 = all cores). */
mm_err *mm_sm90_pack_matrix_fast(const mm_qmat *m, mm_weight_mode mode, int gate_up,
                                 uint8_t *dst, float *row_scale, double fold_err[2],
                                 int threads);

/* Packs experts[0 .. count) the way mm_sm90_layer_create lays a layer out:
 * expert e's w13 (gate/up order) at dst + e * expert_bytes, its w2 right
 * after (expert_bytes = w13 bytes + w2 bytes); w13 row factors to
 * rs13 + e * w13.rows, w2 row factors to rs2 + e * w2.rows. fold_err (may be
 * NULL) accumulates each matrix's two fold sums in order (w13 then w2 of each
 * expert), as adding up mm_sm90_pack_matrix's results would. The error is the
 * reference's for the first failing matrix, wrapped "local expert %d w13
 * (gate/up)" or "... w2 (down)" with %d = index_base + e. All experts must
 * have the shapes of experts[0]. threads: 0 = all cores. */
mm_err *mm_sm90_pack_experts(const mm_expert_q *experts, int count, int index_base,
                             mm_weight_mode mode, int threads, uint8_t *dst, float *rs13,
                             float *rs2, double fold_err[2]);

#ifdef __cplusplus
}
#endif
#endif

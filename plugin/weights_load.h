/* weights_load.h -- raw checkpoint tensors of one MoE layer -> canonical
 * mm_expert_q (plugin/qmat.h): format detection, validation, and the
 * requant policy. CPU only: every tensor must be in host memory (the op
 * copies device tensors to the host before calling in; a view with
 * on_device set is an error).
 *
 * Accepted per expert and projection (gate/up/down stored separately; names
 * "experts.{E}.{gate,up,down}_proj.{weight,weight_scale,weight_scale_2,
 * input_scale}", anything before "experts." is ignored, e.g. "mlp."):
 *   weight          U8 [N, K/2] (element 2j in the low nibble) or
 *                   F4_E2M1 [N, K] (shape in elements)
 *   weight_scale    F8_E4M3 [N, K/16]               NVFP4, needs weight_scale_2
 *                   U8 or F8_E8M0 [N, K/16], [N, K/32]   UE8M0 group 16 / 32
 *                   I32 [N, ceil(K/g/4)]            UE8M0 packed 4 per word
 *                                                   (byte j = group 4w+j)
 *                   F32 [N, K/16], [N, K/32]        powers of two (UE8M0)
 *   weight_scale_2  F32 scalar ([] or [1]): NVFP4 global, finite, > 0
 *   input_scale     F32 scalar, optional, finite: recorded in the report
 * Gate/up: [I, H], down: [H, I] (cfg->model). All tensors of the layer must
 * share one scale format and group size. Anything else is INVALID_ARGUMENT
 * (NOT_FOUND for a missing tensor) naming the tensor. */
#ifndef MM_WEIGHTS_LOAD_H
#define MM_WEIGHTS_LOAD_H

#include <stddef.h>

#include "config.h"
#include "qmat.h"
#include "requant.h"
#include "status.h"
#include "tensor_view.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { MM_PROJ_GATE = 0, MM_PROJ_UP = 1, MM_PROJ_DOWN = 2 } mm_proj;
const char *mm_proj_name(mm_proj p); /* "gate_proj", ... */

/* One projection of one expert, as loaded. */
typedef struct mm_tensor_report {
  int expert;          /* global expert id */
  mm_proj proj;
  double rel_rms;      /* requant error vs the source values (0: not requantized) */
  double max_abs;
  float global_scale;  /* weight_scale_2 (1 when the format has none) */
  float input_scale;   /* NAN when absent */
} mm_tensor_report;

/* Per-layer load summary. `summary` is one line for the info log. */
typedef struct mm_requant_report {
  int num_tensors;             /* 3 * num_local */
  mm_tensor_report *tensors;   /* owned; expert-major, gate/up/down */
  const char *source_format;   /* "nvfp4-g16", "ue8m0-g16", "ue8m0-g32" */
  int source_gran, gran;       /* group size before and after */
  mm_scale_format source_sf;   /* scale format of the checkpoint */
  mm_scale_format sf;          /* scale format of the result */
  int requantized;             /* 1 if group16 -> group32 was applied */
  int requant_pending;         /* 1: it is due but was deferred (MM_LOAD_DEFER_REQUANT) */
  int requant_on_device;       /* 1: mm_requant_report_finish took the GPU's statistics */
  mm_requant_stats total;      /* all requantized tensors together */
  int worst_tensor;            /* index of the largest rel_rms, -1 if none */
  int globals_differ;          /* experts whose gate and up globals differ */
  double globals_max_ratio;    /* max(gate/up, up/gate) over experts, >= 1 */
  char summary[768];
} mm_requant_report;

void mm_requant_report_free(mm_requant_report *r);

/* Loads local experts first_expert .. first_expert+num_local-1 of one layer
 * (tensors of other experts are ignored; a missing local tensor is NOT_FOUND
 * naming it). Builds w13 = [gate rows; up rows] (row_scale = that
 * projection's weight_scale_2) and w2 (row_scale = down's). With
 * cfg->requant_policy == MM_REQUANT_G16_TO_G32 group-16 sources are
 * requantized (UE8M0, gran 32, row_scale 1; the error of each tensor is
 * measured and a relative RMS above cfg->requant_max_rel_error fails the
 * load). cfg->gran_k (0 = either) must be met by the result.
 * Experts load in parallel on cfg->cpu_threads threads (0 = all cores);
 * results and the error reported (the first a sequential load would meet)
 * do not depend on the thread count.
 * On error nothing is left allocated (experts_out zeroed, report freed).
 * report_out may be NULL; otherwise free it with mm_requant_report_free. */
mm_err *mm_weights_load_layer(const mm_config *cfg, const mm_tensor_view *tensors, size_t n,
                              int first_expert, int num_local,
                              mm_expert_q *experts_out /* [num_local] */,
                              mm_requant_report *report_out);

/* Flags of mm_weights_load_layer_ex. */
enum {
  /* Where the layer needs a group16 -> group32 requant, leave it to the
   * caller (the cuda backend runs it on the GPU while packing): the experts
   * come back in their source format (gran 16, row_scale = the global of
   * each row's projection), every other check done; the report says
   * requant_pending, gran 32 and UE8M0, and its summary and statistics wait
   * for mm_requant_report_finish. Needs report_out. Errors stay those of a
   * sequential load: when an expert fails, the experts before it are
   * requantized on the host to find an earlier requant error. */
  MM_LOAD_DEFER_REQUANT = 1u
};

/* mm_weights_load_layer with flags (above). */
mm_err *mm_weights_load_layer_ex(const mm_config *cfg, const mm_tensor_view *tensors, size_t n,
                                 int first_expert, int num_local, unsigned flags,
                                 mm_expert_q *experts_out, mm_requant_report *report_out);

/* Completes a report whose requant was deferred, from each tensor's
 * statistics (stats[num_tensors], expert-major, gate/up/down: what the
 * deferred requant measured; the caller has applied requant.max-rel-error
 * with mm_requant_limit_error): per-tensor errors, totals, the worst
 * tensor, the summary. on_device: the summary says the GPU ran it. */
mm_err *mm_requant_report_finish(mm_requant_report *r, const mm_config *cfg,
                                 const mm_requant_stats *stats, int on_device);

/* The group16 -> group32 requant of one canonical group-16 expert (as a
 * deferred load leaves it: row_scale = each row's projection's global),
 * projection by projection as the loader runs it: the same bytes,
 * statistics (st[3]: gate, up, down) and errors (a non-finite value, a
 * tensor above cfg->requant_max_rel_error), named experts.<eid>.<proj>,
 * on cfg->cpu_threads threads.
 * dst (may be NULL: errors and statistics only) gets a new group-32
 * expert, row_scale 1, only on success; src stays the caller's. */
mm_err *mm_requant_expert(const mm_config *cfg, int eid, const mm_expert_q *src,
                          mm_expert_q *dst, mm_requant_stats st[3]);

/* Splits "...experts.{E}.{proj}.{field}" ("experts." at the start or after
 * a '.'): *prefix_len (may be NULL) gets the bytes before "experts.", field
 * 0 weight, 1 weight_scale, 2 weight_scale_2, 3 input_scale. Returns 0, or
 * -1 for a name of any other kind (e.g. "shared_experts.*", "gate.weight"). */
int mm_weights_parse_name(const char *name, size_t *prefix_len, long *expert, mm_proj *proj,
                          int *field);

/* The tensors of one projection (scale_2 and input_scale may be NULL). */
typedef struct mm_proj_views {
  const mm_tensor_view *weight, *scale, *scale_2, *input_scale;
} mm_proj_views;

/* Decodes one projection into a canonical matrix in its source format (gran
 * 16 or 32, E4M3 or UE8M0 scale bytes, row_scale = weight_scale_2 or 1).
 * rows/cols: the expected shape, or 0 to take it from the weight. gran_k: 0
 * (auto), 16 or 32, only used to resolve a packed I32 scale shape that fits
 * both group sizes (K <= 64). require_global: NVFP4 without weight_scale_2 is an
 * error (else it means 1). `name` prefixes messages ("experts.3.up_proj").
 * *input_scale gets the recorded input scale (NAN when absent); may be NULL. */
mm_err *mm_weights_decode_proj(const char *name, const mm_proj_views *v, int rows, int cols,
                               int gran_k, int require_global, mm_qmat *out,
                               float *input_scale);

#ifdef __cplusplus
}
#endif
#endif

/* backend_cuda.h -- what the CUDA backend offers beyond backend.h. */
#ifndef MM_BACKEND_CUDA_H
#define MM_BACKEND_CUDA_H

#include "backend.h"
#include "mode_choice.h"
#include "moe_compute.h"

/* The documented check for errors a low-latency execute could not report
 * without a host sync (invalid expert ids -> INVALID_ARGUMENT, pool overflow
 * -> RESOURCE_EXHAUSTED, ranks in different modes -> FAILED_PRECONDITION) and
 * for asynchronous NCCL failures. wait = 1 first waits for the op's work on
 * `stream` (NULL = the op's own stream) with comm.timeout-ms; wait = 0 reports
 * what finished steps left. A reported device error is cleared. A
 * communicator failure (error or timeout) makes the op fatal. The next
 * non-captured execute calls this with wait = 0 (after issuing its own work,
 * so the ranks stay in step) and returns what it found. */
mm_err *mm_cuda_check(mm_op *op, void *stream, int wait);

/* Weight mode for a layer of gran-k `gran` under compute.mode `mode` and
 * compute.max-rel-error `max_rel_error`: mm_choose_weight_mode
 * (plugin/mode_choice.h). fp8: gran 32 -> 1, gran 16 -> 3; bf16-exact:
 * gran 32 -> 4, gran 16 -> 2; auto: the fastest measured mode whose error
 * bound is within max_rel_error (default 0.02: 1 for gran 32, 2 for 16). */
static inline mm_weight_mode mm_cuda_weight_mode(int gran, mm_compute_mode mode,
                                                 double max_rel_error) {
  return mm_choose_weight_mode(gran, mode, max_rel_error).mode;
}

/* Which dispatch mode execute uses for a step whose deciding token count
 * (plugin/dispatch_choice.h) is deciding_tokens (1 normal, 2 low-latency). */
int mm_cuda_dispatch_mode(const mm_op *op, int deciding_tokens);
/* The planned low-latency transport: "ipc", "nccl", or "none" (no
 * low-latency mode planned). */
const char *mm_cuda_transport(const mm_op *op);

#endif

/* ep_comm.h -- the expert-parallel communicator: ep-size ranks, one GPU each,
 * over NCCL.
 *
 * Creation: the host's ncclComm_t when it gives one (borrowed, never
 * destroyed or aborted here); otherwise a communicator of our own,
 * bootstrapped through the host's key-value callbacks: rank 0 puts
 * ncclGetUniqueId under "<key>/nccl-unique-id", the others get it; then a
 * non-blocking ncclCommInitRankConfig polled up to the timeout. One rank
 * needs no key-value service.
 *
 * Failure: every NCCL call that can be pending is polled with
 * ncclCommGetAsyncError up to timeout_ms; an error or a timeout aborts an
 * owned communicator (ncclCommAbort) and leaves the object failed: every
 * later call returns ABORTED with the first message. */
#ifndef MM_EP_COMM_H
#define MM_EP_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef struct mm_ep_comm mm_ep_comm;

typedef struct mm_ep_comm_args {
  int rank, ranks, device;
  void *host_comm;          /* ncclComm_t or NULL */
  const char *key;          /* key prefix for the kv bootstrap ("megamoe" if NULL/empty) */
  int timeout_ms;           /* > 0 */
  /* kv services (from the host); may be NULL when ranks == 1 or host_comm is set */
  void *kv_ctx;
  int (*kv_put)(void *ctx, const char *key, const void *value, size_t len);
  int (*kv_get)(void *ctx, const char *key, void *value, size_t cap, size_t *len, int timeout_ms);
} mm_ep_comm_args;

mm_err *mm_ep_comm_create(const mm_ep_comm_args *a, mm_ep_comm **out);
/* Destroys an owned communicator (abort when it failed); NULL is fine. */
void mm_ep_comm_destroy(mm_ep_comm *c);

int mm_ep_comm_rank(const mm_ep_comm *c);
int mm_ep_comm_size(const mm_ep_comm *c);
void *mm_ep_comm_nccl(const mm_ep_comm *c); /* ncclComm_t */
int mm_ep_comm_timeout_ms(const mm_ep_comm *c);
/* Non-NULL message once the communicator failed. */
const char *mm_ep_comm_failure(const mm_ep_comm *c);

/* Marks the communicator failed (aborting it when owned) with `why`;
 * returns the error to report. For states the peers cannot recover from. */
mm_err *mm_ep_comm_abort(mm_ep_comm *c, megamoe_code code, const char *why);

/* Checks for an asynchronous NCCL error without blocking. */
mm_err *mm_ep_comm_check(mm_ep_comm *c);

/* Waits for all work on `stream` (cudaStream_t) with the timeout, polling
 * the stream and NCCL's asynchronous error; aborts on error or timeout. */
mm_err *mm_ep_comm_sync(mm_ep_comm *c, void *stream);
/* The same with another limit (a wait that covers device-side timeouts). */
mm_err *mm_ep_comm_sync_for(mm_ep_comm *c, void *stream, int timeout_ms);

/* In-place all-gather of `bytes` per rank (this rank's part is at
 * buf + rank * bytes), as grouped point-to-point transfers. Every transfer
 * of this module is ncclSend / ncclRecv: no collective algorithm, so no
 * NVLink multicast (NVLS) is ever selected for it. */
mm_err *mm_ep_comm_allgather(mm_ep_comm *c, void *buf, size_t bytes, void *stream);

/* Grouped all-to-all-v of bytes: to peer r send_bytes[r] from
 * send + send_off[r]; from peer r recv_bytes[r] into recv + recv_off[r].
 * Zero-byte pairs are skipped (both sides know the size). */
mm_err *mm_ep_comm_alltoallv(mm_ep_comm *c, const void *send, const int64_t *send_off,
                             const int64_t *send_bytes, void *recv, const int64_t *recv_off,
                             const int64_t *recv_bytes, void *stream);

#endif

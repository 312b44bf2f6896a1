/* ep_comm.c -- NCCL communicator with bootstrap, error polling and abort. */
#include "ep_comm.h"

#include <cuda_runtime_api.h>
#ifdef MM_HAVE_NCCL
#include <nccl.h>
#endif
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* A wait of waited_ms so far: yield for the first 2 ms, which covers the
 * GPU work a step waits for (the normal dispatch's count read, the combine's
 * end), then sleep 10 us, and 200 us from 50 ms on. A sleep wakes late by
 * the timer slack (~50 us on Linux), which those waits paid after only 64
 * yields before. */
static void backoff(double waited_ms) {
  if (waited_ms < 2.0) {
    sched_yield();
    return;
  }
  struct timespec ts = {0, waited_ms < 50.0 ? 10000 : 200000};
  nanosleep(&ts, NULL);
}

#ifdef MM_HAVE_NCCL
struct mm_ep_comm {
  ncclComm_t comm;
  int owned;
  int rank, ranks, device;
  int timeout_ms;
  int failed;
  megamoe_code fail_code;
  char failure[512];
};

static mm_err *failed_error(const mm_ep_comm *c) {
  return mm_error(MEGAMOE_CODE_ABORTED, "NCCL communicator failed earlier: %s", c->failure);
}

/* Records the first failure, aborts an owned communicator. */
static mm_err *fail(mm_ep_comm *c, megamoe_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static mm_err *fail(mm_ep_comm *c, megamoe_code code, const char *fmt, ...) {
  char msg[400];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (!c->failed) {
    c->failed = 1;
    c->fail_code = code;
    snprintf(c->failure, sizeof c->failure, "rank %d of %d: %s%s", c->rank, c->ranks, msg,
             c->owned ? " (communicator aborted)"
                      : " (the host's communicator: abort it before reuse)");
    if (c->owned && c->comm) {
      ncclCommAbort(c->comm);
      c->comm = NULL;
    }
  }
  return mm_error(code, "%s", c->failure);
}

static const char *nccl_detail(mm_ep_comm *c) {
  const char *s = ncclGetLastError(c->comm);
  return s ? s : "";
}

/* Completes a call that may be pending on a non-blocking communicator. */
static mm_err *complete(mm_ep_comm *c, ncclResult_t res, const char *what) {
  if (res != ncclSuccess && res != ncclInProgress)
    return fail(c, MEGAMOE_CODE_INTERNAL, "%s: %s (%s)", what, ncclGetErrorString(res),
                nccl_detail(c));
  if (res == ncclSuccess) return NULL;
  double t0 = now_ms();
  for (;;) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(c->comm, &st);
    if (q != ncclSuccess)
      return fail(c, MEGAMOE_CODE_INTERNAL, "%s: ncclCommGetAsyncError: %s", what,
                  ncclGetErrorString(q));
    if (st == ncclSuccess) return NULL;
    if (st != ncclInProgress)
      return fail(c, MEGAMOE_CODE_INTERNAL, "%s: %s (%s)", what, ncclGetErrorString(st),
                  nccl_detail(c));
    if (now_ms() - t0 > c->timeout_ms)
      return fail(c, MEGAMOE_CODE_DEADLINE_EXCEEDED, "%s did not complete within comm.timeout-ms = %d",
                  what, c->timeout_ms);
    backoff(now_ms() - t0);
  }
}

static mm_err *bootstrap_id(const mm_ep_comm_args *a, ncclUniqueId *id) {
  char key[256];
  snprintf(key, sizeof key, "%s/nccl-unique-id", a->key && a->key[0] ? a->key : "megamoe");
  if (a->rank == 0) {
    if (a->ranks > 1 && !a->kv_put)
      return mm_error(MEGAMOE_CODE_FAILED_PRECONDITION,
                      "ep-size %d needs the host's nccl_comm or its kv_put/kv_get services",
                      a->ranks);
    ncclResult_t r = ncclGetUniqueId(id);
    if (r != ncclSuccess)
      return mm_error(MEGAMOE_CODE_INTERNAL, "ncclGetUniqueId: %s", ncclGetErrorString(r));
    if (a->ranks == 1) return NULL;
    if (a->kv_put(a->kv_ctx, key, id, sizeof *id) != 0)
      return mm_error(MEGAMOE_CODE_UNAVAILABLE, "kv_put(\"%s\") failed", key);
    return NULL;
  }
  if (!a->kv_get)
    return mm_error(MEGAMOE_CODE_FAILED_PRECONDITION,
                    "ep-size %d needs the host's nccl_comm or its kv_put/kv_get services", a->ranks);
  size_t len = 0;
  if (a->kv_get(a->kv_ctx, key, id, sizeof *id, &len, a->timeout_ms) != 0)
    return mm_error(MEGAMOE_CODE_DEADLINE_EXCEEDED,
                    "rank %d: kv_get(\"%s\") got no NCCL id from rank 0 within %d ms", a->rank,
                    key, a->timeout_ms);
  if (len != sizeof *id)
    return mm_error(MEGAMOE_CODE_DATA_LOSS, "kv_get(\"%s\"): %zu bytes, expected %zu", key, len,
                    sizeof *id);
  return NULL;
}

mm_err *mm_ep_comm_create(const mm_ep_comm_args *a, mm_ep_comm **out) {
  *out = NULL;
  MM_ARG_CHECK(a->ranks >= 1 && a->rank >= 0 && a->rank < a->ranks, "rank %d of ep-size %d",
               a->rank, a->ranks);
  MM_ARG_CHECK(a->timeout_ms > 0, "comm.timeout-ms %d must be > 0", a->timeout_ms);
  mm_ep_comm *c = calloc(1, sizeof *c);
  if (!c) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of host memory");
  c->rank = a->rank;
  c->ranks = a->ranks;
  c->device = a->device;
  c->timeout_ms = a->timeout_ms;
  mm_err *err = NULL;
  if (a->host_comm) {
    c->comm = (ncclComm_t)a->host_comm;
    int n = 0, r = 0;
    if (ncclCommCount(c->comm, &n) != ncclSuccess || ncclCommUserRank(c->comm, &r) != ncclSuccess ||
        n != a->ranks || r != a->rank) {
      err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                     "the host's nccl_comm has %d ranks and rank %d; the op has ep-size %d, rank %d",
                     n, r, a->ranks, a->rank);
      goto fail;
    }
    *out = c;
    return NULL;
  }
  cudaError_t ce = cudaSetDevice(a->device);
  if (ce != cudaSuccess) {
    err = mm_error(MEGAMOE_CODE_INTERNAL, "cudaSetDevice(%d): %s", a->device, cudaGetErrorString(ce));
    goto fail;
  }
  ncclUniqueId id;
  MM_TRY_GOTO(bootstrap_id(a, &id), err, fail);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  /* Non-blocking, so that init and every call can be polled with the
   * timeout. MEGAMOE_NCCL_BLOCKING=1 trades that for latency (NCCL completes
   * non-blocking grouped calls on its own thread: measured 783 -> 444 us for
   * a normal dispatch at 4096 tokens on 2 x H200; docs/CONFIG.md). */
  const char *blocking = getenv("MEGAMOE_NCCL_BLOCKING");
  cfg.blocking = blocking && blocking[0] == '1';
  c->owned = 1;
  ncclResult_t r = ncclCommInitRankConfig(&c->comm, a->ranks, id, a->rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    err = mm_error(MEGAMOE_CODE_INTERNAL, "ncclCommInitRankConfig(rank %d of %d): %s", a->rank,
                   a->ranks, ncclGetErrorString(r));
    if (c->comm) ncclCommAbort(c->comm);
    c->comm = NULL;
    goto fail;
  }
  err = complete(c, r, "ncclCommInitRankConfig");
  if (err) goto fail;
  *out = c;
  return NULL;
fail:
  free(c);
  return err;
}

void mm_ep_comm_destroy(mm_ep_comm *c) {
  if (!c) return;
  if (c->owned && c->comm) {
    if (c->failed) {
      ncclCommAbort(c->comm);
    } else {
      /* Finalize flushes pending work; poll it like any other call. */
      ncclResult_t r = ncclCommFinalize(c->comm);
      mm_err *e = complete(c, r, "ncclCommFinalize");
      if (e) {
        megamoe_error_destroy(e); /* fail() aborted it */
      } else {
        ncclCommDestroy(c->comm);
      }
    }
  }
  free(c);
}

int mm_ep_comm_rank(const mm_ep_comm *c) { return c->rank; }
int mm_ep_comm_size(const mm_ep_comm *c) { return c->ranks; }
int mm_ep_comm_timeout_ms(const mm_ep_comm *c) { return c->timeout_ms; }
void *mm_ep_comm_nccl(const mm_ep_comm *c) { return c->comm; }
const char *mm_ep_comm_failure(const mm_ep_comm *c) { return c->failed ? c->failure : NULL; }

mm_err *mm_ep_comm_abort(mm_ep_comm *c, megamoe_code code, const char *why) {
  if (c->failed) return failed_error(c);
  return fail(c, code, "%s", why);
}

mm_err *mm_ep_comm_check(mm_ep_comm *c) {
  if (c->failed) return failed_error(c);
  ncclResult_t st = ncclSuccess;
  ncclResult_t q = ncclCommGetAsyncError(c->comm, &st);
  if (q != ncclSuccess)
    return fail(c, MEGAMOE_CODE_INTERNAL, "ncclCommGetAsyncError: %s", ncclGetErrorString(q));
  if (st != ncclSuccess && st != ncclInProgress)
    return fail(c, MEGAMOE_CODE_INTERNAL, "asynchronous NCCL error: %s (%s)",
                ncclGetErrorString(st), nccl_detail(c));
  return NULL;
}

mm_err *mm_ep_comm_sync(mm_ep_comm *c, void *stream) {
  return mm_ep_comm_sync_for(c, stream, c->timeout_ms);
}

mm_err *mm_ep_comm_sync_for(mm_ep_comm *c, void *stream, int timeout_ms) {
  if (c->failed) return failed_error(c);
  double t0 = now_ms();
  for (;;) {
    cudaError_t ce = cudaStreamQuery((cudaStream_t)stream);
    if (ce == cudaSuccess) return mm_ep_comm_check(c);
    if (ce != cudaErrorNotReady)
      return fail(c, MEGAMOE_CODE_INTERNAL, "device error while waiting for the stream: %s",
                  cudaGetErrorString(ce));
    MM_TRY(mm_ep_comm_check(c));
    if (now_ms() - t0 > timeout_ms)
      return fail(c, MEGAMOE_CODE_DEADLINE_EXCEEDED,
                  "the stream did not finish within %d ms (comm.timeout-ms = %d; a peer is "
                  "missing or hung)", timeout_ms, c->timeout_ms);
    backoff(now_ms() - t0);
  }
}

/* As grouped send/recv, not ncclAllGather: the communicator then only ever
 * runs point-to-point transfers (no collective algorithm, no NVLS). */
mm_err *mm_ep_comm_allgather(mm_ep_comm *c, void *buf, size_t bytes, void *stream) {
  if (c->failed) return failed_error(c);
  if (c->ranks == 1) return NULL; /* this rank's part is already in place */
  char *b = buf;
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return fail(c, MEGAMOE_CODE_INTERNAL, "ncclGroupStart: %s", ncclGetErrorString(r));
  for (int p = 0; p < c->ranks && r == ncclSuccess; p++) {
    if (p == c->rank) continue;
    r = ncclSend(b + (size_t)c->rank * bytes, bytes, ncclUint8, p, c->comm, (cudaStream_t)stream);
    if (r == ncclSuccess)
      r = ncclRecv(b + (size_t)p * bytes, bytes, ncclUint8, p, c->comm, (cudaStream_t)stream);
  }
  ncclResult_t e = ncclGroupEnd();
  if (r != ncclSuccess)
    return fail(c, MEGAMOE_CODE_INTERNAL, "count exchange: %s (%s)", ncclGetErrorString(r),
                nccl_detail(c));
  return complete(c, e, "count exchange (grouped ncclSend/ncclRecv)");
}

mm_err *mm_ep_comm_alltoallv(mm_ep_comm *c, const void *send, const int64_t *send_off,
                             const int64_t *send_bytes, void *recv, const int64_t *recv_off,
                             const int64_t *recv_bytes, void *stream) {
  if (c->failed) return failed_error(c);
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return fail(c, MEGAMOE_CODE_INTERNAL, "ncclGroupStart: %s", ncclGetErrorString(r));
  for (int p = 0; p < c->ranks && r == ncclSuccess; p++) {
    if (send_bytes[p] > 0)
      r = ncclSend((const char *)send + send_off[p], (size_t)send_bytes[p], ncclUint8, p, c->comm,
                   (cudaStream_t)stream);
    if (r == ncclSuccess && recv_bytes[p] > 0)
      r = ncclRecv((char *)recv + recv_off[p], (size_t)recv_bytes[p], ncclUint8, p, c->comm,
                   (cudaStream_t)stream);
  }
  ncclResult_t e = ncclGroupEnd();
  if (r != ncclSuccess)
    return fail(c, MEGAMOE_CODE_INTERNAL, "ncclSend/ncclRecv: %s (%s)", ncclGetErrorString(r),
                nccl_detail(c));
  return complete(c, e, "grouped ncclSend/ncclRecv");
}

#else /* !MM_HAVE_NCCL: one rank, plain device copies */

struct mm_ep_comm {
  int rank, ranks, timeout_ms, failed;
  char failure[256];
};

mm_err *mm_ep_comm_create(const mm_ep_comm_args *a, mm_ep_comm **out) {
  *out = NULL;
  if (a->ranks != 1 || a->host_comm)
    return mm_error(MEGAMOE_CODE_UNIMPLEMENTED,
                    "built without NCCL: only ep-size 1 without a host communicator (ep-size %d)",
                    a->ranks);
  MM_ARG_CHECK(a->timeout_ms > 0, "comm.timeout-ms %d must be > 0", a->timeout_ms);
  mm_ep_comm *c = calloc(1, sizeof *c);
  if (!c) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of host memory");
  c->ranks = 1;
  c->timeout_ms = a->timeout_ms;
  *out = c;
  return NULL;
}

void mm_ep_comm_destroy(mm_ep_comm *c) { free(c); }
int mm_ep_comm_rank(const mm_ep_comm *c) { return c->rank; }
int mm_ep_comm_size(const mm_ep_comm *c) { return c->ranks; }
int mm_ep_comm_timeout_ms(const mm_ep_comm *c) { return c->timeout_ms; }
void *mm_ep_comm_nccl(const mm_ep_comm *c) { (void)c; return NULL; }
const char *mm_ep_comm_failure(const mm_ep_comm *c) { return c->failed ? c->failure : NULL; }

mm_err *mm_ep_comm_abort(mm_ep_comm *c, megamoe_code code, const char *why) {
  if (!c->failed) {
    c->failed = 1;
    snprintf(c->failure, sizeof c->failure, "%s", why);
  }
  return mm_error(code, "%s", c->failure);
}

mm_err *mm_ep_comm_check(mm_ep_comm *c) {
  return c->failed ? mm_error(MEGAMOE_CODE_ABORTED, "failed earlier: %s", c->failure) : NULL;
}

mm_err *mm_ep_comm_sync(mm_ep_comm *c, void *stream) {
  return mm_ep_comm_sync_for(c, stream, c->timeout_ms);
}

mm_err *mm_ep_comm_sync_for(mm_ep_comm *c, void *stream, int timeout_ms) {
  MM_TRY(mm_ep_comm_check(c));
  double t0 = now_ms();
  for (;;) {
    cudaError_t ce = cudaStreamQuery((cudaStream_t)stream);
    if (ce == cudaSuccess) return NULL;
    if (ce != cudaErrorNotReady)
      return mm_ep_comm_abort(c, MEGAMOE_CODE_INTERNAL, cudaGetErrorString(ce));
    if (now_ms() - t0 > timeout_ms)
      return mm_ep_comm_abort(c, MEGAMOE_CODE_DEADLINE_EXCEEDED,
                              "the stream did not finish within comm.timeout-ms");
    backoff(now_ms() - t0);
  }
}

mm_err *mm_ep_comm_allgather(mm_ep_comm *c, void *buf, size_t bytes, void *stream) {
  (void)buf, (void)bytes, (void)stream;
  return mm_ep_comm_check(c); /* one rank: its part is already in place */
}

mm_err *mm_ep_comm_alltoallv(mm_ep_comm *c, const void *send, const int64_t *send_off,
                             const int64_t *send_bytes, void *recv, const int64_t *recv_off,
                             const int64_t *recv_bytes, void *stream) {
  MM_TRY(mm_ep_comm_check(c));
  if (send_bytes[0] != recv_bytes[0])
    return mm_error(MEGAMOE_CODE_INTERNAL, "self copy of %lld bytes into %lld",
                    (long long)send_bytes[0], (long long)recv_bytes[0]);
  if (send_bytes[0] <= 0) return NULL;
  cudaError_t ce = cudaMemcpyAsync((char *)recv + recv_off[0], (const char *)send + send_off[0],
                                   (size_t)send_bytes[0], cudaMemcpyDeviceToDevice,
                                   (cudaStream_t)stream);
  return ce == cudaSuccess ? NULL : mm_error(MEGAMOE_CODE_INTERNAL, "cudaMemcpyAsync: %s",
                                             cudaGetErrorString(ce));
}
#endif

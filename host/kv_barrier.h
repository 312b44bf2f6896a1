/* kv_barrier.h -- a barrier (and an abort flag) across processes, built on
 * the TCP key-value store: megamoe-host's multi-process mode synchronises its
 * iterations with it as the threaded mode does with its in-process barrier.
 *
 * Generation g: every rank but 0 puts "<ns>/b/<g>/<rank>" and waits for
 * "<ns>/b/<g>/go"; rank 0 waits for all arrivals, puts "go", then deletes the
 * arrivals and generation g-1's "go" (every rank has left g-1 once it arrived
 * at g), so the store holds O(world) barrier keys. Messages: 2(W-1) puts and
 * gets per generation, not W^2.
 *
 * Abort: "<ns>/abort" holds why the group gave up. mm_kv_barrier_abort puts it
 * (unless a first reason is already there), and every wait returns ABORTED
 * with that reason once it appears. mm_kv_barrier_new adds a will to the
 * client, so a rank whose process dies aborts the group through the server.
 * Waits check for an abort every 200 ms and give up after timeout_ms
 * (DEADLINE_EXCEEDED). */
#ifndef MM_KV_BARRIER_H
#define MM_KV_BARRIER_H

#include "kv_tcp.h"

typedef struct mm_kv_barrier mm_kv_barrier;

/* The client is borrowed; ns is a key prefix (at most 128 bytes). */
mm_err *mm_kv_barrier_new(mm_kv_client *c, const char *ns, int rank, int world, int timeout_ms,
                          mm_kv_barrier **out);
void mm_kv_barrier_free(mm_kv_barrier *b);

/* Returns when every rank called it for this generation. */
mm_err *mm_kv_barrier_wait(mm_kv_barrier *b);
/* Aborts the group (first reason wins). */
mm_err *mm_kv_barrier_abort(mm_kv_barrier *b, const char *why);
/* NULL, or ABORTED with the reason when the group was aborted. */
mm_err *mm_kv_barrier_check(mm_kv_barrier *b);
/* Waits up to the barrier's timeout for `key` (abort-aware), like
 * mm_kv_client_get. */
mm_err *mm_kv_barrier_wait_key(mm_kv_barrier *b, const char *key, void *value, size_t cap,
                               size_t *len);

#endif

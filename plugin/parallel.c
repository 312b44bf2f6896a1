/* parallel.c -- static-chunk parallel loop over libuv threads. */
#include "parallel.h"

#include <stdatomic.h>
#include <uv.h>

#define MM_MAX_THREADS 64

int mm_thread_count(int requested) {
  if (requested > 0) return requested > MM_MAX_THREADS ? MM_MAX_THREADS : requested;
  unsigned n = uv_available_parallelism();
  if (n < 1) n = 1;
  return n > MM_MAX_THREADS ? MM_MAX_THREADS : (int)n;
}

typedef struct {
  mm_range_fn fn;
  void *ctx;
  size_t begin, end;
} mm_chunk;

static void run_chunk(void *arg) {
  mm_chunk *c = arg;
  c->fn(c->ctx, c->begin, c->end);
}

void mm_parallel_for(size_t n, int threads, mm_range_fn fn, void *ctx) {
  if (n == 0) return;
  if (threads > MM_MAX_THREADS) threads = MM_MAX_THREADS;
  if ((size_t)threads > n) threads = (int)n;
  if (threads <= 1) {
    fn(ctx, 0, n);
    return;
  }
  mm_chunk chunks[MM_MAX_THREADS];
  uv_thread_t tids[MM_MAX_THREADS];
  int started[MM_MAX_THREADS] = {0};
  for (int t = 0; t < threads; t++) {
    chunks[t].fn = fn;
    chunks[t].ctx = ctx;
    chunks[t].begin = n * (size_t)t / (size_t)threads;
    chunks[t].end = n * (size_t)(t + 1) / (size_t)threads;
  }
  /* Thread 0's chunk runs on the caller; a failed spawn runs inline. */
  for (int t = 1; t < threads; t++)
    started[t] = uv_thread_create(&tids[t], run_chunk, &chunks[t]) == 0;
  run_chunk(&chunks[0]);
  for (int t = 1; t < threads; t++) {
    if (started[t]) uv_thread_join(&tids[t]);
    else run_chunk(&chunks[t]);
  }
}

typedef struct {
  mm_item_fn fn;
  void *ctx;
  size_t n;
  atomic_size_t next;
} mm_item_queue;

static void take_items(void *arg, size_t begin, size_t end) {
  (void)begin, (void)end;
  mm_item_queue *q = arg;
  for (size_t i; (i = atomic_fetch_add(&q->next, 1)) < q->n;) q->fn(q->ctx, i);
}

void mm_parallel_items(size_t n, int threads, mm_item_fn fn, void *ctx) {
  if (n == 0) return;
  if ((size_t)threads > n) threads = (int)n;
  mm_item_queue q = {fn, ctx, n, 0};
  /* one range per thread; each drains the shared queue */
  mm_parallel_for(threads > 1 ? (size_t)threads : 1, threads, take_items, &q);
}

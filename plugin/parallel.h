/* parallel.h -- a parallel for-loop over [0, n) on libuv threads, for the
 * CPU reference paths. Chunks are contiguous and static, so results never
 * depend on the thread count. */
#ifndef MM_PARALLEL_H
#define MM_PARALLEL_H

#include <stddef.h>

typedef void (*mm_range_fn)(void *ctx, size_t begin, size_t end);

/* Number of threads to use for `requested` (0 = online cores, capped at 64). */
int mm_thread_count(int requested);

/* Calls fn(ctx, begin, end) on disjoint ranges covering [0, n). Runs inline
 * when threads <= 1 or n is small, or when threads cannot be created. */
void mm_parallel_for(size_t n, int threads, mm_range_fn fn, void *ctx);

/* Calls fn(ctx, item) once for every item in [0, n), on `threads` threads
 * (one spawn for the whole set) that take the next item in order as they
 * become free: for items of unequal cost (experts, matrices of different
 * sizes). Which thread runs an item is not fixed, so fn must write its
 * results to the item's own slot. Inline when threads <= 1. */
typedef void (*mm_item_fn)(void *ctx, size_t item);
void mm_parallel_items(size_t n, int threads, mm_item_fn fn, void *ctx);

#endif

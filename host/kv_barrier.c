/* kv_barrier.c -- gather at rank 0, release with one "go" key. */
#include "kv_barrier.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#define SLICE_MS 200 /* how often a wait looks for an abort */
#define MAX_NS 128

struct mm_kv_barrier {
  mm_kv_client *c;
  char ns[MAX_NS + 1];
  char abort_key[MAX_NS + 16];
  int rank, world, timeout_ms;
  long gen;
};

mm_err *mm_kv_barrier_new(mm_kv_client *c, const char *ns, int rank, int world, int timeout_ms,
                          mm_kv_barrier **out) {
  *out = NULL;
  MM_ARG_CHECK(c && ns && *ns && strlen(ns) <= MAX_NS, "barrier: bad client or namespace");
  MM_ARG_CHECK(world >= 1 && world <= 100000 && rank >= 0 && rank < world,
               "barrier: rank %d of world %d", rank, world);
  mm_kv_barrier *b = calloc(1, sizeof *b);
  if (!b) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "barrier: out of memory");
  b->c = c;
  snprintf(b->ns, sizeof b->ns, "%s", ns);
  snprintf(b->abort_key, sizeof b->abort_key, "%s/abort", ns);
  b->rank = rank;
  b->world = world;
  b->timeout_ms = timeout_ms > 0 ? timeout_ms : 1;
  char will[160];
  int n = snprintf(will, sizeof will, "rank %d lost its connection to the key-value store", rank);
  mm_err *err = mm_kv_client_add_will(c, b->abort_key, will, (size_t)n);
  if (err) {
    free(b);
    return mm_error_wrap(err, "barrier");
  }
  *out = b;
  return NULL;
}

void mm_kv_barrier_free(mm_kv_barrier *b) { free(b); }

mm_err *mm_kv_barrier_check(mm_kv_barrier *b) {
  char why[512];
  size_t len = 0;
  mm_err *err = mm_kv_client_get(b->c, b->abort_key, why, sizeof why - 1, &len, 0);
  if (err && megamoe_error_code(err) == MEGAMOE_CODE_DEADLINE_EXCEEDED) {
    megamoe_error_destroy(err);
    return NULL;
  }
  if (err) return err;
  why[len < sizeof why - 1 ? len : sizeof why - 1] = '\0';
  return mm_error(MEGAMOE_CODE_ABORTED, "aborted: %s", why);
}

mm_err *mm_kv_barrier_abort(mm_kv_barrier *b, const char *why) {
  mm_err *err = mm_kv_barrier_check(b);
  if (err) { /* already aborted (first reason wins), or the store is gone */
    megamoe_error_destroy(err);
    return NULL;
  }
  size_t n = strlen(why);
  return mm_kv_client_put(b->c, b->abort_key, why, n < 500 ? n : 500);
}

mm_err *mm_kv_barrier_wait_key(mm_kv_barrier *b, const char *key, void *value, size_t cap,
                               size_t *len) {
  uint64_t deadline = uv_hrtime() / 1000000u + (uint64_t)b->timeout_ms;
  for (;;) {
    uint64_t now = uv_hrtime() / 1000000u;
    int slice = now >= deadline ? 0 : deadline - now < SLICE_MS ? (int)(deadline - now) : SLICE_MS;
    mm_err *err = mm_kv_client_get(b->c, key, value, cap, len, slice);
    if (!err) return NULL;
    if (megamoe_error_code(err) != MEGAMOE_CODE_DEADLINE_EXCEEDED) return err;
    megamoe_error_destroy(err);
    MM_TRY(mm_kv_barrier_check(b));
    if (uv_hrtime() / 1000000u >= deadline)
      return mm_error(MEGAMOE_CODE_DEADLINE_EXCEEDED,
                      "waited %d ms for '%s' (a rank is missing or stuck)", b->timeout_ms, key);
  }
}

mm_err *mm_kv_barrier_wait(mm_kv_barrier *b) {
  char key[MAX_NS + 64];
  long g = b->gen++;
  if (b->rank != 0) {
    snprintf(key, sizeof key, "%s/b/%ld/%d", b->ns, g, b->rank);
    MM_TRY(mm_kv_client_put(b->c, key, "", 0));
    snprintf(key, sizeof key, "%s/b/%ld/go", b->ns, g);
    return mm_error_wrap(mm_kv_barrier_wait_key(b, key, NULL, 0, NULL), "barrier %ld", g);
  }
  for (int r = 1; r < b->world; r++) {
    snprintf(key, sizeof key, "%s/b/%ld/%d", b->ns, g, r);
    MM_TRY(mm_error_wrap(mm_kv_barrier_wait_key(b, key, NULL, 0, NULL), "barrier %ld", g));
  }
  if (b->world == 1) return mm_kv_barrier_check(b);
  snprintf(key, sizeof key, "%s/b/%ld/go", b->ns, g);
  MM_TRY(mm_kv_client_put(b->c, key, "", 0));
  for (int r = 1; r < b->world; r++) {
    snprintf(key, sizeof key, "%s/b/%ld/%d", b->ns, g, r);
    MM_TRY(mm_kv_client_del(b->c, key, NULL));
  }
  if (g > 0) {
    snprintf(key, sizeof key, "%s/b/%ld/go", b->ns, g - 1);
    MM_TRY(mm_kv_client_del(b->c, key, NULL));
  }
  return NULL;
}

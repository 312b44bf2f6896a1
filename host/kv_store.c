/* kv_store.c -- linked list under a libuv mutex + condition variable. */
#include "kv_store.h"

#include <stdlib.h>
#include <string.h>
#include <uv.h>

typedef struct entry {
  struct entry *next;
  char *key;
  void *value;
  size_t len;
} entry;

struct mm_kv_store {
  uv_mutex_t lock;
  uv_cond_t changed;
  entry *head;
};

mm_kv_store *mm_kv_store_new(void) {
  mm_kv_store *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  if (uv_mutex_init(&s->lock)) { free(s); return NULL; }
  if (uv_cond_init(&s->changed)) { uv_mutex_destroy(&s->lock); free(s); return NULL; }
  return s;
}

void mm_kv_store_free(mm_kv_store *s) {
  if (!s) return;
  for (entry *e = s->head, *n; e; e = n) {
    n = e->next;
    free(e->key);
    free(e->value);
    free(e);
  }
  uv_cond_destroy(&s->changed);
  uv_mutex_destroy(&s->lock);
  free(s);
}

static entry *find(mm_kv_store *s, const char *key) {
  for (entry *e = s->head; e; e = e->next)
    if (strcmp(e->key, key) == 0) return e;
  return NULL;
}

int mm_kv_store_put(mm_kv_store *s, const char *key, const void *value, size_t len) {
  void *copy = malloc(len ? len : 1);
  if (!copy) return -1;
  memcpy(copy, value, len);
  uv_mutex_lock(&s->lock);
  entry *e = find(s, key);
  if (!e) {
    e = calloc(1, sizeof *e);
    char *k = e ? strdup(key) : NULL;
    if (!e || !k) {
      uv_mutex_unlock(&s->lock);
      free(e);
      free(copy);
      return -1;
    }
    e->key = k;
    e->next = s->head;
    s->head = e;
  }
  free(e->value);
  e->value = copy;
  e->len = len;
  uv_cond_broadcast(&s->changed);
  uv_mutex_unlock(&s->lock);
  return 0;
}

int mm_kv_store_get(mm_kv_store *s, const char *key, void *value, size_t cap, size_t *len,
                    int timeout_ms) {
  uint64_t deadline = uv_hrtime() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms) * 1000000ull;
  uv_mutex_lock(&s->lock);
  entry *e;
  while (!(e = find(s, key))) {
    uint64_t now = uv_hrtime();
    if (now >= deadline || uv_cond_timedwait(&s->changed, &s->lock, deadline - now) != 0) {
      if ((e = find(s, key))) break;
      uv_mutex_unlock(&s->lock);
      return -1;
    }
  }
  memcpy(value, e->value, e->len < cap ? e->len : cap);
  *len = e->len;
  uv_mutex_unlock(&s->lock);
  return 0;
}

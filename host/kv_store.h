/* kv_store.h -- an in-process key-value store with blocking get, used by
 * megamoe-host to bootstrap NCCL among its worker threads (the plugin's
 * kv_put / kv_get host services). Thread-safe. */
#ifndef MM_KV_STORE_H
#define MM_KV_STORE_H

#include <stddef.h>

typedef struct mm_kv_store mm_kv_store;

mm_kv_store *mm_kv_store_new(void);
void mm_kv_store_free(mm_kv_store *s);
/* 0 on success; replaces an existing value. */
int mm_kv_store_put(mm_kv_store *s, const char *key, const void *value, size_t len);
/* Waits up to timeout_ms; 0 and *len on success (copies min(cap, len)). */
int mm_kv_store_get(mm_kv_store *s, const char *key, void *value, size_t cap, size_t *len,
                    int timeout_ms);

#endif

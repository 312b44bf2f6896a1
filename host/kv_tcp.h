/* kv_tcp.h -- the key-value store of kv_store.h served over TCP, so that ranks
 * in different processes (and on different nodes) can bootstrap NCCL and
 * synchronise: megamoe-host's multi-process mode.
 *
 * Server: mm_kv_server_start binds HOST:PORT and serves from a background
 * thread running its own libuv loop until mm_kv_server_stop. The server holds
 * a GET for a missing key until the key is put or the request's timeout
 * passes, so waiting costs no polling.
 *
 * Client: a blocking connection (plain sockets, deadlines with poll). One
 * request is in flight per client; calls from several threads are serialised
 * (a waiting get delays the others: give each waiting thread its own client).
 * Connecting retries until the server is up or the timeout passes. A client
 * may leave "wills": keys the server puts when the connection ends without
 * mm_kv_client_close (the process died or lost the network), so that peers
 * waiting on the store learn it instead of waiting for a timeout. After an
 * I/O error or a reply that breaks the protocol the client is broken: every
 * later call fails (the server may have fired the will; reconnecting would
 * hide that).
 *
 * Wire protocol, integers little-endian, one reply per request, in order:
 *   request  u32 magic | u8 op | u8 0 | u16 0 | u32 key_len | u32 value_len |
 *            u32 timeout_ms | key | value                      (20-byte header)
 *   reply    u32 magic | u8 status | u8 0 | u16 0 | u32 value_len | value
 *                                                              (12-byte header)
 * ops: HELLO (no key, no value), PUT (key, value), GET (key, timeout_ms: how
 * long the server waits for the key), DEL (key), WILL (key and value: adds or
 * replaces the will for that key, at most MM_KV_MAX_WILLS per connection,
 * value <= MM_KV_MAX_WILL; neither: drops them all), BYE (no key, no value;
 * the wills are dropped and nothing may follow). Keys are 1..MM_KV_MAX_KEY bytes
 * without NUL. A frame that breaks any rule (magic, op, reserved bytes,
 * lengths, a field the op does not take, a timeout over MM_KV_MAX_TIMEOUT_MS,
 * a frame after BYE, a partial frame left unfinished for frame_timeout_ms)
 * closes that connection, and only that one. A PUT of a new key beyond the
 * server's key or byte limits is answered FULL and changes nothing.
 */
#ifndef MM_KV_TCP_H
#define MM_KV_TCP_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

#define MM_KV_MAX_KEY 256
#define MM_KV_MAX_VALUE (1u << 20)
#define MM_KV_MAX_WILL 4096u
#define MM_KV_MAX_WILLS 8
#define MM_KV_MAX_TIMEOUT_MS 86400000u /* one day */

/* Wire constants (tests craft frames with them). */
#define MM_KV_MAGIC 0x314B4D4Du /* "MMK1" */
#define MM_KV_REQ_HEADER 20
#define MM_KV_REPLY_HEADER 12
enum { MM_KV_OP_HELLO = 1, MM_KV_OP_PUT, MM_KV_OP_GET, MM_KV_OP_DEL, MM_KV_OP_WILL, MM_KV_OP_BYE };
enum { MM_KV_OK = 0, MM_KV_NOT_FOUND = 1, MM_KV_FULL = 2 };

typedef struct {
  int max_keys;           /* 0: 4096 */
  int max_connections;    /* 0: 256; more are accepted and closed at once */
  size_t max_total_bytes; /* keys + values; 0: 64 MiB */
  int frame_timeout_ms;   /* 0: 10000 */
} mm_kv_server_limits;

typedef struct {
  int connections; /* open now */
  int keys;
  int waiting; /* GETs parked for a missing key */
  uint64_t accepted, rejected; /* rejected: over max_connections */
  uint64_t malformed;          /* connections closed for breaking the protocol */
  uint64_t wills_fired;
} mm_kv_server_stats;

typedef struct mm_kv_server mm_kv_server;
typedef struct mm_kv_client mm_kv_client;

/* "HOST:PORT" or "[V6ADDR]:PORT" -> host (NUL-terminated) and port 0..65535. */
mm_err *mm_kv_parse_address(const char *text, char *host, size_t host_cap, int *port);

/* Binds host:port (port 0: any free port, see mm_kv_server_port) and starts
 * serving. Fails with UNAVAILABLE naming the address when it is in use. */
mm_err *mm_kv_server_start(const char *host, int port, const mm_kv_server_limits *limits,
                           mm_kv_server **out);
int mm_kv_server_port(const mm_kv_server *s);
void mm_kv_server_get_stats(mm_kv_server *s, mm_kv_server_stats *out);
/* Closes every connection (no will fires), stops the thread, frees. NULL ok. */
void mm_kv_server_stop(mm_kv_server *s);

/* Connects and greets, retrying (refused, unreachable, unresolved, rejected)
 * until timeout_ms has passed: DEADLINE_EXCEEDED then, with the last error. */
mm_err *mm_kv_client_connect(const char *host, int port, int timeout_ms, mm_kv_client **out);
/* Replaces an existing value. RESOURCE_EXHAUSTED when the server is full. */
mm_err *mm_kv_client_put(mm_kv_client *c, const char *key, const void *value, size_t len);
/* Waits up to timeout_ms (<= 0: no wait) for the key: DEADLINE_EXCEEDED when
 * it did not appear. On success copies min(cap, length) bytes, sets *len. */
mm_err *mm_kv_client_get(mm_kv_client *c, const char *key, void *value, size_t cap, size_t *len,
                         int timeout_ms);
/* *existed (may be NULL): whether the key was there. */
mm_err *mm_kv_client_del(mm_kv_client *c, const char *key, int *existed);
/* Adds (or replaces, for the same key) a will: on a connection that ends
 * without BYE the server puts key = value. RESOURCE_EXHAUSTED past
 * MM_KV_MAX_WILLS keys. */
mm_err *mm_kv_client_add_will(mm_kv_client *c, const char *key, const void *value, size_t len);
mm_err *mm_kv_client_clear_wills(mm_kv_client *c);
/* Says BYE (no will fires) and closes. NULL ok. */
void mm_kv_client_close(mm_kv_client *c);
/* Drops the connection without BYE, as a crashed process would (the wills
 * fire). For tests. NULL ok. */
void mm_kv_client_abandon(mm_kv_client *c);

#endif

/* kv_tcp.c -- the TCP key-value server: one libuv loop on its own thread, a
 * hash table of entries, GETs for missing keys parked on their connection
 * until a PUT or their timer. Every connection is bounded (one frame of
 * input at most, a write queue limit) and any protocol error closes only it. */
#include "kv_tcp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#define BUCKETS 1024
#define READ_CHUNK 65536
#define MAX_BUFFERED (MM_KV_REQ_HEADER + MM_KV_MAX_KEY + MM_KV_MAX_VALUE)
#define MAX_WRITE_QUEUE (4u << 20) /* stop reading a client that does not read replies */

typedef struct entry {
  struct entry *next;
  char *key;
  uint8_t *value;
  uint32_t len;
} entry;

typedef struct conn {
  struct conn *prev, *next;
  struct mm_kv_server *srv;
  uv_tcp_t tcp;
  uv_timer_t wait_timer;  /* a parked GET */
  uv_timer_t stall_timer; /* a partial frame */
  int handles_open, closing, reading, bye, kicked;
  uint8_t *in;
  size_t in_len, in_cap;
  int waiting;
  char wait_key[MM_KV_MAX_KEY + 1];
  struct will {
    char *key;
    uint8_t *value;
    uint32_t len;
  } wills[MM_KV_MAX_WILLS];
  int num_wills;
} conn;

struct mm_kv_server {
  uv_loop_t loop;
  uv_tcp_t listener;
  uv_async_t stop_async;
  uv_idle_t kick; /* resumes connections whose parked GET ended */
  uv_thread_t thread;
  uv_mutex_t stats_lock;
  mm_kv_server_stats stats;
  mm_kv_server_limits lim;
  entry *buckets[BUCKETS];
  int num_keys;
  size_t total_bytes;
  conn *conns;
  int num_conns, num_waiting;
  int port, stopping, kick_active;
};

/* ---- little-endian fields --------------------------------------------------- */
static uint32_t rd32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static void wr32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
  p[2] = (uint8_t)(v >> 16);
  p[3] = (uint8_t)(v >> 24);
}

/* ---- address parsing (shared with the client) --------------------------------- */
mm_err *mm_kv_parse_address(const char *text, char *host, size_t host_cap, int *port) {
  MM_ARG_CHECK(text && *text, "rendezvous address is empty (expected HOST:PORT)");
  const char *colon, *h = text;
  size_t hl;
  if (text[0] == '[') {
    const char *close = strchr(text, ']');
    MM_ARG_CHECK(close && close[1] == ':', "rendezvous address '%s': expected [ADDR]:PORT", text);
    h = text + 1;
    hl = (size_t)(close - h);
    colon = close + 1;
  } else {
    colon = strrchr(text, ':');
    MM_ARG_CHECK(colon && colon != text, "rendezvous address '%s': expected HOST:PORT", text);
    hl = (size_t)(colon - text);
    MM_ARG_CHECK(memchr(text, ':', hl) == NULL,
                 "rendezvous address '%s': write an IPv6 address as [ADDR]:PORT", text);
  }
  MM_ARG_CHECK(hl > 0 && hl < host_cap, "rendezvous address '%s': bad host part", text);
  char *end;
  long p = strtol(colon + 1, &end, 10);
  MM_ARG_CHECK(colon[1] && !*end && p >= 0 && p <= 65535,
               "rendezvous address '%s': port must be 0..65535", text);
  memcpy(host, h, hl);
  host[hl] = '\0';
  *port = (int)p;
  return NULL;
}

/* ---- the table ------------------------------------------------------------------ */
static uint32_t hash_key(const char *k) {
  uint32_t h = 2166136261u; /* FNV-1a */
  for (; *k; k++) h = (h ^ (uint8_t)*k) * 16777619u;
  return h % BUCKETS;
}
static entry **find_slot(mm_kv_server *s, const char *key) {
  entry **p = &s->buckets[hash_key(key)];
  while (*p && strcmp((*p)->key, key)) p = &(*p)->next;
  return p;
}
static void stats_keys(mm_kv_server *s) {
  uv_mutex_lock(&s->stats_lock);
  s->stats.keys = s->num_keys;
  s->stats.connections = s->num_conns;
  s->stats.waiting = s->num_waiting;
  uv_mutex_unlock(&s->stats_lock);
}

static void reply(conn *c, int status, const uint8_t *value, uint32_t len);
static void start_kick(mm_kv_server *s);

/* MM_KV_OK, MM_KV_FULL, or -1 (out of memory). Wakes parked GETs of the key. */
static int table_put(mm_kv_server *s, const char *key, const uint8_t *value, uint32_t len) {
  entry **slot = find_slot(s, key);
  size_t klen = strlen(key);
  size_t old = *slot ? (*slot)->len : 0;
  size_t need = s->total_bytes - old + len + (*slot ? 0 : klen);
  if ((!*slot && s->num_keys >= s->lim.max_keys) || need > s->lim.max_total_bytes) return MM_KV_FULL;
  uint8_t *copy = malloc(len ? len : 1);
  if (!copy) return -1;
  memcpy(copy, value, len);
  if (!*slot) {
    entry *e = calloc(1, sizeof *e);
    char *k = e ? malloc(klen + 1) : NULL;
    if (!k) {
      free(e);
      free(copy);
      return -1;
    }
    memcpy(k, key, klen + 1);
    e->key = k;
    *slot = e;
    s->num_keys++;
  }
  free((*slot)->value);
  (*slot)->value = copy;
  (*slot)->len = len;
  s->total_bytes = need;
  for (conn *w = s->conns; w; w = w->next)
    if (w->waiting && !w->closing && !strcmp(w->wait_key, key)) {
      w->waiting = 0;
      s->num_waiting--;
      uv_timer_stop(&w->wait_timer);
      reply(w, MM_KV_OK, copy, len);
      w->kicked = 1; /* its buffered frames are processed from the idle handle */
      start_kick(s);
    }
  stats_keys(s);
  return MM_KV_OK;
}

static int table_del(mm_kv_server *s, const char *key) {
  entry **slot = find_slot(s, key), *e = *slot;
  if (!e) return 0;
  *slot = e->next;
  s->total_bytes -= strlen(e->key) + e->len;
  s->num_keys--;
  free(e->key);
  free(e->value);
  free(e);
  stats_keys(s);
  return 1;
}

/* ---- connections ---------------------------------------------------------------- */
typedef struct {
  uv_write_t req;
  conn *c;
  uint8_t data[];
} write_req;

static void update_reading(conn *c);
static void process(conn *c);

static void clear_wills(conn *c) {
  for (int i = 0; i < c->num_wills; i++) {
    free(c->wills[i].key);
    free(c->wills[i].value);
  }
  c->num_wills = 0;
}

/* Adds or replaces the will for key: MM_KV_OK, MM_KV_FULL, or -1. */
static int add_will(conn *c, const char *key, const uint8_t *value, uint32_t len) {
  int i = 0;
  while (i < c->num_wills && strcmp(c->wills[i].key, key)) i++;
  if (i == MM_KV_MAX_WILLS) return MM_KV_FULL;
  uint8_t *v = malloc(len ? len : 1);
  char *k = i == c->num_wills ? strdup(key) : c->wills[i].key;
  if (!v || !k) {
    free(v);
    if (i == c->num_wills) free(k);
    return -1;
  }
  memcpy(v, value, len);
  if (i == c->num_wills) c->num_wills++;
  else free(c->wills[i].value);
  c->wills[i] = (struct will){k, v, len};
  return MM_KV_OK;
}

static void on_handle_closed(uv_handle_t *h) {
  conn *c = h->data;
  if (--c->handles_open) return;
  mm_kv_server *s = c->srv;
  if (c->prev) c->prev->next = c->next;
  else s->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  s->num_conns--;
  stats_keys(s);
  free(c->in);
  clear_wills(c);
  free(c);
}

static void conn_close(conn *c, int malformed) {
  if (c->closing) return;
  c->closing = 1;
  mm_kv_server *s = c->srv;
  if (c->waiting) {
    c->waiting = 0;
    s->num_waiting--;
    stats_keys(s);
  }
  if (malformed) {
    uv_mutex_lock(&s->stats_lock);
    s->stats.malformed++;
    uv_mutex_unlock(&s->stats_lock);
  }
  if (c->num_wills && !c->bye && !s->stopping) {
    uv_mutex_lock(&s->stats_lock);
    s->stats.wills_fired += (uint64_t)c->num_wills;
    uv_mutex_unlock(&s->stats_lock);
    for (int i = 0; i < c->num_wills; i++) /* FULL: nothing to do */
      table_put(s, c->wills[i].key, c->wills[i].value, c->wills[i].len);
  }
  uv_close((uv_handle_t *)&c->tcp, on_handle_closed);
  uv_close((uv_handle_t *)&c->wait_timer, on_handle_closed);
  uv_close((uv_handle_t *)&c->stall_timer, on_handle_closed);
}

static void on_written(uv_write_t *req, int status) {
  write_req *w = (write_req *)req;
  conn *c = w->c;
  free(w);
  if (status < 0) conn_close(c, 0);
  else process(c);
}

static void reply(conn *c, int status, const uint8_t *value, uint32_t len) {
  if (c->closing) return;
  write_req *w = malloc(sizeof *w + MM_KV_REPLY_HEADER + len);
  if (!w) {
    conn_close(c, 0);
    return;
  }
  w->c = c;
  wr32(w->data, MM_KV_MAGIC);
  w->data[4] = (uint8_t)status;
  w->data[5] = w->data[6] = w->data[7] = 0;
  wr32(w->data + 8, len);
  if (len) memcpy(w->data + MM_KV_REPLY_HEADER, value, len);
  uv_buf_t b = uv_buf_init((char *)w->data, MM_KV_REPLY_HEADER + len);
  if (uv_write(&w->req, (uv_stream_t *)&c->tcp, &b, 1, on_written)) {
    free(w);
    conn_close(c, 0);
  }
}

static void on_wait_timeout(uv_timer_t *t) {
  conn *c = t->data;
  if (!c->waiting || c->closing) return;
  c->waiting = 0;
  c->srv->num_waiting--;
  stats_keys(c->srv);
  reply(c, MM_KV_NOT_FOUND, NULL, 0);
  process(c);
}

static void on_stall(uv_timer_t *t) { conn_close(t->data, 1); }

static void on_kick(uv_idle_t *h) {
  mm_kv_server *s = h->data;
  int more = 0;
  for (conn *c = s->conns; c; c = c->next)
    if (c->kicked) {
      c->kicked = 0;
      if (!c->closing) process(c); /* may kick others (more set below) */
    }
  for (conn *c = s->conns; c; c = c->next) more |= c->kicked;
  if (!more) {
    uv_idle_stop(h);
    s->kick_active = 0;
  }
}
static void start_kick(mm_kv_server *s) {
  if (s->kick_active || s->stopping) return;
  s->kick_active = 1;
  uv_idle_start(&s->kick, on_kick);
}

/* Handles one complete, validated frame. Returns 0, or -1 when the frame is
 * malformed (the caller closes). */
static int handle(conn *c, int op, const char *key, const uint8_t *value, uint32_t len,
                  uint32_t timeout_ms) {
  mm_kv_server *s = c->srv;
  switch (op) {
    case MM_KV_OP_HELLO:
      reply(c, MM_KV_OK, NULL, 0);
      return 0;
    case MM_KV_OP_PUT: {
      int r = table_put(s, key, value, len);
      if (r < 0) return -1;
      reply(c, r, NULL, 0);
      return 0;
    }
    case MM_KV_OP_GET: {
      entry *e = *find_slot(s, key);
      if (e) reply(c, MM_KV_OK, e->value, e->len);
      else if (timeout_ms == 0) reply(c, MM_KV_NOT_FOUND, NULL, 0);
      else {
        c->waiting = 1;
        s->num_waiting++;
        stats_keys(s);
        snprintf(c->wait_key, sizeof c->wait_key, "%s", key);
        uv_timer_start(&c->wait_timer, on_wait_timeout, timeout_ms, 0);
      }
      return 0;
    }
    case MM_KV_OP_DEL:
      reply(c, table_del(s, key) ? MM_KV_OK : MM_KV_NOT_FOUND, NULL, 0);
      return 0;
    case MM_KV_OP_WILL: {
      int r = MM_KV_OK;
      if (key[0]) r = add_will(c, key, value, len);
      else clear_wills(c);
      if (r < 0) return -1;
      reply(c, r, NULL, 0);
      return 0;
    }
    case MM_KV_OP_BYE:
      c->bye = 1;
      clear_wills(c);
      reply(c, MM_KV_OK, NULL, 0);
      return 0;
  }
  return -1;
}

/* Checks a header; returns the frame's total length, or 0 when malformed. */
static size_t check_header(const conn *c, const uint8_t *h) {
  uint32_t op = h[4], klen = rd32(h + 8), vlen = rd32(h + 12), tmo = rd32(h + 16);
  if (rd32(h) != MM_KV_MAGIC || h[5] || h[6] || h[7] || c->bye) return 0;
  if (klen > MM_KV_MAX_KEY || vlen > MM_KV_MAX_VALUE) return 0;
  switch (op) {
    case MM_KV_OP_HELLO:
    case MM_KV_OP_BYE:
      if (klen || vlen || tmo) return 0;
      break;
    case MM_KV_OP_PUT:
      if (!klen || tmo) return 0;
      break;
    case MM_KV_OP_GET:
      if (!klen || vlen || tmo > MM_KV_MAX_TIMEOUT_MS) return 0;
      break;
    case MM_KV_OP_DEL:
      if (!klen || vlen || tmo) return 0;
      break;
    case MM_KV_OP_WILL:
      if (tmo || vlen > MM_KV_MAX_WILL || (!klen && vlen)) return 0;
      break;
    default:
      return 0;
  }
  return MM_KV_REQ_HEADER + (size_t)klen + vlen;
}

static int write_backlog(conn *c) {
  return uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) >= MAX_WRITE_QUEUE;
}

/* Serves the complete frames buffered, in order, until a GET parks or the
 * replies pile up (a client that does not read: resumed by on_written). */
static void process(conn *c) {
  size_t off = 0;
  while (!c->closing && !c->waiting && !write_backlog(c) && c->in_len - off >= MM_KV_REQ_HEADER) {
    const uint8_t *h = c->in + off;
    size_t total = check_header(c, h);
    if (!total) {
      conn_close(c, 1);
      return;
    }
    if (c->in_len - off < total) break;
    uint32_t klen = rd32(h + 8), vlen = rd32(h + 12);
    char key[MM_KV_MAX_KEY + 1];
    memcpy(key, h + MM_KV_REQ_HEADER, klen);
    key[klen] = '\0';
    if (strlen(key) != klen || handle(c, h[4], key, h + MM_KV_REQ_HEADER + klen, vlen, rd32(h + 16))) {
      conn_close(c, 1);
      return;
    }
    off += total;
  }
  if (c->closing) return;
  if (off) {
    memmove(c->in, c->in + off, c->in_len - off);
    c->in_len -= off;
    uv_timer_stop(&c->stall_timer); /* progress: the next frame gets its own deadline */
  }
  if (c->in_len == 0 && c->in_cap > READ_CHUNK) { /* give back a large frame's buffer */
    free(c->in);
    c->in = NULL;
    c->in_cap = 0;
  }
  /* What stays buffered (a partial frame, or frames held back because the
   * client does not read its replies) must move within frame_timeout_ms. */
  if (c->in_len && !c->waiting) {
    if (!uv_is_active((uv_handle_t *)&c->stall_timer))
      uv_timer_start(&c->stall_timer, on_stall, (uint64_t)c->srv->lim.frame_timeout_ms, 0);
  } else {
    uv_timer_stop(&c->stall_timer);
  }
  update_reading(c);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  conn *c = h->data;
  if (c->in_cap - c->in_len < READ_CHUNK && c->in_cap < MAX_BUFFERED) {
    size_t cap = c->in_cap ? c->in_cap * 2 : READ_CHUNK;
    if (cap < c->in_len + READ_CHUNK) cap = c->in_len + READ_CHUNK;
    if (cap > MAX_BUFFERED) cap = MAX_BUFFERED;
    uint8_t *p = realloc(c->in, cap);
    if (p) {
      c->in = p;
      c->in_cap = cap;
    }
  }
  *buf = uv_buf_init((char *)c->in + c->in_len, (unsigned)(c->in_cap - c->in_len));
  if (!c->in) buf->len = 0;
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf) {
  conn *c = st->data;
  if (n > 0) {
    c->in_len += (size_t)n;
    process(c);
  } else if (n == UV_ENOBUFS && c->waiting) {
    uv_read_stop(st); /* input full while a GET is parked: resume when it ends */
    c->reading = 0;
  } else if (n < 0) {
    /* EOF in the middle of a frame is a truncated frame. */
    conn_close(c, c->in_len > 0 && !c->waiting);
  }
}

static void update_reading(conn *c) {
  if (c->closing) return;
  int want = c->in_len < MAX_BUFFERED && !write_backlog(c);
  if (want && !c->reading) {
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) == 0) c->reading = 1;
  } else if (!want && c->reading) {
    uv_read_stop((uv_stream_t *)&c->tcp);
    c->reading = 0;
  }
}

static void on_connection(uv_stream_t *server, int status) {
  mm_kv_server *s = server->data;
  if (status < 0 || s->stopping) return;
  conn *c = calloc(1, sizeof *c);
  if (!c) return;
  c->srv = s;
  uv_tcp_init(&s->loop, &c->tcp);
  uv_timer_init(&s->loop, &c->wait_timer);
  uv_timer_init(&s->loop, &c->stall_timer);
  c->tcp.data = c->wait_timer.data = c->stall_timer.data = c;
  c->handles_open = 3;
  c->next = s->conns;
  if (s->conns) s->conns->prev = c;
  s->conns = c;
  s->num_conns++;
  int reject = s->num_conns > s->lim.max_connections;
  uv_mutex_lock(&s->stats_lock);
  if (reject) s->stats.rejected++;
  else s->stats.accepted++;
  uv_mutex_unlock(&s->stats_lock);
  stats_keys(s);
  if (uv_accept(server, (uv_stream_t *)&c->tcp) || reject) {
    conn_close(c, 0);
    return;
  }
  uv_tcp_nodelay(&c->tcp, 1);
  update_reading(c);
}

/* ---- lifecycle ------------------------------------------------------------------- */
static void close_quietly(uv_handle_t *h) { (void)h; }

static void on_stop(uv_async_t *a) {
  mm_kv_server *s = a->data;
  s->stopping = 1;
  for (conn *c = s->conns; c; c = c->next) conn_close(c, 0);
  uv_close((uv_handle_t *)&s->listener, close_quietly);
  uv_close((uv_handle_t *)&s->kick, close_quietly);
  uv_close((uv_handle_t *)&s->stop_async, close_quietly);
}

static void run_loop(void *arg) {
  mm_kv_server *s = arg;
  uv_run(&s->loop, UV_RUN_DEFAULT);
}

static void free_table(mm_kv_server *s) {
  for (int b = 0; b < BUCKETS; b++)
    for (entry *e = s->buckets[b], *n; e; e = n) {
      n = e->next;
      free(e->key);
      free(e->value);
      free(e);
    }
}

mm_err *mm_kv_server_start(const char *host, int port, const mm_kv_server_limits *limits,
                           mm_kv_server **out) {
  *out = NULL;
  MM_ARG_CHECK(host && port >= 0 && port <= 65535, "key-value server: bad address");
  mm_kv_server *s = calloc(1, sizeof *s);
  if (!s) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "key-value server: out of memory");
  if (limits) s->lim = *limits;
  if (s->lim.max_keys <= 0) s->lim.max_keys = 4096;
  if (s->lim.max_connections <= 0) s->lim.max_connections = 256;
  if (s->lim.max_total_bytes == 0) s->lim.max_total_bytes = 64u << 20;
  if (s->lim.frame_timeout_ms <= 0) s->lim.frame_timeout_ms = 10000;
  int r = uv_loop_init(&s->loop);
  if (r) {
    free(s);
    return mm_error(MEGAMOE_CODE_INTERNAL, "key-value server: uv_loop_init: %s", uv_strerror(r));
  }
  uv_mutex_init(&s->stats_lock);
  char service[16];
  snprintf(service, sizeof service, "%d", port);
  struct addrinfo hints;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  uv_getaddrinfo_t gai;
  mm_err *err = NULL;
  r = uv_getaddrinfo(&s->loop, &gai, NULL, host, service, &hints); /* synchronous */
  if (r) {
    err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "key-value server: cannot resolve '%s': %s", host,
                   uv_strerror(r));
    goto fail_loop;
  }
  uv_tcp_init(&s->loop, &s->listener);
  s->listener.data = s;
  r = uv_tcp_bind(&s->listener, gai.addrinfo->ai_addr, 0);
  uv_freeaddrinfo(gai.addrinfo);
  if (!r) r = uv_listen((uv_stream_t *)&s->listener, 128, on_connection);
  if (r) {
    err = mm_error(MEGAMOE_CODE_UNAVAILABLE, "key-value server: cannot listen on %s:%d: %s", host,
                   port, uv_strerror(r));
    uv_close((uv_handle_t *)&s->listener, close_quietly);
    goto fail_loop;
  }
  struct sockaddr_storage sa;
  int salen = sizeof sa;
  uv_tcp_getsockname(&s->listener, (struct sockaddr *)&sa, &salen);
  s->port = sa.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&sa)->sin6_port)
                                     : ntohs(((struct sockaddr_in *)&sa)->sin_port);
  uv_async_init(&s->loop, &s->stop_async, on_stop);
  s->stop_async.data = s;
  uv_idle_init(&s->loop, &s->kick);
  s->kick.data = s;
  r = uv_thread_create(&s->thread, run_loop, s);
  if (r) {
    err = mm_error(MEGAMOE_CODE_INTERNAL, "key-value server: cannot start its thread: %s",
                   uv_strerror(r));
    uv_close((uv_handle_t *)&s->listener, close_quietly);
    uv_close((uv_handle_t *)&s->stop_async, close_quietly);
    uv_close((uv_handle_t *)&s->kick, close_quietly);
    goto fail_loop;
  }
  *out = s;
  return NULL;
fail_loop:
  uv_run(&s->loop, UV_RUN_DEFAULT); /* completes the closes */
  uv_loop_close(&s->loop);
  uv_mutex_destroy(&s->stats_lock);
  free(s);
  return err;
}

int mm_kv_server_port(const mm_kv_server *s) { return s ? s->port : 0; }

void mm_kv_server_get_stats(mm_kv_server *s, mm_kv_server_stats *out) {
  uv_mutex_lock(&s->stats_lock);
  *out = s->stats;
  uv_mutex_unlock(&s->stats_lock);
}

void mm_kv_server_stop(mm_kv_server *s) {
  if (!s) return;
  uv_async_send(&s->stop_async);
  uv_thread_join(&s->thread);
  uv_loop_close(&s->loop);
  free_table(s);
  uv_mutex_destroy(&s->stats_lock);
  free(s);
}

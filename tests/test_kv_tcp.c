/* test_kv_tcp.c -- the TCP key-value store and the barrier on it, in one
 * process: a server on 127.0.0.1 (ephemeral ports) and clients in threads.
 * Covers the get/put semantics of kv_store.h, waiting gets, timeouts, limits,
 * hostile frames (garbage, oversized lengths, truncation, fuzzed headers,
 * readers that never read), late servers, ports in use and clean shutdown. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "harness.h"
#include "kv_barrier.h"
#include "kv_tcp.h"

#define HOST "127.0.0.1"

static double ms_since(uint64_t t0) { return (double)(uv_hrtime() - t0) / 1e6; }

static mm_kv_server *start(const mm_kv_server_limits *lim) {
  mm_kv_server *s = NULL;
  CHECK_OK(mm_kv_server_start(HOST, 0, lim, &s));
  return s;
}
static mm_kv_client *connect_to(mm_kv_server *s) {
  mm_kv_client *c = NULL;
  CHECK_OK(mm_kv_client_connect(HOST, mm_kv_server_port(s), 5000, &c));
  return c;
}
static void fill_random(uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)mm_test_rand_u64();
}
/* Polls the server's stats until cond holds (the server thread updates them). */
#define WAIT_STATS(s, st, cond)                                   \
  do {                                                            \
    for (int i_ = 0; i_ < 500; i_++) {                            \
      mm_kv_server_get_stats((s), &(st));                         \
      if (cond) break;                                            \
      usleep(10000);                                              \
    }                                                             \
    CHECK(cond);                                                  \
  } while (0)

/* ---- raw sockets, to speak the protocol badly --------------------------------- */
static int raw_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  inet_pton(AF_INET, HOST, &a.sin_addr);
  if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
    close(fd);
    return -1;
  }
  return fd;
}
static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static size_t frame(uint8_t *buf, int op, const char *key, size_t klen, const void *val, size_t vlen,
                    uint32_t tmo) {
  put32(buf, MM_KV_MAGIC);
  buf[4] = (uint8_t)op;
  buf[5] = buf[6] = buf[7] = 0;
  put32(buf + 8, (uint32_t)klen);
  put32(buf + 12, (uint32_t)vlen);
  put32(buf + 16, tmo);
  if (klen) memcpy(buf + MM_KV_REQ_HEADER, key, klen);
  if (vlen) memcpy(buf + MM_KV_REQ_HEADER + klen, val, vlen);
  return MM_KV_REQ_HEADER + klen + vlen;
}
/* 1 when the server closed the connection within ms (reading and dropping
 * whatever replies come first), 0 when it stayed open. */
static int closed_within(int fd, int ms) {
  uint64_t t0 = uv_hrtime();
  for (;;) {
    int left = ms - (int)ms_since(t0);
    if (left <= 0) return 0;
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, left) <= 0) continue;
    uint8_t sink[65536];
    ssize_t r = recv(fd, sink, sizeof sink, 0);
    if (r <= 0) return 1;
  }
}
/* Reads one reply header: its status, or -1 when the connection closed. */
static int raw_reply(int fd, uint32_t *vlen) {
  uint8_t h[MM_KV_REPLY_HEADER];
  size_t got = 0;
  while (got < sizeof h) {
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 5000) <= 0) return -1;
    ssize_t r = recv(fd, h + got, sizeof h - got, 0);
    if (r <= 0) return -1;
    got += (size_t)r;
  }
  *vlen = (uint32_t)h[8] | (uint32_t)h[9] << 8 | (uint32_t)h[10] << 16 | (uint32_t)h[11] << 24;
  return h[4];
}

/* ---- tests ------------------------------------------------------------------------ */
static void test_put_get(void) {
  mm_kv_server *s = start(NULL);
  mm_kv_client *c = connect_to(s);
  if (!s || !c) return;
  char buf[64];
  size_t len = 99;
  CHECK_OK(mm_kv_client_put(c, "a", "hello", 5));
  CHECK_OK(mm_kv_client_get(c, "a", buf, sizeof buf, &len, 0));
  CHECK(len == 5 && !memcmp(buf, "hello", 5));
  CHECK_OK(mm_kv_client_put(c, "a", "hi", 2)); /* replaces */
  CHECK_OK(mm_kv_client_get(c, "a", buf, sizeof buf, &len, 100));
  CHECK(len == 2 && !memcmp(buf, "hi", 2));
  CHECK_OK(mm_kv_client_put(c, "empty", NULL, 0));
  CHECK_OK(mm_kv_client_get(c, "empty", buf, sizeof buf, &len, 0));
  CHECK(len == 0);
  /* a small buffer gets the head and the full length, like kv_store.h */
  CHECK_OK(mm_kv_client_put(c, "long", "0123456789", 10));
  memset(buf, 'x', sizeof buf);
  CHECK_OK(mm_kv_client_get(c, "long", buf, 4, &len, 0));
  CHECK(len == 10 && !memcmp(buf, "0123", 4) && buf[4] == 'x');
  CHECK_OK(mm_kv_client_get(c, "long", NULL, 0, &len, 0));
  CHECK(len == 10);
  int existed = -1;
  CHECK_OK(mm_kv_client_del(c, "long", &existed));
  CHECK(existed == 1);
  CHECK_OK(mm_kv_client_del(c, "long", &existed));
  CHECK(existed == 0);
  CHECK_ERR(mm_kv_client_get(c, "long", buf, sizeof buf, &len, 0), MEGAMOE_CODE_DEADLINE_EXCEEDED);
  /* the connection survives a miss */
  CHECK_OK(mm_kv_client_get(c, "a", buf, sizeof buf, &len, 0));
  mm_kv_server_stats st;
  WAIT_STATS(s, st, st.keys == 2 && st.connections == 1);
  mm_kv_client_close(c);
  WAIT_STATS(s, st, st.connections == 0);
  CHECK(st.malformed == 0 && st.wills_fired == 0);
  mm_kv_server_stop(s);
}

typedef struct {
  int port, timeout_ms;
  const char *key;
  char value[64];
  size_t len;
  mm_err *err;
  double ms;
} getter;
static void getter_main(void *arg) {
  getter *g = arg;
  mm_kv_client *c = NULL;
  g->err = mm_kv_client_connect(HOST, g->port, 5000, &c);
  if (g->err) return;
  uint64_t t0 = uv_hrtime();
  g->err = mm_kv_client_get(c, g->key, g->value, sizeof g->value, &g->len, g->timeout_ms);
  g->ms = ms_since(t0);
  mm_kv_client_close(c);
}

static void test_get_waits_for_put(void) {
  mm_kv_server *s = start(NULL);
  mm_kv_client *c = connect_to(s);
  if (!s || !c) return;
  /* three waiters on one key, one on another key that never comes */
  getter g[4];
  uv_thread_t t[4];
  for (int i = 0; i < 4; i++) {
    g[i] = (getter){.port = mm_kv_server_port(s), .timeout_ms = i == 3 ? 600 : 10000,
                    .key = i == 3 ? "never" : "late"};
    uv_thread_create(&t[i], getter_main, &g[i]);
  }
  mm_kv_server_stats st;
  WAIT_STATS(s, st, st.waiting == 4); /* every getter is parked */
  usleep(100000);
  CHECK_OK(mm_kv_client_put(c, "late", "value", 5));
  for (int i = 0; i < 4; i++) uv_thread_join(&t[i]);
  for (int i = 0; i < 3; i++) {
    CHECK_OK(g[i].err);
    CHECK(g[i].len == 5 && !memcmp(g[i].value, "value", 5));
    CHECK_MSG(g[i].ms >= 90 && g[i].ms < 5000, "waiter %d returned after %.0f ms", i, g[i].ms);
  }
  CHECK_ERR(g[3].err, MEGAMOE_CODE_DEADLINE_EXCEEDED);
  g[3].err = NULL;
  CHECK_MSG(g[3].ms >= 550 && g[3].ms < 5000, "timeout after %.0f ms", g[3].ms);
  mm_kv_client_close(c);
  mm_kv_server_stop(s);
}

static void test_get_timeout(void) {
  mm_kv_server *s = start(NULL);
  mm_kv_client *c = connect_to(s);
  if (!s || !c) return;
  int waits[3] = {0, 50, 400};
  for (int i = 0; i < 3; i++) {
    uint64_t t0 = uv_hrtime();
    size_t len;
    char buf[8];
    CHECK_ERR(mm_kv_client_get(c, "missing", buf, sizeof buf, &len, waits[i]),
              MEGAMOE_CODE_DEADLINE_EXCEEDED);
    double ms = ms_since(t0);
    CHECK_MSG(ms >= waits[i] * 0.9 && ms < waits[i] + 2000, "timeout %d ms took %.0f ms", waits[i], ms);
  }
  mm_kv_client_close(c);
  mm_kv_server_stop(s);
}

static void test_large_values_and_bounds(void) {
  mm_kv_server *s = start(NULL);
  mm_kv_client *c = connect_to(s);
  if (!s || !c) return;
  uint8_t *big = malloc(MM_KV_MAX_VALUE + 1), *back = malloc(MM_KV_MAX_VALUE + 1);
  size_t sizes[] = {1, 4095, 65536, 65537, 300001, MM_KV_MAX_VALUE};
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    fill_random(big, sizes[i]);
    char key[32];
    snprintf(key, sizeof key, "big/%zu", i);
    CHECK_OK(mm_kv_client_put(c, key, big, sizes[i]));
    size_t len = 0;
    memset(back, 0, sizes[i]);
    CHECK_OK(mm_kv_client_get(c, key, back, MM_KV_MAX_VALUE + 1, &len, 0));
    CHECK(len == sizes[i] && !memcmp(big, back, sizes[i]));
  }
  CHECK_ERR(mm_kv_client_put(c, "too-big", big, MM_KV_MAX_VALUE + 1), MEGAMOE_CODE_INVALID_ARGUMENT);
  char key[MM_KV_MAX_KEY + 2];
  memset(key, 'k', sizeof key);
  key[MM_KV_MAX_KEY] = '\0';
  CHECK_OK(mm_kv_client_put(c, key, "x", 1)); /* 256 bytes: the limit */
  key[MM_KV_MAX_KEY] = 'k';
  key[MM_KV_MAX_KEY + 1] = '\0';
  CHECK_ERR(mm_kv_client_put(c, key, "x", 1), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_kv_client_put(c, "", "x", 1), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_kv_client_put(c, NULL, "x", 1), MEGAMOE_CODE_INVALID_ARGUMENT);
  /* still usable after the refusals (they never reached the wire) */
  size_t len;
  CHECK_OK(mm_kv_client_get(c, "big/0", back, 8, &len, 0));
  free(big);
  free(back);
  mm_kv_client_close(c);
  mm_kv_server_stop(s);
}

static void test_limits(void) {
  mm_kv_server_limits lim = {.max_keys = 50, .max_total_bytes = 1 << 16};
  mm_kv_server *s = start(&lim);
  mm_kv_client *c = connect_to(s);
  if (!s || !c) return;
  char key[32];
  for (int i = 0; i < 50; i++) {
    snprintf(key, sizeof key, "k%d", i);
    CHECK_OK(mm_kv_client_put(c, key, "v", 1));
  }
  CHECK_ERR(mm_kv_client_put(c, "one-more", "v", 1), MEGAMOE_CODE_RESOURCE_EXHAUSTED);
  CHECK_OK(mm_kv_client_put(c, "k7", "replaced", 8)); /* replacing needs no new key */
  CHECK_OK(mm_kv_client_del(c, "k0", NULL));
  CHECK_OK(mm_kv_client_put(c, "one-more", "v", 1));
  /* the byte limit: a 70 KB value does not fit in 64 KiB, a 1 KB one does */
  uint8_t *v = calloc(1, 70000);
  CHECK_ERR(mm_kv_client_put(c, "k1", v, 70000), MEGAMOE_CODE_RESOURCE_EXHAUSTED);
  CHECK_OK(mm_kv_client_put(c, "k1", v, 1000));
  size_t len = 0;
  char buf[16];
  CHECK_OK(mm_kv_client_get(c, "k7", buf, sizeof buf, &len, 0));
  CHECK(len == 8 && !memcmp(buf, "replaced", 8));
  free(v);
  mm_kv_client_close(c);
  mm_kv_server_stop(s);
}

typedef struct {
  int port, id, nthreads, nkeys;
  int bad;
  mm_err *err;
} worker;
static void worker_main(void *arg) {
  worker *w = arg;
  mm_kv_client *c = NULL;
  if ((w->err = mm_kv_client_connect(HOST, w->port, 5000, &c))) return;
  char key[64], val[64], got[64];
  for (int i = 0; i < w->nkeys && !w->err; i++) {
    snprintf(key, sizeof key, "w%d/k%d", w->id, i);
    int n = snprintf(val, sizeof val, "value %d of %d", i, w->id);
    w->err = mm_kv_client_put(c, key, val, (size_t)n);
  }
  /* every other worker's keys, waiting for the ones not there yet */
  for (int o = 0; o < w->nthreads && !w->err; o++)
    for (int i = 0; i < w->nkeys && !w->err; i += 7) {
      snprintf(key, sizeof key, "w%d/k%d", o, i);
      int n = snprintf(val, sizeof val, "value %d of %d", i, o);
      size_t len = 0;
      w->err = mm_kv_client_get(c, key, got, sizeof got, &len, 10000);
      if (!w->err && (len != (size_t)n || memcmp(got, val, len))) w->bad++;
    }
  mm_kv_client_close(c);
}

static void test_many_clients_many_keys(void) {
  mm_kv_server *s = start(NULL);
  if (!s) return;
  enum { N = 8 };
  worker w[N];
  uv_thread_t t[N];
  uint64_t t0 = uv_hrtime();
  for (int i = 0; i < N; i++) {
    w[i] = (worker){.port = mm_kv_server_port(s), .id = i, .nthreads = N, .nkeys = 400};
    uv_thread_create(&t[i], worker_main, &w[i]);
  }
  for (int i = 0; i < N; i++) {
    uv_thread_join(&t[i]);
    CHECK_OK(w[i].err);
    CHECK_EQ_INT(w[i].bad, 0);
  }
  printf("# %d clients, %d keys, %.0f ms\n", N, N * 400, ms_since(t0));
  mm_kv_server_stats st;
  WAIT_STATS(s, st, st.keys == N * 400 && st.connections == 0);
  CHECK(st.malformed == 0);
  mm_kv_server_stop(s);
}

static void test_malformed_frames(void) {
  mm_kv_server_limits lim = {.frame_timeout_ms = 300};
  mm_kv_server *s = start(&lim);
  mm_kv_client *good = connect_to(s);
  if (!s || !good) return;
  CHECK_OK(mm_kv_client_put(good, "k", "v", 1));
  int port = mm_kv_server_port(s);
  uint8_t buf[MM_KV_REQ_HEADER + MM_KV_MAX_KEY + 64];
  int expected = 0;
  mm_kv_server_stats st;
  /* garbage */
  int fd = raw_connect(port);
  fill_random(buf, 64);
  buf[0] ^= 0x5A; /* never the magic */
  send(fd, buf, 64, MSG_NOSIGNAL);
  CHECK(closed_within(fd, 3000));
  close(fd);
  expected++;
  /* headers that break one rule each (sent whole, body included) */
  struct {
    const char *what;
    int op;
    uint32_t klen, vlen, tmo;
    int byte, value; /* header byte to overwrite */
  } bad[] = {
      {"unknown op", 9, 1, 0, 0, -1, 0},
      {"op 0", 0, 1, 0, 0, -1, 0},
      {"reserved byte", MM_KV_OP_PUT, 1, 1, 0, 5, 1},
      {"reserved half", MM_KV_OP_PUT, 1, 1, 0, 7, 0x80},
      {"empty key", MM_KV_OP_PUT, 0, 1, 0, -1, 0},
      {"key too long", MM_KV_OP_PUT, MM_KV_MAX_KEY + 1, 0, 0, -1, 0},
      {"GET with a value", MM_KV_OP_GET, 1, 1, 0, -1, 0},
      {"GET timeout too long", MM_KV_OP_GET, 1, 0, MM_KV_MAX_TIMEOUT_MS + 1, -1, 0},
      {"PUT with a timeout", MM_KV_OP_PUT, 1, 1, 5, -1, 0},
      {"HELLO with a key", MM_KV_OP_HELLO, 1, 0, 0, -1, 0},
      {"DEL with a value", MM_KV_OP_DEL, 1, 2, 0, -1, 0},
      {"will value without key", MM_KV_OP_WILL, 0, 3, 0, -1, 0},
      {"will too long", MM_KV_OP_WILL, 1, MM_KV_MAX_WILL + 1, 0, -1, 0},
  };
  char key[MM_KV_MAX_KEY + 2];
  memset(key, 'q', sizeof key);
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    fd = raw_connect(port);
    uint32_t vsend = bad[i].vlen > 32 ? 32 : bad[i].vlen;
    size_t n = frame(buf, bad[i].op, key, bad[i].klen, key, vsend, bad[i].tmo);
    put32(buf + 12, bad[i].vlen);
    if (bad[i].byte >= 0) buf[bad[i].byte] = (uint8_t)bad[i].value;
    send(fd, buf, n, MSG_NOSIGNAL);
    CHECK_MSG(closed_within(fd, 3000), "%s: connection not closed", bad[i].what);
    close(fd);
    expected++;
  }
  /* a key with a NUL inside */
  fd = raw_connect(port);
  send(fd, buf, frame(buf, MM_KV_OP_PUT, "a\0b", 3, "v", 1, 0), MSG_NOSIGNAL);
  CHECK(closed_within(fd, 3000));
  close(fd);
  expected++;
  /* oversized value length: closed on the header, the body is never awaited */
  fd = raw_connect(port);
  size_t n = frame(buf, MM_KV_OP_PUT, "k", 1, NULL, 0, 0);
  put32(buf + 12, MM_KV_MAX_VALUE + 1);
  send(fd, buf, n, MSG_NOSIGNAL);
  CHECK(closed_within(fd, 3000));
  close(fd);
  expected++;
  put32(buf + 12, 0xFFFFFFFFu);
  fd = raw_connect(port);
  send(fd, buf, n, MSG_NOSIGNAL);
  CHECK(closed_within(fd, 3000));
  close(fd);
  expected++;
  /* truncated: half a header, then the client leaves */
  fd = raw_connect(port);
  frame(buf, MM_KV_OP_PUT, "k", 1, "v", 1, 0);
  send(fd, buf, 9, MSG_NOSIGNAL);
  usleep(50000);
  close(fd);
  expected++;
  /* truncated: a header and part of its 1000-byte value, then silence */
  fd = raw_connect(port);
  n = frame(buf, MM_KV_OP_PUT, "k", 1, NULL, 0, 0);
  put32(buf + 12, 1000);
  send(fd, buf, n + 10, MSG_NOSIGNAL);
  uint64_t t0 = uv_hrtime();
  CHECK(closed_within(fd, 5000));
  CHECK_MSG(ms_since(t0) >= 200, "stalled frame closed after %.0f ms (timeout 300)", ms_since(t0));
  close(fd);
  expected++;
  /* a frame after BYE */
  fd = raw_connect(port);
  n = frame(buf, MM_KV_OP_BYE, NULL, 0, NULL, 0, 0);
  n += frame(buf + n, MM_KV_OP_HELLO, NULL, 0, NULL, 0, 0);
  send(fd, buf, n, MSG_NOSIGNAL);
  uint32_t vlen;
  CHECK_EQ_INT(raw_reply(fd, &vlen), MM_KV_OK);
  CHECK(closed_within(fd, 3000));
  close(fd);
  expected++;
  WAIT_STATS(s, st, st.malformed == (uint64_t)expected);
  /* fuzz: valid frames with one random byte changed; each is
   * either served or closes its connection, and the server lives on */
  int served = 0, closed = 0;
  for (int i = 0; i < 200; i++) {
    fd = raw_connect(port);
    static const int ops[] = {MM_KV_OP_PUT, MM_KV_OP_GET, MM_KV_OP_DEL, MM_KV_OP_HELLO};
    int op = ops[i % 4];
    n = frame(buf, op, op == MM_KV_OP_HELLO ? "" : "fz", op == MM_KV_OP_HELLO ? 0 : 2, "val",
              op == MM_KV_OP_PUT ? 3 : 0, 0);
    /* one random byte anywhere: the header (mostly fatal) or the body */
    buf[mm_test_rand_u64() % n] = (uint8_t)mm_test_rand_u64();
    send(fd, buf, n, MSG_NOSIGNAL);
    shutdown(fd, SHUT_WR); /* an incomplete frame ends as truncated */
    int st_ = raw_reply(fd, &vlen);
    if (st_ >= 0) served++;
    else closed++;
    close(fd);
  }
  printf("# fuzz: %d served, %d closed\n", served, closed);
  CHECK(served + closed == 200 && closed > 0 && served > 0);
  size_t len;
  char v[4];
  CHECK_OK(mm_kv_client_get(good, "k", v, sizeof v, &len, 0));
  CHECK(len == 1 && v[0] == 'v');
  mm_kv_client_close(good);
  WAIT_STATS(s, st, st.connections == 0);
  mm_kv_server_stop(s);
}

/* A client that pipelines GETs of a 1 MiB value and never reads: the server
 * stops reading it (bounded write queue) and keeps serving the others. */
static void test_reader_that_never_reads(void) {
  mm_kv_server *s = start(NULL);
  mm_kv_client *c = connect_to(s);
  if (!s || !c) return;
  uint8_t *big = calloc(1, MM_KV_MAX_VALUE);
  CHECK_OK(mm_kv_client_put(c, "big", big, MM_KV_MAX_VALUE));
  int fd = raw_connect(mm_kv_server_port(s));
  int flags = 1;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &flags, sizeof flags); /* tiny receive window */
  uint8_t req[64];
  size_t n = frame(req, MM_KV_OP_GET, "big", 3, NULL, 0, 0);
  struct pollfd p = {fd, POLLOUT, 0};
  int sent = 0;
  struct rusage ru0, ru1;
  getrusage(RUSAGE_SELF, &ru0);
  for (int i = 0; i < 200000; i++) { /* until the server stops reading us */
    if (poll(&p, 1, 200) <= 0) break;
    if (send(fd, req, n, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)n) break;
    sent++;
  }
  getrusage(RUSAGE_SELF, &ru1);
  long grown_mb = (ru1.ru_maxrss - ru0.ru_maxrss) / 1024;
  printf("# %d pipelined GETs of 1 MiB sent before the server stopped reading; peak RSS +%ld MB\n",
         sent, grown_mb);
  CHECK(sent < 200000);
  CHECK_MSG(grown_mb < 64, "the server buffered %ld MB for one client", grown_mb);
  uint64_t t0 = uv_hrtime();
  size_t len = 0;
  CHECK_OK(mm_kv_client_put(c, "other", "x", 1));
  CHECK_OK(mm_kv_client_get(c, "other", big, 8, &len, 0));
  CHECK(ms_since(t0) < 2000);
  close(fd);
  free(big);
  mm_kv_server_stats st;
  mm_kv_client_close(c);
  WAIT_STATS(s, st, st.connections == 0);
  mm_kv_server_stop(s);
}

typedef struct {
  const char *host;
  int port, timeout_ms;
  mm_err *err;
  double ms;
} connector;
static void connector_main(void *arg) {
  connector *k = arg;
  mm_kv_client *c = NULL;
  uint64_t t0 = uv_hrtime();
  k->err = mm_kv_client_connect(k->host, k->port, k->timeout_ms, &c);
  k->ms = ms_since(t0);
  if (!k->err) {
    k->err = mm_kv_client_put(c, "connected", "1", 1);
    mm_kv_client_close(c);
  }
}

static int free_port(void) {
  mm_kv_server *s = NULL;
  CHECK_OK(mm_kv_server_start(HOST, 0, NULL, &s));
  int port = mm_kv_server_port(s);
  mm_kv_server_stop(s);
  return port;
}

static void test_server_starts_late(void) {
  int port = free_port();
  /* nobody there: bounded by the timeout */
  connector k = {HOST, port, 300, NULL, 0};
  connector_main(&k);
  CHECK_ERR(k.err, MEGAMOE_CODE_DEADLINE_EXCEEDED);
  k.err = NULL;
  CHECK_MSG(k.ms >= 280 && k.ms < 3000, "gave up after %.0f ms", k.ms);
  /* the client retries until the server comes up */
  k = (connector){HOST, port, 10000, NULL, 0};
  uv_thread_t t;
  uv_thread_create(&t, connector_main, &k);
  usleep(400000);
  mm_kv_server *s = NULL;
  CHECK_OK(mm_kv_server_start(HOST, port, NULL, &s));
  uv_thread_join(&t);
  CHECK_OK(k.err);
  CHECK_MSG(k.ms >= 350 && k.ms < 5000, "connected after %.0f ms", k.ms);
  mm_kv_client *c = s ? connect_to(s) : NULL;
  size_t len = 0;
  char v[4];
  if (c) CHECK_OK(mm_kv_client_get(c, "connected", v, sizeof v, &len, 0));
  mm_kv_client_close(c);
  mm_kv_server_stop(s);
  /* an unresolvable name is retried too, then reported */
  k = (connector){"no-such-host.invalid", port, 200, NULL, 0};
  connector_main(&k);
  CHECK(k.err && strstr(k.err->message, "resolve"));
  megamoe_error_destroy(k.err);
}

static void test_port_in_use(void) {
  mm_kv_server *s = start(NULL), *s2 = NULL;
  if (!s) return;
  int port = mm_kv_server_port(s);
  mm_err *err = mm_kv_server_start(HOST, port, NULL, &s2);
  char want[64];
  snprintf(want, sizeof want, "%s:%d", HOST, port);
  CHECK(err && err->code == MEGAMOE_CODE_UNAVAILABLE && strstr(err->message, want));
  if (err) printf("# %s\n", err->message);
  megamoe_error_destroy(err);
  CHECK(s2 == NULL);
  CHECK_ERR(mm_kv_server_start("not an address!", 0, NULL, &s2), MEGAMOE_CODE_INVALID_ARGUMENT);
  /* the first server is unharmed */
  mm_kv_client *c = connect_to(s);
  CHECK_OK(mm_kv_client_put(c, "k", "v", 1));
  mm_kv_client_close(c);
  mm_kv_server_stop(s);
}

static void test_connection_limit(void) {
  mm_kv_server_limits lim = {.max_connections = 2};
  mm_kv_server *s = start(&lim);
  if (!s) return;
  mm_kv_client *a = connect_to(s), *b = connect_to(s), *c = NULL;
  CHECK_ERR(mm_kv_client_connect(HOST, mm_kv_server_port(s), 300, &c), MEGAMOE_CODE_DEADLINE_EXCEEDED);
  mm_kv_server_stats st;
  mm_kv_server_get_stats(s, &st);
  CHECK(st.rejected >= 1);
  CHECK_OK(mm_kv_client_put(a, "k", "v", 1));
  mm_kv_client_close(b);
  CHECK_OK(mm_kv_client_connect(HOST, mm_kv_server_port(s), 3000, &c));
  mm_kv_client_close(c);
  mm_kv_client_close(a);
  mm_kv_server_stop(s);
}

static void test_will(void) {
  mm_kv_server *s = start(NULL);
  mm_kv_client *a = connect_to(s), *b = connect_to(s), *w = connect_to(s);
  if (!s || !a || !b || !w) return;
  CHECK_OK(mm_kv_client_add_will(a, "gone/a", "a died", 6));
  CHECK_OK(mm_kv_client_add_will(a, "gone/a2", "old", 3));
  CHECK_OK(mm_kv_client_add_will(a, "gone/a2", "also a", 6)); /* replaces */
  CHECK_OK(mm_kv_client_add_will(b, "gone/b", "b died", 6));
  mm_kv_client_close(b); /* clean: no will */
  mm_kv_client_abandon(a);
  char v[16];
  size_t len = 0;
  CHECK_OK(mm_kv_client_get(w, "gone/a", v, sizeof v, &len, 5000));
  CHECK(len == 6 && !memcmp(v, "a died", 6));
  CHECK_OK(mm_kv_client_get(w, "gone/a2", v, sizeof v, &len, 5000));
  CHECK(len == 6 && !memcmp(v, "also a", 6));
  CHECK_ERR(mm_kv_client_get(w, "gone/b", v, sizeof v, &len, 200), MEGAMOE_CODE_DEADLINE_EXCEEDED);
  /* cleared wills do not fire; at most MM_KV_MAX_WILLS keys */
  mm_kv_client *d = connect_to(s);
  char key[32];
  for (int i = 0; i < MM_KV_MAX_WILLS; i++) {
    snprintf(key, sizeof key, "gone/d%d", i);
    CHECK_OK(mm_kv_client_add_will(d, key, "x", 1));
  }
  CHECK_ERR(mm_kv_client_add_will(d, "gone/one-too-many", "x", 1), MEGAMOE_CODE_RESOURCE_EXHAUSTED);
  CHECK_OK(mm_kv_client_add_will(d, "gone/d0", "y", 1)); /* replacing still works */
  CHECK_ERR(mm_kv_client_add_will(d, "gone/big", v, MM_KV_MAX_WILL + 1), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_OK(mm_kv_client_clear_wills(d));
  mm_kv_client_abandon(d);
  CHECK_ERR(mm_kv_client_get(w, "gone/d0", v, sizeof v, &len, 300), MEGAMOE_CODE_DEADLINE_EXCEEDED);
  mm_kv_server_stats st;
  mm_kv_server_get_stats(s, &st);
  CHECK_EQ_INT(st.wills_fired, 2);
  mm_kv_client_close(w);
  mm_kv_server_stop(s);
}

/* Stopping with parked GETs and open connections: the waiters fail at once. */
static void test_stop_with_waiters(void) {
  mm_kv_server *s = start(NULL);
  if (!s) return;
  getter g[3];
  uv_thread_t t[3];
  for (int i = 0; i < 3; i++) {
    g[i] = (getter){.port = mm_kv_server_port(s), .timeout_ms = 30000, .key = "never"};
    uv_thread_create(&t[i], getter_main, &g[i]);
  }
  mm_kv_server_stats st;
  WAIT_STATS(s, st, st.waiting == 3);
  uint64_t t0 = uv_hrtime();
  mm_kv_server_stop(s);
  for (int i = 0; i < 3; i++) {
    uv_thread_join(&t[i]);
    CHECK_ERR(g[i].err, MEGAMOE_CODE_UNAVAILABLE);
    g[i].err = NULL;
  }
  CHECK_MSG(ms_since(t0) < 3000, "waiters released after %.0f ms", ms_since(t0));
}

static void test_parse_address(void) {
  char host[64];
  int port = -1;
  CHECK_OK(mm_kv_parse_address("127.0.0.1:29500", host, sizeof host, &port));
  CHECK(!strcmp(host, "127.0.0.1") && port == 29500);
  CHECK_OK(mm_kv_parse_address("node-3.cluster:0", host, sizeof host, &port));
  CHECK(!strcmp(host, "node-3.cluster") && port == 0);
  CHECK_OK(mm_kv_parse_address("[::1]:80", host, sizeof host, &port));
  CHECK(!strcmp(host, "::1") && port == 80);
  const char *bad[] = {"", "host", ":80", "host:", "host:65536", "host:-1", "host:8x", "::1:80",
                       "[::1]80", "[::1"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
    CHECK_ERR(mm_kv_parse_address(bad[i], host, sizeof host, &port), MEGAMOE_CODE_INVALID_ARGUMENT);
  char tiny[4];
  CHECK_ERR(mm_kv_parse_address("longhost:1", tiny, sizeof tiny, &port), MEGAMOE_CODE_INVALID_ARGUMENT);
}

/* ---- the barrier, ranks as threads ------------------------------------------------- */
typedef struct {
  int port, rank, world, rounds, abort_at, vanish_at;
  int mismatches;
  mm_err *err;
  int rounds_done;
} brank;
static void brank_main(void *arg) {
  brank *r = arg;
  mm_kv_client *c = NULL;
  mm_kv_barrier *b = NULL;
  if ((r->err = mm_kv_client_connect(HOST, r->port, 5000, &c))) return;
  if ((r->err = mm_kv_barrier_new(c, "test", r->rank, r->world, 5000, &b))) goto out;
  for (int g = 0; g < r->rounds; g++) {
    if (g == r->vanish_at) {
      mm_kv_barrier_free(b);
      mm_kv_client_abandon(c); /* as if the process died */
      return;
    }
    if (g == r->abort_at) {
      r->err = mm_kv_barrier_abort(b, "rank gave up on purpose");
      if (!r->err) r->err = mm_error(MEGAMOE_CODE_ABORTED, "self");
      break;
    }
    char key[64], val[64], got[64];
    snprintf(key, sizeof key, "v/%d/%d", g, r->rank);
    int n = snprintf(val, sizeof val, "%d:%d", g, r->rank * 31 + g);
    if ((r->err = mm_kv_client_put(c, key, val, (size_t)n))) break;
    if ((r->err = mm_kv_barrier_wait(b))) break;
    /* after the barrier every rank's value of this round is there */
    for (int o = 0; o < r->world; o++) {
      snprintf(key, sizeof key, "v/%d/%d", g, o);
      n = snprintf(val, sizeof val, "%d:%d", g, o * 31 + g);
      size_t len = 0;
      mm_err *e = mm_kv_client_get(c, key, got, sizeof got, &len, 0);
      if (e || len != (size_t)n || memcmp(got, val, len)) r->mismatches++;
      megamoe_error_destroy(e);
    }
    r->rounds_done = g + 1;
  }
out:
  mm_kv_barrier_free(b);
  mm_kv_client_close(c);
}

static void run_ranks(brank *r, int world) {
  uv_thread_t t[16];
  for (int i = 0; i < world; i++) uv_thread_create(&t[i], brank_main, &r[i]);
  for (int i = 0; i < world; i++) uv_thread_join(&t[i]);
}

static void test_barrier_threads(void) {
  mm_kv_server *s = start(NULL);
  if (!s) return;
  int worlds[] = {1, 2, 5};
  for (int wi = 0; wi < 3; wi++) {
    int world = worlds[wi];
    brank r[8];
    for (int i = 0; i < world; i++)
      r[i] = (brank){.port = mm_kv_server_port(s), .rank = i, .world = world, .rounds = 40,
                     .abort_at = -1, .vanish_at = -1};
    uint64_t t0 = uv_hrtime();
    run_ranks(r, world);
    printf("# world %d: 40 barriers in %.0f ms\n", world, ms_since(t0));
    for (int i = 0; i < world; i++) {
      CHECK_OK(r[i].err);
      CHECK_EQ_INT(r[i].mismatches, 0);
      CHECK_EQ_INT(r[i].rounds_done, 40);
    }
    /* barrier keys are reclaimed: the values and the last "go" are left */
    mm_kv_server_stats st;
    WAIT_STATS(s, st, st.keys == 40 * world + (world > 1));
    mm_kv_server_stop(s);
    s = start(NULL);
    if (!s) return;
  }
  mm_kv_server_stop(s);
}

static void test_barrier_abort_and_death(void) {
  for (int mode = 0; mode < 2; mode++) {
    mm_kv_server *s = start(NULL);
    if (!s) return;
    enum { W = 4 };
    brank r[W];
    for (int i = 0; i < W; i++)
      r[i] = (brank){.port = mm_kv_server_port(s), .rank = i, .world = W, .rounds = 30,
                     .abort_at = -1, .vanish_at = -1};
    int culprit = (int)(mm_test_rand_u64() % W);
    if (mode == 0) r[culprit].abort_at = 7;
    else r[culprit].vanish_at = 7;
    uint64_t t0 = uv_hrtime();
    run_ranks(r, W);
    double ms = ms_since(t0);
    CHECK_MSG(ms < 4000, "the group took %.0f ms to notice (timeout 5000)", ms);
    for (int i = 0; i < W; i++) {
      if (i == culprit) {
        if (mode == 0) CHECK_ERR(r[i].err, MEGAMOE_CODE_ABORTED);
        else CHECK(r[i].err == NULL);
        r[i].err = NULL;
        continue;
      }
      CHECK_MSG(r[i].err && r[i].err->code == MEGAMOE_CODE_ABORTED &&
                    strstr(r[i].err->message, mode ? "lost its connection" : "on purpose"),
                "rank %d: %s", i, r[i].err ? r[i].err->message : "no error");
      CHECK(r[i].rounds_done == 7 || r[i].rounds_done == 6);
      megamoe_error_destroy(r[i].err);
    }
    printf("# %s of rank %d noticed by the others in %.0f ms\n", mode ? "death" : "abort", culprit, ms);
    mm_kv_server_stop(s);
  }
}

static void test_barrier_timeout(void) {
  mm_kv_server *s = start(NULL);
  mm_kv_client *c = connect_to(s);
  if (!s || !c) return;
  mm_kv_barrier *b = NULL;
  CHECK_OK(mm_kv_barrier_new(c, "lonely", 0, 2, 500, &b));
  uint64_t t0 = uv_hrtime();
  mm_err *err = b ? mm_kv_barrier_wait(b) : NULL;
  CHECK(err && err->code == MEGAMOE_CODE_DEADLINE_EXCEEDED && strstr(err->message, "lonely/b/0/1"));
  megamoe_error_destroy(err);
  CHECK(ms_since(t0) >= 450 && ms_since(t0) < 3000);
  mm_kv_barrier_free(b);
  CHECK_ERR(mm_kv_barrier_new(c, "x", 2, 2, 500, &b), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK(b == NULL);
  mm_kv_client_close(c);
  mm_kv_server_stop(s);
}

int main(void) {
  mm_test_seed();
  alarm(300); /* a hang is a failure, not a stuck CI job */
  RUN(test_parse_address);
  RUN(test_put_get);
  RUN(test_get_waits_for_put);
  RUN(test_get_timeout);
  RUN(test_large_values_and_bounds);
  RUN(test_limits);
  RUN(test_many_clients_many_keys);
  RUN(test_malformed_frames);
  RUN(test_reader_that_never_reads);
  RUN(test_server_starts_late);
  RUN(test_port_in_use);
  RUN(test_connection_limit);
  RUN(test_will);
  RUN(test_stop_with_waiters);
  RUN(test_barrier_threads);
  RUN(test_barrier_abort_and_death);
  RUN(test_barrier_timeout);
  return mm_test_done();
}

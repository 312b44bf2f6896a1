/* kv_tcp_client.c -- the blocking client of the TCP key-value store: plain
 * non-blocking sockets driven by poll() against a deadline per request. */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "kv_tcp.h"

#define IO_TIMEOUT_MS 60000   /* a reply the server owes now */
#define GET_GRACE_MS 10000    /* beyond a parked GET's own timeout */
#define ATTEMPT_MAX_MS 2000   /* one connect attempt */

struct mm_kv_client {
  int fd;
  int broken;
  uv_mutex_t lock;
  char where[300]; /* "host:port" for messages */
  char why[256];   /* what broke it */
};

static uint64_t now_ms(void) { return uv_hrtime() / 1000000u; }

static void wr32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
  p[2] = (uint8_t)(v >> 16);
  p[3] = (uint8_t)(v >> 24);
}
static uint32_t rd32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Waits for `events` on fd until deadline: 0, or -1 with errno (ETIMEDOUT). */
static int wait_fd(int fd, short events, uint64_t deadline) {
  for (;;) {
    uint64_t now = now_ms();
    if (now >= deadline) {
      errno = ETIMEDOUT;
      return -1;
    }
    struct pollfd p = {fd, events, 0};
    uint64_t left = deadline - now;
    int r = poll(&p, 1, left > 1000000 ? 1000000 : (int)left);
    if (r > 0) return 0;
    if (r < 0 && errno != EINTR) return -1;
  }
}

/* 0, or -1 with a message in why. */
static int send_all(int fd, const void *buf, size_t n, uint64_t deadline, char *why, size_t cap) {
  const uint8_t *p = buf;
  while (n) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && wait_fd(fd, POLLOUT, deadline) == 0)
      continue;
    snprintf(why, cap, "send: %s", strerror(errno));
    return -1;
  }
  return 0;
}
static int recv_all(int fd, void *buf, size_t n, uint64_t deadline, char *why, size_t cap) {
  uint8_t *p = buf;
  while (n) {
    ssize_t r = recv(fd, p, n, 0);
    if (r > 0) {
      p += r;
      n -= (size_t)r;
      continue;
    }
    if (r == 0) {
      snprintf(why, cap, "the server closed the connection");
      return -1;
    }
    if (errno == EINTR) continue;
    if ((errno == EAGAIN || errno == EWOULDBLOCK) && wait_fd(fd, POLLIN, deadline) == 0) continue;
    snprintf(why, cap, "%s", errno == ETIMEDOUT ? "no reply from the server in time" : strerror(errno));
    return -1;
  }
  return 0;
}

static void make_header(uint8_t *h, int op, size_t klen, size_t vlen, uint32_t timeout_ms) {
  wr32(h, MM_KV_MAGIC);
  h[4] = (uint8_t)op;
  h[5] = h[6] = h[7] = 0;
  wr32(h + 8, (uint32_t)klen);
  wr32(h + 12, (uint32_t)vlen);
  wr32(h + 16, timeout_ms);
}

/* One request/reply on fd. The reply's value goes to out (min(cap, len)
 * bytes, the rest is read and dropped). Returns the status (>= 0), or -1 with
 * a message in why. */
static int exchange(int fd, int op, const char *key, const void *value, size_t vlen,
                    uint32_t timeout_ms, void *out, size_t cap, size_t *out_len, uint64_t deadline,
                    char *why, size_t wcap) {
  size_t klen = key ? strlen(key) : 0;
  uint8_t h[MM_KV_REQ_HEADER + MM_KV_MAX_KEY];
  make_header(h, op, klen, vlen, timeout_ms);
  if (klen) memcpy(h + MM_KV_REQ_HEADER, key, klen);
  if (send_all(fd, h, MM_KV_REQ_HEADER + klen, deadline, why, wcap) ||
      (vlen && send_all(fd, value, vlen, deadline, why, wcap)))
    return -1;
  uint8_t r[MM_KV_REPLY_HEADER];
  if (recv_all(fd, r, sizeof r, deadline, why, wcap)) return -1;
  uint32_t len = rd32(r + 8);
  if (rd32(r) != MM_KV_MAGIC || r[4] > MM_KV_FULL || r[5] || r[6] || r[7] || len > MM_KV_MAX_VALUE ||
      (len && (op != MM_KV_OP_GET || r[4] != MM_KV_OK))) {
    snprintf(why, wcap, "malformed reply (not a megamoe key-value server?)");
    return -1;
  }
  if (out_len) *out_len = len;
  size_t take = len < cap ? len : cap;
  if (take && recv_all(fd, out, take, deadline, why, wcap)) return -1;
  for (size_t left = len - take; left;) {
    uint8_t sink[4096];
    size_t n = left < sizeof sink ? left : sizeof sink;
    if (recv_all(fd, sink, n, deadline, why, wcap)) return -1;
    left -= n;
  }
  return r[4];
}

/* One connection attempt: 0 and *fd_out, or -1 with why. */
static int attempt(const char *host, int port, uint64_t deadline, int *fd_out, char *why,
                   size_t cap) {
  char service[16];
  snprintf(service, sizeof service, "%d", port);
  struct addrinfo hints, *ai = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  int g = getaddrinfo(host, service, &hints, &ai);
  if (g) {
    snprintf(why, cap, "cannot resolve %s: %s", host, gai_strerror(g));
    return -1;
  }
  int ok = -1;
  for (struct addrinfo *a = ai; a && ok; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      snprintf(why, cap, "socket: %s", strerror(errno));
      continue;
    }
    int r = connect(fd, a->ai_addr, a->ai_addrlen);
    if (r < 0 && errno == EINPROGRESS) {
      uint64_t d = now_ms() + ATTEMPT_MAX_MS;
      r = wait_fd(fd, POLLOUT, d < deadline ? d : deadline);
      int soerr = 0;
      socklen_t sl = sizeof soerr;
      if (r == 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) == 0 && soerr) {
        errno = soerr;
        r = -1;
      }
    }
    if (r < 0) {
      snprintf(why, cap, "connect: %s", strerror(errno));
      close(fd);
      continue;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    /* The greeting proves a megamoe server, and that it did not turn us away
     * (over its connection limit it closes at once). */
    uint64_t d = now_ms() + IO_TIMEOUT_MS;
    int st = exchange(fd, MM_KV_OP_HELLO, NULL, NULL, 0, 0, NULL, 0, NULL, d < deadline ? d : deadline,
                      why, cap);
    if (st != MM_KV_OK) {
      if (st > 0) snprintf(why, cap, "greeting refused (status %d)", st);
      close(fd);
      continue;
    }
    *fd_out = fd;
    ok = 0;
  }
  freeaddrinfo(ai);
  return ok;
}

mm_err *mm_kv_client_connect(const char *host, int port, int timeout_ms, mm_kv_client **out) {
  *out = NULL;
  MM_ARG_CHECK(host && *host && port > 0 && port <= 65535, "key-value client: bad address %s:%d",
               host ? host : "(null)", port);
  mm_kv_client *c = calloc(1, sizeof *c);
  if (!c) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "key-value client: out of memory");
  snprintf(c->where, sizeof c->where, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
  uint64_t t0 = now_ms(), deadline = t0 + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0);
  char why[256] = "no attempt";
  unsigned backoff = 10;
  int attempts = 0;
  for (;;) {
    attempts++;
    uint64_t now = now_ms(), d = deadline > now + 200 ? deadline : now + 200; /* one real try */
    if (attempt(host, port, d, &c->fd, why, sizeof why) == 0) break;
    now = now_ms();
    if (now >= deadline) {
      free(c);
      return mm_error(MEGAMOE_CODE_DEADLINE_EXCEEDED,
                      "no key-value store at %s:%d within %d ms (%d attempts; last: %s)", host,
                      port, timeout_ms, attempts, why);
    }
    uint64_t nap = backoff < deadline - now ? backoff : deadline - now;
    usleep((useconds_t)(nap * 1000));
    backoff = backoff * 2 > 500 ? 500 : backoff * 2;
  }
  uv_mutex_init(&c->lock);
  *out = c;
  return NULL;
}

/* Runs one request under the lock; maps statuses to errors. */
static mm_err *request(mm_kv_client *c, int op, const char *key, const void *value, size_t vlen,
                       uint32_t timeout_ms, void *out, size_t cap, size_t *out_len, int *status) {
  uv_mutex_lock(&c->lock);
  if (c->broken) {
    uv_mutex_unlock(&c->lock);
    return mm_error(MEGAMOE_CODE_UNAVAILABLE, "key-value store %s: connection lost earlier (%s)",
                    c->where, c->why);
  }
  uint64_t deadline = now_ms() + IO_TIMEOUT_MS + (op == MM_KV_OP_GET ? timeout_ms + GET_GRACE_MS : 0);
  int st = exchange(c->fd, op, key, value, vlen, timeout_ms, out, cap, out_len, deadline, c->why,
                    sizeof c->why);
  if (st < 0) {
    c->broken = 1;
    shutdown(c->fd, SHUT_RDWR);
  }
  uv_mutex_unlock(&c->lock);
  if (st < 0)
    return mm_error(MEGAMOE_CODE_UNAVAILABLE, "key-value store %s: %s", c->where, c->why);
  *status = st;
  return NULL;
}

static mm_err *check_key(const char *key) {
  MM_ARG_CHECK(key, "key-value store: NULL key");
  size_t n = strlen(key);
  MM_ARG_CHECK(n >= 1 && n <= MM_KV_MAX_KEY, "key-value store: key of %zu bytes (1..%d allowed)", n,
               MM_KV_MAX_KEY);
  return NULL;
}

mm_err *mm_kv_client_put(mm_kv_client *c, const char *key, const void *value, size_t len) {
  MM_TRY(check_key(key));
  MM_ARG_CHECK(len <= MM_KV_MAX_VALUE && (value || !len),
               "key-value store: value of '%s' is %zu bytes (at most %u)", key, len, MM_KV_MAX_VALUE);
  int st;
  MM_TRY(request(c, MM_KV_OP_PUT, key, value, len, 0, NULL, 0, NULL, &st));
  if (st == MM_KV_FULL)
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED,
                    "key-value store %s is full (key or byte limit), cannot put '%s'", c->where, key);
  return NULL;
}

mm_err *mm_kv_client_get(mm_kv_client *c, const char *key, void *value, size_t cap, size_t *len,
                         int timeout_ms) {
  MM_TRY(check_key(key));
  uint32_t t = timeout_ms <= 0 ? 0
               : (uint32_t)timeout_ms > MM_KV_MAX_TIMEOUT_MS ? MM_KV_MAX_TIMEOUT_MS
                                                             : (uint32_t)timeout_ms;
  int st;
  size_t got = 0;
  MM_TRY(request(c, MM_KV_OP_GET, key, NULL, 0, t, value, value ? cap : 0, &got, &st));
  if (st != MM_KV_OK)
    return mm_error(MEGAMOE_CODE_DEADLINE_EXCEEDED, "key '%s' did not appear in %s within %u ms",
                    key, c->where, t);
  if (len) *len = got;
  return NULL;
}

mm_err *mm_kv_client_del(mm_kv_client *c, const char *key, int *existed) {
  MM_TRY(check_key(key));
  int st;
  MM_TRY(request(c, MM_KV_OP_DEL, key, NULL, 0, 0, NULL, 0, NULL, &st));
  if (existed) *existed = st == MM_KV_OK;
  return NULL;
}

mm_err *mm_kv_client_add_will(mm_kv_client *c, const char *key, const void *value, size_t len) {
  MM_TRY(check_key(key));
  MM_ARG_CHECK(len <= MM_KV_MAX_WILL && (value || !len),
               "key-value store: a will of %zu bytes for '%s' (at most %u)", len, key, MM_KV_MAX_WILL);
  int st;
  MM_TRY(request(c, MM_KV_OP_WILL, key, value, len, 0, NULL, 0, NULL, &st));
  if (st == MM_KV_FULL)
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "key-value store: more than %d wills",
                    MM_KV_MAX_WILLS);
  return NULL;
}

mm_err *mm_kv_client_clear_wills(mm_kv_client *c) {
  int st;
  return request(c, MM_KV_OP_WILL, NULL, NULL, 0, 0, NULL, 0, NULL, &st);
}

void mm_kv_client_close(mm_kv_client *c) {
  if (!c) return;
  if (!c->broken) {
    uint64_t d = now_ms() + 2000; /* best effort: a gone server must not hold us up */
    char why[256];
    exchange(c->fd, MM_KV_OP_BYE, NULL, NULL, 0, 0, NULL, 0, NULL, d, why, sizeof why);
  }
  mm_kv_client_abandon(c);
}

void mm_kv_client_abandon(mm_kv_client *c) {
  if (!c) return;
  close(c->fd);
  uv_mutex_destroy(&c->lock);
  free(c);
}

/* host_mp.c -- megamoe-host's multi-process mode: this process runs one rank.
 *
 * The key-value store is served over TCP (kv_tcp.h) by rank 0, or by the
 * process given --rendezvous-serve; every process, the server's included, is
 * a client. The plugin bootstraps NCCL through it (kv services), iterations
 * meet at a barrier on it (kv_barrier.h), and a rank that fails, or dies,
 * aborts the others through it.
 *
 * Each rank checks its own sampled tokens against the cpu-reference backend
 * (the same tokens the threaded mode checks for that rank), prints its own
 * result line ("megamoe-host: PASS rank=R ..."), and puts its result in the
 * store; rank 0 gathers every rank's result and prints last the world's line
 * in the threaded mode's format (worst error, worst time per size), and its
 * exit code is the world's. The serving process keeps the store up until
 * rank 0 has gathered. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "host.h"
#include "kv_barrier.h"
#include "kv_tcp.h"

#define NS "megamoe-host"
#define GRACE_MS 30000u /* after an abort: how long results are still awaited (at most) */

static mm_kv_server *g_server;
static mm_kv_client *g_client;
static mm_kv_barrier *g_barrier;
static char g_where[300];

static int format_result(char *buf, size_t cap, const host_result *r);

static int serving(void) {
  return opt.rendezvous_serve == 1 || (opt.rendezvous_serve < 0 && opt.rank == 0);
}

static void print_err(mm_err *err, const char *what) {
  if (!err) return;
  uv_mutex_lock(&g_print_lock);
  fprintf(stderr, "megamoe-host: rank %d: %s%s%s\n", opt.rank, what ? what : "", what ? ": " : "",
          megamoe_error_message(err));
  uv_mutex_unlock(&g_print_lock);
  megamoe_error_destroy(err);
}

/* ---- the group on the store ----------------------------------------------------- */
static int mp_sync(void) {
  mm_err *err = mm_kv_barrier_wait(g_barrier);
  if (!err) return 0;
  print_err(err, NULL);
  return -1;
}
static void mp_group_abort(const char *why) { mp_abort(why); }
static const host_group mp_group = {mp_sync, mp_group_abort};

void mp_abort(const char *why) {
  if (g_barrier) print_err(mm_kv_barrier_abort(g_barrier, why), "abort");
}

int mp_kv_put(const char *key, const void *value, size_t len) {
  mm_err *err = mm_kv_client_put(g_client, key, value, len);
  if (!err) return 0;
  print_err(err, "kv_put");
  return -1;
}
int mp_kv_get(const char *key, void *value, size_t cap, size_t *len, int timeout_ms) {
  mm_err *err = mm_kv_client_get(g_client, key, value, cap, len, timeout_ms);
  if (!err) return 0;
  print_err(err, "kv_get"); /* the plugin says what it was waiting for */
  return -1;
}

int mp_connect(void) {
  char host[256];
  int port;
  mm_err *err = mm_kv_parse_address(opt.rendezvous, host, sizeof host, &port);
  if (err) {
    print_err(err, NULL);
    return 1;
  }
  const char *chost = host;
  if (serving()) {
    if ((err = mm_kv_server_start(host, port, NULL, &g_server))) {
      print_err(err, NULL);
      return 1;
    }
    port = mm_kv_server_port(g_server);
    /* A wildcard bind is reached through loopback from this process. */
    if (!strcmp(host, "0.0.0.0")) chost = "127.0.0.1";
    else if (!strcmp(host, "::")) chost = "::1";
    fprintf(stderr, "megamoe-host: rank %d serves the key-value store on %s:%d\n", opt.rank, host,
            port);
  } else if (port == 0) {
    fprintf(stderr, "megamoe-host: rank %d: --rendezvous %s: port 0 only for the serving process\n",
            opt.rank, opt.rendezvous);
    return 1;
  }
  snprintf(g_where, sizeof g_where, "%s:%d", chost, port);
  int tmo = opt.rendezvous_timeout_s > 2147483 ? 2147483647 : opt.rendezvous_timeout_s * 1000;
  err = mm_kv_client_connect(chost, port, tmo, &g_client);
  if (!err) err = mm_kv_barrier_new(g_client, NS, opt.rank, opt.world, tmo, &g_barrier);
  if (!err) { /* should this process die, its result is a FAIL */
    char key[64], val[1024];
    host_result fail = {.pass = 0, .rel_err = NAN, .tolerance = check_tolerance(-1)};
    snprintf(key, sizeof key, "%s/result/%d", NS, opt.rank);
    int n = format_result(val, sizeof val, &fail);
    err = mm_kv_client_add_will(g_client, key, val, n > 0 && n < 1024 ? (size_t)n : 0);
  }
  if (err) {
    print_err(err, "rendezvous");
    mm_kv_client_close(g_client);
    mm_kv_server_stop(g_server);
    g_client = NULL;
    g_server = NULL;
    return 1;
  }
  g_group = &mp_group;
  return 0;
}

/* ---- results ---------------------------------------------------------------------- */
static int format_result(char *buf, size_t cap, const host_result *r) {
  int n = snprintf(buf, cap, "%d %.17g %.17g %.17g %llu %.17g %d", r->pass, r->rel_err,
                   r->tolerance, r->prepare_s, (unsigned long long)r->plan_bytes, r->wall_s,
                   opt.num_tokens);
  for (int i = 0; i < opt.num_tokens && n > 0 && (size_t)n < cap; i++)
    n += snprintf(buf + n, cap - (size_t)n, " %.17g", r->median_ms[i]);
  return n;
}
static int parse_result(const char *s, host_result *r) {
  char *end;
  memset(r, 0, sizeof *r);
  r->pass = (int)strtol(s, &end, 10);
  r->rel_err = strtod(end, &end);
  r->tolerance = strtod(end, &end);
  r->prepare_s = strtod(end, &end);
  r->plan_bytes = strtoull(end, &end, 10);
  r->wall_s = strtod(end, &end);
  long n = strtol(end, &end, 10);
  if (n != opt.num_tokens) return -1; /* ranks ran with different --tokens */
  for (int i = 0; i < n; i++) {
    const char *p = end;
    r->median_ms[i] = strtod(p, &end);
    if (end == p) return -1;
  }
  return *end ? -1 : 0;
}

/* Waits for key like the barrier does; once the group was aborted, waits at
 * most GRACE_MS more in total (*grace: that deadline, 0 until the abort). */
static mm_err *await(const char *key, void *value, size_t cap, size_t *len, uint64_t *grace) {
  if (!*grace) {
    mm_err *err = mm_kv_barrier_wait_key(g_barrier, key, value, cap, len);
    if (megamoe_error_code(err) != MEGAMOE_CODE_ABORTED) return err;
    megamoe_error_destroy(err);
    uint64_t limit = (uint64_t)opt.rendezvous_timeout_s * 1000u;
    *grace = uv_hrtime() / 1000000u + (limit < GRACE_MS ? limit : GRACE_MS);
  }
  uint64_t now = uv_hrtime() / 1000000u;
  return mm_kv_client_get(g_client, key, value, cap, len, now < *grace ? (int)(*grace - now) : 0);
}

/* Rank 0: every rank's result into the world's. */
static host_result gather(void) {
  host_result world = {.pass = 1, .rel_err = opt.check_tokens > 0 ? 0 : NAN};
  uint64_t grace = 0;
  for (int r = 0; r < opt.world; r++) {
    char key[64], val[1024];
    size_t len = 0;
    snprintf(key, sizeof key, "%s/result/%d", NS, r);
    mm_err *err = await(key, val, sizeof val - 1, &len, &grace);
    host_result one;
    if (!err) {
      val[len < sizeof val - 1 ? len : sizeof val - 1] = '\0';
      if (parse_result(val, &one))
        err = mm_error(MEGAMOE_CODE_DATA_LOSS, "unreadable result '%s'", val);
    }
    if (err) {
      char what[64];
      snprintf(what, sizeof what, "no result from rank %d", r);
      print_err(err, what);
      world.pass = 0;
      world.rel_err = NAN;
      continue;
    }
    if (!one.pass) fprintf(stderr, "megamoe-host: rank %d reported FAIL\n", r);
    world.pass &= one.pass;
    if (isnan(one.rel_err) || isnan(world.rel_err)) world.rel_err = NAN;
    else if (one.rel_err > world.rel_err) world.rel_err = one.rel_err;
    if (r == 0) {
      world.prepare_s = one.prepare_s;
      world.plan_bytes = one.plan_bytes;
    }
    if (one.wall_s > world.wall_s) world.wall_s = one.wall_s;
    if (one.tolerance > world.tolerance) world.tolerance = one.tolerance;
    for (int i = 0; i < opt.num_tokens; i++)
      if (one.median_ms[i] > world.median_ms[i]) world.median_ms[i] = one.median_ms[i];
  }
  return world;
}

/* ---- the run ------------------------------------------------------------------------ */
int mp_run(const host_setup *su) {
  host_result mine = {.pass = 0, .rel_err = NAN, .tolerance = check_tolerance(-1)};
  const char *backend = su ? (su->gpus > 0 ? "cuda" : "cpu-reference") : "unknown";
  int layers = su ? su->num_layers : 0;
  rank_work w;
  memset(&w, 0, sizeof w);
  if (su) {
    int device = su->gpus > 0 ? (opt.local_device >= 0 ? opt.local_device : opt.rank % su->gpus) : -1;
    init_rank(&w, su, opt.rank, device);
    char where[32];
    snprintf(where, sizeof where, device >= 0 ? "GPU %d" : "the CPU", device);
    fprintf(stderr,
            "megamoe-host: rank %d of %d on %s (store %s), ep-size %d, %d layer(s), hidden %d, "
            "top-%d, %d experts\n",
            opt.rank, opt.world, where, g_where, su->ep, su->num_layers, su->H, su->K, su->E);
    double t0 = now_s();
    rank_main(&w);
    mine.wall_s = now_s() - t0;
    int check_failed = 1;
    if (w.ok && opt.check_tokens > 0) {
      host_ref *ref = NULL;
      check_failed = ref_open(su->ck, su->layers[0], &ref);
      if (!check_failed) check_failed = ref_check(ref, &w, &mine.rel_err);
      if (check_failed) mine.rel_err = NAN;
      ref_close(ref);
    } else if (w.ok) {
      check_failed = 0;
    }
    mine.tolerance = w.tolerance;
    mine.pass = w.ok && !check_failed && (opt.check_tokens <= 0 || mine.rel_err <= mine.tolerance);
    mine.prepare_s = w.prepare_s;
    mine.plan_bytes = w.plan_device_bytes;
    memcpy(mine.median_ms, w.median_ms, sizeof mine.median_ms);
    rank_work_release(&w);
  }
  char key[64], val[1024];
  snprintf(key, sizeof key, "%s/result/%d", NS, opt.rank);
  int n = format_result(val, sizeof val, &mine);
  print_err(mm_kv_client_put(g_client, key, val, n > 0 && (size_t)n < sizeof val ? (size_t)n : 0),
            "result");
  print_result(&mine, opt.rank, backend, opt.world, layers);
  int rc = mine.pass ? 0 : 1;
  uint64_t grace = 0;
  if (opt.rank == 0) {
    host_result world = gather();
    print_result(&world, -1, backend, opt.world, layers);
    print_err(mm_kv_client_put(g_client, NS "/gathered", "", 0), "gathered");
    rc = world.pass ? 0 : 1;
  }
  if (g_server) {
    /* Keep the store up until rank 0 has everything, then let the others
     * say goodbye (bounded) before closing it. */
    if (opt.rank != 0) print_err(await(NS "/gathered", NULL, 0, NULL, &grace), "waiting for rank 0");
    for (int i = 0; i < 200; i++) {
      mm_kv_server_stats st;
      mm_kv_server_get_stats(g_server, &st);
      if (st.connections <= 1) break;
      usleep(10000);
    }
  }
  mm_kv_barrier_free(g_barrier);
  mm_kv_client_close(g_client);
  mm_kv_server_stop(g_server);
  g_barrier = NULL;
  g_client = NULL;
  g_server = NULL;
  return rc;
}

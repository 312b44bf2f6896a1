/* test_kv_mp.c -- the TCP key-value store and its barrier across real
 * processes (fork), on 127.0.0.1: the server in a separate process or in
 * rank 0's, values exchanged between barriers, a rank that is killed, a
 * serving rank that is killed. Children report through their exit codes. */
#include <errno.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <uv.h>

#include "harness.h"
#include "kv_barrier.h"
#include "kv_tcp.h"

#define HOST "127.0.0.1"
enum { EXIT_OK = 0, EXIT_SETUP = 10, EXIT_MISMATCH = 11, EXIT_ABORTED = 12, EXIT_UNAVAILABLE = 13,
       EXIT_OTHER = 14 };

typedef struct {
  int rank, world, rounds;
  int serve;      /* this child starts the server and sends its port up */
  int die_at;     /* raise(SIGKILL) at this round, -1: never */
  const char *expect; /* substring of the error the rank must end with (NULL: none) */
} child_spec;

static int read_int(int fd) {
  int v = -1;
  ssize_t r;
  do r = read(fd, &v, sizeof v);
  while (r < 0 && errno == EINTR);
  return r == sizeof v ? v : -1;
}
static void write_int(int fd, int v) {
  ssize_t r;
  do r = write(fd, &v, sizeof v);
  while (r < 0 && errno == EINTR);
}

static int classify(mm_err *err, const char *expect) {
  int code = megamoe_error_code(err) == MEGAMOE_CODE_ABORTED       ? EXIT_ABORTED
             : megamoe_error_code(err) == MEGAMOE_CODE_UNAVAILABLE ? EXIT_UNAVAILABLE
                                                                   : EXIT_OTHER;
  if (expect && !strstr(megamoe_error_message(err), expect)) code = EXIT_OTHER;
  fprintf(stderr, "# child: %s\n", megamoe_error_message(err));
  megamoe_error_destroy(err);
  return code;
}

/* One rank: rounds of put / barrier / read everybody's values; rank 0 then
 * collects a "done" from every rank, as megamoe-host gathers results. */
static int child_main(const child_spec *sp, int port_in, int port_out) {
  alarm(60);
  mm_kv_server *srv = NULL;
  int port;
  if (sp->serve) {
    if (mm_kv_server_start(HOST, 0, NULL, &srv)) return EXIT_SETUP;
    port = mm_kv_server_port(srv);
    write_int(port_out, port);
  } else {
    port = read_int(port_in);
  }
  mm_kv_client *c = NULL;
  mm_kv_barrier *b = NULL;
  mm_err *err = mm_kv_client_connect(HOST, port, 10000, &c);
  if (!err) err = mm_kv_barrier_new(c, "mp", sp->rank, sp->world, 10000, &b);
  if (err) {
    megamoe_error_destroy(err);
    return EXIT_SETUP;
  }
  int rc = EXIT_OK;
  for (int g = 0; g < sp->rounds && rc == EXIT_OK; g++) {
    if (g == sp->die_at) raise(SIGKILL);
    char key[64], val[64], got[64];
    snprintf(key, sizeof key, "v/%d/%d", g, sp->rank);
    int n = snprintf(val, sizeof val, "round %d rank %d pid %d", g, sp->rank, (int)getpid());
    if ((err = mm_kv_client_put(c, key, val, (size_t)n)) || (err = mm_kv_barrier_wait(b))) {
      rc = classify(err, sp->expect);
      break;
    }
    for (int o = 0; o < sp->world; o++) {
      snprintf(key, sizeof key, "v/%d/%d", g, o);
      size_t len = 0;
      err = mm_kv_client_get(c, key, got, sizeof got - 1, &len, 0);
      if (megamoe_error_code(err) == MEGAMOE_CODE_UNAVAILABLE) { /* the store is gone */
        rc = classify(err, sp->expect);
        break;
      }
      got[len < sizeof got ? len : sizeof got - 1] = '\0';
      snprintf(val, sizeof val, "round %d rank %d pid", g, o);
      if (err || strncmp(got, val, strlen(val))) rc = EXIT_MISMATCH; /* missing or wrong */
      megamoe_error_destroy(err);
    }
  }
  if (rc == EXIT_OK) {
    char key[32];
    snprintf(key, sizeof key, "done/%d", sp->rank);
    if ((err = mm_kv_client_put(c, key, "", 0))) rc = classify(err, sp->expect);
  }
  if (rc == EXIT_OK && sp->rank == 0)
    for (int o = 0; o < sp->world && rc == EXIT_OK; o++) {
      char key[32];
      snprintf(key, sizeof key, "done/%d", o);
      if ((err = mm_kv_barrier_wait_key(b, key, NULL, 0, NULL))) rc = classify(err, sp->expect);
    }
  if (rc == EXIT_OK && sp->expect) rc = EXIT_OTHER; /* an error was expected */
  mm_kv_barrier_free(b);
  mm_kv_client_close(c);
  if (srv) { /* let the others leave before closing the store */
    for (int i = 0; i < 300; i++) {
      mm_kv_server_stats st;
      mm_kv_server_get_stats(srv, &st);
      if (st.connections == 0) break;
      usleep(10000);
    }
    mm_kv_server_stop(srv);
  }
  return rc;
}

/* Forks the children (before any thread exists here), serves from this
 * process unless a child serves, relays the port, waits (bounded). Returns
 * the children's exit codes in codes[] (-SIG when killed). */
static void run_world(const child_spec *spec, int n, int parent_serves, int *codes, double *ms) {
  int to_child[16][2], from_child[2];
  pid_t pid[16];
  CHECK(pipe(from_child) == 0);
  for (int i = 0; i < n; i++) {
    CHECK(pipe(to_child[i]) == 0);
    fflush(stdout);
    pid[i] = fork();
    if (pid[i] == 0) {
      close(from_child[0]);
      _exit(child_main(&spec[i], to_child[i][0], from_child[1]));
    }
    close(to_child[i][0]);
  }
  close(from_child[1]);
  uint64_t t0 = uv_hrtime();
  mm_kv_server *srv = NULL;
  int port = -1;
  if (parent_serves) {
    CHECK_OK(mm_kv_server_start(HOST, 0, NULL, &srv));
    port = mm_kv_server_port(srv);
  } else {
    port = read_int(from_child[0]);
  }
  for (int i = 0; i < n; i++)
    if (!spec[i].serve) write_int(to_child[i][1], port);
  for (int i = 0; i < n; i++) codes[i] = -1000;
  int left = n;
  while (left && (uv_hrtime() - t0) / 1000000u < 60000) {
    for (int i = 0; i < n; i++) {
      int st;
      if (codes[i] != -1000 || waitpid(pid[i], &st, WNOHANG) != pid[i]) continue;
      codes[i] = WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? -WTERMSIG(st) : -999;
      left--;
    }
    usleep(5000);
  }
  *ms = (double)(uv_hrtime() - t0) / 1e6;
  for (int i = 0; i < n; i++)
    if (codes[i] == -1000) { /* stuck: a failure, and no orphan left behind */
      kill(pid[i], SIGKILL);
      waitpid(pid[i], NULL, 0);
    }
  for (int i = 0; i < n; i++) close(to_child[i][1]);
  close(from_child[0]);
  mm_kv_server_stop(srv);
}

static void test_server_apart(void) {
  child_spec s[3];
  int codes[3];
  double ms;
  for (int i = 0; i < 3; i++) s[i] = (child_spec){i, 3, 50, 0, -1, NULL};
  run_world(s, 3, 1, codes, &ms);
  printf("# 3 processes, 50 barriers, store in the parent: %.0f ms\n", ms);
  for (int i = 0; i < 3; i++) CHECK_EQ_INT(codes[i], EXIT_OK);
}

static void test_server_in_rank0(void) {
  child_spec s[2] = {{0, 2, 50, 1, -1, NULL}, {1, 2, 50, 0, -1, NULL}};
  int codes[2];
  double ms;
  run_world(s, 2, 0, codes, &ms);
  printf("# 2 processes, 50 barriers, store in rank 0: %.0f ms\n", ms);
  CHECK_EQ_INT(codes[0], EXIT_OK);
  CHECK_EQ_INT(codes[1], EXIT_OK);
}

static void test_rank_killed(void) {
  int victim = 1 + (int)(mm_test_rand_u64() % 2);
  child_spec s[3];
  for (int i = 0; i < 3; i++)
    s[i] = (child_spec){i, 3, 50, 0, i == victim ? 5 : -1, "lost its connection"};
  int codes[3];
  double ms;
  run_world(s, 3, 1, codes, &ms);
  printf("# rank %d killed at round 5: the others ended in %.0f ms\n", victim, ms);
  for (int i = 0; i < 3; i++) CHECK_EQ_INT(codes[i], i == victim ? -SIGKILL : EXIT_ABORTED);
  CHECK(ms < 10000); /* noticed through the will, not the 10 s timeout */
}

static void test_serving_rank_killed(void) {
  child_spec s[2] = {{0, 2, 50, 1, 5, NULL}, {1, 2, 50, 0, -1, "key-value store 127.0.0.1"}};
  int codes[2];
  double ms;
  run_world(s, 2, 0, codes, &ms);
  printf("# serving rank 0 killed at round 5: rank 1 ended in %.0f ms\n", ms);
  CHECK_EQ_INT(codes[0], -SIGKILL);
  CHECK_EQ_INT(codes[1], EXIT_UNAVAILABLE);
  CHECK(ms < 10000);
}

int main(void) {
  mm_test_seed();
  alarm(240);
  RUN(test_server_apart);
  RUN(test_server_in_rank0);
  RUN(test_rank_killed);
  RUN(test_serving_rank_killed);
  return mm_test_done();
}

/* test_bench_args.c -- the benchmark programs' option parsing
 * (bench/bench_args.h): values taken, and the typos and out-of-range values
 * that used to run a different benchmark refused. */
#include "../bench/bench_args.h"
#include "harness.h"

static void test_int(void) {
  int x = -7;
  CHECK(bench_arg_int("--iters", "20", 1, 100, &x) == 0 && x == 20);
  CHECK(bench_arg_int("--iters", "+5", 1, 100, &x) == 0 && x == 5);
  static const char *const bad[] = {"",    "abc", "4k", "0", "101", "-3", "1e2",
                                    "99999999999999999999"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    x = -7;
    CHECK_MSG(bench_arg_int("--iters", bad[i], 1, 100, &x) == -1 && x == -7, "'%s'", bad[i]);
  }
  CHECK(bench_arg_int("--iters", NULL, 1, 100, &x) == -1);
}

static void test_double(void) {
  double d = -1;
  CHECK(bench_arg_double("--warmup-ms", "1500", 0, 1e6, &d) == 0 && d == 1500);
  CHECK(bench_arg_double("--warmup-ms", "2.5e2", 0, 1e6, &d) == 0 && d == 250);
  static const char *const bad[] = {"", "nan", "inf", "-1", "1e7", "10ms", "x"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    d = -1;
    CHECK_MSG(bench_arg_double("--warmup-ms", bad[i], 0, 1e6, &d) == -1 && d == -1, "'%s'", bad[i]);
  }
}

static void test_choice(void) {
  static const char *const paths[] = {"auto", "wgmma", "prefill", "simt", NULL};
  int k = -1;
  CHECK(bench_arg_choice("--path", "prefill", paths, &k) == 0 && k == 2);
  CHECK(bench_arg_choice("--path", "auto", paths, &k) == 0 && k == 0);
  static const char *const bad[] = {"", "Prefill", "wgmma ", "foo"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    k = -1;
    CHECK_MSG(bench_arg_choice("--path", bad[i], paths, &k) == -1 && k == -1, "'%s'", bad[i]);
  }
  CHECK(bench_arg_choice("--path", NULL, paths, &k) == -1);
}

static void test_int_list(void) {
  int v[4] = {0}, n = -1;
  CHECK(bench_arg_int_list("--M", "256,1024,32768", 0, 1 << 20, v, 4, &n) == 0 && n == 3 &&
        v[0] == 256 && v[1] == 1024 && v[2] == 32768);
  CHECK(bench_arg_int_list("--M", "7", 0, 1 << 20, v, 4, &n) == 0 && n == 1 && v[0] == 7);
  CHECK(bench_arg_int_list("--M", "1,2,3,4", 0, 9, v, 4, &n) == 0 && n == 4);
  static const char *const bad[] = {"", ",", "1,", ",1", "1,,2", "4k", "1,x", "-1", "1,2,3,4,5",
                                    "10", "1;2"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    n = -1;
    CHECK_MSG(bench_arg_int_list("--M", bad[i], 0, 9, v, 4, &n) == -1 && n == -1, "'%s'", bad[i]);
  }
  CHECK(bench_arg_int_list("--M", NULL, 0, 9, v, 4, &n) == -1);
}

int main(void) {
  RUN(test_int);
  RUN(test_double);
  RUN(test_choice);
  RUN(test_int_list);
  return mm_test_done();
}

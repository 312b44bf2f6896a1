/* test_cuda_arch.c -- which devices the built SM targets run on
 * (plugin/cuda_arch.c): the product's sm_90a runs on Hopper (9.0) only. */
#include "cuda_arch.h"
#include "harness.h"

static void test_targets(void) {
  static const struct {
    const char *archs;
    int major, minor, runs;
  } cases[] = {
      {"90a", 9, 0, 1},        {"90a", 8, 0, 0},       {"90a", 8, 9, 0},
      {"90a", 10, 0, 0},       {"90a", 9, 1, 0},       {"90", 9, 0, 1},
      {"90", 9, 1, 1},         {"90", 10, 0, 0},       {"80", 8, 9, 1},
      {"80", 8, 0, 1},         {"89", 8, 6, 0},        {"90a,100a", 10, 0, 1},
      {"90a,100a", 12, 0, 0},  {"100f", 10, 3, 1},     {"100f", 10, 0, 1},
      {"100f", 11, 0, 0},      {"90a,", 9, 0, 1},      {"", 9, 0, 0},
      {"sm_90a", 9, 0, 0},     {"90b", 9, 0, 0},       {"9", 9, 0, 0},
      {"90a 100a", 10, 0, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    CHECK_MSG(mm_cuda_archs_run_on(cases[i].archs, cases[i].major, cases[i].minor) == cases[i].runs,
              "'%s' on %d.%d", cases[i].archs, cases[i].major, cases[i].minor);
  CHECK(mm_cuda_archs_run_on(NULL, 9, 0) == 0);
}

int main(void) {
  RUN(test_targets);
  return mm_test_done();
}

/* test_dispatch_choice.c -- the dispatch mode of a step
 * (plugin/dispatch_choice.c): the fixed modes, auto's threshold, no
 * low-latency step without a low-latency plan, and that ranks with
 * different token counts agree once the step's largest count decides. */
#include "dispatch_choice.h"
#include "harness.h"

enum { N = MM_DISPATCH_RUN_NORMAL, LL = MM_DISPATCH_RUN_LOW_LATENCY };

static void test_modes(void) {
  CHECK_EQ_INT(mm_dispatch_choose(MM_DISPATCH_NORMAL, 256, 1), N);
  CHECK_EQ_INT(mm_dispatch_choose(MM_DISPATCH_LOW_LATENCY, 4096, 4096), LL);
  CHECK_EQ_INT(mm_dispatch_choose(MM_DISPATCH_AUTO, 256, 0), LL);
  CHECK_EQ_INT(mm_dispatch_choose(MM_DISPATCH_AUTO, 256, 256), LL);
  CHECK_EQ_INT(mm_dispatch_choose(MM_DISPATCH_AUTO, 256, 257), N);
  /* low-latency-max-tokens 0 ("never"): not even an empty step (there are
   * no low-latency buffers to run it in) */
  CHECK_EQ_INT(mm_dispatch_choose(MM_DISPATCH_AUTO, 0, 0), N);
  CHECK_EQ_INT(mm_dispatch_choose(MM_DISPATCH_AUTO, 0, 1), N);
}

static void test_deciding_tokens(void) {
  CHECK_EQ_INT(mm_dispatch_deciding_tokens(8, 0), 8);
  CHECK_EQ_INT(mm_dispatch_deciding_tokens(8, 300), 300);
  CHECK_EQ_INT(mm_dispatch_deciding_tokens(0, 17), 17);
}

/* Ranks of one step with random token counts: deciding by the step's
 * largest count, every rank picks the same mode; deciding by their own,
 * ranks on both sides of the threshold pick differently (the hazard the
 * ABI's max_tokens_any_rank removes). */
static void test_ranks_agree(void) {
  uint32_t x = 12345;
  int straddled = 0;
  for (int step = 0; step < 2000; step++) {
    int T[8], mx = 0;
    for (int r = 0; r < 8; r++) {
      x = x * 1664525u + 1013904223u;
      T[r] = (int)((x >> 8) % 600);
      if (T[r] > mx) mx = T[r];
    }
    const int m0 = mm_dispatch_choose(MM_DISPATCH_AUTO, 256, mm_dispatch_deciding_tokens(T[0], mx));
    int own_differ = 0;
    for (int r = 1; r < 8; r++) {
      CHECK(mm_dispatch_choose(MM_DISPATCH_AUTO, 256, mm_dispatch_deciding_tokens(T[r], mx)) == m0);
      own_differ |= mm_dispatch_choose(MM_DISPATCH_AUTO, 256, T[r]) !=
                    mm_dispatch_choose(MM_DISPATCH_AUTO, 256, T[0]);
    }
    straddled += own_differ;
  }
  CHECK(straddled > 100); /* the random steps do straddle the threshold */
}

int main(void) {
  RUN(test_modes);
  RUN(test_deciding_tokens);
  RUN(test_ranks_agree);
  return mm_test_done();
}

/* test_mode_choice.c -- compute.mode's weight mode choice (plugin/mode_choice.h):
 * the measured table's shape, the documented outcomes at the default and
 * at the edges of each bound, random bounds against a brute-force statement
 * of the rule, explicit modes ignoring the bound, the fallback when nothing
 * is accurate enough, and the log line. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "harness.h"
#include "mode_choice.h"

static const mm_weight_mode all_modes[4] = {MM_WMODE_G32_FP8, MM_WMODE_G16_BF16_EXACT,
                                            MM_WMODE_G16_FP8, MM_WMODE_G32_F16_EXACT};

static void test_table(void) {
  int prev = 0;
  for (int i = 0; i < MM_MODE_PERF_NUM_M; i++) {
    CHECK(mm_mode_perf_m(i) > prev);
    prev = mm_mode_perf_m(i);
  }
  CHECK_EQ_INT(mm_mode_perf_m(-1), -1);
  CHECK_EQ_INT(mm_mode_perf_m(MM_MODE_PERF_NUM_M), -1);
  for (int j = 0; j < 4; j++) {
    const mm_weight_mode m = all_modes[j];
    const double b = mm_mode_error_bound(m);
    CHECK_MSG(b > 0 && b <= 1, "mode %d bound %g", (int)m, b);
    for (int i = 0; i < MM_MODE_PERF_NUM_M; i++) CHECK(mm_mode_perf_us(m, i) > 0);
    /* more tokens never take less time */
    for (int i = 1; i < MM_MODE_PERF_NUM_M; i++)
      CHECK(mm_mode_perf_us(m, i) > mm_mode_perf_us(m, i - 1));
    CHECK(mm_mode_perf_us(m, -1) < 0 && mm_mode_perf_us(m, MM_MODE_PERF_NUM_M) < 0);
    CHECK(strcmp(mm_weight_mode_name(m), "?") != 0);
  }
  CHECK(mm_mode_error_bound((mm_weight_mode)0) < 0 && mm_mode_error_bound((mm_weight_mode)5) < 0);
  CHECK(mm_mode_perf_us((mm_weight_mode)5, 0) < 0);
  CHECK(!strcmp(mm_weight_mode_name((mm_weight_mode)9), "?"));
  /* the exact modes are the accurate ones of their granularity */
  CHECK(mm_mode_error_bound(MM_WMODE_G32_F16_EXACT) < mm_mode_error_bound(MM_WMODE_G32_FP8));
  CHECK(mm_mode_error_bound(MM_WMODE_G16_BF16_EXACT) < mm_mode_error_bound(MM_WMODE_G16_FP8));
}

static mm_weight_mode pick(int gran, double e) {
  return mm_choose_weight_mode(gran, MM_COMPUTE_AUTO, e).mode;
}

/* The outcomes the configuration reference documents. */
static void test_documented(void) {
  CHECK_EQ_INT(pick(32, 0.02), MM_WMODE_G32_FP8);
  CHECK_EQ_INT(pick(16, 0.02), MM_WMODE_G16_BF16_EXACT);
  CHECK_EQ_INT(pick(32, 1e-3), MM_WMODE_G32_F16_EXACT);
  CHECK_EQ_INT(pick(16, 1e-3), MM_WMODE_G16_BF16_EXACT);
  CHECK_EQ_INT(pick(32, 0.1), MM_WMODE_G32_FP8);
  CHECK_EQ_INT(pick(16, 0.1), MM_WMODE_G16_FP8);
  CHECK_EQ_INT(pick(32, 1.0), MM_WMODE_G32_FP8);
  CHECK_EQ_INT(pick(16, 1.0), MM_WMODE_G16_FP8);
  /* bounds are inclusive: just below one excludes the mode */
  CHECK_EQ_INT(pick(32, nextafter(0.02, 0.0)), MM_WMODE_G32_F16_EXACT);
  CHECK_EQ_INT(pick(16, nextafter(0.1, 0.0)), MM_WMODE_G16_BF16_EXACT);
  /* the default 0.02 with every granularity a checkpoint may report; not
   * 32 is taken as 16 (0: no local experts) */
  const int grans[] = {0, 16, 7, -1};
  for (int g = 0; g < 4; g++) CHECK_EQ_INT(pick(grans[g], 0.02), MM_WMODE_G16_BF16_EXACT);
  mm_mode_choice c = mm_choose_weight_mode(32, MM_COMPUTE_AUTO, 0.02);
  CHECK(c.auto_pick && c.met_bound);
  CHECK_EQ_INT(c.candidates, 2);
  CHECK_EQ_INT(c.eligible, 2);
  CHECK_EQ_INT(c.wins, MM_MODE_PERF_NUM_M); /* mode 1 is the fastest at every M */
  c = mm_choose_weight_mode(32, MM_COMPUTE_AUTO, 1e-3);
  CHECK_EQ_INT(c.eligible, 1);
  CHECK(c.met_bound);
}

/* Nothing accurate enough: the most accurate mode, met_bound 0. */
static void test_fallback(void) {
  const double tight[] = {nextafter(1e-3, 0.0), 1e-4, 1e-9, 4.9e-324};
  for (int i = 0; i < 4; i++) {
    mm_mode_choice c = mm_choose_weight_mode(32, MM_COMPUTE_AUTO, tight[i]);
    CHECK_EQ_INT(c.mode, MM_WMODE_G32_F16_EXACT);
    CHECK(!c.met_bound && c.auto_pick && c.eligible == 0);
    c = mm_choose_weight_mode(16, MM_COMPUTE_AUTO, tight[i]);
    CHECK_EQ_INT(c.mode, MM_WMODE_G16_BF16_EXACT);
    CHECK(!c.met_bound && c.eligible == 0);
  }
}

/* The rule, stated by brute force over the public table. */
static mm_weight_mode reference(int gran, double e, int *met) {
  const mm_weight_mode cand[2] = {gran == 32 ? MM_WMODE_G32_FP8 : MM_WMODE_G16_FP8,
                                  gran == 32 ? MM_WMODE_G32_F16_EXACT : MM_WMODE_G16_BF16_EXACT};
  int best_wins = -1;
  mm_weight_mode best = 0, accurate = cand[0];
  for (int j = 0; j < 2; j++) {
    const double bj = mm_mode_error_bound(cand[j]);
    if (bj < mm_mode_error_bound(accurate)) accurate = cand[j];
    if (bj > e) continue;
    int wins = 0;
    for (int i = 0; i < MM_MODE_PERF_NUM_M; i++) {
      int fastest = 1;
      for (int k = 0; k < 2; k++)
        if (k != j && mm_mode_error_bound(cand[k]) <= e &&
            mm_mode_perf_us(cand[k], i) < mm_mode_perf_us(cand[j], i))
          fastest = 0;
      wins += fastest;
    }
    if (wins > best_wins ||
        (wins == best_wins && bj < mm_mode_error_bound(best))) {
      best_wins = wins;
      best = cand[j];
    }
  }
  *met = best_wins >= 0;
  return *met ? best : accurate;
}

static void test_random_bounds(void) {
  for (int it = 0; it < 20000; it++) {
    /* log-uniform in [1e-9, 1], plus the bounds themselves now and then */
    double e = pow(10.0, -9.0 * mm_test_uniform(0.0f, 1.0f));
    if (it % 7 == 0) e = mm_mode_error_bound(all_modes[it % 4]);
    if (it % 11 == 0) e = nextafter(mm_mode_error_bound(all_modes[it % 4]), 0.0);
    const int gran = it & 1 ? 32 : 16;
    int met = 0;
    const mm_weight_mode want = reference(gran, e, &met);
    const mm_mode_choice c = mm_choose_weight_mode(gran, MM_COMPUTE_AUTO, e);
    CHECK_MSG(c.mode == want && c.met_bound == met, "gran %d bound %.17g: mode %d (met %d), "
              "expected %d (met %d)", gran, e, (int)c.mode, c.met_bound, (int)want, met);
    /* the pick always belongs to the granularity */
    if (gran == 32) CHECK(c.mode == MM_WMODE_G32_FP8 || c.mode == MM_WMODE_G32_F16_EXACT);
    else CHECK(c.mode == MM_WMODE_G16_FP8 || c.mode == MM_WMODE_G16_BF16_EXACT);
    if (c.met_bound) CHECK(mm_mode_error_bound(c.mode) <= e);
    /* explicit modes do not look at the bound */
    const mm_mode_choice f = mm_choose_weight_mode(gran, MM_COMPUTE_FP8, e);
    const mm_mode_choice x = mm_choose_weight_mode(gran, MM_COMPUTE_BF16_EXACT, e);
    CHECK_EQ_INT(f.mode, gran == 32 ? MM_WMODE_G32_FP8 : MM_WMODE_G16_FP8);
    CHECK_EQ_INT(x.mode, gran == 32 ? MM_WMODE_G32_F16_EXACT : MM_WMODE_G16_BF16_EXACT);
    CHECK(f.met_bound && !f.auto_pick && x.met_bound && !x.auto_pick);
    if (mm_test_case_failed_) break;
  }
}

/* A looser bound never gives a slower mode: where the pick changes, the new
 * mode is faster than the old one at most of the measured M (not at every
 * M: version 18's mode 2 is faster than mode 3 at M = 256 only). */
static void test_monotone(void) {
  for (int g = 0; g < 2; g++) {
    const int gran = g ? 32 : 16;
    mm_weight_mode prev = pick(gran, 1e-9);
    for (double e = 1e-9; e <= 1.0; e *= 1.07) {
      mm_weight_mode m = pick(gran, e);
      if (m != prev) {
        int faster = 0, slower = 0;
        for (int i = 0; i < MM_MODE_PERF_NUM_M; i++) {
          faster += mm_mode_perf_us(m, i) < mm_mode_perf_us(prev, i);
          slower += mm_mode_perf_us(m, i) > mm_mode_perf_us(prev, i);
        }
        CHECK_MSG(faster > slower, "gran %d bound %g: mode %d faster at %d M, slower at %d", gran,
                  e, (int)m, faster, slower);
      }
      prev = m;
    }
  }
}

static void test_describe(void) {
  char buf[512];
  mm_mode_choice c = mm_choose_weight_mode(32, MM_COMPUTE_AUTO, 0.02);
  size_t n = mm_mode_choice_describe(&c, 32, MM_COMPUTE_AUTO, 0.02, buf, sizeof buf);
  printf("# %s\n", buf);
  CHECK(n == strlen(buf) && n < sizeof buf);
  CHECK(strstr(buf, "compute.mode auto") && strstr(buf, "gran-k 32"));
  CHECK(strstr(buf, "weight mode 1 (g32-fp8"));
  CHECK(strstr(buf, "fastest at 3 of 3 measured M"));
  char us[32]; /* the table's figure at the first M, as describe prints it */
  snprintf(us, sizeof us, "%.1f / ", mm_mode_perf_us(MM_WMODE_G32_FP8, 0));
  CHECK(strstr(buf, us));
  c = mm_choose_weight_mode(16, MM_COMPUTE_AUTO, 1e-5);
  n = mm_mode_choice_describe(&c, 16, MM_COMPUTE_AUTO, 1e-5, buf, sizeof buf);
  printf("# %s\n", buf);
  CHECK(strstr(buf, "no weight mode meets compute.max-rel-error 1e-05"));
  CHECK(strstr(buf, "weight mode 2 (g16-bf16-exact, error bound 1e-03)"));
  c = mm_choose_weight_mode(16, MM_COMPUTE_FP8, 1e-5);
  n = mm_mode_choice_describe(&c, 16, MM_COMPUTE_FP8, 1e-5, buf, sizeof buf);
  printf("# %s\n", buf);
  CHECK(strstr(buf, "compute.mode fp8, gran-k 16: weight mode 3 (g16-fp8"));
  CHECK(!strstr(buf, "max-rel-error"));
  /* truncation behaves like snprintf; no buffer gives the length */
  char small[8];
  memset(small, 'x', sizeof small);
  size_t full = mm_mode_choice_describe(&c, 16, MM_COMPUTE_FP8, 1e-5, small, sizeof small);
  CHECK(full == n && small[7] == '\0' && strlen(small) == 7);
  CHECK(mm_mode_choice_describe(&c, 16, MM_COMPUTE_FP8, 1e-5, NULL, 0) == n);
}

int main(void) {
  mm_test_seed();
  RUN(test_table);
  RUN(test_documented);
  RUN(test_fallback);
  RUN(test_random_bounds);
  RUN(test_monotone);
  RUN(test_describe);
  return mm_test_done();
}

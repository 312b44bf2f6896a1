/* harness.h -- a tiny TAP test harness. Each test binary prints TAP
 * ("ok 3 - name"), automake's tap-driver counts the cases. A binary that
 * needs a GPU and has none calls mm_test_skip_all(reason) (prints 1..0 # SKIP).
 *
 *   static void test_something(void) { CHECK(x == 1); CHECK_NEAR(a, b, 1e-6); }
 *   int main(void) { RUN(test_something); return mm_test_done(); }
 */
#ifndef MM_TEST_HARNESS_H
#define MM_TEST_HARNESS_H

#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int mm_test_count_ = 0;
static int mm_test_failed_cases_ = 0;
static int mm_test_case_failed_ = 0;

#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      printf("# %s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);    \
      mm_test_case_failed_ = 1;                                            \
    }                                                                      \
  } while (0)

#define CHECK_MSG(cond, ...)                                               \
  do {                                                                     \
    if (!(cond)) {                                                         \
      printf("# %s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);    \
      printf(__VA_ARGS__);                                                 \
      printf("\n");                                                        \
      mm_test_case_failed_ = 1;                                            \
    }                                                                      \
  } while (0)

#define CHECK_EQ_INT(a, b)                                                 \
  do {                                                                     \
    long long a_ = (long long)(a), b_ = (long long)(b);                    \
    if (a_ != b_) {                                                        \
      printf("# %s:%d: %s == %s failed: %lld != %lld\n", __FILE__,         \
             __LINE__, #a, #b, a_, b_);                                    \
      mm_test_case_failed_ = 1;                                            \
    }                                                                      \
  } while (0)

#define CHECK_NEAR(a, b, tol)                                              \
  do {                                                                     \
    double a_ = (double)(a), b_ = (double)(b);                             \
    if (!(fabs(a_ - b_) <= (tol))) {                                       \
      printf("# %s:%d: |%s - %s| <= %g failed: %.9g vs %.9g\n", __FILE__,  \
             __LINE__, #a, #b, (double)(tol), a_, b_);                     \
      mm_test_case_failed_ = 1;                                            \
    }                                                                      \
  } while (0)

/* CHECK_OK(expr): expr returns megamoe_error*; fails and frees if non-NULL. */
#define CHECK_OK(expr)                                                     \
  do {                                                                     \
    megamoe_error *e_ = (expr);                                            \
    if (e_) {                                                              \
      printf("# %s:%d: %s failed: [%d] %s\n", __FILE__, __LINE__, #expr,   \
             (int)e_->code, e_->message);                                  \
      megamoe_error_destroy(e_);                                           \
      mm_test_case_failed_ = 1;                                            \
    }                                                                      \
  } while (0)

/* CHECK_ERR(expr, code): expr must fail with `code`; the error is freed. */
#define CHECK_ERR(expr, want_code)                                              \
  do {                                                                     \
    megamoe_error *e_ = (expr);                                            \
    if (!e_) {                                                             \
      printf("# %s:%d: %s succeeded, expected code %d\n", __FILE__,        \
             __LINE__, #expr, (int)(want_code));                                \
      mm_test_case_failed_ = 1;                                            \
    } else {                                                               \
      if ((int)e_->code != (int)(want_code)) {                                  \
        printf("# %s:%d: %s: code %d, expected %d (%s)\n", __FILE__,       \
               __LINE__, #expr, (int)e_->code, (int)(want_code), e_->message);  \
        mm_test_case_failed_ = 1;                                          \
      }                                                                    \
      megamoe_error_destroy(e_);                                           \
    }                                                                      \
  } while (0)

static inline void mm_test_run_(const char *name, void (*fn)(void)) {
  mm_test_case_failed_ = 0;
  fn();
  mm_test_count_++;
  if (mm_test_case_failed_) mm_test_failed_cases_++;
  printf("%s %d - %s\n", mm_test_case_failed_ ? "not ok" : "ok", mm_test_count_, name);
  fflush(stdout);
}
#define RUN(fn) mm_test_run_(#fn, fn)

static inline int mm_test_done(void) {
  printf("1..%d\n", mm_test_count_);
  return mm_test_failed_cases_ ? 1 : 0;
}

static inline int mm_test_skip_all(const char *reason) {
  printf("1..0 # SKIP %s\n", reason);
  return 0;
}

/* Zeroed memory for a test's buffers; out of memory ends the binary with a
 * message (a Bail out! line: the run counts as failed) instead of a crash
 * on a NULL pointer. */
static inline void *mm_test_alloc(size_t bytes) {
  void *p = calloc(bytes ? bytes : 1, 1);
  if (!p) {
    printf("Bail out! out of memory (%zu bytes)\n", bytes);
    exit(1);
  }
  return p;
}

/* Deterministic per-test random numbers (splitmix64); seed from
 * MEGAMOE_TEST_SEED or the time, printed so a failure can be replayed. */
static uint64_t mm_test_rng_state_ = 0;
static inline uint64_t mm_test_rand_u64(void) {
  uint64_t z = (mm_test_rng_state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static inline void mm_test_seed(void) {
  const char *s = getenv("MEGAMOE_TEST_SEED");
  uint64_t seed = s ? strtoull(s, NULL, 0) : (uint64_t)time(NULL) ^ (uint64_t)clock();
  mm_test_rng_state_ = seed;
  /* line-buffered even into a file: a test killed by a timeout still shows
   * how far it got */
  setvbuf(stdout, NULL, _IOLBF, 0);
  printf("# seed %llu (MEGAMOE_TEST_SEED to replay)\n", (unsigned long long)seed);
}
static inline float mm_test_uniform(float lo, float hi) {
  return lo + (hi - lo) * (float)((mm_test_rand_u64() >> 40) * (1.0 / 16777216.0));
}
static inline float mm_test_normal(void) {
  float u1 = mm_test_uniform(1e-7f, 1.0f), u2 = mm_test_uniform(0.0f, 1.0f);
  return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

/* The source tree (MEGAMOE_SRCDIR, which make check sets; else "."). */
static inline const char *mm_test_srcdir(void) {
  const char *s = getenv("MEGAMOE_SRCDIR");
  return s && *s ? s : ".";
}

/* A whole file as a NUL-terminated string (free it), or NULL. */
static inline char *mm_test_read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)n + 1);
  if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) n = 0;
  if (buf) buf[n] = '\0';
  fclose(f);
  return buf;
}

/* Removes a file or a directory tree (test scratch space). */
static inline void mm_test_rm_tree(const char *path) {
  DIR *d = opendir(path);
  if (!d) {
    unlink(path);
    return;
  }
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", path, e->d_name);
    mm_test_rm_tree(p);
  }
  closedir(d);
  rmdir(path);
}

#endif

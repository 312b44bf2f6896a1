/* expert_counts.c -- the benchmark's expert loads (expert_counts.h). */
#include "expert_counts.h"

#include <stdint.h>
#include <string.h>

const char *const mm_load_names[MM_LOAD_COUNT] = {"uniform", "skewed", "random", "zipf"};

int mm_load_by_name(const char *name) {
  for (int k = 0; k < MM_LOAD_COUNT; k++)
    if (!strcmp(name, mm_load_names[k])) return k;
  return -1;
}

/* expert i's share of n rows spread evenly over k: the first n % k take one more */
static int even_share(int n, int k, int i) { return n / k + (i < n % k); }

void mm_load_counts(int load, int M, int E, int *cnt) {
  for (int e = 0; e < E; e++) cnt[e] = 0;
  if (load == MM_LOAD_UNIFORM) {
    for (int e = 0; e < E; e++) cnt[e] = even_share(M, E, e);
    return;
  }
  if (load == MM_LOAD_SKEWED) {
    if (E == 1) {
      cnt[0] = M;
      return;
    }
    cnt[0] = M / 2;
    for (int e = 1; e < E; e++) cnt[e] = even_share(M - M / 2, E - 1, e - 1);
    return;
  }
  double zsum = 0.0;
  for (int e = 0; e < E; e++) zsum += 1.0 / (e + 1);
  uint32_t rng = 0x9E3779B9u ^ (uint32_t)M;
  for (int r = 0; r < M; r++) {
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    int e = (int)(((uint64_t)rng * (uint64_t)E) >> 32);
    if (load == MM_LOAD_ZIPF) { /* the first expert whose cumulative weight passes u */
      const double u = rng / 4294967296.0 * zsum;
      double acc = 1.0;
      e = 0;
      while (e < E - 1 && acc <= u) acc += 1.0 / (++e + 1);
    }
    cnt[e]++;
  }
}

/* expert_counts_dump.c -- prints bench_moe_compute's expert counts
 * (bench/expert_counts.h), one line per M and load: "M load c0 c1 ...",
 * for tests/test_padding_by_count.sh to compare with
 * scripts/padding_by_count.py's copy of the generator.
 *
 *   expert_counts_dump E M[,M...] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../bench/expert_counts.h"

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s E M[,M...]\n", argv[0]);
    return 2;
  }
  const int E = atoi(argv[1]);
  if (E < 1 || E > 4096) {
    fprintf(stderr, "E must be 1..4096\n");
    return 2;
  }
  int *cnt = malloc(sizeof(int) * (size_t)E);
  if (!cnt) return 1;
  for (char *s = strtok(argv[2], ","); s; s = strtok(NULL, ",")) {
    const int M = atoi(s);
    if (M < 0) {
      fprintf(stderr, "M must be >= 0\n");
      free(cnt);
      return 2;
    }
    for (int load = 0; load < MM_LOAD_COUNT; load++) {
      mm_load_counts(load, M, E, cnt);
      printf("%d %s", M, mm_load_names[load]);
      for (int e = 0; e < E; e++) printf(" %d", cnt[e]);
      printf("\n");
    }
  }
  free(cnt);
  return 0;
}

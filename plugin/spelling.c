/* spelling.c -- optimal string alignment distance, with three rolling rows. */
#include "spelling.h"

#include <limits.h>
#include <string.h>

int mm_osa_distance(const char *a, const char *b) {
  size_t n = strlen(a), m = strlen(b);
  if (n > MM_SPELLING_MAX || m > MM_SPELLING_MAX) return INT_MAX;
  int rows[3][MM_SPELLING_MAX + 1];
  int *pp = rows[0], *prev = rows[1], *cur = rows[2];
  for (size_t j = 0; j <= m; j++) prev[j] = (int)j;
  for (size_t i = 1; i <= n; i++) {
    cur[0] = (int)i;
    for (size_t j = 1; j <= m; j++) {
      int cost = a[i - 1] != b[j - 1];
      int v = prev[j] + 1;
      if (cur[j - 1] + 1 < v) v = cur[j - 1] + 1;
      if (prev[j - 1] + cost < v) v = prev[j - 1] + cost;
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] && pp[j - 2] + 1 < v)
        v = pp[j - 2] + 1; /* a transposition */
      cur[j] = v;
    }
    int *t = pp;
    pp = prev;
    prev = cur;
    cur = t;
  }
  return prev[m];
}

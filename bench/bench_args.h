/* bench_args.h -- strict option values for the benchmark programs: a typo
 * or a value out of range is refused with the option named (the program
 * then exits with code 2), so that a benchmark never runs, and labels its
 * rows with, something other than what was asked for. Each function
 * returns 0, or -1 after printing why on stderr. */
#ifndef MM_BENCH_ARGS_H
#define MM_BENCH_ARGS_H

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* An integer in [lo, hi]. */
static inline int bench_arg_int(const char *opt, const char *v, long lo, long hi, int *out) {
  char *end = NULL;
  errno = 0;
  const long x = v ? strtol(v, &end, 10) : 0;
  if (!v || !*v || *end || errno || x < lo || x > hi) {
    fprintf(stderr, "%s needs an integer in [%ld, %ld], not '%s'\n", opt, lo, hi, v ? v : "");
    return -1;
  }
  *out = (int)x;
  return 0;
}

/* A finite number in [lo, hi]. */
static inline int bench_arg_double(const char *opt, const char *v, double lo, double hi,
                                   double *out) {
  char *end = NULL;
  const double x = v ? strtod(v, &end) : NAN;
  if (!v || !*v || *end || !isfinite(x) || x < lo || x > hi) {
    fprintf(stderr, "%s needs a number in [%g, %g], not '%s'\n", opt, lo, hi, v ? v : "");
    return -1;
  }
  *out = x;
  return 0;
}

/* One of names (NULL-terminated): its index. */
static inline int bench_arg_choice(const char *opt, const char *v, const char *const *names,
                                   int *out) {
  for (int i = 0; v && names[i]; i++)
    if (!strcmp(v, names[i])) {
      *out = i;
      return 0;
    }
  fprintf(stderr, "%s takes", opt);
  for (int i = 0; names[i]; i++) fprintf(stderr, "%s %s", i ? "," : "", names[i]);
  fprintf(stderr, ", not '%s'\n", v ? v : "");
  return -1;
}

/* 1 to cap comma-separated integers in [lo, hi]: out[0 .. *n). */
static inline int bench_arg_int_list(const char *opt, const char *v, long lo, long hi, int *out,
                                     int cap, int *n) {
  int k = 0;
  const char *s = v;
  while (s && *s) {
    char *end = NULL;
    errno = 0;
    const long x = strtol(s, &end, 10);
    if (end == s || errno || x < lo || x > hi || (*end && *end != ',') || k == cap) break;
    out[k++] = (int)x;
    s = *end == ',' ? end + 1 : end;
  }
  if (!s || *s || k == 0 || v[strlen(v) - 1] == ',') { /* a trailing comma too */
    fprintf(stderr, "%s needs 1 to %d comma-separated integers in [%ld, %ld], not '%s'\n", opt,
            cap, lo, hi, v ? v : "");
    return -1;
  }
  *n = k;
  return 0;
}

/* A layer-shaped benchmark's options: [--experts E] [--hidden H] [--inter
 * I] [--reps N], the shapes multiples of 128. The values passed in are the
 * defaults. Returns 0, or 2 (the exit code) after saying why. */
static inline int bench_layer_args(int argc, char **argv, int *E, int *H, int *I, int *reps,
                                   int max_reps) {
  for (int i = 1; i < argc; i += 2) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    int bad;
    if (!strcmp(a, "--experts")) bad = bench_arg_int(a, v, 1, 4096, E);
    else if (!strcmp(a, "--hidden")) bad = bench_arg_int(a, v, 128, 65536, H);
    else if (!strcmp(a, "--inter")) bad = bench_arg_int(a, v, 128, 65536, I);
    else if (!strcmp(a, "--reps")) bad = bench_arg_int(a, v, 1, max_reps, reps);
    else {
      fprintf(stderr, "usage: %s [--experts E] [--hidden H] [--inter I] [--reps N]\n", argv[0]);
      return 2;
    }
    if (bad) return 2;
  }
  if (*H % 128 || *I % 128) {
    fprintf(stderr, "--hidden and --inter must be multiples of 128\n");
    return 2;
  }
  return 0;
}

#endif

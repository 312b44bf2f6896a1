/* bench_util.h -- shared by the bench programs in bench/: a failed call ends
 * the run with its message (a benchmark has nothing to recover). */
#ifndef MM_BENCH_UTIL_H
#define MM_BENCH_UTIL_H

#include <stdio.h>
#include <stdlib.h>

#include "status.h"

#define OK(call)                                                                 \
  do {                                                                           \
    mm_err *e_ = (call);                                                         \
    if (e_) {                                                                    \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, e_->message); \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

#endif

/* dispatch_choice.c -- the dispatch mode of a step (see the header). */
#include "dispatch_choice.h"

int mm_dispatch_deciding_tokens(int T, int max_any_rank) { return max_any_rank > 0 ? max_any_rank : T; }

int mm_dispatch_choose(mm_dispatch_mode mode, int ll_planned, int deciding_tokens) {
  switch (mode) {
    case MM_DISPATCH_NORMAL: return MM_DISPATCH_RUN_NORMAL;
    case MM_DISPATCH_LOW_LATENCY: return MM_DISPATCH_RUN_LOW_LATENCY;
    default:
      return ll_planned > 0 && deciding_tokens <= ll_planned ? MM_DISPATCH_RUN_LOW_LATENCY
                                                             : MM_DISPATCH_RUN_NORMAL;
  }
}

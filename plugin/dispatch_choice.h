/* dispatch_choice.h -- which dispatch mode a step runs (docs/CONFIG.md,
 * dispatch-mode). Every rank of an expert-parallel group must run the same
 * mode in a step: a mismatch ends in the step's timeout and the op turns
 * fatal. So under `auto` the choice is made from a count all ranks share:
 * the largest token count of any rank in the step when the host gives it
 * (execute's max_tokens_any_rank, ABI 1.2), else this rank's own, which is
 * safe only while every rank's count lies on the same side of
 * dispatch.low-latency-max-tokens. Pure, so CPU tests check it. */
#ifndef MM_DISPATCH_CHOICE_H
#define MM_DISPATCH_CHOICE_H

#include "config.h"

/* mm_ep_mode's values (plugin/ep_engine.h) */
enum { MM_DISPATCH_RUN_NORMAL = 1, MM_DISPATCH_RUN_LOW_LATENCY = 2 };

/* The count the choice is made from: max_any_rank when given (> 0), else T. */
int mm_dispatch_deciding_tokens(int T, int max_any_rank);

/* The mode of a step under the dispatch-mode key `mode`: normal and
 * low-latency as set; auto: low-latency when the plan made a low-latency
 * capacity (ll_planned > 0) and the deciding count is at most that. */
int mm_dispatch_choose(mm_dispatch_mode mode, int ll_planned, int deciding_tokens);

#endif

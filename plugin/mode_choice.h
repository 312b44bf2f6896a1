/* mode_choice.h -- which sm90 weight mode (plugin/layout_sm90.h) a layer
 * gets under compute.mode and compute.max-rel-error. Pure: the choice is
 * made from a static table of measured times and error bounds
 * (mode_choice.c), so CPU tests check it. */
#ifndef MM_MODE_CHOICE_H
#define MM_MODE_CHOICE_H

#include <stddef.h>

#include "config.h"
#include "layout_sm90.h"

/* Token counts (rows M of one rank's expert pool) the table was measured at. */
#define MM_MODE_PERF_NUM_M 3

typedef struct mm_mode_choice {
  mm_weight_mode mode;
  int met_bound;  /* 1: the mode's error bound <= max_rel_error (always 1 for an explicit mode) */
  int auto_pick;  /* 1: chosen by compute.mode auto from the table */
  int candidates; /* auto: modes of the granularity considered (2) */
  int eligible;   /* auto: of those, the ones whose bound met max_rel_error */
  int wins;       /* auto: measured M at which `mode` was the fastest eligible one */
} mm_mode_choice;

/* The measured M (i < MM_MODE_PERF_NUM_M), a mode's median time at it (us)
 * and a mode's end-to-end relative error bound; -1 for an unknown mode. */
int mm_mode_perf_m(int i);
double mm_mode_perf_us(mm_weight_mode mode, int i);
double mm_mode_error_bound(mm_weight_mode mode);
/* "g32-fp8", "g16-bf16-exact", "g16-fp8", "g32-f16-exact" (docs/LAYOUTS.md), "?" */
const char *mm_weight_mode_name(mm_weight_mode mode);

/* The weight mode for a layer of gran-k `gran` (32; anything else is taken
 * as 16) under compute.mode `mode`:
 *  fp8:        gran 32 -> 1 (QGMMA), gran 16 -> 3 (lossy fold);
 *  bf16-exact: gran 32 -> 4, gran 16 -> 2 (F16 HGMMA, exact);
 *  auto:       the modes of the granularity whose error bound is <=
 *              max_rel_error, then the fastest at the largest number of
 *              measured M (ties: the more accurate). None eligible: the most
 *              accurate, with met_bound = 0 (the caller warns).
 * max_rel_error only matters for auto. */
mm_mode_choice mm_choose_weight_mode(int gran, mm_compute_mode mode, double max_rel_error);

/* One line for the log: the choice and why. Like snprintf. */
size_t mm_mode_choice_describe(const mm_mode_choice *c, int gran, mm_compute_mode mode,
                               double max_rel_error, char *buf, size_t size);

#endif

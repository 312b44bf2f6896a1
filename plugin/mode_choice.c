/* mode_choice.c -- compute.mode auto: per granularity, the fastest measured
 * weight mode among those accurate enough for compute.max-rel-error. */
#include "mode_choice.h"

#include <stdio.h>

/* Measured on an H200: one EP8 rank of GLM-5 (32 local experts, H 6144,
 * I 2048), bench_moe_compute medians in microseconds (`--profile-only
 * --iters 20`), uniform routing, version 44's kernels and launch rules,
 * mean of two runs. Modes 1, 3 and 4 with per-block references
 * (`--block-refs`), the slower of their two forms (where every row takes
 * the packer's row anchor, modes 1 and 3 take the prefill path at
 * M = 32768: about 2860 and 2950 us in the same machine's issue 4 run).
 * Source: docs/PERF.md, fifty-fourth stop; version 35's
 * table, the one before, picked the same modes. */
static const int perf_m[MM_MODE_PERF_NUM_M] = {256, 1024, 32768};
_Static_assert(MM_MODE_PERF_NUM_M == 3, "mm_mode_choice_describe prints three M");

/* End-to-end relative error bounds (Frobenius, layer output against the
 * float64 CPU reference), the measurement with margin:
 *  mode 1: QGMMA accumulation error, measured up to 1.6e-2 on small random
 *          shapes and 5.5e-3 on a GLM-5-shaped run -> 2e-2;
 *  modes 2, 4: exact products, FP32 accumulation, measured ~1e-7; a single
 *          rounding near-tie of the FP8 intermediate can move a tiny batch
 *          by ~1e-3 -> 1e-3;
 *  mode 3: measured 4.5 .. 7% (weight fold error 2.4%) -> 1e-1. */
#define MM_MODE1_BOUND 2e-2
#define MM_MODE_EXACT_BOUND 1e-3
#define MM_MODE3_BOUND 1e-1

typedef struct mode_row {
  double bound;
  double us[MM_MODE_PERF_NUM_M];
} mode_row;

/* Indexed by mm_weight_mode (1..4). */
static const mode_row rows[5] = {
  [MM_WMODE_G32_FP8] = {MM_MODE1_BOUND, {184.9, 228.4, 3233.2}},
  [MM_WMODE_G16_BF16_EXACT] = {MM_MODE_EXACT_BOUND, {197.4, 247.2, 4353.2}},
  [MM_WMODE_G16_FP8] = {MM_MODE3_BOUND, {193.2, 232.9, 3244.6}},
  [MM_WMODE_G32_F16_EXACT] = {MM_MODE_EXACT_BOUND, {252.8, 303.1, 4745.2}},
};

static int known(mm_weight_mode m) { return m >= MM_WMODE_G32_FP8 && m <= MM_WMODE_G32_F16_EXACT; }

int mm_mode_perf_m(int i) { return i >= 0 && i < MM_MODE_PERF_NUM_M ? perf_m[i] : -1; }

double mm_mode_perf_us(mm_weight_mode mode, int i) {
  return known(mode) && i >= 0 && i < MM_MODE_PERF_NUM_M ? rows[mode].us[i] : -1.0;
}

double mm_mode_error_bound(mm_weight_mode mode) { return known(mode) ? rows[mode].bound : -1.0; }

const char *mm_weight_mode_name(mm_weight_mode mode) {
  switch (mode) {
    case MM_WMODE_G32_FP8: return "g32-fp8";
    case MM_WMODE_G16_BF16_EXACT: return "g16-bf16-exact";
    case MM_WMODE_G16_FP8: return "g16-fp8";
    case MM_WMODE_G32_F16_EXACT: return "g32-f16-exact";
  }
  return "?";
}

/* The weights are laid out once per layer, before any token count is known,
 * so auto fixes one mode per layer: the one that is fastest at the most
 * measured M. A tie in that count goes to the more accurate mode (then the
 * lower mode number, so the result never depends on candidate order). */
mm_mode_choice mm_choose_weight_mode(int gran, mm_compute_mode mode, double max_rel_error) {
  mm_mode_choice c = {0};
  const mm_weight_mode fast = gran == 32 ? MM_WMODE_G32_FP8 : MM_WMODE_G16_FP8;
  const mm_weight_mode exact = gran == 32 ? MM_WMODE_G32_F16_EXACT : MM_WMODE_G16_BF16_EXACT;
  c.met_bound = 1;
  if (mode == MM_COMPUTE_FP8) {
    c.mode = fast;
    return c;
  }
  if (mode == MM_COMPUTE_BF16_EXACT) {
    c.mode = exact;
    return c;
  }
  const mm_weight_mode cand[2] = {fast, exact};
  c.auto_pick = 1;
  c.candidates = 2;
  int ok[2], wins[2] = {0, 0};
  for (int j = 0; j < 2; j++) {
    ok[j] = rows[cand[j]].bound <= max_rel_error;
    c.eligible += ok[j];
  }
  if (!c.eligible) {
    /* nothing meets the bound: the most accurate */
    c.mode = rows[exact].bound <= rows[fast].bound ? exact : fast;
    c.met_bound = 0;
    return c;
  }
  for (int i = 0; i < MM_MODE_PERF_NUM_M; i++) {
    double best = -1.0;
    for (int j = 0; j < 2; j++)
      if (ok[j] && (best < 0 || rows[cand[j]].us[i] < best)) best = rows[cand[j]].us[i];
    for (int j = 0; j < 2; j++)
      if (ok[j] && rows[cand[j]].us[i] == best) wins[j]++;
  }
  int pick = -1;
  for (int j = 0; j < 2; j++) {
    if (!ok[j]) continue;
    if (pick < 0 || wins[j] > wins[pick]) {
      pick = j;
      continue;
    }
    if (wins[j] < wins[pick]) continue;
    const double bj = rows[cand[j]].bound, bp = rows[cand[pick]].bound;
    if (bj < bp || (bj == bp && cand[j] < cand[pick])) pick = j;
  }
  c.mode = cand[pick];
  c.wins = wins[pick];
  return c;
}

size_t mm_mode_choice_describe(const mm_mode_choice *c, int gran, mm_compute_mode mode,
                               double max_rel_error, char *buf, size_t size) {
  char dummy[1];
  if (!buf || !size) buf = dummy, size = 1;
  const int g = gran == 32 ? 32 : 16;
  const char *mn = mm_compute_mode_name(mode);
  int n;
  if (!c->auto_pick) {
    n = snprintf(buf, size, "compute.mode %s, gran-k %d: weight mode %d (%s, error bound %.0e)",
                 mn, g, (int)c->mode, mm_weight_mode_name(c->mode),
                 mm_mode_error_bound(c->mode));
  } else if (!c->met_bound) {
    n = snprintf(buf, size,
                 "compute.mode %s, gran-k %d: no weight mode meets compute.max-rel-error %g; "
                 "using the most accurate, weight mode %d (%s, error bound %.0e)",
                 mn, g, max_rel_error, (int)c->mode, mm_weight_mode_name(c->mode),
                 mm_mode_error_bound(c->mode));
  } else {
    n = snprintf(buf, size,
                 "compute.mode %s, gran-k %d: weight mode %d (%s, error bound %.0e <= "
                 "compute.max-rel-error %g; %d of %d modes eligible; fastest at %d of %d "
                 "measured M: %.1f / %.1f / %.1f us at M %d / %d / %d, H200 GLM-5 EP8 rank)",
                 mn, g, (int)c->mode, mm_weight_mode_name(c->mode), mm_mode_error_bound(c->mode),
                 max_rel_error, c->eligible, c->candidates, c->wins, MM_MODE_PERF_NUM_M,
                 mm_mode_perf_us(c->mode, 0), mm_mode_perf_us(c->mode, 1),
                 mm_mode_perf_us(c->mode, 2), perf_m[0], perf_m[1], perf_m[2]);
  }
  return n > 0 ? (size_t)n : 0;
}

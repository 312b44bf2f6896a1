/* gpu_test_moe_compute.c -- the sm90 fused expert compute against the CPU
 * reference (ref_moe.h) on fresh random data: all four weight modes, all
 * three paths (the WGMMA kernels, the FP8 modes' prefill path, the CUDA-core
 * kernels), mode 3 against the reference with its folded weights (as tightly
 * as mode 1) and against the checkpoint's (its fold error), several pool shapes
 * (M not a multiple of any tile, empty experts, one expert holding every row,
 * E_loc 1..32), an activation clamp, extreme UE8M0 exponents, matrices whose
 * rows all take the packer's row anchor (w13) and ones where some do not
 * (w2). Outputs and the workspace are poisoned (NaN) before every run; rows
 * outside the pool must stay poisoned. Skips (TAP) without a GPU. */
#include <cuda_runtime.h>
#include <math.h>
#include <string.h>

#include "formats.h"
#include "gpu_harness.h"
#include "moe_compute.h"
#include "ref_moe.h"


typedef struct {
  int H, I, E;
  const int *counts; /* NULL: random 0..max_rand */
  int max_rand;
  float clamp;
  int extreme; /* modes 1 / 4: wide exponent spread */
  int exact;   /* sums exact in any accumulator: x in {0, +-1}, unit scales */
  int lead;    /* pool rows start at offsets[0] = lead (rows before it: not ours) */
} shape;

static void make_expert(mm_expert_q *x, int H, int I, mm_weight_mode mode, int extreme, int exact) {
  const int gran = mode == MM_WMODE_G32_FP8 || mode == MM_WMODE_G32_F16_EXACT ? 32 : 16;
  mm_qmat *ms[2] = {&x->w13, &x->w2};
  const int rows[2] = {2 * I, H}, cols[2] = {H, I};
  for (int j = 0; j < 2; j++) {
    mm_qmat *m = ms[j];
    CHECK(mm_qmat_alloc(m, rows[j], cols[j], gran, gran == 16 ? MM_SF_E4M3 : MM_SF_UE8M0) == 0);
    for (size_t i = 0; i < (size_t)m->rows * m->cols / 2; i++) m->codes[i] = (uint8_t)mm_test_rand_u64();
    const int G = m->cols / gran;
    for (int r = 0; r < m->rows; r++) {
      int base = 120 + (int)(mm_test_rand_u64() % 4);
      if (extreme) base = (j == 0 ? 118 : 60) + (int)(mm_test_rand_u64() % 12);
      for (int g = 0; g < G; g++) {
        uint8_t b;
        if (gran == 32) {
          b = (uint8_t)(extreme ? base - (int)(mm_test_rand_u64() % 15) : base - (int)(mm_test_rand_u64() % 5));
          /* w2 up to 256 columns, every 7th row: its second 128-column
           * block 30 binades lower, so that it keeps per-block references
           * (no row anchor): w13's rows all take the packer's row anchor
           * (references all 0, the mode 1 kernels without the reference
           * multiply), w2's not. Wider w2s keep the anchor, so that the
           * prefill path (reference 0 only) runs their long K loops. */
          if (j == 1 && m->cols <= 256 && r % 7 == 3 && g / 4 == 1) b = (uint8_t)(b - 30);
        } else {
          do {
            b = (uint8_t)(0x20 + mm_test_rand_u64() % 0x38); /* 2^-3 .. ~2^3.9 */
          } while (mm_e4m3_is_nan(b));
          if (mm_test_rand_u64() % 16 == 0) b = (uint8_t)(mm_test_rand_u64() % 8); /* subnormal/zero */
          /* Mode 3's row anchor: a scale of at least 10 (0x52) in every
           * 128-column block, so that every block's reference is 2^-2
           * (6 * max |s| in (56, 112]) and the packer moves it into the row
           * factor (the prefill path takes only such layers, the WGMMA path
           * runs its kernels without the reference multiply on them). A block
           * maximum of 16 above the range instead made one group per block
           * dominate its dots, and the end-to-end error reached 9.5% of a
           * fold error of 1.5% (seeds 1796369289, 1796258495; every path
           * alike). w2 up to 256 columns, every 7th row: a scale of 448
           * in its first block (reference 2^3; the row factor below takes
           * 2^-5 back) and subnormal ones in its second, whose weights
           * would round differently against 2^3 than against their own
           * block's reference: per-block references (the WGMMA path's
           * reference multiply; the prefill path refuses the layer). A
           * second block of subnormal scales beside blocks of 2^-2 still
           * anchors: its weights are multiples of 2^-9 there. */
          if (g % 8 == 5 && b < 0x52) b = 0x52;
          if (j == 1 && m->cols <= 256 && r % 7 == 3)
            b = g / 8 == 1 ? (uint8_t)(1 + mm_test_rand_u64() % 7) : g % 8 == 5 ? 0x7E : b;
        }
        m->scales[(size_t)r * G + g] = exact ? (gran == 32 ? 127 : 0x38) : b;
      }
      /* NVFP4: per-projection globals (gate and up may differ) */
      if (gran == 16) m->row_scale[r] = (j == 0 && r >= I) ? 0.004f : 0.0025f;
      else m->row_scale[r] = 1.0f;
      if (gran == 16 && j == 1 && m->cols <= 256 && r % 7 == 3) m->row_scale[r] *= 0x1p-5f;
    }
    /* K normalisation: keep activations O(1) */
    float norm = 1.0f / sqrtf((float)m->cols);
    if (gran == 32 && !extreme) norm *= 128.0f; /* UE8M0 base 2^-7 .. 2^-4 */
    if (gran == 16) norm *= 64.0f;
    if (extreme) norm *= j == 0 ? 256.0f : 1.0f;
    for (int r = 0; r < m->rows; r++) m->row_scale[r] *= norm;
    if (extreme && j == 1)
      for (int r = 0; r < m->rows; r++) m->row_scale[r] = ldexpf(1.0f, 60) * norm;
    if (exact)
      for (int r = 0; r < m->rows; r++) m->row_scale[r] = 1.0f / 64.0f;
  }
}

static double rel_frob(const uint16_t *a, const uint16_t *ref, int rows, int H, int *nan_rows) {
  double e2 = 0, r2 = 0;
  *nan_rows = 0;
  for (int i = 0; i < rows; i++) {
    int bad = 0;
    for (int c = 0; c < H; c++) {
      float x = mm_bf16_to_float(a[(size_t)i * H + c]), y = mm_bf16_to_float(ref[(size_t)i * H + c]);
      if (!isfinite(x)) bad = 1;
      else {
        e2 += ((double)x - y) * ((double)x - y);
        r2 += (double)y * y;
      }
    }
    *nan_rows += bad;
  }
  return r2 > 0 ? sqrt(e2 / r2) : (e2 > 0 ? 1.0 : 0.0);
}

/* BF16 values one step apart: adjacent encodings of the same sign (a
 * rounding near-tie that an FP32 sum and the float64 reference round to
 * either side of). */
static int bf16_one_step(uint16_t a, uint16_t b) {
  return (a ^ b) < 0x8000u && (a > b ? a - b : b - a) == 1;
}

/* rel_frob without the values one BF16 step from the reference, which are
 * counted in *flips instead. An FP32-accumulating path rounds such
 * near-ties to the other side now and then (its sums carry several FP32
 * roundings; up to 0.04% of a case's values on the H100), and one such
 * flip on a value that dominates the case's norm moves rel_frob by up to
 * 2^-8 alone (seed 1796586083, quick set: 1 of 24576 values, -3.50e11
 * against -3.52e11, 1.045e-3). */
static double rel_frob_flips(const uint16_t *a, const uint16_t *ref, int rows, int H, size_t *flips) {
  double e2 = 0, r2 = 0;
  *flips = 0;
  for (size_t i = 0; i < (size_t)rows * H; i++) {
    const double x = mm_bf16_to_float(a[i]), y = mm_bf16_to_float(ref[i]);
    r2 += y * y;
    if (bf16_one_step(a[i], ref[i])) ++*flips;
    else e2 += (x - y) * (x - y);
  }
  return r2 > 0 ? sqrt(e2 / r2) : (e2 > 0 ? 1.0 : 0.0);
}

/* On a failed comparison: how many values differ, how many by more than
 * one BF16 step of the reference, and the largest differences with their
 * places, so that a rare failure says what it was (one wrong value, a
 * wrong row, or a spread of rounding flips). */
static void report_worst(const char *what, const uint16_t *a, const uint16_t *ref, int rows, int H) {
  enum { kShow = 4 };
  double worst[kShow] = {0};
  int wi[kShow] = {0}, wc[kShow] = {0};
  size_t differ = 0, far = 0;
  for (int i = 0; i < rows; i++)
    for (int c = 0; c < H; c++) {
      const uint16_t ga = a[(size_t)i * H + c], gr = ref[(size_t)i * H + c];
      if (ga == gr) continue;
      differ++;
      const double x = mm_bf16_to_float(ga), y = mm_bf16_to_float(gr);
      const double d = isnan(x - y) ? INFINITY : fabs(x - y); /* NaN first */
      far += !bf16_one_step(ga, gr);
      for (int k = 0; k < kShow; k++)
        if (d > worst[k]) {
          for (int j = kShow - 1; j > k; j--) worst[j] = worst[j - 1], wi[j] = wi[j - 1], wc[j] = wc[j - 1];
          worst[k] = d, wi[k] = i, wc[k] = c;
          break;
        }
    }
  printf("#   %s: %zu of %zu values differ, %zu by more than one BF16 step\n", what, differ,
         (size_t)rows * H, far);
  for (int k = 0; k < kShow && (size_t)k < differ; k++)
    printf("#     row %d col %d: got %.6g, reference %.6g\n", wi[k], wc[k],
           mm_bf16_to_float(a[(size_t)wi[k] * H + wc[k]]), mm_bf16_to_float(ref[(size_t)wi[k] * H + wc[k]]));
}

/* An expert's weights as the check's reference reads them: w13 [2I][H]
 * (gate rows, then up rows) and w2 [H][I] without their row factors, and
 * the row factors r13 [2I], r2 [H]. From the checkpoint (mm_qmat_weight),
 * or for mode 3 from its packed records (mm_sm90_weight, the packer's row
 * factors): the folded weights its kernels multiply, so that mode 3 is
 * checked as tightly as mode 1 against the weights it computes with, and
 * its fold error is measured apart (the end-to-end error against the
 * checkpoint's reference). */
typedef struct {
  int H, I;
  float *w13, *r13, *w2, *r2;
} dense_expert;

static void dense_matrix(const mm_qmat *m, mm_weight_mode mode, int gate_up, float *w, float *rf) {
  if (mode != MM_WMODE_G16_FP8) {
    for (int r = 0; r < m->rows; r++) {
      rf[r] = m->row_scale[r];
      for (int k = 0; k < m->cols; k++) w[(size_t)r * m->cols + k] = mm_qmat_weight(m, r, k);
    }
    return;
  }
  uint8_t *blob = mm_test_alloc(mm_sm90_matrix_bytes(mode, m->rows, m->cols));
  float *rs = mm_test_alloc(sizeof(float) * (size_t)m->rows);
  CHECK_OK(mm_sm90_pack_matrix(m, mode, gate_up, blob, rs, NULL));
  for (int r = 0; r < m->rows; r++) {
    const int src = mm_sm90_src_row(r, m->rows, gate_up);
    rf[src] = rs[r];
    for (int k = 0; k < m->cols; k++)
      w[(size_t)src * m->cols + k] = mm_sm90_weight(blob, mode, m->rows, m->cols, r, k);
  }
  free(blob);
  free(rs);
}

static void dense_expert_make(dense_expert *d, const mm_expert_q *e, mm_weight_mode mode) {
  const int H = e->w13.cols, I = e->w2.cols;
  d->H = H, d->I = I;
  d->w13 = mm_test_alloc(sizeof(float) * 2 * (size_t)I * H);
  d->w2 = mm_test_alloc(sizeof(float) * (size_t)H * I);
  d->r13 = mm_test_alloc(sizeof(float) * 2 * (size_t)I);
  d->r2 = mm_test_alloc(sizeof(float) * (size_t)H);
  dense_matrix(&e->w13, mode, 1, d->w13, d->r13);
  dense_matrix(&e->w2, mode, 0, d->w2, d->r2);
}

static void dense_expert_free(dense_expert *d) {
  free(d->w13), free(d->r13), free(d->w2), free(d->r2);
}

/* The reference intermediate of ref_moe.h for one expert's rows: FP8 codes
 * [m, I] and scales [m, I/128] (same formulas, float64 dots), and for every
 * (row, channel) the gate/up dots before the row factor (g, u) and their
 * magnitude sums sum_k |x_k w_k| (ga, ua), which bound any accumulation
 * order's error. */
typedef struct {
  double *g, *u, *ga, *ua; /* [rows][I] */
  size_t clamped;          /* gates the clamp cut (reference values) */
} l1_dots;

static void ref_intermediate(const dense_expert *e, int m, const uint8_t *xq, const float *xs,
                             const float *rw, float clamp, uint8_t *aq, float *as, l1_dots *d) {
  const int H = e->H, I = e->I, KB = H / 128;
  double *x = malloc(sizeof(double) * H);
  float *a = malloc(sizeof(float) * I);
  for (int i = 0; i < m; i++) {
    for (int k = 0; k < H; k++)
      x[k] = (double)mm_e4m3_to_float(xq[(size_t)i * H + k]) * xs[(size_t)i * KB + k / 128];
    for (int c = 0; c < I; c++) {
      double g = 0, u = 0, ga = 0, ua = 0;
      for (int k = 0; k < H; k++) {
        const double pg = x[k] * (double)e->w13[(size_t)c * H + k];
        const double pu = x[k] * (double)e->w13[(size_t)(I + c) * H + k];
        g += pg, u += pu, ga += fabs(pg), ua += fabs(pu);
      }
      const size_t o = (size_t)i * I + c;
      d->g[o] = g, d->u[o] = u, d->ga[o] = ga, d->ua[o] = ua;
      float gf = mm_round_bf16((float)(g * e->r13[c]));
      float uf = mm_round_bf16((float)(u * e->r13[I + c]));
      if (clamp > 0) {
        d->clamped += gf > clamp;
        gf = mm_clamp_gate(gf, clamp);
        uf = mm_clamp_up(uf, clamp);
      }
      a[c] = mm_swiglu_weighted(gf, uf, rw[i]);
    }
    for (int b = 0; b < I / 128; b++)
      mm_quant_fp8_block(a + b * 128, 128, aq + (size_t)i * I + b * 128, as + (size_t)i * (I / 128) + b);
  }
  free(x);
  free(a);
}

/* The smallest and largest weighted SwiGLU value of (row o / I, channel c)
 * over the box of gate and up dots within tau * sum|x w| of the exact ones
 * (see code_explained). */
static void value_box(const dense_expert *e, const l1_dots *d, size_t o, int c, float rw,
                      float clamp, double tau, double *vmin_out, double *vmax_out) {
  const int I = e->I;
  const double silu_min_at = -1.2784645427610738; /* argmin of g / (1 + e^-g) */
  const double g_lo = d->g[o] - tau * d->ga[o], g_hi = d->g[o] + tau * d->ga[o];
  double gates[3] = {g_lo, g_hi, g_lo};
  const double rs_g = e->r13[c];
  if ((g_lo * rs_g - silu_min_at) * (g_hi * rs_g - silu_min_at) < 0) gates[2] = silu_min_at / rs_g;
  const double ups[2] = {d->u[o] - tau * d->ua[o], d->u[o] + tau * d->ua[o]};
  double vmin = INFINITY, vmax = -INFINITY;
  for (int gi = 0; gi < 3; gi++)
    for (int ui = 0; ui < 2; ui++) {
      float gf = mm_round_bf16((float)(gates[gi] * rs_g));
      float uf = mm_round_bf16((float)(ups[ui] * e->r13[I + c]));
      if (clamp > 0) {
        gf = mm_clamp_gate(gf, clamp);
        uf = mm_clamp_up(uf, clamp);
      }
      const double v = (double)mm_swiglu_weighted(gf, uf, rw);
      vmin = fmin(vmin, v);
      vmax = fmax(vmax, v);
    }
  *vmin_out = vmin;
  *vmax_out = vmax;
}

/* Whether the GPU's FP8 code q for (row i, channel c) is one a correct kernel
 * can produce: the reference path re-run with the gate and up dots anywhere
 * within tau * sum|x w| of the exact ones (any summation order's error
 * bound, tau per path), the value scaled by the GPU's own block scale and
 * moved by 2^-20 (expf and reciprocal ulps). The value is monotone in each
 * dot over such a box (BF16 rounding is; silu is apart from its minimum,
 * taken as a third gate point when the box holds it), so q must lie between
 * the codes of the box's smallest and largest values. Wide boxes come from
 * cancelling dots (a gate dot of 0.04 from terms summing to 1870 in
 * magnitude), where several codes are legitimate. */
static int code_explained(const dense_expert *e, const l1_dots *d, size_t o, int c, float rw,
                          float clamp, float gpu_scale, double tau, double abs_slack, uint8_t q,
                          uint8_t ref_q) {
  /* the approximate path (abs_slack > 0): one code step, or a difference
   * small against the block's range */
  if (abs_slack > 0 && (((q ^ ref_q) & 0x80) == 0 && abs((q & 0x7F) - (ref_q & 0x7F)) == 1)) return 1;
  if (fabsf(mm_e4m3_to_float(q) - mm_e4m3_to_float(ref_q)) <= abs_slack * 448.0) return 1;
  double vmin, vmax;
  value_box(e, d, o, c, rw, clamp, tau, &vmin, &vmax);
  vmin /= gpu_scale;
  vmax /= gpu_scale;
  const float lo = mm_e4m3_to_float(mm_float_to_e4m3((float)(vmin - fabs(vmin) * 0x1p-20)));
  const float hi = mm_e4m3_to_float(mm_float_to_e4m3((float)(vmax + fabs(vmax) * 0x1p-20)));
  const float qv = mm_e4m3_to_float(q);
  return qv >= lo && qv <= hi;
}

/* Intermediate check: every FP8 code equals the reference's or is explained
 * by a rounding near-tie (code_explained); at most diff_frac of them differ
 * (the QGMMA paths' codes a step away); every block scale within scale_rel
 * of the reference's or explained by a near-tie of its block's largest
 * value. */
static void check_intermediate(const dense_expert *ex, const int *offs, int E, const l1_dots *d,
                               const float *rw, float clamp, double tau, double abs_slack,
                               double diff_frac, const uint8_t *gq,
                               const float *gs, const uint8_t *rq, const float *rs, int I,
                               const char *what, double scale_rel) {
  size_t diff = 0, unexplained = 0, n = (size_t)offs[E] * I;
  double smax = 0;
  for (int e = 0; e < E; e++)
    for (int i = offs[e]; i < offs[e + 1]; i++)
      for (int c = 0; c < I; c++) {
        const size_t o = (size_t)i * I + c;
        if (gq[o] == rq[o]) continue;
        diff++;
        const float gs_ = gs[(size_t)i * (I / 128) + c / 128]; /* the GPU's block scale */
        if (!code_explained(&ex[e], d, o, c, rw[i], clamp, gs_, tau, abs_slack, gq[o], rq[o])) {
          if (unexplained++ < 3) {
            const float gf = mm_round_bf16((float)(d->g[o] * ex[e].r13[c]));
            const float uf = mm_round_bf16((float)(d->u[o] * ex[e].r13[I + c]));
            printf("#   row %d channel %d: gpu code 0x%02x, reference 0x%02x, not a near-tie: "
                   "gate dot %.9g (sum|xw| %.3g) up dot %.9g (%.3g), bf16 %.9g %.9g, top-k "
                   "weight %.9g, value / scale %.9g (scale %.9g)\n",
                   i, c, gq[o], rq[o], d->g[o], d->ga[o], d->u[o], d->ua[o], gf, uf, rw[i],
                   (double)mm_swiglu_weighted(gf, uf, rw[i]) / gs_, gs_);
          }
        }
      }
  /* Block scales: within scale_rel of the reference's, or (a near-tie in
   * the block's largest value: one BF16 step of a gate or up moves the
   * scale by up to 2^-8) amax / 448 for an amax between the box's smallest
   * and largest possible block maximum, over the channels' value boxes. */
  size_t sbad = 0, sbox = 0;
  for (int e = 0; e < E; e++)
    for (int i = offs[e]; i < offs[e + 1]; i++)
      for (int b = 0; b < I / 128; b++) {
        const size_t si = (size_t)i * (I / 128) + b;
        const double r = fabs((double)gs[si] - rs[si]) / fmax(fabs((double)rs[si]), 1e-30);
        if (r > smax) smax = r;
        if (r <= scale_rel) continue;
        double lo = 0, hi = 0; /* the block maximum's range */
        for (int c = b * 128; c < b * 128 + 128; c++) {
          double vmin, vmax;
          value_box(&ex[e], d, (size_t)i * I + c, c, rw[i], clamp, tau, &vmin, &vmax);
          const double amin = vmin <= 0 && vmax >= 0 ? 0 : fmin(fabs(vmin), fabs(vmax));
          lo = fmax(lo, amin);
          hi = fmax(hi, fmax(fabs(vmin), fabs(vmax)));
        }
        const double m = (double)gs[si] * 448.0; /* the GPU's block maximum */
        if (m >= fmax(lo, 1e-4) * (1 - 1e-6) && m <= fmax(hi, 1e-4) * (1 + 1e-6)) {
          sbox++;
        } else if (sbad++ < 3) {
          printf("#   row %d block %d: gpu scale %.9g, reference %.9g, block maximum range "
                 "[%.9g, %.9g] / 448\n", i, b, (double)gs[si], (double)rs[si], lo, hi);
        }
      }
  printf("#   %s intermediate: %zu of %zu FP8 codes differ from the reference, %zu not at a "
         "rounding near-tie (tau %.1e); scale max rel %.2e, %zu scales explained by a near-tie "
         "only\n",
         what, diff, n, unexplained, tau, smax, sbox);
  CHECK_EQ_INT(unexplained, 0);
  CHECK(diff <= (size_t)(diff_frac * (double)n) + 2);
  CHECK_EQ_INT(sbad, 0);
}

/* L2 of the reference from a given intermediate (the GPU's): isolates L2.
 * Optionally each value before its BF16 rounding (exact, float64) and its
 * magnitude sum |r2| sum_c |x_c w_c| (mag), which bound any accumulation
 * order's error as in L1. */
static void ref_l2(const dense_expert *e, int m, const uint8_t *aq, const float *as, uint16_t *out,
                   double *exact, double *mag) {
  const int H = e->H, I = e->I;
  double *x = malloc(sizeof(double) * I);
  for (int i = 0; i < m; i++) {
    for (int c = 0; c < I; c++)
      x[c] = (double)mm_e4m3_to_float(aq[(size_t)i * I + c]) * as[(size_t)i * (I / 128) + c / 128];
    for (int h = 0; h < H; h++) {
      double acc = 0, acc_abs = 0;
      for (int c = 0; c < I; c++) {
        const double term = x[c] * (double)e->w2[(size_t)h * I + c];
        acc += term;
        acc_abs += fabs(term);
      }
      const size_t o = (size_t)i * H + h;
      const double v = acc * (double)e->r2[h];
      out[o] = mm_float_to_bf16((float)v);
      if (exact) exact[o] = v;
      if (mag) mag[o] = acc_abs * fabs((double)e->r2[h]);
    }
  }
  free(x);
}

/* L2 value by value against its exact sum: equal to the reference's BF16,
 * or one BF16 rounding from the exact value (|got - exact| <= 2^-8 |exact|:
 * a near-tie that the kernel's sum rounded to the other side), or that plus
 * the accumulation error tau * sum |x w| allows (a QGMMA sum's lost low bits
 * where the terms cancel). Returns the values that none of these explains,
 * printing the first few; *by_sum counts the values only the last
 * explains. */
static size_t check_l2_values(const uint16_t *got, const uint16_t *ref, const double *exact,
                              const double *mag, size_t n, int H, double tau, size_t *by_sum) {
  size_t bad = 0;
  *by_sum = 0;
  for (size_t i = 0; i < n; i++) {
    if (got[i] == ref[i]) continue;
    const double g = mm_bf16_to_float(got[i]), d = fabs(g - exact[i]), one = 0x1p-8 * fabs(exact[i]);
    if (d <= one) continue;
    if (d <= one + tau * mag[i]) {
      ++*by_sum;
      continue;
    }
    if (bad++ < 4)
      printf("#     L2 row %zu col %zu: got %.6g, exact %.6g, sum |x w| %.3g: %.2f of tau's allowance\n",
             i / (size_t)H, i % (size_t)H, g, exact[i], mag[i], (d - one) / (tau * mag[i]));
  }
  return bad;
}

static int g_have_wgmma_fail = 0;
static int g_prefill_runs = 0; /* cases the prefill path computed */
/* MEGAMOE_TEST_PATH=simt|wgmma|prefill: that path only (sanitizer runs) */
static int g_only_path = -1;

static const char *path_name(int path) {
  return path == MM_SM90_PATH_SIMT ? "simt " : path == MM_SM90_PATH_WGMMA ? "wgmma" : "prefill";
}

/* The pool with an out_rows map (a random permutation of [0, M), so rows
 * also land outside the pool's own range): each pool row's result must be
 * the unmapped run's row (`got`) bit for bit, at its mapped row; rows that
 * are neither mapped to nor staging rows (modes 2-4) keep the poison. */
/* A compute call's result: checked, then (after the device is done) its
 * output copied to host. */
static void fetch_out(mm_err *err, const void *d_out, uint16_t *host, size_t bytes) {
  CHECK_OK(err);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(host, d_out, bytes, cudaMemcpyDeviceToHost));
}

static void check_out_rows(const mm_sm90_layer *L, const mm_expert_pool *pool, float clamp,
                           void *d_ws, size_t wsb, mm_sm90_path path, const uint16_t *got,
                           int lead, int Mused, int H, int stages) {
  const int M = pool->num_rows_max;
  int32_t *map = malloc(sizeof(int32_t) * M);
  unsigned char *hit = calloc((size_t)M, 1);
  uint16_t *got2 = malloc(2 * (size_t)M * H);
  for (int i = 0; i < M; i++) map[i] = i;
  for (int i = M - 1; i > 0; i--) {
    const int j = (int)(mm_test_rand_u64() % (uint64_t)(i + 1)), t = map[i];
    map[i] = map[j];
    map[j] = t;
  }
  void *d_map;
  CUDA_OK(cudaMalloc(&d_map, sizeof(int32_t) * M));
  CUDA_OK(cudaMemcpy(d_map, map, sizeof(int32_t) * M, cudaMemcpyHostToDevice));
  mm_expert_pool p2 = *pool;
  p2.out_rows = d_map;
  CUDA_OK(cudaMemset(p2.out, 0xFF, 2 * (size_t)M * H));
  CUDA_OK(cudaMemset(d_ws, 0xFF, wsb));
  fetch_out(mm_sm90_expert_compute_path(L, &p2, clamp, d_ws, wsb, NULL, path), p2.out, got2,
            2 * (size_t)M * H);
  size_t moved = 0, stray = 0;
  for (int p = lead; p < Mused; p++) {
    hit[map[p]] = 1;
    moved += memcmp(got2 + (size_t)map[p] * H, got + (size_t)p * H, 2 * (size_t)H) != 0;
  }
  for (int r = 0; r < M; r++) {
    if (hit[r] || (stages && r >= lead && r < Mused)) continue;
    for (int c = 0; c < H; c++) stray += got2[(size_t)r * H + c] != 0xFFFF;
  }
  printf("#   %s out_rows (permutation of %d rows): %zu rows differ, %zu stray values\n",
         path_name(path), M, moved, stray);
  CHECK_EQ_INT(moved, 0);
  CHECK_EQ_INT(stray, 0);
  cudaFree(d_map);
  free(map);
  free(hit);
  free(got2);
}

/* A pool's device buffers: expert offsets (E + 1), tokens [M][H] and their
 * scales [M][H / 128], top-k weights [M], the BF16 output [M][H], and the
 * workspace (ws_bytes). */
typedef struct {
  void *off, *x, *xs, *rw, *out, *ws;
} dev_pool;

static void dev_pool_alloc(dev_pool *d, int E, int M, int H, size_t ws_bytes) {
  memset(d, 0, sizeof(*d));
  CUDA_OK(cudaMalloc(&d->off, sizeof(int) * (size_t)(E + 1)));
  CUDA_OK(cudaMalloc(&d->x, (size_t)M * H));
  CUDA_OK(cudaMalloc(&d->xs, sizeof(float) * (size_t)M * (H / 128)));
  CUDA_OK(cudaMalloc(&d->rw, sizeof(float) * (size_t)M));
  CUDA_OK(cudaMalloc(&d->out, 2 * (size_t)M * H));
  CUDA_OK(cudaMalloc(&d->ws, ws_bytes));
}

static void dev_pool_free(dev_pool *d) {
  cudaFree(d->off);
  cudaFree(d->x);
  cudaFree(d->xs);
  cudaFree(d->rw);
  cudaFree(d->out);
  cudaFree(d->ws);
  memset(d, 0, sizeof(*d));
}

static void run_case(mm_weight_mode mode, const shape *s) {
  const int H = s->H, I = s->I, E = s->E;
  int counts[64], offs[65];
  offs[0] = s->lead;
  for (int e = 0; e < E; e++) {
    counts[e] = s->counts ? s->counts[e] : (int)(mm_test_rand_u64() % (uint64_t)(s->max_rand + 1));
    offs[e + 1] = offs[e] + counts[e];
  }
  /* rows [0, lead) and [Mused, M): capacity outside the pool, must stay poisoned
   * (modes 2 and 4 stage their F16 copy of x in out, mode 3 an FP8 one) */
  const int lead = s->lead, Mused = offs[E], M = Mused + 3;
  const int KB = H / 128;
  mm_expert_q *ex = calloc((size_t)E, sizeof(*ex));
  dense_expert *dx = calloc((size_t)E, sizeof(*dx));
  for (int e = 0; e < E; e++) {
    make_expert(&ex[e], H, I, mode, s->extreme, s->exact);
    dense_expert_make(&dx[e], &ex[e], mode);
  }
  uint8_t *xq = malloc((size_t)M * H);
  float *xs = malloc(sizeof(float) * (size_t)M * KB), *rw = malloc(sizeof(float) * M);
  uint16_t *ref = malloc(2 * (size_t)M * H), *got = malloc(2 * (size_t)M * H);
  {
    uint16_t *xb = malloc(2 * (size_t)M * H);
    for (size_t i = 0; i < (size_t)M * H; i++) xb[i] = mm_float_to_bf16(mm_test_normal());
    /* a few rows of zeros and one huge row */
    if (M > 4) {
      memset(xb + (size_t)1 * H, 0, 2 * (size_t)H);
      for (int c = 0; c < H; c++) xb[(size_t)2 * H + c] = mm_float_to_bf16(mm_test_normal() * 3e4f);
    }
    mm_ref_quant_act(xb, M, H, xq, xs);
    free(xb);
    if (s->exact) { /* every L1 dot product is a small multiple of 1/2: exact everywhere */
      static const uint8_t kUnit[3] = {0x00, 0x38, 0xB8};
      for (size_t i = 0; i < (size_t)M * H; i++) xq[i] = kUnit[mm_test_rand_u64() % 3];
      for (size_t i = 0; i < (size_t)M * KB; i++) xs[i] = 0.125f;
    }
  }
  for (int i = 0; i < M; i++) rw[i] = mm_test_uniform(0.05f, 1.0f);
  for (int e = 0; e < E; e++)
    mm_ref_expert_rows(&ex[e], counts[e], xq + (size_t)offs[e] * H, xs + (size_t)offs[e] * KB,
                       rw + offs[e], s->clamp, ref + (size_t)offs[e] * H);

  uint8_t *rq = malloc((size_t)M * I + 1), *gq = malloc((size_t)M * I + 1);
  float *rsc = malloc(sizeof(float) * ((size_t)M * (I / 128) + 1)),
        *gsc = malloc(sizeof(float) * ((size_t)M * (I / 128) + 1));
  uint16_t *ref2 = malloc(2 * (size_t)M * H), *ref_fold = malloc(2 * (size_t)M * H);
  /* L2's exact sums and magnitudes: only the QGMMA paths (FP8 modes) check them */
  const int fp8_mode = mode == MM_WMODE_G32_FP8 || mode == MM_WMODE_G16_FP8;
  double *exact2 = fp8_mode ? malloc(sizeof(double) * ((size_t)M * H + 1)) : NULL,
         *mag2 = fp8_mode ? malloc(sizeof(double) * ((size_t)M * H + 1)) : NULL;
  l1_dots dots;
  const size_t nd = (size_t)M * I + 1;
  dots.g = malloc(sizeof(double) * nd), dots.u = malloc(sizeof(double) * nd);
  dots.ga = malloc(sizeof(double) * nd), dots.ua = malloc(sizeof(double) * nd);
  dots.clamped = 0;
  for (int e = 0; e < E; e++) {
    const size_t o = (size_t)offs[e] * I;
    l1_dots de = {dots.g + o, dots.u + o, dots.ga + o, dots.ua + o, 0};
    ref_intermediate(&dx[e], counts[e], xq + (size_t)offs[e] * H, xs + (size_t)offs[e] * KB,
                     rw + offs[e], s->clamp, rq + (size_t)offs[e] * I,
                     rsc + (size_t)offs[e] * (I / 128), &de);
    dots.clamped += de.clamped;
    /* mode 3: the end-to-end reference with its folded weights */
    if (mode == MM_WMODE_G16_FP8)
      ref_l2(&dx[e], counts[e], rq + o, rsc + (size_t)offs[e] * (I / 128),
             ref_fold + (size_t)offs[e] * H, NULL, NULL);
  }
  /* the clamp shape must clamp: its gates above the clamp take the
   * epilogue's silu of the clamp (silu_c), not the table */
  if (s->clamp > 0) {
    printf("#   clamp %g: %zu of %zu reference gates clamped\n", (double)s->clamp, dots.clamped,
           (size_t)M * I);
    CHECK_MSG(dots.clamped > 0, "the clamp shape clamps no gate");
  }
  mm_sm90_layer *L = NULL;
  mm_err *err = mm_sm90_layer_create(ex, E, mode, NULL, &L);
  CHECK_OK(err);
  if (!L) goto done;
  {
    const size_t wsb = mm_sm90_workspace_bytes(L, M);
    dev_pool dp;
    dev_pool_alloc(&dp, E, M, H, wsb);
    void *const d_off = dp.off, *const d_x = dp.x, *const d_xs = dp.xs, *const d_rw = dp.rw,
               *const d_out = dp.out, *const d_ws = dp.ws;
    CUDA_OK(cudaMemcpy(d_off, offs, sizeof(int) * (E + 1), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_x, xq, (size_t)M * H, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_xs, xs, sizeof(float) * (size_t)M * KB, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_rw, rw, sizeof(float) * M, cudaMemcpyHostToDevice));
    mm_expert_pool pool = {M, d_off, d_x, d_xs, d_rw, d_out, 0, NULL};
    /* mode 3 against the checkpoint's reference: the weight fold error
     * (E4M3 rounding) passes through both GEMMs and the requant: bound 5x
     * the measured weight error. Measured (seventh stop, ~250 cases per
     * path): up to 3.4x on these small shapes, the CUDA-core and WGMMA
     * paths within 1% of each other case by case; one run (seed
     * 1796165612) failed two of its mode 3 checks against 4x, the data's
     * tail rather than a kernel's error. The kernels themselves are held to
     * mode 1's bounds against the reference with the folded weights (the
     * intermediate, L2 and end-to-end checks below). */
    const double tol_m3 = 5.0 * mm_sm90_layer_fold_error(L);
    /* the prefill path (modes 1 and 3 with zero references only; main
     * plans its workspace region at every size) */
    for (int path = MM_SM90_PATH_SIMT; path <= MM_SM90_PATH_PREFILL; path++) {
      if (g_only_path >= 0 && path != g_only_path) continue;
      CUDA_OK(cudaMemset(d_out, 0xFF, 2 * (size_t)M * H)); /* NaN */
      CUDA_OK(cudaMemset(d_ws, 0xFF, wsb));
      err = mm_sm90_expert_compute_path(L, &pool, s->clamp, d_ws, wsb, NULL, (mm_sm90_path)path);
      if (err && err->code == MEGAMOE_CODE_UNIMPLEMENTED && path == MM_SM90_PATH_WGMMA) {
        printf("# wgmma path: %s\n", err->message);
        megamoe_error_destroy(err);
        g_have_wgmma_fail++;
        continue;
      }
      if (path == MM_SM90_PATH_PREFILL &&
          ((mode != MM_WMODE_G32_FP8 && mode != MM_WMODE_G16_FP8) || err)) {
        /* other modes, and modes 1 and 3 with references in their blocks,
         * are refused with a reason */
        CHECK_MSG(err && err->code == MEGAMOE_CODE_UNIMPLEMENTED, "mode %d: prefill path not refused",
                  (int)mode);
        if (err) printf("# prefill path: %s\n", err->message);
        megamoe_error_destroy(err);
        continue;
      }
      g_prefill_runs += path == MM_SM90_PATH_PREFILL;
      fetch_out(err, d_out, got, 2 * (size_t)M * H);
      /* What "within 1e-3 of the reference computed from the same quantized
       * inputs" means here, in two exact checks and one sanity bound:
       * 1. L1 + SwiGLU + requant: every FP8 code of the intermediate equals
       *    the float64 reference's, or differs only at a rounding near-tie
       *    (code_explained). A single such flip moves the final output of a
       *    small case by ~1e-3 on its own, so the end-to-end error is not
       *    the right gauge of L1.
       * 2. L2: the output within 1e-3 of the reference L2 applied to the
       *    GPU's own intermediate, without its one-step rounding flips,
       *    which are counted (FP32 sums) or checked value by value (QGMMA).
       * 3. End to end against the full reference: printed, bounded loosely.
       * tau, the accumulation error allowed in L1 relative to sum |x w|:
       * FP32 accumulation (CUDA cores; F16 HGMMA: modes 2 and 4) 2^-16; FP8
       * QGMMA (modes 1 and 3), which adds with about 14 bits between the
       * FP32 promotions every 128 K (DeepSeek-V3 sec. 3.3), 2^-10; exact-sum
       * data 0. Mode 3's reference takes its folded weights (dense_expert),
       * so the same checks and bounds hold for it. */
      const int qg = path != MM_SM90_PATH_SIMT && fp8_mode;
      const double tau_sums = qg ? 0x1p-10 : 0x1p-16;
      const double tau = s->exact ? 0.0 : tau_sums;
      /* The QGMMA paths are the fast, approximate ones: measured on the
       * H200 in mode 1, its L1
       * codes also differ away from near-ties (e.g. 0x88 for 0x81, 0x5a for
       * 0x5b), by one code step or by little against the block's range, in
       * 0.5% of the codes. Bounds for it: one step or 2^-8 of the block's
       * range, at most 2% of the codes. Exact-sum data still pins its
       * decode bit for bit. */
      const double abs_slack = qg && !s->exact ? 0x1p-8 : 0.0;
      /* Of the codes, mode 1 measured up to 0.76% a step away (bound 2%);
       * mode 3, whose folded weights carry three mantissa bits (mode 1's
       * one), so that more of the QGMMA's sums lose low bits, 0.7-1.8%
       * (H 1280 the most: 1.6-1.8% in four runs; bound 4%). */
      const double diff_frac = mode == MM_WMODE_G16_FP8 ? 0.04 : 0.02;
      /* L2, every path: 1e-3 without the values one BF16 step from the
       * reference (rel_frob_flips), as the issue asks. The flips: on the
       * FP32-accumulating paths at most 0.2% of the values and 4 (measured
       * at most 0.04%: 1 of 2500 values; 52 of 1.05 million in the largest
       * case); on the QGMMA paths, whose sums lose low bits, 3-4% of
       * the values (rel 0.3-1.8e-3 with them), so there each value is held
       * to its exact sum instead (check_l2_values). */
      const double l2_tol = 1e-3;
      /* End to end, loosely. Mode 1 on the extreme-exponent data: its
       * legitimate near-tie flips in L1 (checked code by code below) land on
       * channels that the 2^60-scaled down projection amplifies; seed
       * 1796017857 gives 9.0e-2 from 4 flips, identically before and after
       * the launch changes of the third stop. A broken decode of those
       * groups (zeroed, sign-flipped, wrapped) is O(1) here. */
      const int m3 = mode == MM_WMODE_G16_FP8;
      /* Mode 3 on the QGMMA paths: its 0.7-1.8% of near-tie flips (check 1)
       * move small cases further; seed 1796424815 gives 6.1e-2 on both
       * QGMMA paths (E 40, M 159: 271 of 19968 codes a step away, every
       * one at a near-tie, L2 from the GPU's intermediate 8e-4), where the
       * other cases run at 2e-4 to 1.9e-2. */
      /* Mode 1 there too, on small cases: seed 1796441190 gives 5.24e-2 on
       * both QGMMA paths under TOKEN_TILE=128 GRID=3 (E 32, M 108: 72 of
       * 13440 codes a step away, all at near-ties, a token's FP8 scale
       * 0.5% off; L2 from the GPU's intermediate 6e-4; kernels unchanged
       * since version 31). */
      const double tol = qg && s->extreme ? 0.25 : qg ? 0.1 : 5e-2;
      int nan_rows;
      double rel = rel_frob(got + (size_t)lead * H, (m3 ? ref_fold : ref) + (size_t)lead * H,
                            Mused - lead, H, &nan_rows);
      printf("# mode %d %s H %d I %d E %d M %d (rows %d..%d) clamp %g%s: end-to-end rel %.3e "
             "(bound %.1e%s) nan rows %d\n",
             (int)mode, path_name(path), H, I, E, M, lead, Mused,
             (double)s->clamp, s->extreme ? " extreme" : "", rel, tol,
             m3 ? ", folded weights" : "", nan_rows);
      CHECK(nan_rows == 0);
      if (!(rel <= tol))
        report_worst("end to end against the reference", got + (size_t)lead * H,
                     (m3 ? ref_fold : ref) + (size_t)lead * H, Mused - lead, H);
      CHECK(rel <= tol);
      if (m3) { /* and against the checkpoint's weights: the fold error */
        int nan_c;
        const double rel_c = rel_frob(got + (size_t)lead * H, ref + (size_t)lead * H,
                                      Mused - lead, H, &nan_c);
        printf("#   mode 3 %s end-to-end rel %.3e against the checkpoint's weights (bound %.1e)\n",
               path_name(path), rel_c, tol_m3);
        CHECK(rel_c <= tol_m3);
      }
      size_t touched = 0; /* outside the pool: still the poison */
      for (int i = 0; i < M; i++)
        for (int c = 0; (i < lead || i >= Mused) && c < H; c++) touched += got[(size_t)i * H + c] != 0xFFFF;
      CHECK_MSG(touched == 0, "%zu values outside the pool rows were written", touched);
      if (Mused > 0) {
        CHECK_OK(mm_sm90_debug_intermediate(L, M, d_ws, Mused, gq, gsc));
        check_intermediate(dx, offs, E, &dots, rw, s->clamp, tau, abs_slack, diff_frac, gq, gsc,
                           rq, rsc, I, path_name(path), qg && !s->exact ? 2e-2 : 1e-6);
        for (int e = 0; e < E; e++)
          ref_l2(&dx[e], counts[e], gq + (size_t)offs[e] * I, gsc + (size_t)offs[e] * (I / 128),
                 ref2 + (size_t)offs[e] * H, qg ? exact2 + (size_t)offs[e] * H : NULL,
                 qg ? mag2 + (size_t)offs[e] * H : NULL);
        int nan2;
        const size_t n2 = (size_t)(Mused - lead) * H;
        const uint16_t *g2 = got + (size_t)lead * H, *r2 = ref2 + (size_t)lead * H;
        const double rel2 = rel_frob(g2, r2, Mused - lead, H, &nan2);
        size_t flips = 0, by_sum = 0;
        const double rel2x = rel_frob_flips(g2, r2, Mused - lead, H, &flips);
        /* the QGMMA paths: value by value instead of a count of flips (and
         * no longer rel with the flips in, bounded at 5e-3 until the
         * fifty-ninth stop: one flip on a value that dominates a case's
         * norm moves it by up to 2^-7 alone; seed 1796611622, extreme
         * exponents, the huge row's 5.89e14 at a near-tie, gave 5.6e-3 on
         * the prefill path, whose sum rounded the other way from the WGMMA
         * path's, 1.1e-4) */
        const size_t max_flips = n2 / 500 + 4;
        /* L1's tau even for exact-sum data: L2's input is the GPU's
         * intermediate, whose sums are not exact (see l2_tol) */
        const size_t bad2 = qg ? check_l2_values(g2, r2, exact2 + (size_t)lead * H,
                                                 mag2 + (size_t)lead * H, n2, H, tau_sums, &by_sum)
                               : 0;
        printf("#   %s L2 from the GPU's intermediate: rel %.3e, %.3e without its %zu one-step flips",
               path_name(path), rel2, rel2x, flips);
        if (qg) printf(" (%zu values within tau of their sum |x w| only, %zu beyond)", by_sum, bad2);
        else printf(" (at most %zu)", max_flips);
        printf(" (tol %.1e)\n", l2_tol);
        const int flips_ok = qg || flips <= max_flips; /* the QGMMA paths: no count */
        if (!(rel2x <= l2_tol) || !flips_ok || bad2)
          report_worst("L2 against the reference from the GPU's intermediate", g2, r2, Mused - lead, H);
        CHECK(rel2x <= l2_tol);
        CHECK(flips_ok);
        CHECK_EQ_INT(bad2, 0);
      }
      /* the F16 modes stage their copy of x in out, mode 3 on the WGMMA path */
      check_out_rows(L, &pool, s->clamp, d_ws, wsb, (mm_sm90_path)path, got, lead, Mused, H,
                     mode == MM_WMODE_G16_BF16_EXACT || mode == MM_WMODE_G32_F16_EXACT ||
                         (mode == MM_WMODE_G16_FP8 && path != MM_SM90_PATH_SIMT &&
                          path != MM_SM90_PATH_PREFILL));
    }
    if (mode == MM_WMODE_G16_FP8) printf("# mode 3 weight fold error %.4f\n", mm_sm90_layer_fold_error(L));
    dev_pool_free(&dp);
  }
done:
  mm_sm90_layer_destroy(L);
  for (int e = 0; e < E; e++) {
    mm_qmat_free(&ex[e].w13);
    mm_qmat_free(&ex[e].w2);
    dense_expert_free(&dx[e]);
  }
  free(ex);
  free(dx);
  free(ref_fold);
  free(xq);
  free(xs);
  free(rw);
  free(ref);
  free(got);
  free(rq);
  free(gq);
  free(rsc);
  free(gsc);
  free(ref2);
  free(exact2);
  free(mag2);
  free(dots.g), free(dots.u), free(dots.ga), free(dots.ua);
}

static const int k_counts_a[] = {5, 0, 70};
static const int k_counts_all[] = {0, 0, 200, 0};
static const int k_counts_one[] = {130};
static const int k_counts_empty[] = {0, 0};
/* both widths of the 128+160 launch pair in one call (mm_sm90_wide_count):
 * 150 and 140 rows take one 160-wide tile, 3 and 70 a 128-wide one, 270
 * and 530 both widths (160 + 128 and 160 + 3 x 128) */
static const int k_counts_pair[] = {150, 3, 270, 70, 0, 140, 530};
/* 2100 rows: 17 L1 token tiles, the last of 52 rows split alone; 1930:
 * 16 tiles, the last of 10 rows, so the last set of two is split and one
 * warpgroup computes the small tile (mm_sm90_prefill_unit) */
static const int k_counts_big[] = {2100, 77, 0, 1930};
/* the mixed kernels' large tiles at both MMA widths (Kern::kNarrow): in
 * the FP8 modes' 32-wide kernels 33 and 40 rows take m64n40 MMAs, 45, 52
 * and 110 (64 + 46) full ones; in the F16 modes' 33-45 rows take the
 * middle tiles, 52 and 110's second tile m64n56 MMAs; forced 16-wide
 * tiles at one CTA per SM (gpu_suite.sh) give mode 2's 32-wide large tiles
 * of 1-20 rows m64n24 MMAs; 128-wide tiles (the 64+128 and 32+128 pairs,
 * TOKEN_TILE=128) every width of their second half: none at 1-52 rows,
 * m64n16 at 70, n32 at 90, n48 at 110 (Kern::k_loop_ahead); forced
 * 64-wide tiles (TOKEN_TILE=64) m64n48 MMAs at 45, 3, 33 and 40 rows and
 * in the last tiles of 70, 90 and 110, full ones at 52 */
static const int k_counts_widths[] = {45, 3, 33, 70, 110, 2, 52, 40, 90, 0};
/* the prefill path's narrow tiles (moe_sm90_prefill.cu, narrow_unit): an
 * expert's last token tile of 1-16 rows in both GEMMs (m64n16: 16, 1, 8,
 * 144's and 134's last), of 17-32 in L2 (m64n32: 17, 32, 159's last; L1
 * takes them on one warpgroup), and 33 rows on the usual tile */
static const int k_counts_narrow[] = {16, 17, 32, 1, 159, 33, 0, 144, 8, 134};

static const shape k_shapes[] = {
    {256, 128, 3, k_counts_a, 0, 0.0f, 0, 0, 0},
    {512, 256, 1, k_counts_one, 0, 0.0f, 0, 0, 0},
    /* a clamp BF16 cannot hold: clamped gates take silu_c (moe_sm90_wgmma.cu) */
    {256, 128, 4, k_counts_all, 0, 2.7f, 0, 0, 0},
    {256, 128, 32, NULL, 9, 0.0f, 0, 0, 0},
    {256, 256, 2, k_counts_empty, 0, 0.0f, 0, 0, 0},
    {256, 128, 3, k_counts_a, 0, 0.0f, 0, 0, 37},
    {256, 128, 7, k_counts_pair, 0, 0.0f, 0, 0, 0},
    /* more experts than the prefill path's chunk (MM_SM90_PREFILL_CHUNK) */
    {256, 128, 40, NULL, 9, 0.0f, 0, 0, 0},
    /* 10 and 9 K blocks: the prefill path's runs of 8, 2 and 1 (kRun) */
    {1280, 1152, 3, k_counts_a, 0, 0.0f, 0, 0, 0},
    /* the prefill path's raster groups (17 L1 token tiles: two groups of 8
     * sets and a split last tile; 16 with a small last tile) and odd tile
     * counts in both GEMMs */
    {256, 256, 4, k_counts_big, 0, 0.0f, 0, 0, 0},
    {256, 128, 10, k_counts_widths, 0, 0.0f, 0, 0, 0},
    /* I = 384: w2 anchors, so modes 1 and 3 take the prefill path */
    {256, 384, 10, k_counts_narrow, 0, 0.0f, 0, 0, 0},
    {256, 384, 10, k_counts_narrow, 0, 2.7f, 0, 0, 3},
};

static void test_mode(mm_weight_mode mode) {
  /* MEGAMOE_TEST_QUICK (sanitizer runs): six shapes per mode */
  const int quick = getenv("MEGAMOE_TEST_QUICK") != NULL;
  for (size_t i = 0; i < sizeof(k_shapes) / sizeof(k_shapes[0]); i++)
    if (!quick || i == 0 || i == 3 || i == 5 || i == 6 || i == 10 || i == 11)
      run_case(mode, &k_shapes[i]);
}
static void test_mode1_g32(void) {
  test_mode(MM_WMODE_G32_FP8);
  /* random rows fold with one reference each: the prefill path must have
   * run, not only been refused */
  printf("# prefill path: %d cases computed\n", g_prefill_runs);
  CHECK(g_prefill_runs > 0 || (g_only_path >= 0 && g_only_path != MM_SM90_PATH_PREFILL));
}
static void test_mode2_g16_exact(void) { test_mode(MM_WMODE_G16_BF16_EXACT); }
static void test_mode3_g16_fp8(void) {
  const int before = g_prefill_runs;
  test_mode(MM_WMODE_G16_FP8);
  /* rows whose blocks share their largest scale anchor: the prefill path
   * must have run mode 3 too */
  printf("# prefill path: %d mode 3 cases computed\n", g_prefill_runs - before);
  CHECK(g_prefill_runs > before || (g_only_path >= 0 && g_only_path != MM_SM90_PATH_PREFILL));
}
static void test_mode4_g32_f16_exact(void) { test_mode(MM_WMODE_G32_F16_EXACT); }
static void test_mode1_extreme_exponents(void) {
  const shape s = {256, 128, 2, k_counts_a, 0, 0.0f, 1, 0, 0};
  run_case(MM_WMODE_G32_FP8, &s);
}
static void test_mode4_extreme_exponents(void) {
  const shape s = {256, 128, 2, k_counts_a, 0, 0.0f, 1, 0, 0};
  run_case(MM_WMODE_G32_F16_EXACT, &s);
}

/* Decode pinned down: x in {0, +-1}, unit group scales, so every L1 sum is
 * exact in any accumulator; the intermediate must match bit for bit. */
static void test_exact_sums(void) {
  const shape s1 = {512, 256, 2, k_counts_a, 0, 0.0f, 0, 1, 0};
  run_case(MM_WMODE_G32_FP8, &s1);
  const shape s2 = {256, 128, 32, NULL, 9, 0.0f, 0, 1, 0};
  run_case(MM_WMODE_G32_FP8, &s2);
  const shape s3 = {1280, 1152, 3, k_counts_a, 0, 0.0f, 0, 1, 0}; /* runs of 8, 2, 1 */
  run_case(MM_WMODE_G32_FP8, &s3);
  const shape s4 = {256, 256, 4, k_counts_big, 0, 0.0f, 0, 1, 0}; /* raster groups, split tiles */
  run_case(MM_WMODE_G32_FP8, &s4);
  const shape s5 = {256, 128, 10, k_counts_widths, 0, 0.0f, 0, 1, 0}; /* MMA widths */
  run_case(MM_WMODE_G32_FP8, &s5);
  const shape s6 = {256, 384, 10, k_counts_narrow, 0, 0.0f, 0, 1, 0}; /* narrow last tiles */
  run_case(MM_WMODE_G32_FP8, &s6);
  run_case(MM_WMODE_G16_BF16_EXACT, &s1);
  run_case(MM_WMODE_G32_F16_EXACT, &s1);
  run_case(MM_WMODE_G32_F16_EXACT, &s2);
}

/* The L1 epilogue's silu table and silu_n (the division's fast path
 * without a branch per value, which fills it) against the division on every
 * BF16 gate value. */
static void test_silu_every_bf16(void) {
  unsigned long long bad = ~0ull;
  CHECK_OK(mm_sm90_check_silu(&bad));
  CHECK_MSG(bad == 0, "%llu silu results differ from g / (1 + expf(-g))", bad);
}

static void test_bad_args(void) {
  mm_expert_q ex;
  memset(&ex, 0, sizeof(ex));
  make_expert(&ex, 256, 128, MM_WMODE_G32_FP8, 0, 0);
  mm_sm90_layer *L = NULL;
  /* wrong mode for the scale format: refused at load, nothing allocated */
  CHECK_ERR(mm_sm90_layer_create(&ex, 1, MM_WMODE_G16_BF16_EXACT, NULL, &L),
            MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK(L == NULL);
  mm_expert_q e16;
  memset(&e16, 0, sizeof(e16));
  make_expert(&e16, 256, 128, MM_WMODE_G16_BF16_EXACT, 0, 0);
  CHECK_ERR(mm_sm90_layer_create(&e16, 1, MM_WMODE_G32_F16_EXACT, NULL, &L),
            MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK(L == NULL);
  mm_qmat_free(&e16.w13);
  mm_qmat_free(&e16.w2);
  CHECK_OK(mm_sm90_layer_create(&ex, 1, MM_WMODE_G32_FP8, NULL, &L));
  if (L) {
    mm_expert_pool pool = {8, NULL, NULL, NULL, NULL, NULL, 0, NULL};
    CHECK_ERR(mm_sm90_expert_compute(L, &pool, 0.0f, NULL, 0, NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
    mm_sm90_layer_destroy(L);
  }
  mm_qmat_free(&ex.w13);
  mm_qmat_free(&ex.w2);
}

/* NaN inputs on every path: a token with an E4M3 NaN code (0x7F, or 0xFF)
 * or a NaN token scale must come out NaN in every channel (its gates and
 * ups are NaN, the activation clamp keeps NaN, its FP8 blocks are NaN), and
 * every other row bit for bit as in a clean run of the same pool (docs/
 * RELIABILITY.md). The backend test (gpu_test_ep) covers the WGMMA kernels
 * through the whole layer; this covers each path of the expert compute,
 * the prefill path's epilogues included. I = 384: w2 wider than 256
 * columns anchors (make_expert), so modes 1 and 3 take the prefill path. */
static void run_nan_case(mm_weight_mode mode, float clamp) {
  const int H = 256, I = 384, E = 3, KB = H / 128, M = 75;
  const int offs[4] = {0, 5, 5, M};
  const int nan_rows[3] = {2, 40, 74}; /* code 0x7F, scale NaN, code 0xFF */
  mm_expert_q ex[3];
  memset(ex, 0, sizeof(ex));
  for (int e = 0; e < E; e++) make_expert(&ex[e], H, I, mode, 0, 0);
  uint8_t *xq = mm_test_alloc((size_t)M * H), *xq_nan = mm_test_alloc((size_t)M * H);
  float *xs = mm_test_alloc(sizeof(float) * M * KB), *xs_nan = mm_test_alloc(sizeof(float) * M * KB);
  float *rw = mm_test_alloc(sizeof(float) * M);
  {
    uint16_t *xb = mm_test_alloc(2 * (size_t)M * H);
    for (size_t i = 0; i < (size_t)M * H; i++) xb[i] = mm_float_to_bf16(mm_test_normal());
    mm_ref_quant_act(xb, M, H, xq, xs);
    free(xb);
  }
  for (int i = 0; i < M; i++) rw[i] = mm_test_uniform(0.05f, 1.0f);
  memcpy(xq_nan, xq, (size_t)M * H);
  memcpy(xs_nan, xs, sizeof(float) * M * KB);
  xq_nan[(size_t)nan_rows[0] * H + 7] = 0x7F;
  xs_nan[(size_t)nan_rows[1] * KB + 1] = NAN;
  xq_nan[(size_t)nan_rows[2] * H + 200] = 0xFF;
  const size_t ob = 2 * (size_t)M * H;
  uint16_t *clean = mm_test_alloc(ob), *got = mm_test_alloc(ob), *again = mm_test_alloc(ob);
  mm_sm90_layer *L = NULL;
  CHECK_OK(mm_sm90_layer_create(ex, E, mode, NULL, &L));
  dev_pool dp = {0};
  if (!L) goto done;
  const size_t wsb = mm_sm90_workspace_bytes(L, M);
  dev_pool_alloc(&dp, E, M, H, wsb);
  void *const d_off = dp.off, *const d_x = dp.x, *const d_xs = dp.xs, *const d_rw = dp.rw,
             *const d_out = dp.out, *const d_ws = dp.ws;
  CUDA_OK(cudaMemcpy(d_off, offs, sizeof(offs), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_rw, rw, sizeof(float) * M, cudaMemcpyHostToDevice));
  mm_expert_pool pool = {M, d_off, d_x, d_xs, d_rw, d_out, 0, NULL};
  for (int path = MM_SM90_PATH_SIMT; path <= MM_SM90_PATH_PREFILL; path++) {
    if (g_only_path >= 0 && path != g_only_path) continue;
    uint16_t *dst[3] = {clean, got, again};
    int refused = 0;
    for (int run = 0; run < 3 && !refused; run++) { /* clean, NaN, clean again */
      CUDA_OK(cudaMemcpy(d_x, run == 1 ? xq_nan : xq, (size_t)M * H, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(d_xs, run == 1 ? xs_nan : xs, sizeof(float) * M * KB, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemset(d_out, 0xFF, ob));
      CUDA_OK(cudaMemset(d_ws, 0xFF, wsb));
      mm_err *err = mm_sm90_expert_compute_path(L, &pool, clamp, d_ws, wsb, NULL, (mm_sm90_path)path);
      if (err && err->code == MEGAMOE_CODE_UNIMPLEMENTED) { /* the prefill path in modes 2, 4 */
        CHECK_MSG(path == MM_SM90_PATH_PREFILL &&
                      (mode == MM_WMODE_G16_BF16_EXACT || mode == MM_WMODE_G32_F16_EXACT),
                  "mode %d %s refused: %s", (int)mode, path_name(path), err->message);
        megamoe_error_destroy(err);
        refused = 1;
        break;
      }
      fetch_out(err, d_out, dst[run], ob);
    }
    if (refused) continue;
    size_t not_nan = 0, diff = 0, diff_again = 0;
    for (int r = 0; r < M; r++) {
      const int poisoned = r == nan_rows[0] || r == nan_rows[1] || r == nan_rows[2];
      for (int c = 0; c < H; c++) {
        const size_t o = (size_t)r * H + c;
        if (poisoned) not_nan += (got[o] & 0x7FFF) <= 0x7F80;
        else diff += got[o] != clean[o];
        diff_again += again[o] != clean[o];
      }
    }
    printf("# mode %d %s clamp %g, NaN in 3 rows: %zu of their values not NaN, %zu other values "
           "differ from the clean run, %zu differ in a clean run after it\n",
           (int)mode, path_name(path), (double)clamp, not_nan, diff, diff_again);
    CHECK_EQ_INT(not_nan, 0);
    CHECK_EQ_INT(diff, 0);
    CHECK_EQ_INT(diff_again, 0);
  }
done:
  dev_pool_free(&dp);
  mm_sm90_layer_destroy(L);
  for (int e = 0; e < E; e++) {
    mm_qmat_free(&ex[e].w13);
    mm_qmat_free(&ex[e].w2);
  }
  free(xq), free(xq_nan), free(xs), free(xs_nan), free(rw), free(clean), free(got), free(again);
}

static void test_nan_inputs(void) {
  for (int m = MM_WMODE_G32_FP8; m <= MM_WMODE_G32_F16_EXACT; m++) {
    run_nan_case((mm_weight_mode)m, 0.0f);
    run_nan_case((mm_weight_mode)m, 2.7f);
  }
}

/* NaN / Inf values of got, and values that differ from ref (BF16 bits). */
static void count_diff(const uint16_t *got, const uint16_t *ref, size_t n, size_t *nan,
                       size_t *diff) {
  for (size_t i = 0; i < n; i++) {
    *nan += (got[i] & 0x7F80) == 0x7F80;
    *diff += got[i] != ref[i];
  }
}

/* The prefill path's workspace region: a call given only the minimum runs
 * the WGMMA kernels (a plan made before the layers were prepared), a forced
 * prefill call refuses it, less than the minimum is refused; one and two
 * experts per launch pair (compute.prefill-experts) take a smaller region
 * and compute the same bits; a layer with the path turned off
 * plans no region and refuses the forced path. */
static void test_prefill_workspace(void) {
  /* exact data: one reference per row; three different experts, so that
   * an expert's weights read from another's slot show */
  mm_expert_q exs[3];
  memset(exs, 0, sizeof(exs));
  for (int e = 0; e < 3; e++) make_expert(&exs[e], 256, 128, MM_WMODE_G32_FP8, 0, 1);
  mm_sm90_layer *L = NULL;
  CHECK_OK(mm_sm90_layer_create(exs, 3, MM_WMODE_G32_FP8, NULL, &L));
  const int M = 70, H = 256, I = 128;
  const int offs[4] = {0, 20, 20, M}; /* expert 1 empty */
  const size_t out_bytes = 2 * (size_t)M * H;
  dev_pool dp = {0};
  uint16_t *got = malloc(out_bytes), *ref = malloc(out_bytes);
  if (!L) goto done;
  const size_t full = mm_sm90_workspace_bytes(L, M), least = mm_sm90_workspace_bytes_min(L, M);
  printf("# workspace for %d rows: %zu bytes, %zu without the prefill region\n", M, full, least);
  CHECK(full >= least + 3 * (size_t)2 * I * H);
  dev_pool_alloc(&dp, 3, M, H, full);
  void *const d_off = dp.off, *const d_x = dp.x, *const d_xs = dp.xs, *const d_rw = dp.rw,
             *const d_out = dp.out, *const d_ws = dp.ws;
  CUDA_OK(cudaMemcpy(d_off, offs, sizeof(offs), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(d_x, 0x38, (size_t)M * H)); /* 1.0 */
  {
    float *h = malloc(sizeof(float) * (size_t)M * (H / 128));
    for (int i = 0; i < M * (H / 128); i++) h[i] = 0.5f;
    CUDA_OK(cudaMemcpy(d_xs, h, sizeof(float) * (size_t)M * (H / 128), cudaMemcpyHostToDevice));
    for (int i = 0; i < M; i++) h[i] = 1.0f;
    CUDA_OK(cudaMemcpy(d_rw, h, sizeof(float) * M, cudaMemcpyHostToDevice));
    free(h);
  }
  mm_expert_pool pool = {M, d_off, d_x, d_xs, d_rw, d_out, 0, NULL};
  /* each call's output poisoned before it, checked and copied after it */
  size_t nan = 0, diff = 0;
  /* the full region: the forced path runs (the exact data's matrices have
   * reference 0 everywhere, so it must not be refused) */
  CUDA_OK(cudaMemset(d_out, 0xFF, out_bytes));
  fetch_out(mm_sm90_expert_compute_path(L, &pool, 0.0f, d_ws, full, NULL, MM_SM90_PATH_PREFILL),
            d_out, ref, out_bytes);
  /* the minimum: AUTO runs (the WGMMA kernels), the same bits on exact
   * data; the forced path is refused */
  CUDA_OK(cudaMemset(d_out, 0xFF, out_bytes));
  fetch_out(mm_sm90_expert_compute(L, &pool, 0.0f, d_ws, least, NULL), d_out, got, out_bytes);
  count_diff(got, ref, (size_t)M * H, &nan, &diff);
  CHECK_ERR(mm_sm90_expert_compute_path(L, &pool, 0.0f, d_ws, least, NULL, MM_SM90_PATH_PREFILL),
            MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_sm90_expert_compute(L, &pool, 0.0f, d_ws, least - 1, NULL),
            MEGAMOE_CODE_INVALID_ARGUMENT);
  /* one and two experts per launch pair: three and two launch pairs in a
   * smaller weight region, the same bits. With one, no launch decodes
   * ahead into w13 slots (none is free while a w2 launch runs) and every
   * L1 launch decodes its pair's w2 ahead; with two, an L2 launch decodes
   * the next pair's first w13 ahead, and the last pair has one expert
   * (mm_sm90_prefill_slot). */
  for (int per = 1; per <= 2; per++) {
    mm_sm90_layer_set_prefill(L, 1, per);
    const size_t part = mm_sm90_workspace_bytes(L, M);
    printf("# %d expert(s) per launch pair: %zu bytes\n", per, part);
    CHECK(part < full && part >= least + (size_t)2 * per * I * H);
    CUDA_OK(cudaMemset(d_out, 0xFF, out_bytes));
    CUDA_OK(cudaMemset(d_ws, 0xFF, part));
    fetch_out(mm_sm90_expert_compute_path(L, &pool, 0.0f, d_ws, part, NULL, MM_SM90_PATH_PREFILL),
              d_out, got, out_bytes);
    count_diff(got, ref, (size_t)M * H, &nan, &diff);
    CHECK_EQ_INT(nan, 0);
    CHECK_EQ_INT(diff, 0);
  }
  /* turned off (compute.prefill-path: off) */
  mm_sm90_layer_set_prefill(L, 0, 0);
  CHECK_EQ_INT(mm_sm90_workspace_bytes(L, M), least);
  CHECK_ERR(mm_sm90_expert_compute_path(L, &pool, 0.0f, d_ws, full, NULL, MM_SM90_PATH_PREFILL),
            MEGAMOE_CODE_UNIMPLEMENTED);
  CUDA_OK(cudaDeviceSynchronize());
done:
  free(got);
  free(ref);
  dev_pool_free(&dp);
  mm_sm90_layer_destroy(L);
  for (int e = 0; e < 3; e++) {
    mm_qmat_free(&exs[e].w13);
    mm_qmat_free(&exs[e].w2);
  }
}

/* The prefill path's threshold per mode (mm_sm90_prefill_min_rows): a
 * workspace plan holds the path's region from that many rows per local
 * expert on, not below, when MEGAMOE_SM90_PREFILL does not force it. */
static void test_prefill_threshold(void) {
  const char *forced = getenv("MEGAMOE_SM90_PREFILL");
  char *saved = forced ? strdup(forced) : NULL;
  unsetenv("MEGAMOE_SM90_PREFILL");
  const mm_weight_mode modes[2] = {MM_WMODE_G32_FP8, MM_WMODE_G16_FP8};
  for (int i = 0; i < 2; i++) {
    mm_expert_q ex[3];
    memset(ex, 0, sizeof(ex));
    for (int e = 0; e < 3; e++) make_expert(&ex[e], 256, 384, modes[i], 0, 0); /* anchored */
    mm_sm90_layer *L = NULL;
    CHECK_OK(mm_sm90_layer_create(ex, 3, modes[i], NULL, &L));
    if (L) {
      const int at = 3 * mm_sm90_prefill_min_rows(modes[i]);
      const int below = mm_sm90_workspace_bytes(L, at - 1) > mm_sm90_workspace_bytes_min(L, at - 1);
      const int from = mm_sm90_workspace_bytes(L, at) > mm_sm90_workspace_bytes_min(L, at);
      printf("# mode %d: prefill region planned at %d rows (3 experts): %s, at %d: %s\n",
             (int)modes[i], at - 1, below ? "yes" : "no", at, from ? "yes" : "no");
      CHECK(!below && from);
    }
    mm_sm90_layer_destroy(L);
    for (int e = 0; e < 3; e++) {
      mm_qmat_free(&ex[e].w13);
      mm_qmat_free(&ex[e].w2);
    }
  }
  CHECK(mm_sm90_prefill_min_rows(MM_WMODE_G16_FP8) < mm_sm90_prefill_min_rows(MM_WMODE_G32_FP8));
  if (saved) setenv("MEGAMOE_SM90_PREFILL", saved, 1);
  free(saved);
}

int main(void) {
  if (!mm_test_have_gpu()) return mm_test_skip_all("no GPU");
  mm_test_seed();
  /* workspaces with the prefill path's region at every size */
  setenv("MEGAMOE_SM90_PREFILL", "1", 1);
  const char *only = getenv("MEGAMOE_TEST_PATH");
  if (only)
    g_only_path = !strcmp(only, "simt")      ? MM_SM90_PATH_SIMT
                  : !strcmp(only, "wgmma")   ? MM_SM90_PATH_WGMMA
                  : !strcmp(only, "prefill") ? MM_SM90_PATH_PREFILL
                                             : -1;
  /* MEGAMOE_TEST_MODE=1..4: that weight mode's shapes only (a quick look
   * at one mode's data or kernels) */
  const char *mode_only = getenv("MEGAMOE_TEST_MODE");
  if (mode_only) {
    void (*const by_mode[5])(void) = {NULL, test_mode1_g32, test_mode2_g16_exact,
                                      test_mode3_g16_fp8, test_mode4_g32_f16_exact};
    const int m = atoi(mode_only);
    if (m < 1 || m > 4) {
      printf("Bail out! MEGAMOE_TEST_MODE=%s is not 1-4\n", mode_only);
      return 1;
    }
    mm_test_run_(mode_only, by_mode[m]);
    return mm_test_done();
  }
  RUN(test_bad_args);
  RUN(test_silu_every_bf16);
  RUN(test_mode1_g32);
  RUN(test_mode2_g16_exact);
  RUN(test_mode3_g16_fp8);
  RUN(test_mode4_g32_f16_exact);
  RUN(test_mode1_extreme_exponents);
  RUN(test_mode4_extreme_exponents);
  RUN(test_exact_sums);
  RUN(test_prefill_workspace);
  RUN(test_nan_inputs);
  RUN(test_prefill_threshold);
  return mm_test_done();
}

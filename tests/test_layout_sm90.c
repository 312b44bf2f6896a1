/* test_layout_sm90.c -- the sm90 weight layout transform (CPU): every weight
 * of the packed records decodes to the canonical value (modes 1, 2 and 4
 * exactly, mode 3 within its E4M3 rounding; mode 4 = mode 1's records), mode
 * 4's K order against the PTX fragment layouts, the F16 high bytes mode 4's
 * kernels make of the fold table, the cuda backend's mode
 * choice, the workspace plan, extremes of both scale formats,
 * refusal of unfoldable UE8M0 blocks, mode 1's scale bytes as compact-table
 * offsets, the w13 gate/up order, and a bit-level
 * check of the thread-register word layout. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"
#include "harness.h"
#include "backend_cuda.h"
#include "layout_sm90.h"
#include "sm90_test_scales.h"

static void rand_codes(mm_qmat *m) {
  for (size_t i = 0; i < (size_t)m->rows * m->cols / 2; i++) m->codes[i] = (uint8_t)mm_test_rand_u64();
}

/* The power of two a layout row factor carries beyond the source row's
 * (mode 1's row anchor; 0 otherwise): rs == row_scale * 2^R exactly, else
 * a failed check and 0. */
static int row_anchor_of(float rs, float row_scale) {
  if (rs == row_scale) return 0;
  int er, es;
  frexpf(rs, &er);
  frexpf(row_scale, &es);
  CHECK(ldexpf(row_scale, er - es) == rs);
  return ldexpf(row_scale, er - es) == rs ? er - es : 0;
}

/* 1 if every K block of layout row r stores reference exponent 0 (the
 * row anchor moved its reference into the row factor). */
static int refs_all_zero(const uint8_t *blob, mm_weight_mode mode, int KB, int r) {
  int zero = 1;
  for (int kb = 0; kb < KB; kb++) {
    int16_t ref;
    memcpy(&ref, blob + ((size_t)(r / 64) * KB + kb) * mm_sm90_record_bytes(mode) +
                     mm_sm90_ref_offset(mode) + 2 * (r % 64), 2);
    zero &= ref == 0;
  }
  return zero;
}

/* Compares every layout weight with the canonical one (times the power of
 * two the row factor took from it); returns max |rel err|. rs: the packer's
 * row factors. */
static double compare_all(const mm_qmat *m, mm_weight_mode mode, int gate_up, const uint8_t *blob,
                          const float *rs, int *exact_fail) {
  double worst = 0.0;
  *exact_fail = 0;
  for (int r = 0; r < m->rows; r++) {
    int src = mm_sm90_src_row(r, m->rows, gate_up);
    const int R = row_anchor_of(rs[r], m->row_scale[src]);
    if (mode == MM_WMODE_G16_BF16_EXACT) CHECK_EQ_INT(R, 0);
    for (int k = 0; k < m->cols; k++) {
      float w = mm_qmat_weight(m, src, k);
      float v = ldexpf(mm_sm90_weight(blob, mode, m->rows, m->cols, r, k), R);
      if (v != w && !(v == 0.0f && w == 0.0f)) {
        if (*exact_fail < 3)
          printf("# mismatch mode %d row %d (src %d) k %d: %g vs %g\n", (int)mode, r, src, k, v,
                 w);
        (*exact_fail)++;
      }
      if (w != 0.0f) {
        double rel = fabs((double)v - (double)w) / fabs((double)w);
        if (rel > worst) worst = rel;
      }
    }
  }
  return worst;
}

/* Mode 4 = mode 1's records (sizes, bytes, row factors, decoded weights). */
static void same_records_mode4(const mm_qmat *m, int gate_up, const uint8_t *mode1,
                               const float *rs1) {
  const size_t bytes = mm_sm90_matrix_bytes(MM_WMODE_G32_F16_EXACT, m->rows, m->cols);
  CHECK(bytes == mm_sm90_matrix_bytes(MM_WMODE_G32_FP8, m->rows, m->cols));
  CHECK(mm_sm90_record_bytes(MM_WMODE_G32_F16_EXACT) == 4480);
  uint8_t *blob = mm_test_alloc(bytes);
  float *rs = mm_test_alloc(sizeof(float) * (size_t)m->rows);
  memset(blob, 0x5A, bytes);
  CHECK_OK(mm_sm90_pack_matrix(m, MM_WMODE_G32_F16_EXACT, gate_up, blob, rs, NULL));
  CHECK(memcmp(blob, mode1, bytes) == 0);
  CHECK(memcmp(rs, rs1, sizeof(float) * (size_t)m->rows) == 0);
  int bad;
  compare_all(m, MM_WMODE_G32_F16_EXACT, gate_up, blob, rs, &bad);
  CHECK_EQ_INT(bad, 0);
  free(blob);
  free(rs);
}

/* Mode 1's scale bytes are fold-table indices (k, 0): multiples of 8 in
 * [0, 8 * (KMAX - KMIN)]. The kernels rely on it: they use a byte as the
 * byte offset of its entry in the compact table of the (k, 0) entries. */
static void check_compact_indices(const uint8_t *blob, int rows, int cols) {
  const size_t rec = mm_sm90_record_bytes(MM_WMODE_G32_FP8);
  const size_t n = (size_t)(rows / 64) * (size_t)(cols / 128);
  int bad = 0;
  for (size_t r = 0; r < n; r++)
    for (int i = 0; i < 64 * 4; i++) {
      const int b = blob[r * rec + mm_sm90_scale_offset() + (size_t)i];
      if (b % 8 || b > 8 * (MM_SM90_LUT_KMAX - MM_SM90_LUT_KMIN)) bad++;
    }
  CHECK_EQ_INT(bad, 0);
}

static void test_g32_exact_random(void) {
  const int shapes[][2] = {{64, 128}, {128, 256}, {256, 384}};
  for (int s = 0; s < 3; s++) {
    for (int gate_up = 0; gate_up < 2; gate_up++) {
      if (gate_up && shapes[s][0] % 128) continue;
      mm_qmat m;
      CHECK(mm_qmat_alloc(&m, shapes[s][0], shapes[s][1], 32, MM_SF_UE8M0) == 0);
      rand_codes(&m);
      /* each 128-block: a base exponent anywhere, groups up to 14 below it */
      for (int r = 0; r < m.rows; r++) {
        m.row_scale[r] = mm_test_uniform(0.5f, 2.0f);
        for (int kb = 0; kb < m.cols / 128; kb++) {
          int base = 14 + (int)(mm_test_rand_u64() % 239); /* 14..252: 6 * 2^125 is finite */
          for (int g = 0; g < 4; g++)
            m.scales[(size_t)r * (m.cols / 32) + kb * 4 + g] =
                (uint8_t)(base - (int)(mm_test_rand_u64() % 15));
        }
      }
      uint8_t *blob = mm_test_alloc(mm_sm90_matrix_bytes(MM_WMODE_G32_FP8, m.rows, m.cols));
      float *rs = mm_test_alloc(sizeof(float) * m.rows);
      double fe[2];
      CHECK_OK(mm_sm90_pack_matrix(&m, MM_WMODE_G32_FP8, gate_up, blob, rs, fe));
      check_compact_indices(blob, m.rows, m.cols);
      int bad;
      compare_all(&m, MM_WMODE_G32_FP8, gate_up, blob, rs, &bad);
      CHECK_EQ_INT(bad, 0);
      CHECK(fe[0] == 0.0);
      same_records_mode4(&m, gate_up, blob, rs);
      free(blob);
      free(rs);
      mm_qmat_free(&m);
    }
  }
}

/* Extreme bytes: 0 (2^-127) and 254 (2^127) in the same matrix, tiny groups
 * 14 below large ones, all-zero groups with wild exponents, a code-0.5-only
 * group allowing a wider window. */
static void test_g32_extremes(void) {
  mm_qmat m;
  CHECK(mm_qmat_alloc(&m, 64, 256, 32, MM_SF_UE8M0) == 0);
  rand_codes(&m);
  mm_test_g32_extreme_scales(&m);
  /* an all-zero group with a far-away exponent must not matter */
  for (int k = 32; k < 64; k++) mm_fp4_set(m.codes + 5 * 128, (size_t)k, (k & 1) ? 8 : 0);
  m.scales[5 * 8 + 1] = 3;
  uint8_t *blob = mm_test_alloc(mm_sm90_matrix_bytes(MM_WMODE_G32_FP8, 64, 256));
  float rs[64];
  CHECK_OK(mm_sm90_pack_matrix(&m, MM_WMODE_G32_FP8, 0, blob, rs, NULL));
  check_compact_indices(blob, 64, 256);
  int bad;
  compare_all(&m, MM_WMODE_G32_FP8, 0, blob, rs, &bad);
  CHECK_EQ_INT(bad, 0);
  same_records_mode4(&m, 0, blob, rs);
  free(blob);
  mm_qmat_free(&m);
}

/* The row anchor (mode 1): rows whose groups all fold against one
 * reference exponent store reference 0 in every block and carry 2^R in the
 * row factor; rows that need per-block references, or whose row factor
 * times 2^R would not be exact, keep their blocks' references. */
static void test_g32_row_anchor(void) {
  const int rows = 64, cols = 512, KB = cols / 128;
  mm_qmat m;
  CHECK(mm_qmat_alloc(&m, rows, cols, 32, MM_SF_UE8M0) == 0);
  rand_codes(&m);
  for (int r = 0; r < rows; r++) {
    m.row_scale[r] = mm_test_uniform(0.5f, 2.0f);
    /* r % 4: 0, 3 one row within 6 binades; 1 block 2 sixty binades below
     * the others; 2 like 0, but the row factor times 2^R would overflow */
    const int base = r % 4 == 2 ? 200 : 80 + (int)(mm_test_rand_u64() % 140);
    if (r % 4 == 2) m.row_scale[r] = 3e38f;
    for (int g = 0; g < cols / 32; g++) {
      int b = base - (int)(mm_test_rand_u64() % 6);
      if (r % 4 == 1 && g / 4 == 2) b -= 60;
      m.scales[(size_t)r * (cols / 32) + g] = (uint8_t)b;
    }
  }
  uint8_t *blob = mm_test_alloc(mm_sm90_matrix_bytes(MM_WMODE_G32_FP8, rows, cols));
  float rs[64];
  CHECK_OK(mm_sm90_pack_matrix(&m, MM_WMODE_G32_FP8, 0, blob, rs, NULL));
  check_compact_indices(blob, m.rows, m.cols);
  int bad;
  compare_all(&m, MM_WMODE_G32_FP8, 0, blob, rs, &bad);
  CHECK_EQ_INT(bad, 0);
  int anchored = 0, kept = 0;
  for (int r = 0; r < rows; r++) {
    const int zero = refs_all_zero(blob, MM_WMODE_G32_FP8, KB, r);
    const int expect = r % 4 == 0 || r % 4 == 3;
    CHECK_EQ_INT(zero, expect);
    if (!expect) CHECK(rs[r] == m.row_scale[r]);
    anchored += zero;
    kept += !zero && rs[r] == m.row_scale[r];
  }
  printf("# %d rows anchored, %d with per-block references\n", anchored, kept);
  CHECK_EQ_INT(anchored + kept, rows);
  same_records_mode4(&m, 0, blob, rs);
  free(blob);
  mm_qmat_free(&m);
}

static void test_g32_refuses_unfoldable(void) {
  mm_qmat m;
  CHECK(mm_qmat_alloc(&m, 64, 128, 32, MM_SF_UE8M0) == 0);
  for (size_t i = 0; i < 64 * 64; i++) m.codes[i] = 0x73; /* codes 3 (1.5) and 7 (6) */
  for (size_t i = 0; i < 64 * 4; i++) m.scales[i] = 127;
  m.scales[17 * 4 + 2] = 127 - 16; /* 1.5 * 2^-16 relative: cannot fold */
  uint8_t *blob = mm_test_alloc(mm_sm90_matrix_bytes(MM_WMODE_G32_FP8, 64, 128));
  float rs[64];
  mm_err *e = mm_sm90_pack_matrix(&m, MM_WMODE_G32_FP8, 0, blob, rs, NULL);
  CHECK(e != NULL);
  if (e) {
    printf("# refused as expected: %s\n", e->message);
    CHECK(e->code == MEGAMOE_CODE_INVALID_ARGUMENT);
    CHECK(strstr(e->message, "row 17") != NULL);
    megamoe_error_destroy(e);
  }
  m.scales[17 * 4 + 2] = 0xFF; /* NaN scale */
  CHECK_ERR(mm_sm90_pack_matrix(&m, MM_WMODE_G32_FP8, 0, blob, rs, NULL),
            MEGAMOE_CODE_INVALID_ARGUMENT);
  /* wrong mode for the format */
  CHECK_ERR(mm_sm90_pack_matrix(&m, MM_WMODE_G16_BF16_EXACT, 0, blob, rs, NULL),
            MEGAMOE_CODE_INVALID_ARGUMENT);
  free(blob);
  mm_qmat_free(&m);
}

static void fill_g16(mm_qmat *m, int all_bytes) {
  rand_codes(m);
  for (size_t i = 0; i < (size_t)m->rows * (m->cols / 16); i++) {
    uint8_t b;
    do {
      b = all_bytes ? (uint8_t)mm_test_rand_u64() : (uint8_t)(0x28 + mm_test_rand_u64() % 0x28);
    } while (mm_e4m3_is_nan(b));
    m->scales[i] = b;
  }
  for (int r = 0; r < m->rows; r++) m->row_scale[r] = mm_test_uniform(1e-3f, 1e-2f);
}

static void test_g16_modes(void) {
  for (int all_bytes = 0; all_bytes < 2; all_bytes++)
    for (int gate_up = 0; gate_up < 2; gate_up++) {
      mm_qmat m;
      CHECK(mm_qmat_alloc(&m, 128, 384, 16, MM_SF_E4M3) == 0);
      fill_g16(&m, all_bytes);
      uint8_t *blob = mm_test_alloc(mm_sm90_matrix_bytes(MM_WMODE_G16_FP8, 128, 384));
      float rs[128];
      double fe[2];
      CHECK_OK(mm_sm90_pack_matrix(&m, MM_WMODE_G16_BF16_EXACT, gate_up, blob, rs, fe));
      int bad;
      compare_all(&m, MM_WMODE_G16_BF16_EXACT, gate_up, blob, rs, &bad);
      CHECK_EQ_INT(bad, 0);
      CHECK(fe[0] == 0.0);
      CHECK_OK(mm_sm90_pack_matrix(&m, MM_WMODE_G16_FP8, gate_up, blob, rs, fe));
      double rel = sqrt(fe[0] / fe[1]);
      printf("# mode 3 fold error (%s scales, gate_up %d): %.4f relative Frobenius\n",
             all_bytes ? "all E4M3" : "moderate", gate_up, rel);
      /* E4M3 keeps 4 significant bits: per-element error <= 2^-4 relative
       * unless the value underflows the window; Frobenius well under 5%. */
      CHECK(rel < 0.05);
      if (!all_bytes) {
        double worst = compare_all(&m, MM_WMODE_G16_FP8, gate_up, blob, rs, &bad);
        CHECK(worst <= 1.0 / 16.0 + 1e-9);
      }
      free(blob);
      mm_qmat_free(&m);
    }
}

/* Mode 3's row anchor (docs/LAYOUTS.md): a row takes one reference where
 * every weight folds to its block's own value. Every weight of the packed
 * matrix, anchored or not, must be E4M3_RNE(w / 2^r_b) * 2^r_b with r_b
 * its block's reference (the smallest r with max |s| * 6 <= 448 * 2^r),
 * computed here from the canonical weights. Rows (r % 4): 0 blocks of one
 * reference (the block maximum pinned) with subnormal and negative scales
 * among the others: anchored; 1 one block of subnormal scales beside
 * blocks at 448: its smallest weights would round differently against
 * the row's reference, so per-block references; 2 like 0 with a row factor
 * whose product with 2^R overflows: per-block; 3 random moderate scales,
 * which anchor unless a block's small weights would round differently. */
static void test_g16_row_anchor(void) {
  const int rows = 128, cols = 512, KB = cols / 128, G = cols / 16;
  mm_qmat m;
  CHECK(mm_qmat_alloc(&m, rows, cols, 16, MM_SF_E4M3) == 0);
  rand_codes(&m);
  for (int r = 0; r < rows; r++) {
    m.row_scale[r] = r % 4 == 2 ? 3e38f : mm_test_uniform(1e-3f, 1e-2f);
    for (int g = 0; g < G; g++) {
      uint8_t b;
      do {
        b = (uint8_t)(0x20 + mm_test_rand_u64() % 0x30);
      } while (mm_e4m3_is_nan(b));
      if (r % 4 != 3 && mm_test_rand_u64() % 8 == 0) b = (uint8_t)(1 + mm_test_rand_u64() % 7);
      if (r % 4 != 3 && g % 8 == 3) b = r % 4 == 2 ? 0x6A : 0x50; /* each block's largest: R = 1 or -3 */
      if (mm_test_rand_u64() % 5 == 0) b |= 0x80; /* negative scales flip codes */
      if (r % 4 == 1) b = (uint8_t)(g / 8 == 2 ? 1 + g % 7 : 0x7E);
      m.scales[(size_t)r * G + g] = b;
    }
    for (int i = 0; i < cols / 2; i++) /* magnitude 1 (0.5) in every group */
      if (i % 8 == 0) m.codes[(size_t)r * (cols / 2) + i] = 0x11;
  }
  uint8_t *blob = mm_test_alloc(mm_sm90_matrix_bytes(MM_WMODE_G16_FP8, rows, cols));
  float rs[128];
  double fe[2];
  CHECK_OK(mm_sm90_pack_matrix(&m, MM_WMODE_G16_FP8, 0, blob, rs, fe));
  int anchored[4] = {0, 0, 0, 0}, bad = 0;
  for (int r = 0; r < rows; r++) {
    const int zero = refs_all_zero(blob, MM_WMODE_G16_FP8, KB, r);
    const int R = row_anchor_of(rs[r], m.row_scale[r]);
    if (!zero) CHECK(rs[r] == m.row_scale[r]);
    anchored[r % 4] += zero;
    for (int kb = 0; kb < KB; kb++) {
      float smax = 0.0f;
      for (int g = 0; g < 8; g++) {
        int nz = 0;
        for (int k = (kb * 8 + g) * 16; k < (kb * 8 + g + 1) * 16; k++) nz |= mm_qmat_weight(&m, r, k) != 0.0f;
        const float a = fabsf(mm_qmat_group_scale(&m, r, kb * 8 + g));
        if (nz && a > smax) smax = a;
      }
      int rb = 0;
      if (smax > 0.0f)
        for (rb = -40; ldexpf(448.0f, rb) < smax * 6.0f; rb++) {
        }
      for (int k = kb * 128; k < kb * 128 + 128; k++) {
        const float w = mm_qmat_weight(&m, r, k);
        const float want = ldexpf(mm_e4m3_to_float(mm_float_to_e4m3(ldexpf(w, -rb))), rb);
        const float v = ldexpf(mm_sm90_weight(blob, MM_WMODE_G16_FP8, rows, cols, r, k), R);
        if (v != want && bad++ < 3) printf("# row %d k %d: %g, the block's fold %g\n", r, k, v, want);
      }
    }
  }
  printf("# rows anchored by class: %d %d %d %d of %d; fold error %.4f\n", anchored[0],
         anchored[1], anchored[2], anchored[3], rows / 4, sqrt(fe[0] / fe[1]));
  CHECK_EQ_INT(bad, 0);
  CHECK_EQ_INT(anchored[0], rows / 4);
  CHECK_EQ_INT(anchored[1], 0);
  CHECK_EQ_INT(anchored[2], 0);
  CHECK(anchored[3] > 0);
  free(blob);
  mm_qmat_free(&m);
}

/* Bit-level: the word of thread t holds exactly its A-fragment elements. */
static void test_slot_bijection(void) {
  for (int mode = 1; mode <= 4; mode++) {
    static uint8_t seen[4096 * 8];
    memset(seen, 0, sizeof(seen));
    int dup = 0, frag = 0;
    for (int lr = 0; lr < 64; lr++)
      for (int kk = 0; kk < 128; kk++) {
        int off, mb, sb;
        mm_sm90_code_slot((mm_weight_mode)mode, lr, kk, &off, &mb, &sb);
        for (int b = 0; b < 3; b++) dup += seen[off * 8 + mb + b]++ != 0;
        dup += seen[off * 8 + sb]++ != 0;
        /* owner thread: 16-byte chunk index within its 2048-byte half */
        int t = (off % 2048) / 16, w = t / 32, g = (t % 32) / 4, q = t % 4;
        int rowok = lr == 16 * w + g || lr == 16 * w + g + 8;
        /* modes 2 and 3: the fragment's columns are positions of their K
         * order (mode 4's records are mode 1's) */
        const int kp = mode == 4 ? kk : mm_sm90_kperm_pos((mm_weight_mode)mode, kk);
        int kq = mode == 2 ? (kp % 8) / 2 : (kp % 16) / 4;
        frag += !(rowok && kq == q);
      }
    CHECK_EQ_INT(dup, 0);
    CHECK_EQ_INT(frag, 0);
  }
}

/* mm_sm90_kperm of `mode` permutes the columns inside every 32-column
 * block, and src inverts pos. */
static void check_block_permutation(mm_weight_mode mode) {
  static int seen[1024];
  memset(seen, 0, sizeof seen);
  for (int k = 0; k < 1024; k++) {
    const int p = mm_sm90_kperm_pos(mode, k);
    CHECK(p / 32 == k / 32);
    seen[p]++;
    CHECK_EQ_INT(mm_sm90_kperm_src(mode, p), k);
  }
  for (int k = 0; k < 1024; k++) CHECK_EQ_INT(seen[k], 1);
}

/* Mode 4's K order, re-derived from the PTX register layouts: FP8 k32 A
 * fragment register R (rows: R % 2, columns 16 * (R / 2) + 4q + i, i = 0..3)
 * splits into F16 pairs i / 2 = t, which are register R of the k16 step t,
 * where the F16 A fragment puts column 8 * (R / 2) + 2q + (i % 2). The F16 B
 * operand must therefore hold, at position 16t + that column, FP8 column
 * 16 * (R / 2) + 4q + i. */
static void test_mode4_kperm(void) {
  int bad = 0;
  for (int R = 0; R < 4; R++)
    for (int q = 0; q < 4; q++)
      for (int i = 0; i < 4; i++) {
        const int fp8_col = 16 * (R / 2) + 4 * q + i;
        const int pos = 16 * (i / 2) + 8 * (R / 2) + 2 * q + (i % 2);
        for (int blk = 0; blk < 4 * 128; blk += 32) {
          bad += mm_sm90_kperm_src(MM_WMODE_G32_F16_EXACT, blk + pos) != blk + fp8_col;
          bad += mm_sm90_kperm_pos(MM_WMODE_G32_F16_EXACT, blk + fp8_col) != blk + pos;
        }
      }
  CHECK_EQ_INT(bad, 0);
  check_block_permutation(MM_WMODE_G32_F16_EXACT);
  /* the identity for mode 1 */
  for (int k = 0; k < 1024; k++) {
    CHECK_EQ_INT(mm_sm90_kperm_pos(MM_WMODE_G32_FP8, k), k);
    CHECK_EQ_INT(mm_sm90_kperm_src(MM_WMODE_G32_FP8, k), k);
  }
  /* the first pairs: columns 0, 1 stay, 2, 3 go to the second k16 step */
  CHECK_EQ_INT(mm_sm90_kperm_pos(MM_WMODE_G32_F16_EXACT, 2), 16);
  CHECK_EQ_INT(mm_sm90_kperm_pos(MM_WMODE_G32_F16_EXACT, 4), 2);
  CHECK_EQ_INT(mm_sm90_kperm_pos(MM_WMODE_G32_F16_EXACT, 16), 8);
}

/* Mode 2's K order from the F16 k16 A fragment: thread q's register pair
 * j of step t holds positions 16t + 8j + 2q + b (b: the F16 half). Every
 * half b must hold a column of the block's 16-group b (so one scale pair
 * serves every register of a row's k32 chunk), and the two columns of a
 * source byte (2i, 2i + 1) must land in one thread's word (same q, same
 * chunk), which the packers' gather tables rely on. */
static void test_mode2_kperm(void) {
  const mm_weight_mode m2 = MM_WMODE_G16_BF16_EXACT;
  int bad = 0;
  for (int t = 0; t < 2; t++)
    for (int j = 0; j < 2; j++)
      for (int q = 0; q < 4; q++)
        for (int b = 0; b < 2; b++) {
          const int pos = 16 * t + 8 * j + 2 * q + b, col = 16 * b + 4 * q + 2 * t + j;
          bad += col / 16 != b;
          for (int blk = 0; blk < 4 * 128; blk += 32) {
            bad += mm_sm90_kperm_src(m2, blk + pos) != blk + col;
            bad += mm_sm90_kperm_pos(m2, blk + col) != blk + pos;
          }
        }
  CHECK_EQ_INT(bad, 0);
  check_block_permutation(m2);
  for (int k = 0; k < 1024; k += 2) { /* a source byte: same thread (q = position bits 1-2) */
    const int p = mm_sm90_kperm_pos(m2, k), p1 = mm_sm90_kperm_pos(m2, k + 1);
    CHECK_EQ_INT((p / 2) % 4, (p1 / 2) % 4);
    CHECK_EQ_INT(p % 2, p1 % 2);
  }
  CHECK_EQ_INT(mm_sm90_kperm_pos(m2, 1), 8);  /* j = 1 */
  CHECK_EQ_INT(mm_sm90_kperm_pos(m2, 2), 16); /* t = 1 */
  CHECK_EQ_INT(mm_sm90_kperm_pos(m2, 16), 1); /* the second group: the high half */
}

/* Mode 3's K order from the FP8 k32 A fragment: thread q's code word of a
 * step holds positions 4q + b (low half) and 16 + 4q + b (high half). All
 * 8 columns of a word must be one 16-group's, so that the decode takes one
 * fold-table entry per word, and they must be the 8 consecutive columns
 * 8q .. 8q + 7 (the prefill path's decoder stores a word's 8 bytes at
 * once). Through the records: every word of a mode 3 record holds the
 * columns of one group. */
static void test_mode3_kperm(void) {
  const mm_weight_mode m3 = MM_WMODE_G16_FP8;
  int bad = 0;
  for (int h = 0; h < 2; h++)
    for (int q = 0; q < 4; q++)
      for (int b = 0; b < 4; b++)
        for (int blk = 0; blk < 4 * 128; blk += 32) {
          const int pos = 16 * h + 4 * q + b, col = mm_sm90_kperm_src(m3, blk + pos) - blk;
          bad += col != 8 * q + 4 * h + b;
          bad += col / 16 != q / 2;
          bad += mm_sm90_kperm_pos(m3, blk + col) != blk + pos;
        }
  CHECK_EQ_INT(bad, 0);
  check_block_permutation(m3);
  CHECK_EQ_INT(mm_sm90_kperm_pos(m3, 4), 16); /* column 4: thread 0's high half */
  CHECK_EQ_INT(mm_sm90_kperm_pos(m3, 8), 4);  /* column 8: thread 1 */
  static int group_of_word[MM_SM90_CODE_BYTES / 4];
  for (int i = 0; i < MM_SM90_CODE_BYTES / 4; i++) group_of_word[i] = -1;
  int mixed = 0;
  for (int lr = 0; lr < 64; lr++)
    for (int kk = 0; kk < 128; kk++) {
      int off, mb, sb;
      mm_sm90_code_slot(m3, lr, kk, &off, &mb, &sb);
      const int gi = 64 * lr + mm_sm90_group_of(m3, kk);
      if (group_of_word[off / 4] < 0) group_of_word[off / 4] = gi;
      mixed += group_of_word[off / 4] != gi;
    }
  CHECK_EQ_INT(mixed, 0);
}

/* compute.mode x gran-k -> weight mode (the cuda backend's choice), and the
 * mode properties the kernels and the workspace rely on. */
static void test_weight_mode_selection(void) {
  /* explicit modes ignore the bound; auto at the default 0.02 keeps the old
   * rule (the full rule: tests/test_mode_choice.c) */
  const double bounds[] = {1e-9, 1e-3, 0.02, 0.1, 1.0};
  for (int b = 0; b < 5; b++) {
    CHECK_EQ_INT(mm_cuda_weight_mode(32, MM_COMPUTE_FP8, bounds[b]), MM_WMODE_G32_FP8);
    CHECK_EQ_INT(mm_cuda_weight_mode(32, MM_COMPUTE_BF16_EXACT, bounds[b]), MM_WMODE_G32_F16_EXACT);
    CHECK_EQ_INT(mm_cuda_weight_mode(16, MM_COMPUTE_FP8, bounds[b]), MM_WMODE_G16_FP8);
    CHECK_EQ_INT(mm_cuda_weight_mode(16, MM_COMPUTE_BF16_EXACT, bounds[b]),
                 MM_WMODE_G16_BF16_EXACT);
  }
  CHECK_EQ_INT(mm_cuda_weight_mode(32, MM_COMPUTE_AUTO, 0.02), MM_WMODE_G32_FP8);
  CHECK_EQ_INT(mm_cuda_weight_mode(16, MM_COMPUTE_AUTO, 0.02), MM_WMODE_G16_BF16_EXACT);
  CHECK_EQ_INT(mm_cuda_weight_mode(32, MM_COMPUTE_AUTO, 1e-3), MM_WMODE_G32_F16_EXACT);
  CHECK_EQ_INT(mm_cuda_weight_mode(16, MM_COMPUTE_AUTO, 0.1), MM_WMODE_G16_FP8);
  const int f16[5] = {0, 0, 1, 0, 1}, groups[5] = {0, 4, 8, 8, 4}, ref[5] = {0, 1, 0, 1, 1};
  for (int mode = 1; mode <= 4; mode++) {
    CHECK_EQ_INT(mm_sm90_f16_mma((mm_weight_mode)mode), f16[mode]);
    CHECK_EQ_INT(mm_sm90_groups_per_row((mm_weight_mode)mode), groups[mode]);
    CHECK_EQ_INT(mm_sm90_has_ref((mm_weight_mode)mode), ref[mode]);
  }
  /* workspace: F16 intermediate in the exact modes, no copy of x */
  const int H = 6144, I = 2048, M = 1000, Mp = 1024;
  for (int mode = 1; mode <= 4; mode++) {
    mm_sm90_ws_plan w = mm_sm90_workspace_plan((mm_weight_mode)mode, H, I, M);
    CHECK_EQ_INT(w.Mp, Mp);
    CHECK(w.xs_t == 0 && w.act == (size_t)Mp * (H / 128) * 4);
    CHECK(w.as_t == w.act + (size_t)Mp * I * (f16[mode] ? 2 : 1));
    CHECK(w.bytes == w.as_t + (size_t)Mp * (I / 128) * 4);
  }
  CHECK_EQ_INT(mm_sm90_workspace_plan(MM_WMODE_G32_FP8, H, I, 0).Mp, 64);
  CHECK_EQ_INT(mm_sm90_workspace_plan(MM_WMODE_G32_FP8, H, I, 64).Mp, 64);
  CHECK_EQ_INT(mm_sm90_workspace_plan(MM_WMODE_G32_FP8, H, I, 65).Mp, 128);
  /* a gran-32 mode refuses gran-16 matrices and vice versa; unknown modes */
  mm_qmat m;
  CHECK(mm_qmat_alloc(&m, 64, 128, 16, MM_SF_E4M3) == 0);
  CHECK_ERR(mm_sm90_check_matrix(&m, MM_WMODE_G32_F16_EXACT, 0), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_OK(mm_sm90_check_matrix(&m, MM_WMODE_G16_BF16_EXACT, 0));
  CHECK_ERR(mm_sm90_check_matrix(&m, (mm_weight_mode)5, 0), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_sm90_check_matrix(&m, (mm_weight_mode)0, 0), MEGAMOE_CODE_INVALID_ARGUMENT);
  mm_qmat_free(&m);
  CHECK(mm_qmat_alloc(&m, 64, 128, 32, MM_SF_UE8M0) == 0);
  CHECK_OK(mm_sm90_check_matrix(&m, MM_WMODE_G32_F16_EXACT, 0));
  CHECK_ERR(mm_sm90_check_matrix(&m, MM_WMODE_G16_FP8, 0), MEGAMOE_CODE_INVALID_ARGUMENT);
  mm_qmat_free(&m);
}

/* The F16 bits of v, which must be representable (else a failed check). */
static uint16_t f16_bits(float v) {
  if (v == 0.0f) return signbit(v) ? 0x8000 : 0;
  const uint16_t sign = v < 0 ? 0x8000 : 0;
  const float a = fabsf(v);
  if (a < 0x1p-14f) { /* subnormal: a multiple of 2^-24 */
    const float m = a * 0x1p24f;
    CHECK(m == floorf(m) && m < 1024.0f);
    return (uint16_t)(sign | (uint16_t)m);
  }
  int e;
  const float f = frexpf(a, &e); /* a = 2f * 2^(e-1) */
  const float mant = (2.0f * f - 1.0f) * 1024.0f;
  CHECK(e - 1 <= 15 && mant == floorf(mant));
  return (uint16_t)(sign | (uint16_t)((e - 1 + 15) << 10) | (uint16_t)mant);
}

/* Mode 4's kernels turn each fold-table entry into the high byte of its F16
 * and make F16 pairs by placing those bytes over zero low bytes (and OR the
 * sign into them, as into the E4M3 bytes). That is exact for the entries
 * mode 1's records index (j = 0: e2m1 * 2^s, at most two significant bits):
 * each must be an F16 whose low byte is 0 and whose high byte, with the sign
 * bit set, is the F16 of the negated value. */
static void test_mode4_f16_high_bytes(void) {
  uint8_t table[MM_SM90_LUT_ENTRIES][8];
  mm_sm90_lut_table(table);
  int entries = 0;
  for (int k = MM_SM90_LUT_KMIN; k <= MM_SM90_LUT_KMAX; k++)
    for (int c = 0; c < 8; c++) {
      const uint8_t b = table[MM_SM90_LUT_INDEX(k, 0)][c];
      const float v = mm_e4m3_to_float(b), nv = mm_e4m3_to_float((uint8_t)(b | 0x80));
      const uint16_t h = f16_bits(v), nh = f16_bits(nv);
      CHECK_MSG((h & 0xFF) == 0, "shift %d magnitude %d: E4M3 0x%02X = %g has F16 0x%04X", k, c, b,
                (double)v, h);
      CHECK_EQ_INT(nh, (h | 0x8000) & 0xFFFF);
      entries++;
    }
  CHECK_EQ_INT(entries, (MM_SM90_LUT_KMAX - MM_SM90_LUT_KMIN + 1) * 8);
}

/* Mode 2's kernel decode (mm_sm90_dec_f16_pair) against the layout: for
 * every slot o and lane hh that mm_sm90_code_slot gives a weight, and every
 * value of that lane's 16 bits (the other lane a varying mix), the lane of
 * the decoded pair is the F16 of e2m1(code) * 2^-14, code read from the
 * slot's magnitude and sign bits; no other lane bits leak in. */
static void test_mode2_f16_pair_decode(void) {
  int sign_bit[4][2]; /* each slot's sign bit, from the layout (-1: no weight) */
  memset(sign_bit, -1, sizeof sign_bit);
  for (int lr = 0; lr < 64; lr++)
    for (int kk = 0; kk < 128; kk++) {
      int off, mb, sb;
      mm_sm90_code_slot(MM_WMODE_G16_BF16_EXACT, lr, kk, &off, &mb, &sb);
      const int hh = mb / 16, o = (mb % 16) / 3;
      CHECK(mb % 16 % 3 == 0 && o < 4 && sb / 16 == hh);
      CHECK(sign_bit[o][hh] < 0 || sign_bit[o][hh] == sb);
      sign_bit[o][hh] = sb;
    }
  int bad = 0;
  for (int o = 0; o < 4; o++)
    for (int hh = 0; hh < 2; hh++) {
      const int mb = 16 * hh + 3 * o, sb = sign_bit[o][hh];
      CHECK_MSG(sb >= 0, "slot %d lane %d holds no weight", o, hh);
      if (sb < 0) continue;
      for (uint32_t v = 0; v < 65536; v++) {
        const uint32_t other = (v * 40503u + 0x9E37u) & 0xFFFFu;
        const uint32_t w = hh ? (v << 16) | other : (other << 16) | v;
        const uint8_t code = (uint8_t)((((w >> sb) & 1) << 3) | ((w >> mb) & 7));
        const uint16_t want = f16_bits(mm_e2m1_to_float(code) * 0x1p-14f);
        const uint16_t got = (uint16_t)(mm_sm90_dec_f16_pair(w, o) >> (16 * hh));
        if (got != want && bad++ < 5)
          fprintf(stderr, "# slot %d lane %d word 0x%08X: 0x%04X, want 0x%04X\n", o, hh,
                  (unsigned)w, got, want);
      }
    }
  CHECK_EQ_INT(bad, 0);
}

/* The reference exponent's 2^ref at the edges of FP32: the CPU reference, the
 * CUDA-core kernel and the WGMMA kernels (pow2_exact) agree on these. */
static void test_pow2_edges(void) {
  CHECK(mm_sm90_pow2(0) == 1.0f);
  CHECK(mm_sm90_pow2(-126) == ldexpf(1.0f, -126));
  CHECK(mm_sm90_pow2(-127) == ldexpf(1.0f, -127)); /* subnormal */
  CHECK(mm_sm90_pow2(-149) == ldexpf(1.0f, -149));
  CHECK(mm_sm90_pow2(-150) == 0.0f);
  CHECK(mm_sm90_pow2(-400) == 0.0f);
  CHECK(mm_sm90_pow2(127) == ldexpf(1.0f, 127));
  CHECK(isinf(mm_sm90_pow2(128)) && mm_sm90_pow2(128) > 0.0f);
  CHECK(isinf(mm_sm90_pow2(300)) && mm_sm90_pow2(300) > 0.0f);
}

/* The 128+160 launch pair's split of an expert (mm_sm90_wide_count): its
 * first 160 a rows in 160-wide tiles, the rest in 128-wide ones. */
static void test_wide_split(void) {
  static const struct {
    int m, a;
  } k[] = {{0, 0},    {1, 0},    {64, 0},   {128, 0},  {129, 1},  {144, 1},   {160, 1},
           {161, 0},  {256, 0},  {257, 1},  {288, 1},  {289, 2},  {320, 2},   {321, 0},
           {384, 0},  {385, 1},  {416, 1},  {417, 2},  {448, 2},  {449, 3},   {480, 3},
           {481, 0},  {512, 0},  {513, 1},  {544, 1},  {545, 2},  {576, 2},   {577, 3},
           {608, 3},  {609, 0},  {1024, 0}, {1025, 1}, {1088, 2}, {1089, 0},  {16384, 0}};
  for (size_t i = 0; i < sizeof(k) / sizeof(k[0]); i++) {
    if (mm_sm90_wide_count(k[i].m) != k[i].a) fprintf(stderr, "# m = %d\n", k[i].m);
    CHECK_EQ_INT(mm_sm90_wide_count(k[i].m), k[i].a);
  }
  /* over a range: the two launches' tiles cover the expert, every tile
   * holds a row (a unit of none ends a kernel's walk), and the split is the
   * cheapest of a = 0..3 at 1.21 per 160-wide tile, taken only where it
   * saves MM_SM90_WIDE_SAVING percent of the 128-wide tiles' cost */
  for (int m = 1; m <= 20000; m++) {
    const int a = mm_sm90_wide_count(m), b = mm_sm90_narrow_count(m, a), n128 = (m + 127) / 128;
    int ok = a >= 0 && a <= 3 && 160 * a + 128 * b >= m;
    ok = ok && (a == 0 || m > 160 * (a - 1)) && (b == 0 || m - 160 * a - 128 * (b - 1) > 0);
    if (a == 0) {
      ok = ok && b == n128;
    } else {
      const int cost = 121 * a + 100 * b;
      ok = ok && 100 * cost <= (100 - MM_SM90_WIDE_SAVING) * 100 * n128;
      for (int x = 1; x <= 3; x++) {
        const int rest = m - 160 * x, bx = rest > 0 ? (rest + 127) / 128 : 0;
        ok = ok && 121 * x + 100 * bx >= cost;
      }
    }
    if (!ok) fprintf(stderr, "# m = %d: a = %d, b = %d\n", m, a, b);
    CHECK(ok);
    if (!ok) break;
  }
}

/* The WGMMA path's launch rule (mm_sm90_launch_rule): shapes the kernels
 * have at every average (16-wide tiles alone at two CTAs per SM; a pair's
 * second tile 128 after a 32- or 64-wide launch, 160 after a 128-wide one),
 * the FP8 modes alike, and docs/CONFIG.md's table of launch shapes equal to
 * the one the rule gives (printed here when it is not). */
static void launch_text(mm_sm90_launch s, char *buf, size_t n) {
  if (s.pair) snprintf(buf, n, "%d+%d", s.tile, s.pair);
  else if (s.ctas_per_sm == 2) snprintf(buf, n, "%d, two CTAs per SM", s.tile);
  else snprintf(buf, n, "%d", s.tile);
}
static void test_launch_rule(void) {
  static const mm_weight_mode k_modes[] = {MM_WMODE_G32_FP8, MM_WMODE_G16_BF16_EXACT,
                                           MM_WMODE_G16_FP8, MM_WMODE_G32_F16_EXACT};
  for (int avg = 0; avg <= 40000; avg++)
    for (int i = 0; i < 4; i++) {
      const mm_sm90_launch s = mm_sm90_launch_rule(k_modes[i], avg);
      const int ok = (s.tile == 16 && s.pair == 0) ||
                     (s.ctas_per_sm == 1 && ((s.tile == 32 && (s.pair == 0 || s.pair == 128)) ||
                                             (s.tile == 64 && (s.pair == 0 || s.pair == 128)) ||
                                             (s.tile == 128 && s.pair == 160)));
      CHECK_MSG(ok && (s.ctas_per_sm == 1 || s.ctas_per_sm == 2), "mode %d avg %d: %d+%d x%d",
                k_modes[i], avg, s.tile, s.pair, s.ctas_per_sm);
    }
  for (int avg = 0; avg <= 1000; avg++) {
    const mm_sm90_launch a = mm_sm90_launch_rule(MM_WMODE_G32_FP8, avg),
                         b = mm_sm90_launch_rule(MM_WMODE_G16_FP8, avg);
    CHECK_MSG(a.tile == b.tile && a.pair == b.pair && a.ctas_per_sm == b.ctas_per_sm,
              "modes 1 and 3 differ at %d", avg);
  }
  /* the table: one row per run of averages where no column changes, up to
   * the last change (then "from N") */
  char table[4096], cells[3][64], prev[3][64] = {"", "", ""};
  size_t len = (size_t)snprintf(table, sizeof table,
                                "| rows per local expert | modes 1 and 3 | mode 2 | mode 4 |\n"
                                "|---|---|---|---|\n");
  int first = 1;
  const int last = 2000;
  for (int avg = 1; avg <= last + 1; avg++) {
    launch_text(mm_sm90_launch_rule(MM_WMODE_G32_FP8, avg), cells[0], sizeof cells[0]);
    launch_text(mm_sm90_launch_rule(MM_WMODE_G16_BF16_EXACT, avg), cells[1], sizeof cells[1]);
    launch_text(mm_sm90_launch_rule(MM_WMODE_G32_F16_EXACT, avg), cells[2], sizeof cells[2]);
    const int same = avg > 1 && !strcmp(cells[0], prev[0]) && !strcmp(cells[1], prev[1]) &&
                     !strcmp(cells[2], prev[2]);
    if (avg > 1 && (!same || avg == last + 1)) {
      char range[32];
      if (avg == last + 1) snprintf(range, sizeof range, "from %d", first);
      else if (first == avg - 1) snprintf(range, sizeof range, "%d", first);
      else snprintf(range, sizeof range, "%d-%d", first, avg - 1);
      len += (size_t)snprintf(table + len, sizeof table - len, "| %s | %s | %s | %s |\n", range,
                              prev[0], prev[1], prev[2]);
    }
    if (!same) first = avg;
    memcpy(prev, cells, sizeof prev);
  }
  CHECK(len < sizeof table);
  /* the rule must be constant well before `last` */
  CHECK(strstr(table, "| from 113 |") != NULL);
  char path[1024];
  snprintf(path, sizeof path, "%s/docs/CONFIG.md", mm_test_srcdir());
  char *doc = mm_test_read_file(path);
  CHECK_MSG(doc != NULL, "cannot read %s", path);
  if (!doc) return;
  const int found = strstr(doc, table) != NULL;
  CHECK_MSG(found, "docs/CONFIG.md lacks the launch shapes' table; the rule's is:");
  if (!found) printf("%s", table);
  free(doc);
}

/* mm_sm90_prefill_task_kblocks: GLM-5's two launches on 132 SMs, the
 * bounds, and in between the fewest K blocks that give every decoder warp
 * at most one task's share of the expert's work. */
static void test_prefill_task_kblocks(void) {
  CHECK_EQ_INT(mm_sm90_prefill_task_kblocks(48, 64, 3 * 132), 8); /* L1: 384 tasks */
  CHECK_EQ_INT(mm_sm90_prefill_task_kblocks(16, 96, 3 * 132), 4); /* L2: 384 tasks */
  CHECK_EQ_INT(mm_sm90_prefill_task_kblocks(10, 20, 3 * 132), 2); /* small: the floor */
  CHECK_EQ_INT(mm_sm90_prefill_task_kblocks(48, 64, 9), 16);      /* 3 CTAs: the cap */
  CHECK_EQ_INT(mm_sm90_prefill_task_kblocks(48, 64, 0), 16);
  CHECK_EQ_INT(mm_sm90_prefill_task_kblocks(1, 1, 1), 2);
  int bad = 0;
  for (int kb = 1; kb <= 64; kb++)
    for (int rt = 1; rt <= 128; rt += 7)
      for (int d = 1; d <= 600; d += 13) {
        const int kt = mm_sm90_prefill_task_kblocks(kb, rt, d);
        const long work = (long)kb * rt;
        bad += kt < 2 || kt > MM_SM90_PREFILL_TASK_KB_MAX;
        if (kt > 2 && kt < MM_SM90_PREFILL_TASK_KB_MAX)
          bad += (long)kt * d < work || (long)(kt - 1) * d >= work;
      }
  CHECK_EQ_INT(bad, 0);
}

/* The prefill path's weight slots (mm_sm90_prefill_slot), in bytes of a
 * region for `chunk` experts: every expert's w13 and w2 lie inside the
 * region and apart from the same matrix of every other expert; what a
 * launch decodes ahead for the next one misses everything the running one
 * reads: the first ahead experts' w2 every w13 (an L1 launch runs), their
 * w13 every w2 (an L2 launch runs). With I x H = 1, a w13 slot is 2
 * bytes and a w2 slot 1. */
static int overlap(long a, long alen, long b, long blen) { return a < b + blen && b < a + alen; }
static void test_prefill_slots(void) {
  int bad = 0, ahead_w13 = 0;
  for (int chunk = 1; chunk <= MM_SM90_PREFILL_CHUNK; chunk++) {
    const long region = (long)mm_sm90_prefill_weight_bytes(16, 16, chunk) / 256;
    const int a2 = mm_sm90_prefill_ahead_max(2, chunk), a1 = mm_sm90_prefill_ahead_max(1, chunk);
    bad += a2 != MM_SM90_PREFILL_AHEAD_MAX || a1 > chunk;
    ahead_w13 += a1 > 0;
    for (int e = 0; e < chunk; e++) {
      const long w13 = 2L * mm_sm90_prefill_slot(1, e, chunk), w2 = mm_sm90_prefill_slot(2, e, chunk);
      bad += w13 < 0 || w13 + 2 > region || w2 < 0 || w2 + 1 > region;
      for (int f = 0; f < chunk; f++) {
        const long f13 = 2L * mm_sm90_prefill_slot(1, f, chunk), f2 = mm_sm90_prefill_slot(2, f, chunk);
        if (f != e) bad += overlap(w13, 2, f13, 2) + overlap(w2, 1, f2, 1);
        if (e < a2) bad += overlap(w2, 1, f13, 2);
        if (e < a1) bad += overlap(w13, 2, f2, 1);
      }
    }
  }
  CHECK_EQ_INT(bad, 0);
  CHECK_EQ_INT(ahead_w13, MM_SM90_PREFILL_CHUNK - 1); /* every chunk but 1 */
}

/* The prefill path's token-tile counts (mm_sm90_prefill_tile_count_bytes):
 * an L1 launch counts each token tile at the pool row it starts on, and an
 * overlapping L2 launch waits there, so every tile of every expert must
 * start on a row of its own inside the Mp counts the region holds; the
 * region is the weights, the launch counts and the tile counts. Random
 * pools of 0-40 experts (some empty) and 1-5000 rows. */
static void test_prefill_tile_counts(void) {
  int bad = 0;
  CHECK_EQ_INT(mm_sm90_rows_padded(0), 64);
  CHECK_EQ_INT(mm_sm90_rows_padded(64), 64);
  CHECK_EQ_INT(mm_sm90_rows_padded(65), 128);
  for (int r = 0; r < 300; r++) {
    const int M = 1 + (int)(mm_test_rand_u64() % 5000), E = (int)(mm_test_rand_u64() % 41);
    const int mp = mm_sm90_rows_padded(M);
    bad += mp < M || mp % 64 || mm_sm90_prefill_tile_count_bytes(M) < sizeof(int) * (size_t)mp;
    const int chunk = 1 + (int)(mm_test_rand_u64() % MM_SM90_PREFILL_CHUNK);
    /* the parts in order, 256-byte aligned, none overlapping the next */
    const mm_sm90_prefill_region rg = mm_sm90_prefill_region_layout(E > 0 ? E : 1, 256, 128, chunk, M);
    bad += rg.count != mm_sm90_prefill_weight_bytes(256, 128, chunk) || rg.count % 256 ||
           rg.tiles % 256 || rg.tiles - rg.count < mm_sm90_prefill_count_bytes(E > 0 ? E : 1, chunk) ||
           rg.bytes - rg.tiles < sizeof(int) * (size_t)mp;
    /* expert offsets: E + 1 sorted cuts of [0, M] */
    static int cut[42];
    static unsigned char used[5000];
    cut[0] = 0;
    cut[E] = M;
    for (int e = 1; e < E; e++) cut[e] = mm_test_rand_u64() % 4 ? (int)(mm_test_rand_u64() % (M + 1)) : cut[e - 1];
    for (int e = 1; e < E; e++)
      for (int f = e; f > 0 && cut[f] < cut[f - 1]; f--) {
        const int x = cut[f];
        cut[f] = cut[f - 1];
        cut[f - 1] = x;
      }
    memset(used, 0, sizeof(used));
    for (int e = 0; e < E; e++)
      for (int row0 = cut[e]; row0 < cut[e + 1]; row0 += 128) {
        bad += row0 < 0 || row0 >= mp || used[row0];
        used[row0] = 1;
      }
  }
  CHECK_EQ_INT(bad, 0);
}

/* The prefill path's work units (mm_sm90_prefill_unit): every pair of a
 * token tile and a column tile is computed by exactly one CTA of one unit
 * (a lost pair would drop tokens, a doubled one race on their output); a
 * full set's CTAs share the column tile they multicast and hold
 * consecutive token tiles; a split unit's CTAs share one of the expert's
 * last tiles (the last one alone, or with a small last tile the whole last
 * set); raster groups hold MM_SM90_PREFILL_RASTER_SETS sets, and an expert
 * of at most that many sets keeps the order of all its sets per column
 * tile. Without a small last tile the units are the old ones (only a last
 * set of one tile split). */
static void test_prefill_units(void) {
  static const int k_cs[] = {1, 2, 4};
  static const int k_nt[] = {1, 2, 3, 5, 9, 16, 48};
  static const int k_tiles[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 65, 257};
  const int g = MM_SM90_PREFILL_RASTER_SETS;
  int bad = 0;
  for (int small = 0; small < 2; small++)
    for (size_t a = 0; a < sizeof(k_cs) / sizeof(k_cs[0]); a++)
      for (size_t b = 0; b < sizeof(k_nt) / sizeof(k_nt[0]); b++)
        for (size_t c = 0; c < sizeof(k_tiles) / sizeof(k_tiles[0]); c++) {
          const int cs = k_cs[a], nt = k_nt[b], tiles = k_tiles[c], rem = tiles % cs;
          /* the trailing tiles split, by the rule's words */
          const int ns = cs == 1 || tiles == 0 ? 0 : rem == 1 ? 1 : small ? (rem ? rem : cs) : 0;
          const int sets = (tiles - ns) / cs;
          const int units = mm_sm90_prefill_units(tiles, cs, nt, small);
          int *count = mm_test_alloc(sizeof(int) * (size_t)(tiles ? tiles : 1) * (size_t)nt);
          bad += mm_sm90_prefill_split_tiles(tiles, cs, small) != ns;
          /* every pair has a slot; a split set adds at most one unit a tile */
          CHECK(units * cs >= tiles * nt && units <= (tiles + cs - 1) / cs * nt + ns);
          if (!small) /* the old count */
            bad += units != tiles / cs * nt + (rem == 0 ? 0 : rem == 1 ? (nt + cs - 1) / cs : nt);
          for (int v = 0; v < units; v++) {
            int mt0 = 0, ct0 = 0, split0 = 0;
            for (int r = 0; r < cs; r++) {
              int mt, ct, split;
              mm_sm90_prefill_unit(tiles, cs, nt, small, r, v, &mt, &ct, &split);
              if (r == 0) mt0 = mt, ct0 = ct, split0 = split;
              bad += mt < 0 || ct < 0 || split != split0;
              if (split)
                bad += mt < tiles - ns || mt >= tiles || mt != mt0 || ct != ct0 + r;
              else
                bad += ct != ct0 || mt != mt0 + r || mt >= (ns ? tiles - ns : tiles + cs);
              if (mt < tiles && ct < nt) count[mt * nt + ct]++;
              /* raster groups, and the old order where one group holds all */
              if (!split && v < sets * nt) {
                bad += mt / cs / g != v / (g * nt);
                if (sets <= g) bad += mt != cs * (v % sets) + r || ct != v / sets;
              }
            }
          }
          for (int i = 0; i < tiles * nt; i++)
            if (count[i] != 1) {
              fprintf(stderr, "# cs %d nt %d tiles %d small %d: pair (%d, %d) computed %d times\n",
                      cs, nt, tiles, small, i / nt, i % nt, count[i]);
              bad++;
            }
          free(count);
        }
  CHECK_EQ_INT(bad, 0);
  /* the shapes the kernels run: GLM-5's L1 (16 column tiles of 256) and L2
   * (48 of 128) in clusters of 2; 1024 rows per expert keep their order; an
   * expert of 16 tiles whose last is small splits its last two */
  CHECK_EQ_INT(mm_sm90_prefill_units(16, 2, 16, 0), 8 * 16);
  CHECK_EQ_INT(mm_sm90_prefill_units(16, 2, 16, 1), 7 * 16 + 2 * 8);
  CHECK_EQ_INT(mm_sm90_prefill_units(17, 2, 16, 0), 8 * 16 + 8);
  CHECK_EQ_INT(mm_sm90_prefill_units(17, 2, 16, 1), 8 * 16 + 8);
  CHECK_EQ_INT(mm_sm90_prefill_units(5, 2, 48, 1), 2 * 48 + 24);
}

static void test_gate_up_order(void) {
  const int I = 96 * 2, rows = 2 * I;
  for (int c = 0; c < I; c++) {
    CHECK_EQ_INT(mm_sm90_src_row(mm_sm90_gate_row(c), rows, 1), c);
    CHECK_EQ_INT(mm_sm90_src_row(mm_sm90_gate_row(c) + 8, rows, 1), I + c);
  }
}

int main(void) {
  mm_test_seed();
  RUN(test_pow2_edges);
  RUN(test_slot_bijection);
  RUN(test_gate_up_order);
  RUN(test_wide_split);
  RUN(test_launch_rule);
  RUN(test_prefill_units);
  RUN(test_prefill_task_kblocks);
  RUN(test_prefill_slots);
  RUN(test_prefill_tile_counts);
  RUN(test_mode4_kperm);
  RUN(test_mode2_kperm);
  RUN(test_mode2_f16_pair_decode);
  RUN(test_mode3_kperm);
  RUN(test_mode4_f16_high_bytes);
  RUN(test_weight_mode_selection);
  RUN(test_g32_exact_random);
  RUN(test_g32_extremes);
  RUN(test_g32_row_anchor);
  RUN(test_g32_refuses_unfoldable);
  RUN(test_g16_modes);
  RUN(test_g16_row_anchor);
  return mm_test_done();
}

/* qmat.h -- a quantized weight matrix in the canonical host layout: what the
 * load-time validation produces and what every layout transform (sm90 kernel
 * layout, DeepGEMM sm100 export) and the CPU reference consume.
 *
 *   W[r][k] = e2m1(code(r, k)) * group_scale(r, k / gran) * row_scale[r]
 *
 * codes  [rows, cols/2]    element 2j of a row in the low nibble of byte j
 * scales [rows, cols/gran] one byte per group: E4M3 (NVFP4) or UE8M0
 * row_scale [rows]         per-output-row FP32 factor: the NVFP4 global
 *                          `weight_scale_2` of the row's projection, else 1.
 */
#ifndef MM_QMAT_H
#define MM_QMAT_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"

typedef enum { MM_SF_E4M3 = 1, MM_SF_UE8M0 = 2 } mm_scale_format;

typedef struct mm_qmat {
  int rows, cols, gran;  /* cols % gran == 0; gran 16 or 32 */
  mm_scale_format sf;
  uint8_t *codes;        /* owned, [rows * cols / 2] */
  uint8_t *scales;       /* owned, [rows * cols / gran] */
  float *row_scale;      /* owned, [rows] */
} mm_qmat;

static inline float mm_qmat_group_scale(const mm_qmat *m, int r, int g) {
  uint8_t b = m->scales[(size_t)r * (size_t)(m->cols / m->gran) + (size_t)g];
  return m->sf == MM_SF_E4M3 ? mm_e4m3_to_float(b) : mm_ue8m0_to_float(b);
}

/* e2m1 * group scale (exact in FP32), without the row factor. */
static inline float mm_qmat_weight(const mm_qmat *m, int r, int k) {
  const uint8_t *row = m->codes + (size_t)r * (size_t)(m->cols / 2);
  return mm_e2m1_to_float(mm_fp4_get(row, (size_t)k)) * mm_qmat_group_scale(m, r, k / m->gran);
}

/* Allocates codes/scales/row_scale (row_scale set to 1). 0 on success. */
static inline int mm_qmat_alloc(mm_qmat *m, int rows, int cols, int gran, mm_scale_format sf) {
  m->rows = rows;
  m->cols = cols;
  m->gran = gran;
  m->sf = sf;
  m->codes = (uint8_t *)calloc((size_t)rows * (size_t)cols / 2 + 1, 1);
  m->scales = (uint8_t *)calloc((size_t)rows * (size_t)(cols / gran) + 1, 1);
  m->row_scale = (float *)malloc(sizeof(float) * ((size_t)rows + 1));
  if (!m->codes || !m->scales || !m->row_scale) return -1;
  for (int r = 0; r < rows; r++) m->row_scale[r] = 1.0f;
  return 0;
}

static inline void mm_qmat_free(mm_qmat *m) {
  free(m->codes);
  free(m->scales);
  free(m->row_scale);
  m->codes = m->scales = NULL;
  m->row_scale = NULL;
}

/* 1 when a and b hold the same shape, format and bytes. */
static inline int mm_qmat_equal(const mm_qmat *a, const mm_qmat *b) {
  return a->rows == b->rows && a->cols == b->cols && a->gran == b->gran && a->sf == b->sf &&
         !memcmp(a->codes, b->codes, (size_t)a->rows * (size_t)a->cols / 2) &&
         !memcmp(a->scales, b->scales, (size_t)a->rows * (size_t)(a->cols / a->gran)) &&
         !memcmp(a->row_scale, b->row_scale, sizeof(float) * (size_t)a->rows);
}

/* One expert: w13 = [gate rows 0..I-1 ; up rows I..2I-1] x hidden,
 * w2 = hidden x I. Both in the canonical layout above. */
typedef struct mm_expert_q {
  mm_qmat w13;
  mm_qmat w2;
} mm_expert_q;

/* Frees an array of experts and their matrices (NULL is fine). */
static inline void mm_experts_free(mm_expert_q *experts, int n) {
  if (!experts) return;
  for (int i = 0; i < n; i++) {
    mm_qmat_free(&experts[i].w13);
    mm_qmat_free(&experts[i].w2);
  }
  free(experts);
}

#endif

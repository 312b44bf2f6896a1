/* sm90_test_scales.h -- UE8M0 scale patterns shared by the sm90 layout tests
 * (the reference packer in test_layout_sm90, the fast one in test_sm90_pack).
 * Header-only; include after harness.h. */
#ifndef MM_SM90_TEST_SCALES_H
#define MM_SM90_TEST_SCALES_H

#include "qmat.h"

/* Extreme bytes for a [64, 256] gran-32 matrix: 0 (2^-127) and 254 (2^127)
 * in the same row, tiny groups 14 below large ones, neighbours 14 apart,
 * near-subnormal and ordinary rows. */
static inline void mm_test_g32_extreme_scales(mm_qmat *m) {
  for (int r = 0; r < 64; r++)
    for (int g = 0; g < 8; g++) {
      uint8_t b;
      switch (r % 4) {
        case 0: b = g < 4 ? (g == 0 ? 254 : 254 - 14) : (g == 4 ? 14 : 0); break;
        case 1: b = (uint8_t)(g % 2 ? 200 : 186); break;
        case 2: b = (uint8_t)(g % 4 == 0 ? 1 : 15); break;
        default: b = (uint8_t)(127 + (g % 3) * 5); break;
      }
      m->scales[(size_t)r * 8 + (size_t)g] = b;
    }
}

#endif

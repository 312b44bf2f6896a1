/* sm90_pack_data.h -- random canonical matrices for the sm90 packers'
 * tests (test_sm90_pack, gpu_test_pack_sm90): codes with all-zero groups
 * and rows, UE8M0 group-32 scales of every exponent with foldable and
 * unfoldable blocks and row anchors, E4M3 group-16 scales of every byte. */
#ifndef MM_SM90_PACK_DATA_H
#define MM_SM90_PACK_DATA_H

#include <string.h>

#include "formats.h"
#include "harness.h"
#include "qmat.h"

static uint8_t rand_e4m3_any(void) {
  for (;;) {
    uint8_t b = (uint8_t)mm_test_rand_u64();
    if (!mm_e4m3_is_nan(b)) return b;
  }
}

/* Random codes with some all-zero groups (+0 and -0 codes) and zero rows. */
static void rand_codes(mm_qmat *m) {
  size_t cb = (size_t)m->cols / 2;
  for (size_t i = 0; i < (size_t)m->rows * cb; i++) m->codes[i] = (uint8_t)mm_test_rand_u64();
  for (int r = 0; r < m->rows; r++) {
    uint64_t u = mm_test_rand_u64();
    if (u % 17 == 0) memset(m->codes + (size_t)r * cb, (u >> 8) % 2 ? 0x88 : 0, cb);
    for (int g = 0; g < m->cols / m->gran; g++) {
      uint64_t v = mm_test_rand_u64();
      uint8_t *p = m->codes + (size_t)r * cb + (size_t)g * (size_t)m->gran / 2;
      if (v % 9 == 0) memset(p, (int)((v >> 8) & 0x88), (size_t)m->gran / 2); /* zeros */
      else if (v % 13 == 0) memset(p, 0x11, (size_t)m->gran / 2);            /* only 0.5 */
      else if (v % 29 == 0) memset(p, 0x77, (size_t)m->gran / 2);            /* only 6 */
    }
  }
}

/* UE8M0 group-32 scales: per 128 columns a base exponent anywhere (0..254)
 * and groups up to `spread` below it (spread > 14 makes unfoldable blocks);
 * a third of the rows keep one base for all their blocks (mode 1's row
 * anchor), some of them with a row factor that 2^R would overflow. */
static void rand_g32(mm_qmat *m, int spread) {
  rand_codes(m);
  for (int r = 0; r < m->rows; r++) {
    const uint64_t ur = mm_test_rand_u64();
    m->row_scale[r] = ur % 7 == 0 ? 3e38f : mm_test_uniform(0.25f, 4.0f);
    const int row_base = ur % 3 == 0 ? 14 + (int)((ur >> 8) % 241) : -1;
    for (int kb = 0; kb < m->cols / 128; kb++) {
      uint64_t u = mm_test_rand_u64();
      int base = row_base >= 0 ? row_base
                 : u % 11 == 0 ? 254
                 : u % 13 == 0 ? (int)(u >> 8) % 15
                               : 14 + (int)((u >> 8) % 241);
      for (int g = 0; g < 4; g++) {
        int b = base - (int)(mm_test_rand_u64() % (uint64_t)(spread + 1));
        m->scales[(size_t)r * (size_t)(m->cols / 32) + (size_t)(kb * 4 + g)] =
            (uint8_t)(b < 0 ? 0 : b);
      }
    }
  }
}

/* E4M3 group-16 scales: any non-NaN byte (negative, subnormal, zero) or a
 * moderate range. */
static void rand_g16(mm_qmat *m, int all_bytes) {
  rand_codes(m);
  for (size_t i = 0; i < (size_t)m->rows * (size_t)(m->cols / 16); i++)
    m->scales[i] = all_bytes ? rand_e4m3_any() : (uint8_t)(0x28 + mm_test_rand_u64() % 0x28);
  for (int r = 0; r < m->rows; r++) m->row_scale[r] = mm_test_uniform(1e-3f, 1e-2f);
}

#endif

/* prep_lut.h -- the GPU requant of one group of 32, in its lookup-table form.
 * Compiles as CUDA (the kernel in prep.cu) and as C (tests/test_requant.c
 * checks it against plugin/requant.c on the CPU, so CI without a GPU still
 * covers the algorithm).
 *
 * Why a table: within a half-group (16 elements sharing one group-16 scale)
 * the requantized code depends only on the element's code, so the 7 non-zero
 * magnitudes are requantized once and the 16 elements are mapped with byte
 * permutes (4 per instruction). Every value is the one the per-element
 * reference computes: v = f32(f32(e2m1 * s16) * rs) is a function of the
 * magnitude (and sign, by the symmetry of round-to-nearest), and the group
 * maximum is the value of the largest magnitude (rounding is monotonic). */
#ifndef MM_PREP_LUT_H
#define MM_PREP_LUT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define MM_HD static __host__ __device__ __forceinline__
#define MM_UNROLL _Pragma("unroll")
#else
#define MM_HD static inline
#define MM_UNROLL
#endif

MM_HD float mm_lut_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
MM_HD uint32_t mm_lut_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
/* Round-to-nearest products (no contraction into FMA on the device). */
MM_HD float mm_lut_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MM_HD uint32_t mm_lut_byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, sel);
#else
  uint64_t x = ((uint64_t)b << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; i++) r |= (uint32_t)((x >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r; /* selectors here never use the sign-replicate bit */
#endif
}
MM_HD uint32_t mm_lut_vmaxu4(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __vmaxu4(a, b);
#else
  uint32_t r = 0;
  for (int i = 0; i < 4; i++) {
    uint32_t x = (a >> (8 * i)) & 0xFF, y = (b >> (8 * i)) & 0xFF;
    r |= (x > y ? x : y) << (8 * i);
  }
  return r;
#endif
}
MM_HD int mm_lut_popc(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __popc(x);
#else
  return __builtin_popcount(x);
#endif
}
MM_HD int mm_lut_rint(float x) {
#if defined(__CUDA_ARCH__)
  return __float2int_rn(x);
#else
  return (int)rintf(x); /* default rounding mode: to nearest, ties to even */
#endif
}

/* E2M1 magnitude m (0..7) as FP32 bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6. */
MM_HD float mm_lut_e2m1_mag(uint32_t m) {
  uint32_t e = m >> 1, f = m & 1u;
  return mm_lut_f32(m < 2u ? (m ? 0x3F000000u : 0u) : (((e + 126u) << 23) | (f << 22)));
}
MM_HD float mm_lut_e4m3(uint32_t b) {
  if ((b & 0x7Fu) == 0x7Fu) return mm_lut_f32(0x7FC00000u);
  uint32_t e = (b >> 3) & 15u, m = b & 7u;
  float v = e == 0 ? mm_lut_mul((float)m, 0.001953125f) /* m * 2^-9 */
                   : mm_lut_f32(((e + 120u) << 23) | (m << 20));
  return (b & 0x80u) ? -v : v;
}
MM_HD float mm_lut_ue8m0(uint32_t b) {
  if (b == 0xFFu) return mm_lut_f32(0x7FC00000u);
  return mm_lut_f32(b ? b << 23 : 0x00400000u); /* byte 0: 2^-127, subnormal */
}
/* E2M1 code magnitude of x in [0, 6], round to nearest, ties to even:
 * grid step 0.5 below 2, 1 below 4, 2 above (0.25 -> 0, 0.75 -> 1, 2.5 -> 2,
 * 3.5 -> 4, 5 -> 4). */
MM_HD uint32_t mm_lut_rne_mag(float x) {
  float s = x < 2.0f ? 2.0f : x < 4.0f ? 1.0f : 0.5f;
  int off = x < 2.0f ? 0 : x < 4.0f ? 2 : 4;
  return (uint32_t)(mm_lut_rint(mm_lut_mul(x, s)) + off);
}
/* UE8M0 byte of E, the smallest integer with amax / 2^E <= 6 (amax > 0). */
MM_HD uint32_t mm_lut_exp_byte(uint32_t amax_bits) {
  int ex = (int)((amax_bits >> 23) & 0xFFu);
  uint32_t man = amax_bits & 0x7FFFFFu;
  if (ex == 0) return 0;
  int b = man <= 0x400000u ? ex - 2 : ex - 1;
  return (uint32_t)(b < 0 ? 0 : b > 254 ? 254 : b);
}
/* Largest magnitude (0..7) among the 16 codes of w0, w1. */
MM_HD uint32_t mm_lut_max_mag(uint32_t w0, uint32_t w1) {
  uint32_t a = mm_lut_vmaxu4(w0 & 0x07070707u, (w0 >> 4) & 0x07070707u);
  uint32_t b = mm_lut_vmaxu4(w1 & 0x07070707u, (w1 >> 4) & 0x07070707u);
  a = mm_lut_vmaxu4(a, b);
  a = mm_lut_vmaxu4(a, a >> 16);
  a = mm_lut_vmaxu4(a, a >> 8);
  return a & 0xFFu;
}
/* Maps the 8 codes of w through the magnitude table (bytes m of lut_lo:lut_hi)
 * and restores the signs (flipped when scale and row factor differ in sign;
 * none on a zero result). */
MM_HD uint32_t mm_lut_map_word(uint32_t w, uint32_t lut_lo, uint32_t lut_hi, uint32_t flip) {
  uint32_t mags = w & 0x77777777u;
  uint32_t r0 = mm_lut_byte_perm(lut_lo, lut_hi, mags & 0xFFFFu);
  uint32_t r1 = mm_lut_byte_perm(lut_lo, lut_hi, mags >> 16);
  uint32_t x0 = (r0 | (r0 >> 4)) & 0x00FF00FFu, x1 = (r1 | (r1 >> 4)) & 0x00FF00FFu;
  uint32_t o = mm_lut_byte_perm(x0, x1, 0x6420u);
  uint32_t nz = ((o | (o >> 1) | (o >> 2)) << 3) & 0x88888888u;
  return o | (((w & 0x88888888u) ^ flip) & nz);
}

/* Requantizes one group of 32: codes w[4] (element 8k+i in nibble i of w[k]),
 * the two group-16 scale bytes in s2 (low byte first), row factor rs.
 * Returns the UE8M0 byte and fills out[4]; *bad = 1 (nothing written) when a
 * source value is not finite. With stats, st[0] += sum x^2, st[1] += sum
 * e^2, st[2] = max(st[2], |e|), all in units of 2^E (x = v / 2^E); in those
 * FP32 units an element 2^149 below the group's largest (the other half's
 * scale) underflows, and its error counts as 0 (the CPU's stats keep it). */
MM_HD uint32_t mm_lut_requant_group(const uint32_t w[4], uint32_t s2, int e4m3, float rs,
                                    uint32_t out[4], int want_stats, float st[3], int *bad) {
  float s16[2];
  s16[0] = e4m3 ? mm_lut_e4m3(s2 & 0xFFu) : mm_lut_ue8m0(s2 & 0xFFu);
  s16[1] = e4m3 ? mm_lut_e4m3((s2 >> 8) & 0xFFu) : mm_lut_ue8m0((s2 >> 8) & 0xFFu);
  const float ars = fabsf(rs);
  float amax = 0.0f;
  *bad = 0;
  MM_UNROLL
  for (int h = 0; h < 2; h++) {
    float m = mm_lut_mul(mm_lut_mul(mm_lut_e2m1_mag(mm_lut_max_mag(w[2 * h], w[2 * h + 1])),
                                    fabsf(s16[h])),
                         ars);
    *bad |= (mm_lut_bits(m) & 0x7F800000u) == 0x7F800000u;
    amax = m > amax ? m : amax;
  }
  if (*bad) return 0;
  const uint32_t b = amax == 0.0f ? 127u : mm_lut_exp_byte(mm_lut_bits(amax));
  const float inv = mm_lut_f32(b == 254u ? 0x00400000u : (254u - b) << 23); /* 2^(127-b) */
  MM_UNROLL
  for (int h = 0; h < 2; h++) {
    uint32_t lo = 0, hi = 0;
    float xm[8], em[8];
    MM_UNROLL
    for (int m = 1; m < 8; m++) {
      float v = mm_lut_mul(mm_lut_mul(mm_lut_e2m1_mag((uint32_t)m), s16[h]), rs);
      /* Magnitudes above the group's largest may overflow (6 * s16 * rs); no
       * element uses them, clamping keeps their table entry in range. */
      float x = fminf(fabsf(mm_lut_mul(v, inv)), 6.0f);
      uint32_t q = mm_lut_rne_mag(x);
      if (m < 4) lo |= q << (8 * m);
      else hi |= q << (8 * (m - 4));
      xm[m] = x;
      em[m] = x - mm_lut_e2m1_mag(q); /* exact: same grid */
    }
    uint32_t flip = (mm_lut_bits(s16[h]) ^ mm_lut_bits(rs)) & 0x80000000u ? 0x88888888u : 0u;
    out[2 * h] = mm_lut_map_word(w[2 * h], lo, hi, flip);
    out[2 * h + 1] = mm_lut_map_word(w[2 * h + 1], lo, hi, flip);
    if (want_stats) {
      /* Histogram of the 16 magnitudes, bit-sliced: flag bits 4i (w0) and 4i+1 (w1). */
      uint32_t b0 = (w[2 * h] & 0x11111111u) | ((w[2 * h + 1] & 0x11111111u) << 1);
      uint32_t b1 = ((w[2 * h] >> 1) & 0x11111111u) | (((w[2 * h + 1] >> 1) & 0x11111111u) << 1);
      uint32_t b2 = ((w[2 * h] >> 2) & 0x11111111u) | (((w[2 * h + 1] >> 2) & 0x11111111u) << 1);
      MM_UNROLL
      for (int m = 1; m < 8; m++) {
        uint32_t sel = ((m & 1) ? b0 : ~b0) & ((m & 2) ? b1 : ~b1) & ((m & 4) ? b2 : ~b2);
        int c = mm_lut_popc(sel);
        if (c) {
          st[0] += (float)c * xm[m] * xm[m];
          st[1] += (float)c * em[m] * em[m];
          st[2] = fabsf(em[m]) > st[2] ? fabsf(em[m]) : st[2];
        }
      }
    }
  }
  return b;
}

#endif

/* formats.h -- bit-level number formats: E2M1 (FP4), E4M3FN (FP8), UE8M0,
 * BF16, and the per-128-channel FP8 activation quantization. Plain C, the
 * reference every GPU kernel is compared against. */
#ifndef MM_FORMATS_H
#define MM_FORMATS_H

#include <stddef.h>
#include <stdint.h>

/* E2M1: bit 3 sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6. */
float mm_e2m1_to_float(uint8_t code);
/* Nearest E2M1 code to x (already divided by the group scale), ties to even,
 * |x| > 6 saturates to 6. A value rounding to zero magnitude gives code 0. */
uint8_t mm_float_to_e2m1(float x);
/* Element k of a packed row: element 2j in the low nibble of byte j. */
static inline uint8_t mm_fp4_get(const uint8_t *row, size_t k) {
  return (uint8_t)((row[k >> 1] >> ((k & 1) * 4)) & 0xF);
}
static inline void mm_fp4_set(uint8_t *row, size_t k, uint8_t code) {
  uint8_t shift = (uint8_t)((k & 1) * 4);
  row[k >> 1] = (uint8_t)((row[k >> 1] & ~(0xF << shift)) | ((code & 0xF) << shift));
}

/* E4M3FN: bias 7, no infinity, 0x7F / 0xFF are NaN, max 448. */
float mm_e4m3_to_float(uint8_t b);
/* Round to nearest even, saturating to +-448; NaN -> 0x7F (as cvt.rn.satfinite). */
uint8_t mm_float_to_e4m3(float x);
/* Also device code: the packing steps (layout_sm90_pack_rules.h) test
 * scale bytes with it on the GPU. */
#if defined(__CUDACC__)
__host__ __device__
#endif
static inline int mm_e4m3_is_nan(uint8_t b) { return (b & 0x7F) == 0x7F; }

/* UE8M0: 2^(b-127); 0xFF is NaN. */
float mm_ue8m0_to_float(uint8_t b);

/* BF16, round to nearest even (NaN stays NaN). */
uint16_t mm_float_to_bf16(float x);
float mm_bf16_to_float(uint16_t h);
static inline float mm_round_bf16(float x) { return mm_bf16_to_float(mm_float_to_bf16(x)); }

/* SwiGLU input clamp (model.activation-clamp c > 0): gate to (-inf, c], up
 * to [-c, c]. A NaN stays NaN: fminf/fmaxf return the bound for a NaN and
 * would make a NaN token, defined to give a NaN output row
 * (docs/RELIABILITY.md), finite. Equal to fminf(g, c) and
 * fminf(fmaxf(u, -c), c) for every other input. Shared by the reference and
 * the kernels. */
#ifdef __CUDACC__
#define MM_HOST_DEVICE __host__ __device__
#else
#define MM_HOST_DEVICE
#endif
static inline MM_HOST_DEVICE float mm_clamp_gate(float g, float c) { return g > c ? c : g; }
static inline MM_HOST_DEVICE float mm_clamp_up(float u, float c) {
  return u > c ? c : u < -c ? -c : u;
}

/* FP8 activation quantization of one block of n (<= 128) channels, DeepGEMM's
 * rule: amax = max(max|x|, 1e-4); q = e4m3(x * (448 / amax)); scale = amax / 448.
 * Dequantized value: e4m3(q) * scale. */
#define MM_ACT_BLOCK 128
#define MM_ACT_AMAX_MIN 1e-4f
void mm_quant_fp8_block(const float *x, size_t n, uint8_t *q, float *scale);

/* x * 2^e for integer e, exact when representable (ldexpf). */
float mm_pow2f(int e);

#endif

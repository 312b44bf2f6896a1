/* formats.c -- scalar codecs for the narrow number formats. */
#include "formats.h"

#include <math.h>
#include <string.h>

static const float kE2M1Magnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

float mm_e2m1_to_float(uint8_t code) {
  float m = kE2M1Magnitude[code & 7];
  return (code & 8) ? -m : m;
}

uint8_t mm_float_to_e2m1(float x) {
  float m = fabsf(x);
  uint8_t c;
  /* Midpoints between neighbours; a tie goes to the even code. */
  if (m <= 0.25f) c = 0;
  else if (m < 0.75f) c = 1;
  else if (m <= 1.25f) c = 2;
  else if (m < 1.75f) c = 3;
  else if (m <= 2.5f) c = 4;
  else if (m < 3.5f) c = 5;
  else if (m <= 5.0f) c = 6;
  else c = 7;
  if (c != 0 && signbit(x)) c |= 8;
  return c;
}

float mm_pow2f(int e) { return ldexpf(1.0f, e); }

float mm_e4m3_to_float(uint8_t b) {
  if (mm_e4m3_is_nan(b)) return NAN;
  int e = (b >> 3) & 0xF, m = b & 7;
  float v = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
  return (b & 0x80) ? -v : v;
}

uint8_t mm_float_to_e4m3(float x) {
  if (isnan(x)) return 0x7F;
  uint8_t sign = signbit(x) ? 0x80 : 0;
  float m = fabsf(x);
  if (m >= 448.0f) return sign | 0x7E;
  int e;
  frexpf(m, &e); /* m = f * 2^e, f in [0.5, 1) -> unbiased exponent e-1 */
  int ue = e - 1;
  if (m == 0.0f || ue < -6) ue = -6; /* subnormal range shares the 2^-9 step */
  float step = ldexpf(1.0f, ue - 3);
  float q = rintf(m / step) * step; /* exact division by a power of two; RNE */
  if (q >= 448.0f) return sign | 0x7E;
  if (q == 0.0f) return sign;
  int qe;
  frexpf(q, &qe);
  int uq = qe - 1;
  if (uq < -6) return sign | (uint8_t)(q / ldexpf(1.0f, -9)); /* subnormal */
  int mant = (int)(q / ldexpf(1.0f, uq - 3)) - 8;
  return sign | (uint8_t)(((uq + 7) << 3) | mant);
}

float mm_ue8m0_to_float(uint8_t b) {
  if (b == 0xFF) return NAN;
  return ldexpf(1.0f, (int)b - 127);
}

uint16_t mm_float_to_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

float mm_bf16_to_float(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float x;
  memcpy(&x, &u, 4);
  return x;
}

void mm_quant_fp8_block(const float *x, size_t n, uint8_t *q, float *scale) {
  float amax = 0.0f;
  for (size_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
  amax = fmaxf(amax, MM_ACT_AMAX_MIN);
  float inv = 448.0f / amax;
  for (size_t i = 0; i < n; i++) q[i] = mm_float_to_e4m3(x[i] * inv);
  *scale = amax / 448.0f;
}

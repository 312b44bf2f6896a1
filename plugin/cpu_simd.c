/* cpu_simd.c -- the choice between the AVX2 and the baseline builds. */
#include "cpu_simd.h"

#include <stdlib.h>

/* -1: by the CPU; 0: baseline; 1: AVX2 where the CPU has it; -2: not read
 * yet. Threads that get to the first read at once each store the same
 * value. */
static _Atomic int g_mode = -2;

int mm_cpu_simd_set(int mode) {
  g_mode = mode < 0 ? -1 : mode > 0;
  return mm_cpu_avx2();
}

int mm_cpu_avx2(void) {
#if MM_HAVE_AVX2_CLONES
  if (g_mode == -2) {
    const char *v = getenv("MEGAMOE_CPU_SIMD");
    g_mode = v && v[0] == '0' && !v[1] ? 0 : -1;
  }
  return g_mode != 0 && __builtin_cpu_supports("avx2");
#else
  return 0;
#endif
}

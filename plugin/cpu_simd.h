/* cpu_simd.h -- which build of the host's hot loops runs. The CPU
 * reference's dot products are compiled twice from one body, for AVX2 and
 * for the baseline ISA, and the CPU picks at run time. Both builds do the
 * same operations on the same values in the same order (their products are
 * exact, so FMA or not), so they give the same bits (test_ref_moe). The
 * group16 -> group32 requant was tried the same way and ran no faster
 * (docs/PERF.md, "CPU reference backend"). */
#ifndef MM_CPU_SIMD_H
#define MM_CPU_SIMD_H

#if defined(__x86_64__) && defined(__GNUC__)
#define MM_HAVE_AVX2_CLONES 1
/* A body inlined into both builds, so each is compiled for its ISA. */
#define MM_ALWAYS_INLINE __attribute__((always_inline))
#define MM_TARGET_AVX2 __attribute__((target("avx2")))
#else
#define MM_HAVE_AVX2_CLONES 0
#define MM_ALWAYS_INLINE
#define MM_TARGET_AVX2
#endif

/* 1 when the AVX2 builds run: the CPU has AVX2 and neither
 * MEGAMOE_CPU_SIMD=0 (read at first use; docs/CONFIG.md) nor
 * mm_cpu_simd_set(0) asked for the baseline. */
int mm_cpu_avx2(void);

/* For tests and comparisons: -1 by the CPU (the default), 0 the baseline
 * builds, 1 AVX2 where the CPU has it. Returns mm_cpu_avx2(). */
int mm_cpu_simd_set(int mode);

#endif

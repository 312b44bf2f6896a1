/* cuda_arch.h -- whether the SM targets the kernels were compiled for
 * (configure --with-cuda-arch, MM_CUDA_ARCHS: "90a", "90a,100a", ...) run on
 * a device of a given compute capability. Pure, so CPU tests check it. */
#ifndef MM_CUDA_ARCH_H
#define MM_CUDA_ARCH_H

/* 1 when one of the comma-separated targets in `archs` runs on compute
 * capability major.minor: an arch-specific target ("90a") on exactly that
 * capability, a plain or family one ("90", "100f") on the same major and a
 * minor at least its own. 0 otherwise, and for a list it cannot read. */
int mm_cuda_archs_run_on(const char *archs, int major, int minor);

#endif

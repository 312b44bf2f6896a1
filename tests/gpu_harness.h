/* gpu_harness.h -- what GPU tests add to harness.h: a CUDA call check that
 * fails the current case and returns, and the no-GPU skip. */
#ifndef MM_TEST_GPU_HARNESS_H
#define MM_TEST_GPU_HARNESS_H

#include <cuda_runtime.h>

#include "harness.h"

#define CUDA_OK(x)                                                                  \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      printf("# %s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      mm_test_case_failed_ = 1;                                                     \
      return;                                                                       \
    }                                                                               \
  } while (0)

/* 1 when at least one CUDA device is usable. */
static inline int mm_test_have_gpu(void) {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#endif

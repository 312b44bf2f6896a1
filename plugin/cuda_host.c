/* cuda_host.c -- the few CUDA runtime calls the op itself makes (staging
 * device tensors to the host at load time). Built only with CUDA. */
#include <cuda_runtime.h>

#include "backend.h"

mm_err *mm_cuda_copy_to_host(void *dst, const void *src, size_t bytes, int device) {
  int prev = 0;
  cudaGetDevice(&prev);
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
  cudaSetDevice(prev);
  if (e != cudaSuccess)
    return mm_error(MEGAMOE_CODE_INTERNAL, "copying %zu bytes from device %d: %s", bytes, device,
                    cudaGetErrorString(e));
  return NULL;
}

// ep_combine.cu -- expert-parallel combine side: pool output rows into the
// per-source combine segments, and the final weighted sum at the source
// (FP32, ascending k, then BF16: the same order as plugin/ref_moe.c, so the
// result does not depend on the rank count).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "ep_kernels.h"

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) gather_kernel(mm_ep_dev d, int64_t rows) {
  const int H = d.hidden;
  int64_t n = d.expert_off[d.experts_per_rank];
  if (n > d.pool_cap) n = d.pool_cap;
  if (n > rows) n = rows;
  for (int64_t p = blockIdx.x; p < n; p += gridDim.x) {
    const uint4 *src = reinterpret_cast<const uint4 *>(d.pool_out + p * H);
    uint4 *dst = reinterpret_cast<uint4 *>(d.csend + (int64_t)d.pool_to_cs[p] * H);
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x) dst[c] = src[c];
  }
}

__device__ __forceinline__ void add_bf16x8(float *acc, uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    acc[2 * i] += __uint_as_float(w[i] << 16);
    acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
  }
}

__global__ void __launch_bounds__(kThreads) combine_kernel(mm_ep_dev d, int T, const int32_t *ids,
                                                           __nv_bfloat16 *out) {
  __shared__ int64_t src_row[64];
  const int K = d.top_k, H = d.hidden, per = d.experts_per_rank, R = d.ranks;
  const int64_t *s_cr = d.seg + MM_EP_SEG_CRECV * (R + 1);
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    __syncthreads(); // src_row of the previous token is no longer read
    if (threadIdx.x < K) {
      const int64_t p = (int64_t)t * K + threadIdx.x;
      const int slot = d.pair_slot[p];
      src_row[threadIdx.x] = slot < 0 ? -1 : s_cr[ids[p] / per] + slot;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int j = 0; j < K; j++) {
        const int64_t r = src_row[j];
        if (r < 0) continue;
        add_bf16x8(acc, reinterpret_cast<const uint4 *>(d.crecv + r * H)[c]);
      }
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; i++) {
        __nv_bfloat162 b = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
        w[i] = *reinterpret_cast<uint32_t *>(&b);
      }
      reinterpret_cast<uint4 *>(out + (int64_t)t * H)[c] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

inline int grid_for(int64_t rows, int64_t cap) { return (int)(rows < cap ? rows : cap); }

} // namespace

extern "C" int mm_ep_launch_gather(const mm_ep_dev *d, int64_t grid_rows, void *stream) {
  if (grid_rows <= 0) return 0;
  gather_kernel<<<grid_for(grid_rows, 4096), kThreads, 0, (cudaStream_t)stream>>>(*d, grid_rows);
  return (int)cudaGetLastError();
}

extern "C" int mm_ep_launch_combine(const mm_ep_dev *d, int T, const int32_t *ids, uint16_t *out,
                                    void *stream) {
  if (T <= 0) return 0;
  combine_kernel<<<grid_for(T, 8192), kThreads, 0, (cudaStream_t)stream>>>(
      *d, T, ids, reinterpret_cast<__nv_bfloat16 *>(out));
  return (int)cudaGetLastError();
}

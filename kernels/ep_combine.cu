// ep_combine.cu -- expert-parallel combine side: the final weighted sum at
// the source (FP32, ascending k, then BF16: the same order as
// plugin/ref_moe.c, so the result does not depend on the rank count). The
// expert compute writes its rows straight into the per-source combine
// segments (mm_expert_pool.out_rows), so no gather pass runs before the
// exchange.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "ep_kernels.h"
#include "moe_compute.h"

namespace {

constexpr int kThreads = 256;

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

// Stand-in expert (tests, bench): out[out_rows[p]] = BF16(dequant(x[p]) *
// w[p] * m(e)), m(e) = 1 + (global expert id mod 16), all FP32 in that order.
__global__ void __launch_bounds__(kThreads) identity_kernel(mm_expert_pool P, int E_loc, int first,
                                                            int H, int64_t rows) {
  __shared__ int off[MM_EP_MAX_EXPERTS_IDENTITY + 1];
  for (int e = threadIdx.x; e <= E_loc; e += blockDim.x) off[e] = P.expert_offsets[e];
  __syncthreads();
  const int64_t n = off[E_loc] < rows ? off[E_loc] : rows;
  for (int64_t p = blockIdx.x; p < n; p += gridDim.x) {
    int e = 0;
    while (e + 1 < E_loc && off[e + 1] <= p) e++;
    const float m = (float)(1 + ((first + e) & 15));
    const float w = P.row_weight[p];
    const int64_t o = P.out_rows ? P.out_rows[p] : p; /* moe_compute.h */
    if (o < 0 || o >= P.num_rows_max) continue;
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
      __nv_fp8_e4m3 q;
      q.__x = P.x[p * H + c];
      const float v = __fmul_rn(__fmul_rn(__fmul_rn((float)q, P.x_scale[p * (H / 128) + c / 128]), w), m);
      P.out[o * H + c] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
    }
  }
}

inline int grid_for(int64_t rows, int64_t cap) { return (int)(rows < cap ? rows : cap); }

} // namespace

extern "C" int mm_ep_launch_identity_compute(const mm_expert_pool *pool, int num_local,
                                             int first_expert, int hidden, void *stream) {
  if (pool->num_rows_max <= 0) return 0;
  if (num_local > MM_EP_MAX_EXPERTS_IDENTITY) return (int)cudaErrorInvalidValue;
  identity_kernel<<<grid_for(pool->num_rows_max, 4096), kThreads, 0, (cudaStream_t)stream>>>(
      *pool, num_local, first_expert, hidden, pool->num_rows_max);
  return (int)cudaGetLastError();
}

extern "C" int mm_ep_launch_combine(const mm_ep_dev *d, int T, const int32_t *ids, uint16_t *out,
                                    void *stream) {
  if (T <= 0) return 0;
  combine_kernel<<<grid_for(T, 8192), kThreads, 0, (cudaStream_t)stream>>>(
      *d, T, ids, reinterpret_cast<__nv_bfloat16 *>(out));
  return (int)cudaGetLastError();
}

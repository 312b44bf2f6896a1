// prep.cu -- GPU weight preparation: group16 -> group32 requant, scale NaN
// scan, DeepGEMM sm100 layout export. Byte-identical to the C references in
// plugin/requant.c and plugin/layout_sm100.c: every value is produced by the
// same IEEE single-precision operations (products of exact values, one
// rounded multiply by the global, exact power-of-two scaling), no FMA, no
// flush-to-zero (the build does not use fast math).
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "status.h"
}
#include "prep.h"
#include "prep_lut.h"

#define MM_CUDA_TRY(call, what)                                                          \
  do {                                                                                   \
    cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess)                                                               \
      return mm_error(MEGAMOE_CODE_INTERNAL, "%s: %s (%s)", what, cudaGetErrorString(e_), \
                      cudaGetErrorName(e_));                                             \
  } while (0)

namespace {

constexpr int kRequantThreads = 256;  // 8 rows (warps) per block

// ---- number formats (device twins of plugin/formats.c, requant.h) ----------

__device__ __forceinline__ float e2m1_value(uint32_t c) {
  uint32_t i = c & 7u, e = i >> 1, m = i & 1u;
  uint32_t bits = i < 2u ? (i ? 0x3F000000u : 0u) : (((e + 126u) << 23) | (m << 22));
  return __uint_as_float(bits | ((c & 8u) << 28));
}

__device__ __forceinline__ float e4m3_value(uint32_t b) {
  if ((b & 0x7Fu) == 0x7Fu) return __uint_as_float(0x7FC00000u);
  uint32_t e = (b >> 3) & 15u, m = b & 7u;
  float v = e == 0 ? __fmul_rn((float)m, 0.001953125f)  // m * 2^-9, exact
                   : __uint_as_float(((e + 120u) << 23) | (m << 20));
  return (b & 0x80u) ? -v : v;
}

__device__ __forceinline__ float ue8m0_value(uint32_t b) {
  if (b == 0xFFu) return __uint_as_float(0x7FC00000u);
  return __uint_as_float(b ? b << 23 : 0x00400000u);  // byte 0: 2^-127 (subnormal)
}

// UE8M0 byte of E, E the smallest integer with amax / 2^E <= 6 (amax > 0).
__device__ __forceinline__ uint32_t exp_byte(uint32_t amax_bits) {
  int ex = (int)((amax_bits >> 23) & 0xFFu);
  uint32_t man = amax_bits & 0x7FFFFFu;
  if (ex == 0) return 0;
  int b = man <= 0x400000u ? ex - 2 : ex - 1;
  return (uint32_t)(b < 0 ? 0 : b > 254 ? 254 : b);
}

__device__ __forceinline__ uint32_t e2m1_rne(float x) {
  float m = fabsf(x);
  uint32_t c = (uint32_t)(m > 0.25f) + (uint32_t)(m >= 0.75f) + (uint32_t)(m > 1.25f) +
               (uint32_t)(m >= 1.75f) + (uint32_t)(m > 2.5f) + (uint32_t)(m >= 3.5f) +
               (uint32_t)(m > 5.0f);
  return (c != 0 && x < 0.0f) ? (c | 8u) : c;
}

// ---- requant ------------------------------------------------------------------

// The reference variant: every element on its own (same formula as the CPU).
// Same contract as mm_lut_requant_group (prep_lut.h).
template <bool kE4M3, bool kStats>
__device__ __forceinline__ uint32_t simple_group(const uint32_t w[4], uint32_t s2, float rs,
                                                 uint32_t o[4], float st[3], int *bad) {
  float s16[2];
  s16[0] = kE4M3 ? e4m3_value(s2 & 0xFFu) : ue8m0_value(s2 & 0xFFu);
  s16[1] = kE4M3 ? e4m3_value((s2 >> 8) & 0xFFu) : ue8m0_value((s2 >> 8) & 0xFFu);
  // Group maximum and finiteness from the largest magnitude of each half
  // (rounding is monotonic), then one pass over the elements.
  const float ars = fabsf(rs);
  float amax = 0.0f;
  *bad = 0;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    float m = __fmul_rn(__fmul_rn(mm_lut_e2m1_mag(mm_lut_max_mag(w[2 * h], w[2 * h + 1])),
                                  fabsf(s16[h])),
                        ars);
    *bad |= (__float_as_uint(m) & 0x7F800000u) == 0x7F800000u;
    amax = fmaxf(amax, m);
  }
  if (*bad) return 0;
  const uint32_t b = amax == 0.0f ? 127u : exp_byte(__float_as_uint(amax));
  const float inv = __uint_as_float(b == 254u ? 0x00400000u : (254u - b) << 23);  // 2^(127-b)
  // One 8-element word at a time (keeps register pressure low).
#pragma unroll 1
  for (int k = 0; k < 4; k++) {
    const uint32_t wk = k == 0 ? w[0] : k == 1 ? w[1] : k == 2 ? w[2] : w[3];
    const float sk = k < 2 ? s16[0] : s16[1];
    uint32_t ok = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
      const uint32_t c = (wk >> (4 * i)) & 0xFu;
      const float v = __fmul_rn(__fmul_rn(e2m1_value(c), sk), rs);
      const float x = __fmul_rn(v, inv);
      const uint32_t oc = e2m1_rne(x);
      ok |= oc << (4 * i);
      if (kStats) {
        const float e = __fsub_rn(fabsf(x), mm_lut_e2m1_mag(oc & 7u));  // exact: same grid
        st[0] = __fmaf_rn(x, x, st[0]);
        st[1] = __fmaf_rn(e, e, st[1]);
        st[2] = fmaxf(st[2], fabsf(e));
      }
    }
    if (k == 0) o[0] = ok;
    else if (k == 1) o[1] = ok;
    else if (k == 2) o[2] = ok;
    else o[3] = ok;
  }
  return b;
}

// One warp per row: lane l handles groups l, l + 32, ... in order (the next
// group's bytes are loaded before the current one is computed), then a fixed
// shuffle tree reduces the row statistics (deterministic). kLut picks the
// lookup-table group routine (prep_lut.h) or the per-element one.
template <bool kE4M3, bool kStats, bool kLut>
__global__ void __launch_bounds__(kRequantThreads)
    requant_kernel(int rows, int cols, const uint8_t *__restrict__ codes,
                   const uint8_t *__restrict__ scales, const float *__restrict__ row_scale,
                   uint8_t *__restrict__ codes_out, uint8_t *__restrict__ scales_out,
                   double *__restrict__ row_stats, uint32_t *__restrict__ status) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * (kRequantThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int groups = cols / 32;
  const float rs = row_scale ? row_scale[row] : 1.0f;
  const size_t row_codes = (size_t)row * (size_t)(cols / 2);
  const uint4 *in = reinterpret_cast<const uint4 *>(codes + row_codes);
  const uint16_t *sc =
      reinterpret_cast<const uint16_t *>(scales + (size_t)row * (size_t)(cols / 16));
  uint4 *out = reinterpret_cast<uint4 *>(codes_out + row_codes);
  uint8_t *so = scales_out + (size_t)row * (size_t)groups;
  double src_sq = 0.0, err_sq = 0.0, max_abs = 0.0;

  uint4 q_next = make_uint4(0, 0, 0, 0);
  uint32_t s_next = 0;
  if (lane < groups) {
    q_next = __ldg(in + lane);
    s_next = __ldg(sc + lane);
  }
  for (int g = lane; g < groups; g += 32) {
    const uint4 q = q_next;
    const uint32_t s2 = s_next;
    if (g + 32 < groups) {
      q_next = __ldg(in + g + 32);
      s_next = __ldg(sc + g + 32);
    }
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    uint32_t o[4] = {0, 0, 0, 0};
    float st[3] = {0.0f, 0.0f, 0.0f};
    int bad;
    const uint32_t b = kLut ? mm_lut_requant_group(w, s2, kE4M3, rs, o, kStats, st, &bad)
                            : simple_group<kE4M3, kStats>(w, s2, rs, o, st, &bad);
    if (bad) {
      atomicMin(status, (uint32_t)((size_t)row * (size_t)groups + (size_t)g));
      continue;
    }
    out[g] = make_uint4(o[0], o[1], o[2], o[3]);
    so[g] = (uint8_t)b;
    if (kStats) {
      const int E = (int)b - 127;
      src_sq += ldexp((double)st[0], 2 * E);
      err_sq += ldexp((double)st[1], 2 * E);
      max_abs = fmax(max_abs, ldexp((double)st[2], E));
    }
  }

  if (kStats) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      src_sq += __shfl_down_sync(0xFFFFFFFFu, src_sq, off);
      err_sq += __shfl_down_sync(0xFFFFFFFFu, err_sq, off);
      max_abs = fmax(max_abs, __shfl_down_sync(0xFFFFFFFFu, max_abs, off));
    }
    if (lane == 0) {
      row_stats[3 * (size_t)row + 0] = src_sq;
      row_stats[3 * (size_t)row + 1] = err_sq;
      row_stats[3 * (size_t)row + 2] = max_abs;
    }
  }
}

// ---- scale scan ------------------------------------------------------------------

__device__ __forceinline__ bool is_nan_byte(uint32_t b, bool e4m3) {
  return e4m3 ? (b & 0x7Fu) == 0x7Fu : b == 0xFFu;
}

__global__ void scan_kernel(const uint8_t *__restrict__ s, size_t n, int e4m3,
                            uint32_t *__restrict__ status) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t nvec = ((reinterpret_cast<uintptr_t>(s) & 15u) == 0) ? n / 16 : 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
    uint4 q = __ldg(reinterpret_cast<const uint4 *>(s) + i);
    uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 16; j++)
      if (is_nan_byte((w[j / 4] >> ((j % 4) * 8)) & 0xFFu, e4m3))
        atomicMin(status, (uint32_t)min(16 * i + (size_t)j, (size_t)0xFFFFFFFEu));
  }
  for (size_t i = 16 * nvec + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    if (is_nan_byte(s[i], e4m3)) atomicMin(status, (uint32_t)min(i, (size_t)0xFFFFFFFEu));
}

// ---- sm100 layout ------------------------------------------------------------------

// Canonical row of interleaved position n (inverse of mm_sm100_interleave_pos).
__device__ __forceinline__ int deinterleave(int n, int I) {
  return ((n >> 3) & 1) * I + 8 * (n >> 4) + (n & 7);
}
// Source row of UTCCP destination row q (inverse of mm_sm100_utccp_row).
__device__ __forceinline__ int utccp_src(int q) {
  return (q & ~127) + 32 * (q & 3) + (q & 127) / 4;
}

__global__ void interleave_rows_kernel(const uint4 *__restrict__ in, uint4 *__restrict__ out,
                                       int E, int I, int row_vecs) {
  size_t total = (size_t)E * 2 * (size_t)I * (size_t)row_vecs;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    size_t row = i / (size_t)row_vecs, col = i % (size_t)row_vecs;
    int e = (int)(row / (size_t)(2 * I)), n = (int)(row % (size_t)(2 * I));
    size_t src = ((size_t)e * (size_t)(2 * I) + (size_t)deinterleave(n, I)) * (size_t)row_vecs + col;
    out[i] = __ldg(in + src);
  }
}

// One thread per output word (e, p, q): storage e*P*MNa + p*MNa + q.
__global__ void pack_scales_kernel(const uint8_t *__restrict__ s, uint32_t *__restrict__ out,
                                   int E, int mn, int sfk, int I_interleave) {
  int P = (sfk + 3) / 4, mna = (mn + 3) & ~3;
  size_t total = (size_t)E * (size_t)P * (size_t)mna;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    int q = (int)(i % (size_t)mna);
    int p = (int)((i / (size_t)mna) % (size_t)P);
    int e = (int)(i / ((size_t)mna * (size_t)P));
    uint32_t word = 0;
    if (q < mn) {
      int n = utccp_src(q);
      int r = I_interleave ? deinterleave(n, I_interleave) : n;
      const uint8_t *src = s + ((size_t)e * (size_t)mn + (size_t)r) * (size_t)sfk;
#pragma unroll
      for (int j = 0; j < 4; j++)
        if (4 * p + j < sfk) word |= (uint32_t)src[4 * p + j] << (8 * j);
    }
    out[i] = word;
  }
}

int grid_for(size_t work, int threads) {
  size_t blocks = (work + (size_t)threads - 1) / (size_t)threads;
  if (blocks < 1) blocks = 1;
  return blocks > 132 * 16 ? 132 * 16 : (int)blocks;
}

}  // namespace

template <bool kLut>
static mm_err *requant_launch(int rows, int cols, mm_scale_format sf, const uint8_t *codes,
                              const uint8_t *scales, const float *row_scale, uint8_t *codes_out,
                              uint8_t *scales_out, double *row_stats, uint32_t *status,
                              void *stream) {
  MM_ARG_CHECK(rows >= 0 && cols >= 0 && cols % 32 == 0,
               "gpu requant: shape [%d, %d] needs K %% 32 == 0", rows, cols);
  MM_ARG_CHECK(sf == MM_SF_E4M3 || sf == MM_SF_UE8M0, "gpu requant: scale format %d", (int)sf);
  MM_ARG_CHECK(status, "gpu requant: status word required");
  if (rows == 0 || cols == 0) return NULL;
  MM_ARG_CHECK(codes && scales && codes_out && scales_out, "gpu requant: NULL array");
  MM_ARG_CHECK(((uintptr_t)codes & 15u) == 0 && ((uintptr_t)codes_out & 15u) == 0,
               "gpu requant: code arrays must be 16-byte aligned");
  MM_ARG_CHECK(((uintptr_t)scales & 1u) == 0, "gpu requant: scale array must be 2-byte aligned");
  cudaStream_t st = (cudaStream_t)stream;
  dim3 grid((unsigned)((rows + kRequantThreads / 32 - 1) / (kRequantThreads / 32))),
      block(kRequantThreads);
  if (sf == MM_SF_E4M3) {
    if (row_stats)
      requant_kernel<true, true, kLut><<<grid, block, 0, st>>>(
          rows, cols, codes, scales, row_scale, codes_out, scales_out, row_stats, status);
    else
      requant_kernel<true, false, kLut><<<grid, block, 0, st>>>(
          rows, cols, codes, scales, row_scale, codes_out, scales_out, NULL, status);
  } else {
    if (row_stats)
      requant_kernel<false, true, kLut><<<grid, block, 0, st>>>(
          rows, cols, codes, scales, row_scale, codes_out, scales_out, row_stats, status);
    else
      requant_kernel<false, false, kLut><<<grid, block, 0, st>>>(
          rows, cols, codes, scales, row_scale, codes_out, scales_out, NULL, status);
  }
  MM_CUDA_TRY(cudaGetLastError(), "gpu requant: launch");
  return NULL;
}

extern "C" mm_err *mm_gpu_requant_launch(int rows, int cols, mm_scale_format sf,
                                         const uint8_t *codes, const uint8_t *scales,
                                         const float *row_scale, uint8_t *codes_out,
                                         uint8_t *scales_out, double *row_stats,
                                         uint32_t *status, void *stream) {
  return requant_launch<true>(rows, cols, sf, codes, scales, row_scale, codes_out, scales_out,
                              row_stats, status, stream);
}

extern "C" mm_err *mm_gpu_requant_launch_simple(int rows, int cols, mm_scale_format sf,
                                                const uint8_t *codes, const uint8_t *scales,
                                                const float *row_scale, uint8_t *codes_out,
                                                uint8_t *scales_out, double *row_stats,
                                                uint32_t *status, void *stream) {
  return requant_launch<false>(rows, cols, sf, codes, scales, row_scale, codes_out, scales_out,
                               row_stats, status, stream);
}

static mm_err *requant_sync(int simple, int rows, int cols, mm_scale_format sf,
                            const uint8_t *codes, const uint8_t *scales, const float *row_scale,
                            uint8_t *codes_out, uint8_t *scales_out, mm_requant_stats *stats,
                            void *stream) {
  if (stats) memset(stats, 0, sizeof(*stats));
  if (rows == 0 || cols == 0) return NULL;
  cudaStream_t st = (cudaStream_t)stream;
  uint32_t *d_status = NULL;
  double *d_stats = NULL, *h_stats = NULL;
  uint32_t h_status = MM_GPU_STATUS_OK;
  mm_err *err = NULL;
  cudaError_t ce = cudaMalloc((void **)&d_status, sizeof(uint32_t));
  if (ce == cudaSuccess && stats) ce = cudaMalloc((void **)&d_stats, sizeof(double) * 3 * (size_t)rows);
  if (ce == cudaSuccess) ce = cudaMemcpyAsync(d_status, &h_status, 4, cudaMemcpyHostToDevice, st);
  if (ce != cudaSuccess) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "gpu requant: allocation: %s",
                   cudaGetErrorString(ce));
    goto done;
  }
  err = (simple ? mm_gpu_requant_launch_simple : mm_gpu_requant_launch)(
      rows, cols, sf, codes, scales, row_scale, codes_out, scales_out, d_stats, d_status, stream);
  if (err) goto done;
  ce = cudaMemcpyAsync(&h_status, d_status, 4, cudaMemcpyDeviceToHost, st);
  if (ce == cudaSuccess) ce = cudaStreamSynchronize(st);
  if (ce != cudaSuccess) {
    err = mm_error(MEGAMOE_CODE_INTERNAL, "gpu requant: %s", cudaGetErrorString(ce));
    goto done;
  }
  if (h_status != MM_GPU_STATUS_OK) {
    int g = (int)(h_status % (uint32_t)(cols / 32)), r = (int)(h_status / (uint32_t)(cols / 32));
    err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                   "row %d, elements %d..%d: non-finite source value", r, 32 * g, 32 * g + 31);
    goto done;
  }
  if (stats) {
    h_stats = (double *)malloc(sizeof(double) * 3 * (size_t)rows);
    if (!h_stats) {
      err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "gpu requant: out of host memory");
      goto done;
    }
    ce = cudaMemcpy(h_stats, d_stats, sizeof(double) * 3 * (size_t)rows, cudaMemcpyDeviceToHost);
    if (ce != cudaSuccess) {
      err = mm_error(MEGAMOE_CODE_INTERNAL, "gpu requant: stats copy: %s", cudaGetErrorString(ce));
      goto done;
    }
    for (int r = 0; r < rows; r++) {
      mm_requant_stats one = {h_stats[3 * r], h_stats[3 * r + 1], h_stats[3 * r + 2], 0.0, cols};
      mm_requant_stats_merge(stats, &one);
    }
  }
done:
  free(h_stats);
  cudaFree(d_stats);
  cudaFree(d_status);
  return err;
}

extern "C" mm_err *mm_gpu_requant(int rows, int cols, mm_scale_format sf, const uint8_t *codes,
                                  const uint8_t *scales, const float *row_scale,
                                  uint8_t *codes_out, uint8_t *scales_out,
                                  mm_requant_stats *stats, void *stream) {
  return requant_sync(0, rows, cols, sf, codes, scales, row_scale, codes_out, scales_out, stats,
                      stream);
}

extern "C" mm_err *mm_gpu_requant_simple(int rows, int cols, mm_scale_format sf,
                                         const uint8_t *codes, const uint8_t *scales,
                                         const float *row_scale, uint8_t *codes_out,
                                         uint8_t *scales_out, mm_requant_stats *stats,
                                         void *stream) {
  return requant_sync(1, rows, cols, sf, codes, scales, row_scale, codes_out, scales_out, stats,
                      stream);
}

extern "C" mm_err *mm_gpu_scan_scales_launch(const uint8_t *scales, size_t n, mm_scale_format sf,
                                             uint32_t *status, void *stream) {
  MM_ARG_CHECK(status && (scales || n == 0), "gpu scale scan: NULL argument");
  if (n == 0) return NULL;
  scan_kernel<<<grid_for(n / 16 + 1, 256), 256, 0, (cudaStream_t)stream>>>(
      scales, n, sf == MM_SF_E4M3, status);
  MM_CUDA_TRY(cudaGetLastError(), "gpu scale scan: launch");
  return NULL;
}

extern "C" mm_err *mm_gpu_sm100_export_launch(const mm_sm100_shape *s, const mm_sm100_canon *in,
                                              const mm_sm100_packed *out, void *stream) {
  MM_TRY(mm_sm100_check_shape(s));
  MM_ARG_CHECK(in->w13 && in->s13 && in->w2 && in->s2 && out->w13 && out->s13 && out->w2 &&
                   out->s2,
               "gpu sm100 export: NULL array");
  MM_ARG_CHECK(((uintptr_t)in->w13 & 15u) == 0 && ((uintptr_t)out->w13 & 15u) == 0,
               "gpu sm100 export: w13 arrays must be 16-byte aligned");
  cudaStream_t st = (cudaStream_t)stream;
  int row_vecs = s->H / 32;  // H/2 bytes per row, 16 per vector
  size_t w13_vecs = (size_t)s->E * 2 * (size_t)s->I * (size_t)row_vecs;
  interleave_rows_kernel<<<grid_for(w13_vecs, 256), 256, 0, st>>>(
      reinterpret_cast<const uint4 *>(in->w13), reinterpret_cast<uint4 *>(out->w13), s->E, s->I,
      row_vecs);
  MM_CUDA_TRY(cudaGetLastError(), "gpu sm100 export: w13 interleave launch");
  MM_CUDA_TRY(cudaMemcpyAsync(out->w2, in->w2, mm_sm100_w2_bytes(s), cudaMemcpyDeviceToDevice, st),
              "gpu sm100 export: w2 copy");
  int sfk13 = mm_sm100_sfk(s->H, s->gran), sfk2 = mm_sm100_sfk(s->I, s->gran);
  pack_scales_kernel<<<grid_for(mm_sm100_s13_words(s), 256), 256, 0, st>>>(
      in->s13, reinterpret_cast<uint32_t *>(out->s13), s->E, 2 * s->I, sfk13, s->I);
  MM_CUDA_TRY(cudaGetLastError(), "gpu sm100 export: s13 pack launch");
  pack_scales_kernel<<<grid_for(mm_sm100_s2_words(s), 256), 256, 0, st>>>(
      in->s2, reinterpret_cast<uint32_t *>(out->s2), s->E, s->H, sfk2, 0);
  MM_CUDA_TRY(cudaGetLastError(), "gpu sm100 export: s2 pack launch");
  return NULL;
}

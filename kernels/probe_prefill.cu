/* probe_prefill.cu -- the prefill-structure probe (probe_prefill.h;
 * docs/PERF.md, version 20). A persistent grid of CTAs, each one producer
 * warpgroup (thread 0 issues the copies; with the in-kernel decode its warps
 * 1-3 decode weights) and two consumer warpgroups of m64n128k32 SS WGMMAs.
 * Work units (expert, M tile, N tile), M tiles fastest, so that the CTAs
 * running at one time share the weight tiles of an expert in L2. */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <string.h>

#include "moe_sm90_impl.h"
#include "sm90_ptx.h"
#include "sm90_record_decode.h"
#include "sm90_ss_kblock.h"

extern "C" {
#include "probe_prefill.h"
}

namespace {

/* The probe's FP4 word (8 weights): bytes 0-3 from nibbles 0-3 (magnitude
 * bits 0-2 of each) with their signs at bits 8i + 7, bytes 4-7 from nibbles
 * 4-7 with their signs at bits 8i + 3; magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}
 * times 2^d through one byte permute per 4 weights, d from the group's
 * exponent byte (0-3: every value stays a normal E4M3), through mode 1's
 * word decode (rec_dec8: the same 7 instructions per 8 weights) with a
 * computed table entry instead of a shared one. */
__device__ __forceinline__ void probe_table(uint32_t d, uint32_t &tx, uint32_t &ty) {
  tx = 0x3C383000u + 8u * d * 0x01010100u;
  ty = 0x4C484440u + 8u * d * 0x01010101u;
}
/* 32 weights: 16 code bytes and their exponent byte -> 32 E4M3 bytes. */
__device__ __forceinline__ void probe_dec32(uint4 c, uint32_t sb, uint4 *out) {
  uint32_t tx, ty, o[8];
  probe_table(sb & 3u, tx, ty);
  rec_dec8(c.x, tx, ty, o[0], o[1]);
  rec_dec8(c.y, tx, ty, o[2], o[3]);
  rec_dec8(c.z, tx, ty, o[4], o[5]);
  rec_dec8(c.w, tx, ty, o[6], o[7]);
  out[0] = make_uint4(o[0], o[1], o[2], o[3]);
  out[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

/* kSplitN: 64 x 256 tiles, each warpgroup one 128-row half of B (else
 * 128 x 128, each warpgroup 64 of the tokens); kCluster: clusters of 2 CTAs
 * on neighbouring M tiles, each copying one half of B into both; kDecode
 * (1: the probe's FP4 format, 2: mode 1's records):
 * the weights come as FP4 and are decoded into p.wdec ahead of the GEMM. */
template <bool kSplitN, bool kCluster, int kDecode, bool kSwiGLU = false>
struct Probe {
  static constexpr int BM = kSplitN ? 64 : 128, BN = kSplitN ? 256 : 128;
  static constexpr int kA = BM * 128, kB = BN * 128, kS = 1024; /* 1024-aligned stages */
  static constexpr int kStage = kA + kB + kS;
  static constexpr int kStg = 2 * 16384; /* per consumer: 64 rows x 128 BF16 columns */
  /* mode 1's records: two 32 x 128 E4M3 tiles per decoder warp, which it
   * fills and stores */
  static constexpr int kDecStg = kDecode == 2 ? 3 * 8192 : 0;
  static constexpr int kStages0 = (232448 - 2048 - 256 - kStg - kDecStg) / kStage;
  static constexpr int kStages = kStages0 > 8 ? 8 : kStages0;
  static constexpr int kOffStg = kStages * kStage;
  static constexpr int kOffDec = kOffStg + kStg; /* 1024-aligned: 128B-swizzled tiles */
  static constexpr int kOffLut = kOffDec + kDecStg; /* mode 1's compact fold table, 256 bytes */
  static constexpr int kOffBar = kOffLut + 256;
  static constexpr int kBytes = kOffBar + 256 + 1024;
  static constexpr int kDecodeRows = 16; /* rows per decode task (the probe's format) */
};


/* The in-kernel decode, on the producer warpgroup's warps 1-3: tasks of 16
 * weight rows dealt over the CTAs in expert order, four 32-weight groups in
 * flight per thread (the loads are the latency); each warp counts a finished
 * task in ready[expert] after making its writes visible to the async proxy,
 * whose tensor copies read them. */
__device__ void decode_tasks(const mm_probe_problem &p, int d, int per_expert) {
  const int groups_per_row = p.K / 32, ntasks = p.E * per_expert;
  const uint4 *codes = (const uint4 *)p.codes;
  uint4 *wdec = (uint4 *)p.wdec;
  for (int t = blockIdx.x; t < ntasks; t += gridDim.x) {
    const size_t g0 = (size_t)t * 16 * groups_per_row, n = (size_t)16 * groups_per_row;
    for (size_t i0 = d; i0 < n; i0 += 4 * 96) {
      uint4 c[4];
      uint32_t sb[4];
#pragma unroll
      for (int j = 0; j < 4; j++)
        if (i0 + 96 * j < n) {
          c[j] = __ldcs(codes + g0 + i0 + 96 * j);
          sb[j] = __ldcs(p.scales + g0 + i0 + 96 * j);
        }
#pragma unroll
      for (int j = 0; j < 4; j++)
        if (i0 + 96 * j < n) probe_dec32(c[j], sb[j], wdec + 2 * (g0 + i0 + 96 * j));
    }
    asm volatile("fence.proxy.async.global;" ::: "memory");
    __threadfence();
    __syncwarp();
    if ((threadIdx.x & 31) == 0) atomicAdd(&p.ready[t / per_expert], 1);
  }
}

/* The L1 epilogue of a 64 x 256 tile (kSwiGLU): columns 2i and 2i + 1 are
 * gate i and up i (each thread holds such pairs), rounded to BF16, then
 * silu(gate) * up; the amax of a token's 128 outputs (both warpgroups'
 * halves, through shared memory, double-buffered by unit parity: the only
 * barrier both warpgroups meet) sets its FP32 scale. Each warpgroup stages
 * its 64 FP8 columns and writes them out behind its own barrier. */
__device__ __forceinline__ float probe_silu(float g) { return __fdividef(g, 1.0f + __expf(-g)); }
__device__ void swiglu_epilogue(const mm_probe_problem &p, const float (&fin)[64], uint8_t *stg,
                                float *red, int c, int t, int row0, int nt) {
  const int w = t / 32, l = t % 32, ra = 16 * w + l / 4;
  float h[32], amax[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 16; j++)
#pragma unroll
    for (int q = 0; q < 2; q++) {
      const float g = __bfloat162float(__float2bfloat16_rn(fin[4 * j + 2 * q]));
      const float u = __bfloat162float(__float2bfloat16_rn(fin[4 * j + 2 * q + 1]));
      h[2 * j + q] = probe_silu(g) * u;
      amax[q] = fmaxf(amax[q], fabsf(h[2 * j + q]));
    }
#pragma unroll
  for (int q = 0; q < 2; q++) {
    amax[q] = fmaxf(amax[q], __shfl_xor_sync(0xffffffffu, amax[q], 1));
    amax[q] = fmaxf(amax[q], __shfl_xor_sync(0xffffffffu, amax[q], 2));
  }
  if (l % 4 == 0) {
    red[c * 64 + ra] = amax[0];
    red[c * 64 + ra + 8] = amax[1];
  }
  named_sync(3, 256);
  float inv[2];
#pragma unroll
  for (int q = 0; q < 2; q++) {
    const int r = ra + 8 * q;
    const float s = fmaxf(fmaxf(red[r], red[64 + r]), 1e-4f) / 448.0f;
    inv[q] = 1.0f / s;
    if (c == 0 && l % 4 == 0) p.act_s[(size_t)nt * p.E * p.Me + row0 + r] = s;
  }
  uint8_t *half = stg + c * 4096; /* this warpgroup's 64 rows x 64 columns */
#pragma unroll
  for (int j = 0; j < 16; j++)
#pragma unroll
    for (int q = 0; q < 2; q++)
      half[(ra + 8 * q) * 64 + 4 * j + l % 4] =
          (uint8_t)__nv_cvt_float_to_fp8(h[2 * j + q] * inv[q], __NV_SATFINITE, __NV_E4M3);
  named_sync(1 + c, 128);
  /* 128 threads: half of a 64-byte row each */
  const uint4 *src = (const uint4 *)(half + (t / 2) * 64 + (t % 2) * 32);
  uint4 *dst = (uint4 *)(p.act + (size_t)(row0 + t / 2) * (p.N / 2) + nt * 128 + 64 * c + (t % 2) * 32);
  dst[0] = src[0];
  dst[1] = src[1];
  /* the next unit writes the staging only after both warpgroups meet at its
   * amax barrier, so every thread has read it by then */
}

/* Mode 1's records into the workspace (sm90_record_decode.h): tasks of up
 * to 16 records of one 64-row tile, dealt over the decoder warps of all CTAs
 * in expert order; each warp decodes its tasks alone (half records through
 * its own two shared tiles) and counts each in ready[expert]. Before
 * (version 20) the three warps shared each record, 128 slots for 96
 * threads, and one of them did two while the others waited (docs/PERF.md,
 * version 21). */
__device__ void decode_records(const mm_probe_problem &p, const CUtensorMap *tw, int d,
                               const uint8_t *lut, uint8_t *dec) {
  const int KB = p.K / 128, groups = (KB + 15) / 16, per_expert = p.N / 64 * groups;
  const int wj = d / 32;
  int n = 0;
  for (int t = 3 * blockIdx.x + wj; t < p.E * per_expert; t += 3 * gridDim.x) {
    const int tile = t / groups, kb0 = 16 * (t % groups), kb1 = min(KB, kb0 + 16);
    decode_record_run<1>(p.records + ((size_t)tile * KB + kb0) * RecFmt<1>::kRec, kb0, kb1, tw,
                         64 * tile, lut, dec + wj * 8192, n);
    if (d % 32 == 0) atomicAdd(&p.ready[t / per_expert], 1);
  }
}

template <bool kSplitN, bool kCluster, int kDecode, bool kSwiGLU = false>
__global__ void __launch_bounds__(384, 1)
    probe_kernel(const mm_probe_problem p, const __grid_constant__ CUtensorMap ta,
                 const __grid_constant__ CUtensorMap tb, const __grid_constant__ CUtensorMap to,
                 const __grid_constant__ CUtensorMap tw) {
  using G = Probe<kSplitN, kCluster, kDecode, kSwiGLU>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t *sm = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  uint64_t *full = (uint64_t *)(sm + G::kOffBar), *empty = full + G::kStages;
  const int wg = threadIdx.x / 128, KB = p.K / 128, MT = p.Me / G::BM, NT = p.N / G::BN;
  uint32_t crank = 0;
  if (kCluster) asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(crank));
  if (threadIdx.x == 0) {
    for (int s = 0; s < G::kStages; s++) {
      mbar_init(&full[s], 1);
      /* with clusters one arrive per consumer warp of both CTAs: the
       * producer's next copy writes into both */
      mbar_init(&empty[s], kCluster ? 16 : 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (kCluster) cluster_sync();
  /* units: with clusters, a pair of neighbouring M tiles per cluster */
  const int ustep = kCluster ? gridDim.x / 2 : gridDim.x, ufirst = kCluster ? blockIdx.x / 2 : blockIdx.x;
  const int MTw = kCluster ? MT / 2 : MT, nunits = p.E * MTw * NT;
  auto unit_of = [&](int u, int &e, int &mt, int &nt) {
    e = u / (MTw * NT);
    mt = u % (MTw * NT) % MTw;
    nt = u % (MTw * NT) / MTw;
    if (kCluster) mt = 2 * mt + (int)crank;
  };

  if (wg == 0) { /* producer warpgroup */
    if (kDecode == 1 && threadIdx.x >= 32) decode_tasks(p, threadIdx.x - 32, p.N / G::kDecodeRows);
    if (kDecode == 2 && threadIdx.x >= 32) {
      uint8_t *lut = sm + G::kOffLut;
      for (int i = threadIdx.x - 32; i < 64; i += 96) ((uint32_t *)lut)[i] = ((const uint32_t *)p.lut)[i];
      named_sync(4, 96);
      decode_records(p, &tw, threadIdx.x - 32, lut, sm + G::kOffDec);
    }
    if (threadIdx.x == 0) {
      int stage = 0, e_ready = -1;
      uint32_t phase = 0;
      for (int u = ufirst; u < nunits; u += ustep) {
        int e, mt, nt;
        unit_of(u, e, mt, nt);
        if (kDecode && e != e_ready) { /* the expert's weights, decoded by every CTA */
          const int want = kDecode == 2 ? (p.N / 64) * ((KB + 15) / 16) : 3 * (p.N / G::kDecodeRows);
          wait_count_async(p.ready + e, want, 200);
          e_ready = e;
        }
        const int row0 = e * p.Me + mt * G::BM, brow = e * p.N + nt * G::BN;
        for (int kb = 0; kb < KB; kb++) {
          mbar_wait(&empty[stage], phase ^ 1);
          uint8_t *st = sm + stage * G::kStage;
          mbar_expect_tx(&full[stage], G::kA + G::kB + 4 * G::BM);
          tma_2d(st, &ta, kb * 128, row0, &full[stage]);
          if (kCluster) {
            const int half = (int)crank * (G::BN / 2);
            asm volatile(
                "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes."
                "multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(smem_u32(st + G::kA + half * 128)),
                "l"((uint64_t)&tb), "r"(kb * 128), "r"(brow + half), "r"(smem_u32(&full[stage])),
                "h"((uint16_t)3)
                : "memory");
          } else {
            tma_2d(st + G::kA, &tb, kb * 128, brow, &full[stage]);
          }
          bulk_g2s(st + G::kA + G::kB, p.xs_t + (size_t)kb * p.E * p.Me + row0, 4 * G::BM,
                   &full[stage]);
          if (++stage == G::kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
    if (kCluster) cluster_sync(); /* the peer's copies and arrivals reach us until it ends */
    return;
  }

  /* consumers */
  const int c = wg - 1, t = threadIdx.x % 128, w = t / 32, l = t % 32;
  const int aoff = kSplitN ? 0 : 64 * c, boff = kSplitN ? 128 * c : 0;
  const int r0 = aoff + 16 * w + l / 4; /* rows r0, r0 + 8 of the tile */
  uint32_t peer_empty = 0;
  /* the peer's barrier: a plain (CTA-scope release) remote arrive; with
   * .release.cluster every arrive waited for a cluster-scope fence and the
   * kernel ran at half speed (docs/PERF.md, version 20) */
  if (kCluster)
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(peer_empty) : "r"(smem_u32(empty)), "r"(crank ^ 1));
  int stage = 0;
  uint32_t phase = 0;
  float acc[64], fin[64];
  uint8_t *stg = sm + G::kOffStg + c * 16384;
  for (int u = ufirst; u < nunits; u += ustep) {
    int e, mt, nt;
    unit_of(u, e, mt, nt);
#pragma unroll
    for (int i = 0; i < 64; i++) fin[i] = 0.f;
    for (int kb = 0; kb < KB; kb++) {
      mbar_wait(&full[stage], phase);
      const uint8_t *st = sm + stage * G::kStage;
      const uint32_t peer[1] = {peer_empty + 8 * stage};
      ss_kblock<kCluster ? 2 : 1>(st + aoff * 128, st + G::kA + boff * 128,
                                  (const float *)(st + G::kA + G::kB), r0, &empty[stage], peer,
                                  acc, fin);
      if (++stage == G::kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    if (kSwiGLU) {
      const int parity = ((u - ufirst) / ustep) & 1;
      swiglu_epilogue(p, fin, sm + G::kOffStg, (float *)(sm + G::kOffStg + 8192) + 128 * parity, c,
                      t, e * p.Me + mt * G::BM, nt);
      continue;
    }
    /* BF16 tile into this warpgroup's staging (two 64-column boxes, 128B
     * swizzle), then thread 0's two tensor stores, which drain while the
     * next unit's MMAs run */
    const uint32_t bar = 1 + c;
    if (t == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    named_sync(bar, 128);
#pragma unroll
    for (int j = 0; j < 16; j++) {
      const int col = 8 * j + 2 * (l % 4), h = col / 64, cb = (col % 64) * 2;
#pragma unroll
      for (int q = 0; q < 2; q++) {
        const int rr = 16 * w + l / 4 + 8 * q;
        const int off = h * 8192 + rr * 128 + ((((cb >> 4) ^ (rr & 7)) << 4) | (cb & 15));
        __nv_bfloat162 v = __floats2bfloat162_rn(fin[4 * j + 2 * q], fin[4 * j + 2 * q + 1]);
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_u32(stg + off)), "r"(*(uint32_t *)&v)
                     : "memory");
      }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    named_sync(bar, 128);
    if (t == 0) {
      const int row = e * p.Me + mt * G::BM + aoff, col = nt * G::BN + boff;
#pragma unroll
      for (int h = 0; h < 2; h++)
        asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                         (uint64_t)&to),
                     "r"(col + 64 * h), "r"(row), "r"(smem_u32(stg + h * 8192))
                     : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  if (t == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  if (kCluster) cluster_sync();
}

template <bool kSplitN, bool kCluster, int kDecode, bool kSwiGLU = false>
mm_err *launch(const mm_probe_problem &p, cudaStream_t st) {
  using G = Probe<kSplitN, kCluster, kDecode, kSwiGLU>;
  MM_ARG_CHECK(p.E > 0 && p.Me > 0 && p.Me % 256 == 0 && p.N % 256 == 0 && p.K % 128 == 0,
               "probe: Me and N must be multiples of 256, K of 128");
  CUtensorMap ta, tb, to, tw;
  const int rows = p.E * p.Me;
  MM_TRY(make_map(&ta, CU_TENSOR_MAP_DATA_TYPE_UINT8, p.x, p.K, rows, p.K, 128, G::BM, true));
  MM_TRY(make_map(&tb, CU_TENSOR_MAP_DATA_TYPE_UINT8, kDecode ? p.wdec : p.w, p.K,
                  (uint64_t)p.E * p.N, p.K, 128, kCluster ? G::BN / 2 : G::BN, true));
  MM_TRY(make_map(&to, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, p.out, p.N, rows, 2ull * p.N, 64, 64, true));
  tw = tb; /* the record decode's stores: 32 x 128 tiles of the workspace */
  if (kDecode == 2)
    MM_TRY(make_map(&tw, CU_TENSOR_MAP_DATA_TYPE_UINT8, p.wdec, p.K, (uint64_t)p.E * p.N, p.K, 128, 32, true));
  MM_ARG_CHECK(!kSwiGLU || (p.act && p.act_s), "probe: the SwiGLU variant writes act and act_s");
  MM_ARG_CHECK(kDecode != 2 || (p.records && p.lut), "probe: the record variants read records and lut");
  auto kern = probe_kernel<kSplitN, kCluster, kDecode, kSwiGLU>;
  MM_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, G::kBytes));
  if (kDecode) MM_CUDA_TRY(cudaMemsetAsync(p.ready, 0, sizeof(int) * p.E, st));
  int dev = 0, sms = 0;
  MM_CUDA_TRY(cudaGetDevice(&dev));
  MM_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute at;
  cluster_launch_config(&cfg, &at, kCluster ? 2 : 1, 384, G::kBytes, st);
  cfg.gridDim = dim3(sms);
  if (kCluster) { /* clusters sit inside a GPC: not every SM may hold one */
    int clusters = 0;
    MM_CUDA_TRY(cudaOccupancyMaxActiveClusters(&clusters, kern, &cfg));
    MM_ARG_CHECK(clusters > 0, "probe: no cluster of 2 fits");
    cfg.gridDim = dim3(2 * clusters);
  }
  MM_CUDA_TRY(cudaLaunchKernelEx(&cfg, kern, p, ta, tb, to, tw));
  return NULL;
}

__global__ void decode_kernel(const uint4 *codes, const uint8_t *scales, uint4 *w, size_t groups) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < groups;
       i += (size_t)gridDim.x * blockDim.x)
    probe_dec32(codes[i], scales[i], w + 2 * i);
}

/* Mode 1's records decoded weight by weight from the layout's formulas
 * (docs/LAYOUTS.md), independently of decode_record_slot. */
__global__ void records_reference_kernel(const uint8_t *records, const uint8_t *lut, uint8_t *w,
                                         size_t rows, int K) {
  const int KB = K / 128;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < rows * K;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t r = i / K;
    const int k = (int)(i % K), lr = (int)(r % 64), kk = k % 128;
    const uint8_t *rec = records + ((r / 64) * KB + k / 128) * RecFmt<1>::kRec;
    const int s = kk / 32, h = (kk % 32) / 16, b = kk % 4, q = (kk % 16) / 4, rr = (lr / 8) % 2;
    const int T = 32 * (lr / 16) + 4 * (lr % 8) + q, u = 2 * s + rr;
    const uint32_t word = *(const uint32_t *)(rec + (u / 4) * 2048 + 16 * T + 4 * (u % 4));
    const uint32_t mag = h ? (word >> (16 + 4 * b)) & 7u : (word >> (4 * b)) & 7u;
    const uint32_t sign = h ? (word >> (8 * b + 3)) & 1u : (word >> (8 * b + 7)) & 1u;
    w[i] = (uint8_t)(lut[(rec[4096 + 4 * lr + s] & 0xF8) + mag] | sign << 7);
  }
}

__device__ __forceinline__ uint32_t hash32(size_t i, uint32_t seed) {
  uint32_t h = (uint32_t)i * 2654435761u ^ seed;
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  return h ^ (h >> 15);
}
__global__ void fill_e4m3_kernel(uint8_t *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const uint32_t h = hash32(i, seed);
    p[i] = (uint8_t)((h & 0x80) | ((4 + ((h >> 8) & 7)) << 3) | ((h >> 16) & 7));
  }
}
/* Random mode 1 records: any code bytes; per row and group a fold-table
 * entry (k, 0) with k in [-6, 2] (every value a finite E4M3 of at most 24);
 * references 0. */
__global__ void fill_records_kernel(uint8_t *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const uint32_t h = hash32(i, seed), o = (uint32_t)(i % RecFmt<1>::kRec);
    p[i] = o < 4096 ? (uint8_t)h : o < 4352 ? (uint8_t)(8 * (16 - 6 + (int)(h % 9))) : 0;
  }
}
__global__ void fill_scales_kernel(float *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = 1e-3f * (0.5f + (float)(hash32(i, seed) >> 8) / 16777216.0f);
}

/* Row r = blockIdx.y * stride, column n: sum over K blocks of the block's
 * FP32 dot product times the token's scale. */
__global__ void reference_kernel(mm_probe_problem p, const uint8_t *w, int stride, float *ref) {
  const int r = blockIdx.y * stride, n = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= p.E * p.Me || n >= p.N) return;
  const uint8_t *a = p.x + (size_t)r * p.K, *b = w + ((size_t)(r / p.Me) * p.N + n) * p.K;
  float tot = 0.f;
  for (int kb = 0; kb < p.K / 128; kb++) {
    float s = 0.f;
    for (int k = 128 * kb; k < 128 * kb + 128; k++) {
      __nv_fp8_e4m3 x, y;
      x.__x = a[k];
      y.__x = b[k];
      s += (float)x * (float)y;
    }
    tot += s * p.xs_t[(size_t)kb * p.E * p.Me + r];
  }
  ref[(size_t)blockIdx.y * p.N + n] = tot;
}

}  // namespace

extern "C" const char *mm_probe_variant_name(mm_probe_variant v) {
  switch (v) {
    case MM_PROBE_SS: return "SS 128x128";
    case MM_PROBE_SS_MCAST: return "SS 128x128, clusters of 2 multicasting B";
    case MM_PROBE_SS_DECODE: return "SS 128x128, clusters, FP4 decoded in the kernel";
    case MM_PROBE_SPLITN_DECODE: return "SS 64x256, clusters, FP4 decoded in the kernel";
    case MM_PROBE_SWIGLU: return "the same with an L1 epilogue (SwiGLU, FP8 requant)";
    case MM_PROBE_RECORDS: return "SS 128x128, clusters, mode 1 records decoded in the kernel";
    case MM_PROBE_RECORDS_SWIGLU: return "SS 64x256, clusters, mode 1 records, L1 epilogue";
    default: return "?";
  }
}

extern "C" mm_err *mm_probe_gemm(const mm_probe_problem *p, mm_probe_variant v, void *stream) {
  MM_ARG_CHECK(p, "probe: no problem");
  cudaStream_t st = (cudaStream_t)stream;
  switch (v) {
    case MM_PROBE_SS: return launch<false, false, 0>(*p, st);
    case MM_PROBE_SS_MCAST: return launch<false, true, 0>(*p, st);
    case MM_PROBE_SS_DECODE: return launch<false, true, 1>(*p, st);
    case MM_PROBE_SPLITN_DECODE: return launch<true, true, 1>(*p, st);
    case MM_PROBE_SWIGLU: return launch<true, true, 1, true>(*p, st);
    case MM_PROBE_RECORDS: return launch<false, true, 2>(*p, st);
    case MM_PROBE_RECORDS_SWIGLU: return launch<true, true, 2, true>(*p, st);
    default: return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "probe: variant %d", (int)v);
  }
}

extern "C" mm_err *mm_probe_decode(const uint8_t *codes, const uint8_t *scales, uint8_t *w,
                                   size_t n, void *stream) {
  MM_ARG_CHECK(n % 32 == 0, "probe: decode whole groups of 32");
  decode_kernel<<<1024, 256, 0, (cudaStream_t)stream>>>((const uint4 *)codes, scales, (uint4 *)w, n / 32);
  MM_CUDA_TRY(cudaGetLastError());
  return NULL;
}

extern "C" mm_err *mm_probe_fill_e4m3(uint8_t *p, size_t n, uint32_t seed, void *stream) {
  fill_e4m3_kernel<<<1024, 256, 0, (cudaStream_t)stream>>>(p, n, seed);
  MM_CUDA_TRY(cudaGetLastError());
  return NULL;
}

extern "C" mm_err *mm_probe_fill_records(uint8_t *p, size_t n, uint32_t seed, void *stream) {
  MM_ARG_CHECK(n % RecFmt<1>::kRec == 0, "probe: whole records");
  fill_records_kernel<<<1024, 256, 0, (cudaStream_t)stream>>>(p, n, seed);
  MM_CUDA_TRY(cudaGetLastError());
  return NULL;
}

extern "C" mm_err *mm_probe_decode_records(const uint8_t *records, const uint8_t *lut, uint8_t *w,
                                           size_t rows, int K, void *stream) {
  MM_ARG_CHECK(rows % 64 == 0 && K % 128 == 0, "probe: whole records");
  records_reference_kernel<<<1024, 256, 0, (cudaStream_t)stream>>>(records, lut, w, rows, K);
  MM_CUDA_TRY(cudaGetLastError());
  return NULL;
}

extern "C" mm_err *mm_probe_fill_scales(float *p, size_t n, uint32_t seed, void *stream) {
  fill_scales_kernel<<<256, 256, 0, (cudaStream_t)stream>>>(p, n, seed);
  MM_CUDA_TRY(cudaGetLastError());
  return NULL;
}

extern "C" mm_err *mm_probe_reference(const mm_probe_problem *p, const uint8_t *w, int stride,
                                      float *ref, void *stream) {
  MM_ARG_CHECK(p && stride > 0 && p->N % 128 == 0, "probe: reference arguments");
  const int rows = (p->E * p->Me + stride - 1) / stride;
  reference_kernel<<<dim3(p->N / 128, rows), 128, 0, (cudaStream_t)stream>>>(*p, w, stride, ref);
  MM_CUDA_TRY(cudaGetLastError());
  return NULL;
}

/* sm90_ptx.h -- PTX wrappers shared by the sm90 kernels (C++/CUDA only):
 * shared-memory addresses, mbarriers, bulk and tensor copies, named barriers,
 * WGMMA fences and descriptors, byte permutes; and the host's 2-D tensor-map
 * encoder. Everything sits in the including file's unnamed namespace. */
#ifndef MM_SM90_PTX_H
#define MM_SM90_PTX_H

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

extern "C" {
#include "status.h"
}

/* A WGMMA's FP32 accumulator operands for N columns (N / 2 registers per
 * thread): the "+f" constraints and the matching PTX operand list %0 .. */
#define MM_ACC8(d, o)                                                                        \
  "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), \
      "+f"(d[o + 6]), "+f"(d[o + 7])
#define MM_ACC4(d, o) "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3])
#define MM_ACC_16(d) MM_ACC8(d, 0)
#define MM_ACC_24(d) MM_ACC8(d, 0), MM_ACC4(d, 8)
#define MM_ACC_32(d) MM_ACC8(d, 0), MM_ACC8(d, 8)
#define MM_ACC_40(d) MM_ACC_32(d), MM_ACC4(d, 16)
#define MM_ACC_48(d) MM_ACC8(d, 0), MM_ACC8(d, 8), MM_ACC8(d, 16)
#define MM_ACC_56(d) MM_ACC_48(d), MM_ACC4(d, 24)
#define MM_ACC_64(d) MM_ACC8(d, 0), MM_ACC8(d, 8), MM_ACC8(d, 16), MM_ACC8(d, 24)
#define MM_ACC_80(d) MM_ACC_64(d), MM_ACC8(d, 32)
#define MM_ACC_128(d) MM_ACC_64(d), MM_ACC8(d, 32), MM_ACC8(d, 40), MM_ACC8(d, 48), MM_ACC8(d, 56)
#define MM_D_16 "%0, %1, %2, %3, %4, %5, %6, %7"
#define MM_D_24 MM_D_16 ", %8, %9, %10, %11"
#define MM_D_32 MM_D_16 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define MM_D_40 MM_D_32 ", %16, %17, %18, %19"
#define MM_D_48 MM_D_32 ", %16, %17, %18, %19, %20, %21, %22, %23"
#define MM_D_56 MM_D_48 ", %24, %25, %26, %27"
#define MM_D_64 \
  MM_D_32 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MM_D_80 MM_D_64 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define MM_D_128                                                                       \
  MM_D_80 ", %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, " \
          "%55, %56, %57, %58, %59, %60, %61, %62, %63"

namespace {

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(uint64_t *b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t *b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *b, uint32_t parity) {
  uint32_t ok;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, 0x989680;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(smem_u32(b)), "r"(parity)
        : "memory");
  } while (!ok);
}
__device__ __forceinline__ void bulk_g2s(void *dst, const void *src, uint32_t bytes,
                                         uint64_t *bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void tma_2d(void *dst, const CUtensorMap *map, int c0, int c1,
                                       uint64_t *bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(smem_u32(dst)),
      "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void named_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
/* A warpgroup's register budget (every warp of it executes the same one;
 * the kernel needs __launch_bounds__(threads, 1), and the CTA's pool must
 * balance: an inc that the pool cannot serve waits forever). */
template <int N>
__device__ __forceinline__ void set_max_regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void set_max_regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int R>
__device__ __forceinline__ void fence_acc(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}
/* A K-major, 128B-swizzled operand tile in shared memory (the WGMMA kernels'
 * token tiles, both of the probe's operands): 8-row atoms 1024 bytes apart. */
__device__ __forceinline__ uint64_t desc_b(uint32_t saddr) {
  return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)(16 >> 4) << 16) |
         ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

/* One m64n128k32 E4M3 WGMMA with both operands in shared memory (A and B
 * descriptors): the prefill path's and the probe's MMA. */
__device__ __forceinline__ void mma_ss128(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" MM_D_128
               "}, %64, %65, p, 1, 1;\n}\n"
               : MM_ACC_128(d)
               : "l"(da), "l"(db), "r"(scale_d));
}

/* One m64nNk32 E4M3 WGMMA (N 16, 24 or 32) with both operands in shared memory:
 * the prefill path's small last tiles, weights as A and tokens as B. */
template <int N>
__device__ __forceinline__ void mma_ss_narrow(float (&d)[N / 2], uint64_t da, uint64_t db,
                                              int scale_d) {
  static_assert(N == 16 || N == 24 || N == 32, "mma_ss_narrow: N 16, 24 or 32");
  if constexpr (N == 24)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %14, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n24k32.f32.e4m3.e4m3 {" MM_D_24
                 "}, %12, %13, p, 1, 1;\n}\n"
                 : MM_ACC_24(d)
                 : "l"(da), "l"(db), "r"(scale_d));
  else if constexpr (N == 16)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {" MM_D_16
                 "}, %8, %9, p, 1, 1;\n}\n"
                 : MM_ACC_16(d)
                 : "l"(da), "l"(db), "r"(scale_d));
  else
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {" MM_D_32
                 "}, %16, %17, p, 1, 1;\n}\n"
                 : MM_ACC_32(d)
                 : "l"(da), "l"(db), "r"(scale_d));
}

/* Spin (sleeping sleep_ns between tries) until *count, written by other
 * CTAs or kernels, reaches at_least, acquiring at GPU scope; then order
 * this thread's later tensor copies (async proxy) after what the count
 * published: a producer's wait for data another CTA wrote. */
__device__ __forceinline__ void wait_count_async(const int *count, int at_least,
                                                 unsigned sleep_ns) {
  for (;;) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
    if (v >= at_least) break;
    __nanosleep(sleep_ns);
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

/* Both CTAs of a cluster meet: their barriers, copies and remote arrives
 * are set up (at the start) or done with (at the end). */
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

/* ---- host ---- */

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = NULL;
  if (!fn) {
    cudaDriverEntryPointQueryResult q;
    void *f = NULL;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = (PFN_cuTensorMapEncodeTiled_v12000)f;
  }
  return fn;
}

/* A launch of CTAs of `threads` threads and `smem` bytes of dynamic shared
 * memory, in clusters of `cs` along x, on `st`; the caller sets the grid
 * (a multiple of cs). `at` must live until the launch. */
inline void cluster_launch_config(cudaLaunchConfig_t *cfg, cudaLaunchAttribute *at, int cs,
                                  int threads, size_t smem, cudaStream_t st) {
  memset(cfg, 0, sizeof(*cfg));
  memset(at, 0, sizeof(*at));
  at->id = cudaLaunchAttributeClusterDimension;
  at->val.clusterDim.x = cs;
  at->val.clusterDim.y = at->val.clusterDim.z = 1;
  cfg->gridDim = dim3(cs);
  cfg->blockDim = dim3(threads);
  cfg->dynamicSmemBytes = smem;
  cfg->stream = st;
  cfg->attrs = at;
  cfg->numAttrs = 1;
}

/* 2-D map over [outer, inner] (inner contiguous, rows row_bytes apart), box
 * {box0, box1}; swz: 128B swizzle. */
mm_err *make_map(CUtensorMap *m, CUtensorMapDataType dt, const void *base, uint64_t inner,
                 uint64_t outer, uint64_t row_bytes, uint32_t box0, uint32_t box1, bool swz) {
  PFN_cuTensorMapEncodeTiled_v12000 fn = encode_fn();
  if (!fn) return mm_error(MEGAMOE_CODE_INTERNAL, "cuTensorMapEncodeTiled is not available");
  cuuint64_t dims[2] = {inner, outer}, strides[1] = {row_bytes};
  cuuint32_t box[2] = {box0, box1}, estr[2] = {1, 1};
  CUresult r = fn(m, dt, 2, const_cast<void *>(base), dims, strides, box, estr,
                  CU_TENSOR_MAP_INTERLEAVE_NONE,
                  swz ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return mm_error(MEGAMOE_CODE_INTERNAL,
                    "cuTensorMapEncodeTiled failed (%d) for [%llu, %llu] box {%u, %u}", (int)r,
                    (unsigned long long)outer, (unsigned long long)inner, box0, box1);
  return NULL;
}

}  // namespace

#endif

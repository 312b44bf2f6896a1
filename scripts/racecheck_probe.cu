// racecheck_probe.cu -- a reproducer for a compute-sanitizer racecheck false
// positive that the prefill kernel's narrow units met (docs/RELIABILITY.md,
// the narrow units' racecheck row): two consumer warpgroups exchange partial
// maxima through shared memory, ordered by a 256-thread named barrier
// (bar.sync 3, 256) before and after the reads. When the first warpgroup has
// passed its own 128-thread barrier more often than the second has passed
// its own (as the prefill kernel's wide-unit epilogues make them), racecheck
// reports RAW hazards from the first warpgroup's stores to the second's
// loads across barrier 3, although the barrier orders them and every value
// checks out. The prefill kernel now exchanges through mbarriers instead.
// Standalone on purpose: kernels/sm90_ptx.h, whose wrappers these repeat
// instruction for instruction, brings host code that needs the plugin's
// library.
//
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/racecheck_probe scripts/racecheck_probe.cu
//   compute-sanitizer --tool racecheck /tmp/racecheck_probe FLAGS [UNITS]
//
// FLAGS, a bit mask of the kernel's other ingredients:
//   1 a cluster of 2 CTAs with cluster barriers    2 setmaxnreg
//   4 an mbarrier ring between a producer thread and the consumers
//   8 each warpgroup passes its own named barrier (1 + warpgroup) once a unit
//  16 the first warpgroup passes its own barrier twice more a unit
// Measured (H100, compute-sanitizer 2025.3.1, sixty-first stop): masks 0-15
// 0 hazards; masks 16-31 4-8 hazards in the default report (mask 16: 4576
// errors with --racecheck-report hazard); 0 values wrong under every mask. The program checks every output against a
// host computation and exits 1 on a wrong value, 2 on a CUDA error.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

namespace {

constexpr int kThreads = 384, kConsumers = 256, kStages = 4, kCols = 16;

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init(uint64_t *b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t *b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *b, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile("{\n.reg .pred p;\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, 0x989680;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(smem_addr(b)), "r"(parity)
                 : "memory");
  } while (!done);
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// the value thread `tid` of block `blk` contributes to column (j, b) in unit u;
// small integers, so the sums below are exact in float
__host__ __device__ float probe_value(int u, int tid, int j, int b, int blk) {
  return (float)((u * 131 + tid * 7 + j * 3 + b) % 97) + (float)blk;
}

__global__ void __launch_bounds__(kThreads, 1) probe(int flags, int units, float *out) {
  __shared__ float red[8 * kCols];
  __shared__ uint64_t full[kStages], empty[kStages];
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; s++) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (flags & 1) cluster_sync();
  if (wg == 0) { // the producer warpgroup
    if (flags & 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if ((flags & 4) && threadIdx.x == 0) {
      int stage = 0;
      uint32_t phase = 0;
      for (int u = 0; u < units; u++) {
        mbar_wait(&empty[stage], phase ^ 1);
        mbar_arrive(&full[stage]);
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      }
    }
    if (flags & 1) cluster_sync();
    return;
  }
  if (flags & 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int c = wg - 1, t = threadIdx.x % 128, w = t / 32, l = t % 32, q = l % 4;
  int stage = 0;
  uint32_t phase = 0;
  float acc = 0.0f;
  for (int u = 0; u < units; u++) {
    if (flags & 4) mbar_wait(&full[stage], phase);
    float v[2][2];
    for (int j = 0; j < 2; j++)
      for (int b = 0; b < 2; b++) v[j][b] = probe_value(u, threadIdx.x, j, b, blockIdx.x);
    if (flags & 4) {
      mbar_arrive(&empty[stage]);
      if (++stage == kStages) { stage = 0; phase ^= 1; }
    }
    // the warp's maximum over its lanes of one q, stored per warp
    for (int j = 0; j < 2; j++)
      for (int b = 0; b < 2; b++) {
        float m = v[j][b];
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
        if (l < 4) red[(4 * c + w) * kCols + 8 * j + 2 * q + b] = m;
      }
    named_sync(3, kConsumers); // partial maxima written
    for (int j = 0; j < 2; j++)
      for (int b = 0; b < 2; b++) {
        float m = 0.0f;
        for (int k = 0; k < 8; k++) m = fmaxf(m, red[k * kCols + 8 * j + 2 * q + b]);
        acc += m;
      }
    named_sync(3, kConsumers); // read before the next unit's stores
    if (flags & 8) named_sync(1 + c, 128);
    if ((flags & 16) && c == 0) { // unequal counts per warpgroup
      named_sync(1 + c, 128);
      named_sync(1 + c, 128);
    }
  }
  out[blockIdx.x * kThreads + threadIdx.x] = acc;
  if (flags & 1) cluster_sync();
}

// what consumer thread tid of block blk must hold: per unit, for each (j, b),
// the largest value over the 256 consumer threads whose lane % 4 equals its own
float expected(int units, int tid, int blk) {
  const int q = tid % 4;
  float acc = 0.0f;
  for (int u = 0; u < units; u++)
    for (int j = 0; j < 2; j++)
      for (int b = 0; b < 2; b++) {
        float m = 0.0f;
        for (int s = 128 + q; s < kThreads; s += 4) m = fmaxf(m, probe_value(u, s, j, b, blk));
        acc += m;
      }
  return acc;
}

} // namespace

int main(int argc, char **argv) {
  const int flags = argc > 1 ? atoi(argv[1]) : 0, units = argc > 2 ? atoi(argv[2]) : 64;
  if (flags < 0 || flags > 31 || units < 1 || units > 100000) {
    fprintf(stderr, "usage: racecheck_probe [FLAGS 0-31] [UNITS 1-100000]\n");
    return 2;
  }
  float *out = nullptr;
  float host[2 * kThreads];
  cudaError_t e = cudaMalloc(&out, sizeof host);
  if (e == cudaSuccess) e = cudaMemset(out, 0xff, sizeof host); // NaN: unwritten values fail
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  cfg.gridDim = dim3(2);
  cfg.blockDim = dim3(kThreads);
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 2;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = (flags & 1) ? 1 : 0;
  if (e == cudaSuccess) e = cudaLaunchKernelEx(&cfg, probe, flags, units, out);
  if (e == cudaSuccess) e = cudaMemcpy(host, out, sizeof host, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) {
    printf("racecheck_probe flags %d units %d: %s\n", flags, units, cudaGetErrorString(e));
    return 2;
  }
  int wrong = 0;
  for (int blk = 0; blk < 2; blk++)
    for (int tid = 128; tid < kThreads; tid++)
      if (!(host[blk * kThreads + tid] == expected(units, tid, blk))) wrong++;
  printf("racecheck_probe flags %d units %d: %d of %d values wrong\n", flags, units, wrong,
         2 * kConsumers);
  cudaFree(out);
  return wrong ? 1 : 0;
}

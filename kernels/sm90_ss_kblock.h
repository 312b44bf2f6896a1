/* sm90_ss_kblock.h -- one 128-wide K block of the tokens-as-A SS GEMM (the
 * prefill path, moe_sm90_prefill.cu, and its probe, probe_prefill.cu):
 * C++/CUDA only; include after sm90_ptx.h. Everything sits in the including
 * file's unnamed namespace. */
#ifndef MM_SM90_SS_KBLOCK_H
#define MM_SM90_SS_KBLOCK_H

namespace {

/* A consumer warpgroup's K block in two halves, so that the next block's
 * MMAs can be queued before this one's promotion (the prefill path keeps
 * two accumulators):
 * - ss_issue: four m64n128k32 MMAs from the stage's token tile (da: the
 *   descriptor of its 64 rows) and weight tile (db: of its 128 rows), both
 *   K-major with 128B swizzle, into acc, as one commit group;
 * - ss_promote: waits until at most kPending groups are in flight (acc's is
 *   then done), releases the stage and adds acc times the token scale of
 *   the thread's rows r0 and r0 + 8 (sc: the stage's scales of the
 *   warpgroup's rows) to fin, the one promotion per block.
 * The stage is released as soon as its last read is done: in clusters of
 * kCS > 1 CTAs (whose copies write into every CTA's stage) by lane 0 of
 * each warp, on this CTA's barrier and on the kCS - 1 peers' (peer_empty:
 * their barriers' shared::cluster addresses, stage offset included; plain,
 * CTA-scope remote arrives: with .release.cluster each waited for a
 * cluster-scope fence and the probe ran at half speed, docs/PERF.md version
 * 20), the lanes' reads ordered before it by their proxy fences and the
 * warp barrier; else by every thread. */
__device__ __forceinline__ void ss_issue(uint64_t da, uint64_t db, float (&acc)[64]) {
  fence_acc(acc);
  wg_fence();
#pragma unroll
  for (int k = 0; k < 4; k++) mma_ss128(acc, da + 2 * k, db + 2 * k, k);
  wg_commit();
  fence_acc(acc);
}

/* The release of a stage (see above): after the thread's reads, by lane 0
 * of each warp on this CTA's barrier and the peers' in clusters, else by
 * every thread. */
template <int kCS>
__device__ __forceinline__ void ss_release(uint64_t *empty, const uint32_t *peer_empty) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  if (kCS > 1) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) {
      mbar_arrive(empty);
#pragma unroll
      for (int i = 0; i < kCS - 1; i++)
        asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(peer_empty[i]) : "memory");
    }
  } else {
    mbar_arrive(empty);
  }
}

template <int kCS, int kPending>
__device__ __forceinline__ void ss_promote(const float *sc, int r0, uint64_t *empty,
                                           const uint32_t *peer_empty, float (&acc)[64],
                                           float (&fin)[64]) {
  wg_wait<kPending>();
  fence_acc(acc); /* acc's reads stay after the wait */
  const float s0 = sc[r0], s1 = sc[r0 + 8];
  ss_release<kCS>(empty, peer_empty);
#pragma unroll
  for (int j = 0; j < 16; j++) {
    fin[4 * j] = fmaf(acc[4 * j], s0, fin[4 * j]);
    fin[4 * j + 1] = fmaf(acc[4 * j + 1], s0, fin[4 * j + 1]);
    fin[4 * j + 2] = fmaf(acc[4 * j + 2], s1, fin[4 * j + 2]);
    fin[4 * j + 3] = fmaf(acc[4 * j + 3], s1, fin[4 * j + 3]);
  }
}

/* Both halves at once: one accumulator, the MMAs done before the promotion. */
template <int kCS>
__device__ __forceinline__ void ss_kblock(const uint8_t *a, const uint8_t *b, const float *sc,
                                          int r0, uint64_t *empty, const uint32_t *peer_empty,
                                          float (&acc)[64], float (&fin)[64]) {
  ss_issue(desc_b(smem_u32(a)), desc_b(smem_u32(b)), acc);
  ss_promote<kCS, 0>(sc, r0, empty, peer_empty, acc, fin);
}

}  // namespace

#endif

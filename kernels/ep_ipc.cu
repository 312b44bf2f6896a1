// ep_ipc.cu -- the low-latency exchanges over CUDA IPC peer pointers: each
// rank pushes its segment for peer r straight into r's receive buffer (the
// layout of ep_kernels.h mm_ep_ipc_dev), with a two-flag handshake per
// exchange:
//   1. every block stores ready[me] = e on every peer ("my buffers are free
//      for exchange e": everything that read them is earlier on my stream);
//   2. every block waits for ready[p] >= e of every peer, then copies its
//      share of the rows;
//   3. the last block to finish (a counter in local memory) fences and stores
//      data[me] = e on every peer, then waits for data[p] >= e of every peer.
// e = local epoch + 1; the last block advances the epoch, so the exchange is
// the same kernel on every call and a captured graph replays correctly.
// Every spin gives up after timeout_ns (globaltimer): it records
// MM_EP_ERR_PEER_TIMEOUT with the peer and marks the transport failed, after
// which every exchange returns at once (the host then aborts the op).
#include <cuda_runtime.h>
#include <stdint.h>

#include "ep_kernels.h"

namespace {

// Data exchanges: one block per 64 KiB of the segments' capacity, 4 to 64
// blocks (few for a handful of tokens, enough SMs to keep NVLink busy at
// hundreds). The receivers do not depend on the sender's grid.
constexpr int kMinBlocks = 4, kMaxBlocks = 64;
constexpr int64_t kBytesPerBlock = 64 << 10;
constexpr int kCopyThreads = 512;
constexpr int kCountThreads = 128;

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t *p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t *peer_word(const mm_ep_ipc_dev &x, int q, int64_t off) {
  return reinterpret_cast<uint64_t *>(x.peer_base[q] + off) + x.rank;
}

__device__ __forceinline__ bool failed(const mm_ep_ipc_dev &x) {
  return *reinterpret_cast<volatile uint64_t *>(x.local + 2) != 0;
}

__device__ void flag_timeout(const mm_ep_dev &d, const mm_ep_ipc_dev &x, int peer) {
  atomicOr(&d.err[0], MM_EP_ERR_PEER_TIMEOUT);
  atomicCAS(&d.err[1], 0, peer + 1);
  atomicExch(reinterpret_cast<unsigned long long *>(x.local + 2), 1ull);
}

// Waits for *p >= e. Returns false on timeout (recorded) or when another
// block already failed the transport.
__device__ bool wait_for(const mm_ep_dev &d, const mm_ep_ipc_dev &x, const uint64_t *p, uint64_t e,
                         int peer, uint64_t deadline) {
  for (uint32_t i = 0;; i++) {
    if (ld_acquire_sys(p) >= e) return true;
    if ((i & 31) == 31) {
      if (failed(x)) return false;
      if (globaltimer() > deadline) {
        flag_timeout(d, x, peer);
        return false;
      }
    }
  }
}

// n 16-byte words, strided over the grid, four loads in flight per thread.
__device__ __forceinline__ void copy16(const uint4 *src, uint4 *dst, int64_t n, int64_t i,
                                       int64_t stride) {
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], e = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = e;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

__device__ __forceinline__ int64_t clamp_rows(int64_t n, int64_t cap) {
  return n < 0 ? 0 : n > cap ? cap : n;
}

__global__ void __launch_bounds__(kCopyThreads) exchange_kernel(mm_ep_dev d, mm_ep_ipc_dev x,
                                                                int kind) {
  __shared__ int s_ok, s_last;
  const int R = x.ranks, me = x.rank, L = 2 * R + 4, tid = threadIdx.x;
  // Read before this block counts itself done: the last block advances it.
  const uint64_t e = *reinterpret_cast<volatile uint64_t *>(x.local) + 1;
  const uint64_t deadline = globaltimer() + (uint64_t)x.timeout_ns;
  if (tid == 0) s_ok = !failed(x);
  __syncthreads();
  // Every block announces (the same value): no block depends on another
  // block of its own grid being scheduled. This rank's own buffers need no
  // flags: its stream orders their readers before this kernel.
  if (s_ok) {
    for (int q = tid; q < R; q += blockDim.x)
      if (q != me) st_release_sys(peer_word(x, q, x.ready_off), e);
    for (int q = tid; q < R; q += blockDim.x)
      if (q != me) wait_for(d, x, x.ready + q, e, q, deadline);
  }
  __syncthreads();
  if (tid == 0) s_ok = s_ok && !failed(x);
  __syncthreads();
  if (s_ok) {
    if (kind == MM_EP_IPC_COUNTS) {
      const int32_t *mine = d.counts + (int64_t)me * L;
      for (int i = tid; i < R * L; i += blockDim.x) {
        const int q = i / L;
        if (q == me) continue; // already in place
        int32_t *dst = reinterpret_cast<int32_t *>(x.peer_base[q] + x.counts_off);
        dst[(int64_t)me * L + i % L] = mine[i % L];
      }
    } else {
      const bool disp = kind == MM_EP_IPC_DISPATCH;
      const int64_t rb = disp ? d.row_bytes : (int64_t)d.hidden * 2;
      const int64_t stride = disp ? d.tok_stride : d.pair_stride;
      const uint8_t *send = disp ? d.send : reinterpret_cast<const uint8_t *>(d.csend);
      const int64_t t0 = (int64_t)blockIdx.x * blockDim.x + tid, nt = (int64_t)gridDim.x * blockDim.x;
      for (int i = 0; i < R; i++) {
        const int q = (me + 1 + i) % R; // ranks start on different peers
        // Rows the receiver reads: mine for it (dispatch), its pairs here (combine).
        const int64_t rows = clamp_rows(
            disp ? d.counts[(int64_t)me * L + MM_EP_CNT_TOK(R, q)]
                 : d.counts[(int64_t)q * L + MM_EP_CNT_PAIR(R, me)], stride);
        const uint4 *src = reinterpret_cast<const uint4 *>(send + (int64_t)q * stride * rb);
        uint4 *dst = reinterpret_cast<uint4 *>(x.peer_base[q] + x.payload_off +
                                               (int64_t)me * stride * rb);
        copy16(src, dst, rows * rb / 16, t0, nt);
      }
    }
  }
  // The block's stores (ordered by the barrier), fenced at system scope,
  // before it counts itself done (the pattern of a flag after a barrier).
  __syncthreads();
  if (tid == 0) {
    __threadfence_system();
    s_last = atomicAdd(reinterpret_cast<unsigned long long *>(x.local + 1), 1ull) ==
             (unsigned long long)gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;
  if (tid == 0) s_ok = !failed(x);
  __threadfence_system(); // the other blocks' stores (fenced before they counted) before the flags
  __syncthreads();
  if (s_ok) {
    for (int q = tid; q < R; q += blockDim.x)
      if (q != me) st_release_sys(peer_word(x, q, x.data_off), e);
    for (int q = tid; q < R; q += blockDim.x)
      if (q != me) wait_for(d, x, x.data + q, e, q, deadline);
  }
  __syncthreads();
  if (tid == 0) {
    x.local[1] = 0;
    x.local[0] = e;
  }
}

} // namespace

extern "C" int mm_ep_launch_ipc_exchange(const mm_ep_dev *d, const mm_ep_ipc_dev *x, int kind,
                                         void *stream) {
  if (kind < MM_EP_IPC_COUNTS || kind > MM_EP_IPC_COMBINE) return (int)cudaErrorInvalidValue;
  const bool counts = kind == MM_EP_IPC_COUNTS;
  const int64_t cap = kind == MM_EP_IPC_DISPATCH
                          ? (int64_t)d->ranks * d->tok_stride * d->row_bytes
                          : (int64_t)d->ranks * d->pair_stride * d->hidden * 2;
  int64_t blocks = cap / kBytesPerBlock;
  blocks = blocks < kMinBlocks ? kMinBlocks : blocks > kMaxBlocks ? kMaxBlocks : blocks;
  exchange_kernel<<<counts ? 1 : (int)blocks, counts ? kCountThreads : kCopyThreads, 0,
                    (cudaStream_t)stream>>>(*d, *x, kind);
  return (int)cudaGetLastError();
}

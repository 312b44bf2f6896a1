/* moe_sm90_prefill.cu -- the FP8 modes' prefill path (modes 1 and 3;
 * docs/ARCHITECTURE.md; docs/PERF.md, versions 20-21, 25): pools with some
 * hundreds of rows per expert, where moe_sm90_wgmma.cu's kernels are held
 * by their consumers' instruction chain (decode, 32 token-scale loads per K
 * block).
 *
 * The GEMMs turn around: tokens are the WGMMA A operand and the weights,
 * as E4M3, the B operand, both tensor-copied K-major with 128B swizzle
 * (m64n128k32 SS WGMMAs). The promotion takes one token scale per row and
 * K block, and no decode sits in the consumers' chain: the producer
 * warpgroup's warps 1-3 decode the records once per call into an E4M3
 * workspace, expert by expert ahead of the GEMM and beside it
 * (sm90_record_decode.h). Decode tasks are claimed from a counter, so every
 * task belongs to a running CTA whatever else holds SMs; a CTA waits for an
 * expert's tasks before its first copy of that expert's weights. A task is
 * some K blocks of a 64-row tile, sized so that every decoder warp gets
 * about one task of each expert (mm_sm90_prefill_task_kblocks): the first
 * launch starts with all of them on its first expert (docs/PERF.md, version
 * 44). Once a launch's own tasks are claimed, its decoder warps decode the
 * next launch's first experts (decode ahead, PfParams::nx), into slots that
 * the running launch does not read (mm_sm90_prefill_slot), so that the
 * later launches start on decoded weights (version 45). Every launch after
 * a call's first is a programmatic dependent of the one before (overlap):
 * its CTAs start as that launch's CTAs end; its decoders wait for that
 * launch's end, since they write slots it may read, and an L2 launch reads
 * a token tile's intermediate once L1 has counted all of its units of it
 * (PfParams::tiles; version 46).
 *
 * Only matrices whose reference exponents are all 0 (the layer's
 * refs_zero: the row anchor moved every row's reference into its row
 * factor): the records' values are then the weights over the row factor,
 * which the epilogues apply per column. The two modes differ only in their
 * records, so only the decode knows the mode: the GEMMs see E4M3 weights.
 *
 * Per kernel: a persistent grid of clusters of 2 CTAs on neighbouring token
 * tiles of one expert, each CTA copying half of the weight tile into both
 * (multicast); an expert's odd last token tile, or its last set where the
 * last tile holds at most 64 rows, goes to both CTAs with different column
 * tiles (PfUnit::split), and a large expert's tiles are walked in raster
 * groups (mm_sm90_prefill_unit, plugin/layout_sm90.h). A warpgroup without
 * rows in a tile only releases its stages, so that a tile of at most 64
 * rows takes one warpgroup's MMAs (docs/PERF.md, version 28).
 * One producer warpgroup (thread 0: copies; warps 1-3: decode) and two
 * consumer warpgroups, each with two accumulators, so that a K
 * block's MMAs run while the previous block's sums are promoted.
 * Both GEMMs run 128 x 128 tiles, 64 tokens per warpgroup:
 * - L1: units of 128 tokens and 256 layout rows of w13, the gates and ups
 *   of 128 channels (docs/LAYOUTS.md, "Row order"), in two passes of 128
 *   rows. A row's 128 channels are then its warpgroup's alone: the first
 *   pass's SwiGLU values wait in shared memory until the second pass's
 *   epilogue (top-k weight, FP8 per 128 channels, ref_moe.h's order)
 *   writes the intermediate and its scales. (64 x 256 tiles, the
 *   warpgroups splitting the columns, filled a fourth more shared memory
 *   per FLOP: up to 4% slower from 896 rows per expert, up to 3% faster at
 *   448-768, where the units of twice the work leave longer tails;
 *   docs/PERF.md, version 27.)
 * - L2: units of 128 tokens and 128 rows of w2; BF16 out through the row
 *   map.
 * mm_sm90_prefill_chunk experts (compute.prefill-experts, at most kChunk)
 * per launch pair, whose weights the workspace holds; L2 reuses L1's. */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <string.h>

#include <atomic>
#include <type_traits>

#include "moe_sm90_impl.h"
#include "sm90_ptx.h"
#include "sm90_record_decode.h"
#include "sm90_ss_kblock.h"

extern "C" {
#include "formats.h"
}

namespace {

constexpr int kChunk = MM_SM90_PREFILL_CHUNK; /* the most experts per launch pair */
/* CTAs per cluster, each copying 1 / kClusterSize of the weight tile into
 * all: clusters of 4 were no faster at M = 32768 and 8% slower on routed
 * loads, whose odd tile counts leave more CTAs without rows (docs/PERF.md,
 * version 21) */
constexpr int kClusterSize = 2;
/* K blocks per run of the consumers' two accumulators: runs of 8 were 2-5%
 * faster than one accumulator at 24576-65536 rows, runs of 16 no faster
 * (docs/PERF.md, version 22) */
constexpr int kRun = 8;
/* L1 units per release of their token tiles' counts (overlap) */
constexpr int kTileBatch = 4;
/* registers: the producer warpgroup (copies, decode: it spills at 64) and
 * each consumer warpgroup (two accumulators and the promoted sums, 192);
 * the pool of 384 x 168 must hold them */
constexpr int kProducerRegs = 72, kConsumerRegs = 216;
static_assert(kProducerRegs + 2 * kConsumerRegs <= 3 * 168, "register pool over-committed");

struct PfParams {
  const uint8_t *w;   /* layer records */
  size_t expert_bytes, mat_off;
  const float *rs;    /* row factors [E][N] of the matrix */
  const uint8_t *lut; /* the fold table, copied to shared memory: mode 1's entries (k, 0), mode 3's all */
  int mode;           /* the records' mode: 1 or 3 (RecFmt) */
  const int32_t *offsets;
  int e0, E;          /* this launch's experts [e0, e0 + E) */
  int N, K;           /* the matrix: N layout rows (GEMM columns), K columns */
  int M, Mp;
  /* L1 */
  const float *row_weight;
  float clamp;
  const float *silu; /* silu of every BF16 value (moe_sm90_wgmma.cu) */
  uint8_t *act;      /* [Mp][N / 2] FP8 */
  float *as_t;       /* [N / 256][Mp] */
  /* L2 */
  uint16_t *out;     /* [M][N] BF16 */
  const int32_t *out_rows;
  int *ready;        /* [E]: finished decode tasks per expert; [E]: tasks claimed;
                      * [kChunk + 1]: tasks claimed by the previous launch (decode ahead) */
  int narrow;        /* small last tiles with the operands turned around (narrow_unit) */
  /* overlap: the launch may start while the one before it runs; tiles: per
   * token tile, at its first pool row, L1's warpgroup units of it that are
   * stored (2 per L1 column tile), which L2 waits for */
  int overlap;
  int *tiles;
  int task_kb;       /* K blocks per decode task (mm_sm90_prefill_task_kblocks) */
  int gemm, chunk;   /* this launch's GEMM and the experts a chunk (mm_sm90_prefill_slot) */
  int pre;           /* its first experts whose tasks the previous launch decoded */
  /* decode ahead (mm_sm90_prefill_slot): the next launch's experts, matrix
   * (the other GEMM's: launches alternate) and counts, and how many of its
   * first experts' tasks this launch's decoder warps may claim once their
   * own are done (0: none) */
  struct {
    int ahead, e0, E, N, K, task_kb;
    size_t mat_off;
    int *ready;
  } nx;
};

template <int GEMM>
struct PfCfg {
  static constexpr int kPasses = GEMM == 1 ? 2 : 1;
  /* BN: a unit's column tile; BNP: a pass's (a stage's weight rows) */
  static constexpr int BM = 128, BN = 128 * kPasses, BNP = 128;
  static constexpr int kA = BM * 128, kB = BNP * 128;
  static constexpr int kStage = kA + kB; /* a stage's tiles, 1024-aligned */
  /* a token tile of at most this many rows (an expert's last) runs with the
   * operands turned around (the consumers' narrow_unit; 0: never). L1 only
   * to 16: with m64n24 or m64n32 tiles ptxas spilled 12 bytes in L1's wide
   * tiles. */
  static constexpr int kNarrowMax = GEMM == 1 ? 16 : 32;
  static constexpr int kScaleBox = BM + 4; /* token scales from row0 & ~3 */
  /* the token scales' ring beside the tiles' (a tensor copy's destination:
   * 128-byte aligned). As a third part of each 1024-aligned stage they took
   * 1024 bytes a stage, which left no room for mode 3's fold table. */
  static constexpr int kSlot = (4 * kScaleBox + 127) / 128 * 128;
  /* per consumer: L1's first-pass values (32 per thread, FP32), then its
   * FP8 codes (64 rows x 128 channels); L2's 64 rows x 128 BF16 columns */
  static constexpr int kStg = 2 * 16384;
  static constexpr int kDec = 3 * 8192;   /* per decoder warp: two 32 x 128 tiles */
  /* the fold table: mode 1's compact one (its 26 entries (k, 0), 256
   * bytes), or mode 3's whole one (208 entries, 1664 bytes) */
  static constexpr int kLut = 2048;
  static constexpr int kFixed = kStg + kDec + kLut + 2048 + 1024 + 1024 + 256;
  static constexpr int kStages0 = (232448 - 1024 - kFixed) / (kStage + kSlot);
  static constexpr int kStages = kStages0 > 8 ? 8 : kStages0;
  static constexpr int kOffStg = kStages * kStage;
  static constexpr int kOffDec = kOffStg + kStg;   /* 1024-aligned: swizzled tiles */
  static constexpr int kOffLut = kOffDec + kDec;   /* fold table, 256-aligned */
  static constexpr int kOffFac = kOffLut + kLut;   /* row factors [2 wg][2 parity][128] */
  static constexpr int kOffRed = kOffFac + 2048;   /* L2's out rows [2 wg][2 parity][64] */
  static constexpr int kOffSched = kOffRed + 1024; /* unit and task prefixes, offsets */
  static constexpr int kOffScl = kOffSched + 1024; /* token scales [kStages][kSlot] */
  static constexpr int kOffBar = kOffScl + kStages * kSlot;
  static constexpr int kBytes = kOffBar + 256 + 1024;
  static_assert(kBytes <= 232448, "shared memory");
  static_assert(MM_SM90_LUT_ENTRIES * 8 <= kLut, "mode 3's fold table");
  static_assert(kStages >= 3, "at least three stages");
  static_assert((2 * kStages + 2) * 8 <= 256, "barriers: full, empty, the narrow exchange's two");
  static_assert((5 * (kChunk + 1) + 2 * kTileBatch + 1) * 4 <= 1024, "schedule arrays");
};

/* the rings' depths on an H200's 227 KB: in 64 x 256 tiles, one stage
 * fewer in L1 ran 11% slower at M = 32768 (docs/PERF.md, version 24) */
static_assert(PfCfg<1>::kStages == 5 && PfCfg<2>::kStages == 5, "stage counts");

/* a descriptor from its low word (desc_b's high word: 1024-byte stride,
 * 128B swizzle) */
__device__ __forceinline__ uint64_t desc_lo(uint32_t lo) {
  uint64_t d;
  asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo), "r"(0x40000040u));
  return d;
}
/* silu table entry i: the address in one wide multiply-add (the compiler's
 * own form took a shift and a 64-bit add, three instructions) */
__device__ __forceinline__ float silu_entry(const float *table, uint32_t i) {
  const float *a;
  asm("mad.wide.u32 %0, %1, 4, %2;" : "=l"(a) : "r"(i), "l"(table));
  return __ldg(a);
}
/* min / max that return NaN when either operand is NaN (fminf / fmaxf
 * return the other operand) */
__device__ __forceinline__ float fmin_nan(float a, float b) {
  float d;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
/* Two values to E4M3 in one conversion: x in the low byte. */
__device__ __forceinline__ uint32_t to_e4m3x2(float x, float y) {
  return __nv_cvt_float2_to_fp8x2(make_float2(x, y), __NV_SATFINITE, __NV_E4M3);
}
/* A gate and an up rounded to BF16 in one conversion (the same bits as two
 * roundings), returned as floats: one conversion and two masks instead of
 * two conversions and two shifts */
__device__ __forceinline__ void to_bf16_pair(float g, float u, float &gb, float &ub) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(u), "f"(g)); /* g low, u high */
  gb = __uint_as_float(d << 16);
  ub = __uint_as_float(d & 0xFFFF0000u);
}

/* silu(gate) * up of a BF16 gate and up, as ref_moe.h orders it; clamped:
 * the activation clamp first (gate <= c, up in [-c, c]). A BF16 gate's silu
 * comes from the table (its index is in the table whatever the gate); a
 * clamped one that BF16 cannot hold is the clamp itself, whose silu is
 * silu_c. The gate keeps a NaN's bits (min.NaN would make it the canonical
 * NaN, whose low half is not 0: silu_c), the up may become the canonical
 * NaN, a NaN all the same. */
template <bool kClamped>
__device__ __forceinline__ float silu_up(float gt, float up, float clamp, float silu_c,
                                         const float *silu) {
  if constexpr (kClamped) {
    gt = mm_clamp_gate(gt, clamp);
    up = fmax_nan(fmin_nan(up, clamp), -clamp);
    const uint32_t gb = __float_as_uint(gt);
    const float s = silu_entry(silu, gb >> 16);
    return ((gb & 0xFFFFu) ? silu_c : s) * up;
  } else {
    return silu_entry(silu, __float_as_uint(gt) >> 16) * up;
  }
}

/* A work unit: expert e (of the launch), token tile mt (of the expert's),
 * column tile nt; row0 the pool row of the tile's first token (a tile past
 * the expert's rows, in a cluster's last set, re-reads its first tile),
 * valid its rows of the expert. split: one of an expert's last token tiles
 * (mm_sm90_prefill_unit): every CTA of the cluster takes it, each with its
 * own column tile, copied whole without multicast (a column tile past the
 * matrix re-reads the last one, valid 0). A last tile alone in its set is
 * split, since the set's other CTAs would only wait beside it; so is the
 * last set when its last tile holds at most 64 rows, since that tile's one
 * busy warpgroup would otherwise keep the pace of its peer's full tile. */
struct PfUnit {
  int e, nt, row0, valid, split;
};

/* Expert e's pool rows [a, b), read from the offsets as the kernel trusts
 * them: an offset outside [0, M] or below the one before makes the expert
 * empty, never a row outside the pool. */
__device__ __forceinline__ void expert_rows(const int32_t *offsets, int e, int M, int &a, int &b) {
  a = min(max(offsets[e], 0), M);
  b = min(max(offsets[e + 1], a), M);
}

template <int GEMM, int CS>
__global__ void __launch_bounds__(384, 1)
    prefill_kernel(const PfParams p, const __grid_constant__ CUtensorMap ta,
                   const __grid_constant__ CUtensorMap ts, const __grid_constant__ CUtensorMap tb,
                   const __grid_constant__ CUtensorMap tw, const __grid_constant__ CUtensorMap tah,
                   const __grid_constant__ CUtensorMap tq,
                   const __grid_constant__ CUtensorMap tw_next) {
  using G = PfCfg<GEMM>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t *sm = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  uint64_t *full = (uint64_t *)(sm + G::kOffBar), *empty = full + G::kStages;
  uint64_t *const xbar = empty + G::kStages; /* [2]: narrow_unit's exchange */
  /* units: each expert's token tiles in groups of CS (one per CTA of a
   * cluster) times the column tiles; decode tasks: task_kb records of a
   * 64-row tile */
  int *uoff = (int *)(sm + G::kOffSched), *toff = uoff + kChunk + 1;
  int *rbeg = toff + kChunk + 1, *rend = rbeg + kChunk + 1; /* each expert's pool rows */
  int *xoff = rend + kChunk + 1; /* the next launch's task prefixes (decode ahead) */
  int *pend0 = xoff + kChunk + 1; /* each consumer warpgroup's uncounted token tiles */
  /* the decoders' first task, past those the launch before decoded: read
   * at a fixed offset (an address kept in a register made them spill) */
  int *const tpre = (int *)(sm + G::kOffSched) + 5 * (kChunk + 1) + 2 * kTileBatch;
  const int wg = threadIdx.x / 128, KB = p.K / 128, NT = p.N / G::BN;
  const int groups = (KB + p.task_kb - 1) / p.task_kb, tasks_pe = p.N / 64 * groups;
  uint32_t crank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(crank));
  /* an expert whose last token tile holds at most one warpgroup's rows:
   * that tile's units are split, so that no peer's full tile paces them */
  auto small_last = [](int rows) { return rows % G::BM != 0 && rows % G::BM <= G::BM / 2; };
  if (threadIdx.x == 0) {
    for (int s = 0; s < G::kStages; s++) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8 * CS); /* one arrive per consumer warp of every CTA */
    }
    /* the narrow units' exchange: every consumer thread arrives */
    mbar_init(xbar, 256);
    mbar_init(xbar + 1, 256);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    uoff[0] = toff[0] = 0;
    for (int e = 0; e < p.E; e++) {
      int a, b;
      expert_rows(p.offsets, p.e0 + e, p.M, a, b);
      rbeg[e] = a;
      rend[e] = b;
      uoff[e + 1] = uoff[e] + mm_sm90_prefill_units((b - a + G::BM - 1) / G::BM, CS, NT,
                                                    small_last(b - a));
      toff[e + 1] = toff[e] + (b > a ? tasks_pe : 0);
    }
    *tpre = toff[min(p.pre, p.E)];
    /* the next launch's tasks, as that launch counts them */
    const int nxg = (p.nx.K / 128 + p.nx.task_kb - 1) / max(p.nx.task_kb, 1);
    xoff[0] = 0;
    for (int e = 0; e < min(p.nx.ahead, p.nx.E); e++) {
      int a, b;
      expert_rows(p.offsets, p.nx.e0 + e, p.M, a, b);
      xoff[e + 1] = xoff[e] + (b > a ? p.nx.N / 64 * nxg : 0);
    }
  }
  if (p.mode == 3) { /* the whole fold table */
    for (int i = threadIdx.x; i < MM_SM90_LUT_ENTRIES * 2; i += blockDim.x)
      ((uint32_t *)(sm + G::kOffLut))[i] = ((const uint32_t *)p.lut)[i];
  } else if (threadIdx.x >= 32 && threadIdx.x < 96) { /* the compact one: entries (k, 0) */
    const int i = threadIdx.x - 32;
    const int src = (i >> 1) * 16 + (i & 1);
    ((uint32_t *)(sm + G::kOffLut))[i] =
        src < MM_SM90_LUT_ENTRIES * 2 ? ((const uint32_t *)p.lut)[src] : 0u;
  }
  __syncthreads();
  cluster_sync();
  /* the next launch may start as this one's CTAs end (overlap) */
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int ustep = gridDim.x / CS, ufirst = blockIdx.x / CS, nunits = uoff[p.E];
  int cur = 0;
  auto unit_of = [&](int u) {
    while (uoff[cur + 1] <= u) cur++;
    PfUnit un;
    un.e = cur;
    /* raster groups and split last tiles (mm_sm90_prefill_unit): where
     * all sets of a large expert went for one column tile at a time, every
     * column tile streamed its tokens from HBM again (docs/PERF.md,
     * version 23) */
    const int a = rbeg[cur], rows = rend[cur] - a, tiles = (rows + G::BM - 1) / G::BM;
    int mt;
    mm_sm90_prefill_unit(tiles, CS, NT, small_last(rows), (int)crank, u - uoff[cur], &mt, &un.nt,
                         &un.split);
    const bool past = un.nt >= NT;
    un.nt = min(un.nt, NT - 1);
    un.valid = past ? 0 : min(max(rows - mt * G::BM, 0), G::BM);
    un.row0 = un.valid > 0 ? a + mt * G::BM : a;
    return un;
  };

  if (wg == 0) {
    set_max_regs_dec<kProducerRegs>();
    if (threadIdx.x >= 32) { /* decoder warps */
      const int wj = threadIdx.x / 32 - 1, lane = threadIdx.x % 32;
      uint8_t *bufs = sm + G::kOffDec + wj * 8192;
      /* one task loop per record mode (its record size and decode are
       * compile-time constants in each) */
      auto decode_tasks = [&](auto mode) {
        constexpr int MODE = decltype(mode)::value;
        int n = 0, dcur = 0;
        /* the launch before has ended and its writes are visible: it may
         * read the slots this launch's decoders write (overlap) */
        if (p.overlap) asm volatile("griddepcontrol.wait;" ::: "memory");
        for (;;) {
          int t = 0;
          if (lane == 0) t = *tpre + atomicAdd(p.ready + p.E, 1);
          t = __shfl_sync(0xffffffffu, t, 0);
          if (t >= toff[p.E]) break;
          while (toff[dcur + 1] <= t) dcur++;
          const int v = t - toff[dcur], tile = v / groups, kb0 = p.task_kb * (v % groups);
          const uint8_t *rec = p.w + (size_t)(p.e0 + dcur) * p.expert_bytes + p.mat_off +
                               ((size_t)tile * KB + kb0) * RecFmt<MODE>::kRec;
          decode_record_run<MODE, GEMM == 1>(rec, kb0, min(KB, kb0 + p.task_kb), &tw,
                                             mm_sm90_prefill_slot(GEMM, dcur, p.chunk) * p.N +
                                                 64 * tile,
                                             sm + G::kOffLut, bufs, n);
          if (lane == 0) atomicAdd(p.ready + dcur, 1);
        }
        /* decode ahead: the next launch's first nx.ahead experts' tasks,
         * from a counter of their own (that launch's decoders start past
         * them: PfParams::pre). Every warp claims until the counter passes
         * their end, so all of them are done before this launch ends. (A
         * compare-and-swap on that launch's own counter, bounded at their
         * end, ran each launch that decoded ahead 12-32% slower on an
         * H100: all decoder warps reach it at once, when their own tasks
         * run out; docs/PERF.md, version 45.) */
        const int nxa = min(p.nx.ahead, p.nx.E), nkb = p.nx.K / 128;
        const int ngroups = nxa > 0 ? (nkb + p.nx.task_kb - 1) / p.nx.task_kb : 1;
        dcur = 0;
        for (;;) {
          if (nxa <= 0) break;
          int t = 0;
          if (lane == 0) t = atomicAdd(p.nx.ready + kChunk + 1, 1);
          t = __shfl_sync(0xffffffffu, t, 0);
          if (t >= xoff[nxa]) break;
          while (xoff[dcur + 1] <= t) dcur++;
          const int v = t - xoff[dcur], tile = v / ngroups, kb0 = p.nx.task_kb * (v % ngroups);
          const uint8_t *rec = p.w + (size_t)(p.nx.e0 + dcur) * p.expert_bytes + p.nx.mat_off +
                               ((size_t)tile * nkb + kb0) * RecFmt<MODE>::kRec;
          constexpr int NG = 3 - GEMM; /* the next launch's GEMM */
          /* L1's weights in mode 3's own K order (decode_record_slot) */
          decode_record_run<MODE, NG == 1>(rec, kb0, min(nkb, kb0 + p.nx.task_kb), &tw_next,
                                           mm_sm90_prefill_slot(NG, dcur, p.chunk) * p.nx.N +
                                               64 * tile,
                                           sm + G::kOffLut, bufs, n);
          if (lane == 0) atomicAdd(p.nx.ready + dcur, 1);
        }
      };
      if (p.mode == 3) decode_tasks(std::integral_constant<int, 3>());
      else decode_tasks(std::integral_constant<int, 1>());
    } else if (threadIdx.x == 0) { /* copies */
      int stage = 0, e_ready = -1, tile_ready = -1;
      uint32_t phase = 0;
      for (int u = ufirst; u < nunits; u += ustep) {
        const PfUnit un = unit_of(u);
        if (GEMM == 2 && p.overlap && un.valid > 0 && un.row0 != tile_ready) {
          /* the token tile's intermediate: L1's units of it, two warpgroups
           * for each of its K / 128 column tiles */
          wait_count_async(p.tiles + un.row0, 2 * KB, 100);
          tile_ready = un.row0;
        }
        if (un.e != e_ready) { /* the expert's weights, decoded by all CTAs */
          wait_count_async(p.ready + un.e, tasks_pe, 200);
          e_ready = un.e;
        }
        /* at most one warpgroup's rows: only its half of the token tile; a
         * narrow unit of at most 16 rows (narrow_unit's m64n16): only those */
        const bool half = un.valid <= G::BM / 2;
        const bool rows16 = p.narrow && un.valid > 0 && un.valid <= 16;
        const CUtensorMap *tx = rows16 ? &tq : half ? &tah : &ta;
        const uint32_t abytes = rows16 ? 16 * 128 : half ? G::kA / 2 : G::kA;
        for (int ps = 0; ps < G::kPasses; ps++) {
          const int brow = mm_sm90_prefill_slot(GEMM, un.e, p.chunk) * p.N + un.nt * G::BN +
                           ps * G::BNP +
                           (un.split ? 0 : (int)crank * (G::BNP / CS));
          for (int kb = 0; kb < KB; kb++) {
            mbar_wait(&empty[stage], phase ^ 1);
            uint8_t *st = sm + stage * G::kStage;
            mbar_expect_tx(&full[stage], abytes + G::kB + 4 * G::kScaleBox);
            tma_2d(st, tx, kb * 128, un.row0, &full[stage]);
            if (un.split) /* the whole weight tile, into this CTA only */
#pragma unroll
              for (int i = 0; i < CS; i++)
                tma_2d(st + G::kA + i * (G::BNP / CS) * 128, &tb, kb * 128, brow + i * (G::BNP / CS),
                       &full[stage]);
            else
              asm volatile(
                "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes."
                "multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(
                    smem_u32(st + G::kA + (int)crank * (G::BNP / CS) * 128)),
                "l"((uint64_t)&tb), "r"(kb * 128), "r"(brow), "r"(smem_u32(&full[stage])),
                "h"((uint16_t)((1u << CS) - 1))
                : "memory");
            /* the token scales from row0 & ~3: a box's first element must
             * sit 16-byte aligned (an unaligned one is an illegal
             * instruction) */
            tma_2d(sm + G::kOffScl + stage * G::kSlot, &ts, un.row0 & ~3, kb, &full[stage]);
            if (++stage == G::kStages) {
              stage = 0;
              phase ^= 1;
            }
          }
        }
      }
    }
    cluster_sync(); /* the peer's copies and arrivals reach us until it ends */
    return;
  }

  /* consumers */
  /* c from a warp reduction: ptxas then knows it is the same in every lane
   * and builds the weight tile's descriptors in uniform registers */
  const int c = (int)__reduce_max_sync(0xffffffffu, (unsigned)(wg - 1));
  const int t = threadIdx.x % 128, w = t / 32, l = t % 32, q = l % 4;
  const int aoff = 64 * c; /* the warpgroup's token rows of the tile */
  const int r0 = 16 * w + l / 4; /* rows r0, r0 + 8 of the warpgroup's 64 */
  uint32_t peer_empty[CS - 1]; /* the other CTAs' empty barriers */
#pragma unroll
  for (int i = 0; i < CS - 1; i++)
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(peer_empty[i])
                 : "r"(smem_u32(empty)), "r"((crank + 1 + i) % CS));
  int stage = 0, it = 0;
  uint32_t phase = 0;
  float acc0[64], acc1[64], fin[64];
  auto next_stage = [&]() {
    if (++stage == G::kStages) {
      stage = 0;
      phase ^= 1;
    }
  };
  /* the low words of stage 0's descriptors: a stage's are these plus its
   * offset / 16, a k32 step's 2 more (addresses below 256 KiB: the 14-bit
   * address field does not carry), the high word is the same for all */
  const uint32_t da0 = (uint32_t)desc_b(smem_u32(sm + aoff * 128)),
                 db0 = (uint32_t)desc_b(smem_u32(sm + G::kA));
  auto issue = [&](float(&acc)[64]) {
    mbar_wait(&full[stage], phase);
    const uint32_t so = (uint32_t)stage * (G::kStage >> 4);
    ss_issue(desc_lo(da0 + so), desc_lo(db0 + so), acc);
    const int s = stage;
    next_stage();
    return s;
  };
  /* the peers' empty barriers of stage s */
  auto peers_at = [&](int s, uint32_t(&peer)[CS - 1]) {
#pragma unroll
    for (int i = 0; i < CS - 1; i++) peer[i] = peer_empty[i] + 8 * s;
  };
  /* the promotion of the block at stage s (its group in acc), kPending
   * groups left in flight; sc0: the warpgroup's scales in stage 0's slot */
  auto promote = [&](float(&acc)[64], int s, const float *sc0, auto pending) {
    uint32_t peer[CS - 1];
    peers_at(s, peer);
    const float *sc = (const float *)((const uint8_t *)sc0 + s * G::kSlot);
    ss_promote<CS, decltype(pending)::value>(sc, r0, &empty[s], peer, acc, fin);
  };
  /* A run of n K blocks in two accumulators, the first block already issued
   * into a0 at stage s0; a0 and a1 alternate: block i + 1's MMAs are queued
   * before block i's promotion, so the warpgroup's tensor work does not stop
   * for it. Nothing stays in flight across a loop's back edge: ptxas then
   * serializes every MMA of the kernel. issue_acc(acc) issues the next
   * stage's block and returns its stage, promote_acc(acc, s, pending) waits
   * and promotes the block at stage s. */
  auto two_acc_run = [&](auto len, int s0, auto &a0, auto &a1, auto &&issue_acc,
                         auto &&promote_acc) {
    constexpr int n = decltype(len)::value;
    int s1 = 0;
#pragma unroll
    for (int i = 0; i < n; i++) {
      const std::integral_constant<int, 1> next_in_flight;
      const std::integral_constant<int, 0> none_in_flight;
      if (i + 1 == n) { /* the run's last block: wait for everything */
        if (i % 2 == 0) promote_acc(a0, s0, none_in_flight);
        else promote_acc(a1, s1, none_in_flight);
      } else if (i % 2 == 0) {
        s1 = issue_acc(a1);
        promote_acc(a0, s0, next_in_flight);
      } else {
        s0 = issue_acc(a0);
        promote_acc(a1, s1, next_in_flight);
      }
    }
  };
  /* ---- a small tile (1 to G::kNarrowMax rows, an expert's last) with the
   * operands turned around: the stage's 128 weight rows as A (64 per
   * warpgroup), the tile's tokens as B, in m64n16 or m64n32 MMAs. Such a tile
   * then costs 16 or 32 token columns on both warpgroups instead of one
   * warpgroup's 64 token rows (docs/PERF.md, version 41). Accumulator rows
   * r0 and r0 + 8 are the unit's weight rows 64c + r0 (+ 8): in L1 the gate
   * and the up of channel 32c + 8w + l/4 of the pass's 64 (docs/LAYOUTS.md,
   * "Row order"); column 8j + 2q + b is the tile's token 8j + 2q + b. The
   * copies: the whole weight tile (split units), and the tile's first 16
   * token rows (m64n16) or 64 (m64n32); L1's FP8 scale of a token takes the maxima of both
   * warpgroups, through shared memory (kOffRed, which only L2 uses
   * otherwise). */
  uint32_t xphase = 0; /* xbar's, flipped once a narrow unit */
  auto narrow_unit = [&](auto ncols, const PfUnit &un) {
    constexpr int N = decltype(ncols)::value, NJ = N / 8, R = N / 2;
    /* the thread's coordinates, read again here (a volatile read stays
     * where it is): derived from the outer ones, the branch's addresses were
     * hoisted out of the unit loop, and their registers made ptxas spill in
     * the wide tiles' L1 */
    uint32_t tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    const int c = (int)(tid / 128) - 1, t = (int)(tid % 128), w = t / 32, l = t % 32, q = l % 4,
              r0 = 16 * w + l / 4;
    const uint32_t dw0 = (uint32_t)desc_b(smem_u32(sm + G::kA + c * 64 * 128)),
                   dt0 = (uint32_t)desc_b(smem_u32(sm));
    const float *sc0 = (const float *)(sm + G::kOffScl) + (un.row0 & 3);
    float a0[R], a1[R], fn[R];
    auto issue_n = [&](auto &acc) {
      mbar_wait(&full[stage], phase);
      const uint32_t so = (uint32_t)stage * (G::kStage >> 4);
      fence_acc(acc);
      wg_fence();
#pragma unroll
      for (int k = 0; k < 4; k++)
        mma_ss_narrow<N>(acc, desc_lo(dw0 + so + 2 * k), desc_lo(dt0 + so + 2 * k), k);
      wg_commit();
      fence_acc(acc);
      const int s = stage;
      next_stage();
      return s;
    };
    /* the promotion: one token scale per column */
    auto promote_n = [&](auto &acc, int s, auto pending) {
      wg_wait<decltype(pending)::value>();
      fence_acc(acc);
      const float *sc = (const float *)((const uint8_t *)sc0 + s * G::kSlot);
      float sv[NJ][2];
#pragma unroll
      for (int j = 0; j < NJ; j++) {
        sv[j][0] = sc[8 * j + 2 * q];
        sv[j][1] = sc[8 * j + 2 * q + 1];
      }
      uint32_t peer[CS - 1];
      peers_at(s, peer);
      ss_release<CS>(&empty[s], peer);
#pragma unroll
      for (int j = 0; j < NJ; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) fn[4 * j + i] = fmaf(acc[4 * j + i], sv[j][i & 1], fn[4 * j + i]);
    };
    auto run_n = [&](auto len, int s0) { two_acc_run(len, s0, a0, a1, issue_n, promote_n); };
    /* L1: the top-k weights of the thread's tokens (0 past the tile's rows) */
    float rwv[NJ][2], h0[NJ][2];
#pragma unroll
    for (int j = 0; j < NJ; j++)
#pragma unroll
      for (int b = 0; b < 2; b++) {
        const int tok = 8 * j + 2 * q + b;
        rwv[j][b] = GEMM == 1 && tok < un.valid ? __ldg(p.row_weight + un.row0 + tok) : 0.0f;
        h0[j][b] = 0.0f;
      }
#pragma unroll 1
    for (int ps = 0; ps < G::kPasses; ps++) {
      /* the factors of the thread's two weight rows */
      const size_t fb = (size_t)(p.e0 + un.e) * p.N + un.nt * G::BN + ps * G::BNP + 64 * c + r0;
      const float f0 = __ldg(p.rs + fb), f1 = __ldg(p.rs + fb + 8);
#pragma unroll
      for (int i = 0; i < R; i++) fn[i] = 0.0f;
      int kb = 0;
      for (; kb + kRun <= KB; kb += kRun) run_n(std::integral_constant<int, kRun>(), issue_n(a0));
      for (; kb + 2 <= KB; kb += 2) run_n(std::integral_constant<int, 2>(), issue_n(a0));
      if (kb < KB) run_n(std::integral_constant<int, 1>(), issue_n(a0));
      if (GEMM == 1) {
        /* SwiGLU, as the wide tiles' epilogue computes it */
        const bool clamped = p.clamp > 0.0f;
        const float silu_c = clamped ? p.clamp / (1.0f + expf(-p.clamp)) : 0.0f;
        float v[NJ][2];
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
          for (int b = 0; b < 2; b++) {
            float gt, up;
            to_bf16_pair(fn[4 * j + b] * f0, fn[4 * j + 2 + b] * f1, gt, up);
            v[j][b] = (clamped ? silu_up<true>(gt, up, p.clamp, silu_c, p.silu)
                               : silu_up<false>(gt, up, p.clamp, silu_c, p.silu)) *
                      rwv[j][b];
          }
        if (ps == 0) {
#pragma unroll
          for (int j = 0; j < NJ; j++) {
            h0[j][0] = v[j][0];
            h0[j][1] = v[j][1];
          }
          continue;
        }
        /* a token's maximum over the unit's 128 channels: the thread's one
         * per pass, the warp's 8 channel lanes (l / 4), then the 8 warps of
         * both warpgroups through shared memory */
        float *red = (float *)(sm + G::kOffRed);
        float mx[NJ][2];
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
          for (int b = 0; b < 2; b++) {
            float m = fmaxf(fmaxf(0.0f, fabsf(h0[j][b])), fabsf(v[j][b]));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
            if (l < 4) red[(4 * c + w) * N + 8 * j + 2 * q + b] = m;
          }
        /* both warpgroups: partial maxima written, the previous unit's
         * staging reads done. An mbarrier, not a 256-thread named barrier:
         * racecheck misorders a named barrier between warpgroups that have
         * passed other named barriers unequal numbers of times, as the wide
         * units' epilogues make them (scripts/racecheck_probe.cu reproduces
         * it with correct values; docs/RELIABILITY.md). Same speed, and the
         * tool stays a usable check of this path */
        mbar_arrive(xbar);
        mbar_wait(xbar, xphase);
        uint8_t *const stg1 = sm + G::kOffStg; /* [N tokens][128 channels] */
        const int ch = 32 * c + 8 * w + l / 4;
        const int pos = p.mode == 3 ? mm_sm90_kperm_pos(MM_WMODE_G16_FP8, ch) : ch;
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
          for (int b = 0; b < 2; b++) {
            const int tok = 8 * j + 2 * q + b;
            float m = 0.0f;
#pragma unroll
            for (int k = 0; k < 8; k++) m = fmaxf(m, red[k * N + tok]);
            mx[j][b] = fmaxf(m, 1e-4f);
            const float inv = 448.0f / mx[j][b];
#pragma unroll
            for (int pp = 0; pp < 2; pp++) {
              const int byte = 64 * pp + pos;
              const uint8_t code = (uint8_t)__nv_cvt_float_to_fp8((pp ? v[j][b] : h0[j][b]) * inv,
                                                                  __NV_SATFINITE, __NV_E4M3);
              stg1[tok * 128 + (((byte >> 4) ^ (tok & 7)) << 4) + (byte & 15)] = code;
            }
            if (c == 0 && w == 0 && l < 4 && tok < un.valid)
              p.as_t[(size_t)un.nt * p.Mp + un.row0 + tok] = mx[j][b] / 448.0f;
          }
        mbar_arrive(xbar + 1); /* the maxima read */
        mbar_wait(xbar + 1, xphase);
        xphase ^= 1;
        /* 16-byte chunks, one per thread: with N = 16 the first warpgroup's,
         * whose staging this is, so its next writes there follow these reads
         * in the same threads (with N = 32 the second warpgroup's reads would
         * precede the first one's next epilogue by a whole K loop, which
         * cannot run more than the ring's stages ahead of them) */
        const int id = 128 * c + t;
        if (id < 8 * N) {
          const int tok = id / 8, ck = id % 8;
          if (tok < un.valid)
            *(uint4 *)(p.act + (size_t)(un.row0 + tok) * (p.N / 2) + un.nt * 128 + 16 * ck) =
                *(const uint4 *)(stg1 + tok * 128 + ((ck ^ (tok & 7)) << 4));
        }
      } else {
        /* BF16 [N tokens][the warpgroup's 64 columns] in its staging, 16-byte
         * chunk k of token row r at k ^ (r % 8) */
        uint8_t *const stg = sm + G::kOffStg + c * 16384;
        named_sync(1 + c, 128); /* the previous unit's copy-out reads are done */
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
          for (int i = 0; i < 4; i++) {
            const int tok = 8 * j + 2 * q + (i & 1), col = r0 + 8 * (i >> 1);
            const __nv_bfloat16 h = __float2bfloat16_rn(fn[4 * j + i] * (i >> 1 ? f1 : f0));
            *(__nv_bfloat16 *)(stg + tok * 128 + (((col >> 3) ^ (tok & 7)) << 4) + 2 * (col & 7)) = h;
          }
        named_sync(1 + c, 128);
        /* a map entry outside [0, M) is a caller's bug and is not followed */
#pragma unroll
        for (int id = t; id < 8 * N; id += 128) {
          const int tok = id / 8, ck = id % 8;
          if (tok < un.valid) {
            const int orow = p.out_rows ? __ldg(p.out_rows + un.row0 + tok) : un.row0 + tok;
            if ((unsigned)orow < (unsigned)p.M)
              *(uint4 *)(p.out + (size_t)orow * p.N + un.nt * 128 + 64 * c + 8 * ck) =
                  *(const uint4 *)(stg + tok * 128 + ((ck ^ (tok & 7)) << 4));
          }
        }
      }
    }
  };
  /* L1 (overlap): the token tiles of the warpgroup's units, counted in
   * tiles[] in batches of kTileBatch units: once every thread of the
   * warpgroup has passed a barrier after its stores, one thread's fence at
   * GPU scope makes all of them visible before its counts. A release per
   * unit holds the warp that issues it, and with it the warpgroup's next
   * MMAs: 0.6-2.5% slower (docs/PERF.md, version 46). */
  int *const pend = pend0 + kTileBatch * c;
  auto tile_flush = [&](int n) {
    named_sync(1 + c, 128);
    if (t == 0) {
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
      for (int i = 0; i < n; i++)
        if (pend[i] >= 0)
          asm volatile("red.relaxed.gpu.global.add.s32 [%0], 1;" ::"l"(p.tiles + pend[i]) : "memory");
    }
  };
  /* unit k's tile (none for a unit for nobody) */
  auto tile_done = [&](const PfUnit &un, int k) {
    if (GEMM != 1 || !p.overlap) return;
    if (t == 0) pend[k % kTileBatch] = un.valid > 0 ? un.row0 : -1;
    if (k % kTileBatch == kTileBatch - 1) tile_flush(kTileBatch);
  };
  set_max_regs_inc<kConsumerRegs>();
  /* one loop-carried counter: with the unit number carried beside it,
   * ptxas kept one of them in local memory */
  for (; ufirst + it * ustep < nunits; it++) {
    const PfUnit un = unit_of(ufirst + it * ustep);
    if (p.narrow && un.valid > 0 && un.valid <= G::kNarrowMax) {
      if constexpr (G::kNarrowMax <= 16) {
        narrow_unit(std::integral_constant<int, 16>(), un);
      } else {
        if (un.valid <= 16) narrow_unit(std::integral_constant<int, 16>(), un);
        else narrow_unit(std::integral_constant<int, 32>(), un);
      }
      tile_done(un, it);
      continue;
    }
    if (aoff >= un.valid) {
      /* no rows for this warpgroup (a small last tile, or a unit for
       * nobody): it only releases the stages, and the other warpgroup's
       * MMAs have the tensor cores to themselves. The barrier keeps the
       * warpgroup's warps within a unit of each other, as an epilogue's
       * does (the factor slots alternate by unit). */
      for (int i = 0; i < G::kPasses * KB; i++) {
        mbar_wait(&full[stage], phase);
        uint32_t peer[CS - 1];
        peers_at(stage, peer);
        ss_release<CS>(&empty[stage], peer);
        next_stage();
      }
      named_sync(1 + c, 128);
      tile_done(un, it);
      continue;
    }
    /* the top-k weights of the thread's two rows (L1), loaded now so that
     * their latency passes under the K loop */
    float rw[2] = {0.0f, 0.0f};
    if (GEMM == 1)
#pragma unroll
      for (int rr = 0; rr < 2; rr++)
        if (aoff + r0 + 8 * rr < un.valid) rw[rr] = __ldg(p.row_weight + un.row0 + aoff + r0 + 8 * rr);
    /* L2: the out row of token row t of the warpgroup's 64 (the caller's
     * map, else the pool row; -1 past the expert's rows), loaded now and
     * shared through shared memory: one map load per row instead of one
     * per 16-byte copy, its latency under the K loop */
    int orow_t = -1;
    if (GEMM == 2 && t < 64 && aoff + t < un.valid)
      orow_t = p.out_rows ? __ldg(p.out_rows + un.row0 + aoff + t) : un.row0 + aoff + t;
    /* the warpgroup's token scales in stage 0's slot (the box starts at
     * row0 & ~3) */
    const float *sc0 = (const float *)(sm + G::kOffScl) + (un.row0 & 3) + aoff;
    float amax0[2] = {0.0f, 0.0f}; /* L1: the first pass's row maxima */
#pragma unroll 1
    for (int ps = 0; ps < G::kPasses; ps++) {
      /* the epilogue's slots: L1 has one per pass, L2 one per unit parity */
      const int parity = G::kPasses > 1 ? ps : it & 1;
      /* the row factor of column t of the pass's 128, loaded now so that its
       * latency passes under the K loop */
      const float fac = __ldg(p.rs + (size_t)(p.e0 + un.e) * p.N + un.nt * G::BN + ps * G::BNP + t);
#pragma unroll
      for (int i = 0; i < 64; i++) fin[i] = 0.f;
      /* runs of kRun blocks in two accumulators (two_acc_run) */
      auto promote_wide = [&](auto &acc, int s, auto pending) { promote(acc, s, sc0, pending); };
      auto run = [&](auto len, int s0) { two_acc_run(len, s0, acc0, acc1, issue, promote_wide); };
      int kb = 0;
      for (; kb + kRun <= KB; kb += kRun) run(std::integral_constant<int, kRun>(), issue(acc0));
      for (; kb + 2 <= KB; kb += 2) run(std::integral_constant<int, 2>(), issue(acc0));
      if (kb < KB) run(std::integral_constant<int, 1>(), issue(acc0));
      /* ---- epilogue: the factors into shared memory (one slot per parity:
       * a thread reaching the next unit's slot has passed this barrier, which
       * every thread of the warpgroup meets after its previous copy-out) */
      float *facs = (float *)(sm + G::kOffFac) + (2 * c + parity) * 128;
      facs[t] = fac;
      if (GEMM == 2 && t < 64) ((int *)(sm + G::kOffRed))[(2 * c + parity) * 64 + t] = orow_t;
      named_sync(1 + c, 128);
      /* the warpgroup's staging region (kStg) */
      uint8_t *const stg = sm + G::kOffStg + c * 16384;
      if (GEMM == 1) {
        /* accumulator column 8j + 2q + b: gate when j is even, the up of the
         * same channel 8 columns on (j + 1); the thread's channels of the
         * pass's 64 are 8m + 2q + b (m = j / 2) */
        float h[32], amax[2] = {0.0f, 0.0f};
        /* one branch-free body per clamp setting: with the clamp's test
         * between the values, each value was a basic block of its own and
         * its table load could not be issued beside the others' */
        auto swiglu = [&](auto clamped) {
          /* made here, not kept across the unit loop (ptxas put it in local
           * memory there); the expression is silu_n's, so the table's bits */
          const float silu_c = clamped ? p.clamp / (1.0f + expf(-p.clamp)) : 0.0f;
#pragma unroll
          for (int m = 0; m < 8; m++) {
            /* the factors of the gate columns 16m + 2q + b and of their ups,
             * 8 columns on: one 8-byte load each */
            const float2 fg = *(const float2 *)(facs + 16 * m + 2 * q),
                         fu = *(const float2 *)(facs + 16 * m + 2 * q + 8);
#pragma unroll
            for (int rr = 0; rr < 2; rr++)
#pragma unroll
              for (int b = 0; b < 2; b++) {
                float gt, up;
                to_bf16_pair(fin[8 * m + 2 * rr + b] * (b ? fg.y : fg.x),
                             fin[8 * m + 4 + 2 * rr + b] * (b ? fu.y : fu.x), gt, up);
                const float v =
                    silu_up<decltype(clamped)::value>(gt, up, p.clamp, silu_c, p.silu) * rw[rr];
                h[16 * rr + 2 * m + b] = v;
                amax[rr] = fmaxf(amax[rr], fabsf(v));
              }
          }
        };
        if (p.clamp > 0.0f) swiglu(std::true_type());
        else swiglu(std::false_type());
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
          amax[rr] = fmaxf(amax[rr], __shfl_xor_sync(0xffffffffu, amax[rr], 1));
          amax[rr] = fmaxf(amax[rr], __shfl_xor_sync(0xffffffffu, amax[rr], 2));
        }
        /* a row's 128 channels are the warpgroup's over both passes: the
         * first pass's values wait in shared memory (each thread's own,
         * [value][thread]: no barrier, no bank conflicts), their maxima in
         * registers */
        float *stash = (float *)stg;
        if (ps == 0) {
#pragma unroll
          for (int i = 0; i < 32; i++) stash[128 * i + t] = h[i];
          amax0[0] = amax[0];
          amax0[1] = amax[1];
        } else {
          float h0[32];
#pragma unroll
          for (int i = 0; i < 32; i++) h0[i] = stash[128 * i + t];
          named_sync(1 + c, 128); /* the stash becomes the codes' staging */
          /* 64 rows x 128 channels; row r's 16-byte chunk j at j ^ (r % 8) */
          auto chunk = [&](int r, int j) { return stg + r * 128 + ((j ^ (r & 7)) << 4); };
          const bool kperm3 = p.mode == 3;
#pragma unroll
          for (int rr = 0; rr < 2; rr++) {
            const int row = r0 + 8 * rr;
            const float mx = fmaxf(fmaxf(amax0[rr], amax[rr]), 1e-4f);
            const float inv = 448.0f / mx;
            if (q == 0 && aoff + row < un.valid)
              p.as_t[(size_t)un.nt * p.Mp + un.row0 + aoff + row] = mx / 448.0f;
#pragma unroll
            for (int m = 0; m < 8; m++) {
              /* channels 16 (m / 2) + 8 (m % 2) + 2q, + 1 (and 64 on), at
               * their mm_sm90_kperm positions in mode 3 (its L2's K order,
               * the WGMMA kernels' too), else in place: 16-byte chunk ck,
               * byte in */
              const int ch = 16 * (m >> 1) + 8 * (m & 1) + 2 * q;
              const int pos = kperm3 ? mm_sm90_kperm_pos(MM_WMODE_G16_FP8, ch) : ch;
              const int ck = pos >> 4, in = pos & 15;
              const uint32_t c0 = to_e4m3x2(h0[16 * rr + 2 * m] * inv, h0[16 * rr + 2 * m + 1] * inv),
                             c1 = to_e4m3x2(h[16 * rr + 2 * m] * inv, h[16 * rr + 2 * m + 1] * inv);
              *(uint16_t *)(chunk(row, ck) + in) = (uint16_t)c0;
              *(uint16_t *)(chunk(row, 4 + ck) + in) = (uint16_t)c1;
            }
          }
          named_sync(1 + c, 128);
          /* two threads per token row, 64 bytes each */
          const int row = t / 2, hf = t % 2;
          if (aoff + row < un.valid) {
            uint4 *dst = (uint4 *)(p.act + (size_t)(un.row0 + aoff + row) * (p.N / 2) +
                                   un.nt * 128 + 64 * hf);
#pragma unroll
            for (int i = 0; i < 4; i++)
              dst[i] = *(const uint4 *)chunk(row, 4 * hf + i);
          }
        }
      } else {
        /* BF16 tile in staging: row r's 16-byte chunk j at j ^ (r % 8), so
         * the 8 rows of a store (r % 8 = g) fall in different banks. The rows
         * are 256 bytes in a 1024-aligned tile, so the chunk's address is
         * (the row's | (r % 8) << 4) ^ (j << 4): one XOR per store. */
        const int *orows = (const int *)(sm + G::kOffRed) + (2 * c + parity) * 64;
        /* the thread's column factors, read before the stores, whose memory
         * clobbers would have them read again for every store */
        float2 fc[16];
#pragma unroll
        for (int j = 0; j < 16; j++) fc[j] = *(const float2 *)(facs + 8 * j + 2 * q);
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
          const int row = r0 + 8 * rr;
          const uint32_t at = (smem_u32(stg + row * 256) | (uint32_t)(row & 7) << 4) + 4 * q;
#pragma unroll
          for (int j = 0; j < 16; j++) {
            __nv_bfloat162 v = __floats2bfloat162_rn(fin[4 * j + 2 * rr] * fc[j].x,
                                                     fin[4 * j + 2 * rr + 1] * fc[j].y);
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(at ^ (uint32_t)(j << 4)), "r"(*(uint32_t *)&v)
                         : "memory");
          }
        }
        named_sync(1 + c, 128);
        /* 16 threads per token row; a map entry outside [0, M) is a caller's
         * bug and is not followed into foreign memory */
#pragma unroll
        for (int i = 0; i < 8; i++) {
          const int row = t / 16 + 8 * i, ck = t % 16, orow = orows[row];
          if ((unsigned)orow < (unsigned)p.M)
            *(uint4 *)(p.out + (size_t)orow * p.N + un.nt * 128 + ck * 8) =
                *(const uint4 *)(stg + row * 256 + ((ck ^ (row & 7)) << 4));
        }
      }
    }
    tile_done(un, it);
  }
  if (GEMM == 1 && p.overlap && it % kTileBatch) tile_flush(it % kTileBatch);
  cluster_sync();
}

/* CTAs in the clusters of CS that fit at once, per device (a cluster sits
 * in one GPC: not every SM may hold one). */
template <int GEMM, int CS>
mm_err *grid_size(const cudaLaunchConfig_t &cfg, int *ctas) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];
  int dev = 0;
  MM_CUDA_TRY(cudaGetDevice(&dev));
  int n = dev < kMaxDevices ? cached[dev].load() : 0;
  if (!n) {
    int clusters = 0;
    MM_CUDA_TRY(cudaOccupancyMaxActiveClusters(&clusters, prefill_kernel<GEMM, CS>, &cfg));
    MM_ARG_CHECK(clusters > 0, "sm90 prefill: no cluster of %d CTAs fits", CS);
    n = CS * clusters;
    if (dev < kMaxDevices) cached[dev].store(n);
  }
  *ctas = n;
  return NULL;
}

/* A launch's configuration and grid: the kernel's CTAs at once, capped
 * (tests) to whole clusters, at least one. */
template <int GEMM, int CS>
mm_err *launch_config(int max_ctas, cudaStream_t st, cudaLaunchConfig_t *cfg,
                      cudaLaunchAttribute *at) {
  using G = PfCfg<GEMM>;
  /* per call: a function attribute belongs to one device's context */
  MM_CUDA_TRY(cudaFuncSetAttribute(prefill_kernel<GEMM, CS>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, G::kBytes));
  cluster_launch_config(cfg, at, CS, 384, G::kBytes, st);
  int ctas = 0;
  MM_TRY((grid_size<GEMM, CS>(*cfg, &ctas)));
  if (max_ctas > 0 && max_ctas < ctas) ctas = max_ctas < CS ? CS : max_ctas / CS * CS;
  cfg->gridDim = dim3(ctas);
  return NULL;
}

/* K blocks per decode task of a matrix of K columns and N rows for a grid
 * of ctas CTAs (3 decoder warps a CTA); MEGAMOE_SM90_PREFILL_TASK_KB=n
 * (1-16): n instead (docs/CONFIG.md; a measurement's control and the
 * tests' other sizes). */
int task_kblocks(int N, int K, int ctas) {
  const char *tk = getenv("MEGAMOE_SM90_PREFILL_TASK_KB");
  const int want = tk ? atoi(tk) : 0;
  if (want >= 1 && want <= MM_SM90_PREFILL_TASK_KB_MAX) return want;
  return mm_sm90_prefill_task_kblocks(K / 128, N / 64, 3 * ctas);
}

/* A launch; early: it may start while the stream's kernel before it runs
 * (a programmatic dependent launch: PfParams::overlap) */
template <int GEMM, int CS>
mm_err *launch(const PfParams &p, cudaLaunchConfig_t cfg, bool early, const CUtensorMap &ta,
               const CUtensorMap &ts, const CUtensorMap &tb, const CUtensorMap &tw,
               const CUtensorMap &tah, const CUtensorMap &tq, const CUtensorMap &tw_next) {
  cudaLaunchAttribute at[2] = {cfg.attrs[0], {}};
  at[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = early ? 2 : 1;
  MM_CUDA_TRY(cudaLaunchKernelEx(&cfg, prefill_kernel<GEMM, CS>, p, ta, ts, tb, tw, tah, tq,
                                 tw_next));
  return NULL;
}

}  // namespace

const char *mm_sm90_prefill_unsupported(const mm_sm90_layer *L) {
  if (L->prefill_off) return "turned off (compute.prefill-path: off)";
  if (L->mode != MM_WMODE_G32_FP8 && L->mode != MM_WMODE_G16_FP8)
    return "the FP8 modes only (1 g32-fp8, 3 g16-fp8)";
  if (!L->refs_zero13 || !L->refs_zero2) return "weights with per-block reference exponents";
  if (L->H % 128 || L->I % 128) return "hidden and expert sizes must be multiples of 128";
  if (L->rec != (L->mode == MM_WMODE_G32_FP8 ? RecFmt<1>::kRec : RecFmt<3>::kRec))
    return "record size mismatch";
  return NULL;
}

mm_err *mm_sm90_run_prefill(const mm_sm90_layer *L, const mm_expert_pool *pool, float clamp,
                            const mm_sm90_ws *ws, cudaStream_t st) {
  const char *why = mm_sm90_prefill_unsupported(L);
  if (why) return mm_error(MEGAMOE_CODE_UNIMPLEMENTED, "sm90 prefill path: %s", why);
  MM_ARG_CHECK(ws->wdec && ws->pf_count && ws->pf_tiles,
               "sm90 prefill path: the workspace has no weight region (planned without it)");
  MM_ARG_CHECK((uintptr_t)pool->x % 16 == 0 && (uintptr_t)pool->out % 16 == 0,
               "sm90 expert compute: pool x and out must be 16-byte aligned");
  const int H = L->H, I = L->I, M = pool->num_rows_max, Mp = ws->Mp;
  const int chunk = mm_sm90_prefill_chunk(L), chunks = (L->E + chunk - 1) / chunk;
  const int max_ctas = mm_sm90_grid_cap();
  MM_TRY(mm_sm90_prep_token_scales(L, pool, ws, st));
  MM_CUDA_TRY(cudaMemsetAsync(ws->pf_count, 0, mm_sm90_prefill_count_bytes(L->E, chunk), st));
  MM_CUDA_TRY(cudaMemsetAsync(ws->pf_tiles, 0, mm_sm90_prefill_tile_count_bytes(M), st));
  CUtensorMap x1, s1, x2, s2, wb1, ww1, wb2, ww2, x1h, x2h, x1q, x2q;
  const int ec = chunk;
  using C1 = PfCfg<1>;
  using C2 = PfCfg<2>;
  MM_TRY(make_map(&x1, CU_TENSOR_MAP_DATA_TYPE_UINT8, pool->x, H, M, H, 128, C1::BM, true));
  /* the token tiles' first halves, for tiles of at most one warpgroup's rows */
  MM_TRY(make_map(&x1h, CU_TENSOR_MAP_DATA_TYPE_UINT8, pool->x, H, M, H, 128, C1::BM / 2, true));
  MM_TRY(make_map(&x2h, CU_TENSOR_MAP_DATA_TYPE_UINT8, ws->act, I, Mp, I, 128, C2::BM / 2, true));
  /* and their first 16 rows, for the narrow units of at most 16 rows */
  MM_TRY(make_map(&x1q, CU_TENSOR_MAP_DATA_TYPE_UINT8, pool->x, H, M, H, 128, 16, true));
  MM_TRY(make_map(&x2q, CU_TENSOR_MAP_DATA_TYPE_UINT8, ws->act, I, Mp, I, 128, 16, true));
  MM_TRY(make_map(&s1, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, ws->xs_t, Mp, H / 128, 4ull * Mp,
                  C1::kScaleBox, 1, false));
  MM_TRY(make_map(&x2, CU_TENSOR_MAP_DATA_TYPE_UINT8, ws->act, I, Mp, I, 128, C2::BM, true));
  MM_TRY(make_map(&s2, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, ws->as_t, Mp, I / 128, 4ull * Mp,
                  C2::kScaleBox, 1, false));
  /* the weight tiles' copies (1 / kClusterSize of their rows per CTA) and
   * the decode's tensor stores (32 x 128 tiles) */
  /* (the w2 slots reach past the w13 ones: mm_sm90_prefill_slot) */
  const uint64_t rows13 = (uint64_t)ec * 2 * I;
  const uint64_t rows2 = (uint64_t)(2 * ec + MM_SM90_PREFILL_AHEAD_MAX) * H;
  MM_TRY(make_map(&wb1, CU_TENSOR_MAP_DATA_TYPE_UINT8, ws->wdec, H, rows13, H, 128,
                  C1::BNP / kClusterSize, true));
  MM_TRY(make_map(&wb2, CU_TENSOR_MAP_DATA_TYPE_UINT8, ws->wdec, I, rows2, I, 128,
                  C2::BNP / kClusterSize, true));
  MM_TRY(make_map(&ww1, CU_TENSOR_MAP_DATA_TYPE_UINT8, ws->wdec, H, rows13, H, 128, 32, true));
  MM_TRY(make_map(&ww2, CU_TENSOR_MAP_DATA_TYPE_UINT8, ws->wdec, I, rows2, I, 128, 32, true));

  PfParams p;
  memset(&p, 0, sizeof(p));
  p.w = L->d_w;
  p.expert_bytes = L->expert_bytes;
  p.lut = L->d_lut;
  p.mode = L->mode == MM_WMODE_G16_FP8 ? 3 : 1;
  p.offsets = pool->expert_offsets;
  p.M = M;
  p.Mp = Mp;
  p.row_weight = pool->row_weight;
  p.clamp = clamp;
  p.silu = mm_sm90_silu_table();
  MM_ARG_CHECK(p.silu, "sm90 prefill path: no silu table on this device");
  p.act = ws->act;
  p.as_t = ws->as_t;
  p.out = pool->out;
  p.out_rows = pool->out_rows;
  /* MEGAMOE_SM90_PREFILL_NARROW=0: every small last tile on the usual tile
   * (docs/CONFIG.md; a measurement's control) */
  p.narrow = mm_sm90_env_on("MEGAMOE_SM90_PREFILL_NARROW");
  p.chunk = chunk;
  /* MEGAMOE_SM90_PREFILL_OVERLAP=0: each launch starts once the one before
   * it has ended (docs/CONFIG.md; a measurement's control) */
  p.overlap = mm_sm90_env_on("MEGAMOE_SM90_PREFILL_OVERLAP");
  p.tiles = ws->pf_tiles;
  /* MEGAMOE_SM90_PREFILL_AHEAD=n (0-2): decode n of the next launch's
   * first experts ahead (docs/CONFIG.md; 0: none, a measurement's control) */
  const char *av = getenv("MEGAMOE_SM90_PREFILL_AHEAD");
  const int ahead = av && av[0] >= '0' && av[0] <= '0' + MM_SM90_PREFILL_AHEAD_MAX && !av[1]
                        ? av[0] - '0'
                        : MM_SM90_PREFILL_AHEAD_MAX;
  cudaLaunchConfig_t cfg1, cfg2;
  cudaLaunchAttribute at1, at2;
  MM_TRY((launch_config<1, kClusterSize>(max_ctas, st, &cfg1, &at1)));
  MM_TRY((launch_config<2, kClusterSize>(max_ctas, st, &cfg2, &at2)));
  const int kb1 = task_kblocks(2 * I, H, (int)cfg1.gridDim.x),
            kb2 = task_kblocks(H, I, (int)cfg2.gridDim.x);
  /* launch j (L1 of chunk j / 2, or its L2): its GEMM's fields of p */
  auto launch_fields = [&](int j, PfParams &q) {
    const int g1 = j % 2 == 0;
    q.gemm = g1 ? 1 : 2;
    q.e0 = j / 2 * chunk;
    q.E = L->E - q.e0 < chunk ? L->E - q.e0 : chunk;
    q.mat_off = g1 ? 0 : L->w13_bytes;
    q.rs = g1 ? L->d_rs13 : L->d_rs2;
    q.N = g1 ? 2 * I : H;
    q.K = g1 ? H : I;
    q.task_kb = g1 ? kb1 : kb2;
    q.ready = ws->pf_count + j * (kChunk + 2);
  };
  for (int j = 0; j < 2 * chunks; j++) {
    launch_fields(j, p);
    p.pre = p.nx.ahead; /* the previous launch's (0 before the first) */
    memset(&p.nx, 0, sizeof(p.nx));
    if (j + 1 < 2 * chunks) {
      PfParams n = p;
      launch_fields(j + 1, n);
      const int most = mm_sm90_prefill_ahead_max(n.gemm, chunk);
      p.nx.ahead = ahead < most ? ahead : most;
      p.nx.e0 = n.e0;
      p.nx.E = n.E;
      p.nx.N = n.N;
      p.nx.K = n.K;
      p.nx.task_kb = n.task_kb;
      p.nx.mat_off = n.mat_off;
      p.nx.ready = n.ready;
    }
    /* with overlap a launch's CTAs start as the one before it ends, but its
     * decoders wait for that launch's end and its L2 reads only the token
     * tiles L1 has counted, so only what a launch decodes ahead meets the
     * weights the running launch reads, in other slots
     * (mm_sm90_prefill_slot) */
    const bool early = p.overlap && j > 0;
    if (p.gemm == 1)
      MM_TRY((launch<1, kClusterSize>(p, cfg1, early, x1, s1, wb1, ww1, x1h, x1q, ww2)));
    else
      MM_TRY((launch<2, kClusterSize>(p, cfg2, early, x2, s2, wb2, ww2, x2h, x2q, ww1)));
  }
  return NULL;
}

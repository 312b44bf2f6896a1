/* moe_sm90_wgmma.cu -- the WGMMA product path of the sm90 fused expert
 * compute: two persistent, warp-specialized kernels per call (L1 with the
 * SwiGLU + FP8 requant epilogue, L2 with the BF16 epilogue) and a small prep
 * kernel (token scales transposed; modes 2 and 4: F16 copy of the
 * activations, mode 3 an FP8 one, in the mode's K order (mm_sm90_kperm),
 * written into the pool's output buffer, which L2 overwrites afterwards).
 *
 * Swap-AB: weights are the WGMMA A operand (64 rows per m64 tile, decoded from
 * packed FP4 straight into A-fragment registers, "RS" form), tokens are N
 * (TMA-loaded with 128B swizzle). A CTA = 1 producer warpgroup (TMA bulk
 * copies of the weight records, tensor copies of the token tile and its
 * scales, S-stage mbarrier ring) + 2 consumer warpgroups, each owning two
 * m64 tiles: 256 weight rows x one token tile per work unit. Work units
 * (expert, 256-row block, token tile) are walked round-robin by a persistent
 * grid, token tile fastest so that neighbouring CTAs share weights in L2 and
 * a skewed expert spreads over every SM; with mixed tiles the experts of
 * the wider tiles are walked first (Kern::setup_walk). The producer alone walks them and
 * publishes each unit beside the stage of its first K block (unit_pack); the
 * consumers read it there (version 12: 2-7% faster than every consumer
 * thread walking the schedule, whose integer divisions and global loads of
 * the expert offsets stood at the start of every unit).
 *
 * Token tiles (mm_sm90_run_wgmma picks them from the average rows per
 * expert): 16, 32, 64 or 128 tokens; with 16 or 32, an expert holding more
 * rows than that gets 64-wide tiles ("mixed tiles"; 32-wide in the 16-wide
 * kernels of modes 1-3, Kern::kBig), so its weights are decoded once per 64
 * (32) of its tokens; in the F16 modes' 32-wide kernels (and mode 4's 16-wide
 * ones) an expert a few rows above the tile gets a middle one, 48 (32)
 * wide, first (Kern::kMid); a large tile of a few rows more than those
 * runs narrower MMAs (Kern::kNarrow), as do the 64-wide kernels' tiles
 * of at most 48 rows. With 50-112 rows per expert, a launch pair gives
 * the experts above 64 rows 128-wide tiles (the others 64-wide ones, at
 * 50-59 and 65-76 rows the 32-wide kernels' tiles); a 128-wide
 * tile of at most 112 rows issues its second column half's MMAs only as
 * wide as its rows need (Kern::k_loop_ahead's NW2). With 128
 * (prefill), each consumer warpgroup owns one m64 tile of 128 columns,
 * and a unit's 256 rows are two halves in turn (Kern::kWide). Prefill runs a launch pair per GEMM:
 * 160-wide tiles (two m64n80 halves) where they cover an expert's rows
 * with less waste (129-160 rows: one tile instead of two; 520 rows: 160 +
 * 3 x 128 instead of 5 x 128), 128-wide ones for the rest
 * (mm_sm90_wide_count, tile_span; launch_gemm, Kern::produce). In the decode
 * regime of the FP8 modes and mode 2 (up to 12 rows per expert) the grid
 * runs two CTAs per SM with 16-wide tiles only (more warps to hide the
 * decode's latency; larger tiles do not fit their registers). With 64-wide
 * tiles (and 128- and 160-wide ones in the F16 modes) the two consumer
 * warpgroups take turns issuing their MMAs (Kern::kPingPong). 128- and
 * 160-wide tiles decode one K block ahead (Kern::k_loop_ahead): the decode
 * of block kb + 1 runs beside block kb's promotion; in the FP8 modes' one-CTA
 * kernels the 16- and 32-wide tiles decode block kb + 1 beside block kb's
 * MMAs and promote block kb beside block kb + 1's, in two accumulator sets
 * (Kern::k_loop_db). In modes 1, 3 and 4 (mode 4: mode 1's records),
 * matrices whose references are all 0 (the packers' row anchors) run kernels
 * that promote without the reference multiply and its loads and copy the
 * records without the references (Kern's ONE, kRecCopy), at every tile
 * width.
 * Measured and not kept: 4 consumer warpgroups of one tile each (no faster:
 * the per-block overhead doubles), decoding the next block ahead of the
 * last MMAs (slower), promoting one block while the next one's MMAs run
 * (version 3: ptxas serialized the WGMMAs, C7514; version 4, 16-wide tiles
 * with two accumulator sets: up to 11% slower), one FMA per promoted element
 * while a row keeps its reference exponent (version 4, before decode ahead:
 * no faster), fold-table loads hoisted before the decode (no faster), two
 * CTAs per SM with 32-wide tiles (3-5% faster on even loads, slower skewed,
 * still spills), separate decoder warpgroups writing E4M3 tiles for SS
 * WGMMAs (version 6: 12-57% slower, at 128-wide tiles 13%; branch
 * proto/decoder-warpgroups), a bank-conflict swizzle of the fold table (one
 * more instruction per lookup: 3-12% slower), the decode's shifts and table
 * addresses as IMADs on the FMA pipe (up to 7% slower), token-scale pairs
 * in the decode-ahead loop (15-20% slower), both promotion forms in one
 * kernel (the per-block one 4-7% slower: docs/PERF.md, version 7), token
 * scales as 16-byte loads from a permuted layout (7% slower at 128-wide),
 * the next block's inputs fetched during the MMAs at 16-64-wide tiles
 * (mixed), four column quarters instead of halves in the 128-wide loop
 * (4-7% slower), a second A buffer set there (no faster), 32-wide tiles
 * split like the 64-wide ones (3-7% slower), two CTAs per SM in the F16
 * modes (3-6% faster even, 12-17% slower skewed; version 8; mode 2 takes
 * them at <= 12 rows per expert since version 18, for routed loads); in the
 * decode-ahead loop (version 9): turns in the FP8 modes (10-14% slower
 * skewed), one group of m64n128 MMAs in the F16 ones (4-7% slower), their
 * turn granted after the first half's MMAs (3-7% slower), token-scale pairs
 * as 8-byte shared loads (5-7% slower), a block's token scales loaded into
 * registers right after its MMAs issue, with the L1 first half's outputs
 * moved to shared memory to make room (7-15% slower), the next block's
 * fetch before the first half retires (5-7% slower), the next block's MMAs
 * before the second half's promotion (ptxas serializes them, C7514; with a
 * second accumulator set for the second half, spills and 10% slower); for
 * loads that are not a multiple of 128 rows per expert (version 10): 128-wide
 * tiles inside the 16/32-wide mixed kernels and 64-wide tail tiles inside the
 * 128-wide ones (a third code path made either kernel slower), a half-empty
 * tile skipping its second half's MMAs or running a first-half-only loop (it
 * still costs 0.93 of a full one); 32-wide tiles with two CTAs per SM (with
 * the epilogue factors loaded late their K loop fits 104 registers: no
 * faster than one CTA per SM) and a double-buffered 16/32-wide FP8 loop
 * for every tile of the mixed kernels (mode 1 0-4% faster, mode 3 up to 5%
 * faster but the 64-wide tiles 5-6% slower; version 11: version 14 keeps
 * it for the 16/32-wide tiles only, Kern::k_loop_db); version 12: a
 * banded unit order (8 token tiles of an expert against all its row blocks,
 * for L2 reuse with a skewed expert: equal at M = 16384-32768 skewed, 2-3%
 * slower at 1024), mode 2 without the
 * fold table's shared memory (one more stage in the L1 16-64-wide kernels:
 * equal), mode 2's scale pairs made in the decode again (2-3% slower) and
 * the 128/160-wide promotion's token scales loaded ahead of the MMA waits
 * (mode 1 4-10% slower, mode 4 4-7%); version 13: units taken from a
 * counter per launch once a CTA's first ring pass is issued (dynamic
 * scheduling: 3-7% slower on even loads, 4-12% faster on some uneven ones;
 * the same producer code walking the round-robin order ran as fast as
 * version 12, so the order itself costs; branch proto/dynamic-units) and
 * mixed 16/32 tiles at two CTAs per SM (its 32-wide K loop spills at 104
 * registers; 6-14% faster on some uneven loads, 3-9% slower on others);
 * version 14: middle tiles in the FP8 modes (up to 2% (mode 1) and 6%
 * (mode 3) slower on even loads for 3-6% on random ones), mode 2's 16-wide
 * kernels with 16/32/64 tiles (6-10% slower at M = 384-512 skewed), 48-wide
 * tiles instead of 64 as the 32-wide kernels' large ones (8-16% slower at
 * M = 1024 skewed), the 64+128 pair below 60 rows per expert (at 57: 2-3%
 * slower on even loads, 0-4% faster on random ones), and more registers for the
 * two-CTA kernels' mixed 16/32 loop: it still spills at 112 and 120 (ptxas;
 * 112 is what one CTA of two rings, four consumer warpgroups and a
 * producer warpgroup would give; with a producer warp instead of a
 * warpgroup, 288 threads, ptxas caps two CTAs per SM at 96), the turn
 * barriers as immediates in the F16 modes' kernels (1-8% slower at
 * M = 4096-32768); version 15: 240 registers for the one-CTA consumers
 * (a 24-register producer: the K loops compile the same, mode 2 at
 * M = 32768 6% slower), the double-buffered loop in mode 2's 16-wide
 * tiles (uniform loads 1-3% faster, routed and skewed ones at M = 512
 * 1-2% slower; mode 4's 16-wide kernels spilled 228-504 bytes with it),
 * token-scale pairs from a scale box starting at tok0 itself (TMA traps:
 * illegal instruction; where the start is aligned anyway, uniform loads,
 * within +-2%: the 128-wide loop waits on its chain, not on issue slots),
 * a shallower ring (6 or 4 stages: within noise), and mode 2's mixed 16/32
 * tiles at two CTAs per SM (ptxas: 208-504 bytes of spills at 104);
 * version 16: the wide tiles' epilogue factors loaded beside the last
 * block's MMAs (no faster: the epilogue is held by its instructions, not by
 * those loads), and each wide half's epilogue run beside the next half's
 * first MMAs (block 0 peeled off the K loop; 5-10% slower at M = 4096-32768,
 * with 72-644 bytes of spills in the L1 kernels; a rotated loop instead made
 * ptxas serialize every MMA, C7514); version 17: the FP8 modes' 128-wide L1
 * epilogue in the producer warpgroup's warps 1-3 from BF16 gates and ups
 * the consumers stage (4-8% slower at M = 4096: the workers' instructions
 * and silu-table loads slow the consumers; the consumers' own epilogue
 * costs no measurable time), and a stage's records as one 5-D TMA tensor
 * copy (mode 1 at M = 256 4% slower, the rest within +-3%); version 29:
 * 48-wide middle tiles in the FP8 modes' 32-wide kernels again (routed
 * loads at M = 1024 2-4% faster, even ones 2-3% and skewed ones 4-5%
 * slower), and a stage's records copied from one contiguous region (the
 * same bytes permuted: no faster, so the records' layout is not what holds
 * the decode-size rows); version 30: two accumulator sets in the F16
 * modes' chunked 16-48-wide loop (modes 2 and 4 0-3% slower), and the FP8
 * loop's trips of four blocks as one loop with a partial last trip (it
 * spilled 152-232 bytes; not run); version 31: the odd block's promotion
 * of that loop deferred to the next trip, beside the even block's MMAs, so
 * that every promotion runs beside MMAs (level at M = 640-1024, modes 1 and
 * 3: the promotion is not what holds it; branch proto/defer-promotion);
 * version 35, for the F16 modes' 160-wide L1 kernels' one value in local
 * memory across the K loop: 240 consumer registers (a 24-register
 * producer; spills 76 -> 44 bytes, the one in the loop stays) and the next
 * block's fetch after the MMAs retire (more spills; neither run).
 * In long runs the decode sizes reach the board's power cap, where each
 * half alone (the copies, the consumers) does not (docs/PERF.md, version
 * 31; ablation builds on branch proto/ablation-v31).
 *
 * Per 128-wide K block each tile accumulates in a fresh FP32 register tile,
 * then promotes: final += acc * token_scale * weight_ref (modes 1, 3, 4) or
 * acc * token_scale (mode 2, whose F16 encoding of e2m1 * scale carries a
 * 2^-14 that the epilogue's row factors take back: Kern::row_factor).
 *
 * Mode 4 decodes mode 1's records like mode 1, with a fold table of F16 high
 * bytes (its values' low bytes are 0), and spreads each byte pair into an F16
 * pair with one byte permute, so its k16 HGMMA steps see K in mm_sm90_kperm
 * order inside every 32-column block; its B operands (the prep kernel's F16
 * copy of x, the L1 epilogue's F16 intermediate) are stored in that order.
 * Mode 2 multiplies F16 pairs of e2m1 * 2^-14 (its own code layout, 1-3
 * instructions per pair: mm_sm90_dec_f16_pair, plugin/layout_sm90.h) by
 * its scales' F16 pairs: its K order (mm_sm90_kperm) puts a column of each
 * of a k32 chunk's two groups in every register, so one conversion of two
 * adjacent scale bytes makes the pair of all the chunk's registers of a
 * row. */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <mutex>
#include <vector>

#include "moe_sm90_impl.h"
#include "sm90_ptx.h"

namespace {

constexpr int kRowsCta = 256;  /* weight rows per work unit: 4 m64 tiles */
/* Consumer warpgroups per CTA, each owning two of a unit's m64 tiles (four
 * of one tile each measured no faster: docs/PERF.md). */
constexpr int kConsumers = 2;
constexpr int kTilesPerWg = 4 / kConsumers;
constexpr int kMaxExperts = 256;
/* Shared memory per CTA: the per-block maximum with one CTA per SM; with
 * two, half of the SM's 228 KiB less the 1 KiB each block reserves. */
constexpr int kSmemLimit1 = 232448;
constexpr int kSmemLimit2 = 233472 / 2 - 1024;

template <int MODE, int BN>
struct Cfg {
  static constexpr bool kF16 = MODE == 2 || MODE == 4; /* HGMMA, F16 activations */
  static constexpr bool kG32 = MODE == 1 || MODE == 4; /* mode 1's records */
  static constexpr int kG = kG32 ? 4 : 8;
  static constexpr int kRec = MM_SM90_RECORD_BYTES(kG, MODE != 2);
  static constexpr int kRefOff = 4096 + 64 * kG;
  /* records per stage: the unit's 4 m64 tiles, or with 128-wide token
   * tiles the 2 of one half of the unit (Kern::kHalves) */
  static constexpr int kRecs = BN >= 128 ? 2 : 4;
  static constexpr int kA = kRecs * kRec;
  static constexpr int kSlab = BN * 128;        /* BN tokens x 128 bytes of K */
  static constexpr int kB = kF16 ? 2 * kSlab : kSlab;
  /* token scales: TMA wants a 16-byte aligned inner start (a box from tok0
   * itself, for 8-byte scale pairs, trapped with an illegal instruction on
   * the H200: docs/PERF.md, version 15), so the box is BN + 4 floats from
   * tok0 & ~3, in a 128-aligned slot */
  static constexpr int kSBoxN = BN + 4;
  static constexpr int kSBox = 4 * kSBoxN;
  static constexpr int kS = (kSBox + 127) / 128 * 128;
  static constexpr int kStage = kA + kB + kS;
};

/* CPS CTAs (1 or 2) share an SM. MIXED: the kernel's walk has an expert
 * order of its own (Kern::setup_walk); the others walk in expert order. */
template <int MODE, int GEMM, int BN, int CPS, bool MIXED>
struct Smem {
  static constexpr int kSmemLimit = CPS == 1 ? kSmemLimit1 : kSmemLimit2;
  using C = Cfg<MODE, BN>;
  /* L1: BN tokens x 128 channels; L2: BN tokens x the output columns of
   * one pass (256, or 128 per half with 128-wide tiles), BF16 */
  static constexpr int kOrder = MIXED ? kMaxExperts : 0; /* the walk's expert order */
  static constexpr int kStaging =
      GEMM == 1 ? BN * 128 * (C::kF16 ? 2 : 1) : BN * (BN >= 128 ? 128 : 256) * 2;
  static constexpr int kFixed = 1024 /* align slack */ + 128 /* table alignment */ +
                                MM_SM90_LUT_ENTRIES * 8 +
                                4 * kConsumers * BN * 4 /* amax */ + kStaging +
                                4 * (kMaxExperts + 1) + kOrder + 16 * 8 /* barriers */ +
                                8 * 10 /* unit descriptors */;
  static constexpr int kStages0 = (kSmemLimit - kFixed) / C::kStage;
  static constexpr int kStages = kStages0 > 10 ? 10 : kStages0;
  /* offsets from the 1024-aligned base */
  static constexpr int kOffB = 0;
  static constexpr int kOffA = kStages * C::kB;
  static constexpr int kOffS = kOffA + kStages * C::kA;
  /* 256-aligned: in mode 1's records a fold-table address is the table's
   * address with its low byte replaced by the scale byte (Kern::fold_entry) */
  static constexpr int kOffLut = (kOffS + kStages * C::kS + 255) / 256 * 256;
  static constexpr int kOffRed = kOffLut + MM_SM90_LUT_ENTRIES * 8;
  static constexpr int kOffStg = kOffRed + 4 * kConsumers * BN * 4;
  static constexpr int kOffSched = kOffStg + kStaging;
  static constexpr int kOffOrder = kOffSched + 4 * (kMaxExperts + 1);
  static constexpr int kOffBar = (kOffOrder + kOrder + 7) / 8 * 8;
  static constexpr int kOffUnit = kOffBar + 20 * 8; /* kStages x 8 bytes */
  static constexpr int kBytes = kOffUnit + 8 * kStages + 1024;
  static_assert(kStages >= 3, "too few pipeline stages");
  static_assert(kBytes <= kSmemLimit, "shared memory budget");
};

struct Params {
  const uint8_t *w;      /* layer weights */
  size_t expert_bytes;
  size_t mat_off;        /* 0 (w13) or w13 bytes (w2) */
  const float *rs;       /* row factors [E][rows] */
  const uint8_t *lut;
  const int32_t *offsets;
  int E, rows, K, Mp, M;
  int mixed;             /* large tiles (Kern::kBig) for experts with more than BS rows */
  int wide_first;        /* mixed tiles: walk the experts of the widest tiles
                            first (Kern::setup_walk); 0: in expert order */
  int width_class;       /* 0: every tile; 1 / 2: only the narrow / wide
                            tiles of a launch pair (tile_span) */
  int wide_above;        /* a pair's wide tiles: 0: the 160-wide ones that
                            mm_sm90_wide_count gives an expert (the 128+160
                            pair); n: the 128-wide ones, every tile of the
                            experts above n rows (the 64+128 and 32+128
                            pairs: 64) */
  int pair_role;         /* 0: a single launch; 1 / 2: the first / second of a
                            launch pair (Kern::produce) */
  const float *row_weight;
  float clamp;
  uint8_t *act;          /* L1 out: [Mp][I] FP8 or F16 */
  float *as_t;           /* L1 out: [I/128][Mp] */
  uint16_t *out;         /* L2 out: [M][H] BF16 */
  const int32_t *out_rows; /* L2: pool row p to out row out_rows[p]; NULL: p */
};

/* ------------------------------------------------------------ PTX bits ---- */
/* (the ones the sm90 kernels share are in sm90_ptx.h) */

/* The consumer warpgroups' turn barriers (Kern::kTurn = 2, 3) with the id
 * as an immediate, for the FP8 mixed kernels' 64-wide tiles: beside the
 * double-buffered loop (Kern::k_loop_db) ptxas spilled the register holding
 * it around their MMAs. The other kernels keep the register form (the F16
 * modes' 128-wide kernels measured 1-8% slower with these). */
__device__ __forceinline__ void turn_sync(int c) {
  if (c) asm volatile("bar.sync 3, 256;" ::: "memory");
  else asm volatile("bar.sync 2, 256;" ::: "memory");
}
__device__ __forceinline__ void turn_grant(int c) { /* the other warpgroup's turn */
  if (c) asm volatile("bar.arrive 2, 256;" ::: "memory");
  else asm volatile("bar.arrive 3, 256;" ::: "memory");
}
/* Mode 1/3/4 decode of one code word (8 weights) with its fold-table entry
 * t (8 magnitude bytes): lo = bytes of nibbles 0-3 (signs at bits 8i + 7),
 * hi = nibbles 4-7 (signs at 8i + 3), as the packers lay them out
 * (docs/LAYOUTS.md). */
__device__ __forceinline__ void dec_fold(uint32_t word, uint2 t, uint32_t &lo, uint32_t &hi) {
  const uint32_t sel = word & 0x77777777u;
  lo = prmt(t.x, t.y, sel) | (word & 0x80808080u);
  hi = prmt(t.x, t.y, sel >> 16) | ((word << 4) & 0x80808080u);
}
__device__ __forceinline__ uint32_t hmul2u(uint32_t a, uint32_t b) {
  __half2 r = __hmul2(*reinterpret_cast<__half2 *>(&a), *reinterpret_cast<__half2 *>(&b));
  return *reinterpret_cast<uint32_t *>(&r);
}
/* Two E4M3 bytes (low = first) -> F16 pair (exact). */
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
  uint32_t d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"((uint16_t)two));
  return d;
}
__device__ __forceinline__ uint8_t f32_to_e4m3(float x) {
  return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ float round_bf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}
/* silu(g) = g / (1 + e^-g) for N values, bit for bit what that expression
 * (mm_swiglu_weighted's) gives on the device, without a branch per value:
 * the division's own fast path (a reciprocal and two Newton steps, then one
 * correction, as div.rn.f32 takes when its range check passes) for every
 * value, and the division itself for all N only where some value lies
 * outside the range where that path is exact. Per value, `/` compiles to the
 * fast path and a branch to a slow-path call; the convergence region around
 * each kept the 32 divisions of an epilogue one after the other
 * (docs/PERF.md, version 16). It fills the silu table (g_silu_bf16) and
 * gives the silu of a clamp that BF16 cannot hold. The range:
 * g finite, at least -87 and |g| at least 2^-100, so that 1 + e^-g lies in
 * [1, 2^126) (exactly 1 from g = 17 up) and the quotient is normal; g = +-0
 * gives g itself (-0 / b is -0, which the path would make +0), and a g
 * whose 1 + e^-g is infinite (below about -88.7) gives -0. NaN, infinities
 * and the few values in between take the division. mm_sm90_check_silu
 * compares this with `/` on every BF16 value of g. */
template <int N>
__device__ __forceinline__ void silu_n(const float (&g)[N], float (&s)[N]) {
  bool fast = true;
#pragma unroll
  for (int k = 0; k < N; k++) {
    const float b = 1.0f + expf(-g[k]), ag = fabsf(g[k]);
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
    r = fmaf(r, fmaf(-b, r, 1.0f), r);
    const float q = g[k] * r;
    const float f = fmaf(r, fmaf(-b, q, g[k]), q);
    const bool inf_b = b == __int_as_float(0x7f800000);
    fast = fast && (ag <= 0x1.fffffep127f && (g[k] >= -87.0f || inf_b) &&
                    (ag >= 0x1p-100f || ag == 0.0f));
    s[k] = ag == 0.0f ? g[k] : inf_b ? -0.0f : f;
  }
  /* one division for all N in a loop, its value picked and put back with
   * selects: indexing g and s at run time would put them in local memory,
   * and N divisions unrolled would each bring their slow-path call */
  if (!fast)
#pragma unroll 1
    for (int k = 0; k < N; k++) {
      float gk = g[0];
#pragma unroll
      for (int j = 1; j < N; j++) gk = k == j ? g[j] : gk;
      const float sk = gk / (1.0f + expf(-gk));
#pragma unroll
      for (int j = 0; j < N; j++) s[j] = k == j ? sk : s[j];
    }
}
/* silu of every BF16 value, by bit pattern: the L1 epilogue's gates are
 * BF16 (or the clamp), so one load replaces silu_n's 14 instructions per
 * value (exp, reciprocal, Newton steps, range checks) with the same bits:
 * modes 1, 2 and 4 0.5-3% faster than with silu_n at M = 4096-32768, mode
 * 3 equal (docs/PERF.md, version 16).
 * Filled once per device by mm_sm90_silu_table_init, at layer creation. */
__device__ float g_silu_bf16[65536];

__global__ void silu_table_kernel() {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 65536u) return;
  const float g[1] = {__uint_as_float(i << 16)};
  float s[1];
  silu_n(g, s);
  g_silu_bf16[i] = s[0];
}
/* Token column of the k-th of a lane's N / 4 accumulator columns (q = lane
 * % 4): the m64nN fragment holds column 8 * (k / 2) + 2q + (k & 1) in
 * register 4 * (k / 2) + (k & 1) (row r0) and in that + 2 (row r0 + 8). */
__device__ __forceinline__ int acc_col(int k, int q) { return 8 * (k >> 1) + 2 * q + (k & 1); }
/* A consumer thread's place in its warpgroup's m64 fragments: thread tid =
 * 32 w + 4 g + q owns rows r0 = 16 w + g and r0 + 8 of each tile and the
 * token columns acc_col(k, q). */
struct FragPlace {
  int tid, w, lane, g, q, r0;
};
__device__ __forceinline__ FragPlace frag_place() {
  const int tid = threadIdx.x % 128, w = tid / 32, lane = tid % 32, g = lane / 4;
  return {tid, w, lane, g, lane % 4, 16 * w + g};
}
/* The first N of an accumulator array's R registers: the m64nN fragment of
 * its first N token columns (acc_col's layout puts them first). */
template <int N, int R>
__device__ __forceinline__ float (&head(float (&a)[R]))[N] {
  static_assert(N <= R, "a prefix");
  return *reinterpret_cast<float(*)[N]>(&a[0]);
}
/* The last N of an accumulator array's R registers (k_loop_ahead: its
 * second column half's m64n(2N) fragment). */
template <int N, int R>
__device__ __forceinline__ float (&tail(float (&a)[R]))[N] {
  static_assert(N <= R, "a suffix");
  return *reinterpret_cast<float(*)[N]>(&a[R - N]);
}

/* mma<FP8, N>: one m64nNk32 (FP8 E4M3) or m64nNk16 (F16) WGMMA, A from
 * registers, B from a shared-memory descriptor, D += A*B (D = A*B when
 * scale_d is 0). */
template <int FP8, int N>
__device__ __forceinline__ void mma(float (&d)[N / 2], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint64_t desc, int scale_d);

/* Inline asm wants literal operand lists, so one macro writes the six
 * specializations. Per N: the accumulator's "+f" constraints and PTX operands
 * (%0 .. %(N/2 - 1), MM_ACC_N and MM_D_N in sm90_ptx.h), then the operands
 * after them: {a0..a3}, desc and scale_d. KTYPE: K and the input types;
 * TAIL: F16's B-transpose immediate. */
#define MM_AB_16 "{%8, %9, %10, %11}, %12"
#define MM_AB_24 "{%12, %13, %14, %15}, %16"
#define MM_AB_32 "{%16, %17, %18, %19}, %20"
#define MM_AB_40 "{%20, %21, %22, %23}, %24"
#define MM_AB_48 "{%24, %25, %26, %27}, %28"
#define MM_AB_56 "{%28, %29, %30, %31}, %32"
#define MM_AB_64 "{%32, %33, %34, %35}, %36"
#define MM_AB_80 "{%40, %41, %42, %43}, %44"
#define MM_SCALE_16 "%13"
#define MM_SCALE_24 "%17"
#define MM_SCALE_32 "%21"
#define MM_SCALE_40 "%25"
#define MM_SCALE_48 "%29"
#define MM_SCALE_56 "%33"
#define MM_SCALE_64 "%37"
#define MM_SCALE_80 "%45"
#define MM_WGMMA(FP8, N, KTYPE, TAIL)                                                     \
  template <>                                                                            \
  __device__ __forceinline__ void mma<FP8, N>(float (&d)[N / 2], uint32_t a0, uint32_t a1, \
                                              uint32_t a2, uint32_t a3, uint64_t desc,     \
                                              int scale_d) {                               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " MM_SCALE_##N ", 0;\n"               \
                 "wgmma.mma_async.sync.aligned.m64n" #N KTYPE " "                       \
                 "{" MM_D_##N "}, " MM_AB_##N ", p, 1, 1" TAIL ";\n}\n"                  \
                 : MM_ACC_##N(d)                                                        \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d));       \
  }
#define MM_WGMMA_N(N)                      \
  MM_WGMMA(1, N, "k32.f32.e4m3.e4m3", "") \
  MM_WGMMA(0, N, "k16.f32.f16.f16", ", 0")
MM_WGMMA_N(16)
MM_WGMMA_N(24) /* mode 2's 32-wide large tiles of 17-24 rows (Kern::kNarrow) */
MM_WGMMA_N(32)
MM_WGMMA_N(40) /* a 64-wide tile's MMAs for 33-40 rows (Kern::kNarrow) */
MM_WGMMA_N(48) /* the F16 modes' 32-wide kernels' middle tiles */
MM_WGMMA_N(56) /* 64-wide tiles of 49-56 rows in the F16 modes */
MM_WGMMA_N(64) /* the 128-wide loop issues two n64 halves */
MM_WGMMA_N(80) /* the 160-wide loop: two n80 halves */
#undef MM_WGMMA_N
#undef MM_WGMMA

/* ------------------------------------------------------------- kernel ---- */

/* Work units: (expert, 256-row block, token tile). An expert with at most BS
 * rows gets one BS-wide token tile; with mixed tiles (BS < 64) an expert
 * with more rows gets BIG-wide tiles (Kern::kBig: 64, or 32), so a skewed
 * expert's weights are decoded once per BIG of its tokens rather than once
 * per BS. */
struct Unit {
  int e, rb, tok0, valid, bn;
};
/* A unit as the producer publishes it to the consumers, in the stage that
 * holds its first K block (Kern::produce): one 8-byte shared load instead of
 * each consumer thread walking the schedule (integer divisions and global
 * loads of the expert offsets at every unit). Fields of 8 bits: e < 256
 * (kMaxExperts), rb < 256 (mm_sm90_wgmma_unsupported), valid and bn <= 160;
 * valid = 0: no more units (every unit holds a row). */
__device__ __forceinline__ uint2 unit_pack(const Unit &u) {
  return make_uint2((uint32_t)u.tok0,
                    (uint32_t)u.e | (uint32_t)u.rb << 8 | (uint32_t)u.valid << 16 | (uint32_t)u.bn << 24);
}
__device__ __forceinline__ Unit unit_unpack(uint2 v) {
  Unit u;
  u.tok0 = (int)v.x;
  u.e = v.y & 0xFF;
  u.rb = (v.y >> 8) & 0xFF;
  u.valid = (v.y >> 16) & 0xFF;
  u.bn = v.y >> 24;
  return u;
}
template <int BS, bool kMixed, int BIG, int MID>
__device__ __forceinline__ int unit_tile(int m, int mixed) {
  return kMixed && mixed && m > BS ? (MID && m <= MID ? MID : BIG) : BS;
}
/* An expert's token tiles in this launch (Params::width_class): how many,
 * and the row of the first, counted from the expert's first row. A single
 * launch takes them all. The 64+128 and 32+128 pairs give an expert to one
 * launch whole: above wide_above rows to the 128-wide one. The 128+160 pair
 * splits it (mm_sm90_wide_count, layout_sm90.h): the 160-wide launch takes
 * its first 160 a rows, the 128-wide launch the rest. Only the 128- and
 * 160-wide kernels (BS) run that pair: the others keep the split's code out
 * (mode 4's two-CTA 16-wide L1 kernel spilled 16 more bytes with it). */
struct TileSpan {
  int n, row0;
};
template <int BS>
__device__ __forceinline__ TileSpan tile_span(int m, int bn, int width_class, int wide_above) {
  TileSpan t = {(m + bn - 1) / bn, 0};
  if (width_class == 0) return t;
  if (BS < 128 || wide_above) {
    if ((width_class == 2) != (m > wide_above)) t.n = 0;
    return t;
  }
  const int a = mm_sm90_wide_count(m);
  if (width_class == 2) {
    t.n = a;
  } else {
    t.n = mm_sm90_narrow_count(m, a);
    t.row0 = 160 * a;
  }
  return t;
}

/* Walks this CTA's work units: returns false when done. The walk goes
 * through the experts in the order `order` gives (Kern::setup_walk): sched[i]
 * is the first unit of expert order[i]; *pos, the walk's place in it. */
template <int BS, bool kMixed, int BIG, int MID>
__device__ __forceinline__ bool next_unit(const int *sched, const uint8_t *order, const int32_t *off,
                                          int E, int mixed, int width_class, int wide_above, int u,
                                          int *pos, Unit *out) {
  if (u >= sched[E]) return false;
  while (sched[*pos + 1] <= u) (*pos)++;
  const int e = kMixed ? order[*pos] : *pos;
  const int m = off[e + 1] - off[e], bn = unit_tile<BS, kMixed, BIG, MID>(m, mixed);
  /* the walk visits only experts with tiles here (setup_walk): below 128
   * wide, all of an expert's from its first row */
  TileSpan ts = {(m + bn - 1) / bn, 0};
  if (BS >= 128) ts = tile_span<BS>(m, bn, width_class, wide_above);
  const int local = u - sched[*pos];
  out->e = e;
  out->rb = local / ts.n;
  const int nt = local % ts.n;
  out->bn = bn;
  out->tok0 = off[e] + ts.row0 + nt * bn;
  out->valid = min(bn, m - ts.row0 - nt * bn);
  return true;
}

/* Threads and register split per CTAs-per-SM count: the entry count
 * (65536 / CPS / threads, rounded down to 8) times the threads is the CTA's
 * pool; the producer gives back registers and the consumers take the rest
 * (one CTA: 168 -> 40 / 232; two: 80 -> 24 / 104). */
template <int CPS>
struct Warps {
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kEntry = 65536 / CPS / kThreads / 8 * 8;
  static constexpr int kProducerRegs = CPS == 1 ? 40 : 24;
  static constexpr int kConsumerFree =
      (kEntry * kThreads - 128 * kProducerRegs) / (128 * kConsumers) / 8 * 8;
  static constexpr int kConsumerRegs = kConsumerFree > 232 ? 232 : kConsumerFree;
  static_assert(CPS == 1 || CPS == 2, "1 or 2 CTAs per SM");
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= kEntry * kThreads,
                "register pool over-committed (setmaxnreg.inc would hang)");
};
/* 2^e as FP32 without branches, equal to mm_sm90_pow2 for e in [-254, 255]
 * (the packers' reference exponents stay within about +-160): exact for
 * [-149, 127], 0 below (2^-150 is a tie to 0), +inf above; the product of
 * two normal powers of two rounds only outside FP32's range. */
__device__ __forceinline__ float pow2_exact(int e) {
  const int h = e >> 1;
  return __fmul_rn(__int_as_float((h + 127) << 23), __int_as_float((e - h + 127) << 23));
}

/* The token side's tensor maps of a launch, as the kernel holds them (its
 * __grid_constant__ parameters): token tile and scales of the BS-wide tiles
 * (b, s), of the large ones (bl, sl: Kern::kBig) and of the middle ones (bm,
 * sm: Kern::kMid); the host's TileMaps, by address. */
struct TokenMaps {
  const CUtensorMap *b, *s, *bl, *sl, *bm, *sm;
};

/* The kernel's two roles, warp-specialized: a producer warpgroup (one thread
 * issues the copies) and the consumer warpgroups. BS: the token tile of
 * small experts; kMixed adds larger tiles (kBig) for the others (one CTA per
 * SM only: their accumulators do not fit two CTAs' registers; 16/32 there
 * measured with a spilling 32-wide loop, version 13). ONE
 * (modes 1, 3 and 4): every reference exponent of the matrix is 0 (the
 * packer's row anchor moved each row's into its row factor), so the
 * promotion skips the reference multiply, and the K loop the references'
 * loads and powers of two. A kernel of its own rather than a branch per
 * tile: two copies of the K loop in one kernel ran the per-block-reference
 * copy 4-7% slower (docs/PERF.md, version 7). At 16-64-wide tiles ONE
 * measured 2-8% faster (version 8), at 128-wide 8-10% (version 7); mode 4's
 * share of its 8-11% (with the byte permutes, version 8) was not measured
 * apart; mode 3 (anchored since version 25) 6-9% faster at M = 256-4096
 * (version 33; version 10, before its K order, measured 0-4.5%). */
template <int MODE, int GEMM, int BS, int CPS, bool ONE = false>
struct Kern {
  static constexpr bool kMixed = BS < 64 && CPS == 1;
  /* the mixed kernels' large tile: 64, or 32 in the 16-wide kernels of
   * modes 1-3 (mode 2, version 13: with random routing at 8-16 rows per
   * expert 9-21% faster, even loads equal; with a 64-wide one beside it,
   * version 14, 6-10% slower at M = 384-512 skewed; the FP8 modes' one-CTA
   * 16-wide kernels run 13-20 rows per expert, version 18). Mode 4 keeps 64
   * with a 32-wide middle tile (version 13: 32 alone 2-4% slower on even
   * loads). */
  static constexpr int kBig = BS == 16 && MODE != 4 ? 32 : 64;
  /* Middle tiles (0: none): an expert of BS + 1 to kMid rows gets kMid-wide
   * tiles, above that kBig-wide ones. The F16 modes' 32-wide kernels take
   * 48 and mode 4's 16-wide ones 32: under random routing, where half the
   * experts hold a few rows more than the tile, 4-12% faster at M = 768-1024
   * and 7-21% at M = 256-512 in mode 4, even and skewed loads within 1-2%
   * (mode 4's 16-wide kernels 2-4% slower there: the third K loop's code
   * alone, since those loads never take it). In the FP8 modes the third
   * loop slowed even loads by up to 2% (mode 1) and 6% (mode 3) for 3-6%
   * on random ones (docs/PERF.md, version 14). */
  static constexpr int kMid =
      !kMixed ? 0 : BS == 32 && (MODE == 2 || MODE == 4) ? 48 : BS == 16 && MODE == 4 ? 32 : 0;
  /* Narrow MMAs (Kern::k_loop_chunked): a large tile of at most kNarrow
   * rows issues m64n<kNarrow> MMAs and promotes kNarrow columns, not kBig:
   * the experts a few rows above the small (or middle) tiles, half of them
   * under random routing. 40 in mode 4's 16-wide kernels (above their
   * 32-wide middle tiles) and the FP8 modes' 32-wide ones (33-40 rows):
   * routed loads at M = 1024 5-6% (mode 1) and 6-7% (mode 3) faster, even
   * and skewed ones within 1%; with 48 beside 40, skewed loads 1-2% slower
   * (docs/PERF.md, version 32). The F16 modes' 32-wide kernels take 56
   * above their 48-wide middle tiles, mode 2's 16-wide ones 24 (routed
   * loads at M = 512 and 1536 2% faster). The FP8 modes' 16-wide kernels
   * keep full 32-wide large tiles: with a second, m64n24 instantiation of
   * their double-buffered loop ptxas serialized the WGMMAs of mode 3's L1
   * kernel (C7511, registers), which ran 2-4.5% slower at M = 512-640,
   * even loads too. The 64-wide kernels (not mixed: the 64+128 pair's first
   * launch, whose tiles hold the experts of at most 64 rows) take 48 for
   * their tiles: the small experts of skewed loads, at 60-88 rows per
   * expert 4-11% faster, zipf loads 2-6% (version 38). */
  static constexpr int kNarrow = !kMixed ? 48 : kBig == 32 ? 24 : kMid == 48 ? 56 : 40;
  /* The FP8 modes' 32-wide kernels (one CTA per SM, double-buffered loop):
   * a small tile of at most 24 rows issues m64n24 MMAs (the small experts of
   * skewed and zipf loads at 21-49 rows per expert: 7-24 rows, which fill
   * half of a 32-wide tile; scripts/padding_by_count.py). 0: none. */
  static constexpr int kNarrowSmall = ONE && BS == 32 && kMixed && (MODE == 1 || MODE == 3) ? 24 : 0;
  static constexpr int kBNMax = kMixed ? kBig : BS;
  using S = Smem<MODE, GEMM, kBNMax, CPS, kMixed>;
  using CM = Cfg<MODE, kBNMax>; /* stage strides */
  using W = Warps<CPS>;
  /* 128-wide token tiles (prefill): two 128-row halves of the unit one
   * after the other, one m64 tile per consumer warpgroup in each, since two
   * tiles' accumulators of 128 columns would not fit the registers; the L1
   * epilogue keeps the first half's SwiGLU outputs in registers until the
   * second half completes the 128 channels of its FP8 scale. */
  static constexpr bool kWide = BS >= 128;
  static constexpr int kHalves = kWide ? 2 : 1;
  static constexpr int TPW = kWide ? 1 : kTilesPerWg;
  static_assert(CM::kRecs == kConsumers * TPW, "records per stage");
  /* Turns: the consumer warpgroups take turns issuing a block's MMAs (named
   * barriers kTurn + c), so that one promotes while the other's MMAs run,
   * instead of both promoting at once beside an idle tensor pipe. Measured
   * (docs/PERF.md, version 5): with 64-wide tiles 4-9% faster in modes 1-3
   * and 1% in mode 4, with 128-wide tiles 2-4% faster in modes 2-4 and 3%
   * slower in mode 1 (the least work beside its MMAs); in the decode-ahead
   * loop (version 9) mode 1 equal at M = 32768 and 10-14% slower skewed with
   * them, so the FP8 modes' 128-wide tiles go without. 16- and 32-wide tiles
   * are decode-bound, and turns would serialize their decode; the mixed
   * kernels' 64-wide tiles take them (kTurns in consume: version 13, 4-9%
   * faster at M = 1024 with random routing, where half the experts hold more
   * than 32 rows; the tiles of the other width skip the barriers, whose
   * grants then wait for the next 64-wide tile). Warpgroup 1 grants the
   * first turn; warpgroup 0 takes the last grant. */
  static constexpr bool kPingPong = BS == 64 || (kMixed && kBig == 64) || (kWide && CM::kF16);
  static constexpr int kTurn = 2; /* barriers 2 and 3: turn_sync, turn_grant */
  /* barriers 4 and 5: the L2 epilogue of warpgroup 0 / 1 (barrier 1: the
   * L1 epilogue, both warpgroups) */
  static constexpr int kEpilogueWg = 4;
  static_assert(kTurn == 2 && kConsumers == 2, "turn_sync's immediates");
  /* Mode 2 with one CTA per SM: a block's scale pairs are made with its
   * records, not in the decode (Kern::consume; the two-CTA kernels spill
   * with them). */
  static constexpr bool kScalesAhead = MODE == 2 && CPS == 1;
  /* Double-buffered K loop for 16- and 32-wide tiles (Kern::k_loop_db):
   * FP8 modes, one CTA per SM (the two-CTA kernels have 104 registers, and
   * the second A buffer set alone takes 32 at 16-wide tiles). */
  static constexpr bool kDoubleBuffer = !CM::kF16 && CPS == 1;
  /* Bytes of each weight record the producer copies: the ONE kernels never
   * read the reference exponents (the record's last 128 bytes, all 0), so
   * they stay in HBM. */
  static constexpr int kRecCopy = ONE ? CM::kRefOff : CM::kRec;
  static_assert(kRecCopy % 16 == 0, "bulk copies move multiples of 16 bytes");
  /* An epilogue row factor as the epilogue applies it: mode 2's F16 weights
   * hold e2m1 * scale * 2^-14, so its row factors carry the 2^14 back. Once
   * per row and unit, not in the promotion (an FMUL per token scale and K
   * block); a power of two commutes with every rounding on the way (barring
   * FP32 underflow), so the outputs are the same bits. Applied where the
   * epilogue uses the factor, not where it is loaded: the small tiles load
   * their factors before the K loop, and a multiply there would wait for
   * the load. */
  static __device__ __forceinline__ float row_factor(float v) {
    return MODE == 2 ? v * 16384.0f : v;
  }
  /* A token scale t times the weight reference factor w of its row and
   * block: t alone in the ONE kernels, where every reference is 0. */
  static __device__ __forceinline__ float with_ref(float t, float w) { return ONE ? t : t * w; }
  /* One m64 tile's promotion after a 16-64-wide K block: fin += acc times
   * the token factor of the register's column (sx, one per acc_col) and,
   * unless ONE, the reference factor of its row (sw: rows r0, r0 + 8). */
  template <int NR>
  static __device__ __forceinline__ void promote_tile(float (&fin)[NR], const float (&acc)[NR],
                                                      const float (&sx)[NR / 2],
                                                      const float (&sw)[2]) {
#pragma unroll
    for (int i = 0; i < NR; i++)
      fin[i] = fmaf(acc[i], with_ref(sx[(i >> 2) * 2 + (i & 1)], sw[(i >> 1) & 1]), fin[i]);
  }
  /* the unit's m64 tile (0..3) of tile j of warpgroup c in half h */
  static __device__ __forceinline__ int tile_of(int h, int c, int j) {
    return kConsumers * TPW * h + TPW * c + j;
  }

  /* ---- the decode, shared by both K loops ---- */
  /* Scale bytes per row of a record's block: 4 in mode 1's records, 8
   * otherwise; row r's start at byte 4096 + kRowScaleBytes * r. */
  static constexpr int kRowScaleBytes = CM::kG32 ? 4 : 8;
  /* A row's scale bytes at p (in .x only in mode 1's records, there masked
   * to multiples of 8 below 256: byte offsets into the compact fold table,
   * which the packer's indices MM_SM90_LUT_INDEX(k, 0) are). */
  static __device__ __forceinline__ uint2 row_scales(const uint8_t *p) {
    if (CM::kG32) return make_uint2(*(const uint32_t *)p & 0xF8F8F8F8u, 0u);
    return *(const uint2 *)p;
  }
  /* The fold-table entry (modes 1, 3, 4) of a row's code word in chunk ch:
   * one group's scale for all 8 codes (mode 3's words hold one 16-group's
   * columns in its K order). Mode 1's records index the compact table
   * (entry k at byte 8k, 256-aligned): one prmt puts the scale byte in the
   * low byte of the table's address, and the load takes that address as is,
   * without the shift-and-add of an index (modes 1 and 4 1-3% faster at M =
   * 768-2048, docs/PERF.md version 11). Mode 3's byte extract is one prmt,
   * zero-filled from the 0 operand: group 2 ch + q / 2 (mm_sm90_kperm; two
   * entries per word before version 30). */
  static __device__ __forceinline__ uint2 fold_entry(const uint2 *lut, uint2 sb, int ch) {
    if (CM::kG32) {
      uint2 t;
      const uint32_t a = prmt(sb.x, (uint32_t)smem_u32(lut), 0x7650 | ch);
      asm("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(t.x), "=r"(t.y) : "r"(a));
      return t;
    }
    const uint32_t v = ch < 2 ? sb.x : sb.y;
    return lut[prmt(v, 0, 0x4440 | (2 * (ch & 1) + ((threadIdx.x >> 1) & 1)))];
  }
  /* Mode 2: the F16 scale pair of a row's k32 chunk ch (0..3), the scales
   * of its groups 2 ch and 2 ch + 1: every A register of the chunk holds a
   * column of each in its low and high half (mm_sm90_kperm_pos), so one
   * conversion of the two adjacent scale bytes makes it (version 12; before,
   * a byte permute and a conversion per group made (s, s) pairs). */
  static __device__ __forceinline__ uint32_t scale_pair(uint2 sb, int ch) {
    const uint32_t sv = ch < 2 ? sb.x : sb.y;
    return e4m3x2_to_f16x2(ch & 1 ? sv >> 16 : sv);
  }
  /* The A registers of one code word, row rr (0: r0, 1: r0 + 8) of a k32
   * chunk: FP8 registers rr and rr + 2 of a[0], or in the F16 modes those
   * of the chunk's two k16 steps a[0], a[1]. t: its fold-table entry
   * (modes 1, 3, 4); sc: mode 2's scale pair of the chunk. */
  static __device__ __forceinline__ void decode_word(uint32_t word, uint2 t, uint32_t sc, int rr,
                                                     uint32_t (&a)[2][4]) {
    if (MODE == 2) {
      a[0][rr] = hmul2u(mm_sm90_dec_f16_pair(word, 0), sc);
      a[0][rr + 2] = hmul2u(mm_sm90_dec_f16_pair(word, 1), sc);
      a[1][rr] = hmul2u(mm_sm90_dec_f16_pair(word, 2), sc);
      a[1][rr + 2] = hmul2u(mm_sm90_dec_f16_pair(word, 3), sc);
      return;
    }
    uint32_t lo, hi;
    dec_fold(word, t, lo, hi);
    if (MODE == 4) {
      /* each byte pair to an F16 pair: mode 4's table holds F16 high bytes
       * (the low bytes of its values are 0), so one byte permute with zeros
       * makes the pair. FP8 register rr (+2) of the chunk splits into F16
       * register rr (+2) of its k16 steps (mm_sm90_kperm_src order). */
      a[0][rr] = prmt(lo, 0, 0x1404);
      a[1][rr] = prmt(lo, 0, 0x3424);
      a[0][rr + 2] = prmt(hi, 0, 0x1404);
      a[1][rr + 2] = prmt(hi, 0, 0x3424);
    } else {
      a[0][rr] = lo;
      a[0][rr + 2] = hi;
    }
  }

  /* The ring position after (stage, phase): the next stage, the phase
   * flipped where the ring wraps. */
  static __device__ __forceinline__ void advance(int &stage, uint32_t &phase) {
    if (++stage == S::kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  /* A consumer thread's release of the stage it has read, once the MMAs
   * reading it have retired, then the next stage: every thread arrives for
   * its own reads (an arrive releases only the arriving thread's accesses),
   * after a proxy fence, since the producer's next bulk copy (async proxy)
   * overwrites the stage. */
  static __device__ __forceinline__ void release_stage(uint64_t *empty, int &stage,
                                                       uint32_t &phase) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    mbar_arrive(&empty[stage]);
    advance(stage, phase);
  }

  /* Token-side copies of one stage: the token tile and its scales. */
  static __device__ __forceinline__ void load_tokens(uint8_t *sm, const Unit &un, int kb,
                                                     int stage, const TokenMaps &tm) {
    using C = CM;
    uint64_t *full = (uint64_t *)(sm + S::kOffBar);
    const bool big = kMixed && un.bn == kBig, mid = kMid && un.bn == kMid;
    const CUtensorMap *mb = big ? tm.bl : mid ? tm.bm : tm.b, *ms = big ? tm.sl : mid ? tm.sm : tm.s;
    uint8_t *dB = sm + S::kOffB + stage * C::kB;
    tma_2d(dB, mb, kb * 128, un.tok0, &full[stage]);
    if (C::kF16) tma_2d(dB + un.bn * 128, mb, kb * 128 + 64, un.tok0, &full[stage]);
    tma_2d(sm + S::kOffS + stage * C::kS, ms, un.tok0 & ~3, kb, &full[stage]);
  }

  /* The walk's expert order and the first unit of each (warp 0, before the
   * block's first barrier): order[i] is the i-th expert walked, sched[i] its
   * first unit, sched[E] the units of the launch. In the mixed kernels the
   * experts of the large tiles come first, then the middle ones, then the
   * small (p.wide_first): the round-robin walk deals out the costlier units
   * first, so that every CTA's count of them differs by at most one and the
   * small units go on from the CTAs that got fewer. In expert order, routed
   * loads left some CTAs two or three large units more than others, about
   * four units of the GEMM each (docs/PERF.md, version 29). Within a width
   * the expert order stays, and so does each expert's own unit order. */
  static __device__ __forceinline__ void setup_walk(const Params &p, int *sched, uint8_t *order) {
    const int lane = threadIdx.x, E = p.E, RB = p.rows / kRowsCta;
    int placed = 0;
    /* without wide-first ranks every expert is rank 2: one pass */
    for (int rank = kMixed && p.wide_first ? 0 : 2; rank < 3; rank++) /* large, middle, small */
      for (int e0 = 0; e0 < E; e0 += 32) {
        const int e = e0 + lane;
        int n = 0, r = 2;
        if (e < E) {
          const int m = p.offsets[e + 1] - p.offsets[e], bn = unit_tile<BS, kMixed, kBig, kMid>(m, p.mixed);
          n = tile_span<BS>(m, bn, p.width_class, p.wide_above).n * RB;
          if (p.wide_first && bn != BS) r = bn == kBig ? 0 : 1;
        }
        const uint32_t mine = __ballot_sync(0xffffffffu, e < E && r == rank);
        if (e < E && r == rank) {
          const int i = placed + __popc(mine & ((1u << lane) - 1u));
          if (kMixed) order[i] = (uint8_t)e; /* the others' order is the experts' own */
          sched[i] = n; /* the count, until the scan below */
        }
        placed += __popc(mine);
      }
    __syncwarp();
    int carry = 0;
    for (int i0 = 0; i0 < E; i0 += 32) {
      const int i = i0 + lane, n = i < E ? sched[i] : 0;
      int x = n; /* inclusive scan over the lanes */
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
      }
      if (i < E) sched[i] = carry + x - n;
      carry += __shfl_sync(0xffffffffu, x, 31);
    }
    if (lane == 0) sched[E] = carry;
  }

  /* The kernel is launched as a programmatic dependent of the previous one
   * on the stream (the prep kernel before L1, L1 before L2): it may start
   * while that one finishes. Only the token side comes from it, so the
   * first pass over the ring copies weights at once and the token tiles
   * after griddepcontrol.wait (which makes the previous kernel's writes
   * visible); the consumers only read what these copies bring.
   * The launch pair (Params::pair_role): the first launch lets the second
   * one start only after its own wait (the trigger in catch_up), so that
   * the second one's token tiles, which come from the same earlier kernels,
   * are complete when it starts: it copies them at once and runs beside the
   * first launch's last units. It waits for the first launch at its end, so
   * that the next kernel, which waits for it, sees both launches' results. */
  static __device__ __forceinline__ void produce(const Params &p, uint8_t *sm, const int *sched,
                                                 const uint8_t *order, const TokenMaps &tm) {
    using C = CM;
    uint64_t *full = (uint64_t *)(sm + S::kOffBar), *empty = full + S::kStages;
    uint2 *units = (uint2 *)(sm + S::kOffUnit);
    const int KB = p.K / 128;
    /* early: first-pass stages without their tokens (-1: none) */
    int stage = 0, pos = 0, early = p.pair_role == 2 ? -1 : 0;
    uint32_t phase = 0;
    Unit un;
    /* token copies of the first `early` stages, walked again from the start */
    auto catch_up = [&]() {
      asm volatile("griddepcontrol.wait;" ::: "memory");
      if (p.pair_role == 1) asm volatile("griddepcontrol.launch_dependents;");
      int pos2 = 0, n = 0;
      Unit u2;
      for (int u = blockIdx.x;
           n < early &&
           next_unit<BS, kMixed, kBig, kMid>(sched, order, p.offsets, p.E, p.mixed, p.width_class,
                                             p.wide_above, u, &pos2, &u2);
           u += gridDim.x)
        for (int h = 0; h < kHalves && n < early; h++)
          for (int kb = 0; kb < KB && n < early; kb++, n++)
            load_tokens(sm, u2, kb, n, tm);
      early = -1;
    };
    for (int u = blockIdx.x;
         next_unit<BS, kMixed, kBig, kMid>(sched, order, p.offsets, p.E, p.mixed, p.width_class,
                                           p.wide_above, u, &pos, &un);
         u += gridDim.x) {
      const uint32_t tx = C::kRecs * kRecCopy + (C::kF16 ? 2 : 1) * un.bn * 128 + 4 * (un.bn + 4);
      for (int h = 0; h < kHalves; h++) {
        const uint8_t *wrec = p.w + (size_t)un.e * p.expert_bytes + p.mat_off +
                              (size_t)(un.rb * 4 + h * C::kRecs) * (size_t)KB * C::kRec;
        for (int kb = 0; kb < KB; kb++) {
          mbar_wait(&empty[stage], phase ^ 1);
          if (h == 0 && kb == 0) units[stage] = unit_pack(un);
          mbar_expect_tx(&full[stage], tx);
          uint8_t *dA = sm + S::kOffA + stage * C::kA;
#pragma unroll
          for (int i = 0; i < C::kRecs; i++)
            bulk_g2s(dA + i * C::kRec, wrec + ((size_t)i * KB + kb) * C::kRec, kRecCopy,
                     &full[stage]);
          if (early < 0) load_tokens(sm, un, kb, stage, tm);
          else if (++early == S::kStages) catch_up(); /* before any stage is reused */
          advance(stage, phase);
        }
      }
    }
    if (early >= 0) catch_up();
    else if (p.pair_role == 2) asm volatile("griddepcontrol.wait;" ::: "memory");
    /* the end: a descriptor without a unit, its stage completed by a plain
     * arrive (no bytes) */
    mbar_wait(&empty[stage], phase ^ 1);
    units[stage] = make_uint2(0u, 0u);
    mbar_arrive(&full[stage]);
  }

  /* The K loop of one 128- or 160-wide tile, decoding ahead: block kb + 1's
   * records are fetched and decoded while block kb is promoted, in one straight
   * stretch of code, so that the decode's byte permutes and table loads (ALU
   * pipe, shared memory) overlap the promotion's FMAs; block kb + 1's MMAs
   * then issue together from four ready A buffers, in two groups (token
   * columns 0-63 and 64-127, or 0-79 and 80-159) so that the first half's
   * promotion runs beside the second half's MMAs. FP8 modes: 2-4% faster than decoding each chunk
   * before its MMA (docs/PERF.md, version 7), the halves 3-4% more (version
   * 8). F16 modes, with turns (kPingPong): mode 4 5-6% and mode 2 2-4%
   * faster than the chunked loop with turns (version 9). fin / acc: the
   * tile's promoted and block accumulators. With ONE the promotion skips the
   * reference multiply (x * 1.0f == x: the same sums bit for bit).
   * NW2: the second half's MMA width, BN / 2 or (128-wide tiles of fewer
   * rows) less, 0 for none: m64n<NW2> MMAs on its first NW2 columns, and
   * only those promoted, so the rest of fin stays 0 for the epilogue. */
  template <int BN, int NW2 = BN / 2>
  static __device__ __forceinline__ void k_loop_ahead(const Params &p, uint8_t *sm, const Unit &un,
                                                      int c, int &stage, uint32_t &phase,
                                                      float (&fin)[BN / 2], float (&acc)[BN / 2]) {
    using C = Cfg<MODE, BN>;
    constexpr int NH = BN / 2;  /* token columns per half */
    /* A narrow loop's accumulators: arrays of its own. As slices of acc
     * beside the full-width loop in the same kernel, ptxas serialized the
     * MMAs of every 128-wide kernel (C7511); so it did with one loop that
     * picked the width per block, and injected warpgroup.arrive (C7519). */
    constexpr bool kFull = NW2 == NH;
    float nlo[kFull ? 1 : NH / 2], nhi[kFull || !NW2 ? 1 : NW2 / 2];
    constexpr int NP = BN / 16; /* promotion parts of 8 registers */
    static_assert(NW2 % 16 == 0 && NW2 <= NH, "a second half of whole promotion parts");
    constexpr int NP2 = NP / 2 + NW2 / 16; /* the parts the MMAs write */
    constexpr int kMid = NP / 2 + (NW2 / 16 + 1) / 2;
    constexpr int kSteps = C::kF16 ? 2 : 1; /* k16 F16 steps per k32 chunk */
    uint64_t *full = (uint64_t *)(sm + S::kOffBar), *empty = full + S::kStages;
    const FragPlace at = frag_place();
    const int tid = at.tid, q = at.q, r0 = at.r0;
    const uint2 *lut = (const uint2 *)(sm + S::kOffLut);
    const int KB = p.K / 128;
    uint32_t a[4][2][4];   /* A fragments: [chunk][k16 step (F16)][register] */
    uint32_t wd[8];        /* the next block's code words */
    /* its fold-table entries: [chunk][row], twice: with one copy ptxas
     * orders the 128/160-wide L1 kernels otherwise, and mode 1 ran 1.3%
     * slower at M = 4096 (docs/PERF.md, version 31) */
    uint2 tl[4][2][2];
    uint32_t sc[2][4];     /* mode 2: its scale pairs [row][chunk] */
    float sw[2] = {1.0f, 1.0f}, swn[2] = {1.0f, 1.0f}; /* references: in flight, next */
    auto fetch = [&](int st) {
      const uint8_t *R = sm + S::kOffA + st * C::kA + c * C::kRec;
      const uint4 c0 = *(const uint4 *)(R + tid * 16), c1 = *(const uint4 *)(R + 2048 + tid * 16);
      wd[0] = c0.x; wd[1] = c0.y; wd[2] = c0.z; wd[3] = c0.w;
      wd[4] = c1.x; wd[5] = c1.y; wd[6] = c1.z; wd[7] = c1.w;
#pragma unroll
      for (int hh = 0; hh < 2; hh++) {
        const int r = r0 + 8 * hh;
        const uint2 sb = row_scales(R + 4096 + kRowScaleBytes * r);
        if (MODE == 2)
#pragma unroll
          for (int ch = 0; ch < 4; ch++) sc[hh][ch] = scale_pair(sb, ch);
        else
#pragma unroll
          for (int ch = 0; ch < 4; ch++) tl[ch][hh][0] = tl[ch][hh][1] = fold_entry(lut, sb, ch);
        if (!ONE && MODE != 2) swn[hh] = pow2_exact(*(const int16_t *)(R + C::kRefOff + 2 * r));
      }
    };
    auto decode = [&](int ch) {
#pragma unroll
      for (int rr = 0; rr < 2; rr++)
        decode_word(wd[2 * ch + rr], tl[ch][rr][0], sc[rr][ch], rr, a[ch]);
    };
    /* registers [8 part, 8 part + 8) of the block in the stage's tile */
    auto promote = [&](int part) {
      const float *sS = (const float *)(sm + S::kOffS + stage * C::kS) + (un.tok0 & 3);
#pragma unroll
      for (int ii = 0; ii < 8; ii++) {
        const int i = 8 * part + ii, k = (i >> 2) * 2 + (i & 1);
        const float t = sS[acc_col(k, q)];
        const float v = kFull ? acc[i] : i < NH / 2 ? nlo[i] : nhi[i < NH / 2 ? 0 : i - NH / 2];
        fin[i] = fmaf(v, with_ref(t, sw[(i >> 1) & 1]), fin[i]);
      }
    };
    /* The block's MMAs in two groups, one per half of the token columns:
     * registers [0, 32) of the m64n128 fragment hold columns [0, 64) and
     * [32, 64) columns [64, 128), each as an m64n64 fragment (160-wide:
     * [0, 40) and [40, 80), m64n80). The first half
     * is promoted while the second half's MMAs run, where the warps would
     * otherwise wait for all of them: mode 1 3-4% faster (docs/PERF.md,
     * version 8); one group of m64n128 MMAs ran mode 4 5-7% and mode 2 3-4%
     * slower (version 9). */
    auto &acc_lo = [&]() -> auto & {
      if constexpr (kFull) return head<NH / 2>(acc);
      else return nlo;
    }();
    auto &acc_hi = [&]() -> auto & {
      if constexpr (kFull) return tail<NH / 2>(acc);
      else return nhi;
    }();
    auto fence_all = [&]() {
      if constexpr (kFull) {
        fence_acc(acc);
      } else {
        fence_acc(nlo);
        if constexpr (NW2 > 0) fence_acc(nhi);
      }
    };
    auto issue = [&]() { /* the block's 4 chunks: 2 x 4 MMAs (F16: 2 x 8) */
      const uint64_t dB0 = desc_b(smem_u32(sm + S::kOffB + stage * C::kB));
      if (kPingPong) named_sync(kTurn + c, 128 * kConsumers); /* my turn */
      fence_all();
      wg_fence();
#pragma unroll
      for (int hf = 0; hf < (NW2 ? 2 : 1); hf++) {
#pragma unroll
        for (int ch = 0; ch < 4; ch++)
#pragma unroll
          for (int ss = 0; ss < kSteps; ss++) {
            /* step s reads 32 bytes of each token row (F16 rows span 2
             * slabs); token rows 64.. start 64 x 128 bytes into a slab */
            const int s = kSteps * ch + ss;
            const uint64_t d =
                dB0 + (uint64_t)(((s >> 2) * C::kSlab + (s & 3) * 32 + hf * NH * 128) >> 4);
            if (hf == 0)
              mma<!C::kF16, NH>(acc_lo, a[ch][ss][0], a[ch][ss][1], a[ch][ss][2], a[ch][ss][3],
                                d, s > 0);
            else if constexpr (NW2 > 0)
              mma<!C::kF16, NW2>(acc_hi, a[ch][ss][0], a[ch][ss][1], a[ch][ss][2],
                                 a[ch][ss][3], d, s > 0);
          }
        wg_commit();
      }
      if (kPingPong) named_arrive(kTurn + (c ^ 1), 128 * kConsumers); /* the other's turn */
    };
    auto retire_lo = [&]() {
      wg_wait<NW2 ? 1 : 0>();
      fence_acc(acc_lo);
    };
    auto retire = [&]() {
      wg_wait<0>();
      fence_all();
    };
    auto release = [&]() { release_stage(empty, stage, phase); };
    mbar_wait(&full[stage], phase);
    fetch(stage);
#pragma unroll
    for (int ch = 0; ch < 4; ch++) decode(ch);
    sw[0] = swn[0];
    sw[1] = swn[1];
#pragma unroll 1
    for (int kb = 0; kb + 1 < KB; kb++) {
      issue();
      const int next = stage + 1 == S::kStages ? 0 : stage + 1;
      mbar_wait(&full[next], next == 0 ? phase ^ 1 : phase);
      retire_lo();
      fetch(next);
#pragma unroll
      for (int pp = 0; pp < NP / 2; pp++) promote(pp); /* beside the second half's MMAs */
      retire();
      /* the A registers are free: one stretch, the compiler interleaves them
       * (the second half's parts in two runs, split at kMid) */
#pragma unroll
      for (int pp = NP / 2; pp < kMid; pp++) promote(pp);
      decode(0);
      decode(1);
#pragma unroll
      for (int pp = kMid; pp < NP2; pp++) promote(pp);
      decode(2);
      decode(3);
      release();
      sw[0] = swn[0];
      sw[1] = swn[1];
    }
    issue();
    retire();
#pragma unroll
    for (int part = 0; part < NP2; part++) promote(part);
    release();
  }

  /* The K loop of one 16- or 32-wide tile in the FP8 modes with one CTA
   * per SM, double-buffered, with two accumulator sets: block kb + 1's
   * records are fetched and decoded into the second A buffer set while block
   * kb's MMAs run; block kb + 1's MMAs then issue at once, and block kb
   * retires, is promoted and block kb + 2 decoded beside them. Two blocks per
   * trip, so that the buffer and accumulator indices are constants and no
   * MMA group is in flight across the loop's back edge (with one there,
   * ptxas serialized every MMA, C7514: docs/PERF.md, version 29): the second
   * block's promotion waits for its MMAs. The chunked loop (Kern::consume)
   * decodes each chunk just before its MMA, so a warpgroup's decode and its
   * own MMAs never overlap. Against the chunked loop, one accumulator set:
   * mode 1 2-3% faster on even loads at M = 640-1024 (mode 3 about 2%),
   * routed and skewed loads equal or 1-2% faster (version 14); two sets: mode
   * 1 another 2% at M = 768-1024 even, mode 3 equal (version 30). The mixed
   * kernels' 64-wide tiles keep the chunked loop (version 11 measured them
   * 5-6% slower double-buffered). NW: the MMAs' width, BN or less
   * (kNarrowSmall for a 32-wide tile of few rows), as in k_loop_chunked. */
  template <int BN, int NW = BN>
  static __device__ __forceinline__ void k_loop_db(const Params &p, uint8_t *sm, const Unit &un,
                                                   int c, int &stage, uint32_t &phase,
                                                   float (&fin)[TPW][BN / 2],
                                                   float (&acc)[TPW][BN / 2]) {
    using C = Cfg<MODE, BN>;
    static_assert(NW % 8 == 0 && NW <= BN, "an MMA width of the tile");
    constexpr int NC = NW / 4; /* token columns per thread in the MMAs */
    uint64_t *full = (uint64_t *)(sm + S::kOffBar), *empty = full + S::kStages;
    const FragPlace at = frag_place();
    const int tid = at.tid, q = at.q, r0 = at.r0;
    const uint2 *lut = (const uint2 *)(sm + S::kOffLut);
    const int KB = p.K / 128;
    uint32_t a[2][4][TPW][2][4]; /* [buffer][chunk][tile][step][register]; step 0 only */
    float sx[2][NC], sw[2][TPW][2];
    float acc2[TPW][NW / 2]; /* the second accumulator set (odd blocks) */
    /* block at stage st into buffer b: token scales, references, A registers */
    auto fetch = [&](int st, int b) {
      const uint8_t *sA = sm + S::kOffA + st * CM::kA + (TPW * c) * C::kRec;
      const float *sS = (const float *)(sm + S::kOffS + st * CM::kS) + (un.tok0 & 3);
#pragma unroll
      for (int k = 0; k < NC; k++) sx[b][k] = sS[acc_col(k, q)];
#pragma unroll
      for (int j = 0; j < TPW; j++) {
        const uint8_t *R = sA + j * C::kRec;
        const uint4 c0 = *(const uint4 *)(R + tid * 16), c1 = *(const uint4 *)(R + 2048 + tid * 16);
        const uint32_t wd[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
        uint2 sb[2];
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
          const int r = r0 + 8 * hh;
          sb[hh] = row_scales(R + 4096 + kRowScaleBytes * r);
          sw[b][j][hh] = ONE ? 1.0f : pow2_exact(*(const int16_t *)(R + C::kRefOff + 2 * r));
        }
#pragma unroll
        for (int ch = 0; ch < 4; ch++)
#pragma unroll
          for (int rr = 0; rr < 2; rr++) {
            decode_word(wd[2 * ch + rr], fold_entry(lut, sb[rr], ch), 0u, rr, a[b][ch][j]);
          }
      }
    };
    /* buffer b's MMAs on the token tile of stage st into d (acc's first NW
     * columns, or acc2) */
    auto issue = [&](int st, int b, auto &d) {
      const uint64_t dB0 = desc_b(smem_u32(sm + S::kOffB + st * CM::kB));
#pragma unroll
      for (int j = 0; j < TPW; j++) fence_acc(head<NW / 2>(d[j]));
      wg_fence();
#pragma unroll
      for (int ch = 0; ch < 4; ch++)
#pragma unroll
        for (int j = 0; j < TPW; j++)
          mma<true, NW>(head<NW / 2>(d[j]), a[b][ch][j][0][0], a[b][ch][j][0][1],
                        a[b][ch][j][0][2], a[b][ch][j][0][3], dB0 + (uint64_t)(ch * 2), ch > 0);
      wg_commit();
    };
    /* tile j's promotion of the accumulators d with buffer b's scales */
    auto promote = [&](int j, auto &d, int b) {
      promote_tile(head<NW / 2>(fin[j]), head<NW / 2>(d[j]), sx[b], sw[b][j]);
    };
    mbar_wait(&full[stage], phase);
    fetch(stage, 0);
#pragma unroll 1
    for (int kb = 0; kb < KB; kb += 2) { /* block kb in buffer 0, no MMA in flight */
      int st1 = stage;
      uint32_t ph1 = phase;
      advance(st1, ph1);
      issue(stage, 0, acc);
      if (kb + 1 < KB) {
        mbar_wait(&full[st1], ph1);
        fetch(st1, 1);
        issue(st1, 1, acc2);
        wg_wait<1>();
#pragma unroll
        for (int j = 0; j < TPW; j++) fence_acc(head<NW / 2>(acc[j]));
        release_stage(empty, stage, phase); /* block kb's; to st1 */
#pragma unroll
        for (int j = 0; j < TPW; j++) promote(j, acc, 0);
        int st2 = st1;
        uint32_t ph2 = ph1;
        advance(st2, ph2);
        if (kb + 2 < KB) {
          mbar_wait(&full[st2], ph2);
          fetch(st2, 0);
        }
        wg_wait<0>();
#pragma unroll
        for (int j = 0; j < TPW; j++) fence_acc(acc2[j]);
        release_stage(empty, stage, phase); /* block kb + 1's; to st2 */
#pragma unroll
        for (int j = 0; j < TPW; j++) promote(j, acc2, 1);
      } else {
        wg_wait<0>();
#pragma unroll
        for (int j = 0; j < TPW; j++) fence_acc(head<NW / 2>(acc[j]));
        release_stage(empty, stage, phase);
#pragma unroll
        for (int j = 0; j < TPW; j++) promote(j, acc, 0);
      }
    }
  }

  /* The K loop of one 16-64-wide tile without double buffering (the
   * chunked loop): each chunk of a block is decoded just before its MMAs.
   * NW: the MMAs' width, BN or less (kNarrow for a large tile of few
   * rows): m64nNW MMAs on the first NW token columns of the tile, and only
   * those promoted, so the rest of fin stays 0 for the epilogue. */
  template <int BN, int NW>
  static __device__ __forceinline__ void k_loop_chunked(const Params &p, uint8_t *sm,
                                                        const Unit &un, int c, int &stage,
                                                        uint32_t &phase, float (&fin)[TPW][BN / 2],
                                                        float (&acc)[TPW][BN / 2]) {
    using C = Cfg<MODE, BN>;
    static_assert(NW % 8 == 0 && NW <= BN, "an MMA width of the tile");
    constexpr int NC = NW / 4; /* token columns per thread in the MMAs */
    uint64_t *full = (uint64_t *)(sm + S::kOffBar), *empty = full + S::kStages;
    const FragPlace at = frag_place();
    const int tid = at.tid, q = at.q, r0 = at.r0;
    const uint2 *lut = (const uint2 *)(sm + S::kOffLut);
    const int KB = p.K / 128;
    /* Pinned offsets: the thread's byte offsets into a stage, fixed for the
     * K loop. With two CTAs per SM (FP8 modes, 104 registers) ptxas
     * recomputed them from %tid at the top of every block; the empty asm
     * keeps them in registers there: 2-7% faster at M = 256 and 512 in
     * mode 1 (mode 3 unchanged). The other kernels keep their own address
     * arithmetic (with the pinned form they were 1-3% slower, and the F16
     * modes spilled). */
    constexpr bool kPin = CPS == 2 && !C::kF16;
    uint32_t o_w = (TPW * c) * C::kRec + tid * 16;                        /* codes */
    uint32_t o_s = (TPW * c) * C::kRec + 4096 + r0 * kRowScaleBytes;     /* scales */
    uint32_t o_r = (TPW * c) * C::kRec + C::kRefOff + 2 * r0;            /* references */
    uint32_t o_x = 4 * ((un.tok0 & 3) + acc_col(0, q));                  /* token scales */
    /* the token column that sS points at */
    const int col0 = kPin ? acc_col(0, q) : 0;
    for (int kb = 0; kb < KB; kb++) {
      if (kPin) asm volatile("" : "+r"(o_w), "+r"(o_s), "+r"(o_r), "+r"(o_x));
      mbar_wait(&full[stage], phase);
      const uint8_t *sA = sm + S::kOffA + stage * CM::kA + (kPin ? 0 : (TPW * c) * C::kRec);
      /* descriptor of the stage's token tile; steps add their byte offset
       * / 16 to the start-address field (shared memory < 256 KiB: no carry) */
      const uint64_t dB0 = desc_b(smem_u32(sm + S::kOffB + stage * CM::kB));
      const float *sS = kPin ? (const float *)(sm + S::kOffS + stage * CM::kS + o_x)
                             : (const float *)(sm + S::kOffS + stage * CM::kS) + (un.tok0 & 3);
      /* token scales: read before the MMAs */
      float sx[NC];
#pragma unroll
      for (int k = 0; k < NC; k++) sx[k] = sS[acc_col(k, q) - col0];
      uint32_t wd[TPW][8];
      float sw[TPW][2];
      uint2 sb[TPW][2];
      /* mode 2 (one CTA per SM): the block's scale pairs, read with its
       * records rather than in the decode: 1-3% faster at M = 256-2048
       * (docs/PERF.md, version 9); the two-CTA kernels spill with them */
      uint32_t sc[kScalesAhead ? TPW : 1][2][4];
#pragma unroll
      for (int j = 0; j < TPW; j++) {
        const uint8_t *R = sA + j * C::kRec;
        const uint4 c0 = *(const uint4 *)(R + (kPin ? o_w : tid * 16)),
                    c1 = *(const uint4 *)(R + (kPin ? o_w + 2048 : 2048 + tid * 16));
        wd[j][0] = c0.x; wd[j][1] = c0.y; wd[j][2] = c0.z; wd[j][3] = c0.w;
        wd[j][4] = c1.x; wd[j][5] = c1.y; wd[j][6] = c1.z; wd[j][7] = c1.w;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
          const int r = r0 + 8 * hh;
          sb[j][hh] = row_scales(R + (kPin ? o_s + 8 * kRowScaleBytes * hh
                                           : 4096 + kRowScaleBytes * r));
          if (kScalesAhead)
#pragma unroll
            for (int ch = 0; ch < 4; ch++) sc[kScalesAhead ? j : 0][hh][ch] = scale_pair(sb[j][hh], ch);
          sw[j][hh] = MODE == 2 || ONE ? 1.0f
                                       : pow2_exact(*(const int16_t *)(R + (kPin ? o_r + 16 * hh
                                                                                 : C::kRefOff + 2 * r)));
        }
      }
      /* defined once sb and sc hold the block's values (a capture before
       * that draws nvcc's "used before its value is set", #549-D) */
      auto scale_of = [&](int j, int rr, int ch) {
        return kScalesAhead ? sc[kScalesAhead ? j : 0][rr][ch] : scale_pair(sb[j][rr], ch);
      };
#pragma unroll
      for (int j = 0; j < TPW; j++) fence_acc(head<NW / 2>(acc[j]));
      /* A registers: a chunk's stay untouched until its MMAs retire. The
       * FP8 modes' 64-wide tiles give each of the block's 4 chunks its own
       * buffer, so that no decode waits on an MMA inside the block (mode 1
       * 2-5% faster, docs/PERF.md version 6). The others alternate two
       * buffers: 16/32-wide tiles measured 1% slower with four, and the
       * F16 fragments (twice the registers) spilled. (The 128-wide tiles
       * run k_loop_ahead, with four.) */
      constexpr int kBufs = BN == 64 && !C::kF16 ? 4 : 2;
      /* Split (FP8 64-wide tiles, the mixed kernels' too): the MMAs of
       * tile 1 issue after all of tile 0's, in a group of their own, and
       * tile 0 is promoted while they run, as the 128-wide loop does with
       * its two column halves: 3% faster at M = 2048 (docs/PERF.md,
       * version 8); in the mixed kernels 2% slower at M = 1024 without
       * turns there (version 8), with them 1-4% faster (version 13). */
      constexpr bool kSplit = kBufs == 4 && TPW == 2 && BN == 64;
      /* turns at 64-wide tiles, the mixed kernels' too (kPingPong) */
      constexpr bool kTurns = kPingPong && BN == 64;
      uint32_t a[kBufs][TPW][2][4]; /* [buffer][tile][step in chunk][register] */
#pragma unroll
      for (int ch = 0; ch < 4; ch++) {
        const int buf = ch % kBufs;
        /* two buffers: chunk ch-2 has retired, its registers are free */
        if (kBufs == 2 && ch >= 2) wg_wait<1>();
#pragma unroll
        for (int j = 0; j < TPW; j++) {
#pragma unroll
          for (int rr = 0; rr < 2; rr++) {
            uint2 t = make_uint2(0u, 0u);
            uint32_t scp = 0;
            if (MODE == 2)
              scp = scale_of(j, rr, ch);
            else
              t = fold_entry(lut, sb[j][rr], ch);
            decode_word(wd[j][2 * ch + rr], t, scp, rr, a[buf][j]);
          }
        }
        if (kTurns && ch == 0) { /* my turn */
          if constexpr (kDoubleBuffer) turn_sync(c);
          else named_sync(kTurn + c, 128 * kConsumers);
        }
        wg_fence();
        constexpr int kSteps = C::kF16 ? 2 : 1; /* k16 F16 steps per k32 chunk */
#pragma unroll
        for (int j = 0; j < (kSplit ? 1 : TPW); j++)
#pragma unroll
          for (int ss = 0; ss < kSteps; ss++) {
            /* step s reads 32 bytes of each token row; F16 rows span 2 slabs */
            const int s = kSteps * ch + ss;
            const uint64_t d = dB0 + (uint64_t)(((s >> 2) * C::kSlab + (s & 3) * 32) >> 4);
            mma<!C::kF16, NW>(head<NW / 2>(acc[j]), a[buf][j][ss][0], a[buf][j][ss][1],
                              a[buf][j][ss][2], a[buf][j][ss][3], d, s > 0);
          }
        wg_commit();
      }
      if constexpr (kSplit) { /* tile 1: the chunks' buffers are all still live */
        wg_fence();
#pragma unroll
        for (int ch = 0; ch < 4; ch++)
          mma<true, NW>(head<NW / 2>(acc[1]), a[ch][1][0][0], a[ch][1][0][1], a[ch][1][0][2],
                        a[ch][1][0][3], dB0 + (uint64_t)(ch * 2), ch > 0);
        wg_commit();
      }
      if (kTurns) { /* the other's turn */
        if constexpr (kDoubleBuffer) turn_grant(c);
        else named_arrive(kTurn + (c ^ 1), 128 * kConsumers);
      }
      /* tile j's promotion with the scales read before the MMAs */
      auto promote = [&](int j) {
        promote_tile(head<NW / 2>(fin[j]), head<NW / 2>(acc[j]), sx, sw[j]);
      };
      if constexpr (kSplit) { /* tile 0 beside tile 1's MMAs */
        wg_wait<1>();
        fence_acc(head<NW / 2>(acc[0]));
        promote(0);
      }
      wg_wait<0>();
#pragma unroll
      for (int j = kSplit ? 1 : 0; j < TPW; j++) fence_acc(head<NW / 2>(acc[j]));
      release_stage(empty, stage, phase);
#pragma unroll
      for (int j = kSplit ? 1 : 0; j < TPW; j++) promote(j);
    }
  }

  /* One work unit of consumer warpgroup c with a BN-wide token tile: per
   * half (one unless kWide), the K loop over its stages, then the epilogue. */
  template <int BN>
  static __device__ __forceinline__ void consume(const Params &p, uint8_t *sm, const Unit &un,
                                                 int c, int &stage, uint32_t &phase) {
    using C = Cfg<MODE, BN>;
    constexpr int NR = BN / 2; /* accumulator registers per m64 tile */
    constexpr int NC = BN / 4; /* token columns per thread */
    const FragPlace at = frag_place();
    const int tid = at.tid, w = at.w, lane = at.lane, g = at.g, q = at.q, r0 = at.r0;
    /* 128- and 160-wide tiles, L1: the first half's SwiGLU outputs (channel
     * 32 c + lc of the unit's 128), kept for the second half's FP8 scale.
     * The F16 modes' 160-wide tiles stash them in the staging tile, free
     * until the second half's epilogue and as large as they are (each
     * thread's own, [value][thread]: no barrier, no bank conflicts). In
     * registers across the second half's K loop, beside the F16 A
     * fragments, they had ptxas keep a value in local memory there, and the
     * stash runs those tiles 2-4% faster (docs/PERF.md, version 35); at
     * 128-wide tiles, which do not spill, mode 4 ran 1-4% slower with it. */
    constexpr bool kStash = GEMM == 1 && CM::kF16 && BN == 160;
    static_assert(!kStash || NC * 128 * kConsumers * 4 <= S::kStaging,
                  "the stash fits the staging tile");
    float av0[kWide && GEMM == 1 ? NC : 1];
#pragma unroll 1
    for (int h = 0; h < kHalves; h++) {
      float fin[TPW][NR], acc[TPW][NR];
#pragma unroll
      for (int j = 0; j < TPW; j++)
#pragma unroll
        for (int i = 0; i < NR; i++) fin[j][i] = 0.0f;
      /* The epilogue's factors from global memory: row factors of the lane's
       * rows (GEMM 1: gate r0, up r0 + 8; GEMM 2: rows r0, r0 + 8) and
       * (GEMM 1) the top-k weights of its token columns. Small tiles load
       * them now, so that their latency hides behind the K loop; beside the
       * 64-wide tile's accumulators they would spill. */
      constexpr bool kEarly = BN <= 32;
      float rsf[TPW][2], rwv[NC];
      auto load_factors = [&]() {
#pragma unroll
        for (int j = 0; j < TPW; j++)
#pragma unroll
          for (int hh = 0; hh < 2; hh++)
            rsf[j][hh] = p.rs[(size_t)un.e * p.rows + (un.rb * 4 + tile_of(h, c, j)) * 64 + r0 +
                              8 * hh];
#pragma unroll
        for (int k = 0; k < NC; k++) {
          const int col = acc_col(k, q);
          rwv[k] = GEMM == 1 && col < un.valid ? p.row_weight[un.tok0 + col] : 0.0f;
        }
      };
      if (kEarly) load_factors();

      if constexpr (BN == 128) {
        /* a tile of fewer rows: its second half's MMAs only as wide as its
         * rows need (m64n16-48, none at <= 64 rows): the experts of 65-112
         * rows on the launch pairs, the last tiles of larger ones. The MMAs
         * of the padding columns had set the pace there: even loads of 65-96
         * rows per expert 10-19% faster, routed ones 7-15%, skewed and zipf
         * loads at 144 rows 7-12% (docs/PERF.md, version 37). One loop per
         * width, each with accumulators of its own (k_loop_ahead). */
        if (un.valid <= 64) k_loop_ahead<BN, 0>(p, sm, un, c, stage, phase, fin[0], acc[0]);
        else if (un.valid <= 80) k_loop_ahead<BN, 16>(p, sm, un, c, stage, phase, fin[0], acc[0]);
        else if (un.valid <= 96) k_loop_ahead<BN, 32>(p, sm, un, c, stage, phase, fin[0], acc[0]);
        else if (un.valid <= 112) k_loop_ahead<BN, 48>(p, sm, un, c, stage, phase, fin[0], acc[0]);
        else k_loop_ahead<BN>(p, sm, un, c, stage, phase, fin[0], acc[0]);
      } else if constexpr (BN >= 128) {
        k_loop_ahead<BN>(p, sm, un, c, stage, phase, fin[0], acc[0]);
      } else if constexpr (kDoubleBuffer && BN <= 32) {
        /* the 32-wide kernels' small tiles of at most kNarrowSmall rows:
         * narrow MMAs, as kNarrow for the large tiles */
        if (kNarrowSmall && BN == BS && un.valid <= kNarrowSmall)
          k_loop_db<BN, kNarrowSmall ? kNarrowSmall : BN>(p, sm, un, c, stage, phase, fin, acc);
        else
          k_loop_db<BN>(p, sm, un, c, stage, phase, fin, acc);
      } else if constexpr (BN == kBNMax && (kMixed || BN == 64)) {
        /* a mixed kernel's large tile or a 64-wide kernel's tile, whose rows
         * need kNarrow columns or fewer */
        if (un.valid > kNarrow) k_loop_chunked<BN, BN>(p, sm, un, c, stage, phase, fin, acc);
        else k_loop_chunked<BN, kNarrow>(p, sm, un, c, stage, phase, fin, acc);
      } else {
        k_loop_chunked<BN, BN>(p, sm, un, c, stage, phase, fin, acc);
      }

      /* ------------------------------------------------------ epilogue ---- */
      if (!kEarly) load_factors();
      uint8_t *stg = sm + S::kOffStg;
      const int ct = c * 128 + tid;
      if (GEMM == 1) {
        const int I = p.rows / 2;
        float av[TPW][NC], amx[NC], silu_c = 0.0f;
        if (p.clamp > 0.0f) {
          const float cl[1] = {p.clamp};
          float sc[1];
          silu_n(cl, sc);
          silu_c = sc[0];
        }
#pragma unroll
        for (int k = 0; k < NC; k++) amx[k] = 0.0f;
#pragma unroll
        for (int j = 0; j < TPW; j++) {
          const float rsg = row_factor(rsf[j][0]), rsu = row_factor(rsf[j][1]);
#pragma unroll
          for (int k = 0; k < NC; k++) {
            const int i = 4 * (k >> 1) + (k & 1);
            float gt = round_bf16(fin[j][i] * rsg), up = round_bf16(fin[j][i + 2] * rsu);
            if (p.clamp > 0.0f) {
              gt = mm_clamp_gate(gt, p.clamp); /* keeps NaN, unlike fminf */
              up = mm_clamp_up(up, p.clamp);
            }
            /* a BF16 gate from the table; a clamped one that BF16 cannot
             * hold is the clamp itself, whose silu is silu_c */
            const uint32_t gb = __float_as_uint(gt);
            const float s = gb & 0xFFFFu ? silu_c : __ldg(&g_silu_bf16[gb >> 16]);
            av[j][k] = (s * up) * rwv[k];
            amx[k] = fmaxf(amx[k], fabsf(av[j][k]));
          }
        }
        /* the thread's slot of value k in the stash, [value][thread] */
        auto stash = [&](int k) -> float & { return ((float *)stg)[k * 128 * kConsumers + ct]; };
        if (kWide && h == 0) { /* the second half completes the channels */
#pragma unroll
          for (int k = 0; k < NC; k++) {
            if (kStash) stash(k) = av[0][k];
            else av0[k] = av[0][k];
          }
          continue;
        }
        if (kStash) /* before the barrier below: the staging stores follow it */
#pragma unroll
          for (int k = 0; k < NC; k++) av0[k] = stash(k);
        if (kWide)
#pragma unroll
          for (int k = 0; k < NC; k++) amx[k] = fmaxf(amx[k], fabsf(av0[k]));
#pragma unroll
        for (int k = 0; k < NC; k++) {
          amx[k] = fmaxf(amx[k], __shfl_xor_sync(0xffffffffu, amx[k], 4));
          amx[k] = fmaxf(amx[k], __shfl_xor_sync(0xffffffffu, amx[k], 8));
          amx[k] = fmaxf(amx[k], __shfl_xor_sync(0xffffffffu, amx[k], 16));
        }
        float *red = (float *)(sm + S::kOffRed);
        if (g == 0)
#pragma unroll
          for (int k = 0; k < NC; k++) red[(c * 4 + w) * BN + acc_col(k, q)] = amx[k];
        named_sync(1, 128 * kConsumers);
        /* channel within the 128-block = L2's K column, stored at its
         * mm_sm90_kperm position (the F16 modes; identity otherwise) */
        const int lc = mm_sm90_kperm_pos((mm_weight_mode)MODE, 8 * w + g);
        auto stage_q8 = [&](int col, int lch, float v) {
          const uint8_t q8 = f32_to_e4m3(v);
          if (C::kF16)
            ((uint16_t *)stg)[col * 128 + lch] =
                __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q8, __NV_E4M3).x;
          else
            stg[col * 128 + lch] = q8;
        };
        /* one thread per token column: the column's amax over the 8 warps'
         * partials, its FP8 scale out and the quantization factor into the
         * first partial's slot (only this thread reads that column), instead
         * of every thread of the column repeating the reduction and the
         * division */
        if (ct < BN) {
          float m = 0.0f;
#pragma unroll
          for (int x = 0; x < 4 * kConsumers; x++) m = fmaxf(m, red[x * BN + ct]);
          m = fmaxf(m, 1e-4f);
          red[ct] = 448.0f / m;
          if (ct < un.valid) p.as_t[(size_t)un.rb * p.Mp + un.tok0 + ct] = m / 448.0f;
        }
        named_sync(1, 128 * kConsumers);
#pragma unroll
        for (int k = 0; k < NC; k++) {
          const int col = acc_col(k, q);
          const float inv = red[col];
#pragma unroll
          for (int j = 0; j < TPW; j++) stage_q8(col, 32 * tile_of(h, c, j) + lc, av[j][k] * inv);
          if (kWide) stage_q8(col, 32 * tile_of(0, c, 0) + lc, av0[k] * inv);
        }
        named_sync(1, 128 * kConsumers);
        constexpr int kChunks = C::kF16 ? 16 : 8; /* 16-byte chunks per token row */
        const size_t esz = C::kF16 ? 2 : 1;
        for (int idx = ct; idx < BN * kChunks; idx += 128 * kConsumers) {
          const int row = idx / kChunks, ck = idx % kChunks;
          if (row < un.valid)
            *(uint4 *)(p.act + ((size_t)(un.tok0 + row) * I + (size_t)un.rb * 128) * esz + ck * 16) =
                *(const uint4 *)(stg + row * 128 * esz + ck * 16);
        }
        named_sync(1, 128 * kConsumers);
      } else {
        /* this pass's output columns: the unit's 256, or 128 per half */
        constexpr int kCols = 256 / kHalves;
        constexpr int kRowChunks = kCols / 8; /* 16-byte chunks per token row */
        const int H = p.rows;
        uint16_t *stg16 = (uint16_t *)stg;
        /* BF16 pairs of two token columns of a weight row, transposed into
         * the token rows of the staging tile by stmatrix (8 x 8 blocks: 16
         * bytes of 8 weight rows per token row; one instruction per 4 blocks
         * instead of a 2-byte store per value). A row's 16-byte chunk ck
         * sits at ck ^ (row & 7), so that the 8 token rows of a block, 512
         * bytes apart, fall in different banks. Lane l addresses row l % 8 of
         * the instruction's block l / 8. */
        const int mb = lane >> 3, mr = lane & 7;
        /* Each warpgroup copies out its own tiles' chunks of the token rows
         * (below); the out rows of the thread's copies, looked up now, so
         * that the loads run beside the transposition: the caller's row
         * order (the combine's segments: mm_expert_pool.out_rows), else the
         * pool's. -1: a row past the tile's valid ones. (Looked up in the
         * copy loop, the map cost 3-4% at M = 1024-4096 in modes 1 and 2.) */
        constexpr int kWgChunks = kRowChunks / kConsumers;
        constexpr int kCopies = BN * kWgChunks / 128;
        static_assert(BN * kWgChunks % 128 == 0, "whole copy rounds");
        int orow[kCopies];
#pragma unroll
        for (int i = 0; i < kCopies; i++) {
          const int row = (unsigned)(tid + 128 * i) / kWgChunks;
          orow[i] = row >= un.valid ? -1
                    : p.out_rows   ? __ldg(p.out_rows + un.tok0 + row)
                                   : un.tok0 + row;
        }
#pragma unroll
        for (int j = 0; j < TPW; j++) {
          const int ck0 = 8 * (TPW * c + j) + 2 * w; /* the chunk of weight rows 16 w .. */
#pragma unroll
          for (int t = 0; t < NC / 4; t++) { /* blocks of token columns 16 t .. 16 t + 15 */
            uint32_t v[4];
#pragma unroll
            for (int m = 0; m < 4; m++) { /* block m: rows + 8 (m & 1), columns + 8 (m >> 1) */
              const int i = 4 * (2 * t + (m >> 1)) + 2 * (m & 1);
              const float rsv = row_factor(rsf[j][m & 1]);
              const __nv_bfloat162 b2 = __floats2bfloat162_rn(fin[j][i] * rsv, fin[j][i + 1] * rsv);
              v[m] = *reinterpret_cast<const uint32_t *>(&b2);
            }
            const int row = 16 * t + 8 * (mb >> 1) + mr;
            const int ck = (ck0 + (mb & 1)) ^ mr;
            asm volatile(
                "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                    smem_u32(stg16 + row * kCols + ck * 8)),
                "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
                : "memory");
          }
        }
        /* The copy-out (the swizzle keeps a chunk within its aligned 8): the
         * barriers are the warpgroup's own (kEpilogueWg + c), so neither
         * waits for the other's epilogue, which may then run beside the
         * other's MMAs. A map entry outside [0, M) is a caller's bug, and is
         * not followed into foreign memory. */
        named_sync(kEpilogueWg + c, 128);
#pragma unroll
        for (int i = 0; i < kCopies; i++) {
          const int idx = tid + 128 * i;
          const int row = (unsigned)idx / kWgChunks, ck = c * kWgChunks + (unsigned)idx % kWgChunks;
          if ((unsigned)orow[i] < (unsigned)p.M)
            *(uint4 *)(p.out + (size_t)orow[i] * H + (size_t)un.rb * 256 + h * kCols + ck * 8) =
                *(const uint4 *)(stg16 + row * kCols + (ck ^ (row & 7)) * 8);
        }
        named_sync(kEpilogueWg + c, 128);
      }
    }
  }
};

/* tmB / tmS: token tile and scale maps of the BS-wide tiles; tmBL / tmSL:
 * of the large ones (mixed tiles only, Kern::kBig), tmBM / tmSM of the
 * middle ones (Kern::kMid). */
template <int MODE, int GEMM, int BS, int CPS, bool ONE>
__global__ void __launch_bounds__(Warps<CPS>::kThreads, CPS)
    wg_kernel(const Params p, const __grid_constant__ CUtensorMap tmB,
              const __grid_constant__ CUtensorMap tmS, const __grid_constant__ CUtensorMap tmBL,
              const __grid_constant__ CUtensorMap tmSL, const __grid_constant__ CUtensorMap tmBM,
              const __grid_constant__ CUtensorMap tmSM) {
  using K = Kern<MODE, GEMM, BS, CPS, ONE>;
  using S = typename K::S;
  using W = Warps<CPS>;
  constexpr bool kMixed = K::kMixed;
  extern __shared__ uint8_t smem_raw[];
  /* offset arithmetic on the shared pointer keeps ld/st.shared (not generic) */
  uint8_t *sm = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  uint64_t *full = (uint64_t *)(sm + S::kOffBar);
  uint64_t *empty = full + S::kStages;
  int *sched = (int *)(sm + S::kOffSched);
  uint8_t *order = sm + S::kOffOrder;
  const int wg = threadIdx.x / 128;
  /* the next kernel (L2 after L1) may launch now: its CTAs take SMs as ours
   * leave and wait for our results in griddepcontrol.wait (the first of a
   * launch pair triggers later, Kern::produce) */
  if (threadIdx.x == 0 && p.pair_role != 1) asm volatile("griddepcontrol.launch_dependents;");

  if (threadIdx.x == 0) {
    for (int s = 0; s < S::kStages; s++) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 128 * kConsumers); /* every consumer thread */
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (threadIdx.x < 32) K::setup_walk(p, sched, order);
  /* fold table: modes 1, 3, 4; in mode 1's records (modes 1, 4) only the
   * entries (k, 0), 8 bytes apart, padded with zeros to 32 (the compact
   * table, Kern::fold_entry) */
  constexpr bool kCompact = Cfg<MODE, BS>::kG32;
  constexpr int kLutWords = kCompact ? 64 : MM_SM90_LUT_ENTRIES * 2;
  static_assert(MM_SM90_LUT_ENTRIES <= 32 * 8, "compact table: 32 entries (k, 0)");
  if (MODE != 2)
    for (int i = threadIdx.x; i < kLutWords; i += W::kThreads) {
      const int src = kCompact ? (i >> 1) * 16 + (i & 1) : i; /* word of entry (k, 0) */
      uint32_t v = src < MM_SM90_LUT_ENTRIES * 2 ? ((const uint32_t *)p.lut)[src] : 0u;
      /* mode 4: each entry, an E4M3 e2m1 * 2^s with at most one mantissa
       * bit, as the high byte of its F16 (exact: the low byte is 0 for every
       * entry mode 1's records index; test_layout_sm90 checks it) */
      if (MODE == 4) v = prmt(e4m3x2_to_f16x2(v & 0xFFFFu), e4m3x2_to_f16x2(v >> 16), 0x7531);
      ((uint32_t *)(sm + S::kOffLut))[i] = v;
    }
  __syncthreads();

  if (wg == 0) { /* ------------------------------------ producer ---- */
    set_max_regs_dec<W::kProducerRegs>();
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&tmB) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&tmS) : "memory");
      if (kMixed) {
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&tmBL) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&tmSL) : "memory");
      }
      if (K::kMid) {
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&tmBM) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&tmSM) : "memory");
      }
      K::produce(p, sm, sched, order, TokenMaps{&tmB, &tmS, &tmBL, &tmSL, &tmBM, &tmSM});
    }
    return;
  }

  /* ------------------------------------------------------- consumers ---- */
  set_max_regs_inc<W::kConsumerRegs>();
  const int c = wg - 1;
  int stage = 0;
  uint32_t phase = 0;
  const uint2 *units = (const uint2 *)(sm + S::kOffUnit);
  static_assert(!K::kPingPong || kConsumers == 2, "turns between two warpgroups");
  if (K::kPingPong && c == 1) named_arrive(K::kTurn, 128 * kConsumers);
  for (;;) {
    /* the unit whose first K block this stage holds (the wait repeats in
     * consume, at once) */
    mbar_wait(&full[stage], phase);
    const Unit un = unit_unpack(units[stage]);
    if (un.valid == 0) break;
    if (kMixed && un.bn == K::kBig)
      K::template consume<kMixed ? K::kBig : BS>(p, sm, un, c, stage, phase);
    else if (K::kMid && un.bn == K::kMid)
      K::template consume<K::kMid ? K::kMid : BS>(p, sm, un, c, stage, phase);
    else
      K::template consume<BS>(p, sm, un, c, stage, phase);
  }
  if (K::kPingPong && c == 0) named_sync(K::kTurn, 128 * kConsumers);
}

/* Mode 3's FP8 copy of x lives in out's BF16 rows: row r's H bytes start
 * fp8_copy_pitch(H) r bytes in, so that only the pool's own rows are
 * written. The prep kernel's stores and L1's token map both use it. */
__host__ __device__ constexpr size_t fp8_copy_pitch(int H) { return 2 * (size_t)H; }

/* Token scales transposed to [K/128][Mp]; modes 2 / 4 also x as F16, mode
 * 3 as FP8 (in their mm_sm90_kperm order). Rows outside [offsets[0],
 * offsets[E]) are left alone. */
template <int COPY> /* 0: scales only (mode 1); 2, 4: F16 copy, 3: FP8 copy, in the mode's mm_sm90_kperm order */
__global__ void prep_kernel(const uint8_t *x, const float *xs, const int32_t *off, int E, int H,
                            int Mp, float *xs_t, uint16_t *xc) {
  if (threadIdx.x == 0) asm volatile("griddepcontrol.launch_dependents;"); /* L1 may launch */
  const int r0 = off[0], r1 = off[E], KB = H / 128;
  const long stride = (long)gridDim.x * blockDim.x;
  const long first = (long)blockIdx.x * blockDim.x + threadIdx.x;
  /* rows fastest: the transposed writes coalesce (K blocks fastest wrote 4
   * bytes per row, Mp apart: 27 us for M = 32768, H = 6144 under ncu); the
   * strided reads come back through L2 for the next K blocks */
  const long n = r1 - r0;
  for (long i = first; i < n * KB; i += stride) {
    const int r = r0 + (int)(i % n), kb = (int)(i / n);
    xs_t[(size_t)kb * Mp + r] = xs[(size_t)r * KB + kb];
  }
  if (!COPY) return;
  const uint32_t *x4 = (const uint32_t *)(x + (size_t)r0 * H);
  if (COPY == 3) {
    /* mm_sm90_kperm_pos, mode 3: the 4-column unit 2q + h of a 32-column
     * block at unit position 4h + q; a thread moves one block (8 units),
     * row r's to fp8_copy_pitch(H) r. */
    const int nb = H / 32;
    for (long i = first; i < (long)(r1 - r0) * nb; i += stride) {
      const size_t r = (size_t)r0 + (size_t)(i / nb), cb = (size_t)(i % nb);
      const uint4 *src = (const uint4 *)(x + r * H + 32 * cb);
      uint4 *dst = (uint4 *)((uint8_t *)xc + r * fp8_copy_pitch(H) + 32 * cb);
      const uint4 a = src[0], b = src[1];           /* units 0-3, 4-7 */
      dst[0] = make_uint4(a.x, a.z, b.x, b.z); /* h = 0: units 0, 2, 4, 6 */
      dst[1] = make_uint4(a.y, a.w, b.y, b.w); /* h = 1: units 1, 3, 5, 7 */
    }
    return;
  }
  uint16_t *o = xc + (size_t)r0 * H; /* rows start 32-column blocks: H % 128 == 0 */
  if (COPY == 2) {
    /* mm_sm90_kperm_pos, mode 2: columns 4q + 2t + j and 16 + 4q + 2t + j
     * of a 32-column block side by side at position 16t + 8j + 2q: a thread
     * reads the 4 columns 4q .. 4q + 3 and their partners 16 on, and stores
     * 4 pairs */
    for (long i = first; i < (long)(r1 - r0) * (H / 8); i += stride) {
      const long blk = i >> 2;
      const int q = (int)(i & 3);
      const uint32_t v0 = x4[8 * blk + q], v1 = x4[8 * blk + q + 4];
      const uint32_t a01 = e4m3x2_to_f16x2(v0 & 0xFFFFu), a23 = e4m3x2_to_f16x2(v0 >> 16);
      const uint32_t b01 = e4m3x2_to_f16x2(v1 & 0xFFFFu), b23 = e4m3x2_to_f16x2(v1 >> 16);
      uint32_t *ob = (uint32_t *)o + 16 * blk + q; /* 32-bit word 8t + 4j + q of the block */
      ob[0] = prmt(a01, b01, 0x5410);  /* column 4q:     t 0, j 0 */
      ob[4] = prmt(a01, b01, 0x7632);  /* column 4q + 1: t 0, j 1 */
      ob[8] = prmt(a23, b23, 0x5410);  /* column 4q + 2: t 1, j 0 */
      ob[12] = prmt(a23, b23, 0x7632); /* column 4q + 3: t 1, j 1 */
    }
  } else {
    for (long i = first; i < (long)(r1 - r0) * (H / 4); i += stride) {
      const uint32_t v = x4[i];
      const uint32_t lo = e4m3x2_to_f16x2(v & 0xFFFFu), hi = e4m3x2_to_f16x2(v >> 16);
      /* columns 4i, 4i + 1 and 4i + 2, 4i + 3 land 16 apart */
      const long base = 4 * i & ~31L;
      const int k = (int)(4 * i & 31);
      *(uint32_t *)(o + base + mm_sm90_kperm_pos(MM_WMODE_G32_F16_EXACT, k)) = lo;
      *(uint32_t *)(o + base + mm_sm90_kperm_pos(MM_WMODE_G32_F16_EXACT, k + 2)) = hi;
    }
  }
}

/* --------------------------------------------------------------- host ---- */

/* Per-device state: the ranks of one process drive different devices from
 * different threads, and a function attribute belongs to one device's
 * context (setting it once per process left rank 1's launches invalid). */
constexpr int kMaxDevices = 64;

int current_device() {
  int dev = 0;
  cudaGetDevice(&dev);
  return dev;
}

int sm_count() {
  static std::atomic<int> cached[kMaxDevices];
  const int dev = current_device();
  int n = dev < kMaxDevices ? cached[dev].load() : 0;
  if (!n) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0)
      n = 132;
    if (dev < kMaxDevices) cached[dev].store(n);
  }
  return n;
}

/* The maps of one GEMM's B operand: token tiles and their scales, for the
 * BS-wide tiles and (mixed tiles) the 64-wide ones. */
struct TileMaps {
  CUtensorMap b, s, bl, sl, bm, sm;
};

/* The launch-shape overrides that reach below the tile choice
 * (mm_sm90_run_wgmma reads them all, once per call). */
struct Overrides {
  bool allow_mixed; /* large tiles for experts with more than BS rows, where
                       the kernel has them (Kern::kMixed, kBig) */
  int max_ctas;     /* tests: at most this many CTAs per launch (0: no cap) */
  bool wide_first;  /* mixed tiles: the wide tiles' experts walked first */
};

template <int MODE, int GEMM, int BS, int CPS, bool ONE = false>
mm_err *launch(const Params &p, const TileMaps &m, int max_ctas, cudaStream_t st) {
  using S = typename Kern<MODE, GEMM, BS, CPS, ONE>::S;
  static std::atomic<uint64_t> done{0}; /* one bit per device */
  const int dev = current_device();
  const uint64_t bit = dev < kMaxDevices ? 1ull << dev : 0;
  if (!(done.load() & bit) || !bit) {
    MM_CUDA_TRY(cudaFuncSetAttribute(wg_kernel<MODE, GEMM, BS, CPS, ONE>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, S::kBytes));
    done.fetch_or(bit);
  }
  /* a programmatic dependent of the previous kernel (see Kern::produce) */
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg;
  memset(&cfg, 0, sizeof(cfg));
  const int ctas = CPS * sm_count();
  cfg.gridDim = dim3(max_ctas > 0 && max_ctas < ctas ? max_ctas : ctas);
  cfg.blockDim = dim3(Warps<CPS>::kThreads);
  cfg.dynamicSmemBytes = S::kBytes;
  cfg.stream = st;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  MM_CUDA_TRY(cudaLaunchKernelEx(&cfg, wg_kernel<MODE, GEMM, BS, CPS, ONE>, p, m.b, m.s, m.bl, m.sl, m.bm, m.sm));
  return NULL;
}

/* B maps over [rows, K] (x or the intermediate) and the transposed scales
 * [K / 128, Mp]; box = BS rows, and big / mid (when not 0) for the mixed
 * kernels' large and middle tiles (Kern::kBig, kMid). */
mm_err *make_tile_maps(TileMaps *m, bool f16, bool mixed, int bs, int big, int mid, const void *x,
                       int K, int rows, const float *scales_t, int Mp, uint64_t pitch = 0) {
  const CUtensorMapDataType dt = f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8;
  const uint32_t box0 = f16 ? 64 : 128;
  /* bytes from one token row to the next: the row's own, or `pitch` */
  const uint64_t row_bytes = pitch ? pitch : (f16 ? 2ull : 1ull) * (uint64_t)K;
  /* the token tile map of `width` rows and its scale map (Cfg::kSBoxN) */
  auto tile_and_scales = [&](CUtensorMap *b, CUtensorMap *s, int width) -> mm_err * {
    MM_TRY(make_map(b, dt, x, K, rows, row_bytes, box0, width, true));
    return make_map(s, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, scales_t, Mp, K / 128, 4ull * Mp,
                    width + 4, 1, false);
  };
  MM_TRY(tile_and_scales(&m->b, &m->s, bs));
  m->bl = m->bm = m->b;
  m->sl = m->sm = m->s;
  if (!mixed) return NULL;
  MM_TRY(tile_and_scales(&m->bl, &m->sl, big));
  return mid ? tile_and_scales(&m->bm, &m->sm, mid) : NULL;
}

/* One kernel of BS-wide tiles: in modes 1, 3 and 4 the ONE kernel where
 * every reference of the matrix is 0 (one), else the one with references
 * (mode 2's records have none). */
template <int MODE, int GEMM, int BS, int CPS>
mm_err *launch_refs(const Params &p, bool one, const TileMaps &m, int max_ctas, cudaStream_t st) {
  constexpr bool kOneKernels = MODE != 2;
  if (kOneKernels && one) return launch<MODE, GEMM, BS, CPS, kOneKernels>(p, m, max_ctas, st);
  return launch<MODE, GEMM, BS, CPS>(p, m, max_ctas, st);
}

/* One GEMM's launches: BS-wide tiles, or with BS2 a launch pair, each
 * launch taking the tiles of its width class (tile_span). 128+160 (prefill):
 * the 160-wide launch first; where no expert takes it (even loads of a
 * multiple of 128 rows), its CTAs find no units and leave as soon as the
 * kernel before it has finished, a few microseconds (measured 1-3% at such
 * loads). 64+128 and 32+128 (50-112 rows per expert): the 64-wide (32-wide
 * mixed) launch first, for the experts of at most 64 rows, so that it keeps
 * its overlap with the kernel before it; an empty 128-wide launch after it
 * costs 1-4% (docs/PERF.md, version 14). The second launch starts
 * beside the first one's last units, and the next GEMM waits for both
 * (Kern::produce). one: the matrix's references are all 0 (launch_refs). */
template <int MODE, int GEMM, int BS, int CPS, int BS2>
mm_err *launch_gemm(Params p, bool one, const TileMaps &m, const TileMaps &m2, int max_ctas,
                    cudaStream_t st) {
  if constexpr (BS2 == 160) {
    p.width_class = 2;
    p.pair_role = 1;
    MM_TRY((launch_refs<MODE, GEMM, BS2, CPS>(p, one, m2, max_ctas, st)));
    p.width_class = 1;
    p.pair_role = 2;
  } else if constexpr (BS2 != 0) {
    /* the first launch takes the experts its own tiles cover: 64 rows in
     * the 64-wide kernels and the 32-wide mixed ones (their large tiles) */
    p.wide_above = Kern<MODE, GEMM, BS, CPS>::kBNMax;
    p.width_class = 1;
    p.pair_role = 1;
    MM_TRY((launch_refs<MODE, GEMM, BS, CPS>(p, one, m, max_ctas, st)));
    p.width_class = 2;
    p.pair_role = 2;
    return launch_refs<MODE, GEMM, BS2, CPS>(p, one, m2, max_ctas, st);
  }
  return launch_refs<MODE, GEMM, BS, CPS>(p, one, m, max_ctas, st);
}

template <int MODE, int BS, int CPS, int BS2 = 0>
mm_err *run_mode(const mm_sm90_layer *L, const mm_expert_pool *pool, float clamp,
                 const mm_sm90_ws *ws, const Overrides &o, cudaStream_t st) {
  const bool f16 = Cfg<MODE, BS>::kF16, mixed = Kern<MODE, 1, BS, CPS>::kMixed;
  const int H = L->H, I = L->I, M = pool->num_rows_max, Mp = ws->Mp;
  /* TMA wants 16-byte aligned bases (the L2 epilogue stores 16 bytes too) */
  MM_ARG_CHECK((uintptr_t)pool->x % 16 == 0 && (uintptr_t)pool->out % 16 == 0,
               "sm90 expert compute: pool x and out must be 16-byte aligned");
  /* F16 modes: the F16 copy of x lives in pool->out (dead until L2 writes
   * it; moe_compute.h). The map has M rows: a token tile reaching past the
   * last row reads TMA zero fill. Rows of [0, M) outside the pool hold
   * whatever the caller left there; they only feed token columns that are
   * never stored. */
  /* Mode 3 reads an FP8 copy of x in its K order there too. */
  constexpr bool kCopy = Cfg<MODE, BS>::kF16 || MODE == 3;
  uint16_t *xc = kCopy ? pool->out : NULL;
  TileMaps m1, m2, m1w, m2w; /* L1, L2; the pair's second launches */
  const void *x1 = kCopy ? (const void *)xc : (const void *)pool->x;
  const int big = Kern<MODE, 1, BS, CPS>::kBig, mid = Kern<MODE, 1, BS, CPS>::kMid;
  const uint64_t x1_pitch = MODE == 3 ? fp8_copy_pitch(H) : 0; /* mode 3's copy: in out's BF16 rows */
  MM_TRY(make_tile_maps(&m1, f16, mixed, BS, big, mid, x1, H, M, ws->xs_t, Mp, x1_pitch));
  MM_TRY(make_tile_maps(&m2, f16, mixed, BS, big, mid, ws->act, I, Mp, ws->as_t, Mp));
  if (BS2) {
    MM_TRY(make_tile_maps(&m1w, f16, false, BS2, 0, 0, x1, H, M, ws->xs_t, Mp, x1_pitch));
    MM_TRY(make_tile_maps(&m2w, f16, false, BS2, 0, 0, ws->act, I, Mp, ws->as_t, Mp));
  }
  /* maps first: the prep kernel then runs back to back with L1 */
  prep_kernel<kCopy ? MODE : 0><<<2 * sm_count(), 256, 0, st>>>(
      pool->x, pool->x_scale, pool->expert_offsets, L->E, H, Mp, ws->xs_t, xc);
  MM_CUDA_TRY(cudaGetLastError());
  Params p;
  memset(&p, 0, sizeof(p));
  p.w = L->d_w;
  p.expert_bytes = L->expert_bytes;
  p.lut = L->d_lut;
  p.offsets = pool->expert_offsets;
  p.E = L->E;
  p.Mp = Mp;
  p.M = M;
  p.row_weight = pool->row_weight;
  p.clamp = clamp;
  p.act = ws->act;
  p.as_t = ws->as_t;
  p.out = pool->out;
  p.out_rows = pool->out_rows;
  p.mixed = mixed && o.allow_mixed;
  p.wide_first = o.wide_first;
  /* L1 */
  p.mat_off = 0;
  p.rs = L->d_rs13;
  p.rows = 2 * I;
  p.K = H;
  /* modes 1, 3 and 4: the kernels without the reference multiply where
   * every reference of the matrix is 0 (Kern's ONE) */
  MM_TRY((launch_gemm<MODE, 1, BS, CPS, BS2>(p, L->refs_zero13, m1, m1w, o.max_ctas, st)));
  /* L2 */
  p.mat_off = L->w13_bytes;
  p.rs = L->d_rs2;
  p.rows = H;
  p.K = I;
  MM_TRY((launch_gemm<MODE, 2, BS, CPS, BS2>(p, L->refs_zero2, m2, m2w, o.max_ctas, st)));
  return NULL;
}

/* Every BF16 value g (thread g of 65536) through silu_n alone and paired
 * with another value, and its g_silu_bf16 entry, against the division: the
 * bit patterns must agree (NaN with NaN). */
__global__ void silu_check_kernel(unsigned long long *mismatches) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 65536u) return;
  const unsigned j = (i * 40503u + 12345u) & 0xFFFFu; /* a partner, in or out of the fast range */
  const float g1[1] = {__uint_as_float(i << 16)};
  const float g2[2] = {g1[0], __uint_as_float(j << 16)};
  float s1[1], s2[2];
  silu_n(g1, s1);
  silu_n(g2, s2);
  auto same = [](float a, float b) {
    return __float_as_uint(a) == __float_as_uint(b) || (a != a && b != b);
  };
  const float want = g1[0] / (1.0f + expf(-g1[0])), want2 = g2[1] / (1.0f + expf(-g2[1]));
  const int bad = !same(s1[0], want) + !same(s2[0], want) + !same(s2[1], want2) +
                  !same(g_silu_bf16[i], want);
  if (bad) atomicAdd(mismatches, (unsigned long long)bad);
}

}  // namespace

extern "C" mm_err *mm_sm90_silu_table_init(void *stream) {
  cudaStream_t st = (cudaStream_t)stream;
  /* a flag per device (any device number); the mutex keeps a second thread
   * of the same device from returning before the table is written */
  static std::mutex mu;
  static std::vector<bool> done;
  int dev = 0;
  MM_CUDA_TRY(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if ((size_t)dev < done.size() && done[dev]) return NULL;
  silu_table_kernel<<<256, 256, 0, st>>>();
  MM_CUDA_TRY(cudaGetLastError());
  MM_CUDA_TRY(cudaStreamSynchronize(st));
  if ((size_t)dev >= done.size()) done.resize((size_t)dev + 1, false);
  done[dev] = true;
  return NULL;
}

extern "C" mm_err *mm_sm90_check_silu(unsigned long long *mismatches) {
  MM_TRY(mm_sm90_silu_table_init(NULL));
  unsigned long long *d = NULL;
  MM_CUDA_TRY(cudaMalloc(&d, sizeof(*d)));
  mm_err *err = NULL;
  cudaError_t e = cudaMemset(d, 0, sizeof(*d));
  if (e == cudaSuccess) {
    silu_check_kernel<<<256, 256>>>(d);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaMemcpy(mismatches, d, sizeof(*d), cudaMemcpyDeviceToHost);
  if (e != cudaSuccess)
    err = mm_error(MEGAMOE_CODE_INTERNAL, "silu check: %s", cudaGetErrorString(e));
  cudaFree(d);
  return err;
}

mm_err *mm_sm90_prep_token_scales(const mm_sm90_layer *L, const mm_expert_pool *pool,
                                  const mm_sm90_ws *ws, cudaStream_t st) {
  prep_kernel<0><<<2 * sm_count(), 256, 0, st>>>(pool->x, pool->x_scale, pool->expert_offsets,
                                                 L->E, L->H, ws->Mp, ws->xs_t, NULL);
  MM_CUDA_TRY(cudaGetLastError());
  return NULL;
}

const float *mm_sm90_silu_table(void) {
  void *p = NULL;
  return cudaGetSymbolAddress(&p, g_silu_bf16) == cudaSuccess ? (const float *)p : NULL;
}

const char *mm_sm90_wgmma_unsupported(const mm_sm90_layer *L) {
  if (L->H % kRowsCta) return "hidden size must be a multiple of 256";
  if (L->E > kMaxExperts) return "more than 256 local experts";
  if (L->H / kRowsCta > 256 || 2 * L->I / kRowsCta > 256)
    return "hidden size and 2 x expert size must be at most 65536"; /* unit_pack */
  const int m = L->mode;
  if ((size_t)L->rec != (m == 1   ? Cfg<1, 64>::kRec
                         : m == 2 ? Cfg<2, 64>::kRec
                         : m == 3 ? Cfg<3, 64>::kRec
                                  : Cfg<4, 64>::kRec))
    return "record size mismatch";
  return NULL;
}

mm_err *mm_sm90_run_wgmma(const mm_sm90_layer *L, const mm_expert_pool *pool, float clamp,
                          const mm_sm90_ws *ws, cudaStream_t stream) {
  /* the launch shape from the average rows per expert (mm_sm90_launch_rule:
   * the counts live on the device; the caller's rows hint, else the
   * capacity) */
  const int rows = pool->rows_hint > 0 ? pool->rows_hint : pool->num_rows_max;
  const mm_sm90_launch rule = mm_sm90_launch_rule(L->mode, (rows + L->E - 1) / L->E);
  int bn = rule.tile, cps = rule.ctas_per_sm;
  bool pair = rule.pair != 0;
  /* overrides for tests and tuning (docs/CONFIG.md), read per call */
  const char *v = getenv("MEGAMOE_SM90_TOKEN_TILE");
  if (v && (!strcmp(v, "128+160") || !strcmp(v, "64+128") || !strcmp(v, "32+128"))) {
    bn = atoi(v);
    pair = true;
  } else if (v && (atoi(v) == 16 || atoi(v) == 32 || atoi(v) == 64 || atoi(v) == 128 ||
                   atoi(v) == 160)) {
    bn = atoi(v);
    pair = false;
  }
  v = getenv("MEGAMOE_SM90_CTAS_PER_SM");
  if (v && (atoi(v) == 1 || atoi(v) == 2)) cps = atoi(v);
  Overrides o;
  o.allow_mixed = mm_sm90_env_on("MEGAMOE_SM90_MIXED_TILES");
  o.wide_first = mm_sm90_env_on("MEGAMOE_SM90_WIDE_FIRST");
  o.max_ctas = mm_sm90_grid_cap();
  if (bn != 16) cps = 1; /* wider tiles spill with two CTAs per SM */
#define MM_RUN_BN(m)                                                                   \
  return bn == 16 ? (cps == 2 ? run_mode<m, 16, 2>(L, pool, clamp, ws, o, stream)      \
                              : run_mode<m, 16, 1>(L, pool, clamp, ws, o, stream))     \
         : bn == 32 ? (pair ? run_mode<m, 32, 1, 128>(L, pool, clamp, ws, o, stream)    \
                            : run_mode<m, 32, 1>(L, pool, clamp, ws, o, stream))       \
         : bn == 64 ? (pair ? run_mode<m, 64, 1, 128>(L, pool, clamp, ws, o, stream)    \
                            : run_mode<m, 64, 1>(L, pool, clamp, ws, o, stream))       \
         : bn == 128 ? (pair ? run_mode<m, 128, 1, 160>(L, pool, clamp, ws, o, stream)  \
                             : run_mode<m, 128, 1>(L, pool, clamp, ws, o, stream))     \
                     : run_mode<m, 160, 1>(L, pool, clamp, ws, o, stream)
  switch (L->mode) {
    case MM_WMODE_G32_FP8: MM_RUN_BN(1);
    case MM_WMODE_G16_BF16_EXACT: MM_RUN_BN(2);
    case MM_WMODE_G32_F16_EXACT: MM_RUN_BN(4);
    default: MM_RUN_BN(3);
  }
#undef MM_RUN_BN
}

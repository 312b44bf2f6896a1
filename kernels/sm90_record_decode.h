/* sm90_record_decode.h -- the FP8 modes' records (docs/LAYOUTS.md,
 * "Codes", FP8 modes) decoded to E4M3 rows by one warp through a
 * 128B-swizzled shared tile and a tensor store: the prefill path's weight
 * workspace (moe_sm90_prefill.cu; modes 1 and 3) and the probe's
 * (probe_prefill.cu; mode 1). C++/CUDA only; include after sm90_ptx.h.
 * Everything sits in the including file's unnamed namespace. */
#ifndef MM_SM90_RECORD_DECODE_H
#define MM_SM90_RECORD_DECODE_H

namespace {

/* The record formats: mode 1's (one scale byte per row and 32-group, an
 * index of the compact fold table) and mode 3's (one per 16-group, an
 * index of the full table). */
template <int MODE>
struct RecFmt {
  static_assert(MODE == 1 || MODE == 3, "the FP8 modes' records");
  static constexpr int kScaleBytes = MODE == 1 ? 4 : 8; /* per row */
  static constexpr int kRec = MM_SM90_RECORD_BYTES(kScaleBytes, true);
};

/* 8 weights of one code word through its group's fold-table entry (lx, ly):
 * bytes 0-3 from nibbles 0-3 (magnitude bits 0-2) with their signs at bits
 * 8i + 7, bytes 4-7 from nibbles 4-7 with their signs at bits 8i + 3: one
 * byte permute per 4 weights. */
__device__ __forceinline__ void rec_dec8(uint32_t w, uint32_t lx, uint32_t ly, uint32_t &lo,
                                         uint32_t &hi) {
  const uint32_t sel = w & 0x77777777u;
  lo = prmt(lx, ly, sel) | (w & 0x80808080u);
  hi = prmt(lx, ly, sel >> 16) | ((w << 4) & 0x80808080u);
}

/* A record's thread slot T = 32w + 4g + q owns rows 16w + g and 16w + g + 8
 * and the words u = 0..7 at byte (u / 4) * 2048 + 16 T + 4 (u % 4); word
 * u = 2s + rr is row 16w + g + 8rr, MMA positions 32s + 4q .. + 3 (its low
 * half) and 32s + 16 + 4q .. + 3 (its high half), decoded through the
 * fold-table entry at the row's scale byte for 32-group s (mode 1: the
 * positions are the columns) or 16-group 2s + q / 2 (mode 3: columns 32s +
 * 8q .. + 7 in its K order, mm_sm90_kperm). One slot's inputs: its 8 code words and its two
 * rows' scale bytes (sb[rr][0] in mode 1, both words in mode 3). */
struct RecSlot {
  uint4 c0, c1;
  uint32_t sb[2][2];
};
template <int MODE>
__device__ __forceinline__ void load_record_slot(const uint8_t *rec, int T, RecSlot &r) {
  const int w = T / 32, g = (T % 32) / 4;
  r.c0 = __ldcs((const uint4 *)(rec + 16 * T));
  r.c1 = __ldcs((const uint4 *)(rec + 2048 + 16 * T));
#pragma unroll
  for (int rr = 0; rr < 2; rr++) {
    const uint8_t *row = rec + 4096 + RecFmt<MODE>::kScaleBytes * (16 * w + g + 8 * rr);
    if (MODE == 1) {
      r.sb[rr][0] = __ldcs((const uint32_t *)row) & 0xF8F8F8F8u;
    } else {
      const uint2 v = __ldcs((const uint2 *)row);
      r.sb[rr][0] = v.x;
      r.sb[rr][1] = v.y;
    }
  }
}
/* The slot's 64 bytes into a 32-row half tile (rows row_base .. + 31 of the
 * record), 128B-swizzled: 16-byte chunk ^ row % 8 (= g), so that the 8
 * rows of a warp's 4-byte store land in 8 chunks instead of one bank
 * quarter. lut: the fold table in shared memory, mode 1's compact one
 * (256-aligned) or mode 3's whole one (read from global memory instead,
 * the prefill path's mode 3 ran 3-7% slower: docs/PERF.md, version 25). */
template <int MODE, bool NATURAL>
__device__ __forceinline__ void decode_record_slot(const RecSlot &r, int T, const uint8_t *lut,
                                                   uint8_t *tile, int row_base) {
  const int w = T / 32, g = (T % 32) / 4, q = T % 4;
  const uint32_t words[8] = {r.c0.x, r.c0.y, r.c0.z, r.c0.w, r.c1.x, r.c1.y, r.c1.z, r.c1.w};
#pragma unroll
  for (int u = 0; u < 8; u++) {
    const int s = u / 2, rr = u % 2;
    uint32_t lx, ly, lo, hi;
    if (MODE == 1) {
      const uint32_t a = prmt(r.sb[rr][0], smem_u32(lut), 0x7650 | s); /* the entry's address */
      asm("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(lx), "=r"(ly) : "r"(a));
    } else {
      /* the word's 8 columns, 32s + 8q .. + 7 (mm_sm90_kperm), are 16-group
       * 2s + q / 2's: byte 2 (s % 2) + q / 2 of the row's scale word */
      const uint32_t v = r.sb[rr][s / 2];
      asm("ld.shared.v2.u32 {%0, %1}, [%2];"
          : "=r"(lx), "=r"(ly) : "r"(smem_u32(lut) + 8 * prmt(v, 0, 0x4440 | (2 * (s & 1) + q / 2))));
    }
    rec_dec8(words[u], lx, ly, lo, hi);
    const uint32_t row = smem_u32(tile + (16 * w + g + 8 * rr - row_base) * 128);
    if (MODE == 3 && NATURAL) { /* columns 32s + 8q .. + 7: chunk 2s + q / 2 */
      asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(row + (((2 * s + q / 2) ^ g) << 4) +
                                                           8 * (q % 2)),
                   "r"(lo), "r"(hi) : "memory");
    } else { /* MMA positions 32s + 4q .. + 3 and 32s + 16 + 4q .. + 3 */
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(row + (((2 * s) ^ g) << 4) + 4 * q), "r"(lo) : "memory");
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(row + (((2 * s + 1) ^ g) << 4) + 4 * q), "r"(hi) : "memory");
    }
  }
}

/* One warp decodes the records [kb0, kb1) of one 64-row tile, as half
 * records (rows 32h .. 32h + 31: slots 64h .. 64h + 63, two per lane), into
 * its two 4 KB shared tiles `bufs` (1024-aligned), each stored by lane 0 with
 * a tensor copy (map tw: 32 x 128 boxes, 128B swizzle) at column 128 kb, row
 * wrow + 32h of the workspace. The next half record's loads are in flight
 * during a decode. n counts the warp's half records (the tile parity) across
 * calls. On return lane 0 has waited for the stores to complete and fenced
 * them, so the caller may publish the rows. NATURAL: the weights in column
 * order (mode 3's GEMM 1, whose tokens are the pool's rows as they are),
 * else in MMA position order (mode 3's GEMM 2, whose intermediate the L1
 * epilogues write in mm_sm90_kperm order; mode 1, where both are one). */
template <int MODE, bool NATURAL = false>
__device__ __forceinline__ void decode_record_run(const uint8_t *rec0, int kb0, int kb1,
                                                  const CUtensorMap *tw, int wrow,
                                                  const uint8_t *lut, uint8_t *bufs, int &n) {
  const int lane = threadIdx.x % 32, units = 2 * (kb1 - kb0);
  RecSlot cur[2];
  load_record_slot<MODE>(rec0, lane, cur[0]);
  load_record_slot<MODE>(rec0, lane + 32, cur[1]);
  for (int un = 0; un < units; un++, n++) {
    const int h = un % 2, kb = kb0 + un / 2;
    uint8_t *buf = bufs + (n & 1) * 4096;
    if (lane == 0) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    __syncwarp(); /* buf's store, two half records ago, has read it */
    const bool more = un + 1 < units;
    const uint8_t *nrec = rec0 + (size_t)((un + 1) / 2) * RecFmt<MODE>::kRec;
    const int nh = (un + 1) % 2;
    if (MODE == 1) {
      const RecSlot a0 = cur[0], a1 = cur[1];
      if (more) {
        load_record_slot<MODE>(nrec, 64 * nh + lane, cur[0]);
        load_record_slot<MODE>(nrec, 64 * nh + lane + 32, cur[1]);
      }
      decode_record_slot<MODE, NATURAL>(a0, 64 * h + lane, lut, buf, 32 * h);
      decode_record_slot<MODE, NATURAL>(a1, 64 * h + lane + 32, lut, buf, 32 * h);
    } else {
      /* each slot decoded from where it was loaded, then reloaded: with the
       * next loads beside copies of both slots (4 x 12 registers) the
       * decoder warps spilled at the producer warpgroup's 72 registers
       * (20 bytes still with one fold-table entry per word, version 31) */
#pragma unroll
      for (int i = 0; i < 2; i++) {
        decode_record_slot<MODE, NATURAL>(cur[i], 64 * h + lane + 32 * i, lut, buf, 32 * h);
        if (more) load_record_slot<MODE>(nrec, 64 * nh + lane + 32 * i, cur[i]);
      }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0) {
      asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                       (uint64_t)tw),
                   "r"(128 * kb), "r"(wrow + 32 * h), "r"(smem_u32(buf))
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  if (lane == 0) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    __threadfence();
  }
  __syncwarp();
}

}  // namespace

#endif

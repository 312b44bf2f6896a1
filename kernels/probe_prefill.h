/* probe_prefill.h -- a probe of another prefill structure for the sm90 expert
 * compute (docs/PERF.md, version 20), run by kernels/bench_prefill_probe:
 * one grouped FP8 GEMM with the tokens as the WGMMA A operand and E4M3
 * weights as B, both tensor-copied K-major with 128B swizzle (SS WGMMAs),
 * promoted per 128-wide K block with the token's FP32 scale, BF16 out
 * through staged tensor stores or an L1-like epilogue; the weights E4M3, or
 * decoded inside the kernel from the probe's own FP4 format or from mode 1's
 * records. Not a product path: no clamp, row weights, row factors or out-row
 * map, random data, every expert holding Me rows. Needs sm_90a. */
#ifndef MM_PROBE_PREFILL_H
#define MM_PROBE_PREFILL_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef enum {
  MM_PROBE_SS = 0,        /* 128 x 128 tiles, weights given as E4M3 */
  MM_PROBE_SS_MCAST,      /* + clusters of 2 CTAs along M multicasting B halves */
  MM_PROBE_SS_DECODE,     /* + the weights decoded from FP4 inside the kernel */
  MM_PROBE_SPLITN_DECODE, /* the same with 64 x 256 tiles (each warpgroup one B half) */
  MM_PROBE_SWIGLU,        /* that with an L1 epilogue: columns 2i, 2i + 1 gate and up i,
                             BF16-rounded, silu(gate) * up, FP8 per token per 128 outputs */
  MM_PROBE_RECORDS,       /* SS_DECODE with mode 1's records (docs/LAYOUTS.md) as the source */
  MM_PROBE_RECORDS_SWIGLU, /* SWIGLU with mode 1's records as the source */
  MM_PROBE_VARIANTS
} mm_probe_variant;

typedef struct {
  int E, Me, N, K;          /* experts, rows per expert (a multiple of 256), weight rows
                               per expert (of 256), K (of 128) */
  const uint8_t *x;         /* [E Me][K] E4M3 tokens */
  const float *xs_t;        /* [K / 128][E Me] token scales per 128-wide K block */
  const uint8_t *w;         /* [E N][K] E4M3 weights (variants without decode) */
  const uint8_t *codes;     /* [E N][K / 2] FP4 codes (decode variants: 16 bytes per
                               32 weights, mm_probe_decode's format) */
  const uint8_t *scales;    /* [E N][K / 32] one exponent byte per 32 weights */
  const uint8_t *records;   /* record variants: [E N / 64][K / 128] mode 1 records, references 0 */
  const uint8_t *lut;       /* and the compact fold table: 256 bytes, entry (k, 0) at 8 (k + 16) */
  uint8_t *wdec;            /* [E N][K] E4M3 the in-kernel decode writes */
  int *ready;               /* [E] decode progress counters (zeroed per call here) */
  uint16_t *out;            /* [E Me][N] BF16 */
  uint8_t *act;             /* MM_PROBE_SWIGLU: [E Me][N / 2] FP8 */
  float *act_s;             /* and its scales [N / 256][E Me] */
} mm_probe_problem;

const char *mm_probe_variant_name(mm_probe_variant v);
/* One call of variant v on the stream (a cudaStream_t). */
mm_err *mm_probe_gemm(const mm_probe_problem *p, mm_probe_variant v, void *stream);
/* The decode as a pass of its own: codes + scales -> E4M3 weights (n weights). */
mm_err *mm_probe_decode(const uint8_t *codes, const uint8_t *scales, uint8_t *w, size_t n,
                        void *stream);
/* Finite E4M3 bytes (|v| in 2^-3..2^4), and scales in [5e-4, 1.5e-3). */
mm_err *mm_probe_fill_e4m3(uint8_t *p, size_t n, uint32_t seed, void *stream);
mm_err *mm_probe_fill_scales(float *p, size_t n, uint32_t seed, void *stream);
/* n bytes of random mode 1 records (fold-table entries (k, 0), k in [-6, 2];
 * references 0), and their weights decoded one by one from the layout's
 * formulas (rows x K, E4M3). */
mm_err *mm_probe_fill_records(uint8_t *p, size_t n, uint32_t seed, void *stream);
mm_err *mm_probe_decode_records(const uint8_t *records, const uint8_t *lut, uint8_t *w, size_t rows,
                                int K, void *stream);
/* FP32 reference of every stride-th output row (ref [rows][N]) from E4M3 weights w. */
mm_err *mm_probe_reference(const mm_probe_problem *p, const uint8_t *w, int stride, float *ref,
                           void *stream);

#endif

/* pack_sm90.cu -- the sm90 kernel layout packed on the GPU (pack_sm90.h).
 * The steps are the host packer's (plugin/layout_sm90_pack_rules.h): a
 * thread per layout row finds the row anchors, then a block of 64 threads
 * per record, one per record row, fills the record's rows, scale bytes and
 * references, gathers its 1024 code words from shared memory and, in mode
 * 3, adds up its fold error. A fault goes to a per-record slot; the host
 * reads them in the host packer's order, so the first one it meets is the
 * one the host packer reports. */
#include <cuda_runtime.h>

#include <math.h> /* before the C headers' extern "C" block */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "layout_sm90_pack.h"
#include "pack_sm90.h"
#include "prep.h"
}

namespace {

/* One matrix of a launch: its canonical source (device copies), where its
 * records and row factors go, and its per-row and per-record scratch. */
struct PackMat {
  mm_qmat m;
  int gate_up;
  uint8_t *dst;          /* records, [rows/64][cols/128] */
  float *row_factor;     /* [rows], layout row order */
  uint8_t *nz, *stops;   /* mode 1, per layout row: [cols/32], [cols/128] */
  int32_t *anchor;       /* per layout row */
  mm_sm90p_fault *fault; /* per record */
  double *fold;          /* per record: sum err^2, sum w^2 (mode 3) */
  int row0, rec0;        /* its first row and record in the launch */
};

__device__ int find_mat(const PackMat *mats, int n, int i, int rec) {
  int k = 0;
  while (k + 1 < n && (rec ? mats[k + 1].rec0 : mats[k + 1].row0) <= i) k++;
  return k;
}

__global__ void row_anchor_kernel(const mm_sm90_pack_tables *T, const PackMat *mats, int n,
                                  int rows) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows) return;
  const PackMat *M = &mats[find_mat(mats, n, i, 0)];
  const int r = i - M->row0, ng = M->m.cols / 32, KB = M->m.cols / 128;
  M->anchor[r] = mm_sm90p_row_anchor(T, &M->m, M->gate_up, r,
                                     M->nz ? M->nz + (size_t)r * ng : NULL,
                                     M->stops ? M->stops + (size_t)r * KB : NULL);
}

__global__ void __launch_bounds__(64) record_kernel(const mm_sm90_pack_tables *T,
                                                    const PackMat *mats, int n) {
  __shared__ uint8_t in[64 * 64];
  __shared__ mm_sm90p_fault faults[64];
  __shared__ double e2s[64], r2s[64];
  __shared__ int first_bad;
  const PackMat *M = &mats[find_mat(mats, n, (int)blockIdx.x, 1)];
  const mm_weight_mode mode = (mm_weight_mode)T->mode;
  const int rec = (int)blockIdx.x - M->rec0, KB = M->m.cols / 128, ng = M->m.cols / 32;
  const int t = rec / KB, kb = rec % KB, lr = threadIdx.x, r = 64 * t + lr;
  const int G = mm_sm90_groups_per_row(mode);
  uint8_t *R = M->dst + (size_t)rec * mm_sm90_record_bytes(mode);
  uint8_t *sc = R + mm_sm90_scale_offset() + lr * G;
  if (lr == 0) first_bad = 64;
  __syncthreads();
  mm_sm90p_fault f;
  f.kind = MM_SM90P_FAULT_NONE;
  int16_t ref;
  int fold;
  float row_factor;
  const int bad = mm_sm90p_record_row(
      T, &M->m, M->gate_up, t, kb, lr, M->nz ? M->nz + (size_t)r * ng : NULL,
      M->stops ? M->stops + (size_t)r * KB : NULL, M->anchor ? M->anchor[r] : MM_SM90P_NO_ANCHOR,
      in + 64 * lr, sc, &ref, &fold, &row_factor, &f);
  if (bad) {
    faults[lr] = f;
    atomicMin(&first_bad, lr);
  }
  __syncthreads();
  if (first_bad < 64) { /* the record's first failing row, as the host packer meets it */
    if (lr == 0) M->fault[rec] = faults[first_bad];
    return;
  }
  if (lr == 0) M->fault[rec].kind = MM_SM90P_FAULT_NONE;
  if (kb == 0) M->row_factor[r] = row_factor;
  uint32_t *words = (uint32_t *)R;
  for (int w = lr; w < 1024; w += 64) words[w] = mm_sm90p_word(T, in, w);
  if (mm_sm90_has_ref(mode)) ((int16_t *)(R + mm_sm90_ref_offset(mode)))[lr] = ref;
  if (mode != MM_WMODE_G16_FP8) return;
  double e2 = 0.0, r2 = 0.0;
  mm_sm90p_record_row_error(T, &M->m, M->gate_up, t, kb, lr, sc, fold, &e2, &r2);
  e2s[lr] = e2;
  r2s[lr] = r2;
  __syncthreads();
  if (lr == 0) { /* in row order: deterministic */
    e2 = r2 = 0.0;
    for (int i = 0; i < 64; i++) {
      e2 += e2s[i];
      r2 += r2s[i];
    }
    M->fold[2 * (size_t)rec] = e2;
    M->fold[2 * (size_t)rec + 1] = r2;
  }
}

__global__ void fill_ones(float *x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = 1.0f;
}

/* The scratch of one matrix slot: the source copy and the per-row and
 * per-record arrays its record mode uses, at 256-byte aligned offsets; with
 * a requant, after them the group-16 source and the requant's row
 * statistics and status word. m: the matrix as packed (group 32 after a
 * requant). */
struct SlotPlan {
  size_t codes, scales, row_scale, nz, stops, anchor, fault, fold;
  size_t src_codes, src_scales, src_row_scale, row_stats, status, bytes;
};
SlotPlan slot_plan(const mm_qmat *m, mm_weight_mode rmode, int requant) {
  const size_t rows = (size_t)m->rows, recs = rows / 64 * (size_t)(m->cols / 128);
  const int g32 = rmode == MM_WMODE_G32_FP8, anchors = rmode != MM_WMODE_G16_BF16_EXACT;
  SlotPlan p;
  size_t off = 0;
  p.codes = off;
  off += mm_sm90_align256(rows * (size_t)m->cols / 2);
  p.scales = off;
  off += mm_sm90_align256(rows * (size_t)(m->cols / m->gran));
  p.row_scale = off;
  off += mm_sm90_align256(sizeof(float) * rows);
  p.nz = off; /* mode 1 */
  off += g32 ? mm_sm90_align256(rows * (size_t)(m->cols / 32)) : 0;
  p.stops = off; /* mode 1 */
  off += g32 ? mm_sm90_align256(rows * (size_t)(m->cols / 128)) : 0;
  p.anchor = off; /* modes 1 and 3 */
  off += anchors ? mm_sm90_align256(sizeof(int32_t) * rows) : 0;
  p.fault = off;
  off += mm_sm90_align256(sizeof(mm_sm90p_fault) * recs);
  p.fold = off; /* mode 3 */
  off += rmode == MM_WMODE_G16_FP8 ? mm_sm90_align256(2 * sizeof(double) * recs) : 0;
  p.src_codes = off;
  off += requant ? mm_sm90_align256(rows * (size_t)m->cols / 2) : 0;
  p.src_scales = off;
  off += requant ? mm_sm90_align256(rows * (size_t)(m->cols / 16)) : 0;
  p.src_row_scale = off;
  off += requant ? mm_sm90_align256(sizeof(float) * rows) : 0;
  p.row_stats = off;
  off += requant ? mm_sm90_align256(3 * sizeof(double) * rows) : 0;
  p.status = off;
  off += requant ? 256 : 0;
  p.bytes = off;
  return p;
}

mm_err *cuda_err(cudaError_t ce, const char *what) {
  return mm_error(ce == cudaErrorMemoryAllocation ? MEGAMOE_CODE_RESOURCE_EXHAUSTED
                                                  : MEGAMOE_CODE_INTERNAL,
                  "sm90 GPU pack: %s: %s", what, cudaGetErrorString(ce));
}

#define CU(call, what)                                 \
  do {                                                 \
    cudaError_t ce_ = (call);                          \
    if (ce_ != cudaSuccess) {                          \
      err = cuda_err(ce_, what);                       \
      goto done;                                       \
    }                                                  \
  } while (0)

/* experts per upload: bounds the scratch (about 23 MB per GLM-5 expert).
 * The uploads are from pageable memory (9 GB/s on the H200 host): staging
 * two experts at a time in pinned memory (55 GB/s) on the host's cores,
 * with its allocation per call, measured slower (bench_pack_sm90: 154-167
 * ms a GLM-5 layer against 92-116; docs/PERF.md "GPU packing"). */
const int kChunk = 4;

/* The matrix as the packer sees it: after a requant, group 32 with UE8M0
 * scales (its row_scale then 1). */
mm_qmat as_packed(const mm_qmat *m, int requant) {
  mm_qmat d = *m;
  if (requant) {
    d.gran = 32;
    d.sf = MM_SF_UE8M0;
  }
  return d;
}

/* The requant's statistics of one matrix (w13: gate then up; w2: down) from
 * its row statistics, each row added in order as mm_requant_g16_to_g32
 * adds them, and its errors in the loader's order: a non-finite value
 * (cannot pass the loader's checks; kept for any other caller), then each
 * projection over the limit. */
mm_err *requant_result(const mm_qmat *m, int w, int expert, uint32_t status,
                       const double *row_stats, const mm_sm90_requant *rq,
                       mm_requant_stats *out /* [2] for w13, [1] for w2 */) {
  static const char *const kProj[3] = {"gate_proj", "up_proj", "down_proj"};
  const int parts = w ? 1 : 2, prows = m->rows / parts, groups = m->cols / 32;
  char name[96];
  if (status != MM_GPU_STATUS_OK) {
    const int r = (int)(status / (uint32_t)groups), g = (int)(status % (uint32_t)groups);
    const uint8_t *sc = m->scales + (size_t)r * (size_t)(m->cols / 16) + 2 * (size_t)g;
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "experts.%d.%s: row %d, elements %d..%d: non-finite source value (scale "
                    "bytes 0x%02x 0x%02x, global %g)",
                    expert, kProj[w ? 2 : r / prows], r % prows, 32 * g, 32 * g + 31, sc[0],
                    sc[1], (double)m->row_scale[r]);
  }
  for (int q = 0; q < parts; q++) {
    mm_requant_stats acc = {};
    for (int r = q * prows; r < (q + 1) * prows; r++) {
      const mm_requant_stats one = {row_stats[3 * (size_t)r], row_stats[3 * (size_t)r + 1],
                                    row_stats[3 * (size_t)r + 2], 0.0, m->cols};
      mm_requant_stats_merge(&acc, &one);
    }
    out[q] = acc;
    snprintf(name, sizeof name, "experts.%d.%s", expert, kProj[w ? 2 : q]);
    MM_TRY(mm_requant_limit_error(name, &acc, rq->max_rel_error));
  }
  return NULL;
}

} // namespace

extern "C" mm_err *mm_sm90_pack_experts_gpu(const mm_expert_q *experts, int count, int index_base,
                                            mm_weight_mode mode, uint8_t *dst, float *rs13,
                                            float *rs2, double fold_err[2],
                                            const mm_sm90_requant *rq, void *stream) {
  MM_ARG_CHECK(experts && count > 0 && dst && rs13 && rs2, "sm90 pack: %d experts", count);
  MM_ARG_CHECK(((uintptr_t)dst & 3) == 0 && ((uintptr_t)rs13 & 3) == 0 && ((uintptr_t)rs2 & 3) == 0,
               "sm90 GPU pack: outputs must be 4-byte aligned");
  const int requant = rq != NULL;
  MM_ARG_CHECK(!requant || rq->stats, "sm90 GPU pack: a requant needs its statistics array");
  const mm_qmat *w13 = &experts[0].w13, *w2 = &experts[0].w2;
  for (int e = 1; e < count; e++)
    MM_ARG_CHECK(experts[e].w13.rows == w13->rows && experts[e].w13.cols == w13->cols &&
                     experts[e].w2.rows == w2->rows && experts[e].w2.cols == w2->cols,
                 "sm90 pack: local expert %d has other shapes than expert %d", index_base + e,
                 index_base);
  for (int i = 0; i < 2 * count && requant; i++) {
    const mm_qmat *m = i % 2 ? &experts[i / 2].w2 : &experts[i / 2].w13;
    MM_ARG_CHECK(m->gran == 16 && m->cols % 32 == 0 && (i % 2 || m->rows % 2 == 0),
                 "sm90 GPU pack: requant of local expert %d %s: needs group 16 and cols %% 32 "
                 "== 0 (gran %d, [%d, %d])",
                 index_base + i / 2, i % 2 ? "w2" : "w13", m->gran, m->rows, m->cols);
  }
  /* A matrix the host packer would refuse: pack only the ones before it;
   * their faults come first, as there. */
  const int nmat = 2 * count;
  int n_ok = nmat;
  mm_err *check_err = NULL;
  for (int i = 0; i < nmat && !check_err; i++) {
    const mm_qmat m = as_packed(i % 2 ? &experts[i / 2].w2 : &experts[i / 2].w13, requant);
    if ((check_err = mm_sm90_check_matrix(&m, mode, i % 2 == 0))) n_ok = i;
  }
  cudaStream_t st = (cudaStream_t)stream;
  const mm_weight_mode rmode = mm_sm90_record_mode(mode); /* mode 4: mode 1's records */
  const size_t b13 = mm_sm90_matrix_bytes(rmode, w13->rows, w13->cols);
  const size_t b2 = mm_sm90_matrix_bytes(rmode, w2->rows, w2->cols);
  const int chunk = count < kChunk ? count : kChunk;
  const mm_qmat p13m = as_packed(w13, requant), p2m = as_packed(w2, requant);
  mm_err *err = NULL;
  mm_sm90_pack_tables *T = NULL, *d_T = NULL;
  PackMat *d_mats = NULL;
  uint8_t *scratch = NULL;
  mm_sm90p_fault *faults = NULL;
  double *folds = NULL, *row_stats = NULL;
  uint32_t status[2 * kChunk];
  SlotPlan p13 = {}, p2 = {};
  size_t recs13 = 0, recs2 = 0;
  int failed = -1;
  /* the fold sums, added matrix by matrix as the host packer adds them */
  double fold[2] = {fold_err ? fold_err[0] : 0.0, fold_err ? fold_err[1] : 0.0};
  if (requant) memset(rq->stats, 0, sizeof(mm_requant_stats) * 3 * (size_t)count);
  if (n_ok == 0) goto checked;
  /* a refused w2 is not looked at (its group size may be anything) */
  p13 = slot_plan(&p13m, rmode, requant);
  recs13 = (size_t)(w13->rows / 64) * (size_t)(w13->cols / 128);
  if (n_ok > 1) {
    p2 = slot_plan(&p2m, rmode, requant);
    recs2 = (size_t)(w2->rows / 64) * (size_t)(w2->cols / 128);
  }
  (void)cudaGetLastError(); /* a launch error below is ours */
  T = (mm_sm90_pack_tables *)malloc(sizeof *T);
  faults = (mm_sm90p_fault *)malloc(sizeof(mm_sm90p_fault) * (recs13 + recs2) * (size_t)chunk);
  folds = (double *)malloc(2 * sizeof(double) * (recs13 + recs2) * (size_t)chunk);
  if (requant)
    row_stats = (double *)malloc(3 * sizeof(double) * (size_t)(w13->rows + w2->rows) * (size_t)chunk);
  if (!T || !faults || !folds || (requant && !row_stats)) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "sm90 GPU pack: out of host memory");
    goto done;
  }
  if (mm_sm90_pack_tables_build(T, rmode) != 0) {
    err = mm_error(MEGAMOE_CODE_INTERNAL, "sm90 layout: code slots are not byte-aligned words");
    goto done;
  }
  CU(cudaMalloc((void **)&d_T, sizeof *T), "tables");
  CU(cudaMalloc((void **)&d_mats, sizeof(PackMat) * 2 * (size_t)chunk), "matrix list");
  CU(cudaMalloc((void **)&scratch, (p13.bytes + p2.bytes) * (size_t)chunk), "scratch");
  CU(cudaMemcpyAsync(d_T, T, sizeof *T, cudaMemcpyHostToDevice, st), "tables upload");
  for (int e0 = 0; e0 < count && 2 * e0 < n_ok && !err; e0 += chunk) {
    PackMat mats[2 * kChunk];
    uint8_t *bases[2 * kChunk];
    int n = 0, rows = 0, recs = 0;
    for (int i = 2 * e0; i < 2 * (e0 + chunk) && i < n_ok; i++, n++) {
      const int e = i / 2, w = i % 2;
      const mm_qmat *m = w ? &experts[e].w2 : &experts[e].w13;
      const SlotPlan &sp = w ? p2 : p13;
      uint8_t *base = scratch + (size_t)(e - e0) * (p13.bytes + p2.bytes) + (w ? p13.bytes : 0);
      PackMat &M = mats[n];
      bases[n] = base;
      M.m = as_packed(m, requant);
      M.m.codes = base + sp.codes;
      M.m.scales = base + sp.scales;
      M.m.row_scale = (float *)(base + sp.row_scale);
      M.gate_up = !w;
      M.dst = dst + (size_t)e * (b13 + b2) + (w ? b13 : 0);
      M.row_factor = w ? rs2 + (size_t)e * (size_t)w2->rows : rs13 + (size_t)e * (size_t)w13->rows;
      M.nz = rmode == MM_WMODE_G32_FP8 ? base + sp.nz : NULL;
      M.stops = rmode == MM_WMODE_G32_FP8 ? base + sp.stops : NULL;
      M.anchor = rmode == MM_WMODE_G16_BF16_EXACT ? NULL : (int32_t *)(base + sp.anchor);
      M.fault = (mm_sm90p_fault *)(base + sp.fault);
      M.fold = rmode == MM_WMODE_G16_FP8 ? (double *)(base + sp.fold) : NULL;
      M.row0 = rows;
      M.rec0 = recs;
      rows += m->rows;
      recs += (m->rows / 64) * (m->cols / 128);
      /* pageable sources: each copy returns once its bytes are staged; with
       * a requant the group-16 source goes up and is requantized into the
       * slot's canonical arrays */
      uint8_t *up_codes = requant ? base + sp.src_codes : M.m.codes;
      uint8_t *up_scales = requant ? base + sp.src_scales : M.m.scales;
      float *up_rs = requant ? (float *)(base + sp.src_row_scale) : M.m.row_scale;
      CU(cudaMemcpyAsync(up_codes, m->codes, (size_t)m->rows * (size_t)m->cols / 2,
                         cudaMemcpyHostToDevice, st), "upload of codes");
      CU(cudaMemcpyAsync(up_scales, m->scales, (size_t)m->rows * (size_t)(m->cols / m->gran),
                         cudaMemcpyHostToDevice, st), "upload of scales");
      CU(cudaMemcpyAsync(up_rs, m->row_scale, sizeof(float) * (size_t)m->rows,
                         cudaMemcpyHostToDevice, st), "upload of row factors");
      if (requant) {
        uint32_t *d_status = (uint32_t *)(base + sp.status);
        CU(cudaMemsetAsync(d_status, 0xFF, sizeof(uint32_t), st), "requant status"); /* = MM_GPU_STATUS_OK */
        err = mm_gpu_requant_launch(m->rows, m->cols, m->sf, up_codes, up_scales, up_rs,
                                    M.m.codes, M.m.scales, (double *)(base + sp.row_stats),
                                    d_status, st);
        if (err) goto done;
        fill_ones<<<(unsigned)((m->rows + 255) / 256), 256, 0, st>>>(M.m.row_scale, m->rows);
      }
    }
    CU(cudaMemcpyAsync(d_mats, mats, sizeof(PackMat) * (size_t)n, cudaMemcpyHostToDevice, st),
       "matrix list upload");
    if (rmode != MM_WMODE_G16_BF16_EXACT)
      row_anchor_kernel<<<(unsigned)((rows + 127) / 128), 128, 0, st>>>(d_T, d_mats, n, rows);
    record_kernel<<<(unsigned)recs, 64, 0, st>>>(d_T, d_mats, n);
    CU(cudaGetLastError(), "kernel launch");
    /* every record's fault slot and fold sums, in matrix order; the
     * requant's status and row statistics */
    size_t at = 0, rat = 0;
    for (int k = 0; k < n; k++) {
      const size_t nr = (size_t)(mats[k].m.rows / 64) * (size_t)(mats[k].m.cols / 128);
      CU(cudaMemcpyAsync(faults + at, mats[k].fault, sizeof(mm_sm90p_fault) * nr,
                         cudaMemcpyDeviceToHost, st), "fault read-back");
      if (rmode == MM_WMODE_G16_FP8)
        CU(cudaMemcpyAsync(folds + 2 * at, mats[k].fold, 2 * sizeof(double) * nr,
                           cudaMemcpyDeviceToHost, st), "fold read-back");
      if (requant) {
        const SlotPlan &sp = k % 2 ? p2 : p13;
        CU(cudaMemcpyAsync(&status[k], bases[k] + sp.status, sizeof(uint32_t),
                           cudaMemcpyDeviceToHost, st), "requant status read-back");
        CU(cudaMemcpyAsync(row_stats + 3 * rat, bases[k] + sp.row_stats,
                           3 * sizeof(double) * (size_t)mats[k].m.rows, cudaMemcpyDeviceToHost, st),
           "requant statistics read-back");
      }
      at += nr;
      rat += (size_t)mats[k].m.rows;
    }
    CU(cudaStreamSynchronize(st), "packing");
    at = rat = 0;
    for (int k = 0; k < n && !err; k++) {
      const int e = e0 + k / 2, w = k % 2;
      const size_t nr = (size_t)(mats[k].m.rows / 64) * (size_t)(mats[k].m.cols / 128);
      if (requant) {
        const mm_qmat *m = w ? &experts[e].w2 : &experts[e].w13;
        err = requant_result(m, w, rq->first_expert + e, status[k], row_stats + 3 * rat, rq,
                             rq->stats + 3 * (size_t)e + (w ? 2 : 0));
        if (err) break; /* names its tensor */
      }
      double e2 = 0.0, r2 = 0.0;
      for (size_t q = 0; q < nr; q++) {
        const mm_sm90p_fault *f = &faults[at + q];
        if (f->kind != MM_SM90P_FAULT_NONE) {
          char msg[256];
          mm_sm90p_fault_message(f, msg);
          err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "sm90 layout: %s", msg);
          failed = 2 * e0 + k;
          break;
        }
        if (rmode == MM_WMODE_G16_FP8) {
          e2 += folds[2 * (at + q)];
          r2 += folds[2 * (at + q) + 1];
        }
      }
      if (!err) {
        fold[0] += e2;
        fold[1] += r2;
      }
      at += nr;
      rat += (size_t)mats[k].m.rows;
    }
  }
checked:
  if (!err && check_err) {
    err = check_err;
    check_err = NULL;
    failed = n_ok;
  }
  if (!err && fold_err) {
    fold_err[0] = fold[0];
    fold_err[1] = fold[1];
  }
done:
  if (err && failed >= 0)
    err = mm_error_wrap(err, failed % 2 ? "local expert %d w2 (down)" : "local expert %d w13 (gate/up)",
                        index_base + failed / 2);
  if (err) cudaStreamSynchronize(st); /* kernels may still read the scratch */
  mm_error_free(check_err);
  cudaFree(d_T);
  cudaFree(d_mats);
  cudaFree(scratch);
  free(T);
  free(faults);
  free(folds);
  free(row_stats);
  return err;
}

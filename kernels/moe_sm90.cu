/* moe_sm90.cu -- sm90 expert compute: layer upload, workspace, dispatch, and
 * the plain CUDA-core implementation of the contract (no tensor cores; the
 * debugging reference for the WGMMA path in moe_sm90_wgmma.cu). */
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <stdlib.h>
#include <string.h>

#include "moe_sm90_impl.h"

/* ---------------------------------------------------------------- layer ---- */

extern "C" mm_err *mm_sm90_layer_create(const mm_expert_q *experts, int num_local,
                                        mm_weight_mode mode, void *stream,
                                        mm_sm90_layer **out) {
  *out = NULL;
  if (num_local <= 0 || !experts)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "sm90 layer: %d local experts", num_local);
  const int H = experts[0].w13.cols, I = experts[0].w2.cols;
  for (int e = 0; e < num_local; e++) {
    const mm_expert_q *x = &experts[e];
    if (x->w13.rows != 2 * I || x->w13.cols != H || x->w2.rows != H || x->w2.cols != I)
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                      "sm90 layer: expert %d has w13 [%d, %d] and w2 [%d, %d], expected [%d, %d] "
                      "and [%d, %d]",
                      e, x->w13.rows, x->w13.cols, x->w2.rows, x->w2.cols, 2 * I, H, H, I);
  }
  if (H % 128 || I % 128)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "sm90 layer: hidden %d and intermediate %d must be multiples of 128", H, I);
  cudaStream_t st = (cudaStream_t)stream;
  mm_sm90_layer *L = (mm_sm90_layer *)calloc(1, sizeof(*L));
  if (!L) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "sm90 layer: out of host memory");
  L->mode = mode;
  L->E = num_local;
  L->H = H;
  L->I = I;
  L->rec = mm_sm90_record_bytes(mode);
  L->w13_bytes = mm_sm90_matrix_bytes(mode, 2 * I, H);
  L->w2_bytes = mm_sm90_matrix_bytes(mode, H, I);
  L->expert_bytes = L->w13_bytes + L->w2_bytes;
  mm_err *err = NULL;
  uint8_t *host = NULL;
  float *hrs = NULL;
  double e2 = 0.0, r2 = 0.0;
  const size_t rs_count = (size_t)num_local * (size_t)(2 * I + H);
  size_t wbytes = L->expert_bytes * (size_t)num_local;
  cudaError_t ce = cudaMalloc((void **)&L->d_w, wbytes);
  if (ce == cudaSuccess) ce = cudaMalloc((void **)&L->d_rs13, sizeof(float) * rs_count);
  if (ce == cudaSuccess) ce = cudaMalloc((void **)&L->d_lut, MM_SM90_LUT_ENTRIES * 8);
  if (ce != cudaSuccess) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED,
                   "sm90 layer: cudaMalloc of %zu weight bytes failed: %s", wbytes,
                   cudaGetErrorString(ce));
    goto fail;
  }
  L->d_rs2 = L->d_rs13 + (size_t)num_local * (size_t)(2 * I);
  L->device_bytes = wbytes + sizeof(float) * rs_count + MM_SM90_LUT_ENTRIES * 8;
  host = (uint8_t *)malloc(L->expert_bytes);
  hrs = (float *)malloc(sizeof(float) * rs_count);
  if (!host || !hrs) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "sm90 layer: out of host memory");
    goto fail;
  }
  {
    uint8_t lut[MM_SM90_LUT_ENTRIES][8];
    mm_sm90_lut_table(lut);
    ce = cudaMemcpyAsync(L->d_lut, lut, sizeof(lut), cudaMemcpyHostToDevice, st);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(st);
    if (ce != cudaSuccess) {
      err = mm_error(MEGAMOE_CODE_INTERNAL, "sm90 layer: upload failed: %s",
                     cudaGetErrorString(ce));
      goto fail;
    }
  }
  for (int e = 0; e < num_local; e++) {
    double fe[2] = {0, 0};
    err = mm_sm90_pack_matrix(&experts[e].w13, mode, 1, host,
                              hrs + (size_t)e * (size_t)(2 * I), fe);
    if (err) {
      err = mm_error_wrap(err, "local expert %d w13 (gate/up)", e);
      goto fail;
    }
    e2 += fe[0];
    r2 += fe[1];
    err = mm_sm90_pack_matrix(&experts[e].w2, mode, 0, host + L->w13_bytes,
                              hrs + (size_t)num_local * (size_t)(2 * I) + (size_t)e * (size_t)H,
                              fe);
    if (err) {
      err = mm_error_wrap(err, "local expert %d w2 (down)", e);
      goto fail;
    }
    e2 += fe[0];
    r2 += fe[1];
    /* one host staging buffer: copy, then wait before it is reused */
    ce = cudaMemcpyAsync(L->d_w + (size_t)e * L->expert_bytes, host, L->expert_bytes,
                         cudaMemcpyHostToDevice, st);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(st);
    if (ce != cudaSuccess) {
      err = mm_error(MEGAMOE_CODE_INTERNAL, "sm90 layer: upload of expert %d failed: %s", e,
                     cudaGetErrorString(ce));
      goto fail;
    }
  }
  ce = cudaMemcpyAsync(L->d_rs13, hrs, sizeof(float) * rs_count, cudaMemcpyHostToDevice, st);
  if (ce == cudaSuccess) ce = cudaStreamSynchronize(st);
  if (ce != cudaSuccess) {
    err = mm_error(MEGAMOE_CODE_INTERNAL, "sm90 layer: upload of row factors failed: %s",
                   cudaGetErrorString(ce));
    goto fail;
  }
  L->fold_rel = r2 > 0.0 ? sqrt(e2 / r2) : 0.0;
  free(host);
  free(hrs);
  *out = L;
  return NULL;
fail:
  free(host);
  free(hrs);
  mm_sm90_layer_destroy(L);
  return err;
}

extern "C" void mm_sm90_layer_destroy(mm_sm90_layer *L) {
  if (!L) return;
  cudaFree(L->d_w);
  cudaFree(L->d_rs13);
  cudaFree(L->d_lut);
  free(L);
}

extern "C" size_t mm_sm90_layer_device_bytes(const mm_sm90_layer *L) {
  return L ? L->device_bytes : 0;
}
extern "C" double mm_sm90_layer_fold_error(const mm_sm90_layer *L) { return L->fold_rel; }
extern "C" mm_weight_mode mm_sm90_layer_mode(const mm_sm90_layer *L) { return L->mode; }

/* ------------------------------------------------------------ workspace ---- */

static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

mm_sm90_ws mm_sm90_ws_carve(const mm_sm90_layer *L, int num_rows_max, void *base) {
  mm_sm90_ws w;
  memset(&w, 0, sizeof(w));
  w.Mp = (num_rows_max + 63) / 64 * 64;
  if (w.Mp == 0) w.Mp = 64;
  const size_t Mp = (size_t)w.Mp;
  const int m2 = L->mode == MM_WMODE_G16_BF16_EXACT;
  size_t off = 0;
  uint8_t *b = (uint8_t *)base;
  w.xs_t = (float *)(b ? b + off : NULL);
  off += align256(sizeof(float) * (size_t)(L->H / 128) * Mp);
  w.x16 = m2 && b ? (uint16_t *)(b + off) : NULL;
  if (m2) off += align256(2 * Mp * (size_t)L->H);
  w.act = b ? b + off : NULL;
  off += align256((m2 ? 2 : 1) * Mp * (size_t)L->I);
  w.as_t = (float *)(b ? b + off : NULL);
  off += align256(sizeof(float) * (size_t)(L->I / 128) * Mp);
  w.bytes = off;
  return w;
}

extern "C" size_t mm_sm90_workspace_bytes(const mm_sm90_layer *L, int num_rows_max) {
  return mm_sm90_ws_carve(L, num_rows_max, NULL).bytes;
}

/* ------------------------------------------------------------- dispatch ---- */

extern "C" mm_err *mm_sm90_expert_compute_path(const mm_sm90_layer *L, const mm_expert_pool *pool,
                                               float clamp, void *workspace,
                                               size_t workspace_bytes, void *stream,
                                               mm_sm90_path path) {
  MM_ARG_CHECK(L && pool, "sm90 expert compute: NULL layer or pool");
  MM_ARG_CHECK(pool->num_rows_max >= 0, "sm90 expert compute: num_rows_max %d < 0",
               pool->num_rows_max);
  MM_ARG_CHECK(clamp >= 0.0f, "sm90 expert compute: activation clamp %g < 0", (double)clamp);
  if (pool->num_rows_max == 0) return NULL;
  MM_ARG_CHECK(pool->expert_offsets && pool->x && pool->x_scale && pool->row_weight && pool->out,
               "sm90 expert compute: NULL device pointer in the pool");
  mm_sm90_ws ws = mm_sm90_ws_carve(L, pool->num_rows_max, workspace);
  MM_ARG_CHECK(workspace && workspace_bytes >= ws.bytes,
               "sm90 expert compute: workspace of %zu bytes, %zu needed for %d rows",
               workspace_bytes, ws.bytes, pool->num_rows_max);
  cudaStream_t st = (cudaStream_t)stream;
  const char *why = mm_sm90_wgmma_unsupported(L);
  if (path == MM_SM90_PATH_WGMMA && why)
    return mm_error(MEGAMOE_CODE_UNIMPLEMENTED, "sm90 expert compute: WGMMA path: %s", why);
  if (path == MM_SM90_PATH_SIMT || why) return mm_sm90_run_simt(L, pool, clamp, &ws, st);
  return mm_sm90_run_wgmma(L, pool, clamp, &ws, st);
}

extern "C" mm_err *mm_sm90_expert_compute(const mm_sm90_layer *L, const mm_expert_pool *pool,
                                          float clamp, void *workspace, size_t workspace_bytes,
                                          void *stream) {
  return mm_sm90_expert_compute_path(L, pool, clamp, workspace, workspace_bytes, stream,
                                     MM_SM90_PATH_AUTO);
}

/* ------------------------------------------------------- CUDA-core path ---- */

__device__ __forceinline__ float e4m3_to_f32(uint8_t b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
  return __half2float(__half(h));
}
__device__ __forceinline__ uint8_t f32_to_e4m3(float x) {
  return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ float round_bf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

/* Expert of `row`, or -1 when the row is outside [offsets[0], offsets[E]). */
__device__ int expert_of_row(const int32_t *off, int E, int row) {
  if (row < off[0] || row >= off[E]) return -1;
  int lo = 0, hi = E; /* off[lo] <= row < off[hi] */
  while (hi - lo > 1) {
    int mid = (lo + hi) / 2;
    if (off[mid] <= row) lo = mid;
    else hi = mid;
  }
  return lo;
}

/* Folded weight of (layout row r, column k) of a matrix without the row's
 * reference factor; ref receives that factor (1 in mode 2). */
__device__ float simt_weight(const uint8_t *blob, mm_weight_mode mode, int KB, size_t rec,
                             const uint8_t *lut, int r, int k, float *ref) {
  const int lr = r & 63, kk = k & 127, G = mm_sm90_groups_per_row(mode);
  const uint8_t *R = blob + ((size_t)(r >> 6) * (size_t)KB + (size_t)(k >> 7)) * rec;
  int off, mb, sb;
  mm_sm90_code_slot(mode, lr, kk, &off, &mb, &sb);
  uint32_t word = *(const uint32_t *)(R + off);
  int mag = (word >> mb) & 7, neg = (word >> sb) & 1;
  uint8_t sbyte = R[MM_SM90_CODE_BYTES + lr * G + mm_sm90_group_of(mode, kk)];
  if (mode == MM_WMODE_G16_BF16_EXACT) {
    const float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    *ref = 1.0f;
    float v = kMag[mag] * e4m3_to_f32(sbyte);
    return neg ? -v : v;
  }
  *ref = mm_sm90_pow2(*(const int16_t *)(R + mm_sm90_ref_offset(mode) + 2 * lr));
  return e4m3_to_f32((uint8_t)(lut[sbyte * 8 + mag] | (neg << 7)));
}

/* Intermediate element (FP8 byte, or F16 holding the FP8 value) as float. */
__device__ __forceinline__ float act_value(const uint8_t *act, int m2, size_t i) {
  if (m2) return __half2float(((const __half *)act)[i]);
  return e4m3_to_f32(act[i]);
}

/* L1 + SwiGLU + requant: block (128 channels, one row), thread = channel. */
__global__ void __launch_bounds__(128) simt_l1(mm_sm90_layer L, mm_expert_pool P, float clamp,
                                               mm_sm90_ws W) {
  __shared__ float red[4];
  const int row = blockIdx.x, E = L.E;
  const int e = expert_of_row(P.expert_offsets, E, row);
  if (e < 0) return;
  const int H = L.H, I = L.I, KB = H / 128;
  const int ch = blockIdx.y * 128 + threadIdx.x;
  const uint8_t *w13 = L.d_w + (size_t)e * L.expert_bytes;
  const int rg = mm_sm90_gate_row(ch), ru = rg + 8;
  const uint8_t *x = P.x + (size_t)row * H;
  float fg = 0.0f, fu = 0.0f;
  for (int kb = 0; kb < KB; kb++) {
    float ag = 0.0f, au = 0.0f, refg = 1.0f, refu = 1.0f;
    for (int kk = 0; kk < 128; kk++) {
      const int k = kb * 128 + kk;
      const float xv = e4m3_to_f32(x[k]);
      ag = fmaf(xv, simt_weight(w13, L.mode, KB, L.rec, L.d_lut, rg, k, &refg), ag);
      au = fmaf(xv, simt_weight(w13, L.mode, KB, L.rec, L.d_lut, ru, k, &refu), au);
    }
    const float sx = P.x_scale[(size_t)row * KB + kb];
    fg = fmaf(ag, sx * refg, fg);
    fu = fmaf(au, sx * refu, fu);
  }
  const float *rs = L.d_rs13 + (size_t)e * (size_t)(2 * I);
  float g = round_bf16(fg * rs[rg]), u = round_bf16(fu * rs[ru]);
  if (clamp > 0.0f) {
    g = fminf(g, clamp);
    u = fminf(fmaxf(u, -clamp), clamp);
  }
  const float s = g / (1.0f + expf(-g));
  const float a = (s * u) * P.row_weight[row];
  /* amax over the 128 channels of this block */
  float m = fabsf(a);
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  float amax = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
  amax = fmaxf(amax, 1e-4f);
  const uint8_t q = f32_to_e4m3(a * (448.0f / amax));
  if (L.mode == MM_WMODE_G16_BF16_EXACT) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q, __NV_E4M3);
    ((uint16_t *)W.act)[(size_t)row * I + ch] = h.x;
  } else {
    W.act[(size_t)row * I + ch] = q;
  }
  if (threadIdx.x == 0) W.as_t[(size_t)blockIdx.y * W.Mp + row] = amax / 448.0f;
}

/* L2: block (128 output channels, one row), thread = channel. */
__global__ void __launch_bounds__(128) simt_l2(mm_sm90_layer L, mm_expert_pool P, mm_sm90_ws W) {
  const int row = blockIdx.x, E = L.E;
  const int e = expert_of_row(P.expert_offsets, E, row);
  if (e < 0) return;
  const int H = L.H, I = L.I, KB = I / 128;
  const int n = blockIdx.y * 128 + threadIdx.x;
  const uint8_t *w2 = L.d_w + (size_t)e * L.expert_bytes + L.w13_bytes;
  const int m2 = L.mode == MM_WMODE_G16_BF16_EXACT;
  float f = 0.0f;
  for (int kb = 0; kb < KB; kb++) {
    float acc = 0.0f, ref = 1.0f;
    for (int kk = 0; kk < 128; kk++) {
      const int k = kb * 128 + kk;
      acc = fmaf(act_value(W.act, m2, (size_t)row * I + k),
                 simt_weight(w2, L.mode, KB, L.rec, L.d_lut, n, k, &ref), acc);
    }
    f = fmaf(acc, W.as_t[(size_t)kb * W.Mp + row] * ref, f);
  }
  const float *rs = L.d_rs2 + (size_t)e * (size_t)H;
  P.out[(size_t)row * H + n] = __bfloat16_as_ushort(__float2bfloat16_rn(f * rs[n]));
}

mm_err *mm_sm90_run_simt(const mm_sm90_layer *L, const mm_expert_pool *pool, float clamp,
                         const mm_sm90_ws *ws, cudaStream_t stream) {
  const int M = pool->num_rows_max;
  simt_l1<<<dim3(M, L->I / 128), 128, 0, stream>>>(*L, *pool, clamp, *ws);
  MM_CUDA_TRY(cudaGetLastError());
  simt_l2<<<dim3(M, L->H / 128), 128, 0, stream>>>(*L, *pool, *ws);
  MM_CUDA_TRY(cudaGetLastError());
  return NULL;
}

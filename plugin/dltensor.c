/* dltensor.c -- validation of DLPack tensors crossing the ABI. */
#include "dltensor.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

const char *mm_dtype_name(mm_dtype dt) {
  switch (dt) {
    case MM_DT_U8: return "uint8";
    case MM_DT_I32: return "int32";
    case MM_DT_F32: return "float32";
    case MM_DT_BF16: return "bfloat16";
    case MM_DT_F8_E4M3: return "float8_e4m3fn";
    case MM_DT_F8_E8M0: return "float8_e8m0fnu";
    case MM_DT_F4_E2M1: return "float4_e2m1fn";
    default: return "invalid";
  }
}

static mm_dtype map_dtype(DLDataType d) {
  if (d.lanes != 1) return MM_DT_INVALID;
  switch (d.code) {
    case kDLUInt: return d.bits == 8 ? MM_DT_U8 : MM_DT_INVALID;
    case kDLInt: return d.bits == 32 ? MM_DT_I32 : MM_DT_INVALID;
    case kDLFloat: return d.bits == 32 ? MM_DT_F32 : MM_DT_INVALID;
    case kDLBfloat: return d.bits == 16 ? MM_DT_BF16 : MM_DT_INVALID;
    case MEGAMOE_DL_FLOAT8_E4M3FN: return d.bits == 8 ? MM_DT_F8_E4M3 : MM_DT_INVALID;
    case MEGAMOE_DL_FLOAT8_E8M0FNU: return d.bits == 8 ? MM_DT_F8_E8M0 : MM_DT_INVALID;
    case MEGAMOE_DL_FLOAT4_E2M1FN: return d.bits == 4 ? MM_DT_F4_E2M1 : MM_DT_INVALID;
    default: return MM_DT_INVALID;
  }
}

static size_t elem_bits(mm_dtype dt) {
  switch (dt) {
    case MM_DT_I32: case MM_DT_F32: return 32;
    case MM_DT_BF16: return 16;
    case MM_DT_F4_E2M1: return 4;
    default: return 8;
  }
}

int64_t mm_tensor_numel(const mm_tensor_view *v) {
  int64_t n = 1;
  for (int i = 0; i < v->ndim; i++) n *= v->shape[i];
  return n;
}

size_t mm_tensor_nbytes(const mm_tensor_view *v) {
  return ((size_t)mm_tensor_numel(v) * elem_bits(v->dtype) + 7) / 8;
}

static void shape_str(const mm_tensor_view *v, char *buf, size_t cap) {
  size_t n = (size_t)snprintf(buf, cap, "%s [", mm_dtype_name(v->dtype));
  for (int i = 0; i < v->ndim && n < cap; i++)
    n += (size_t)snprintf(buf + n, cap - n, i ? ", %lld" : "%lld", (long long)v->shape[i]);
  if (n < cap) snprintf(buf + n, cap - n, "]");
}

mm_err *mm_dltensor_view(const char *what, const DLTensor *t, mm_tensor_view *v, int *device_out) {
  memset(v, 0, sizeof *v);
  v->name = what;
  if (!t) return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: tensor is NULL", what);
  if (t->ndim < 0 || t->ndim > 4)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: ndim %d is not in [0, 4]", what, t->ndim);
  if (t->ndim > 0 && !t->shape)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: shape is NULL", what);
  v->dtype = map_dtype(t->dtype);
  if (v->dtype == MM_DT_INVALID)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s: unsupported dtype (code %u, bits %u, lanes %u)", what, t->dtype.code,
                    t->dtype.bits, t->dtype.lanes);
  v->ndim = t->ndim;
  int64_t numel = 1;
  for (int i = 0; i < t->ndim; i++) {
    if (t->shape[i] < 0 || t->shape[i] > ((int64_t)1 << 40))
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: shape[%d] = %lld is out of range", what,
                      i, (long long)t->shape[i]);
    v->shape[i] = t->shape[i];
    if (t->shape[i] && numel > ((int64_t)1 << 42) / t->shape[i])
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: too many elements", what);
    numel *= t->shape[i];
  }
  if (v->dtype == MM_DT_F4_E2M1 && t->ndim > 0 && t->shape[t->ndim - 1] % 2)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s: float4 tensors need an even innermost dimension", what);
  if (t->strides && numel > 0) { /* an empty tensor has no layout; and numel > 0
                                   * bounds the running product below */
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
      if (t->shape[i] != 1 && t->strides[i] != expect)
        return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                        "%s: strides are not compact row-major (dim %d has stride %lld, expected "
                        "%lld)",
                        what, i, (long long)t->strides[i], (long long)expect);
      expect *= t->shape[i];
    }
  }
  if (!t->data && numel > 0)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: data is NULL", what);
  /* Address arithmetic in integers: a wild byte_offset must not be UB here. */
  uintptr_t addr = (uintptr_t)t->data + (uintptr_t)t->byte_offset;
  if (t->data && addr < (uintptr_t)t->data)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: byte_offset %llu wraps the address space",
                    what, (unsigned long long)t->byte_offset);
  /* Typed loads (and GPU vector loads) need element-aligned data. */
  size_t align = elem_bits(v->dtype) >= 8 ? elem_bits(v->dtype) / 8 : 1;
  if (numel > 0 && addr % align)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s: data + byte_offset (%p + %llu) is not aligned to the %zu-byte %s element",
                    what, t->data, (unsigned long long)t->byte_offset, align,
                    mm_dtype_name(v->dtype));
  v->data = t->data ? (const void *)addr : NULL;
  switch (t->device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:
      *device_out = -1;
      break;
    case kDLCUDA:
      if (t->device.device_id < 0)
        return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: negative CUDA device id", what);
      *device_out = t->device.device_id;
      v->on_device = 1;
      break;
    default:
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                      "%s: device type %d is not supported (CPU, CUDAHost or CUDA)", what,
                      (int)t->device.device_type);
  }
  return NULL;
}

mm_err *mm_expect_tensor(const char *what, const mm_tensor_view *v, mm_dtype dtype, int ndim,
                         const int64_t *shape) {
  int ok = v->dtype == dtype && v->ndim == ndim;
  for (int i = 0; ok && i < ndim; i++) ok = shape[i] < 0 || shape[i] == v->shape[i];
  if (ok) return NULL;
  char got[128], want[128];
  mm_tensor_view w = {0};
  w.dtype = dtype;
  w.ndim = ndim;
  for (int i = 0; i < ndim; i++) w.shape[i] = shape[i];
  shape_str(v, got, sizeof got);
  shape_str(&w, want, sizeof want);
  return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: expected %s (-1 = any), got %s", what, want,
                  got);
}

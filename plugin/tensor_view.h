/* tensor_view.h -- a plain view of one named tensor, independent of DLPack:
 * what the op hands to the weight loader after checking the DLTensor. */
#ifndef MM_TENSOR_VIEW_H
#define MM_TENSOR_VIEW_H

#include <stdint.h>

typedef enum {
  MM_DT_INVALID = 0,
  MM_DT_U8,       /* packed E2M1 codes, UE8M0 scale bytes */
  MM_DT_I32,      /* UE8M0 packed 4 per int32 (byte j = group 4w+j) */
  MM_DT_F32,
  MM_DT_BF16,
  MM_DT_F8_E4M3,  /* NVFP4 group scales, FP8 activations */
  MM_DT_F8_E8M0,  /* UE8M0 scale bytes typed as such */
  MM_DT_F4_E2M1   /* packed 2 per byte, shape in elements (last dim even) */
} mm_dtype;

typedef struct mm_tensor_view {
  const char *name;   /* e.g. "experts.7.gate_proj.weight" */
  mm_dtype dtype;
  int ndim;           /* 0..4 */
  int64_t shape[4];   /* in elements; for MM_DT_F4_E2M1 the unpacked count */
  const void *data;   /* host memory, compact row-major, borrowed */
  int on_device;      /* 1: data is a CUDA device pointer of the op's device */
} mm_tensor_view;

const char *mm_dtype_name(mm_dtype dt);

#endif

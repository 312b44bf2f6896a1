/* dltensor.h -- checks a borrowed DLPack DLTensor and turns it into an
 * mm_tensor_view (dtype, shape, compact data pointer, placement). */
#ifndef MM_DLTENSOR_H
#define MM_DLTENSOR_H

#include "megamoe_plugin.h"
#include "status.h"
#include "tensor_view.h"

/* `what` names the tensor in messages. Accepts compact row-major tensors
 * (strides NULL or matching), lanes 1, on kDLCPU / kDLCUDAHost (host) or
 * kDLCUDA. *device_out: -1 for host memory, else the CUDA ordinal. */
mm_err *mm_dltensor_view(const char *what, const DLTensor *t, mm_tensor_view *v, int *device_out);

/* Expects dtype and shape; a negative entry in `shape` matches any size. */
mm_err *mm_expect_tensor(const char *what, const mm_tensor_view *v, mm_dtype dtype, int ndim,
                         const int64_t *shape);

int64_t mm_tensor_numel(const mm_tensor_view *v);
size_t mm_tensor_nbytes(const mm_tensor_view *v);

#endif

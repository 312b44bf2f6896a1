/* safetensors_internal.h -- helpers shared by the safetensors reader,
 * writer and checkpoint files; not part of the API. */
#ifndef MM_SAFETENSORS_INTERNAL_H
#define MM_SAFETENSORS_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

/* FNV-1a with a final mix, for the name indexes. */
uint64_t mm_st_hash(const char *s, size_t n);
/* "<path>: <what>: <strerror>" with a status code chosen from errno. */
mm_err *mm_st_errno_error(int err, const char *what, const char *path);

#endif

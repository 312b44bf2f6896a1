/* safetensors.h -- strict reader and streaming writer for the safetensors
 * format, plus a sharded-checkpoint view (model.safetensors.index.json).
 *
 * File layout: u64 little-endian N, then N bytes of JSON header (an object:
 * tensor name -> {"dtype", "shape", "data_offsets": [begin, end]}, optional
 * "__metadata__": string -> string), then the data section; offsets are
 * relative to the data section. Tensor data is not necessarily aligned, so
 * it is always copied out with pread (mm_st_read), never mapped and cast.
 *
 * Errors: a malformed header (JSON, schema, dtype, shape, size mismatch,
 * duplicate names, overlapping tensors) is INVALID_ARGUMENT; a file too
 * short for what its header promises (truncation, header length beyond the
 * file, offsets beyond the file end) or a failed read is DATA_LOSS; a missing
 * file or tensor is NOT_FOUND. Messages name the file and the tensor.
 *
 * Threads: an open file / checkpoint is read-only after open; mm_st_read
 * may be called from several threads at once. */
#ifndef MM_SAFETENSORS_H
#define MM_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"
#include "tensor_view.h"

/* ---- dtypes -------------------------------------------------------------- */

typedef enum {
  MM_ST_INVALID = 0,
  MM_ST_BOOL,
  MM_ST_U8,
  MM_ST_I8,
  MM_ST_U16,
  MM_ST_I16,
  MM_ST_U32,
  MM_ST_I32,
  MM_ST_U64,
  MM_ST_I64,
  MM_ST_F16,
  MM_ST_BF16,
  MM_ST_F32,
  MM_ST_F64,
  MM_ST_C64,
  MM_ST_F8_E4M3,
  MM_ST_F8_E5M2,
  MM_ST_F8_E8M0,
  MM_ST_F8_E4M3FNUZ,
  MM_ST_F8_E5M2FNUZ,
  MM_ST_F6_E2M3,
  MM_ST_F6_E3M2,
  MM_ST_F4,          /* E2M1, two per byte */
  MM_ST_DTYPE_COUNT_
} mm_st_dtype;

const char *mm_st_dtype_name(mm_st_dtype dt);                 /* "F8_E4M3"; "INVALID" */
mm_st_dtype mm_st_dtype_from_name(const char *name, size_t len); /* MM_ST_INVALID if unknown */
int mm_st_dtype_bits(mm_st_dtype dt);                         /* 4, 6, 8 .. 64; 0 if invalid */
/* The plugin's dtype for a safetensors one: U8, I32, F32, BF16, F8_E4M3,
 * F8_E8M0, F4 (-> MM_DT_F4_E2M1) map; everything else is MM_DT_INVALID. */
mm_dtype mm_st_to_mm_dtype(mm_st_dtype dt);
mm_st_dtype mm_st_from_mm_dtype(mm_dtype dt);                 /* inverse; MM_ST_INVALID */

/* Bytes of `nelems` elements of dt; 0 with *ok = 0 when not a whole number
 * of bytes (sub-byte dtypes) or on overflow. */
uint64_t mm_st_nbytes(mm_st_dtype dt, uint64_t nelems, int *ok);

/* ---- reading one file ---------------------------------------------------- */

#define MM_ST_MAX_DIMS 8
#define MM_ST_MAX_HEADER ((uint64_t)100 << 20) /* header length cap, bytes */

typedef struct {
  const char *name;            /* NUL-terminated, no embedded NUL */
  mm_st_dtype dtype;
  int ndim;                    /* 0 (scalar) .. MM_ST_MAX_DIMS */
  int64_t shape[MM_ST_MAX_DIMS];
  uint64_t nelems;             /* product of shape (1 for a scalar) */
  uint64_t nbytes;
  uint64_t offset;             /* absolute byte offset of the data in the file */
} mm_st_tensor;

typedef struct mm_st_file mm_st_file;

mm_err *mm_st_open(const char *path, mm_st_file **out);
void mm_st_close(mm_st_file *f); /* NULL is fine */

const char *mm_st_path(const mm_st_file *f);
uint64_t mm_st_file_size(const mm_st_file *f);
size_t mm_st_count(const mm_st_file *f);                  /* tensors, header order */
const mm_st_tensor *mm_st_tensor_at(const mm_st_file *f, size_t i); /* NULL if out of range */
const mm_st_tensor *mm_st_find(const mm_st_file *f, const char *name); /* NULL if absent */
/* Like mm_st_find, but a missing tensor is a NOT_FOUND error naming the file. */
mm_err *mm_st_get(const mm_st_file *f, const char *name, const mm_st_tensor **out);

/* __metadata__ (string -> string, header order). */
size_t mm_st_metadata_count(const mm_st_file *f);
const char *mm_st_metadata_key_at(const mm_st_file *f, size_t i);
const char *mm_st_metadata_value_at(const mm_st_file *f, size_t i);
const char *mm_st_metadata(const mm_st_file *f, const char *key); /* NULL if absent */

/* Copies the tensor's t->nbytes bytes into dst (dst_size >= t->nbytes). t
 * must come from f. */
mm_err *mm_st_read(const mm_st_file *f, const mm_st_tensor *t, void *dst, size_t dst_size);
/* Copies bytes [byte_begin, byte_begin + n) of the tensor's data. */
mm_err *mm_st_read_range(const mm_st_file *f, const mm_st_tensor *t, uint64_t byte_begin,
                         void *dst, size_t n);

/* ---- sharded checkpoints -------------------------------------------------- */

/* path is one of:
 *   - a .safetensors file (a single-file checkpoint);
 *   - an index file ("weight_map": tensor name -> shard file name, relative
 *     to the index's directory; shard names may not contain '/');
 *   - a directory: its model.safetensors.index.json if present, else its
 *     only *.safetensors.index.json, else all its *.safetensors files.
 * Every shard is opened and validated; a tensor present in two shards, or
 * named by the index but absent from its shard, is INVALID_ARGUMENT. */
typedef struct mm_st_ckpt mm_st_ckpt;

mm_err *mm_st_ckpt_open(const char *path, mm_st_ckpt **out);
void mm_st_ckpt_close(mm_st_ckpt *c); /* NULL is fine */

size_t mm_st_ckpt_shard_count(const mm_st_ckpt *c);
const mm_st_file *mm_st_ckpt_shard(const mm_st_ckpt *c, size_t i);
size_t mm_st_ckpt_count(const mm_st_ckpt *c); /* tensors over all shards */
/* The i-th tensor (shard order, then header order); *file (optional) gets its shard. */
const mm_st_tensor *mm_st_ckpt_tensor_at(const mm_st_ckpt *c, size_t i, const mm_st_file **file);
const mm_st_tensor *mm_st_ckpt_find(const mm_st_ckpt *c, const char *name, const mm_st_file **file);
mm_err *mm_st_ckpt_get(const mm_st_ckpt *c, const char *name, const mm_st_tensor **t,
                       const mm_st_file **file);
/* Finds `name` and reads it whole (dst_size >= its nbytes). */
mm_err *mm_st_ckpt_read(const mm_st_ckpt *c, const char *name, void *dst, size_t dst_size);

/* ---- writing ---------------------------------------------------------------- */

/* Declare tensors (in data order), then either mm_st_writer_write (all data
 * given at add time) or stream: mm_st_writer_begin, mm_st_writer_append the
 * data section bytes in declaration order (any chunking), mm_st_writer_finish.
 * The file is written to a temporary name beside `path` and renamed into
 * place by finish; on any error (or free before finish) the temporary is
 * removed. The header is padded with spaces to a multiple of 8 bytes. */
typedef struct mm_st_writer mm_st_writer;

mm_err *mm_st_writer_new(mm_st_writer **out);
void mm_st_writer_free(mm_st_writer *w); /* NULL is fine; removes an unfinished temporary */
/* data (borrowed until the write) may be NULL when streaming; nbytes must
 * equal the size the dtype and shape imply. Names must be valid UTF-8,
 * unique, not "__metadata__". */
mm_err *mm_st_writer_add(mm_st_writer *w, const char *name, mm_st_dtype dtype, int ndim,
                         const int64_t *shape, const void *data, uint64_t nbytes);
mm_err *mm_st_writer_set_metadata(mm_st_writer *w, const char *key, const char *value); /* copies */
size_t mm_st_writer_count(const mm_st_writer *w);
uint64_t mm_st_writer_data_size(const mm_st_writer *w); /* bytes of the data section so far */

mm_err *mm_st_writer_write(mm_st_writer *w, const char *path);
mm_err *mm_st_writer_begin(mm_st_writer *w, const char *path);
mm_err *mm_st_writer_append(mm_st_writer *w, const void *data, size_t n);
mm_err *mm_st_writer_finish(mm_st_writer *w);

#endif

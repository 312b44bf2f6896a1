/* safetensors.c -- dtype table and the strict single-file reader. */
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json.h"
#include "safetensors_internal.h"

/* ---- dtypes -------------------------------------------------------------- */

static const struct {
  const char *name;
  int bits;
  mm_dtype mm;
} dtype_table[MM_ST_DTYPE_COUNT_] = {
    [MM_ST_INVALID] = {"INVALID", 0, MM_DT_INVALID},
    [MM_ST_BOOL] = {"BOOL", 8, MM_DT_INVALID},
    [MM_ST_U8] = {"U8", 8, MM_DT_U8},
    [MM_ST_I8] = {"I8", 8, MM_DT_INVALID},
    [MM_ST_U16] = {"U16", 16, MM_DT_INVALID},
    [MM_ST_I16] = {"I16", 16, MM_DT_INVALID},
    [MM_ST_U32] = {"U32", 32, MM_DT_INVALID},
    [MM_ST_I32] = {"I32", 32, MM_DT_I32},
    [MM_ST_U64] = {"U64", 64, MM_DT_INVALID},
    [MM_ST_I64] = {"I64", 64, MM_DT_INVALID},
    [MM_ST_F16] = {"F16", 16, MM_DT_INVALID},
    [MM_ST_BF16] = {"BF16", 16, MM_DT_BF16},
    [MM_ST_F32] = {"F32", 32, MM_DT_F32},
    [MM_ST_F64] = {"F64", 64, MM_DT_INVALID},
    [MM_ST_C64] = {"C64", 64, MM_DT_INVALID},
    [MM_ST_F8_E4M3] = {"F8_E4M3", 8, MM_DT_F8_E4M3},
    [MM_ST_F8_E5M2] = {"F8_E5M2", 8, MM_DT_INVALID},
    [MM_ST_F8_E8M0] = {"F8_E8M0", 8, MM_DT_F8_E8M0},
    [MM_ST_F8_E4M3FNUZ] = {"F8_E4M3FNUZ", 8, MM_DT_INVALID},
    [MM_ST_F8_E5M2FNUZ] = {"F8_E5M2FNUZ", 8, MM_DT_INVALID},
    [MM_ST_F6_E2M3] = {"F6_E2M3", 6, MM_DT_INVALID},
    [MM_ST_F6_E3M2] = {"F6_E3M2", 6, MM_DT_INVALID},
    [MM_ST_F4] = {"F4", 4, MM_DT_F4_E2M1},
};

const char *mm_st_dtype_name(mm_st_dtype dt) {
  if ((int)dt <= 0 || dt >= MM_ST_DTYPE_COUNT_) return "INVALID";
  return dtype_table[dt].name;
}

mm_st_dtype mm_st_dtype_from_name(const char *name, size_t len) {
  if (!name) return MM_ST_INVALID;
  for (int i = 1; i < MM_ST_DTYPE_COUNT_; i++)
    if (strlen(dtype_table[i].name) == len && memcmp(dtype_table[i].name, name, len) == 0)
      return (mm_st_dtype)i;
  return MM_ST_INVALID;
}

int mm_st_dtype_bits(mm_st_dtype dt) {
  if ((int)dt <= 0 || dt >= MM_ST_DTYPE_COUNT_) return 0;
  return dtype_table[dt].bits;
}

mm_dtype mm_st_to_mm_dtype(mm_st_dtype dt) {
  if ((int)dt <= 0 || dt >= MM_ST_DTYPE_COUNT_) return MM_DT_INVALID;
  return dtype_table[dt].mm;
}

mm_st_dtype mm_st_from_mm_dtype(mm_dtype dt) {
  if (dt == MM_DT_INVALID) return MM_ST_INVALID;
  for (int i = 1; i < MM_ST_DTYPE_COUNT_; i++)
    if (dtype_table[i].mm == dt) return (mm_st_dtype)i;
  return MM_ST_INVALID;
}

uint64_t mm_st_nbytes(mm_st_dtype dt, uint64_t nelems, int *ok) {
  int bits = mm_st_dtype_bits(dt);
  uint64_t total;
  if (!bits || __builtin_mul_overflow(nelems, (uint64_t)bits, &total) || total % 8) {
    if (ok) *ok = 0;
    return 0;
  }
  if (ok) *ok = 1;
  return total / 8;
}

/* ---- shared helpers --------------------------------------------------------- */

uint64_t mm_st_hash(const char *s, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
  return h ^ (h >> 31);
}

mm_err *mm_st_errno_error(int err, const char *what, const char *path) {
  megamoe_code code = MEGAMOE_CODE_UNKNOWN;
  if (err == ENOENT || err == ENOTDIR) code = MEGAMOE_CODE_NOT_FOUND;
  else if (err == EACCES || err == EPERM || err == EROFS) code = MEGAMOE_CODE_PERMISSION_DENIED;
  else if (err == ENOMEM) code = MEGAMOE_CODE_RESOURCE_EXHAUSTED;
  else if (err == ENOSPC || err == EDQUOT) code = MEGAMOE_CODE_RESOURCE_EXHAUSTED;
  else if (err == EIO) code = MEGAMOE_CODE_DATA_LOSS;
  return mm_error(code, "%s: %s: %s", path, what, strerror(err));
}

/* ---- reader ----------------------------------------------------------------- */

struct mm_st_file {
  char *path;
  int fd;
  uint64_t size, data_start, data_size;
  mm_st_tensor *tensors;
  size_t n;
  char *names;        /* pool of tensor names */
  uint32_t *index;    /* open addressing: tensor index + 1 */
  size_t mask;
  char **meta;        /* key0, value0, key1, value1, ... */
  size_t nmeta;
  char *meta_pool;
};

void mm_st_close(mm_st_file *f) {
  if (!f) return;
  if (f->fd >= 0) close(f->fd);
  free(f->path);
  free(f->tensors);
  free(f->names);
  free(f->index);
  free(f->meta);
  free(f->meta_pool);
  free(f);
}

/* pread all n bytes or fail: a short read means the file shrank. */
static mm_err *pread_all(int fd, const char *path, void *dst, size_t n, uint64_t off) {
  unsigned char *d = dst;
  while (n > 0) {
    size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
    ssize_t r = pread(fd, d, chunk, (off_t)off);
    if (r < 0) {
      if (errno == EINTR) continue;
      return mm_st_errno_error(errno, "read", path);
    }
    if (r == 0)
      return mm_error(MEGAMOE_CODE_DATA_LOSS, "%s: unexpected end of file at byte %llu", path,
                      (unsigned long long)off);
    d += r;
    n -= (size_t)r;
    off += (uint64_t)r;
  }
  return NULL;
}

#define NAME_FMT "%.200s"

static mm_err *bad(const mm_st_file *f, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static mm_err *bad(const mm_st_file *f, const char *name, const char *fmt, ...) {
  char what[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  if (name) return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: tensor \"" NAME_FMT "\": %s", f->path, name, what);
  return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: %s", f->path, what);
}

/* An exact non-negative integer from a JSON number. */
static int json_u64(const mm_json *v, uint64_t *out) {
  int64_t i;
  if (!mm_json_int64(v, &i) || i < 0) return 0;
  *out = (uint64_t)i;
  return 1;
}

static mm_err *parse_metadata(mm_st_file *f, const mm_json *m) {
  if (!mm_json_is(m, MM_JSON_OBJECT))
    return bad(f, NULL, "__metadata__ is a %s, expected an object of strings",
               mm_json_type_name(mm_json_type_of(m)));
  size_t n = mm_json_size(m), pool = 0;
  for (size_t i = 0; i < n; i++) {
    size_t kl, vl;
    const char *k = mm_json_key_at(m, i, &kl);
    const char *v = mm_json_string(mm_json_value_at(m, i), &vl);
    if (!v)
      return bad(f, NULL, "__metadata__ \"" NAME_FMT "\" is a %s, expected a string", k,
                 mm_json_type_name(mm_json_type_of(mm_json_value_at(m, i))));
    if (strlen(k) != kl || strlen(v) != vl)
      return bad(f, NULL, "__metadata__ \"" NAME_FMT "\" contains a NUL character", k);
    pool += kl + vl + 2;
  }
  f->meta = calloc(2 * n + 1, sizeof(char *));
  f->meta_pool = malloc(pool + 1);
  if (!f->meta || !f->meta_pool)
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory", f->path);
  char *p = f->meta_pool;
  for (size_t i = 0; i < n; i++) {
    size_t kl, vl;
    const char *k = mm_json_key_at(m, i, &kl);
    const char *v = mm_json_string(mm_json_value_at(m, i), &vl);
    memcpy(p, k, kl + 1);
    f->meta[2 * i] = p;
    p += kl + 1;
    memcpy(p, v, vl + 1);
    f->meta[2 * i + 1] = p;
    p += vl + 1;
  }
  f->nmeta = n;
  return NULL;
}

static mm_err *parse_tensor(mm_st_file *f, const char *name, const mm_json *v, mm_st_tensor *t) {
  if (!mm_json_is(v, MM_JSON_OBJECT))
    return bad(f, name, "entry is a %s, expected an object", mm_json_type_name(mm_json_type_of(v)));
  const mm_json *dt = NULL, *shape = NULL, *offs = NULL;
  for (size_t i = 0; i < mm_json_size(v); i++) {
    const char *k = mm_json_key_at(v, i, NULL);
    const mm_json *x = mm_json_value_at(v, i);
    if (strcmp(k, "dtype") == 0) dt = x;
    else if (strcmp(k, "shape") == 0) shape = x;
    else if (strcmp(k, "data_offsets") == 0) offs = x;
    else return bad(f, name, "unknown field \"" NAME_FMT "\"", k);
  }
  if (!dt) return bad(f, name, "missing \"dtype\"");
  if (!shape) return bad(f, name, "missing \"shape\"");
  if (!offs) return bad(f, name, "missing \"data_offsets\"");
  size_t dl;
  const char *ds = mm_json_string(dt, &dl);
  if (!ds) return bad(f, name, "\"dtype\" is a %s, expected a string", mm_json_type_name(mm_json_type_of(dt)));
  t->dtype = mm_st_dtype_from_name(ds, dl);
  if (t->dtype == MM_ST_INVALID) return bad(f, name, "unknown dtype \"%.40s\"", ds);
  if (!mm_json_is(shape, MM_JSON_ARRAY)) return bad(f, name, "\"shape\" is not an array");
  size_t nd = mm_json_size(shape);
  if (nd > MM_ST_MAX_DIMS) return bad(f, name, "shape has %zu dimensions (at most %d supported)", nd, MM_ST_MAX_DIMS);
  t->ndim = (int)nd;
  uint64_t nel = 1;
  for (size_t i = 0; i < nd; i++) {
    uint64_t d;
    if (!json_u64(mm_json_at(shape, i), &d))
      return bad(f, name, "shape[%zu] is not a non-negative integer", i);
    t->shape[i] = (int64_t)d;
    if (__builtin_mul_overflow(nel, d, &nel)) return bad(f, name, "element count overflows (shape[%zu] = %llu)", i, (unsigned long long)d);
  }
  t->nelems = nel;
  int ok;
  t->nbytes = mm_st_nbytes(t->dtype, nel, &ok);
  if (!ok)
    return bad(f, name, "%llu elements of %s are not a whole number of bytes (or overflow)",
               (unsigned long long)nel, mm_st_dtype_name(t->dtype));
  uint64_t b, e;
  if (!mm_json_is(offs, MM_JSON_ARRAY) || mm_json_size(offs) != 2 ||
      !json_u64(mm_json_at(offs, 0), &b) || !json_u64(mm_json_at(offs, 1), &e))
    return bad(f, name, "\"data_offsets\" must be [begin, end] of non-negative integers");
  if (e < b) return bad(f, name, "data_offsets [%llu, %llu] end before begin", (unsigned long long)b, (unsigned long long)e);
  if (e - b != t->nbytes)
    return bad(f, name, "data_offsets [%llu, %llu] hold %llu bytes but %s shape needs %llu",
               (unsigned long long)b, (unsigned long long)e, (unsigned long long)(e - b),
               mm_st_dtype_name(t->dtype), (unsigned long long)t->nbytes);
  if (e > f->data_size)
    return mm_error(MEGAMOE_CODE_DATA_LOSS,
                    "%s: tensor \"" NAME_FMT "\": data_offsets [%llu, %llu] beyond the data section (%llu bytes; file truncated?)",
                    f->path, name, (unsigned long long)b, (unsigned long long)e,
                    (unsigned long long)f->data_size);
  t->offset = f->data_start + b;
  return NULL;
}

static int cmp_by_offset(const void *a, const void *b) {
  const mm_st_tensor *x = *(const mm_st_tensor *const *)a, *y = *(const mm_st_tensor *const *)b;
  if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
  return x->nbytes < y->nbytes ? -1 : x->nbytes > y->nbytes;
}

static mm_err *check_overlaps(mm_st_file *f) {
  if (f->n < 2) return NULL;
  mm_st_tensor **s = malloc(f->n * sizeof(*s));
  if (!s) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory", f->path);
  for (size_t i = 0; i < f->n; i++) s[i] = &f->tensors[i];
  qsort(s, f->n, sizeof(*s), cmp_by_offset);
  const mm_st_tensor *prev = NULL;
  mm_err *err = NULL;
  for (size_t i = 0; i < f->n && !err; i++) {
    if (s[i]->nbytes == 0) continue;
    if (prev && s[i]->offset < prev->offset + prev->nbytes)
      err = bad(f, s[i]->name, "data overlaps tensor \"" NAME_FMT "\"", prev->name);
    if (!prev || s[i]->offset + s[i]->nbytes > prev->offset + prev->nbytes) prev = s[i];
  }
  free(s);
  return err;
}

static mm_err *build_index(mm_st_file *f) {
  size_t cap = 16;
  while (cap < f->n * 2) cap *= 2;
  f->index = calloc(cap, sizeof(uint32_t));
  if (!f->index) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory", f->path);
  f->mask = cap - 1;
  for (size_t i = 0; i < f->n; i++) {
    size_t h = (size_t)mm_st_hash(f->tensors[i].name, strlen(f->tensors[i].name)) & f->mask;
    while (f->index[h]) h = (h + 1) & f->mask;
    f->index[h] = (uint32_t)(i + 1);
  }
  return NULL;
}

static mm_err *parse_header(mm_st_file *f, const char *hdr, size_t len) {
  if (len == 0 || hdr[0] != '{') return bad(f, NULL, "header does not start with '{'");
  mm_json_doc *doc = NULL;
  mm_json_limits lim = {len, 16};
  mm_err *err = mm_json_parse(hdr, len, &lim, &doc);
  if (err) return mm_error_wrap(err, "%s: header", f->path);
  const mm_json *root = mm_json_root(doc);
  size_t nm = mm_json_size(root), pool = 0;
  if (nm >= UINT32_MAX / 4) {
    mm_json_free(doc);
    return bad(f, NULL, "too many tensors (%zu)", nm);
  }
  for (size_t i = 0; i < nm; i++) pool += strlen(mm_json_key_at(root, i, NULL)) + 1;
  f->tensors = calloc(nm ? nm : 1, sizeof(mm_st_tensor));
  f->names = malloc(pool + 1);
  if (!f->tensors || !f->names) {
    mm_json_free(doc);
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory for %zu tensors", f->path, nm);
  }
  char *p = f->names;
  for (size_t i = 0; i < nm && !err; i++) {
    size_t kl;
    const char *k = mm_json_key_at(root, i, &kl);
    const mm_json *v = mm_json_value_at(root, i);
    if (strlen(k) != kl) {
      err = bad(f, k, "name contains a NUL character");
    } else if (strcmp(k, "__metadata__") == 0) {
      err = parse_metadata(f, v);
    } else {
      mm_st_tensor *t = &f->tensors[f->n];
      memcpy(p, k, kl + 1);
      t->name = p;
      p += kl + 1;
      err = parse_tensor(f, t->name, v, t);
      if (!err) f->n++;
    }
  }
  mm_json_free(doc);
  if (!err) err = check_overlaps(f);
  if (!err) err = build_index(f);
  return err;
}

mm_err *mm_st_open(const char *path, mm_st_file **out) {
  MM_ARG_CHECK(out, "mm_st_open: out is NULL");
  *out = NULL;
  MM_ARG_CHECK(path && *path, "mm_st_open: empty path");
  mm_st_file *f = calloc(1, sizeof(*f));
  if (!f) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory", path);
  f->fd = -1;
  f->path = strdup(path);
  if (!f->path) {
    free(f);
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory", path);
  }
  mm_err *err = NULL;
  char *hdr = NULL;
  /* O_NONBLOCK: a FIFO must not block the open (it is refused below as not
   * a regular file); reads of regular files ignore the flag. */
  f->fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (f->fd < 0) {
    err = mm_st_errno_error(errno, "open", path);
    goto fail;
  }
  struct stat st;
  if (fstat(f->fd, &st) != 0) {
    err = mm_st_errno_error(errno, "stat", path);
    goto fail;
  }
  if (!S_ISREG(st.st_mode)) {
    err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: not a regular file", path);
    goto fail;
  }
  f->size = (uint64_t)st.st_size;
  if (f->size < 8) {
    err = mm_error(MEGAMOE_CODE_DATA_LOSS, "%s: file is %llu bytes, too short for the 8-byte header length",
                   path, (unsigned long long)f->size);
    goto fail;
  }
  unsigned char lenb[8];
  MM_TRY_GOTO(pread_all(f->fd, path, lenb, 8, 0), err, fail);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | lenb[i];
  if (hlen > MM_ST_MAX_HEADER) {
    err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: header length %llu exceeds the %llu-byte limit",
                   path, (unsigned long long)hlen, (unsigned long long)MM_ST_MAX_HEADER);
    goto fail;
  }
  if (hlen > f->size - 8) {
    err = mm_error(MEGAMOE_CODE_DATA_LOSS, "%s: header length %llu runs past the end of the %llu-byte file",
                   path, (unsigned long long)hlen, (unsigned long long)f->size);
    goto fail;
  }
  f->data_start = 8 + hlen;
  f->data_size = f->size - f->data_start;
  hdr = malloc(hlen ? hlen : 1);
  if (!hdr) {
    err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory for a %llu-byte header", path,
                   (unsigned long long)hlen);
    goto fail;
  }
  MM_TRY_GOTO(pread_all(f->fd, path, hdr, (size_t)hlen, 8), err, fail);
  MM_TRY_GOTO(parse_header(f, hdr, (size_t)hlen), err, fail);
  free(hdr);
  *out = f;
  return NULL;
fail:
  free(hdr);
  mm_st_close(f);
  return err;
}

const char *mm_st_path(const mm_st_file *f) { return f ? f->path : NULL; }
uint64_t mm_st_file_size(const mm_st_file *f) { return f ? f->size : 0; }
size_t mm_st_count(const mm_st_file *f) { return f ? f->n : 0; }

const mm_st_tensor *mm_st_tensor_at(const mm_st_file *f, size_t i) {
  return f && i < f->n ? &f->tensors[i] : NULL;
}

const mm_st_tensor *mm_st_find(const mm_st_file *f, const char *name) {
  if (!f || !name || !f->index) return NULL;
  size_t n = strlen(name);
  for (size_t h = (size_t)mm_st_hash(name, n) & f->mask; f->index[h]; h = (h + 1) & f->mask) {
    const mm_st_tensor *t = &f->tensors[f->index[h] - 1];
    if (strcmp(t->name, name) == 0) return t;
  }
  return NULL;
}

mm_err *mm_st_get(const mm_st_file *f, const char *name, const mm_st_tensor **out) {
  MM_ARG_CHECK(f && name && out, "mm_st_get: NULL argument");
  *out = mm_st_find(f, name);
  if (!*out) return mm_error(MEGAMOE_CODE_NOT_FOUND, "%s: no tensor \"" NAME_FMT "\"", f->path, name);
  return NULL;
}

size_t mm_st_metadata_count(const mm_st_file *f) { return f ? f->nmeta : 0; }
const char *mm_st_metadata_key_at(const mm_st_file *f, size_t i) {
  return f && i < f->nmeta ? f->meta[2 * i] : NULL;
}
const char *mm_st_metadata_value_at(const mm_st_file *f, size_t i) {
  return f && i < f->nmeta ? f->meta[2 * i + 1] : NULL;
}
const char *mm_st_metadata(const mm_st_file *f, const char *key) {
  if (!f || !key) return NULL;
  for (size_t i = 0; i < f->nmeta; i++)
    if (strcmp(f->meta[2 * i], key) == 0) return f->meta[2 * i + 1];
  return NULL;
}

static int owns(const mm_st_file *f, const mm_st_tensor *t) {
  return f && t && f->n && t >= f->tensors && t < f->tensors + f->n;
}

mm_err *mm_st_read_range(const mm_st_file *f, const mm_st_tensor *t, uint64_t byte_begin, void *dst,
                         size_t n) {
  MM_ARG_CHECK(owns(f, t), "mm_st_read: tensor does not belong to %s", f ? f->path : "(null file)");
  MM_ARG_CHECK(byte_begin <= t->nbytes && n <= t->nbytes - byte_begin,
               "%s: tensor \"" NAME_FMT "\": read of bytes [%llu, +%zu) outside its %llu bytes",
               f->path, t->name, (unsigned long long)byte_begin, n, (unsigned long long)t->nbytes);
  MM_ARG_CHECK(dst || n == 0, "mm_st_read: dst is NULL");
  mm_err *err = pread_all(f->fd, f->path, dst, n, t->offset + byte_begin);
  return err ? mm_error_wrap(err, "tensor \"" NAME_FMT "\"", t->name) : NULL;
}

mm_err *mm_st_read(const mm_st_file *f, const mm_st_tensor *t, void *dst, size_t dst_size) {
  MM_ARG_CHECK(owns(f, t), "mm_st_read: tensor does not belong to %s", f ? f->path : "(null file)");
  MM_ARG_CHECK(dst_size >= t->nbytes, "%s: tensor \"" NAME_FMT "\" has %llu bytes, buffer only %zu",
               f->path, t->name, (unsigned long long)t->nbytes, dst_size);
  return mm_st_read_range(f, t, 0, dst, (size_t)t->nbytes);
}

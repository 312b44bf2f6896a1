/* safetensors_writer.c -- declare tensors, then write the file through a
 * temporary and a rename so a reader never sees a half-written file. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json.h"
#include "safetensors.h"
#include "safetensors_internal.h"

#define NAME_FMT "%.200s"
#define WBUF_SIZE ((size_t)1 << 20)

typedef struct {
  char *name;
  mm_st_dtype dtype;
  int ndim;
  int64_t shape[MM_ST_MAX_DIMS];
  const void *data;
  uint64_t begin, nbytes;
} mm_st_wtensor;

enum { W_DECLARING, W_STREAMING, W_DONE, W_FAILED };

struct mm_st_writer {
  mm_st_wtensor *t;
  size_t n, cap;
  uint32_t *index; /* tensor index + 1, for duplicate names */
  size_t mask;
  char **meta;     /* key, value pairs */
  size_t nmeta;
  uint64_t data_size;
  int state;
  int fd;
  char *tmp_path, *path;
  uint64_t written;
  unsigned char *buf;
  size_t buf_used;
};

mm_err *mm_st_writer_new(mm_st_writer **out) {
  MM_ARG_CHECK(out, "mm_st_writer_new: out is NULL");
  *out = calloc(1, sizeof(**out));
  if (!*out) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "safetensors writer: out of memory");
  (*out)->fd = -1;
  return NULL;
}

static void discard_tmp(mm_st_writer *w) {
  if (w->fd >= 0) close(w->fd);
  w->fd = -1;
  if (w->tmp_path) unlink(w->tmp_path);
  free(w->tmp_path);
  w->tmp_path = NULL;
}

void mm_st_writer_free(mm_st_writer *w) {
  if (!w) return;
  discard_tmp(w);
  for (size_t i = 0; i < w->n; i++) free(w->t[i].name);
  free(w->t);
  free(w->index);
  for (size_t i = 0; i < 2 * w->nmeta; i++) free(w->meta[i]);
  free(w->meta);
  free(w->path);
  free(w->buf);
  free(w);
}

size_t mm_st_writer_count(const mm_st_writer *w) { return w ? w->n : 0; }
uint64_t mm_st_writer_data_size(const mm_st_writer *w) { return w ? w->data_size : 0; }

static mm_err *oom(void) {
  return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "safetensors writer: out of memory");
}

static int find_name(const mm_st_writer *w, const char *name, size_t *slot) {
  size_t h = (size_t)mm_st_hash(name, strlen(name)) & w->mask;
  for (; w->index[h]; h = (h + 1) & w->mask)
    if (strcmp(w->t[w->index[h] - 1].name, name) == 0) return 1;
  *slot = h;
  return 0;
}

static mm_err *grow(mm_st_writer *w) {
  if (w->n + 1 <= w->cap && (w->n + 1) * 2 <= w->mask + 1) return NULL;
  size_t cap = w->cap ? w->cap * 2 : 64;
  mm_st_wtensor *t = realloc(w->t, cap * sizeof(*t));
  if (!t) return oom();
  w->t = t;
  w->cap = cap;
  size_t icap = 16;
  while (icap < cap * 2) icap *= 2;
  uint32_t *idx = calloc(icap, sizeof(uint32_t));
  if (!idx) return oom();
  free(w->index);
  w->index = idx;
  w->mask = icap - 1;
  for (size_t i = 0; i < w->n; i++) {
    size_t h = (size_t)mm_st_hash(w->t[i].name, strlen(w->t[i].name)) & w->mask;
    while (w->index[h]) h = (h + 1) & w->mask;
    w->index[h] = (uint32_t)(i + 1);
  }
  return NULL;
}

mm_err *mm_st_writer_add(mm_st_writer *w, const char *name, mm_st_dtype dtype, int ndim,
                         const int64_t *shape, const void *data, uint64_t nbytes) {
  MM_ARG_CHECK(w && name, "mm_st_writer_add: NULL argument");
  MM_ARG_CHECK(w->state == W_DECLARING, "safetensors writer: tensor \"" NAME_FMT "\" added after writing began", name);
  MM_ARG_CHECK(mm_json_utf8_valid(name, strlen(name)), "safetensors writer: tensor name is not valid UTF-8");
  MM_ARG_CHECK(strcmp(name, "__metadata__") != 0, "safetensors writer: \"__metadata__\" is reserved");
  MM_ARG_CHECK(mm_st_dtype_bits(dtype) > 0, "safetensors writer: tensor \"" NAME_FMT "\": invalid dtype %d", name, (int)dtype);
  MM_ARG_CHECK(ndim >= 0 && ndim <= MM_ST_MAX_DIMS && (shape || ndim == 0),
               "safetensors writer: tensor \"" NAME_FMT "\": ndim %d outside [0, %d]", name, ndim, MM_ST_MAX_DIMS);
  uint64_t nel = 1;
  for (int i = 0; i < ndim; i++) {
    MM_ARG_CHECK(shape[i] >= 0, "safetensors writer: tensor \"" NAME_FMT "\": shape[%d] = %lld is negative", name, i,
                 (long long)shape[i]);
    MM_ARG_CHECK(!__builtin_mul_overflow(nel, (uint64_t)shape[i], &nel),
                 "safetensors writer: tensor \"" NAME_FMT "\": element count overflows", name);
  }
  int ok;
  uint64_t want = mm_st_nbytes(dtype, nel, &ok);
  MM_ARG_CHECK(ok, "safetensors writer: tensor \"" NAME_FMT "\": %llu elements of %s are not a whole number of bytes",
               name, (unsigned long long)nel, mm_st_dtype_name(dtype));
  MM_ARG_CHECK(nbytes == want, "safetensors writer: tensor \"" NAME_FMT "\": %llu bytes given, %s shape needs %llu",
               name, (unsigned long long)nbytes, mm_st_dtype_name(dtype), (unsigned long long)want);
  MM_ARG_CHECK(w->data_size + nbytes >= w->data_size, "safetensors writer: data section overflows");
  MM_TRY(grow(w));
  size_t slot;
  MM_ARG_CHECK(!find_name(w, name, &slot), "safetensors writer: duplicate tensor \"" NAME_FMT "\"", name);
  mm_st_wtensor *t = &w->t[w->n];
  memset(t, 0, sizeof(*t));
  t->name = strdup(name);
  if (!t->name) return oom();
  t->dtype = dtype;
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
  t->data = data;
  t->begin = w->data_size;
  t->nbytes = nbytes;
  w->index[slot] = (uint32_t)(++w->n);
  w->data_size += nbytes;
  return NULL;
}

mm_err *mm_st_writer_set_metadata(mm_st_writer *w, const char *key, const char *value) {
  MM_ARG_CHECK(w && key && value, "mm_st_writer_set_metadata: NULL argument");
  MM_ARG_CHECK(w->state == W_DECLARING, "safetensors writer: metadata set after writing began");
  MM_ARG_CHECK(mm_json_utf8_valid(key, strlen(key)) && mm_json_utf8_valid(value, strlen(value)),
               "safetensors writer: metadata \"" NAME_FMT "\" is not valid UTF-8", key);
  char *v = strdup(value);
  if (!v) return oom();
  for (size_t i = 0; i < w->nmeta; i++)
    if (strcmp(w->meta[2 * i], key) == 0) {
      free(w->meta[2 * i + 1]);
      w->meta[2 * i + 1] = v;
      return NULL;
    }
  char **m = realloc(w->meta, (2 * w->nmeta + 2) * sizeof(*m));
  char *k = strdup(key);
  if (!m || !k) {
    free(v);
    free(k);
    if (m) w->meta = m;
    return oom();
  }
  w->meta = m;
  m[2 * w->nmeta] = k;
  m[2 * w->nmeta + 1] = v;
  w->nmeta++;
  return NULL;
}

/* ---- header text ------------------------------------------------------------ */

typedef struct {
  char *s;
  size_t len, cap;
  int failed;
} mm_sbuf;

static void sb_put(mm_sbuf *b, const char *s, size_t n) {
  if (b->failed) return;
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + n + 1) cap *= 2;
    char *p = realloc(b->s, cap);
    if (!p) {
      b->failed = 1;
      return;
    }
    b->s = p;
    b->cap = cap;
  }
  memcpy(b->s + b->len, s, n);
  b->len += n;
  b->s[b->len] = '\0';
}

static void sb_str(mm_sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_json_string(mm_sbuf *b, const char *s) {
  sb_put(b, "\"", 1);
  const char *run = s;
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c != '"' && c != '\\' && c >= 0x20) continue;
    sb_put(b, run, (size_t)(s - run));
    char esc[8];
    if (c == '"' || c == '\\') snprintf(esc, sizeof esc, "\\%c", c);
    else snprintf(esc, sizeof esc, "\\u%04x", c);
    sb_str(b, esc);
    run = s + 1;
  }
  sb_put(b, run, (size_t)(s - run));
  sb_put(b, "\"", 1);
}

static void sb_u64(mm_sbuf *b, uint64_t v) {
  char tmp[24];
  snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v);
  sb_str(b, tmp);
}

static mm_err *build_header(const mm_st_writer *w, mm_sbuf *b) {
  sb_str(b, "{");
  int first = 1;
  if (w->nmeta) {
    sb_str(b, "\"__metadata__\":{");
    for (size_t i = 0; i < w->nmeta; i++) {
      if (i) sb_str(b, ",");
      sb_json_string(b, w->meta[2 * i]);
      sb_str(b, ":");
      sb_json_string(b, w->meta[2 * i + 1]);
    }
    sb_str(b, "}");
    first = 0;
  }
  for (size_t i = 0; i < w->n; i++) {
    const mm_st_wtensor *t = &w->t[i];
    if (!first) sb_str(b, ",");
    first = 0;
    sb_json_string(b, t->name);
    sb_str(b, ":{\"dtype\":\"");
    sb_str(b, mm_st_dtype_name(t->dtype));
    sb_str(b, "\",\"shape\":[");
    for (int d = 0; d < t->ndim; d++) {
      if (d) sb_str(b, ",");
      sb_u64(b, (uint64_t)t->shape[d]);
    }
    sb_str(b, "],\"data_offsets\":[");
    sb_u64(b, t->begin);
    sb_str(b, ",");
    sb_u64(b, t->begin + t->nbytes);
    sb_str(b, "]}");
  }
  sb_str(b, "}");
  /* Pad so the data section starts 8-byte aligned (8 + len). */
  while (!b->failed && b->len % 8) sb_str(b, " ");
  if (b->failed) return oom();
  if ((uint64_t)b->len > MM_ST_MAX_HEADER)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "safetensors writer: header of %zu bytes exceeds the %llu-byte limit",
                    b->len, (unsigned long long)MM_ST_MAX_HEADER);
  return NULL;
}

/* ---- output ------------------------------------------------------------------- */

static mm_err *fail(mm_st_writer *w, mm_err *err) {
  if (err) {
    w->state = W_FAILED;
    discard_tmp(w);
  }
  return err;
}

static mm_err *write_all(mm_st_writer *w, const void *data, size_t n) {
  const unsigned char *p = data;
  while (n > 0) {
    size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
    ssize_t r = write(w->fd, p, chunk);
    if (r < 0) {
      if (errno == EINTR) continue;
      return mm_st_errno_error(errno, "write", w->tmp_path);
    }
    p += r;
    n -= (size_t)r;
  }
  return NULL;
}

static mm_err *flush_buf(mm_st_writer *w) {
  mm_err *err = w->buf_used ? write_all(w, w->buf, w->buf_used) : NULL;
  w->buf_used = 0;
  return err;
}

mm_err *mm_st_writer_begin(mm_st_writer *w, const char *path) {
  MM_ARG_CHECK(w && path && *path, "mm_st_writer_begin: NULL argument");
  MM_ARG_CHECK(w->state == W_DECLARING, "safetensors writer: begin called twice");
  mm_sbuf hb = {0};
  mm_err *err = build_header(w, &hb);
  if (err) {
    free(hb.s);
    return fail(w, err);
  }
  w->path = strdup(path);
  size_t pl = strlen(path);
  w->tmp_path = malloc(pl + 16);
  w->buf = malloc(WBUF_SIZE);
  if (!w->path || !w->tmp_path || !w->buf) {
    free(hb.s);
    return fail(w, oom());
  }
  /* The temporary sits beside the target (same file system for rename). */
  snprintf(w->tmp_path, pl + 16, "%s.tmp.XXXXXX", path);
  w->fd = mkstemp(w->tmp_path);
  if (w->fd < 0) {
    err = mm_st_errno_error(errno, "create temporary", w->tmp_path);
    free(w->tmp_path);
    w->tmp_path = NULL;
    free(hb.s);
    return fail(w, err);
  }
  if (fchmod(w->fd, 0644) != 0) {
    free(hb.s);
    return fail(w, mm_st_errno_error(errno, "chmod", w->tmp_path));
  }
  w->state = W_STREAMING;
  unsigned char lenb[8];
  for (int i = 0; i < 8; i++) lenb[i] = (unsigned char)((uint64_t)hb.len >> (8 * i));
  err = write_all(w, lenb, 8);
  if (!err) err = write_all(w, hb.s, hb.len);
  free(hb.s);
  return fail(w, err);
}

mm_err *mm_st_writer_append(mm_st_writer *w, const void *data, size_t n) {
  MM_ARG_CHECK(w, "mm_st_writer_append: NULL writer");
  MM_ARG_CHECK(w->state == W_STREAMING, "safetensors writer: append outside begin/finish");
  MM_ARG_CHECK(data || n == 0, "mm_st_writer_append: NULL data");
  if (n > w->data_size - w->written)
    return fail(w, mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                            "%s: appending %zu bytes overruns the %llu-byte data section (%llu written)",
                            w->path, n, (unsigned long long)w->data_size, (unsigned long long)w->written));
  w->written += n;
  if (w->buf_used + n <= WBUF_SIZE) {
    memcpy(w->buf + w->buf_used, data, n);
    w->buf_used += n;
    return NULL;
  }
  mm_err *err = flush_buf(w);
  if (!err) err = write_all(w, data, n);
  return fail(w, err);
}

mm_err *mm_st_writer_finish(mm_st_writer *w) {
  MM_ARG_CHECK(w, "mm_st_writer_finish: NULL writer");
  MM_ARG_CHECK(w->state == W_STREAMING, "safetensors writer: finish without begin");
  if (w->written != w->data_size)
    return fail(w, mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: %llu of %llu data bytes written",
                            w->path, (unsigned long long)w->written, (unsigned long long)w->data_size));
  MM_TRY(fail(w, flush_buf(w)));
  if (fsync(w->fd) != 0) return fail(w, mm_st_errno_error(errno, "fsync", w->tmp_path));
  int fd = w->fd;
  w->fd = -1;
  if (close(fd) != 0) return fail(w, mm_st_errno_error(errno, "close", w->tmp_path));
  if (rename(w->tmp_path, w->path) != 0) return fail(w, mm_st_errno_error(errno, "rename into place", w->path));
  free(w->tmp_path);
  w->tmp_path = NULL;
  w->state = W_DONE;
  return NULL;
}

mm_err *mm_st_writer_write(mm_st_writer *w, const char *path) {
  MM_ARG_CHECK(w, "mm_st_writer_write: NULL writer");
  for (size_t i = 0; i < w->n; i++)
    MM_ARG_CHECK(w->t[i].data || w->t[i].nbytes == 0,
                 "safetensors writer: tensor \"" NAME_FMT "\" has no data (streaming-only)", w->t[i].name);
  MM_TRY(mm_st_writer_begin(w, path));
  for (size_t i = 0; i < w->n; i++)
    MM_TRY(mm_st_writer_append(w, w->t[i].data, (size_t)w->t[i].nbytes));
  return mm_st_writer_finish(w);
}

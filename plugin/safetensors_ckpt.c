/* safetensors_ckpt.c -- one name space over the shards of a checkpoint. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json.h"
#include "safetensors.h"
#include "safetensors_internal.h"

#define MM_ST_MAX_INDEX ((size_t)256 << 20)
#define INDEX_NAME "model.safetensors.index.json"
#define NAME_FMT "%.200s"

typedef struct {
  uint32_t shard, tensor;
} mm_st_ref;

struct mm_st_ckpt {
  mm_st_file **shards;
  size_t nshards;
  mm_st_ref *refs;
  size_t n;
  uint32_t *index; /* open addressing: ref index + 1 */
  size_t mask;
};

void mm_st_ckpt_close(mm_st_ckpt *c) {
  if (!c) return;
  for (size_t i = 0; i < c->nshards; i++) mm_st_close(c->shards[i]);
  free(c->shards);
  free(c->refs);
  free(c->index);
  free(c);
}

static int ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), m = strlen(suffix);
  return n >= m && strcmp(s + n - m, suffix) == 0;
}

static char *join(const char *dir, const char *name) {
  size_t a = strlen(dir), b = strlen(name);
  char *p = malloc(a + b + 2);
  if (!p) return NULL;
  memcpy(p, dir, a);
  p[a] = '/';
  memcpy(p + a + 1, name, b + 1);
  return p;
}

static mm_err *oom(const char *path) {
  return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory", path);
}

static mm_err *add_shard(mm_st_ckpt *c, const char *path) {
  mm_st_file **s = realloc(c->shards, (c->nshards + 1) * sizeof(*s));
  if (!s) return oom(path);
  c->shards = s;
  MM_TRY(mm_st_open(path, &c->shards[c->nshards]));
  c->nshards++;
  return NULL;
}

static const mm_st_ref *lookup(const mm_st_ckpt *c, const char *name) {
  if (!c->index) return NULL;
  size_t n = strlen(name);
  for (size_t h = (size_t)mm_st_hash(name, n) & c->mask; c->index[h]; h = (h + 1) & c->mask) {
    const mm_st_ref *r = &c->refs[c->index[h] - 1];
    if (strcmp(mm_st_tensor_at(c->shards[r->shard], r->tensor)->name, name) == 0) return r;
  }
  return NULL;
}

/* Collects every tensor of every shard into one hash index. */
static mm_err *build_index(mm_st_ckpt *c) {
  size_t total = 0;
  for (size_t s = 0; s < c->nshards; s++) total += mm_st_count(c->shards[s]);
  if (total >= UINT32_MAX / 4)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "checkpoint has too many tensors (%zu)", total);
  size_t cap = 16;
  while (cap < total * 2) cap *= 2;
  c->refs = malloc((total ? total : 1) * sizeof(*c->refs));
  c->index = calloc(cap, sizeof(uint32_t));
  if (!c->refs || !c->index) return oom("checkpoint");
  c->mask = cap - 1;
  for (size_t s = 0; s < c->nshards; s++) {
    for (size_t i = 0; i < mm_st_count(c->shards[s]); i++) {
      const char *name = mm_st_tensor_at(c->shards[s], i)->name;
      size_t h = (size_t)mm_st_hash(name, strlen(name)) & c->mask;
      for (; c->index[h]; h = (h + 1) & c->mask) {
        const mm_st_ref *o = &c->refs[c->index[h] - 1];
        if (strcmp(mm_st_tensor_at(c->shards[o->shard], o->tensor)->name, name) == 0)
          return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "tensor \"" NAME_FMT "\" is in both %s and %s",
                          name, mm_st_path(c->shards[o->shard]), mm_st_path(c->shards[s]));
      }
      c->refs[c->n] = (mm_st_ref){(uint32_t)s, (uint32_t)i};
      c->index[h] = (uint32_t)(++c->n);
    }
  }
  return NULL;
}

static mm_err *read_small_file(const char *path, size_t cap, char **out, size_t *len) {
  *out = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* a FIFO must not block */
  if (fd < 0) return mm_st_errno_error(errno, "open", path);
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size > cap) {
    close(fd);
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: not a regular file of at most %zu bytes", path, cap);
  }
  size_t n = (size_t)st.st_size, got = 0;
  char *buf = malloc(n ? n : 1);
  if (!buf) {
    close(fd);
    return oom(path);
  }
  while (got < n) {
    ssize_t r = read(fd, buf + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      mm_err *err = r < 0 ? mm_st_errno_error(errno, "read", path)
                          : mm_error(MEGAMOE_CODE_DATA_LOSS, "%s: file shrank while reading", path);
      free(buf);
      close(fd);
      return err;
    }
    got += (size_t)r;
  }
  close(fd);
  *out = buf;
  *len = n;
  return NULL;
}

static int shard_name_ok(const char *s, size_t len) {
  return len > 0 && strlen(s) == len && !strchr(s, '/') && strcmp(s, ".") && strcmp(s, "..");
}

static mm_err *open_index(mm_st_ckpt *c, const char *index_path) {
  char *text = NULL, *dir = NULL;
  size_t len = 0;
  mm_json_doc *doc = NULL;
  mm_err *err = read_small_file(index_path, MM_ST_MAX_INDEX, &text, &len);
  if (err) return err;
  mm_json_limits lim = {MM_ST_MAX_INDEX, 32};
  err = mm_json_parse(text, len, &lim, &doc);
  free(text);
  if (err) return mm_error_wrap(err, "%s", index_path);
  const mm_json *wm = mm_json_get(mm_json_root(doc), "weight_map");
  if (!mm_json_is(wm, MM_JSON_OBJECT)) {
    err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: no \"weight_map\" object", index_path);
    goto done;
  }
  const char *slash = strrchr(index_path, '/');
  dir = slash ? strndup(index_path, (size_t)(slash - index_path)) : strdup(".");
  if (!dir) {
    err = oom(index_path);
    goto done;
  }
  if (!*dir) {  /* index at the file system root */
    free(dir);
    dir = strdup("");
    if (!dir) {
      err = oom(index_path);
      goto done;
    }
  }
  /* Open each distinct shard once, in order of first mention. */
  size_t n = mm_json_size(wm);
  for (size_t i = 0; i < n && !err; i++) {
    size_t sl;
    const char *key = mm_json_key_at(wm, i, NULL);
    const char *shard = mm_json_string(mm_json_value_at(wm, i), &sl);
    if (!shard || !shard_name_ok(shard, sl)) {
      err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                     "%s: weight_map[\"" NAME_FMT "\"] is not a plain shard file name", index_path, key);
      break;
    }
    int seen = 0; /* shards are few (~100), tensors many: scan the shards */
    for (size_t j = 0; j < c->nshards && !seen; j++) {
      const char *base = strrchr(mm_st_path(c->shards[j]), '/');
      seen = strcmp(base ? base + 1 : mm_st_path(c->shards[j]), shard) == 0;
    }
    if (seen) continue;
    char *p = join(dir, shard);
    if (!p) {
      err = oom(index_path);
      break;
    }
    err = add_shard(c, p);
    free(p);
    if (err) err = mm_error_wrap(err, "%s", index_path);
  }
  if (!err) err = build_index(c);
  /* Every mapped tensor must be in the shard the index names. */
  for (size_t i = 0; i < n && !err; i++) {
    const char *key = mm_json_key_at(wm, i, NULL);
    const char *shard = mm_json_string(mm_json_value_at(wm, i), NULL);
    const mm_st_ref *r = lookup(c, key);
    const char *in = r ? strrchr(mm_st_path(c->shards[r->shard]), '/') : NULL;
    in = in ? in + 1 : (r ? mm_st_path(c->shards[r->shard]) : NULL);
    if (!r || strcmp(in, shard) != 0)
      err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: tensor \"" NAME_FMT "\" mapped to %s but %s%s",
                     index_path, key, shard, r ? "found in " : "not found in any shard",
                     r ? mm_st_path(c->shards[r->shard]) : "");
  }
done:
  free(dir);
  mm_json_free(doc);
  return err;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static mm_err *open_dir(mm_st_ckpt *c, const char *path) {
  DIR *d = opendir(path);
  if (!d) return mm_st_errno_error(errno, "opendir", path);
  char **names = NULL, *index = NULL;
  size_t n = 0, nindex = 0;
  int has_model_index = 0;
  mm_err *err = NULL;
  struct dirent *e;
  while ((e = readdir(d)) != NULL && !err) {
    if (e->d_name[0] == '.') continue; /* hidden and temporary files */
    if (ends_with(e->d_name, ".safetensors.index.json")) {
      nindex++;
      int is_model = strcmp(e->d_name, INDEX_NAME) == 0;
      if (is_model || (!index && !has_model_index)) {
        free(index);
        index = strdup(e->d_name);
        if (!index) err = oom(path);
      }
      has_model_index |= is_model;
    } else if (ends_with(e->d_name, ".safetensors")) {
      char **nn = realloc(names, (n + 1) * sizeof(*nn));
      if (!nn) {
        err = oom(path);
        break;
      }
      names = nn;
      names[n] = strdup(e->d_name);
      if (!names[n]) err = oom(path);
      else n++;
    }
  }
  closedir(d);
  if (!err && nindex > 1 && !has_model_index)
    err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: %zu *.safetensors.index.json files and no " INDEX_NAME,
                   path, nindex);
  if (!err && index) {
    char *p = join(path, index);
    err = p ? open_index(c, p) : oom(path);
    free(p);
  } else if (!err) {
    if (n == 0) err = mm_error(MEGAMOE_CODE_NOT_FOUND, "%s: no *.safetensors files", path);
    if (n) qsort(names, n, sizeof(*names), cmp_str);
    for (size_t i = 0; i < n && !err; i++) {
      char *p = join(path, names[i]);
      err = p ? add_shard(c, p) : oom(path);
      free(p);
    }
    if (!err) err = build_index(c);
  }
  for (size_t i = 0; i < n; i++) free(names[i]);
  free(names);
  free(index);
  return err;
}

mm_err *mm_st_ckpt_open(const char *path, mm_st_ckpt **out) {
  MM_ARG_CHECK(out, "mm_st_ckpt_open: out is NULL");
  *out = NULL;
  MM_ARG_CHECK(path && *path, "mm_st_ckpt_open: empty path");
  struct stat st;
  if (stat(path, &st) != 0) return mm_st_errno_error(errno, "stat", path);
  mm_st_ckpt *c = calloc(1, sizeof(*c));
  if (!c) return oom(path);
  mm_err *err;
  if (S_ISDIR(st.st_mode)) {
    err = open_dir(c, path);
  } else if (ends_with(path, ".json")) {
    err = open_index(c, path);
  } else {
    err = add_shard(c, path);
    if (!err) err = build_index(c);
  }
  if (err) {
    mm_st_ckpt_close(c);
    return err;
  }
  *out = c;
  return NULL;
}

size_t mm_st_ckpt_shard_count(const mm_st_ckpt *c) { return c ? c->nshards : 0; }

const mm_st_file *mm_st_ckpt_shard(const mm_st_ckpt *c, size_t i) {
  return c && i < c->nshards ? c->shards[i] : NULL;
}

size_t mm_st_ckpt_count(const mm_st_ckpt *c) { return c ? c->n : 0; }

const mm_st_tensor *mm_st_ckpt_tensor_at(const mm_st_ckpt *c, size_t i, const mm_st_file **file) {
  if (!c || i >= c->n) return NULL;
  const mm_st_file *f = c->shards[c->refs[i].shard];
  if (file) *file = f;
  return mm_st_tensor_at(f, c->refs[i].tensor);
}

const mm_st_tensor *mm_st_ckpt_find(const mm_st_ckpt *c, const char *name, const mm_st_file **file) {
  if (!c || !name) return NULL;
  const mm_st_ref *r = lookup(c, name);
  if (!r) return NULL;
  if (file) *file = c->shards[r->shard];
  return mm_st_tensor_at(c->shards[r->shard], r->tensor);
}

mm_err *mm_st_ckpt_get(const mm_st_ckpt *c, const char *name, const mm_st_tensor **t,
                       const mm_st_file **file) {
  MM_ARG_CHECK(c && name && t, "mm_st_ckpt_get: NULL argument");
  *t = mm_st_ckpt_find(c, name, file);
  if (!*t)
    return mm_error(MEGAMOE_CODE_NOT_FOUND, "checkpoint %s: no tensor \"" NAME_FMT "\"",
                    c->nshards ? mm_st_path(c->shards[0]) : "(empty)", name);
  return NULL;
}

mm_err *mm_st_ckpt_read(const mm_st_ckpt *c, const char *name, void *dst, size_t dst_size) {
  const mm_st_tensor *t;
  const mm_st_file *f = NULL;
  MM_TRY(mm_st_ckpt_get(c, name, &t, &f));
  return mm_st_read(f, t, dst, dst_size);
}

/* fuzz_safetensors.c -- libFuzzer target for the safetensors reader
 * (plugin/safetensors.c, json.c) and, behind it, the expert weight loader
 * (plugin/weights_load.c). The input is a whole .safetensors file; it is put
 * in a memfd and opened by path, like a checkpoint shard. An input starting
 * with '{' is instead a model.safetensors.index.json opened beside two fixed
 * shards (sharded checkpoints, plugin/safetensors_ckpt.c).
 * Properties checked beyond "no crash, no leak, no UB":
 *   - an error has a code in [1, 16] and a non-empty message;
 *   - every accepted tensor lies inside the data section, its byte count
 *     matches dtype x shape, no two non-empty tensors overlap, and each is
 *     found by name;
 *   - reading every tensor succeeds into a buffer of exactly its size;
 *   - the tensors (as host views) through mm_weights_load_layer for a tiny
 *     model (H 64, I 32, 2 experts), with and without group16->group32
 *     requant: either an error or a complete layer of finite scales;
 *   - with the requant deferred (MM_LOAD_DEFER_REQUANT): where it fails, the
 *     plain load fails alike (code and message); where it passes, the
 *     deferred experts requantized here give the plain load's bytes and,
 *     over the limit, its error. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#include "safetensors.h"
#include "weights_load.h"

#define FZ_FAIL(...)                                  \
  do {                                                \
    fprintf(stderr, "fuzz_safetensors: " __VA_ARGS__); \
    fputc('\n', stderr);                              \
    abort();                                          \
  } while (0)

static void check_error(megamoe_error *e, const char *what) {
  if (!e) return;
  if (e->code <= MEGAMOE_CODE_OK || e->code >= MEGAMOE_CODE_COUNT_ || !e->message ||
      !e->message[0])
    FZ_FAIL("%s: malformed error (code %d)", what, (int)e->code);
}

/* The deferred load against the plain one (`plain_err`, `plain`: its
 * result), as the file comment says. */
static void check_deferred(const mm_config *cfg, const mm_tensor_view *views, size_t nv,
                           megamoe_error *plain_err, const mm_expert_q *plain) {
  mm_expert_q d[2];
  mm_requant_report rep;
  memset(d, 0, sizeof d);
  megamoe_error *e = mm_weights_load_layer_ex(cfg, views, nv, 0, 2, MM_LOAD_DEFER_REQUANT, d, &rep);
  check_error(e, "deferred load");
  if (e) {
    if (!plain_err || plain_err->code != e->code || strcmp(plain_err->message, e->message))
      FZ_FAIL("deferred load: \"%s\", plain load: \"%s\"", e->message,
              plain_err ? plain_err->message : "ok");
    megamoe_error_destroy(e);
    return;
  }
  megamoe_error *over = NULL; /* the first tensor over the limit, in load order */
  for (int i = 0; i < 2; i++) {
    static const char *const kProj[3] = {"gate_proj", "up_proj", "down_proj"};
    for (int p = 0; p < 3 && rep.requant_pending; p++) {
      const mm_qmat *m = p == 2 ? &d[i].w2 : &d[i].w13;
      const int rows = p == 2 ? m->rows : m->rows / 2;
      const size_t r0 = p == 1 ? (size_t)rows : 0;
      const mm_g16_source src = mm_g16_rows(m, (int)r0, rows);
      uint8_t *c = malloc((size_t)rows * (size_t)m->cols / 2 + 1);
      uint8_t *sc = malloc((size_t)rows * (size_t)(m->cols / 32) + 1);
      mm_requant_stats st;
      megamoe_error *re = mm_requant_g16_to_g32(&src, c, sc, 1, &st);
      if (re) FZ_FAIL("requant of a deferred layer failed: %s", re->message);
      char name[64];
      snprintf(name, sizeof name, "experts.%d.%s", i, kProj[p]);
      if (!over) over = mm_requant_limit_error(name, &st, cfg->requant_max_rel_error);
      const mm_qmat *q = p == 2 ? &plain[i].w2 : &plain[i].w13;
      if (!plain_err && (memcmp(q->codes + r0 * (size_t)(m->cols / 2), c, (size_t)rows * (size_t)m->cols / 2) ||
                         memcmp(q->scales + r0 * (size_t)(m->cols / 32), sc, (size_t)rows * (size_t)(m->cols / 32))))
        FZ_FAIL("expert %d %s: the deferred requant's bytes differ from the plain load's", i, kProj[p]);
      free(c);
      free(sc);
    }
    if (!rep.requant_pending && !plain_err &&
        (!mm_qmat_equal(&d[i].w13, &plain[i].w13) || !mm_qmat_equal(&d[i].w2, &plain[i].w2)))
      FZ_FAIL("expert %d: a load with nothing to defer differs from the plain one", i);
  }
  if (!over != !plain_err || (over && strcmp(over->message, plain_err->message)))
    FZ_FAIL("deferred load passed; its requant: \"%s\", plain load: \"%s\"",
            over ? over->message : "ok", plain_err ? plain_err->message : "ok");
  if (over) megamoe_error_destroy(over);
  for (int i = 0; i < 2; i++) {
    mm_qmat_free(&d[i].w13);
    mm_qmat_free(&d[i].w2);
  }
  mm_requant_report_free(&rep);
}

static void load_layer(const mm_st_file *f, void **bufs, int requant) {
  size_t n = mm_st_count(f);
  mm_tensor_view *views = calloc(n + 1, sizeof *views);
  if (!views) return;
  size_t nv = 0;
  for (size_t i = 0; i < n; i++) {
    const mm_st_tensor *t = mm_st_tensor_at(f, i);
    mm_dtype dt = mm_st_to_mm_dtype(t->dtype);
    if (!bufs[i] || dt == MM_DT_INVALID || t->ndim > 4) continue;
    mm_tensor_view *v = &views[nv++];
    v->name = t->name;
    v->dtype = dt;
    v->ndim = t->ndim;
    for (int d = 0; d < t->ndim; d++) v->shape[d] = t->shape[d];
    v->data = bufs[i];
  }
  mm_config cfg;
  mm_config_defaults(&cfg);
  cfg.model.hidden_size = 64;
  cfg.model.moe_intermediate_size = 32;
  cfg.model.num_experts = 2;
  cfg.model.top_k = 1;
  cfg.cpu_threads = 1;
  cfg.requant_policy = requant ? MM_REQUANT_G16_TO_G32 : MM_REQUANT_NONE;
  cfg.requant_max_rel_error = 1.0;
  mm_expert_q ex[2];
  mm_requant_report rep;
  memset(ex, 0, sizeof ex);
  megamoe_error *e = mm_weights_load_layer(&cfg, views, nv, 0, 2, ex, &rep);
  check_error(e, "weights load");
  if (requant) check_deferred(&cfg, views, nv, e, ex);
  if (e) {
    for (int i = 0; i < 2; i++)
      if (ex[i].w13.codes || ex[i].w2.codes) FZ_FAIL("failed load left expert %d allocated", i);
    megamoe_error_destroy(e);
  } else {
    for (int i = 0; i < 2; i++) {
      const mm_qmat *m[2] = {&ex[i].w13, &ex[i].w2};
      for (int j = 0; j < 2; j++) {
        if (!m[j]->codes || m[j]->cols % m[j]->gran) FZ_FAIL("incomplete expert %d", i);
        for (int r = 0; r < m[j]->rows; r++)
          for (int g = 0; g < m[j]->cols / m[j]->gran; g++) {
            float s = mm_qmat_group_scale(m[j], r, g) * m[j]->row_scale[r];
            if (s != s) FZ_FAIL("expert %d: NaN scale accepted", i);
          }
      }
      mm_qmat_free(&ex[i].w13);
      mm_qmat_free(&ex[i].w2);
    }
    mm_requant_report_free(&rep);
  }
  free(views);
}

/* ---- index mode: an input starting with '{' is a model.safetensors.index.json
 * beside two small fixed shards (a.safetensors: x, y; b.safetensors: z). */
static char g_dir[256];

static void write_file(const char *name, const void *p, size_t n) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", g_dir, name);
  FILE *f = fopen(path, "wb");
  if (!f) abort();
  fwrite(p, 1, n, f);
  fclose(f);
}

static void write_shard(const char *name, const char *hdr, size_t data) {
  uint8_t buf[512];
  size_t hl = strlen(hdr);
  for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)hl >> (8 * i));
  memcpy(buf + 8, hdr, hl);
  memset(buf + 8 + hl, 0x3C, data);
  write_file(name, buf, 8 + hl + data);
}

static void remove_dir(void) {
  static const char *names[3] = {"a.safetensors", "b.safetensors", "model.safetensors.index.json"};
  char path[512];
  for (int i = 0; i < 3; i++) {
    snprintf(path, sizeof path, "%s/%s", g_dir, names[i]);
    unlink(path);
  }
  rmdir(g_dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  const char *tmp = getenv("TMPDIR");
  snprintf(g_dir, sizeof g_dir, "%s/megamoe-fuzz-st-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(g_dir)) abort();
  atexit(remove_dir);
  write_shard("a.safetensors",
              "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
              "\"y\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[8,11]}}",
              11);
  write_shard("b.safetensors",
              "{\"z\":{\"dtype\":\"BF16\",\"shape\":[1,2],\"data_offsets\":[0,4]}}", 4);
  return 0;
}

static void index_mode(const uint8_t *data, size_t size) {
  write_file("model.safetensors.index.json", data, size);
  char path[512];
  snprintf(path, sizeof path, "%s/model.safetensors.index.json", g_dir);
  mm_st_ckpt *c = NULL;
  megamoe_error *e = mm_st_ckpt_open(path, &c);
  check_error(e, "index open");
  if (e) {
    if (c) FZ_FAIL("error but a checkpoint handle");
    megamoe_error_destroy(e);
    return;
  }
  for (size_t i = 0; i < mm_st_ckpt_count(c); i++) {
    const mm_st_file *f = NULL;
    const mm_st_tensor *t = mm_st_ckpt_tensor_at(c, i, &f);
    const mm_st_file *g = NULL;
    if (!t || !f || mm_st_ckpt_find(c, t->name, &g) != t || g != f) FZ_FAIL("index lookup %zu", i);
    uint8_t buf[16];
    if (t->nbytes > sizeof buf) FZ_FAIL("fixed shard tensor too big");
    e = mm_st_ckpt_read(c, t->name, buf, sizeof buf);
    check_error(e, "index read");
    if (e) FZ_FAIL("%s: read failed: %s", t->name, e->message);
  }
  mm_st_ckpt_close(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > (4u << 20)) return 0;
  if (size > 0 && data[0] == '{') {
    if (!g_dir[0]) LLVMFuzzerInitialize(NULL, NULL);
    index_mode(data, size);
    return 0;
  }
  int fd = memfd_create("fuzz.safetensors", MFD_CLOEXEC);
  if (fd < 0) return 0;
  size_t off = 0;
  while (off < size) {
    ssize_t w = write(fd, data + off, size - off);
    if (w <= 0) {
      close(fd);
      return 0;
    }
    off += (size_t)w;
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  mm_st_file *f = NULL;
  megamoe_error *e = mm_st_open(path, &f);
  close(fd); /* the reader holds its own descriptor */
  check_error(e, "open");
  if (e) {
    if (f) FZ_FAIL("error but a file handle");
    megamoe_error_destroy(e);
    return 0;
  }
  const uint64_t fsize = mm_st_file_size(f);
  if (fsize != size) FZ_FAIL("file size %llu, input %zu", (unsigned long long)fsize, size);
  size_t n = mm_st_count(f);
  void **bufs = calloc(n + 1, sizeof *bufs);
  if (!bufs) goto out;
  for (size_t i = 0; i < n; i++) {
    const mm_st_tensor *t = mm_st_tensor_at(f, i);
    int ok;
    uint64_t nb = mm_st_nbytes(t->dtype, t->nelems, &ok);
    if (!ok || nb != t->nbytes) FZ_FAIL("%s: nbytes %llu", t->name, (unsigned long long)t->nbytes);
    uint64_t nel = 1;
    for (int d = 0; d < t->ndim; d++) nel *= (uint64_t)t->shape[d];
    if (nel != t->nelems || t->ndim < 0 || t->ndim > MM_ST_MAX_DIMS) FZ_FAIL("%s: shape", t->name);
    if (t->offset < 8 || t->offset > fsize || t->nbytes > fsize - t->offset)
      FZ_FAIL("%s: [%llu, +%llu) outside the %llu-byte file", t->name,
              (unsigned long long)t->offset, (unsigned long long)t->nbytes,
              (unsigned long long)fsize);
    if (mm_st_find(f, t->name) != t) FZ_FAIL("%s: not found by name", t->name);
    for (size_t j = 0; j < i; j++) {
      const mm_st_tensor *u = mm_st_tensor_at(f, j);
      if (t->nbytes && u->nbytes && t->offset < u->offset + u->nbytes &&
          u->offset < t->offset + t->nbytes)
        FZ_FAIL("%s overlaps %s", t->name, u->name);
      if (strcmp(t->name, u->name) == 0) FZ_FAIL("duplicate name %s", t->name);
    }
    bufs[i] = malloc(t->nbytes ? t->nbytes : 1);
    if (!bufs[i]) continue;
    e = mm_st_read(f, t, bufs[i], t->nbytes);
    check_error(e, "read");
    if (e) FZ_FAIL("%s: read failed: %s", t->name, e->message);
    if (t->nbytes && memcmp(bufs[i], data + t->offset, t->nbytes) != 0)
      FZ_FAIL("%s: bytes differ from the file", t->name);
  }
  for (size_t i = 0; i < mm_st_metadata_count(f); i++) {
    const char *k = mm_st_metadata_key_at(f, i), *v = mm_st_metadata_value_at(f, i);
    if (!k || !v || mm_st_metadata(f, k) == NULL) FZ_FAIL("metadata %zu", i);
  }
  load_layer(f, bufs, 0);
  load_layer(f, bufs, 1);
  for (size_t i = 0; i < n; i++) free(bufs[i]);
  free(bufs);
out:
  mm_st_close(f);
  return 0;
}

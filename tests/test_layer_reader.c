/* test_layer_reader.c -- megamoe-host's layer reads on libuv's thread pool
 * (host/layer_reader.c): the bytes, names, dtypes and shapes of every
 * tensor against plain mm_st_read, tensors larger than one read piece, two
 * layers in flight at once, absent tensors left out, and a file that
 * shrank after it was opened reported by tensor name. */
#include <fcntl.h>
#include <unistd.h>

#include "harness.h"
#include "layer_reader.h"
#include "safetensors.h"

enum { kLayers = 2, kExperts = 3 };

static char g_dir[256], g_path[300];

/* Per expert and projection: weight (U8 codes, [rows, cols / 2]) and
 * weight_scale (F8_E4M3, [rows, cols / 16]); experts.1.up_proj of layer 1
 * is 2 x 12 MiB + 3 bytes of codes (two and a bit read pieces); layer 0 has
 * no experts.2.down_proj.weight_scale. */
static uint64_t code_bytes(int l, int e, int p) {
  return l == 1 && e == 1 && p == 1 ? (uint64_t)24 * 1024 * 1024 + 3 : (uint64_t)(64 + 32 * e + p);
}

static void fill(uint8_t *b, uint64_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (uint64_t i = 0; i < n; i++) {
    x = x * 1664525u + 1013904223u;
    b[i] = (uint8_t)(x >> 24);
  }
}

static int write_ckpt(void) {
  static const char *projs[3] = {"gate", "up", "down"};
  mm_st_writer *w = NULL;
  if (mm_st_writer_new(&w)) return -1;
  uint8_t *bufs[kLayers * kExperts * 3 * 2] = {0};
  int nb = 0, bad = 0;
  for (int l = 0; l < kLayers && !bad; l++)
    for (int e = 0; e < kExperts && !bad; e++)
      for (int p = 0; p < 3 && !bad; p++) {
        char name[160];
        const uint64_t n = code_bytes(l, e, p);
        uint8_t *c = malloc(n), *s = malloc(n / 8 + 1);
        bufs[nb++] = c, bufs[nb++] = s;
        if (!c || !s) { bad = 1; break; }
        fill(c, n, (uint32_t)(100 * l + 10 * e + p));
        fill(s, n / 8, (uint32_t)(1000 + 100 * l + 10 * e + p));
        const int64_t shc[2] = {1, (int64_t)n}, shs[2] = {1, (int64_t)(n / 8)};
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s_proj.weight", l, e, projs[p]);
        bad |= mm_st_writer_add(w, name, MM_ST_U8, 2, shc, c, n) != NULL;
        if (l == 0 && e == 2 && p == 2) continue;
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s_proj.weight_scale", l, e,
                 projs[p]);
        bad |= mm_st_writer_add(w, name, MM_ST_F8_E4M3, 2, shs, s, n / 8) != NULL;
      }
  if (!bad) bad = mm_st_writer_write(w, g_path) != NULL;
  mm_st_writer_free(w);
  for (int i = 0; i < nb; i++) free(bufs[i]);
  return bad ? -1 : 0;
}

/* Every tensor of layer cl, experts [first, first + n), against mm_st_read. */
static void check_layer(const mm_st_ckpt *ck, host_layer *hl, int cl, int first, int n,
                        size_t want_count) {
  megamoe_error *err = host_layer_wait(hl);
  CHECK_MSG(err == NULL, "%s", err ? megamoe_error_message(err) : "");
  if (err) megamoe_error_destroy(err);
  size_t count = 0;
  const megamoe_named_tensor *nt = host_layer_tensors(hl, &count);
  CHECK_EQ_INT(count, want_count);
  double bytes = 0;
  for (size_t i = 0; i < count; i++) {
    int e = -1;
    char proj[8] = "", suf[16] = "";
    CHECK(sscanf(nt[i].name, "experts.%d.%7[a-z]_proj.%15s", &e, proj, suf) == 3);
    CHECK(e >= first && e < first + n);
    char full[200];
    snprintf(full, sizeof full, "model.layers.%d.mlp.%s", cl, nt[i].name);
    const mm_st_file *f;
    const mm_st_tensor *t = mm_st_ckpt_find(ck, full, &f);
    CHECK_MSG(t != NULL, "%s", full);
    if (!t) continue;
    const DLTensor *d = nt[i].tensor;
    CHECK_EQ_INT(d->ndim, t->ndim);
    CHECK_EQ_INT(d->shape[1], t->shape[1]);
    CHECK_EQ_INT(d->device.device_type, kDLCPU);
    CHECK_EQ_INT(d->dtype.code, !strcmp(suf, "weight") ? kDLUInt : MEGAMOE_DL_FLOAT8_E4M3FN);
    uint8_t *want = malloc(t->nbytes + 1);
    CHECK(want && mm_st_read(f, t, want, t->nbytes) == NULL);
    CHECK_MSG(want && memcmp(want, d->data, t->nbytes) == 0, "%s: bytes differ", full);
    free(want);
    bytes += (double)t->nbytes;
  }
  CHECK(bytes == host_layer_bytes(hl));
}

static void test_reads(void) {
  mm_st_ckpt *ck = NULL;
  CHECK(mm_st_ckpt_open(g_path, &ck) == NULL);
  if (!ck) return;
  /* both layers in flight, waited for in reverse order */
  host_layer *a = host_layer_read(ck, 0, 0, kExperts), *b = host_layer_read(ck, 1, 1, 2);
  CHECK(a && b);
  if (b) check_layer(ck, b, 1, 1, 2, 2 * 3 * 2);
  if (a) check_layer(ck, a, 0, 0, kExperts, kExperts * 3 * 2 - 1); /* one scale absent */
  host_layer_free(a);
  host_layer_free(b);
  /* a layer the checkpoint does not hold, no experts, and freed unwaited */
  host_layer *none = host_layer_read(ck, 7, 0, kExperts), *empty = host_layer_read(ck, 0, 0, 0);
  host_layer *unwaited = host_layer_read(ck, 1, 0, kExperts);
  CHECK(none && empty && unwaited);
  size_t count = 99;
  if (none) {
    CHECK(host_layer_wait(none) == NULL);
    host_layer_tensors(none, &count);
    CHECK_EQ_INT(count, 0);
  }
  if (empty) CHECK(host_layer_wait(empty) == NULL);
  host_layer_free(none);
  host_layer_free(empty);
  host_layer_free(unwaited); /* waits for its reads itself */
  host_layer_free(NULL);
  mm_st_ckpt_close(ck);
}

static void test_shrunk_file(void) {
  mm_st_ckpt *ck = NULL;
  CHECK(mm_st_ckpt_open(g_path, &ck) == NULL);
  if (!ck) return;
  /* cut the file inside layer 1's large tensor: its reads come up short */
  const mm_st_file *f;
  const mm_st_tensor *t = mm_st_ckpt_find(ck, "model.layers.1.mlp.experts.1.up_proj.weight", &f);
  CHECK(t != NULL);
  if (t) CHECK(truncate(g_path, (off_t)(t->offset + 20 * 1024 * 1024)) == 0);
  host_layer *hl = host_layer_read(ck, 1, 0, kExperts);
  CHECK(hl != NULL);
  if (hl) {
    megamoe_error *err = host_layer_wait(hl);
    CHECK(err != NULL);
    if (err) {
      CHECK_MSG(strstr(megamoe_error_message(err), "experts.1.up_proj.weight") != NULL, "%s",
                megamoe_error_message(err));
      megamoe_error_destroy(err);
    }
    CHECK(host_layer_wait(hl) == NULL); /* reported once */
  }
  host_layer_free(hl);
  mm_st_ckpt_close(ck);
}

int main(void) {
  const char *tmp = getenv("TMPDIR");
  snprintf(g_dir, sizeof g_dir, "%s/mm_layer_reader_XXXXXX", tmp ? tmp : "/tmp");
  if (!mkdtemp(g_dir)) {
    printf("Bail out! mkdtemp failed\n");
    return 1;
  }
  snprintf(g_path, sizeof g_path, "%s/model.safetensors", g_dir);
  if (write_ckpt()) {
    printf("Bail out! cannot write the test checkpoint\n");
    return 1;
  }
  RUN(test_reads);
  RUN(test_shrunk_file);
  unlink(g_path);
  rmdir(g_dir);
  return mm_test_done();
}

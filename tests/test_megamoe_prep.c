/* test_megamoe_prep.c -- the installed tool, end to end: `requant` and
 * `sm100-layout` on the golden files (outputs equal to the golden tensors),
 * and `convert` on a synthetic GLM-shaped sharded checkpoint (NVFP4 experts,
 * a dense layer, shared experts, router, a second shard, config.json): every
 * output tensor is compared with the library's own loader / exporter run in
 * the test, pass-through tensors with the input, and failures (NVFP4 to the
 * sm100 layout, a NaN scale, a requant error limit) exit 1 naming the tensor. */
#include <ftw.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "formats.h"
#include "harness.h"
#include "layout_sm100.h"
#include "prep_golden.h"
#include "safetensors.h"
#include "weights_load.h"

static char g_tool[1024], g_tmp[256];

/* Runs a shell command; output (stdout+stderr) into out; returns the exit code. */
static int run(char *out, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int run(char *out, size_t cap, const char *fmt, ...) {
  char cmd[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  strncat(cmd, " 2>&1", sizeof cmd - strlen(cmd) - 1);
  FILE *p = popen(cmd, "r");
  if (!p) return -1;
  size_t n = fread(out, 1, cap - 1, p);
  out[n] = 0;
  int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int rm_cb(const char *p, const struct stat *s, int f, struct FTW *w) {
  (void)s, (void)f, (void)w;
  return remove(p);
}

static void *read_tensor(mm_st_file *f, const char *name, const mm_st_tensor **t) {
  const mm_st_tensor *x = mm_st_find(f, name);
  if (!x) return NULL;
  void *d = malloc(x->nbytes + 1);
  mm_err *e = mm_st_read(f, x, d, x->nbytes);
  if (e) {
    mm_error_free(e);
    free(d);
    return NULL;
  }
  if (t) *t = x;
  return d;
}

/* ---- golden files through the tool ------------------------------------------ */

static void test_requant_golden(void) {
  char out[8192], path[512];
  for (size_t fi = 0; fi < sizeof kGoldenRequantFiles / sizeof kGoldenRequantFiles[0]; fi++) {
    snprintf(path, sizeof path, "%s/rq_%zu.safetensors", g_tmp, fi);
    int rc = run(out, sizeof out, "%s requant --in %s/%s --out %s", g_tool, golden_dir(),
                 kGoldenRequantFiles[fi], path);
    CHECK_MSG(rc == 0, "%s: rc %d: %s", kGoldenRequantFiles[fi], rc, out);
    CHECK(strstr(out, "src: [") && strstr(out, "rel RMS"));
    mm_st_file *o = NULL, *g = golden_open(kGoldenRequantFiles[fi]);
    CHECK_OK(mm_st_open(path, &o));
    if (!o || !g) {
      mm_st_close(o), mm_st_close(g);
      continue;
    }
    const mm_st_tensor *a, *b;
    /* src.* now holds the requantized result: equal to dst.* */
    static const char *pairs[2][2] = {{"src.weight", "dst.weight"},
                                      {"src.weight_scale", "dst.weight_scale"}};
    for (int k = 0; k < 2; k++) {
      void *x = read_tensor(o, pairs[k][0], &a), *y = read_tensor(g, pairs[k][1], &b);
      CHECK_MSG(x && y && a->nbytes == b->nbytes && a->dtype == MM_ST_U8 &&
                    memcmp(x, y, a->nbytes) == 0,
                "%s: %s differs from golden %s", kGoldenRequantFiles[fi], pairs[k][0], pairs[k][1]);
      free(x), free(y);
    }
    CHECK(mm_st_find(o, "src.weight_scale_2") == NULL); /* folded in */
    /* Everything else is copied unchanged. */
    for (size_t i = 0; i < mm_st_count(g); i++) {
      const mm_st_tensor *t = mm_st_tensor_at(g, i);
      if (!strcmp(t->name, "src.weight") || !strcmp(t->name, "src.weight_scale") ||
          !strcmp(t->name, "src.weight_scale_2"))
        continue;
      void *x = read_tensor(o, t->name, &a), *y = read_tensor(g, t->name, NULL);
      CHECK_MSG(x && y && a->nbytes == t->nbytes && memcmp(x, y, t->nbytes) == 0, "%s: %s",
                kGoldenRequantFiles[fi], t->name);
      free(x), free(y);
    }
    mm_st_close(o), mm_st_close(g);
  }
  /* A limit below the measured error fails and leaves no output. */
  snprintf(path, sizeof path, "%s/rq_fail.safetensors", g_tmp);
  int rc = run(out, sizeof out, "%s requant --in %s/nvfp4_small.safetensors --out %s --max-rel-error 0.05",
               g_tool, golden_dir(), path);
  CHECK(rc == 1 && strstr(out, "src: requant error") != NULL);
  CHECK(access(path, F_OK) != 0);
}

static void test_sm100_golden(void) {
  char out[4096], path[512];
  for (size_t fi = 0; fi < sizeof kGoldenSm100Files / sizeof kGoldenSm100Files[0]; fi++) {
    snprintf(path, sizeof path, "%s/sm_%zu.safetensors", g_tmp, fi);
    int rc = run(out, sizeof out, "%s sm100-layout --in %s/%s --out %s", g_tool, golden_dir(),
                 kGoldenSm100Files[fi], path);
    CHECK_MSG(rc == 0, "%s: %s", kGoldenSm100Files[fi], out);
    mm_st_file *o = NULL, *g = golden_open(kGoldenSm100Files[fi]);
    CHECK_OK(mm_st_open(path, &o));
    if (!o || !g) {
      mm_st_close(o), mm_st_close(g);
      continue;
    }
    static const char *names[4] = {"sm100.w13", "sm100.s13", "sm100.w2", "sm100.s2"};
    for (int k = 0; k < 4; k++) {
      const mm_st_tensor *a, *b;
      void *x = read_tensor(o, names[k], &a), *y = read_tensor(g, names[k], &b);
      CHECK_MSG(x && y && a->dtype == b->dtype && a->nbytes == b->nbytes &&
                    memcmp(x, y, a->nbytes) == 0,
                "%s: %s", kGoldenSm100Files[fi], names[k]);
      free(x), free(y);
    }
    static const char *meta[] = {"E", "H", "I", "gran_k", "s13_shape", "s13_strides", "s2_shape",
                                 "s2_strides"};
    for (size_t k = 0; k < sizeof meta / sizeof meta[0]; k++) {
      const char *x = mm_st_metadata(o, meta[k]), *y = mm_st_metadata(g, meta[k]);
      CHECK_MSG(x && y && !strcmp(x, y), "%s: metadata %s: %s vs %s", kGoldenSm100Files[fi],
                meta[k], x ? x : "-", y ? y : "-");
    }
    mm_st_close(o), mm_st_close(g);
  }
}

/* ---- synthetic GLM-shaped checkpoint ------------------------------------------------ */

#define SH 256
#define SI 128
#define SE 8

typedef struct {
  char name[128];
  mm_st_dtype dt;
  int ndim;
  int64_t shape[3];
  void *data;
  size_t bytes;
  int shard;
} syn_t;

static syn_t g_syn[512];
static int g_nsyn;

static void *syn_add(int shard, mm_st_dtype dt, int ndim, int64_t a, int64_t b, size_t bytes,
                     const char *fmt, ...) __attribute__((format(printf, 7, 8)));
static void *syn_add(int shard, mm_st_dtype dt, int ndim, int64_t a, int64_t b, size_t bytes,
                     const char *fmt, ...) {
  syn_t *t = &g_syn[g_nsyn++];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t->name, sizeof t->name, fmt, ap);
  va_end(ap);
  t->dt = dt, t->ndim = ndim, t->shape[0] = a, t->shape[1] = b;
  t->bytes = bytes;
  t->data = malloc(bytes);
  t->shard = shard;
  uint8_t *d = t->data;
  for (size_t i = 0; i < bytes; i++) d[i] = (uint8_t)mm_test_rand_u64();
  return t->data;
}

/* 3 layers: 0 dense; 1 and 2 MoE (NVFP4, 8 experts). Layer 2's experts sit
 * in the second shard, except its expert 7 down_proj (a layer may span shards). */
static void make_ckpt(const char *dir) {
  g_nsyn = 0;
  syn_add(0, MM_ST_BF16, 2, 64, SH, 64 * SH * 2, "model.embed_tokens.weight");
  syn_add(0, MM_ST_BF16, 2, 2 * SI, SH, 2 * SI * SH * 2, "model.layers.0.mlp.gate_proj.weight");
  for (int L = 1; L <= 2; L++) {
    syn_add(0, MM_ST_BF16, 2, SE, SH, SE * SH * 2, "model.layers.%d.mlp.gate.weight", L);
    syn_add(0, MM_ST_F32, 1, SE, 0, SE * 4, "model.layers.%d.mlp.gate.e_score_correction_bias", L);
    syn_add(0, MM_ST_U8, 2, SI, SH / 2, SI * SH / 2, "model.layers.%d.mlp.shared_experts.gate_proj.weight", L);
    for (int e = 0; e < SE; e++) {
      static const char *pn[3] = {"gate_proj", "up_proj", "down_proj"};
      for (int p = 0; p < 3; p++) {
        int N = p == 2 ? SH : SI, K = p == 2 ? SI : SH;
        int shard = L == 2 && !(e == 7 && p == 2) ? 1 : 0;
        syn_add(shard, MM_ST_U8, 2, N, K / 2, (size_t)N * K / 2,
                "model.layers.%d.mlp.experts.%d.%s.weight", L, e, pn[p]);
        uint8_t *s = syn_add(shard, MM_ST_F8_E4M3, 2, N, K / 16, (size_t)N * K / 16,
                             "model.layers.%d.mlp.experts.%d.%s.weight_scale", L, e, pn[p]);
        for (int i = 0; i < N * K / 16; i++) s[i] = (uint8_t)(0x18 + mm_test_rand_u64() % 0x40);
        float *g = syn_add(shard, MM_ST_F32, 0, 0, 0, 4,
                           "model.layers.%d.mlp.experts.%d.%s.weight_scale_2", L, e, pn[p]);
        *g = mm_test_uniform(1e-3f, 4e-3f);
        float *in = syn_add(shard, MM_ST_F32, 0, 0, 0, 4,
                            "model.layers.%d.mlp.experts.%d.%s.input_scale", L, e, pn[p]);
        *in = 0.01f;
      }
    }
  }
  syn_add(1, MM_ST_BF16, 1, SH, 0, SH * 2, "model.norm.weight");
  char path[512];
  mkdir(dir, 0777);
  FILE *idx;
  snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
  idx = fopen(path, "w");
  fprintf(idx, "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {");
  for (int s = 0; s < 2; s++) {
    mm_st_writer *w = NULL;
    CHECK_OK(mm_st_writer_new(&w));
    for (int i = 0; i < g_nsyn; i++) {
      if (g_syn[i].shard != s) continue;
      CHECK_OK(mm_st_writer_add(w, g_syn[i].name, g_syn[i].dt, g_syn[i].ndim, g_syn[i].shape,
                                g_syn[i].data, g_syn[i].bytes));
      fprintf(idx, "%s\"%s\": \"model-0000%d-of-00002.safetensors\"", i ? ", " : "", g_syn[i].name,
              s + 1);
    }
    snprintf(path, sizeof path, "%s/model-0000%d-of-00002.safetensors", dir, s + 1);
    CHECK_OK(mm_st_writer_write(w, path));
    mm_st_writer_free(w);
  }
  fprintf(idx, "}}\n");
  fclose(idx);
  snprintf(path, sizeof path, "%s/config.json", dir);
  FILE *c = fopen(path, "w");
  fprintf(c, "{\"hidden_size\": %d, \"moe_intermediate_size\": %d, \"n_routed_experts\": %d}\n",
          SH, SI, SE);
  fclose(c);
}

/* The expected layer, computed in the test with the library loader. */
static void expected_layer(int L, int requant, mm_expert_q *x) {
  mm_tensor_view v[SE * 12];
  int n = 0;
  char pre[64];
  snprintf(pre, sizeof pre, "model.layers.%d.mlp.experts.", L);
  for (int i = 0; i < g_nsyn; i++) {
    if (strncmp(g_syn[i].name, pre, strlen(pre)) != 0) continue;
    mm_tensor_view *t = &v[n++];
    memset(t, 0, sizeof *t);
    t->name = g_syn[i].name;
    t->dtype = mm_st_to_mm_dtype(g_syn[i].dt);
    t->ndim = g_syn[i].ndim;
    t->shape[0] = g_syn[i].shape[0], t->shape[1] = g_syn[i].shape[1];
    t->data = g_syn[i].data;
  }
  mm_config cfg;
  mm_config_defaults(&cfg);
  cfg.model.hidden_size = SH, cfg.model.moe_intermediate_size = SI, cfg.model.num_experts = SE;
  cfg.requant_policy = requant ? MM_REQUANT_G16_TO_G32 : MM_REQUANT_NONE;
  CHECK_OK(mm_weights_load_layer(&cfg, v, (size_t)n, 0, SE, x, NULL));
}

static mm_st_ckpt *open_out(const char *dir) {
  mm_st_ckpt *c = NULL;
  CHECK_OK(mm_st_ckpt_open(dir, &c));
  return c;
}

static void check_passthrough(mm_st_ckpt *c) {
  for (int i = 0; i < g_nsyn; i++) {
    if (strstr(g_syn[i].name, "mlp.experts.")) {
      CHECK_MSG(mm_st_ckpt_find(c, g_syn[i].name, NULL) == NULL, "%s still present", g_syn[i].name);
      continue;
    }
    void *d = malloc(g_syn[i].bytes + 1);
    CHECK_OK(mm_st_ckpt_read(c, g_syn[i].name, d, g_syn[i].bytes));
    CHECK_MSG(memcmp(d, g_syn[i].data, g_syn[i].bytes) == 0, "%s changed", g_syn[i].name);
    free(d);
  }
}

static void check_bytes(mm_st_ckpt *c, const char *name, const void *want, size_t n) {
  const mm_st_tensor *t = NULL;
  const mm_st_file *f = NULL;
  mm_err *e = mm_st_ckpt_get(c, name, &t, &f);
  CHECK_MSG(e == NULL, "%s missing", name);
  mm_error_free(e);
  if (!t) return;
  CHECK_MSG(t->nbytes == n, "%s: %llu bytes, want %zu", name, (unsigned long long)t->nbytes, n);
  if (t->nbytes != n) return;
  void *d = malloc(n + 1);
  CHECK_OK(mm_st_read(f, t, d, n));
  CHECK_MSG(memcmp(d, want, n) == 0, "%s differs", name);
  free(d);
}

static void test_convert(void) {
  char out[16384], in[512], dst[512], nm[1024];
  snprintf(in, sizeof in, "%s/ckpt", g_tmp);
  make_ckpt(in);
  for (int mode = 0; mode < 3; mode++) { /* canonical, canonical+requant, sm100+requant */
    int requant = mode > 0;
    const char *layout = mode == 2 ? "sm100-deepgemm" : "canonical";
    snprintf(dst, sizeof dst, "%s/out%d", g_tmp, mode);
    int rc = run(out, sizeof out, "%s convert --in %s --out %s --layout %s%s --threads 2", g_tool,
                 in, dst, layout, requant ? " --requant" : "");
    CHECK_MSG(rc == 0, "convert %s: rc %d: %s", layout, rc, out);
    CHECK(strstr(out, "[1/2] model.layers.1.mlp.") && strstr(out, "[2/2] model.layers.2.mlp."));
    if (requant) CHECK(strstr(out, "requantized: rel RMS") != NULL);
    CHECK(strstr(out, "gate/up global scales differ") != NULL);
    printf("# %s", strstr(out, "[1/2]") ? strstr(out, "[1/2]") : out);
    mm_st_ckpt *c = open_out(dst);
    if (!c) continue;
    CHECK_EQ_INT(mm_st_ckpt_shard_count(c), 2);
    check_passthrough(c);
    for (int L = 1; L <= 2; L++) {
      mm_expert_q x[SE];
      expected_layer(L, requant, x);
      int g = requant ? 32 : 16;
      if (mode < 2) {
        size_t b13 = (size_t)2 * SI * SH / 2, b2 = (size_t)SH * SI / 2;
        uint8_t *w = malloc(SE * b13 * 2);
        float *rs = malloc(sizeof(float) * SE * 2 * SI * 2);
        static const char *mat[2] = {"w13", "w2"};
        for (int m = 0; m < 2; m++) {
          size_t cb = m ? b2 : b13, sb = m ? (size_t)SH * SI / g : (size_t)2 * SI * SH / g;
          int rows = m ? SH : 2 * SI;
          for (int e = 0; e < SE; e++) memcpy(w + e * cb, (m ? x[e].w2 : x[e].w13).codes, cb);
          snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.%s_weight", L, mat[m]);
          check_bytes(c, nm, w, SE * cb);
          for (int e = 0; e < SE; e++) memcpy(w + e * sb, (m ? x[e].w2 : x[e].w13).scales, sb);
          snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.%s_weight_scale", L, mat[m]);
          check_bytes(c, nm, w, SE * sb);
          for (int e = 0; e < SE; e++)
            memcpy(rs + e * rows, (m ? x[e].w2 : x[e].w13).row_scale, sizeof(float) * rows);
          snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.%s_row_scale", L, mat[m]);
          check_bytes(c, nm, rs, sizeof(float) * SE * rows);
        }
        free(w), free(rs);
      } else {
        mm_sm100_shape s;
        mm_sm100_canon cn;
        CHECK_OK(mm_sm100_canon_from_experts(x, SE, &s, &cn));
        mm_sm100_packed p = {malloc(mm_sm100_w13_bytes(&s)), malloc(4 * mm_sm100_s13_words(&s)),
                             malloc(mm_sm100_w2_bytes(&s)), malloc(4 * mm_sm100_s2_words(&s))};
        CHECK_OK(mm_sm100_export(&s, &cn, &p, 1));
        snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.sm100.w13", L);
        check_bytes(c, nm, p.w13, mm_sm100_w13_bytes(&s));
        snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.sm100.s13", L);
        check_bytes(c, nm, p.s13, 4 * mm_sm100_s13_words(&s));
        snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.sm100.w2", L);
        check_bytes(c, nm, p.w2, mm_sm100_w2_bytes(&s));
        snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.sm100.s2", L);
        check_bytes(c, nm, p.s2, 4 * mm_sm100_s2_words(&s));
        mm_sm100_canon_free(&cn);
        free(p.w13), free(p.s13), free(p.w2), free(p.s2);
      }
      for (int e = 0; e < SE; e++) mm_qmat_free(&x[e].w13), mm_qmat_free(&x[e].w2);
    }
    mm_st_ckpt_close(c);
    snprintf(nm, sizeof nm, "%s/config.json", dst);
    CHECK(access(nm, F_OK) == 0);
  }

  /* NVFP4 to the sm100 layout needs --requant. */
  snprintf(dst, sizeof dst, "%s/bad1", g_tmp);
  int rc = run(out, sizeof out, "%s convert --in %s --out %s --layout sm100-deepgemm", g_tool, in, dst);
  CHECK_MSG(rc == 1 && strstr(out, "--requant"), "rc %d: %s", rc, out);
  /* A NaN scale byte: exit 1 naming the tensor, no shard left behind. */
  for (int i = 0; i < g_nsyn; i++) free(g_syn[i].data);
  snprintf(in, sizeof in, "%s/ckpt_nan", g_tmp);
  make_ckpt(in);
  {
    char p[1024];
    mm_st_writer *w = NULL;
    CHECK_OK(mm_st_writer_new(&w));
    for (int i = 0; i < g_nsyn; i++) {
      if (g_syn[i].shard != 1) continue;
      if (!strcmp(g_syn[i].name, "model.layers.2.mlp.experts.5.up_proj.weight_scale"))
        ((uint8_t *)g_syn[i].data)[7] = 0x7F;
      CHECK_OK(mm_st_writer_add(w, g_syn[i].name, g_syn[i].dt, g_syn[i].ndim, g_syn[i].shape,
                                g_syn[i].data, g_syn[i].bytes));
    }
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", in);
    CHECK_OK(mm_st_writer_write(w, p));
    mm_st_writer_free(w);
  }
  snprintf(dst, sizeof dst, "%s/bad2", g_tmp);
  rc = run(out, sizeof out, "%s convert --in %s --out %s --layout canonical", g_tool, in, dst);
  CHECK_MSG(rc == 1 && strstr(out, "model.layers.2.mlp.experts.5.up_proj.weight_scale: NaN scale byte 0x7f"),
            "rc %d: %s", rc, out);
  for (int k = 1; k <= 2; k++) {
    snprintf(nm, sizeof nm, "%s/model-0000%d-of-00002.safetensors", dst, k);
    CHECK(access(nm, F_OK) != 0);
  }
  /* The requant error limit. */
  snprintf(dst, sizeof dst, "%s/bad3", g_tmp);
  rc = run(out, sizeof out, "%s convert --in %s/ckpt --out %s --layout canonical --requant --max-rel-error 0.02",
           g_tool, g_tmp, dst);
  CHECK_MSG(rc == 1 && strstr(out, "model.layers.1.mlp.experts.0.gate_proj: group16 -> group32"),
            "rc %d: %s", rc, out);
  /* Usage errors. */
  CHECK(run(out, sizeof out, "%s convert --in %s/ckpt --out %s --layout nope", g_tool, g_tmp, dst) == 2);
  CHECK(run(out, sizeof out, "%s frobnicate --in a --out b", g_tool) == 2);
  for (int i = 0; i < g_nsyn; i++) free(g_syn[i].data);
  g_nsyn = 0;
}

int main(void) {
  const char *b = getenv("MEGAMOE_BUILDDIR");
  snprintf(g_tool, sizeof g_tool, "%s/host/megamoe-prep", b ? b : ".");
  if (access(g_tool, X_OK) != 0) {
    printf("# %s not found\n", g_tool);
    return mm_test_skip_all("megamoe-prep not built");
  }
  snprintf(g_tmp, sizeof g_tmp, "/tmp/mm_prep_test_XXXXXX");
  if (!mkdtemp(g_tmp)) return mm_test_skip_all("no temp dir");
  mm_test_seed();
  RUN_GOLDEN(test_requant_golden);
  RUN_GOLDEN(test_sm100_golden);
  RUN(test_convert);
  nftw(g_tmp, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
  return mm_test_done();
}

/* test_synth.c -- runs megamoe-synth on small shapes and checks what it
 * wrote through the safetensors reader: names, shapes, dtypes, sharding,
 * determinism across thread counts, and that the quantized values look like
 * quantized Gaussians (no NaN scales, each group's largest code near 6). */
#include <dirent.h>
#include <errno.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "formats.h"
#include "harness.h"
#include "json.h"
#include "safetensors.h"

static char g_tmp[256], g_bin[1024];


/* Runs the tool with args; returns its exit status. Its output is echoed
 * as TAP comments. */
static int synth(const char *args) {
  char cmd[4096], log[300];
  snprintf(log, sizeof log, "%s/synth.log", g_tmp);
  snprintf(cmd, sizeof cmd, "'%s' --quiet %s >'%s' 2>&1", g_bin, args, log);
  int st = system(cmd);
  FILE *fp = fopen(log, "r");
  char line[512];
  while (fp && fgets(line, sizeof line, fp)) printf("#   %s", line);
  if (fp) fclose(fp);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void *read_all(const mm_st_ckpt *c, const char *name, size_t *n) {
  const mm_st_tensor *t;
  const mm_st_file *f;
  mm_err *e = mm_st_ckpt_get(c, name, &t, &f);
  if (e) {
    printf("# %s\n", e->message);
    mm_error_free(e);
    return NULL;
  }
  void *p = malloc(t->nbytes ? t->nbytes : 1);
  CHECK_OK(mm_st_read(f, t, p, (size_t)t->nbytes));
  if (n) *n = (size_t)t->nbytes;
  return p;
}

static int files_equal(const char *a, const char *b) {
  FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
  int eq = fa && fb;
  while (eq) {
    int x = fgetc(fa), y = fgetc(fb);
    if (x != y) eq = 0;
    if (x == EOF || y == EOF) break;
  }
  if (fa) fclose(fa);
  if (fb) fclose(fb);
  return eq;
}

typedef struct {
  int layers, first, experts, mxfp4, fast;
  int64_t hidden, inter;
} shape_t;

/* Checks every tensor of the checkpoint at dir against the shape. */
static void check_ckpt(const char *dir, const shape_t *s) {
  mm_st_ckpt *c = NULL;
  CHECK_OK(mm_st_ckpt_open(dir, &c));
  if (!c) return;
  int per_proj = s->mxfp4 ? 2 : 4, g = s->mxfp4 ? 32 : 16;
  CHECK_EQ_INT(mm_st_ckpt_count(c), (int64_t)s->layers * s->experts * 3 * per_proj);
  static const char *const projs[3] = {"gate", "up", "down"};
  int groups = 0, weak_groups = 0, nan_scales = 0, same_global = 0;
  double sum = 0, sum2 = 0, cnt = 0;
  for (int l = s->first; l < s->first + s->layers; l++)
    for (int e = 0; e < s->experts; e++) {
      float globals[3] = {0};
      for (int p = 0; p < 3; p++) {
        int64_t n = p < 2 ? s->inter : s->hidden, k = p < 2 ? s->hidden : s->inter;
        char name[200];
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s_proj.weight", l, e, projs[p]);
        const mm_st_tensor *tw = mm_st_ckpt_find(c, name, NULL);
        CHECK_MSG(tw && tw->dtype == MM_ST_U8 && tw->ndim == 2 && tw->shape[0] == n && tw->shape[1] == k / 2,
                  "%s", name);
        uint8_t *w = read_all(c, name, NULL);
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s_proj.weight_scale", l, e, projs[p]);
        const mm_st_tensor *ts = mm_st_ckpt_find(c, name, NULL);
        CHECK_MSG(ts && ts->dtype == (s->mxfp4 ? MM_ST_U8 : MM_ST_F8_E4M3) && ts->ndim == 2 && ts->shape[0] == n &&
                      ts->shape[1] == k / g,
                  "%s", name);
        uint8_t *sc = read_all(c, name, NULL);
        float global = 1.0f;
        if (!s->mxfp4) {
          snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s_proj.weight_scale_2", l, e, projs[p]);
          const mm_st_tensor *tg = mm_st_ckpt_find(c, name, NULL);
          CHECK_MSG(tg && tg->dtype == MM_ST_F32 && tg->ndim == 0, "%s", name);
          float *gp = read_all(c, name, NULL);
          if (gp) global = globals[p] = *gp;
          free(gp);
          CHECK(global > 1e-6f && global < 1e-3f);
          snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s_proj.input_scale", l, e, projs[p]);
          float *is = read_all(c, name, NULL);
          CHECK(is && *is > 1e-4f && *is < 0.1f);
          free(is);
        }
        for (int64_t r = 0; w && sc && r < n; r++)
          for (int64_t q = 0; q < k / g; q++) {
            uint8_t b = sc[r * (k / g) + q];
            if (s->mxfp4 ? b == 0xFF : mm_e4m3_is_nan(b)) nan_scales++;
            float scale = s->mxfp4 ? mm_ue8m0_to_float(b) : mm_e4m3_to_float(b) * global;
            int maxmag = 0;
            for (int64_t j = q * g; j < (q + 1) * g; j++) {
              uint8_t code = mm_fp4_get(w + r * (k / 2), (size_t)j);
              if ((code & 7) > maxmag) maxmag = code & 7;
              double v = (double)mm_e2m1_to_float(code) * scale;
              sum += v, sum2 += v * v, cnt++;
            }
            groups++;
            /* amax lands near 6 (NVFP4) or in (3, 6] (MXFP4) */
            if (!s->fast && maxmag < (s->mxfp4 ? 5 : 6)) weak_groups++;
          }
        free(w);
        free(sc);
      }
      if (!s->mxfp4 && globals[0] == globals[1]) same_global++;
    }
  CHECK_EQ_INT(nan_scales, 0);
  CHECK_MSG(weak_groups == 0, "%d of %d groups without a large code", weak_groups, groups);
  CHECK_EQ_INT(same_global, 0);
  double mean = sum / cnt, sd = sqrt(sum2 / cnt - mean * mean);
  printf("# %s: %d groups, dequant mean %.2e std %.4f\n", dir, groups, mean, sd);
  if (!s->fast) {
    CHECK(fabs(mean) < 2e-3);
    CHECK(sd > 0.014 && sd < 0.028);
  }
  mm_st_ckpt_close(c);
}

static void test_self_test(void) { CHECK_EQ_INT(synth("--self-test"), 0); }

static void test_nvfp4_deterministic(void) {
  shape_t s = {2, 3, 5, 0, 0, 256, 128};
  char a[512], b[512], args[1024], fa[600], fb[600];
  snprintf(a, sizeof a, "%s/nv1", g_tmp);
  snprintf(b, sizeof b, "%s/nv3", g_tmp);
  snprintf(args, sizeof args, "--out %s --layers 2 --first-layer 3 --experts 5 --hidden 256 --intermediate 128 --seed 7 --shard-mb 0 --threads 1", a);
  CHECK_EQ_INT(synth(args), 0);
  snprintf(args, sizeof args, "--out %s --layers 2 --first-layer 3 --experts 5 --hidden 256 --intermediate 128 --seed 7 --shard-mb 0 --threads 3", b);
  CHECK_EQ_INT(synth(args), 0);
  snprintf(fa, sizeof fa, "%s/model.safetensors", a);
  snprintf(fb, sizeof fb, "%s/model.safetensors", b);
  CHECK(files_equal(fa, fb));
  check_ckpt(a, &s);
  /* another seed gives other bytes */
  snprintf(args, sizeof args, "--out %s --layers 2 --first-layer 3 --experts 5 --hidden 256 --intermediate 128 --seed 8 --shard-mb 0", b);
  CHECK_EQ_INT(synth(args), 0);
  CHECK(!files_equal(fa, fb));
  /* config.json */
  snprintf(fa, sizeof fa, "%s/config.json", a);
  FILE *fp = fopen(fa, "rb");
  char text[4096] = {0};
  size_t n = fp ? fread(text, 1, sizeof text - 1, fp) : 0;
  if (fp) fclose(fp);
  mm_json_doc *doc = NULL;
  CHECK_OK(mm_json_parse(text, n, NULL, &doc));
  const mm_json *r = mm_json_root(doc);
  int64_t v;
  CHECK(mm_json_int64(mm_json_get(r, "hidden_size"), &v) && v == 256);
  CHECK(mm_json_int64(mm_json_get(r, "moe_intermediate_size"), &v) && v == 128);
  CHECK(mm_json_int64(mm_json_get(r, "n_routed_experts"), &v) && v == 5);
  CHECK(mm_json_int64(mm_json_get(r, "num_experts_per_tok"), &v) && v == 8);
  CHECK(mm_json_int64(mm_json_get(r, "num_hidden_layers"), &v) && v == 5);
  CHECK(mm_json_number(mm_json_get(r, "routed_scaling_factor")) == 2.5);
  mm_json_free(doc);
}

static void test_sharded_matches_single(void) {
  /* expert = 3 x (256*512/2 + 256*512/16 + 8) = 221208 bytes; 1 MB shards hold 4 */
  shape_t s = {2, 0, 9, 0, 0, 512, 256};
  char a[512], b[512], args[1024], p[700];
  snprintf(a, sizeof a, "%s/single", g_tmp);
  snprintf(b, sizeof b, "%s/sharded", g_tmp);
  snprintf(args, sizeof args, "--out %s --layers 2 --experts 9 --hidden 512 --intermediate 256 --seed 3 --shard-mb 0", a);
  CHECK_EQ_INT(synth(args), 0);
  snprintf(args, sizeof args, "--out %s --layers 2 --experts 9 --hidden 512 --intermediate 256 --seed 3 --shard-mb 1 --threads 2", b);
  CHECK_EQ_INT(synth(args), 0);
  snprintf(p, sizeof p, "%s/model.safetensors.index.json", b);
  CHECK(access(p, F_OK) == 0);
  snprintf(p, sizeof p, "%s/model-00005-of-00005.safetensors", b);
  CHECK(access(p, F_OK) == 0);
  snprintf(p, sizeof p, "%s/model.safetensors.index.json", a);
  CHECK(access(p, F_OK) != 0);
  check_ckpt(b, &s);
  mm_st_ckpt *ca = NULL, *cb = NULL;
  CHECK_OK(mm_st_ckpt_open(a, &ca));
  CHECK_OK(mm_st_ckpt_open(b, &cb));
  if (!ca || !cb) return;
  CHECK_EQ_INT(mm_st_ckpt_shard_count(cb), 5);
  CHECK_EQ_INT(mm_st_ckpt_count(ca), mm_st_ckpt_count(cb));
  int diff = 0;
  for (size_t i = 0; i < mm_st_ckpt_count(ca); i++) {
    const mm_st_tensor *t = mm_st_ckpt_tensor_at(ca, i, NULL);
    size_t na = 0, nb = 0;
    void *x = read_all(ca, t->name, &na), *y = read_all(cb, t->name, &nb);
    if (!x || !y || na != nb || memcmp(x, y, na) != 0) diff++;
    free(x);
    free(y);
  }
  CHECK_EQ_INT(diff, 0);
  mm_st_ckpt_close(ca);
  mm_st_ckpt_close(cb);
}

static void test_mxfp4(void) {
  shape_t s = {1, 0, 4, 1, 0, 256, 192};
  char a[512], args[1024];
  snprintf(a, sizeof a, "%s/mx", g_tmp);
  snprintf(args, sizeof args, "--out %s --layers 1 --experts 4 --hidden 256 --intermediate 192 --format mxfp4 --seed 1", a);
  CHECK_EQ_INT(synth(args), 0);
  check_ckpt(a, &s);
}

static void test_fast(void) {
  shape_t s = {1, 0, 3, 0, 1, 256, 128};
  char a[512], args[1024];
  snprintf(a, sizeof a, "%s/fast", g_tmp);
  snprintf(args, sizeof args, "--out %s --layers 1 --experts 3 --hidden 256 --intermediate 128 --fast", a);
  CHECK_EQ_INT(synth(args), 0);
  check_ckpt(a, &s);
  s.mxfp4 = 1;
  snprintf(args, sizeof args, "--out %s --layers 1 --experts 3 --hidden 256 --intermediate 128 --fast --format mxfp4", a);
  CHECK_EQ_INT(synth(args), 0);
  check_ckpt(a, &s);
}

static void test_bad_args(void) {
  char args[1024];
  CHECK_EQ_INT(synth("--layers 2"), 2); /* no --out */
  snprintf(args, sizeof args, "--out %s/x --hidden 100", g_tmp);
  CHECK_EQ_INT(synth(args), 2);
  snprintf(args, sizeof args, "--out %s/x --format fp8", g_tmp);
  CHECK_EQ_INT(synth(args), 2);
  snprintf(args, sizeof args, "--out %s/x --layers 0", g_tmp);
  CHECK_EQ_INT(synth(args), 2);
  snprintf(args, sizeof args, "--out %s/x --experts abc", g_tmp);
  CHECK_EQ_INT(synth(args), 2);
  CHECK_EQ_INT(synth("--out /proc/nope/x --experts 1 --hidden 32 --intermediate 32"), 1);
}

int main(void) {
  const char *bd = getenv("MEGAMOE_BUILDDIR");
  snprintf(g_bin, sizeof g_bin, "%s/host/megamoe-synth", bd && *bd ? bd : ".");
  if (access(g_bin, X_OK) != 0) {
    printf("Bail out! %s not built\n", g_bin);
    return 1;
  }
  const char *tmp = getenv("TMPDIR");
  snprintf(g_tmp, sizeof g_tmp, "%s/mm_synth_test_XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(g_tmp)) {
    printf("Bail out! mkdtemp: %s\n", strerror(errno));
    return 1;
  }
  RUN(test_self_test);
  RUN(test_nvfp4_deterministic);
  RUN(test_sharded_matches_single);
  RUN(test_mxfp4);
  RUN(test_fast);
  RUN(test_bad_args);
  mm_test_rm_tree(g_tmp);
  return mm_test_done();
}

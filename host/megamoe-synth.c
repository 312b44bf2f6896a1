/* megamoe-synth -- writes a synthetic FP4 MoE checkpoint (expert weights
 * only) with GLM-5 shapes by default, for loader and kernel tests without
 * the real 400 GB download.
 *
 * NVFP4 (ModelOpt naming), per layer L, expert E, proj in gate/up/down:
 *   model.layers.L.mlp.experts.E.P_proj.weight          U8 [N, K/2]  E2M1 codes
 *   model.layers.L.mlp.experts.E.P_proj.weight_scale    F8_E4M3 [N, K/16]
 *   model.layers.L.mlp.experts.E.P_proj.weight_scale_2  F32 []  per-tensor global
 *   model.layers.L.mlp.experts.E.P_proj.input_scale     F32 []
 * gate/up: [N, K] = [I, H]; down: [H, I]. MXFP4: weight and weight_scale
 * (U8 UE8M0 [N, K/32]) only.
 *
 * Values: Gaussian weights (std ~0.02, varied per tensor so gate and up get
 * different globals), clipped at 6 std; per group amax -> scale (E4M3 of
 * amax/6/global, or the UE8M0 power of two with amax/2^E <= 6), then E2M1
 * codes rounded to nearest even. --fast writes random codes and plausible
 * random scales instead. Every byte depends only on --seed and the shapes,
 * never on --threads. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "formats.h"
#include "parallel.h"
#include "safetensors.h"
#include "status.h"

/* ---- configuration --------------------------------------------------------- */

typedef struct {
  const char *out;
  int layers, first_layer, experts, threads, mxfp4, fast, quiet;
  int64_t hidden, inter;
  uint64_t seed, shard_bytes;
} synth_cfg;

static const char *const proj_names[3] = {"gate", "up", "down"};

/* One projection of one expert: where its bytes go inside the expert's
 * region of the data section, and its generation parameters. */
typedef struct {
  int64_t n, k;
  float sigma, global, input_scale;
  uint64_t seed;
  size_t off_w, off_s, off_g, off_i, nb_w, nb_s;
} synth_proj;

typedef struct {
  const synth_cfg *cfg;
  int group;            /* 16 (NVFP4) or 32 (MXFP4) */
  size_t expert_bytes;  /* all tensors of one expert */
  size_t proj_off[3];
} synth_layout;

/* ---- random numbers ---------------------------------------------------------- */

static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* splitmix64 stream: a counter through the mixer, cheap and splittable. */
typedef struct {
  uint64_t s;
} synth_rng;
static inline uint64_t rng_next(synth_rng *r) { return mix64(r->s += 0x9E3779B97F4A7C15ull); }
static inline float rng_uniform(synth_rng *r) { return (float)((rng_next(r) >> 40) * (1.0 / 16777216.0)); }

static uint64_t seed_of(uint64_t seed, uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t h = mix64(seed ^ 0x6D65676Dull);
  h = mix64(h ^ (a + 0x1000)), h = mix64(h ^ (b + 0x2000));
  h = mix64(h ^ (c + 0x3000)), h = mix64(h ^ (d + 0x4000));
  return h;
}

/* Standard normal by inverse CDF: a 65536-entry table of bin midpoints
 * for the body (z resolution ~1e-4, far below FP4 steps), the exact inverse
 * (Newton on erfc) for the two outer bins, |z| > 3.97. */
#define ICDF_BITS 16
#define ICDF_N (1 << ICDF_BITS)
static float icdf_table[ICDF_N];

static double norm_icdf(double u) {
  if (u > 0.5) return -norm_icdf(1.0 - u);
  /* Phi is convex left of 0: Newton from 0 converges monotonically. */
  double z = 0.0;
  for (int it = 0; it < 200; it++) {
    double cdf = 0.5 * erfc(-z / M_SQRT2), pdf = exp(-0.5 * z * z) / sqrt(2 * M_PI);
    double dz = (cdf - u) / pdf;
    z -= dz;
    if (fabs(dz) < 1e-12) break;
  }
  return z;
}

static void icdf_init(void) {
  for (int i = 0; i < ICDF_N; i++) icdf_table[i] = (float)norm_icdf(((double)i + 0.5) / ICDF_N);
}

static inline float gauss_from32(uint32_t r) {
  uint32_t i = r >> (32 - ICDF_BITS);
  if (__builtin_expect(i == 0 || i == ICDF_N - 1, 0))
    return (float)norm_icdf(((double)r + 0.5) * (1.0 / 4294967296.0));
  return icdf_table[i];
}

/* ---- quantization ------------------------------------------------------------ */

#define CLIP_SIGMAS 6.0f

/* E2M1 round to nearest even of x (already divided by its scale), the same
 * rule as mm_float_to_e2m1. Every rounding boundary is a multiple of 0.25,
 * so t = 4|x| (exact) splits into an integer part and "exactly on it":
 * e2m1_lut[2 * floor(t) + (t not an integer)]. */
static const uint8_t e2m1_lut[50] = {
    /* t = 0  (0,1) 1  (1,2) 2  (2,3) 3  (3,4) 4  (4,5) 5  (5,6) 6  (6,7) */
    0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3,
    /* 7  (7,8) 8  (8,9) 9  (9,10) 10 (10,11) 11 (11,12) 12 (12,13) 13 (13,14) */
    4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5,
    /* 14 (14,15) 15 .. 19 (19,20) */
    6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6,
    /* 20 (20,21) 21 .. 24 (24,..) */
    6, 7, 7, 7, 7, 7, 7, 7, 7, 7};

static inline uint8_t e2m1_rne(float x) {
  float t = fabsf(x) * 4.0f;
  t = t < 24.0f ? t : 24.0f; /* saturate at 6 (also maps NaN to 6) */
  int i = (int)t;
  uint8_t c = e2m1_lut[2 * i + (t != (float)i)];
  /* signs are random: keep this branch-free */
  return (uint8_t)(c | (((c != 0) & (x < 0.0f)) << 3));
}

/* Generates rows [r0, r1) of one projection: codes into w, scales into s. */
static void gen_rows(const synth_layout *lay, const synth_proj *p, int64_t r0, int64_t r1, uint8_t *w,
                     uint8_t *s) {
  const int g = lay->group;
  const int64_t kb = p->k / 2, ks = p->k / g;
  float v[32];
  for (int64_t r = r0; r < r1; r++) {
    synth_rng rng = {mix64(p->seed ^ ((uint64_t)r * 0xD1B54A32D192ED03ull))};
    uint8_t *wr = w + r * kb, *sr = s + r * ks;
    if (lay->cfg->fast) {
      for (int64_t j = 0; j < kb; j += 8) {
        uint64_t x = rng_next(&rng);
        int64_t m = kb - j < 8 ? kb - j : 8;
        memcpy(wr + j, &x, (size_t)m);
      }
      for (int64_t j = 0; j < ks; j++) {
        uint64_t x = rng_next(&rng);
        /* E4M3 32..448 (never 0x7F) / UE8M0 2^-8 .. 2^-6 */
        sr[j] = g == 16 ? (uint8_t)(0x60 + x % 31) : (uint8_t)(119 + x % 3);
      }
      continue;
    }
    const float clip = CLIP_SIGMAS * p->sigma;
    for (int64_t gi = 0; gi < ks; gi++) {
      uint32_t rb[32];
      for (int i = 0; i < g; i += 2) {
        uint64_t x = rng_next(&rng);
        rb[i] = (uint32_t)x;
        rb[i + 1] = (uint32_t)(x >> 32);
      }
      float amax = 0.0f;
      for (int i = 0; i < g; i++) {
        float a = p->sigma * gauss_from32(rb[i]);
        a = a > clip ? clip : a < -clip ? -clip : a;
        v[i] = a;
        float m = fabsf(a);
        amax = m > amax ? m : amax;
      }
      float scale;
      if (g == 16) {
        uint8_t sb = mm_float_to_e4m3(amax / 6.0f / p->global);
        sr[gi] = sb;
        scale = mm_e4m3_to_float(sb) * p->global;
      } else {
        int e = 0;
        if (amax > 0.0f) {
          float m = frexpf(amax / 6.0f, &e); /* amax/6 = m * 2^e, m in [0.5, 1) */
          if (m == 0.5f) e--;                /* smallest E with amax / 2^E <= 6 */
          if (e < -127) e = -127;
          if (e > 127) e = 127;
        }
        sr[gi] = (uint8_t)(amax > 0.0f ? e + 127 : 127);
        scale = amax > 0.0f ? ldexpf(1.0f, e) : 0.0f;
      }
      uint8_t *wg = wr + gi * (g / 2);
      if (scale > 0.0f) {
        uint8_t c[32];
        for (int i = 0; i < g; i++) c[i] = e2m1_rne(v[i] / scale);
        for (int i = 0; i < g; i += 2) wg[i / 2] = (uint8_t)(c[i] | (c[i + 1] << 4));
      } else {
        memset(wg, 0, (size_t)g / 2);
      }
    }
  }
}

/* ---- layout ------------------------------------------------------------------- */

static void layout_init(synth_layout *lay, const synth_cfg *cfg) {
  lay->cfg = cfg;
  lay->group = cfg->mxfp4 ? 32 : 16;
  size_t off = 0;
  for (int p = 0; p < 3; p++) {
    int64_t n = p < 2 ? cfg->inter : cfg->hidden, k = p < 2 ? cfg->hidden : cfg->inter;
    lay->proj_off[p] = off;
    off += (size_t)(n * k / 2) + (size_t)(n * k / lay->group) + (cfg->mxfp4 ? 0 : 8);
  }
  lay->expert_bytes = off;
}

static void proj_params(const synth_layout *lay, int layer, int expert, int p, synth_proj *out) {
  const synth_cfg *cfg = lay->cfg;
  memset(out, 0, sizeof(*out));
  out->n = p < 2 ? cfg->inter : cfg->hidden;
  out->k = p < 2 ? cfg->hidden : cfg->inter;
  out->seed = seed_of(cfg->seed, (uint64_t)layer, (uint64_t)expert, (uint64_t)p, 0);
  synth_rng r = {seed_of(cfg->seed, (uint64_t)layer, (uint64_t)expert, (uint64_t)p, 1)};
  /* std 0.02 * 2^[-0.3, 0.3): each tensor gets its own global scale */
  out->sigma = 0.02f * exp2f(rng_uniform(&r) * 0.6f - 0.3f);
  /* ModelOpt's global: amax / (6 * 448), amax = the clip point */
  out->global = CLIP_SIGMAS * out->sigma / (6.0f * 448.0f);
  if (cfg->fast) out->global = 0.02f * exp2f(rng_uniform(&r) * 0.6f - 0.3f) / 448.0f;
  /* gate and up read the same activations: one input scale per expert */
  synth_rng ri = {seed_of(cfg->seed, (uint64_t)layer, (uint64_t)expert, p == 2 ? 2u : 0u, 2)};
  out->input_scale = exp2f(rng_uniform(&ri) * 5.6f - 10.0f); /* ~1e-3 .. 5e-2 */
  out->nb_w = (size_t)(out->n * out->k / 2);
  out->nb_s = (size_t)(out->n * out->k / lay->group);
  out->off_w = lay->proj_off[p];
  out->off_s = out->off_w + out->nb_w;
  out->off_g = out->off_s + out->nb_s;
  out->off_i = out->off_g + 4;
}

static mm_err *declare_expert(const synth_layout *lay, mm_st_writer *w, int layer, int expert) {
  const synth_cfg *cfg = lay->cfg;
  char name[160];
  for (int p = 0; p < 3; p++) {
    int64_t n = p < 2 ? cfg->inter : cfg->hidden, k = p < 2 ? cfg->hidden : cfg->inter;
    int64_t sw[2] = {n, k / 2}, ss[2] = {n, k / lay->group};
#define NAME(field) \
  snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s_proj.%s", layer, expert, proj_names[p], field)
    NAME("weight");
    MM_TRY(mm_st_writer_add(w, name, MM_ST_U8, 2, sw, NULL, (uint64_t)(sw[0] * sw[1])));
    NAME("weight_scale");
    MM_TRY(mm_st_writer_add(w, name, cfg->mxfp4 ? MM_ST_U8 : MM_ST_F8_E4M3, 2, ss, NULL, (uint64_t)(ss[0] * ss[1])));
    if (!cfg->mxfp4) {
      NAME("weight_scale_2");
      MM_TRY(mm_st_writer_add(w, name, MM_ST_F32, 0, NULL, NULL, 4));
      NAME("input_scale");
      MM_TRY(mm_st_writer_add(w, name, MM_ST_F32, 0, NULL, NULL, 4));
    }
#undef NAME
  }
  return NULL;
}

/* ---- batch generation ----------------------------------------------------------- */

#define ROWS_PER_ITEM 32

typedef struct {
  const synth_layout *lay;
  uint8_t *buf;
  int64_t unit0;          /* first expert unit of the batch */
  int nunits;
  int64_t items_per_proj[3];
  int64_t items_per_unit;
} synth_batch;

static void unit_pos(const synth_cfg *cfg, int64_t unit, int *layer, int *expert) {
  *layer = cfg->first_layer + (int)(unit / cfg->experts);
  *expert = (int)(unit % cfg->experts);
}

static void batch_items(void *ctx, size_t begin, size_t end) {
  synth_batch *b = ctx;
  for (size_t it = begin; it < end; it++) {
    int64_t u = (int64_t)it / b->items_per_unit, rem = (int64_t)it % b->items_per_unit;
    int p = 0;
    while (rem >= b->items_per_proj[p]) rem -= b->items_per_proj[p++];
    int layer, expert;
    unit_pos(b->lay->cfg, b->unit0 + u, &layer, &expert);
    synth_proj pp;
    proj_params(b->lay, layer, expert, p, &pp);
    uint8_t *base = b->buf + (size_t)u * b->lay->expert_bytes;
    int64_t r0 = rem * ROWS_PER_ITEM, r1 = r0 + ROWS_PER_ITEM < pp.n ? r0 + ROWS_PER_ITEM : pp.n;
    gen_rows(b->lay, &pp, r0, r1, base + pp.off_w, base + pp.off_s);
  }
}

static void gen_batch(const synth_layout *lay, uint8_t *buf, int64_t unit0, int nunits, int threads) {
  const synth_cfg *cfg = lay->cfg;
  synth_batch b = {lay, buf, unit0, nunits, {0, 0, 0}, 0};
  for (int p = 0; p < 3; p++) {
    int64_t n = p < 2 ? cfg->inter : cfg->hidden;
    b.items_per_proj[p] = (n + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    b.items_per_unit += b.items_per_proj[p];
  }
  mm_parallel_for((size_t)(b.items_per_unit * nunits), threads, batch_items, &b);
  if (cfg->mxfp4) return;
  for (int u = 0; u < nunits; u++) {
    int layer, expert;
    unit_pos(cfg, unit0 + u, &layer, &expert);
    uint8_t *base = buf + (size_t)u * lay->expert_bytes;
    for (int p = 0; p < 3; p++) {
      synth_proj pp;
      proj_params(lay, layer, expert, p, &pp);
      memcpy(base + pp.off_g, &pp.global, 4); /* little-endian host */
      memcpy(base + pp.off_i, &pp.input_scale, 4);
    }
  }
}

/* ---- output: double-buffered writer thread -------------------------------------- */

typedef struct {
  mm_st_writer *w;      /* shard being written */
  const char *path;     /* its final path */
  const uint8_t *data;
  size_t n;
  int begin, finish;
  mm_err *err;
} synth_write_job;

static void write_job(void *arg) {
  synth_write_job *j = arg;
  j->err = NULL;
  if (j->begin) j->err = mm_st_writer_begin(j->w, j->path);
  if (!j->err) j->err = mm_st_writer_append(j->w, j->data, j->n);
  if (!j->err && j->finish) j->err = mm_st_writer_finish(j->w);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Writes text to path through a temporary and a rename. */
static mm_err *write_text_file(const char *path, const char *text) {
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *fp = fopen(tmp, "w");
  if (!fp) return mm_error(MEGAMOE_CODE_UNKNOWN, "%s: %s", tmp, strerror(errno));
  int bad = fputs(text, fp) < 0;
  bad |= fclose(fp) != 0;
  if (bad || rename(tmp, path) != 0) {
    unlink(tmp);
    return mm_error(MEGAMOE_CODE_UNKNOWN, "%s: write failed: %s", path, strerror(errno));
  }
  return NULL;
}

static char *shard_name(int i, int count) {
  char *s = malloc(64);
  if (!s) return NULL;
  if (count == 1) snprintf(s, 64, "model.safetensors");
  else snprintf(s, 64, "model-%05d-of-%05d.safetensors", i + 1, count);
  return s;
}

static mm_err *write_config(const synth_cfg *cfg) {
  char path[4096], text[2048];
  snprintf(path, sizeof path, "%s/config.json", cfg->out);
  snprintf(text, sizeof text,
           "{\n"
           "  \"model_type\": \"megamoe_synthetic\",\n"
           "  \"hidden_size\": %lld,\n"
           "  \"moe_intermediate_size\": %lld,\n"
           "  \"n_routed_experts\": %d,\n"
           "  \"num_experts_per_tok\": 8,\n"
           "  \"routed_scaling_factor\": 2.5,\n"
           "  \"num_hidden_layers\": %d,\n"
           "  \"quantization_config\": {\"quant_method\": \"%s\", \"quant_algo\": \"%s\", \"group_size\": %d},\n"
           "  \"megamoe_synth\": {\"seed\": %llu, \"first_layer\": %d, \"layers\": %d, \"fast\": %s}\n"
           "}\n",
           (long long)cfg->hidden, (long long)cfg->inter, cfg->experts, cfg->first_layer + cfg->layers,
           cfg->mxfp4 ? "mxfp4" : "modelopt", cfg->mxfp4 ? "MXFP4" : "NVFP4", cfg->mxfp4 ? 32 : 16,
           (unsigned long long)cfg->seed, cfg->first_layer, cfg->layers, cfg->fast ? "true" : "false");
  return write_text_file(path, text);
}

static mm_err *write_index(const synth_cfg *cfg, const synth_layout *lay, int64_t per_shard, int nshards,
                           uint64_t total_size) {
  char path[4096];
  snprintf(path, sizeof path, "%s/model.safetensors.index.json", cfg->out);
  if (nshards == 1) {
    unlink(path); /* a stale index would hide the single file */
    return NULL;
  }
  int64_t units = (int64_t)cfg->layers * cfg->experts;
  size_t cap = (size_t)units * (cfg->mxfp4 ? 6 : 12) * 140 + 256, len = 0;
  char *text = malloc(cap);
  if (!text) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of memory for the index");
  len += (size_t)snprintf(text + len, cap - len, "{\n  \"metadata\": {\"total_size\": %llu},\n  \"weight_map\": {",
                          (unsigned long long)total_size);
  static const char *const fields[4] = {"weight", "weight_scale", "weight_scale_2", "input_scale"};
  int first = 1;
  for (int64_t u = 0; u < units; u++) {
    int layer, expert;
    unit_pos(cfg, u, &layer, &expert);
    char *sn = shard_name((int)(u / per_shard), nshards);
    for (int p = 0; p < 3; p++)
      for (int f = 0; f < (cfg->mxfp4 ? 2 : 4); f++) {
        len += (size_t)snprintf(text + len, cap - len, "%s\n    \"model.layers.%d.mlp.experts.%d.%s_proj.%s\": \"%s\"",
                                first ? "" : ",", layer, expert, proj_names[p], fields[f], sn);
        first = 0;
      }
    free(sn);
  }
  snprintf(text + len, cap - len, "\n  }\n}\n");
  (void)lay;
  mm_err *err = write_text_file(path, text);
  free(text);
  return err;
}

static mm_err *run(const synth_cfg *cfg) {
  synth_layout lay;
  layout_init(&lay, cfg);
  int threads = mm_thread_count(cfg->threads);
  /* --fast is memory-bound: a few generator threads keep up with the disk
   * and leave the cores to the writer thread's copies into the page cache. */
  int gen_threads = cfg->fast ? (threads / 4 > 1 ? threads / 4 : 1) : threads;
  int64_t units = (int64_t)cfg->layers * cfg->experts;
  int64_t per_shard = cfg->shard_bytes ? (int64_t)(cfg->shard_bytes / lay.expert_bytes) : units;
  if (per_shard < 1) per_shard = 1;
  if (per_shard > units) per_shard = units;
  int nshards = (int)((units + per_shard - 1) / per_shard);
  /* batches of whole experts, ~256 MiB, inside one shard */
  int64_t per_batch = (int64_t)(((size_t)256 << 20) / lay.expert_bytes);
  if (per_batch < 1) per_batch = 1;
  size_t buf_bytes = (size_t)(per_batch < per_shard ? per_batch : per_shard) * lay.expert_bytes;
  uint8_t *bufs[2] = {malloc(buf_bytes), malloc(buf_bytes)};
  if (!bufs[0] || !bufs[1]) {
    free(bufs[0]);
    free(bufs[1]);
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of memory for 2 x %zu-byte buffers", buf_bytes);
  }
  icdf_init();
  uint64_t total = (uint64_t)units * lay.expert_bytes;
  if (!cfg->quiet)
    fprintf(stderr, "megamoe-synth: %s%s, %d layer(s) from %d, %d experts, H=%lld I=%lld: %.2f GB in %d shard(s), %d threads\n",
            cfg->mxfp4 ? "MXFP4" : "NVFP4", cfg->fast ? " (fast)" : "", cfg->layers, cfg->first_layer, cfg->experts,
            (long long)cfg->hidden, (long long)cfg->inter, (double)total / 1e9, nshards, threads);
  mm_err *err = NULL;
  mm_st_writer *writers[2] = {NULL, NULL};
  char *paths[2] = {NULL, NULL};
  synth_write_job job = {0};
  uv_thread_t tid;
  int busy = 0, k = 0;
  uint64_t done = 0;
  double t0 = now_s(), last = t0;
  int tty = isatty(2);
  for (int s = 0; s < nshards && !err; s++) {
    int slot = s & 1;
    /* the writer of shard s-2 is finished: its job was joined */
    mm_st_writer_free(writers[slot]);
    writers[slot] = NULL;
    free(paths[slot]);
    char *sn = shard_name(s, nshards);
    paths[slot] = sn ? malloc(strlen(cfg->out) + strlen(sn) + 2) : NULL;
    if (!paths[slot]) {
      free(sn);
      err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of memory");
      break;
    }
    sprintf(paths[slot], "%s/%s", cfg->out, sn);
    free(sn);
    MM_TRY_GOTO(mm_st_writer_new(&writers[slot]), err, stop);
    int64_t u0 = s * per_shard, u1 = u0 + per_shard < units ? u0 + per_shard : units;
    for (int64_t u = u0; u < u1 && !err; u++) {
      int layer, expert;
      unit_pos(cfg, u, &layer, &expert);
      err = declare_expert(&lay, writers[slot], layer, expert);
    }
    if (err) break;
    MM_TRY_GOTO(mm_st_writer_set_metadata(writers[slot], "format", "pt"), err, stop);
    for (int64_t b0 = u0; b0 < u1 && !err; b0 += per_batch) {
      int nb = (int)(b0 + per_batch < u1 ? per_batch : u1 - b0);
      uint8_t *buf = bufs[k++ & 1];
      gen_batch(&lay, buf, b0, nb, gen_threads);
      if (busy) {
        uv_thread_join(&tid);
        busy = 0;
        if ((err = job.err)) break;
      }
      job = (synth_write_job){writers[slot], paths[slot], buf, (size_t)nb * lay.expert_bytes, b0 == u0,
                              b0 + nb == u1, NULL};
      if (uv_thread_create(&tid, write_job, &job) == 0) {
        busy = 1;
      } else {
        write_job(&job);
        if ((err = job.err)) break;
      }
      done += job.n;
      double t = now_s();
      if (!cfg->quiet && (t - last > (tty ? 1.0 : 10.0))) {
        last = t;
        fprintf(stderr, "%smegamoe-synth: %5.1f%% %.2f of %.2f GB, %.0f MB/s%s", tty ? "\r" : "",
                100.0 * (double)done / (double)total, (double)done / 1e9, (double)total / 1e9,
                (double)done / 1e6 / (t - t0), tty ? "" : "\n");
      }
    }
  }
stop:
  if (busy) {
    uv_thread_join(&tid);
    if (!err) err = job.err;
    else mm_error_free(job.err);
  }
  if (!err) err = write_index(cfg, &lay, per_shard, nshards, total);
  if (!err) err = write_config(cfg);
  if (!err && !cfg->quiet) {
    double t = now_s() - t0;
    fprintf(stderr, "%smegamoe-synth: wrote %.2f GB in %.1f s (%.0f MB/s) to %s\n", tty ? "\r" : "",
            (double)total / 1e9, t, (double)total / 1e6 / (t > 0 ? t : 1), cfg->out);
  }
  mm_st_writer_free(writers[0]);
  mm_st_writer_free(writers[1]);
  free(paths[0]);
  free(paths[1]);
  free(bufs[0]);
  free(bufs[1]);
  return err;
}

/* ---- self test (for tests/test_synth) ---------------------------------------------- */

/* The table-driven rounding against the library's reference, and the normal
 * sampler's moments. Returns the number of failures. */
static int self_test(void) {
  int bad = 0;
  for (int i = -8 * 256; i <= 8 * 256; i++) {
    float x = (float)i / 256.0f;
    for (int d = -1; d <= 1; d++) {
      float y = d < 0 ? nextafterf(x, -INFINITY) : d > 0 ? nextafterf(x, INFINITY) : x;
      if (e2m1_rne(y) != mm_float_to_e2m1(y)) {
        if (bad++ < 5) fprintf(stderr, "self-test: e2m1(%a) = %d, reference %d\n", y, e2m1_rne(y), mm_float_to_e2m1(y));
      }
    }
  }
  synth_rng r = {12345};
  for (int i = 0; i < 1000000; i++) {
    uint32_t u = (uint32_t)rng_next(&r);
    float y;
    memcpy(&y, &u, 4);
    if (isnan(y)) continue;
    if (e2m1_rne(y) != mm_float_to_e2m1(y) && bad++ < 5)
      fprintf(stderr, "self-test: e2m1(%a) = %d, reference %d\n", y, e2m1_rne(y), mm_float_to_e2m1(y));
  }
  icdf_init();
  double s1 = 0, s2 = 0, s4 = 0, mx = 0;
  const int n = 4000000;
  for (int i = 0; i < n; i++) {
    double z = gauss_from32((uint32_t)rng_next(&r));
    s1 += z, s2 += z * z, s4 += z * z * z * z;
    if (fabs(z) > mx) mx = fabs(z);
  }
  double mean = s1 / n, var = s2 / n - mean * mean, kurt = s4 / n / (var * var);
  fprintf(stderr, "self-test: normal mean %.4f var %.4f kurtosis %.3f max %.2f\n", mean, var, kurt, mx);
  if (fabs(mean) > 0.005 || fabs(var - 1) > 0.01 || fabs(kurt - 3) > 0.05 || mx < 4.5) bad++;
  for (int i = 0; i + 1 < ICDF_N; i++)
    if (!(icdf_table[i] < icdf_table[i + 1])) bad++;
  return bad;
}

/* ---- command line ----------------------------------------------------------------- */

static void usage(FILE *fp) {
  fprintf(fp,
          "usage: megamoe-synth --out DIR [options]\n"
          "Writes a synthetic FP4 MoE checkpoint (expert weights) into DIR.\n"
          "  --layers N         layers to write (default 2)\n"
          "  --first-layer L    index of the first layer (default 0)\n"
          "  --hidden H         hidden size (default 6144)\n"
          "  --intermediate I   expert intermediate size (default 2048)\n"
          "  --experts E        experts per layer (default 256)\n"
          "  --format F         nvfp4 (default) or mxfp4\n"
          "  --seed S           random seed (default 0)\n"
          "  --shard-mb M       shard size limit in MB (default 4096; 0 = one file)\n"
          "  --threads N        generator threads (default: all cores)\n"
          "  --fast             random codes and scales (disk speed)\n"
          "  --quiet            no progress output\n");
}

static int parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 0);
  if (errno || end == s || *end || v < lo || v > hi) return 0;
  *out = v;
  return 1;
}

int main(int argc, char **argv) {
  synth_cfg cfg = {.out = NULL, .layers = 2, .first_layer = 0, .experts = 256, .threads = 0,
                   .hidden = 6144, .inter = 2048, .seed = 0, .shard_bytes = (uint64_t)4096 << 20};
  static const struct option opts[] = {
      {"out", required_argument, 0, 'o'},          {"layers", required_argument, 0, 'l'},
      {"first-layer", required_argument, 0, 'L'},  {"hidden", required_argument, 0, 'H'},
      {"intermediate", required_argument, 0, 'I'}, {"experts", required_argument, 0, 'E'},
      {"format", required_argument, 0, 'f'},       {"seed", required_argument, 0, 's'},
      {"shard-mb", required_argument, 0, 'm'},     {"threads", required_argument, 0, 't'},
      {"fast", no_argument, 0, 'F'},               {"quiet", no_argument, 0, 'q'},
      {"help", no_argument, 0, 'h'},               {"self-test", no_argument, 0, 'T'},
      {0, 0, 0, 0}};
  int c;
  int64_t v;
  while ((c = getopt_long(argc, argv, "o:h", opts, NULL)) != -1) {
    int ok = 1;
    switch (c) {
      case 'o': cfg.out = optarg; break;
      case 'l': ok = parse_i64(optarg, 1, 100000, &v), cfg.layers = (int)v; break;
      case 'L': ok = parse_i64(optarg, 0, 100000, &v), cfg.first_layer = (int)v; break;
      case 'H': ok = parse_i64(optarg, 32, 1 << 20, &v), cfg.hidden = v; break;
      case 'I': ok = parse_i64(optarg, 32, 1 << 20, &v), cfg.inter = v; break;
      case 'E': ok = parse_i64(optarg, 1, 1 << 20, &v), cfg.experts = (int)v; break;
      case 's': ok = parse_i64(optarg, 0, INT64_MAX, &v), cfg.seed = (uint64_t)v; break;
      case 'm': ok = parse_i64(optarg, 0, (int64_t)1 << 30, &v), cfg.shard_bytes = (uint64_t)v << 20; break;
      case 't': ok = parse_i64(optarg, 0, 1024, &v), cfg.threads = (int)v; break;
      case 'F': cfg.fast = 1; break;
      case 'q': cfg.quiet = 1; break;
      case 'f':
        if (!strcmp(optarg, "nvfp4")) cfg.mxfp4 = 0;
        else if (!strcmp(optarg, "mxfp4")) cfg.mxfp4 = 1;
        else ok = 0;
        break;
      case 'h': usage(stdout); return 0;
      case 'T': return self_test() ? 1 : 0;
      default: usage(stderr); return 2;
    }
    if (!ok) {
      fprintf(stderr, "megamoe-synth: bad value '%s' for --%s\n", optarg,
              c == 'l' ? "layers" : c == 'L' ? "first-layer" : c == 'H' ? "hidden" : c == 'I' ? "intermediate"
              : c == 'E' ? "experts" : c == 's' ? "seed" : c == 'm' ? "shard-mb" : c == 't' ? "threads" : "format");
      return 2;
    }
  }
  if (optind != argc || !cfg.out || !*cfg.out) {
    usage(stderr);
    return 2;
  }
  if (cfg.hidden % 32 || cfg.inter % 32) {
    fprintf(stderr, "megamoe-synth: --hidden and --intermediate must be multiples of 32\n");
    return 2;
  }
  if (mkdir(cfg.out, 0755) != 0 && errno != EEXIST) {
    fprintf(stderr, "megamoe-synth: mkdir %s: %s\n", cfg.out, strerror(errno));
    return 1;
  }
  mm_err *err = run(&cfg);
  if (err) {
    fprintf(stderr, "\nmegamoe-synth: %s: %s\n", mm_code_name(err->code), err->message);
    mm_error_free(err);
    return 1;
  }
  return 0;
}

/* megamoe-host -- the reference host: loads plugins through the C ABI the way
 * an engine does, validates configs, loads a safetensors checkpoint layer by
 * layer, runs forward passes on every visible GPU (one worker thread per
 * rank, libuv threads and barriers, an in-process key-value store for the
 * NCCL bootstrap), checks sampled tokens against the cpu-reference backend
 * and prints timings.
 *
 *   megamoe-host --plugin PATH --config FILE --validate [--set KEY=VALUE ...]
 *   megamoe-host --plugin-dir DIR --list
 *   megamoe-host --plugin PATH --config FILE --checkpoint CKPT [--world N]
 *                [--layers N] [--tokens T[,T...]] [--iters N] [--check-tokens S]
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#ifdef MM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "formats.h"
#include "kv_store.h"
#include "megamoe_plugin.h"
#include "plugin_loader.h"
#include "safetensors.h"

#define MAX_SETS 64
#define MAX_TOKEN_SIZES 8
#define MAX_RANKS 64

typedef struct {
  const char *plugin, *plugin_dir, *config, *checkpoint;
  int validate, list, world, layers, iters, warmup, check_tokens, seed, force_cpu;
  int tokens[MAX_TOKEN_SIZES], num_tokens;
  double tolerance;
  megamoe_kv sets[MAX_SETS];
  int num_sets;
} host_options;

static host_options opt = {.world = 0, .layers = 0, .iters = 10, .warmup = 3, .check_tokens = 8,
                           .seed = 1, .tolerance = 2e-2};
static mm_kv_store *g_kv;
static const megamoe_op_api *g_api;
/* An abortable barrier: a rank that fails releases the others. */
static uv_mutex_t g_bar_lock;
static uv_cond_t g_bar_cond;
static int g_bar_count, g_bar_gen, g_bar_abort, g_bar_parties;
static int g_failed;
static uv_mutex_t g_print_lock;

static void usage(void) {
  fprintf(stderr,
          "usage: megamoe-host (--plugin PATH | --plugin-dir DIR) [--list]\n"
          "       [--config FILE] [--validate] [--set KEY=VALUE]...\n"
          "       [--checkpoint CKPT] [--world N] [--layers N] [--tokens T[,T...]]\n"
          "       [--iters N] [--warmup N] [--check-tokens S] [--tolerance X] [--seed N] [--cpu]\n"
          "MEGAMOE_PLUGIN_PATH (colon-separated directories) is scanned when no --plugin is given.\n");
}

/* ---- host services ---------------------------------------------------------- */
static void host_log(void *ctx, megamoe_log_level level, const char *msg) {
  static const char *names[] = {"error", "warn", "info", "debug"};
  uv_mutex_lock(&g_print_lock);
  fprintf(stderr, "[plugin %s] %s\n", names[level <= 3 ? level : 3], msg);
  uv_mutex_unlock(&g_print_lock);
}
static int host_kv_put(void *ctx, const char *key, const void *v, size_t len) {
  return mm_kv_store_put(g_kv, key, v, len);
}
static int host_kv_get(void *ctx, const char *key, void *v, size_t cap, size_t *len, int ms) {
  return mm_kv_store_get(g_kv, key, v, cap, len, ms);
}

/* ---- small helpers ------------------------------------------------------------ */
static int report(megamoe_error *err, const char *what) {
  if (!err) return 0;
  uv_mutex_lock(&g_print_lock);
  fprintf(stderr, "%s%s%s\n", what ? what : "", what ? ": " : "", megamoe_error_message(err));
  uv_mutex_unlock(&g_print_lock);
  megamoe_error_destroy(err);
  return 1;
}

/* Returns 0 when all ranks arrived, -1 when a rank aborted. */
static int sync_ranks(void) {
  uv_mutex_lock(&g_bar_lock);
  int gen = g_bar_gen;
  if (++g_bar_count == g_bar_parties) {
    g_bar_count = 0;
    g_bar_gen++;
    uv_cond_broadcast(&g_bar_cond);
  } else {
    while (gen == g_bar_gen && !g_bar_abort) uv_cond_wait(&g_bar_cond, &g_bar_lock);
  }
  int r = g_bar_abort ? -1 : 0;
  uv_mutex_unlock(&g_bar_lock);
  return r;
}
static void abort_ranks(void) {
  uv_mutex_lock(&g_bar_lock);
  g_bar_abort = 1;
  uv_cond_broadcast(&g_bar_cond);
  uv_mutex_unlock(&g_bar_lock);
}

static double now_s(void) { return (double)uv_hrtime() * 1e-9; }

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The DLPack type of a safetensors dtype, faithfully: a dtype the plugin
 * does not take must reach it as what it is (and be refused by name), never
 * relabelled as bytes; F4 is 4 bits per element (the shape counts elements). */
static DLDataType dl_type(mm_st_dtype dt) {
  DLDataType t = {kDLUInt, 8, 1};
  switch (dt) {
    case MM_ST_U8: break;
    case MM_ST_BOOL: t.code = 6; break;           /* kDLBool (DLPack >= 0.8) */
    case MM_ST_I8: t.code = kDLInt; break;
    case MM_ST_U16: t.bits = 16; break;
    case MM_ST_I16: t.code = kDLInt; t.bits = 16; break;
    case MM_ST_U32: t.bits = 32; break;
    case MM_ST_I32: t.code = kDLInt; t.bits = 32; break;
    case MM_ST_U64: t.bits = 64; break;
    case MM_ST_I64: t.code = kDLInt; t.bits = 64; break;
    case MM_ST_F16: t.code = kDLFloat; t.bits = 16; break;
    case MM_ST_BF16: t.code = kDLBfloat; t.bits = 16; break;
    case MM_ST_F32: t.code = kDLFloat; t.bits = 32; break;
    case MM_ST_F64: t.code = kDLFloat; t.bits = 64; break;
    case MM_ST_C64: t.code = kDLComplex; t.bits = 64; break;
    case MM_ST_F8_E4M3: t.code = MEGAMOE_DL_FLOAT8_E4M3FN; break;
    case MM_ST_F8_E8M0: t.code = MEGAMOE_DL_FLOAT8_E8M0FNU; break;
    case MM_ST_F4: t.code = MEGAMOE_DL_FLOAT4_E2M1FN; t.bits = 4; break;
    case MM_ST_F8_E5M2: t.code = 12; break;      /* DLPack 1.1 kDLFloat8_e5m2 */
    case MM_ST_F8_E4M3FNUZ: t.code = 11; break;  /* kDLFloat8_e4m3fnuz */
    case MM_ST_F8_E5M2FNUZ: t.code = 13; break;  /* kDLFloat8_e5m2fnuz */
    case MM_ST_F6_E2M3: t.code = 15; t.bits = 6; break;
    case MM_ST_F6_E3M2: t.code = 16; t.bits = 6; break;
    default: t.code = kDLOpaqueHandle; break;
  }
  return t;
}

static megamoe_op_create_args create_args(int rank, int device) {
  megamoe_op_create_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = MEGAMOE_OP_CREATE_ARGS_STRUCT_SIZE;
  a.config_path = opt.config;
  a.overrides = opt.sets;
  a.num_overrides = (size_t)opt.num_sets;
  a.rank = rank;
  a.device = device;
  return a;
}

static int cmp_int(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

/* Layer indices present in the checkpoint ("model.layers.N.mlp.experts."). */
static int find_layers(const mm_st_ckpt *ck, int *layers, int cap) {
  int n = 0;
  for (size_t i = 0; i < mm_st_ckpt_count(ck); i++) {
    const mm_st_tensor *t = mm_st_ckpt_tensor_at(ck, i, NULL);
    int l;
    if (sscanf(t->name, "model.layers.%d.mlp.experts.", &l) != 1) continue;
    int seen = 0;
    for (int j = 0; j < n && !seen; j++) seen = layers[j] == l;
    if (!seen && n < cap) layers[n++] = l;
  }
  qsort(layers, (size_t)n, sizeof *layers, cmp_int);
  return n;
}

/* Reads the tensors of experts [first, first+n) of checkpoint layer `cl` and
 * hands them to prepare_weights as host DLTensors (layer slot `slot`). */
static megamoe_error *load_layer(megamoe_op *op, const mm_st_ckpt *ck, int cl, int slot, int first,
                                 int n, double *bytes) {
  static const char *projs[3] = {"gate", "up", "down"};
  static const char *sufs[4] = {"weight", "weight_scale", "weight_scale_2", "input_scale"};
  size_t cap = (size_t)n * 12, count = 0;
  megamoe_named_tensor *nt = calloc(cap, sizeof *nt);
  DLTensor *dl = calloc(cap, sizeof *dl);
  int64_t(*shapes)[MM_ST_MAX_DIMS] = calloc(cap, sizeof *shapes);
  char(*names)[96] = calloc(cap, sizeof *names);
  void **bufs = calloc(cap, sizeof *bufs);
  megamoe_error *err = NULL;
  if (!nt || !dl || !shapes || !names || !bufs) {
    err = NULL;
    fprintf(stderr, "megamoe-host: out of memory loading layer %d\n", cl);
    g_failed = 1;
    goto done;
  }
  for (int e = first; e < first + n; e++)
    for (int p = 0; p < 3; p++)
      for (int s = 0; s < 4; s++) {
        char full[160];
        snprintf(full, sizeof full, "model.layers.%d.mlp.experts.%d.%s_proj.%s", cl, e, projs[p],
                 sufs[s]);
        const mm_st_file *f;
        const mm_st_tensor *t = mm_st_ckpt_find(ck, full, &f);
        if (!t) continue; /* the op names what is missing */
        if (t->ndim > 4) continue;
        bufs[count] = malloc(t->nbytes ? t->nbytes : 1);
        if (!bufs[count]) {
          fprintf(stderr, "megamoe-host: out of memory reading %s\n", full);
          g_failed = 1;
          goto done;
        }
        megamoe_error *re = mm_st_read(f, t, bufs[count], t->nbytes);
        if (re) {
          err = re;
          goto done;
        }
        *bytes += (double)t->nbytes;
        snprintf(names[count], sizeof names[count], "experts.%d.%s_proj.%s", e, projs[p], sufs[s]);
        for (int d = 0; d < t->ndim; d++) shapes[count][d] = t->shape[d];
        dl[count].data = bufs[count];
        dl[count].device.device_type = kDLCPU;
        dl[count].ndim = t->ndim;
        dl[count].dtype = dl_type(t->dtype);
        dl[count].shape = shapes[count];
        nt[count].name = names[count];
        nt[count].tensor = &dl[count];
        count++;
      }
  megamoe_op_prepare_args pa;
  memset(&pa, 0, sizeof pa);
  pa.struct_size = MEGAMOE_OP_PREPARE_ARGS_STRUCT_SIZE;
  pa.op = op;
  pa.layer = slot;
  pa.tensors = nt;
  pa.num_tensors = count;
  err = g_api->prepare_weights(&pa);
done:
  for (size_t i = 0; bufs && i < count + 1 && i < cap; i++) free(bufs[i]);
  free(nt);
  free(dl);
  free(shapes);
  free(names);
  free(bufs);
  return err;
}

/* ---- one rank ---------------------------------------------------------------- */
typedef struct {
  int rank, device;
  const mm_st_ckpt *ck;
  const int *layers;
  int num_layers;
  int H, K, E;
  /* results */
  int ok;
  double prepare_s, load_bytes;
  uint64_t plan_device_bytes;
  double median_ms[MAX_TOKEN_SIZES];
  /* inputs/outputs of the first token size at layer 0, for the check */
  int T0;
  uint16_t *hidden, *out;
  int32_t *ids;
  float *weights;
} rank_work;

static void make_inputs(rank_work *w, int T) {
  uint64_t st = (uint64_t)opt.seed * 1000003u + (uint64_t)w->rank * 7919u + (uint64_t)T;
#define NEXT() (st = st * 6364136223846793005ull + 1442695040888963407ull, (uint32_t)(st >> 33))
  for (size_t i = 0; i < (size_t)T * w->H; i++) {
    float u1 = ((float)NEXT() + 1.0f) / 2147483649.0f, u2 = (float)NEXT() / 2147483648.0f;
    w->hidden[i] = mm_float_to_bf16(sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2));
  }
  for (int t = 0; t < T; t++) {
    float sum = 0;
    for (int k = 0; k < w->K; k++) {
      int id, dup;
      do { /* distinct experts per token, like a real router */
        id = (int)(NEXT() % (uint32_t)w->E);
        dup = 0;
        for (int j = 0; j < k; j++) dup |= w->ids[t * w->K + j] == id;
      } while (dup && w->K <= w->E);
      w->ids[t * w->K + k] = id;
      w->weights[t * w->K + k] = 0.1f + (float)NEXT() / 2147483648.0f;
      sum += w->weights[t * w->K + k];
    }
    for (int k = 0; k < w->K; k++) w->weights[t * w->K + k] /= sum;
  }
#undef NEXT
}

static void dl2(DLTensor *t, void *data, int64_t *shape, int64_t a, int64_t b, DLDataType ty,
                int device) {
  memset(t, 0, sizeof *t);
  shape[0] = a;
  shape[1] = b;
  t->data = data;
  t->ndim = 2;
  t->shape = shape;
  t->dtype = ty;
  t->device.device_type = device >= 0 ? kDLCUDA : kDLCPU;
  t->device.device_id = device >= 0 ? device : 0;
}

/* One execute on tensors at `device` (-1 = host) holding T tokens. */
static megamoe_error *run_execute(const rank_work *w, megamoe_op *op, int layer, int T, void *h,
                                  void *ids, void *wt, void *out) {
  DLTensor th, ti, tw, to;
  int64_t sh[2], si[2], sw[2], so[2];
  dl2(&th, h, sh, T, w->H, (DLDataType){kDLBfloat, 16, 1}, w->device);
  dl2(&ti, ids, si, T, w->K, (DLDataType){kDLInt, 32, 1}, w->device);
  dl2(&tw, wt, sw, T, w->K, (DLDataType){kDLFloat, 32, 1}, w->device);
  dl2(&to, out, so, T, w->H, (DLDataType){kDLBfloat, 16, 1}, w->device);
  megamoe_op_execute_args ea;
  memset(&ea, 0, sizeof ea);
  ea.struct_size = MEGAMOE_OP_EXECUTE_ARGS_STRUCT_SIZE;
  ea.op = op;
  ea.layer = layer;
  ea.hidden = &th;
  ea.topk_ids = &ti;
  ea.topk_weights = &tw;
  ea.out = &to;
  return g_api->execute(&ea);
}

static int device_sync(int device) {
#ifdef MM_HAVE_CUDA
  if (device >= 0) {
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      fprintf(stderr, "megamoe-host: device %d: %s\n", device, cudaGetErrorString(e));
      return 1;
    }
  }
#endif
  return 0;
}

/* Buffers on the rank's device (or host); copies in from host arrays. */
static void *dev_alloc(int device, size_t bytes, const void *src) {
  bytes = bytes ? bytes : 16;
#ifdef MM_HAVE_CUDA
  if (device >= 0) {
    void *p = NULL;
    if (cudaMalloc(&p, bytes) != cudaSuccess) return NULL;
    if (src && cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
      cudaFree(p);
      return NULL;
    }
    if (!src) cudaMemset(p, 0xFF, bytes); /* poison */
    return p;
  }
#endif
  void *p = malloc(bytes);
  if (p) {
    if (src) memcpy(p, src, bytes);
    else memset(p, 0xFF, bytes);
  }
  return p;
}
static void dev_free(int device, void *p) {
#ifdef MM_HAVE_CUDA
  if (device >= 0) {
    cudaFree(p);
    return;
  }
#endif
  free(p);
}
static int dev_to_host(int device, void *dst, const void *src, size_t bytes) {
#ifdef MM_HAVE_CUDA
  if (device >= 0) return cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost) != cudaSuccess;
#endif
  memcpy(dst, src, bytes);
  return 0;
}

static void rank_main(void *arg) {
  rank_work *w = arg;
  megamoe_op *op = NULL;
  void *dh = NULL, *di = NULL, *dw = NULL, *dout = NULL;
#ifdef MM_HAVE_CUDA
  if (w->device >= 0 && cudaSetDevice(w->device) != cudaSuccess) {
    fprintf(stderr, "rank %d: cannot use CUDA device %d\n", w->rank, w->device);
    goto fail;
  }
#endif
  megamoe_op_create_args ca = create_args(w->rank, w->device);
  if (report(g_api->create(&ca), "create")) goto fail;
  op = ca.op;
  megamoe_op_info_args info;
  memset(&info, 0, sizeof info);
  info.struct_size = MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE;
  info.op = op;
  if (report(g_api->get_info(&info), "get_info")) goto fail;
  double t0 = now_s();
  for (int l = 0; l < w->num_layers; l++) {
    char what[64];
    snprintf(what, sizeof what, "rank %d: layer %d", w->rank, w->layers[l]);
    if (report(load_layer(op, w->ck, w->layers[l], l, info.first_local_expert,
                          info.num_local_experts, &w->load_bytes),
               what))
      goto fail;
    if (w->rank == 0)
      fprintf(stderr, "megamoe-host: prepared layer %d/%d (%.1f GB read, %.1f s)\n", l + 1,
              w->num_layers, w->load_bytes / 1e9, now_s() - t0);
  }
  w->prepare_s = now_s() - t0;
  int Tmax = 0;
  for (int i = 0; i < opt.num_tokens; i++) Tmax = opt.tokens[i] > Tmax ? opt.tokens[i] : Tmax;
  megamoe_op_plan_args pl;
  memset(&pl, 0, sizeof pl);
  pl.struct_size = MEGAMOE_OP_PLAN_ARGS_STRUCT_SIZE;
  pl.op = op;
  pl.max_tokens_per_rank = Tmax;
  if (report(g_api->plan(&pl), "plan")) goto fail;
  w->plan_device_bytes = pl.device_bytes;
  w->hidden = malloc(sizeof(uint16_t) * (size_t)Tmax * w->H + 2);
  w->out = malloc(sizeof(uint16_t) * (size_t)Tmax * w->H + 2);
  w->ids = malloc(sizeof(int32_t) * (size_t)Tmax * w->K + 4);
  w->weights = malloc(sizeof(float) * (size_t)Tmax * w->K + 4);
  if (!w->hidden || !w->out || !w->ids || !w->weights) goto fail;
  for (int ti = 0; ti < opt.num_tokens; ti++) {
    int T = opt.tokens[ti];
    make_inputs(w, T);
    dh = dev_alloc(w->device, sizeof(uint16_t) * (size_t)T * w->H, w->hidden);
    di = dev_alloc(w->device, sizeof(int32_t) * (size_t)T * w->K, w->ids);
    dw = dev_alloc(w->device, sizeof(float) * (size_t)T * w->K, w->weights);
    dout = dev_alloc(w->device, sizeof(uint16_t) * (size_t)T * w->H, NULL);
    if (!dh || !di || !dw || !dout) {
      fprintf(stderr, "rank %d: out of memory for %d tokens\n", w->rank, T);
      goto fail;
    }
    double times[1024];
    int iters = opt.iters < 1024 ? opt.iters : 1024;
    for (int it = -opt.warmup; it < iters; it++) {
      if (sync_ranks()) goto fail; /* ranks execute together, as in serving */
      double s = now_s();
      for (int l = 0; l < w->num_layers; l++)
        if (report(run_execute(w, op, l, T, dh, di, dw, dout), "execute")) goto fail;
      if (device_sync(w->device)) goto fail;
      if (it >= 0) times[it] = (now_s() - s) / w->num_layers;
      if (it == -opt.warmup && ti == 0) {
        /* keep layer-0 output of the first size for the reference check */
        if (report(run_execute(w, op, 0, T, dh, di, dw, dout), "execute")) goto fail;
        if (device_sync(w->device) ||
            dev_to_host(w->device, w->out, dout, sizeof(uint16_t) * (size_t)T * w->H))
          goto fail;
        w->T0 = T;
      }
    }
    qsort(times, (size_t)iters, sizeof(double), cmp_double);
    w->median_ms[ti] = iters ? times[iters / 2] * 1e3 : 0;
    dev_free(w->device, dh);
    dev_free(w->device, di);
    dev_free(w->device, dw);
    dev_free(w->device, dout);
    dh = di = dw = dout = NULL;
  }
  make_inputs(w, w->T0); /* the check needs the first size's inputs back */
  w->ok = 1;
  goto done;
fail:
  g_failed = 1;
  abort_ranks(); /* release ranks waiting at the barrier */
done:
  dev_free(w->device, dh);
  dev_free(w->device, di);
  dev_free(w->device, dw);
  dev_free(w->device, dout);
  if (op) {
    megamoe_op_destroy_args da = {MEGAMOE_OP_DESTROY_ARGS_STRUCT_SIZE, NULL, op};
    report(g_api->destroy(&da), "destroy");
  }
}

/* ---- reference check ---------------------------------------------------------- */
/* Runs the cpu-reference backend (ep-size 1, every expert) on check_tokens
 * sampled tokens of every rank at layer 0 and compares with the run's output. */
static int check_against_reference(rank_work *ranks, int world, const mm_st_ckpt *ck, int layer0,
                                   double *worst_rel) {
  megamoe_kv sets[MAX_SETS + 2];
  int n = 0;
  for (int i = 0; i < opt.num_sets; i++)
    if (strcmp(opt.sets[i].key, "ep-size") && strcmp(opt.sets[i].key, "backend"))
      sets[n++] = opt.sets[i];
  sets[n++] = (megamoe_kv){"backend", "cpu-reference"};
  sets[n++] = (megamoe_kv){"ep-size", "1"};
  megamoe_op_create_args ca = create_args(0, -1);
  ca.overrides = sets;
  ca.num_overrides = (size_t)n;
  if (report(g_api->create(&ca), "reference create")) return 1;
  megamoe_op *ref = ca.op;
  int bad = 0;
  double bytes = 0, t0 = now_s();
  const int H = ranks[0].H, K = ranks[0].K, E = ranks[0].E;
  if (report(load_layer(ref, ck, layer0, 0, 0, E, &bytes), "reference load")) bad = 1;
  megamoe_op_plan_args pl = {MEGAMOE_OP_PLAN_ARGS_STRUCT_SIZE, NULL, ref, opt.check_tokens, NULL, 0, 0};
  if (!bad && report(g_api->plan(&pl), "reference plan")) bad = 1;
  fprintf(stderr, "megamoe-host: reference weights loaded (%.1f GB, %.1f s)\n", bytes / 1e9,
          now_s() - t0);
  *worst_rel = 0;
  for (int r = 0; r < world && !bad; r++) {
    rank_work *w = &ranks[r];
    int S = opt.check_tokens < w->T0 ? opt.check_tokens : w->T0;
    if (S <= 0) continue;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)S * H), *o = malloc(sizeof(uint16_t) * (size_t)S * H);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)S * K);
    float *wt = malloc(sizeof(float) * (size_t)S * K);
    int *rows = malloc(sizeof(int) * (size_t)S);
    for (int i = 0; i < S; i++) {
      rows[i] = (int)((long)i * w->T0 / S); /* spread over the batch */
      memcpy(h + (size_t)i * H, w->hidden + (size_t)rows[i] * H, sizeof(uint16_t) * H);
      memcpy(ids + (size_t)i * K, w->ids + (size_t)rows[i] * K, sizeof(int32_t) * K);
      memcpy(wt + (size_t)i * K, w->weights + (size_t)rows[i] * K, sizeof(float) * K);
    }
    rank_work host = *w;
    host.device = -1;
    if (report(run_execute(&host, ref, 0, S, h, ids, wt, o), "reference execute")) bad = 1;
    double num = 0, den = 0;
    int nan = 0;
    for (int i = 0; i < S && !bad; i++)
      for (int c = 0; c < H; c++) {
        float got = mm_bf16_to_float(w->out[(size_t)rows[i] * H + c]);
        float want = mm_bf16_to_float(o[(size_t)i * H + c]);
        if (isnan(got) || isinf(got)) nan++;
        num += ((double)got - want) * ((double)got - want);
        den += (double)want * want;
      }
    double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    if (nan) rel = INFINITY;
    if (rel > *worst_rel) *worst_rel = rel;
    fprintf(stderr, "megamoe-host: rank %d: %d sampled tokens vs cpu-reference: rel err %.3g%s\n",
            r, S, rel, nan ? " (NaN/Inf in output)" : "");
    free(h); free(o); free(ids); free(wt); free(rows);
  }
  megamoe_op_destroy_args da = {MEGAMOE_OP_DESTROY_ARGS_STRUCT_SIZE, NULL, ref};
  report(g_api->destroy(&da), "reference destroy");
  return bad;
}

/* ---- main ------------------------------------------------------------------------ */
static int parse_tokens(const char *s) {
  opt.num_tokens = 0;
  while (*s && opt.num_tokens < MAX_TOKEN_SIZES) {
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || v < 0 || v > (1 << 20)) return -1;
    opt.tokens[opt.num_tokens++] = (int)v;
    s = *end == ',' ? end + 1 : end;
    if (*end && *end != ',') return -1;
  }
  return opt.num_tokens ? 0 : -1;
}

static int parse_args(int argc, char **argv) {
  static char set_buf[MAX_SETS][512];
  opt.tokens[0] = 128;
  opt.num_tokens = 1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define TAKE(field) \
  do {              \
    if (!v) return -1; \
    field = v;      \
    i++;            \
  } while (0)
#define TAKE_INT(field) \
  do {                  \
    if (!v) return -1;  \
    field = atoi(v);    \
    i++;                \
  } while (0)
    if (!strcmp(a, "--plugin")) TAKE(opt.plugin);
    else if (!strcmp(a, "--plugin-dir")) TAKE(opt.plugin_dir);
    else if (!strcmp(a, "--config")) TAKE(opt.config);
    else if (!strcmp(a, "--checkpoint")) TAKE(opt.checkpoint);
    else if (!strcmp(a, "--validate")) opt.validate = 1;
    else if (!strcmp(a, "--list")) opt.list = 1;
    else if (!strcmp(a, "--cpu")) opt.force_cpu = 1;
    else if (!strcmp(a, "--world")) TAKE_INT(opt.world);
    else if (!strcmp(a, "--layers")) TAKE_INT(opt.layers);
    else if (!strcmp(a, "--iters")) TAKE_INT(opt.iters);
    else if (!strcmp(a, "--warmup")) TAKE_INT(opt.warmup);
    else if (!strcmp(a, "--check-tokens")) TAKE_INT(opt.check_tokens);
    else if (!strcmp(a, "--seed")) TAKE_INT(opt.seed);
    else if (!strcmp(a, "--tolerance")) {
      if (!v) return -1;
      opt.tolerance = atof(v);
      i++;
    } else if (!strcmp(a, "--tokens")) {
      if (!v || parse_tokens(v)) return -1;
      i++;
    } else if (!strcmp(a, "--set")) {
      if (!v || opt.num_sets == MAX_SETS || strlen(v) >= sizeof set_buf[0]) return -1;
      char *kv = set_buf[opt.num_sets];
      strcpy(kv, v);
      char *eq = strchr(kv, '=');
      if (!eq) return -1;
      *eq = '\0';
      opt.sets[opt.num_sets++] = (megamoe_kv){kv, eq + 1};
      i++;
    } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage();
      exit(0);
    } else {
      fprintf(stderr, "megamoe-host: unknown argument '%s'\n", a);
      return -1;
    }
  }
  if (opt.iters < 1) opt.iters = 1;
  if (opt.warmup < 1) opt.warmup = 1;
  return 0;
}

static int has_set(const char *key) {
  for (int i = 0; i < opt.num_sets; i++)
    if (!strcmp(opt.sets[i].key, key)) return 1;
  return 0;
}

int main(int argc, char **argv) {
  if (parse_args(argc, argv)) {
    usage();
    return 2;
  }
  uv_mutex_init(&g_print_lock);
  uv_mutex_init(&g_bar_lock);
  uv_cond_init(&g_bar_cond);
  g_kv = mm_kv_store_new();
  megamoe_host_services services;
  memset(&services, 0, sizeof services);
  services.struct_size = MEGAMOE_HOST_SERVICES_STRUCT_SIZE;
  services.log = host_log;
  services.kv_put = host_kv_put;
  services.kv_get = host_kv_get;
  mm_plugin_loader *loader = mm_plugin_loader_new(&services);
  if (!g_kv || !loader) return 1;
  if (opt.plugin) mm_plugin_loader_load(loader, opt.plugin);
  if (opt.plugin_dir) mm_plugin_loader_scan_dir(loader, opt.plugin_dir);
  if (!opt.plugin && !opt.plugin_dir) {
    const char *env = getenv("MEGAMOE_PLUGIN_PATH");
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", env ? env : "");
    for (char *save = NULL, *d = strtok_r(buf, ":", &save); d; d = strtok_r(NULL, ":", &save))
      mm_plugin_loader_scan_dir(loader, d);
  }
  if (opt.list) {
    for (size_t i = 0; i < mm_plugin_loader_op_count(loader); i++) {
      const mm_registered_op *r = mm_plugin_loader_op_at(loader, i);
      megamoe_op_attributes_args at;
      memset(&at, 0, sizeof at);
      at.struct_size = MEGAMOE_OP_ATTRIBUTES_ARGS_STRUCT_SIZE;
      megamoe_error *e = r->api->get_attributes(&at);
      printf("%s %u.%u  (%s)  caps 0x%x, %d GPU(s), %s\n", r->name, r->version_major,
             r->version_minor, r->plugin_path, e ? 0 : at.capabilities,
             e ? 0 : at.num_cuda_devices, e ? megamoe_error_message(e) : at.build_info);
      megamoe_error_destroy(e);
    }
  }
  const mm_registered_op *reg = mm_plugin_loader_find(loader, "megamoe_fp4");
  int rc = 0;
  if (!reg) {
    if (!opt.list) fprintf(stderr, "megamoe-host: no plugin registered op 'megamoe_fp4'\n");
    rc = opt.list ? 0 : 1;
    goto out;
  }
  g_api = reg->api;
  if (!opt.config) {
    if (!opt.list) {
      fprintf(stderr, "megamoe-host: --config is required\n");
      rc = 2;
    }
    goto out;
  }
  if (opt.validate) {
    megamoe_op_create_args ca = create_args(0, -1);
    megamoe_error *e = g_api->validate_config(&ca);
    if (e) {
      fprintf(stderr, "%s\n", megamoe_error_message(e));
      megamoe_error_destroy(e);
      rc = 1;
    } else {
      printf("%s: valid\n", opt.config);
    }
    goto out;
  }
  if (!opt.checkpoint) {
    fprintf(stderr, "megamoe-host: --checkpoint is required to run\n");
    rc = 2;
    goto out;
  }
  /* world: --world, else every visible GPU, else one CPU rank. */
  megamoe_op_attributes_args at;
  memset(&at, 0, sizeof at);
  at.struct_size = MEGAMOE_OP_ATTRIBUTES_ARGS_STRUCT_SIZE;
  report(g_api->get_attributes(&at), "get_attributes");
  int gpus = opt.force_cpu ? 0 : at.num_cuda_devices;
  int world = opt.world > 0 ? opt.world : gpus > 0 ? gpus : 1;
  if (world > MAX_RANKS || (gpus > 0 && world > gpus)) {
    fprintf(stderr, "megamoe-host: --world %d needs that many GPUs (%d visible, max %d)\n", world,
            gpus, MAX_RANKS);
    rc = 2;
    goto out;
  }
  static char world_str[16];
  snprintf(world_str, sizeof world_str, "%d", world);
  if (!has_set("ep-size") && opt.num_sets < MAX_SETS)
    opt.sets[opt.num_sets++] = (megamoe_kv){"ep-size", world_str};
  if (opt.force_cpu && !has_set("backend") && opt.num_sets < MAX_SETS)
    opt.sets[opt.num_sets++] = (megamoe_kv){"backend", "cpu-reference"};
  /* Shapes come from the config as the plugin resolved it. */
  megamoe_op_create_args vca = create_args(0, -1);
  if (report(g_api->validate_config(&vca), opt.config)) {
    rc = 1;
    goto out;
  }
  mm_st_ckpt *ck = NULL;
  if (report(mm_st_ckpt_open(opt.checkpoint, &ck), "checkpoint")) {
    rc = 1;
    goto out;
  }
  int layers[1024];
  int num_layers = find_layers(ck, layers, 1024);
  if (opt.layers > 0 && opt.layers < num_layers) num_layers = opt.layers;
  if (num_layers == 0) {
    fprintf(stderr, "megamoe-host: %s has no model.layers.N.mlp.experts.* tensors\n", opt.checkpoint);
    mm_st_ckpt_close(ck);
    rc = 1;
    goto out;
  }
  rank_work *ranks = calloc((size_t)world, sizeof *ranks);
  uv_thread_t tids[MAX_RANKS];
  g_bar_parties = world;
  /* Learn H, K, E from a throw-away create on the CPU backend's checks. */
  for (int r = 0; r < world; r++) {
    ranks[r].rank = r;
    ranks[r].device = gpus > 0 ? r : -1;
    ranks[r].ck = ck;
    ranks[r].layers = layers;
    ranks[r].num_layers = num_layers;
  }
  {
    megamoe_kv sets[MAX_SETS + 2];
    int n = 0;
    for (int i = 0; i < opt.num_sets; i++)
      if (strcmp(opt.sets[i].key, "ep-size") && strcmp(opt.sets[i].key, "backend"))
        sets[n++] = opt.sets[i];
    sets[n++] = (megamoe_kv){"backend", "cpu-reference"};
    sets[n++] = (megamoe_kv){"ep-size", "1"};
    megamoe_op_create_args ca = create_args(0, -1);
    ca.overrides = sets;
    ca.num_overrides = (size_t)n;
    if (report(g_api->create(&ca), "create")) {
      rc = 1;
      goto out_ck;
    }
    megamoe_op_info_args info;
    memset(&info, 0, sizeof info);
    info.struct_size = MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE;
    info.op = ca.op;
    report(g_api->get_info(&info), "get_info");
    for (int r = 0; r < world; r++) {
      ranks[r].H = info.hidden_size;
      ranks[r].K = info.top_k;
      ranks[r].E = info.num_local_experts; /* ep-size 1: all experts */
    }
    megamoe_op_destroy_args da = {MEGAMOE_OP_DESTROY_ARGS_STRUCT_SIZE, NULL, ca.op};
    report(g_api->destroy(&da), "destroy");
  }
  fprintf(stderr, "megamoe-host: %d rank(s) on %s, %d layer(s), hidden %d, top-%d, %d experts\n",
          world, gpus > 0 ? "GPUs" : "the CPU", num_layers, ranks[0].H, ranks[0].K, ranks[0].E);
  double t0 = now_s();
  for (int r = 0; r < world; r++)
    if (uv_thread_create(&tids[r], rank_main, &ranks[r])) {
      fprintf(stderr, "megamoe-host: cannot start rank %d\n", r);
      g_failed = 1;
      abort_ranks();
      world = r;
      break;
    }
  for (int r = 0; r < world; r++) uv_thread_join(&tids[r]);
  double wall = now_s() - t0;
  double rel = NAN;
  int check_failed = 1;
  if (!g_failed && opt.check_tokens > 0)
    check_failed = check_against_reference(ranks, world, ck, layers[0], &rel);
  else if (!g_failed)
    check_failed = 0;
  int pass = !g_failed && !check_failed && (opt.check_tokens <= 0 || rel <= opt.tolerance);
  printf("megamoe-host: %s backend=%s world=%d layers=%d", pass ? "PASS" : "FAIL",
         gpus > 0 ? "cuda" : "cpu-reference", world, num_layers);
  if (opt.check_tokens > 0) printf(" rel_err=%.3g (tol %.3g)", rel, opt.tolerance);
  printf(" prepare=%.2fs plan=%.1fMiB", ranks[0].prepare_s,
         (double)ranks[0].plan_device_bytes / 1048576.0);
  for (int i = 0; i < opt.num_tokens; i++) {
    double worst = 0;
    for (int r = 0; r < world; r++) worst = ranks[r].median_ms[i] > worst ? ranks[r].median_ms[i] : worst;
    printf(" T%d=%.3fms/layer", opt.tokens[i], worst);
  }
  printf(" wall=%.1fs\n", wall);
  rc = pass ? 0 : 1;
  for (int r = 0; r < world; r++) {
    free(ranks[r].hidden);
    free(ranks[r].out);
    free(ranks[r].ids);
    free(ranks[r].weights);
  }
out_ck:
  free(ranks);
  mm_st_ckpt_close(ck);
out:
  mm_plugin_loader_free(loader);
  mm_kv_store_free(g_kv);
  return rc;
}

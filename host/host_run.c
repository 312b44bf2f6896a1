/* host_run.c -- the work of one rank (create, load every layer, plan, timed
 * executes, destroy), the reference check and the helpers that the threaded
 * and the multi-process modes of megamoe-host share. */
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
#include "host.h"
#include "layer_reader.h"
#include "safetensors.h"

/* ---- small helpers ------------------------------------------------------------ */
int report(megamoe_error *err, const char *what) {
  if (!err) return 0;
  uv_mutex_lock(&g_print_lock);
  fprintf(stderr, "%s%s%s\n", what ? what : "", what ? ": " : "", megamoe_error_message(err));
  uv_mutex_unlock(&g_print_lock);
  megamoe_error_destroy(err);
  return 1;
}

double now_s(void) { return (double)uv_hrtime() * 1e-9; }

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* get_info on op; the fields a plugin of an older ABI leaves unwritten
 * read as unknown: the 1.1 phases -1, the 1.3 weight mode NULL and error
 * bound -1. */
static megamoe_error *op_info(megamoe_op *op, megamoe_op_info_args *info) {
  memset(info, 0, sizeof *info);
  info->struct_size = MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE;
  info->op = op;
  info->last_dispatch_us = -1;
  info->error_bound = -1;
  return g_api->get_info(info);
}

/* Device-timed phases of the last layer's execute (ABI 1.1 get_info). */
typedef struct {
  double d_us, x_us, c_us;
  int64_t d_bytes, c_bytes;
} step_phases;

static int read_phases(megamoe_op *op, step_phases *p) {
  megamoe_op_info_args info;
  megamoe_error *e = op_info(op, &info);
  if (e) {
    megamoe_error_destroy(e);
    return 0;
  }
  if (info.last_dispatch_us < 0) return 0;
  *p = (step_phases){info.last_dispatch_us, info.last_compute_us, info.last_combine_us,
                     info.last_dispatch_bytes, info.last_combine_bytes};
  return 1;
}

/* Median of each phase over the timed iterations, one line per rank. */
static void print_phases(int rank, int T, const step_phases *p, int n) {
  if (n <= 0) return;
  double v[3][MAX_ITERS];
  for (int i = 0; i < n; i++) v[0][i] = p[i].d_us, v[1][i] = p[i].x_us, v[2][i] = p[i].c_us;
  for (int k = 0; k < 3; k++) qsort(v[k], (size_t)n, sizeof(double), cmp_double);
  const double d = v[0][n / 2], x = v[1][n / 2], c = v[2][n / 2];
  const double db = (double)p[n - 1].d_bytes, cb = (double)p[n - 1].c_bytes;
  fprintf(stderr,
          "megamoe-host: rank %d T%d phases (median of %d): dispatch %.1f us (%.2f MB, %.1f GB/s), "
          "compute %.1f us, combine %.1f us (%.2f MB, %.1f GB/s)\n",
          rank, T, n, d, db / 1e6, d > 0 ? db / (d * 1e3) : 0.0, x, c, cb / 1e6,
          c > 0 ? cb / (c * 1e3) : 0.0);
}

megamoe_op_create_args create_args(int rank, int device) {
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

int has_set(const char *key) { return get_set(key) != NULL; }
const char *get_set(const char *key) {
  for (int i = 0; i < opt.num_sets; i++)
    if (!strcmp(opt.sets[i].key, key)) return opt.sets[i].value;
  return NULL;
}

static int cmp_int(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

/* Layer indices present in the checkpoint ("model.layers.N.mlp.experts."). */
int find_layers(const mm_st_ckpt *ck, int *layers, int cap) {
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

/* Hands a layer's tensors, read, to prepare_weights as layer slot `slot`. */
static megamoe_error *prepare_layer(megamoe_op *op, host_layer *hl, int slot) {
  megamoe_error *err = host_layer_wait(hl);
  if (err) return err;
  megamoe_op_prepare_args pa;
  memset(&pa, 0, sizeof pa);
  pa.struct_size = MEGAMOE_OP_PREPARE_ARGS_STRUCT_SIZE;
  pa.op = op;
  pa.layer = slot;
  pa.tensors = host_layer_tensors(hl, &pa.num_tensors);
  return g_api->prepare_weights(&pa);
}

/* ---- one rank ---------------------------------------------------------------- */
void init_rank(rank_work *w, const host_setup *su, int r, int device) {
  static char keys[MAX_RANKS][32];
  memset(w, 0, sizeof *w);
  w->rank = r;
  w->world = su->world;
  w->device = device;
  w->ep_rank = r % su->ep;
  if (su->world > su->ep) { /* several groups: each bootstraps under its own keys */
    char *k = keys[(r / su->ep) % MAX_RANKS];
    snprintf(k, sizeof keys[0], "megamoe/g%d", r / su->ep);
    w->comm_key = k;
  }
  w->ck = su->ck;
  w->layers = su->layers;
  w->num_layers = su->num_layers;
  w->H = su->H;
  w->K = su->K;
  w->E = su->E;
  w->tolerance = check_tolerance(-1);
}

double check_tolerance(double error_bound) {
  if (opt.tolerance >= 0) return opt.tolerance;
  return error_bound > 2e-2 ? error_bound : 2e-2;
}

/* The prepared op's weight mode and error bound (ABI 1.3), and so the
 * tolerance of the rank's check; rank 0 says which. */
static void read_numerics(megamoe_op *op, rank_work *w) {
  megamoe_op_info_args info;
  megamoe_error *e = op_info(op, &info);
  if (e) { /* unknown, as from an older plugin */
    megamoe_error_destroy(e);
    info.weight_mode = NULL;
    info.error_bound = -1;
  }
  w->tolerance = check_tolerance(info.error_bound);
  if (w->rank == 0 && opt.check_tokens > 0)
    fprintf(stderr, "megamoe-host: weight mode %s, error bound %.3g; the check's tolerance %.3g%s\n",
            info.weight_mode ? info.weight_mode : "(not reported)", info.error_bound, w->tolerance,
            opt.tolerance >= 0 ? " (--tolerance)" : "");
}

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
  ea.max_tokens_any_rank = T; /* every rank runs the same batch size in a step */
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

/* Buffers on the rank's device (or host); copies in from host arrays. An
 * empty one still gets a (16-byte) allocation, so that its tensor has a
 * valid data pointer; nothing is copied into it. */
static void *dev_alloc(int device, size_t bytes, const void *src) {
  const size_t alloc = bytes ? bytes : 16;
#ifdef MM_HAVE_CUDA
  if (device >= 0) {
    void *p = NULL;
    if (cudaMalloc(&p, alloc) != cudaSuccess) return NULL;
    if (src && bytes && cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
      cudaFree(p);
      return NULL;
    }
    if (!src) cudaMemset(p, 0xFF, alloc); /* poison */
    return p;
  }
#endif
  void *p = malloc(alloc);
  if (p) {
    if (src) memcpy(p, src, bytes);
    else memset(p, 0xFF, alloc);
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

void rank_main(void *arg) {
  rank_work *w = arg;
  megamoe_op *op = NULL;
  void *dh = NULL, *di = NULL, *dw = NULL, *dout = NULL;
#ifdef MM_HAVE_CUDA
  if (w->device >= 0 && cudaSetDevice(w->device) != cudaSuccess) {
    fprintf(stderr, "rank %d: cannot use CUDA device %d\n", w->rank, w->device);
    goto fail;
  }
#endif
  megamoe_op_create_args ca = create_args(w->ep_rank, w->device);
  ca.comm_key = w->comm_key;
  if (report(g_api->create(&ca), "create")) goto fail;
  op = ca.op;
  megamoe_op_info_args info;
  if (report(op_info(op, &info), "get_info")) goto fail;
  /* Layer l + 1's reads run while layer l is prepared (--read-ahead 1). */
  double t0 = now_s(), waited = 0;
  const int first = info.first_local_expert, n = info.num_local_experts;
  host_layer *next = host_layer_read(w->ck, w->layers[0], first, n);
  for (int l = 0; l < w->num_layers; l++) {
    host_layer *cur = next;
    next = NULL;
    if (!cur) goto fail; /* out of memory: said */
    const double tw = now_s();
    megamoe_error *err = host_layer_wait(cur);
    waited += now_s() - tw;
    if (!err && opt.read_ahead && l + 1 < w->num_layers)
      next = host_layer_read(w->ck, w->layers[l + 1], first, n);
    if (!err) err = prepare_layer(op, cur, l);
    w->load_bytes += host_layer_bytes(cur);
    host_layer_free(cur);
    char what[64];
    snprintf(what, sizeof what, "rank %d: layer %d", w->rank, w->layers[l]);
    if (report(err, what)) {
      host_layer_free(next); /* after its reads finish */
      goto fail;
    }
    if (w->rank == 0)
      fprintf(stderr,
              "megamoe-host: prepared layer %d/%d (%.1f GB read, %.1f s, %.1f s of it waiting "
              "for reads)\n",
              l + 1, w->num_layers, w->load_bytes / 1e9, now_s() - t0, waited);
    if (!opt.read_ahead && l + 1 < w->num_layers)
      next = host_layer_read(w->ck, w->layers[l + 1], first, n);
  }
  w->prepare_s = now_s() - t0;
  read_numerics(op, w);
  int Tmax = 0;
  for (int i = 0; i < opt.num_tokens; i++) Tmax = opt.tokens[i] > Tmax ? opt.tokens[i] : Tmax;
  int check_ti = 0;
  while (check_ti + 1 < opt.num_tokens && opt.tokens[check_ti] == 0) check_ti++;
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
    double times[MAX_ITERS];
    int iters = opt.iters; /* at most MAX_ITERS: parse_args */
    step_phases ph[MAX_ITERS];
    int nph = 0;
    for (int it = -opt.warmup; it < iters; it++) {
      if (g_group->sync()) goto fail; /* ranks execute together, as in serving */
      double s = now_s();
      for (int l = 0; l < w->num_layers; l++)
        if (report(run_execute(w, op, l, T, dh, di, dw, dout), "execute")) goto fail;
      if (device_sync(w->device)) goto fail;
      if (it >= 0) times[it] = (now_s() - s) / w->num_layers;
      if (it >= 0 && read_phases(op, &ph[nph])) nph++;
      if (it == -opt.warmup && ti == check_ti) {
        /* keep layer-0 output of the first nonempty size for the reference check */
        if (report(run_execute(w, op, 0, T, dh, di, dw, dout), "execute")) goto fail;
        if (device_sync(w->device) ||
            dev_to_host(w->device, w->out, dout, sizeof(uint16_t) * (size_t)T * w->H))
          goto fail;
        w->T0 = T;
      }
    }
    qsort(times, (size_t)iters, sizeof(double), cmp_double);
    w->median_ms[ti] = iters ? times[iters / 2] * 1e3 : 0;
    print_phases(w->rank, T, ph, nph);
    dev_free(w->device, dh);
    dev_free(w->device, di);
    dev_free(w->device, dw);
    dev_free(w->device, dout);
    dh = di = dw = dout = NULL;
  }
  make_inputs(w, w->T0); /* the check needs that size's inputs back */
  w->ok = 1;
  goto done;
fail:
  g_failed = 1;
  {
    char why[64];
    snprintf(why, sizeof why, "rank %d failed", w->rank);
    g_group->abort(why); /* release ranks waiting at the barrier */
  }
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


void rank_work_release(rank_work *w) {
  free(w->hidden);
  free(w->out);
  free(w->ids);
  free(w->weights);
  w->hidden = w->out = NULL;
  w->ids = NULL;
  w->weights = NULL;
}

/* The overrides with backend = cpu-reference and ep-size = 1. */
static int reference_sets(megamoe_kv *sets) {
  int n = 0;
  for (int i = 0; i < opt.num_sets; i++)
    if (strcmp(opt.sets[i].key, "ep-size") && strcmp(opt.sets[i].key, "backend"))
      sets[n++] = opt.sets[i];
  sets[n++] = (megamoe_kv){"backend", "cpu-reference"};
  sets[n++] = (megamoe_kv){"ep-size", "1"};
  return n;
}

int probe_shapes(int *H, int *K, int *E) {
  megamoe_kv sets[MAX_SETS + 2];
  megamoe_op_create_args ca = create_args(0, -1);
  ca.overrides = sets;
  ca.num_overrides = (size_t)reference_sets(sets);
  if (report(g_api->create(&ca), "create")) return 1;
  megamoe_op_info_args info;
  int bad = report(op_info(ca.op, &info), "get_info");
  *H = info.hidden_size;
  *K = info.top_k;
  *E = info.num_local_experts; /* ep-size 1: all experts */
  megamoe_op_destroy_args da = {MEGAMOE_OP_DESTROY_ARGS_STRUCT_SIZE, NULL, ca.op};
  report(g_api->destroy(&da), "destroy");
  return bad;
}

/* ---- reference check ---------------------------------------------------------- */
struct host_ref {
  megamoe_op *op;
  int H, K, E;
};

int ref_open(const mm_st_ckpt *ck, int layer0, host_ref **out) {
  *out = NULL;
  megamoe_kv sets[MAX_SETS + 2];
  megamoe_op_create_args ca = create_args(0, -1);
  ca.overrides = sets;
  ca.num_overrides = (size_t)reference_sets(sets);
  if (report(g_api->create(&ca), "reference create")) return 1;
  host_ref *ref = calloc(1, sizeof *ref);
  megamoe_op_info_args info;
  int bad = !ref || report(op_info(ca.op, &info), "reference get_info");
  if (ref) {
    ref->op = ca.op;
    ref->H = info.hidden_size;
    ref->K = info.top_k;
    ref->E = info.num_local_experts;
  }
  double bytes = 0, t0 = now_s();
  if (!bad) {
    host_layer *hl = host_layer_read(ck, layer0, 0, ref->E);
    if (!hl || report(prepare_layer(ca.op, hl, 0), "reference load")) bad = 1;
    if (hl) bytes = host_layer_bytes(hl);
    host_layer_free(hl);
  }
  megamoe_op_plan_args pl = {MEGAMOE_OP_PLAN_ARGS_STRUCT_SIZE, NULL, ca.op, opt.check_tokens, NULL, 0, 0};
  if (!bad && report(g_api->plan(&pl), "reference plan")) bad = 1;
  fprintf(stderr, "megamoe-host: reference weights loaded (%.1f GB, %.1f s)\n", bytes / 1e9,
          now_s() - t0);
  if (bad) {
    if (ref) ref_close(ref);
    else {
      megamoe_op_destroy_args da = {MEGAMOE_OP_DESTROY_ARGS_STRUCT_SIZE, NULL, ca.op};
      report(g_api->destroy(&da), "reference destroy");
    }
    return 1;
  }
  *out = ref;
  return 0;
}

/* --dump-check: the checked tokens of rank w (inputs, the op's output and
 * the reference's) and where they came from, for scripts/layer_oracle.py.
 * One file per rank: FILE, and FILE.rank<r> where the world has several. */
static int dump_check(const rank_work *w, int S, const uint16_t *h, const int32_t *ids,
                      const float *wt, const int *rows, const uint16_t *ref_out) {
  const int H = w->H, K = w->K;
  char path[4096], meta[32];
  if (w->world > 1) snprintf(path, sizeof path, "%s.rank%d", opt.dump_check, w->rank);
  else snprintf(path, sizeof path, "%s", opt.dump_check);
  uint16_t *got = malloc(sizeof(uint16_t) * (size_t)S * H + 2);
  mm_st_writer *wr = NULL;
  mm_err *err = got ? mm_st_writer_new(&wr)
                    : mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of host memory");
  for (int i = 0; got && i < S; i++)
    memcpy(got + (size_t)i * H, w->out + (size_t)rows[i] * H, sizeof(uint16_t) * (size_t)H);
  const int64_t th[2] = {S, H}, tk[2] = {S, K};
  const uint64_t bh = sizeof(uint16_t) * (uint64_t)S * (uint64_t)H;
  const uint64_t bk = sizeof(int32_t) * (uint64_t)S * (uint64_t)K;
  /* BF16 as raw 16-bit words: readers need no BF16 type */
  if (!err) err = mm_st_writer_add(wr, "hidden_bf16", MM_ST_U16, 2, th, h, bh);
  if (!err) err = mm_st_writer_add(wr, "topk_ids", MM_ST_I32, 2, tk, ids, bk);
  if (!err) err = mm_st_writer_add(wr, "topk_weights", MM_ST_F32, 2, tk, wt, bk);
  if (!err) err = mm_st_writer_add(wr, "out_bf16", MM_ST_U16, 2, th, got, bh);
  if (!err) err = mm_st_writer_add(wr, "reference_bf16", MM_ST_U16, 2, th, ref_out, bh);
  snprintf(meta, sizeof meta, "%d", w->layers[0]);
  if (!err) err = mm_st_writer_set_metadata(wr, "layer", meta);
  snprintf(meta, sizeof meta, "%d", w->rank);
  if (!err) err = mm_st_writer_set_metadata(wr, "rank", meta);
  if (!err) err = mm_st_writer_write(wr, path);
  mm_st_writer_free(wr);
  free(got);
  if (err) {
    fprintf(stderr, "megamoe-host: --dump-check %s: %s\n", path, err->message);
    mm_error_free(err);
    return 1;
  }
  return 0;
}

int ref_check(host_ref *ref, const rank_work *w, double *rel_out) {
  const int H = ref->H, K = ref->K;
  int S = opt.check_tokens < w->T0 ? opt.check_tokens : w->T0;
  *rel_out = 0;
  if (S <= 0) return 0;
  uint16_t *h = malloc(sizeof(uint16_t) * (size_t)S * H), *o = malloc(sizeof(uint16_t) * (size_t)S * H);
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)S * K);
  float *wt = malloc(sizeof(float) * (size_t)S * K);
  int *rows = malloc(sizeof(int) * (size_t)S);
  int bad = !h || !o || !ids || !wt || !rows;
  for (int i = 0; i < S && !bad; i++) {
    rows[i] = (int)((long)i * w->T0 / S); /* spread over the batch */
    memcpy(h + (size_t)i * H, w->hidden + (size_t)rows[i] * H, sizeof(uint16_t) * H);
    memcpy(ids + (size_t)i * K, w->ids + (size_t)rows[i] * K, sizeof(int32_t) * K);
    memcpy(wt + (size_t)i * K, w->weights + (size_t)rows[i] * K, sizeof(float) * K);
  }
  rank_work host = *w;
  host.device = -1;
  if (!bad && report(run_execute(&host, ref->op, 0, S, h, ids, wt, o), "reference execute")) bad = 1;
  if (!bad) {
    double num = 0, den = 0;
    int nan = 0;
    for (int i = 0; i < S; i++)
      for (int c = 0; c < H; c++) {
        float got = mm_bf16_to_float(w->out[(size_t)rows[i] * H + c]);
        float want = mm_bf16_to_float(o[(size_t)i * H + c]);
        if (isnan(got) || isinf(got)) nan++;
        num += ((double)got - want) * ((double)got - want);
        den += (double)want * want;
      }
    double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    if (nan) rel = INFINITY;
    *rel_out = rel;
    fprintf(stderr, "megamoe-host: rank %d: %d sampled tokens vs cpu-reference: rel err %.3g%s\n",
            w->rank, S, rel, nan ? " (NaN/Inf in output)" : "");
    if (opt.dump_check) bad = dump_check(w, S, h, ids, wt, rows, o);
  }
  free(h);
  free(o);
  free(ids);
  free(wt);
  free(rows);
  return bad;
}

void ref_close(host_ref *ref) {
  if (!ref) return;
  megamoe_op_destroy_args da = {MEGAMOE_OP_DESTROY_ARGS_STRUCT_SIZE, NULL, ref->op};
  report(g_api->destroy(&da), "reference destroy");
  free(ref);
}

/* ---- the summary line -------------------------------------------------------------- */
void print_result(const host_result *r, int rank, const char *backend, int world, int layers) {
  printf("megamoe-host: %s", r->pass ? "PASS" : "FAIL");
  if (rank >= 0) printf(" rank=%d", rank);
  printf(" backend=%s world=%d layers=%d", backend, world, layers);
  if (opt.check_tokens > 0) printf(" rel_err=%.3g (tol %.3g)", r->rel_err, r->tolerance);
  printf(" prepare=%.2fs plan=%.1fMiB", r->prepare_s, (double)r->plan_bytes / 1048576.0);
  for (int i = 0; i < opt.num_tokens; i++)
    printf(" T%d=%.3fms/layer", opt.tokens[i], r->median_ms[i]);
  printf(" wall=%.1fs\n", r->wall_s);
  fflush(stdout);
}

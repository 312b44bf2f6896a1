/* abi_fixture.h -- what the tests that drive the plugin through its C ABI
 * share (test_abi.c, test_hostile_inputs.c, fuzz/fuzz_abi_tensors.c): the
 * plugin loaded as a host loads it, host services that capture the
 * megamoe_fp4 op, the tiny NVFP4 model held in memory with its named
 * DLTensors, and one-call wrappers over the op API.
 *
 * Header only and free of harness.h: the libFuzzer build (scripts/fuzz.sh)
 * compiles the fuzz target alone with its own source list. Define the model
 * dimensions H (hidden), I (intermediate), E (experts) and K (top-k) before
 * including. */
#ifndef MM_TEST_ABI_FIXTURE_H
#define MM_TEST_ABI_FIXTURE_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "megamoe_plugin.h"

enum { MMFX_NT = E * 12 }; /* tensors of one layer: 3 projections x 4 fields per expert */

/* ---- the plugin ------------------------------------------------------------------ */
static const megamoe_op_api *mmfx_api; /* the megamoe_fp4 op, set by registration */
static int mmfx_registrations;

static inline void mmfx_log_sink(void *ctx, megamoe_log_level level, const char *msg) {}
static inline int mmfx_on_register(void *ctx, const megamoe_op_registration *reg) {
  mmfx_registrations++;
  if (reg && reg->name && strcmp(reg->name, "megamoe_fp4") == 0) mmfx_api = reg->api;
  return 0;
}

/* Services of a host that registers ops and silences the plugin's log. */
static inline megamoe_host_services mmfx_services(void) {
  megamoe_host_services s;
  memset(&s, 0, sizeof s);
  s.struct_size = MEGAMOE_HOST_SERVICES_STRUCT_SIZE;
  s.log = mmfx_log_sink;
  s.register_op = mmfx_on_register;
  return s;
}

/* dlopens $MEGAMOE_BUILDDIR/plugin/.libs/libmegamoe_plugin.so (the path goes
 * to path[cap]); its init entry point, or NULL with the reason in why. */
static inline megamoe_plugin_init_v1_fn mmfx_load(char *path, size_t cap, char *why,
                                                  size_t why_cap) {
  const char *dir = getenv("MEGAMOE_BUILDDIR");
  snprintf(path, cap, "%s/plugin/.libs/libmegamoe_plugin.so", dir ? dir : ".");
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(why, why_cap, "cannot dlopen %s: %s", path, dlerror());
    return NULL;
  }
  megamoe_plugin_init_v1_fn init = (megamoe_plugin_init_v1_fn)dlsym(lib, MEGAMOE_PLUGIN_INIT_V1_SYMBOL);
  if (!init) snprintf(why, why_cap, "no %s in %s", MEGAMOE_PLUGIN_INIT_V1_SYMBOL, path);
  return init;
}

/* init with the given ABI major and args struct_size (a larger size is a
 * newer host: the tail is zero); the filled-in args go to out (optional). */
static inline megamoe_error *mmfx_init_with(megamoe_plugin_init_v1_fn init,
                                            const megamoe_host_services *s, uint32_t major,
                                            size_t size, megamoe_plugin_init_args *out) {
  unsigned char buf[512];
  memset(buf, 0, sizeof buf);
  megamoe_plugin_init_args *a = (megamoe_plugin_init_args *)buf;
  a->struct_size = size;
  a->host_abi_major = major;
  a->host_abi_minor = MEGAMOE_ABI_MINOR;
  a->services = s;
  megamoe_error *e = init(a);
  if (out) *out = *a;
  return e;
}

/* ---- the tiny NVFP4 model ------------------------------------------------------------ */
typedef struct {
  uint8_t codes[3][H * I / 2]; /* gate [I,H], up [I,H], down [H,I] (same byte count) */
  uint8_t scales[3][H * I / 16];
  float global[3], input_scale;
} mmfx_raw_expert;
static mmfx_raw_expert mmfx_raw[E];
static const char *mmfx_proj[3] = {"gate", "up", "down"};
static const char *mmfx_field[4] = {"weight", "weight_scale", "weight_scale_2", "input_scale"};

/* The position of expert e, projection p, field s in a layer's tensor list. */
static inline int mmfx_tensor_index(int e, int p, int s) { return (e * 3 + p) * 4 + s; }

/* Random codes, E4M3 block scales in [0x28, 0x50) (normal, finite), globals
 * in [0.002, 0.02), input scales 1; rng gives the random bits. */
static inline void mmfx_make_raw(uint64_t (*rng)(void)) {
  for (int e = 0; e < E; e++) {
    for (int p = 0; p < 3; p++) {
      for (size_t i = 0; i < sizeof mmfx_raw[e].codes[p]; i++) mmfx_raw[e].codes[p][i] = (uint8_t)rng();
      for (size_t i = 0; i < sizeof mmfx_raw[e].scales[p]; i++)
        mmfx_raw[e].scales[p][i] = (uint8_t)(0x28 + rng() % 0x28);
      mmfx_raw[e].global[p] = 0.002f + 0.018f * (float)(rng() >> 40) / (float)(1 << 24);
    }
    mmfx_raw[e].input_scale = 1.0f;
  }
}

/* Describes tensor (e, p, s) of the raw model as a host DLTensor on the raw
 * bytes (shape storage in shape[2]); returns its size in bytes. The name, with
 * an optional prefix, goes to name[cap] when name is not NULL. */
static inline size_t mmfx_model_tensor(DLTensor *t, int64_t *shape, int e, int p, int s,
                                       const char *prefix, char *name, size_t cap) {
  int rows = p == 2 ? H : I, cols = p == 2 ? I : H;
  memset(t, 0, sizeof *t);
  t->device.device_type = kDLCPU;
  t->shape = shape;
  if (name) snprintf(name, cap, "%sexperts.%d.%s_proj.%s", prefix ? prefix : "", e, mmfx_proj[p], mmfx_field[s]);
  if (s == 0) {
    shape[0] = rows, shape[1] = cols / 2, t->ndim = 2;
    t->dtype = (DLDataType){kDLUInt, 8, 1};
    t->data = mmfx_raw[e].codes[p];
    return sizeof mmfx_raw[e].codes[p];
  }
  if (s == 1) {
    shape[0] = rows, shape[1] = cols / 16, t->ndim = 2;
    t->dtype = (DLDataType){MEGAMOE_DL_FLOAT8_E4M3FN, 8, 1};
    t->data = mmfx_raw[e].scales[p];
    return sizeof mmfx_raw[e].scales[p];
  }
  t->ndim = 0;
  t->dtype = (DLDataType){kDLFloat, 32, 1};
  t->data = s == 2 ? &mmfx_raw[e].global[p] : &mmfx_raw[e].input_scale;
  return sizeof(float);
}

/* The layer's named tensors over mmfx_raw, in mmfx_tensor_index order; tests
 * break single descriptors (mmfx_dl, mmfx_shapes) or raw bytes and restore them. */
static DLTensor mmfx_dl[MMFX_NT];
static int64_t mmfx_shapes[MMFX_NT][2];
static megamoe_named_tensor mmfx_nt[MMFX_NT];
static char mmfx_names[MMFX_NT][64];

static inline void mmfx_make_tensors(void) {
  for (int e = 0; e < E; e++)
    for (int p = 0; p < 3; p++)
      for (int s = 0; s < 4; s++) {
        int n = mmfx_tensor_index(e, p, s);
        mmfx_model_tensor(&mmfx_dl[n], mmfx_shapes[n], e, p, s, NULL, mmfx_names[n], sizeof mmfx_names[n]);
        mmfx_nt[n].name = mmfx_names[n];
        mmfx_nt[n].tensor = &mmfx_dl[n];
      }
}

/* ---- the op API, one call each ----------------------------------------------------------- */
static inline megamoe_error *mmfx_create(const char *text, const char *name, megamoe_op **op) {
  megamoe_op_create_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = MEGAMOE_OP_CREATE_ARGS_STRUCT_SIZE;
  a.config_text = text;
  a.config_name = name;
  a.device = -1;
  megamoe_error *e = mmfx_api->create(&a);
  *op = a.op;
  return e;
}

/* prepare_weights; the worst requant errors it reports go to rel / abs_err
 * (either may be NULL; -1 where the call does not set them). */
static inline megamoe_error *mmfx_prepare_report(megamoe_op *op, int layer,
                                                 const megamoe_named_tensor *nt, size_t n,
                                                 double *rel, double *abs_err) {
  megamoe_op_prepare_args p;
  memset(&p, 0, sizeof p);
  p.struct_size = MEGAMOE_OP_PREPARE_ARGS_STRUCT_SIZE;
  p.op = op;
  p.layer = layer;
  p.tensors = nt;
  p.num_tensors = n;
  p.requant_rel_rms_max = p.requant_abs_max = -1.0;
  megamoe_error *e = mmfx_api->prepare_weights(&p);
  if (rel) *rel = p.requant_rel_rms_max;
  if (abs_err) *abs_err = p.requant_abs_max;
  return e;
}

static inline megamoe_error *mmfx_prepare(megamoe_op *op, int layer, const megamoe_named_tensor *nt,
                                          size_t n) {
  return mmfx_prepare_report(op, layer, nt, n, NULL, NULL);
}

static inline megamoe_error *mmfx_plan(megamoe_op *op, int tokens) {
  megamoe_op_plan_args p = {MEGAMOE_OP_PLAN_ARGS_STRUCT_SIZE, NULL, op, tokens, NULL, 0, 0};
  return mmfx_api->plan(&p);
}

/* execute with an explicit struct_size and ABI 1.2's max_tokens_any_rank */
static inline megamoe_error *mmfx_execute_sized(megamoe_op *op, int layer, const DLTensor *h,
                                                const DLTensor *ids, const DLTensor *w,
                                                const DLTensor *out, size_t struct_size,
                                                int32_t max_tokens_any_rank) {
  megamoe_op_execute_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = struct_size;
  a.op = op;
  a.layer = layer;
  a.hidden = h;
  a.topk_ids = ids;
  a.topk_weights = w;
  a.out = out;
  a.max_tokens_any_rank = max_tokens_any_rank;
  return mmfx_api->execute(&a);
}

static inline megamoe_error *mmfx_execute(megamoe_op *op, int layer, const DLTensor *h,
                                          const DLTensor *ids, const DLTensor *w,
                                          const DLTensor *out) {
  return mmfx_execute_sized(op, layer, h, ids, w, out, MEGAMOE_OP_EXECUTE_ARGS_STRUCT_SIZE, 0);
}

static inline megamoe_error *mmfx_destroy(megamoe_op *op) {
  megamoe_op_destroy_args d = {MEGAMOE_OP_DESTROY_ARGS_STRUCT_SIZE, NULL, op};
  return mmfx_api->destroy(&d);
}

static inline megamoe_error *mmfx_info(megamoe_op *op, megamoe_op_info_args *out) {
  memset(out, 0, sizeof *out);
  out->struct_size = MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE;
  out->op = op;
  return mmfx_api->get_info(out);
}

static inline megamoe_error *mmfx_check(megamoe_op *op, int wait) {
  megamoe_op_check_args c = {MEGAMOE_OP_CHECK_ARGS_STRUCT_SIZE, NULL, op, NULL, wait};
  return mmfx_api->check(&c);
}

/* ---- execute tensors over caller buffers --------------------------------------------------- */
typedef struct {
  DLTensor h, ids, w, out;
  int64_t sh[4][2];
} mmfx_io;

static inline DLTensor mmfx_t2(void *data, int64_t *sh, int64_t a, int64_t b, DLDataType ty) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  sh[0] = a;
  sh[1] = b;
  t.data = data;
  t.ndim = 2;
  t.shape = sh;
  t.dtype = ty;
  t.device.device_type = kDLCPU;
  return t;
}

/* hidden [T,H] BF16, topk_ids [T,K] I32, topk_weights [T,K] F32, out [T,H] BF16. */
static inline void mmfx_io_init(mmfx_io *io, int T, void *hid, void *ids, void *w, void *out) {
  io->h = mmfx_t2(hid, io->sh[0], T, H, (DLDataType){kDLBfloat, 16, 1});
  io->ids = mmfx_t2(ids, io->sh[1], T, K, (DLDataType){kDLInt, 32, 1});
  io->w = mmfx_t2(w, io->sh[2], T, K, (DLDataType){kDLFloat, 32, 1});
  io->out = mmfx_t2(out, io->sh[3], T, H, (DLDataType){kDLBfloat, 16, 1});
}

static inline megamoe_error *mmfx_execute_io(megamoe_op *op, int layer, const mmfx_io *io) {
  return mmfx_execute(op, layer, &io->h, &io->ids, &io->w, &io->out);
}

#endif

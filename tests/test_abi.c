/* test_abi.c -- the plugin through its C ABI exactly as a host sees it:
 * dlopen the built .so, negotiate, register, then the op lifecycle on the
 * cpu-reference backend with weights built in memory, checked bit for bit
 * against the reference layer called directly; plus every misuse the ABI
 * promises to answer with an error object (NULL args, struct sizes, wrong
 * major, wrong order, stale handles, bad tensors). */
#include <dlfcn.h>
#include <math.h>

#include "formats.h"
#include "harness.h"
#include "megamoe_plugin.h"
#include "ref_moe.h"

static void *g_lib;
static megamoe_plugin_init_v1_fn g_init;
static const megamoe_op_api *g_api;
static int g_registrations;

static int on_register(void *ctx, const megamoe_op_registration *reg) {
  g_registrations++;
  if (reg && reg->name && strcmp(reg->name, "megamoe_fp4") == 0) g_api = reg->api;
  return 0;
}

static megamoe_host_services services(void) {
  megamoe_host_services s;
  memset(&s, 0, sizeof s);
  s.struct_size = MEGAMOE_HOST_SERVICES_STRUCT_SIZE;
  s.register_op = on_register;
  return s;
}

static megamoe_error *init_with(const megamoe_host_services *s, uint32_t major, size_t size,
                                megamoe_plugin_init_args *out) {
  unsigned char buf[512];
  memset(buf, 0, sizeof buf);
  megamoe_plugin_init_args *a = (megamoe_plugin_init_args *)buf;
  a->struct_size = size;
  a->host_abi_major = major;
  a->host_abi_minor = MEGAMOE_ABI_MINOR;
  a->services = s;
  megamoe_error *e = g_init(a);
  if (out) *out = *a;
  return e;
}

static void test_negotiation(void) {
  megamoe_host_services s = services();
  CHECK_ERR(g_init(NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(init_with(&s, 1, MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE - 8, NULL),
            MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(init_with(&s, 2, MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE, NULL),
            MEGAMOE_CODE_FAILED_PRECONDITION);
  CHECK_ERR(init_with(NULL, 1, MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE, NULL),
            MEGAMOE_CODE_INVALID_ARGUMENT);
  megamoe_host_services bad = s;
  bad.register_op = NULL;
  CHECK_ERR(init_with(&bad, 1, MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE, NULL),
            MEGAMOE_CODE_INVALID_ARGUMENT);
  bad = s;
  bad.struct_size = 16;
  CHECK_ERR(init_with(&bad, 1, MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE, NULL),
            MEGAMOE_CODE_INVALID_ARGUMENT);
  bad = s;
  bad.kv_put = (void *)1; /* kv_get missing */
  CHECK_ERR(init_with(&bad, 1, MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE, NULL),
            MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_EQ_INT(g_registrations, 0); /* nothing registered by failed inits */
  /* A newer host: larger args and services structs, unknown tail ignored. */
  unsigned char sbuf[sizeof(megamoe_host_services) + 64];
  memset(sbuf, 0xAB, sizeof sbuf);
  memcpy(sbuf, &s, sizeof s);
  ((megamoe_host_services *)sbuf)->struct_size = sizeof sbuf;
  megamoe_plugin_init_args out;
  CHECK_OK(init_with((megamoe_host_services *)sbuf, 1, MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE + 64, &out));
  CHECK_EQ_INT(g_registrations, 1);
  CHECK(g_api != NULL);
  CHECK(out.plugin_name && strcmp(out.plugin_name, "megamoe") == 0);
  CHECK_EQ_INT(out.num_ops_registered, 1);
  CHECK(out.finalize != NULL);
  CHECK(g_api->struct_size >= MEGAMOE_OP_API_STRUCT_SIZE);
  CHECK_EQ_INT(g_api->abi_major, MEGAMOE_ABI_MAJOR);
}

/* ---- a tiny NVFP4 model built in memory ------------------------------------ */
enum { H = 256, I = 128, E = 4, K = 2 };
typedef struct {
  uint8_t codes[3][H * I / 2];      /* gate [I,H], up [I,H], down [H,I] (same byte count) */
  uint8_t scales[3][H * I / 16];
  float global[3], input_scale;
} raw_expert;
static raw_expert g_raw[E];
static int64_t g_shapes[E][3][4][2];
static DLTensor g_dl[E * 12];
static megamoe_named_tensor g_nt[E * 12];
static char g_names[E * 12][64];

static void make_model(void) {
  static const char *projs[3] = {"gate", "up", "down"};
  size_t n = 0;
  for (int e = 0; e < E; e++) {
    for (int p = 0; p < 3; p++) {
      for (size_t i = 0; i < sizeof g_raw[e].codes[p]; i++) g_raw[e].codes[p][i] = (uint8_t)mm_test_rand_u64();
      for (size_t i = 0; i < sizeof g_raw[e].scales[p]; i++)
        g_raw[e].scales[p][i] = (uint8_t)(0x28 + mm_test_rand_u64() % 0x28);
      g_raw[e].global[p] = mm_test_uniform(0.002f, 0.02f);
      int rows = p == 2 ? H : I, cols = p == 2 ? I : H;
      const char *suf[4] = {"weight", "weight_scale", "weight_scale_2", "input_scale"};
      for (int s = 0; s < 4; s++) {
        DLTensor *t = &g_dl[n];
        memset(t, 0, sizeof *t);
        t->device.device_type = kDLCPU;
        int64_t *sh = g_shapes[e][p][s];
        if (s == 0) { sh[0] = rows; sh[1] = cols / 2; t->ndim = 2; t->dtype = (DLDataType){kDLUInt, 8, 1}; t->data = g_raw[e].codes[p]; }
        if (s == 1) { sh[0] = rows; sh[1] = cols / 16; t->ndim = 2; t->dtype = (DLDataType){MEGAMOE_DL_FLOAT8_E4M3FN, 8, 1}; t->data = g_raw[e].scales[p]; }
        if (s == 2) { t->ndim = 0; t->dtype = (DLDataType){kDLFloat, 32, 1}; t->data = &g_raw[e].global[p]; }
        if (s == 3) { t->ndim = 0; t->dtype = (DLDataType){kDLFloat, 32, 1}; t->data = &g_raw[e].input_scale; g_raw[e].input_scale = 1.0f; }
        t->shape = sh;
        snprintf(g_names[n], sizeof g_names[n], "experts.%d.%s_proj.%s", e, projs[p], suf[s]);
        g_nt[n].name = g_names[n];
        g_nt[n].tensor = t;
        n++;
      }
    }
  }
}

/* The same model as canonical matrices, for the direct reference call. */
static void canonical(mm_expert_q *ex) {
  for (int e = 0; e < E; e++) {
    mm_qmat_alloc(&ex[e].w13, 2 * I, H, 16, MM_SF_E4M3);
    mm_qmat_alloc(&ex[e].w2, H, I, 16, MM_SF_E4M3);
    for (int p = 0; p < 2; p++) {
      memcpy(ex[e].w13.codes + (size_t)p * I * H / 2, g_raw[e].codes[p], (size_t)I * H / 2);
      memcpy(ex[e].w13.scales + (size_t)p * I * H / 16, g_raw[e].scales[p], (size_t)I * H / 16);
      for (int r = 0; r < I; r++) ex[e].w13.row_scale[p * I + r] = g_raw[e].global[p];
    }
    memcpy(ex[e].w2.codes, g_raw[e].codes[2], (size_t)H * I / 2);
    memcpy(ex[e].w2.scales, g_raw[e].scales[2], (size_t)H * I / 16);
    for (int r = 0; r < H; r++) ex[e].w2.row_scale[r] = g_raw[e].global[2];
  }
}

static const char *kConfig =
    "schema-version: 1\n"
    "backend: cpu-reference\n"
    "model:\n"
    "  hidden-size: 256\n"
    "  moe-intermediate-size: 128\n"
    "  num-experts: 4\n"
    "  top-k: 2\n"
    "num-max-tokens-per-rank: 64\n";

static megamoe_op *create_op(const char *text, megamoe_error **err) {
  megamoe_op_create_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = MEGAMOE_OP_CREATE_ARGS_STRUCT_SIZE;
  a.config_text = text;
  a.config_name = "test.yaml";
  a.device = -1;
  *err = g_api->create(&a);
  return a.op;
}

static megamoe_error *prepare(megamoe_op *op, int layer, size_t n) {
  megamoe_op_prepare_args p;
  memset(&p, 0, sizeof p);
  p.struct_size = MEGAMOE_OP_PREPARE_ARGS_STRUCT_SIZE;
  p.op = op;
  p.layer = layer;
  p.tensors = g_nt;
  p.num_tensors = n;
  return g_api->prepare_weights(&p);
}

static megamoe_error *plan(megamoe_op *op, int tokens) {
  megamoe_op_plan_args p = {MEGAMOE_OP_PLAN_ARGS_STRUCT_SIZE, NULL, op, tokens, NULL, 0, 0};
  return g_api->plan(&p);
}

static DLTensor t2(void *data, int64_t *sh, int64_t a, int64_t b, DLDataType ty) {
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

typedef struct {
  DLTensor h, ids, w, out;
  int64_t sh[4][2];
} io_t;

static megamoe_error *execute(megamoe_op *op, int layer, io_t *io) {
  megamoe_op_execute_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = MEGAMOE_OP_EXECUTE_ARGS_STRUCT_SIZE;
  a.op = op;
  a.layer = layer;
  a.hidden = &io->h;
  a.topk_ids = &io->ids;
  a.topk_weights = &io->w;
  a.out = &io->out;
  return g_api->execute(&a);
}

static void destroy(megamoe_op *op, int want_ok) {
  megamoe_op_destroy_args d = {MEGAMOE_OP_DESTROY_ARGS_STRUCT_SIZE, NULL, op};
  if (want_ok) CHECK_OK(g_api->destroy(&d));
  else CHECK_ERR(g_api->destroy(&d), MEGAMOE_CODE_INVALID_ARGUMENT);
}

static void test_lifecycle_matches_reference(void) {
  enum { T = 37 };
  static uint16_t hid[T * H], out[T * H], ref_out[T * H];
  static int32_t ids[T * K];
  static float w[T * K];
  for (int i = 0; i < T * H; i++) hid[i] = mm_float_to_bf16(mm_test_normal());
  for (int i = 0; i < T * K; i++) {
    ids[i] = (int)(mm_test_rand_u64() % E);
    w[i] = mm_test_uniform(0, 1);
  }
  ids[3] = -1; /* one masked slot */
  megamoe_error *err;
  megamoe_op *op = create_op(kConfig, &err);
  CHECK_OK(err);
  if (!op) return;
  io_t io;
  io.h = t2(hid, io.sh[0], T, H, (DLDataType){kDLBfloat, 16, 1});
  io.ids = t2(ids, io.sh[1], T, K, (DLDataType){kDLInt, 32, 1});
  io.w = t2(w, io.sh[2], T, K, (DLDataType){kDLFloat, 32, 1});
  io.out = t2(out, io.sh[3], T, H, (DLDataType){kDLBfloat, 16, 1});
  CHECK_ERR(execute(op, 0, &io), MEGAMOE_CODE_FAILED_PRECONDITION); /* before plan */
  CHECK_OK(plan(op, 64));
  CHECK_ERR(execute(op, 0, &io), MEGAMOE_CODE_FAILED_PRECONDITION); /* no weights yet */
  CHECK_ERR(prepare(op, 0, E * 12 - 12), MEGAMOE_CODE_NOT_FOUND); /* expert 3 missing */
  CHECK_OK(prepare(op, 0, E * 12));
  CHECK_OK(prepare(op, 5, E * 12)); /* layers are independent slots */
  memset(out, 0xFF, sizeof out);
  CHECK_OK(execute(op, 0, &io));
  mm_expert_q ex[E];
  canonical(ex);
  mm_ref_layer_args ra = {T, H, I, K, E, 0, E, ex, hid, ids, w, 1.0f, 0.0f, 1, ref_out, NULL};
  CHECK_OK(mm_ref_moe_layer(&ra));
  CHECK(memcmp(out, ref_out, sizeof out) == 0);
  /* misuse that must fail and leave the op usable */
  int32_t saved = ids[5];
  ids[5] = E; /* out of range */
  CHECK_ERR(execute(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT);
  ids[5] = saved;
  io.h.dtype = (DLDataType){kDLFloat, 32, 1};
  CHECK_ERR(execute(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT);
  io.h.dtype = (DLDataType){kDLBfloat, 16, 1};
  io.out.device.device_type = kDLCUDA;
  CHECK_ERR(execute(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT);
  io.out.device.device_type = kDLCPU;
  int64_t bad_strides[2] = {1, T};
  io.h.strides = bad_strides;
  CHECK_ERR(execute(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT);
  io.h.strides = NULL;
  CHECK_ERR(execute(op, 1, &io), MEGAMOE_CODE_FAILED_PRECONDITION); /* layer 1 not prepared */
  CHECK_ERR(execute(op, -1, &io), MEGAMOE_CODE_FAILED_PRECONDITION);
  CHECK_ERR(plan(op, -5), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_OK(plan(op, 16));
  CHECK_ERR(execute(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT); /* T 37 > 16 planned */
  CHECK_OK(plan(op, 64));
  io.h.shape[0] = io.ids.shape[0] = io.w.shape[0] = io.out.shape[0] = 0; /* zero tokens */
  CHECK_OK(execute(op, 0, &io));
  io.h.shape[0] = io.ids.shape[0] = io.w.shape[0] = io.out.shape[0] = T;
  memset(out, 0xFF, sizeof out);
  CHECK_OK(execute(op, 0, &io)); /* still usable after the errors */
  CHECK(memcmp(out, ref_out, sizeof out) == 0);
  megamoe_op_info_args info;
  memset(&info, 0, sizeof info);
  info.struct_size = MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE;
  info.op = op;
  CHECK_OK(g_api->get_info(&info));
  CHECK(info.backend && strcmp(info.backend, "cpu-reference") == 0);
  CHECK_EQ_INT(info.num_layers_ready, 2);
  CHECK_EQ_INT(info.gran_k, 16);
  megamoe_op_check_args ck = {MEGAMOE_OP_CHECK_ARGS_STRUCT_SIZE, NULL, op, NULL, 1};
  CHECK_OK(g_api->check(&ck)); /* the cpu backend reports errors synchronously */
  destroy(op, 1);
  CHECK_ERR(g_api->check(&ck), MEGAMOE_CODE_INVALID_ARGUMENT); /* stale handle */
  /* A later op (likely at the same address) does not revive the old handle. */
  megamoe_error *cerr;
  megamoe_op *again = create_op(kConfig, &cerr);
  CHECK_OK(cerr);
  CHECK(again != op);
  CHECK_ERR(g_api->check(&ck), MEGAMOE_CODE_INVALID_ARGUMENT);
  destroy(again, 1);
  destroy(op, 0); /* double destroy is an error, not a crash */
  CHECK_ERR(execute(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT); /* stale handle */
  destroy(NULL, 1);
  for (int e = 0; e < E; e++) {
    mm_qmat_free(&ex[e].w13);
    mm_qmat_free(&ex[e].w2);
  }
}

static void test_bad_weights(void) {
  megamoe_error *err;
  megamoe_op *op = create_op(kConfig, &err);
  CHECK_OK(err);
  if (!op) return;
  uint8_t saved = g_raw[1].scales[0][7];
  g_raw[1].scales[0][7] = 0x7F; /* NaN scale byte */
  err = prepare(op, 0, E * 12);
  CHECK(err && err->code == MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_MSG(err && strstr(err->message, "experts.1.gate_proj.weight_scale"), "%s",
            err ? err->message : "");
  megamoe_error_destroy(err);
  g_raw[1].scales[0][7] = saved;
  g_shapes[2][1][0][0] = I - 1; /* up rows != gate rows */
  CHECK_ERR(prepare(op, 0, E * 12), MEGAMOE_CODE_INVALID_ARGUMENT);
  g_shapes[2][1][0][0] = I;
  megamoe_op_info_args info;
  memset(&info, 0, sizeof info);
  info.struct_size = MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE;
  info.op = op;
  CHECK_OK(g_api->get_info(&info));
  CHECK_EQ_INT(info.num_layers_ready, 0); /* nothing half-loaded */
  CHECK_OK(prepare(op, 0, E * 12));
  destroy(op, 1);
}

static void test_create_errors(void) {
  megamoe_error *err;
  CHECK(create_op("model: {top-k: [1, 2]}\n", &err) == NULL);
  CHECK(err && err->code == MEGAMOE_CODE_INVALID_ARGUMENT && strstr(err->message, "test.yaml:1:"));
  megamoe_error_destroy(err);
  megamoe_op_create_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = MEGAMOE_OP_CREATE_ARGS_STRUCT_SIZE;
  CHECK_ERR(g_api->create(&a), MEGAMOE_CODE_INVALID_ARGUMENT); /* no config */
  CHECK_ERR(g_api->create(NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  a.struct_size = 8;
  a.config_text = kConfig;
  CHECK_ERR(g_api->create(&a), MEGAMOE_CODE_INVALID_ARGUMENT); /* old/short struct */
  a.struct_size = MEGAMOE_OP_CREATE_ARGS_STRUCT_SIZE;
  a.rank = 3;
  CHECK_ERR(g_api->create(&a), MEGAMOE_CODE_INVALID_ARGUMENT); /* rank >= ep-size */
  a.rank = 0;
  CHECK_OK(g_api->validate_config(&a));
  CHECK(a.op == NULL);
  megamoe_kv ov[1] = {{"ep-size", "2"}};
  a.overrides = ov;
  a.num_overrides = 1;
  CHECK_ERR(g_api->create(&a), MEGAMOE_CODE_FAILED_PRECONDITION); /* cpu backend is one rank */
  megamoe_op_attributes_args at;
  memset(&at, 0, sizeof at);
  at.struct_size = MEGAMOE_OP_ATTRIBUTES_ARGS_STRUCT_SIZE;
  CHECK_OK(g_api->get_attributes(&at));
  CHECK(at.capabilities & MEGAMOE_CAP_BACKEND_CPU);
  CHECK(at.gran_k_mask == (MEGAMOE_GRAN_K_16 | MEGAMOE_GRAN_K_32));
}

static void test_finalize(void) {
  megamoe_host_services s = services();
  megamoe_plugin_init_args out;
  CHECK_OK(init_with(&s, 1, MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE, &out));
  megamoe_error *err;
  megamoe_op *leaked = create_op(kConfig, &err); /* finalize must clean it up */
  CHECK_OK(err);
  CHECK(leaked != NULL);
  out.finalize();
  CHECK_ERR(create_op(kConfig, &err) == NULL ? err : NULL, MEGAMOE_CODE_FAILED_PRECONDITION);
  /* Re-initialized: a handle from before finalize names nothing. */
  CHECK_OK(init_with(&s, 1, MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE, &out));
  megamoe_op *fresh = create_op(kConfig, &err);
  CHECK_OK(err);
  megamoe_op_check_args ck = {MEGAMOE_OP_CHECK_ARGS_STRUCT_SIZE, NULL, leaked, NULL, 0};
  CHECK_ERR(g_api->check(&ck), MEGAMOE_CODE_INVALID_ARGUMENT);
  ck.op = fresh;
  CHECK_OK(g_api->check(&ck));
  destroy(fresh, 1);
  out.finalize();
}

int main(void) {
  const char *dir = getenv("MEGAMOE_BUILDDIR");
  char path[4096];
  snprintf(path, sizeof path, "%s/plugin/.libs/libmegamoe_plugin.so", dir ? dir : ".");
  g_lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!g_lib) {
    printf("Bail out! cannot dlopen %s: %s\n", path, dlerror());
    return 1;
  }
  g_init = (megamoe_plugin_init_v1_fn)dlsym(g_lib, MEGAMOE_PLUGIN_INIT_V1_SYMBOL);
  if (!g_init) {
    printf("Bail out! no %s in %s\n", MEGAMOE_PLUGIN_INIT_V1_SYMBOL, path);
    return 1;
  }
  mm_test_seed();
  make_model();
  RUN(test_negotiation);
  if (!g_api) return mm_test_done();
  RUN(test_create_errors);
  RUN(test_lifecycle_matches_reference);
  RUN(test_bad_weights);
  RUN(test_finalize);
  return mm_test_done();
}

/* test_abi.c -- the plugin through its C ABI exactly as a host sees it:
 * dlopen the built .so, negotiate, register, then the op lifecycle on the
 * cpu-reference backend with weights built in memory, checked bit for bit
 * against the reference layer called directly; plus every misuse the ABI
 * promises to answer with an error object (NULL args, struct sizes, wrong
 * major, wrong order, stale handles, bad tensors). */
#include <math.h>

#include "formats.h"
#include "harness.h"
#include "megamoe_plugin.h"
#include "ref_moe.h"

enum { H = 256, I = 128, E = 4, K = 2 };
#include "abi_fixture.h"

static megamoe_plugin_init_v1_fn g_init;

/* A host without a log service (the plugin's own default then). */
static megamoe_host_services services(void) {
  megamoe_host_services s = mmfx_services();
  s.log = NULL;
  return s;
}

static megamoe_error *init_with(const megamoe_host_services *s, uint32_t major, size_t size,
                                megamoe_plugin_init_args *out) {
  return mmfx_init_with(g_init, s, major, size, out);
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
  CHECK_EQ_INT(mmfx_registrations, 0); /* nothing registered by failed inits */
  /* A newer host: larger args and services structs, unknown tail ignored. */
  unsigned char sbuf[sizeof(megamoe_host_services) + 64];
  memset(sbuf, 0xAB, sizeof sbuf);
  memcpy(sbuf, &s, sizeof s);
  ((megamoe_host_services *)sbuf)->struct_size = sizeof sbuf;
  megamoe_plugin_init_args out;
  CHECK_OK(init_with((megamoe_host_services *)sbuf, 1, MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE + 64, &out));
  CHECK_EQ_INT(mmfx_registrations, 1);
  CHECK(mmfx_api != NULL);
  CHECK(out.plugin_name && strcmp(out.plugin_name, "megamoe") == 0);
  CHECK_EQ_INT(out.num_ops_registered, 1);
  CHECK(out.finalize != NULL);
  CHECK(mmfx_api->struct_size >= MEGAMOE_OP_API_STRUCT_SIZE);
  CHECK_EQ_INT(mmfx_api->abi_major, MEGAMOE_ABI_MAJOR);
}

/* The same model as canonical matrices, for the direct reference call. */
static void canonical(mm_expert_q *ex) {
  for (int e = 0; e < E; e++) {
    mm_qmat_alloc(&ex[e].w13, 2 * I, H, 16, MM_SF_E4M3);
    mm_qmat_alloc(&ex[e].w2, H, I, 16, MM_SF_E4M3);
    for (int p = 0; p < 2; p++) {
      memcpy(ex[e].w13.codes + (size_t)p * I * H / 2, mmfx_raw[e].codes[p], (size_t)I * H / 2);
      memcpy(ex[e].w13.scales + (size_t)p * I * H / 16, mmfx_raw[e].scales[p], (size_t)I * H / 16);
      for (int r = 0; r < I; r++) ex[e].w13.row_scale[p * I + r] = mmfx_raw[e].global[p];
    }
    memcpy(ex[e].w2.codes, mmfx_raw[e].codes[2], (size_t)H * I / 2);
    memcpy(ex[e].w2.scales, mmfx_raw[e].scales[2], (size_t)H * I / 16);
    for (int r = 0; r < H; r++) ex[e].w2.row_scale[r] = mmfx_raw[e].global[2];
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
  megamoe_op *op;
  *err = mmfx_create(text, "test.yaml", &op);
  return op;
}

static void destroy(megamoe_op *op, int want_ok) {
  if (want_ok) CHECK_OK(mmfx_destroy(op));
  else CHECK_ERR(mmfx_destroy(op), MEGAMOE_CODE_INVALID_ARGUMENT);
}

/* T tokens: normal BF16 hidden states, experts drawn uniformly, weights in [0, 1). */
static void random_inputs(int T, uint16_t *hid, int32_t *ids, float *w) {
  for (int i = 0; i < T * H; i++) hid[i] = mm_float_to_bf16(mm_test_normal());
  for (int i = 0; i < T * K; i++) {
    ids[i] = (int)(mm_test_rand_u64() % E);
    w[i] = mm_test_uniform(0, 1);
  }
}

static void test_lifecycle_matches_reference(void) {
  enum { T = 37 };
  static uint16_t hid[T * H], out[T * H], ref_out[T * H];
  static int32_t ids[T * K];
  static float w[T * K];
  random_inputs(T, hid, ids, w);
  ids[3] = -1; /* one masked slot */
  megamoe_error *err;
  megamoe_op *op = create_op(kConfig, &err);
  CHECK_OK(err);
  if (!op) return;
  mmfx_io io;
  mmfx_io_init(&io, T, hid, ids, w, out);
  CHECK_ERR(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_FAILED_PRECONDITION); /* before plan */
  CHECK_OK(mmfx_plan(op, 64));
  CHECK_ERR(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_FAILED_PRECONDITION); /* no weights yet */
  megamoe_op_info_args before;
  CHECK_OK(mmfx_info(op, &before)); /* ABI 1.3 numerics: none before a layer is prepared */
  CHECK(before.weight_mode == NULL && before.error_bound == -1);
  CHECK_ERR(mmfx_prepare(op, 0, mmfx_nt, MMFX_NT - 12), MEGAMOE_CODE_NOT_FOUND); /* expert 3 missing */
  CHECK_OK(mmfx_prepare(op, 0, mmfx_nt, MMFX_NT));
  CHECK_OK(mmfx_prepare(op, 5, mmfx_nt, MMFX_NT)); /* layers are independent slots */
  memset(out, 0xFF, sizeof out);
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  mm_expert_q ex[E];
  canonical(ex);
  mm_ref_layer_args ra = {T, H, I, K, E, 0, E, ex, hid, ids, w, 1.0f, 0.0f, 1, ref_out, NULL};
  CHECK_OK(mm_ref_moe_layer(&ra));
  CHECK(memcmp(out, ref_out, sizeof out) == 0);
  /* misuse that must fail and leave the op usable */
  int32_t saved = ids[5];
  ids[5] = E; /* out of range */
  CHECK_ERR(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT);
  ids[5] = saved;
  io.h.dtype = (DLDataType){kDLFloat, 32, 1};
  CHECK_ERR(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT);
  io.h.dtype = (DLDataType){kDLBfloat, 16, 1};
  io.out.device.device_type = kDLCUDA;
  CHECK_ERR(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT);
  io.out.device.device_type = kDLCPU;
  int64_t bad_strides[2] = {1, T};
  io.h.strides = bad_strides;
  CHECK_ERR(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT);
  io.h.strides = NULL;
  CHECK_ERR(mmfx_execute_io(op, 1, &io), MEGAMOE_CODE_FAILED_PRECONDITION); /* layer 1 not prepared */
  CHECK_ERR(mmfx_execute_io(op, -1, &io), MEGAMOE_CODE_FAILED_PRECONDITION);
  CHECK_ERR(mmfx_plan(op, -5), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_OK(mmfx_plan(op, 16));
  CHECK_ERR(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT); /* T 37 > 16 planned */
  CHECK_OK(mmfx_plan(op, 64));
  io.h.shape[0] = io.ids.shape[0] = io.w.shape[0] = io.out.shape[0] = 0; /* zero tokens */
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  io.h.shape[0] = io.ids.shape[0] = io.w.shape[0] = io.out.shape[0] = T;
  memset(out, 0xFF, sizeof out);
  CHECK_OK(mmfx_execute_io(op, 0, &io)); /* still usable after the errors */
  CHECK(memcmp(out, ref_out, sizeof out) == 0);
  megamoe_op_info_args info;
  CHECK_OK(mmfx_info(op, &info));
  CHECK(info.backend && strcmp(info.backend, "cpu-reference") == 0);
  CHECK_EQ_INT(info.num_layers_ready, 2);
  CHECK_EQ_INT(info.gran_k, 16);
  /* ABI 1.1 phase timings: the cpu-reference backend has none (-1) */
  CHECK(info.last_dispatch_us == -1 && info.last_compute_us == -1 && info.last_combine_us == -1);
  CHECK(info.last_dispatch_bytes == -1 && info.last_combine_bytes == -1);
  /* ABI 1.3: the reference backend is the reference */
  CHECK(info.weight_mode && strcmp(info.weight_mode, "reference") == 0);
  CHECK(info.error_bound == 0);
  /* a 1.0-sized struct is accepted and its tail (past 1.0) left alone */
  megamoe_op_info_args old;
  memset(&old, 0x5A, sizeof old);
  old.struct_size = MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE_1_0;
  old.extension = NULL;
  old.op = op;
  CHECK_OK(mmfx_api->get_info(&old));
  CHECK_EQ_INT(old.num_layers_ready, 2);
  CHECK(((unsigned char *)&old)[MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE_1_0] == 0x5A);
  CHECK(((unsigned char *)&old)[MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE - 1] == 0x5A);
  /* a 1.1-sized one gets the phases, and its 1.3 tail is left alone */
  memset(&old, 0x5A, sizeof old);
  old.struct_size = MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE_1_1;
  old.extension = NULL;
  old.op = op;
  CHECK_OK(mmfx_api->get_info(&old));
  CHECK(old.last_combine_bytes == -1);
  CHECK(((unsigned char *)&old)[MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE_1_1] == 0x5A);
  CHECK(((unsigned char *)&old)[MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE - 1] == 0x5A);
  old.struct_size = MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE_1_0 - 4; /* below 1.0: refused */
  CHECK_ERR(mmfx_api->get_info(&old), MEGAMOE_CODE_INVALID_ARGUMENT);
  megamoe_op_check_args ck = {MEGAMOE_OP_CHECK_ARGS_STRUCT_SIZE, NULL, op, NULL, 1};
  CHECK_OK(mmfx_api->check(&ck)); /* the cpu backend reports errors synchronously */
  destroy(op, 1);
  CHECK_ERR(mmfx_api->check(&ck), MEGAMOE_CODE_INVALID_ARGUMENT); /* stale handle */
  /* A later op (likely at the same address) does not revive the old handle. */
  megamoe_error *cerr;
  megamoe_op *again = create_op(kConfig, &cerr);
  CHECK_OK(cerr);
  CHECK(again != op);
  CHECK_ERR(mmfx_api->check(&ck), MEGAMOE_CODE_INVALID_ARGUMENT);
  destroy(again, 1);
  destroy(op, 0); /* double destroy is an error, not a crash */
  CHECK_ERR(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT); /* stale handle */
  destroy(NULL, 1);
  for (int e = 0; e < E; e++) {
    mm_qmat_free(&ex[e].w13);
    mm_qmat_free(&ex[e].w2);
  }
}

/* The sizes a host compiled against an older header sends: appending a
 * field must not move them, so they are pinned (LP64). A struct that grew
 * keeps its older sizes under _1_0 / _1_1 names. */
static void test_struct_sizes_pinned(void) {
#if UINTPTR_MAX == UINT64_MAX
  CHECK_EQ_INT((int)MEGAMOE_ERROR_STRUCT_SIZE, 40);
  CHECK_EQ_INT((int)MEGAMOE_HOST_SERVICES_STRUCT_SIZE, 72);
  CHECK_EQ_INT((int)MEGAMOE_OP_ATTRIBUTES_ARGS_STRUCT_SIZE, 80);
  CHECK_EQ_INT((int)MEGAMOE_OP_CREATE_ARGS_STRUCT_SIZE, 96);
  CHECK_EQ_INT((int)MEGAMOE_OP_PREPARE_ARGS_STRUCT_SIZE, 80);
  CHECK_EQ_INT((int)MEGAMOE_OP_PLAN_ARGS_STRUCT_SIZE, 56);
  CHECK_EQ_INT((int)MEGAMOE_OP_EXECUTE_ARGS_STRUCT_SIZE_1_0, 72);
  CHECK_EQ_INT((int)MEGAMOE_OP_EXECUTE_ARGS_STRUCT_SIZE, 76); /* 1.2 */
  CHECK_EQ_INT((int)MEGAMOE_OP_DESTROY_ARGS_STRUCT_SIZE, 24);
  CHECK_EQ_INT((int)MEGAMOE_OP_CHECK_ARGS_STRUCT_SIZE, 36);
  CHECK_EQ_INT((int)MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE_1_0, 68);
  CHECK_EQ_INT((int)MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE_1_1, 112);
  CHECK_EQ_INT((int)MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE, 128); /* 1.3 */
  CHECK_EQ_INT((int)MEGAMOE_OP_API_STRUCT_SIZE, 96);
  CHECK_EQ_INT((int)MEGAMOE_OP_REGISTRATION_STRUCT_SIZE, 40);
  CHECK_EQ_INT((int)MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE, 64);
#endif
}

static void test_bad_weights(void) {
  megamoe_error *err;
  megamoe_op *op = create_op(kConfig, &err);
  CHECK_OK(err);
  if (!op) return;
  uint8_t saved = mmfx_raw[1].scales[0][7];
  mmfx_raw[1].scales[0][7] = 0x7F; /* NaN scale byte */
  err = mmfx_prepare(op, 0, mmfx_nt, MMFX_NT);
  CHECK(err && err->code == MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_MSG(err && strstr(err->message, "experts.1.gate_proj.weight_scale"), "%s",
            err ? err->message : "");
  megamoe_error_destroy(err);
  mmfx_raw[1].scales[0][7] = saved;
  mmfx_shapes[mmfx_tensor_index(2, 1, 0)][0] = I - 1; /* up rows != gate rows */
  CHECK_ERR(mmfx_prepare(op, 0, mmfx_nt, MMFX_NT), MEGAMOE_CODE_INVALID_ARGUMENT);
  mmfx_shapes[mmfx_tensor_index(2, 1, 0)][0] = I;
  megamoe_op_info_args info;
  CHECK_OK(mmfx_info(op, &info));
  CHECK_EQ_INT(info.num_layers_ready, 0); /* nothing half-loaded */
  CHECK_OK(mmfx_prepare(op, 0, mmfx_nt, MMFX_NT));
  destroy(op, 1);
}

/* One op on `config` with MEGAMOE_CPU_REQUANT=where (NULL: unset): prepare
 * layer 0 (its requant statistics to rel/abs), then T tokens into io's out.
 * Returns prepare's error (the op is gone either way). */
static megamoe_error *load_and_run(const char *config, const char *where, int T,
                                   const mmfx_io *io, double *rel, double *abs_err, int *gran) {
  *rel = *abs_err = -1.0;
  *gran = 0;
  if (where) setenv("MEGAMOE_CPU_REQUANT", where, 1);
  else unsetenv("MEGAMOE_CPU_REQUANT");
  megamoe_error *err;
  megamoe_op *op = create_op(config, &err);
  CHECK_OK(err);
  if (!op) return NULL;
  err = mmfx_prepare_report(op, 0, mmfx_nt, MMFX_NT, rel, abs_err);
  if (!err) {
    megamoe_op_info_args info;
    CHECK_OK(mmfx_info(op, &info));
    *gran = info.gran_k;
    CHECK_OK(mmfx_plan(op, T));
    memset(io->out.data, 0xFF, sizeof(uint16_t) * (size_t)T * H); /* poisoned */
    CHECK_OK(mmfx_execute_io(op, 0, io));
  }
  destroy(op, 1);
  unsetenv("MEGAMOE_CPU_REQUANT");
  return err;
}

/* requant.policy group16-to-group32 with the requant in the loader (the
 * default) and in the backend (MEGAMOE_CPU_REQUANT=backend: the op's
 * deferred path, which the cuda backend's GPU requant takes): the same
 * output bits, statistics and errors, word for word. */
static void test_backend_requant(void) {
  enum { T = 29 };
  static uint16_t hid[T * H], out[3][T * H];
  static int32_t ids[T * K];
  static float w[T * K];
  random_inputs(T, hid, ids, w);
  char config[512], strict[512];
  snprintf(config, sizeof config, "%srequant:\n  policy: group16-to-group32\n", kConfig);
  const char *where[3] = {NULL, "loader", "backend"};
  double rel[3], abs_err[3];
  int gran[3] = {0, 0, 0};
  for (int k = 0; k < 3; k++) {
    mmfx_io io;
    mmfx_io_init(&io, T, hid, ids, w, out[k]);
    CHECK_OK(load_and_run(config, where[k], T, &io, &rel[k], &abs_err[k], &gran[k]));
    CHECK_EQ_INT(gran[k], 32);
  }
  CHECK(rel[0] > 0.0 && abs_err[0] > 0.0); /* the fixture's scales do not requantize exactly */
  for (int k = 1; k < 3; k++) {
    CHECK_MSG(memcmp(out[k], out[0], sizeof out[0]) == 0, "%s: outputs differ", where[k]);
    CHECK_MSG(rel[k] == rel[0] && abs_err[k] == abs_err[0], "%s: rel %.17g / %.17g, abs %.17g / %.17g",
              where[k], rel[k], rel[0], abs_err[k], abs_err[0]);
  }
  /* Over requant.max-rel-error: the first tensor a sequential load meets,
   * both ways; with a later expert's load check failing too (a NaN scale
   * byte), still the requant error before it. */
  snprintf(strict, sizeof strict, "%s  max-rel-error: %.6f\n", config, 0.5 * rel[0]);
  for (int nan = 0; nan < 2; nan++) {
    uint8_t saved = mmfx_raw[3].scales[1][5];
    if (nan) mmfx_raw[3].scales[1][5] = 0x7F;
    megamoe_error *e[2];
    for (int k = 0; k < 2; k++) {
      mmfx_io io;
      mmfx_io_init(&io, T, hid, ids, w, out[k]);
      e[k] = load_and_run(strict, where[2 * k], T, &io, &rel[k], &abs_err[k], &gran[k]);
    }
    CHECK(e[0] && e[1]);
    if (e[0] && e[1]) {
      CHECK_EQ_INT(e[1]->code, e[0]->code);
      CHECK_MSG(strcmp(e[1]->message, e[0]->message) == 0, "loader: %s\n#  backend: %s",
                e[0]->message, e[1]->message);
      CHECK_MSG(strstr(e[0]->message, "exceeds requant.max-rel-error"), "%s", e[0]->message);
    }
    megamoe_error_destroy(e[0]);
    megamoe_error_destroy(e[1]);
    mmfx_raw[3].scales[1][5] = saved;
  }
}

static void test_create_errors(void) {
  megamoe_error *err;
  CHECK(create_op("model: {top-k: [1, 2]}\n", &err) == NULL);
  CHECK(err && err->code == MEGAMOE_CODE_INVALID_ARGUMENT && strstr(err->message, "test.yaml:1:"));
  megamoe_error_destroy(err);
  megamoe_op_create_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = MEGAMOE_OP_CREATE_ARGS_STRUCT_SIZE;
  CHECK_ERR(mmfx_api->create(&a), MEGAMOE_CODE_INVALID_ARGUMENT); /* no config */
  CHECK_ERR(mmfx_api->create(NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  a.struct_size = 8;
  a.config_text = kConfig;
  CHECK_ERR(mmfx_api->create(&a), MEGAMOE_CODE_INVALID_ARGUMENT); /* old/short struct */
  a.struct_size = MEGAMOE_OP_CREATE_ARGS_STRUCT_SIZE;
  a.rank = 3;
  CHECK_ERR(mmfx_api->create(&a), MEGAMOE_CODE_INVALID_ARGUMENT); /* rank >= ep-size */
  a.rank = 0;
  CHECK_OK(mmfx_api->validate_config(&a));
  CHECK(a.op == NULL);
  megamoe_kv ov[1] = {{"ep-size", "2"}};
  a.overrides = ov;
  a.num_overrides = 1;
  CHECK_ERR(mmfx_api->create(&a), MEGAMOE_CODE_FAILED_PRECONDITION); /* cpu backend is one rank */
  megamoe_op_attributes_args at;
  memset(&at, 0, sizeof at);
  at.struct_size = MEGAMOE_OP_ATTRIBUTES_ARGS_STRUCT_SIZE;
  CHECK_OK(mmfx_api->get_attributes(&at));
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
  CHECK_ERR(mmfx_api->check(&ck), MEGAMOE_CODE_INVALID_ARGUMENT);
  ck.op = fresh;
  CHECK_OK(mmfx_api->check(&ck));
  destroy(fresh, 1);
  out.finalize();
}

int main(void) {
  char path[4096], why[4352];
  g_init = mmfx_load(path, sizeof path, why, sizeof why);
  if (!g_init) {
    printf("Bail out! %s\n", why);
    return 1;
  }
  mm_test_seed();
  mmfx_make_raw(mm_test_rand_u64);
  mmfx_make_tensors();
  RUN(test_struct_sizes_pinned);
  RUN(test_negotiation);
  if (!mmfx_api) return mm_test_done();
  RUN(test_create_errors);
  RUN(test_lifecycle_matches_reference);
  RUN(test_bad_weights);
  RUN(test_backend_requant);
  RUN(test_finalize);
  return mm_test_done();
}

/* test_hostile_inputs.c -- run-time and checkpoint inputs a careless or
 * hostile host can hand the plugin, through the C ABI exactly as a host does
 * (dlopen of the built .so, cpu-reference backend, a tiny NVFP4 model built
 * in memory), each answered with a defined code and a message naming the
 * thing, after which a valid call still gives the reference bits:
 *   duplicated expert ids (defined: each slot is its own pair, summed),
 *   NaN/Inf in hidden states and top-k weights (defined: that token's row is
 *   NaN, other tokens are untouched, results are deterministic), NaN bytes
 *   and non-finite globals in weights, every lifecycle misuse (execute before
 *   plan / prepare, double destroy, use after destroy and after finalize),
 *   T above the plan, zero tokens, wrong device, strides, misalignment,
 *   overlapping out, dtype / shape mismatches;
 * and checkpoint files through megamoe-host --cpu: truncated, header past the
 * end, overlapping tensors, a missing expert, gate/up of different shapes, a
 * NaN scale byte, a tensor in two shards, a FIFO instead of a file (must not
 * hang). docs/RELIABILITY.md lists these cases. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "formats.h"
#include "harness.h"
#include "megamoe_plugin.h"
#include "safetensors.h"

enum { H = 128, I = 128, E = 4, K = 2, TP = 16 };
#include "abi_fixture.h"

static megamoe_plugin_init_v1_fn g_init;
static megamoe_plugin_init_args g_init_out;
static char g_plugin_path[2048], g_tmp[256];

static const char *kConfig =
    "schema-version: 1\n"
    "backend: cpu-reference\n"
    "model: {hidden-size: 128, moe-intermediate-size: 128, num-experts: 4, top-k: 2}\n"
    "num-max-tokens-per-rank: 16\n"
    "cpu: {threads: 1}\n"
    "log-level: error\n";

/* ---- plugin ------------------------------------------------------------------ */
static megamoe_host_services g_services;

static megamoe_error *plugin_init(void) {
  g_services = mmfx_services();
  return mmfx_init_with(g_init, &g_services, MEGAMOE_ABI_MAJOR, MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE,
                        &g_init_out);
}

/* Fails the case unless e has `code` and its message contains `needle`. */
#define CHECK_ERR_MSG(expr, want_code, needle)                                                 \
  do {                                                                                         \
    megamoe_error *e2_ = (expr);                                                               \
    if (!e2_) {                                                                                \
      printf("# %s:%d: %s succeeded, expected code %d\n", __FILE__, __LINE__, #expr,           \
             (int)(want_code));                                                                \
      mm_test_case_failed_ = 1;                                                                \
    } else {                                                                                   \
      if ((int)e2_->code != (int)(want_code) || !strstr(e2_->message, needle)) {               \
        printf("# %s:%d: %s: code %d, expected %d with '%s': %s\n", __FILE__, __LINE__, #expr, \
               (int)e2_->code, (int)(want_code), needle, e2_->message);                        \
        mm_test_case_failed_ = 1;                                                              \
      }                                                                                        \
      megamoe_error_destroy(e2_);                                                              \
    }                                                                                          \
  } while (0)

/* ---- API helpers -------------------------------------------------------------------- */
static megamoe_op *create_op(megamoe_error **err) {
  megamoe_op *op;
  *err = mmfx_create(kConfig, "hostile.yaml", &op);
  return op;
}
static megamoe_error *prepare(megamoe_op *op, int layer) { return mmfx_prepare(op, layer, mmfx_nt, MMFX_NT); }
static int layers_ready(megamoe_op *op) {
  megamoe_op_info_args in;
  megamoe_error *e = mmfx_info(op, &in);
  if (e) {
    megamoe_error_destroy(e);
    return -1;
  }
  return in.num_layers_ready;
}

/* A reference batch: random tokens, distinct experts, computed once by a
 * fresh op; every test ends by reproducing it on its (misused) op. */
static uint16_t g_ref_hid[TP * H], g_ref_out[TP * H];
static int32_t g_ref_ids[TP * K];
static float g_ref_w[TP * K];

static void make_reference(void) {
  for (int i = 0; i < TP * H; i++) g_ref_hid[i] = mm_float_to_bf16(mm_test_normal());
  for (int t = 0; t < TP; t++) {
    int a = (int)(mm_test_rand_u64() % E), b = (a + 1 + (int)(mm_test_rand_u64() % (E - 1))) % E;
    g_ref_ids[t * K] = a;
    g_ref_ids[t * K + 1] = b;
    g_ref_w[t * K] = mm_test_uniform(0.1f, 0.9f);
    g_ref_w[t * K + 1] = 1.0f - g_ref_w[t * K];
  }
  megamoe_error *err;
  megamoe_op *op = create_op(&err);
  CHECK_OK(err);
  CHECK_OK(prepare(op, 0));
  CHECK_OK(mmfx_plan(op, TP));
  mmfx_io io;
  mmfx_io_init(&io, TP, g_ref_hid, g_ref_ids, g_ref_w, g_ref_out);
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  CHECK_OK(mmfx_destroy(op));
}

/* The op still works: the reference batch gives the reference bits. */
static void check_still_works(megamoe_op *op) {
  static uint16_t out[TP * H];
  memset(out, 0xFF, sizeof out);
  mmfx_io io;
  mmfx_io_init(&io, TP, g_ref_hid, g_ref_ids, g_ref_w, out);
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  CHECK(memcmp(out, g_ref_out, sizeof out) == 0);
}

static megamoe_op *ready_op(void) {
  megamoe_error *err;
  megamoe_op *op = create_op(&err);
  CHECK_OK(err);
  if (!op) return NULL;
  CHECK_OK(prepare(op, 0));
  CHECK_OK(mmfx_plan(op, TP));
  return op;
}

/* ---- run-time inputs ------------------------------------------------------------------- */

/* Duplicated ids: {e, e} with weights {a, b} is two (token, slot) pairs of
 * expert e, each computed and rounded to BF16 on its own, summed in FP32:
 * exactly the sum of the single-slot rows {e, -1} with a and with b. */
static void test_duplicate_ids(void) {
  megamoe_op *op = ready_op();
  if (!op) return;
  enum { T = 3 };
  uint16_t hid[T * H], out[T * H];
  int32_t ids[T * K];
  float w[T * K];
  for (int e = 0; e < E; e++) {
    for (int c = 0; c < H; c++) hid[c] = hid[H + c] = hid[2 * H + c] = mm_float_to_bf16(mm_test_normal());
    float a = mm_test_uniform(0.05f, 1.0f), b = mm_test_uniform(-1.0f, 1.0f);
    int32_t i3[T * K] = {e, e, e, -1, -1, e};
    float w3[T * K] = {a, b, a, 0.5f, 7.0f, b};
    memcpy(ids, i3, sizeof ids);
    memcpy(w, w3, sizeof w);
    mmfx_io io;
    mmfx_io_init(&io, T, hid, ids, w, out);
    memset(out, 0xFF, sizeof out);
    CHECK_OK(mmfx_execute_io(op, 0, &io));
    int bad = 0;
    for (int c = 0; c < H; c++) {
      float want = mm_bf16_to_float(out[H + c]) + mm_bf16_to_float(out[2 * H + c]);
      bad += out[c] != mm_float_to_bf16(want);
    }
    CHECK_MSG(bad == 0, "expert %d: %d channels differ from the sum of the two slots", e, bad);
    uint16_t again[T * H];
    io.out.data = again;
    CHECK_OK(mmfx_execute_io(op, 0, &io));
    CHECK(memcmp(again, out, sizeof out) == 0);
  }
  /* A token whose every slot is the same expert, and all-masked tokens. */
  int32_t ids2[2 * K] = {1, 1, -1, -1};
  float w2[2 * K] = {0.5f, 0.5f, 1.0f, 1.0f};
  mmfx_io io;
  mmfx_io_init(&io, 2, hid, ids2, w2, out);
  memset(out, 0xFF, sizeof out);
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  int nonzero = 0;
  for (int c = 0; c < H; c++) nonzero += out[H + c] != 0;
  CHECK_MSG(nonzero == 0, "an all-masked token must give +0, %d channels differ", nonzero);
  check_still_works(op);
  CHECK_OK(mmfx_destroy(op));
}

static int row_all_nan(const uint16_t *row) {
  for (int c = 0; c < H; c++)
    if (!isnan(mm_bf16_to_float(row[c]))) return 0;
  return 1;
}

/* Copies the first T tokens of the reference batch into hid/ids/w and runs
 * them into clean_out: the clean batch a poisoned copy is compared with. */
static void run_clean_prefix(megamoe_op *op, int T, uint16_t *hid, int32_t *ids, float *w,
                             uint16_t *clean_out) {
  memcpy(hid, g_ref_hid, sizeof hid[0] * (size_t)T * H);
  memcpy(ids, g_ref_ids, sizeof ids[0] * (size_t)T * K);
  memcpy(w, g_ref_w, sizeof w[0] * (size_t)T * K);
  mmfx_io io;
  mmfx_io_init(&io, T, hid, ids, w, clean_out);
  CHECK_OK(mmfx_execute_io(op, 0, &io));
}

/* NaN / Inf in hidden states or top-k weights: defined as "the token's output
 * row is NaN in every channel" (FP8 quantization of a block holding NaN/Inf
 * yields NaN, which reaches every output channel through the two GEMMs), other
 * tokens are bit-identical to a clean batch, masked slots ignore their weight,
 * and the results are deterministic. */
static void test_nan_inf_inputs(void) {
  megamoe_op *op = ready_op();
  if (!op) return;
  enum { T = 10 };
  static uint16_t hid[T * H], out[T * H], out2[T * H], clean_out[T * H];
  int32_t ids[T * K];
  float w[T * K];
  run_clean_prefix(op, T, hid, ids, w, clean_out);
  CHECK(memcmp(clean_out, g_ref_out, sizeof clean_out) == 0); /* a prefix of the reference */
  mmfx_io io;
  const int c1 = (int)(mm_test_rand_u64() % H);
  hid[1 * H + c1] = 0x7FC0;               /* NaN */
  hid[2 * H + c1] = 0x7F80;               /* +Inf */
  hid[3 * H + c1] = 0xFF80;               /* -Inf */
  hid[4 * H + c1] = 0xFFC1;               /* negative NaN with payload */
  w[5 * K + 1] = NAN;                     /* NaN weight on a live slot */
  w[6 * K] = INFINITY;                    /* Inf weight on a live slot */
  ids[7 * K + 1] = -1, w[7 * K + 1] = NAN; /* NaN weight on a masked slot: ignored */
  hid[8 * H + c1] = 0x7FC0;               /* NaN hidden, every slot masked: +0 */
  ids[8 * K] = ids[8 * K + 1] = -1;
  mmfx_io_init(&io, T, hid, ids, w, out);
  memset(out, 0x55, sizeof out);
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  for (int t = 1; t <= 6; t++) CHECK_MSG(row_all_nan(out + t * H), "token %d is not all NaN", t);
  for (int c = 0; c < H; c++) {
    CHECK(out[8 * H + c] == 0);
    CHECK(out[0 * H + c] == clean_out[0 * H + c]);
    CHECK(out[9 * H + c] == clean_out[9 * H + c]);
    CHECK(!isnan(mm_bf16_to_float(out[7 * H + c])));
  }
  io.out.data = out2;
  memset(out2, 0x33, sizeof out2);
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  CHECK(memcmp(out, out2, sizeof out) == 0); /* deterministic, NaN payloads included */
  /* Extremes that are finite: zeros and the largest BF16 values. */
  for (int c = 0; c < H; c++) hid[c] = 0, hid[H + c] = (c & 1) ? 0x7F7F : 0xFF7F;
  int32_t ids2[2 * K] = {0, 1, 2, 3};
  float w2[2 * K] = {0.5f, 0.5f, 0.5f, 0.5f};
  mmfx_io_init(&io, 2, hid, ids2, w2, out);
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  for (int c = 0; c < H; c++) CHECK(out[c] == 0 || out[c] == 0x8000); /* zero in, zero out */
  io.out.data = out2;
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  CHECK(memcmp(out, out2, 2 * H * 2) == 0);
  check_still_works(op);
  CHECK_OK(mmfx_destroy(op));
}

/* The same with the SwiGLU clamp on: a NaN token stays NaN through the clamp
 * (fminf / fmaxf would have made it +-clamp and the row finite). */
static void test_nan_inf_with_clamp(void) {
  static const char *cfg =
      "schema-version: 1\n"
      "backend: cpu-reference\n"
      "model: {hidden-size: 128, moe-intermediate-size: 128, num-experts: 4, top-k: 2,\n"
      "        activation-clamp: 0.5}\n"
      "num-max-tokens-per-rank: 16\n"
      "cpu: {threads: 1}\n"
      "log-level: error\n";
  megamoe_op *op;
  CHECK_OK(mmfx_create(cfg, "clamp.yaml", &op));
  if (!op) return;
  CHECK_OK(prepare(op, 0));
  CHECK_OK(mmfx_plan(op, TP));
  enum { T = 5 };
  uint16_t hid[T * H], out[T * H], clean_out[T * H];
  int32_t ids[T * K];
  float w[T * K];
  run_clean_prefix(op, T, hid, ids, w, clean_out);
  const int c1 = (int)(mm_test_rand_u64() % H);
  hid[1 * H + c1] = 0x7FC0; /* NaN */
  hid[2 * H + c1] = 0xFF80; /* -Inf */
  w[3 * K] = INFINITY;      /* Inf weight on a live slot */
  mmfx_io io;
  mmfx_io_init(&io, T, hid, ids, w, out);
  memset(out, 0x55, sizeof out);
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  for (int t = 1; t <= 3; t++) CHECK_MSG(row_all_nan(out + t * H), "token %d is not all NaN", t);
  CHECK(memcmp(out, clean_out, H * 2) == 0);
  CHECK(memcmp(out + 4 * H, clean_out + 4 * H, H * 2) == 0);
  CHECK_OK(mmfx_destroy(op));
}

/* NaN bytes and non-finite values in weights: refused at prepare with the
 * tensor's name; nothing of the failed layer stays, an earlier preparation
 * of the same layer is still the one used. */
static void test_bad_weight_values(void) {
  megamoe_op *op = ready_op();
  if (!op) return;
  static const uint8_t nan_scales[2] = {0x7F, 0xFF}; /* E4M3 NaN encodings */
  for (int i = 0; i < 2; i++) {
    int e = (int)(mm_test_rand_u64() % E), p = (int)(mm_test_rand_u64() % 3);
    size_t at = mm_test_rand_u64() % sizeof mmfx_raw[e].scales[p];
    uint8_t saved = mmfx_raw[e].scales[p][at];
    mmfx_raw[e].scales[p][at] = nan_scales[i];
    char name[64];
    snprintf(name, sizeof name, "experts.%d.%s_proj.weight_scale", e, mmfx_proj[p]);
    CHECK_ERR_MSG(prepare(op, 0), MEGAMOE_CODE_INVALID_ARGUMENT, name);
    CHECK_ERR_MSG(prepare(op, 1), MEGAMOE_CODE_INVALID_ARGUMENT, "NaN scale byte");
    mmfx_raw[e].scales[p][at] = saved;
  }
  static const float bad_globals[5] = {NAN, INFINITY, 0.0f, -0.01f, 3e38f};
  for (int i = 0; i < 5; i++) {
    int e = i % E, p = i % 3;
    float saved = mmfx_raw[e].global[p];
    mmfx_raw[e].global[p] = bad_globals[i];
    char name[64];
    snprintf(name, sizeof name, "experts.%d.%s_proj.weight_scale_2", e, mmfx_proj[p]);
    CHECK_ERR_MSG(prepare(op, 0), MEGAMOE_CODE_INVALID_ARGUMENT, name);
    mmfx_raw[e].global[p] = saved;
  }
  mmfx_raw[2].input_scale = NAN;
  CHECK_ERR_MSG(prepare(op, 0), MEGAMOE_CODE_INVALID_ARGUMENT, "input_scale");
  mmfx_raw[2].input_scale = 1.0f;
  CHECK_EQ_INT(layers_ready(op), 1); /* layer 0 only, from ready_op */
  check_still_works(op);             /* and it is still the good one */
  CHECK_OK(mmfx_destroy(op));
}

/* Weight tensors with the wrong form: missing expert, gate/up of different
 * shapes, a tensor given twice, wrong dtype/shape, device tensors, strides. */
static void test_bad_weight_tensors(void) {
  megamoe_op *op = ready_op();
  if (!op) return;
  static megamoe_named_tensor nt[MMFX_NT + 1];
  /* a missing expert (all its tensors) */
  size_t n = 0;
  for (int i = 0; i < MMFX_NT; i++)
    if (i < mmfx_tensor_index(2, 0, 0) || i >= mmfx_tensor_index(3, 0, 0)) nt[n++] = mmfx_nt[i];
  CHECK_ERR_MSG(mmfx_prepare(op, 0, nt, n), MEGAMOE_CODE_NOT_FOUND, "experts.2.gate_proj.weight: missing");
  /* one missing tensor */
  memcpy(nt, mmfx_nt, sizeof mmfx_nt);
  nt[mmfx_tensor_index(3, 2, 1)] = nt[MMFX_NT - 1];
  CHECK_ERR_MSG(mmfx_prepare(op, 0, nt, MMFX_NT - 1), MEGAMOE_CODE_NOT_FOUND, "experts.3.down_proj.weight_scale");
  /* gate and up of different shapes */
  int64_t saved = mmfx_shapes[mmfx_tensor_index(1, 1, 0)][0];
  mmfx_shapes[mmfx_tensor_index(1, 1, 0)][0] = I / 2;
  CHECK_ERR_MSG(prepare(op, 0), MEGAMOE_CODE_INVALID_ARGUMENT, "experts.1.up_proj.weight");
  mmfx_shapes[mmfx_tensor_index(1, 1, 0)][0] = saved;
  /* the same tensor twice */
  memcpy(nt, mmfx_nt, sizeof mmfx_nt);
  nt[MMFX_NT] = mmfx_nt[5];
  CHECK_ERR_MSG(mmfx_prepare(op, 0, nt, MMFX_NT + 1), MEGAMOE_CODE_INVALID_ARGUMENT, "given twice");
  /* wrong dtype, wrong shape */
  DLTensor *t = &mmfx_dl[mmfx_tensor_index(0, 2, 1)];
  t->dtype = (DLDataType){kDLBfloat, 16, 1};
  CHECK_ERR_MSG(prepare(op, 0), MEGAMOE_CODE_INVALID_ARGUMENT, "experts.0.down_proj.weight_scale");
  t->dtype = (DLDataType){MEGAMOE_DL_FLOAT8_E4M3FN, 8, 1};
  mmfx_shapes[mmfx_tensor_index(0, 2, 0)][1] = I / 4;
  CHECK_ERR_MSG(prepare(op, 0), MEGAMOE_CODE_INVALID_ARGUMENT, "experts.0.down_proj.weight");
  mmfx_shapes[mmfx_tensor_index(0, 2, 0)][1] = I / 2;
  /* on a GPU while the op runs on the host; non-compact strides; lanes */
  t = &mmfx_dl[mmfx_tensor_index(3, 0, 0)];
  t->device.device_type = kDLCUDA;
  CHECK_ERR_MSG(prepare(op, 0), MEGAMOE_CODE_INVALID_ARGUMENT, "experts.3.gate_proj.weight");
  t->device.device_type = kDLCPU;
  int64_t st[2] = {1, I};
  t->strides = st;
  CHECK_ERR_MSG(prepare(op, 0), MEGAMOE_CODE_INVALID_ARGUMENT, "strides");
  t->strides = NULL;
  t->dtype.lanes = 2;
  CHECK_ERR_MSG(prepare(op, 0), MEGAMOE_CODE_INVALID_ARGUMENT, "dtype");
  t->dtype.lanes = 1;
  /* a NULL tensor or name */
  memcpy(nt, mmfx_nt, sizeof mmfx_nt);
  nt[7].tensor = NULL;
  CHECK_ERR(mmfx_prepare(op, 0, nt, MMFX_NT), MEGAMOE_CODE_INVALID_ARGUMENT);
  nt[7] = mmfx_nt[7];
  nt[9].name = NULL;
  CHECK_ERR(mmfx_prepare(op, 0, nt, MMFX_NT), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_EQ_INT(layers_ready(op), 1);
  check_still_works(op);
  CHECK_OK(prepare(op, 0)); /* the fixed tensors load again */
  check_still_works(op);
  CHECK_OK(mmfx_destroy(op));
}

static void test_lifecycle_misuse(void) {
  megamoe_error *err;
  megamoe_op *op = create_op(&err);
  CHECK_OK(err);
  if (!op) return;
  uint16_t out[TP * H];
  mmfx_io io;
  mmfx_io_init(&io, TP, g_ref_hid, g_ref_ids, g_ref_w, out);
  CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_FAILED_PRECONDITION, "plan");
  CHECK_OK(mmfx_check(op, 1)); /* nothing pending before plan */
  CHECK_OK(mmfx_plan(op, TP));
  CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_FAILED_PRECONDITION, "no prepared weights");
  CHECK_OK(prepare(op, 0)); /* prepare after plan is allowed */
  CHECK_ERR_MSG(mmfx_execute_io(op, 1, &io), MEGAMOE_CODE_FAILED_PRECONDITION, "layer 1");
  CHECK_ERR(mmfx_execute_io(op, -1, &io), MEGAMOE_CODE_FAILED_PRECONDITION);
  CHECK_ERR(mmfx_execute_io(op, 1 << 30, &io), MEGAMOE_CODE_FAILED_PRECONDITION);
  CHECK_ERR(prepare(op, -1), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(prepare(op, 1 << 30), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_OK(mmfx_plan(op, 4)); /* re-plan smaller, then back */
  CHECK_OK(mmfx_plan(op, TP));
  check_still_works(op);
  /* a second op is independent; destroying it leaves the first alone */
  megamoe_op *op2 = create_op(&err);
  CHECK_OK(err);
  CHECK_OK(mmfx_destroy(op2));
  check_still_works(op);
  /* use after destroy, double destroy, foreign handles */
  megamoe_op *stale = op2; /* address may be reused by a later create: test at once */
  megamoe_op_info_args in;
  CHECK_ERR_MSG(mmfx_destroy(stale), MEGAMOE_CODE_INVALID_ARGUMENT, "not a live op");
  CHECK_ERR(mmfx_execute_io(stale, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(prepare(stale, 0), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mmfx_plan(stale, 1), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mmfx_info(stale, &in), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mmfx_check(stale, 1), MEGAMOE_CODE_INVALID_ARGUMENT);
  static char not_an_op[256];
  CHECK_ERR(mmfx_execute_io((megamoe_op *)not_an_op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mmfx_destroy((megamoe_op *)not_an_op), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_OK(mmfx_destroy(NULL));
  /* NULL args and short structs */
  CHECK_ERR(mmfx_api->execute(NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mmfx_api->plan(NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mmfx_api->prepare_weights(NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mmfx_api->destroy(NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mmfx_api->get_info(NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mmfx_api->check(NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  /* the cpu backend is synchronous: errors came back from execute itself,
   * and check has nothing left to report */
  CHECK_ERR(mmfx_execute_io(op, 0, &(mmfx_io){0}), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_OK(mmfx_check(op, 0));
  CHECK_OK(mmfx_check(op, 1));
  megamoe_op_execute_args ea;
  memset(&ea, 0, sizeof ea);
  ea.struct_size = 8;
  ea.op = op;
  CHECK_ERR_MSG(mmfx_api->execute(&ea), MEGAMOE_CODE_INVALID_ARGUMENT, "struct_size");
  check_still_works(op);

  /* finalize with a live op: the plugin destroys it; every entry then
   * answers FAILED_PRECONDITION until a new init */
  g_init_out.finalize();
  CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_FAILED_PRECONDITION, "not initialized");
  CHECK_ERR(prepare(op, 0), MEGAMOE_CODE_FAILED_PRECONDITION);
  CHECK_ERR(mmfx_plan(op, 1), MEGAMOE_CODE_FAILED_PRECONDITION);
  CHECK_ERR(mmfx_destroy(op), MEGAMOE_CODE_FAILED_PRECONDITION);
  CHECK_ERR(mmfx_info(op, &in), MEGAMOE_CODE_FAILED_PRECONDITION);
  CHECK_ERR(mmfx_check(op, 0), MEGAMOE_CODE_FAILED_PRECONDITION);
  CHECK(create_op(&err) == NULL);
  CHECK_ERR(err, MEGAMOE_CODE_FAILED_PRECONDITION);
  megamoe_op_attributes_args at;
  memset(&at, 0, sizeof at);
  at.struct_size = MEGAMOE_OP_ATTRIBUTES_ARGS_STRUCT_SIZE;
  CHECK_ERR(mmfx_api->get_attributes(&at), MEGAMOE_CODE_FAILED_PRECONDITION);
  /* re-init: the old handle is gone, a new op works */
  CHECK_OK(plugin_init());
  CHECK_ERR(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT);
  megamoe_op *fresh = ready_op();
  if (fresh) {
    check_still_works(fresh);
    CHECK_OK(mmfx_destroy(fresh));
  }
}

/* Token counts: above the plan, zero, exactly the plan; plan bounds. */
static void test_token_counts(void) {
  megamoe_op *op = ready_op();
  if (!op) return;
  static uint16_t hid[(TP + 1) * H], out[(TP + 1) * H];
  int32_t ids[(TP + 1) * K];
  float w[(TP + 1) * K];
  memcpy(hid, g_ref_hid, sizeof g_ref_hid);
  memcpy(ids, g_ref_ids, sizeof g_ref_ids);
  memcpy(w, g_ref_w, sizeof g_ref_w);
  ids[TP * K] = 0, ids[TP * K + 1] = 1, w[TP * K] = w[TP * K + 1] = 0.5f;
  mmfx_io io;
  mmfx_io_init(&io, TP + 1, hid, ids, w, out);
  CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, "num-max-tokens-per-rank");
  mmfx_io_init(&io, 0, hid, ids, w, out);
  memset(out, 0x77, sizeof out);
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  CHECK(out[0] == 0x7777 && out[H - 1] == 0x7777); /* zero tokens: nothing written */
  io.h.data = io.ids.data = io.w.data = io.out.data = NULL; /* and NULL data is fine then */
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  CHECK_ERR(mmfx_plan(op, -1), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mmfx_plan(op, (1 << 20) + 1), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_OK(mmfx_plan(op, 0)); /* 0: the config's num-max-tokens-per-rank (16) */
  megamoe_op_info_args in;
  CHECK_OK(mmfx_info(op, &in));
  CHECK_EQ_INT(in.planned_tokens, TP);
  check_still_works(op); /* exactly the planned count */
  CHECK_OK(mmfx_plan(op, TP - 1));
  mmfx_io_init(&io, TP, hid, ids, w, out);
  CHECK_ERR(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_OK(mmfx_plan(op, TP));
  check_still_works(op);
  /* ABI 1.2's max_tokens_any_rank: 0 or in [T, planned]; a 1.1-sized
   * struct's caller never set it (its bytes are not read); same output */
  enum { T = 5 };
  static uint16_t want[T * H], got[T * H];
  mmfx_io_init(&io, T, hid, ids, w, want);
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  const size_t full = MEGAMOE_OP_EXECUTE_ARGS_STRUCT_SIZE,
               v10 = MEGAMOE_OP_EXECUTE_ARGS_STRUCT_SIZE_1_0;
  CHECK_ERR_MSG(mmfx_execute_sized(op, 0, &io.h, &io.ids, &io.w, &io.out, full, T - 1),
                MEGAMOE_CODE_INVALID_ARGUMENT, "max_tokens_any_rank 4");
  CHECK_ERR_MSG(mmfx_execute_sized(op, 0, &io.h, &io.ids, &io.w, &io.out, full, TP + 1),
                MEGAMOE_CODE_INVALID_ARGUMENT, "max_tokens_any_rank");
  CHECK_ERR(mmfx_execute_sized(op, 0, &io.h, &io.ids, &io.w, &io.out, full, -1),
            MEGAMOE_CODE_INVALID_ARGUMENT);
  const int32_t fine[3] = {T, TP, 0};
  for (int i = 0; i < 4; i++) {
    mmfx_io_init(&io, T, hid, ids, w, got);
    memset(got, 0x55, sizeof got);
    CHECK_OK(i < 3 ? mmfx_execute_sized(op, 0, &io.h, &io.ids, &io.w, &io.out, full, fine[i])
                   : mmfx_execute_sized(op, 0, &io.h, &io.ids, &io.w, &io.out, v10, -7));
    CHECK_MSG(memcmp(got, want, sizeof got) == 0, "max_tokens_any_rank case %d", i);
  }
  CHECK_OK(mmfx_destroy(op));
}

/* Descriptors: device, strides, alignment, overlap, dtype, shape. */
static void test_bad_descriptors(void) {
  megamoe_op *op = ready_op();
  if (!op) return;
  enum { T = 4 };
  static uint16_t hid[T * H + 8], out[T * H + 8];
  int32_t ids[T * K + 4];
  float w[T * K + 4];
  memcpy(hid, g_ref_hid, T * H * 2);
  memcpy(ids, g_ref_ids, sizeof g_ref_ids[0] * T * K);
  memcpy(w, g_ref_w, sizeof g_ref_w[0] * T * K);
  mmfx_io io;
  mmfx_io_init(&io, T, hid, ids, w, out);
  DLTensor *ts[4] = {&io.h, &io.ids, &io.w, &io.out};
  const char *names[4] = {"hidden", "topk_ids", "topk_weights", "out"};
  for (int i = 0; i < 4; i++) {
    DLTensor saved = *ts[i];
    ts[i]->device.device_type = kDLCUDA;
    CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, "must be on the host");
    ts[i]->device.device_type = kDLOpenCL;
    CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, names[i]);
    ts[i]->device.device_type = kDLCUDAHost; /* pinned host memory is host memory */
    CHECK_OK(mmfx_execute_io(op, 0, &io));
    *ts[i] = saved;
    int64_t col_major[2] = {1, ts[i]->shape[0]};
    ts[i]->strides = col_major;
    CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, "strides");
    int64_t padded[2] = {ts[i]->shape[1] + 1, 1};
    ts[i]->strides = padded;
    CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, names[i]);
    int64_t compact[2] = {ts[i]->shape[1], 1};
    ts[i]->strides = compact; /* explicit compact strides are fine */
    CHECK_OK(mmfx_execute_io(op, 0, &io));
    *ts[i] = saved;
    ts[i]->byte_offset = i == 0 || i == 3 ? 1 : 2; /* not element aligned */
    CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, "aligned");
    *ts[i] = saved;
    ts[i]->dtype.lanes = 2;
    CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, names[i]);
    ts[i]->dtype = (DLDataType){kDLFloat, 64, 1};
    CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, names[i]);
    *ts[i] = saved;
    int64_t sh3[3] = {ts[i]->shape[0], ts[i]->shape[1], 1};
    ts[i]->shape = sh3;
    ts[i]->ndim = 3;
    CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, names[i]);
    ts[i]->shape = saved.shape;
    ts[i]->ndim = 1;
    CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, names[i]);
    *ts[i] = saved;
    ts[i]->shape[1] += 1; /* hidden size / top-k mismatch */
    CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, names[i]);
    ts[i]->shape[1] -= 1;
    if (i > 0) {
      ts[i]->shape[0] -= 1; /* T differs between tensors */
      CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, names[i]);
      ts[i]->shape[0] += 1;
    }
    ts[i]->data = NULL;
    CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, "NULL");
    ts[i]->shape = NULL;
    CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, "shape is NULL");
    *ts[i] = saved;
  }
  /* an empty 4-d tensor with huge dimensions and strides: refused, no overflow */
  {
    DLTensor saved = io.h;
    int64_t sh4[4] = {0, (int64_t)1 << 40, (int64_t)1 << 40, (int64_t)1 << 40};
    int64_t st4[4] = {0, (int64_t)1 << 62, (int64_t)1 << 40, 1};
    io.h.ndim = 4;
    io.h.shape = sh4;
    io.h.strides = st4;
    CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, "hidden");
    io.h = saved;
  }
  /* element-aligned offsets are fine: hidden at element 8 of a larger buffer */
  memmove(hid + 8, hid, T * H * 2);
  io.h.byte_offset = 16;
  static uint16_t out_off[T * H + 8];
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  memcpy(out_off, out, sizeof out);
  memmove(hid, hid + 8, T * H * 2);
  io.h.byte_offset = 0;
  CHECK_OK(mmfx_execute_io(op, 0, &io));
  CHECK(memcmp(out_off, out, T * H * 2) == 0);
  CHECK(memcmp(out, g_ref_out, T * H * 2) == 0);
  /* out overlapping an input */
  io.out.data = hid;
  CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, "overlaps hidden");
  io.out.data = (uint8_t *)hid + H; /* partial overlap */
  CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, "overlaps hidden");
  static uint16_t big[T * H * 2];
  memcpy(big, ids, sizeof ids[0] * T * K);
  io.ids.data = big; /* ids at the start of out's buffer */
  io.out.data = big;
  CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, "overlaps topk_ids");
  io.ids.data = ids;
  memcpy(big + T * H, w, sizeof w[0] * T * K);
  io.w.data = big + T * H;
  io.out.data = big + 4;
  CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, "overlaps topk_weights");
  io.w.data = w;
  io.out.data = out;
  /* out-of-range ids */
  static const int32_t bad_ids[4] = {E, -2, INT32_MIN, INT32_MAX};
  for (int i = 0; i < 4; i++) {
    int32_t saved = ids[3];
    ids[3] = bad_ids[i];
    CHECK_ERR_MSG(mmfx_execute_io(op, 0, &io), MEGAMOE_CODE_INVALID_ARGUMENT, "topk_ids[1][1]");
    ids[3] = saved;
  }
  check_still_works(op);
  CHECK_OK(mmfx_destroy(op));
}

/* Another request's op is not disturbed by a misbehaving neighbour: one
 * thread runs valid executes and checks every output, another creates,
 * misuses and destroys its own ops (stale handles, bad tensors, bad
 * weights) at the same time. */
typedef struct {
  megamoe_op *op;
  int iters, bad;
} worker_arg;

static void *good_worker(void *p) {
  worker_arg *w = p;
  static uint16_t out[TP * H];
  mmfx_io io;
  mmfx_io_init(&io, TP, g_ref_hid, g_ref_ids, g_ref_w, out);
  for (int i = 0; i < w->iters; i++) {
    memset(out, 0xFF, sizeof out);
    megamoe_error *e = mmfx_execute_io(w->op, 0, &io);
    if (e || memcmp(out, g_ref_out, sizeof out) != 0) w->bad++;
    megamoe_error_destroy(e);
  }
  return NULL;
}

static void *bad_worker(void *p) {
  worker_arg *w = p;
  static uint16_t out[TP * H];
  static megamoe_named_tensor nt[MMFX_NT];
  for (int i = 0; i < w->iters; i++) {
    megamoe_error *e;
    megamoe_op *op = create_op(&e);
    megamoe_error_destroy(e);
    if (!op) {
      w->bad++;
      continue;
    }
    mmfx_io io;
    mmfx_io_init(&io, TP, g_ref_hid, g_ref_ids, g_ref_w, out);
    megamoe_error_destroy(mmfx_execute_io(op, 0, &io)); /* before plan */
    memcpy(nt, mmfx_nt, sizeof nt);
    nt[i % MMFX_NT].name = "experts.0.gate_proj.weight"; /* a duplicate or a missing one */
    megamoe_error_destroy(mmfx_prepare(op, 0, nt, MMFX_NT));
    megamoe_error_destroy(mmfx_plan(op, -3));
    io.h.byte_offset = 1;
    megamoe_error_destroy(mmfx_execute_io(op, 0, &io));
    megamoe_error_destroy(mmfx_destroy(op));
    megamoe_error_destroy(mmfx_destroy(op)); /* stale */
    megamoe_error_destroy(mmfx_execute_io(op, 0, &io));
  }
  return NULL;
}

static void test_neighbour_misuse(void) {
  megamoe_op *op = ready_op();
  if (!op) return;
  worker_arg good = {op, 40, 0}, bad = {NULL, 40, 0};
  pthread_t a, b;
  CHECK(pthread_create(&a, NULL, good_worker, &good) == 0);
  CHECK(pthread_create(&b, NULL, bad_worker, &bad) == 0);
  pthread_join(a, NULL);
  pthread_join(b, NULL);
  CHECK_EQ_INT(good.bad, 0);
  CHECK_EQ_INT(bad.bad, 0);
  check_still_works(op);
  CHECK_OK(mmfx_destroy(op));
}

/* ---- files ----------------------------------------------------------------------------------- */
static void on_alarm(int sig) {
  (void)sig;
  static const char msg[] = "Bail out! timed out: a file operation hung (FIFO?)\n";
  ssize_t r = write(1, msg, sizeof msg - 1);
  (void)r;
  _exit(1);
}

/* FIFOs where a config, a config.json or a checkpoint is expected must be
 * refused at once, not block in open() waiting for a writer. */
static void test_fifo_paths(void) {
  char fifo[512], yaml[512];
  snprintf(fifo, sizeof fifo, "%s/pipe", g_tmp);
  snprintf(yaml, sizeof yaml, "%s/with-json.yaml", g_tmp);
  if (mkfifo(fifo, 0600) != 0) {
    printf("# mkfifo: %s (skipped)\n", strerror(errno));
    return;
  }
  signal(SIGALRM, on_alarm);
  alarm(20);
  megamoe_op_create_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = MEGAMOE_OP_CREATE_ARGS_STRUCT_SIZE;
  a.config_path = fifo;
  a.device = -1;
  CHECK_ERR_MSG(mmfx_api->validate_config(&a), MEGAMOE_CODE_INVALID_ARGUMENT, "not a regular file");
  FILE *f = fopen(yaml, "w");
  if (f) {
    fprintf(f, "schema-version: 1\nmodel:\n  config-json: pipe\n");
    fclose(f);
  }
  a.config_path = yaml;
  CHECK_ERR_MSG(mmfx_api->validate_config(&a), MEGAMOE_CODE_INVALID_ARGUMENT, "config-json");
  mm_st_file *st = NULL;
  megamoe_error *e = mm_st_open(fifo, &st);
  CHECK(e && e->code == MEGAMOE_CODE_INVALID_ARGUMENT);
  megamoe_error_destroy(e);
  mm_st_ckpt *ck = NULL;
  e = mm_st_ckpt_open(fifo, &ck);
  CHECK(e != NULL && ck == NULL);
  megamoe_error_destroy(e);
  alarm(0);
  unlink(fifo);
  unlink(yaml);
}

/* A checkpoint of the tiny model, layer 0 (model.layers.0.mlp.experts.*),
 * written byte by byte so that broken variants are easy to make. */
typedef enum {
  CK_VALID,
  CK_OVERLAP,        /* the second tensor's data starts inside the first */
  CK_MISSING_EXPERT, /* expert 3 absent */
  CK_GATE_UP_SHAPES, /* expert 1: up has half the rows of gate */
  CK_NAN_SCALE,      /* expert 2: a 0xFF (NaN) E4M3 byte in down_proj.weight_scale */
  CK_F4_WEIGHTS,     /* codes typed F4 [N, K] (elements) instead of U8 [N, K/2] */
  CK_F16_SCALE,      /* expert 0: gate_proj.weight_scale typed F16 (same bytes) */
} ck_kind;

static int write_ckpt(const char *path, ck_kind kind) {
  static char hdr[1 << 16];
  static uint8_t data[E * 3 * (H * I / 2 + H * I / 16 + 8)];
  size_t hl = 0, dl = 0;
  hl += (size_t)snprintf(hdr + hl, sizeof hdr - hl, "{\"__metadata__\":{\"format\":\"pt\"}");
  for (int e = 0; e < E; e++)
    for (int p = 0; p < 3; p++)
      for (int s = 0; s < 4; s++) {
        if (kind == CK_MISSING_EXPERT && e == 3) continue;
        const DLTensor *t = &mmfx_dl[mmfx_tensor_index(e, p, s)];
        int64_t r = t->ndim ? t->shape[0] : 0, c = t->ndim ? t->shape[1] : 0;
        if (kind == CK_GATE_UP_SHAPES && e == 1 && p == 1 && s < 2) r /= 2;
        size_t nb = s >= 2 ? 4 : (size_t)(r * c);
        size_t begin = dl;
        if (kind == CK_OVERLAP && e == 0 && p == 0 && s == 1) begin = 64;
        memcpy(data + dl, t->data, nb);
        if (kind == CK_NAN_SCALE && e == 2 && p == 2 && s == 1) data[dl + 11] = 0xFF;
        dl += nb;
        const char *dtype = s == 0 ? "U8" : s == 1 ? "F8_E4M3" : "F32";
        if (kind == CK_F4_WEIGHTS && s == 0) dtype = "F4", c *= 2;
        if (kind == CK_F16_SCALE && e == 0 && p == 0 && s == 1) dtype = "F16", c /= 2;
        char shape[64];
        if (s >= 2) snprintf(shape, sizeof shape, "[]");
        else snprintf(shape, sizeof shape, "[%lld,%lld]", (long long)r, (long long)c);
        hl += (size_t)snprintf(hdr + hl, sizeof hdr - hl,
                               ",\"model.layers.0.mlp.experts.%d.%s_proj.%s\":{\"dtype\":\"%s\","
                               "\"shape\":%s,\"data_offsets\":[%zu,%zu]}",
                               e, mmfx_proj[p], mmfx_field[s], dtype, shape, begin, begin + nb);
      }
  hl += (size_t)snprintf(hdr + hl, sizeof hdr - hl, "}");
  while (hl % 8) hdr[hl++] = ' ';
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  uint8_t len[8];
  for (int i = 0; i < 8; i++) len[i] = (uint8_t)((uint64_t)hl >> (8 * i));
  int ok = fwrite(len, 1, 8, f) == 8 && fwrite(hdr, 1, hl, f) == hl && fwrite(data, 1, dl, f) == dl;
  return fclose(f) == 0 && ok ? 0 : -1;
}

/* Copies src to dst keeping `keep` bytes (all when keep < 0), then patches
 * `len` bytes at `at` (none when patch is NULL). */
static int copy_patched(const char *src, const char *dst, long keep, long at, const void *patch,
                        size_t len) {
  FILE *in = fopen(src, "rb"), *out = fopen(dst, "wb");
  if (!in || !out) {
    if (in) fclose(in);
    if (out) fclose(out);
    return -1;
  }
  static char buf[1 << 20];
  size_t n = fread(buf, 1, sizeof buf, in);
  fclose(in);
  if (keep >= 0 && (size_t)keep < n) n = (size_t)keep;
  if (patch && at >= 0 && (size_t)at + len <= n) memcpy(buf + at, patch, len);
  size_t w = fwrite(buf, 1, n, out);
  return fclose(out) == 0 && w == n ? 0 : -1;
}

/* Runs megamoe-host --cpu on `ckpt`; returns its exit status, output in out. */
static int run_host(const char *ckpt, char *out, size_t cap) {
  const char *dir = getenv("MEGAMOE_BUILDDIR");
  char cfg[512], cmd[8192];
  snprintf(cfg, sizeof cfg, "%s/host.yaml", g_tmp);
  FILE *f = fopen(cfg, "w");
  if (!f) return -1;
  fputs(kConfig, f);
  fclose(f);
  snprintf(cmd, sizeof cmd,
           "MEGAMOE_PLUGIN_PATH= timeout 120 %s/host/megamoe-host --plugin %s --config %s "
           "--checkpoint %s --cpu --tokens 5 --iters 1 --warmup 1 --check-tokens 3 2>&1",
           dir ? dir : ".", g_plugin_path, cfg, ckpt);
  FILE *p = popen(cmd, "r");
  if (!p) return -1;
  size_t n = fread(out, 1, cap - 1, p);
  out[n] = '\0';
  int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static void expect_host(const char *ckpt, int want_rc, const char *needle1, const char *needle2) {
  static char out[1 << 16];
  int rc = run_host(ckpt, out, sizeof out);
  int ok = rc == want_rc && strstr(out, needle1) && (!needle2 || strstr(out, needle2));
  CHECK_MSG(ok, "megamoe-host on %s: exit %d (want %d), want '%s'%s%s in:\n%s", ckpt, rc, want_rc,
            needle1, needle2 ? " and " : "", needle2 ? needle2 : "", out);
  if (ok) { /* the line that names the problem, for the log */
    const char *at = strstr(out, needle1);
    const char *bol = at;
    while (bol > out && bol[-1] != '\n') bol--;
    const char *eol = strchr(at, '\n');
    printf("#   %s -> exit %d: %.*s\n", strrchr(ckpt, '/') + 1, rc,
           (int)((eol ? eol : at + strlen(at)) - bol > 300 ? 300 : (eol ? eol : at + strlen(at)) - bol), bol);
  }
}

static void test_hostile_checkpoints(void) {
  char good[512], p[1024], q[1024];
  snprintf(good, sizeof good, "%s/good.safetensors", g_tmp);
  CHECK(write_ckpt(good, CK_VALID) == 0);
  expect_host(good, 0, "megamoe-host: PASS", NULL);
  struct stat st;
  CHECK(stat(good, &st) == 0);
  /* truncated data section: the last tensors run past the end */
  snprintf(p, sizeof p, "%s/truncated.safetensors", g_tmp);
  CHECK(copy_patched(good, p, (long)st.st_size - 100, -1, NULL, 0) == 0);
  expect_host(p, 1, "truncated.safetensors", "truncated?");
  /* truncated inside the header */
  snprintf(p, sizeof p, "%s/short-header.safetensors", g_tmp);
  CHECK(copy_patched(good, p, 200, -1, NULL, 0) == 0);
  expect_host(p, 1, "runs past the end", NULL);
  /* a header length of 1 TiB */
  snprintf(p, sizeof p, "%s/huge-header.safetensors", g_tmp);
  static const uint8_t huge[8] = {0, 0, 0, 0, 0, 1, 0, 0};
  CHECK(copy_patched(good, p, -1, 0, huge, 8) == 0);
  expect_host(p, 1, "exceeds", NULL);
  /* overlapping tensors */
  snprintf(p, sizeof p, "%s/overlap.safetensors", g_tmp);
  CHECK(write_ckpt(p, CK_OVERLAP) == 0);
  expect_host(p, 1, "overlaps tensor", "experts.0.gate_proj.weight");
  /* a missing expert */
  snprintf(p, sizeof p, "%s/missing-expert.safetensors", g_tmp);
  CHECK(write_ckpt(p, CK_MISSING_EXPERT) == 0);
  expect_host(p, 1, "experts.3.gate_proj.weight: missing", NULL);
  /* gate and up of different shapes */
  snprintf(p, sizeof p, "%s/gate-up.safetensors", g_tmp);
  CHECK(write_ckpt(p, CK_GATE_UP_SHAPES) == 0);
  expect_host(p, 1, "experts.1.up_proj.weight", "gate and up must have the same shape");
  /* a NaN scale byte */
  snprintf(p, sizeof p, "%s/nan-scale.safetensors", g_tmp);
  CHECK(write_ckpt(p, CK_NAN_SCALE) == 0);
  expect_host(p, 1, "experts.2.down_proj.weight_scale: NaN scale byte", NULL);
  /* FP4 codes typed F4 (shape in elements): the host must pass them as 4-bit
   * elements (it relabelled them U8 of twice the size: an over-read) */
  snprintf(p, sizeof p, "%s/f4.safetensors", g_tmp);
  CHECK(write_ckpt(p, CK_F4_WEIGHTS) == 0);
  expect_host(p, 0, "megamoe-host: PASS", NULL);
  /* a scale stored as F16: refused by name (it was relabelled U8 and used) */
  snprintf(p, sizeof p, "%s/f16-scale.safetensors", g_tmp);
  CHECK(write_ckpt(p, CK_F16_SCALE) == 0);
  expect_host(p, 1, "experts.0.gate_proj.weight_scale", "unsupported dtype");
  /* the same tensors in two shards of a directory checkpoint */
  char d[512];
  snprintf(d, sizeof d, "%.256s/sharded", g_tmp);
  CHECK(mkdir(d, 0700) == 0);
  snprintf(p, sizeof p, "%s/a.safetensors", d);
  snprintf(q, sizeof q, "%s/b.safetensors", d);
  CHECK(copy_patched(good, p, -1, -1, NULL, 0) == 0 && copy_patched(good, q, -1, -1, NULL, 0) == 0);
  expect_host(d, 1, "is in both", NULL);
  /* no file at all */
  snprintf(p, sizeof p, "%s/does-not-exist.safetensors", g_tmp);
  expect_host(p, 1, "does-not-exist.safetensors", NULL);
}


int main(void) {
  char why[2304];
  g_init = mmfx_load(g_plugin_path, sizeof g_plugin_path, why, sizeof why);
  if (!g_init) {
    printf("Bail out! %s\n", why);
    return 1;
  }
  megamoe_error *e = plugin_init();
  if (e || !mmfx_api) {
    printf("Bail out! plugin init failed: %s\n", e ? e->message : "no entry point / op");
    return 1;
  }
  const char *tmp = getenv("TMPDIR");
  snprintf(g_tmp, sizeof g_tmp, "%s/megamoe-hostile-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(g_tmp)) {
    printf("Bail out! mkdtemp: %s\n", strerror(errno));
    return 1;
  }
  mm_test_seed();
  mmfx_make_raw(mm_test_rand_u64);
  mmfx_make_tensors();
  make_reference();
  RUN(test_duplicate_ids);
  RUN(test_nan_inf_inputs);
  RUN(test_nan_inf_with_clamp);
  RUN(test_bad_weight_values);
  RUN(test_bad_weight_tensors);
  RUN(test_token_counts);
  RUN(test_bad_descriptors);
  RUN(test_neighbour_misuse);
  RUN(test_fifo_paths);
  RUN(test_hostile_checkpoints);
  RUN(test_lifecycle_misuse); /* last: finalizes and re-inits the plugin */
  mm_test_rm_tree(g_tmp);
  return mm_test_done();
}

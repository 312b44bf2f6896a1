/* fuzz_abi_tensors.c -- libFuzzer target for the plugin's op API at its ABI
 * boundary (plugin/op.c, entry.c, dltensor.c, weights_load.c, the
 * cpu-reference backend), driven only through megamoe_plugin.h: the plugin
 * objects are linked in (scripts/fuzz.sh), or the built .so is dlopened
 * (MM_FUZZ_DLOPEN, the corpus replay in `make check`).
 *
 * A tiny model (hidden 128, intermediate 128, 4 experts, top-2, NVFP4) is
 * prepared on a main op at layer 0 and planned for 8 tokens once. Each input
 * is a program of up to 8 actions read from the bytes:
 *   X  execute with fuzzed DLTensor descriptors (dtype, ndim, shape, strides,
 *      device, byte_offset, NULLs) and fuzzed contents (NaN/Inf hidden and
 *      weights, out-of-range / duplicated / masked expert ids);
 *   P  prepare_weights of layer 1..3 (or a bad layer) from the valid tensor
 *      set with fuzzed mutations (drop, duplicate, rename, dtype, shape, ndim,
 *      NaN scale bytes, device, strides, misalignment, NULLs);
 *   L  plan with a fuzzed token count;
 *   C  lifecycle of a second op (create variants, prepare, plan, execute,
 *      info, check, destroy, double destroy, stale and foreign handles);
 *   N  NULL args and short / long struct sizes.
 * Oracles (any violation aborts, so libFuzzer records the input):
 *   - errors: code in [1, 16], non-empty message; descriptor errors are
 *     INVALID_ARGUMENT, lifecycle errors FAILED_PRECONDITION;
 *   - execute accepts a call iff an independent model of the documented
 *     rules (fuzz_exec_valid) says it is valid;
 *   - an accepted execute is deterministic (run twice, same bits) and token
 *     0 alone gives the same row as in the batch (tokens are independent,
 *     NaN in one token cannot leak into another);
 *   - a failed prepare leaves the layer count and the layer's output as they
 *     were (nothing half-loaded is used);
 *   - after every input a valid execute of layer 0 on the main op returns
 *     the baseline bits (the op stays usable after any error). */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "megamoe_plugin.h"

#define FZ_FAIL(...)                                      \
  do {                                                    \
    fprintf(stderr, "fuzz_abi_tensors: " __VA_ARGS__);    \
    fputc('\n', stderr);                                  \
    abort();                                              \
  } while (0)

enum { H = 128, I = 128, E = 4, K = 2, TMAX = 8, NLAYERS = 4 };
#include "../abi_fixture.h"

static const char *kConfig =
    "schema-version: 1\n"
    "backend: cpu-reference\n"
    "model: {hidden-size: 128, moe-intermediate-size: 128, num-experts: 4, top-k: 2}\n"
    "num-max-tokens-per-rank: 8\n"
    "cpu: {threads: 1}\n"
    "log-level: error\n";

static megamoe_op *g_op; /* main op */
static int g_planned;     /* its planned tokens */
static int g_ready[NLAYERS];
static uint16_t g_layer_out[NLAYERS][2 * H]; /* valid 2-token output per ready layer */
static uint16_t g_hid0[2 * H];
static int32_t g_ids0[2 * K] = {0, 1, 3, 2};
static float g_w0[2 * K] = {0.75f, 0.25f, 0.5f, 0.5f};

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t rng(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}

/* ---- errors --------------------------------------------------------------------- */
/* Checks the error's form; returns its code (OK for NULL) and frees it. */
static megamoe_code take(megamoe_error *e, const char *what) {
  if (!e) return MEGAMOE_CODE_OK;
  megamoe_code c = e->code;
  if (c <= MEGAMOE_CODE_OK || c >= MEGAMOE_CODE_COUNT_ || !e->message || !e->message[0])
    FZ_FAIL("%s: malformed error object (code %d)", what, (int)c);
  megamoe_error_destroy(e);
  return c;
}
static void expect(megamoe_error *e, megamoe_code want, const char *what) {
  megamoe_error *keep = e;
  const char *msg = e && e->message ? e->message : "";
  char buf[512];
  snprintf(buf, sizeof buf, "%s", msg);
  megamoe_code got = take(keep, what);
  if (got != want) FZ_FAIL("%s: code %d, expected %d (%s)", what, (int)got, (int)want, buf);
}

/* ---- fuzz input reader ------------------------------------------------------------ */
typedef struct {
  const uint8_t *p;
  size_t n;
} fz;
static uint8_t u8(fz *f) {
  if (!f || !f->n) return (uint8_t)rng();
  f->n--;
  return *f->p++;
}
static uint32_t u32(fz *f) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v = v << 8 | u8(f);
  return v;
}

/* ---- tensors with exactly-sized buffers ---------------------------------------------- */
typedef struct {
  DLTensor t;
  int64_t shape[8], strides[8];
  void *buf; /* owned */
  int null_tensor, null_data;
  char name[96];
  int null_name;
} fz_tensor;

static size_t elem_bits(DLDataType d) { return (size_t)d.bits * (d.lanes ? d.lanes : 1); }

/* Elements the descriptor claims, or -1 when negative / absurd. */
static int64_t claimed_numel(const DLTensor *t) {
  if (t->ndim < 0 || t->ndim > 8 || (t->ndim > 0 && !t->shape)) return -1;
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++) {
    if (t->shape[i] < 0 || t->shape[i] > ((int64_t)1 << 40)) return -1;
    if (t->shape[i] && n > ((int64_t)1 << 40) / t->shape[i]) return -1;
    n *= t->shape[i];
  }
  return n;
}

/* Bytes a compact tensor of the descriptor holds (0 when absurd). */
static size_t claimed_bytes(const DLTensor *t) {
  int64_t n = claimed_numel(t);
  if (n < 0) return 0;
  uint64_t b = ((uint64_t)n * elem_bits(t->dtype) + 7) / 8;
  return b > (1u << 20) ? 0 : (size_t)b;
}

/* Allocates what the descriptor claims (byte_offset + compact bytes), so
 * ASan sees any access beyond it. A descriptor claiming more than 1 MiB gets
 * a 64-byte buffer: the op must reject it before touching the data. `src`
 * (optional) seeds the content, the rest comes from `fill`. */
typedef void (*fill_fn)(fz *f, uint8_t *p, size_t nbytes);
static void materialize(fz_tensor *x, fz *f, fill_fn fill, const void *src, size_t src_len) {
  free(x->buf);
  x->buf = NULL;
  int64_t n = claimed_numel(&x->t);
  size_t bits = elem_bits(x->t.dtype);
  size_t bytes = n < 0 ? SIZE_MAX : (size_t)(((uint64_t)n * bits + 7) / 8);
  if (n < 0 || bytes > (1u << 20) || x->t.byte_offset > 4096) {
    x->buf = calloc(1, 64);
    x->t.byte_offset = 0;
  } else {
    x->buf = malloc(x->t.byte_offset + bytes + (x->t.byte_offset + bytes == 0));
    if (!x->buf) abort();
    uint8_t *p = (uint8_t *)x->buf + x->t.byte_offset;
    memset(x->buf, 0xA5, x->t.byte_offset);
    size_t c = src ? (src_len < bytes ? src_len : bytes) : 0;
    if (c) memcpy(p, src, c);
    if (bytes > c) fill(f, p + c, bytes - c);
  }
  x->t.data = x->null_data ? NULL : x->buf;
}

static void fill_bytes(fz *f, uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++) p[i] = u8(f);
}
static void fill_poison(fz *f, uint8_t *p, size_t n) { memset(p, 0xFF, n); }
static void fill_hidden(fz *f, uint8_t *p, size_t n) {
  static const uint16_t special[8] = {0x7FC0, 0x7F80, 0xFF80, 0x7F7F, 0x0001, 0x8000, 0xFFC1, 0xFF7F};
  for (size_t i = 0; i + 1 < n; i += 2) {
    uint8_t b = u8(f);
    uint16_t v;
    if (b < 240) {
      float x = ((float)b - 120.0f) / 24.0f;
      uint32_t u;
      memcpy(&u, &x, 4);
      v = (uint16_t)(u >> 16);
    } else {
      v = special[b & 7];
    }
    memcpy(p + i, &v, 2);
  }
  if (n & 1) p[n - 1] = u8(f);
}
static void fill_ids(fz *f, uint8_t *p, size_t n) {
  static const int32_t special[8] = {-1, E, -2, INT32_MIN, INT32_MAX, 1000, -1, -1};
  int32_t prev = 0;
  for (size_t i = 0; i + 3 < n; i += 4) {
    uint8_t b = u8(f);
    int32_t v = b < 200 ? (int32_t)(b % E) : b < 240 ? prev /* duplicate */ : special[b & 7];
    memcpy(p + i, &v, 4);
    prev = v;
  }
  for (size_t i = n & ~(size_t)3; i < n; i++) p[i] = u8(f);
}
static void fill_weights(fz *f, uint8_t *p, size_t n) {
  static const float special[8] = {0.0f / 0.0f, 1.0f / 0.0f, -1.0f / 0.0f, -1.0f,
                                   0.0f,        1e30f,       1e-40f,       3.4e38f};
  for (size_t i = 0; i + 3 < n; i += 4) {
    uint8_t b = u8(f);
    float v = b < 224 ? (float)b / 224.0f : special[b & 7];
    memcpy(p + i, &v, 4);
  }
  for (size_t i = n & ~(size_t)3; i < n; i++) p[i] = u8(f);
}

static void set2(fz_tensor *x, uint8_t code, uint8_t bits, int64_t a, int64_t b) {
  memset(&x->t, 0, sizeof x->t);
  x->t.ndim = 2;
  x->shape[0] = a;
  x->shape[1] = b;
  x->t.shape = x->shape;
  x->t.dtype = (DLDataType){code, bits, 1};
  x->t.device.device_type = kDLCPU;
  x->null_tensor = 0;
}

static int64_t shape_menu(fz *f, int64_t valid) {
  static const int64_t m[16] = {0, 1, 2, 3, 7, 8, 9, H, K, H + 1, K + 1, -1,
                                (int64_t)1 << 40, ((int64_t)1 << 40) + 1, INT64_MAX, INT64_MIN};
  uint8_t b = u8(f);
  return b < 128 ? valid : m[b & 15];
}

static int64_t bump(int64_t v, int d) { /* v + d without overflow */
  return (d > 0 && v == INT64_MAX) || (d < 0 && v == INT64_MIN) ? v : v + d;
}

/* One random change to a descriptor (never lies about memory it claims:
 * materialize() sizes the buffer after the change). */
static void mutate_desc(fz *f, fz_tensor *x, int depth) {
  static const uint8_t codes[8] = {kDLInt, kDLUInt, kDLFloat, kDLBfloat, MEGAMOE_DL_FLOAT8_E4M3FN,
                                   MEGAMOE_DL_FLOAT8_E8M0FNU, MEGAMOE_DL_FLOAT4_E2M1FN, 200};
  static const uint8_t bits[6] = {4, 8, 16, 32, 64, 0};
  static const int devs[8] = {kDLCPU, kDLCUDA, kDLCUDAHost, kDLOpenCL, kDLVulkan, kDLMetal, 99, -1};
  uint8_t w = u8(f);
  switch (w % 12) {
    case 0:
      x->t.dtype.code = codes[u8(f) & 7];
      x->t.dtype.bits = bits[u8(f) % 6];
      if (u8(f) > 200) x->t.dtype.lanes = (uint16_t)(u8(f) % 4);
      break;
    case 1: {
      int nd = u8(f) % 7 - 1; /* -1 .. 5 */
      for (int d = x->t.ndim > 0 ? x->t.ndim : 0; d < 8; d++) x->shape[d] = shape_menu(f, 1 + (u8(f) & 3));
      x->t.ndim = nd;
      break;
    }
    case 2: x->shape[0] = shape_menu(f, bump(x->shape[0], 1)); break;
    case 3: x->shape[1] = shape_menu(f, bump(x->shape[1], -1)); break;
    case 4: {
      uint8_t k = u8(f) % 5;
      int nd = x->t.ndim > 0 && x->t.ndim <= 8 ? x->t.ndim : 0;
      int64_t st = 1;
      for (int d = nd - 1; d >= 0; d--) {
        x->strides[d] = st;
        st = (int64_t)((uint64_t)st * (uint64_t)x->shape[d]); /* wraps, no UB */
      }
      if (k == 1 && nd == 2) { /* column-major */
        x->strides[0] = 1;
        x->strides[1] = x->shape[0];
      } else if (k == 2 && nd > 0) {
        x->strides[0] = 0; /* broadcast */
      } else if (k == 3 && nd > 0) {
        x->strides[nd - 1] = 2; /* padded */
      } else if (k == 4 && nd > 0) {
        x->strides[u8(f) % nd] = (int64_t)u32(f) - 0x7FFFFFFF;
      }
      x->t.strides = x->strides;
      break;
    }
    case 5:
      x->t.device.device_type = (DLDeviceType)devs[u8(f) & 7];
      x->t.device.device_id = (int32_t)(u8(f) % 4) - 1;
      break;
    case 6: x->t.byte_offset = (uint64_t)(u8(f) % 9); break;
    case 7: x->null_data = 1; break;
    case 8: x->null_tensor = 1; break;
    case 9: x->t.shape = NULL; break;
    case 10:
      if (depth < 3) {
        mutate_desc(f, x, depth + 1);
        mutate_desc(f, x, depth + 1);
      }
      break;
    default: x->shape[0] = bump(x->shape[0], 1); break;
  }
}

/* ---- the independent model of execute's rules -------------------------------------------- */
static int strides_compact(const DLTensor *t) {
  if (!t->strides) return 1;
  int64_t expect = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    if (t->shape[d] != 1 && t->strides[d] != expect) return 0;
    expect *= t->shape[d];
  }
  return 1;
}

static const char *g_why = ""; /* why the model called a call invalid */

static int desc_ok(const char *what, const DLTensor *t, uint8_t code, uint8_t bits, int64_t d0,
                   int64_t d1) {
  static char why[128];
#define BAD(reason)                                               \
  do {                                                            \
    snprintf(why, sizeof why, "%s: %s", what, reason);            \
    g_why = why;                                                  \
    return 0;                                                     \
  } while (0)
  if (!t) BAD("NULL tensor");
  if (t->ndim != 2 || !t->shape) BAD("ndim or shape");
  if (t->dtype.code != code || t->dtype.bits != bits || t->dtype.lanes != 1) BAD("dtype");
  if (t->shape[0] != d0 || t->shape[1] != d1) BAD("shape");
  if (t->device.device_type != kDLCPU && t->device.device_type != kDLCUDAHost) BAD("device");
  if (d0 * d1 > 0) { /* an empty tensor's strides and data do not matter */
    if (!strides_compact(t)) BAD("strides");
    if (!t->data) BAD("NULL data");
    if (((uintptr_t)t->data + t->byte_offset) % (bits / 8)) BAD("misaligned");
  }
  return 1;
#undef BAD
}

static const uint8_t *first_byte(const DLTensor *t) {
  return (const uint8_t *)((uintptr_t)t->data + (uintptr_t)t->byte_offset);
}
static int overlap(const DLTensor *a, size_t an, const DLTensor *b, size_t bn) {
  if (!an || !bn) return 0;
  const uint8_t *x = first_byte(a), *y = first_byte(b);
  return x < y + bn && y < x + an;
}

/* 1: valid; 0: invalid descriptors (INVALID_ARGUMENT); -1: invalid ids. */
static int fuzz_exec_valid(const DLTensor *h, const DLTensor *ids, const DLTensor *w,
                           const DLTensor *out, int planned) {
  g_why = "";
  if (!h || h->ndim != 2 || !h->shape) return g_why = "hidden: not 2-d", 0;
  int64_t T = h->shape[0];
  if (T < 0 || T > planned) return g_why = "T outside [0, planned]", 0;
  if (!desc_ok("hidden", h, kDLBfloat, 16, T, H) || !desc_ok("topk_ids", ids, kDLInt, 32, T, K) ||
      !desc_ok("topk_weights", w, kDLFloat, 32, T, K) || !desc_ok("out", out, kDLBfloat, 16, T, H))
    return 0;
  size_t hb = (size_t)T * H * 2, kb = (size_t)T * K * 4;
  if (overlap(out, hb, h, hb) || overlap(out, hb, ids, kb) || overlap(out, hb, w, kb))
    return g_why = "out overlaps an input", 0;
  const uint8_t *ip = first_byte(ids);
  for (int64_t i = 0; i < T * K; i++) {
    int32_t v;
    memcpy(&v, ip + 4 * i, 4);
    if (v != -1 && (v < 0 || v >= E)) return g_why = "expert id out of range", -1;
  }
  return 1;
}

/* ---- API wrappers ---------------------------------------------------------------------- */
/* Valid 2-token (or T-token) execute into out. */
static megamoe_error *valid_execute(megamoe_op *op, int layer, int T, uint16_t *out) {
  mmfx_io io;
  mmfx_io_init(&io, T, g_hid0, g_ids0, g_w0, out);
  return mmfx_execute_io(op, layer, &io);
}

/* The valid tensor set of one layer, each in its own exact buffer. */
static int valid_tensors(fz_tensor *x, int prefix) {
  int n = 0;
  for (int e = 0; e < E; e++)
    for (int p = 0; p < 3; p++)
      for (int s = 0; s < 4; s++) {
        fz_tensor *t = &x[n++];
        memset(t, 0, sizeof *t);
        size_t len = mmfx_model_tensor(&t->t, t->shape, e, p, s, prefix ? "mlp." : NULL, t->name,
                                       sizeof t->name);
        materialize(t, NULL, fill_bytes, t->t.data, len); /* a copy of the raw bytes */
      }
  return n;
}

static megamoe_error *do_prepare(megamoe_op *op, int layer, fz_tensor *x, int n) {
  megamoe_named_tensor nt[MMFX_NT * 2 + 8];
  for (int i = 0; i < n; i++) {
    nt[i].name = x[i].null_name ? NULL : x[i].name;
    nt[i].tensor = x[i].null_tensor ? NULL : &x[i].t;
  }
  return mmfx_prepare(op, layer, nt, (size_t)n);
}

static void free_tensors(fz_tensor *x, int n) {
  for (int i = 0; i < n; i++) free(x[i].buf);
}

/* ---- init ------------------------------------------------------------------------------- */
int LLVMFuzzerInitialize(int *argc, char ***argv) {
  megamoe_plugin_init_v1_fn init;
#ifdef MM_FUZZ_DLOPEN
  char path[4096], why[4352];
  init = mmfx_load(path, sizeof path, why, sizeof why);
  if (!init) FZ_FAIL("%s", why);
#else
  init = megamoe_plugin_init_v1;
#endif
  static megamoe_host_services s;
  s = mmfx_services();
  if (take(mmfx_init_with(init, &s, MEGAMOE_ABI_MAJOR, MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE, NULL),
           "init") != MEGAMOE_CODE_OK ||
      !mmfx_api)
    FZ_FAIL("init failed");
  mmfx_make_raw(rng);
  for (int i = 0; i < 2 * H; i++) g_hid0[i] = (uint16_t)(0x3C00 + (rng() & 0x3FF)) ^ (i & 1 ? 0x8000 : 0);
  expect(mmfx_create(kConfig, "fuzz.yaml", &g_op), MEGAMOE_CODE_OK, "create main op");
  fz_tensor *x = calloc(MMFX_NT, sizeof *x);
  int n = valid_tensors(x, 0);
  expect(do_prepare(g_op, 0, x, n), MEGAMOE_CODE_OK, "prepare layer 0");
  free_tensors(x, n);
  free(x);
  expect(mmfx_plan(g_op, TMAX), MEGAMOE_CODE_OK, "plan");
  g_planned = TMAX;
  expect(valid_execute(g_op, 0, 2, g_layer_out[0]), MEGAMOE_CODE_OK, "baseline execute");
  g_ready[0] = 1;
  return 0;
}

/* ---- actions -------------------------------------------------------------------------------- */
static void action_execute(fz *f) {
  int layer = u8(f) < 240 ? 0 : (int)(u8(f) % 6) - 1;
  int T = u8(f) % (TMAX + 2); /* 0 .. TMAX+1 */
  fz_tensor x[4];
  memset(x, 0, sizeof x);
  set2(&x[0], kDLBfloat, 16, T, H);
  set2(&x[1], kDLInt, 32, T, K);
  set2(&x[2], kDLFloat, 32, T, K);
  set2(&x[3], kDLBfloat, 16, T, H);
  for (int i = 0; i < 4; i++)
    if (u8(f) >= 160) mutate_desc(f, &x[i], 0);
  fill_fn fills[4] = {fill_hidden, fill_ids, fill_weights, fill_poison};
  for (int i = 0; i < 4; i++) materialize(&x[i], f, fills[i], NULL, 0);
  int alias = u8(f);
  if (alias >= 248) { /* out on top of an input, in one buffer big enough for both */
    fz_tensor *in = &x[alias % 3], *o = &x[3];
    size_t ib = in->t.byte_offset + claimed_bytes(&in->t);
    size_t ob = in->t.byte_offset + (size_t)(alias & 4 ? 2 : 0) + claimed_bytes(&o->t);
    uint8_t *both = calloc(1, (ib > ob ? ib : ob) + 1);
    if (!both) abort();
    if (in->buf && in->t.data) memcpy(both, in->buf, ib);
    free(in->buf);
    in->buf = both;
    if (in->t.data) in->t.data = both;
    o->t.data = both;
    o->t.byte_offset = in->t.byte_offset + (alias & 4 ? 2 : 0);
  }
  const DLTensor *t[4];
  for (int i = 0; i < 4; i++) t[i] = x[i].null_tensor ? NULL : &x[i].t;
  int valid = fuzz_exec_valid(t[0], t[1], t[2], t[3], g_planned);
  int layer_ok = layer >= 0 && layer < NLAYERS && g_ready[layer];
  megamoe_error *e = mmfx_execute(g_op, layer, t[0], t[1], t[2], t[3]);
  char msg[512];
  snprintf(msg, sizeof msg, "%s", e && e->message ? e->message : "");
  megamoe_code c = take(e, "execute");
  if (!layer_ok) {
    if (c != MEGAMOE_CODE_FAILED_PRECONDITION)
      FZ_FAIL("execute on unprepared layer %d: code %d (%s)", layer, (int)c, msg);
  } else if (valid == 1) {
    if (c != MEGAMOE_CODE_OK && c != MEGAMOE_CODE_RESOURCE_EXHAUSTED)
      FZ_FAIL("valid execute (T=%lld) refused: code %d: %s", (long long)t[0]->shape[0], (int)c, msg);
  } else if (c != MEGAMOE_CODE_INVALID_ARGUMENT) {
    FZ_FAIL("invalid execute (%s) answered code %d: %s", g_why, (int)c, msg);
  }
  if (layer_ok && valid == 1 && c == MEGAMOE_CODE_OK && t[0]->shape[0] > 0) {
    const int64_t Tn = t[0]->shape[0];
    size_t ob = (size_t)Tn * H * 2;
    uint8_t *o = (uint8_t *)first_byte(t[3]);
    uint8_t *first = malloc(ob + 1);
    if (!first) abort();
    memcpy(first, o, ob);
    memset(o, 0xFF, ob);
    expect(mmfx_execute(g_op, layer, t[0], t[1], t[2], t[3]), MEGAMOE_CODE_OK, "re-execute");
    if (memcmp(first, o, ob) != 0) FZ_FAIL("execute is not deterministic (T=%lld)", (long long)Tn);
    if (Tn >= 2) { /* token 0 alone */
      uint16_t row[H];
      mmfx_io y;
      mmfx_io_init(&y, 1, (void *)first_byte(t[0]), (void *)first_byte(t[1]),
                   (void *)first_byte(t[2]), row);
      expect(mmfx_execute_io(g_op, layer, &y), MEGAMOE_CODE_OK, "token 0 alone");
      if (memcmp(row, first, sizeof row) != 0)
        FZ_FAIL("token 0 alone differs from token 0 in a batch of %lld", (long long)Tn);
    }
    free(first);
  }
  for (int i = 0; i < 4; i++) free(x[i].buf);
}

static void ensure_planned(void) {
  if (g_planned >= 2) return;
  expect(mmfx_plan(g_op, TMAX), MEGAMOE_CODE_OK, "re-plan");
  g_planned = TMAX;
}

static void action_prepare(fz *f) {
  static const int bad_layers[4] = {-1, 4096, INT_MAX, INT_MIN};
  uint8_t lb = u8(f);
  int layer = lb < 224 ? 1 + lb % 3 : bad_layers[lb & 3];
  fz_tensor *x = calloc(MMFX_NT * 2 + 8, sizeof *x);
  if (!x) abort();
  int n = valid_tensors(x, u8(f) & 1);
  int muts = u8(f) % 5;
  for (int m = 0; m < muts && n > 0; m++) {
    int i = u8(f) % n;
    fz_tensor *t = &x[i];
    uint8_t kind = u8(f) % 12;
    switch (kind) {
      case 0: /* drop */
        free(t->buf);
        x[i] = x[--n];
        memset(&x[n], 0, sizeof x[n]);
        if (x[i].t.shape) x[i].t.shape = x[i].shape; /* the arrays moved with it */
        if (x[i].t.strides) x[i].t.strides = x[i].strides;
        break;
      case 1: /* duplicate */
        if (n < MMFX_NT * 2 + 8) {
          x[n] = *t;
          x[n].buf = NULL;
          x[n].t.shape = x[n].shape;
          if (x[n].t.strides) x[n].t.strides = x[n].strides;
          materialize(&x[n], f, fill_bytes,
                      t->t.data ? (uint8_t *)t->t.data + t->t.byte_offset : NULL,
                      t->t.data ? claimed_bytes(&t->t) : 0);
          n++;
        }
        break;
      case 2: { /* rename */
        static const char *names[8] = {"experts.9.gate_proj.weight", "experts.-1.up_proj.weight",
                                       "experts.1.gate_proj.weight_scale_3",
                                       "experts.99999999999999999999.down_proj.weight",
                                       "xexperts.0.gate_proj.weight", "", "experts.0.gate_proj.",
                                       "experts.0..weight"};
        uint8_t b = u8(f);
        if (b < 16) {
          t->null_name = 1;
        } else if (b < 128) {
          snprintf(t->name, sizeof t->name, "%s", names[b & 7]);
        } else {
          size_t len = u8(f) % 48;
          for (size_t k = 0; k < len; k++) t->name[k] = (char)(u8(f) | 1);
          t->name[len] = '\0';
        }
        break;
      }
      case 3: { /* dtype */
        static const DLDataType dts[8] = {{kDLUInt, 8, 1},  {kDLInt, 32, 1},
                                          {kDLFloat, 32, 1}, {kDLBfloat, 16, 1},
                                          {MEGAMOE_DL_FLOAT8_E4M3FN, 8, 1},
                                          {MEGAMOE_DL_FLOAT8_E8M0FNU, 8, 1},
                                          {MEGAMOE_DL_FLOAT4_E2M1FN, 4, 1}, {kDLFloat, 16, 1}};
        void *old = t->buf;
        const void *old_data = t->t.data ? (uint8_t *)t->t.data + t->t.byte_offset : NULL;
        size_t old_bytes = old_data ? claimed_bytes(&t->t) : 0;
        t->buf = NULL;
        t->t.dtype = dts[u8(f) & 7];
        materialize(t, f, fill_bytes, old_data, old_bytes);
        free(old);
        break;
      }
      case 4: case 5: { /* shape / ndim */
        static const int64_t dims[12] = {0, 1, 2, H / 2, I / 2, H / 16, I / 16, H / 32, H, 2 * H,
                                         4, (int64_t)1 << 40};
        void *old = t->buf;
        t->buf = NULL;
        if (kind == 4 && t->t.ndim > 0) t->shape[u8(f) % t->t.ndim] = dims[u8(f) % 12];
        else {
          int nd = u8(f) % 5;
          for (int d = t->t.ndim > 0 ? t->t.ndim : 0; d < nd; d++) t->shape[d] = 1;
          t->t.ndim = nd;
        }
        materialize(t, f, fill_bytes, NULL, 0);
        free(old);
        break;
      }
      case 6: { /* special values in scales */
        if (!t->buf || t->t.data != t->buf) break;
        int64_t ne = claimed_numel(&t->t);
        size_t nb = ne < 0 ? 0 : (size_t)((uint64_t)ne * elem_bits(t->t.dtype) / 8);
        if (!nb || nb > (1u << 20)) break;
        uint8_t *p = (uint8_t *)t->buf + t->t.byte_offset;
        if (t->t.dtype.bits == 32 && nb >= 4) {
          static const float sv[8] = {0.0f / 0.0f, 1.0f / 0.0f, 0.0f, -1.0f, 3.4e38f, 1e-40f, 1e30f, -0.0f};
          float v = sv[u8(f) & 7];
          memcpy(p + (u32(f) % (nb / 4)) * 4, &v, 4);
        } else {
          static const uint8_t sb[4] = {0x7F, 0xFF, 0x7E, 0x00};
          p[u32(f) % nb] = sb[u8(f) & 3];
        }
        break;
      }
      case 7: /* device */
        t->t.device.device_type = u8(f) & 1 ? kDLCUDA : (DLDeviceType)(u8(f) % 20);
        t->t.device.device_id = (int32_t)(u8(f) % 3) - 1;
        break;
      case 8: { /* strides */
        int nd = t->t.ndim;
        if (nd <= 0 || nd > 8) break;
        int64_t st = 1;
        for (int d = nd - 1; d >= 0; d--) {
          t->strides[d] = st;
          st = (int64_t)((uint64_t)st * (uint64_t)t->shape[d]);
        }
        if (u8(f) & 1) t->strides[u8(f) % nd] += 1;
        t->t.strides = t->strides;
        break;
      }
      case 9: { /* misaligned start */
        void *old = t->buf;
        const void *old_data = t->t.data ? (uint8_t *)t->t.data + t->t.byte_offset : NULL;
        size_t old_bytes = old_data ? claimed_bytes(&t->t) : 0;
        t->buf = NULL;
        t->t.byte_offset = 1 + u8(f) % 3;
        materialize(t, f, fill_bytes, old_data, old_bytes);
        free(old);
        break;
      }
      case 10: t->null_tensor = 1; break;
      default: t->null_data = 1; t->t.data = NULL; break;
    }
  }
  ensure_planned(); /* the checks below execute 2 tokens */
  megamoe_op_info_args info;
  expect(mmfx_info(g_op, &info), MEGAMOE_CODE_OK, "info before prepare");
  int before = info.num_layers_ready;
  megamoe_code c = take(do_prepare(g_op, layer, x, n), "prepare");
  expect(mmfx_info(g_op, &info), MEGAMOE_CODE_OK, "info after prepare");
  int valid_layer = layer >= 1 && layer < NLAYERS;
  if (!valid_layer && c != MEGAMOE_CODE_INVALID_ARGUMENT)
    FZ_FAIL("prepare of layer %d: code %d", layer, (int)c);
  if (muts == 0 && valid_layer && c != MEGAMOE_CODE_OK) FZ_FAIL("valid prepare refused (%d)", (int)c);
  if (c != MEGAMOE_CODE_OK) {
    if (info.num_layers_ready != before) FZ_FAIL("failed prepare changed the ready layers");
    if (valid_layer && g_ready[layer]) { /* the old layer is still the one used */
      uint16_t out[2 * H];
      expect(valid_execute(g_op, layer, 2, out), MEGAMOE_CODE_OK, "execute after failed prepare");
      if (memcmp(out, g_layer_out[layer], sizeof out) != 0)
        FZ_FAIL("layer %d changed after a failed prepare", layer);
    } else if (valid_layer) {
      uint16_t out[2 * H];
      expect(valid_execute(g_op, layer, 2, out), MEGAMOE_CODE_FAILED_PRECONDITION,
             "execute of a layer whose prepare failed");
    }
  } else {
    if (!valid_layer) FZ_FAIL("prepare of bad layer %d accepted", layer);
    if (info.num_layers_ready != before + !g_ready[layer]) FZ_FAIL("ready count after prepare");
    g_ready[layer] = 1;
    expect(valid_execute(g_op, layer, 2, g_layer_out[layer]), MEGAMOE_CODE_OK,
           "execute after prepare");
  }
  free_tensors(x, n);
  free(x);
}

static void action_plan(fz *f) {
  static const int menu[12] = {0, 1, 2, 7, 8, 9, -1, 1 << 20, (1 << 20) + 1, INT_MAX, INT_MIN, 3};
  int n = menu[u8(f) % 12];
  megamoe_code c = take(mmfx_plan(g_op, n), "plan");
  int want_ok = n == 0 || (n >= 1 && n <= (1 << 20));
  if (want_ok != (c == MEGAMOE_CODE_OK)) FZ_FAIL("plan(%d): code %d", n, (int)c);
  if (!want_ok && c != MEGAMOE_CODE_INVALID_ARGUMENT) FZ_FAIL("plan(%d): code %d", n, (int)c);
  if (c == MEGAMOE_CODE_OK) g_planned = n ? n : TMAX; /* 0: the config's 8 */
  megamoe_op_info_args info;
  expect(mmfx_info(g_op, &info), MEGAMOE_CODE_OK, "info after plan");
  if (info.planned_tokens != g_planned) FZ_FAIL("planned %d, info says %d", g_planned, info.planned_tokens);
}

/* A second op through its whole lifecycle, against a model of the states. */
static megamoe_op *g_op2, *g_stale;
static int g_op2_planned, g_op2_ready;

static void action_lifecycle(fz *f) {
  static const char *bad_configs[4] = {
      "schema-version: 1\nbackend: cpu-reference\nep-size: 2\nmodel: {num-experts: 4, top-k: 2}\n",
      "model: {top-k: [1, 2]}\n", "schema-version: 2\n", "backend: cpu-reference\nnum-max-tokens-per-rank: 0\n"};
  int steps = 1 + u8(f) % 6;
  for (int s = 0; s < steps; s++) {
    uint8_t k = u8(f) % 9;
    int live = g_op2 != NULL;
    int stale_usable = g_stale && g_stale != g_op && g_stale != g_op2;
    switch (k) {
      case 0: { /* create */
        if (g_op2) {
          expect(mmfx_destroy(g_op2), MEGAMOE_CODE_OK, "destroy before re-create");
          g_stale = g_op2;
          g_op2 = NULL;
        }
        uint8_t b = u8(f);
        megamoe_op *op = NULL;
        if (b < 128) {
          expect(mmfx_create(kConfig, "fuzz.yaml", &op), MEGAMOE_CODE_OK, "create op2");
          g_op2 = op;
          g_op2_planned = 0;
          g_op2_ready = 0;
        } else {
          megamoe_code c = take(mmfx_create(bad_configs[b & 3], "fuzz.yaml", &op), "bad create");
          if (c == MEGAMOE_CODE_OK || op) FZ_FAIL("bad config %d accepted", b & 3);
        }
        break;
      }
      case 1: { /* plan */
        int n = u8(f) % 10;
        if (live) {
          expect(mmfx_plan(g_op2, n), MEGAMOE_CODE_OK, "plan op2");
          g_op2_planned = n ? n : TMAX;
        } else if (stale_usable) {
          expect(mmfx_plan(g_stale, n), MEGAMOE_CODE_INVALID_ARGUMENT, "plan stale");
        }
        break;
      }
      case 2: { /* prepare layer 0 */
        fz_tensor *x = calloc(MMFX_NT, sizeof *x);
        int n = valid_tensors(x, 0);
        if (live) {
          expect(do_prepare(g_op2, 0, x, n), MEGAMOE_CODE_OK, "prepare op2");
          g_op2_ready = 1;
        } else if (stale_usable) {
          expect(do_prepare(g_stale, 0, x, n), MEGAMOE_CODE_INVALID_ARGUMENT, "prepare stale");
        }
        free_tensors(x, n);
        free(x);
        break;
      }
      case 3: { /* execute */
        uint16_t out[2 * H];
        if (live) {
          megamoe_code want = g_op2_planned >= 2 && g_op2_ready ? MEGAMOE_CODE_OK
                              : !g_op2_planned || !g_op2_ready ? MEGAMOE_CODE_FAILED_PRECONDITION
                                                               : MEGAMOE_CODE_INVALID_ARGUMENT;
          expect(valid_execute(g_op2, 0, 2, out), want, "execute op2");
          if (want == MEGAMOE_CODE_OK && memcmp(out, g_layer_out[0], sizeof out) != 0)
            FZ_FAIL("op2 output differs from the main op's");
        } else if (stale_usable) {
          expect(valid_execute(g_stale, 0, 2, out), MEGAMOE_CODE_INVALID_ARGUMENT, "execute stale");
        }
        break;
      }
      case 4: /* destroy (twice is an error) */
        if (live) {
          expect(mmfx_destroy(g_op2), MEGAMOE_CODE_OK, "destroy op2");
          g_stale = g_op2;
          g_op2 = NULL;
        } else if (stale_usable) {
          expect(mmfx_destroy(g_stale), MEGAMOE_CODE_INVALID_ARGUMENT, "double destroy");
        }
        break;
      case 5: { /* info */
        megamoe_op_info_args info;
        if (live) {
          expect(mmfx_info(g_op2, &info), MEGAMOE_CODE_OK, "info op2");
          if (info.planned_tokens != g_op2_planned || info.num_layers_ready != g_op2_ready)
            FZ_FAIL("op2 info: planned %d ready %d, model %d %d", info.planned_tokens,
                    info.num_layers_ready, g_op2_planned, g_op2_ready);
        } else if (stale_usable) {
          expect(mmfx_info(g_stale, &info), MEGAMOE_CODE_INVALID_ARGUMENT, "info stale");
          expect(mmfx_check(g_stale, 0), MEGAMOE_CODE_INVALID_ARGUMENT, "check stale");
        }
        break;
      }
      case 6: { /* a foreign pointer as the handle */
        static char not_an_op[64];
        megamoe_op *bogus = u8(f) & 1 ? (megamoe_op *)not_an_op : (megamoe_op *)(uintptr_t)u32(f);
        if (bogus == g_op || bogus == g_op2 || !bogus) break;
        megamoe_op_info_args info;
        expect(mmfx_info(bogus, &info), MEGAMOE_CODE_INVALID_ARGUMENT, "info foreign");
        expect(mmfx_plan(bogus, 1), MEGAMOE_CODE_INVALID_ARGUMENT, "plan foreign");
        expect(mmfx_check(bogus, 1), MEGAMOE_CODE_INVALID_ARGUMENT, "check foreign");
        expect(mmfx_destroy(bogus), MEGAMOE_CODE_INVALID_ARGUMENT, "destroy foreign");
        break;
      }
      case 7: /* destroy(NULL) is a no-op */
        expect(mmfx_destroy(NULL), MEGAMOE_CODE_OK, "destroy NULL");
        break;
      default: { /* execute with op NULL */
        uint16_t out[2 * H];
        expect(valid_execute(NULL, 0, 2, out), MEGAMOE_CODE_INVALID_ARGUMENT, "execute NULL op");
        break;
      }
    }
  }
}

static void action_nulls(fz *f) {
  uint8_t k = u8(f) % 8;
  size_t small = u8(f) % 16;
  unsigned char big[1024];
  memset(big, u8(f), sizeof big);
  switch (k) {
    case 0: expect(mmfx_api->execute(NULL), MEGAMOE_CODE_INVALID_ARGUMENT, "execute(NULL)"); break;
    case 1: expect(mmfx_api->prepare_weights(NULL), MEGAMOE_CODE_INVALID_ARGUMENT, "prepare(NULL)"); break;
    case 2: expect(mmfx_api->plan(NULL), MEGAMOE_CODE_INVALID_ARGUMENT, "plan(NULL)"); break;
    case 3:
      expect(mmfx_api->get_info(NULL), MEGAMOE_CODE_INVALID_ARGUMENT, "info(NULL)");
      expect(mmfx_api->check(NULL), MEGAMOE_CODE_INVALID_ARGUMENT, "check(NULL)");
      expect(mmfx_check(g_op, small & 1), MEGAMOE_CODE_OK, "check main op"); /* cpu: synchronous */
      break;
    case 4: { /* short struct */
      megamoe_op_execute_args a;
      memset(&a, 0, sizeof a);
      a.struct_size = small;
      a.op = g_op;
      expect(mmfx_api->execute(&a), MEGAMOE_CODE_INVALID_ARGUMENT, "execute short struct");
      break;
    }
    case 5: { /* newer host: a longer info struct with a garbage tail */
      megamoe_op_info_args *info = (megamoe_op_info_args *)big;
      memset(info, 0, sizeof *info);
      info->struct_size = sizeof big;
      info->op = g_op;
      expect(mmfx_api->get_info(info), MEGAMOE_CODE_OK, "long info struct");
      if (info->hidden_size != H || info->top_k != K) FZ_FAIL("info fields");
      break;
    }
    case 6: { /* prepare with NULL tensors and a count */
      megamoe_op_prepare_args p;
      memset(&p, 0, sizeof p);
      p.struct_size = MEGAMOE_OP_PREPARE_ARGS_STRUCT_SIZE;
      p.op = g_op;
      p.layer = 1;
      p.num_tensors = 1 + small;
      expect(mmfx_api->prepare_weights(&p), MEGAMOE_CODE_INVALID_ARGUMENT, "prepare NULL tensors");
      break;
    }
    default: { /* zero tensors: every expert is missing */
      megamoe_op_prepare_args p;
      memset(&p, 0, sizeof p);
      p.struct_size = MEGAMOE_OP_PREPARE_ARGS_STRUCT_SIZE;
      p.op = g_op;
      p.layer = 1 + (int)(small % 3);
      expect(mmfx_api->prepare_weights(&p), MEGAMOE_CODE_NOT_FOUND, "prepare no tensors");
      break;
    }
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!mmfx_api) LLVMFuzzerInitialize(NULL, NULL);
  fz f = {data, size};
  g_rng = 0x9E3779B97F4A7C15ull ^ size; /* bytes past the input: deterministic per input */
  for (int a = 0; a < 8 && f.n > 0; a++) {
    switch (u8(&f) % 8) {
      case 0: case 1: case 2: action_execute(&f); break;
      case 3: case 4: action_prepare(&f); break;
      case 5: action_plan(&f); break;
      case 6: action_lifecycle(&f); break;
      default: action_nulls(&f); break;
    }
  }
  /* The main op is still usable and gives the baseline. */
  ensure_planned();
  uint16_t out[2 * H];
  expect(valid_execute(g_op, 0, 2, out), MEGAMOE_CODE_OK, "final execute");
  if (memcmp(out, g_layer_out[0], sizeof out) != 0) FZ_FAIL("layer 0 output changed");
  return 0;
}

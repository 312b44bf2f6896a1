/*
 * megamoe_plugin.h -- the stable C ABI between an inference engine (the host)
 * and the megamoe plugin (libmegamoe_plugin.so).
 *
 * C99, usable from C++. This is the only header a host needs.
 *
 * ---------------------------------------------------------------------------
 * 1. Loading and version negotiation
 * ---------------------------------------------------------------------------
 * The plugin exports exactly one symbol per ABI major version:
 *
 *     megamoe_error *megamoe_plugin_init_v1(megamoe_plugin_init_args *args);
 *
 * A host dlopens the library and probes the entry symbols from the newest
 * major it knows down to the oldest (NCCL-plugin style). Within a major:
 *   - MEGAMOE_ABI_MAJOR changes when anything is deleted, retyped, reordered or
 *     changes meaning. A new major gets a new entry symbol (_v2); a plugin may
 *     export several.
 *   - MEGAMOE_ABI_MINOR changes when something is appended: a field at the end
 *     of a struct, a function pointer at the end of a table, a new enum value,
 *     a new config key. Every change is one line in abi/CHANGELOG.md.
 *
 * Every struct that crosses the boundary starts with `struct_size` (set by
 * whoever allocates the struct to MEGAMOE_<NAME>_STRUCT_SIZE of the header it
 * was compiled against) and `extension` (NULL, reserved for chained extension
 * structs, each beginning with megamoe_extension_base). Fields are only ever
 * appended, so:
 *   - a receiver given a *smaller* struct (older peer) reads only the fields
 *     that fit in struct_size and treats the rest as zero / default; a struct
 *     smaller than its v1.0 size is rejected with INVALID_ARGUMENT;
 *   - a receiver given a *larger* struct (newer peer) ignores the tail;
 *   - an output field is written only if it fits in struct_size.
 * MEGAMOE_STRUCT_SIZE(type, last_field) computes the sizes; the plugin's test
 * suite pins the v1.0 values so an accidental change fails the build.
 *
 * ---------------------------------------------------------------------------
 * 2. Registration (plugin -> host)
 * ---------------------------------------------------------------------------
 * In megamoe_plugin_init_v1 the plugin calls services->register_op once per
 * operator it provides (today: "megamoe_fp4"), passing a name, an operator
 * version and a table of functions (megamoe_op_api). The host keeps the
 * pointers; they stay valid until the plugin library is unloaded (after
 * args->finalize, if the host calls it). A host may refuse a registration
 * (non-zero return, e.g. a duplicate name); the plugin logs it and goes on.
 *
 * ---------------------------------------------------------------------------
 * 3. Errors
 * ---------------------------------------------------------------------------
 * Every fallible call returns `megamoe_error *`: NULL on success, otherwise an
 * object owned by the caller, who must release it with megamoe_error_destroy()
 * (which calls the object's own destroy, so the allocator of the side that made
 * it is used). Codes follow absl / PJRT numbering (megamoe_code). Nothing ever
 * aborts, exits or longjmps across this boundary; a plugin that cannot allocate
 * an error object returns a static one whose destroy is a no-op.
 *
 * ---------------------------------------------------------------------------
 * 4. Tensors
 * ---------------------------------------------------------------------------
 * Tensors cross as DLPack DLTensor, borrowed for the duration of the call only
 * (the plugin copies what it keeps). Strides may be NULL (compact row-major).
 * FP8 / FP4 / E8M0 use DLPack 1.1 type codes; they are defined below when the
 * installed dlpack.h is older.
 *
 * ---------------------------------------------------------------------------
 * 5. Operator lifecycle
 * ---------------------------------------------------------------------------
 *   create -> prepare_weights (once per layer, any order) -> plan -> execute*
 *          -> destroy
 * `plan` allocates every buffer the op needs for the given token capacity;
 * nothing allocates after it. In the low-latency dispatch mode, `execute`
 * performs no host synchronisation, so a CUDA graph can capture it. Calling out
 * of order returns FAILED_PRECONDITION and leaves the op usable. After a fatal
 * error (e.g. a communication timeout) every call except destroy returns
 * ABORTED; destroy and re-create to recover.
 *
 * Thread safety: megamoe_plugin_init_v1 and finalize must not race with each
 * other or with any other call. Distinct ops may be used concurrently from
 * different threads (one thread per GPU is the intended pattern). Calls on one
 * op must be serialised by the host. get_attributes is thread-safe.
 */
#ifndef MEGAMOE_PLUGIN_H
#define MEGAMOE_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MEGAMOE_ABI_MAJOR 1
#define MEGAMOE_ABI_MINOR 3

#if defined(__GNUC__) || defined(__clang__)
#define MEGAMOE_EXPORT __attribute__((visibility("default")))
#else
#define MEGAMOE_EXPORT
#endif

/* Size of a struct up to and including `last_field`. */
#define MEGAMOE_STRUCT_SIZE(type, last_field) \
  (offsetof(type, last_field) + sizeof(((type *)0)->last_field))

/* DLPack 1.1 type codes for the narrow float types (dlpack.h < 1.1 lacks them). */
#define MEGAMOE_DL_FLOAT8_E4M3FN 10
#define MEGAMOE_DL_FLOAT8_E8M0FNU 14
#define MEGAMOE_DL_FLOAT4_E2M1FN 17
#if !defined(DLPACK_MAJOR_VERSION) || \
    (DLPACK_MAJOR_VERSION == 1 && DLPACK_MINOR_VERSION < 1)
#define MEGAMOE_DLPACK_DEFINES_NARROW_FLOATS 1
enum {
  kDLFloat8_e4m3fn = MEGAMOE_DL_FLOAT8_E4M3FN,
  kDLFloat8_e8m0fnu = MEGAMOE_DL_FLOAT8_E8M0FNU,
  kDLFloat4_e2m1fn = MEGAMOE_DL_FLOAT4_E2M1FN
};
#endif

/* ------------------------------------------------------------------------- */
/* Status codes (absl / PJRT numbering).                                      */
/* ------------------------------------------------------------------------- */
#define MEGAMOE_CODE_MAP(XX)  \
  XX(OK, 0)                   \
  XX(CANCELLED, 1)            \
  XX(UNKNOWN, 2)              \
  XX(INVALID_ARGUMENT, 3)     \
  XX(DEADLINE_EXCEEDED, 4)    \
  XX(NOT_FOUND, 5)            \
  XX(ALREADY_EXISTS, 6)       \
  XX(PERMISSION_DENIED, 7)    \
  XX(RESOURCE_EXHAUSTED, 8)   \
  XX(FAILED_PRECONDITION, 9)  \
  XX(ABORTED, 10)             \
  XX(OUT_OF_RANGE, 11)        \
  XX(UNIMPLEMENTED, 12)       \
  XX(INTERNAL, 13)            \
  XX(UNAVAILABLE, 14)         \
  XX(DATA_LOSS, 15)           \
  XX(UNAUTHENTICATED, 16)

typedef enum megamoe_code {
#define MEGAMOE_CODE_ENUM_(name, value) MEGAMOE_CODE_##name = value,
  MEGAMOE_CODE_MAP(MEGAMOE_CODE_ENUM_)
#undef MEGAMOE_CODE_ENUM_
  MEGAMOE_CODE_COUNT_
} megamoe_code;

/* An error object. Owned by the caller of the call that returned it. */
typedef struct megamoe_error megamoe_error;
struct megamoe_error {
  size_t struct_size;
  void *extension;
  megamoe_code code;
  const char *message;                  /* NUL-terminated, lives as long as the object */
  void (*destroy)(megamoe_error *self); /* frees with the allocator of its maker */
};
#define MEGAMOE_ERROR_STRUCT_SIZE MEGAMOE_STRUCT_SIZE(megamoe_error, destroy)

static inline megamoe_code megamoe_error_code(const megamoe_error *e) {
  return e ? e->code : MEGAMOE_CODE_OK;
}
static inline const char *megamoe_error_message(const megamoe_error *e) {
  return (e && e->message) ? e->message : "";
}
static inline void megamoe_error_destroy(megamoe_error *e) {
  if (e && e->destroy) e->destroy(e);
}

/* Base of every extension struct chained off an `extension` pointer. */
typedef struct megamoe_extension_base {
  size_t struct_size;
  uint32_t type; /* MEGAMOE_EXT_* ; none defined in 1.0 */
  struct megamoe_extension_base *next;
} megamoe_extension_base;

/* ------------------------------------------------------------------------- */
/* Host services (host -> plugin).                                            */
/* ------------------------------------------------------------------------- */
typedef enum megamoe_log_level {
  MEGAMOE_LOG_ERROR = 0,
  MEGAMOE_LOG_WARN = 1,
  MEGAMOE_LOG_INFO = 2,
  MEGAMOE_LOG_DEBUG = 3
} megamoe_log_level;

struct megamoe_op_registration;

/*
 * Filled by the host, read by the plugin in init. The plugin copies the table
 * (up to struct_size); `host_ctx` and the function pointers must stay valid
 * until the plugin is unloaded. Every callback may be NULL unless marked
 * required; callbacks may be called from any thread the host calls into the
 * plugin from, and from the plugin's own worker threads (log only).
 */
typedef struct megamoe_host_services {
  size_t struct_size;
  void *extension;
  void *host_ctx; /* passed back as the first argument of every callback */

  /* Log sink. NULL: the plugin writes to stderr. `message` has no newline.
   * The plugin has already dropped messages above the level in force (the
   * op's `log-level` config key, or MEGAMOE_LOG_LEVEL; docs/CONFIG.md). */
  void (*log)(void *host_ctx, megamoe_log_level level, const char *message);

  /* Optional device allocator. Returns 0 and sets *ptr on success. When NULL
   * the plugin uses cudaMalloc / cudaFree on the op's device. */
  int (*device_alloc)(void *host_ctx, int device, size_t bytes, void **ptr);
  void (*device_free)(void *host_ctx, int device, void *ptr);

  /* Optional key-value exchange among the ranks of one EP group, used to
   * bootstrap NCCL when the host provides no communicator. put: 0 on success.
   * get: blocks up to timeout_ms for the key; returns 0 and the value length
   * in *len (copying min(cap, len) bytes), non-zero on timeout or error. */
  int (*kv_put)(void *host_ctx, const char *key, const void *value, size_t len);
  int (*kv_get)(void *host_ctx, const char *key, void *value, size_t cap,
                size_t *len, int timeout_ms);

  /* Required: registry callback. Returns 0 if the host accepted the op. */
  int (*register_op)(void *host_ctx, const struct megamoe_op_registration *reg);
} megamoe_host_services;
#define MEGAMOE_HOST_SERVICES_STRUCT_SIZE \
  MEGAMOE_STRUCT_SIZE(megamoe_host_services, register_op)

/* ------------------------------------------------------------------------- */
/* Operator API (plugin -> host).                                             */
/* ------------------------------------------------------------------------- */
typedef struct megamoe_op megamoe_op; /* opaque handle */

/* Capability bits. */
#define MEGAMOE_CAP_GRAPH_CAPTURABLE 0x1u /* low-latency execute has no host sync */
#define MEGAMOE_CAP_DETERMINISTIC 0x2u    /* same inputs -> same bits, any ep-size */
#define MEGAMOE_CAP_BACKEND_CPU 0x4u      /* cpu-reference backend available */
#define MEGAMOE_CAP_BACKEND_CUDA 0x8u     /* built with CUDA and a usable GPU seen */
#define MEGAMOE_CAP_NCCL 0x10u            /* built with NCCL (ep-size > 1) */

#define MEGAMOE_GRAN_K_16 0x1u /* NVFP4: E4M3 scale per 16 weights */
#define MEGAMOE_GRAN_K_32 0x2u /* MXFP4: UE8M0 scale per 32 weights */

typedef struct megamoe_op_attributes_args {
  size_t struct_size;
  void *extension;
  /* out */
  uint32_t capabilities;     /* MEGAMOE_CAP_* */
  uint32_t gran_k_mask;      /* MEGAMOE_GRAN_K_* bits supported */
  uint32_t compute_modes;    /* bit0 fp8, bit1 bf16-exact */
  int32_t num_sm_versions;   /* entries used in sm_versions */
  int32_t sm_versions[8];    /* e.g. 90 for sm_90a kernels compiled in */
  int32_t num_cuda_devices;  /* visible CUDA devices, 0 without a GPU */
  const char *build_info;    /* static string: version, CUDA, NCCL */
} megamoe_op_attributes_args;
#define MEGAMOE_OP_ATTRIBUTES_ARGS_STRUCT_SIZE \
  MEGAMOE_STRUCT_SIZE(megamoe_op_attributes_args, build_info)

/* A "key=value" override applied on top of the YAML file (kebab-case dotted
 * keys, e.g. {"ep-size", "8"}). Borrowed for the call. */
typedef struct megamoe_kv {
  const char *key;
  const char *value;
} megamoe_kv;

typedef struct megamoe_op_create_args {
  size_t struct_size;
  void *extension;
  /* in: exactly one of config_path / config_text (config_text may be with
   * config_text_len = 0 meaning NUL-terminated). Borrowed for the call. */
  const char *config_path;
  const char *config_text;
  size_t config_text_len;
  const char *config_name; /* name used in messages for config_text; may be NULL */
  const megamoe_kv *overrides;
  size_t num_overrides;
  /* in: placement. device: CUDA ordinal, or -1 for the CPU backend. */
  int32_t device;
  int32_t rank;          /* 0 .. ep-size-1 */
  void *nccl_comm;       /* optional ncclComm_t of ep-size ranks; borrowed for the op's life */
  const char *comm_key;  /* optional namespace for kv_put/kv_get keys (default "megamoe") */
  /* out */
  megamoe_op *op; /* release with destroy */
} megamoe_op_create_args;
#define MEGAMOE_OP_CREATE_ARGS_STRUCT_SIZE \
  MEGAMOE_STRUCT_SIZE(megamoe_op_create_args, op)

/* A named tensor. */
typedef struct megamoe_named_tensor {
  const char *name;
  const DLTensor *tensor;
} megamoe_named_tensor;

/*
 * Load-time weights of one layer, raw as stored in the checkpoint. Names are
 * relative to the layer: "experts.{E}.{gate,up,down}_proj.{weight,weight_scale,
 * weight_scale_2,input_scale}" with E the global expert id. The op keeps the
 * experts this rank owns and ignores the others; a missing local expert or a
 * malformed tensor is an error naming it, and nothing of the layer stays
 * loaded. Tensors may live on the host or on the op's device.
 */
typedef struct megamoe_op_prepare_args {
  size_t struct_size;
  void *extension;
  megamoe_op *op;
  int32_t layer; /* 0 .. (any), layers are independent */
  const megamoe_named_tensor *tensors;
  size_t num_tensors;
  void *stream; /* cudaStream_t for GPU work; NULL = the op's own stream */
  /* out: requantization report of this layer (zeros when no requant) */
  double requant_rel_rms_max; /* worst tensor's relative RMS error */
  double requant_abs_max;     /* worst absolute error */
  double seconds;             /* wall time of the call */
} megamoe_op_prepare_args;
#define MEGAMOE_OP_PREPARE_ARGS_STRUCT_SIZE \
  MEGAMOE_STRUCT_SIZE(megamoe_op_prepare_args, seconds)

typedef struct megamoe_op_plan_args {
  size_t struct_size;
  void *extension;
  megamoe_op *op;
  int32_t max_tokens_per_rank; /* 0: the config's num-max-tokens-per-rank */
  void *stream;
  /* out */
  uint64_t device_bytes; /* bytes allocated on the device by plan */
  uint64_t host_bytes;   /* pinned / host bytes allocated by plan */
} megamoe_op_plan_args;
#define MEGAMOE_OP_PLAN_ARGS_STRUCT_SIZE \
  MEGAMOE_STRUCT_SIZE(megamoe_op_plan_args, host_bytes)

/*
 * One MoE layer on this rank's tokens.
 *   hidden       bf16 [T, hidden]           (T <= planned max tokens)
 *   topk_ids     int32 [T, top-k], -1 = masked, else in [0, num-experts)
 *   topk_weights float32 [T, top-k]
 *   out          bf16 [T, hidden], written by the call
 * All on the op's device (or the host for the CPU backend). T may be 0.
 * Each tensor's data + byte_offset must be aligned to its element size (the
 * cuda backend: hidden and out to 16 bytes), and
 * out must not share bytes with an input (INVALID_ARGUMENT otherwise). An
 * expert id repeated within a token's top-k is allowed: every slot is its own
 * (token, expert) pair, the pairs are summed. NaN/Inf in a token's hidden row
 * or in a weight of one of its unmasked slots makes that token's output row
 * NaN (a token whose slots are all masked gives +0); other tokens are
 * unaffected (docs/RELIABILITY.md).
 */
typedef struct megamoe_op_execute_args {
  size_t struct_size;
  void *extension;
  megamoe_op *op;
  int32_t layer;
  const DLTensor *hidden;
  const DLTensor *topk_ids;
  const DLTensor *topk_weights;
  const DLTensor *out;
  void *stream; /* cudaStream_t; NULL = the op's own stream */
  /* ABI 1.2. The largest T of any rank of the op's expert-parallel group in
   * this step, when the host knows it; 0: unknown. Every rank must run one
   * dispatch mode per step, and with dispatch-mode auto the plugin chooses
   * it from this count (else from this rank's T, which is safe only while
   * every rank's T lies on the same side of dispatch.low-latency-max-tokens;
   * ranks that choose differently fail the step with DEADLINE_EXCEEDED and
   * the op turns fatal). Must be 0, or at least T and at most the planned
   * tokens per rank (INVALID_ARGUMENT otherwise). */
  int32_t max_tokens_any_rank;
} megamoe_op_execute_args;
#define MEGAMOE_OP_EXECUTE_ARGS_STRUCT_SIZE \
  MEGAMOE_STRUCT_SIZE(megamoe_op_execute_args, max_tokens_any_rank)
#define MEGAMOE_OP_EXECUTE_ARGS_STRUCT_SIZE_1_0 \
  MEGAMOE_STRUCT_SIZE(megamoe_op_execute_args, stream)

typedef struct megamoe_op_destroy_args {
  size_t struct_size;
  void *extension;
  megamoe_op *op; /* NULL is a no-op */
} megamoe_op_destroy_args;
#define MEGAMOE_OP_DESTROY_ARGS_STRUCT_SIZE \
  MEGAMOE_STRUCT_SIZE(megamoe_op_destroy_args, op)

/* Reports errors recorded on the device by earlier asynchronous executes
 * (low-latency mode performs no host synchronisation, so a bad expert id or
 * a capacity overflow found by its kernels is kept in device memory):
 * INVALID_ARGUMENT / RESOURCE_EXHAUSTED for such input errors (the affected
 * tokens were masked, never written out of bounds), ABORTED after a
 * communicator failure. The next non-captured execute also reports them.
 * wait = 1 first waits for the op's work on `stream` (a host sync: never
 * inside graph capture). */
typedef struct megamoe_op_check_args {
  size_t struct_size;
  void *extension;
  megamoe_op *op;
  void *stream;
  int32_t wait;
} megamoe_op_check_args;
#define MEGAMOE_OP_CHECK_ARGS_STRUCT_SIZE MEGAMOE_STRUCT_SIZE(megamoe_op_check_args, wait)

/* Per-op readable state, for hosts and tests. */
typedef struct megamoe_op_info_args {
  size_t struct_size;
  void *extension;
  megamoe_op *op;
  /* out */
  const char *backend;      /* "cpu-reference" or "cuda"; lives as long as the op */
  int32_t ep_size;
  int32_t rank;
  int32_t num_local_experts;
  int32_t first_local_expert;
  int32_t hidden_size;
  int32_t top_k;
  int32_t gran_k;           /* resolved: 16 or 32 (0 before the first prepare) */
  int32_t num_layers_ready; /* layers with prepared weights */
  int32_t planned_tokens;   /* 0 before plan */
  /* 1.1: the phases of this op's last eager execute, timed on the device
   * (-1 where unknown: the cpu-reference backend, no eager execute yet, or
   * its work still in flight; get_info never waits; CUDA graph replays do
   * not count). Bytes are what this rank sent, its own segment included. */
  double last_dispatch_us;
  double last_compute_us;
  double last_combine_us;
  int64_t last_dispatch_bytes;
  int64_t last_combine_bytes;
  /* 1.3: the numerics of the prepared layers, so that a host can tell how
   * close to exact the op is (NULL and -1 before the first prepare).
   * weight_mode: "reference" (cpu-reference backend), or the cuda backend's
   * weight mode: "g32-fp8", "g16-bf16-exact", "g16-fp8", "g32-f16-exact"
   * (docs/LAYOUTS.md, "Weight modes"); lives as long as the op.
   * error_bound: the documented bound on the layer output's relative error
   * (Frobenius) against the cpu-reference backend on the same checkpoint and
   * inputs; 0 for that backend itself. */
  const char *weight_mode;
  double error_bound;
} megamoe_op_info_args;
#define MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE_1_0 \
  MEGAMOE_STRUCT_SIZE(megamoe_op_info_args, planned_tokens)
#define MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE_1_1 \
  MEGAMOE_STRUCT_SIZE(megamoe_op_info_args, last_combine_bytes)
#define MEGAMOE_OP_INFO_ARGS_STRUCT_SIZE \
  MEGAMOE_STRUCT_SIZE(megamoe_op_info_args, error_bound)

/*
 * The op table. Static storage in the plugin; valid until unload.
 * Ownership and lifetime per call:
 *   get_attributes  no op needed; thread-safe.
 *   create          the op is owned by the caller until destroy.
 *   prepare_weights tensors borrowed for the call; may be called before or
 *                   after plan (re-preparing a layer replaces it).
 *   plan            allocates; may be called again to re-size (frees first).
 *   execute         tensors borrowed until the work on `stream` completes.
 *   destroy         frees everything the op owns; waits for its device work.
 *   get_info        strings point into the op.
 *   validate_config like create's checks, no op; thread-safe.
 *   check           errors left on the device by asynchronous executes.
 *
 * With ep-size > 1, plan and execute are collective over the op's group:
 *   - plan: every rank calls it, with the same max_tokens_per_rank and the
 *     same dispatch settings (it exchanges the low-latency geometry; ranks
 *     that differ all get FAILED_PRECONDITION);
 *   - execute: every rank calls it once per step, for the same layer, in the
 *     same order; each rank's T may differ (max_tokens_any_rank keeps
 *     dispatch-mode auto consistent). Bad expert ids and capacity overflows
 *     are reported after the step completed on every rank: the op stays
 *     usable. Graph capture in the normal mode is refused (FAILED_PRECONDITION)
 *     on every rank alike when they capture alike. Any other error from one
 *     rank's execute (an argument refused, a tensor of the cuda backend not
 *     16-byte aligned) means that rank skipped the step its peers wait in: its
 *     op turns fatal at once (later calls: ABORTED; its communicator is
 *     aborted, so it never exchanges out of step), the peers' step fails
 *     with DEADLINE_EXCEEDED, and the host must destroy every rank's op and
 *     create them anew.
 */
typedef struct megamoe_op_api {
  size_t struct_size;
  void *extension;
  uint32_t abi_major;
  uint32_t abi_minor;
  megamoe_error *(*get_attributes)(megamoe_op_attributes_args *args);
  megamoe_error *(*create)(megamoe_op_create_args *args);
  megamoe_error *(*prepare_weights)(megamoe_op_prepare_args *args);
  megamoe_error *(*plan)(megamoe_op_plan_args *args);
  megamoe_error *(*execute)(megamoe_op_execute_args *args);
  megamoe_error *(*destroy)(megamoe_op_destroy_args *args);
  megamoe_error *(*get_info)(megamoe_op_info_args *args);
  /* Parses and checks the configuration of `args` (config, overrides, rank)
   * without creating an op or touching a device; args->op stays NULL. */
  megamoe_error *(*validate_config)(megamoe_op_create_args *args);
  megamoe_error *(*check)(megamoe_op_check_args *args);
} megamoe_op_api;
#define MEGAMOE_OP_API_STRUCT_SIZE MEGAMOE_STRUCT_SIZE(megamoe_op_api, check)

typedef struct megamoe_op_registration {
  size_t struct_size;
  void *extension;
  const char *name;       /* "megamoe_fp4" */
  uint32_t version_major; /* operator semantics version */
  uint32_t version_minor;
  const megamoe_op_api *api;
} megamoe_op_registration;
#define MEGAMOE_OP_REGISTRATION_STRUCT_SIZE \
  MEGAMOE_STRUCT_SIZE(megamoe_op_registration, api)

/* ------------------------------------------------------------------------- */
/* Entry point.                                                               */
/* ------------------------------------------------------------------------- */
typedef struct megamoe_plugin_init_args {
  size_t struct_size;
  void *extension;
  /* in */
  uint32_t host_abi_major; /* must be 1 for _v1 */
  uint32_t host_abi_minor;
  const megamoe_host_services *services; /* required; copied */
  /* out */
  const char *plugin_name;    /* static */
  const char *plugin_version; /* static */
  uint32_t plugin_abi_minor;
  uint32_t num_ops_registered;
  /* Releases what init set up. After it, registered tables must not be used. */
  void (*finalize)(void);
} megamoe_plugin_init_args;
#define MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE \
  MEGAMOE_STRUCT_SIZE(megamoe_plugin_init_args, finalize)

typedef megamoe_error *(*megamoe_plugin_init_v1_fn)(megamoe_plugin_init_args *args);
#define MEGAMOE_PLUGIN_INIT_V1_SYMBOL "megamoe_plugin_init_v1"

MEGAMOE_EXPORT megamoe_error *megamoe_plugin_init_v1(megamoe_plugin_init_args *args);

#ifdef __cplusplus
}
#endif
#endif /* MEGAMOE_PLUGIN_H */

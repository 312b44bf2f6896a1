/* config.h -- the operator's configuration (conf/megamoe.yaml), parsed with
 * libyaml. Every error names FILE:LINE:COL. Precedence, highest first:
 * overrides (create args) > the YAML file > model.config-json > defaults. */
#ifndef MM_CONFIG_H
#define MM_CONFIG_H

#include <stddef.h>

#include "status.h"

typedef enum { MM_REQUANT_NONE = 0, MM_REQUANT_G16_TO_G32 = 1 } mm_requant_policy;
typedef enum { MM_COMPUTE_AUTO = 0, MM_COMPUTE_FP8 = 1, MM_COMPUTE_BF16_EXACT = 2 } mm_compute_mode;
typedef enum { MM_PREFILL_AUTO = 0, MM_PREFILL_OFF = 1 } mm_prefill_path;
typedef enum { MM_DISPATCH_AUTO = 0, MM_DISPATCH_NORMAL = 1, MM_DISPATCH_LOW_LATENCY = 2 } mm_dispatch_mode;
typedef enum { MM_BACKEND_AUTO = 0, MM_BACKEND_CUDA = 1, MM_BACKEND_CPU_REFERENCE = 2 } mm_backend_kind;
typedef enum { MM_SCALE_FP32 = 0, MM_SCALE_UE8M0 = 1 } mm_act_scale_format;

typedef struct mm_model_config {
  int hidden_size;             /* model.hidden-size (default 6144) */
  int moe_intermediate_size;   /* model.moe-intermediate-size (default 2048) */
  int num_experts;             /* model.num-experts (default 256) */
  int top_k;                   /* model.top-k (default 8) */
  double routed_scaling_factor;/* model.routed-scaling-factor (default 1.0) */
  double activation_clamp;     /* model.activation-clamp; 0 = no clamp (default 0) */
  char config_json[1024];      /* model.config-json: path, "" = none */
} mm_model_config;

typedef struct mm_config {
  int schema_version;          /* schema-version: must be 1 */
  int gran_k;                  /* gran-k: 0 = auto, 16 or 32 */
  mm_requant_policy requant_policy;   /* requant.policy */
  double requant_max_rel_error;       /* requant.max-rel-error (default 0.25) */
  mm_compute_mode compute_mode;       /* compute.mode */
  double compute_max_rel_error;       /* compute.max-rel-error: the largest end-to-end
                                         relative output error compute.mode auto may
                                         accept (default 0.02; plugin/mode_choice.h) */
  mm_prefill_path compute_prefill_path; /* compute.prefill-path: auto (default) or off */
  int compute_prefill_experts; /* compute.prefill-experts: experts per launch pair of
                                  the prefill path, 1..32 (default 16) */
  mm_model_config model;
  int ep_size;                 /* ep-size (default 1) */
  int num_max_tokens_per_rank; /* num-max-tokens-per-rank (default 4096) */
  mm_dispatch_mode dispatch_mode;     /* dispatch-mode */
  int low_latency_max_tokens;  /* dispatch.low-latency-max-tokens: auto picks
                                  low-latency at or below this T (default 256) */
  mm_backend_kind backend;     /* backend */
  int cpu_threads;             /* cpu.threads: 0 = all cores (default 0) */
  int comm_timeout_ms;         /* comm.timeout-ms (default 300000) */
  int log_level;               /* log-level: error|warn|info|debug (default info = 2) */
  char source_name[256];       /* file name (or config_name) used in messages */
} mm_config;

/* One override: dotted kebab-case key and its value as text. */
typedef struct mm_config_override {
  const char *key;
  const char *value;
} mm_config_override;

void mm_config_defaults(mm_config *cfg);

/* Loads a config from a file (`path`) or from text (`text`, `len`; len 0 means
 * NUL-terminated; `name` is used in messages, default "<text>"). Exactly one of
 * path / text. Applies overrides last, then validates cross-field rules.
 * Errors are INVALID_ARGUMENT (NOT_FOUND for a missing file) with messages
 * "FILE:LINE:COL: what is wrong" (overrides report "override 'KEY': ...").
 * On error `out` is left unchanged. Reference: docs/CONFIG.md. */
mm_err *mm_config_load(const char *path, const char *text, size_t len,
                       const char *name, const mm_config_override *overrides,
                       size_t num_overrides, mm_config *out);

/* Text names, for logs and the README reference. */
const char *mm_requant_policy_name(mm_requant_policy p);
const char *mm_compute_mode_name(mm_compute_mode m);
const char *mm_dispatch_mode_name(mm_dispatch_mode m);
const char *mm_backend_name(mm_backend_kind b);
const char *mm_log_level_name(int level); /* "error" .. "debug" */

/* Parsing limits: larger inputs fail with a FILE:LINE:COL error. */
#define MM_CONFIG_MAX_BYTES (4u << 20) /* file or text size */
#define MM_CONFIG_MAX_DEPTH 16         /* nested collections */
#define MM_CONFIG_MAX_KEY 128          /* bytes in one key */
#define MM_CONFIG_MAX_SCALAR 4096      /* bytes in one value */

/* The known keys, in table order (dotted kebab-case); NULL past the end.
 * Lets tests check that conf/megamoe.yaml and docs/CONFIG.md cover them. */
const char *mm_config_key_name(size_t i);

/* Writes `cfg` as a YAML document that mm_config_load reads back to the
 * same values (every key, one per line). Returns the length it needs, like
 * snprintf; writes at most `size` bytes including the NUL. */
size_t mm_config_format(const mm_config *cfg, char *buf, size_t size);

#endif

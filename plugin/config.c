/* config.c -- the operator's configuration: conf/megamoe.yaml read with
 * libyaml's event parser, an optional HF config.json for the model shape,
 * and "key=value" overrides.
 *
 * Each source fills its own layer (values + which keys it set + where); the
 * layers are merged by precedence (overrides > file > config.json >
 * defaults) and the cross-field rules run on the merged result, so an error
 * can still point at the FILE:LINE:COL (or override) that set the key.
 *
 * Parsing is bounded: the input is capped at MM_CONFIG_MAX_BYTES, nesting at
 * MM_CONFIG_MAX_DEPTH, scalars at MM_CONFIG_MAX_SCALAR; anchors, aliases and
 * tags are refused when first seen (no alias expansion can happen), and the
 * first problem ends the parse. */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml.h>

#include "spelling.h"

/* Enum fields are written through `int *`. */
_Static_assert(sizeof(mm_requant_policy) == sizeof(int), "enum size");
_Static_assert(sizeof(mm_compute_mode) == sizeof(int), "enum size");
_Static_assert(sizeof(mm_dispatch_mode) == sizeof(int), "enum size");
_Static_assert(sizeof(mm_backend_kind) == sizeof(int), "enum size");

/* ---- the key table ------------------------------------------------------- */

typedef enum { KT_INT, KT_DOUBLE, KT_ENUM, KT_PATH } key_type;

typedef struct key_def {
  const char *name;               /* dotted kebab-case */
  size_t offset, size;            /* the field in mm_config */
  key_type type;
  long long imin, imax;           /* KT_INT range */
  int multiple;                   /* KT_INT: must be a multiple of this */
  double dmin, dmax;              /* KT_DOUBLE range */
  int dmin_open;                  /* KT_DOUBLE: dmin itself excluded */
  const char *const *names;       /* KT_ENUM: NULL-terminated */
  const int *values;              /* KT_ENUM: value of names[i] */
  const char *json[3];            /* HF config.json names, first wins */
} key_def;

#define FIELD(f) offsetof(mm_config, f), sizeof(((mm_config *)0)->f)

static const char *const gran_k_names[] = {"auto", "16", "32", NULL};
static const int gran_k_values[] = {0, 16, 32};
static const char *const requant_names[] = {"none", "group16-to-group32", NULL};
static const int requant_values[] = {MM_REQUANT_NONE, MM_REQUANT_G16_TO_G32};
static const char *const compute_names[] = {"auto", "fp8", "bf16-exact", NULL};
static const int compute_values[] = {MM_COMPUTE_AUTO, MM_COMPUTE_FP8,
                                     MM_COMPUTE_BF16_EXACT};
static const char *const prefill_names[] = {"auto", "off", NULL};
static const int prefill_values[] = {MM_PREFILL_AUTO, MM_PREFILL_OFF};
static const char *const dispatch_names[] = {"auto", "normal", "low-latency", NULL};
static const int dispatch_values[] = {MM_DISPATCH_AUTO, MM_DISPATCH_NORMAL,
                                      MM_DISPATCH_LOW_LATENCY};
static const char *const backend_names[] = {"auto", "cuda", "cpu-reference", NULL};
static const int backend_values[] = {MM_BACKEND_AUTO, MM_BACKEND_CUDA,
                                     MM_BACKEND_CPU_REFERENCE};
static const char *const log_names[] = {"error", "warn", "info", "debug", NULL};
static const int log_values[] = {0, 1, 2, 3};

#define ENUM(n) .type = KT_ENUM, .names = n##_names, .values = n##_values
#define INT(lo, hi) .type = KT_INT, .imin = (lo), .imax = (hi)
#define DBL(lo, hi) .type = KT_DOUBLE, .dmin = (lo), .dmax = (hi)

enum {
  K_SCHEMA, K_GRAN_K, K_REQUANT_POLICY, K_REQUANT_MAX_REL, K_COMPUTE_MODE, K_COMPUTE_MAX_REL,
  K_COMPUTE_PREFILL, K_COMPUTE_PREFILL_EXPERTS,
  K_HIDDEN, K_INTER, K_EXPERTS, K_TOP_K, K_SCALING, K_CLAMP, K_CONFIG_JSON,
  K_EP_SIZE, K_MAX_TOKENS, K_DISPATCH_MODE, K_LL_MAX_TOKENS, K_BACKEND,
  K_CPU_THREADS, K_COMM_TIMEOUT, K_LOG_LEVEL, NUM_KEYS
};

static const key_def keys[NUM_KEYS] = {
  [K_SCHEMA] = {"schema-version", FIELD(schema_version), INT(1, 1)},
  [K_GRAN_K] = {"gran-k", FIELD(gran_k), ENUM(gran_k)},
  [K_REQUANT_POLICY] = {"requant.policy", FIELD(requant_policy), ENUM(requant)},
  [K_REQUANT_MAX_REL] = {"requant.max-rel-error", FIELD(requant_max_rel_error),
                         DBL(0.0, 1.0), .dmin_open = 1},
  [K_COMPUTE_MODE] = {"compute.mode", FIELD(compute_mode), ENUM(compute)},
  [K_COMPUTE_MAX_REL] = {"compute.max-rel-error", FIELD(compute_max_rel_error),
                         DBL(0.0, 1.0), .dmin_open = 1},
  [K_COMPUTE_PREFILL] = {"compute.prefill-path", FIELD(compute_prefill_path), ENUM(prefill)},
  [K_COMPUTE_PREFILL_EXPERTS] = {"compute.prefill-experts", FIELD(compute_prefill_experts),
                                 INT(1, 32)},
  [K_HIDDEN] = {"model.hidden-size", FIELD(model.hidden_size), INT(128, 65536),
                .multiple = 128, .json = {"hidden_size"}},
  [K_INTER] = {"model.moe-intermediate-size", FIELD(model.moe_intermediate_size),
               INT(128, 65536), .multiple = 128, .json = {"moe_intermediate_size"}},
  [K_EXPERTS] = {"model.num-experts", FIELD(model.num_experts), INT(1, 4096),
                 .json = {"n_routed_experts", "num_experts", "num_local_experts"}},
  [K_TOP_K] = {"model.top-k", FIELD(model.top_k), INT(1, 64),
               .json = {"num_experts_per_tok"}},
  [K_SCALING] = {"model.routed-scaling-factor", FIELD(model.routed_scaling_factor),
                 DBL(0.0, 1e6), .dmin_open = 1, .json = {"routed_scaling_factor"}},
  [K_CLAMP] = {"model.activation-clamp", FIELD(model.activation_clamp), DBL(0.0, 1e6)},
  [K_CONFIG_JSON] = {"model.config-json", FIELD(model.config_json), .type = KT_PATH},
  [K_EP_SIZE] = {"ep-size", FIELD(ep_size), INT(1, 1024)},
  [K_MAX_TOKENS] = {"num-max-tokens-per-rank", FIELD(num_max_tokens_per_rank),
                    INT(1, 1 << 20)},
  [K_DISPATCH_MODE] = {"dispatch-mode", FIELD(dispatch_mode), ENUM(dispatch)},
  [K_LL_MAX_TOKENS] = {"dispatch.low-latency-max-tokens", FIELD(low_latency_max_tokens),
                       INT(0, 1 << 20)},
  [K_BACKEND] = {"backend", FIELD(backend), ENUM(backend)},
  [K_CPU_THREADS] = {"cpu.threads", FIELD(cpu_threads), INT(0, 4096)},
  [K_COMM_TIMEOUT] = {"comm.timeout-ms", FIELD(comm_timeout_ms), INT(1, 86400000)},
  [K_LOG_LEVEL] = {"log-level", FIELD(log_level), ENUM(log)},
};

const char *mm_config_key_name(size_t i) { return i < NUM_KEYS ? keys[i].name : NULL; }

void mm_config_defaults(mm_config *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->schema_version = 1;
  cfg->gran_k = 0;
  cfg->requant_policy = MM_REQUANT_NONE;
  cfg->requant_max_rel_error = 0.25;
  cfg->compute_mode = MM_COMPUTE_AUTO;
  cfg->compute_max_rel_error = 0.02;
  cfg->compute_prefill_path = MM_PREFILL_AUTO;
  cfg->compute_prefill_experts = 16; /* MM_SM90_PREFILL_EXPERTS_DEFAULT */
  cfg->model.hidden_size = 6144; /* GLM-5 */
  cfg->model.moe_intermediate_size = 2048;
  cfg->model.num_experts = 256;
  cfg->model.top_k = 8;
  cfg->model.routed_scaling_factor = 1.0;
  cfg->model.activation_clamp = 0.0;
  cfg->ep_size = 1;
  cfg->num_max_tokens_per_rank = 4096;
  cfg->dispatch_mode = MM_DISPATCH_AUTO;
  cfg->low_latency_max_tokens = 256;
  cfg->backend = MM_BACKEND_AUTO;
  cfg->cpu_threads = 0;
  cfg->comm_timeout_ms = 300000;
  cfg->log_level = 2;
}

static const char *enum_name(const char *const *names, const int *values, int v) {
  for (int i = 0; names[i]; i++)
    if (values[i] == v) return names[i];
  return "?";
}
const char *mm_requant_policy_name(mm_requant_policy p) {
  return enum_name(requant_names, requant_values, (int)p);
}
const char *mm_compute_mode_name(mm_compute_mode m) {
  return enum_name(compute_names, compute_values, (int)m);
}
const char *mm_dispatch_mode_name(mm_dispatch_mode m) {
  return enum_name(dispatch_names, dispatch_values, (int)m);
}
const char *mm_backend_name(mm_backend_kind b) {
  return enum_name(backend_names, backend_values, (int)b);
}
const char *mm_log_level_name(int level) {
  return enum_name(log_names, log_values, level);
}

static int find_key(const char *name) {
  for (int i = 0; i < NUM_KEYS; i++)
    if (!strcmp(keys[i].name, name)) return i;
  return -1;
}

/* "model" for "model.hidden-size": a name some key starts with, then '.'. */
static int is_section(const char *name) {
  size_t n = strlen(name);
  for (int i = 0; i < NUM_KEYS; i++)
    if (!strncmp(keys[i].name, name, n) && keys[i].name[n] == '.') return 1;
  return 0;
}

/* ---- suggestions ---------------------------------------------------------- */

static const char *leaf(const char *name) {
  const char *dot = strrchr(name, '.');
  return dot ? dot + 1 : name;
}

/* The known key (or section) nearest to `key`, or NULL if none is close. A
 * right leaf in the wrong place ("hidden-size" for "model.hidden-size")
 * counts as one edit; a truncated name ("num-max-tokens") is close too. */
static const char *suggest_key(const char *key) {
  static const char *const sections[] = {"requant", "compute", "model", "dispatch",
                                         "cpu", "comm"};
  size_t len = strlen(key);
  int limit = len / 3 > 2 ? (int)(len / 3) : 2;
  const char *best = NULL;
  int best_d = INT_MAX;
  size_t nsec = sizeof sections / sizeof *sections;
  for (size_t i = 0; i < NUM_KEYS + nsec; i++) {
    const char *c = i < NUM_KEYS ? keys[i].name : sections[i - NUM_KEYS];
    int d = mm_osa_distance(key, c);
    int d2 = mm_osa_distance(leaf(key), c);
    int d3 = mm_osa_distance(key, leaf(c));
    if (d2 != INT_MAX && d2 + 1 < d) d = d2 + 1;
    if (d3 != INT_MAX && d3 + 1 < d) d = d3 + 1;
    if (len >= 4 && !strncmp(c, key, len) && limit < d) d = limit; /* a truncated name */
    if (d < best_d) best_d = d, best = c;
  }
  return best_d <= limit ? best : NULL;
}

static const char *suggest_enum(const char *const *names, const char *v) {
  size_t len = strlen(v);
  if (len > MM_CONFIG_MAX_KEY) return NULL;
  int limit = len / 4 > 1 ? (int)(len / 4) : 1;
  const char *best = NULL;
  int best_d = INT_MAX;
  for (int i = 0; names[i]; i++) {
    int d = mm_osa_distance(v, names[i]);
    if (d < best_d) best_d = d, best = names[i];
  }
  return best_d <= limit ? best : NULL;
}

/* ---- value parsing ------------------------------------------------------- */

/* Quotes a value for a message: printable ASCII, at most 40 bytes. */
static const char *show(const char *v, char *buf, size_t size) {
  size_t n = 0, i = 0;
  for (; v[i] && n + 4 < size && i < 40; i++)
    buf[n++] = (v[i] >= 0x20 && v[i] < 0x7f) ? v[i] : '?';
  if (v[i] && n + 4 < size) buf[n++] = '.', buf[n++] = '.', buf[n++] = '.';
  buf[n] = '\0';
  return buf;
}

static int is_null(const char *v, int plain) {
  return plain && (!*v || !strcmp(v, "~") || !strcmp(v, "null") ||
                   !strcmp(v, "Null") || !strcmp(v, "NULL"));
}

/* Strict decimal integer: optional sign, digits, nothing else. */
static int parse_int(const char *s, long long *out, int *overflow) {
  const char *p = s;
  int neg = 0;
  *overflow = 0;
  if (*p == '+' || *p == '-') neg = *p++ == '-';
  if (!*p) return 0;
  unsigned long long v = 0;
  for (; *p; p++) {
    if (*p < '0' || *p > '9') return 0;
    if (v > (ULLONG_MAX - 9) / 10) *overflow = 1;
    else v = v * 10 + (unsigned)(*p - '0');
  }
  if (v > (unsigned long long)LLONG_MAX) *overflow = 1;
  *out = neg ? -(long long)v : (long long)v;
  return 1;
}

/* Finite decimal float: digits, sign, '.', exponent; no inf/nan/hex. */
static int parse_double(const char *s, double *out) {
  int digits = 0;
  for (const char *p = s; *p; p++) {
    if (*p >= '0' && *p <= '9') digits = 1;
    else if (!strchr("+-.eE", *p)) return 0;
  }
  if (!digits) return 0;
  char *end = NULL;
  errno = 0;
  double v = strtod(s, &end);
  if (end == s || *end || !isfinite(v)) return 0;
  *out = v;
  return 1;
}

/* Sets key `k` of `cfg` from scalar `v`. On failure writes the problem to
 * msg (without location) and returns 0. `label` names the key in messages. */
static int set_value(int k, const char *label, const char *v, int plain, mm_config *cfg,
                     char *msg, size_t msize) {
  const key_def *d = &keys[k];
  char *field = (char *)cfg + d->offset;
  char sv[64];
  if (d->type == KT_PATH) {
    size_t n = is_null(v, plain) ? 0 : strlen(v);
    if (n >= d->size) {
      snprintf(msg, msize, "%s: path is %zu bytes long (at most %zu)", label, n, d->size - 1);
      return 0;
    }
    memcpy(field, v, n);
    field[n] = '\0';
    return 1;
  }
  if (is_null(v, plain)) {
    snprintf(msg, msize, "%s: missing value", label);
    return 0;
  }
  switch (d->type) {
    case KT_INT: {
      long long x;
      int overflow;
      if (!parse_int(v, &x, &overflow)) {
        snprintf(msg, msize, "%s: expected an integer, got '%s'", label, show(v, sv, sizeof sv));
        return 0;
      }
      if (overflow || x < d->imin || x > d->imax) {
        if (d->imin == d->imax)
          snprintf(msg, msize, "%s: must be %lld, got %s", label, d->imin, show(v, sv, sizeof sv));
        else
          snprintf(msg, msize, "%s: %s is out of range [%lld, %lld]", label,
                   show(v, sv, sizeof sv), d->imin, d->imax);
        return 0;
      }
      if (d->multiple && x % d->multiple) {
        snprintf(msg, msize, "%s: must be a multiple of %d, got %lld", label, d->multiple, x);
        return 0;
      }
      *(int *)field = (int)x;
      return 1;
    }
    case KT_DOUBLE: {
      double x;
      if (!parse_double(v, &x)) {
        snprintf(msg, msize, "%s: expected a finite number, got '%s'", label,
                 show(v, sv, sizeof sv));
        return 0;
      }
      if (x > d->dmax || x < d->dmin || (d->dmin_open && x == d->dmin)) {
        snprintf(msg, msize, "%s: %s is out of range %c%g, %g]", label, show(v, sv, sizeof sv),
                 d->dmin_open ? '(' : '[', d->dmin, d->dmax);
        return 0;
      }
      *(double *)field = x;
      return 1;
    }
    case KT_ENUM: {
      for (int i = 0; d->names[i]; i++) {
        if (!strcmp(v, d->names[i])) {
          *(int *)field = d->values[i];
          return 1;
        }
      }
      char list[128] = "";
      for (int i = 0; d->names[i]; i++) {
        size_t n = strlen(list);
        snprintf(list + n, sizeof list - n, "%s%s", i ? ", " : "", d->names[i]);
      }
      const char *s = suggest_enum(d->names, v);
      char hint[64] = "";
      if (s) snprintf(hint, sizeof hint, "; did you mean '%s'?", s);
      snprintf(msg, msize, "%s: invalid value '%s' (expected one of: %s)%s", label,
               show(v, sv, sizeof sv), list, hint);
      return 0;
    }
    default:
      snprintf(msg, msize, "%s: internal error: bad key type", label);
      return 0;
  }
}

/* ---- sources, layers and error locations --------------------------------- */

typedef enum { ORIGIN_DEFAULT = 0, ORIGIN_JSON, ORIGIN_FILE, ORIGIN_OVERRIDE } origin_kind;

typedef struct origin {
  origin_kind kind;
  const char *src; /* file name for FILE / JSON */
  int line, col;   /* 1-based, of the key */
  int vline, vcol; /* 1-based, of the value */
} origin;

typedef struct layer {
  mm_config cfg;
  unsigned char set[NUM_KEYS];
  origin where[NUM_KEYS];
} layer;

static void layer_init(layer *l) {
  memset(l, 0, sizeof *l);
  mm_config_defaults(&l->cfg);
}

static void copy_key(mm_config *dst, const mm_config *src, int k) {
  memcpy((char *)dst + keys[k].offset, (const char *)src + keys[k].offset, keys[k].size);
}

static mm_err *error_at(megamoe_code code, const char *src, int line, int col,
                        const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static mm_err *error_at(megamoe_code code, const char *src, int line, int col,
                        const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return mm_error(code, "%s:%d:%d: %s", src, line, col, msg);
}

/* "FILE:LINE:COL" or "override 'KEY'" for a key's origin (its key mark). */
static void where_text(const origin *o, int k, char *buf, size_t size, int value_mark) {
  switch (o->kind) {
    case ORIGIN_FILE:
    case ORIGIN_JSON:
      snprintf(buf, size, "%s:%d:%d", o->src, value_mark ? o->vline : o->line,
               value_mark ? o->vcol : o->col);
      break;
    case ORIGIN_OVERRIDE:
      snprintf(buf, size, "override '%s'", keys[k].name);
      break;
    default:
      snprintf(buf, size, "the default");
      break;
  }
}

/* ---- the event reader ---------------------------------------------------- */

typedef struct reader {
  yaml_parser_t parser;
  const char *src;
  const unsigned char *text;
  size_t len;
  int depth;
} reader;

static void reader_init(reader *r, const char *src, const unsigned char *text, size_t len) {
  memset(r, 0, sizeof *r);
  r->src = src;
  r->text = text;
  r->len = len;
  yaml_parser_initialize(&r->parser);
  /* Fixed UTF-8: no UTF-16 guessing from garbage, and byte offsets of reader
   * errors then map to LINE:COL by a plain scan. */
  yaml_parser_set_encoding(&r->parser, YAML_UTF8_ENCODING);
  yaml_parser_set_input_string(&r->parser, text, len);
}

static void reader_done(reader *r) { yaml_parser_delete(&r->parser); }

/* 1-based line and column (in characters) of a byte offset. */
static void offset_to_line_col(const unsigned char *t, size_t len, size_t off, int *line,
                               int *col) {
  int l = 1, c = 1;
  if (off > len) off = len;
  for (size_t i = 0; i < off; i++) {
    if (t[i] == '\n' || (t[i] == '\r' && (i + 1 >= len || t[i + 1] != '\n'))) {
      l++;
      c = 1;
    } else if (t[i] != '\r' && (t[i] & 0xC0) != 0x80) {
      c++;
    }
  }
  *line = l;
  *col = c;
}

static mm_err *parser_error(reader *r) {
  yaml_parser_t *p = &r->parser;
  switch (p->error) {
    case YAML_MEMORY_ERROR:
      return error_at(MEGAMOE_CODE_RESOURCE_EXHAUSTED, r->src, (int)p->mark.line + 1,
                      (int)p->mark.column + 1, "out of memory while parsing");
    case YAML_READER_ERROR: {
      int line, col;
      offset_to_line_col(r->text, r->len, p->problem_offset, &line, &col);
      if (p->problem_value >= 0)
        return error_at(MEGAMOE_CODE_INVALID_ARGUMENT, r->src, line, col,
                        "invalid input: %s (#%X at byte %zu)", p->problem,
                        (unsigned)p->problem_value, p->problem_offset);
      return error_at(MEGAMOE_CODE_INVALID_ARGUMENT, r->src, line, col,
                      "invalid input: %s (at byte %zu)", p->problem, p->problem_offset);
    }
    default: {
      const char *problem = p->problem ? p->problem : "unknown problem";
      if (p->context)
        return error_at(MEGAMOE_CODE_INVALID_ARGUMENT, r->src, (int)p->problem_mark.line + 1,
                        (int)p->problem_mark.column + 1, "syntax error: %s (%s at %d:%d)",
                        problem, p->context, (int)p->context_mark.line + 1,
                        (int)p->context_mark.column + 1);
      return error_at(MEGAMOE_CODE_INVALID_ARGUMENT, r->src, (int)p->problem_mark.line + 1,
                      (int)p->problem_mark.column + 1, "syntax error: %s", problem);
    }
  }
}

static mm_err *mark_error(reader *r, yaml_mark_t m, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static mm_err *mark_error(reader *r, yaml_mark_t m, const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return error_at(MEGAMOE_CODE_INVALID_ARGUMENT, r->src, (int)m.line + 1, (int)m.column + 1,
                  "%s", msg);
}

/* Next event, refusing what this format does not use (aliases, anchors,
 * tags), too deep nesting and too long scalars. On success the caller owns
 * `ev` (yaml_event_delete); on error nothing is left to free. */
static mm_err *next_event(reader *r, yaml_event_t *ev) {
  if (!yaml_parser_parse(&r->parser, ev)) return parser_error(r);
  mm_err *err = NULL;
  const yaml_char_t *anchor = NULL, *tag = NULL;
  switch (ev->type) {
    case YAML_ALIAS_EVENT:
      err = mark_error(r, ev->start_mark, "aliases are not supported (*%.40s)",
                       (const char *)ev->data.alias.anchor);
      break;
    case YAML_SCALAR_EVENT:
      anchor = ev->data.scalar.anchor;
      tag = ev->data.scalar.tag;
      if (ev->data.scalar.length > MM_CONFIG_MAX_SCALAR)
        err = mark_error(r, ev->start_mark, "scalar is %zu bytes long (at most %d)",
                         ev->data.scalar.length, MM_CONFIG_MAX_SCALAR);
      else if (strlen((const char *)ev->data.scalar.value) != ev->data.scalar.length)
        err = mark_error(r, ev->start_mark, "NUL characters (\\0) are not allowed");
      break;
    case YAML_SEQUENCE_START_EVENT:
    case YAML_MAPPING_START_EVENT:
      if (ev->type == YAML_SEQUENCE_START_EVENT) {
        anchor = ev->data.sequence_start.anchor;
        tag = ev->data.sequence_start.tag;
      } else {
        anchor = ev->data.mapping_start.anchor;
        tag = ev->data.mapping_start.tag;
      }
      if (++r->depth > MM_CONFIG_MAX_DEPTH)
        err = mark_error(r, ev->start_mark, "nesting is deeper than %d levels",
                         MM_CONFIG_MAX_DEPTH);
      break;
    case YAML_SEQUENCE_END_EVENT:
    case YAML_MAPPING_END_EVENT:
      r->depth--;
      break;
    default:
      break;
  }
  if (!err && anchor)
    err = mark_error(r, ev->start_mark, "anchors are not supported (&%.40s)",
                     (const char *)anchor);
  if (!err && tag)
    err = mark_error(r, ev->start_mark, "tags are not supported (%.60s)", (const char *)tag);
  if (err) yaml_event_delete(ev);
  return err;
}

static const char *scalar_text(const yaml_event_t *ev) {
  return (const char *)ev->data.scalar.value;
}
static int scalar_plain(const yaml_event_t *ev) {
  return ev->data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
}
static const char *event_what(yaml_event_type_t t) {
  switch (t) {
    case YAML_MAPPING_START_EVENT: return "a mapping";
    case YAML_SEQUENCE_START_EVENT: return "a list";
    case YAML_SCALAR_EVENT: return "a scalar";
    default: return "something else";
  }
}

/* Reads the stream start and the document start. *root gets the root node's
 * first event; *empty is set for a stream without documents. */
static mm_err *read_doc_start(reader *r, yaml_event_t *root, int *empty) {
  yaml_event_t ev;
  *empty = 0;
  MM_TRY(next_event(r, &ev)); /* STREAM_START */
  yaml_event_delete(&ev);
  MM_TRY(next_event(r, &ev));
  if (ev.type == YAML_STREAM_END_EVENT) {
    yaml_event_delete(&ev);
    *empty = 1;
    return NULL;
  }
  yaml_event_delete(&ev); /* DOCUMENT_START */
  return next_event(r, root);
}

/* After the root node: DOCUMENT_END, then STREAM_END (one document only). */
static mm_err *read_doc_end(reader *r) {
  yaml_event_t ev;
  MM_TRY(next_event(r, &ev)); /* DOCUMENT_END */
  yaml_event_delete(&ev);
  MM_TRY(next_event(r, &ev));
  mm_err *err = NULL;
  if (ev.type != YAML_STREAM_END_EVENT)
    err = mark_error(r, ev.start_mark, "more than one document (only one is allowed)");
  yaml_event_delete(&ev);
  return err;
}

/* Skips the node that starts with `first` (already read and deleted by the
 * caller except for its type). */
static mm_err *skip_node(reader *r, yaml_event_type_t first) {
  if (first != YAML_MAPPING_START_EVENT && first != YAML_SEQUENCE_START_EVENT) return NULL;
  int level = 1;
  while (level > 0) {
    yaml_event_t ev;
    MM_TRY(next_event(r, &ev));
    if (ev.type == YAML_MAPPING_START_EVENT || ev.type == YAML_SEQUENCE_START_EVENT) level++;
    else if (ev.type == YAML_MAPPING_END_EVENT || ev.type == YAML_SEQUENCE_END_EVENT) level--;
    yaml_event_delete(&ev);
  }
  return NULL;
}

/* ---- the YAML file -------------------------------------------------------- */

typedef struct seen_section {
  char name[16];
  int line, col;
} seen_section;

typedef struct file_ctx {
  reader *r;
  layer *l;
  seen_section sections[8];
  int num_sections;
} file_ctx;

static mm_err *parse_map(file_ctx *fc, const char *prefix);

/* One key (already read as `kev`) and its value. */
static mm_err *parse_entry(file_ctx *fc, const char *prefix, yaml_event_t *kev) {
  reader *r = fc->r;
  layer *l = fc->l;
  if (kev->type != YAML_SCALAR_EVENT)
    return mark_error(r, kev->start_mark, "keys must be plain names, not %s",
                      event_what(kev->type));
  const char *key = scalar_text(kev);
  yaml_mark_t km = kev->start_mark;
  if (kev->data.scalar.length > MM_CONFIG_MAX_KEY)
    return mark_error(r, km, "key is %zu bytes long (at most %d)", kev->data.scalar.length,
                      MM_CONFIG_MAX_KEY);
  if (!*key) return mark_error(r, km, "empty key");
  char full[2 * MM_CONFIG_MAX_KEY + 2];
  snprintf(full, sizeof full, "%s%s%s", prefix, *prefix ? "." : "", key);
  char sv[64];

  int k = find_key(full);
  if (k < 0 && is_section(full)) {
    /* A section: a mapping of its keys, or null (all children commented). */
    for (int i = 0; i < fc->num_sections; i++)
      if (!strcmp(fc->sections[i].name, full))
        return mark_error(r, km, "duplicate key '%s' (first at %d:%d)", full,
                          fc->sections[i].line, fc->sections[i].col);
    if (fc->num_sections < (int)(sizeof fc->sections / sizeof *fc->sections) &&
        strlen(full) < sizeof fc->sections[0].name) {
      seen_section *s = &fc->sections[fc->num_sections++];
      memcpy(s->name, full, strlen(full) + 1);
      s->line = (int)km.line + 1;
      s->col = (int)km.column + 1;
    }
    yaml_event_t vev;
    MM_TRY(next_event(r, &vev));
    mm_err *err = NULL;
    if (vev.type == YAML_MAPPING_START_EVENT)
      err = parse_map(fc, full);
    else if (!(vev.type == YAML_SCALAR_EVENT && is_null(scalar_text(&vev), scalar_plain(&vev))))
      err = mark_error(r, vev.start_mark, "'%s' must be a mapping of %s.* keys, not %s", full,
                       full, event_what(vev.type));
    yaml_event_delete(&vev);
    return err;
  }
  if (k < 0) {
    const char *s = suggest_key(full);
    if (s)
      return mark_error(r, km, "unknown key '%s'; did you mean '%s'?", show(full, sv, sizeof sv),
                        s);
    return mark_error(r, km, "unknown key '%s'", show(full, sv, sizeof sv));
  }
  if (l->set[k])
    return mark_error(r, km, "duplicate key '%s' (first at %d:%d)", full, l->where[k].line,
                      l->where[k].col);
  yaml_event_t vev;
  MM_TRY(next_event(r, &vev));
  mm_err *err = NULL;
  char msg[512];
  if (vev.type != YAML_SCALAR_EVENT) {
    err = mark_error(r, vev.start_mark, "%s: expected a single value, not %s", full,
                     event_what(vev.type));
  } else if (!set_value(k, full, scalar_text(&vev), scalar_plain(&vev), &l->cfg, msg,
                        sizeof msg)) {
    err = mark_error(r, vev.start_mark, "%s", msg);
  } else {
    l->set[k] = 1;
    l->where[k] = (origin){ORIGIN_FILE, r->src, (int)km.line + 1, (int)km.column + 1,
                           (int)vev.start_mark.line + 1, (int)vev.start_mark.column + 1};
  }
  yaml_event_delete(&vev);
  return err;
}

/* The entries of a mapping whose MAPPING_START was just read. */
static mm_err *parse_map(file_ctx *fc, const char *prefix) {
  for (;;) {
    yaml_event_t kev;
    MM_TRY(next_event(fc->r, &kev));
    if (kev.type == YAML_MAPPING_END_EVENT) {
      yaml_event_delete(&kev);
      return NULL;
    }
    mm_err *err = parse_entry(fc, prefix, &kev);
    yaml_event_delete(&kev);
    if (err) return err;
  }
}

static mm_err *parse_file(reader *r, layer *l) {
  yaml_event_t root;
  int empty;
  MM_TRY(read_doc_start(r, &root, &empty));
  if (empty) return NULL;
  mm_err *err = NULL;
  if (root.type == YAML_MAPPING_START_EVENT) {
    file_ctx fc = {.r = r, .l = l};
    err = parse_map(&fc, "");
  } else if (!(root.type == YAML_SCALAR_EVENT &&
               is_null(scalar_text(&root), scalar_plain(&root)))) {
    err = mark_error(r, root.start_mark, "the top level must be a mapping of keys, not %s",
                     event_what(root.type));
  }
  yaml_event_delete(&root);
  if (err) return err;
  return read_doc_end(r);
}

/* ---- config.json ----------------------------------------------------------- */

static int find_json_key(const char *name, int *prio) {
  for (int i = 0; i < NUM_KEYS; i++)
    for (int j = 0; j < 3 && keys[i].json[j]; j++)
      if (!strcmp(keys[i].json[j], name)) {
        *prio = j;
        return i;
      }
  return -1;
}

static mm_err *parse_json(reader *r, layer *l) {
  yaml_event_t root;
  int empty;
  int prio[NUM_KEYS] = {0};
  int found = 0;
  MM_TRY(read_doc_start(r, &root, &empty));
  if (empty) return error_at(MEGAMOE_CODE_INVALID_ARGUMENT, r->src, 1, 1, "empty file");
  if (root.type != YAML_MAPPING_START_EVENT) {
    mm_err *err = mark_error(r, root.start_mark, "the top level must be an object, not %s",
                             event_what(root.type));
    yaml_event_delete(&root);
    return err;
  }
  yaml_event_delete(&root);
  for (;;) {
    yaml_event_t kev, vev;
    MM_TRY(next_event(r, &kev));
    if (kev.type == YAML_MAPPING_END_EVENT) {
      yaml_event_delete(&kev);
      break;
    }
    if (kev.type != YAML_SCALAR_EVENT) {
      mm_err *err = mark_error(r, kev.start_mark, "keys must be strings, not %s",
                               event_what(kev.type));
      yaml_event_delete(&kev);
      return err;
    }
    int p = 0;
    int k = find_json_key(scalar_text(&kev), &p);
    yaml_mark_t km = kev.start_mark;
    char jname[64];
    snprintf(jname, sizeof jname, "%s", scalar_text(&kev));
    yaml_event_delete(&kev);
    mm_err *err = next_event(r, &vev);
    if (err) return err;
    yaml_event_type_t vt = vev.type;
    if (k < 0) { /* not ours: skip whatever it is */
      yaml_event_delete(&vev);
      MM_TRY(skip_node(r, vt));
      continue;
    }
    char label[160], msg[512];
    snprintf(label, sizeof label, "%s (%s)", jname, keys[k].name);
    if (l->set[k] && prio[k] == p) {
      err = mark_error(r, km, "duplicate key '%s' (first at %d:%d)", jname, l->where[k].line,
                       l->where[k].col);
    } else if (vt != YAML_SCALAR_EVENT) {
      err = mark_error(r, vev.start_mark, "%s: expected a number, not %s", label,
                       event_what(vt));
    } else if (is_null(scalar_text(&vev), scalar_plain(&vev))) {
      /* "num_experts": null -- as if absent */
    } else if (!l->set[k] || p < prio[k]) {
      if (!set_value(k, label, scalar_text(&vev), scalar_plain(&vev), &l->cfg, msg,
                     sizeof msg)) {
        err = mark_error(r, vev.start_mark, "%s", msg);
      } else {
        l->set[k] = 1;
        prio[k] = p;
        found = 1;
        l->where[k] = (origin){ORIGIN_JSON, r->src, (int)km.line + 1, (int)km.column + 1,
                               (int)vev.start_mark.line + 1, (int)vev.start_mark.column + 1};
      }
    }
    yaml_event_delete(&vev);
    if (vt != YAML_SCALAR_EVENT && !err) err = skip_node(r, vt);
    if (err) return err;
  }
  MM_TRY(read_doc_end(r));
  if (!found)
    return error_at(MEGAMOE_CODE_INVALID_ARGUMENT, r->src, 1, 1,
                    "no model keys found (expected some of hidden_size, moe_intermediate_size, "
                    "n_routed_experts / num_experts / num_local_experts, num_experts_per_tok, "
                    "routed_scaling_factor)");
  return NULL;
}

/* ---- input ---------------------------------------------------------------- */

static const char *errno_text(int e, char *buf, size_t size) {
  return strerror_r(e, buf, size); /* GNU variant (_GNU_SOURCE) */
}

/* Reads at most MM_CONFIG_MAX_BYTES of a regular file. */
static mm_err *read_capped(const char *path, const char *what, unsigned char **out,
                           size_t *out_len) {
  char eb[128];
  *out = NULL;
  *out_len = 0;
  /* O_NONBLOCK: opening a FIFO must not wait for a writer (it is then
   * refused as not a regular file); regular files ignore the flag. */
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    int e = errno;
    return mm_error(e == ENOENT ? MEGAMOE_CODE_NOT_FOUND : MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s: cannot open %s: %s", path, what, errno_text(e, eb, sizeof eb));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: %s is not a regular file", path, what);
  }
  size_t cap = MM_CONFIG_MAX_BYTES;
  if (st.st_size > (off_t)cap) {
    close(fd);
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "%s:1:1: %s is %lld bytes, more than the limit of %zu bytes", path, what,
                    (long long)st.st_size, cap);
  }
  unsigned char *buf = malloc(cap + 1);
  if (!buf) {
    close(fd);
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "%s: out of memory", path);
  }
  size_t n = 0;
  for (;;) {
    ssize_t got = read(fd, buf + n, cap + 1 - n);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      int e = errno;
      close(fd);
      free(buf);
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: cannot read %s: %s", path, what,
                      errno_text(e, eb, sizeof eb));
    }
    if (got == 0) break;
    n += (size_t)got;
    if (n > cap) { /* grew while we read it */
      close(fd);
      free(buf);
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                      "%s:1:1: %s is more than the limit of %zu bytes", path, what, cap);
    }
  }
  close(fd);
  *out = buf;
  *out_len = n;
  return NULL;
}

/* dir(base) + "/" + rel for a relative `rel`; `rel` itself otherwise. */
static int resolve_path(const char *base, const char *rel, char *out, size_t size) {
  const char *slash = base ? strrchr(base, '/') : NULL;
  int n;
  if (rel[0] == '/' || !slash)
    n = snprintf(out, size, "%s", rel);
  else
    n = snprintf(out, size, "%.*s/%s", (int)(slash - base), base, rel);
  return n >= 0 && (size_t)n < size;
}

/* ---- overrides ------------------------------------------------------------ */

static mm_err *parse_overrides(const mm_config_override *ov, size_t n, layer *l) {
  char sv[64], msg[512];
  for (size_t i = 0; i < n; i++) {
    const char *key = ov[i].key;
    if (!key) return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "override #%zu: key is NULL", i);
    if (strlen(key) > MM_CONFIG_MAX_KEY)
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                      "override #%zu: key is %zu bytes long (at most %d)", i, strlen(key),
                      MM_CONFIG_MAX_KEY);
    int k = find_key(key);
    if (k < 0) {
      show(key, sv, sizeof sv);
      if (is_section(key))
        return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                        "override '%s': '%s' is a section; name one of its keys (%s.KEY)", sv,
                        sv, sv);
      const char *s = suggest_key(key);
      if (s)
        return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                        "override '%s': unknown key '%s'; did you mean '%s'?", sv, sv, s);
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "override '%s': unknown key '%s'", sv, sv);
    }
    if (l->set[k])
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "override '%s': given twice", key);
    if (!ov[i].value)
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "override '%s': value is NULL", key);
    if (strlen(ov[i].value) > MM_CONFIG_MAX_SCALAR)
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                      "override '%s': value is %zu bytes long (at most %d)", key,
                      strlen(ov[i].value), MM_CONFIG_MAX_SCALAR);
    if (!set_value(k, key, ov[i].value, 1, &l->cfg, msg, sizeof msg))
      return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "override '%s': %s", key, msg);
    l->set[k] = 1;
    l->where[k] = (origin){.kind = ORIGIN_OVERRIDE};
  }
  return NULL;
}

/* ---- cross-field rules ------------------------------------------------------ */

/* Blames the key of `a` and `b` set by the stronger source (the one most
 * likely just edited) and names where the other came from. */
static mm_err *cross_error(const layer *m, int a, int b, const char *msg) {
  int blame = m->where[b].kind > m->where[a].kind ? b : a;
  int other = blame == a ? b : a;
  char at[320], from[320];
  where_text(&m->where[blame], blame, at, sizeof at, 0);
  if (m->where[blame].kind == ORIGIN_DEFAULT)
    snprintf(at, sizeof at, "%s:1:1", m->cfg.source_name);
  switch (m->where[other].kind) {
    case ORIGIN_DEFAULT: snprintf(from, sizeof from, "the default"); break;
    case ORIGIN_OVERRIDE: snprintf(from, sizeof from, "set by an override"); break;
    default:
      snprintf(from, sizeof from, "set at %s:%d:%d", m->where[other].src,
               m->where[other].line, m->where[other].col);
  }
  return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "%s: %s (%s: %s)", at, msg, keys[other].name,
                  from);
}

static mm_err *check_cross(const layer *m) {
  const mm_config *c = &m->cfg;
  char msg[256];
  if (c->model.num_experts % c->ep_size) {
    snprintf(msg, sizeof msg, "ep-size %d does not divide model.num-experts %d", c->ep_size,
             c->model.num_experts);
    return cross_error(m, K_EP_SIZE, K_EXPERTS, msg);
  }
  if (c->model.top_k > c->model.num_experts) {
    snprintf(msg, sizeof msg, "model.top-k %d is more than model.num-experts %d",
             c->model.top_k, c->model.num_experts);
    return cross_error(m, K_TOP_K, K_EXPERTS, msg);
  }
  if (c->requant_policy == MM_REQUANT_G16_TO_G32 && c->gran_k == 32) {
    snprintf(msg, sizeof msg,
             "requant.policy group16-to-group32 needs group16 weights, but gran-k is 32; "
             "use gran-k auto or 16, or requant.policy none");
    return cross_error(m, K_REQUANT_POLICY, K_GRAN_K, msg);
  }
  return NULL;
}

/* ---- load ------------------------------------------------------------------- */

typedef struct load_state {
  layer merged, file, json, ovr;
} load_state;

mm_err *mm_config_load(const char *path, const char *text, size_t len, const char *name,
                       const mm_config_override *overrides, size_t num_overrides,
                       mm_config *out) {
  MM_ARG_CHECK(out, "mm_config_load: out is NULL");
  MM_ARG_CHECK(!path != !text, "mm_config_load: give exactly one of path and text");
  MM_ARG_CHECK(overrides || !num_overrides, "mm_config_load: overrides is NULL but %zu given",
               num_overrides);
  load_state *s = malloc(sizeof *s);
  if (!s) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "mm_config_load: out of memory");
  layer_init(&s->merged);
  layer_init(&s->file);
  layer_init(&s->json);
  layer_init(&s->ovr);
  mm_config *cfg = &s->merged.cfg;
  snprintf(cfg->source_name, sizeof cfg->source_name, "%s",
           path ? path : (name && *name ? name : "<text>"));
  /* Messages use the full name; source_name may be truncated. */
  const char *src = path ? path : (name && *name ? name : "<text>");

  unsigned char *owned = NULL;
  const unsigned char *data;
  mm_err *err = NULL;
  if (path) {
    MM_TRY_GOTO(read_capped(path, "the config file", &owned, &len), err, done);
    data = owned;
  } else {
    if (!len) len = strnlen(text, (size_t)MM_CONFIG_MAX_BYTES + 1);
    if (len > MM_CONFIG_MAX_BYTES) {
      if (len == (size_t)MM_CONFIG_MAX_BYTES + 1) /* strnlen stopped there */
        err = error_at(MEGAMOE_CODE_INVALID_ARGUMENT, src, 1, 1,
                       "config text is more than the limit of %u bytes", MM_CONFIG_MAX_BYTES);
      else
        err = error_at(MEGAMOE_CODE_INVALID_ARGUMENT, src, 1, 1,
                       "config text is %zu bytes, more than the limit of %u bytes", len,
                       MM_CONFIG_MAX_BYTES);
      goto done;
    }
    data = (const unsigned char *)text;
  }

  /* 1. the file */
  reader r;
  reader_init(&r, src, data, len);
  err = parse_file(&r, &s->file);
  reader_done(&r);
  if (err) goto done;
  if (s->file.set[K_CONFIG_JSON] && s->file.cfg.model.config_json[0]) {
    char resolved[sizeof cfg->model.config_json];
    if (!resolve_path(path, s->file.cfg.model.config_json, resolved, sizeof resolved)) {
      const origin *o = &s->file.where[K_CONFIG_JSON];
      err = error_at(MEGAMOE_CODE_INVALID_ARGUMENT, src, o->vline, o->vcol,
                     "model.config-json: path is too long after joining the config's "
                     "directory (at most %zu bytes)", sizeof resolved - 1);
      goto done;
    }
    memcpy(s->file.cfg.model.config_json, resolved, sizeof resolved);
  }

  /* 2. overrides (parsed before config.json: they may name it) */
  MM_TRY_GOTO(parse_overrides(overrides, num_overrides, &s->ovr), err, done);

  /* 3. config.json */
  const layer *jl = s->ovr.set[K_CONFIG_JSON] ? &s->ovr
                    : s->file.set[K_CONFIG_JSON] ? &s->file : NULL;
  if (jl && jl->cfg.model.config_json[0]) {
    const char *jpath = jl->cfg.model.config_json;
    unsigned char *jdata = NULL;
    size_t jlen = 0;
    err = read_capped(jpath, "the config.json", &jdata, &jlen);
    if (err) {
      char at[320];
      where_text(&jl->where[K_CONFIG_JSON], K_CONFIG_JSON, at, sizeof at, 1);
      err = mm_error_wrap(err, "%s: model.config-json", at);
      goto done;
    }
    reader jr;
    reader_init(&jr, jpath, jdata, jlen);
    err = parse_json(&jr, &s->json);
    reader_done(&jr);
    free(jdata);
    if (err) goto done;
  }

  /* 4. merge: overrides > file > config.json > defaults */
  for (int k = 0; k < NUM_KEYS; k++) {
    const layer *from = s->ovr.set[k] ? &s->ovr
                        : s->file.set[k] ? &s->file
                        : s->json.set[k] ? &s->json : NULL;
    if (!from) continue;
    copy_key(cfg, &from->cfg, k);
    s->merged.set[k] = 1;
    s->merged.where[k] = from->where[k];
  }
  /* The origins point at `src` inside s->merged (or at the json path inside
   * a layer); all stay alive until the end of this function. */
  MM_TRY_GOTO(check_cross(&s->merged), err, done);
  *out = *cfg;

done:
  free(owned);
  free(s);
  return err;
}

/* ---- format ------------------------------------------------------------------ */

size_t mm_config_format(const mm_config *cfg, char *buf, size_t size) {
  size_t n = 0;
  char dummy[1];
  if (!buf || !size) buf = dummy, size = 1;
#define EMIT(...)                                                                   \
  do {                                                                              \
    int w_ = snprintf(n < size ? buf + n : dummy, n < size ? size - n : 1, __VA_ARGS__); \
    if (w_ > 0) n += (size_t)w_;                                                    \
  } while (0)
  char prev[32] = "";
  EMIT("# effective megamoe configuration\n");
  for (int k = 0; k < NUM_KEYS; k++) {
    const key_def *d = &keys[k];
    const char *dot = strchr(d->name, '.');
    const char *field = (const char *)cfg + d->offset;
    char sec[32] = "";
    if (dot) snprintf(sec, sizeof sec, "%.*s", (int)(dot - d->name), d->name);
    if (*sec && strcmp(sec, prev)) EMIT("%s:\n", sec);
    memcpy(prev, sec, sizeof prev);
    if (dot) EMIT("  %s: ", dot + 1);
    else EMIT("%s: ", d->name);
    switch (d->type) {
      case KT_INT: EMIT("%d\n", *(const int *)field); break;
      case KT_DOUBLE: EMIT("%.17g\n", *(const double *)field); break;
      case KT_ENUM: EMIT("%s\n", enum_name(d->names, d->values, *(const int *)field)); break;
      case KT_PATH: {
        EMIT("\"");
        for (const char *p = field; *p; p++) {
          if (*p == '"' || *p == '\\') EMIT("\\%c", *p);
          else if ((unsigned char)*p < 0x20) EMIT("\\x%02x", (unsigned char)*p);
          else EMIT("%c", *p);
        }
        EMIT("\"\n");
        break;
      }
    }
  }
#undef EMIT
  if (buf != dummy) buf[n < size ? n : size - 1] = '\0';
  return n;
}

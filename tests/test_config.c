/* test_config.c -- conf/megamoe.yaml loading: defaults, the shipped file,
 * every key, overrides and config.json precedence, bad inputs (each with the
 * exact LINE:COL and a message substring), bounded parsing of hostile inputs
 * (time and memory measured), and fuzzing. */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "harness.h"
#include "layout_sm90.h"

static const char *SRC = "t.yaml"; /* name of text configs in messages */

static mm_err *load_text(const char *text, const mm_config_override *ov, size_t n,
                         mm_config *cfg) {
  return mm_config_load(NULL, text, 0, SRC, ov, n, cfg);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static long maxrss_kib(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss;
}

/* "SRC:LINE:COL: ..." with LINE, COL >= 1; returns 1 and sets them. */
static int located(const char *msg, const char *src, int *line, int *col) {
  size_t n = strlen(src);
  if (strncmp(msg, src, n) || msg[n] != ':') return 0;
  const char *p = msg + n + 1;
  char *end;
  long l = strtol(p, &end, 10);
  if (end == p || *end != ':') return 0;
  p = end + 1;
  long c = strtol(p, &end, 10);
  if (end == p || end[0] != ':' || end[1] != ' ') return 0;
  if (l < 1 || c < 1) return 0;
  *line = (int)l;
  *col = (int)c;
  return 1;
}

static int config_equal(const mm_config *a, const mm_config *b) {
  return a->schema_version == b->schema_version && a->gran_k == b->gran_k &&
         a->requant_policy == b->requant_policy &&
         a->requant_max_rel_error == b->requant_max_rel_error &&
         a->compute_mode == b->compute_mode &&
         a->compute_max_rel_error == b->compute_max_rel_error &&
         a->compute_prefill_path == b->compute_prefill_path &&
         a->compute_prefill_experts == b->compute_prefill_experts &&
         a->model.hidden_size == b->model.hidden_size &&
         a->model.moe_intermediate_size == b->model.moe_intermediate_size &&
         a->model.num_experts == b->model.num_experts && a->model.top_k == b->model.top_k &&
         a->model.routed_scaling_factor == b->model.routed_scaling_factor &&
         a->model.activation_clamp == b->model.activation_clamp &&
         !strcmp(a->model.config_json, b->model.config_json) && a->ep_size == b->ep_size &&
         a->num_max_tokens_per_rank == b->num_max_tokens_per_rank &&
         a->dispatch_mode == b->dispatch_mode &&
         a->low_latency_max_tokens == b->low_latency_max_tokens && a->backend == b->backend &&
         a->cpu_threads == b->cpu_threads && a->comm_timeout_ms == b->comm_timeout_ms &&
         a->log_level == b->log_level;
}

/* Expects `err` to be INVALID_ARGUMENT "SRC:line:col: ...substr...". */
static void expect_at(mm_err *err, const char *src, int line, int col, const char *substr,
                      const char *what) {
  if (!err) {
    CHECK_MSG(0, "%s: loaded, expected an error at %d:%d", what, line, col);
    return;
  }
  int l = 0, c = 0;
  const char *m = err->message;
  CHECK_MSG(err->code == MEGAMOE_CODE_INVALID_ARGUMENT, "%s: code %d: %s", what, (int)err->code, m);
  CHECK_MSG(located(m, src, &l, &c), "%s: not located at %s:L:C: %s", what, src, m);
  CHECK_MSG(l == line && c == col, "%s: at %d:%d, expected %d:%d: %s", what, l, c, line, col, m);
  CHECK_MSG(strstr(m, substr) != NULL, "%s: '%s' not in: %s", what, substr, m);
  mm_error_free(err);
}

/* ---- good inputs ---------------------------------------------------------- */

static void test_defaults(void) {
  mm_config d, c;
  mm_config_defaults(&d);
  CHECK_EQ_INT(d.schema_version, 1);
  CHECK_EQ_INT(d.gran_k, 0);
  CHECK_EQ_INT(d.requant_policy, MM_REQUANT_NONE);
  CHECK(d.requant_max_rel_error == 0.25);
  CHECK_EQ_INT(d.compute_mode, MM_COMPUTE_AUTO);
  CHECK(d.compute_max_rel_error == 0.02);
  CHECK_EQ_INT(d.compute_prefill_path, MM_PREFILL_AUTO);
  CHECK_EQ_INT(d.compute_prefill_experts, 16);
  CHECK_EQ_INT(d.model.hidden_size, 6144);
  CHECK_EQ_INT(d.model.moe_intermediate_size, 2048);
  CHECK_EQ_INT(d.model.num_experts, 256);
  CHECK_EQ_INT(d.model.top_k, 8);
  CHECK(d.model.routed_scaling_factor == 1.0);
  CHECK(d.model.activation_clamp == 0.0);
  CHECK(d.model.config_json[0] == '\0');
  CHECK_EQ_INT(d.ep_size, 1);
  CHECK_EQ_INT(d.num_max_tokens_per_rank, 4096);
  CHECK_EQ_INT(d.dispatch_mode, MM_DISPATCH_AUTO);
  CHECK_EQ_INT(d.low_latency_max_tokens, 256);
  CHECK_EQ_INT(d.backend, MM_BACKEND_AUTO);
  CHECK_EQ_INT(d.cpu_threads, 0);
  CHECK_EQ_INT(d.comm_timeout_ms, 300000);
  CHECK_EQ_INT(d.log_level, 2);
  /* Inputs that set nothing. */
  const char *empty[] = {"", "{}", "~", "null", "---\n", "# only a comment\n", "---\n...\n",
                         "\xef\xbb\xbf# BOM first\n", "model:\nrequant:\n"};
  for (size_t i = 0; i < sizeof empty / sizeof *empty; i++) {
    memset(&c, 0xAB, sizeof c);
    CHECK_OK(load_text(empty[i], NULL, 0, &c));
    CHECK_MSG(config_equal(&c, &d), "input %zu", i);
    CHECK(!strcmp(c.source_name, SRC));
  }
  /* Name defaults to "<text>"; explicit length ignores what follows. */
  CHECK_OK(mm_config_load(NULL, "ep-size: 2", 0, NULL, NULL, 0, &c));
  CHECK(!strcmp(c.source_name, "<text>"));
  CHECK_EQ_INT(c.ep_size, 2);
  CHECK_OK(mm_config_load(NULL, "ep-size: 4garbage", 10, "x", NULL, 0, &c));
  CHECK_EQ_INT(c.ep_size, 4);
}

/* The shipped file: loads, equals the defaults, and lists every key; the
 * reference lists every key too. */
static void test_shipped_file_and_docs(void) {
  char path[1024];
  mm_config c, d;
  mm_config_defaults(&d);
  snprintf(path, sizeof path, "%s/conf/megamoe.yaml", mm_test_srcdir());
  CHECK_OK(mm_config_load(path, NULL, 0, NULL, NULL, 0, &c));
  CHECK(config_equal(&c, &d));
  CHECK(!strcmp(c.source_name, path));
  char *text = mm_test_read_file(path);
  snprintf(path, sizeof path, "%s/docs/CONFIG.md", mm_test_srcdir());
  char *doc = mm_test_read_file(path);
  snprintf(path, sizeof path, "%s/README.md", mm_test_srcdir());
  char *readme = mm_test_read_file(path);
  CHECK(text && doc && readme);
  if (!text || !doc || !readme) goto out;
  size_t n = 0;
  for (const char *k; (k = mm_config_key_name(n)); n++) {
    const char *dot = strrchr(k, '.');
    char want[160];
    snprintf(want, sizeof want, "%s: ", dot ? dot + 1 : k);
    CHECK_MSG(strstr(text, want) != NULL, "conf/megamoe.yaml lacks %s", k);
    snprintf(want, sizeof want, "`%s`", k);
    CHECK_MSG(strstr(doc, want) != NULL, "docs/CONFIG.md lacks %s", want);
    snprintf(want, sizeof want, "| `%s` |", k);
    CHECK_MSG(strstr(readme, want) != NULL, "README.md's key table lacks %s", want);
  }
  CHECK(n >= 20);
  /* compute.prefill-path's thresholds, as both files state them, are the
   * code's (a moved crossover must move its documentation too) */
  const int g32 = mm_sm90_prefill_min_rows(MM_WMODE_G32_FP8);
  const int g16 = mm_sm90_prefill_min_rows(MM_WMODE_G16_FP8);
  char want[160];
  snprintf(want, sizeof want, "prefill path from %d rows per local expert", g32);
  CHECK_MSG(strstr(text, want) != NULL, "conf/megamoe.yaml lacks \"%s\"", want);
  snprintf(want, sizeof want, "or %d (group16, mode 3)", g16);
  CHECK_MSG(strstr(text, want) != NULL, "conf/megamoe.yaml lacks \"%s\"", want);
  snprintf(want, sizeof want, "averaging %d rows or more per local expert in mode 1, %d in mode 3",
           g32, g16);
  CHECK_MSG(strstr(doc, want) != NULL, "docs/CONFIG.md lacks \"%s\"", want);
out:
  free(text);
  free(doc);
  free(readme);
}

static void test_every_key(void) {
  const char *nested =
      "schema-version: 1\n"
      "gran-k: 16\n"
      "requant:\n"
      "  policy: group16-to-group32\n"
      "  max-rel-error: 0.5\n"
      "compute: {mode: bf16-exact, max-rel-error: 0.001, prefill-path: off, prefill-experts: 8}\n"
      "model:\n"
      "  hidden-size: 4096\n"
      "  moe-intermediate-size: 1536\n"
      "  num-experts: 160\n"
      "  top-k: 6\n"
      "  routed-scaling-factor: 2.5\n"
      "  activation-clamp: 7.0\n"
      "ep-size: 32\n"
      "num-max-tokens-per-rank: 128\n"
      "dispatch-mode: low-latency\n"
      "dispatch:\n"
      "  low-latency-max-tokens: 64\n"
      "backend: cpu-reference\n"
      "cpu: {threads: 3}\n"
      "comm: {timeout-ms: 1000}\n"
      "log-level: debug\n";
  const char *dotted =
      "gran-k: '16'\n"
      "requant.policy: group16-to-group32\n"
      "requant.max-rel-error: 5e-1\n"
      "compute.mode: \"bf16-exact\"\n"
      "compute.max-rel-error: 1e-3\n"
      "compute.prefill-path: off\n"
      "compute.prefill-experts: 8\n"
      "model.hidden-size: +4096\n"
      "model.moe-intermediate-size: 1536\n"
      "model.num-experts: 160\n"
      "model.top-k: 6\n"
      "model.routed-scaling-factor: 2.5\n"
      "model.activation-clamp: 7\n"
      "ep-size: 32\n"
      "num-max-tokens-per-rank: 128\n"
      "dispatch-mode: low-latency\n"
      "dispatch.low-latency-max-tokens: 64\n"
      "backend: cpu-reference\n"
      "cpu.threads: 3\n"
      "comm.timeout-ms: 1000\n"
      "log-level: debug\n";
  const char *texts[] = {nested, dotted};
  for (int t = 0; t < 2; t++) {
    mm_config c;
    CHECK_OK(load_text(texts[t], NULL, 0, &c));
    CHECK_EQ_INT(c.gran_k, 16);
    CHECK_EQ_INT(c.requant_policy, MM_REQUANT_G16_TO_G32);
    CHECK(c.requant_max_rel_error == 0.5);
    CHECK_EQ_INT(c.compute_mode, MM_COMPUTE_BF16_EXACT);
    CHECK(c.compute_max_rel_error == 0.001);
    CHECK_EQ_INT(c.compute_prefill_path, MM_PREFILL_OFF);
    CHECK_EQ_INT(c.compute_prefill_experts, 8);
    CHECK_EQ_INT(c.model.hidden_size, 4096);
    CHECK_EQ_INT(c.model.moe_intermediate_size, 1536);
    CHECK_EQ_INT(c.model.num_experts, 160);
    CHECK_EQ_INT(c.model.top_k, 6);
    CHECK(c.model.routed_scaling_factor == 2.5);
    CHECK(c.model.activation_clamp == 7.0);
    CHECK_EQ_INT(c.ep_size, 32);
    CHECK_EQ_INT(c.num_max_tokens_per_rank, 128);
    CHECK_EQ_INT(c.dispatch_mode, MM_DISPATCH_LOW_LATENCY);
    CHECK_EQ_INT(c.low_latency_max_tokens, 64);
    CHECK_EQ_INT(c.backend, MM_BACKEND_CPU_REFERENCE);
    CHECK_EQ_INT(c.cpu_threads, 3);
    CHECK_EQ_INT(c.comm_timeout_ms, 1000);
    CHECK_EQ_INT(c.log_level, 3);
  }
  /* Range edges that are allowed. */
  mm_config c;
  CHECK_OK(load_text("num-max-tokens-per-rank: 1048576\nrequant: {max-rel-error: 1}\n"
                     "model: {num-experts: 1, top-k: 1, hidden-size: 128}\n"
                     "gran-k: 32\ncomm.timeout-ms: 86400000\ndispatch.low-latency-max-tokens: 0\n"
                     "compute.max-rel-error: 1",
                     NULL, 0, &c));
  CHECK(c.compute_max_rel_error == 1.0);
  CHECK_EQ_INT(c.num_max_tokens_per_rank, 1 << 20);
  CHECK_EQ_INT(c.model.num_experts, 1);
  CHECK_EQ_INT(c.gran_k, 32);
  CHECK_EQ_INT(c.low_latency_max_tokens, 0);
  CHECK_OK(load_text("compute: {max-rel-error: 1e-300}", NULL, 0, &c));
  CHECK(c.compute_max_rel_error == 1e-300);
  CHECK_OK(load_text("compute: {max-rel-error: '0.1'}", NULL, 0, &c)); /* quoted */
  CHECK(c.compute_max_rel_error == 0.1);
}

static void test_names(void) {
  CHECK(!strcmp(mm_requant_policy_name(MM_REQUANT_NONE), "none"));
  CHECK(!strcmp(mm_requant_policy_name(MM_REQUANT_G16_TO_G32), "group16-to-group32"));
  CHECK(!strcmp(mm_compute_mode_name(MM_COMPUTE_AUTO), "auto"));
  CHECK(!strcmp(mm_compute_mode_name(MM_COMPUTE_FP8), "fp8"));
  CHECK(!strcmp(mm_compute_mode_name(MM_COMPUTE_BF16_EXACT), "bf16-exact"));
  CHECK(!strcmp(mm_dispatch_mode_name(MM_DISPATCH_AUTO), "auto"));
  CHECK(!strcmp(mm_dispatch_mode_name(MM_DISPATCH_NORMAL), "normal"));
  CHECK(!strcmp(mm_dispatch_mode_name(MM_DISPATCH_LOW_LATENCY), "low-latency"));
  CHECK(!strcmp(mm_backend_name(MM_BACKEND_AUTO), "auto"));
  CHECK(!strcmp(mm_backend_name(MM_BACKEND_CUDA), "cuda"));
  CHECK(!strcmp(mm_backend_name(MM_BACKEND_CPU_REFERENCE), "cpu-reference"));
  CHECK(!strcmp(mm_log_level_name(0), "error"));
  CHECK(!strcmp(mm_log_level_name(3), "debug"));
  CHECK(!strcmp(mm_backend_name((mm_backend_kind)77), "?"));
  /* Each name loads back to its value. */
  const struct { const char *yaml; int mode; } modes[] = {
      {"compute.mode: fp8", MM_COMPUTE_FP8}, {"compute.mode: auto", MM_COMPUTE_AUTO}};
  for (size_t i = 0; i < 2; i++) {
    mm_config c;
    CHECK_OK(load_text(modes[i].yaml, NULL, 0, &c));
    CHECK_EQ_INT(c.compute_mode, modes[i].mode);
  }
  CHECK(mm_config_key_name(0) != NULL);
  CHECK(mm_config_key_name(1000) == NULL);
}

static void test_overrides(void) {
  const char *file = "ep-size: 2\nmodel:\n  top-k: 4\n  num-experts: 64\n";
  mm_config_override ov[] = {{"ep-size", "8"},
                             {"model.hidden-size", "2048"},
                             {"gran-k", "auto"},
                             {"log-level", "warn"},
                             {"requant.max-rel-error", "0.125"},
                             {"compute.max-rel-error", "1e-3"},
                             {"dispatch-mode", "normal"}};
  mm_config c;
  CHECK_OK(load_text(file, ov, sizeof ov / sizeof *ov, &c));
  CHECK_EQ_INT(c.ep_size, 8);               /* override beats the file */
  CHECK_EQ_INT(c.model.top_k, 4);           /* file */
  CHECK_EQ_INT(c.model.num_experts, 64);    /* file */
  CHECK_EQ_INT(c.model.hidden_size, 2048);  /* override beats the default */
  CHECK_EQ_INT(c.gran_k, 0);
  CHECK_EQ_INT(c.log_level, 1);
  CHECK(c.requant_max_rel_error == 0.125);
  CHECK(c.compute_max_rel_error == 1e-3);
  CHECK_EQ_INT(c.dispatch_mode, MM_DISPATCH_NORMAL);
  /* An override can fix what the file alone gets wrong (checks run after
   * merging), and break what the file alone gets right. */
  mm_config_override fix[] = {{"ep-size", "4"}};
  CHECK_OK(load_text("ep-size: 3\nmodel.num-experts: 12\n", NULL, 0, &c));
  CHECK_OK(load_text("ep-size: 3\n", fix, 1, &c));
  CHECK_EQ_INT(c.ep_size, 4);
  /* Overrides only: no file content. */
  mm_config_override only[] = {{"backend", "cpu-reference"}, {"cpu.threads", "2"}};
  CHECK_OK(load_text("", only, 2, &c));
  CHECK_EQ_INT(c.backend, MM_BACKEND_CPU_REFERENCE);
  CHECK_EQ_INT(c.cpu_threads, 2);
  /* Zero overrides with a NULL array is fine. */
  CHECK_OK(load_text("", NULL, 0, &c));
}

/* ---- bad inputs ------------------------------------------------------------- */

typedef struct bad_case {
  const char *yaml;
  int line, col;
  const char *substr;
} bad_case;

static const bad_case bad_cases[] = {
    /* unknown keys, with suggestions */
    {"ep-sise: 2", 1, 1, "unknown key 'ep-sise'; did you mean 'ep-size'?"},
    {"schema-version: 1\nmodel:\n  hiden-size: 6144\n", 3, 3,
     "unknown key 'model.hiden-size'; did you mean 'model.hidden-size'?"},
    {"hidden-size: 6144", 1, 1, "did you mean 'model.hidden-size'?"},
    {"modle:\n  top-k: 8\n", 1, 1, "unknown key 'modle'; did you mean 'model'?"},
    {"ep-size: 1\nfoo: 1", 2, 1, "unknown key 'foo'"},
    {"model:\n  ep-size: 2\n", 2, 3, "unknown key 'model.ep-size'; did you mean 'ep-size'?"},
    {"compute-mode: fp8", 1, 1, "did you mean 'compute.mode'?"},
    {"ep-szie: 2", 1, 1, "unknown key 'ep-szie'; did you mean 'ep-size'?"},
    {"model:\n  topk: 8\n", 2, 3, "did you mean 'model.top-k'?"},
    {"log_level: info", 1, 1, "did you mean 'log-level'?"},
    {"cpu:\n  thread: 2\n", 2, 3, "unknown key 'cpu.thread'; did you mean 'cpu.threads'?"},
    {"num-max-tokens: 64", 1, 1, "did you mean 'num-max-tokens-per-rank'?"},
    {"model: {top-k: 8, hidden-size: 6144, bogus: 1}", 1, 38, "unknown key 'model.bogus'"},
    {"'': 1", 1, 1, "empty key"},
    {"\"ep-size\\0\": 1", 1, 1, "NUL characters"},
    {"ep-size: \"4\\0x\"", 1, 10, "NUL characters"},
    /* duplicates */
    {"ep-size: 2\nep-size: 4\n", 2, 1, "duplicate key 'ep-size' (first at 1:1)"},
    {"model:\n  top-k: 4\nmodel:\n  top-k: 2\n", 3, 1, "duplicate key 'model' (first at 1:1)"},
    {"model.top-k: 4\nmodel:\n  top-k: 2\n", 3, 3, "duplicate key 'model.top-k' (first at 1:1)"},
    {"{ep-size: 2, ep-size: 2}", 1, 14, "duplicate key 'ep-size' (first at 1:2)"},
    /* enums */
    {"gran-k: 64", 1, 9, "gran-k: invalid value '64' (expected one of: auto, 16, 32)"},
    {"gran-k: 16.0", 1, 9, "gran-k: invalid value '16.0'"},
    {"compute:\n  mode: fp16\n", 2, 9, "compute.mode: invalid value 'fp16'"},
    {"compute.prefill-path: on", 1, 23,
     "compute.prefill-path: invalid value 'on' (expected one of: auto, off)"},
    {"dispatch-mode: low_latency", 1, 16, "did you mean 'low-latency'?"},
    {"backend: gpu", 1, 10, "backend: invalid value 'gpu'"},
    {"log-level: verbose", 1, 12, "log-level: invalid value 'verbose'"},
    {"requant:\n  policy: group32\n", 2, 11, "requant.policy: invalid value 'group32'"},
    /* integers */
    {"ep-size: 4x", 1, 10, "ep-size: expected an integer, got '4x'"},
    {"ep-size: 0x10", 1, 10, "expected an integer"},
    {"ep-size: 1.5", 1, 10, "expected an integer"},
    {"ep-size: 99999999999999999999999", 1, 10, "is out of range [1, 1024]"},
    {"ep-size: 0", 1, 10, "ep-size: 0 is out of range [1, 1024]"},
    {"ep-size: -8", 1, 10, "out of range"},
    {"ep-size: ' 8'", 1, 10, "expected an integer"},
    {"num-max-tokens-per-rank: 1048577", 1, 26, "out of range [1, 1048576]"},
    {"model: {hidden-size: 1000}", 1, 22, "must be a multiple of 128, got 1000"},
    {"model:\n  moe-intermediate-size: 0\n", 2, 26, "out of range [128, 65536]"},
    {"cpu:\n  threads: 5000\n", 2, 12, "out of range [0, 4096]"},
    {"comm:\n  timeout-ms: 0\n", 2, 15, "out of range [1, 86400000]"},
    {"dispatch:\n  low-latency-max-tokens: -1\n", 2, 27, "out of range"},
    {"schema-version: 2", 1, 17, "schema-version: must be 1, got 2"},
    {"model:\n  top-k: 65\n", 2, 10, "out of range [1, 64]"},
    {"compute:\n  prefill-experts: 0\n", 2, 20,
     "compute.prefill-experts: 0 is out of range [1, 32]"},
    {"compute.prefill-experts: 33", 1, 26, "out of range [1, 32]"},
    /* floats */
    {"requant:\n  max-rel-error: nan\n", 2, 18, "expected a finite number, got 'nan'"},
    {"requant:\n  max-rel-error: .inf\n", 2, 18, "expected a finite number"},
    {"requant:\n  max-rel-error: 0\n", 2, 18, "out of range (0, 1]"},
    {"requant:\n  max-rel-error: 1.0000001\n", 2, 18, "out of range (0, 1]"},
    {"compute:\n  max-rel-error: 0\n", 2, 18, "compute.max-rel-error: 0 is out of range (0, 1]"},
    {"compute:\n  max-rel-error: -0.01\n", 2, 18, "out of range (0, 1]"},
    {"compute:\n  max-rel-error: 1.5\n", 2, 18, "out of range (0, 1]"},
    {"compute.max-rel-error: 2e0\n", 1, 24, "out of range (0, 1]"},
    {"compute:\n  mode: auto\n  max-rel-error: fp8\n", 3, 18,
     "compute.max-rel-error: expected a finite number, got 'fp8'"},
    {"compute:\n  max-rel-error: nan\n", 2, 18, "expected a finite number, got 'nan'"},
    {"compute:\n  max-rel-error: 2%\n", 2, 18, "expected a finite number"},
    {"compute:\n  max-rel-error:\n", 2, 17, "compute.max-rel-error: missing value"},
    {"model:\n  routed-scaling-factor: 1e999\n", 2, 26, "expected a finite number"},
    {"model:\n  activation-clamp: -1\n", 2, 21, "out of range [0, 1e+06]"},
    {"model:\n  routed-scaling-factor: 0x1p3\n", 2, 26, "expected a finite number"},
    /* missing values, wrong shapes */
    {"ep-size: ~", 1, 10, "ep-size: missing value"},
    {"log-level:\n", 1, 11, "log-level: missing value"},
    {"ep-size: [1, 2]", 1, 10, "ep-size: expected a single value, not a list"},
    {"ep-size: {a: 1}", 1, 10, "expected a single value, not a mapping"},
    {"model: 5", 1, 8, "'model' must be a mapping of model.* keys, not a scalar"},
    {"model: [1]", 1, 8, "'model' must be a mapping"},
    {"- ep-size: 1", 1, 1, "the top level must be a mapping of keys, not a list"},
    {"just a string", 1, 1, "the top level must be a mapping of keys, not a scalar"},
    {"? [a, b]\n: 1\n", 1, 3, "keys must be plain names, not a list"},
    /* documents, anchors, aliases, tags */
    {"ep-size: 1\n---\nep-size: 2\n", 2, 1, "more than one document"},
    {"ep-size: 1\n...\n---\n", 3, 1, "more than one document"},
    {"model: &m\n  top-k: 4\n", 1, 8, "anchors are not supported (&m)"},
    {"&root {ep-size: 1}", 1, 1, "anchors are not supported"},
    {"ep-size: *a", 1, 10, "aliases are not supported (*a)"},
    {"ep-size: !!int 4", 1, 10, "tags are not supported"},
    {"!config {ep-size: 1}", 1, 1, "tags are not supported (!config)"},
    /* syntax and encoding */
    {"\tep-size: 1", 1, 1, "syntax error: found character that cannot start any token"},
    {"ep-size: 1\x01\n", 1, 11, "control characters are not allowed"},
    {"ep-size: \xff\n", 1, 10, "invalid leading UTF-8 octet"},
    {"# \xc3\xa9\xc3\xa9\xc3\xa9\x02", 1, 6, "control characters"},
    {"log-level: info\r\nep-size: x\r\n", 2, 10, "expected an integer, got 'x'"},
    {"model: {top-k: 8", 2, 1, "syntax error: did not find expected ',' or '}' "
                               "(while parsing a flow mapping at 1:8)"},
    /* cross-field (after merging) */
    {"ep-size: 3", 1, 1, "ep-size 3 does not divide model.num-experts 256 "
                         "(model.num-experts: the default)"},
    {"model:\n  num-experts: 100\nep-size: 8\n", 3, 1,
     "ep-size 8 does not divide model.num-experts 100 (model.num-experts: set at t.yaml:2:3)"},
    {"model:\n  num-experts: 4\n  top-k: 8\n", 3, 3,
     "model.top-k 8 is more than model.num-experts 4"},
    {"model:\n  top-k: 16\n  num-experts: 8\n", 2, 3, "model.top-k 16 is more than"},
    {"gran-k: 32\nrequant:\n  policy: group16-to-group32\n", 3, 3,
     "requant.policy group16-to-group32 needs group16 weights, but gran-k is 32"},
    {"requant.policy: group16-to-group32\ngran-k: 32\n", 1, 1, "(gran-k: set at t.yaml:2:1)"},
};

static void test_bad_cases(void) {
  size_t n = sizeof bad_cases / sizeof *bad_cases;
  CHECK(n >= 30);
  for (size_t i = 0; i < n; i++) {
    mm_config c, before;
    memset(&c, 0x5A, sizeof c);
    memcpy(&before, &c, sizeof c);
    char what[64];
    snprintf(what, sizeof what, "bad case %zu", i);
    expect_at(load_text(bad_cases[i].yaml, NULL, 0, &c), SRC, bad_cases[i].line,
              bad_cases[i].col, bad_cases[i].substr, what);
    CHECK_MSG(!memcmp(&c, &before, sizeof c), "%s: output written on error", what);
  }
}

/* Key and value length limits (under the size cap). */
static void test_long_scalars(void) {
  char *t = malloc(8192);
  memset(t, 'k', 200);
  strcpy(t + 200, ": 1\n");
  expect_at(load_text(t, NULL, 0, &(mm_config){0}), SRC, 1, 1, "key is 200 bytes long (at most 128)",
            "long key");
  strcpy(t, "ep-size: ");
  memset(t + 9, '9', 5000);
  t[5009] = '\0';
  expect_at(load_text(t, NULL, 0, &(mm_config){0}), SRC, 1, 10,
            "scalar is 5000 bytes long (at most 4096)", "long value");
  free(t);
}

typedef struct bad_override {
  const char *file;
  mm_config_override ov[2];
  size_t n;
  const char *prefix; /* the message starts with this */
  const char *substr;
} bad_override;

static void test_bad_overrides(void) {
  static const bad_override cases[] = {
      {"", {{"ep-sise", "2"}}, 1, "override 'ep-sise': ",
       "unknown key 'ep-sise'; did you mean 'ep-size'?"},
      {"", {{"model", "x"}}, 1, "override 'model': ", "is a section"},
      {"", {{"ep-size", "abc"}}, 1, "override 'ep-size': ", "expected an integer, got 'abc'"},
      {"", {{"gran-k", "48"}}, 1, "override 'gran-k': ", "invalid value '48'"},
      {"", {{"ep-size", ""}}, 1, "override 'ep-size': ", "missing value"},
      {"", {{"ep-size", NULL}}, 1, "override 'ep-size': ", "value is NULL"},
      {"", {{NULL, "1"}}, 1, "override #0: ", "key is NULL"},
      {"", {{"ep-size", "2"}, {"ep-size", "4"}}, 2, "override 'ep-size': ", "given twice"},
      {"", {{"ep-size", "3"}}, 1, "override 'ep-size': ",
       "ep-size 3 does not divide model.num-experts 256 (model.num-experts: the default)"},
      {"model:\n  num-experts: 4\n", {{"model.top-k", "8"}}, 1, "override 'model.top-k': ",
       "(model.num-experts: set at t.yaml:2:3)"},
      {"model:\n  top-k: 8\n", {{"model.num-experts", "4"}}, 1,
       "override 'model.num-experts': ", "(model.top-k: set at t.yaml:2:3)"},
      {"gran-k: 32\n", {{"requant.policy", "group16-to-group32"}}, 1,
       "override 'requant.policy': ", "gran-k is 32"},
      {"", {{"ep-size", "1"}, {"requant.max-rel-error", "inf"}}, 2,
       "override 'requant.max-rel-error': ", "expected a finite number"},
      {"", {{"compute.max-rel-error", "0"}}, 1, "override 'compute.max-rel-error': ",
       "out of range (0, 1]"},
      {"compute:\n  max-rel-error: 0.5\n", {{"compute.max-rel-error", "auto"}}, 1,
       "override 'compute.max-rel-error': ", "expected a finite number, got 'auto'"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    mm_config c;
    mm_err *e = load_text(cases[i].file, cases[i].ov, cases[i].n, &c);
    CHECK_MSG(e != NULL, "override case %zu loaded", i);
    if (!e) continue;
    CHECK_EQ_INT(e->code, MEGAMOE_CODE_INVALID_ARGUMENT);
    CHECK_MSG(!strncmp(e->message, cases[i].prefix, strlen(cases[i].prefix)),
              "case %zu: %s", i, e->message);
    CHECK_MSG(strstr(e->message, cases[i].substr) != NULL, "case %zu: %s", i, e->message);
    mm_error_free(e);
  }
}

static void test_bad_arguments(void) {
  mm_config c;
  CHECK_ERR(mm_config_load(NULL, "", 0, NULL, NULL, 0, NULL), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_config_load(NULL, NULL, 0, NULL, NULL, 0, &c), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_config_load("x.yaml", "", 0, NULL, NULL, 0, &c), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_config_load(NULL, "", 0, NULL, NULL, 3, &c), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_config_load("/nonexistent/megamoe.yaml", NULL, 0, NULL, NULL, 0, &c),
            MEGAMOE_CODE_NOT_FOUND);
  CHECK_ERR(mm_config_load("", NULL, 0, NULL, NULL, 0, &c), MEGAMOE_CODE_NOT_FOUND);
  CHECK_ERR(mm_config_load("/", NULL, 0, NULL, NULL, 0, &c), MEGAMOE_CODE_INVALID_ARGUMENT);
  mm_err *e = mm_config_load("/nonexistent/megamoe.yaml", NULL, 0, NULL, NULL, 0, &c);
  CHECK(e && strstr(e->message, "/nonexistent/megamoe.yaml: cannot open") == e->message);
  mm_error_free(e);
}

/* ---- files: relative config.json, precedence ----------------------------- */

static char tmpdir[64];

static void write_file(const char *name, const char *text, size_t len) {
  char path[256];
  snprintf(path, sizeof path, "%s/%s", tmpdir, name);
  FILE *f = fopen(path, "wb");
  CHECK(f != NULL);
  if (!f) return;
  CHECK(fwrite(text, 1, len ? len : strlen(text), f) == (len ? len : strlen(text)));
  fclose(f);
}

static void remove_file(const char *name) {
  char path[256];
  snprintf(path, sizeof path, "%s/%s", tmpdir, name);
  unlink(path);
}

static const char *hf_json =
    "{\n"
    "  \"architectures\": [\"GlmMoeDsaForCausalLM\"],\n"
    "  \"hidden_size\": 5120,\n"
    "  \"num_experts\": 999,\n"
    "  \"moe_intermediate_size\": 1536,\n"
    "  \"n_routed_experts\": 160,\n"
    "  \"num_experts_per_tok\": 8,\n"
    "  \"routed_scaling_factor\": 2.5,\n"
    "  \"rope_scaling\": null,\n"
    "  \"quantization_config\": {\"quant_method\": \"modelopt\", \"config_groups\":\n"
    "    {\"group_0\": {\"weights\": {\"num_bits\": 4, \"group_size\": 16}}}},\n"
    "  \"torch_dtype\": \"bfloat16\"\n"
    "}\n";

static void test_config_json(void) {
  char path[256], jpath[256];
  snprintf(path, sizeof path, "%s/megamoe.yaml", tmpdir);
  snprintf(jpath, sizeof jpath, "%s/config.json", tmpdir);
  write_file("config.json", hf_json, 0);
  /* Relative to the YAML file's directory; the file beats config.json. */
  write_file("megamoe.yaml", "model:\n  config-json: config.json\n  top-k: 4\n", 0);
  mm_config c;
  CHECK_OK(mm_config_load(path, NULL, 0, NULL, NULL, 0, &c));
  CHECK_EQ_INT(c.model.hidden_size, 5120);
  CHECK_EQ_INT(c.model.moe_intermediate_size, 1536);
  CHECK_EQ_INT(c.model.num_experts, 160); /* n_routed_experts beats num_experts */
  CHECK_EQ_INT(c.model.top_k, 4);
  CHECK(c.model.routed_scaling_factor == 2.5);
  CHECK(!strcmp(c.model.config_json, jpath));
  /* Overrides beat both. */
  mm_config_override ov[] = {{"model.hidden-size", "2048"}, {"model.top-k", "2"}};
  CHECK_OK(mm_config_load(path, NULL, 0, NULL, ov, 2, &c));
  CHECK_EQ_INT(c.model.hidden_size, 2048);
  CHECK_EQ_INT(c.model.top_k, 2);
  CHECK_EQ_INT(c.model.num_experts, 160);
  /* config.json beats the defaults; the override names the json. */
  mm_config_override ovj[] = {{"model.config-json", jpath}};
  CHECK_OK(load_text("", ovj, 1, &c));
  CHECK_EQ_INT(c.model.top_k, 8);
  CHECK_EQ_INT(c.model.hidden_size, 5120);
  /* The shipped file leaves config.json's keys unset: naming one there
   * gives its shapes (forty-fifth stop's note: it used to pin GLM-5's). */
  char shipped[1024];
  snprintf(shipped, sizeof shipped, "%s/conf/megamoe.yaml", mm_test_srcdir());
  CHECK_OK(mm_config_load(shipped, NULL, 0, NULL, ovj, 1, &c));
  CHECK_EQ_INT(c.model.hidden_size, 5120);
  CHECK_EQ_INT(c.model.moe_intermediate_size, 1536);
  CHECK_EQ_INT(c.model.num_experts, 160);
  CHECK_EQ_INT(c.model.top_k, 8);
  CHECK(c.model.routed_scaling_factor == 2.5);
  /* An override of "" switches the file's config.json off. */
  mm_config_override off[] = {{"model.config-json", ""}};
  CHECK_OK(mm_config_load(path, NULL, 0, NULL, off, 1, &c));
  CHECK_EQ_INT(c.model.hidden_size, 6144);
  CHECK(c.model.config_json[0] == '\0');
  /* Other expert-count spellings, nulls ignored, values as strings. */
  write_file("mixtral.json",
             "{\"num_local_experts\": 8, \"num_experts_per_tok\": 2, \"hidden_size\": \"4096\","
             " \"num_experts\": null}",
             0);
  write_file("megamoe.yaml", "model.config-json: mixtral.json\n", 0);
  CHECK_OK(mm_config_load(path, NULL, 0, NULL, NULL, 0, &c));
  CHECK_EQ_INT(c.model.num_experts, 8);
  CHECK_EQ_INT(c.model.top_k, 2);
  CHECK_EQ_INT(c.model.moe_intermediate_size, 2048);
  /* A file value fixes a cross-field problem of config.json alone. */
  write_file("small.json", "{\"n_routed_experts\": 4, \"num_experts_per_tok\": 8}", 0);
  write_file("megamoe.yaml", "model:\n  config-json: small.json\n  top-k: 2\n", 0);
  CHECK_OK(mm_config_load(path, NULL, 0, NULL, NULL, 0, &c));
  CHECK_EQ_INT(c.model.num_experts, 4);
  CHECK_EQ_INT(c.model.top_k, 2);
  remove_file("small.json");
  remove_file("mixtral.json");
  remove_file("config.json");
  remove_file("megamoe.yaml");
}

typedef struct bad_json {
  const char *json;
  int line, col;
  const char *substr;
} bad_json;

static void test_config_json_errors(void) {
  static const bad_json cases[] = {
      {"{\n  \"hidden_size\": 1000\n}", 2, 18,
       "hidden_size (model.hidden-size): must be a multiple of 128, got 1000"},
      {"{\n  \"hidden_size\": 100\n}", 2, 18,
       "hidden_size (model.hidden-size): 100 is out of range [128, 65536]"},
      {"[1, 2]", 1, 1, "the top level must be an object, not a list"},
      {"{\"foo\": 1}", 1, 1, "no model keys found"},
      {"", 1, 1, "empty file"},
      {"{\"hidden_size\": 5120, \"hidden_size\": 5120}", 1, 23, "duplicate key 'hidden_size'"},
      {"{\"n_routed_experts\": 4, \"num_experts_per_tok\": 8}", 1, 25,
       "model.top-k 8 is more than model.num-experts 4 (model.num-experts: set at "},
      {"{\"hidden_size\": 5120,,}", 1, 22, "syntax error"},
      {"{\"hidden_size\": [5120]}", 1, 17, "expected a number, not a list"},
      {"{\"num_experts_per_tok\": \"eight\"}", 1, 25, "expected an integer, got 'eight'"},
      {"{\"routed_scaling_factor\": -1}", 1, 27, "out of range (0, 1e+06]"},
      {"{\"hidden_size\": \"null\"}", 1, 17, "expected an integer, got 'null'"},
      {"{\"hidden_size\": 5120}\n{\"hidden_size\": 5120}", 2, 1, "syntax error"},
      {"{\"x\": &a [1], \"hidden_size\": 5120}", 1, 7, "anchors are not supported"},
  };
  char path[256], jpath[256];
  snprintf(jpath, sizeof jpath, "%s/bad.json", tmpdir);
  snprintf(path, sizeof path, "%s/megamoe.yaml", tmpdir);
  write_file("megamoe.yaml", "model:\n  config-json: bad.json\n", 0);
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    write_file("bad.json", cases[i].json, 0);
    mm_config c;
    char what[64];
    snprintf(what, sizeof what, "json case %zu", i);
    expect_at(mm_config_load(path, NULL, 0, NULL, NULL, 0, &c), jpath, cases[i].line,
              cases[i].col, cases[i].substr, what);
  }
  /* A missing config.json: NOT_FOUND at the YAML value that names it. */
  remove_file("bad.json");
  mm_config c;
  mm_err *e = load_text("model:\n  config-json: nope.json\n", NULL, 0, &c);
  CHECK(e && e->code == MEGAMOE_CODE_NOT_FOUND);
  CHECK(e && strstr(e->message, "t.yaml:2:16: model.config-json: nope.json: cannot open") ==
                 e->message);
  mm_error_free(e);
  e = mm_config_load(path, NULL, 0, NULL, NULL, 0, &c);
  char want[600];
  snprintf(want, sizeof want, "%s:2:16: model.config-json: %s: cannot open", path, jpath);
  CHECK(e && e->code == MEGAMOE_CODE_NOT_FOUND);
  CHECK_MSG(e && strstr(e->message, want) == e->message, "%s", e ? e->message : "");
  mm_error_free(e);
  remove_file("megamoe.yaml");
}

/* ---- bounded parsing ----------------------------------------------------------- */

/* Loads in a child process (a crash fails the case instead of the binary)
 * and measures the wall time and the growth of the child's peak RSS. */
typedef struct bounded {
  double seconds;
  long rss_growth_kib;
  int code;
  char msg[480];
} bounded;

static int run_bounded(const char *path, const char *text, size_t len, bounded *out) {
  int fd[2];
  memset(out, 0, sizeof *out);
  if (pipe(fd) != 0) return 0;
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) return 0;
  if (pid == 0) {
    close(fd[0]);
    bounded r = {0};
    mm_config c;
    long rss0 = maxrss_kib();
    double t0 = now_s();
    mm_err *e = mm_config_load(path, text, len, path ? NULL : SRC, NULL, 0, &c);
    r.seconds = now_s() - t0;
    r.rss_growth_kib = maxrss_kib() - rss0;
    r.code = e ? (int)e->code : 0;
    snprintf(r.msg, sizeof r.msg, "%s", e ? e->message : "");
    ssize_t w = write(fd[1], &r, sizeof r);
    _exit(w == (ssize_t)sizeof r ? 0 : 1);
  }
  close(fd[1]);
  size_t got = 0;
  while (got < sizeof *out) {
    ssize_t n = read(fd[0], (char *)out + got, sizeof *out - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += (size_t)n;
  }
  close(fd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return got == sizeof *out && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* Expects a located INVALID_ARGUMENT within 1 s and 64 MiB; line 0 means
 * any location, substr NULL any message. */
static void expect_bounded_at(const char *path, const char *text, size_t len, const char *src,
                              int line, int col, const char *substr, const char *what) {
  bounded r;
  int l = 0, c = 0;
  if (!run_bounded(path, text, len, &r)) {
    CHECK_MSG(0, "%s: the child crashed or failed", what);
    return;
  }
  printf("# %-30s %8.4f s  +%6ld KiB  %.110s\n", what, r.seconds, r.rss_growth_kib, r.msg);
  CHECK_MSG(r.code == MEGAMOE_CODE_INVALID_ARGUMENT, "%s: code %d: %s", what, r.code, r.msg);
  CHECK_MSG(located(r.msg, src, &l, &c), "%s: not located: %s", what, r.msg);
  if (line) CHECK_MSG(l == line && c == col, "%s: at %d:%d, expected %d:%d", what, l, c, line, col);
  if (substr) CHECK_MSG(strstr(r.msg, substr) != NULL, "%s: '%s' not in %s", what, substr, r.msg);
  CHECK_MSG(r.seconds < 1.0, "%s: %.3f s", what, r.seconds);
  CHECK_MSG(r.rss_growth_kib < 64 * 1024, "%s: peak RSS grew %ld KiB", what, r.rss_growth_kib);
}

static void expect_bounded(const char *text, size_t len, const char *what) {
  expect_bounded_at(NULL, text, len, SRC, 0, 0, NULL, what);
}

static char *repeat(const char *head, const char *unit, size_t times, const char *tail,
                    size_t *len) {
  size_t hl = strlen(head), ul = strlen(unit), tl = strlen(tail);
  size_t n = hl + ul * times + tl;
  char *s = malloc(n + 1);
  memcpy(s, head, hl);
  for (size_t i = 0; i < times; i++) memcpy(s + hl + i * ul, unit, ul);
  memcpy(s + hl + ul * times, tail, tl);
  s[n] = '\0';
  *len = n;
  return s;
}

static void test_bounded_huge_key(void) {
  size_t n;
  char *s = repeat("", "k", 10u << 20, ": 1\n", &n); /* 10 MiB key */
  expect_bounded(s, n, "10 MiB key (text)");
  expect_bounded(s, 0, "10 MiB key (NUL-terminated)");
  /* The same through a file. */
  write_file("huge.yaml", s, n);
  char path[256];
  snprintf(path, sizeof path, "%s/huge.yaml", tmpdir);
  expect_bounded_at(path, NULL, 0, path, 1, 1, "more than the limit", "10 MiB key (file)");
  remove_file("huge.yaml");
  free(s);
  /* Just under the size cap: a 3 MiB key and a 3 MiB value. */
  s = repeat("", "k", 3u << 20, ": 1\n", &n);
  expect_bounded_at(NULL, s, n, SRC, 1, 1, "scalar is 3145728 bytes long", "3 MiB key");
  free(s);
  s = repeat("ep-size: ", "9", 3u << 20, "\n", &n);
  expect_bounded_at(NULL, s, n, SRC, 1, 10, "scalar is 3145728 bytes long", "3 MiB value");
  free(s);
  s = repeat("", "ep-size: 1\n", 300000, "", &n); /* 3.3 MB of duplicates */
  expect_bounded(s, n, "300000 duplicate keys");
  free(s);
}

static void test_bounded_alias_bomb(void) {
  /* billion laughs, as keys the schema does not know, under a known section,
   * at the root, and inside config.json (which skips unknown keys). */
  const char *bomb =
      "a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n"
      "b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
      "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
      "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
      "e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
      "f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
      "g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n"
      "h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]\n"
      "i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]\n";
  expect_bounded_at(NULL, bomb, 0, SRC, 1, 1, "unknown key 'a'", "alias bomb");
  char *known = malloc(strlen(bomb) + 64);
  snprintf(known, strlen(bomb) + 64, "ep-size: &x [1, 2]\n%s", bomb);
  expect_bounded_at(NULL, known, 0, SRC, 1, 10, "anchors are not supported (&x)",
                    "alias bomb, known key");
  free(known);
  char *s = malloc(strlen(bomb) + 64);
  snprintf(s, strlen(bomb) + 64, "model:\n  %s", bomb);
  expect_bounded(s, 0, "alias bomb in a section");
  free(s);
  size_t n;
  s = repeat("&x\n", "", 0, bomb, &n);
  expect_bounded_at(NULL, s, n, SRC, 1, 1, "anchors are not supported (&x)",
                    "alias bomb, anchored root");
  free(s);
  const char *jbomb =
      "{\"a\": &a [\"lol\",\"lol\",\"lol\",\"lol\"], \"b\": &b [*a,*a,*a,*a],"
      " \"c\": &c [*b,*b,*b,*b], \"d\": [*c,*c,*c,*c], \"hidden_size\": 5120}";
  write_file("bomb.json", jbomb, 0);
  char yaml[300];
  snprintf(yaml, sizeof yaml, "model.config-json: %s/bomb.json\n", tmpdir);
  char jpath[256];
  snprintf(jpath, sizeof jpath, "%s/bomb.json", tmpdir);
  expect_bounded_at(NULL, yaml, 0, jpath, 1, 7, "anchors are not supported (&a)",
                    "alias bomb in config.json");
  remove_file("bomb.json");
}

static void test_bounded_nesting(void) {
  size_t n;
  char *s = repeat("", "[", 5000, "", &n);
  expect_bounded(s, n, "5000 '['");
  free(s);
  s = repeat("", "{", 5000, "", &n);
  expect_bounded(s, n, "5000 '{'");
  free(s);
  char *open = repeat("model: ", "[", 5000, "", &n);
  char *full = malloc(n + 5001);
  memcpy(full, open, n);
  memset(full + n, ']', 5000);
  full[n + 5000] = '\0';
  expect_bounded(full, 0, "5000 balanced '[' ']'");
  free(open);
  free(full);
  s = repeat("", "{a: ", 5000, "", &n);
  expect_bounded(s, n, "5000 '{a: '");
  free(s);
  /* In config.json, whose unknown keys are skipped: the depth cap stops it. */
  s = repeat("{\"x\": ", "[", 5000, "", &n);
  write_file("deep.json", s, n);
  free(s);
  char yaml[300], jpath[256];
  snprintf(jpath, sizeof jpath, "%s/deep.json", tmpdir);
  snprintf(yaml, sizeof yaml, "model.config-json: %s\n", jpath);
  /* root object = level 1, the 16th '[' (column 7 + 15) is level 17 */
  expect_bounded_at(NULL, yaml, 0, jpath, 1, 22, "nesting is deeper than 16 levels",
                    "5000 '[' in config.json");
  /* Nested block mappings, 2000 levels (2 MB of indentation). */
  size_t cap = 2100 * 2100;
  char *b = malloc(cap);
  size_t k = 0;
  k += (size_t)sprintf(b, "x:\n");
  for (int d = 1; d < 2000; d++) {
    memset(b + k, ' ', (size_t)d);
    k += (size_t)d;
    k += (size_t)sprintf(b + k, "x:\n");
  }
  write_file("deep.json", b, k);
  /* level 17 is the value of the 16th "x:", on line 17 at column 17 */
  expect_bounded_at(NULL, yaml, 0, jpath, 17, 17, "nesting is deeper than 16 levels",
                    "2000 block levels in config.json");
  free(b);
  remove_file("deep.json");
}

static void test_bounded_garbage(void) {
  size_t n = 1u << 20;
  unsigned char *g = malloc(n);
  for (int round = 0; round < 8; round++) {
    for (size_t i = 0; i < n; i++) g[i] = (unsigned char)mm_test_rand_u64();
    if (round & 1) g[0] = 'a'; /* past the first byte, too */
    char what[64];
    snprintf(what, sizeof what, "1 MiB binary garbage #%d", round);
    expect_bounded((const char *)g, n, what);
  }
  /* Printable garbage: syntax errors somewhere, but located. */
  for (size_t i = 0; i < n; i++) g[i] = (unsigned char)(0x20 + mm_test_rand_u64() % 95);
  /* One line with no newline: a leading '#' would make it all one comment
   * (an empty file, which loads as the defaults) about once in 95 runs. */
  if (g[0] == '#') g[0] = 'a';
  expect_bounded((const char *)g, n, "1 MiB printable garbage");
  free(g);
}

/* ---- fuzzing -------------------------------------------------------------------- */

/* Every load ends in OK or a located error (never a crash). */
static int fuzz_one(const char *text, size_t len, int *bad) {
  mm_config c;
  mm_err *e = mm_config_load(NULL, text, len, SRC, NULL, 0, &c);
  if (!e) return 1;
  int l, col;
  /* NOT_FOUND: a fuzzed model.config-json naming no file */
  if ((e->code != MEGAMOE_CODE_INVALID_ARGUMENT && e->code != MEGAMOE_CODE_NOT_FOUND) ||
      !located(e->message, SRC, &l, &col)) {
    if (*bad < 5) printf("# unlocated: %s\n", e->message);
    (*bad)++;
  }
  mm_error_free(e);
  return 0;
}

static void test_fuzz_tokens(void) {
  static const char *const tok[] = {
      "ep-size", "model", "hidden-size", "top-k", "requant", "policy", "gran-k", "auto", "16",
      "32", "group16-to-group32", "cpu", "threads", ":", ": ", ",", "{", "}", "[", "]", "- ",
      "&a ", "*a", "!!str ", "!x ", "'", "\"", "\\", "#", "\n", "\n  ", "\n    ", " ", "\t",
      "---\n", "...\n", "%YAML 1.1\n", "? ", "|\n", ">-\n", "8", "-1", "1e9", "0x1", "~",
      "\xc3\xa9", "\xff", "\x01", "model.top-k", "null", "256", "\r\n", "model.config-json"};
  size_t ntok = sizeof tok / sizeof *tok;
  char buf[2048];
  int ok = 0, bad = 0;
  double t0 = now_s();
  for (int iter = 0; iter < 20000; iter++) {
    size_t len = 0;
    int parts = 1 + (int)(mm_test_rand_u64() % 40);
    for (int p = 0; p < parts; p++) {
      const char *t = tok[mm_test_rand_u64() % ntok];
      size_t tl = strlen(t);
      if (len + tl >= sizeof buf) break;
      memcpy(buf + len, t, tl);
      len += tl;
    }
    buf[len] = '\0';
    ok += fuzz_one(buf, len, &bad);
  }
  printf("# token fuzz: 20000 inputs, %d loaded, %d unlocated errors, %.3f s\n", ok, bad,
         now_s() - t0);
  CHECK_EQ_INT(bad, 0);
}

static void test_fuzz_mutations(void) {
  char path[1024];
  snprintf(path, sizeof path, "%s/conf/megamoe.yaml", mm_test_srcdir());
  char *base = mm_test_read_file(path);
  CHECK(base != NULL);
  if (!base) return;
  size_t bl = strlen(base);
  char *buf = malloc(bl + 64);
  int ok = 0, bad = 0;
  double t0 = now_s();
  for (int iter = 0; iter < 5000; iter++) {
    memcpy(buf, base, bl);
    size_t len = bl;
    int edits = 1 + (int)(mm_test_rand_u64() % 4);
    for (int e = 0; e < edits; e++) {
      size_t at = (size_t)(mm_test_rand_u64() % len);
      unsigned char b = (unsigned char)mm_test_rand_u64();
      switch (mm_test_rand_u64() % 3) {
        case 0: buf[at] = (char)b; break;                       /* replace */
        case 1: memmove(buf + at, buf + at + 1, len - at - 1);  /* delete */
                len--; break;
        default: if (len + 1 < bl + 64) {                       /* insert */
                   memmove(buf + at + 1, buf + at, len - at);
                   buf[at] = (char)b;
                   len++;
                 }
      }
    }
    ok += fuzz_one(buf, len, &bad);
  }
  printf("# mutation fuzz: 5000 inputs, %d loaded, %d unlocated errors, %.3f s\n", ok, bad,
         now_s() - t0);
  CHECK_EQ_INT(bad, 0);
  free(buf);
  free(base);
}

/* ---- format round trip ------------------------------------------------------------ */

static int rand_in(int lo, int hi) { return lo + (int)(mm_test_rand_u64() % (uint64_t)(hi - lo + 1)); }

static void test_format_round_trip(void) {
  char buf[4096];
  for (int iter = 0; iter < 500; iter++) {
    mm_config a, b;
    mm_config_defaults(&a);
    int gk[] = {0, 16, 32};
    a.gran_k = gk[rand_in(0, 2)];
    a.requant_policy = a.gran_k == 32 ? MM_REQUANT_NONE : (mm_requant_policy)rand_in(0, 1);
    a.requant_max_rel_error = 1.0 - mm_test_uniform(0.0f, 0.999f);
    a.compute_mode = (mm_compute_mode)rand_in(0, 2);
    a.compute_max_rel_error = iter % 5 ? 1.0 - mm_test_uniform(0.0f, 0.999f)
                                       : pow(10.0, -rand_in(1, 300));
    a.model.hidden_size = 128 * rand_in(1, 512);
    a.model.moe_intermediate_size = 128 * rand_in(1, 512);
    a.model.num_experts = rand_in(1, 4096);
    a.model.top_k = rand_in(1, a.model.num_experts < 64 ? a.model.num_experts : 64);
    a.model.routed_scaling_factor = mm_test_uniform(1e-3f, 100.0f);
    a.model.activation_clamp = iter % 3 ? 0.0 : mm_test_uniform(0.0f, 50.0f);
    int divs[64], nd = 0;
    for (int d = 1; d <= 1024 && nd < 64; d++)
      if (a.model.num_experts % d == 0) divs[nd++] = d;
    a.ep_size = divs[rand_in(0, nd - 1)];
    a.num_max_tokens_per_rank = rand_in(1, 1 << 20);
    a.dispatch_mode = (mm_dispatch_mode)rand_in(0, 2);
    a.low_latency_max_tokens = rand_in(0, 1 << 20);
    a.backend = (mm_backend_kind)rand_in(0, 2);
    a.cpu_threads = rand_in(0, 4096);
    a.comm_timeout_ms = rand_in(1, 86400000);
    a.log_level = rand_in(0, 3);
    size_t need = mm_config_format(&a, buf, sizeof buf);
    CHECK(need < sizeof buf && strlen(buf) == need);
    mm_err *e = load_text(buf, NULL, 0, &b);
    CHECK_MSG(!e, "iter %d: %s\n%s", iter, e ? e->message : "", buf);
    mm_error_free(e);
    if (!e) CHECK_MSG(config_equal(&a, &b), "iter %d:\n%s", iter, buf);
    if (mm_test_case_failed_) break;
  }
  /* Truncation behaves like snprintf. */
  mm_config d;
  mm_config_defaults(&d);
  char small[16];
  size_t need = mm_config_format(&d, small, sizeof small);
  CHECK(need > sizeof small && strlen(small) == sizeof small - 1);
  CHECK_EQ_INT(mm_config_format(&d, NULL, 0), need);
  CHECK(mm_config_format(&d, buf, sizeof buf) == need);
}

int main(void) {
  mm_test_seed();
  snprintf(tmpdir, sizeof tmpdir, "/tmp/mm_test_config_XXXXXX");
  if (!mkdtemp(tmpdir)) {
    printf("Bail out! mkdtemp: %s\n", strerror(errno));
    return 1;
  }
  RUN(test_defaults);
  RUN(test_shipped_file_and_docs);
  RUN(test_every_key);
  RUN(test_names);
  RUN(test_overrides);
  RUN(test_bad_cases);
  RUN(test_long_scalars);
  RUN(test_bad_overrides);
  RUN(test_bad_arguments);
  RUN(test_config_json);
  RUN(test_config_json_errors);
  RUN(test_bounded_huge_key);
  RUN(test_bounded_alias_bomb);
  RUN(test_bounded_nesting);
  RUN(test_bounded_garbage);
  RUN(test_fuzz_tokens);
  RUN(test_fuzz_mutations);
  RUN(test_format_round_trip);
  rmdir(tmpdir);
  return mm_test_done();
}

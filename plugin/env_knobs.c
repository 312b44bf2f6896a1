/* env_knobs.c -- the table of the plugin's environment variables and the
 * check of a process's MEGAMOE_* entries against it. */
#include "env_knobs.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "spelling.h"

extern char **environ;

typedef struct {
  const char *name;
  /* The values it takes, space-separated (compared without case, as the
   * readers do where they allow it); NULL: a decimal count 0..2^31-1. */
  const char *values;
} env_knob;

static const env_knob g_knobs[] = {
    {"MEGAMOE_LOG_LEVEL", "error warn info debug 0 1 2 3"},
    {"MEGAMOE_EP_TRANSPORT", "auto ipc nccl"},
    {"MEGAMOE_NCCL_BLOCKING", "0 1"},
    {"MEGAMOE_SM90_TOKEN_TILE", "16 32 64 128 160 128+160 64+128 32+128"},
    {"MEGAMOE_SM90_CTAS_PER_SM", "1 2"},
    {"MEGAMOE_SM90_MIXED_TILES", "0 1"},
    {"MEGAMOE_SM90_WIDE_FIRST", "0 1"},
    {"MEGAMOE_SM90_GRID", NULL},
    {"MEGAMOE_SM90_PREFILL", "0 1"},
    {"MEGAMOE_SM90_PREFILL_NARROW", "0 1"},
    {"MEGAMOE_SM90_PREFILL_TASK_KB", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16"},
    {"MEGAMOE_SM90_PREFILL_AHEAD", "0 1 2"},
    {"MEGAMOE_SM90_PREFILL_OVERLAP", "0 1"},
    {"MEGAMOE_SM90_PACK", "auto gpu host"},
    {"MEGAMOE_SM90_REQUANT", "gpu host"},
    {"MEGAMOE_CPU_SIMD", "0 1"},
    {"MEGAMOE_CPU_REQUANT", "loader backend"},
};
#define NUM_KNOBS (sizeof g_knobs / sizeof g_knobs[0])

const char *mm_env_knob_name(int i) {
  return i >= 0 && (size_t)i < NUM_KNOBS ? g_knobs[i].name : NULL;
}

/* v is one of the space-separated words of list. */
static int one_of(const char *list, const char *v) {
  const size_t n = strlen(v);
  for (const char *w = list; *w;) {
    const char *end = strchr(w, ' ');
    const size_t len = end ? (size_t)(end - w) : strlen(w);
    if (n && len == n && !strncasecmp(w, v, n)) return 1;
    if (!end) break;
    w = end + 1;
  }
  return 0;
}

static int is_count(const char *v) {
  if (!*v || strlen(v) > 10) return 0;
  for (const char *c = v; *c; c++)
    if (*c < '0' || *c > '9') return 0;
  return strtoll(v, NULL, 10) <= 2147483647LL;
}

static void say(mm_env_warn_fn warn, void *ctx, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void say(mm_env_warn_fn warn, void *ctx, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  warn(ctx, msg);
}

static int check_entry(const char *entry, mm_env_warn_fn warn, void *ctx) {
  const char *eq = strchr(entry, '=');
  if (strncmp(entry, "MEGAMOE_", 8) || !eq) return 0;
  char name[MM_SPELLING_MAX + 1]; /* a longer name is cut (and near no knob) */
  const size_t len = (size_t)(eq - entry);
  memcpy(name, entry, len < MM_SPELLING_MAX ? len : MM_SPELLING_MAX);
  name[len < MM_SPELLING_MAX ? len : MM_SPELLING_MAX] = '\0';
  const char *v = eq + 1;
  const env_knob *near = NULL;
  int near_d = 3; /* at most two edits */
  for (size_t i = 0; i < NUM_KNOBS; i++) {
    const env_knob *k = &g_knobs[i];
    if (len <= MM_SPELLING_MAX && !strcmp(name, k->name)) {
      if (k->values ? one_of(k->values, v) : is_count(v)) return 0;
      say(warn, ctx, "%s=%s is not one of its values (%s)", name, v,
          k->values ? k->values : "a count: 0, 1, 2, ...");
      return 1;
    }
    const int d = mm_osa_distance(name, k->name);
    if (d < near_d) near_d = d, near = k;
  }
  if (near) {
    say(warn, ctx, "%s is not a megamoe environment variable; did you mean %s?", name,
        near->name);
    return 1;
  }
  if (!strncmp(name, "MEGAMOE_SM90_", 13)) {
    say(warn, ctx, "%s%s is not a megamoe environment variable (docs/CONFIG.md lists them)", name,
        len > MM_SPELLING_MAX ? "..." : "");
    return 1;
  }
  return 0;
}

int mm_env_knobs_check(char *const *envp, mm_env_warn_fn warn, void *ctx) {
  int findings = 0;
  for (size_t i = 0; envp && envp[i]; i++) findings += check_entry(envp[i], warn, ctx);
  return findings;
}

int mm_env_knobs_check_process(mm_env_warn_fn warn, void *ctx) {
  return mm_env_knobs_check(environ, warn, ctx);
}

int mm_env_log_level(void) {
  static const char *const names[] = {"error", "warn", "info", "debug"};
  const char *v = getenv("MEGAMOE_LOG_LEVEL");
  for (int i = 0; v && i < 4; i++)
    if (!strcasecmp(v, names[i]) || (v[0] == '0' + i && !v[1])) return i;
  return -1;
}

/* test_env_knobs.c -- the plugin's environment variables (plugin/env_knobs.c):
 * which MEGAMOE_* entries are reported and how, MEGAMOE_LOG_LEVEL's values,
 * and that the table and docs/CONFIG.md name the same variables. */
#include <ctype.h>

#include "env_knobs.h"
#include "harness.h"

typedef struct {
  int n;
  char last[512];
} sink;

static void collect(void *ctx, const char *msg) {
  sink *s = ctx;
  s->n++;
  snprintf(s->last, sizeof s->last, "%s", msg);
}

/* Findings for one entry; its last message in s. */
static int check_one(const char *entry, sink *s) {
  char *envp[2] = {(char *)entry, NULL};
  memset(s, 0, sizeof *s);
  const int n = mm_env_knobs_check(envp, collect, s);
  if (n != s->n) printf("# %s: returned %d, %d messages\n", entry, n, s->n);
  return n;
}

static void test_values_taken_pass(void) {
  static const char *const ok[] = {
      "MEGAMOE_LOG_LEVEL=debug", "MEGAMOE_LOG_LEVEL=WARN", "MEGAMOE_LOG_LEVEL=0",
      "MEGAMOE_EP_TRANSPORT=ipc", "MEGAMOE_EP_TRANSPORT=NCCL", "MEGAMOE_NCCL_BLOCKING=1",
      "MEGAMOE_SM90_TOKEN_TILE=128+160", "MEGAMOE_SM90_TOKEN_TILE=16",
      "MEGAMOE_SM90_CTAS_PER_SM=2", "MEGAMOE_SM90_MIXED_TILES=0", "MEGAMOE_SM90_WIDE_FIRST=1",
      "MEGAMOE_SM90_GRID=0", "MEGAMOE_SM90_GRID=2147483647", "MEGAMOE_SM90_PREFILL=1",
      /* not the plugin's: the hosts' and the tests' own, and others */
      "MEGAMOE_PLUGIN_PATH=/usr/lib", "MEGAMOE_TEST_QUICK=1", "MEGAMOE_BUILDDIR=.", "PATH=/bin",
      "MEGAMOE_SM90", "NO_EQUALS_SIGN", "MEGAMOE_=1"};
  sink s;
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
    CHECK_MSG(check_one(ok[i], &s) == 0, "%s: %s", ok[i], s.last);
}

static void test_findings(void) {
  static const struct {
    const char *entry, *says;
  } bad[] = {
      {"MEGAMOE_LOG_LEVEL=verbose", "MEGAMOE_LOG_LEVEL=verbose is not one of its values"},
      {"MEGAMOE_LOG_LEVEL=4", "(error warn info debug 0 1 2 3)"},
      {"MEGAMOE_LOG_LEVEL=", "MEGAMOE_LOG_LEVEL= is not one of its values"},
      {"MEGAMOE_SM90_TOKEN_TILE=48", "(16 32 64 128 160 128+160 64+128 32+128)"},
      {"MEGAMOE_SM90_TOKEN_TILE=160+128", "not one of its values"},
      {"MEGAMOE_SM90_CTAS_PER_SM=3", "(1 2)"},
      {"MEGAMOE_SM90_GRID=-1", "(a count: 0, 1, 2, ...)"},
      {"MEGAMOE_SM90_GRID=2147483648", "a count"},
      {"MEGAMOE_SM90_GRID=8x", "a count"},
      {"MEGAMOE_NCCL_BLOCKING=yes", "(0 1)"},
      {"MEGAMOE_EP_TRANSPORT=tcp", "(auto ipc nccl)"},
      {"MEGAMOE_SM90_TOKEN_TILES=32", "did you mean MEGAMOE_SM90_TOKEN_TILE?"},
      {"MEGAMOE_SM90_PERFILL=1", "did you mean MEGAMOE_SM90_PREFILL?"},
      {"MEGAMOE_LOGLEVEL=debug", "did you mean MEGAMOE_LOG_LEVEL?"},
      {"MEGAMOE_EP_TRANSPROT=ipc", "did you mean MEGAMOE_EP_TRANSPORT?"},
      {"MEGAMOE_SM90_BN=64", "MEGAMOE_SM90_BN is not a megamoe environment variable (docs"},
  };
  sink s;
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    CHECK_MSG(check_one(bad[i].entry, &s) == 1, "%s: %d findings", bad[i].entry, s.n);
    CHECK_MSG(strstr(s.last, bad[i].says) != NULL, "%s: '%s' lacks '%s'", bad[i].entry, s.last,
              bad[i].says);
  }
  /* a name past the spelling cap: cut in the message, still reported */
  char longname[400];
  memset(longname, 'X', sizeof longname);
  memcpy(longname, "MEGAMOE_SM90_", 13);
  strcpy(longname + 300, "=1");
  CHECK_EQ_INT(check_one(longname, &s), 1);
  CHECK(strstr(s.last, "XXX... is not a megamoe environment variable") != NULL);
  char *envp[] = {"MEGAMOE_SM90_GRID=2", "MEGAMOE_SM90_GRID=x", "MEGAMOE_SM90_X=1", "HOME=/", NULL};
  memset(&s, 0, sizeof s);
  CHECK_EQ_INT(mm_env_knobs_check(envp, collect, &s), 2);
  CHECK_EQ_INT(mm_env_knobs_check(NULL, collect, &s), 0);
}

static void test_log_level(void) {
  static const struct {
    const char *v;
    int level;
  } cases[] = {{"error", 0}, {"warn", 1}, {"Info", 2}, {"DEBUG", 3}, {"0", 0}, {"3", 3},
               {"4", -1},    {"-1", -1},  {"", -1},    {"debugx", -1}, {"03", -1}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    setenv("MEGAMOE_LOG_LEVEL", cases[i].v, 1);
    CHECK_MSG(mm_env_log_level() == cases[i].level, "'%s' -> %d", cases[i].v, mm_env_log_level());
  }
  unsetenv("MEGAMOE_LOG_LEVEL");
  CHECK_EQ_INT(mm_env_log_level(), -1);
}

/* The table and docs/CONFIG.md give the same MEGAMOE_* settings, each as
 * `NAME=...` (the hosts' and the tests' own are not listed there). */
static void test_documented(void) {
  const char *src = getenv("MEGAMOE_SRCDIR");
  char path[4096];
  snprintf(path, sizeof path, "%s/docs/CONFIG.md", src ? src : "..");
  FILE *f = fopen(path, "rb");
  CHECK_MSG(f != NULL, "cannot open %s", path);
  if (!f) return;
  static char doc[1 << 20];
  const size_t n = fread(doc, 1, sizeof doc - 1, f);
  fclose(f);
  doc[n] = '\0';
  int knobs = 0;
  for (int i = 0; mm_env_knob_name(i); i++, knobs++) {
    char word[160];
    snprintf(word, sizeof word, "`%s=", mm_env_knob_name(i));
    CHECK_MSG(strstr(doc, word) != NULL, "CONFIG.md does not document %s as `NAME=...`",
              mm_env_knob_name(i));
  }
  CHECK(knobs >= 9);
  /* every `MEGAMOE_NAME=...` the document gives as a setting is a knob */
  for (const char *p = strstr(doc, "`MEGAMOE_"); p; p = strstr(p + 1, "`MEGAMOE_")) {
    char name[160];
    size_t k = 0;
    while (k + 1 < sizeof name && (isupper((unsigned char)p[k + 1]) ||
                                   isdigit((unsigned char)p[k + 1]) || p[k + 1] == '_'))
      name[k] = p[k + 1], k++;
    name[k] = '\0';
    if (p[k + 1] != '=') continue; /* a name in prose, not a setting */
    int known = 0;
    for (int i = 0; mm_env_knob_name(i); i++) known |= !strcmp(name, mm_env_knob_name(i));
    CHECK_MSG(known, "CONFIG.md sets %s, which is not in plugin/env_knobs.c's table", name);
  }
}

int main(void) {
  RUN(test_values_taken_pass);
  RUN(test_findings);
  RUN(test_log_level);
  RUN(test_documented);
  return mm_test_done();
}

/* fuzz_config.c -- libFuzzer target for the configuration loader
 * (plugin/config.c): YAML text, an optional model.config-json document and
 * "key=value" overrides, all from the input:
 *
 *   <YAML> [ "\n#%json\n" <config.json text> ] [ "\n#%set\n" <KEY=VALUE lines> ]
 *
 * ("#%" lines are YAML comments, so seeds stay valid YAML.) The JSON part is
 * written to a scratch file that an added override model.config-json names.
 * Properties checked beyond "no crash, no leak, no UB":
 *   - an error has a code in [1, 16] and a non-empty message;
 *   - on error the output struct is untouched (config.h promises it);
 *   - a loaded config survives mm_config_format -> mm_config_load -> format
 *     unchanged (the formatted YAML is a fixed point). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"

#define FZ_FAIL(...)                                  \
  do {                                                \
    fprintf(stderr, "fuzz_config: " __VA_ARGS__);     \
    fputc('\n', stderr);                              \
    abort();                                          \
  } while (0)

static char g_json_path[256];

static void remove_json(void) { unlink(g_json_path); }

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  const char *tmp = getenv("TMPDIR");
  snprintf(g_json_path, sizeof g_json_path, "%s/megamoe-fuzz-config-%d.json",
           tmp && *tmp ? tmp : "/tmp", (int)getpid());
  atexit(remove_json);
  return 0;
}

static void check_error(megamoe_error *e, const char *what) {
  if (!e) return;
  if (e->code <= MEGAMOE_CODE_OK || e->code >= MEGAMOE_CODE_COUNT_ || !e->message ||
      !e->message[0])
    FZ_FAIL("%s: malformed error (code %d)", what, (int)e->code);
}

static const char *find_marker(const char *s, size_t n, const char *m) {
  size_t ml = strlen(m);
  for (size_t i = 0; i + ml <= n; i++)
    if (memcmp(s + i, m, ml) == 0) return s + i;
  return NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > (1u << 20)) return 0;
  char *text = malloc(size + 1);
  if (!text) return 0;
  memcpy(text, data, size);
  text[size] = '\0';
  size_t yaml_len = size;
  const char *json = NULL, *sets = NULL;
  size_t json_len = 0, sets_len = 0;
  const char *mj = find_marker(text, size, "\n#%json\n");
  const char *ms = find_marker(text, size, "\n#%set\n");
  if (mj && ms && ms < mj) mj = NULL; /* json part only before the overrides */
  if (mj) {
    yaml_len = (size_t)(mj - text);
    json = mj + 8;
    json_len = (size_t)((ms ? ms : text + size) - json);
  }
  if (ms) {
    if (!mj) yaml_len = (size_t)(ms - text);
    sets = ms + 7;
    sets_len = (size_t)(text + size - sets);
  }

  /* Overrides: one KEY=VALUE per line, at most 16. */
  mm_config_override ov[17];
  size_t nov = 0;
  char *set_copy = NULL;
  if (sets) {
    set_copy = malloc(sets_len + 1);
    if (!set_copy) goto out;
    memcpy(set_copy, sets, sets_len);
    set_copy[sets_len] = '\0';
    char *line = set_copy;
    while (line && *line && nov < 16) {
      char *nl = strchr(line, '\n');
      if (nl) *nl = '\0';
      char *eq = strchr(line, '=');
      if (eq) {
        *eq = '\0';
        ov[nov].key = line;
        ov[nov].value = eq + 1;
        nov++;
      }
      line = nl ? nl + 1 : NULL;
    }
  }
  if (json) {
    FILE *f = fopen(g_json_path, "wb");
    if (!f) goto out;
    fwrite(json, 1, json_len, f);
    fclose(f);
    ov[nov].key = "model.config-json";
    ov[nov].value = g_json_path;
    nov++;
  }

  mm_config cfg, before;
  memset(&cfg, 0x5A, sizeof cfg);
  memcpy(&before, &cfg, sizeof cfg);
  /* len 0 means NUL-terminated: keep an empty document explicit. */
  char *yaml = malloc(yaml_len + 1);
  if (!yaml) goto out;
  memcpy(yaml, text, yaml_len);
  yaml[yaml_len] = '\0';
  megamoe_error *e = mm_config_load(NULL, yaml, yaml_len, "fuzz.yaml", nov ? ov : NULL, nov, &cfg);
  free(yaml);
  check_error(e, "load");
  if (e) {
    if (memcmp(&cfg, &before, sizeof cfg) != 0) FZ_FAIL("output changed by a failed load");
    megamoe_error_destroy(e);
    goto out;
  }
  /* Round trip through the formatter. */
  size_t need = mm_config_format(&cfg, NULL, 0);
  char *a = malloc(need + 1), *b = NULL;
  if (!a) goto out;
  if (mm_config_format(&cfg, a, need + 1) != need) FZ_FAIL("format length changed");
  mm_config again;
  e = mm_config_load(NULL, a, need, "formatted.yaml", NULL, 0, &again);
  check_error(e, "reload");
  if (e) FZ_FAIL("formatted config does not load back: %s\n---\n%s---", e->message, a);
  size_t need2 = mm_config_format(&again, NULL, 0);
  b = malloc(need2 + 1);
  if (!b) {
    free(a);
    goto out;
  }
  mm_config_format(&again, b, need2 + 1);
  if (need2 != need || strcmp(a, b) != 0) FZ_FAIL("format is not a fixed point:\n%s---\n%s---", a, b);
  free(a);
  free(b);
out:
  free(set_copy);
  free(text);
  return 0;
}

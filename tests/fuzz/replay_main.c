/* replay_main.c -- a main() for a libFuzzer target without libFuzzer: runs
 * every file of the target's committed corpus (seeds and the reproducers of
 * fixed crashes) once and prints TAP, so `make check` (and its sanitizer
 * build) replays them with any compiler. A failing input aborts the program
 * inside the target, which the TAP driver reports with the file's name.
 *   replay_<target> [FILE|DIR]...   (default: $MEGAMOE_SRCDIR/tests/fuzz/corpus/<target>) */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#ifndef MM_FUZZ_TARGET
#error "define MM_FUZZ_TARGET (the corpus folder name)"
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

static int g_count;

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    printf("not ok %d - %s: cannot open\n", ++g_count, path);
    return 1;
  }
  size_t cap = 1 << 16, n = 0;
  uint8_t *buf = malloc(cap);
  for (;;) {
    if (!buf) {
      fclose(f);
      return 1;
    }
    n += fread(buf + n, 1, cap - n, f);
    if (n < cap) break;
    cap *= 2;
    buf = realloc(buf, cap);
  }
  fclose(f);
  printf("# %s (%zu bytes)\n", path, n);
  fflush(stdout);
  /* A copy of exactly n bytes, so reads past the input are caught. */
  uint8_t *exact = malloc(n ? n : 1);
  memcpy(exact, buf, n);
  free(buf);
  LLVMFuzzerTestOneInput(exact, n);
  free(exact);
  const char *base = strrchr(path, '/');
  printf("ok %d - %s\n", ++g_count, base ? base + 1 : path);
  fflush(stdout);
  return 0;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static int run_path(const char *path) {
  struct stat st;
  if (stat(path, &st) != 0) {
    printf("not ok %d - %s: missing\n", ++g_count, path);
    return 1;
  }
  if (!S_ISDIR(st.st_mode)) return run_file(path);
  DIR *d = opendir(path);
  if (!d) return 1;
  char **names = NULL;
  size_t n = 0;
  for (struct dirent *e; (e = readdir(d));) {
    if (e->d_name[0] == '.') continue;
    names = realloc(names, (n + 1) * sizeof *names);
    names[n] = malloc(strlen(path) + strlen(e->d_name) + 2);
    sprintf(names[n], "%s/%s", path, e->d_name);
    n++;
  }
  closedir(d);
  if (n) qsort(names, n, sizeof *names, cmp_str); /* stable order across runs */
  int bad = 0;
  for (size_t i = 0; i < n; i++) {
    bad |= run_file(names[i]);
    free(names[i]);
  }
  free(names);
  return bad;
}

int main(int argc, char **argv) {
  if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
  int bad = 0;
  if (argc > 1) {
    for (int i = 1; i < argc; i++) bad |= run_path(argv[i]);
  } else {
    const char *src = getenv("MEGAMOE_SRCDIR");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/tests/fuzz/corpus/%s", src ? src : ".", MM_FUZZ_TARGET);
    bad |= run_path(dir);
  }
  printf("1..%d\n", g_count);
  return bad;
}

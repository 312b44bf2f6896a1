/* prep_golden.h -- reading the golden vectors (../shared/golden, env
 * MEGAMOE_GOLDEN_DIR) for the weight-preparation tests, through the
 * project's safetensors reader. Header-only, test code. */
#ifndef MM_PREP_GOLDEN_H
#define MM_PREP_GOLDEN_H

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

/* The golden dir, or NULL (with the reason printed) when it is missing. */
static inline const char *golden_dir(void) {
  const char *d = getenv("MEGAMOE_GOLDEN_DIR");
  DIR *h = d ? opendir(d) : NULL;
  if (!h) return NULL;
  closedir(h);
  return d;
}

static inline mm_st_file *golden_open(const char *name) {
  char p[1024];
  snprintf(p, sizeof p, "%s/%s", golden_dir(), name);
  mm_st_file *f = NULL;
  mm_err *e = mm_st_open(p, &f);
  if (e) {
    printf("# %s: %s\n", p, e->message);
    mm_error_free(e);
    return NULL;
  }
  return f;
}

/* Reads tensor `name` whole (malloc'd); *t gets its description. NULL and a
 * message when absent. */
static inline void *golden_read(mm_st_file *f, const char *name, const mm_st_tensor **t) {
  const mm_st_tensor *x = mm_st_find(f, name);
  if (!x) {
    printf("# golden %s: no tensor %s\n", mm_st_path(f), name);
    return NULL;
  }
  void *d = malloc(x->nbytes + 1);
  mm_err *e = mm_st_read(f, x, d, x->nbytes);
  if (e) {
    printf("# golden %s: %s\n", name, e->message);
    mm_error_free(e);
    free(d);
    return NULL;
  }
  if (t) *t = x;
  return d;
}

/* A view of golden tensor data (for the weight loader). */
static inline mm_tensor_view golden_view(const char *name, const mm_st_tensor *t, const void *data) {
  mm_tensor_view v;
  memset(&v, 0, sizeof v);
  v.name = name;
  v.dtype = mm_st_to_mm_dtype(t->dtype);
  v.ndim = t->ndim;
  for (int i = 0; i < t->ndim && i < 4; i++) v.shape[i] = t->shape[i];
  v.data = data;
  return v;
}

/* Prints the TAP line of a skipped case (the golden dir is missing). */
#define RUN_GOLDEN(fn)                                                                     \
  do {                                                                                     \
    if (golden_dir()) RUN(fn);                                                             \
    else                                                                                   \
      printf("ok %d - %s # SKIP golden dir %s missing\n", ++mm_test_count_, #fn,            \
             getenv("MEGAMOE_GOLDEN_DIR") ? getenv("MEGAMOE_GOLDEN_DIR") : "(unset)");     \
  } while (0)

static const char *const kGoldenRequantFiles[] = {
    "nvfp4_small.safetensors", "nvfp4_glm_w13_slice.safetensors",
    "nvfp4_glm_w2_slice.safetensors", "nvfp4_exotic_scales.safetensors",
    "ue8m0_g16.safetensors"};
static const char *const kGoldenSm100Files[] = {
    "sm100_g32.safetensors", "sm100_g16.safetensors", "sm100_g32_wide.safetensors"};

#endif

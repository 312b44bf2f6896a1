/* status.c -- allocation and formatting of error objects. */
#include "status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  megamoe_error base;
  char text[]; /* message storage */
} mm_err_heap;

static void heap_destroy(megamoe_error *e) { free(e); }
static void static_destroy(megamoe_error *e) { (void)e; }

static megamoe_error oom_error = {
    MEGAMOE_ERROR_STRUCT_SIZE, NULL, MEGAMOE_CODE_RESOURCE_EXHAUSTED,
    "out of host memory while reporting an error", static_destroy};

static mm_err *make(megamoe_code code, const char *msg, size_t len) {
  mm_err_heap *h = malloc(sizeof(*h) + len + 1);
  if (!h) return &oom_error;
  h->base.struct_size = MEGAMOE_ERROR_STRUCT_SIZE;
  h->base.extension = NULL;
  h->base.code = code;
  h->base.destroy = heap_destroy;
  memcpy(h->text, msg, len);
  h->text[len] = '\0';
  h->base.message = h->text;
  return &h->base;
}

mm_err *mm_verror(megamoe_code code, const char *fmt, va_list ap) {
  char buf[1024];
  int n = vsnprintf(buf, sizeof buf, fmt, ap);
  if (n < 0) n = 0;
  if ((size_t)n >= sizeof buf) n = (int)sizeof buf - 1;
  return make(code, buf, (size_t)n);
}

mm_err *mm_error(megamoe_code code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  mm_err *e = mm_verror(code, fmt, ap);
  va_end(ap);
  return e;
}

mm_err *mm_error_wrap(mm_err *err, const char *fmt, ...) {
  if (!err) return NULL;
  char prefix[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  if (n < 0) return err;
  if ((size_t)n >= sizeof prefix) n = (int)sizeof prefix - 1;
  size_t mlen = strlen(megamoe_error_message(err));
  size_t len = (size_t)n + 2 + mlen;
  char *tmp = malloc(len + 1);
  if (!tmp) return err;
  snprintf(tmp, len + 1, "%s: %s", prefix, megamoe_error_message(err));
  mm_err *wrapped = make(err->code, tmp, strlen(tmp));
  free(tmp);
  if (wrapped == &oom_error) return err;
  megamoe_error_destroy(err);
  return wrapped;
}

void mm_error_free(mm_err *err) { megamoe_error_destroy(err); }

const char *mm_code_name(megamoe_code code) {
  switch (code) {
#define MM_CODE_NAME_(name, value) \
  case MEGAMOE_CODE_##name:        \
    return #name;
    MEGAMOE_CODE_MAP(MM_CODE_NAME_)
#undef MM_CODE_NAME_
    default:
      return "UNKNOWN_CODE";
  }
}

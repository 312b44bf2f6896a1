/* status.h -- error objects used inside the plugin and its tools.
 *
 * Internally a status is the ABI's `megamoe_error *` (NULL = OK), so errors
 * cross the boundary without translation. Messages are built printf-style and
 * grow a context prefix as they propagate ("layer 3: experts.7.up_proj: ..."). */
#ifndef MM_STATUS_H
#define MM_STATUS_H

#include <stdarg.h>

#include "megamoe_plugin.h"

typedef megamoe_error mm_err;

/* New error with a formatted message. Never returns NULL: on allocation
 * failure it returns a static RESOURCE_EXHAUSTED object. */
mm_err *mm_error(megamoe_code code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
mm_err *mm_verror(megamoe_code code, const char *fmt, va_list ap);

/* Prepends "<context>: " to err's message; returns err (NULL stays NULL). */
mm_err *mm_error_wrap(mm_err *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

void mm_error_free(mm_err *err);
const char *mm_code_name(megamoe_code code); /* "INVALID_ARGUMENT" */

#define MM_TRY(expr)                 \
  do {                               \
    mm_err *mm_try_err_ = (expr);    \
    if (mm_try_err_) return mm_try_err_; \
  } while (0)

/* For functions that own resources: `err` set, jump to `label`. */
#define MM_TRY_GOTO(expr, err, label) \
  do {                                \
    (err) = (expr);                   \
    if (err) goto label;              \
  } while (0)

#define MM_ARG_CHECK(cond, ...) \
  do {                          \
    if (!(cond)) return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, __VA_ARGS__); \
  } while (0)

#endif

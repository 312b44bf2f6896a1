/* json.h -- a small strict JSON (RFC 8259) parser producing a read-only DOM.
 *
 * Strict means: no comments, no trailing commas, no BOM, no leading zeros,
 * no NaN/Infinity, no raw control characters in strings, no lone surrogates,
 * strings must be valid UTF-8 and duplicate object keys are an error.
 * Objects keep their members in document order; objects with many members
 * get a hash index so lookups stay O(1) (a safetensors header can hold
 * ~100k keys). The whole tree lives in one arena freed by mm_json_free.
 *
 * Errors are INVALID_ARGUMENT with "line L col C (byte B): what" (columns
 * count bytes, 1-based). */
#ifndef MM_JSON_H
#define MM_JSON_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef enum {
  MM_JSON_NULL = 0,
  MM_JSON_FALSE,
  MM_JSON_TRUE,
  MM_JSON_NUMBER,
  MM_JSON_STRING,
  MM_JSON_ARRAY,
  MM_JSON_OBJECT
} mm_json_type;

typedef struct mm_json mm_json;    /* one value; owned by its document */
typedef struct mm_json_doc mm_json_doc;

typedef struct {
  size_t max_bytes;  /* input larger than this is rejected (0 = default 256 MiB) */
  int max_depth;     /* nesting of arrays/objects (0 = default 256) */
} mm_json_limits;

/* Parses text[0, len) (need not be NUL-terminated). limits may be NULL.
 * On success *out owns the tree; free it with mm_json_free. */
mm_err *mm_json_parse(const char *text, size_t len, const mm_json_limits *limits,
                      mm_json_doc **out);
void mm_json_free(mm_json_doc *doc); /* NULL is fine */
const mm_json *mm_json_root(const mm_json_doc *doc);

/* Queries. All accept NULL and answer "nothing" (type NULL reported as
 * MM_JSON_NULL, sizes 0, lookups NULL) so chains need one check at the end. */
mm_json_type mm_json_type_of(const mm_json *v);
const char *mm_json_type_name(mm_json_type t); /* "object", "string", ... */
static inline int mm_json_is(const mm_json *v, mm_json_type t) {
  return v && mm_json_type_of(v) == t;
}
size_t mm_json_offset(const mm_json *v); /* byte offset of the value in the input */

/* Arrays and objects: number of elements / members (0 for other types). */
size_t mm_json_size(const mm_json *v);
const mm_json *mm_json_at(const mm_json *array, size_t i);
/* Objects: lookup by key (NULL if absent or v is not an object). */
const mm_json *mm_json_get(const mm_json *object, const char *key);
const mm_json *mm_json_getn(const mm_json *object, const char *key, size_t key_len);
/* Objects: the i-th member in document order; key_len may be NULL. */
const char *mm_json_key_at(const mm_json *object, size_t i, size_t *key_len);
const mm_json *mm_json_value_at(const mm_json *object, size_t i);

/* Strings: decoded UTF-8, NUL-terminated; len (optional) counts bytes and
 * includes embedded NULs from \u0000. NULL if v is not a string. */
const char *mm_json_string(const mm_json *v, size_t *len);
/* Numbers: the nearest double (NaN if v is not a number; +-inf on overflow). */
double mm_json_number(const mm_json *v);
/* 1 and *out set when v is a number whose exact value is an integer that
 * fits int64 ("3", "3.0", "30e-1", "-0"), else 0. */
int mm_json_int64(const mm_json *v, int64_t *out);
/* 1 for true, 0 for false, -1 when v is not a boolean. */
int mm_json_bool(const mm_json *v);

/* 1 if s[0, n) is valid UTF-8 (RFC 3629: no overlongs, surrogates or
 * code points above U+10FFFF), else 0. */
int mm_json_utf8_valid(const char *s, size_t n);

#endif

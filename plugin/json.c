/* json.c -- strict recursive-descent JSON parser into an arena DOM. */
#include "json.h"

#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdalign.h>
#include <stdlib.h>
#include <string.h>

#define MM_JSON_DEFAULT_MAX_BYTES ((size_t)256 << 20)
#define MM_JSON_DEFAULT_MAX_DEPTH 256
/* Objects with more members than this get a hash index. */
#define MM_JSON_INDEX_MIN 8

typedef struct {
  const char *key;
  size_t key_len;
  size_t key_off; /* byte offset of the key, for duplicate-key errors */
  mm_json *value;
} mm_json_member;

struct mm_json {
  mm_json_type type;
  int is_int;
  size_t offset;
  union {
    struct {
      double d;
      int64_t i;
    } num;
    struct {
      const char *s;
      size_t len;
    } str;
    struct {
      mm_json **items;
      size_t n;
    } arr;
    struct {
      mm_json_member *m;
      size_t n;
      uint32_t *index; /* open addressing: member index + 1, 0 = empty */
      size_t index_mask;
    } obj;
  } u;
};

/* ---- arena -------------------------------------------------------------- */

typedef struct mm_arena_block {
  struct mm_arena_block *next;
  size_t cap, used;
  alignas(max_align_t) unsigned char data[];
} mm_arena_block;

struct mm_json_doc {
  mm_arena_block *blocks;
  mm_json *root;
};

static void *arena_alloc(mm_json_doc *doc, size_t size) {
  size = (size + 15) & ~(size_t)15;
  mm_arena_block *b = doc->blocks;
  if (!b || b->cap - b->used < size) {
    /* Blocks double (64 KiB .. 16 MiB) so a large header needs few mallocs. */
    size_t cap = b ? b->cap * 2 : ((size_t)64 << 10);
    if (cap > ((size_t)16 << 20)) cap = (size_t)16 << 20;
    if (cap < size) cap = size;
    mm_arena_block *nb = malloc(sizeof(*nb) + cap);
    if (!nb) return NULL;
    nb->cap = cap;
    nb->used = 0;
    nb->next = b;
    doc->blocks = nb;
    b = nb;
  }
  void *p = b->data + b->used;
  b->used += size;
  return p;
}

void mm_json_free(mm_json_doc *doc) {
  if (!doc) return;
  mm_arena_block *b = doc->blocks;
  while (b) {
    mm_arena_block *next = b->next;
    free(b);
    b = next;
  }
  free(doc);
}

const mm_json *mm_json_root(const mm_json_doc *doc) { return doc ? doc->root : NULL; }

/* ---- parser ------------------------------------------------------------- */

typedef struct {
  const unsigned char *begin, *p, *end;
  int depth, max_depth;
  mm_json_doc *doc;
  mm_json_member *stk; /* children of the open containers */
  size_t top, cap;
  mm_err *err;
} mm_json_parser;

static mm_err *fail_at(mm_json_parser *ps, size_t off, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static mm_err *fail_at(mm_json_parser *ps, size_t off, const char *fmt, ...) {
  if (ps->err) return ps->err;
  size_t line = 1, col = 1;
  for (size_t i = 0; i < off && ps->begin + i < ps->end; i++) {
    if (ps->begin[i] == '\n') {
      line++;
      col = 1;
    } else {
      col++;
    }
  }
  char what[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  ps->err = mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "json: line %zu col %zu (byte %zu): %s",
                     line, col, off, what);
  return ps->err;
}

#define HERE(ps) ((size_t)((ps)->p - (ps)->begin))
#define FAIL(ps, ...) fail_at((ps), HERE(ps), __VA_ARGS__)

static mm_err *oom(mm_json_parser *ps) {
  if (!ps->err)
    ps->err = mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "json: out of memory at byte %zu",
                       HERE(ps));
  return ps->err;
}

static void skip_ws(mm_json_parser *ps) {
  while (ps->p < ps->end &&
         (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
    ps->p++;
}

static const char *describe(mm_json_parser *ps, char *tmp, size_t n) {
  if (ps->p >= ps->end) return "end of input";
  unsigned c = *ps->p;
  if (c >= 0x20 && c < 0x7F) snprintf(tmp, n, "'%c'", (char)c);
  else snprintf(tmp, n, "byte 0x%02X", c);
  return tmp;
}

static mm_json *new_node(mm_json_parser *ps, mm_json_type t, size_t off) {
  mm_json *v = arena_alloc(ps->doc, sizeof(*v));
  if (!v) {
    oom(ps);
    return NULL;
  }
  memset(v, 0, sizeof(*v));
  v->type = t;
  v->offset = off;
  return v;
}

static int push(mm_json_parser *ps, const char *key, size_t key_len, size_t key_off,
                mm_json *value) {
  if (ps->top == ps->cap) {
    size_t cap = ps->cap ? ps->cap * 2 : 64;
    mm_json_member *s = realloc(ps->stk, cap * sizeof(*s));
    if (!s) {
      oom(ps);
      return 0;
    }
    ps->stk = s;
    ps->cap = cap;
  }
  ps->stk[ps->top++] = (mm_json_member){key, key_len, key_off, value};
  return 1;
}

/* Length of the valid UTF-8 sequence at p (1..4), 0 if invalid. */
static int utf8_len(const unsigned char *p, const unsigned char *end) {
  unsigned c = p[0];
  size_t avail = (size_t)(end - p);
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return avail >= 2 && (p[1] & 0xC0) == 0x80 ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (avail < 3) return 0;
    unsigned lo = 0x80, hi = 0xBF;
    if (c == 0xE0) lo = 0xA0;       /* overlong */
    if (c == 0xED) hi = 0x9F;       /* UTF-16 surrogates */
    if (p[1] < lo || p[1] > hi || (p[2] & 0xC0) != 0x80) return 0;
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (avail < 4) return 0;
    unsigned lo = 0x80, hi = 0xBF;
    if (c == 0xF0) lo = 0x90;       /* overlong */
    if (c == 0xF4) hi = 0x8F;       /* > U+10FFFF */
    if (p[1] < lo || p[1] > hi || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80) return 0;
    return 4;
  }
  return 0;
}

static int hex4(const unsigned char *p, unsigned *out) {
  unsigned v = 0;
  for (int i = 0; i < 4; i++) {
    unsigned c = p[i], d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return 0;
    v = v * 16 + d;
  }
  *out = v;
  return 1;
}

/* Parses a string at ps->p (on the opening quote); the decoded bytes are
 * copied into the arena. */
static int parse_string(mm_json_parser *ps, const char **out, size_t *out_len) {
  ps->p++; /* opening quote */
  const unsigned char *start = ps->p;
  int escaped = 0;
  /* First pass: validate and find the end. */
  while (1) {
    if (ps->p >= ps->end) {
      FAIL(ps, "unterminated string");
      return 0;
    }
    unsigned c = *ps->p;
    if (c == '"') break;
    if (c < 0x20) {
      FAIL(ps, "control character 0x%02X in string (must be escaped)", c);
      return 0;
    }
    if (c == '\\') {
      escaped = 1;
      if (ps->p + 1 >= ps->end) {
        FAIL(ps, "unterminated string");
        return 0;
      }
      unsigned e = ps->p[1];
      if (e == 'u') {
        unsigned cp;
        if (ps->end - ps->p < 6 || !hex4(ps->p + 2, &cp)) {
          FAIL(ps, "bad \\u escape (needs 4 hex digits)");
          return 0;
        }
        if (cp >= 0xDC00 && cp <= 0xDFFF) {
          FAIL(ps, "lone low surrogate \\u%04X", cp);
          return 0;
        }
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          unsigned lo;
          if (ps->end - ps->p < 12 || ps->p[6] != '\\' || ps->p[7] != 'u' ||
              !hex4(ps->p + 8, &lo) || lo < 0xDC00 || lo > 0xDFFF) {
            FAIL(ps, "high surrogate \\u%04X not followed by a low surrogate", cp);
            return 0;
          }
          ps->p += 12;
        } else {
          ps->p += 6;
        }
        continue;
      }
      if (!strchr("\"\\/bfnrt", (int)e) || e == 0) {
        FAIL(ps, "invalid escape \\%c", e >= 0x20 && e < 0x7F ? (char)e : '?');
        return 0;
      }
      ps->p += 2;
      continue;
    }
    int n = utf8_len(ps->p, ps->end);
    if (!n) {
      FAIL(ps, "invalid UTF-8 in string (byte 0x%02X)", c);
      return 0;
    }
    ps->p += n;
  }
  const unsigned char *stop = ps->p;
  ps->p++; /* closing quote */
  size_t raw = (size_t)(stop - start);
  char *dst = arena_alloc(ps->doc, raw + 1);
  if (!dst) {
    oom(ps);
    return 0;
  }
  if (!escaped) {
    memcpy(dst, start, raw);
    dst[raw] = '\0';
    *out = dst;
    *out_len = raw;
    return 1;
  }
  /* Second pass: decode (already validated; output is never longer). */
  size_t n = 0;
  for (const unsigned char *q = start; q < stop;) {
    if (*q != '\\') {
      dst[n++] = (char)*q++;
      continue;
    }
    unsigned e = q[1];
    if (e != 'u') {
      static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
      dst[n++] = to[strchr(from, (int)e) - from];
      q += 2;
      continue;
    }
    unsigned cp, lo;
    hex4(q + 2, &cp);
    q += 6;
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      hex4(q + 2, &lo);
      q += 6;
      cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    if (cp < 0x80) {
      dst[n++] = (char)cp;
    } else if (cp < 0x800) {
      dst[n++] = (char)(0xC0 | (cp >> 6));
      dst[n++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      dst[n++] = (char)(0xE0 | (cp >> 12));
      dst[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
      dst[n++] = (char)(0x80 | (cp & 0x3F));
    } else {
      dst[n++] = (char)(0xF0 | (cp >> 18));
      dst[n++] = (char)(0x80 | ((cp >> 12) & 0x3F));
      dst[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
      dst[n++] = (char)(0x80 | (cp & 0x3F));
    }
  }
  dst[n] = '\0';
  *out = dst;
  *out_len = n;
  return 1;
}

static locale_t c_locale;
static pthread_once_t c_locale_once = PTHREAD_ONCE_INIT;
static void c_locale_init(void) { c_locale = newlocale(LC_ALL_MASK, "C", (locale_t)0); }

/* strtod in the "C" locale whatever the host program set. */
static double c_strtod(const char *s) {
  pthread_once(&c_locale_once, c_locale_init);
  if (c_locale) return strtod_l(s, NULL, c_locale);
  return strtod(s, NULL);
}

static int is_digit(unsigned c) { return c >= '0' && c <= '9'; }

/* Exact integer value of digits[0,n) * 10^exp10 with sign, if it is an
 * integer that fits int64. */
static int exact_int(const unsigned char *ip, size_t ni, const unsigned char *fp, size_t nf,
                     long exp10, int neg, int64_t *out) {
  /* Digits are ip (integer part) then fp (fraction); exp10 applies to all
   * of them after the fraction shift. */
  long e = exp10 - (long)nf;
  /* drop trailing zeros */
  size_t total = ni + nf;
#define DIGIT(k) ((k) < ni ? ip[(k)] : fp[(k) - ni])
  while (total > 0 && DIGIT(total - 1) == '0') {
    total--;
    e++;
  }
  size_t first = 0;
  while (first < total && DIGIT(first) == '0') first++;
  if (first == total) {
    *out = 0;
    return 1;
  }
  if (e < 0) return 0;
  if ((long)(total - first) + e > 19) return 0;
  uint64_t v = 0;
  for (size_t k = first; k < total; k++) v = v * 10 + (uint64_t)(DIGIT(k) - '0');
#undef DIGIT
  for (long k = 0; k < e; k++) {
    if (v > UINT64_MAX / 10) return 0;
    v *= 10;
  }
  if (neg) {
    if (v > (uint64_t)INT64_MAX + 1) return 0;
    *out = v == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v;
  } else {
    if (v > (uint64_t)INT64_MAX) return 0;
    *out = (int64_t)v;
  }
  return 1;
}

static mm_json *parse_number(mm_json_parser *ps) {
  size_t off = HERE(ps);
  const unsigned char *s = ps->p;
  int neg = 0;
  if (ps->p < ps->end && *ps->p == '-') {
    neg = 1;
    ps->p++;
  }
  if (ps->p >= ps->end || !is_digit(*ps->p)) {
    FAIL(ps, "expected a digit");
    return NULL;
  }
  const unsigned char *ip = ps->p;
  if (*ps->p == '0') {
    ps->p++;
    if (ps->p < ps->end && is_digit(*ps->p)) {
      FAIL(ps, "leading zero in number");
      return NULL;
    }
  } else {
    while (ps->p < ps->end && is_digit(*ps->p)) ps->p++;
  }
  size_t ni = (size_t)(ps->p - ip);
  const unsigned char *fp = ps->p;
  size_t nf = 0;
  if (ps->p < ps->end && *ps->p == '.') {
    ps->p++;
    fp = ps->p;
    while (ps->p < ps->end && is_digit(*ps->p)) ps->p++;
    nf = (size_t)(ps->p - fp);
    if (!nf) {
      FAIL(ps, "expected a digit after '.'");
      return NULL;
    }
  }
  long exp10 = 0;
  if (ps->p < ps->end && (*ps->p == 'e' || *ps->p == 'E')) {
    ps->p++;
    int eneg = 0;
    if (ps->p < ps->end && (*ps->p == '+' || *ps->p == '-')) eneg = *ps->p++ == '-';
    if (ps->p >= ps->end || !is_digit(*ps->p)) {
      FAIL(ps, "expected a digit in exponent");
      return NULL;
    }
    while (ps->p < ps->end && is_digit(*ps->p)) {
      if (exp10 < 100000000) exp10 = exp10 * 10 + (*ps->p - '0');
      ps->p++;
    }
    if (eneg) exp10 = -exp10;
  }
  mm_json *v = new_node(ps, MM_JSON_NUMBER, off);
  if (!v) return NULL;
  size_t len = (size_t)(ps->p - s);
  char small[128];
  char *tmp = len < sizeof small ? small : malloc(len + 1);
  if (!tmp) {
    oom(ps);
    return NULL;
  }
  memcpy(tmp, s, len);
  tmp[len] = '\0';
  v->u.num.d = c_strtod(tmp);
  if (tmp != small) free(tmp);
  v->is_int = exact_int(ip, ni, fp, nf, exp10, neg, &v->u.num.i);
  return v;
}

static int expect_literal(mm_json_parser *ps, const char *lit) {
  size_t n = strlen(lit);
  if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, lit, n) != 0) {
    FAIL(ps, "invalid literal (expected '%s')", lit);
    return 0;
  }
  ps->p += n;
  return 1;
}

static uint64_t hash_key(const char *k, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)k[i]) * 1099511628211ull;
  return h ^ (h >> 29);
}

/* Builds the hash index of a large object, rejecting duplicate keys. */
static int index_object(mm_json_parser *ps, mm_json *obj) {
  size_t n = obj->u.obj.n;
  mm_json_member *m = obj->u.obj.m;
  if (n <= MM_JSON_INDEX_MIN) {
    for (size_t i = 1; i < n; i++)
      for (size_t j = 0; j < i; j++)
        if (m[i].key_len == m[j].key_len && memcmp(m[i].key, m[j].key, m[i].key_len) == 0) {
          fail_at(ps, m[i].key_off, "duplicate key \"%.*s\"", (int)(m[i].key_len > 200 ? 200 : m[i].key_len), m[i].key);
          return 0;
        }
    return 1;
  }
  if (n >= UINT32_MAX / 4) {
    fail_at(ps, obj->offset, "object has too many members");
    return 0;
  }
  size_t cap = 16;
  while (cap < n * 2) cap *= 2;
  uint32_t *idx = arena_alloc(ps->doc, cap * sizeof(uint32_t));
  if (!idx) {
    oom(ps);
    return 0;
  }
  memset(idx, 0, cap * sizeof(uint32_t));
  size_t mask = cap - 1;
  for (size_t i = 0; i < n; i++) {
    size_t h = (size_t)hash_key(m[i].key, m[i].key_len) & mask;
    while (idx[h]) {
      const mm_json_member *o = &m[idx[h] - 1];
      if (o->key_len == m[i].key_len && memcmp(o->key, m[i].key, o->key_len) == 0) {
        fail_at(ps, m[i].key_off, "duplicate key \"%.*s\"", (int)(m[i].key_len > 200 ? 200 : m[i].key_len), m[i].key);
        return 0;
      }
      h = (h + 1) & mask;
    }
    idx[h] = (uint32_t)(i + 1);
  }
  obj->u.obj.index = idx;
  obj->u.obj.index_mask = mask;
  return 1;
}

static mm_json *parse_value(mm_json_parser *ps);

static mm_json *parse_container(mm_json_parser *ps, int is_object) {
  size_t off = HERE(ps);
  char close = is_object ? '}' : ']';
  if (++ps->depth > ps->max_depth) {
    FAIL(ps, "nesting deeper than %d", ps->max_depth);
    return NULL;
  }
  ps->p++;
  size_t base = ps->top;
  skip_ws(ps);
  if (ps->p < ps->end && *ps->p == close) {
    ps->p++;
  } else {
    while (1) {
      const char *key = NULL;
      size_t key_len = 0, key_off = 0;
      char tmp[16];
      if (is_object) {
        if (ps->p >= ps->end || *ps->p != '"') {
          FAIL(ps, "expected a string key, found %s", describe(ps, tmp, sizeof tmp));
          return NULL;
        }
        key_off = HERE(ps);
        if (!parse_string(ps, &key, &key_len)) return NULL;
        skip_ws(ps);
        if (ps->p >= ps->end || *ps->p != ':') {
          FAIL(ps, "expected ':' after object key, found %s", describe(ps, tmp, sizeof tmp));
          return NULL;
        }
        ps->p++;
        skip_ws(ps);
      }
      mm_json *child = parse_value(ps);
      if (!child || !push(ps, key, key_len, key_off, child)) return NULL;
      skip_ws(ps);
      if (ps->p < ps->end && *ps->p == ',') {
        ps->p++;
        skip_ws(ps);
        continue;
      }
      if (ps->p < ps->end && *ps->p == close) {
        ps->p++;
        break;
      }
      FAIL(ps, "expected ',' or '%c', found %s", close, describe(ps, tmp, sizeof tmp));
      return NULL;
    }
  }
  ps->depth--;
  mm_json *v = new_node(ps, is_object ? MM_JSON_OBJECT : MM_JSON_ARRAY, off);
  if (!v) return NULL;
  size_t n = ps->top - base;
  if (is_object) {
    mm_json_member *m = n ? arena_alloc(ps->doc, n * sizeof(*m)) : NULL;
    if (n && !m) {
      oom(ps);
      return NULL;
    }
    if (n) memcpy(m, ps->stk + base, n * sizeof(*m));
    v->u.obj.m = m;
    v->u.obj.n = n;
    if (!index_object(ps, v)) return NULL;
  } else {
    mm_json **items = n ? arena_alloc(ps->doc, n * sizeof(*items)) : NULL;
    if (n && !items) {
      oom(ps);
      return NULL;
    }
    for (size_t i = 0; i < n; i++) items[i] = ps->stk[base + i].value;
    v->u.arr.items = items;
    v->u.arr.n = n;
  }
  ps->top = base;
  return v;
}

static mm_json *parse_value(mm_json_parser *ps) {
  char tmp[16];
  if (ps->p >= ps->end) {
    FAIL(ps, "expected a value, found end of input");
    return NULL;
  }
  size_t off = HERE(ps);
  switch (*ps->p) {
    case '{':
      return parse_container(ps, 1);
    case '[':
      return parse_container(ps, 0);
    case '"': {
      mm_json *v = new_node(ps, MM_JSON_STRING, off);
      if (!v || !parse_string(ps, &v->u.str.s, &v->u.str.len)) return NULL;
      return v;
    }
    case 't':
      return expect_literal(ps, "true") ? new_node(ps, MM_JSON_TRUE, off) : NULL;
    case 'f':
      return expect_literal(ps, "false") ? new_node(ps, MM_JSON_FALSE, off) : NULL;
    case 'n':
      return expect_literal(ps, "null") ? new_node(ps, MM_JSON_NULL, off) : NULL;
    default:
      if (*ps->p == '-' || is_digit(*ps->p)) return parse_number(ps);
      FAIL(ps, "expected a value, found %s", describe(ps, tmp, sizeof tmp));
      return NULL;
  }
}

mm_err *mm_json_parse(const char *text, size_t len, const mm_json_limits *limits,
                      mm_json_doc **out) {
  MM_ARG_CHECK(out, "json: out is NULL");
  *out = NULL;
  MM_ARG_CHECK(text || len == 0, "json: text is NULL");
  size_t max_bytes = limits && limits->max_bytes ? limits->max_bytes : MM_JSON_DEFAULT_MAX_BYTES;
  int max_depth = limits && limits->max_depth > 0 ? limits->max_depth : MM_JSON_DEFAULT_MAX_DEPTH;
  if (len > max_bytes)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "json: input of %zu bytes exceeds the limit of %zu",
                    len, max_bytes);
  mm_json_parser ps = {0};
  ps.begin = ps.p = (const unsigned char *)(text ? text : "");
  ps.end = ps.begin + len;
  ps.max_depth = max_depth;
  ps.doc = calloc(1, sizeof(*ps.doc));
  if (!ps.doc) return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "json: out of memory");
  skip_ws(&ps);
  mm_json *root = parse_value(&ps);
  if (root) {
    skip_ws(&ps);
    if (ps.p != ps.end) {
      char tmp[16];
      FAIL(&ps, "unexpected %s after the top-level value", describe(&ps, tmp, sizeof tmp));
    }
  }
  free(ps.stk);
  if (ps.err) {
    mm_json_free(ps.doc);
    return ps.err;
  }
  ps.doc->root = root;
  *out = ps.doc;
  return NULL;
}

/* ---- queries ------------------------------------------------------------ */

mm_json_type mm_json_type_of(const mm_json *v) { return v ? v->type : MM_JSON_NULL; }

const char *mm_json_type_name(mm_json_type t) {
  switch (t) {
    case MM_JSON_NULL: return "null";
    case MM_JSON_FALSE: return "false";
    case MM_JSON_TRUE: return "true";
    case MM_JSON_NUMBER: return "number";
    case MM_JSON_STRING: return "string";
    case MM_JSON_ARRAY: return "array";
    case MM_JSON_OBJECT: return "object";
  }
  return "unknown";
}

size_t mm_json_offset(const mm_json *v) { return v ? v->offset : 0; }

size_t mm_json_size(const mm_json *v) {
  if (!v) return 0;
  if (v->type == MM_JSON_ARRAY) return v->u.arr.n;
  if (v->type == MM_JSON_OBJECT) return v->u.obj.n;
  return 0;
}

const mm_json *mm_json_at(const mm_json *a, size_t i) {
  if (!a || a->type != MM_JSON_ARRAY || i >= a->u.arr.n) return NULL;
  return a->u.arr.items[i];
}

const mm_json *mm_json_getn(const mm_json *o, const char *key, size_t n) {
  if (!o || o->type != MM_JSON_OBJECT || !key) return NULL;
  const mm_json_member *m = o->u.obj.m;
  if (o->u.obj.index) {
    size_t mask = o->u.obj.index_mask;
    size_t h = (size_t)hash_key(key, n) & mask;
    for (uint32_t k; (k = o->u.obj.index[h]) != 0; h = (h + 1) & mask)
      if (m[k - 1].key_len == n && memcmp(m[k - 1].key, key, n) == 0) return m[k - 1].value;
    return NULL;
  }
  for (size_t i = 0; i < o->u.obj.n; i++)
    if (m[i].key_len == n && memcmp(m[i].key, key, n) == 0) return m[i].value;
  return NULL;
}

const mm_json *mm_json_get(const mm_json *o, const char *key) {
  return key ? mm_json_getn(o, key, strlen(key)) : NULL;
}

const char *mm_json_key_at(const mm_json *o, size_t i, size_t *key_len) {
  if (!o || o->type != MM_JSON_OBJECT || i >= o->u.obj.n) return NULL;
  if (key_len) *key_len = o->u.obj.m[i].key_len;
  return o->u.obj.m[i].key;
}

const mm_json *mm_json_value_at(const mm_json *o, size_t i) {
  if (!o || o->type != MM_JSON_OBJECT || i >= o->u.obj.n) return NULL;
  return o->u.obj.m[i].value;
}

const char *mm_json_string(const mm_json *v, size_t *len) {
  if (!v || v->type != MM_JSON_STRING) return NULL;
  if (len) *len = v->u.str.len;
  return v->u.str.s;
}

double mm_json_number(const mm_json *v) {
  if (!v || v->type != MM_JSON_NUMBER) return NAN;
  return v->u.num.d;
}

int mm_json_int64(const mm_json *v, int64_t *out) {
  if (!v || v->type != MM_JSON_NUMBER || !v->is_int) return 0;
  if (out) *out = v->u.num.i;
  return 1;
}

int mm_json_bool(const mm_json *v) {
  if (!v) return -1;
  if (v->type == MM_JSON_TRUE) return 1;
  if (v->type == MM_JSON_FALSE) return 0;
  return -1;
}

int mm_json_utf8_valid(const char *s, size_t n) {
  const unsigned char *p = (const unsigned char *)s, *end = p + n;
  while (p < end) {
    int k = utf8_len(p, end);
    if (!k) return 0;
    p += k;
  }
  return 1;
}

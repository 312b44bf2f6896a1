/* test_safetensors.c -- strict JSON, the safetensors reader against the
 * writer, the golden files, hostile files, and sharded checkpoints. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "formats.h"
#include "harness.h"
#include "json.h"
#include "safetensors.h"

static char g_tmp[256];

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void path_in(char *buf, size_t n, const char *name) { snprintf(buf, n, "%s/%s", g_tmp, name); }


static megamoe_code code_of(mm_err *e) {
  megamoe_code c = megamoe_error_code(e);
  mm_error_free(e);
  return c;
}

/* ---- JSON ------------------------------------------------------------------ */

static mm_err *parse_str(const char *s, mm_json_doc **doc) { return mm_json_parse(s, strlen(s), NULL, doc); }

static int json_ok(const char *s) {
  mm_json_doc *doc = NULL;
  mm_err *e = parse_str(s, &doc);
  mm_json_free(doc);
  if (e) {
    mm_error_free(e);
    return 0;
  }
  return 1;
}

static void test_json_basic(void) {
  mm_json_doc *doc = NULL;
  const char *text = " {\"z\": [1, 2.5, true, false, null, \"s\"],\n \"a\": {\"inner\": {}}, \"m\": []} ";
  CHECK_OK(parse_str(text, &doc));
  const mm_json *r = mm_json_root(doc);
  CHECK(mm_json_is(r, MM_JSON_OBJECT));
  CHECK_EQ_INT(mm_json_size(r), 3);
  /* document order kept */
  CHECK(strcmp(mm_json_key_at(r, 0, NULL), "z") == 0);
  CHECK(strcmp(mm_json_key_at(r, 1, NULL), "a") == 0);
  CHECK(strcmp(mm_json_key_at(r, 2, NULL), "m") == 0);
  const mm_json *z = mm_json_get(r, "z");
  CHECK_EQ_INT(mm_json_size(z), 6);
  int64_t i;
  CHECK(mm_json_int64(mm_json_at(z, 0), &i) && i == 1);
  CHECK(mm_json_number(mm_json_at(z, 1)) == 2.5);
  CHECK(!mm_json_int64(mm_json_at(z, 1), &i));
  CHECK_EQ_INT(mm_json_bool(mm_json_at(z, 2)), 1);
  CHECK_EQ_INT(mm_json_bool(mm_json_at(z, 3)), 0);
  CHECK_EQ_INT(mm_json_bool(mm_json_at(z, 4)), -1);
  CHECK(mm_json_is(mm_json_at(z, 4), MM_JSON_NULL));
  CHECK(strcmp(mm_json_string(mm_json_at(z, 5), NULL), "s") == 0);
  CHECK(mm_json_at(z, 6) == NULL);
  CHECK(mm_json_is(mm_json_get(mm_json_get(r, "a"), "inner"), MM_JSON_OBJECT));
  CHECK(mm_json_get(r, "missing") == NULL);
  CHECK(mm_json_get(z, "z") == NULL); /* not an object */
  CHECK(mm_json_size(mm_json_get(r, "m")) == 0);
  CHECK_EQ_INT(mm_json_offset(z), 7);
  mm_json_free(doc);
  /* scalars at the root are valid JSON */
  CHECK(json_ok("3"));
  CHECK(json_ok("\"x\""));
  CHECK(json_ok(" null "));
}

static void test_json_strings(void) {
  mm_json_doc *doc = NULL;
  const char *text = "[\"a\\\"b\\\\c\\/d\\b\\f\\n\\r\\t\", \"\\u00e9\\u20AC\", \"\\ud83d\\ude00\", \"x\\u0000y\", \"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"]";
  CHECK_OK(parse_str(text, &doc));
  const mm_json *r = mm_json_root(doc);
  size_t len;
  CHECK(strcmp(mm_json_string(mm_json_at(r, 0), NULL), "a\"b\\c/d\b\f\n\r\t") == 0);
  CHECK(strcmp(mm_json_string(mm_json_at(r, 1), NULL), "\xc3\xa9\xe2\x82\xac") == 0);
  CHECK(strcmp(mm_json_string(mm_json_at(r, 2), NULL), "\xf0\x9f\x98\x80") == 0);
  const char *s = mm_json_string(mm_json_at(r, 3), &len);
  CHECK(len == 3 && memcmp(s, "x\0y", 3) == 0);
  CHECK(strcmp(mm_json_string(mm_json_at(r, 4), NULL), "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80") == 0);
  mm_json_free(doc);
  static const char *bad[] = {
      "\"\\ud83d\"",          /* lone high surrogate */
      "\"\\ude00\"",          /* lone low surrogate */
      "\"\\ud83d\\u0041\"",   /* high + non-low */
      "\"\\x\"",              /* bad escape */
      "\"\\u12g4\"",          /* bad hex */
      "\"\\u12\"",            /* short */
      "\"a\nb\"",             /* raw control char */
      "\"\xc0\x80\"",         /* overlong NUL */
      "\"\xe0\x80\xaf\"",     /* overlong */
      "\"\xed\xa0\x80\"",     /* encoded surrogate */
      "\"\xf4\x90\x80\x80\"", /* > U+10FFFF */
      "\"\xf5\x80\x80\x80\"", /* invalid lead */
      "\"\x80\"",             /* stray continuation */
      "\"\xc3\"",             /* truncated sequence */
      "\"abc",                /* unterminated */
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) CHECK_MSG(!json_ok(bad[i]), "accepted bad string #%zu", i);
  CHECK(mm_json_utf8_valid("\xc3\xa9", 2));
  CHECK(!mm_json_utf8_valid("\xc3", 1));
  CHECK(!mm_json_utf8_valid("\xed\xbf\xbf", 3));
}

static void test_json_numbers(void) {
  static const struct {
    const char *text;
    int is_int;
    int64_t i;
    double d;
  } cases[] = {
      {"0", 1, 0, 0.0},
      {"-0", 1, 0, -0.0},
      {"17", 1, 17, 17.0},
      {"-17", 1, -17, -17.0},
      {"1e3", 1, 1000, 1000.0},
      {"1E+3", 1, 1000, 1000.0},
      {"1.0", 1, 1, 1.0},
      {"30e-1", 1, 3, 3.0},
      {"1.5", 0, 0, 1.5},
      {"0.001e3", 1, 1, 1.0},
      {"1e-3", 0, 0, 0.001},
      {"9223372036854775807", 1, INT64_MAX, 9223372036854775807.0},
      {"-9223372036854775808", 1, INT64_MIN, -9223372036854775808.0},
      {"9223372036854775808", 0, 0, 9223372036854775808.0},
      {"12345678901234567890", 0, 0, 12345678901234567890.0},
      {"4503599627370496.5", 0, 0, 4503599627370496.0},
      {"1e400", 0, 0, INFINITY},
      {"1e-400", 0, 0, 0.0},
      {"0.000000000000000000000000000000000000000000001e45", 1, 1, 1.0},
      {"1e99999999999999999999", 0, 0, INFINITY},
  };
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    mm_json_doc *doc = NULL;
    CHECK_OK(parse_str(cases[c].text, &doc));
    const mm_json *v = mm_json_root(doc);
    int64_t i = 12345;
    int is = mm_json_int64(v, &i);
    CHECK_MSG(is == cases[c].is_int && (!is || i == cases[c].i), "%s: int %d %lld", cases[c].text, is, (long long)i);
    CHECK_MSG(mm_json_number(v) == cases[c].d, "%s: %.17g", cases[c].text, mm_json_number(v));
    mm_json_free(doc);
  }
  static const char *bad[] = {"01", "-01", "1.", ".5", "-", "+1", "1e", "1e+", "NaN", "Infinity",
                              "-Infinity", "0x10", "1.e3", "--1", "1_000"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) CHECK_MSG(!json_ok(bad[i]), "accepted %s", bad[i]);
  CHECK(isnan(mm_json_number(NULL)));
}

static void test_json_errors(void) {
  static const char *bad[] = {
      "",           "   ",         "{",          "[1,]",        "{\"a\":1,}", "{\"a\" 1}",
      "{a:1}",      "{'a':1}",     "[1] x",      "[1][2]",      "\xef\xbb\xbf[1]", "// c\n[1]",
      "[1 2]",      "{\"a\":1 \"b\":2}", "tru",  "nul",         "[\x01]",     "{\"a\":1,\"a\":2}",
      "[\"a\"\0]",
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) CHECK_MSG(!json_ok(bad[i]), "accepted bad #%zu", i);
  /* duplicate key in a large (hash-indexed) object */
  char big[2048];
  size_t n = 0;
  n += (size_t)snprintf(big + n, sizeof big - n, "{");
  for (int k = 0; k < 40; k++) n += (size_t)snprintf(big + n, sizeof big - n, "\"k%d\":%d,", k, k);
  snprintf(big + n, sizeof big - n, "\"k17\":0}");
  mm_json_doc *doc = NULL;
  mm_err *e = parse_str(big, &doc);
  CHECK(e && e->code == MEGAMOE_CODE_INVALID_ARGUMENT && strstr(e->message, "duplicate key \"k17\""));
  mm_error_free(e);
  /* error position: line and column */
  e = parse_str("{\n  \"a\": 1,\n  \"b\": x\n}", &doc);
  CHECK_MSG(e && strstr(e->message, "line 3 col 8"), "%s", e ? e->message : "(ok)");
  mm_error_free(e);
  /* input size cap */
  mm_json_limits lim = {9, 0};
  CHECK_ERR(mm_json_parse("[1,2,3,45]", 10, &lim, &doc), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_OK(mm_json_parse("[1,2,3,4]", 9, &lim, &doc));
  mm_json_free(doc);
  /* not NUL-terminated input: only len bytes are read */
  CHECK_OK(mm_json_parse("[1]garbage", 3, NULL, &doc));
  mm_json_free(doc);
}

static void test_json_depth(void) {
  for (int depth = 5000; depth <= 1000000; depth *= 200) {
    char *s = malloc((size_t)depth * 2 + 1);
    memset(s, '[', (size_t)depth);
    memset(s + depth, ']', (size_t)depth);
    s[2 * depth] = 0;
    mm_json_doc *doc = NULL;
    double t0 = now_s();
    CHECK_ERR(mm_json_parse(s, 2 * (size_t)depth, NULL, &doc), MEGAMOE_CODE_INVALID_ARGUMENT);
    double dt = now_s() - t0;
    /* Rejected at the depth cap, not after scanning: well under a second
     * even under ASan on a loaded 2-core machine (0.13 s seen there). */
    CHECK_MSG(dt < 1.0, "depth %d rejected in %.3f s", depth, dt);
    free(s);
  }
  /* within the limit it parses */
  char s[512];
  memset(s, '[', 200);
  memset(s + 200, ']', 200);
  s[400] = 0;
  CHECK(json_ok(s));
  mm_json_limits lim = {0, 3};
  mm_json_doc *doc = NULL;
  CHECK_OK(mm_json_parse("[[[1]]]", 7, &lim, &doc));
  mm_json_free(doc);
  CHECK_ERR(mm_json_parse("[[[[1]]]]", 9, &lim, &doc), MEGAMOE_CODE_INVALID_ARGUMENT);
}

static void test_json_large_object(void) {
  const int n = 100000;
  size_t cap = (size_t)n * 40;
  char *s = malloc(cap);
  size_t len = 0;
  s[len++] = '{';
  for (int k = 0; k < n; k++) len += (size_t)snprintf(s + len, cap - len, "%s\"layer.%d.w\":[%d]", k ? "," : "", k, k);
  s[len++] = '}';
  mm_json_doc *doc = NULL;
  double t0 = now_s();
  CHECK_OK(mm_json_parse(s, len, NULL, &doc));
  const mm_json *r = mm_json_root(doc);
  CHECK_EQ_INT(mm_json_size(r), n);
  int bad = 0;
  for (int k = 0; k < n; k++) {
    char key[32];
    snprintf(key, sizeof key, "layer.%d.w", k);
    int64_t v;
    if (!mm_json_int64(mm_json_at(mm_json_get(r, key), 0), &v) || v != k) bad++;
  }
  CHECK_EQ_INT(bad, 0);
  CHECK(mm_json_get(r, "layer.100000.w") == NULL);
  printf("# 100k-key object parsed and looked up in %.3f s\n", now_s() - t0);
  mm_json_free(doc);
  free(s);
}

/* ---- writer -> reader round trip ------------------------------------------- */

static void random_shape(mm_st_dtype dt, int *ndim, int64_t *shape, uint64_t *nbytes) {
  for (;;) {
    *ndim = (int)(mm_test_rand_u64() % 5);
    uint64_t nel = 1;
    for (int d = 0; d < *ndim; d++) {
      shape[d] = (int64_t)(mm_test_rand_u64() % 9);
      if (mm_test_rand_u64() % 8 == 0) shape[d] = (int64_t)(mm_test_rand_u64() % 300);
      nel *= (uint64_t)shape[d];
    }
    int ok;
    *nbytes = mm_st_nbytes(dt, nel, &ok);
    if (ok) return;
  }
}

static void test_roundtrip(void) {
  char path[512];
  path_in(path, sizeof path, "rt.safetensors");
  for (int round = 0; round < 4; round++) {
    enum { NT = 60 };
    mm_st_writer *w = NULL;
    CHECK_OK(mm_st_writer_new(&w));
    char names[NT][64];
    mm_st_dtype dts[NT];
    int nds[NT];
    int64_t shapes[NT][MM_ST_MAX_DIMS];
    unsigned char *data[NT];
    uint64_t nb[NT];
    for (int i = 0; i < NT; i++) {
      dts[i] = (mm_st_dtype)(1 + mm_test_rand_u64() % (MM_ST_DTYPE_COUNT_ - 1));
      random_shape(dts[i], &nds[i], shapes[i], &nb[i]);
      /* names with characters the header must escape */
      snprintf(names[i], sizeof names[i], "%s.%d.%s", i % 3 ? "model.layers" : "q\"uo\\te\n", i,
               i % 5 ? "weight" : "\xc3\xa9t\xc3\xa9");
      data[i] = malloc(nb[i] ? nb[i] : 1);
      for (uint64_t b = 0; b < nb[i]; b++) data[i][b] = (unsigned char)mm_test_rand_u64();
      CHECK_OK(mm_st_writer_add(w, names[i], dts[i], nds[i], shapes[i], data[i], nb[i]));
    }
    CHECK_OK(mm_st_writer_set_metadata(w, "format", "pt"));
    CHECK_OK(mm_st_writer_set_metadata(w, "note", "line1\nline2 \"quoted\" \\ \xe2\x82\xac"));
    CHECK_OK(mm_st_writer_set_metadata(w, "format", "pt2")); /* replaces */
    CHECK_EQ_INT(mm_st_writer_count(w), NT);
    CHECK_OK(mm_st_writer_write(w, path));
    mm_st_writer_free(w);

    /* header length keeps the data section 8-byte aligned */
    FILE *fp = fopen(path, "rb");
    unsigned char lb[8] = {0};
    CHECK(fp && fread(lb, 1, 8, fp) == 8);
    if (fp) fclose(fp);
    uint64_t hl = 0;
    for (int b = 7; b >= 0; b--) hl = (hl << 8) | lb[b];
    CHECK_EQ_INT(hl % 8, 0);

    mm_st_file *f = NULL;
    CHECK_OK(mm_st_open(path, &f));
    if (!f) return;
    CHECK_EQ_INT(mm_st_count(f), NT);
    CHECK(strcmp(mm_st_metadata(f, "format"), "pt2") == 0);
    CHECK(strcmp(mm_st_metadata(f, "note"), "line1\nline2 \"quoted\" \\ \xe2\x82\xac") == 0);
    CHECK_EQ_INT(mm_st_metadata_count(f), 2);
    CHECK(strcmp(mm_st_metadata_key_at(f, 1), "note") == 0);
    CHECK(mm_st_metadata(f, "nope") == NULL);
    for (int i = 0; i < NT; i++) {
      const mm_st_tensor *t = mm_st_find(f, names[i]);
      CHECK_MSG(t != NULL, "missing %s", names[i]);
      if (!t) continue;
      CHECK(t == mm_st_tensor_at(f, (size_t)i)); /* header order = declaration order */
      CHECK(t->dtype == dts[i]);
      CHECK_EQ_INT(t->ndim, nds[i]);
      for (int d = 0; d < nds[i]; d++) CHECK_EQ_INT(t->shape[d], shapes[i][d]);
      CHECK_EQ_INT(t->nbytes, nb[i]);
      unsigned char *got = malloc(nb[i] + 8);
      memset(got, 0xA5, nb[i] + 8);
      CHECK_OK(mm_st_read(f, t, got, nb[i] + 8));
      CHECK(memcmp(got, data[i], nb[i]) == 0);
      CHECK(got[nb[i]] == 0xA5); /* nothing past the tensor */
      if (nb[i] >= 3) {
        memset(got, 0, nb[i]);
        CHECK_OK(mm_st_read_range(f, t, 1, got, (size_t)nb[i] - 2));
        CHECK(memcmp(got, data[i] + 1, nb[i] - 2) == 0);
        CHECK_ERR(mm_st_read_range(f, t, 1, got, (size_t)nb[i]), MEGAMOE_CODE_INVALID_ARGUMENT);
        CHECK_ERR(mm_st_read(f, t, got, (size_t)nb[i] - 1), MEGAMOE_CODE_INVALID_ARGUMENT);
      }
      free(got);
      free(data[i]);
    }
    CHECK(mm_st_find(f, "model.layers.0.weight") == NULL);
    const mm_st_tensor *t = NULL;
    mm_err *e = mm_st_get(f, "no.such.tensor", &t);
    CHECK(e && e->code == MEGAMOE_CODE_NOT_FOUND && strstr(e->message, "no.such.tensor") && strstr(e->message, "rt.safetensors"));
    mm_error_free(e);
    mm_st_close(f);
  }
  /* an empty file (no tensors) is valid */
  mm_st_writer *w = NULL;
  CHECK_OK(mm_st_writer_new(&w));
  CHECK_OK(mm_st_writer_write(w, path));
  mm_st_writer_free(w);
  mm_st_file *f = NULL;
  CHECK_OK(mm_st_open(path, &f));
  CHECK_EQ_INT(mm_st_count(f), 0);
  CHECK(mm_st_find(f, "x") == NULL);
  mm_st_close(f);
}

static void test_many_tensors(void) {
  const int n = 100000;
  char path[512];
  path_in(path, sizeof path, "many.safetensors");
  mm_st_writer *w = NULL;
  CHECK_OK(mm_st_writer_new(&w));
  float *vals = malloc(sizeof(float) * (size_t)n);
  double t0 = now_s();
  for (int i = 0; i < n && w; i++) {
    char name[64];
    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.w.input_scale", i / 256, i % 256);
    vals[i] = (float)i * 0.5f;
    CHECK_OK(mm_st_writer_add(w, name, MM_ST_F32, 0, NULL, &vals[i], 4));
  }
  CHECK_OK(mm_st_writer_write(w, path));
  mm_st_writer_free(w);
  double t1 = now_s();
  mm_st_file *f = NULL;
  CHECK_OK(mm_st_open(path, &f));
  double t2 = now_s();
  CHECK_EQ_INT(mm_st_count(f), n);
  int bad = 0;
  for (int i = 0; i < n && f; i += 1 + (i % 7)) {
    char name[64];
    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.w.input_scale", i / 256, i % 256);
    const mm_st_tensor *t = mm_st_find(f, name);
    float v = -1;
    if (!t || t->ndim != 0 || t->nelems != 1) {
      bad++;
      continue;
    }
    mm_err *e = mm_st_read(f, t, &v, sizeof v);
    if (e || v != vals[i]) bad++;
    mm_error_free(e);
  }
  CHECK_EQ_INT(bad, 0);
  printf("# 100k tensors: write %.3f s, open %.3f s, lookups+reads %.3f s\n", t1 - t0, t2 - t1, now_s() - t2);
  mm_st_close(f);
  free(vals);
  unlink(path);
}

static int count_tmp_files(void) {
  DIR *d = opendir(g_tmp);
  int n = 0;
  struct dirent *e;
  while (d && (e = readdir(d)) != NULL) n += strstr(e->d_name, ".tmp.") != NULL;
  if (d) closedir(d);
  return n;
}

static void test_writer_streaming_and_errors(void) {
  char path[512];
  path_in(path, sizeof path, "stream.safetensors");
  unlink(path);
  mm_st_writer *w = NULL;
  CHECK_OK(mm_st_writer_new(&w));
  int64_t s1[2] = {3, 5}, s2[1] = {7};
  CHECK_OK(mm_st_writer_add(w, "a", MM_ST_BF16, 2, s1, NULL, 30));
  CHECK_OK(mm_st_writer_add(w, "b", MM_ST_U8, 1, s2, NULL, 7));
  CHECK_EQ_INT(mm_st_writer_data_size(w), 37);
  /* rejected declarations */
  CHECK_ERR(mm_st_writer_add(w, "a", MM_ST_U8, 1, s2, NULL, 7), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_st_writer_add(w, "c", MM_ST_U8, 1, s2, NULL, 8), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_st_writer_add(w, "__metadata__", MM_ST_U8, 1, s2, NULL, 7), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_st_writer_add(w, "bad\xff", MM_ST_U8, 1, s2, NULL, 7), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_st_writer_add(w, "f4", MM_ST_F4, 1, s2, NULL, 4), MEGAMOE_CODE_INVALID_ARGUMENT); /* 7 nibbles */
  int64_t neg[1] = {-1}, huge[3] = {INT64_MAX, INT64_MAX, 4};
  CHECK_ERR(mm_st_writer_add(w, "n", MM_ST_U8, 1, neg, NULL, 0), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_st_writer_add(w, "h", MM_ST_U8, 3, huge, NULL, 0), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_st_writer_add(w, "d", MM_ST_INVALID, 1, s2, NULL, 7), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_st_writer_write(w, path), MEGAMOE_CODE_INVALID_ARGUMENT); /* no data */
  CHECK_OK(mm_st_writer_begin(w, path));
  CHECK_ERR(mm_st_writer_add(w, "late", MM_ST_U8, 1, s2, NULL, 7), MEGAMOE_CODE_INVALID_ARGUMENT);
  unsigned char bytes[37];
  for (int i = 0; i < 37; i++) bytes[i] = (unsigned char)(i * 7 + 1);
  /* odd chunking across the tensor boundary */
  CHECK_OK(mm_st_writer_append(w, bytes, 1));
  CHECK_OK(mm_st_writer_append(w, bytes + 1, 0));
  CHECK_OK(mm_st_writer_append(w, bytes + 1, 31));
  CHECK_EQ_INT(count_tmp_files(), 1);
  CHECK(access(path, F_OK) != 0); /* not visible before finish */
  CHECK_OK(mm_st_writer_append(w, bytes + 32, 5));
  CHECK_OK(mm_st_writer_finish(w));
  mm_st_writer_free(w);
  CHECK_EQ_INT(count_tmp_files(), 0);
  mm_st_file *f = NULL;
  CHECK_OK(mm_st_open(path, &f));
  unsigned char got[30];
  CHECK_OK(mm_st_read(f, mm_st_find(f, "a"), got, 30));
  CHECK(memcmp(got, bytes, 30) == 0);
  CHECK_OK(mm_st_read(f, mm_st_find(f, "b"), got, 7));
  CHECK(memcmp(got, bytes + 30, 7) == 0);
  mm_st_close(f);

  /* overrun, short finish and abandoned writes leave no temporary and keep the old file */
  CHECK_OK(mm_st_writer_new(&w));
  CHECK_OK(mm_st_writer_add(w, "x", MM_ST_U8, 1, s2, NULL, 7));
  CHECK_OK(mm_st_writer_begin(w, path));
  CHECK_ERR(mm_st_writer_append(w, bytes, 8), MEGAMOE_CODE_INVALID_ARGUMENT);
  CHECK_ERR(mm_st_writer_append(w, bytes, 1), MEGAMOE_CODE_INVALID_ARGUMENT); /* writer failed */
  mm_st_writer_free(w);
  CHECK_OK(mm_st_writer_new(&w));
  CHECK_OK(mm_st_writer_add(w, "x", MM_ST_U8, 1, s2, NULL, 7));
  CHECK_OK(mm_st_writer_begin(w, path));
  CHECK_OK(mm_st_writer_append(w, bytes, 6));
  CHECK_ERR(mm_st_writer_finish(w), MEGAMOE_CODE_INVALID_ARGUMENT);
  mm_st_writer_free(w);
  CHECK_OK(mm_st_writer_new(&w));
  CHECK_OK(mm_st_writer_add(w, "x", MM_ST_U8, 1, s2, NULL, 7));
  CHECK_OK(mm_st_writer_begin(w, path));
  mm_st_writer_free(w);
  CHECK_EQ_INT(count_tmp_files(), 0);
  CHECK_OK(mm_st_open(path, &f));
  CHECK(mm_st_find(f, "a") != NULL);
  mm_st_close(f);
  /* unwritable destination */
  CHECK_OK(mm_st_writer_new(&w));
  mm_err *e = mm_st_writer_write(w, "/nonexistent-dir/x.safetensors");
  CHECK(e && e->code == MEGAMOE_CODE_NOT_FOUND);
  mm_error_free(e);
  mm_st_writer_free(w);
}

static void test_dtype_map(void) {
  CHECK(mm_st_dtype_from_name("F8_E4M3", 7) == MM_ST_F8_E4M3);
  CHECK(mm_st_dtype_from_name("F8_E4M", 6) == MM_ST_INVALID);
  CHECK(mm_st_dtype_from_name("f32", 3) == MM_ST_INVALID);
  for (int d = 1; d < MM_ST_DTYPE_COUNT_; d++) {
    const char *nm = mm_st_dtype_name((mm_st_dtype)d);
    CHECK(mm_st_dtype_from_name(nm, strlen(nm)) == (mm_st_dtype)d);
    mm_dtype m = mm_st_to_mm_dtype((mm_st_dtype)d);
    if (m != MM_DT_INVALID) CHECK(mm_st_from_mm_dtype(m) == (mm_st_dtype)d);
  }
  CHECK(mm_st_to_mm_dtype(MM_ST_U8) == MM_DT_U8);
  CHECK(mm_st_to_mm_dtype(MM_ST_F8_E4M3) == MM_DT_F8_E4M3);
  CHECK(mm_st_to_mm_dtype(MM_ST_F8_E8M0) == MM_DT_F8_E8M0);
  CHECK(mm_st_to_mm_dtype(MM_ST_F32) == MM_DT_F32);
  CHECK(mm_st_to_mm_dtype(MM_ST_BF16) == MM_DT_BF16);
  CHECK(mm_st_to_mm_dtype(MM_ST_I32) == MM_DT_I32);
  CHECK(mm_st_to_mm_dtype(MM_ST_F4) == MM_DT_F4_E2M1);
  CHECK(mm_st_to_mm_dtype(MM_ST_F16) == MM_DT_INVALID);
  CHECK_EQ_INT(mm_st_dtype_bits(MM_ST_F4), 4);
  CHECK_EQ_INT(mm_st_dtype_bits(MM_ST_F6_E2M3), 6);
  CHECK_EQ_INT(mm_st_dtype_bits(MM_ST_C64), 64);
  int ok;
  CHECK_EQ_INT(mm_st_nbytes(MM_ST_F4, 6, &ok), 3);
  CHECK(ok);
  mm_st_nbytes(MM_ST_F4, 5, &ok);
  CHECK(!ok);
  CHECK_EQ_INT(mm_st_nbytes(MM_ST_F6_E3M2, 4, &ok), 3);
  mm_st_nbytes(MM_ST_F64, UINT64_MAX / 8, &ok);
  CHECK(!ok);
}

/* ---- golden files ------------------------------------------------------------ */

static void check_shape(const mm_st_file *f, const char *name, mm_st_dtype dt, int ndim, int64_t d0, int64_t d1) {
  const mm_st_tensor *t = mm_st_find(f, name);
  CHECK_MSG(t != NULL, "%s: no %s", mm_st_path(f), name);
  if (!t) return;
  CHECK_MSG(t->dtype == dt && t->ndim == ndim && (ndim < 1 || t->shape[0] == d0) && (ndim < 2 || t->shape[1] == d1),
            "%s: %s is %s ndim %d", mm_st_path(f), name, mm_st_dtype_name(t->dtype), t->ndim);
}

static void *read_whole(const mm_st_file *f, const char *name) {
  const mm_st_tensor *t = mm_st_find(f, name);
  if (!t) return NULL;
  void *p = malloc(t->nbytes ? t->nbytes : 1);
  mm_err *e = mm_st_read(f, t, p, (size_t)t->nbytes);
  if (e) {
    printf("# %s\n", e->message);
    mm_error_free(e);
    free(p);
    return NULL;
  }
  return p;
}

static void golden_codecs(const mm_st_file *f) {
  check_shape(f, "e4m3.code", MM_ST_U8, 1, 256, 0);
  check_shape(f, "e4m3.value", MM_ST_F32, 1, 256, 0);
  uint8_t *code = read_whole(f, "e4m3.code");
  float *val = read_whole(f, "e4m3.value");
  CHECK(code && val);
  for (int i = 0; code && val && i < 256; i++) {
    float want = mm_e4m3_to_float(code[i]);
    CHECK_MSG(isnan(want) ? isnan(val[i]) : val[i] == want, "e4m3 %02x: %g vs %g", code[i], val[i], want);
  }
  free(code);
  free(val);
  code = read_whole(f, "e2m1.code");
  val = read_whole(f, "e2m1.value");
  CHECK(code && val);
  for (int i = 0; code && val && i < 16; i++) CHECK(val[i] == mm_e2m1_to_float(code[i]));
  free(code);
  free(val);
}

/* The README's dequant rule over the read bytes: exercises unaligned reads. */
static void golden_nvfp4(const mm_st_file *f, int64_t n, int64_t k) {
  check_shape(f, "src.weight", MM_ST_U8, 2, n, k / 2);
  check_shape(f, "src.weight_scale", MM_ST_F8_E4M3, 2, n, k / 16);
  check_shape(f, "src.weight_scale_2", MM_ST_F32, 0, 0, 0);
  check_shape(f, "dst.weight_scale", MM_ST_U8, 2, n, k / 32);
  uint8_t *w = read_whole(f, "src.weight"), *s = read_whole(f, "src.weight_scale");
  float *g = read_whole(f, "src.weight_scale_2"), *dq = read_whole(f, "src.dequant");
  CHECK(w && s && g && dq);
  int bad = 0;
  for (int64_t r = 0; w && s && g && dq && r < n; r++)
    for (int64_t c = 0; c < k; c++) {
      float v = mm_e2m1_to_float(mm_fp4_get(w + r * (k / 2), (size_t)c)) * mm_e4m3_to_float(s[r * (k / 16) + c / 16]);
      v = v * g[0];
      if (memcmp(&v, &dq[r * k + c], 4) != 0 && !(v == 0 && dq[r * k + c] == 0)) bad++;
    }
  CHECK_MSG(bad == 0, "%s: %d dequant mismatches", mm_st_path(f), bad);
  free(w);
  free(s);
  free(g);
  free(dq);
}

static void test_golden(void) {
  const char *dir = getenv("MEGAMOE_GOLDEN_DIR");
  DIR *d = opendir(dir); /* main checked it exists */
  CHECK(d != NULL);
  if (!d) return;
  struct dirent *e;
  int files = 0, tensors = 0, seen_small = 0;
  while ((e = readdir(d)) != NULL) {
    size_t l = strlen(e->d_name);
    if (l < 12 || strcmp(e->d_name + l - 12, ".safetensors") != 0) continue;
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    mm_st_file *f = NULL;
    CHECK_OK(mm_st_open(p, &f));
    if (!f) continue;
    files++;
    uint64_t total = 0, min_off = UINT64_MAX;
    for (size_t i = 0; i < mm_st_count(f); i++) {
      const mm_st_tensor *t = mm_st_tensor_at(f, i);
      void *buf = malloc(t->nbytes ? t->nbytes : 1);
      CHECK_OK(mm_st_read(f, t, buf, (size_t)t->nbytes));
      free(buf);
      total += t->nbytes;
      if (t->offset < min_off) min_off = t->offset;
      tensors++;
    }
    /* contiguous data section: header + tensors = file */
    CHECK_EQ_INT(min_off + total, mm_st_file_size(f));
    CHECK(mm_st_metadata(f, "kind") != NULL);
    if (!strcmp(e->d_name, "codecs.safetensors")) golden_codecs(f);
    if (!strcmp(e->d_name, "nvfp4_small.safetensors")) {
      seen_small = 1;
      golden_nvfp4(f, 64, 256);
      CHECK(strcmp(mm_st_metadata(f, "N"), "64") == 0);
    }
    if (!strcmp(e->d_name, "nvfp4_glm_w13_slice.safetensors")) golden_nvfp4(f, 64, 6144);
    if (!strcmp(e->d_name, "nvfp4_glm_w2_slice.safetensors")) golden_nvfp4(f, 128, 2048);
    if (!strcmp(e->d_name, "sm100_g32.safetensors")) {
      check_shape(f, "w13", MM_ST_U8, 3, 2, 384);
      check_shape(f, "sm100.s13", MM_ST_I32, 1, 3840, 0);
      CHECK(strcmp(mm_st_metadata(f, "s13_shape"), "[2, 384, 5]") == 0);
    }
    mm_st_close(f);
  }
  closedir(d);
  CHECK(files >= 5);
  CHECK(seen_small);
  printf("# golden: %d files, %d tensors read\n", files, tensors);
}

/* ---- hostile files ------------------------------------------------------------ */

/* Writes u64 hlen (the header's length unless forced), the header, then
 * `data` zero bytes. */
static void write_raw(const char *path, const char *hdr, uint64_t forced_len, int use_forced, size_t data) {
  FILE *fp = fopen(path, "wb");
  uint64_t hl = use_forced ? forced_len : strlen(hdr);
  unsigned char lb[8];
  for (int i = 0; i < 8; i++) lb[i] = (unsigned char)(hl >> (8 * i));
  fwrite(lb, 1, 8, fp);
  fwrite(hdr, 1, strlen(hdr), fp);
  for (size_t i = 0; i < data; i++) fputc(0, fp);
  fclose(fp);
}

static megamoe_code open_code(const char *path, int show) {
  mm_st_file *f = NULL;
  mm_err *e = mm_st_open(path, &f);
  if (show && e) printf("#   -> %s\n", e->message);
  mm_st_close(f);
  return code_of(e);
}

static void test_hostile(void) {
  char p[512];
  path_in(p, sizeof p, "hostile.safetensors");
  const megamoe_code INV = MEGAMOE_CODE_INVALID_ARGUMENT, LOSS = MEGAMOE_CODE_DATA_LOSS;
  static const struct {
    const char *what, *hdr;
    size_t data;
    megamoe_code code;
  } cases[] = {
      {"valid", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, MEGAMOE_CODE_OK},
      {"valid, space padded", "{\"a\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}   ", 1, MEGAMOE_CODE_OK},
      {"invalid JSON", "{\"a\":{\"dtype\":\"F32\",", 0, INV},
      {"non-object root", "[1, 2]", 0, INV},
      {"string root", "\"{}\"", 0, INV},
      {"leading space", " {}", 0, INV},
      {"trailing garbage", "{} x", 0, INV},
      {"duplicate names",
       "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2, INV},
      {"overlapping offsets",
       "{\"a\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[4,12]}}", 12, INV},
      {"same offsets",
       "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},\"b\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, INV},
      {"nested inside", "{\"a\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[3,5]}}", 8, INV},
      {"zero-size inside another (no bytes shared)",
       "{\"a\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[3,3]}}", 8, MEGAMOE_CODE_OK},
      {"out-of-bounds offsets", "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8, LOSS},
      {"huge offsets", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[18446744073709551614,18446744073709551615]}}", 8, INV},
      {"size/shape mismatch", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 8, INV},
      {"end before begin", "{\"a\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[4,0]}}", 8, INV},
      {"bad dtype", "{\"a\":{\"dtype\":\"F33\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8, INV},
      {"lowercase dtype", "{\"a\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8, INV},
      {"numeric dtype", "{\"a\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 8, INV},
      {"negative shape", "{\"a\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,0]}}", 8, INV},
      {"fractional shape", "{\"a\":{\"dtype\":\"U8\",\"shape\":[2.5],\"data_offsets\":[0,2]}}", 8, INV},
      {"string shape", "{\"a\":{\"dtype\":\"U8\",\"shape\":[\"2\"],\"data_offsets\":[0,2]}}", 8, INV},
      {"overflowing shape", "{\"a\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296,16],\"data_offsets\":[0,0]}}", 8, INV},
      {"overflowing bytes", "{\"a\":{\"dtype\":\"F64\",\"shape\":[4611686018427387904],\"data_offsets\":[0,0]}}", 8, INV},
      {"shape beyond int64", "{\"a\":{\"dtype\":\"U8\",\"shape\":[9223372036854775808],\"data_offsets\":[0,0]}}", 8, INV},
      {"zero dim times huge", "{\"a\":{\"dtype\":\"U8\",\"shape\":[0,9223372036854775807],\"data_offsets\":[0,0]}}", 8, MEGAMOE_CODE_OK},
      {"odd F4 count", "{\"a\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,1]}}", 8, INV},
      {"nine dims", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 8, INV},
      {"missing data_offsets", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", 8, INV},
      {"missing dtype", "{\"a\":{\"shape\":[1],\"data_offsets\":[0,1]}}", 8, INV},
      {"missing shape", "{\"a\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 8, INV},
      {"one offset", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}", 8, INV},
      {"negative offset", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[-1,0]}}", 8, INV},
      {"unknown field", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":1}}", 8, INV},
      {"entry not an object", "{\"a\":[1]}", 8, INV},
      {"metadata not strings", "{\"__metadata__\":{\"k\":1}}", 0, INV},
      {"metadata not an object", "{\"__metadata__\":\"x\"}", 0, INV},
      {"NUL in name", "{\"a\\u0000b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 8, INV},
      {"deep nesting", "{\"__metadata__\":{\"k\":[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]}}", 0, INV},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    write_raw(p, cases[i].hdr, 0, 0, cases[i].data);
    megamoe_code c = open_code(p, 0);
    CHECK_MSG(c == cases[i].code, "%s: code %s, expected %s", cases[i].what, mm_code_name(c),
              mm_code_name(cases[i].code));
  }
  /* the message names the file and the tensor */
  write_raw(p, "{\"model.x.weight\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 0, 0, 8);
  mm_st_file *f = NULL;
  mm_err *e = mm_st_open(p, &f);
  CHECK(e && strstr(e->message, "hostile.safetensors") && strstr(e->message, "model.x.weight"));
  if (e) printf("# e.g.: %s\n", e->message);
  mm_error_free(e);
  /* header length vs file size */
  write_raw(p, "{}", 1000, 1, 0);
  CHECK_EQ_INT(open_code(p, 1), LOSS);
  write_raw(p, "{}", (uint64_t)1 << 62, 1, 0);
  CHECK_EQ_INT(open_code(p, 1), INV);
  write_raw(p, "{}", UINT64_MAX, 1, 0);
  CHECK_EQ_INT(open_code(p, 0), INV);
  write_raw(p, "{}", MM_ST_MAX_HEADER + 1, 1, 0);
  CHECK_EQ_INT(open_code(p, 0), INV);
  write_raw(p, "{}", 0, 1, 0);
  CHECK_EQ_INT(open_code(p, 0), INV);
  /* truncated files */
  FILE *fp = fopen(p, "wb");
  fwrite("\x02\x00\x00", 1, 3, fp);
  fclose(fp);
  CHECK_EQ_INT(open_code(p, 0), LOSS);
  fp = fopen(p, "wb");
  fclose(fp);
  CHECK_EQ_INT(open_code(p, 0), LOSS);
  /* a real file cut short in its data section */
  mm_st_writer *w = NULL;
  CHECK_OK(mm_st_writer_new(&w));
  static unsigned char buf[4096];
  int64_t sh[1] = {4096};
  CHECK_OK(mm_st_writer_add(w, "big", MM_ST_U8, 1, sh, buf, 4096));
  CHECK_OK(mm_st_writer_write(w, p));
  mm_st_writer_free(w);
  struct stat st;
  stat(p, &st);
  CHECK(truncate(p, st.st_size - 1) == 0);
  CHECK_EQ_INT(open_code(p, 1), LOSS);
  /* not a file */
  CHECK_EQ_INT(open_code(g_tmp, 0), INV);
  path_in(p, sizeof p, "does-not-exist.safetensors");
  CHECK_EQ_INT(open_code(p, 0), MEGAMOE_CODE_NOT_FOUND);
  /* random garbage headers never crash and never succeed wrongly */
  path_in(p, sizeof p, "fuzz.safetensors");
  const char *base = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},\"__metadata__\":{\"k\":\"v\"}}";
  size_t bl = strlen(base);
  int accepted = 0;
  for (int it = 0; it < 2000; it++) {
    char h[256];
    memcpy(h, base, bl + 1);
    int flips = 1 + (int)(mm_test_rand_u64() % 3);
    for (int k = 0; k < flips; k++) h[mm_test_rand_u64() % bl] = (char)(1 + mm_test_rand_u64() % 255);
    write_raw(p, h, 0, 0, 16);
    mm_st_file *ff = NULL;
    mm_err *fe = mm_st_open(p, &ff);
    if (!fe) {
      accepted++;
      /* whatever was accepted must be self-consistent */
      for (size_t i = 0; i < mm_st_count(ff); i++) {
        const mm_st_tensor *t = mm_st_tensor_at(ff, i);
        CHECK(t->offset + t->nbytes <= mm_st_file_size(ff));
      }
    }
    mm_error_free(fe);
    mm_st_close(ff);
  }
  printf("# fuzz: %d of 2000 mutated headers still valid\n", accepted);
}

/* ---- sharded checkpoints --------------------------------------------------------- */

static void write_shard(const char *path, int first, int count, const char *dup_name) {
  mm_st_writer *w = NULL;
  CHECK_OK(mm_st_writer_new(&w));
  static int32_t vals[64][3];
  int64_t sh[1] = {3};
  for (int i = first; i < first + count; i++) {
    char name[64];
    snprintf(name, sizeof name, "model.layers.%d.w", i);
    for (int j = 0; j < 3; j++) vals[i][j] = i * 10 + j;
    CHECK_OK(mm_st_writer_add(w, name, MM_ST_I32, 1, sh, vals[i], 12));
  }
  if (dup_name) CHECK_OK(mm_st_writer_add(w, dup_name, MM_ST_I32, 1, sh, vals[0], 12));
  CHECK_OK(mm_st_writer_write(w, path));
  mm_st_writer_free(w);
}

static void write_text(const char *path, const char *text) {
  FILE *fp = fopen(path, "w");
  fputs(text, fp);
  fclose(fp);
}

static void check_ckpt(const char *path, int n) {
  mm_st_ckpt *c = NULL;
  CHECK_OK(mm_st_ckpt_open(path, &c));
  if (!c) return;
  CHECK_EQ_INT(mm_st_ckpt_count(c), n);
  for (int i = 0; i < n; i++) {
    char name[64];
    snprintf(name, sizeof name, "model.layers.%d.w", i);
    const mm_st_file *f = NULL;
    const mm_st_tensor *t = mm_st_ckpt_find(c, name, &f);
    CHECK_MSG(t && f, "%s: %s missing", path, name);
    int32_t v[3] = {-1, -1, -1};
    CHECK_OK(mm_st_ckpt_read(c, name, v, sizeof v));
    CHECK(v[0] == i * 10 && v[1] == i * 10 + 1 && v[2] == i * 10 + 2);
  }
  size_t seen = 0;
  for (size_t i = 0; i < mm_st_ckpt_count(c); i++) {
    const mm_st_file *f = NULL;
    const mm_st_tensor *t = mm_st_ckpt_tensor_at(c, i, &f);
    seen += t && f && mm_st_find(f, t->name) == t;
  }
  CHECK_EQ_INT(seen, n);
  const mm_st_tensor *t;
  CHECK_ERR(mm_st_ckpt_get(c, "model.layers.999.w", &t, NULL), MEGAMOE_CODE_NOT_FOUND);
  mm_st_ckpt_close(c);
}

static megamoe_code ckpt_code(const char *path) {
  mm_st_ckpt *c = NULL;
  mm_err *e = mm_st_ckpt_open(path, &c);
  if (e) printf("#   -> %s\n", e->message);
  mm_st_ckpt_close(c);
  return code_of(e);
}

static void test_ckpt(void) {
  char dir[512], p[600], idx[600];
  path_in(dir, sizeof dir, "ckpt");
  mkdir(dir, 0755);
  snprintf(p, sizeof p, "%s/model-00001-of-00003.safetensors", dir);
  write_shard(p, 0, 4, NULL);
  snprintf(p, sizeof p, "%s/model-00002-of-00003.safetensors", dir);
  write_shard(p, 4, 3, NULL);
  snprintf(p, sizeof p, "%s/model-00003-of-00003.safetensors", dir);
  write_shard(p, 7, 5, NULL);
  char text[4096];
  size_t n = (size_t)snprintf(text, sizeof text, "{\"metadata\":{\"total_size\":144},\"weight_map\":{");
  for (int i = 0; i < 12; i++)
    n += (size_t)snprintf(text + n, sizeof text - n, "%s\"model.layers.%d.w\":\"model-0000%d-of-00003.safetensors\"",
                          i ? "," : "", i, i < 4 ? 1 : i < 7 ? 2 : 3);
  snprintf(text + n, sizeof text - n, "}}");
  snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
  write_text(idx, text);
  check_ckpt(dir, 12);
  check_ckpt(idx, 12);
  /* wrong shard in the index */
  char bad[4096];
  memcpy(bad, text, sizeof bad);
  char *q = strstr(bad, "\"model.layers.5.w\":\"model-00002");
  q[strlen("\"model.layers.5.w\":\"model-0000")] = '3';
  write_text(idx, bad);
  CHECK_EQ_INT(ckpt_code(dir), MEGAMOE_CODE_INVALID_ARGUMENT);
  /* tensor named by the index but absent */
  memcpy(bad, text, sizeof bad);
  q = strstr(bad, "}}");
  snprintf(q, 200, ",\"model.layers.99.w\":\"model-00001-of-00003.safetensors\"}}");
  write_text(idx, bad);
  CHECK_EQ_INT(ckpt_code(idx), MEGAMOE_CODE_INVALID_ARGUMENT);
  /* missing shard file; shard name escaping the directory */
  write_text(idx, "{\"weight_map\":{\"a\":\"model-00009-of-00009.safetensors\"}}");
  CHECK_EQ_INT(ckpt_code(dir), MEGAMOE_CODE_NOT_FOUND);
  write_text(idx, "{\"weight_map\":{\"a\":\"../x.safetensors\"}}");
  CHECK_EQ_INT(ckpt_code(dir), MEGAMOE_CODE_INVALID_ARGUMENT);
  write_text(idx, "{\"weights\":{}}");
  CHECK_EQ_INT(ckpt_code(dir), MEGAMOE_CODE_INVALID_ARGUMENT);
  /* no index: every *.safetensors in the directory */
  unlink(idx);
  check_ckpt(dir, 12);
  /* no index and a tensor in two shards */
  snprintf(p, sizeof p, "%s/model-00004-of-00003.safetensors", dir);
  write_shard(p, 20, 1, "model.layers.2.w");
  CHECK_EQ_INT(ckpt_code(dir), MEGAMOE_CODE_INVALID_ARGUMENT);
  unlink(p);
  /* a single file, as a path and as a one-file directory */
  char one[512];
  path_in(one, sizeof one, "one");
  mkdir(one, 0755);
  snprintf(p, sizeof p, "%s/model.safetensors", one);
  write_shard(p, 0, 9, NULL);
  check_ckpt(p, 9);
  check_ckpt(one, 9);
  /* an empty directory */
  path_in(one, sizeof one, "empty");
  mkdir(one, 0755);
  CHECK_EQ_INT(ckpt_code(one), MEGAMOE_CODE_NOT_FOUND);
}

int main(void) {
  const char *tmp = getenv("TMPDIR");
  snprintf(g_tmp, sizeof g_tmp, "%s/mm_st_test_XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(g_tmp)) {
    printf("Bail out! mkdtemp: %s\n", strerror(errno));
    return 1;
  }
  mm_test_seed();
  RUN(test_json_basic);
  RUN(test_json_strings);
  RUN(test_json_numbers);
  RUN(test_json_errors);
  RUN(test_json_depth);
  RUN(test_json_large_object);
  RUN(test_dtype_map);
  RUN(test_roundtrip);
  RUN(test_many_tensors);
  RUN(test_writer_streaming_and_errors);
  {
    const char *gd = getenv("MEGAMOE_GOLDEN_DIR");
    DIR *d = gd ? opendir(gd) : NULL;
    if (d) {
      closedir(d);
      RUN(test_golden);
    } else {
      printf("ok %d - test_golden # SKIP golden dir %s missing\n", ++mm_test_count_, gd ? gd : "(unset)");
    }
  }
  RUN(test_hostile);
  RUN(test_ckpt);
  mm_test_rm_tree(g_tmp);
  return mm_test_done();
}

/* ep_test_util.h -- shared by the expert-parallel GPU test and bench: the
 * host services a plugin normally gets from entry.c (log, an in-process
 * key-value store for the NCCL bootstrap), random routing inputs, the CPU
 * expectation for the stand-in expert, random experts, and a runner of one
 * thread per rank. Header-only, included by one file per program (it
 * defines mm_log and mm_host_services, and uses gpu_harness.h's
 * random numbers). */
#ifndef MM_EP_TEST_UTIL_H
#define MM_EP_TEST_UTIL_H

#include <stdint.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "formats.h"
#include "gpu_harness.h"
#include "megamoe_plugin.h"
#include "qmat.h"
#include "ref_moe.h"

/* Which ids a batch gets. */
typedef enum {
  EPT_IDS_RANDOM,      /* distinct-ish random ids, ~10% masked */
  EPT_IDS_DUPLICATES,  /* ids drawn from 3 experts: repeats within a token */
  EPT_IDS_ONE_EXPERT,  /* every (token, k) to expert `hot` */
  EPT_IDS_MASKED,      /* every id -1 */
  EPT_IDS_BAD          /* random with ~1/7 ids >= E and some < -1 */
} ept_ids_kind;

/* ---- host services (what entry.c provides inside the plugin) ---------------- */

#define KV_MAX 64
static struct {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  char key[KV_MAX][256];
  unsigned char val[KV_MAX][256];
  size_t len[KV_MAX];
  int n;
} g_kv = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, {{0}}, {{0}}, {0}, 0};

static int kv_put(void *ctx, const char *key, const void *value, size_t len) {
  (void)ctx;
  if (len > 256 || strlen(key) >= 256) return -1;
  pthread_mutex_lock(&g_kv.lock);
  int i = 0;
  while (i < g_kv.n && strcmp(g_kv.key[i], key)) i++;
  if (i == KV_MAX) {
    pthread_mutex_unlock(&g_kv.lock);
    return -1;
  }
  if (i == g_kv.n) g_kv.n++;
  snprintf(g_kv.key[i], 256, "%s", key);
  memcpy(g_kv.val[i], value, len);
  g_kv.len[i] = len;
  pthread_cond_broadcast(&g_kv.cond);
  pthread_mutex_unlock(&g_kv.lock);
  return 0;
}

static int kv_get(void *ctx, const char *key, void *value, size_t cap, size_t *len,
                  int timeout_ms) {
  (void)ctx;
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += timeout_ms / 1000;
  dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) {
    dl.tv_sec++;
    dl.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&g_kv.lock);
  for (;;) {
    for (int i = 0; i < g_kv.n; i++)
      if (!strcmp(g_kv.key[i], key)) {
        *len = g_kv.len[i];
        memcpy(value, g_kv.val[i], g_kv.len[i] < cap ? g_kv.len[i] : cap);
        pthread_mutex_unlock(&g_kv.lock);
        return 0;
      }
    if (pthread_cond_timedwait(&g_kv.cond, &g_kv.lock, &dl) != 0) {
      pthread_mutex_unlock(&g_kv.lock);
      return -1;
    }
  }
}

static int register_op(void *ctx, const struct megamoe_op_registration *reg) {
  (void)ctx, (void)reg;
  return 0;
}

static const megamoe_host_services g_services = {
    MEGAMOE_HOST_SERVICES_STRUCT_SIZE, NULL, NULL, NULL, NULL, NULL, kv_put, kv_get, register_op};

const struct megamoe_host_services *mm_host_services(void) { return &g_services; }

void mm_log(int level, const char *fmt, ...) {
  if (level > MEGAMOE_LOG_WARN && !getenv("MEGAMOE_TEST_VERBOSE")) return;
  va_list ap;
  va_start(ap, fmt);
  printf("# log %d: ", level);
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
}


/* ---- inputs ----------------------------------------------------------------------- */

static inline void ept_fill_ids(int32_t *ids, int T, int K, int E, ept_ids_kind kind, int hot) {
  for (int t = 0; t < T; t++)
    for (int j = 0; j < K; j++) {
      uint64_t u = mm_test_rand_u64();
      int32_t v;
      switch (kind) {
        case EPT_IDS_DUPLICATES: v = (int32_t)((u >> 8) % (uint64_t)(E < 3 ? E : 3)); break;
        case EPT_IDS_ONE_EXPERT: v = hot; break;
        case EPT_IDS_MASKED: v = -1; break;
        case EPT_IDS_BAD:
          v = (u % 7 == 0)    ? (int32_t)(E + (u >> 8) % 1000)
              : (u % 13 == 0) ? -2 - (int32_t)((u >> 8) % 100)
                              : (int32_t)((u >> 8) % (uint64_t)E);
          break;
        default: v = (u % 10 == 0) ? -1 : (int32_t)((u >> 8) % (uint64_t)E); break;
      }
      ids[(size_t)t * K + j] = v;
    }
}

static inline void ept_fill_hidden(uint16_t *x, int T, int H) {
  for (int t = 0; t < T; t++) {
    float row_scale = (t % 17 == 3) ? 1e3f : (t % 17 == 5) ? 1e-6f : 1.0f;
    for (int c = 0; c < H; c++) {
      float v = mm_test_normal() * row_scale;
      if (t % 23 == 7) v = 0.0f; /* all-zero row: amax clamps to 1e-4 */
      x[(size_t)t * H + c] = mm_float_to_bf16(v);
    }
  }
}

static inline void ept_fill_weights(float *w, int T, int K) {
  for (int i = 0; i < T * K; i++) w[i] = mm_test_uniform(0.0f, 1.0f);
}

static inline void ept_expected_identity(const uint16_t *x, const int32_t *ids, const float *w, int T, int H,
                           int K, int E, float rsf, uint16_t *out) {
  uint8_t *xq = malloc((size_t)H);
  float *xs = malloc(sizeof(float) * (size_t)(H / 128));
  float *acc = malloc(sizeof(float) * (size_t)H);
  for (int t = 0; t < T; t++) {
    mm_ref_quant_act(x + (size_t)t * H, 1, H, xq, xs);
    for (int c = 0; c < H; c++) acc[c] = 0.0f;
    for (int j = 0; j < K; j++) {
      int id = ids[(size_t)t * K + j];
      if (id < 0 || id >= E) continue;
      float wj = w[(size_t)t * K + j] * rsf;
      float m = (float)(1 + (id & 15));
      for (int c = 0; c < H; c++) {
        float v = mm_e4m3_to_float(xq[c]) * xs[c / 128];
        v = v * wj;
        v = v * m;
        acc[c] += mm_round_bf16(v);
      }
    }
    for (int c = 0; c < H; c++) out[(size_t)t * H + c] = mm_float_to_bf16(acc[c]);
  }
  free(xq);
  free(xs);
  free(acc);
}

static inline mm_expert_q *ept_make_experts(int n, int H, int I, int gran, uint64_t seed) {
  uint64_t saved = mm_test_rng_state_;
  mm_test_rng_state_ = seed;
  mm_expert_q *ex = calloc((size_t)n, sizeof *ex);
  for (int e = 0; e < n; e++) {
    mm_qmat *ms[2] = {&ex[e].w13, &ex[e].w2};
    const int rows[2] = {2 * I, H}, cols[2] = {H, I};
    for (int m = 0; m < 2; m++) {
      mm_qmat *q = ms[m];
      if (mm_qmat_alloc(q, rows[m], cols[m], gran, gran == 16 ? MM_SF_E4M3 : MM_SF_UE8M0)) abort();
      for (size_t i = 0; i < (size_t)q->rows * q->cols / 2; i++) q->codes[i] = (uint8_t)mm_test_rand_u64();
      const int G = q->cols / gran;
      float norm = 1.0f / sqrtf((float)q->cols);
      for (int r = 0; r < q->rows; r++) {
        for (int g = 0; g < G; g++) {
          uint8_t b;
          if (gran == 32) {
            b = (uint8_t)(122 - (int)(mm_test_rand_u64() % 5));
          } else {
            do b = (uint8_t)(0x20 + mm_test_rand_u64() % 0x38);
            while (mm_e4m3_is_nan(b));
          }
          q->scales[(size_t)r * G + g] = b;
        }
        /* per-projection globals: gate and up differ */
        q->row_scale[r] = (gran == 16 ? (m == 0 && r >= I ? 0.004f : 0.0025f) * 64.0f : 32.0f) * norm;
      }
    }
  }
  mm_test_rng_state_ = saved;
  return ex;
}

/* ---- one thread per rank --------------------------------------------------------- */

typedef struct {
  void (*fn)(int, void *);
  void *ctx;
  int rank;
} rank_arg;

static void *rank_main(void *p) {
  rank_arg *a = p;
  a->fn(a->rank, a->ctx);
  return NULL;
}

static inline void ept_run_ranks(int ranks, void (*fn)(int rank, void *ctx), void *ctx) {
  pthread_t *th = calloc((size_t)ranks, sizeof *th);
  rank_arg *args = calloc((size_t)ranks, sizeof *args);
  for (int r = 0; r < ranks; r++) {
    args[r] = (rank_arg){fn, ctx, r};
    if (pthread_create(&th[r], NULL, rank_main, &args[r])) {
      fn(r, ctx); /* cannot happen in practice; run inline */
      th[r] = 0;
    }
  }
  for (int r = 0; r < ranks; r++)
    if (th[r]) pthread_join(th[r], NULL);
  free(th);
  free(args);
}

#endif

/* test_routing.c -- the expert-parallel routing plan on simulated 1..64 ranks:
 * counts and dedup against brute force, slots, the per-expert pool order, and
 * the round trip dispatch -> pool -> combine for packed (normal) and
 * fixed-stride (low-latency) segments. Also the plan-time sizing and the
 * docs/PERF.md memory table (`test_routing --table` prints it as markdown). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "layout_sm90.h"
#include "routing.h"

typedef enum { IDS_RANDOM, IDS_ALL_ONE, IDS_MASKED_HEAVY, IDS_DUPLICATES, IDS_BAD } ids_kind;

static void fill_ids(int32_t *ids, int T, int K, int E, ids_kind kind, int hot) {
  for (int t = 0; t < T; t++)
    for (int j = 0; j < K; j++) {
      int32_t *p = &ids[(size_t)t * K + j];
      uint64_t u = mm_test_rand_u64();
      switch (kind) {
        case IDS_ALL_ONE: *p = hot; break;
        case IDS_MASKED_HEAVY: *p = (u % 3) ? -1 : (int32_t)((u >> 8) % (uint64_t)E); break;
        case IDS_DUPLICATES: *p = (int32_t)((u >> 8) % (uint64_t)(E < 3 ? E : 3)); break;
        case IDS_BAD:
          *p = (u % 7 == 0) ? (int32_t)(E + (u >> 8) % 5) : (u % 11 == 0) ? -2 - (int32_t)(u % 3)
                                                                            : (int32_t)((u >> 8) % (uint64_t)E);
          break;
        default: *p = (u % 10 == 0) ? -1 : (int32_t)((u >> 8) % (uint64_t)E); break;
      }
    }
}

static int valid_id(int id, int E) { return id >= 0 && id < E; }

/* Brute-force checks of one source's plan. */
static void check_send_plan(const mm_route_geom *g, int T, const int32_t *ids, const int *tc,
                            const int *pc, const int32_t *ts, const int32_t *ps, int bad) {
  const int R = g->ranks, K = g->top_k, E = g->num_experts, per = E / R;
  int nbad = 0;
  for (int r = 0; r < R; r++) {
    int ntok = 0, npair = 0;
    for (int t = 0; t < T; t++) {
      int has = 0;
      for (int j = 0; j < K; j++) {
        int id = ids[t * K + j];
        if (!valid_id(id, E) || id / per != r) continue;
        if (!has) {
          CHECK_EQ_INT(ts[t * K + j], ntok); /* first j to r opens the row */
          has = 1;
        } else {
          CHECK_EQ_INT(ts[t * K + j], ntok); /* dedup: same row */
        }
        CHECK_EQ_INT(ps[t * K + j], npair);
        npair++;
      }
      ntok += has;
    }
    CHECK_EQ_INT(tc[r], ntok);
    CHECK_EQ_INT(pc[r], npair);
  }
  for (int p = 0; p < T * K; p++) {
    if (ids[p] != -1 && !valid_id(ids[p], E)) nbad++;
    if (!valid_id(ids[p], E)) {
      CHECK_EQ_INT(ts[p], -1);
      CHECK_EQ_INT(ps[p], -1);
    }
  }
  CHECK_EQ_INT(bad, nbad);
}

/* One simulated step on R ranks; ll_stride > 0 uses fixed segments. */
static void simulate(int R, int per, int K, int tmax, ids_kind kind, int ll) {
  mm_route_geom g = {R, R * per, K};
  const int E = g.num_experts;
  CHECK_OK(mm_route_geom_check(&g));
  int *T = calloc((size_t)R, sizeof(int));
  int32_t **ids = calloc((size_t)R, sizeof(*ids));
  int **tc = calloc((size_t)R, sizeof(*tc)), **pc = calloc((size_t)R, sizeof(*pc));
  int32_t **ts = calloc((size_t)R, sizeof(*ts)), **ps = calloc((size_t)R, sizeof(*ps));
  const int kk = K; /* duplicate ids: up to k pairs per token and rank */
  const int tok_stride = ll ? tmax : 0, pair_stride = ll ? tmax * kk : 0;
  int hot = (int)(mm_test_rand_u64() % (uint64_t)E);
  for (int s = 0; s < R; s++) {
    T[s] = (kind == IDS_ALL_ONE && s % 3 == 1) ? 0 : (int)(mm_test_rand_u64() % (uint64_t)(tmax + 1));
    ids[s] = malloc(sizeof(int32_t) * ((size_t)T[s] * K + 1));
    fill_ids(ids[s], T[s], K, E, kind, hot);
    tc[s] = malloc(sizeof(int) * (size_t)R);
    pc[s] = malloc(sizeof(int) * (size_t)R);
    ts[s] = malloc(sizeof(int32_t) * ((size_t)T[s] * K + 1));
    ps[s] = malloc(sizeof(int32_t) * ((size_t)T[s] * K + 1));
    int64_t first_bad;
    int bad = mm_route_send_plan(&g, T[s], ids[s], tc[s], pc[s], ts[s], ps[s], &first_bad);
    check_send_plan(&g, T[s], ids[s], tc[s], pc[s], ts[s], ps[s], bad);
    if (bad) CHECK(first_bad >= 0 && ids[s][first_bad] != -1 && !valid_id(ids[s][first_bad], E));
    if (!bad) CHECK_EQ_INT(first_bad, -1);
    for (int r = 0; r < R; r++) {
      CHECK(tc[s][r] <= T[s]);
      CHECK(pc[s][r] <= T[s] * kk);
    }
  }
  /* Per receiver: transport the sanitized id rows, plan, fill the pool with a
   * code per pair, gather into the combine-send buffer. */
  int64_t **cs = calloc((size_t)R, sizeof(*cs));
  int64_t **cs_off = calloc((size_t)R, sizeof(*cs_off));
  int64_t total_pairs = 0, pooled = 0;
  for (int me = 0; me < R; me++) {
    int recv_tok[64];
    for (int s = 0; s < R; s++) recv_tok[s] = tc[s][me];
    int64_t roff[65];
    mm_route_offsets(R, recv_tok, tok_stride, roff);
    const int64_t rows = roff[R];
    int32_t *rids = malloc(sizeof(int32_t) * ((size_t)rows * K + 1));
    for (int64_t i = 0; i < rows * K; i++) rids[i] = 0x5A5A5A5A; /* poison: unused LL rows */
    for (int s = 0; s < R; s++)
      for (int t = 0; t < T[s]; t++)
        for (int j = 0; j < K; j++) {
          int id = ids[s][t * K + j];
          if (ts[s][t * K + j] < 0 || id / per != me) continue;
          int64_t row = roff[s] + ts[s][t * K + j];
          for (int jj = 0; jj < K; jj++) {
            int v = ids[s][t * K + jj];
            rids[row * K + jj] = valid_id(v, E) ? v : -1;
          }
        }
    int *ecount = malloc(sizeof(int) * (size_t)per);
    int64_t *eoff = malloc(sizeof(int64_t) * (size_t)(per + 1));
    int32_t *prow = malloc(sizeof(int32_t) * ((size_t)rows * K + 1));
    int64_t *crow = malloc(sizeof(int64_t) * ((size_t)rows * K + 1));
    int recv_pair[64];
    cs_off[me] = malloc(sizeof(int64_t) * (size_t)(R + 1));
    mm_route_recv_plan(&g, me, recv_tok, roff, rids, pair_stride, ecount, eoff, prow, crow,
                       recv_pair, cs_off[me]);
    int64_t npool = eoff[per];
    for (int s = 0; s < R; s++) CHECK_EQ_INT(recv_pair[s], pc[s][me]);
    /* Pool: rows grouped by expert in (s, slot, j) order, each row once. */
    int64_t *pool_code = malloc(sizeof(int64_t) * ((size_t)npool + 1));
    int64_t *pool_key = malloc(sizeof(int64_t) * ((size_t)npool + 1));
    for (int64_t i = 0; i < npool; i++) pool_code[i] = -1;
    for (int s = 0; s < R; s++)
      for (int t = 0; t < T[s]; t++)
        for (int j = 0; j < K; j++) {
          int id = ids[s][t * K + j];
          if (ts[s][t * K + j] < 0 || id / per != me) continue;
          int64_t row = roff[s] + ts[s][t * K + j];
          int32_t p = prow[row * K + j];
          CHECK(p >= eoff[id - me * per] && p < eoff[id - me * per + 1]);
          if (p < 0 || p >= npool) continue;
          CHECK_EQ_INT(pool_code[p], -1);
          pool_code[p] = ((int64_t)s << 40) | ((int64_t)t << 8) | j;
          pool_key[p] = (((int64_t)(id - me * per) * R + s) << 40) | ((int64_t)ts[s][t * K + j] << 8) | j;
          CHECK_EQ_INT(crow[row * K + j], cs_off[me][s] + ps[s][t * K + j]);
        }
    for (int64_t i = 0; i < npool; i++) {
      CHECK(pool_code[i] >= 0);
      if (i) CHECK(pool_key[i] > pool_key[i - 1]);
    }
    /* Unused rows of fixed segments and non-local pairs stay -1. */
    for (int s = 0; s < R; s++)
      for (int64_t row = roff[s] + recv_tok[s]; row < roff[s + 1]; row++)
        for (int j = 0; j < K; j++) CHECK_EQ_INT(prow[row * K + j], -1);
    int64_t cs_rows = cs_off[me][R];
    cs[me] = malloc(sizeof(int64_t) * ((size_t)cs_rows + 1));
    for (int64_t i = 0; i < cs_rows; i++) cs[me][i] = -7;
    for (int64_t row = 0; row < rows; row++)
      for (int j = 0; j < K; j++)
        if (prow[row * K + j] >= 0) cs[me][crow[row * K + j]] = pool_code[prow[row * K + j]];
    total_pairs += npool;
    pooled += npool;
    free(rids);
    free(ecount);
    free(eoff);
    free(prow);
    free(crow);
    free(pool_code);
    free(pool_key);
  }
  /* Combine: source s receives from each r its segment; pair (t, j) is at
   * croff[r] + pair_slot and must carry the code of (s, t, j). */
  int64_t sent = 0;
  for (int s = 0; s < R; s++) {
    int64_t croff[65];
    mm_route_offsets(R, pc[s], pair_stride, croff);
    int64_t *cr = malloc(sizeof(int64_t) * ((size_t)croff[R] + 1));
    for (int r = 0; r < R; r++)
      memcpy(cr + croff[r], cs[r] + cs_off[r][s], sizeof(int64_t) * (size_t)pc[s][r]);
    for (int t = 0; t < T[s]; t++)
      for (int j = 0; j < K; j++) {
        int id = ids[s][t * K + j];
        if (!valid_id(id, E)) continue;
        int r = id / per;
        CHECK_EQ_INT(cr[croff[r] + ps[s][t * K + j]], ((int64_t)s << 40) | ((int64_t)t << 8) | j);
        sent++;
      }
    free(cr);
  }
  CHECK_EQ_INT(sent, total_pairs);
  (void)pooled;
  for (int s = 0; s < R; s++) {
    free(ids[s]);
    free(tc[s]);
    free(pc[s]);
    free(ts[s]);
    free(ps[s]);
    free(cs[s]);
    free(cs_off[s]);
  }
  free(T);
  free(ids);
  free(tc);
  free(pc);
  free(ts);
  free(ps);
  free(cs);
  free(cs_off);
}

static const int kRanks[] = {1, 2, 3, 4, 8, 16, 32, 64};

static void run_kind(ids_kind kind) {
  for (size_t i = 0; i < sizeof kRanks / sizeof kRanks[0]; i++) {
    int R = kRanks[i];
    int per = 1 << (int)(mm_test_rand_u64() % 4); /* 1..8 experts per rank */
    if (R * per > 512) per = 512 / R;
    int K = 1 + (int)(mm_test_rand_u64() % 8);
    int tmax = R >= 32 ? 24 : 64;
    for (int ll = 0; ll < 2; ll++) simulate(R, per, K, tmax, kind, ll);
  }
}

static void test_random_ids(void) { run_kind(IDS_RANDOM); }
static void test_masked_ids(void) { run_kind(IDS_MASKED_HEAVY); }
static void test_duplicate_ids(void) { run_kind(IDS_DUPLICATES); }
static void test_all_to_one_expert(void) { run_kind(IDS_ALL_ONE); }
static void test_invalid_ids(void) { run_kind(IDS_BAD); }

static void test_zero_tokens(void) {
  for (int R = 1; R <= 64; R *= 4) {
    mm_route_geom g = {R, R * 2, 4};
    int tc[64], pc[64];
    int64_t fb = 7;
    CHECK_EQ_INT(mm_route_send_plan(&g, 0, NULL, tc, pc, NULL, NULL, &fb), 0);
    CHECK_EQ_INT(fb, -1);
    for (int r = 0; r < R; r++) CHECK(tc[r] == 0 && pc[r] == 0);
  }
  simulate(4, 2, 3, 0, IDS_RANDOM, 0);
  simulate(4, 2, 3, 0, IDS_RANDOM, 1);
}

/* A hand-checked case: R = 2, 4 experts (2 per rank), k = 3. */
static void test_small_exact(void) {
  mm_route_geom g = {2, 4, 3};
  const int32_t ids[] = {0, 1, 3,   /* t0: rank 0 twice (dedup), rank 1 */
                         -1, -1, -1, /* t1: masked */
                         2, 2, 9,   /* t2: rank 1 twice, one bad id */
                         1, -1, 0}; /* t3: rank 0 twice */
  int tc[2], pc[2];
  int32_t ts[12], ps[12];
  int64_t fb;
  CHECK_EQ_INT(mm_route_send_plan(&g, 4, ids, tc, pc, ts, ps, &fb), 1);
  CHECK_EQ_INT(fb, 8);
  CHECK(tc[0] == 2 && tc[1] == 2 && pc[0] == 4 && pc[1] == 3);
  const int32_t ets[] = {0, 0, 0, -1, -1, -1, 1, 1, -1, 1, -1, 1};
  const int32_t eps[] = {0, 1, 0, -1, -1, -1, 1, 2, -1, 2, -1, 3};
  for (int i = 0; i < 12; i++) {
    CHECK_EQ_INT(ts[i], ets[i]);
    CHECK_EQ_INT(ps[i], eps[i]);
  }
}

static void test_geom_errors(void) {
  mm_route_geom g = {3, 8, 2};
  CHECK_ERR(mm_route_geom_check(&g), MEGAMOE_CODE_INVALID_ARGUMENT);
  g = (mm_route_geom){0, 8, 2};
  CHECK_ERR(mm_route_geom_check(&g), MEGAMOE_CODE_INVALID_ARGUMENT);
  g = (mm_route_geom){2, 8, 0};
  CHECK_ERR(mm_route_geom_check(&g), MEGAMOE_CODE_INVALID_ARGUMENT);
}


/* The sm90 compute workspace of a pool (what the backend plans with). */
static int64_t sm90_ws(mm_weight_mode mode, int H, int I, int64_t pool_rows) {
  return (int64_t)mm_sm90_workspace_plan(mode, H, I, (int)pool_rows).bytes;
}

static mm_ep_size_args glm5(int R, int T) {
  mm_ep_size_args a = {R, 256, 8, 6144, 2048, T, T < 256 ? T : 256, MM_EP_POOL_FACTOR_DEFAULT, -1};
  return a;
}

static void test_sizing(void) {
  for (int R = 1; R <= 64; R *= 2)
    for (int T = 1; T <= 8192; T *= 8) {
      mm_ep_size_args a = glm5(R, T);
      mm_ep_sizes s;
      CHECK_OK(mm_ep_size(&a, &s));
      CHECK_EQ_INT(s.row_bytes, 6144 + 192 + 64);
      CHECK(s.recv_rows >= (int64_t)T * (R < 8 ? R : 8) || s.recv_rows >= 2 * s.send_rows);
      CHECK(s.recv_rows <= (int64_t)R * T);
      CHECK(s.pool_rows >= (int64_t)T * 8 || s.pool_rows == (int64_t)R * T * s.pair_rows_per_tok);
      if (R == 1) CHECK_EQ_INT(s.pool_rows, (int64_t)T * 8); /* exact: capacity by construction */
      /* what ep_engine.c puts where: y holds the pool output, which is the
       * combine send (normal: received pairs <= pool rows; low-latency: the
       * fixed segments); x the combine receive, once the pool is dead */
      CHECK(s.region_y >= (uint64_t)s.pool_rows * 12288);
      CHECK(s.region_y >= (uint64_t)s.ll_pair_rows * 12288);
      CHECK(s.region_x >= (uint64_t)s.combine_rows * 12288);
      CHECK(s.region_x >= (uint64_t)s.ll_pair_rows * 12288);
      CHECK(s.region_y >= (uint64_t)s.recv_rows * (uint64_t)s.row_bytes);
      /* one rank works in place in y: the dispatch send is its receive, the
       * combine receive its send */
      if (R == 1) {
        CHECK(s.region_y >= (uint64_t)s.send_rows * (uint64_t)s.row_bytes);
        CHECK(s.region_y >= (uint64_t)s.ll_tok_rows * (uint64_t)s.row_bytes);
        CHECK(s.region_y >= (uint64_t)s.combine_rows * 12288);
      }
      CHECK(s.device_total == s.region_x + s.region_y + s.meta);
    }
  /* The goal: <= 1.5 GiB per rank at 4096 tokens per rank (GLM-5, EP8). */
  mm_ep_size_args a = glm5(8, 4096);
  mm_ep_sizes s;
  CHECK_OK(mm_ep_size(&a, &s));
  for (int mode = MM_WMODE_G32_FP8; mode <= MM_WMODE_G32_F16_EXACT; mode++) {
    a.workspace_bytes = sm90_ws((mm_weight_mode)mode, a.hidden, a.intermediate, s.pool_rows);
    mm_ep_sizes sm;
    CHECK_OK(mm_ep_size(&a, &sm));
    CHECK_MSG(sm.device_total <= 1536ull << 20, "mode %d: %.3f GiB", mode,
              sm.device_total / 1073741824.0);
  }
  /* mode 1 also plans the prefill path's weight region here (a pool of
   * 1536 rows per local expert), at compute.prefill-experts' default */
  {
    const int E = a.num_experts / a.ranks;
    CHECK(s.pool_rows >= (int64_t)mm_sm90_prefill_min_rows(MM_WMODE_G32_FP8) * E);
    a.workspace_bytes = sm90_ws(MM_WMODE_G32_FP8, a.hidden, a.intermediate, s.pool_rows) +
                        (int64_t)mm_sm90_prefill_region_bytes(E, a.hidden, a.intermediate,
                                                              MM_SM90_PREFILL_EXPERTS_DEFAULT,
                                                              (int)s.pool_rows);
    mm_ep_sizes sm;
    CHECK_OK(mm_ep_size(&a, &sm));
    CHECK_MSG(sm.device_total <= 1536ull << 20, "mode 1 with the prefill region: %.3f GiB",
              sm.device_total / 1073741824.0);
  }
  a.hidden = 100;
  CHECK_ERR(mm_ep_size(&a, &s), MEGAMOE_CODE_INVALID_ARGUMENT);
  /* The default estimate (plan before prepare) covers every weight mode, and
   * not by much. */
  const int64_t rows[] = {0, 1, 63, 64, 65, 1000, 49152, 98304};
  const int shapes[][2] = {{6144, 2048}, {256, 128}, {7168, 256}};
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
      const int H = shapes[k][0], I = shapes[k][1];
      const int64_t est = mm_ep_workspace_estimate(rows[i], H, I);
      int64_t most = 0;
      for (int mode = MM_WMODE_G32_FP8; mode <= MM_WMODE_G32_F16_EXACT; mode++) {
        const int64_t need = sm90_ws((mm_weight_mode)mode, H, I, rows[i]);
        CHECK_MSG(est >= need, "rows %lld H %d I %d mode %d: estimate %lld < %lld",
                  (long long)rows[i], H, I, mode, (long long)est, (long long)need);
        if (need > most) most = need;
      }
      CHECK(est <= most + 3 * 256);
    }
}

static void print_table(void) {
  printf("| ep-size | tokens/rank | low-latency cap | pool rows | recv rows | weight mode | "
         "workspace (MiB) | region x (MiB) | region y (MiB) | small (MiB) | device total (GiB) | "
         "pinned host (KiB) |\n");
  printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  const int Rs[] = {8, 16, 64}, Ts[] = {128, 4096, 8192};
  /* rows: modes 1 / 3, modes 2 / 4, then mode 1 with the prefill path's
   * region (compute.prefill-experts 32, 16, 8) where a plan holds it */
  const char *names[] = {"1 / 3 (fp8)", "2 / 4 (exact, F16)", "1 + prefill region, 32 experts",
                         "1 + prefill region, 16 experts", "1 + prefill region, 8 experts"};
  const int chunks[] = {0, 0, 32, 16, 8};
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 3; j++)
      for (int m2 = 0; m2 < 5; m2++) {
        mm_ep_size_args a = glm5(Rs[i], Ts[j]);
        mm_ep_sizes s;
        mm_err *e = mm_ep_size(&a, &s); /* pool rows do not depend on the workspace */
        const int E = a.num_experts / a.ranks;
        if (!e && chunks[m2] &&
            s.pool_rows < (int64_t)mm_sm90_prefill_min_rows(MM_WMODE_G32_FP8) * E)
          continue;
        if (!e) {
          a.workspace_bytes = sm90_ws(m2 == 1 ? MM_WMODE_G16_BF16_EXACT : MM_WMODE_G32_FP8, a.hidden,
                                      a.intermediate, s.pool_rows);
          if (chunks[m2])
            a.workspace_bytes += (int64_t)mm_sm90_prefill_region_bytes(
                E, a.hidden, a.intermediate, chunks[m2] < E ? chunks[m2] : E, (int)s.pool_rows);
          e = mm_ep_size(&a, &s);
        }
        if (e) {
          megamoe_error_destroy(e);
          continue;
        }
        printf("| %d | %d | %d | %lld | %lld | %s | %.1f | %.1f | %.1f | %.1f | %.3f | %.1f |\n",
               Rs[i], Ts[j], a.ll_tokens, (long long)s.pool_rows, (long long)s.recv_rows,
               names[m2], s.workspace / 1048576.0, s.region_x / 1048576.0,
               s.region_y / 1048576.0, s.meta / 1048576.0, s.device_total / 1073741824.0,
               s.host_total / 1024.0);
      }
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "--table")) {
    print_table();
    return 0;
  }
  mm_test_seed();
  RUN(test_small_exact);
  RUN(test_geom_errors);
  RUN(test_random_ids);
  RUN(test_masked_ids);
  RUN(test_duplicate_ids);
  RUN(test_all_to_one_expert);
  RUN(test_invalid_ids);
  RUN(test_zero_tokens);
  RUN(test_sizing);
  return mm_test_done();
}

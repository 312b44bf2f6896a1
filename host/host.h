/* host.h -- what the parts of megamoe-host share: the options, the plugin's
 * op table, the work of one rank (host_run.c), the reference check, and the
 * rank group through which ranks wait for each other and give up together
 * (threads of one process in megamoe-host.c, processes in host_mp.c). */
#ifndef MM_HOST_H
#define MM_HOST_H

#include <stdint.h>
#include <uv.h>

#include "megamoe_plugin.h"
#include "safetensors.h"

#define MAX_SETS 64
#define MAX_TOKEN_SIZES 8
#define MAX_RANKS 64        /* threads of one process */
#define MAX_MP_WORLD 65536  /* processes */
#define MAX_LAYERS 1024     /* layers of one checkpoint */
#define MAX_ITERS 1024      /* timed iterations per token size */

typedef struct {
  const char *plugin, *plugin_dir, *config, *checkpoint;
  int validate, list, world, layers, iters, warmup, check_tokens, seed, force_cpu;
  int read_ahead; /* 1: read layer l + 1 while layer l is prepared */
  const char *dump_check; /* --dump-check FILE: the checked tokens, for scripts/layer_oracle.py */
  int tokens[MAX_TOKEN_SIZES], num_tokens;
  double tolerance; /* --tolerance; < 0: each rank's check_tolerance */
  megamoe_kv sets[MAX_SETS];
  int num_sets;
  /* multi-process mode (--rendezvous): this process runs rank `rank` only */
  const char *rendezvous;  /* HOST:PORT of the key-value store */
  int rank;                /* -1 unless given */
  int local_device;        /* -1: rank % visible GPUs */
  int rendezvous_serve;    /* -1: rank 0 serves, 0: never, 1: this process serves */
  int rendezvous_timeout_s;
} host_options;

extern host_options opt;
extern const megamoe_op_api *g_api;
extern int g_failed;            /* a rank of this process failed */
extern uv_mutex_t g_print_lock; /* one line at a time on stderr */

/* How ranks meet. sync: 0 when every rank arrived, -1 when the group was
 * aborted (or cannot meet any more). abort: releases every rank waiting in
 * sync, with a reason. */
typedef struct {
  int (*sync)(void);
  void (*abort)(const char *why);
} host_group;
extern const host_group *g_group;

/* ---- one rank ------------------------------------------------------------------ */
typedef struct {
  int rank, device;        /* global rank; CUDA ordinal or -1 (host) */
  int world;               /* ranks in all (threads, or processes with --rendezvous) */
  int ep_rank;             /* rank inside its expert-parallel group */
  const char *comm_key;    /* the group's kv namespace (NULL: the plugin's default) */
  const mm_st_ckpt *ck;
  const int *layers;
  int num_layers;
  int H, K, E;
  /* results */
  int ok;
  double tolerance; /* its check's: check_tolerance of the op's error bound */
  double prepare_s, load_bytes;
  uint64_t plan_device_bytes;
  double median_ms[MAX_TOKEN_SIZES];
  /* inputs/outputs of the first nonzero token size at layer 0, for the check */
  int T0;
  uint16_t *hidden, *out;
  int32_t *ids;
  float *weights;
} rank_work;

/* The reference check's tolerance for an op whose error bound is
 * error_bound (< 0: unknown): --tolerance when given, else the larger of
 * 0.02 and the bound, so that a lossy weight mode (g16-fp8: 0.1) is held to
 * what it promises rather than failed for it. */
double check_tolerance(double error_bound);
/* Runs create, prepare (every layer), plan, the timed executes and destroy
 * for one rank; sets w->ok. A uv_thread entry point. */
void rank_main(void *arg);
void rank_work_release(rank_work *w);

/* What both modes set up before running (megamoe-host.c: prepare_run). */
typedef struct {
  int gpus, world, ep; /* ep: ep-size; world/ep independent expert-parallel groups */
  mm_st_ckpt *ck;
  int layers[MAX_LAYERS], num_layers;
  int H, K, E;
} host_setup;
/* Rank r of the setup on `device`: its place in its expert-parallel group
 * (groups after the first bootstrap under their own comm_key). */
void init_rank(rank_work *w, const host_setup *su, int r, int device);

/* ---- helpers ------------------------------------------------------------------- */
/* Prints err (prefixed by what) and frees it; returns whether there was one. */
int report(megamoe_error *err, const char *what);
double now_s(void);
megamoe_op_create_args create_args(int rank, int device);
int has_set(const char *key);
const char *get_set(const char *key);
/* Layer indices present in the checkpoint, sorted. */
int find_layers(const mm_st_ckpt *ck, int *layers, int cap);
/* hidden size, top-k and the number of experts as the plugin resolves the
 * config (a throw-away cpu-reference op). 0 on success. */
int probe_shapes(int *H, int *K, int *E);

/* ---- the reference check --------------------------------------------------------- */
/* The cpu-reference backend (ep-size 1, every expert) loaded with checkpoint
 * layer `layer0`; checks check_tokens sampled tokens of a rank's first token
 * size at layer 0 against the run's output. */
typedef struct host_ref host_ref;
int ref_open(const mm_st_ckpt *ck, int layer0, host_ref **out);
/* 0 when the reference ran (*rel: relative RMS error, INFINITY on NaN/Inf). */
int ref_check(host_ref *ref, const rank_work *w, double *rel);
void ref_close(host_ref *ref);

/* ---- the summary line -------------------------------------------------------------- */
typedef struct {
  int pass;
  double rel_err; /* NAN when not checked */
  double tolerance;
  double prepare_s;
  uint64_t plan_bytes;
  double median_ms[MAX_TOKEN_SIZES];
  double wall_s;
} host_result;
/* "megamoe-host: PASS [rank=R ]backend=... world=W layers=L rel_err=... ..." */
void print_result(const host_result *r, int rank, const char *backend, int world, int layers);

/* ---- multi-process mode (host_mp.c) ------------------------------------------------- */
/* Starts the server (when this process serves) and joins the store. 0 on
 * success; on failure nothing is left running. */
int mp_connect(void);
/* The plugin's kv services on the store. */
int mp_kv_put(const char *key, const void *value, size_t len);
int mp_kv_get(const char *key, void *value, size_t cap, size_t *len, int timeout_ms);
/* Aborts the group from this process (setup failures before the run). */
void mp_abort(const char *why);
/* Runs this process's rank, checks its tokens, exchanges results, prints
 * the result lines, leaves the store. su is NULL when this rank's setup
 * failed (it then reports FAIL). Returns the exit code. */
int mp_run(const host_setup *su);

#endif

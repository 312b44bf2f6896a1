/* megamoe-host -- the reference host: loads plugins through the C ABI the way
 * an engine does, validates configs, loads a safetensors checkpoint layer by
 * layer, runs forward passes, checks sampled tokens against the cpu-reference
 * backend and prints timings. Two ways to place ranks:
 *   - threaded (default): one worker thread per visible GPU (libuv threads
 *     and barriers), an in-process key-value store for the NCCL bootstrap;
 *   - multi-process (--rendezvous): this process runs one rank; the store is
 *     served over TCP (host/kv_tcp.h) by rank 0 or --rendezvous-serve, and a
 *     barrier on it syncs the iterations (host_mp.c). Works across nodes.
 *
 *   megamoe-host --plugin PATH --config FILE --validate [--set KEY=VALUE ...]
 *   megamoe-host --plugin-dir DIR --list
 *   megamoe-host --plugin PATH --config FILE --checkpoint CKPT [--world N]
 *                [--layers N] [--tokens T[,T...]] [--iters N] [--check-tokens S]
 *   megamoe-host ... --checkpoint CKPT --rank R --world W --rendezvous HOST:PORT
 *                [--local-device D] [--[no-]rendezvous-serve] [--rendezvous-timeout S]
 *
 * This file: options, plugin loading, --list / --validate, the setup shared
 * by both modes and the threaded mode. host_run.c: the work of one rank.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "host.h"
#include "kv_store.h"
#include "plugin_loader.h"

host_options opt = {.world = 0, .layers = 0, .iters = 10, .warmup = 3, .check_tokens = 8,
                    .seed = 1, .read_ahead = 1, .tolerance = -1, .rank = -1, .local_device = -1,
                    .rendezvous_serve = -1, .rendezvous_timeout_s = 600};
const megamoe_op_api *g_api;
int g_failed;
uv_mutex_t g_print_lock;
const host_group *g_group;
static mm_kv_store *g_kv;

static void usage(void) {
  fprintf(stderr,
          "usage: megamoe-host (--plugin PATH | --plugin-dir DIR) [--list]\n"
          "       [--config FILE] [--validate] [--set KEY=VALUE]...\n"
          "       [--checkpoint CKPT] [--world N] [--layers N] [--tokens T[,T...]]\n"
          "       [--iters N] [--warmup N] [--check-tokens S] [--tolerance X] [--seed N] [--cpu]\n"
          "       [--read-ahead 0|1] [--dump-check FILE]\n"
          "       [--rank R --world W --rendezvous HOST:PORT [--local-device D]\n"
          "        [--rendezvous-serve | --no-rendezvous-serve] [--rendezvous-timeout SECONDS]]\n"
          "MEGAMOE_PLUGIN_PATH (colon-separated directories) is scanned when no --plugin is given.\n"
          "--rendezvous runs one rank per process (see docs/HOST.md); without it, one thread per GPU.\n");
}

/* ---- host services ---------------------------------------------------------- */
static void host_log(void *ctx, megamoe_log_level level, const char *msg) {
  static const char *names[] = {"error", "warn", "info", "debug"};
  uv_mutex_lock(&g_print_lock);
  fprintf(stderr, "[plugin %s] %s\n", names[level <= 3 ? level : 3], msg);
  uv_mutex_unlock(&g_print_lock);
}
static int host_kv_put(void *ctx, const char *key, const void *v, size_t len) {
  if (opt.rendezvous) return mp_kv_put(key, v, len);
  return mm_kv_store_put(g_kv, key, v, len);
}
static int host_kv_get(void *ctx, const char *key, void *v, size_t cap, size_t *len, int ms) {
  if (opt.rendezvous) return mp_kv_get(key, v, cap, len, ms);
  return mm_kv_store_get(g_kv, key, v, cap, len, ms);
}

/* ---- the threaded group: an abortable barrier -------------------------------- */
static uv_mutex_t g_bar_lock;
static uv_cond_t g_bar_cond;
static int g_bar_count, g_bar_gen, g_bar_abort, g_bar_parties;

/* Returns 0 when all ranks arrived, -1 when a rank aborted. */
static int sync_ranks(void) {
  uv_mutex_lock(&g_bar_lock);
  int gen = g_bar_gen;
  if (++g_bar_count == g_bar_parties) {
    g_bar_count = 0;
    g_bar_gen++;
    uv_cond_broadcast(&g_bar_cond);
  } else {
    while (gen == g_bar_gen && !g_bar_abort) uv_cond_wait(&g_bar_cond, &g_bar_lock);
  }
  int r = g_bar_abort ? -1 : 0;
  uv_mutex_unlock(&g_bar_lock);
  return r;
}
static void abort_ranks(const char *why) {
  uv_mutex_lock(&g_bar_lock);
  g_bar_abort = 1;
  uv_cond_broadcast(&g_bar_cond);
  uv_mutex_unlock(&g_bar_lock);
}
static const host_group threaded_group = {sync_ranks, abort_ranks};

/* ---- options --------------------------------------------------------------------- */
/* Every refused option says which one and why, so a typo never runs
 * something other than what was asked for. */
#define MAX_TOKENS_PER_SIZE (1 << 20)

static int parse_tokens(const char *s) {
  opt.num_tokens = 0;
  while (*s) {
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || v < 0 || v > MAX_TOKENS_PER_SIZE || (*end && *end != ',') ||
        opt.num_tokens == MAX_TOKEN_SIZES)
      return -1;
    opt.tokens[opt.num_tokens++] = (int)v;
    s = *end == ',' ? end + 1 : end;
  }
  return opt.num_tokens ? 0 : -1;
}

static int takes_value(const char *a) {
  static const char *const names[] = {
      "--plugin", "--plugin-dir", "--config", "--checkpoint", "--rendezvous", "--world",
      "--layers", "--iters", "--warmup", "--check-tokens", "--seed", "--rank", "--local-device",
      "--rendezvous-timeout", "--tolerance", "--tokens", "--set", "--read-ahead",
      "--dump-check"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (!strcmp(a, names[i])) return 1;
  return 0;
}

/* An integer option's value in [lo, hi]. */
static int take_int(const char *name, const char *v, long lo, long hi, int *out) {
  char *end;
  errno = 0;
  long x = v ? strtol(v, &end, 10) : 0;
  if (!v || !*v || *end || errno || x < lo || x > hi) {
    fprintf(stderr, "megamoe-host: %s needs an integer in [%ld, %ld]%s%s%s\n", name, lo, hi,
            v ? ", not '" : "", v ? v : "", v ? "'" : "");
    return -1;
  }
  *out = (int)x;
  return 0;
}

static int parse_args(int argc, char **argv) {
  static char set_buf[MAX_SETS][512];
  opt.tokens[0] = 128;
  opt.num_tokens = 1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    /* options without a value */
    if (!strcmp(a, "--validate")) opt.validate = 1;
    else if (!strcmp(a, "--list")) opt.list = 1;
    else if (!strcmp(a, "--cpu")) opt.force_cpu = 1;
    else if (!strcmp(a, "--rendezvous-serve")) opt.rendezvous_serve = 1;
    else if (!strcmp(a, "--no-rendezvous-serve")) opt.rendezvous_serve = 0;
    else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage();
      exit(0);
    } else if (!takes_value(a)) {
      fprintf(stderr, "megamoe-host: unknown argument '%s'\n", a);
      return -1;
    } else if (!v) {
      fprintf(stderr, "megamoe-host: %s needs a value\n", a);
      return -1;
    } else {
      /* options with a value */
      int bad = 0;
      i++;
      if (!strcmp(a, "--plugin")) opt.plugin = v;
      else if (!strcmp(a, "--plugin-dir")) opt.plugin_dir = v;
      else if (!strcmp(a, "--config")) opt.config = v;
      else if (!strcmp(a, "--checkpoint")) opt.checkpoint = v;
      else if (!strcmp(a, "--dump-check")) opt.dump_check = v;
      else if (!strcmp(a, "--rendezvous")) opt.rendezvous = v;
      else if (!strcmp(a, "--world")) bad = take_int(a, v, 1, MAX_MP_WORLD, &opt.world);
      else if (!strcmp(a, "--layers")) bad = take_int(a, v, 1, MAX_LAYERS, &opt.layers);
      else if (!strcmp(a, "--iters")) bad = take_int(a, v, 1, MAX_ITERS, &opt.iters);
      else if (!strcmp(a, "--warmup")) bad = take_int(a, v, 0, 1000, &opt.warmup);
      else if (!strcmp(a, "--check-tokens"))
        bad = take_int(a, v, 0, MAX_TOKENS_PER_SIZE, &opt.check_tokens);
      else if (!strcmp(a, "--seed")) bad = take_int(a, v, -1000000000, 1000000000, &opt.seed);
      else if (!strcmp(a, "--read-ahead")) bad = take_int(a, v, 0, 1, &opt.read_ahead);
      else if (!strcmp(a, "--rank")) bad = take_int(a, v, 0, MAX_MP_WORLD - 1, &opt.rank);
      else if (!strcmp(a, "--local-device")) bad = take_int(a, v, 0, 1023, &opt.local_device);
      else if (!strcmp(a, "--rendezvous-timeout"))
        bad = take_int(a, v, 1, 86400, &opt.rendezvous_timeout_s);
      else if (!strcmp(a, "--tolerance")) {
        char *end;
        opt.tolerance = strtod(v, &end);
        if (!*v || *end || !isfinite(opt.tolerance) || opt.tolerance < 0) {
          fprintf(stderr, "megamoe-host: --tolerance needs a finite number >= 0, not '%s'\n", v);
          bad = 1;
        }
      } else if (!strcmp(a, "--tokens")) {
        if (parse_tokens(v)) {
          fprintf(stderr,
                  "megamoe-host: --tokens needs 1 to %d comma-separated token counts in "
                  "[0, %d], not '%s'\n",
                  MAX_TOKEN_SIZES, MAX_TOKENS_PER_SIZE, v);
          bad = 1;
        }
      } else if (!strcmp(a, "--set")) {
        const char *eq = strchr(v, '=');
        if (!eq || eq == v) {
          fprintf(stderr, "megamoe-host: --set needs KEY=VALUE, not '%s'\n", v);
          bad = 1;
        } else if (opt.num_sets == MAX_SETS || strlen(v) >= sizeof set_buf[0]) {
          fprintf(stderr, "megamoe-host: at most %d --set options of under %zu characters\n",
                  MAX_SETS, sizeof set_buf[0]);
          bad = 1;
        } else {
          char *kv = set_buf[opt.num_sets];
          strcpy(kv, v);
          kv[eq - v] = '\0';
          opt.sets[opt.num_sets++] = (megamoe_kv){kv, kv + (eq - v) + 1};
        }
      }
      if (bad) return -1;
    }
  }
  int any_tokens = 0;
  for (int i = 0; i < opt.num_tokens; i++) any_tokens |= opt.tokens[i] > 0;
  if (!any_tokens && opt.check_tokens > 0) {
    fprintf(stderr, "megamoe-host: every --tokens size is 0, so no token is checked against the "
                    "reference\n");
    opt.check_tokens = 0;
  }
  if (opt.dump_check && opt.check_tokens <= 0) {
    fprintf(stderr, "megamoe-host: --dump-check writes the checked tokens: it needs --check-tokens "
                    "above 0 and a nonzero --tokens size\n");
    return -1;
  }
  if (!opt.rendezvous) {
    if (opt.rank >= 0 || opt.local_device >= 0 || opt.rendezvous_serve >= 0) {
      fprintf(stderr, "megamoe-host: --rank, --local-device and --[no-]rendezvous-serve need --rendezvous\n");
      return -1;
    }
    return 0;
  }
  /* multi-process mode */
  if (opt.rank < 0 || opt.world < 1 || opt.rank >= opt.world || opt.world > MAX_MP_WORLD) {
    fprintf(stderr, "megamoe-host: --rendezvous needs --rank R and --world W with 0 <= R < W <= %d\n",
            MAX_MP_WORLD);
    return -1;
  }
  if (opt.list || opt.validate) {
    fprintf(stderr, "megamoe-host: --list and --validate run without --rendezvous\n");
    return -1;
  }
  return 0;
}

/* ---- the setup both modes share ---------------------------------------------------- */
/* World, ep-size, the resolved config, the checkpoint's layers and the
 * shapes. 0, or an exit code after printing why. */
static int prepare_run(host_setup *su) {
  if (!opt.checkpoint) {
    fprintf(stderr, "megamoe-host: --checkpoint is required to run\n");
    return 2;
  }
  /* world: --world, else every visible GPU, else one CPU rank. */
  megamoe_op_attributes_args at;
  memset(&at, 0, sizeof at);
  at.struct_size = MEGAMOE_OP_ATTRIBUTES_ARGS_STRUCT_SIZE;
  report(g_api->get_attributes(&at), "get_attributes");
  su->gpus = opt.force_cpu ? 0 : at.num_cuda_devices;
  su->world = opt.world > 0 ? opt.world : su->gpus > 0 ? su->gpus : 1;
  if (opt.rendezvous) {
    if (su->gpus > 0 && opt.local_device >= su->gpus) {
      fprintf(stderr, "megamoe-host: --local-device %d, but %d GPU(s) visible\n", opt.local_device,
              su->gpus);
      return 2;
    }
  } else if (su->world > MAX_RANKS || (su->gpus > 0 && su->world > su->gpus)) {
    fprintf(stderr, "megamoe-host: --world %d needs that many GPUs (%d visible, max %d)\n", su->world,
            su->gpus, MAX_RANKS);
    return 2;
  }
  static char world_str[16];
  snprintf(world_str, sizeof world_str, "%d", su->world);
  if (!has_set("ep-size") && opt.num_sets < MAX_SETS)
    opt.sets[opt.num_sets++] = (megamoe_kv){"ep-size", world_str};
  if (opt.force_cpu && !has_set("backend") && opt.num_sets < MAX_SETS)
    opt.sets[opt.num_sets++] = (megamoe_kv){"backend", "cpu-reference"};
  /* ep-size below the world: world/ep independent expert-parallel groups */
  const char *eps = get_set("ep-size");
  char *end = NULL;
  long ep = eps ? strtol(eps, &end, 10) : 0;
  su->ep = !eps || *end || ep < 1 ? su->world : (int)ep; /* not a number: the plugin says why */
  if (su->world % su->ep) {
    fprintf(stderr, "megamoe-host: ep-size %d does not divide the world (%d ranks)\n", su->ep,
            su->world);
    return 2;
  }
  /* Shapes come from the config as the plugin resolved it. */
  megamoe_op_create_args vca = create_args(0, -1);
  if (report(g_api->validate_config(&vca), opt.config)) return 1;
  if (report(mm_st_ckpt_open(opt.checkpoint, &su->ck), "checkpoint")) return 1;
  su->num_layers = find_layers(su->ck, su->layers, MAX_LAYERS);
  if (su->num_layers == 0) {
    fprintf(stderr, "megamoe-host: %s has no model.layers.N.mlp.experts.* tensors\n",
            opt.checkpoint);
    return 1;
  }
  if (opt.layers > su->num_layers) {
    fprintf(stderr, "megamoe-host: --layers %d, but %s holds %d layer(s)\n", opt.layers,
            opt.checkpoint, su->num_layers);
    return 2;
  }
  if (opt.layers > 0) su->num_layers = opt.layers;
  if (probe_shapes(&su->H, &su->K, &su->E)) return 1;
  return 0;
}

/* ---- the threaded mode ----------------------------------------------------------------- */
static int run_threaded(host_setup *su) {
  int world = su->world, gpus = su->gpus;
  rank_work *ranks = calloc((size_t)world, sizeof *ranks);
  if (!ranks) return 1;
  uv_thread_t tids[MAX_RANKS];
  g_bar_parties = world;
  g_group = &threaded_group;
  for (int r = 0; r < world; r++) init_rank(&ranks[r], su, r, gpus > 0 ? r : -1);
  fprintf(stderr, "megamoe-host: %d rank(s) on %s, %d layer(s), hidden %d, top-%d, %d experts\n",
          world, gpus > 0 ? "GPUs" : "the CPU", su->num_layers, su->H, su->K, su->E);
  double t0 = now_s();
  for (int r = 0; r < world; r++)
    if (uv_thread_create(&tids[r], rank_main, &ranks[r])) {
      fprintf(stderr, "megamoe-host: cannot start rank %d\n", r);
      g_failed = 1;
      abort_ranks("cannot start a rank");
      world = r;
      break;
    }
  for (int r = 0; r < world; r++) uv_thread_join(&tids[r]);
  host_result res = {.rel_err = NAN, .wall_s = now_s() - t0};
  int check_failed = 1;
  if (!g_failed && opt.check_tokens > 0) {
    host_ref *ref = NULL;
    check_failed = ref_open(su->ck, su->layers[0], &ref);
    res.rel_err = 0;
    for (int r = 0; r < world && !check_failed; r++) {
      double rel;
      check_failed = ref_check(ref, &ranks[r], &rel);
      if (rel > res.rel_err) res.rel_err = rel;
    }
    if (check_failed) res.rel_err = NAN;
    ref_close(ref);
  } else if (!g_failed) {
    check_failed = 0;
  }
  res.tolerance = 0;
  for (int r = 0; r < su->world; r++)
    if (ranks[r].tolerance > res.tolerance) res.tolerance = ranks[r].tolerance;
  res.pass = !g_failed && !check_failed && (opt.check_tokens <= 0 || res.rel_err <= res.tolerance);
  res.prepare_s = ranks[0].prepare_s;
  res.plan_bytes = ranks[0].plan_device_bytes;
  for (int i = 0; i < opt.num_tokens; i++)
    for (int r = 0; r < world; r++)
      if (ranks[r].median_ms[i] > res.median_ms[i]) res.median_ms[i] = ranks[r].median_ms[i];
  print_result(&res, -1, gpus > 0 ? "cuda" : "cpu-reference", su->world, su->num_layers);
  for (int r = 0; r < su->world; r++) rank_work_release(&ranks[r]);
  free(ranks);
  return res.pass ? 0 : 1;
}

/* ---- main --------------------------------------------------------------------------------- */
int main(int argc, char **argv) {
  if (parse_args(argc, argv)) {
    usage();
    return 2;
  }
  uv_mutex_init(&g_print_lock);
  uv_mutex_init(&g_bar_lock);
  uv_cond_init(&g_bar_cond);
  g_group = &threaded_group;
  /* Multi-process: join the store first, so that every later failure of
   * this rank reaches the others (as an abort) instead of a timeout. */
  if (opt.rendezvous && mp_connect()) return 1;
  g_kv = mm_kv_store_new();
  megamoe_host_services services;
  memset(&services, 0, sizeof services);
  services.struct_size = MEGAMOE_HOST_SERVICES_STRUCT_SIZE;
  services.log = host_log;
  services.kv_put = host_kv_put;
  services.kv_get = host_kv_get;
  mm_plugin_loader *loader = mm_plugin_loader_new(&services);
  host_setup *su = calloc(1, sizeof *su);
  int rc = 0;
  if (!g_kv || !loader || !su) {
    fprintf(stderr, "megamoe-host: out of memory\n");
    rc = 1;
    goto out;
  }
  if (opt.plugin) mm_plugin_loader_load(loader, opt.plugin);
  if (opt.plugin_dir) mm_plugin_loader_scan_dir(loader, opt.plugin_dir);
  if (!opt.plugin && !opt.plugin_dir) {
    const char *env = getenv("MEGAMOE_PLUGIN_PATH");
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", env ? env : "");
    for (char *save = NULL, *d = strtok_r(buf, ":", &save); d; d = strtok_r(NULL, ":", &save))
      mm_plugin_loader_scan_dir(loader, d);
  }
  if (opt.list) {
    for (size_t i = 0; i < mm_plugin_loader_op_count(loader); i++) {
      const mm_registered_op *r = mm_plugin_loader_op_at(loader, i);
      megamoe_op_attributes_args at;
      memset(&at, 0, sizeof at);
      at.struct_size = MEGAMOE_OP_ATTRIBUTES_ARGS_STRUCT_SIZE;
      megamoe_error *e = r->api->get_attributes(&at);
      printf("%s %u.%u  (%s)  caps 0x%x, %d GPU(s), %s\n", r->name, r->version_major,
             r->version_minor, r->plugin_path, e ? 0 : at.capabilities,
             e ? 0 : at.num_cuda_devices, e ? megamoe_error_message(e) : at.build_info);
      megamoe_error_destroy(e);
    }
  }
  const mm_registered_op *reg = mm_plugin_loader_find(loader, "megamoe_fp4");
  if (!reg) {
    if (!opt.list) fprintf(stderr, "megamoe-host: no plugin registered op 'megamoe_fp4'\n");
    rc = opt.list ? 0 : 1;
    goto out;
  }
  g_api = reg->api;
  if (!opt.config) {
    if (!opt.list) {
      fprintf(stderr, "megamoe-host: --config is required\n");
      rc = 2;
    }
    goto out;
  }
  if (opt.validate) {
    megamoe_op_create_args ca = create_args(0, -1);
    megamoe_error *e = g_api->validate_config(&ca);
    if (e) {
      fprintf(stderr, "%s\n", megamoe_error_message(e));
      megamoe_error_destroy(e);
      rc = 1;
    } else {
      printf("%s: valid\n", opt.config);
    }
    goto out;
  }
  rc = prepare_run(su);
  if (!rc && !opt.rendezvous) rc = run_threaded(su);
out:
  if (opt.rendezvous) {
    /* Every rank reports, including one whose setup failed. */
    if (rc) {
      char why[96];
      snprintf(why, sizeof why, "rank %d: setup failed (see its log)", opt.rank);
      mp_abort(why);
    }
    int mrc = mp_run(rc ? NULL : su);
    rc = rc ? rc : mrc;
  }
  if (su) mm_st_ckpt_close(su->ck);
  free(su);
  mm_plugin_loader_free(loader);
  mm_kv_store_free(g_kv);
  return rc;
}

/* plugin_loader.c -- dlopen, ABI probing and the op registry of the host. */
#include "plugin_loader.h"

#include <dirent.h>
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <uv.h>

#define MAX_PLUGINS 64
#define MAX_OPS 64

typedef struct {
  uv_lib_t lib;
  char *path;
  void (*finalize)(void);
} loaded_plugin;

struct mm_plugin_loader {
  megamoe_host_services services;
  loaded_plugin plugins[MAX_PLUGINS];
  int num_plugins;
  mm_registered_op ops[MAX_OPS];
  size_t num_ops;
  const char *loading_path; /* plugin being initialized, for registration */
};

/* The registry callback: plugin -> host. host_ctx is the loader. */
static int register_op(void *host_ctx, const megamoe_op_registration *reg) {
  mm_plugin_loader *l = host_ctx;
  if (!reg || reg->struct_size < MEGAMOE_OP_REGISTRATION_STRUCT_SIZE || !reg->name || !reg->api)
    return -1;
  /* This host calls up to validate_config: a shorter table is refused here
   * rather than called past its end. */
  if (reg->api->struct_size < MEGAMOE_STRUCT_SIZE(megamoe_op_api, validate_config) ||
      reg->api->abi_major != MEGAMOE_ABI_MAJOR) {
    fprintf(stderr, "megamoe-host: %s: op '%s' has an incompatible op table (ABI %u.%u)\n",
            l->loading_path, reg->name, reg->api->abi_major, reg->api->abi_minor);
    return -1;
  }
  if (mm_plugin_loader_find(l, reg->name)) {
    fprintf(stderr, "megamoe-host: %s: op '%s' is already registered by %s; keeping the first\n",
            l->loading_path, reg->name, mm_plugin_loader_find(l, reg->name)->plugin_path);
    return -1;
  }
  if (l->num_ops == MAX_OPS || strlen(reg->name) >= sizeof l->ops[0].name) return -1;
  mm_registered_op *op = &l->ops[l->num_ops++];
  snprintf(op->name, sizeof op->name, "%s", reg->name);
  op->version_major = reg->version_major;
  op->version_minor = reg->version_minor;
  op->api = reg->api;
  op->plugin_path = l->loading_path;
  return 0;
}

mm_plugin_loader *mm_plugin_loader_new(const megamoe_host_services *services) {
  mm_plugin_loader *l = calloc(1, sizeof *l);
  if (!l) return NULL;
  if (services) l->services = *services;
  l->services.struct_size = MEGAMOE_HOST_SERVICES_STRUCT_SIZE;
  l->services.register_op = register_op;
  return l;
}

int mm_plugin_loader_load(mm_plugin_loader *l, const char *path) {
  if (l->num_plugins == MAX_PLUGINS) {
    fprintf(stderr, "megamoe-host: %s: too many plugins (%d)\n", path, MAX_PLUGINS);
    return -1;
  }
  for (int i = 0; i < l->num_plugins; i++)
    if (strcmp(l->plugins[i].path, path) == 0) return 0; /* already loaded */
  loaded_plugin *p = &l->plugins[l->num_plugins];
  memset(p, 0, sizeof *p);
  struct stat st; /* dlopen of a FIFO would block forever */
  if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
    fprintf(stderr, "megamoe-host: skipping %s: not a regular file\n", path);
    return -1;
  }
  if (uv_dlopen(path, &p->lib)) {
    fprintf(stderr, "megamoe-host: skipping %s: %s\n", path, uv_dlerror(&p->lib));
    uv_dlclose(&p->lib);
    return -1;
  }
  /* Probe entry points from the newest major this host knows. */
  megamoe_plugin_init_v1_fn init_v1 = NULL;
  if (uv_dlsym(&p->lib, MEGAMOE_PLUGIN_INIT_V1_SYMBOL, (void **)&init_v1) || !init_v1) {
    fprintf(stderr, "megamoe-host: skipping %s: no %s (not a megamoe plugin, or too new)\n", path,
            MEGAMOE_PLUGIN_INIT_V1_SYMBOL);
    uv_dlclose(&p->lib);
    return -1;
  }
  p->path = strdup(path);
  if (!p->path) {
    uv_dlclose(&p->lib);
    return -1;
  }
  megamoe_plugin_init_args args;
  memset(&args, 0, sizeof args);
  args.struct_size = MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE;
  args.host_abi_major = MEGAMOE_ABI_MAJOR;
  args.host_abi_minor = MEGAMOE_ABI_MINOR;
  l->services.host_ctx = l;
  args.services = &l->services;
  l->loading_path = p->path;
  size_t ops_before = l->num_ops;
  megamoe_error *err = init_v1(&args);
  l->loading_path = NULL;
  if (err) {
    l->num_ops = ops_before; /* its tables die with the library */
    fprintf(stderr, "megamoe-host: skipping %s: init failed: %s\n", path,
            megamoe_error_message(err));
    megamoe_error_destroy(err);
    free(p->path);
    uv_dlclose(&p->lib);
    return -1;
  }
  p->finalize = args.finalize;
  l->num_plugins++;
  return 0;
}

int mm_plugin_loader_scan_dir(mm_plugin_loader *l, const char *dir) {
  DIR *d = opendir(dir);
  if (!d) {
    fprintf(stderr, "megamoe-host: cannot read plugin directory %s\n", dir);
    return 0;
  }
  char *names[256];
  int n = 0;
  struct dirent *de;
  while ((de = readdir(d)) && n < 256)
    if (fnmatch("lib*_plugin.so", de->d_name, 0) == 0) names[n++] = strdup(de->d_name);
  closedir(d);
  /* Sorted, so the choice between duplicate op names is stable. */
  for (int i = 1; i < n; i++)
    for (int j = i; j > 0 && names[j] && names[j - 1] && strcmp(names[j - 1], names[j]) > 0; j--) {
      char *t = names[j];
      names[j] = names[j - 1];
      names[j - 1] = t;
    }
  int loaded = 0;
  for (int i = 0; i < n; i++) {
    if (!names[i]) continue;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, names[i]);
    loaded += mm_plugin_loader_load(l, path) == 0;
    free(names[i]);
  }
  return loaded;
}

size_t mm_plugin_loader_op_count(const mm_plugin_loader *l) { return l->num_ops; }
const mm_registered_op *mm_plugin_loader_op_at(const mm_plugin_loader *l, size_t i) {
  return i < l->num_ops ? &l->ops[i] : NULL;
}
const mm_registered_op *mm_plugin_loader_find(const mm_plugin_loader *l, const char *name) {
  for (size_t i = 0; i < l->num_ops; i++)
    if (strcmp(l->ops[i].name, name) == 0) return &l->ops[i];
  return NULL;
}

void mm_plugin_loader_free(mm_plugin_loader *l) {
  if (!l) return;
  for (int i = l->num_plugins - 1; i >= 0; i--) {
    if (l->plugins[i].finalize) l->plugins[i].finalize();
    uv_dlclose(&l->plugins[i].lib);
    free(l->plugins[i].path);
  }
  free(l);
}

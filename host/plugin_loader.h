/* plugin_loader.h -- how an engine finds and loads megamoe-style plugins:
 * one file (--plugin), or directories scanned for lib*_plugin.so (--plugin-dir,
 * MEGAMOE_PLUGIN_PATH colon-separated). Each library is dlopened (libuv
 * uv_dlopen), its newest known entry symbol is probed (megamoe_plugin_init_v1),
 * and it registers its ops into the loader's registry. A library that fails
 * to load, lacks the symbol or fails init is reported and skipped. */
#ifndef MM_PLUGIN_LOADER_H
#define MM_PLUGIN_LOADER_H

#include <stddef.h>

#include "megamoe_plugin.h"

typedef struct mm_registered_op {
  char name[64];
  uint32_t version_major, version_minor;
  const megamoe_op_api *api;
  const char *plugin_path; /* owned by the loader */
} mm_registered_op;

typedef struct mm_plugin_loader mm_plugin_loader;

/* services: the host services to hand to plugins (register_op is replaced by
 * the loader's own). */
mm_plugin_loader *mm_plugin_loader_new(const megamoe_host_services *services);
void mm_plugin_loader_free(mm_plugin_loader *l); /* finalizes and unloads */

/* Loads one library; returns 0 on success, else prints why to stderr. */
int mm_plugin_loader_load(mm_plugin_loader *l, const char *path);
/* Scans a directory for lib*_plugin.so; returns the number loaded. */
int mm_plugin_loader_scan_dir(mm_plugin_loader *l, const char *dir);

size_t mm_plugin_loader_op_count(const mm_plugin_loader *l);
const mm_registered_op *mm_plugin_loader_op_at(const mm_plugin_loader *l, size_t i);
const mm_registered_op *mm_plugin_loader_find(const mm_plugin_loader *l, const char *name);

#endif

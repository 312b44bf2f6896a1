/* entry.c -- the exported ABI entry point: negotiates the ABI version, keeps
 * a copy of the host's services, registers the operator, routes log lines
 * (filtered by the level of the op whose call is logging, docs/CONFIG.md
 * "log-level"). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "env_knobs.h"
#include "megamoe_plugin.h"
#include "op_api.h"
#include "status.h"

#define MM_PLUGIN_VERSION "0.1.0"

static megamoe_host_services g_services;
static int g_initialized;
/* MEGAMOE_LOG_LEVEL, read at init: overrides every op's log-level; -1 unset. */
static int g_env_log_level = -1;
/* The log-level of the op whose ABI call runs on this thread; -1 outside one. */
static _Thread_local int t_op_log_level = -1;

const megamoe_host_services *mm_host_services(void) { return g_initialized ? &g_services : NULL; }
int mm_plugin_initialized(void) { return g_initialized; }

int mm_log_scope_enter(int op_log_level) {
  const int prev = t_op_log_level;
  t_op_log_level = op_log_level;
  return prev;
}
void mm_log_scope_leave(int prev) { t_op_log_level = prev; }

void mm_log(int level, const char *fmt, ...) {
  const int limit = g_env_log_level >= 0 ? g_env_log_level
                    : t_op_log_level >= 0 ? t_op_log_level
                                          : MEGAMOE_LOG_INFO;
  if (level > limit) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (g_initialized && g_services.log) {
    g_services.log(g_services.host_ctx, (megamoe_log_level)level, msg);
  } else {
    static const char *names[] = {"error", "warn", "info", "debug"};
    fprintf(stderr, "megamoe %s: %s\n", names[level < 0 ? 0 : level > 3 ? 3 : level], msg);
  }
}

static void warn_env(void *ctx, const char *msg) {
  (void)ctx;
  mm_log(MEGAMOE_LOG_WARN, "%s", msg);
}

static void plugin_finalize(void) {
  mm_op_registry_shutdown();
  memset(&g_services, 0, sizeof g_services);
  g_initialized = 0;
}

MEGAMOE_EXPORT megamoe_error *megamoe_plugin_init_v1(megamoe_plugin_init_args *args) {
  if (!args) return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "init: args is NULL");
  if (args->struct_size < MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "init: args->struct_size %zu is smaller than the ABI 1.0 size %zu",
                    args->struct_size, (size_t)MEGAMOE_PLUGIN_INIT_ARGS_STRUCT_SIZE);
  if (args->host_abi_major != MEGAMOE_ABI_MAJOR)
    return mm_error(MEGAMOE_CODE_FAILED_PRECONDITION,
                    "init: host speaks ABI major %u, megamoe_plugin_init_v1 implements major %d",
                    args->host_abi_major, MEGAMOE_ABI_MAJOR);
  const megamoe_host_services *s = args->services;
  if (!s) return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "init: services is NULL");
  if (s->struct_size < MEGAMOE_HOST_SERVICES_STRUCT_SIZE)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "init: services->struct_size %zu is smaller than the ABI 1.0 size %zu",
                    s->struct_size, (size_t)MEGAMOE_HOST_SERVICES_STRUCT_SIZE);
  if (!s->register_op)
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT, "init: services->register_op is required");
  if ((s->device_alloc == NULL) != (s->device_free == NULL))
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "init: services->device_alloc and device_free must be given together");
  if ((s->kv_put == NULL) != (s->kv_get == NULL))
    return mm_error(MEGAMOE_CODE_INVALID_ARGUMENT,
                    "init: services->kv_put and kv_get must be given together");
  /* Copy what this build knows; a newer host's tail is ignored. */
  memset(&g_services, 0, sizeof g_services);
  memcpy(&g_services, s, s->struct_size < sizeof g_services ? s->struct_size : sizeof g_services);
  g_services.struct_size = sizeof g_services;
  g_initialized = 1;
  g_env_log_level = mm_env_log_level();
  mm_env_knobs_check_process(warn_env, NULL);

  megamoe_op_registration reg = {MEGAMOE_OP_REGISTRATION_STRUCT_SIZE, NULL, "megamoe_fp4", 1, 0,
                                 mm_op_api()};
  uint32_t registered = 0;
  if (g_services.register_op(g_services.host_ctx, &reg) == 0) registered++;
  else mm_log(MEGAMOE_LOG_WARN, "host refused the registration of op 'megamoe_fp4'");

  args->plugin_name = "megamoe";
  args->plugin_version = MM_PLUGIN_VERSION;
  args->plugin_abi_minor = MEGAMOE_ABI_MINOR;
  args->num_ops_registered = registered;
  args->finalize = plugin_finalize;
  return NULL;
}

/* env_knobs.h -- the plugin's environment variables (docs/CONFIG.md,
 * "Environment variables"): one table of their names and the values each
 * takes, so that a misspelt name or a value its reader would ignore is
 * reported in the host's log at init instead of passing in silence. The
 * readers stay where the knobs are used. */
#ifndef MM_ENV_KNOBS_H
#define MM_ENV_KNOBS_H

typedef void (*mm_env_warn_fn)(void *ctx, const char *msg);

/* Checks envp's (NULL-terminated "NAME=VALUE" strings) MEGAMOE_* entries:
 *   - a knob of the table whose value it does not take;
 *   - a name within two edits of a knob's (a typo: "did you mean");
 *   - a name under MEGAMOE_SM90_, which only the plugin's knobs use.
 * Other MEGAMOE_* names (the hosts' and the tests' own) pass. One message
 * per finding through warn; returns the number of findings. */
int mm_env_knobs_check(char *const *envp, mm_env_warn_fn warn, void *ctx);

/* The process's environment, the same way. */
int mm_env_knobs_check_process(mm_env_warn_fn warn, void *ctx);

/* MEGAMOE_LOG_LEVEL: 0-3 for error, warn, info, debug (names or digits);
 * -1 when unset or not one of those (the check above reports the latter). */
int mm_env_log_level(void);

/* Name of knob i of the table, NULL past its end (for tests). */
const char *mm_env_knob_name(int i);

#endif

/* op_registry.h -- the live ops and the handles the host holds for them.
 * A handle is a generation-tagged slot number, never the op's address, so a
 * stale handle (after destroy) is refused even when a later create gets the
 * same memory. Thread-safe. */
#ifndef MM_OP_REGISTRY_H
#define MM_OP_REGISTRY_H

#include "backend.h"
#include "megamoe_plugin.h"

/* Registers op and returns its handle; NULL when out of memory. */
megamoe_op *mm_registry_add(mm_op *op);
/* The live op of a handle, or NULL (NULL, stale or foreign handle). */
mm_op *mm_registry_get(const megamoe_op *handle);
/* Unregisters and returns the op of a live handle, or NULL. */
mm_op *mm_registry_remove(const megamoe_op *handle);
/* Unregisters and returns any live op (NULL when none): for finalize. */
mm_op *mm_registry_pop_any(void);
/* Frees the table when no op is live (finalize; the plugin may be unloaded
 * next). Generations keep counting, so earlier handles stay stale. */
void mm_registry_release(void);

#endif

/* op_api.h -- the megamoe_fp4 op table and the registry of live op handles. */
#ifndef MM_OP_API_H
#define MM_OP_API_H

#include "megamoe_plugin.h"

const megamoe_op_api *mm_op_api(void);
/* Destroys every op still alive (called by finalize). */
void mm_op_registry_shutdown(void);
int mm_plugin_initialized(void);

#endif

/* moe_sm90_wgmma.cu -- the WGMMA product path (placeholder until it lands). */
#include "moe_sm90_impl.h"

const char *mm_sm90_wgmma_unsupported(const mm_sm90_layer *L) {
  (void)L;
  return "not built yet";
}

mm_err *mm_sm90_run_wgmma(const mm_sm90_layer *L, const mm_expert_pool *pool, float clamp,
                          const mm_sm90_ws *ws, cudaStream_t stream) {
  return mm_error(MEGAMOE_CODE_UNIMPLEMENTED, "sm90 WGMMA path not built yet");
}

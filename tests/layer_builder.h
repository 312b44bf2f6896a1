/* layer_builder.h -- one synthetic MoE layer's checkpoint tensors (gate, up
 * and down projections of every expert: FP4 codes, scales in one of the
 * encodings the loader accepts, NVFP4's global and input scales), appended
 * to a tensor_list.h list. The caller picks the name prefix, the sizes and
 * how scale bytes and the NVFP4 per-tensor scales are drawn. */
#ifndef MM_TEST_LAYER_BUILDER_H
#define MM_TEST_LAYER_BUILDER_H

#include <math.h>
#include <string.h>

#include "harness.h"
#include "tensor_list.h"

/* Scale encodings: NVFP4 (E4M3 per 16), MXFP4 UE8M0 per 32 as U8 bytes, as
 * F8_E8M0, packed four to an I32, as FP32 powers of two; UE8M0 per 16 as
 * bytes, packed I32, FP32. */
typedef enum {
  LB_NVFP4,
  LB_MX_U8,
  LB_MX_E8M0,
  LB_MX_I32,
  LB_MX_F32,
  LB_UE8M0_G16,
  LB_G16_I32,
  LB_G16_F32
} lb_fmt;

static inline int lb_group(lb_fmt f) {
  return f == LB_NVFP4 || f == LB_UE8M0_G16 || f == LB_G16_I32 || f == LB_G16_F32 ? 16 : 32;
}

typedef struct {
  const char *prefix;      /* before "mlp.experts.", e.g. "model.layers.1." or "" */
  int experts, hidden, inter;
  uint8_t (*scale_byte)(lb_fmt f); /* an E4M3 byte (NVFP4) or a UE8M0 exponent */
  /* NVFP4 only: weight_scale_2 and input_scale of expert e, projection p
   * (0 gate, 1 up, 2 down); L holds every tensor added so far */
  float (*global_scale)(const layer_t *L, int e, int p);
  float (*input_scale)(int e, int p);
} lb_opts;

static void lb_make_layer(layer_t *L, lb_fmt f, const lb_opts *o) {
  static const char *pn[3] = {"gate_proj", "up_proj", "down_proj"};
  /* (no H / I locals: the including tests define those as macros) */
  uint8_t *bytes = (uint8_t *)malloc((size_t)o->hidden * o->inter / 16);
  L->n = 0;
  for (int e = 0; e < o->experts; e++)
    for (int p = 0; p < 3; p++) {
      const int N = p == 2 ? o->hidden : o->inter, K = p == 2 ? o->inter : o->hidden;
      const int ng = K / lb_group(f);
      char nm[96];
      snprintf(nm, sizeof nm, "%smlp.experts.%d.%s.weight", o->prefix, e, pn[p]);
      uint8_t *w = (uint8_t *)add(L, nm, MM_DT_U8, 2, N, K / 2, (size_t)N * K / 2)->data;
      for (int i = 0; i < N * K / 2; i++) w[i] = (uint8_t)mm_test_rand_u64();
      snprintf(nm, sizeof nm, "%smlp.experts.%d.%s.weight_scale", o->prefix, e, pn[p]);
      for (int i = 0; i < N * ng; i++) bytes[i] = o->scale_byte(f);
      if (f == LB_NVFP4 || f == LB_MX_U8 || f == LB_MX_E8M0 || f == LB_UE8M0_G16) {
        mm_dtype dt = f == LB_NVFP4 ? MM_DT_F8_E4M3 : f == LB_MX_E8M0 ? MM_DT_F8_E8M0 : MM_DT_U8;
        memcpy((void *)add(L, nm, dt, 2, N, ng, (size_t)N * ng)->data, bytes, (size_t)N * ng);
      } else if (f == LB_MX_I32 || f == LB_G16_I32) {
        int words = (ng + 3) / 4;
        uint8_t *d = (uint8_t *)add(L, nm, MM_DT_I32, 2, N, words, (size_t)N * words * 4)->data;
        for (int r = 0; r < N; r++) memcpy(d + (size_t)r * words * 4, bytes + r * ng, (size_t)ng);
      } else {
        float *d = (float *)add(L, nm, MM_DT_F32, 2, N, ng, (size_t)N * ng * 4)->data;
        for (int i = 0; i < N * ng; i++) d[i] = ldexpf(1.0f, bytes[i] - 127);
      }
      if (f == LB_NVFP4) {
        snprintf(nm, sizeof nm, "%smlp.experts.%d.%s.weight_scale_2", o->prefix, e, pn[p]);
        const float gs = o->global_scale(L, e, p);
        *(float *)add(L, nm, MM_DT_F32, 0, 0, 0, 4)->data = gs;
        snprintf(nm, sizeof nm, "%smlp.experts.%d.%s.input_scale", o->prefix, e, pn[p]);
        *(float *)add(L, nm, MM_DT_F32, 1, 1, 0, 4)->data = o->input_scale(e, p);
      }
    }
  free(bytes);
}

#endif

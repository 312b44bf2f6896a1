/* backend_cpu.c -- the cpu-reference backend: keeps the canonical weights and
 * runs the reference layer (ref_moe.c). One rank that owns every expert. It
 * allocates its scratch per call: "nothing allocates after plan" is a promise
 * of the cuda backend, not of this oracle. */
#include <stdlib.h>
#include <strings.h>

#include "backend.h"
#include "ref_moe.h"
#include "weights_load.h"

static mm_err *cpu_init(mm_op *op) { return NULL; }

static mm_err *cpu_prepare_layer(mm_op *op, int layer, mm_expert_q *experts, int num_local,
                                 void *stream) {
  op->layers[layer].experts = experts;
  return NULL;
}

/* MEGAMOE_CPU_REQUANT=backend (for tests): this backend runs requant.policy's
 * group16 -> group32 requant itself, after the load, as the cuda backend's
 * GPU requant does. So the op's deferred-requant path (op.c,
 * MM_LOAD_DEFER_REQUANT, mm_requant_report_finish) runs on machines without
 * a GPU; it must give what the loader's requant (the default) gives. */
static int cpu_requants_itself(mm_op *op) {
  const char *v = getenv("MEGAMOE_CPU_REQUANT");
  return v && strcasecmp(v, "backend") == 0;
}

static mm_err *cpu_prepare_layer_requant(mm_op *op, int layer, mm_expert_q *experts,
                                         int num_local, mm_requant_stats *stats, void *stream) {
  for (int e = 0; e < num_local; e++) {
    mm_expert_q g32;
    mm_err *err = mm_requant_expert(&op->cfg, op->first_local_expert + e, &experts[e], &g32,
                                    stats + 3 * (size_t)e);
    if (err) {
      mm_experts_free(experts, num_local); /* the contract: freed on error */
      return err;
    }
    mm_qmat_free(&experts[e].w13);
    mm_qmat_free(&experts[e].w2);
    experts[e] = g32;
  }
  return cpu_prepare_layer(op, layer, experts, num_local, stream);
}

static mm_err *cpu_plan(mm_op *op, int max_tokens, void *stream, uint64_t *device_bytes,
                        uint64_t *host_bytes) {
  *device_bytes = 0;
  *host_bytes = 0;
  return NULL;
}

static mm_err *cpu_execute(mm_op *op, int layer, const mm_exec_io *io) {
  const mm_model_config *m = &op->cfg.model;
  mm_ref_layer_args a = {
      .T = io->T,
      .H = m->hidden_size,
      .I = m->moe_intermediate_size,
      .top_k = m->top_k,
      .num_experts = m->num_experts,
      .first_expert = op->first_local_expert,
      .num_local = op->num_local_experts,
      .experts = op->layers[layer].experts,
      .hidden = io->hidden,
      .topk_ids = io->topk_ids,
      .topk_weights = io->topk_weights,
      .routed_scaling_factor = (float)m->routed_scaling_factor,
      .activation_clamp = (float)m->activation_clamp,
      .threads = op->cfg.cpu_threads,
      .out = io->out,
      .out_f32 = NULL,
  };
  return mm_ref_moe_layer(&a);
}

static void cpu_destroy(mm_op *op) {}

/* The reference itself: the weights as the checkpoint holds them (or
 * requantized), products and sums in float64. */
static void cpu_numerics(const mm_op *op, const char **weight_mode, double *error_bound) {
  (void)op;
  *weight_mode = "reference";
  *error_bound = 0;
}

const mm_backend_ops mm_backend_cpu = {
    .name = "cpu-reference",
    .init = cpu_init,
    .prepare_layer = cpu_prepare_layer,
    .plan = cpu_plan,
    .execute = cpu_execute,
    .destroy = cpu_destroy,
    .release_layer = NULL,
    .check = NULL, /* synchronous: errors are returned by execute itself */
    .requants_itself = cpu_requants_itself,
    .prepare_layer_requant = cpu_prepare_layer_requant,
    .numerics = cpu_numerics,
};

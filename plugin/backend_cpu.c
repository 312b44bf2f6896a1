/* backend_cpu.c -- the cpu-reference backend: keeps the canonical weights and
 * runs the reference layer (ref_moe.c). One rank that owns every expert. It
 * allocates its scratch per call: "nothing allocates after plan" is a promise
 * of the cuda backend, not of this oracle. */
#include "backend.h"
#include "ref_moe.h"

static mm_err *cpu_init(mm_op *op) { return NULL; }

static mm_err *cpu_prepare_layer(mm_op *op, int layer, mm_expert_q *experts, int num_local,
                                 void *stream) {
  op->layers[layer].experts = experts;
  return NULL;
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

const mm_backend_ops mm_backend_cpu = {
    .name = "cpu-reference",
    .init = cpu_init,
    .prepare_layer = cpu_prepare_layer,
    .plan = cpu_plan,
    .execute = cpu_execute,
    .destroy = cpu_destroy,
    .release_layer = NULL,
    .check = NULL, /* synchronous: errors are returned by execute itself */
};

/* layer_reader.h -- one checkpoint layer's expert tensors read into host
 * memory as named host DLTensors, the reads running on libuv's thread pool:
 * megamoe-host starts the next layer's reads before it hands this one to
 * prepare_weights, so that the disk and the plugin work at the same time
 * (--read-ahead; docs/HOST.md). */
#ifndef MM_HOST_LAYER_READER_H
#define MM_HOST_LAYER_READER_H

#include <stddef.h>

#include "megamoe_plugin.h"
#include "safetensors.h"

typedef struct host_layer host_layer;

/* Starts reading the tensors of experts [first, first + n) of checkpoint
 * layer `cl`, "model.layers.{cl}.mlp.experts.{e}.{gate,up,down}_proj.
 * {weight,weight_scale,weight_scale_2,input_scale}", named for the op as
 * "experts.{e}.{proj}_proj.{suffix}" (an absent one is left out: the op
 * names what it misses). NULL, after printing why, when out of host memory.
 * Only the calling thread may wait for or free the result. */
host_layer *host_layer_read(const mm_st_ckpt *ck, int cl, int first, int n);

/* Waits for every read; then the tensors hold the data. NULL, or the first
 * failed read's error (in tensor order; the caller frees it). */
megamoe_error *host_layer_wait(host_layer *l);

/* The tensors (valid until host_layer_free), and their bytes. */
const megamoe_named_tensor *host_layer_tensors(const host_layer *l, size_t *count);
double host_layer_bytes(const host_layer *l);

/* Waits for reads still running, then frees. NULL is fine. */
void host_layer_free(host_layer *l);

#endif

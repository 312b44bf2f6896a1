/* tensor_list.h -- a list of named host tensors that a test builds one by one
 * and hands to the weight loader. Define MAXT (capacity) before including. */
#ifndef MM_TEST_TENSOR_LIST_H
#define MM_TEST_TENSOR_LIST_H

#include <stdio.h>
#include <stdlib.h>

#include "tensor_view.h"

typedef struct {
  int n;
  mm_tensor_view v[MAXT];
  char names[MAXT][64];
  void *data[MAXT];
} layer_t;

/* Appends a zeroed tensor of `bytes` bytes, shape [a, b] (ndim 0..2). */
static mm_tensor_view *add(layer_t *L, const char *name, mm_dtype dt, int ndim, int64_t a,
                           int64_t b, size_t bytes) {
  mm_tensor_view *t = &L->v[L->n];
  snprintf(L->names[L->n], sizeof L->names[0], "%s", name);
  L->data[L->n] = calloc(bytes + 1, 1);
  t->name = L->names[L->n];
  t->dtype = dt;
  t->ndim = ndim;
  t->shape[0] = a;
  t->shape[1] = b;
  t->data = L->data[L->n];
  t->on_device = 0;
  L->n++;
  return t;
}

static void free_layer(layer_t *L) {
  for (int i = 0; i < L->n; i++) free(L->data[i]);
  L->n = 0;
}

#endif

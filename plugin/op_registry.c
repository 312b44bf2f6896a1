/* op_registry.c -- slots with generations under one libuv mutex. */
#include "op_registry.h"

#include <stdint.h>
#include <stdlib.h>
#include <uv.h>

_Static_assert(sizeof(uintptr_t) >= 8, "handles pack a 32-bit generation and slot");

typedef struct {
  mm_op *op;     /* NULL: free slot */
  uint32_t gen;  /* generation of the registration held */
} slot;

static uv_once_t g_once = UV_ONCE_INIT;
static uv_mutex_t g_lock;
static slot *g_slots;
static size_t g_num_slots, g_cap;
/* One counter for all slots, kept across finalize and re-init (the table
 * itself is freed), so no handle ever names a later registration. */
static uint32_t g_last_gen;

static void init_lock(void) { uv_mutex_init(&g_lock); }

static megamoe_op *handle_of(size_t index, uint32_t gen) {
  return (megamoe_op *)(uintptr_t)(((uint64_t)gen << 32) | (uint64_t)(index + 1));
}

/* Slot index of a handle whose generation matches, or SIZE_MAX. Lock held. */
static size_t find(const megamoe_op *h) {
  uint64_t v = (uint64_t)(uintptr_t)h;
  uint64_t index = (v & 0xFFFFFFFFu) - 1;
  uint32_t gen = (uint32_t)(v >> 32);
  if (!h || index >= g_num_slots || !g_slots[index].op || g_slots[index].gen != gen)
    return SIZE_MAX;
  return (size_t)index;
}

megamoe_op *mm_registry_add(mm_op *op) {
  uv_once(&g_once, init_lock);
  uv_mutex_lock(&g_lock);
  size_t i = 0;
  while (i < g_num_slots && g_slots[i].op) i++;
  if (i == g_num_slots && g_num_slots == g_cap) {
    size_t cap = g_cap ? g_cap * 2 : 16;
    slot *grown = cap < 0xFFFFFFFFu ? realloc(g_slots, cap * sizeof *grown) : NULL;
    if (!grown) {
      uv_mutex_unlock(&g_lock);
      return NULL;
    }
    g_slots = grown;
    g_cap = cap;
  }
  if (i == g_num_slots) g_slots[g_num_slots++] = (slot){NULL, 0};
  g_slots[i].op = op;
  if (++g_last_gen == 0) g_last_gen = 1;
  g_slots[i].gen = g_last_gen;
  megamoe_op *h = handle_of(i, g_slots[i].gen);
  uv_mutex_unlock(&g_lock);
  return h;
}

mm_op *mm_registry_get(const megamoe_op *h) {
  uv_once(&g_once, init_lock);
  uv_mutex_lock(&g_lock);
  size_t i = find(h);
  mm_op *op = i == SIZE_MAX ? NULL : g_slots[i].op;
  uv_mutex_unlock(&g_lock);
  return op;
}

mm_op *mm_registry_remove(const megamoe_op *h) {
  uv_once(&g_once, init_lock);
  uv_mutex_lock(&g_lock);
  size_t i = find(h);
  mm_op *op = NULL;
  if (i != SIZE_MAX) {
    op = g_slots[i].op;
    g_slots[i].op = NULL;
  }
  uv_mutex_unlock(&g_lock);
  return op;
}

mm_op *mm_registry_pop_any(void) {
  uv_once(&g_once, init_lock);
  uv_mutex_lock(&g_lock);
  mm_op *op = NULL;
  for (size_t i = 0; i < g_num_slots && !op; i++)
    if (g_slots[i].op) {
      op = g_slots[i].op;
      g_slots[i].op = NULL;
    }
  uv_mutex_unlock(&g_lock);
  return op;
}

void mm_registry_release(void) {
  uv_once(&g_once, init_lock);
  uv_mutex_lock(&g_lock);
  int empty = 1;
  for (size_t i = 0; i < g_num_slots; i++) empty &= g_slots[i].op == NULL;
  if (empty) {
    free(g_slots);
    g_slots = NULL;
    g_num_slots = g_cap = 0;
  }
  uv_mutex_unlock(&g_lock);
}

/* ep_ipc.c -- set-up of the CUDA IPC low-latency transport (see ep_ipc.h). */
#include "ep_ipc.h"

#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "backend.h" /* mm_log */
#include "megamoe_plugin.h"

struct mm_ep_ipc {
  int rank, ranks, device;
  uint8_t *base; /* this rank's buffer (cudaMalloc) */
  uint64_t bytes;
  int64_t table_off; /* the device peer table inside base */
  void **opened; /* [R] peers opened with cudaIpcOpenMemHandle (NULL: self, same process) */
  mm_ep_ipc_dev dev;
  uint64_t group; /* in-process group key (0: not registered) */
};

/* Buffers of ranks in one process outlive their engines until every rank of
 * that process has destroyed its own: a peer that is still running (late, or
 * failing on its own timeout) pushes flags and rows into this buffer through
 * its raw pointer, and a freed buffer would turn those stores into illegal
 * addresses on the peer's GPU, poisoning its context. (Peers in other
 * processes hold IPC mappings; the driver keeps the memory until they close.) */
typedef struct ipc_group {
  uint64_t key;
  int live;           /* ranks of this process not yet destroyed */
  int n;              /* buffers parked so far */
  uint8_t *buf[64];
  int dev[64];
  struct ipc_group *next;
} ipc_group;
static pthread_mutex_t g_groups_lock = PTHREAD_MUTEX_INITIALIZER;
static ipc_group *g_groups;

static void group_join(uint64_t key, int live) {
  pthread_mutex_lock(&g_groups_lock);
  ipc_group *g = g_groups;
  while (g && g->key != key) g = g->next;
  if (!g && (g = calloc(1, sizeof *g))) {
    g->key = key;
    g->live = live;
    g->next = g_groups;
    g_groups = g;
  }
  pthread_mutex_unlock(&g_groups_lock);
}

/* Parks x's buffer in its group; frees the group's buffers when x is the last. */
static void group_leave(mm_ep_ipc *x) {
  pthread_mutex_lock(&g_groups_lock);
  ipc_group **pg = &g_groups;
  while (*pg && (*pg)->key != x->group) pg = &(*pg)->next;
  ipc_group *g = *pg;
  if (g && g->n < 64) {
    g->buf[g->n] = x->base;
    g->dev[g->n++] = x->device;
    x->base = NULL;
  }
  if (g && --g->live <= 0) {
    *pg = g->next;
    for (int i = 0; i < g->n; i++)
      if (cudaSetDevice(g->dev[i]) == cudaSuccess) cudaFree(g->buf[i]);
    cudaGetLastError();
    free(g);
    cudaSetDevice(x->device);
  }
  pthread_mutex_unlock(&g_groups_lock);
}

/* The record every rank contributes to the set-up all-gather. */
typedef struct ipc_info {
  char host[64];
  uint64_t process; /* per-process nonce */
  int32_t pid, device;
  char bus[32];
  int32_t want, ok; /* asks for IPC; its buffer exists */
  int32_t has_handle; /* its IPC handle exists (needed by other processes only) */
  int32_t ll_tokens, row_bytes, hidden, top_k;
  uint64_t bytes, ptr;
  cudaIpcMemHandle_t handle;
} ipc_info;

static size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

const char *mm_ep_transport_name(mm_ep_transport t) {
  switch (t) {
    case MM_EP_TRANSPORT_NCCL: return "nccl";
    case MM_EP_TRANSPORT_IPC: return "ipc";
    case MM_EP_TRANSPORT_AUTO: return "auto";
    default: return "default";
  }
}

mm_ep_transport mm_ep_transport_from_env(void) {
  const char *v = getenv("MEGAMOE_EP_TRANSPORT");
  if (!v || !v[0] || !strcasecmp(v, "auto")) return MM_EP_TRANSPORT_AUTO;
  if (!strcasecmp(v, "nccl")) return MM_EP_TRANSPORT_NCCL;
  if (!strcasecmp(v, "ipc")) return MM_EP_TRANSPORT_IPC;
  mm_log(MEGAMOE_LOG_WARN, "MEGAMOE_EP_TRANSPORT=%s: expected nccl, ipc or auto; using auto", v);
  return MM_EP_TRANSPORT_AUTO;
}

static uint64_t g_process_nonce;
static void make_nonce(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  g_process_nonce = ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^
                    ((uint64_t)getpid() << 40) ^ (uint64_t)(uintptr_t)&g_process_nonce;
}
static uint64_t process_nonce(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, make_nonce);
  return g_process_nonce;
}

/* Offsets of the buffer layout (ep_kernels.h); the same on every rank. */
static void layout(mm_ep_ipc_dev *d, int R, int ll, int rb, int H, int K, int64_t *table_off,
                   uint64_t *bytes) {
  const size_t flags = align_up((size_t)R * 8);
  d->ready_off = 256;
  d->data_off = d->ready_off + (int64_t)flags;
  *table_off = d->data_off + (int64_t)flags;
  d->counts_off = *table_off + (int64_t)flags;
  d->payload_off = d->counts_off + (int64_t)align_up((size_t)R * (2 * R + 4) * 4);
  const uint64_t disp = (uint64_t)R * ll * rb, comb = (uint64_t)R * ll * K * H * 2;
  *bytes = (uint64_t)d->payload_off + align_up(disp > comb ? disp : comb);
}

void mm_ep_ipc_destroy(mm_ep_ipc *x) {
  if (!x) return;
  if (cudaSetDevice(x->device) == cudaSuccess) {
    for (int q = 0; x->opened && q < x->ranks; q++)
      if (x->opened[q]) cudaIpcCloseMemHandle(x->opened[q]);
    if (x->group) group_leave(x); /* takes the buffer, frees it with the group's last */
    if (x->base) cudaFree(x->base);
  }
  cudaGetLastError();
  free(x->opened);
  free(x);
}

/* In-place all-gather of one record per rank over the communicator, waited for. */
static mm_err *gather(mm_ep_comm *comm, int R, int me, void *recs, size_t bytes) {
  void *d = NULL;
  cudaStream_t st = NULL;
  mm_err *err = NULL;
  cudaError_t ce = cudaMalloc(&d, (size_t)R * bytes);
  if (ce == cudaSuccess) ce = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  if (ce == cudaSuccess)
    ce = cudaMemcpyAsync((char *)d + (size_t)me * bytes, (char *)recs + (size_t)me * bytes, bytes,
                         cudaMemcpyHostToDevice, st);
  if (ce != cudaSuccess) {
    /* A rank that cannot take part would leave the others waiting: the
     * communicator is failed, as for any other broken collective. */
    char why[200];
    snprintf(why, sizeof why, "CUDA IPC transport set-up on device: %s", cudaGetErrorString(ce));
    cudaGetLastError();
    err = mm_ep_comm_abort(comm, MEGAMOE_CODE_INTERNAL, why);
    goto out;
  }
  err = mm_ep_comm_allgather(comm, d, bytes, st);
  if (!err) {
    ce = cudaMemcpyAsync(recs, d, (size_t)R * bytes, cudaMemcpyDeviceToHost, st);
    if (ce != cudaSuccess)
      err = mm_error(MEGAMOE_CODE_INTERNAL, "CUDA IPC set-up copy: %s", cudaGetErrorString(ce));
  }
  if (!err) err = mm_ep_comm_sync(comm, st);
out:
  if (st) cudaStreamDestroy(st);
  if (d) cudaFree(d);
  return err;
}

/* Maps peer q into this process; why receives the reason on failure. */
static int map_peer(mm_ep_ipc *x, const ipc_info *me, const ipc_info *p, int q, char *why,
                    size_t cap) {
  cudaError_t ce;
  int can = 0;
  if (p->process == me->process && p->pid == me->pid) {
    if (p->device != me->device) {
      ce = cudaDeviceCanAccessPeer(&can, me->device, p->device);
      if (ce != cudaSuccess || !can) {
        snprintf(why, cap, "device %d cannot access peer device %d (rank %d)", me->device,
                 p->device, q);
        cudaGetLastError();
        return 0;
      }
      ce = cudaDeviceEnablePeerAccess(p->device, 0);
      if (ce != cudaSuccess && ce != cudaErrorPeerAccessAlreadyEnabled) {
        snprintf(why, cap, "cudaDeviceEnablePeerAccess(%d): %s", p->device, cudaGetErrorString(ce));
        cudaGetLastError();
        return 0;
      }
      cudaGetLastError();
    }
    return 1; /* the peer's pointer is valid here as it is */
  }
  if (!p->has_handle) {
    snprintf(why, cap, "rank %d (another process) has no IPC handle for its buffer", q);
    return 0;
  }
  int dev = -1;
  if (cudaDeviceGetByPCIBusId(&dev, p->bus) == cudaSuccess && dev != me->device) {
    ce = cudaDeviceCanAccessPeer(&can, me->device, dev);
    if (ce != cudaSuccess || !can) {
      snprintf(why, cap, "device %d cannot access rank %d's GPU %s", me->device, q, p->bus);
      cudaGetLastError();
      return 0;
    }
  }
  cudaGetLastError(); /* a GPU not visible here is tried through the handle */
  void *ptr = NULL;
  ce = cudaIpcOpenMemHandle(&ptr, p->handle, cudaIpcMemLazyEnablePeerAccess);
  if (ce != cudaSuccess) {
    snprintf(why, cap, "cudaIpcOpenMemHandle of rank %d's buffer: %s", q, cudaGetErrorString(ce));
    cudaGetLastError();
    return 0;
  }
  x->opened[q] = ptr;
  return 1;
}

mm_err *mm_ep_ipc_create(const mm_ep_ipc_args *a, mm_ep_ipc **out) {
  *out = NULL;
  const int R = a->ranks, me = a->rank;
  if (a->ll_tokens <= 0) return NULL; /* no low-latency mode planned */
  mm_ep_transport req = a->request == MM_EP_TRANSPORT_DEFAULT ? mm_ep_transport_from_env()
                                                               : a->request;
  const int want = req != MM_EP_TRANSPORT_NCCL;
  if (R == 1 && !want) {
    mm_log(MEGAMOE_LOG_INFO, "expert-parallel low-latency transport: nccl (asked for)");
    return NULL;
  }
  mm_ep_ipc *x = calloc(1, sizeof *x);
  ipc_info *recs = calloc((size_t)R, sizeof *recs);
  int32_t *oks = calloc((size_t)R, sizeof *oks);
  if (!x || !recs || !oks) {
    free(x), free(recs), free(oks);
    return mm_error(MEGAMOE_CODE_RESOURCE_EXHAUSTED, "out of host memory");
  }
  x->rank = me, x->ranks = R, x->device = a->device;
  x->opened = calloc((size_t)R, sizeof *x->opened);
  mm_err *err = NULL;
  char why[256] = "";
  ipc_info *mine = &recs[me];
  mine->process = process_nonce();
  mine->pid = (int32_t)getpid();
  mine->device = a->device;
  gethostname(mine->host, sizeof mine->host - 1);
  mine->want = want;
  mine->ll_tokens = a->ll_tokens, mine->row_bytes = a->row_bytes;
  mine->hidden = a->hidden, mine->top_k = a->top_k;
  mm_ep_ipc_dev *d = &x->dev;
  d->ranks = R, d->rank = me;
  d->timeout_ns = (int64_t)mm_ep_comm_timeout_ms(a->comm) * 1000000;
  layout(d, R, a->ll_tokens, a->row_bytes, a->hidden, a->top_k, &x->table_off, &x->bytes);
  mine->bytes = x->bytes;
  /* Local set-up; a failure here is only noted: the others still wait for our record. */
  cudaError_t ce = cudaSetDevice(a->device);
  if (ce == cudaSuccess && !x->opened) ce = cudaErrorMemoryAllocation;
  if (ce == cudaSuccess && want) ce = cudaMalloc((void **)&x->base, x->bytes);
  if (ce == cudaSuccess && want) ce = cudaMemset(x->base, 0, x->bytes);
  if (ce == cudaSuccess && want && R > 1)
    ce = cudaDeviceGetPCIBusId(mine->bus, (int)sizeof mine->bus, a->device);
  if (ce == cudaSuccess && want && R > 1) {
    /* Peers in this process use the pointer: a missing handle only matters to others. */
    mine->has_handle = cudaIpcGetMemHandle(&mine->handle, x->base) == cudaSuccess;
    cudaGetLastError();
  }
  if (ce != cudaSuccess) {
    snprintf(why, sizeof why, "rank %d: buffer of %llu bytes: %s", me,
             (unsigned long long)x->bytes, cudaGetErrorString(ce));
    cudaGetLastError();
  }
  mine->ok = want && ce == cudaSuccess;
  mine->ptr = (uint64_t)(uintptr_t)x->base;
  if (R > 1) MM_TRY_GOTO(gather(a->comm, R, me, recs, sizeof *recs), err, fail);
  /* The low-latency exchange has one geometry for the whole group, whatever
   * its transport: over NCCL, ranks of different geometries would post
   * sends and receives of different sizes, and the first step would hang.
   * Every rank sees the same records, so every rank refuses the plan. */
  for (int q = 0; q < R; q++) {
    const ipc_info *p = &recs[q];
    if (p->ll_tokens != mine->ll_tokens || p->row_bytes != mine->row_bytes ||
        p->hidden != mine->hidden || p->top_k != mine->top_k || p->bytes != mine->bytes) {
      err = mm_error(MEGAMOE_CODE_FAILED_PRECONDITION,
                     "rank %d planned another low-latency geometry (%d tokens, H %d, k %d) than "
                     "rank %d (%d, %d, %d): every rank must plan the same "
                     "num-max-tokens-per-rank and low-latency settings",
                     q, p->ll_tokens, p->hidden, p->top_k, me, mine->ll_tokens, mine->hidden,
                     mine->top_k);
      goto fail;
    }
  }
  /* Every rank decides from the same records. */
  int ok = 1;
  for (int q = 0; q < R && ok; q++) {
    const ipc_info *p = &recs[q];
    if (!p->want) {
      snprintf(why, sizeof why, "rank %d asked for nccl", q);
      ok = 0;
    } else if (!p->ok) {
      if (!why[0]) snprintf(why, sizeof why, "rank %d could not make its buffer", q);
      ok = 0;
    } else if (strncmp(p->host, mine->host, sizeof p->host)) {
      snprintf(why, sizeof why, "rank %d is on host %.64s, rank %d on %.64s", q, p->host, me,
               mine->host);
      ok = 0;
    }
  }
  if (ok) why[0] = 0;
  /* Map the peers, then agree that every rank could. */
  uint64_t *table = calloc((size_t)R, sizeof *table);
  if (!table) {
    ok = 0;
    snprintf(why, sizeof why, "out of host memory");
  }
  for (int q = 0; q < R && ok; q++) {
    if (q == me) {
      table[q] = (uint64_t)(uintptr_t)x->base;
    } else if (map_peer(x, mine, &recs[q], q, why, sizeof why)) {
      table[q] = x->opened[q] ? (uint64_t)(uintptr_t)x->opened[q] : recs[q].ptr;
    } else {
      ok = 0;
    }
  }
  if (ok) {
    d->local = (uint64_t *)x->base;
    d->ready = (uint64_t *)(x->base + d->ready_off);
    d->data = (uint64_t *)(x->base + d->data_off);
    uint8_t *tab = x->base + x->table_off;
    d->peer_base = (uint8_t *const *)tab;
    ce = cudaMemcpy(tab, table, (size_t)R * 8, cudaMemcpyHostToDevice);
    if (ce != cudaSuccess) {
      ok = 0;
      snprintf(why, sizeof why, "peer table: %s", cudaGetErrorString(ce));
      cudaGetLastError();
    }
  }
  free(table);
  if (R > 1) {
    oks[me] = ok;
    MM_TRY_GOTO(gather(a->comm, R, me, oks, sizeof *oks), err, fail);
    for (int q = 0; q < R; q++)
      if (!oks[q] && ok) {
        ok = 0;
        snprintf(why, sizeof why, "rank %d could not map its peers", q);
      }
  }
  if (!ok) {
    mm_log(req == MM_EP_TRANSPORT_IPC ? MEGAMOE_LOG_WARN : MEGAMOE_LOG_INFO,
           "expert-parallel low-latency transport: nccl (CUDA IPC not possible: %s)", why);
    goto fail;
  }
  /* In-process group: keyed by the buffer of its lowest rank (unique while
   * that buffer lives, which it does until the whole group is gone). */
  int same = 0;
  for (int q = 0; q < R; q++)
    if (recs[q].process == mine->process && recs[q].pid == mine->pid) {
      if (!same) x->group = recs[q].ptr;
      same++;
    }
  if (R > 1 && same > 1) group_join(x->group, same);
  else x->group = 0;
  mm_log(MEGAMOE_LOG_INFO,
         "expert-parallel low-latency transport: ipc (%d rank%s on %s, %.1f MiB receive buffer)",
         R, R == 1 ? "" : "s", mine->host, x->bytes / 1048576.0);
  free(recs), free(oks);
  *out = x;
  return NULL;
fail:
  free(recs), free(oks);
  mm_ep_ipc_destroy(x);
  return err;
}

const mm_ep_ipc_dev *mm_ep_ipc_device(const mm_ep_ipc *x) { return &x->dev; }
int32_t *mm_ep_ipc_counts(const mm_ep_ipc *x) { return (int32_t *)(x->base + x->dev.counts_off); }
void *mm_ep_ipc_payload(const mm_ep_ipc *x) { return x->base + x->dev.payload_off; }
uint64_t mm_ep_ipc_bytes(const mm_ep_ipc *x) { return x->bytes; }

/* layer_reader.c -- a layer's tensor reads as libuv thread-pool work: each
 * tensor in pieces of at most kPiece bytes, so that a large one keeps every
 * pool thread busy; the layer's own loop collects the completions when the
 * caller waits. */
#include "layer_reader.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "status.h"

enum { kPiece = 16 << 20, kPerExpert = 12 /* 3 projections x 4 fields */ };

/* The DLPack type of a safetensors dtype, faithfully: a dtype the plugin
 * does not take must reach it as what it is (and be refused by name), never
 * relabelled as bytes; F4 is 4 bits per element (the shape counts elements). */
static DLDataType dl_type(mm_st_dtype dt) {
  DLDataType t = {kDLUInt, 8, 1};
  switch (dt) {
    case MM_ST_U8: break;
    case MM_ST_BOOL: t.code = 6; break;           /* kDLBool (DLPack >= 0.8) */
    case MM_ST_I8: t.code = kDLInt; break;
    case MM_ST_U16: t.bits = 16; break;
    case MM_ST_I16: t.code = kDLInt; t.bits = 16; break;
    case MM_ST_U32: t.bits = 32; break;
    case MM_ST_I32: t.code = kDLInt; t.bits = 32; break;
    case MM_ST_U64: t.bits = 64; break;
    case MM_ST_I64: t.code = kDLInt; t.bits = 64; break;
    case MM_ST_F16: t.code = kDLFloat; t.bits = 16; break;
    case MM_ST_BF16: t.code = kDLBfloat; t.bits = 16; break;
    case MM_ST_F32: t.code = kDLFloat; t.bits = 32; break;
    case MM_ST_F64: t.code = kDLFloat; t.bits = 64; break;
    case MM_ST_C64: t.code = kDLComplex; t.bits = 64; break;
    case MM_ST_F8_E4M3: t.code = MEGAMOE_DL_FLOAT8_E4M3FN; break;
    case MM_ST_F8_E8M0: t.code = MEGAMOE_DL_FLOAT8_E8M0FNU; break;
    case MM_ST_F4: t.code = MEGAMOE_DL_FLOAT4_E2M1FN; t.bits = 4; break;
    case MM_ST_F8_E5M2: t.code = 12; break;      /* DLPack 1.1 kDLFloat8_e5m2 */
    case MM_ST_F8_E4M3FNUZ: t.code = 11; break;  /* kDLFloat8_e4m3fnuz */
    case MM_ST_F8_E5M2FNUZ: t.code = 13; break;  /* kDLFloat8_e5m2fnuz */
    case MM_ST_F6_E2M3: t.code = 15; t.bits = 6; break;
    case MM_ST_F6_E3M2: t.code = 16; t.bits = 6; break;
    default: t.code = kDLOpaqueHandle; break;
  }
  return t;
}

/* A piece of one tensor's bytes, read by a pool thread. */
typedef struct read_piece {
  uv_work_t req;
  const mm_st_file *file;
  const mm_st_tensor *tensor;
  uint64_t begin;
  size_t n;
  uint8_t *dst;
  mm_err *err;
} read_piece;

struct host_layer {
  uv_loop_t loop;
  int loop_open, waited;
  size_t count, npieces, cap_pieces;
  double bytes;
  megamoe_named_tensor *nt;
  DLTensor *dl;
  int64_t (*shapes)[MM_ST_MAX_DIMS];
  char (*names)[96];
  void **bufs;
  read_piece *pieces;
};

static void read_work(uv_work_t *req) {
  read_piece *p = req->data;
  p->err = mm_st_read_range(p->file, p->tensor, p->begin, p->dst, p->n);
}
static void read_done(uv_work_t *req, int status) {
  (void)req, (void)status; /* the piece holds its result; nothing is cancelled */
}

/* Queues the pieces of tensor t (index i of the layer) into bufs[i]. */
static int queue_tensor(host_layer *l, const mm_st_file *f, const mm_st_tensor *t, size_t i) {
  for (uint64_t b = 0; b < t->nbytes || (b == 0 && t->nbytes == 0); b += kPiece) {
    if (l->npieces == l->cap_pieces) return -1; /* counted in host_layer_read: never */
    read_piece *p = &l->pieces[l->npieces];
    const uint64_t left = t->nbytes - b;
    *p = (read_piece){.file = f, .tensor = t, .begin = b, .n = left < kPiece ? (size_t)left : kPiece,
                      .dst = (uint8_t *)l->bufs[i] + b};
    p->req.data = p;
    if (uv_queue_work(&l->loop, &p->req, read_work, read_done)) return -1;
    l->npieces++;
    if (t->nbytes == 0) break;
  }
  return 0;
}

host_layer *host_layer_read(const mm_st_ckpt *ck, int cl, int first, int n) {
  static const char *projs[3] = {"gate", "up", "down"};
  static const char *sufs[4] = {"weight", "weight_scale", "weight_scale_2", "input_scale"};
  host_layer *l = calloc(1, sizeof *l);
  const size_t cap = (size_t)(n > 0 ? n : 0) * kPerExpert;
  if (!l || uv_loop_init(&l->loop)) {
    free(l);
    fprintf(stderr, "megamoe-host: cannot start reading layer %d\n", cl);
    return NULL;
  }
  l->loop_open = 1;
  /* the layer's tensors, found once; then their pieces, counted first so
   * that one array holds them all (a queued request must not move) */
  struct found {
    const mm_st_file *f;
    const mm_st_tensor *t;
    int e, p, s;
  } *found = calloc(cap + 1, sizeof *found);
  size_t nfound = 0, npieces = 0;
  for (int e = first; found && e < first + n; e++)
    for (int p = 0; p < 3; p++)
      for (int s = 0; s < 4; s++) {
        char full[160];
        snprintf(full, sizeof full, "model.layers.%d.mlp.experts.%d.%s_proj.%s", cl, e, projs[p],
                 sufs[s]);
        const mm_st_file *f;
        const mm_st_tensor *t = mm_st_ckpt_find(ck, full, &f);
        if (!t || t->ndim > 4) continue; /* the op names what is missing */
        found[nfound++] = (struct found){f, t, e, p, s};
        npieces += t->nbytes ? (size_t)((t->nbytes + kPiece - 1) / kPiece) : 1;
      }
  l->nt = calloc(cap + 1, sizeof *l->nt);
  l->dl = calloc(cap + 1, sizeof *l->dl);
  l->shapes = calloc(cap + 1, sizeof *l->shapes);
  l->names = calloc(cap + 1, sizeof *l->names);
  l->bufs = calloc(cap + 1, sizeof *l->bufs);
  l->pieces = calloc(npieces + 1, sizeof *l->pieces);
  l->cap_pieces = npieces;
  const int no_lists = !found || !l->nt || !l->dl || !l->shapes || !l->names || !l->bufs || !l->pieces;
  int oom = no_lists;
  for (size_t k = 0; k < nfound && !oom; k++) {
    const mm_st_tensor *t = found[k].t;
    const int e = found[k].e, p = found[k].p, s = found[k].s;
    const size_t i = l->count;
    l->bufs[i] = malloc(t->nbytes ? t->nbytes : 1);
    snprintf(l->names[i], sizeof l->names[i], "experts.%d.%s_proj.%s", e, projs[p], sufs[s]);
    if (!l->bufs[i] || queue_tensor(l, found[k].f, t, i)) {
      fprintf(stderr, "megamoe-host: out of host memory reading layer %d %s\n", cl, l->names[i]);
      oom = 1;
      break;
    }
    l->bytes += (double)t->nbytes;
    for (int d = 0; d < t->ndim; d++) l->shapes[i][d] = t->shape[d];
    l->dl[i].data = l->bufs[i];
    l->dl[i].device.device_type = kDLCPU;
    l->dl[i].ndim = t->ndim;
    l->dl[i].dtype = dl_type(t->dtype);
    l->dl[i].shape = l->shapes[i];
    l->nt[i].name = l->names[i];
    l->nt[i].tensor = &l->dl[i];
    l->count++;
  }
  free(found);
  if (oom) {
    if (no_lists) fprintf(stderr, "megamoe-host: out of host memory reading layer %d\n", cl);
    host_layer_free(l);
    return NULL;
  }
  return l;
}

megamoe_error *host_layer_wait(host_layer *l) {
  if (!l->waited) {
    uv_run(&l->loop, UV_RUN_DEFAULT); /* returns once every piece's completion ran */
    l->waited = 1;
  }
  mm_err *first = NULL;
  for (size_t i = 0; i < l->npieces; i++) {
    if (!first) first = l->pieces[i].err;
    else if (l->pieces[i].err) mm_error_free(l->pieces[i].err);
    l->pieces[i].err = NULL;
  }
  return first;
}

const megamoe_named_tensor *host_layer_tensors(const host_layer *l, size_t *count) {
  *count = l->count;
  return l->nt;
}

double host_layer_bytes(const host_layer *l) { return l->bytes; }

void host_layer_free(host_layer *l) {
  if (!l) return;
  if (l->loop_open) {
    mm_error_free(host_layer_wait(l)); /* no pool thread may still write into a buffer */
    uv_loop_close(&l->loop);
  }
  for (size_t i = 0; l->bufs && i <= l->count; i++) free(l->bufs[i]);
  free(l->nt);
  free(l->dl);
  free(l->shapes);
  free(l->names);
  free(l->bufs);
  free(l->pieces);
  free(l);
}

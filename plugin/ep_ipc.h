/* ep_ipc.h -- the low-latency transport over CUDA IPC peer pointers: when
 * every rank of the group is on this node and every pair of GPUs can access
 * each other, the two NCCL transfers of a low-latency step (the count
 * all-gather and the fixed-capacity all-to-all, in dispatch and in combine)
 * become one push kernel each (kernels/ep_ipc.cu): a rank writes its segment
 * for peer r straight into r's receive buffer, with ready / data flags per
 * exchange. Results are bit-identical to the NCCL path (the receiver reads
 * the same rows).
 *
 * Set-up, all at plan time (never under capture): each rank cudaMallocs its
 * buffer (layout in ep_kernels.h mm_ep_ipc_dev), takes its IPC handle, and
 * all-gathers a record (host name, process, device, PCI bus id, handle,
 * geometry, request) over the NCCL communicator. Peers in the same process
 * use the raw pointer with peer access enabled; peers in other processes on
 * the same host are opened with cudaIpcOpenMemHandle. A second all-gather
 * agrees that every rank succeeded; otherwise every rank falls back to NCCL
 * (logged), never failing the plan for it.
 *
 * Choice: MEGAMOE_EP_TRANSPORT=nccl|ipc|auto (default auto: IPC when
 * possible; ipc: the same, with a warning when it is not possible), or the
 * engine's argument. Every rank takes part in the set-up exchange when
 * ep-size > 1 and the low-latency mode is planned, so ranks that ask for
 * different transports agree on NCCL. */
#ifndef MM_EP_IPC_H
#define MM_EP_IPC_H

#include <stdint.h>

#include "ep_comm.h"
#include "ep_kernels.h"
#include "status.h"

typedef enum {
  MM_EP_TRANSPORT_DEFAULT = 0, /* MEGAMOE_EP_TRANSPORT, else auto */
  MM_EP_TRANSPORT_AUTO = 1,
  MM_EP_TRANSPORT_NCCL = 2,
  MM_EP_TRANSPORT_IPC = 3
} mm_ep_transport;

typedef struct mm_ep_ipc mm_ep_ipc;

typedef struct mm_ep_ipc_args {
  int rank, ranks, device;
  mm_ep_transport request;
  /* geometry: every rank must agree, or NCCL is used */
  int ll_tokens, row_bytes, hidden, top_k;
  mm_ep_comm *comm; /* borrowed; its timeout is the device-side spin limit */
} mm_ep_ipc_args;

/* Collective over the communicator when ranks > 1 and ll_tokens > 0. *out =
 * NULL: the NCCL transport (asked for, or IPC not possible: logged). Fails
 * only when the set-up exchange itself fails (a failed communicator). */
mm_err *mm_ep_ipc_create(const mm_ep_ipc_args *a, mm_ep_ipc **out);
/* Closes the peers' mappings and frees the buffer (call after the device is
 * idle). NULL is fine. */
void mm_ep_ipc_destroy(mm_ep_ipc *x);

const mm_ep_ipc_dev *mm_ep_ipc_device(const mm_ep_ipc *x);
int32_t *mm_ep_ipc_counts(const mm_ep_ipc *x); /* this rank's count matrix [R][2R + 4] */
void *mm_ep_ipc_payload(const mm_ep_ipc *x);   /* this rank's receive rows */
uint64_t mm_ep_ipc_bytes(const mm_ep_ipc *x);  /* device bytes of this rank's buffer */

/* MEGAMOE_EP_TRANSPORT parsed (unset or unknown: auto, the latter with a warning). */
mm_ep_transport mm_ep_transport_from_env(void);
const char *mm_ep_transport_name(mm_ep_transport t);

#endif

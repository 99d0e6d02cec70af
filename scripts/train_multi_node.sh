#!/usr/bin/env bash
# Float8 pretraining on NNODES nodes of NGPU GPUs: run this on every node with the same
# settings; torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT gathers the nodes.
#
#   NNODES=4 MASTER_ADDR=node0 scripts/train_multi_node.sh --preset llama3_8b --out runs/a
#
# Environment:
#   NNODES       nodes in the job (required)
#   MASTER_ADDR  host of the rendezvous, reachable from every node (required unless
#                RDZV_ENDPOINT is set); MASTER_PORT its port (default 29500)
#   RDZV_ENDPOINT host:port, instead of MASTER_ADDR/MASTER_PORT
#   RDZV_ID      job id shared by the nodes (default: f8train)
#   NODE_RANK    set it (0 .. NNODES-1, 0 on MASTER_ADDR) for a static rendezvous with fixed
#                node ranks (torchrun --node_rank --master_addr --master_port) instead
#   NGPU         ranks per node (default 8); PYTHON, DEVICE, DRY_RUN: scripts/_launch.sh
# Every flag goes to `python -m f8train.train`.
source "$(dirname "$0")/_launch.sh"

NGPU=${NGPU:-8}
NNODES=${NNODES:?set NNODES to the number of nodes (and MASTER_ADDR to the rendezvous host)}
need_int NGPU "$NGPU"
need_int NNODES "$NNODES"
MASTER_PORT=${MASTER_PORT:-29500}
if [ -n "${NODE_RANK:-}" ]; then
  if ! [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || ((10#$NODE_RANK >= NNODES)); then
    echo "$(basename "$0"): NODE_RANK=$NODE_RANK is not a node of the job: expected 0 .. $((NNODES - 1)) with NNODES=$NNODES (0 on MASTER_ADDR); set each node's own NODE_RANK, or NNODES to the number of nodes" >&2
    exit 2
  fi
  : "${MASTER_ADDR:?set MASTER_ADDR to the host of node rank 0}"
  RDZV=(--node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
else
  ENDPOINT=${RDZV_ENDPOINT:-${MASTER_ADDR:?set MASTER_ADDR (or RDZV_ENDPOINT=host:port) to the rendezvous host}:$MASTER_PORT}
  RDZV=(--rdzv_backend c10d --rdzv_endpoint "$ENDPOINT" --rdzv_id "${RDZV_ID:-f8train}")
fi
launch "${TORCHRUN[@]}" --nnodes "$NNODES" --nproc_per_node "$NGPU" "${RDZV[@]}" \
  -m f8train.train --device "$DEVICE" "$@"

#!/usr/bin/env bash
# Launch nsa_titan under torchrun.
#
#   ./run_train.sh                                   # train_configs/debug_model.toml, 1 rank on CPU
#   ./run_train.sh --config train_configs/m7c.toml --training.steps 10
#   NGPU=2 ./run_train.sh                            # 2 ranks (2 GPUs, or 2 gloo ranks on CPU)
#
# Environment (all optional):
#   NGPU           local ranks (default: number of GPUs, or 1 without GPUs)
#   NNODES         nodes in the job (default 1: a standalone single-node rendezvous)
#   NODE_RANK      this node's rank, for static multi-node rendezvous
#   RDZV_ENDPOINT  host:port of the c10d rendezvous (multi-node; e.g. the first node)
#   RDZV_ID        job id shared by all nodes (default: nsa_titan)
#   LOG_RANK       comma-separated ranks whose output is shown (default: all)
#   SHUTDOWN_TIMEOUT  seconds ranks get to save a checkpoint after SIGTERM/SIGUSR1/SIGINT (default 120)
#   MAX_RESTARTS   times torchrun restarts every rank after one fails (default 0); each restart
#                  resumes from the latest complete checkpoint
#
# Exit code: the trainer's (0 done or stopped by a signal after saving, 2 bad input or a folder in use
# by another run, 3 halted on a non-finite step, 4 the last save failed, 75 the data source unreadable
# through its retries (saved: rerun to resume), 124 a hang, 130 a second Ctrl-C, 128+N a rank killed by
# signal N, 1 a crash).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"

if [[ -z "${NGPU:-}" ]]; then
  NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count() or 1)')
fi
NNODES="${NNODES:-1}"

# nsa_titan.launch is torchrun plus the stop signals (SIGTERM, SIGUSR1 as Slurm's --signal=USR1@N
# sends, SIGINT): every rank saves and exits 0 within SHUTDOWN_TIMEOUT seconds. Config errors stop
# it before any rank starts.
args=(--nproc_per_node "${NGPU}" --nnodes "${NNODES}" --shutdown-timeout "${SHUTDOWN_TIMEOUT:-120}"
      --max-restarts "${MAX_RESTARTS:-0}")
if [[ "${NNODES}" == "1" && -z "${RDZV_ENDPOINT:-}" ]]; then
  args+=(--standalone)
else
  args+=(--rdzv_backend c10d --rdzv_endpoint "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port for multi-node}"
         --rdzv_id "${RDZV_ID:-nsa_titan}")
  [[ -n "${NODE_RANK:-}" ]] && args+=(--node_rank "${NODE_RANK}")
fi
[[ -n "${LOG_RANK:-}" ]] && args+=(--local-ranks-filter "${LOG_RANK}")

# Without --config the trainer uses train_configs/debug_model.toml.
exec python3 -m nsa_titan.launch "${args[@]}" -m nsa_titan.train "$@"

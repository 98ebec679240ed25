#!/usr/bin/env bash
# dflashops launch script: unit dsv3-0 on host h100-b, from playbook two-node-sglang.
# Rendered by dflashops 0.1.0; do not edit on the host: change the playbook and deploy.
set -euo pipefail
DFLASHOPS_UNIT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)"
DFLASHOPS_WORKDIR="$(cd -- "$DFLASHOPS_UNIT_DIR/../.." && pwd -P)"
export DFLASHOPS_UNIT_DIR DFLASHOPS_WORKDIR
export DFLASHOPS_UNIT=dsv3-0
export DFLASHOPS_FINGERPRINT=46ecb3b18f618a45d8eae85686bcf6b52ec8332c0fb1236ae627a7f8bb9635a1
# A job may write its progress (any JSON object) here; `dflashops status` shows it.
export DFLASHOPS_PROGRESS_FILE="$DFLASHOPS_UNIT_DIR/progress.json"
printf '[dflashops] unit=%s fingerprint=%s engine=%s tp=%s dp=%s port=%s gpus=%s started=%s\n' \
  dsv3-0 46ecb3b18f618a45d8eae85686bcf6b52ec8332c0fb1236ae627a7f8bb9635a1 sglang 16 1 - 0,1,2,3,4,5,6,7 "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
printf '[dflashops] node %s of %s (%s); rendezvous at %s\n' 1 2 h100-a,h100-b 10.0.0.10:50000
export CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7
export GLOO_SOCKET_IFNAME=ens1
export NCCL_SOCKET_IFNAME=ens1
cd -- "$DFLASHOPS_UNIT_DIR"
printf '[dflashops] exec: %s\n' '/root/venv/bin/python3 -m sglang.launch_server --model-path /dev/shm/DeepSeek-V3 --host 127.0.0.1 --tp-size 16 --dp-size 1 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.10:50000 --trust-remote-code --mem-fraction-static 0.85'
# exec: the engine replaces this shell, so the recorded process group is the engine's own.
exec /root/venv/bin/python3 -m sglang.launch_server --model-path /dev/shm/DeepSeek-V3 --host 127.0.0.1 --tp-size 16 --dp-size 1 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.10:50000 --trust-remote-code --mem-fraction-static 0.85

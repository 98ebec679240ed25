#!/usr/bin/env bash
# dflashops launch script: unit monitor on host pro6000, from playbook train-dflash.
# Rendered by dflashops 0.1.0; do not edit on the host: change the playbook and deploy.
set -euo pipefail
DFLASHOPS_UNIT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)"
DFLASHOPS_WORKDIR="$(cd -- "$DFLASHOPS_UNIT_DIR/../.." && pwd -P)"
export DFLASHOPS_UNIT_DIR DFLASHOPS_WORKDIR
export DFLASHOPS_UNIT=monitor
export DFLASHOPS_FINGERPRINT=649b4411f34390f128a15adecaefa0db92449773ca8d6d75c605d946a17c40de
# A job may write its progress (any JSON object) here; `dflashops status` shows it.
export DFLASHOPS_PROGRESS_FILE="$DFLASHOPS_UNIT_DIR/progress.json"
printf '[dflashops] unit=%s fingerprint=%s engine=%s tp=%s dp=%s port=%s gpus=%s started=%s\n' \
  monitor 649b4411f34390f128a15adecaefa0db92449773ca8d6d75c605d946a17c40de job 1 1 - - "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
export CUDA_VISIBLE_DEVICES=''
cd -- "$DFLASHOPS_UNIT_DIR"
printf '[dflashops] exec: %s\n' '/root/venv/bin/python3 "${DFLASHOPS_WORKDIR}"/payloads/b09b11a2432aef8d/monitor.py --watch /workspace/checkpoints/dflash --interval 60'
# exec: the engine replaces this shell, so the recorded process group is the engine's own.
exec /root/venv/bin/python3 "${DFLASHOPS_WORKDIR}"/payloads/b09b11a2432aef8d/monitor.py --watch /workspace/checkpoints/dflash --interval 60

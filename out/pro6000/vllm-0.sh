#!/usr/bin/env bash
# dflashops launch script: unit vllm-0 on host pro6000, from playbook train-dflash.
# Rendered by dflashops 0.1.0; do not edit on the host: change the playbook and deploy.
set -euo pipefail
DFLASHOPS_UNIT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)"
DFLASHOPS_WORKDIR="$(cd -- "$DFLASHOPS_UNIT_DIR/../.." && pwd -P)"
export DFLASHOPS_UNIT_DIR DFLASHOPS_WORKDIR
export DFLASHOPS_UNIT=vllm-0
export DFLASHOPS_FINGERPRINT=f300bccb79f5233a710ee1542cc8808f65a163d5df6940e69cbadc326b888b0e
# A job may write its progress (any JSON object) here; `dflashops status` shows it.
export DFLASHOPS_PROGRESS_FILE="$DFLASHOPS_UNIT_DIR/progress.json"
printf '[dflashops] unit=%s fingerprint=%s engine=%s tp=%s dp=%s port=%s gpus=%s started=%s\n' \
  vllm-0 f300bccb79f5233a710ee1542cc8808f65a163d5df6940e69cbadc326b888b0e vllm 2 1 8000 0,1 "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
# The unit's Python environment, resolved once: the build it starts on is the one it keeps
# (deploy switches the link only to a complete build, and restarts the units that use it).
VIRTUAL_ENV="$(readlink -f -- /root/venv-vllm)"
export VIRTUAL_ENV PATH="$VIRTUAL_ENV/bin:$PATH"
export CUDA_VISIBLE_DEVICES=0,1
cd -- "$DFLASHOPS_UNIT_DIR"
printf '[dflashops] exec: %s\n' '"${VIRTUAL_ENV:?the unit environment is not set}"/bin/python /workspace/speculators/scripts/launch_vllm.py /workspace/models/Qwen3.6-27B --hidden-states-path /workspace/hidden_states --target-layer-ids 2 32 61 -- --host 127.0.0.1 --port 8000 --tensor-parallel-size 2 --data-parallel-size 1 --gpu-memory-utilization 0.85 --max-model-len 8192'
# exec: the engine replaces this shell, so the recorded process group is the engine's own.
exec "${VIRTUAL_ENV:?the unit environment is not set}"/bin/python /workspace/speculators/scripts/launch_vllm.py /workspace/models/Qwen3.6-27B --hidden-states-path /workspace/hidden_states --target-layer-ids 2 32 61 -- --host 127.0.0.1 --port 8000 --tensor-parallel-size 2 --data-parallel-size 1 --gpu-memory-utilization 0.85 --max-model-len 8192

#!/usr/bin/env bash
# dflashops launch script: unit train on host pro6000, from playbook train-dflash.
# Rendered by dflashops 0.1.0; do not edit on the host: change the playbook and deploy.
set -euo pipefail
DFLASHOPS_UNIT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)"
DFLASHOPS_WORKDIR="$(cd -- "$DFLASHOPS_UNIT_DIR/../.." && pwd -P)"
export DFLASHOPS_UNIT_DIR DFLASHOPS_WORKDIR
export DFLASHOPS_UNIT=train
export DFLASHOPS_FINGERPRINT=442a2dc03e42662e137ff30092afa65153c4b2239d471e2d7704f775ffd4ee9d
# A job may write its progress (any JSON object) here; `dflashops status` shows it.
export DFLASHOPS_PROGRESS_FILE="$DFLASHOPS_UNIT_DIR/progress.json"
printf '[dflashops] unit=%s fingerprint=%s engine=%s tp=%s dp=%s port=%s gpus=%s started=%s\n' \
  train 442a2dc03e42662e137ff30092afa65153c4b2239d471e2d7704f775ffd4ee9d job 1 1 - 4,5,6,7 "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
# The unit's Python environment, resolved once: the build it starts on is the one it keeps
# (deploy switches the link only to a complete build, and restarts the units that use it).
VIRTUAL_ENV="$(readlink -f -- /root/venv-vllm)"
export VIRTUAL_ENV PATH="$VIRTUAL_ENV/bin:$PATH"
export CUDA_VISIBLE_DEVICES=4,5,6,7
cd -- "$DFLASHOPS_UNIT_DIR"
printf '[dflashops] exec: %s\n' 'torchrun --standalone --nproc_per_node 4 /workspace/speculators/scripts/train.py --verifier-name-or-path /workspace/models/Qwen3.6-27B --data-path /workspace/dflash/data/completions --vllm-endpoint http://127.0.0.1:8000/v1 --hidden-states-path /workspace/hidden_states --save-path /workspace/checkpoints/dflash'
# exec: the engine replaces this shell, so the recorded process group is the engine's own.
exec torchrun --standalone --nproc_per_node 4 /workspace/speculators/scripts/train.py --verifier-name-or-path /workspace/models/Qwen3.6-27B --data-path /workspace/dflash/data/completions --vllm-endpoint http://127.0.0.1:8000/v1 --hidden-states-path /workspace/hidden_states --save-path /workspace/checkpoints/dflash

#!/usr/bin/env bash
# dflashops launch script: unit sglang-0 on host b200, from playbook serve-sglang.
# Rendered by dflashops 0.1.0; do not edit on the host: change the playbook and deploy.
set -euo pipefail
DFLASHOPS_UNIT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)"
DFLASHOPS_WORKDIR="$(cd -- "$DFLASHOPS_UNIT_DIR/../.." && pwd -P)"
export DFLASHOPS_UNIT_DIR DFLASHOPS_WORKDIR
export DFLASHOPS_UNIT=sglang-0
export DFLASHOPS_FINGERPRINT=cb84f13782786ea9dbf6d56e85ddb056438387b5ac0758c462535b93e4c4207d
# A job may write its progress (any JSON object) here; `dflashops status` shows it.
export DFLASHOPS_PROGRESS_FILE="$DFLASHOPS_UNIT_DIR/progress.json"
printf '[dflashops] unit=%s fingerprint=%s engine=%s tp=%s dp=%s port=%s gpus=%s started=%s\n' \
  sglang-0 cb84f13782786ea9dbf6d56e85ddb056438387b5ac0758c462535b93e4c4207d sglang 1 1 30000 0 "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
# The unit's Python environment, resolved once: the build it starts on is the one it keeps
# (deploy switches the link only to a complete build, and restarts the units that use it).
VIRTUAL_ENV="$(readlink -f -- /root/venv-sglang)"
export VIRTUAL_ENV PATH="$VIRTUAL_ENV/bin:$PATH"
export CUDA_VISIBLE_DEVICES=0
export SGLANG_ENABLE_JIT_DEEPGEMM=1
# secret_env comes from a 0600 file written at deploy time, never from this script.
if [[ ! -r "$DFLASHOPS_UNIT_DIR/secrets.env" ]]; then
  echo "[dflashops] $DFLASHOPS_UNIT_DIR/secrets.env is missing: deploy again with "HF_TOKEN" set on the controller" >&2
  exit 78
fi
set -a
. "$DFLASHOPS_UNIT_DIR/secrets.env"
set +a
cd -- "$DFLASHOPS_UNIT_DIR"
printf '[dflashops] exec: %s\n' '"${VIRTUAL_ENV:?the unit environment is not set}"/bin/python -m sglang.launch_server --model-path /dev/shm/Qwen3.6-27B --host 127.0.0.1 --port 30000 --tp-size 1 --dp-size 1 --served-model-name qwen3.6-27b --mem-fraction-static 0.88 --context-length 40960 --reasoning-parser qwen3 --speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --enable-metrics'
# exec: the engine replaces this shell, so the recorded process group is the engine's own.
exec "${VIRTUAL_ENV:?the unit environment is not set}"/bin/python -m sglang.launch_server --model-path /dev/shm/Qwen3.6-27B --host 127.0.0.1 --port 30000 --tp-size 1 --dp-size 1 --served-model-name qwen3.6-27b --mem-fraction-static 0.88 --context-length 40960 --reasoning-parser qwen3 --speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --enable-metrics

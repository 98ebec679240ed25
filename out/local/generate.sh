#!/usr/bin/env bash
# dflashops launch script: unit generate on host local, from playbook demo.
# Rendered by dflashops 0.1.0; do not edit on the host: change the playbook and deploy.
set -euo pipefail
DFLASHOPS_UNIT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)"
DFLASHOPS_WORKDIR="$(cd -- "$DFLASHOPS_UNIT_DIR/../.." && pwd -P)"
export DFLASHOPS_UNIT_DIR DFLASHOPS_WORKDIR
export DFLASHOPS_UNIT=generate
export DFLASHOPS_FINGERPRINT=f9766d54c06c2fb9bd406c84f081dae61b81180f938cf85391816cfa985935da
# A job may write its progress (any JSON object) here; `dflashops status` shows it.
export DFLASHOPS_PROGRESS_FILE="$DFLASHOPS_UNIT_DIR/progress.json"
printf '[dflashops] unit=%s fingerprint=%s engine=%s tp=%s dp=%s port=%s gpus=%s started=%s\n' \
  generate f9766d54c06c2fb9bd406c84f081dae61b81180f938cf85391816cfa985935da job 1 1 - - "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
# The unit's Python environment, resolved once: the build it starts on is the one it keeps
# (deploy switches the link only to a complete build, and restarts the units that use it).
VIRTUAL_ENV="$(readlink -f -- /work/main/.dflashops/local/venv-demo)"
export VIRTUAL_ENV PATH="$VIRTUAL_ENV/bin:$PATH"
export CUDA_VISIBLE_DEVICES=''
cd -- "$DFLASHOPS_UNIT_DIR"
printf '[dflashops] exec: %s\n' '"${VIRTUAL_ENV:?the unit environment is not set}"/bin/python "${DFLASHOPS_WORKDIR}"/payloads/326a2fc60f8bcb9e/generate_completions.py --prompts /work/main/.dflashops/local/data/demo-prompts.jsonl --output-dir completions --max-output-tokens 256 --concurrency 8 --servers http://127.0.0.1:31000 http://127.0.0.1:31001'
# exec: the engine replaces this shell, so the recorded process group is the engine's own.
exec "${VIRTUAL_ENV:?the unit environment is not set}"/bin/python "${DFLASHOPS_WORKDIR}"/payloads/326a2fc60f8bcb9e/generate_completions.py --prompts /work/main/.dflashops/local/data/demo-prompts.jsonl --output-dir completions --max-output-tokens 256 --concurrency 8 --servers http://127.0.0.1:31000 http://127.0.0.1:31001

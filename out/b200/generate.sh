#!/usr/bin/env bash
# dflashops launch script: unit generate on host b200, from playbook generate-completions.
# Rendered by dflashops 0.1.0; do not edit on the host: change the playbook and deploy.
set -euo pipefail
DFLASHOPS_UNIT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)"
DFLASHOPS_WORKDIR="$(cd -- "$DFLASHOPS_UNIT_DIR/../.." && pwd -P)"
export DFLASHOPS_UNIT_DIR DFLASHOPS_WORKDIR
export DFLASHOPS_UNIT=generate
export DFLASHOPS_FINGERPRINT=aa2a302bac1fcb25c2ad52139625a0b9ef32b874d434c913ddeb53161999f14b
# A job may write its progress (any JSON object) here; `dflashops status` shows it.
export DFLASHOPS_PROGRESS_FILE="$DFLASHOPS_UNIT_DIR/progress.json"
printf '[dflashops] unit=%s fingerprint=%s engine=%s tp=%s dp=%s port=%s gpus=%s started=%s\n' \
  generate aa2a302bac1fcb25c2ad52139625a0b9ef32b874d434c913ddeb53161999f14b job 1 1 - - "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
export CUDA_VISIBLE_DEVICES=''
cd -- "$DFLASHOPS_UNIT_DIR"
printf '[dflashops] exec: %s\n' '/root/venv/bin/python3 "${DFLASHOPS_WORKDIR}"/payloads/326a2fc60f8bcb9e/generate_completions.py --prompts /workspace/prompts.jsonl --output-dir /workspace/completions --max-output-tokens 4096 --concurrency 48 --temperature 0.6 --top-p 0.95 --chat-template-kwargs '"'"'{"enable_thinking":true}'"'"' --servers http://127.0.0.1:30000 http://127.0.0.1:30001 http://127.0.0.1:30002 http://127.0.0.1:30003 http://127.0.0.1:30004 http://127.0.0.1:30005 http://127.0.0.1:30006'
# exec: the engine replaces this shell, so the recorded process group is the engine's own.
exec /root/venv/bin/python3 "${DFLASHOPS_WORKDIR}"/payloads/326a2fc60f8bcb9e/generate_completions.py --prompts /workspace/prompts.jsonl --output-dir /workspace/completions --max-output-tokens 4096 --concurrency 48 --temperature 0.6 --top-p 0.95 --chat-template-kwargs '{"enable_thinking":true}' --servers http://127.0.0.1:30000 http://127.0.0.1:30001 http://127.0.0.1:30002 http://127.0.0.1:30003 http://127.0.0.1:30004 http://127.0.0.1:30005 http://127.0.0.1:30006

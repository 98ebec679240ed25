#!/usr/bin/env bash
# dflashops launch script: unit stub-0 on host local, from playbook demo.
# Rendered by dflashops 0.1.0; do not edit on the host: change the playbook and deploy.
set -euo pipefail
DFLASHOPS_UNIT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)"
DFLASHOPS_WORKDIR="$(cd -- "$DFLASHOPS_UNIT_DIR/../.." && pwd -P)"
export DFLASHOPS_UNIT_DIR DFLASHOPS_WORKDIR
export DFLASHOPS_UNIT=stub-0
export DFLASHOPS_FINGERPRINT=091398410058ce2a4cf83025063a8727b963f869295aeb17b259cac4a38aeb79
# A job may write its progress (any JSON object) here; `dflashops status` shows it.
export DFLASHOPS_PROGRESS_FILE="$DFLASHOPS_UNIT_DIR/progress.json"
printf '[dflashops] unit=%s fingerprint=%s engine=%s tp=%s dp=%s port=%s gpus=%s started=%s\n' \
  stub-0 091398410058ce2a4cf83025063a8727b963f869295aeb17b259cac4a38aeb79 stub 1 1 31000 0 "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
export CUDA_VISIBLE_DEVICES=0
export DFLASHOPS_STUB_LATENCY=0.05
# STAND-IN: the dflashops stub engine, a CPU process with SGLang's core flags and endpoints.
# It loads no model and runs no GPU work; it exists for rehearsals, demos and CI.
echo "[dflashops] STAND-IN: this unit runs the dflashops stub engine, not SGLang"
cd -- "$DFLASHOPS_UNIT_DIR"
printf '[dflashops] exec: %s\n' 'python3 "${DFLASHOPS_WORKDIR}"/payloads/a59ee24ce9a1b79a/stub_engine.py --model-path demo/stub-model --host 127.0.0.1 --port 31000 --tp-size 1 --dp-size 1 --served-model-name demo-model --reasoning-parser qwen3'
# exec: the engine replaces this shell, so the recorded process group is the engine's own.
exec python3 "${DFLASHOPS_WORKDIR}"/payloads/a59ee24ce9a1b79a/stub_engine.py --model-path demo/stub-model --host 127.0.0.1 --port 31000 --tp-size 1 --dp-size 1 --served-model-name demo-model --reasoning-parser qwen3

#!/usr/bin/env bash
# dflashops launch script: unit stub-1 on host local, from playbook demo.
# Rendered by dflashops 0.1.0; do not edit on the host: change the playbook and deploy.
set -euo pipefail
DFLASHOPS_UNIT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)"
DFLASHOPS_WORKDIR="$(cd -- "$DFLASHOPS_UNIT_DIR/../.." && pwd -P)"
export DFLASHOPS_UNIT_DIR DFLASHOPS_WORKDIR
export DFLASHOPS_UNIT=stub-1
export DFLASHOPS_FINGERPRINT=07ed210e2328363a2ab033332d492f5317be1586517c754591429a2e075a0686
# A job may write its progress (any JSON object) here; `dflashops status` shows it.
export DFLASHOPS_PROGRESS_FILE="$DFLASHOPS_UNIT_DIR/progress.json"
printf '[dflashops] unit=%s fingerprint=%s engine=%s tp=%s dp=%s port=%s gpus=%s started=%s\n' \
  stub-1 07ed210e2328363a2ab033332d492f5317be1586517c754591429a2e075a0686 stub 1 1 31001 1 "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
export CUDA_VISIBLE_DEVICES=1
export DFLASHOPS_STUB_LATENCY=0.05
# STAND-IN: the dflashops stub engine, a CPU process with SGLang's core flags and endpoints.
# It loads no model and runs no GPU work; it exists for rehearsals, demos and CI.
echo "[dflashops] STAND-IN: this unit runs the dflashops stub engine, not SGLang"
cd -- "$DFLASHOPS_UNIT_DIR"
printf '[dflashops] exec: %s\n' 'python3 "${DFLASHOPS_WORKDIR}"/payloads/a59ee24ce9a1b79a/stub_engine.py --model-path demo/stub-model --host 127.0.0.1 --port 31001 --tp-size 1 --dp-size 1 --served-model-name demo-model --reasoning-parser qwen3'
# exec: the engine replaces this shell, so the recorded process group is the engine's own.
exec python3 "${DFLASHOPS_WORKDIR}"/payloads/a59ee24ce9a1b79a/stub_engine.py --model-path demo/stub-model --host 127.0.0.1 --port 31001 --tp-size 1 --dp-size 1 --served-model-name demo-model --reasoning-parser qwen3

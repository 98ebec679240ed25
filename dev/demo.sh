#!/usr/bin/env bash
# Set up and run the embedded default: the local host (connection: local, no SSH, no GPU) with
# two stub servers (the CPU stand-in for SGLang) and the completions generator from
# playbooks/demo.yaml. Deploys (a Python environment, the prompts, the servers under their
# supervisors, the job), waits for the generation job, shows status and one frame of `top`, then
# stops it all. On the way it prints the launch lines of the two-node Ray example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh
D=.venv/bin/dflashops
$D preflight --host local
# What a service over two nodes would run (nothing is started: those hosts are examples).
$D render --host h200 -p playbooks/two-node-vllm-ray.yaml | grep -E '^(# dflashops launch|exec)'
$D deploy --host local
for _ in $(seq 120); do
    state=$($D status --host local --json .dflashops/demo-status.json >/dev/null 2>&1 || true
            .venv/bin/python -c 'import json,sys
rows=[json.loads(l) for l in open(".dflashops/demo-status.json")]
print(next((r["state"] for r in rows if r.get("unit")=="generate"),"?"))')
    [[ "$state" == "done" || "$state" == "failed" || "$state" == "dead" ]] && break
    sleep 1
done
$D status --host local
$D top --once --host local
$D logs generate --host local --lines 3
$D stop --host local
[[ "$state" == "done" ]]

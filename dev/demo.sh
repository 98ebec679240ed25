#!/usr/bin/env bash
# Set up and run the embedded default: the local host (connection: local, no SSH, no GPU) with
# two stub servers (the CPU stand-in for SGLang) and the completions generator from
# playbooks/demo.yaml. Deploys (a Python environment, the prompts, the servers under their
# supervisors, the job), waits for the generation job, shows status and one frame of `top`, then
# stops it all. On the way it prints the launch lines of the two-node Ray example, runs the
# built environment's console script from its `path`, shows that the servers' API key (given
# through secret_args) is on no command line, who last held the host's deploy lock, and the
# size of the kept copy of the job's output (`keep:`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh
D=.venv/bin/dflashops
# The servers' API key: from the controller's environment, never from a file in the repo.
export DFLASHOPS_DEMO_API_KEY="${DFLASHOPS_DEMO_API_KEY:-$(.venv/bin/python -c 'import secrets; print(secrets.token_hex(16))')}"
$D preflight --host local
# What a service over two nodes would run (nothing is started: those hosts are examples).
$D render --host h200 -p playbooks/two-node-vllm-ray.yaml | grep -E '^(# dflashops launch|exec)'
$D deploy --host local
# The environment works from its path like one made there by hand: its console scripts run.
.dflashops/local/venv-demo/bin/demo-tools
# The key reached the servers through a 0600 file, not argv: no process shows it.
if grep -qs -- "$DFLASHOPS_DEMO_API_KEY" /proc/[0-9]*/cmdline; then
    echo "demo: the API key is visible in a command line" >&2
    exit 1
fi
echo "demo: the servers' API key is on no command line (ps shows: $(pgrep -a -f 'stub_engine' | head -n1 | cut -c1-100) ...)"
for _ in $(seq 120); do
    # `status --json`: one document on stdout, raw values (docs/operations.md has its schema).
    state=$($D status --host local --unit generate --json 2>/dev/null |
            .venv/bin/python -c 'import json,sys
print(next((u["state"] for u in json.load(sys.stdin)["units"]), "?"))' || true)
    [[ "$state" == "done" || "$state" == "failed" || "$state" == "dead" ]] && break
    sleep 1
done
$D status --host local
$D top --once --host local
$D watch --once --host local  # the control loop's one tick: every unit is where it should be
# The fleet on one page, with plots over time: the command to run it (the demo opens nothing).
echo "demo: the dashboard: $D dashboard --host local  (then open http://127.0.0.1:8765/)"
$D logs generate --host local --lines 3
$D unlock --host local  # the deploy lock: free, and who held it last
$D stop --host local
$D history --host local  # what was deployed and stopped, by whom, with which units
# keep: the generator's outputs, mirrored off the host by deploy and stop (the same files).
kept=.dflashops/keep/local/generate/completions
echo "demo: kept copy of the generator's output: $(du -sh "$kept" | cut -f1) in $kept," \
    "$(cat "$kept"/completions-*.jsonl | wc -l) records"
[[ "$state" == "done" ]]

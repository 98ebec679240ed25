#!/usr/bin/env bash
# Set up and run the embedded default: the local host (connection: local, no SSH, no GPU) with
# the stub engine from playbooks/demo.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh
.venv/bin/dflashops preflight --host local
.venv/bin/dflashops render --host local --out .dflashops/rendered

#!/usr/bin/env bash
# Set up and run the whole test suite: sshd for the fake GPU hosts, the venv, lint, types, tests.
# This is the README's test command and exactly what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/ensure-sshd.sh
bash dev/setup.sh dev
bash dev/parsers-env.sh  # the engines' real parsers, built once and cached beside .venv
bash dev/ray-wheels.sh >/dev/null  # the Ray tests build their environment from it
bash dev/browser.sh  # chromium and chromium-driver: the dashboard's page in a real browser
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/dflashops preflight
# -p no:cacheprovider: CI runs on a read-only-ish fresh clone; no .pytest_cache needed.
exec .venv/bin/pytest -n 2 -p no:cacheprovider "$@"

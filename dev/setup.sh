#!/usr/bin/env bash
# Create .venv and install dflashops into it (editable), with the dev tools when given "dev".
# Works on a fresh Debian with Python 3.10+: installs python3-venv through apt-get when the
# interpreter cannot make a venv and we are root.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"

if [[ ! -x .venv/bin/python ]]; then
    if ! "$PY" -m venv .venv 2>/dev/null; then
        rm -rf .venv
        if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
            echo "setup: $PY cannot create a venv; installing python3-venv" >&2
            apt-get update -qq >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
            "$PY" -m venv .venv
        else
            echo "setup: '$PY -m venv' failed: install your distribution's python3-venv package" >&2
            exit 1
        fi
    fi
fi
spec="."
[[ "$extras" == "dev" ]] && spec=".[dev]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec"
echo "setup: .venv ready ($(.venv/bin/python --version), dflashops $(.venv/bin/dflashops --version | cut -d' ' -f2))"

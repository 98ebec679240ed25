#!/usr/bin/env bash
# The engines' real parsers for the tests (DESIGN.md "Real parts" 2): .venv-parsers beside .venv,
# with SGLang 0.5.23 and vLLM 0.33.0 installed --no-deps (the versions of the reference flag
# lists), CPU torch, and only the modules their parser code imports. No GPU, no model: it can
# parse command lines, never serve. tests/unit/test_real_parsers.py runs every rendered engine
# command line through dflashops/builtins/engine_args.py with its python.
#
# Cached by content: the environment is built once per spec (the hash of everything below) in
# ${DFLASHOPS_CACHE:-~/.cache/dflashops}/parsers-<hash>, and .venv-parsers is a link to it. A
# fresh clone on the same machine (CI's) links the build it finds instead of spending minutes
# and 3.4 GB again; a changed spec builds a new one. It is built in place (a venv names its own
# folder in its scripts) and its stamp is written last, so a killed build is redone by the next
# run. Cold: about 3.4 GB and about 5 minutes on 2 cores (see the last line).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
LINK=.venv-parsers
CACHE="${DFLASHOPS_CACHE:-$HOME/.cache/dflashops}"

# torch 2.13.0 installs its CPU build from this machine's own wheel folder (no download).
TORCH=(torch==2.13.0)
ENGINES=(sglang==0.5.23 vllm==0.33.0)
# What the two parsers import (found by importing and parsing until nothing was missing), with
# the engines' own version constraints where they state one.
MODULES=(
    aiohttp cachetools cbor2 cloudpickle "fastapi>=0.133.0,<0.137.0" ipython
    "llguidance>=1.7.6,<1.8.0" msgspec numpy "openai>=2.25.0" openai-harmony==0.0.4 orjson packaging
    partial-json-parser "pillow>=13.0.0" "prometheus-client>=0.20.0" psutil py-cpuinfo pybase64
    "pydantic>=2.12.0" pyyaml "pyzmq>=25.1.2" regex "requests>=2.33.0" "starlette>=1.0.1"
    tqdm transformers==5.19.0 triton "uvicorn>=0.51" uvloop watchfiles xgrammar==0.2.8
)

spec="$("$PY" -c 'import sys; print(sys.version)') ${TORCH[*]} ${ENGINES[*]} ${MODULES[*]}"
hash="$(printf '%s' "$spec" | sha256sum | cut -c1-16)"
DEST="$CACHE/parsers-$hash"
STAMP="$DEST/.dflashops-spec"

mkdir -p "$CACHE"
exec 9>>"$CACHE/parsers.lock"
flock 9  # two runs at once: the second waits, then finds the first one's stamp
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$hash" ]]; then
    ln -sfn "$DEST" "$LINK"
    echo "parsers-env: $LINK ready (cached in $DEST)"
    exit 0
fi

started=$(date +%s)
rm -rf "$DEST"
[[ -L "$LINK" || ! -e "$LINK" ]] || rm -rf "$LINK"  # a folder from before the cache moved out
"$PY" -m venv "$DEST"
pip=("$DEST/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "${TORCH[@]}"
"${pip[@]}" "${MODULES[@]}"
# --no-deps: their full requirements are CUDA kernels and GBs the parsers never import.
# VLLM_TARGET_DEVICE=cpu: vLLM's CPU build, the one that can build its parser without a GPU.
VLLM_TARGET_DEVICE=cpu "${pip[@]}" --no-deps "${ENGINES[@]}"

# The check the tests rely on: both parsers import and parse a plain line.
answer="$(printf '%s' '{"engines":{"sglang":[["--model-path","m"]],"vllm":[["m"]]}}' |
    VLLM_TARGET_DEVICE=cpu "$DEST/bin/python" dflashops/builtins/engine_args.py 2>/dev/null)" || true
if ! printf '%s' "$answer" | "$PY" -c '
import json, sys
got = json.load(sys.stdin)["engines"]
bad = {k: v["error"] for k, v in got.items() if v["status"] != "parsed" or not v["lines"][0]["ok"]}
sys.exit(f"parsers-env: {bad}" if bad else 0)'; then
    echo "parsers-env: $DEST was built but its parsers do not work (answer: ${answer:-none}); it is rebuilt on the next run" >&2
    exit 1
fi
echo "$hash" >"$STAMP"
ln -sfn "$DEST" "$LINK"
echo "parsers-env: $LINK built in $(($(date +%s) - started))s, $(du -sh "$DEST" | cut -f1) (in $DEST)"

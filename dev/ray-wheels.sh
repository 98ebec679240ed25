#!/usr/bin/env bash
# Ray's wheels and its dependencies', downloaded once into .wheels/ray-<version>/ (git-ignored)
# for the Ray tests: they build the test hosts' environment from that folder alone (`wheels:`),
# as a node without an index would, so no test downloads anything. The Ray of .venv, for
# .venv's Python (the environment is made with that interpreter). Prints the folder.
set -euo pipefail
cd "$(dirname "$0")/.."
version="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("ray"))')"
dest=".wheels/ray-$version"
if [[ ! -e "$dest.done" ]]; then
    rm -rf "$dest"
    mkdir -p "$dest"
    .venv/bin/python -m pip download -q --disable-pip-version-check --only-binary=:all: \
        --dest "$dest" "ray==$version" >&2
    touch "$dest.done"
fi
echo "$dest"

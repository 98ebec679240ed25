#!/usr/bin/env bash
# Make sure this machine can run the integration tests' fake GPU hosts (tests/integration):
# OpenSSH's sshd (the hosts), rsync (the file-sync benchmark's yardstick) and the system
# python's venv module (environments are built on the hosts with /usr/bin/python3).
# Idempotent: installs what is missing (root + apt-get only, `apt-get update` first) and creates
# /run/sshd.
set -euo pipefail

SSHD=/usr/sbin/sshd
missing=()
[[ -x "$SSHD" ]] || missing+=(openssh-server)
command -v rsync >/dev/null 2>&1 || missing+=(rsync)
if [[ -x /usr/bin/python3 ]] && ! /usr/bin/python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    missing+=(python3-venv)
fi
did="nothing to install"

if (( ${#missing[@]} )); then
    if [[ "$(id -u)" -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        echo "ensure-sshd: missing ${missing[*]} and cannot install them here (root + apt-get): install them" >&2
        exit 1
    fi
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    did="installed ${missing[*]}"
fi
if [[ ! -x "$SSHD" ]]; then
    echo "ensure-sshd: $SSHD is still missing after installing openssh-server" >&2
    exit 1
fi

if [[ ! -d /run/sshd ]]; then
    if ! mkdir -p /run/sshd 2>/dev/null; then
        echo "ensure-sshd: cannot create /run/sshd (sshd's privilege separation directory)" >&2
        exit 1
    fi
    chmod 0755 /run/sshd
    did="$did, created /run/sshd"
fi

echo "ensure-sshd: $did ($("$SSHD" -V 2>&1 | head -n1 | cut -d, -f1), $(rsync --version | head -n1 | cut -d' ' -f1-4))"

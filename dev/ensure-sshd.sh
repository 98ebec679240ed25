#!/usr/bin/env bash
# Make sure OpenSSH's sshd can run the integration tests' fake GPU hosts (tests/integration).
# Idempotent: installs openssh-server when missing (root + apt-get only) and creates /run/sshd.
set -euo pipefail

SSHD=/usr/sbin/sshd
did="sshd present"

if [[ ! -x "$SSHD" ]]; then
    if [[ "$(id -u)" -ne 0 ]]; then
        echo "ensure-sshd: $SSHD is missing and we are not root: install openssh-server" >&2
        exit 1
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "ensure-sshd: $SSHD is missing and apt-get is not available: install openssh-server" >&2
        exit 1
    fi
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null
    if [[ ! -x "$SSHD" ]]; then
        echo "ensure-sshd: installed openssh-server but $SSHD is still missing" >&2
        exit 1
    fi
    did="installed openssh-server"
fi

if [[ ! -d /run/sshd ]]; then
    if ! mkdir -p /run/sshd 2>/dev/null; then
        echo "ensure-sshd: cannot create /run/sshd (sshd's privilege separation directory)" >&2
        exit 1
    fi
    chmod 0755 /run/sshd
    did="$did, created /run/sshd"
fi

echo "ensure-sshd: $did ($("$SSHD" -V 2>&1 | head -n1 | cut -d, -f1))"

#!/usr/bin/env bash
# Debian's chromium and chromium-driver for the dashboard's browser tests
# (tests/integration/test_dashboard.py drives them through selenium, from the dev extra).
# Idempotent and quiet: nothing happens when both are there. Installs them with apt-get when
# missing and root (CI runs as root on a fresh Debian); otherwise says what to install, and the
# browser tests skip (or fail under CI=true).
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
if [[ "$(id -u)" -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "browser: chromium or chromedriver is missing: install Debian's chromium and" \
        "chromium-driver (apt-get install chromium chromium-driver) for the dashboard's browser tests" >&2
    exit 0
fi
echo "browser: installing chromium and chromium-driver (apt-get)" >&2
apt-get update -qq >/dev/null
# fonts-liberation: text on the page (and in its screenshot) needs a font; the rest of
# chromium's recommends (desktop integration, printing) does not serve a headless test.
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium chromium-driver fonts-liberation >/dev/null
echo "browser: $(chromium --version 2>/dev/null | head -n1), $(chromedriver --version | cut -d' ' -f1-2)" >&2

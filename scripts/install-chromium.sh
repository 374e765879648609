#!/usr/bin/env bash
# Install Debian's Chromium for the browser test (tests/browser): headless, no downloads of its own.
# Idempotent and quiet: exits 0 at once when chromium is already on PATH; prints apt's log only
# when the install fails.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq && \
       $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends chromium fonts-dejavu-core; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "install-chromium.sh: apt-get could not install chromium (see above)" >&2
    exit 1
fi
command -v chromium >/dev/null

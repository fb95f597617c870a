#!/usr/bin/env bash
# Debian packages the full test suite needs. Installs only what is missing; safe to re-run.
# make test runs this first: without root it stops here, before anything else starts.
set -euo pipefail
if [[ $(id -u) -ne 0 ]]; then
    cat >&2 <<'MSG'
system_deps: make test needs root (sudo make test): it installs Debian packages (docker.io, debootstrap,
shellcheck, chromium), starts a Docker engine, builds the molecule images with debootstrap and creates
a test account. make pipeline needs none of this: run it as yourself.
MSG
    exit 1
fi
declare -A wanted=([docker.io]=dockerd [debootstrap]=debootstrap [shellcheck]=shellcheck
                   [chromium]=chromium)  # headless screenshot of the pipeline report (tests/unit)
missing=()
for pkg in "${!wanted[@]}"; do
    command -v "${wanted[$pkg]}" >/dev/null 2>&1 || missing+=("$pkg")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
echo "system_deps: installing ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"

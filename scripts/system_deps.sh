#!/usr/bin/env bash
# Debian packages the full test suite needs. Installs only what is missing; safe to re-run.
set -euo pipefail
declare -A wanted=([docker.io]=dockerd [debootstrap]=debootstrap [shellcheck]=shellcheck
                   [chromium]=chromium)  # headless screenshot of the pipeline report (tests/unit)
missing=()
for pkg in "${!wanted[@]}"; do
    command -v "${wanted[$pkg]}" >/dev/null 2>&1 || missing+=("$pkg")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"
echo "system_deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"

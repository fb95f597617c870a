#!/usr/bin/env bash
# Install a controller requirements file into an existing venv, byte-compiling everything except the
# `ansible` package's collections.
#
#   scripts/pip_install_controller.sh VENV REQUIREMENTS
#
# ansible-core reads collection code as source (its collection loader compiles on every import and never
# reads a .pyc), yet pip byte-compiles every file it installs: for the `ansible` package that is some 15,000
# files, and about 60% of the CPU a fresh `pip install -r requirements/test.txt` spends. So pip installs
# without compiling, and compileall (all cores) compiles the rest, whose .pyc files imports do read.
# Shared by scripts/bootstrap.sh, scripts/controller_next.sh and the integration tests' system-Python venv.
set -euo pipefail
venv=$1
requirements=$2
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-compile -r "$requirements"
site_packages=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$venv/bin/python" -m compileall -q -j 0 -x '/ansible_collections/' "$site_packages" > /dev/null

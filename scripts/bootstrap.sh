#!/usr/bin/env bash
# Create or refresh the checkout's virtual environment and the collection link.
# Safe to run again: the venv is rebuilt only when a requirements file or its Python changed.
# PYTHON: the interpreter the venv is built on. By default the distribution's /usr/bin/python3 when it is
# 3.11 or newer (ansible-core's floor for a controller) and can make a venv with pip: distributions build
# it optimised (PGO, LTO), and every Ansible task, pytest and molecule run on this venv's interpreter spends
# about a fifth less CPU there than on a Python built without them, as pyenv builds by default
# (bench/controller_python.py). Otherwise python3 on PATH.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
SYSTEM_PYTHON=/usr/bin/python3
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    if [[ -x $SYSTEM_PYTHON ]] && "$SYSTEM_PYTHON" -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        PYTHON=$SYSTEM_PYTHON
    fi
fi
VENV="$ROOT/.venv"
STAMP="$VENV/.requirements.sha256"

wanted="$( { cat requirements/*.txt; "$PYTHON" -c 'import sys; print(sys.executable, sys.version)'; } | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" || "$(cat "$STAMP" 2>/dev/null)" != "$wanted" ]]; then
    echo "bootstrap: installing requirements/test.txt into $VENV (on $("$PYTHON" -c 'import sys; print(sys.executable)'))"
    # --clear: a venv made on another Python keeps that Python's links and site-packages otherwise
    "$PYTHON" -m venv --clear "$VENV"
    scripts/pip_install_controller.sh "$VENV" requirements/test.txt
    echo "$wanted" > "$STAMP"
fi

# ansible.cfg's collections_path points here, so gpuflow.eagle3.* resolves to the checkout.
mkdir -p .cache/collections/ansible_collections/gpuflow
ln -sfn ../../../.. .cache/collections/ansible_collections/gpuflow/eagle3

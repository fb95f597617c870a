#!/usr/bin/env bash
# Create or refresh the checkout's virtual environment and the collection link.
# Safe to run again: the venv is rebuilt only when a requirements file changed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
STAMP="$VENV/.requirements.sha256"

wanted="$(cat requirements/*.txt | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" || "$(cat "$STAMP" 2>/dev/null)" != "$wanted" ]]; then
    echo "bootstrap: installing requirements/test.txt into $VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -r requirements/test.txt
    echo "$wanted" > "$STAMP"
fi

# ansible.cfg's collections_path points here, so gpuflow.eagle3.* resolves to the checkout.
mkdir -p .cache/collections/ansible_collections/gpuflow
ln -sfn ../../../.. .cache/collections/ansible_collections/gpuflow/eagle3

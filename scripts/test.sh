#!/usr/bin/env bash
# Run test phases in order, time each, print a summary; exit non-zero if any phase failed.
# Phases: unit mutation lint sanity package integration molecule.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 1
export PATH="$ROOT/.venv/bin:$PATH" ANSIBLE_CONFIG="$ROOT/ansible.cfg" PYTHONUNBUFFERED=1

run_phase() {
    case "$1" in
        unit)        pytest -q tests/unit ;;
        mutation)    python tests/mutation_check.py ;;
        lint)        ansible-lint --profile production ;;
        sanity)      scripts/sanity.sh ;;
        package)     scripts/package_check.sh ;;
        integration) pytest -q --durations=12 tests/integration ;;
        molecule)    scripts/molecule.sh ;;
    esac
}

for phase in "$@"; do
    case "$phase" in
        unit|mutation|lint|sanity|package|integration|molecule) ;;
        *) echo "test.sh: unknown phase '$phase'" >&2; exit 2 ;;
    esac
done

summary=()
failed=0
start_all=$SECONDS
for phase in "$@"; do
    echo "=== phase: $phase ==="
    start=$SECONDS
    if run_phase "$phase"; then verdict=ok; else verdict=FAILED; failed=1; fi
    summary+=("$(printf '%-12s %-7s %5ds' "$phase" "$verdict" $((SECONDS - start)))")
done
echo "=== summary ==="
printf '%s\n' "${summary[@]}"
printf '%-12s %-7s %5ds\n' total "$([[ $failed == 0 ]] && echo ok || echo FAILED)" $((SECONDS - start_all))
exit "$failed"

#!/usr/bin/env bash
# Run test phases in order, time each, print a summary; exit non-zero if any phase failed.
# Phases: unit lint sanity package integration molecule.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH" ANSIBLE_CONFIG="$ROOT/ansible.cfg" PYTHONUNBUFFERED=1

phase_unit()        { pytest -q tests/unit; }
phase_lint()        { ansible-lint --profile production; }
phase_sanity()      { scripts/sanity.sh; }
phase_package()     { scripts/package_check.sh; }
phase_integration() { pytest -q tests/integration; }
phase_molecule()    { scripts/molecule.sh; }

declare -a summary=()
failed=0
start_all=$SECONDS
for phase in "$@"; do
    echo "=== phase: $phase ==="
    start=$SECONDS
    if "phase_$phase"; then verdict=ok; else verdict=FAILED; failed=1; fi
    summary+=("$(printf '%-12s %-7s %5ds' "$phase" "$verdict" $((SECONDS - start)))")
done
echo "=== summary ==="
printf '%s\n' "${summary[@]}"
printf '%-12s %-7s %5ds\n' total "$([[ $failed == 0 ]] && echo ok || echo FAILED)" $((SECONDS - start_all))
exit $failed

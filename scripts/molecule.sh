#!/usr/bin/env bash
# Run molecule scenarios offline against locally built systemd containers.
#
#   scripts/molecule.sh                 every scenario under molecule/
#   scripts/molecule.sh default fleet   just these, in this order
#   MOLECULE_ACTION=converge scripts/molecule.sh default   any other molecule command
#
# Ensures first: a Docker engine (scripts/dockerd.sh), the images (scripts/build_image.sh:
# bookworm always, and each other suite a scenario's molecule.yml names as
# gpuflow/debian-systemd:<suite>), the collection link
# .cache/collections/ansible_collections/gpuflow/eagle3 -> repo root.
# Runs each scenario even when an earlier one failed; exits non-zero if any failed; prints
# per-scenario wall time. Uses the venv at .venv (override: GPUFLOW_VENV). Holds one lock per
# scenario (/tmp/gpuflow-molecule.locks/<scenario>.lock) while it runs, so that two runs of one
# scenario take turns and different scenarios run side by side.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
VENV=${GPUFLOW_VENV:-$ROOT/.venv}
ACTION=${MOLECULE_ACTION:-test}

say() { printf '[molecule.sh] %s\n' "$*" >&2; }
fmt() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }
stamp_steps() {
  python3 -u -c '
import sys, time
start = time.monotonic()
for line in sys.stdin:
    if line.startswith("INFO") and " > " in line:
        line = "[+%4ds] %s" % (time.monotonic() - start, line)
    sys.stdout.write(line)
'
}

cd "$ROOT" || exit 1
if [ ! -x "$VENV/bin/molecule" ]; then
  say "no molecule in $VENV; install requirements/test.txt into it first"; exit 1
fi
export PATH="$VENV/bin:$PATH"
# stray settings from ansible-test or a caller would change what molecule runs
unset _ANSIBLE_COVERAGE_CONFIG ANSIBLE_PYTHON_INTERPRETER ANSIBLE_CONFIG ANSIBLE_STDOUT_CALLBACK
export ANSIBLE_COLLECTIONS_PATH="$ROOT/.cache/collections"
export PY_COLORS=0 ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0
# community.docker waits 60 s for an answer from the engine by default; on a loaded 2-core machine removing a
# container with a vLLM venv in its layer most likely took longer: the vllm_server scenario's destroy failed
# with rc 2 on CI (its log kept no more)
export DOCKER_TIMEOUT=${DOCKER_TIMEOUT:-600}

if [ $# -gt 0 ]; then
  scenarios=("$@")
else
  scenarios=()
  for f in molecule/*/molecule.yml; do
    [ -e "$f" ] && scenarios+=("$(basename "$(dirname "$f")")")
  done
fi
if [ ${#scenarios[@]} -eq 0 ]; then say "no scenarios under molecule/"; exit 1; fi
for s in "${scenarios[@]}"; do
  [ -f "molecule/$s/molecule.yml" ] || { say "no scenario molecule/$s"; exit 1; }
done

# One run of a scenario at a time on this machine: two runs of one scenario share its container
# names and molecule's ephemeral directory (one prunes it under the other). Scenarios differ in
# both (each names its own containers and network), so they need not wait for each other.
LOCKS=${GPUFLOW_MOLECULE_LOCKS:-/tmp/gpuflow-molecule.locks}
mkdir -p "$LOCKS" || { say "cannot create the lock directory $LOCKS"; exit 1; }

t0=$(date +%s)
"$HERE/dockerd.sh" start || { say "docker engine unavailable"; exit 1; }
t1=$(date +%s)
# bookworm, plus every other suite the scenarios run on (e.g. trixie in default)
suites=$( { echo bookworm; for s in "${scenarios[@]}"; do
  grep -Eho 'gpuflow/debian-systemd:[a-z]+' "molecule/$s/molecule.yml" | cut -d: -f2; done; } | sort -u)
for suite in $suites; do
  "$HERE/build_image.sh" "$suite" >/dev/null || { say "image build failed ($suite)"; exit 1; }
done
t2=$(date +%s)
say "engine ready in $(fmt $((t1 - t0))), images (${suites//$'\n'/ }) ready in $(fmt $((t2 - t1)))"

link=.cache/collections/ansible_collections/gpuflow/eagle3
if [ "$(readlink "$link" 2>/dev/null)" != "../../../.." ]; then
  mkdir -p "$(dirname "$link")" && ln -sfn ../../../.. "$link"
fi

declare -a report
failed=0
for s in "${scenarios[@]}"; do
  say "=== molecule $ACTION -s $s ==="
  exec 9>>"$LOCKS/$s.lock"
  if ! flock -n 9; then
    say "another scripts/molecule.sh run holds $LOCKS/$s.lock; waiting for it"
    flock 9
  fi
  start=$(date +%s)
  # under make test, the verifier's results go beside the pytest phases' junit files, so that the run's
  # summary names a failed verifier test (CI shows only the tail of the output)
  junit=
  [ -n "${GPUFLOW_TEST_TIMES:-}" ] && junit="--junitxml=$(dirname "$GPUFLOW_TEST_TIMES")/junit-molecule-$s.xml"
  # molecule's step lines ("INFO [scenario > step] ...") carry the seconds since the scenario began
  PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} $junit" molecule "$ACTION" -s "$s" 2>&1 | stamp_steps
  rc=${PIPESTATUS[0]}
  seconds=$(($(date +%s) - start))
  took=$(fmt "$seconds")
  [ -n "${GPUFLOW_TEST_TIMES:-}" ] && printf '%d\tmolecule %s\n' "$seconds" "$s" >>"$GPUFLOW_TEST_TIMES"
  if [ "$rc" -eq 0 ]; then
    report+=("$s|passed|$took")
  else
    report+=("$s|FAILED (rc=$rc)|$took"); failed=1
    # leave nothing running behind a failed test
    [ "$ACTION" = test ] && molecule destroy -s "$s" >/dev/null 2>&1
  fi
  exec 9>&-
  IFS='|' read -r _ status took <<<"${report[-1]}"
  say "=== $s: $status in $took ==="
done

say "summary (molecule $ACTION; engine $(fmt $((t1 - t0))), images $(fmt $((t2 - t1))), total $(fmt $(($(date +%s) - t0)))):"
for line in "${report[@]}"; do
  IFS='|' read -r name status took <<<"$line"
  printf '  %-24s %-18s %s\n' "$name" "$status" "$took" >&2
done
exit $failed

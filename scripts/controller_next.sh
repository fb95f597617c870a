#!/usr/bin/env bash
# The collection under the newest ansible-core, on a controller with Debian 13's Python 3.13
# (ansible-core 2.20 and later need Python >= 3.12; this machine's is 3.11). `make test` runs it
# as the phase controller-next.
#
#   scripts/controller_next.sh                  unit, sanity, molecule (in this order)
#   scripts/controller_next.sh unit sanity      just these parts
#
# The controller is the trixie image of scripts/build_image.sh run as a plain command container
# (systemd does not boot in it) on the host's network, with
#   - the checkout mounted at its own path, so paths in scenarios and ansible.cfg stay true;
#   - the engine's socket and the host's docker CLI (the community.docker connection runs
#     `docker exec`), so molecule inside drives the host's engine, as scripts/molecule.sh does;
#   - /tmp/gpuflow-molecule.locks (GPUFLOW_MOLECULE_LOCKS), so that its scenario takes turns with
#     the same scenario of every other scripts/molecule.sh run on this machine;
#   - the host's CA bundle, so pip reaches PyPI the way the host does.
# It runs as the calling user, so what it writes into the checkout is owned as if the host had
# written it. Its own state lies in .cache/controller-next (nothing the host's runs use): the venv
# with requirements/controller-next.txt (rebuilt only when that list or the image's Python
# changed), HOME (pip's cache, ansible's tmp), and ansible-test's work folder
# (scripts/sanity.sh with GPUFLOW_SANITY_WORK). No .pyc files or pytest cache are written into
# the checkout. molecule's ephemeral state (.ansible/tmp) is shared with the host's runs, one run
# of a scenario at a time under that scenario's lock.
# Prints the ansible-core and Python that ran and each part's time; exits non-zero when any part
# (or the set-up) failed.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
REQUIREMENTS=$ROOT/requirements/controller-next.txt
NEXT=$ROOT/.cache/controller-next
VENV=$NEXT/venv
SUITE=trixie
LOCKS=${GPUFLOW_MOLECULE_LOCKS:-/tmp/gpuflow-molecule.locks}
ALL_PARTS=(unit sanity molecule)

say() { printf '[controller_next.sh] %s\n' "$*" >&2; }
fmt() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

# ---- inside the container ----------------------------------------------------------------------
inside() {
  local wanted rc failed=0 start part core python verdict
  local -a report=()
  cd "$ROOT" || return 1
  export PATH="$VENV/bin:$PATH" ANSIBLE_CONFIG="$ROOT/ansible.cfg"

  start=$SECONDS
  wanted=$( { cat "$REQUIREMENTS"; python3 -VV; } | sha256sum | cut -c1-16)
  if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.requirements.sha256" 2>/dev/null)" = "$wanted" ]; then
    say "venv $VENV is current"
  else
    say "creating $VENV from requirements/controller-next.txt"
    rm -rf "$VENV"
    if ! { python3 -m venv "$VENV" &&
           "$HERE/pip_install_controller.sh" "$VENV" "$REQUIREMENTS"; }; then
      say "venv creation failed"; rm -rf "$VENV"; return 1
    fi
    echo "$wanted" >"$VENV/.requirements.sha256"
  fi
  report+=("$(printf '%-10s %-7s %s' venv ok "$(fmt $((SECONDS - start)))")")
  # the whole output read, first line kept: `| head -n1` breaks ansible's pipe (a traceback)
  core=$(ansible --version) && core=${core%%$'\n'*}
  python=$(python -c 'import platform; print(platform.python_version())')
  say "controller: $core, Python $python," \
      "$(sed -n 's/^PRETTY_NAME="\(.*\)"$/\1/p' /etc/os-release)"

  for part in "$@"; do
    say "=== $part ==="
    start=$SECONDS
    case "$part" in
      unit)     python -m pytest -q -p no:cacheprovider tests/unit ;;
      sanity)   GPUFLOW_VENV=$VENV GPUFLOW_SANITY_WORK=$NEXT/sanity scripts/sanity.sh ;;
      molecule) GPUFLOW_VENV=$VENV GPUFLOW_MOLECULE_LOCKS=$LOCKS scripts/molecule.sh default ;;
    esac
    rc=$?
    if [ $rc -eq 0 ]; then verdict=ok; else verdict="FAILED (rc=$rc)"; failed=1; fi
    report+=("$(printf '%-10s %-7s %s' "$part" "$verdict" "$(fmt $((SECONDS - start)))")")
    say "=== $part: $verdict in $(fmt $((SECONDS - start))) ==="
  done
  say "summary, ${core//[\[\]]/}, Python $python:"
  printf '  %s\n' "${report[@]}" >&2
  return $failed
}

if [ "${1:-}" = --inside ]; then
  shift
  inside "$@"
  exit $?
fi

# ---- on the host ------------------------------------------------------------------------------
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=("${ALL_PARTS[@]}")
for part in "${parts[@]}"; do
  case "$part" in
    unit|sanity|molecule) ;;
    *) say "unknown part '$part' (unit, sanity, molecule)"; exit 2 ;;
  esac
done

t0=$SECONDS
mkdir -p "$NEXT/home"
# two runs at once would share the venv and ansible-test's work folder
exec 7>>"$NEXT/.lock"
if ! flock -n 7; then say "another controller_next.sh holds $NEXT/.lock; waiting"; flock 7; fi

"$HERE/dockerd.sh" start || { say "docker engine unavailable"; exit 1; }
for suite in bookworm "$SUITE"; do
  "$HERE/build_image.sh" "$suite" >/dev/null || { say "image build failed ($suite)"; exit 1; }
done
say "engine and images ready in $(fmt $((SECONDS - t0)))"

socket=/var/run/docker.sock
case "${DOCKER_HOST:-}" in unix://*) socket=${DOCKER_HOST#unix://} ;; esac
docker_cli=$(command -v docker) || { say "no docker CLI on PATH"; exit 1; }
# made here, so that it is the calling user's and not a directory the engine creates as root
mkdir -p "$LOCKS" || { say "cannot create the lock directory $LOCKS"; exit 1; }

args=(--rm --init --network host
      --user "$(id -u):$(id -g)"
      -v "$ROOT:$ROOT" -w "$ROOT"
      -v "$socket:/var/run/docker.sock"
      -v "$docker_cli:/usr/local/bin/docker:ro"
      -v "$LOCKS:$LOCKS"
      -e HOME="$NEXT/home" -e USER="$(id -un)" -e LOGNAME="$(id -un)"
      -e PYTHONDONTWRITEBYTECODE=1 -e PYTHONUNBUFFERED=1 -e PIP_DISABLE_PIP_VERSION_CHECK=1)
[ "$(id -u)" -eq 0 ] || args+=(--group-add "$(stat -c %g "$socket")")
ca=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
[ -r "$ca" ] && args+=(-v "$ca:/etc/ssl/certs/ca-certificates.crt:ro")
for var in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY PIP_INDEX_URL; do
  [ -n "${!var:-}" ] && args+=(-e "$var=${!var}")
done

docker run "${args[@]}" "gpuflow/debian-systemd:$SUITE" \
  bash "$ROOT/scripts/controller_next.sh" --inside "${parts[@]}"
rc=$?
say "total $(fmt $((SECONDS - t0))) (rc=$rc)"
exit $rc

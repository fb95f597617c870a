#!/usr/bin/env bash
# Ensure a Docker engine answers on this machine (no systemd as PID 1 here or in CI).
#
#   scripts/dockerd.sh [start]   install docker.io when missing, start dockerd in the background
#                                when `docker info` does not answer, wait until it does (bounded)
#   scripts/dockerd.sh stop      stop the dockerd this script started (pidfile), nothing else
#   scripts/dockerd.sh status    say whether the engine answers and who started it
#
# Idempotent: a running engine (ours or anyone's) is left alone.
# Environment: GPUFLOW_DOCKERD_LOG (default /var/log/gpuflow-dockerd.log),
#              GPUFLOW_DOCKERD_PIDFILE (default /run/gpuflow/dockerd.pid),
#              GPUFLOW_DOCKERD_TIMEOUT seconds to wait for the engine (default 90),
#              GPUFLOW_DOCKERD_NICE the niceness of a dockerd this script starts, which its containers
#              inherit (default 0).
set -euo pipefail

LOG=${GPUFLOW_DOCKERD_LOG:-/var/log/gpuflow-dockerd.log}
PIDFILE=${GPUFLOW_DOCKERD_PIDFILE:-/run/gpuflow/dockerd.pid}
TIMEOUT=${GPUFLOW_DOCKERD_TIMEOUT:-90}
NICE=${GPUFLOW_DOCKERD_NICE:-0}
[[ $NICE =~ ^-?[0-9]+$ ]] || { printf '[dockerd.sh] GPUFLOW_DOCKERD_NICE must be an integer, not %q\n' "$NICE" >&2; exit 2; }

say() { printf '[dockerd.sh] %s\n' "$*" >&2; }

need_root() {
  if [ "$(id -u)" -ne 0 ]; then
    say "must run as root (installs packages and starts dockerd)"; exit 1
  fi
}

answers() { timeout 10 docker info >/dev/null 2>&1; }

# pid from our pidfile when that process is still a dockerd, else nothing
our_pid() {
  local pid
  [ -r "$PIDFILE" ] || return 1
  pid=$(cat "$PIDFILE" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -d "/proc/$pid" ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ] || return 1
  echo "$pid"
}

install_engine() {
  local pkgs=() p
  # docker.io brings dockerd, containerd, runc and the CLI (a newer CLI already on PATH also works)
  if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker >/dev/null 2>&1; then
    pkgs+=(docker.io)
  fi
  command -v iptables >/dev/null 2>&1 || pkgs+=(iptables)
  [ ${#pkgs[@]} -gt 0 ] || return 0
  say "installing ${pkgs[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  # no init system here: keep the package scripts from starting services themselves
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod 0755 "$policy"; made_policy=1
  fi
  local rc=0
  apt-get update -qq || rc=$?
  [ $rc -eq 0 ] && { apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null || rc=$?; }
  [ $made_policy -eq 1 ] && rm -f "$policy"
  if [ $rc -ne 0 ]; then say "apt-get failed (rc=$rc)"; exit $rc; fi
  for p in dockerd docker; do
    command -v "$p" >/dev/null 2>&1 || { say "$p still missing after install"; exit 1; }
  done
}

start() {
  if answers; then
    say "docker engine already answers; leaving it alone"
    return 0
  fi
  need_root
  # one start at a time: two callers at once (test phases side by side) would each start a daemon,
  # and the pidfile would name the one that lost
  mkdir -p "$(dirname "$PIDFILE")"
  exec 8>>"$PIDFILE.lock"
  flock 8
  if answers; then
    say "docker engine already answers (started by another caller); leaving it alone"
    return 0
  fi
  install_engine
  if pid=$(our_pid); then
    say "dockerd (pid $pid) started earlier is not answering yet; waiting for it"
  else
    # a stale socket/pidfile from a dead daemon blocks a new one
    if [ -e /var/run/docker.pid ] && ! kill -0 "$(cat /var/run/docker.pid 2>/dev/null)" 2>/dev/null; then
      rm -f /var/run/docker.pid
    fi
    mkdir -p "$(dirname "$PIDFILE")" "$(dirname "$LOG")"
    say "starting dockerd (nice $NICE), log: $LOG"
    # setsid: own session, so it survives the calling shell and its job control; close
    # inherited descriptors (a caller's flock, a CI pipe) so the daemon does not hold them
    (
      for fd in /proc/self/fd/*; do
        fd=${fd##*/}
        [ "$fd" -gt 2 ] 2>/dev/null && eval "exec $fd>&-" 2>/dev/null
      done
      exec setsid nice -n "$NICE" dockerd >>"$LOG" 2>&1 </dev/null
    ) &
    echo $! >"$PIDFILE"
  fi
  local waited=0
  until answers; do
    if ! our_pid >/dev/null; then
      say "dockerd exited; last log lines:"; tail -n 30 "$LOG" >&2 || true
      rm -f "$PIDFILE"; exit 1
    fi
    if [ "$waited" -ge "$TIMEOUT" ]; then
      say "docker info did not answer within ${TIMEOUT}s; last log lines:"; tail -n 30 "$LOG" >&2 || true
      exit 1
    fi
    sleep 1; waited=$((waited + 1))
  done
  say "docker engine answers (server $(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?'))"
}

stop() {
  local pid n=0
  if ! pid=$(our_pid); then
    say "no dockerd started by this script is running; nothing to stop"
    rm -f "$PIDFILE"; return 0
  fi
  say "stopping dockerd (pid $pid)"
  kill -TERM "$pid"
  while [ -d "/proc/$pid" ] && [ $n -lt 60 ]; do sleep 0.5; n=$((n + 1)); done
  if [ -d "/proc/$pid" ]; then say "dockerd did not stop in 30 s; sending SIGKILL"; kill -KILL "$pid" || true; fi
  rm -f "$PIDFILE"
}

status() {
  if answers; then say "engine answers"; else say "engine does not answer"; fi
  if pid=$(our_pid); then say "started by this script: pid $pid, log $LOG"; else say "not started by this script"; fi
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac

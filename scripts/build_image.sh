#!/usr/bin/env bash
# Build the systemd-capable Debian image the molecule scenarios run on (bookworm, or trixie for
# Debian 13 hosts and the controller of scripts/controller_next.sh), locally, with debootstrap
# (no image registry is reachable) and `docker import`.
#
#   scripts/build_image.sh [SUITE]             build when missing, else reuse (prints the image tag)
#   scripts/build_image.sh --force [SUITE]     rebuild the root file system and re-import
#   scripts/build_image.sh --print-tag [SUITE]
#
# SUITE: bookworm (the default) or trixie; GPUFLOW_DEBIAN_SUITE sets it too (the argument wins).
# Cache, two levels, one set per suite:
#   - docker image gpuflow/debian-systemd:<suite>-<hash>, <hash> = sha256 of this script less
#     its comment lines (it holds the package lists and the root set-up) and of the suite's name,
#     plus the stable tag gpuflow/debian-systemd:<suite> that the scenarios use;
#   - the root tarball .cache/images/debian-systemd-<suite>-<hash>.tar.gz in the checkout, so a
#     fresh docker daemon re-imports it in seconds instead of running debootstrap again.
# The Debian mirror is read from this machine's own apt sources at run time
# (GPUFLOW_DEBIAN_MIRROR overrides it); no mirror host name is written into the repository.
# Needs root and a running engine (scripts/dockerd.sh). docker 20.10 `import` takes no
# STOPSIGNAL change: scenarios set stop_signal themselves.
# trixie's systemd 257 boots under the same flags as bookworm's 252 on these hosts (cgroup v1
# hierarchies plus cgroup2 at /sys/fs/cgroup/unified), marked tainted "cgroupsv1".
set -euo pipefail

REPO_NAME=gpuflow/debian-systemd
# Depends only: debootstrap does not install Recommends.
PACKAGES=(
  systemd systemd-sysv dbus libpam-systemd   # init, PID 1, logind session support
  python3 python3-apt python3-venv python3-pip # ansible modules (apt needs python3-apt); venvs
  sudo acl                                     # become, incl. becoming an unprivileged user
  iproute2 procps psmisc                       # ss (testinfra sockets), ps/pkill, fuser
  ca-certificates curl gnupg                   # https, keys for extra apt repositories
  less vim-tiny                                # someone debugging inside a container
)

FORCE=0 PRINT_TAG=0 SUITE=${GPUFLOW_DEBIAN_SUITE:-bookworm}
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    --print-tag) PRINT_TAG=1 ;;
    bookworm|trixie) SUITE=$arg ;;
    *) echo "usage: $0 [--force|--print-tag] [bookworm|trixie]" >&2; exit 2 ;;
  esac
done
case "$SUITE" in
  bookworm) ;;
  # git: scripts/controller_next.sh runs its controller (ansible-test sanity) in this image
  trixie) PACKAGES+=(git) ;;
  *) echo "build_image.sh: unknown suite '$SUITE' (bookworm or trixie)" >&2; exit 2 ;;
esac

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT_DIR=$(cd "$HERE/.." && pwd)
CACHE_DIR=${GPUFLOW_IMAGE_CACHE:-$ROOT_DIR/.cache/images}
# comment-only edits do not change the image, so full-line comments stay out of the hash
HASH=$({ grep -Ev '^[[:space:]]*#' "${BASH_SOURCE[0]}"; echo "suite=$SUITE"; } | sha256sum | cut -c1-12)
TAG="$REPO_NAME:$SUITE-$HASH"
STABLE="$REPO_NAME:$SUITE"
TARBALL="$CACHE_DIR/debian-systemd-$SUITE-$HASH.tar.gz"

say() { printf '[build_image.sh] %s\n' "$*" >&2; }

if [ $PRINT_TAG -eq 1 ]; then echo "$TAG"; exit 0; fi

# First "deb" URI of a stanza/line that serves <suite> main (deb822 .sources first, then
# one-line sources.list files); falls back to any non-security Debian URI.
host_mirror() {
  local suite=$1 files=() f
  shopt -s nullglob
  files=(/etc/apt/sources.list.d/*.sources)
  shopt -u nullglob
  if [ ${#files[@]} -gt 0 ]; then
    awk -v want="$suite" '
      function flush() {
        if (types ~ /(^| )deb( |$)/ && comps ~ /(^| )main( |$)/ && uri != "") {
          n = split(suites, s, " ")
          for (i = 1; i <= n; i++) if (s[i] == want && exact == "") exact = uri
          if (any == "" && uri !~ /security/) any = uri
        }
        types = suites = comps = uri = ""
      }
      /^[ \t]*$/ { flush(); next }
      /^[ \t]*#/ { next }
      tolower($1) == "types:"      { $1 = ""; types = $0 }
      tolower($1) == "uris:"       { uri = $2 }
      tolower($1) == "suites:"     { $1 = ""; suites = $0 " " }
      tolower($1) == "components:" { $1 = ""; comps = $0 }
      tolower($1) == "enabled:" && tolower($2) == "no" { types = "" }
      END { flush(); if (exact != "") print exact; else if (any != "") print any }
    ' "${files[@]}" | head -n1 | grep . && return 0
  fi
  files=()
  [ -r /etc/apt/sources.list ] && files+=(/etc/apt/sources.list)
  shopt -s nullglob
  for f in /etc/apt/sources.list.d/*.list; do files+=("$f"); done
  shopt -u nullglob
  [ ${#files[@]} -gt 0 ] || return 1
  sed -E 's/\[[^]]*\]//' "${files[@]}" | awk -v want="$suite" '
    $1 == "deb" && $3 == want { print $2; exit }' | grep . && return 0
  sed -E 's/\[[^]]*\]//' "${files[@]}" | awk '
    $1 == "deb" && $2 !~ /security/ { print $2; exit }' | grep .
}

# the security archive next to it, when the host names one (written into the image only)
host_security_mirror() {
  cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
    | grep -Eo 'https?://[^ ]*security[^ ]*' | head -n1 || true
}

tag_stable() {
  local old
  docker tag "$TAG" "$STABLE"
  # drop tags of earlier builds of this script (kept while a container still uses them)
  for old in $(docker image ls --format '{{.Repository}}:{{.Tag}}' "$REPO_NAME" | grep -E ":$SUITE-[0-9a-f]{12}\$" | grep -vx "$TAG"); do
    docker rmi "$old" >/dev/null 2>&1 || true
  done
  say "image ready: $TAG (also $STABLE)"
  echo "$TAG"
}

if ! timeout 10 docker info >/dev/null 2>&1; then
  say "docker engine does not answer; run scripts/dockerd.sh first"; exit 1
fi

# two builds at once would share the tarball name: take turns, then look at the cache again
mkdir -p "$CACHE_DIR"
exec 8>>"$CACHE_DIR/.build.lock"
if ! flock -n 8; then
  say "another build_image.sh is running; waiting for it"
  flock 8
fi

if [ $FORCE -eq 0 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  say "cached image $TAG present; not rebuilding"
  tag_stable; exit 0
fi

import_tarball() {
  say "importing $TARBALL"
  docker import \
    --change 'CMD ["/lib/systemd/systemd"]' \
    --change 'ENV container=docker' \
    --change "LABEL org.gpuflow.image-hash=$HASH" \
    "$TARBALL" "$TAG" >/dev/null
}

if [ $FORCE -eq 0 ] && [ -s "$TARBALL" ] && gzip -t "$TARBALL" 2>/dev/null; then
  import_tarball; tag_stable; exit 0
fi

if [ "$(id -u)" -ne 0 ]; then say "must run as root (debootstrap)"; exit 1; fi
MIRROR=${GPUFLOW_DEBIAN_MIRROR:-$(host_mirror "$SUITE" || true)}
if [ -z "$MIRROR" ]; then
  say "no Debian mirror found in /etc/apt/sources.list{,.d}; set GPUFLOW_DEBIAN_MIRROR"; exit 1
fi
SECURITY=$(host_security_mirror)

if ! command -v debootstrap >/dev/null 2>&1; then
  say "installing debootstrap with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
KEYRING_ARGS=()
[ -r "$KEYRING" ] && KEYRING_ARGS=(--keyring="$KEYRING")

WORK=$(mktemp -d "$CACHE_DIR/build.XXXXXX")
TARGET="$WORK/root"
cleanup() {
  local m
  # debootstrap mounts proc/sys inside the target; never leave them behind
  awk -v t="$TARGET" 'index($2, t) == 1 { print $2 }' /proc/mounts | sort -r |
    while read -r m; do umount -l "$m" 2>/dev/null || true; done
  rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT

include=$(IFS=,; echo "${PACKAGES[*]}")
say "debootstrap $SUITE (minbase) from the host's mirror; this takes about a minute"
start=$(date +%s)
if ! debootstrap --variant=minbase --include="$include" "${KEYRING_ARGS[@]}" \
      "$SUITE" "$TARGET" "$MIRROR" >"$WORK/debootstrap.log" 2>&1; then
  say "debootstrap failed; last lines of its log:"
  tail -n 40 "$WORK/debootstrap.log" >&2
  [ -r "$TARGET/debootstrap/debootstrap.log" ] && tail -n 40 "$TARGET/debootstrap/debootstrap.log" >&2
  exit 1
fi
say "debootstrap done in $(( $(date +%s) - start )) s"

# --- configure the root for running under docker with systemd as PID 1 ---
{
  echo "deb $MIRROR $SUITE main"
  echo "deb $MIRROR $SUITE-updates main"
  [ -n "$SECURITY" ] && echo "deb $SECURITY $SUITE-security main"
} >"$TARGET/etc/apt/sources.list"
# image-level apt settings: no recommends, no docs/caches growing the containers
cat >"$TARGET/etc/apt/apt.conf.d/90gpuflow" <<'APT'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
APT
# each container gets its own machine id at boot
: >"$TARGET/etc/machine-id"
rm -f "$TARGET/var/lib/dbus/machine-id"
# units that make no sense in a container (no ttys, no kernel modules, no udev, no fsck)
for unit in getty@tty1.service console-getty.service getty.target \
            systemd-udevd.service systemd-udev-trigger.service systemd-modules-load.service \
            systemd-remount-fs.service sys-kernel-config.mount sys-kernel-debug.mount \
            sys-kernel-tracing.mount dev-hugepages.mount systemd-firstboot.service \
            systemd-hwdb-update.service apt-daily.timer apt-daily-upgrade.timer; do
  ln -sfn /dev/null "$TARGET/etc/systemd/system/$unit"
done
rm -f "$TARGET"/lib/systemd/system/multi-user.target.wants/getty.target
# boot to multi-user, not graphical
ln -sfn /lib/systemd/system/multi-user.target "$TARGET/etc/systemd/system/default.target"
# no root password, ansible connects with docker exec
chroot "$TARGET" passwd -d root >/dev/null 2>&1 || true
# keep the image small
chroot "$TARGET" apt-get clean
rm -rf "$TARGET"/var/lib/apt/lists/* "$TARGET"/var/cache/apt/*.bin "$TARGET"/var/log/*.log \
       "$TARGET"/usr/share/doc/* "$TARGET"/usr/share/man/* "$TARGET"/debootstrap "$TARGET"/tmp/*
echo "gpuflow debian-systemd $SUITE $HASH" >"$TARGET/etc/gpuflow-image"

say "packing the root into $TARBALL"
# only files that belong to the root: proc/sys/dev mounts are gone by now
tar --numeric-owner --xattrs --one-file-system -C "$TARGET" -cf - . | gzip -1 >"$TARBALL.part"
mv "$TARBALL.part" "$TARBALL"
# older tarballs of this image are stale once the script changed
find "$CACHE_DIR" -maxdepth 1 -name "debian-systemd-$SUITE-*.tar.gz" ! -name "$(basename "$TARBALL")" -delete

import_tarball
say "built in $(( $(date +%s) - start )) s"
tag_stable

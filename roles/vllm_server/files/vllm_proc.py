"""Process helper for gpuflow.eagle3.vllm_server (runs on the managed host: the standard library and the job
library gpuflow_jobs.py, installed beside it, or put in front of it by the host_program filter when the role
feeds the controller's copy to `python -` on stdin).

It runs as root on a privileged run while the server runs as its service account, which owns
vllm_server_home. So it never follows a symlink that account could have made, writes its pid file
and log only in directories that nobody but root (or the user running it) can change, and signals
a process group only while the process the pid file records still has the recorded identity.

Subcommands print one JSON object on stdout and exit 0 unless stated; a refusal exits 1 with
{"failed": true, "msg"}:

  port    --port N [--unit U] [--pidfile F] [--user USER]
          who listens on TCP port N: {"in_use", "pids", "uids", "ours"}; ours = every listener
          belongs to systemd unit U (in the control group systemd names for it) or to the server group F
          records.
  pids    [--unit U] [--pidfile F]
          the processes of unit U (cgroup membership survives re-parenting) or of the server's
          process group: {"pids": [...], "stale"}.
  mkdir   --path D [--path D ...] --mode M [--owner U] [--group G] [--trusted]
          create each directory D in turn (and missing parents) with that owner, group and mode, walking
          from / without following a symlink the service account could have planted. --trusted: each D
          is root's, so it and every directory above it must be changeable only by root or this user.
          The first refusal stops the rest. {"changed", "paths": the directories created or changed}.
  start   --argv-file A --env-file E --log L --pidfile F [--user U] [--group G] [--cwd D]
          (no-systemd hosts) start argv from A detached: new session (pgid == pid), environment
          from E (as vllm.env.j2 writes it), stdout+stderr appended to L. The pid file records the
          pid, its start time and command line. {"changed", "pid"}.
  stop    --pidfile F [--timeout T]
          SIGTERM to the server's process group, wait up to T s, then SIGKILL, then wait until no
          process of the group is left (a /proc scan); exit 1 if any remain. A pid file whose
          process no longer matches is stale: nothing is signalled, {"stale": reason}.
  status  --pidfile F      {"running", "pid", "pids", "stale"}
  wait    --url URL --model NAME [--env-file E] [--unit U | --pidfile F] [--timeout T] [--poll P]
          poll URL (/v1/models) until HTTP 200 lists NAME; exit 1 at once when the unit leaves
          active/activating or the server's process group is gone; exit 1 at timeout. The API key
          is VLLM_API_KEY from the env file E (never from the command line or the environment).

Pid file (JSON): {"pid": leader pid == pgid, "starttime": /proc/PID/stat field 22 (clock ticks
after boot), "cmdline": the leader's argv as /proc/PID/cmdline showed it after the exec}.
"""
import argparse
import errno
import grp
import json
import os
import pwd
import re
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request

from gpuflow_jobs import cmdline, emit, stat_fields

ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
MAX_SYMLINKS = 40
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class Refused(Exception):
    """A path, file or pid file this helper must not act on."""


def out(obj, rc=0):
    emit(obj)
    sys.exit(rc)


def all_pids():
    for d in os.listdir("/proc"):
        if d.isdigit():
            yield int(d)


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def pgid_of(pid):
    fields = stat_fields(pid)
    if not fields or fields[0] == "Z":
        return None
    return int(fields[2])


def process_identity(pid):
    """(pgid, starttime, cmdline) of a live process, None when it is gone or a zombie."""
    fields = stat_fields(pid)
    if not fields or fields[0] == "Z":
        return None
    return int(fields[2]), int(fields[19]), cmdline(pid)


def exec_identity(pid, timeout=2.0):
    """process_identity once the exec has finished: Popen returns when the exec closed its error pipe,
    a moment before the kernel sets the new command line, which reads empty until then."""
    end = time.monotonic() + timeout
    identity = process_identity(pid)
    while identity is not None and not identity[2] and time.monotonic() < end:
        time.sleep(0.005)
        identity = process_identity(pid)
    return identity


def group_members(pgid):
    return sorted(p for p in all_pids() if pgid_of(p) == pgid)


# --- paths the service account cannot redirect ------------------------------------------------

def ours(st):
    """Made by root or by the user running this (the only writers this helper trusts)."""
    return st.st_uid in (0, os.geteuid())


def others_may_write(st):
    # the sticky bit keeps others from renaming or removing entries they do not own
    return bool(st.st_mode & 0o022) and not st.st_mode & stat.S_ISVTX


def components(path):
    return [c for c in path.split("/") if c]


class OpenedDir:
    """A directory reached by walk_to_dir: its fd, whether its parent is trusted (nobody but root
    or this user can change it or anything above it), and whether this walk created it."""

    def __init__(self, fd, parent_trusted, created):
        self.fd, self.parent_trusted, self.created = fd, parent_trusted, created


def walk_to_dir(path, settle=None, trusted_only=False):
    """Open directory `path` from / one component at a time, with O_NOFOLLOW.

    A symlink is followed only when root or this user owns it and it sits in a trusted directory
    (the service account cannot have made it); any other symlink, or a component that is not a
    directory, is refused. Missing components are created (mode 0700, then settle(fd)) only when
    settle is given; without it a missing one raises FileNotFoundError. trusted_only: refuse as
    soon as a directory on the way (the last one included) is not trusted, before creating anything
    in it.
    """
    if not path.startswith("/"):
        raise Refused("%s is not an absolute path" % path)
    stack = [(os.open("/", DIR_FLAGS), True)]  # (fd, trusted) of each directory walked into
    todo, hops, created, where = components(path), 0, False, ""
    try:
        while todo:
            name = todo.pop(0)
            if name == ".":
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop()[0])
                where = os.path.dirname(where)
                continue
            parent_fd, parent_trusted = stack[-1]
            created = False
            try:
                fd = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
            except FileNotFoundError:
                if settle is None:
                    raise FileNotFoundError(errno.ENOENT, "no such directory", where + "/" + name)
                os.mkdir(name, 0o700, dir_fd=parent_fd)
                fd = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
                created = True
                settle(fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise Refused("%s/%s is not a directory" % (where, name))
                if not (parent_trusted and ours(st)):
                    raise Refused("%s/%s is a symlink that a user other than root could have made: not followed"
                                  % (where, name))
                hops += 1
                if hops > MAX_SYMLINKS:
                    raise Refused("%s: too many symlinks" % path)
                target = os.readlink(name, dir_fd=parent_fd)
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop()[0])
                    where = ""
                todo[:0] = components(target)
                continue
            where = where + "/" + name
            st = os.fstat(fd)
            stack.append((fd, parent_trusted and ours(st) and not others_may_write(st)))
            if trusted_only and not stack[-1][1]:
                raise Refused("%s is not root's: %s (uid %d, mode %04o) can be changed by another user, who could "
                              "plant files there" % (path, where, st.st_uid, stat.S_IMODE(st.st_mode)))
        fd = stack.pop()[0]
        return OpenedDir(fd, stack[-1][1] if stack else True, created)
    finally:
        for entry in stack:
            os.close(entry[0])


def trusted_dir(path):
    """fd of a directory that only root or this user can change, as can every directory above it."""
    return walk_to_dir(path, trusted_only=True).fd


def open_in_dir(dir_fd, name, flags, mode=0o640):
    """A regular file in a trusted directory, opened without following a symlink."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Refused("%s is a symlink: not followed" % name)
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or not ours(st):
        os.close(fd)
        raise Refused("%s is not a regular file of root's (uid %d)" % (name, st.st_uid))
    return fd


def user_id(name):
    return int(name) if name.isdigit() else pwd.getpwnam(name).pw_uid


def group_id(name):
    return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid


def cmd_mkdir(a):
    uid = user_id(a.owner) if a.owner else -1
    gid = group_id(a.group) if a.group else -1
    mode = int(a.mode, 8)

    def settle(fd):
        st = os.fstat(fd)
        changed = False
        if (uid != -1 and st.st_uid != uid) or (gid != -1 and st.st_gid != gid):
            os.fchown(fd, uid, gid)  # by fd: the directory this walk opened, never a path
            changed = True
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
            changed = True
        return changed

    changed = []
    for path in a.path:  # one call for every directory: each module run costs a Python start on the host
        d = walk_to_dir(path, settle, trusted_only=a.trusted)
        try:
            st = os.fstat(d.fd)
            if not d.created and not d.parent_trusted and uid != -1 and st.st_uid != uid:
                # the service account may have moved someone else's directory here: do not hand it over
                raise Refused("%s exists, owned by uid %d, in a directory another user can change: not taking it over"
                              % (path, st.st_uid))
            if d.created or settle(d.fd):
                changed.append(path)
        finally:
            os.close(d.fd)
    out({"changed": bool(changed), "paths": changed})


# --- the pid file ------------------------------------------------------------------------------

def is_int(value):
    """An int from JSON, and not a bool (which Python counts as an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def read_record(pidfile):
    """(record, None), or (None, why it is not believed); (None, None) when there is none."""
    try:
        dir_fd = trusted_dir(os.path.dirname(pidfile))
    except FileNotFoundError:
        return None, None
    except Refused as e:
        return None, str(e)
    try:
        fd = open_in_dir(dir_fd, os.path.basename(pidfile), os.O_RDONLY)
    except FileNotFoundError:
        return None, None
    except Refused as e:
        return None, "pid file %s: %s" % (pidfile, e)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd) as f:
        text = f.read()
    try:
        record = json.loads(text)
        valid = (is_int(record["pid"]) and record["pid"] > 1 and is_int(record["starttime"])
                 and isinstance(record["cmdline"], list))
    except (ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        return None, "pid file %s is not the launcher's: %r" % (pidfile, text[:200])
    return record, None


def identity_mismatch(record):
    """Why the process the pid file names is not the server it recorded, or None when it is."""
    pid = record["pid"]
    now = process_identity(pid)
    if now is None:
        return "PID %d has exited" % pid
    pgid, starttime, argv = now
    if starttime != record["starttime"] or argv != record["cmdline"]:
        return ("PID %d is another process now (started at tick %d, not %d; command %s)"
                % (pid, starttime, record["starttime"], json.dumps(argv)[:300]))
    if pgid != pid:
        return "PID %d no longer leads its process group" % pid
    return None


def server_group(pidfile):
    """(pgid, members, stale): the server's process group while the pid file's process is still the
    one it recorded, else (None, [], why not) so that nobody else's group is reported or signalled."""
    if not pidfile:
        return None, [], None
    record, why = read_record(pidfile)
    if record is None:
        return None, [], why
    mismatch = identity_mismatch(record)
    if mismatch:
        return None, [], "stale pid file %s: %s" % (pidfile, mismatch)
    return record["pid"], group_members(record["pid"]), None


def write_record(dir_fd, name, record):
    """Replace the pid file atomically: a fresh O_EXCL temp name, so no planted file is written through."""
    tmp = ".%s.%s.tmp" % (name, os.urandom(8).hex())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record) + "\n")
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


# --- subcommands --------------------------------------------------------------------------------

def unit_cgroup(unit):
    """The control group this host's systemd runs unit in; None where systemd is not booted or the unit is
    not running."""
    if not os.path.isdir("/run/systemd/system"):
        return None
    r = subprocess.run(["systemctl", "show", "-p", "ControlGroup", "--value", "--", unit],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, universal_newlines=True, check=False)
    return r.stdout.strip() or None


def systemd_cgroups(pid):
    """The process's cgroups in the hierarchies systemd lays out: the unified one, cgroup v1's name=systemd
    (a hybrid host has both)."""
    paths = []
    for line in (read("/proc/%d/cgroup" % pid) or "").splitlines():
        hid, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        if (hid == "0" and not ctrls) or "name=systemd" in ctrls.split(","):
            paths.append(path)
    return paths


def unit_pids(unit):
    """The live processes in unit's control group or below it. By the group systemd names, not by the unit's
    name in a path: a container's systemd (cgroupns host) may run a unit of the same name, under its own scope."""
    group = unit_cgroup(unit)
    if not group:
        return []
    below = group.rstrip("/") + "/"
    res = []
    for pid in all_pids():
        inside = any(path == group or path.startswith(below) for path in systemd_cgroups(pid))
        if inside and pgid_of(pid) is not None:  # pgid_of is None for a zombie
            res.append(pid)
    return res


def listeners(port):
    """(in_use, pids, socket owner uids) of TCP listeners on port."""
    inodes, uids = set(), set()
    for fn in ("/proc/net/tcp", "/proc/net/tcp6"):
        txt = read(fn) or ""
        for line in txt.splitlines()[1:]:
            f = line.split()
            if len(f) < 10 or f[3] != "0A":
                continue
            if int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
                uids.add(int(f[7]))
    pids = set()
    if inodes:
        for pid in all_pids():
            try:
                fds = os.listdir("/proc/%d/fd" % pid)
            except OSError:
                continue
            for fd in fds:
                try:
                    link = os.readlink("/proc/%d/fd/%s" % (pid, fd))
                except OSError:
                    continue
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    pids.add(pid)
                    break
    return bool(inodes), sorted(pids), sorted(uids)


def cmd_port(a):
    in_use, pids, uids = listeners(a.port)
    mine = set(server_group(a.pidfile)[1])
    if a.unit:
        mine |= set(unit_pids(a.unit))
    if pids:
        owned = all(p in mine for p in pids)
    else:
        # /proc/PID/fd of another user's process is unreadable without CAP_SYS_PTRACE (containers):
        # fall back to the socket's owner uid, with the instance's processes alive
        uid = None
        if a.user:
            try:
                uid = pwd.getpwnam(a.user).pw_uid
            except KeyError:
                uid = None
        owned = in_use and bool(mine) and uid is not None and uids == [uid]
    out({"in_use": in_use, "pids": pids, "uids": uids, "ours": bool(in_use and owned)})


def cmd_pids(a):
    members, stale = server_group(a.pidfile)[1:]
    pids = set(members)
    if a.unit:
        pids |= set(unit_pids(a.unit))
    out({"pids": sorted(pids), "stale": stale})


def load_env(path):
    """The environment file as vllm.env.j2 writes it: KEY=VALUE lines, each value a JSON string
    (systemd's EnvironmentFile= reads the \\" and \\\\ escapes the same way)."""
    env = {}
    with open(path) as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not ENV_KEY.match(key):
            raise Refused("%s line %d: not KEY=VALUE with a key of letters, digits and _" % (path, number))
        if value.startswith('"'):
            try:
                value = json.loads(value)
            except ValueError:
                raise Refused("%s line %d: the value of %s is not one JSON string" % (path, number, key))
            if not isinstance(value, str):
                raise Refused("%s line %d: the value of %s is not one JSON string" % (path, number, key))
        env[key] = value
    return env


def cmd_status(a):
    pgid, pids, stale = server_group(a.pidfile)
    out({"running": bool(pids), "pid": pgid if pids else None, "pids": pids, "stale": stale})


def cmd_start(a):
    run_fd = trusted_dir(os.path.dirname(a.pidfile))
    log_fd = trusted_dir(os.path.dirname(a.log))
    pgid, pids = server_group(a.pidfile)[:2]
    if pids:
        out({"changed": False, "pid": pgid})
    with open(a.argv_file) as f:
        argv = json.load(f)
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
    env.update(load_env(a.env_file))
    uid = gid = None
    if a.user and os.geteuid() == 0:
        pw = pwd.getpwnam(a.user)
        uid, gid = pw.pw_uid, pw.pw_gid
        if a.group:
            gid = grp.getgrnam(a.group).gr_gid
        env.setdefault("HOME", pw.pw_dir)
        env["USER"] = env["LOGNAME"] = a.user
    # root keeps the log: the server writes through the inherited descriptor, never by the path
    log = open_in_dir(log_fd, os.path.basename(a.log), os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def child_setup():
        os.setsid()
        if uid is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        os.umask(0o027)

    p = subprocess.Popen(argv, env=env, cwd=a.cwd or "/", stdin=subprocess.DEVNULL,
                         stdout=log, stderr=subprocess.STDOUT, preexec_fn=child_setup,
                         close_fds=True)
    os.close(log)
    identity = exec_identity(p.pid)
    if identity is not None:
        write_record(run_fd, os.path.basename(a.pidfile),
                     {"pid": p.pid, "starttime": identity[1], "cmdline": identity[2]})
    time.sleep(0.5)
    if identity is None or p.poll() is not None:
        rc = p.wait()
        out({"changed": True, "pid": p.pid, "failed": True, "rc": rc,
             "msg": "process exited at once with rc %s; see %s" % (rc, a.log)}, 1)
    out({"changed": True, "pid": p.pid})


def wait_gone(pg, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = group_members(pg)
        if not left:
            return []
        time.sleep(0.1)
    return group_members(pg)


def cmd_stop(a):
    try:
        run_fd = trusted_dir(os.path.dirname(a.pidfile))
    except FileNotFoundError:  # never started here: the role makes the directory only to start
        out({"changed": False, "pids_left": [], "stale": None})
    pg, pids, stale = server_group(a.pidfile)
    if not pids:
        out({"changed": False, "pids_left": [], "stale": stale})
    t0 = time.monotonic()
    # checked just above: the group's leader is still the process the pid file recorded
    try:
        os.killpg(pg, signal.SIGTERM)
    except ProcessLookupError:
        pass
    left = wait_gone(pg, a.timeout)
    killed = False
    if left:
        killed = True
        # the group id cannot be reused while any member lives, and members were seen 0.1 s ago
        try:
            os.killpg(pg, signal.SIGKILL)
        except ProcessLookupError:
            pass
        left = wait_gone(pg, 10)
    res = {"changed": True, "pids_left": left, "sigkill": killed,
           "seconds": round(time.monotonic() - t0, 2), "stale": None}
    if not left:
        try:
            os.unlink(os.path.basename(a.pidfile), dir_fd=run_fd)
        except FileNotFoundError:
            pass
    out(res, 1 if left else 0)


def unit_state(unit):
    r = subprocess.run(["systemctl", "show", "-p", "ActiveState", "-p", "SubState",
                        "-p", "ExecMainStatus", unit],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, universal_newlines=True, check=False)
    props = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    if "ActiveState" not in props:
        return []
    return [props.get("ActiveState", ""), props.get("SubState", ""), props.get("ExecMainStatus", "")]


def cmd_wait(a):
    t0 = time.monotonic()
    headers = {}
    key = load_env(a.env_file).get("VLLM_API_KEY") if a.env_file else None
    if key:
        headers["Authorization"] = "Bearer " + key
    last = "no answer yet"
    while True:
        el = time.monotonic() - t0
        if a.unit:
            st = unit_state(a.unit)
            if st and st[0] not in ("active", "activating", "reloading"):
                out({"ready": False, "seconds": round(el, 1), "unit_state": st,
                     "msg": "unit %s left active while loading (state %s)" % (a.unit, "/".join(st))}, 1)
        elif a.pidfile:
            pids, stale = server_group(a.pidfile)[1:]
            if not pids:
                out({"ready": False, "seconds": round(el, 1),
                     "msg": "the server process group is gone" + (" (%s)" % stale if stale else "")}, 1)
        try:
            req = urllib.request.Request(a.url, headers=headers)
            with urllib.request.urlopen(req, timeout=10) as r:
                body = json.loads(r.read().decode())
            ids = [m.get("id") for m in body.get("data", [])]
            if a.model in ids:
                out({"ready": True, "seconds": round(el, 1), "models": ids})
            last = "served models %s do not include %s" % (ids, a.model)
            if el > 60:
                out({"ready": False, "seconds": round(el, 1), "msg": last}, 1)
        except urllib.error.HTTPError as e:
            last = "HTTP %s" % e.code
            if e.code in (401, 403):
                out({"ready": False, "seconds": round(el, 1),
                     "msg": "HTTP %s from %s: API key mismatch" % (e.code, a.url)}, 1)
        except (OSError, ValueError) as e:
            last = str(e)
        if el > a.timeout:
            out({"ready": False, "seconds": round(el, 1),
                 "msg": "not ready after %ss: %s" % (a.timeout, last)}, 1)
        time.sleep(a.poll)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd")
    s = sub.add_parser("port")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--user")
    s.add_argument("--unit")
    s.add_argument("--pidfile")
    s = sub.add_parser("pids")
    s.add_argument("--unit")
    s.add_argument("--pidfile")
    s = sub.add_parser("mkdir")
    s.add_argument("--path", required=True, action="append")
    s.add_argument("--mode", required=True)
    s.add_argument("--owner")
    s.add_argument("--group")
    s.add_argument("--trusted", action="store_true")
    s = sub.add_parser("status")
    s.add_argument("--pidfile", required=True)
    s = sub.add_parser("start")
    for opt in ("--argv-file", "--env-file", "--log", "--pidfile"):
        s.add_argument(opt, required=True)
    s.add_argument("--user")
    s.add_argument("--group")
    s.add_argument("--cwd")
    s = sub.add_parser("stop")
    s.add_argument("--pidfile", required=True)
    s.add_argument("--timeout", type=float, default=300)
    s = sub.add_parser("wait")
    s.add_argument("--url", required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--env-file")
    s.add_argument("--unit")
    s.add_argument("--pidfile")
    s.add_argument("--timeout", type=float, default=3600)
    s.add_argument("--poll", type=float, default=2)
    a = ap.parse_args()
    fn = {"port": cmd_port, "pids": cmd_pids, "mkdir": cmd_mkdir, "status": cmd_status, "start": cmd_start,
          "stop": cmd_stop, "wait": cmd_wait}.get(a.cmd)
    if not fn:
        ap.error("a subcommand is required")
    try:
        fn(a)
    except (Refused, OSError, KeyError) as e:
        # KeyError: an unknown user or group name
        out({"changed": False, "failed": True, "msg": "%s: %s" % (a.cmd, e)}, 1)


if __name__ == "__main__":
    main()

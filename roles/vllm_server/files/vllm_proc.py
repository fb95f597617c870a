"""Process helper for gpuflow.eagle3.vllm_server (stdlib only, runs on the managed host).

Subcommands print one JSON object on stdout and exit 0 unless stated:

  port    --port N [--unit U] [--pidfile F]
          who listens on TCP port N: {"in_use", "pids", "ours"}; ours = every listener
          belongs to systemd unit U (by /proc/PID/cgroup) or to the process group in F.
  pids    [--unit U] [--pidfile F]
          the processes of unit U (cgroup membership survives re-parenting) or of the
          process group recorded in F: {"pids": [...]}.
  start   --argv-file A --env-file E --log L --pidfile F [--user U] [--group G] [--cwd D]
          (no-systemd hosts) start argv from A detached: new session (pgid == pid),
          environment from E (KEY=VALUE lines), stdout+stderr to L. {"changed", "pid"}.
  stop    --pidfile F [--timeout T]
          SIGTERM to the process group, wait up to T s, then SIGKILL, then wait until no
          process of the group is left (verified by a /proc scan). Exit 1 if any remain.
  status  --pidfile F      {"running", "pid"}
  wait    --url URL --model NAME [--unit U | --pidfile F] [--timeout T] [--poll P]
          poll URL (/v1/models) until HTTP 200 lists NAME; exit 1 at once when the unit
          leaves active/activating or the process group is gone; exit 1 at timeout.
          Authorization from env VLLM_API_KEY when set.
"""
import argparse
import json
import os
import pwd
import grp
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request


def out(obj, rc=0):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.exit(rc)


def all_pids():
    for d in os.listdir("/proc"):
        if d.isdigit():
            yield int(d)


def read(path, mode="r"):
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return None


def pgid_of(pid):
    stat = read("/proc/%d/stat" % pid)
    if not stat:
        return None
    # comm may contain spaces and parentheses: split after the last ')'
    rest = stat.rsplit(")", 1)[1].split()
    state, pgid = rest[0], int(rest[2])
    if state == "Z":
        return None
    return pgid


def unit_pids(unit):
    needle = "/" + unit
    res = []
    for pid in all_pids():
        cg = read("/proc/%d/cgroup" % pid)
        if not cg:
            continue
        for line in cg.splitlines():
            path = line.split(":", 2)[-1]
            if path.endswith(needle) or (needle + "/") in path:
                if pgid_of(pid) is not None:  # not a zombie
                    res.append(pid)
                break
    return sorted(set(res))


def read_pidfile(pidfile):
    txt = read(pidfile) if pidfile else None
    try:
        pid = int((txt or "").split()[0])
    except (ValueError, IndexError):
        return None
    return pid if pid > 1 else None


def group_pids(pidfile):
    pg = read_pidfile(pidfile)
    if not pg:
        return []
    return sorted(p for p in all_pids() if pgid_of(p) == pg)


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
    mine = set()
    if a.unit:
        mine |= set(unit_pids(a.unit))
    if a.pidfile:
        mine |= set(group_pids(a.pidfile))
    if pids:
        ours = all(p in mine for p in pids)
    else:
        # /proc/PID/fd of another user's process is unreadable without CAP_SYS_PTRACE (containers):
        # fall back to the socket's owner uid, with the instance's processes alive
        uid = None
        if a.user:
            try:
                uid = pwd.getpwnam(a.user).pw_uid
            except KeyError:
                uid = None
        ours = in_use and bool(mine) and uid is not None and uids == [uid]
    out({"in_use": in_use, "pids": pids, "uids": uids, "ours": bool(in_use and ours)})


def cmd_pids(a):
    pids = set()
    if a.unit:
        pids |= set(unit_pids(a.unit))
    if a.pidfile:
        pids |= set(group_pids(a.pidfile))
    out({"pids": sorted(pids)})


def load_env(path):
    env = {}
    for line in (read(path) or "").splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        k, v = line.split("=", 1)
        v = v.strip()
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'":
            v = v[1:-1]
        env[k.strip()] = v
    return env


def cmd_status(a):
    pids = group_pids(a.pidfile)
    out({"running": bool(pids), "pid": read_pidfile(a.pidfile) if pids else None, "pids": pids})


def cmd_start(a):
    if group_pids(a.pidfile):
        out({"changed": False, "pid": read_pidfile(a.pidfile)})
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
    logf = open(a.log, "ab")
    if uid is not None:
        os.chown(a.log, uid, gid)

    def child_setup():
        os.setsid()
        if uid is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        os.umask(0o027)

    p = subprocess.Popen(argv, env=env, cwd=a.cwd or "/", stdin=subprocess.DEVNULL,
                         stdout=logf, stderr=subprocess.STDOUT, preexec_fn=child_setup,
                         close_fds=True)
    tmp = a.pidfile + ".tmp"
    with open(tmp, "w") as f:
        f.write("%d\n" % p.pid)
    os.replace(tmp, a.pidfile)
    time.sleep(0.5)
    if p.poll() is not None:
        out({"changed": True, "pid": p.pid, "failed": True, "rc": p.returncode,
             "msg": "process exited at once with rc %s; see %s" % (p.returncode, a.log)}, 1)
    out({"changed": True, "pid": p.pid})


def wait_gone(pg, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = [p for p in all_pids() if pgid_of(p) == pg]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in all_pids() if pgid_of(p) == pg]


def cmd_stop(a):
    pg = read_pidfile(a.pidfile)
    if not pg or not group_pids(a.pidfile):
        out({"changed": False, "pids_left": []})
    t0 = time.monotonic()
    try:
        os.killpg(pg, signal.SIGTERM)
    except ProcessLookupError:
        pass
    left = wait_gone(pg, a.timeout)
    killed = False
    if left:
        killed = True
        try:
            os.killpg(pg, signal.SIGKILL)
        except ProcessLookupError:
            pass
        left = wait_gone(pg, 10)
    res = {"changed": True, "pids_left": left, "sigkill": killed,
           "seconds": round(time.monotonic() - t0, 2)}
    if not left:
        try:
            os.unlink(a.pidfile)
        except OSError:
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
    key = os.environ.get("VLLM_API_KEY")
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
        elif a.pidfile and not group_pids(a.pidfile):
            out({"ready": False, "seconds": round(el, 1),
                 "msg": "the server process group is gone"}, 1)
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
    s.add_argument("--unit")
    s.add_argument("--pidfile")
    s.add_argument("--timeout", type=float, default=3600)
    s.add_argument("--poll", type=float, default=2)
    a = ap.parse_args()
    fn = {"port": cmd_port, "pids": cmd_pids, "status": cmd_status, "start": cmd_start,
          "stop": cmd_stop, "wait": cmd_wait}.get(a.cmd)
    if not fn:
        ap.error("a subcommand is required")
    fn(a)


if __name__ == "__main__":
    main()

# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Who holds each GPU: /proc scan + driver process list + classification (PRIVATE).

Two views are joined (FIELD_NOTES.md: each alone is wrong):

1. ``/proc/*/fd`` links to the backend's device nodes (``/dev/nvidiaN`` per GPU by minor
   number; ``nvidiactl``, ``nvidia-uvm``, ``nvidia-caps/*`` host-wide).  psutil's
   ``open_files()`` skips device files, so the links are read directly.
2. The backend's per-GPU process list (NVML compute/graphics/MPS lists), whose PIDs are
   host PIDs and may be garbage (0, 4294967295 from broken bindings): they are validated
   (``1 < pid < PID_LIMIT``) and mapped to a local process only when that process exists
   *and* (when its fds are readable) holds that GPU's device node; otherwise they are
   reported as ``unresolved`` (another PID namespace, or PID reuse) and never signalled.

Each holder is a plain dict (see :func:`describe_process` and :func:`discover`):
``pid, name, exe, cmdline, user, uid, ppid, pgid, sid, state, dstate, create_time,
cgroup, unit, container, nspid, gpus, context_gpus, device_gpus, hostwide_files,
gpu_memory_mib, nvml_listed, seen_by, class, protected_by``.

``device_gpus`` are the GPUs whose device node the process has open; ``context_gpus`` those
on which the driver lists it.  CUDA opens *every* GPU's node at initialisation, so a
process's ``gpus`` (what it holds) are its ``context_gpus`` when it has any, else its
``device_gpus``: a job on GPU 0 is not a holder of GPU 1 just because it opened
``/dev/nvidia1``.

Classes: ``compute`` (driver lists a context on a GPU), ``management`` (holds device files,
no context: monitors, exporters, NVML clients), ``protected`` (matches a protected pattern:
never signalled), ``self`` (this module's own process tree, e.g. its NVML worker).

All functions take ``proc_root`` so unit tests run against a fake /proc tree.
"""

from __future__ import annotations

import os
import pwd
import re

PID_LIMIT = 1 << 22  # kernel maximum of pid_max (4194304)

# Matched in full against the process name (comm), the basename of exe and of argv[0],
# and the systemd unit.  Evidence: research/gpu_drain.md B.2.
DEFAULT_PROTECTED = (
    r"nvidia-persistenced(\.service)?",
    r"nv-fabricmanager",
    r"nvidia-fabricmanager(\.service)?",
    r"nvlsm(\.service)?",
    r"nv-hostengine",
    r"(nvidia-)?dcgm(-exporter|i)?(\.service)?",
    r"nvsm[\w.-]*",
    r"nvidia-smi",
    r"nvidia-gridd(\.service)?",
    r"nvidia-topologyd(\.service)?",
    r"nvidia-mig-(manager|parted)(\.service)?",
    r"nvidia-device-plugin|k8s-device-plugin|gpu-feature-discovery",
    r"nv_peer_mem(\.service)?",
)

_CONTAINER_RES = (
    ("docker", re.compile(r"docker-([0-9a-f]{12,64})\.scope")),
    ("docker", re.compile(r"/docker/([0-9a-f]{12,64})")),
    ("containerd", re.compile(r"cri-containerd-([0-9a-f]{12,64})\.scope")),
    ("cri-o", re.compile(r"crio-([0-9a-f]{12,64})\.scope")),
    ("podman", re.compile(r"libpod-([0-9a-f]{12,64})\.scope")),
    ("containerd", re.compile(r"/containerd/([^/]+)")),
    ("lxc", re.compile(r"/lxc(?:\.payload)?[./]([^/]+)")),
    ("kubernetes", re.compile(r"/kubepods[^/]*/(?:[^/]+/)*?(pod[^/]+)")),
)


class ProtectedMatcher(object):
    """Decides whether a process is protected.

    ``defaults`` (the built-in names) match in full against comm, exe/argv0 basenames and
    the unit; user ``patterns`` are regular expressions searched in comm, exe, the joined
    command line and the unit.  A malformed user pattern raises ``re.error`` at build time.
    """

    def __init__(self, patterns=(), use_defaults=True):
        self.defaults = [re.compile(p) for p in (DEFAULT_PROTECTED if use_defaults else ())]
        self.patterns = [(p, re.compile(p)) for p in patterns or ()]

    def match(self, info):
        names = set()
        for s in (info.get("name"), info.get("exe"), (info.get("argv") or [None])[0]):
            if s:
                names.add(os.path.basename(s))
        unit = info.get("unit")
        for rx in self.defaults:
            for s in names:
                if rx.fullmatch(s):
                    return rx.pattern
            if unit and rx.fullmatch(unit):
                return rx.pattern
        hay = [info.get("name") or "", info.get("exe") or "", info.get("cmdline") or "", unit or ""]
        for pat, rx in self.patterns:
            for s in hay:
                if s and rx.search(s):
                    return pat
        return None


def _read(path, mode="r"):
    with open(path, mode) as f:
        return f.read()


def list_pids(proc_root="/proc"):
    out = []
    for n in os.listdir(proc_root):
        if n.isdigit():
            out.append(int(n))
    return out


def scan_device_fds(classify, proc_root="/proc", pids=None):
    """Return ``({pid: {"gpus": set(minor), "hostwide": set(path)}}, unreadable_pids)``.

    ``classify`` is the backend's ``classify_device_path``.  Processes whose fd directory
    cannot be read are listed in ``unreadable_pids`` (not guessed at).
    """
    found = {}
    unreadable = []
    for pid in pids if pids is not None else list_pids(proc_root):
        fd_dir = os.path.join(proc_root, str(pid), "fd")
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:
            continue
        except OSError:
            unreadable.append(pid)
            continue
        gpus = set()
        hostwide = set()
        for fd in fds:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            c = classify(target)
            if c is None:
                continue
            if c[0] == "gpu":
                gpus.add(c[1])
            else:
                hostwide.add(c[1])
        if gpus or hostwide:
            found[pid] = {"gpus": gpus, "hostwide": hostwide}
    return found, unreadable


def parse_stat(text):
    """Parse /proc/PID/stat: comm may hold spaces and parentheses."""
    lp = text.index("(")
    rp = text.rindex(")")
    comm = text[lp + 1:rp]
    rest = text[rp + 2:].split()
    # rest[0] = state (field 3), rest[1] = ppid (4), rest[2] = pgrp (5), rest[3] = session (6),
    # rest[19] = starttime (22)
    return {"name": comm, "state": rest[0], "ppid": int(rest[1]), "pgid": int(rest[2]),
            "sid": int(rest[3]), "starttime": int(rest[19])}


def parse_status(text):
    out = {}
    for line in text.splitlines():
        k, dummy, v = line.partition(":")
        out[k.strip()] = v.strip()
    res = {}
    if "Uid" in out:
        res["uid"] = int(out["Uid"].split()[0])
    if "NSpid" in out:
        res["nspid"] = [int(x) for x in out["NSpid"].split()]
    if "NSpgid" in out:
        res["nspgid"] = [int(x) for x in out["NSpgid"].split()]
    return res


def parse_cgroup(text):
    """Return ``{"cgroup", "unit", "container"}`` from /proc/PID/cgroup (v1 or v2)."""
    path = None
    fallback = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, ctrls, p = parts
        if hid == "0" and ctrls == "":
            path = p
            break
        if "name=systemd" in ctrls.split(","):
            path = p
        elif fallback is None:
            fallback = p
    if path is None:
        path = fallback
    unit = None
    container = None
    if path:
        for comp in reversed(path.strip("/").split("/")):
            if comp.endswith(".service") or comp.endswith(".scope"):
                unit = comp
                break
        for kind, rx in _CONTAINER_RES:
            m = rx.search(path)
            if m:
                container = "%s:%s" % (kind, m.group(1))
                break
    return {"cgroup": path, "unit": unit, "container": container}


_BOOT_TIME = {}


def boot_time(proc_root="/proc"):
    if proc_root not in _BOOT_TIME:
        bt = 0.0
        for line in _read(os.path.join(proc_root, "stat")).splitlines():
            if line.startswith("btime"):
                bt = float(line.split()[1])
        _BOOT_TIME[proc_root] = bt
    return _BOOT_TIME[proc_root]


CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def create_time(pid, proc_root="/proc"):
    """Process start time in epoch seconds, as psutil computes it (btime + starttime/HZ).

    Returns None when the process is gone.
    """
    try:
        st = parse_stat(_read(os.path.join(proc_root, str(pid), "stat")))
    except (OSError, ValueError, IndexError):
        return None
    return round(boot_time(proc_root) + st["starttime"] / float(CLK_TCK), 2)


def describe_process(pid, proc_root="/proc"):
    """Plain facts about one process, or None when it is gone."""
    base = os.path.join(proc_root, str(pid))
    try:
        st = parse_stat(_read(os.path.join(base, "stat")))
    except (OSError, ValueError, IndexError):
        return None
    info = {"pid": pid, "name": st["name"], "state": st["state"], "dstate": st["state"] == "D",
            "ppid": st["ppid"], "pgid": st["pgid"], "sid": st["sid"],
            "create_time": round(boot_time(proc_root) + st["starttime"] / float(CLK_TCK), 2)}
    try:
        raw = _read(os.path.join(base, "cmdline"), "rb")
        argv = [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
    except OSError:
        argv = []
    info["argv"] = argv
    info["cmdline"] = " ".join(argv)
    try:
        info["exe"] = os.readlink(os.path.join(base, "exe"))
    except OSError:
        info["exe"] = None
    try:
        status = parse_status(_read(os.path.join(base, "status")))
    except OSError:
        status = {}
    info["uid"] = status.get("uid")
    info["nspid"] = status.get("nspid") or [pid]
    try:
        info["user"] = pwd.getpwuid(info["uid"]).pw_name if info["uid"] is not None else None
    except KeyError:
        info["user"] = str(info["uid"])
    try:
        info.update(parse_cgroup(_read(os.path.join(base, "cgroup"))))
    except OSError:
        info.update({"cgroup": None, "unit": None, "container": None})
    return info


def valid_driver_pid(pid):
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return False
    return 1 < pid < PID_LIMIT


def discover(backend, gpus, matcher, own_tree=(), proc_root="/proc"):
    """Join the fd scan with the driver's process lists and classify every holder.

    ``gpus`` is the backend's ``gpus()`` list.  Returns a dict::

        {"holders": {pid: holder}, "unresolved": {index: [{"pid", "used_mib", "type",
         "reason"}]}, "processes": {index: [...]}, "memory": {index: {...}},
         "unreadable_pids": [...], "invalid_driver_pids": [...]}
    """
    minor_to_index = {}
    for g in gpus:
        minor_to_index[g["minor"] if g.get("minor") is not None else g["index"]] = g["index"]
    indices = [g["index"] for g in gpus]
    memory, procs = backend.poll(indices)
    fds, unreadable = scan_device_fds(backend.classify_device_path, proc_root)
    unreadable_set = set(unreadable)
    own = set(own_tree)

    holders = {}

    def holder(pid):
        if pid not in holders:
            info = describe_process(pid, proc_root)
            if info is None:
                return None
            info.update({"gpus": [], "device_gpus": [], "context_gpus": [], "hostwide_files": [],
                         "gpu_memory_mib": {}, "nvml_listed": False, "seen_by": []})
            holders[pid] = info
        return holders[pid]

    for pid, f in fds.items():
        h = holder(pid)
        if h is None:
            continue
        h["device_gpus"] = sorted(minor_to_index[m] for m in f["gpus"] if m in minor_to_index)
        h["hostwide_files"] = sorted(f["hostwide"])
        h["seen_by"].append("fd")

    unresolved = {}
    invalid = []
    for idx in indices:
        for p in procs.get(idx, []):
            pid = p["pid"]
            if not valid_driver_pid(pid):
                invalid.append({"gpu": idx, "pid": pid})
                continue
            reason = None
            if not os.path.isdir(os.path.join(proc_root, str(pid))):
                reason = "PID not visible here (another PID namespace?)"
            elif pid not in fds and pid not in unreadable_set:
                reason = "local PID %d does not hold this GPU's device file (PID reuse or namespace mismatch)" % pid
            elif pid in fds and idx not in [minor_to_index.get(m) for m in fds[pid]["gpus"]]:
                reason = "local PID %d does not hold this GPU's device file (PID reuse or namespace mismatch)" % pid
            if reason:
                unresolved.setdefault(idx, []).append(
                    {"pid": pid, "used_mib": p.get("used_mib"), "type": p.get("type"), "reason": reason})
                continue
            h = holder(pid)
            if h is None:
                continue
            h["nvml_listed"] = True
            if "driver" not in h["seen_by"]:
                h["seen_by"].append("driver")
            if idx not in h["context_gpus"]:
                h["context_gpus"] = sorted(h["context_gpus"] + [idx])
            prev = h["gpu_memory_mib"].get(idx) or 0
            h["gpu_memory_mib"][idx] = prev + (p.get("used_mib") or 0)

    for h in holders.values():
        # CUDA opens every GPU's device node at init, so for a process with a context the
        # driver's per-GPU list says which GPUs it holds; the fd scan decides only for
        # processes with no context anywhere (management clients).
        h["gpus"] = list(h["context_gpus"]) if h["context_gpus"] else list(h["device_gpus"])
        h["class"], h["protected_by"] = classify(h, matcher, own)
    return {"holders": holders, "unresolved": unresolved, "processes": procs, "memory": memory,
            "unreadable_pids": unreadable, "invalid_driver_pids": invalid}


def classify(h, matcher, own=()):
    if h["pid"] in own:
        return "self", None
    pat = matcher.match(h)
    if pat:
        return "protected", pat
    if h.get("nvml_listed"):
        return "compute", None
    return "management", None


def public_holder(h):
    """The holder as returned to the user (stable keys, no internal fields)."""
    keys = ("pid", "name", "cmdline", "exe", "user", "ppid", "pgid", "sid", "state", "dstate",
            "create_time", "cgroup", "unit", "container", "nspid", "gpus", "context_gpus", "device_gpus",
            "hostwide_files",
            "nvml_listed", "seen_by", "class", "protected_by")
    out = dict((k, h.get(k)) for k in keys)
    out["gpu_memory_mib"] = dict((str(k), v) for k, v in (h.get("gpu_memory_mib") or {}).items())
    return out

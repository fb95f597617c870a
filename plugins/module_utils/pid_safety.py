# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Rules that every signal sent by the collection passes through (PRIVATE).

A PID may be signalled only when all of these hold (:func:`check_pid`):

* it is an int with ``1 < pid < PID_LIMIT`` (never 0, 1, negative: ``kill(0)`` and
  ``kill(-1)`` would hit our own group or every process);
* it is not in the module's own process tree (itself, its ancestors: the Ansible / SSH /
  shell chain, its descendants: the NVML worker);
* it is not protected (see :class:`.holders.ProtectedMatcher`);
* its create time is unchanged since discovery (no PID reuse);
* it was seen holding a target GPU, or in a targeted unit's cgroup (``allowed``).

Signals go through :func:`send_signal`, which opens a pidfd, re-checks the create time
*after* the pidfd pins the process, then uses ``pidfd_send_signal``: PID reuse between
check and signal is impossible.  :func:`group_ok` decides when a whole process group may be
signalled with ``killpg`` (never our own group, no protected or own-tree member, every
member a drain target or a descendant of one); :func:`send_group_signal` re-validates every
member's identity immediately before ``killpg``.
"""

from __future__ import annotations

import os
import signal

from ansible_collections.gpuflow.eagle3.plugins.module_utils.holders import (
    PID_LIMIT,
    create_time,
    list_pids,
    parse_stat,
)


def _stat(pid, proc_root):
    try:
        with open(os.path.join(proc_root, str(pid), "stat")) as f:
            return parse_stat(f.read())
    except (OSError, ValueError, IndexError):
        return None


def process_table(proc_root="/proc"):
    """``{pid: {"ppid", "pgid", "sid", "state", "name"}}`` for every visible process."""
    table = {}
    for pid in list_pids(proc_root):
        st = _stat(pid, proc_root)
        if st is not None:
            table[pid] = st
    return table


def own_tree(proc_root="/proc", pid=None, table=None):
    """PIDs of this process, its ancestors and its descendants."""
    me = os.getpid() if pid is None else pid
    table = process_table(proc_root) if table is None else table
    tree = {me}
    cur = me
    seen = set()
    while cur > 1 and cur not in seen:
        seen.add(cur)
        st = table.get(cur) or _stat(cur, proc_root)
        if st is None:
            break
        cur = st["ppid"]
        if cur > 0:
            tree.add(cur)
    tree |= descendants([me], table)
    return tree


def descendants(roots, table):
    children = {}
    for pid, st in table.items():
        children.setdefault(st["ppid"], []).append(pid)
    out = set()
    stack = list(roots)
    while stack:
        p = stack.pop()
        for c in children.get(p, ()):
            if c not in out:
                out.add(c)
                stack.append(c)
    return out


def valid_pid_value(pid):
    return isinstance(pid, int) and not isinstance(pid, bool) and 1 < pid < PID_LIMIT


def check_pid(pid, expected_create_time, own, protected_pids, allowed, proc_root="/proc"):
    """Return ``None`` when ``pid`` may be signalled, else the reason why not."""
    if not valid_pid_value(pid):
        return "invalid PID %r" % (pid,)
    if pid in own:
        return "PID %d is in this module's own process tree" % pid
    if pid in protected_pids:
        return "PID %d is protected" % pid
    if pid not in allowed:
        return "PID %d was not seen holding a target GPU" % pid
    ct = create_time(pid, proc_root)
    if ct is None:
        return "PID %d has exited" % pid
    if expected_create_time is None or abs(ct - expected_create_time) > 0.011:
        return "PID %d changed identity (create time %s, expected %s)" % (pid, ct, expected_create_time)
    return None


def _pidfd_open(pid):
    fn = getattr(os, "pidfd_open", None)
    if fn is None:
        return None
    try:
        return fn(pid)
    except OSError:
        return None


def send_signal(pid, sig, expected_create_time, proc_root="/proc", kill=None):
    """Signal one validated PID safely.  Returns None on success, else a reason string.

    The caller must have passed :func:`check_pid`; this re-checks identity with the process
    pinned by a pidfd when the platform has one.
    """
    if not valid_pid_value(pid):
        return "refused: invalid PID %r" % (pid,)
    if kill is not None:  # injected for tests
        ct = create_time(pid, proc_root)
        if ct is None or abs(ct - expected_create_time) > 0.011:
            return "PID %d changed identity or exited" % pid
        kill(pid, sig)
        return None
    fd = _pidfd_open(pid)
    try:
        ct = create_time(pid, proc_root)
        if ct is None or abs(ct - expected_create_time) > 0.011:
            return "PID %d changed identity or exited before the signal" % pid
        try:
            if fd is not None and hasattr(signal, "pidfd_send_signal"):
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            return "PID %d exited before the signal" % pid
        except PermissionError as e:
            return "PID %d: %s" % (pid, e)
        return None
    finally:
        if fd is not None:
            os.close(fd)


def group_members(pgid, table):
    return sorted(p for p, st in table.items() if st["pgid"] == pgid)


def group_ok(pgid, table, targets, own, protected_pids):
    """Return ``(ok, reason, members)`` for signalling process group ``pgid`` with killpg.

    ``targets`` are the validated drain targets.  Every group member must be a target or a
    descendant of a target (the job's own helpers); the group must not be ours and must
    hold no protected or own-tree process.
    """
    if not valid_pid_value(pgid):
        return False, "invalid process group %r" % (pgid,), []
    my_pgid = os.getpgrp()
    if pgid == my_pgid:
        return False, "process group %d is this module's own group" % pgid, []
    members = group_members(pgid, table)
    if not members:
        return False, "process group %d is empty" % pgid, []
    family = set(targets) | descendants(targets, table)
    for m in members:
        if m in own:
            return False, "process group %d contains this module's process tree (PID %d)" % (pgid, m), members
        if m in protected_pids:
            return False, "process group %d contains protected PID %d" % (pgid, m), members
        if m not in family:
            return False, "process group %d contains PID %d, which is not a drain target" % (pgid, m), members
    return True, None, members


def send_group_signal(pgid, sig, expected, proc_root="/proc", killpg=None):
    """killpg after re-validating that the group's members are what was checked.

    ``expected`` maps member PID -> create time as validated by :func:`group_ok`.
    Returns None on success, else the reason the group signal was not sent.
    """
    if not valid_pid_value(pgid) or pgid == os.getpgrp():
        return "refused: process group %r" % (pgid,)
    table = process_table(proc_root)
    now = set(group_members(pgid, table))
    extra = now - set(expected)
    if extra:
        return "process group %d gained members %s since it was checked" % (pgid, sorted(extra))
    for pid in now:
        ct = create_time(pid, proc_root)
        if ct is not None and abs(ct - expected[pid]) > 0.011:
            return "PID %d in group %d changed identity" % (pid, pgid)
    if not now:
        return "process group %d has no members left" % pgid
    try:
        (killpg or os.killpg)(pgid, sig)
    except ProcessLookupError:
        return "process group %d is gone" % pgid
    except PermissionError as e:
        return "process group %d: %s" % (pgid, e)
    return None

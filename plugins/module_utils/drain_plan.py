# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""GPU drain: who holds the GPUs and who a drain signals (PRIVATE to gpuflow.eagle3).

The side-effect-free half of :mod:`.drain`: :func:`snapshot` (GPUs, process table, own tree,
classified holders), :func:`gpu_facts` (that snapshot as ``gpu_info`` returns it, so that
``gpu_info`` carries no drain logic) and :func:`build_plan` (which holders are signalled, which
are skipped and why).
"""

from __future__ import annotations

from ansible_collections.gpuflow.eagle3.plugins.module_utils import holders as H
from ansible_collections.gpuflow.eagle3.plugins.module_utils import pid_safety as S
from ansible_collections.gpuflow.eagle3.plugins.module_utils.systemd import unit_name


def _brief(h, reason=None):
    d = {"pid": h["pid"], "name": h.get("name"), "cmdline": h.get("cmdline"), "class": h.get("class"),
         "pgid": h.get("pgid"), "unit": h.get("unit"), "gpus": h.get("gpus")}
    if reason:
        d["reason"] = reason
    return d


def snapshot(backend, matcher, proc_root="/proc", own=None):
    gpus = backend.gpus()
    table = S.process_table(proc_root)
    own = S.own_tree(proc_root, table=table) if own is None else own
    disc = H.discover(backend, gpus, matcher, own_tree=own, proc_root=proc_root)
    return gpus, table, own, disc


def gpu_facts(backend, matcher, proc_root="/proc"):
    """Facts for ``gpu_info``: GPUs with memory and classified holders."""
    gpus, table, own, disc = snapshot(backend, matcher, proc_root)
    out = []
    for g in gpus:
        i = g["index"]
        g = dict(g)
        g["memory"] = disc["memory"].get(i, g.get("memory"))
        g["holders"] = [H.public_holder(h) for pid, h in sorted(disc["holders"].items()) if i in h["gpus"]]
        g["unresolved_processes"] = disc["unresolved"].get(i, [])
        g["idle_used_mib"] = backend.idle_used_mib(i)
        out.append(g)
    hostwide = [H.public_holder(h) for pid, h in sorted(disc["holders"].items()) if not h["gpus"]]
    return {"gpus": out, "hostwide_holders": hostwide, "driver": backend.driver(),
            "unreadable_pids": disc["unreadable_pids"], "invalid_driver_pids": disc["invalid_driver_pids"]}


def build_plan(disc, targets, p, rx, unit_procs, table, own):
    """Decide who is signalled.  Pure function over discovered data.

    Returns ``{"units", "signal": [holder brief + create_time], "skipped": [...],
    "not_selected": [...], "allowed": {pid: create_time}}``.
    """
    T = set(targets)
    hs = disc["holders"]
    on_target = dict((pid, h) for pid, h in hs.items() if T & set(h["gpus"]))
    explicit = set(p["pids"] or [])
    by_selector = not (p["units"] or explicit or rx is not None)
    all_mode = p["all_holders"] or by_selector
    drain_mgmt = p["management_clients"] == "drain"
    units = [unit_name(u) for u in p["units"] or []]
    unit_of = dict((pid, u) for u, members in (unit_procs or {}).items() for pid in members)

    desc_of_explicit = S.descendants(sorted(explicit), table) if explicit else set()
    owners = _pattern_owners(on_target, rx, table, own, drain_mgmt, disc.get("proc_root", "/proc")) if rx else {}
    desc_of_owners = S.descendants(sorted(owners), table) if owners else set()
    selected = {}
    skipped = []
    not_selected = []
    for pid, h in sorted(on_target.items()):
        cls = h["class"]
        if cls == "self":
            skipped.append(_brief(h, "own process tree"))
            continue
        if cls == "protected":
            skipped.append(_brief(h, "protected (%s)" % h["protected_by"]))
            continue
        why = None
        if all_mode and (cls == "compute" or drain_mgmt):
            why = "holder of a target GPU"
        elif pid in explicit:
            why = "PID named in pids"
        elif pid in owners:
            why = "cmdline matches %r (owner of GPU-holding descendants)" % p["cmdline_pattern"]
        elif pid in desc_of_owners and (cls == "compute" or drain_mgmt):
            why = "descendant of a process whose cmdline matches %r" % p["cmdline_pattern"]
        elif pid in desc_of_explicit and (cls == "compute" or drain_mgmt):
            why = "descendant of a PID named in pids"
        elif pid in unit_of:
            why = "in unit %s" % unit_of[pid]
        elif rx is not None and rx.search(h.get("cmdline") or "") and (cls == "compute" or drain_mgmt):
            why = "cmdline matches %r" % p["cmdline_pattern"]
        if why:
            selected[pid] = (h, why)
        elif cls == "management":
            skipped.append(_brief(h, "management client (no GPU context): left alone"))
        else:
            not_selected.append(_brief(h, "not selected by units / pids / cmdline_pattern"))

    # Named PIDs that hold no target GPU themselves are signalled only when one of their
    # descendants holds a target GPU (they are its owner); otherwise left alone.
    for pid in sorted(explicit):
        if pid in selected or pid in on_target:
            continue
        st = table.get(pid)
        if st is None:
            skipped.append({"pid": pid, "reason": "PID named in pids is not running"})
            continue
        kids = S.descendants([pid], table)
        if pid in own:
            skipped.append({"pid": pid, "reason": "own process tree"})
        elif any(k in selected for k in kids):
            info = H.describe_process(pid, disc.get("proc_root", "/proc")) or {"pid": pid}
            info.setdefault("gpus", [])
            info["class"] = "owner"
            selected[pid] = (info, "PID named in pids (owner of GPU-holding descendants)")
        else:
            skipped.append({"pid": pid, "name": st.get("name"), "reason": "PID named in pids holds no target GPU"})

    for pid, info in sorted(owners.items()):
        if pid not in selected:
            selected[pid] = (info, "cmdline matches %r (owner of GPU-holding descendants)" % p["cmdline_pattern"])

    allowed = {}
    sig = []
    for pid, (h, why) in sorted(selected.items()):
        d = _brief(h, why)
        d["create_time"] = h.get("create_time")
        d["dstate"] = bool(h.get("dstate"))
        sig.append(d)
        allowed[pid] = h.get("create_time")
    # Leftovers of targeted units (holders or not) are the unit's own processes.
    for u, members in (unit_procs or {}).items():
        for pid, ct in members.items():
            if pid in own or pid in allowed:
                continue
            h = hs.get(pid)
            if h is not None and h["class"] in ("protected", "self"):
                continue
            allowed[pid] = ct
    return {"units": units, "signal": sig, "skipped": skipped, "not_selected": not_selected,
            "allowed": allowed}


def _pattern_owners(on_target, rx, table, own, drain_mgmt, proc_root):
    """``{pid: process info}`` of the processes whose cmdline matches ``rx`` and that own a holder of a
    target GPU that may be drained: its parent, grandparent and so on, as long as each matches (vLLM's API
    server above its engine above its tensor-parallel workers).  Draining them with their holders stops
    such a server as a whole.  The climb stops at the first ancestor that does not match, so a shell or a
    terminal multiplexer that started the server is never an owner, and a process that matches but owns
    no holder is not one either."""
    holders = [pid for pid, h in on_target.items()
               if h["class"] == "compute" or (h["class"] == "management" and drain_mgmt)]
    owners, seen = {}, set()
    for holder in sorted(holders):
        cur = (table.get(holder) or {}).get("ppid", 0)
        while cur > 1 and cur not in seen and cur not in own:
            seen.add(cur)
            h = on_target.get(cur)
            if h is not None and h["class"] in ("protected", "self"):
                break
            info = h or H.describe_process(cur, proc_root)
            if not info or not rx.search(info.get("cmdline") or ""):
                break
            info = dict(info)
            info.setdefault("gpus", [])
            info.setdefault("class", "owner")
            owners[cur] = info
            cur = info.get("ppid", 0)
    return owners

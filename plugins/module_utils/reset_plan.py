# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""GPU reset: health checks and the plan (PRIVATE to gpuflow.eagle3).

Side-effect free: functions of facts already gathered (GPUs, platform, holders, daemons' states),
so that check mode and the tests see exactly what a reset would do.  :func:`health_checks` says
whether a GPU needs a reset; :func:`build_plan` decides the reset groups, what blocks each, the
daemons to stop and the GPUs whose persistence mode is turned off.

MIG: a reset destroys GPU / compute instances and applies a pending MIG mode, so a GPU with
MIG enabled is ``blocked`` unless ``allow_mig``; on a vGPU guest with MIG enabled reset is
``unsupported`` (NVIDIA: not supported on MIG-enabled vGPU guests).  MIG and ECC modes are
never changed here.

Holders: any holder of a GPU in a reset group blocks it ("there can't be any applications
using these devices", including monitoring clients), except this module's own tree (its
NVML worker is closed before the reset), protected daemons whose systemd unit is in
``daemons`` (stopped and restored), nvidia-persistenced (covered by persistence mode off)
and Fabric Manager where the rules keep it running.
"""

from __future__ import annotations

import os

from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_platform import nvlink_groups

PERSISTENCED_NAMES = ("nvidia-persistenced", "nvidia-persistenced.service")


def health_checks(g, plat_gpu, mem, holders_mib, baseline, tol, expect_uuid=None):
    """Checks of one GPU as seen now.  Returns a list of ``{"check", "ok", "detail"}``.

    ``ok`` is None where the device cannot tell (the check is then not failed).
    """
    checks = []
    if g is None:
        return [{"check": "answers", "ok": False, "detail": "the device does not answer / is not listed"}]
    ok = expect_uuid is None or g.get("uuid") == expect_uuid
    checks.append({"check": "answers", "ok": ok,
                   "detail": "listed as %s" % g.get("uuid") if ok else "UUID changed: %s, expected %s" % (g.get("uuid"), expect_uuid)})
    used = (mem or {}).get("used_mib")
    if used is None:
        checks.append({"check": "memory_baseline", "ok": None, "detail": "memory unknown"})
    else:
        limit = baseline + holders_mib + tol
        checks.append({"check": "memory_baseline", "ok": used <= limit,
                       "detail": "used %d MiB, limit %d MiB (baseline %d + held by daemons %d + tolerance %d)"
                       % (used, limit, baseline, holders_mib, tol)})
    for key, label in (("retired_pages_pending", "pending retired pages"),
                       ("remapped_rows_pending", "pending remapped rows"),
                       ("remapped_rows_failure", "row remapping failure")):
        v = g.get(key)
        checks.append({"check": key, "ok": None if v is None else not v,
                       "detail": "%s: %s" % (label, "unknown" if v is None else ("yes" if v else "no"))})
    cur, pend = plat_gpu.get("ecc_mode_current"), plat_gpu.get("ecc_mode_pending")
    if cur is None or pend is None:
        checks.append({"check": "ecc_mode", "ok": None, "detail": "ECC mode unknown"})
    else:
        checks.append({"check": "ecc_mode", "ok": cur == pend,
                       "detail": "ECC %s%s" % ("enabled" if cur else "disabled",
                                               "" if cur == pend else ", change to %s pending" % ("enabled" if pend else "disabled"))})
    mp = plat_gpu.get("mig_mode_pending")
    if mp is not None and g.get("mig_mode") is not None:
        checks.append({"check": "mig_mode", "ok": mp == g.get("mig_mode"),
                       "detail": "MIG %s%s" % ("enabled" if g.get("mig_mode") else "disabled",
                                               "" if mp == g.get("mig_mode") else ", change pending")})
    if plat_gpu.get("health") is not None:
        checks.append({"check": "device_health", "ok": plat_gpu["health"] == "ok",
                       "detail": "device health %s" % plat_gpu["health"]})
    return checks


def failing(checks):
    return [c for c in checks if c["ok"] is False]


def needs_reset(checks):
    """Reasons (strings) a GPU needs a reset, from its health checks."""
    return [c["detail"] for c in failing(checks)]


def build_plan(gpus, selected, plat, disc, p, daemon_states, systemd_ok, smi_ids_of):
    """Decide groups, prerequisites, daemons to stop and persistence changes.  Pure.

    ``daemon_states`` maps each unit of ``p["daemons"]`` (and Fabric Manager units) to
    ``{"load", "active"}``; ``smi_ids_of(indices)`` gives the ``-i`` argument values.
    """
    by_index = dict((g["index"], g) for g in gpus)
    fm = plat.get("fabric_manager") or None
    fm_active = bool(fm and fm["active"])
    groups, notes, expanded, blocked_nv = nvlink_groups(selected, plat, fm_active, p["nvlink_peers"],
                                                        sorted(by_index))
    reset_set = sorted(set(i for g in groups for i in g))
    daemons = [u if "." in u else u + ".service" for u in p["daemons"]]

    # Fabric Manager: kept running unless fabric_manager=stop (then stopped and restored like
    # the other daemons).  Ampere NVSwitch needs it running for individual reset; Hopper and
    # later do not depend on it.
    fm_action = "not present"
    if fm:
        fm_action = "stop" if (p["fabric_manager"] == "stop" and fm_active) else "keep"
        if fm_action == "stop" and fm["unit"] not in daemons:
            daemons = daemons + [fm["unit"]]
        if fm_action == "keep" and fm_active and plat.get("nvswitch"):
            notes.append("Fabric Manager (%s) kept running" % fm["unit"])

    to_stop = [u for u in daemons if (daemon_states.get(u) or {}).get("active") == "active"]
    if not systemd_ok:
        to_stop = []

    blocked = dict((i, [{"reason": r}]) for i, r in blocked_nv.items())
    for i in reset_set:
        g = by_index[i]
        pgi = plat["gpus"].get(i) or {}
        if g.get("mig_mode"):
            if pgi.get("virtualization") == "vgpu":
                blocked.setdefault(i, []).append({"reason": "unsupported: reset is not supported on MIG-enabled vGPU guests",
                                                  "unsupported": True})
            elif not p["allow_mig"]:
                blocked.setdefault(i, []).append({"reason": "MIG mode is enabled: a reset destroys its GPU and compute instances "
                                                            "(recreate them afterwards, e.g. with nvidia-mig-parted); "
                                                            "set allow_mig to reset anyway"})
        for u in disc["unresolved"].get(i, []):
            blocked.setdefault(i, []).append({"pid": u["pid"], "reason": "driver lists PID %s: %s" % (u["pid"], u["reason"])})
    for pid, h in sorted(disc["holders"].items()):
        on = [i for i in h["gpus"] if i in reset_set]
        if not on:
            continue
        cls = h["class"]
        unit = h.get("unit")
        if cls == "self":
            continue
        reason = None
        if cls == "protected":
            names = set([h.get("name") or "", os.path.basename(h.get("exe") or ""), unit or ""])
            if unit and unit in to_stop:
                continue
            if names & set(PERSISTENCED_NAMES):
                continue  # released by persistence mode off
            if fm and unit == fm["unit"] and fm_action == "keep":
                continue
            if unit and unit in daemons and not systemd_ok:
                reason = "protected daemon (%s) holds the GPU; systemd is not running, so it cannot be stopped for the reset" % h["protected_by"]
            else:
                reason = ("protected process (%s%s) holds the GPU and is not a daemon this module may stop; "
                          "add its systemd unit to daemons, or stop it first" % (h["protected_by"], ", unit %s" % unit if unit else ""))
        elif cls == "compute":
            reason = "holds a GPU context: drain it first (gpuflow.eagle3.gpu_drain)"
        else:
            reason = "holds the device files (management client): the driver refuses a reset while any client is attached"
        for i in on:
            blocked.setdefault(i, []).append({"pid": pid, "name": h.get("name"), "class": cls, "unit": unit,
                                              "cmdline": h.get("cmdline"), "reason": reason})

    # a group is blocked as a whole when one of its GPUs is
    plan_groups = []
    for grp in groups:
        why = []
        for i in grp:
            for b in blocked.get(i, []):
                why.append(dict(b, gpu=i))
        plan_groups.append({"gpus": grp, "blocked_by": why,
                            "unsupported": any(b.get("unsupported") for b in why),
                            "command": ["nvidia-smi", "--gpu-reset", "-i", ",".join(smi_ids_of(grp))]})
    runnable = [g for g in plan_groups if not g["blocked_by"]]
    run_set = sorted(set(i for g in runnable for i in g["gpus"]))
    pm_off = [i for i in run_set if by_index[i].get("persistence_mode")]
    if not runnable:
        to_stop = []
    return {"groups": plan_groups, "reset_set": reset_set, "expanded_peers": expanded, "notes": notes,
            "daemons_to_stop": to_stop, "persistence_off": pm_off, "fabric_manager": fm_action,
            "nvswitch": bool(plat.get("nvswitch"))}


def plan_diff(by_index, plan):
    """What check mode reports as the diff: each runnable group's GPUs reset, the daemons stopped and restarted."""
    before = {}
    after = {}
    for g in plan["groups"]:
        if g["blocked_by"]:
            continue
        for i in g["gpus"]:
            before["gpu%d" % i] = {"persistence_mode": by_index[i].get("persistence_mode"), "reset": False}
            after["gpu%d" % i] = {"persistence_mode": by_index[i].get("persistence_mode"), "reset": True}
    if plan["daemons_to_stop"]:
        before["daemons"] = dict((u, "active") for u in plan["daemons_to_stop"])
        after["daemons"] = dict((u, "active (stopped and restarted)") for u in plan["daemons_to_stop"])
    return {"before": before, "after": after}

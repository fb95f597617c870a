# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""GPU drain: plan, escalation and readiness polling (PRIVATE to gpuflow.eagle3).

Entry points (plain data in, plain data out; no Ansible import):

:func:`run_drain`
    What ``gpu_drain`` does: validate parameters (:class:`DrainError` before anything is
    signalled), discover, :func:`.drain_plan.build_plan`, then unless ``check_mode``: stop units through
    systemd, SIGTERM (to the process group where :func:`.pid_safety.group_ok` allows,
    else to each PID), poll until the targets exit or ``grace_period`` passes, SIGKILL the
    survivors, poll again up to ``kill_timeout``, then poll the backend until each target
    GPU is ready or ``release_timeout`` passes.  Every wait is a poll (``poll_interval``),
    never a fixed sleep; a clean host returns after one look with ``changed: false``.
    Its phases are functions of their own that share one :class:`DrainRun`: :func:`drain_look`,
    :func:`drain_decide`, :func:`drain_plan`, then :func:`drain_planned_verdict` in check mode,
    else :func:`drain_execute` and :func:`drain_verdict`.

Ready (per GPU) means: no unprotected compute holder left on it, no unresolved driver PID
on it, and ``used_mib <= baseline + memory of protected/own holders + tolerance``.  The
verdict is ``ready``, ``needs_reboot`` (a holder that survives SIGKILL is in D state) or
``blocked`` (``blocked_by`` says by whom and why).

Injected collaborators keep this testable: ``backend`` (:mod:`.gpu_backend`), ``systemd``
(:class:`.systemd.Systemd`, built on a ``run(argv) -> (rc, out, err)`` callable), ``proc_root``,
``clock`` and ``sleep``.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import time

from ansible_collections.gpuflow.eagle3.plugins.module_utils import holders as H
from ansible_collections.gpuflow.eagle3.plugins.module_utils import pid_safety as S
from ansible_collections.gpuflow.eagle3.plugins.module_utils.drain_plan import _brief, build_plan, snapshot
from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_backend import bad_number, resolve_gpu_spec
from ansible_collections.gpuflow.eagle3.plugins.module_utils.systemd import malformed_unit_name, unit_name

DEFAULTS = {
    "gpus": ["all"],
    "units": [],
    "pids": [],
    "cmdline_pattern": None,
    "all_holders": False,
    "protected": [],
    "protected_defaults": True,
    "management_clients": "ignore",
    "signal_process_group": True,
    "grace_period": 15.0,
    "kill_timeout": 10.0,
    "release_timeout": 10.0,
    "poll_interval": 0.02,
    "memory_tolerance_mib": 256,
    "memory_baseline_mib": None,
    "unit_stop_timeout": 120.0,
}


class DrainError(Exception):
    """Bad parameters or an unusable host: raised before anything is signalled."""


def _now_iso():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def resolve_gpus(spec, gpus):
    """Map ``spec`` (``all``, indices, UUIDs; ints or strings) to sorted GPU indices; DrainError when unknown."""
    try:
        return resolve_gpu_spec(spec, gpus)
    except ValueError as e:
        raise DrainError(str(e))


def validate_params(p):
    """Check parameters that need no host access; returns the compiled pattern."""
    for k, low, high in (("grace_period", 0, None), ("kill_timeout", 0, None), ("release_timeout", 0, None),
                         ("unit_stop_timeout", 0, None), ("poll_interval", 0.001, 5)):
        why = bad_number(k, p[k], low, maximum=high)
        if why:
            raise DrainError(why)
    if int(p["memory_tolerance_mib"]) < 0:
        raise DrainError("memory_tolerance_mib must be >= 0")
    for pid in p["pids"] or []:
        if not S.valid_pid_value(pid):
            raise DrainError("invalid PID %r in pids (must be an integer > 1)" % (pid,))
    rx = None
    if p.get("cmdline_pattern"):
        try:
            rx = re.compile(p["cmdline_pattern"])
        except re.error as e:
            raise DrainError("malformed cmdline_pattern %r: %s" % (p["cmdline_pattern"], e))
    for pat in p["protected"] or []:
        try:
            re.compile(pat)
        except re.error as e:
            raise DrainError("malformed protected pattern %r: %s" % (pat, e))
    for u in p["units"] or []:
        if malformed_unit_name(u):
            raise DrainError("malformed unit name %r" % (u,))
    return rx


def unit_members(control_groups, proc_root="/proc"):
    """``{unit: {pid: create_time}}`` of the processes in each unit's control group, the path systemd gives
    (``{unit: ControlGroup}``), or below it. A unit of the same name run by a container's systemd lies under
    the container's cgroup: its processes are not this host's unit's."""
    out = dict((u, {}) for u in control_groups)
    for pid in H.list_pids(proc_root):
        try:
            with open(os.path.join(proc_root, str(pid), "cgroup")) as f:
                path = H.parse_cgroup(f.read())["cgroup"] or ""
        except OSError:
            continue
        for unit, group in control_groups.items():
            if group and (path == group or path.startswith(group.rstrip("/") + "/")):
                ct = H.create_time(pid, proc_root)
                if ct is not None:
                    out[unit][pid] = ct
    return out


class _Timer(object):
    def __init__(self, clock, t0):
        self.clock = clock
        self.t0 = t0

    def rel(self):
        return round(self.clock() - self.t0, 4)


def _protected_compute(h, i):
    """What a protected holder with a compute context keeps on GPU i (the drain leaves it by design)."""
    return {"pid": h["pid"], "name": h.get("name"), "protected_by": h.get("protected_by"),
            "used_mib": (h.get("gpu_memory_mib") or {}).get(i)}


def _alive(pid, ct, proc_root):
    """True while the process exists as the same process and is not a zombie."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat")) as f:
            st = H.parse_stat(f.read())
    except (OSError, ValueError, IndexError):
        return False
    if st["state"] in ("Z", "X"):
        return False
    now_ct = round(H.boot_time(proc_root) + st["starttime"] / float(H.CLK_TCK), 2)
    return ct is None or abs(now_ct - ct) <= 0.011


def _dstate(pid, proc_root):
    try:
        with open(os.path.join(proc_root, str(pid), "stat")) as f:
            return H.parse_stat(f.read())["state"] == "D"
    except (OSError, ValueError, IndexError):
        return False


def _gpu_ready(i, mem, procs, baseline, tol, ignore_pids, ignore_mib):
    """(ready, reason) from one backend poll for GPU ``i``."""
    listed = [x for x in procs.get(i, []) if x["pid"] not in ignore_pids]
    limit = baseline + ignore_mib + tol
    used = mem[i]["used_mib"]
    if listed:
        return False, "driver still lists PIDs %s" % sorted(set(x["pid"] for x in listed))
    if used > limit:
        return False, "memory used %d MiB > baseline %d MiB + tolerance %d MiB" % (used, baseline + ignore_mib, tol)
    return True, None


class Signaller(object):
    """Where signals leave the process; tests substitute a fake."""

    def send(self, pid, sig, create_time, proc_root):
        return S.send_signal(pid, sig, create_time, proc_root)

    def send_group(self, pgid, sig, expected, proc_root):
        return S.send_group_signal(pgid, sig, expected, proc_root)


def drain_params(params):
    """The parameters with their defaults, checked: ``(p, compiled cmdline_pattern or None)``.

    Raises :class:`DrainError` before the host is looked at.
    """
    p = dict(DEFAULTS)
    p.update(dict((k, v) for k, v in params.items() if v is not None or k == "memory_baseline_mib"))
    for k in ("units", "pids", "protected", "gpus"):
        p[k] = list(p.get(k) or ([] if k != "gpus" else ["all"]))
    return p, validate_params(p)


class DrainRun(object):
    """One drain on its way through the phases: the injected collaborators, then what each phase leaves
    for the later ones.  Plain attributes, so that a test can set up any phase by hand."""

    def __init__(self, p, rx, backend, systemd=None, proc_root="/proc", clock=time.monotonic, sleep=time.sleep,
                 t0=None, warn=None, signaller=None):
        self.p = p
        self.rx = rx
        self.backend = backend
        self.systemd = systemd
        self.proc_root = proc_root
        self.clock = clock
        self.sleep = sleep
        self.warn = warn or (lambda m: None)
        self.signaller = signaller or Signaller()
        self.timer = _Timer(clock, clock() if t0 is None else t0)
        # drain_look
        self.matcher = None
        self.gpus = []
        self.table = {}
        self.own = set()
        self.disc = None
        self.targets = []
        self.unit_cgroups = {}
        self.unit_procs = {}
        # drain_decide
        self.plan = None
        self.baseline = {}
        self.keep_mib = {}
        self.ignore_pids = set()
        # drain_plan
        self.before = {}
        self.result = None
        # drain_execute
        self.first_signal_t = None
        self.allowed = {}
        self.alive = {}
        self.exit_t = {}
        self.protected_pids = set()
        self.survivors = {}
        self.followers = set()  # members of a signalled group that were not targets themselves
        self.release_t = {}
        self.last_reason = {}
        self.pending = set()


def run_drain(backend, params, check_mode=False, systemd=None, proc_root="/proc",
              clock=time.monotonic, sleep=time.sleep, t0=None, own=None, warn=None, signaller=None):
    """Drain the selected GPUs.  Returns the module result (without ``diff`` rendering).

    Raises :class:`DrainError` for bad parameters before any signal or unit stop.
    """
    p, rx = drain_params(params)
    d = DrainRun(p, rx, backend, systemd=systemd, proc_root=proc_root, clock=clock, sleep=sleep, t0=t0,
                 warn=warn, signaller=signaller)
    drain_look(d, own)
    drain_decide(d)
    drain_plan(d, check_mode)
    if check_mode:
        return drain_planned_verdict(d)
    drain_execute(d)
    return drain_verdict(d)


def drain_look(d, own=None):
    """Look: one snapshot of GPUs, processes and holders, the target GPUs, the processes of the named units.

    Raises :class:`DrainError` (no GPU, unknown GPU or unit, units without systemd) before anything is done.
    """
    d.matcher = H.ProtectedMatcher(d.p["protected"], d.p["protected_defaults"])
    d.gpus, d.table, d.own, d.disc = snapshot(d.backend, d.matcher, d.proc_root, own)
    d.disc["proc_root"] = d.proc_root
    if not d.gpus:
        raise DrainError("no GPU found by the %s backend" % d.backend.name)
    d.targets = resolve_gpus(d.p["gpus"], d.gpus)

    units = [unit_name(u) for u in d.p["units"]]
    if units:
        if d.systemd is None or not d.systemd.booted():
            raise DrainError("units %s given, but systemd is not running on this host" % units)
        for u in units:
            rc, props = d.systemd.load_state(u)
            if rc != 0 or props.get("LoadState") in (None, "", "not-found"):
                raise DrainError("unknown systemd unit %s (LoadState=%s)" % (u, props.get("LoadState")))
            # kept for the leftovers after the stop, when systemd no longer names an inactive unit's group
            d.unit_cgroups[u] = props.get("ControlGroup")
        d.unit_procs = unit_members(d.unit_cgroups, d.proc_root)


def drain_decide(d):
    """Decide: who is signalled (:func:`build_plan`), and what may stay on each target GPU once it is ready:
    its idle baseline plus the memory of protected and own holders.  Warns about the driver PIDs that
    will not be signalled."""
    d.plan = build_plan(d.disc, d.targets, d.p, d.rx, d.unit_procs, d.table, d.own)
    for pid_info in d.disc["invalid_driver_pids"]:
        d.warn("driver reported an invalid PID %(pid)s on GPU %(gpu)s; ignored" % pid_info)
    for i, lst in d.disc["unresolved"].items():
        if i in d.targets:
            for u in lst:
                d.warn("GPU %s: driver PID %s cannot be mapped to a local process (%s); it will not be signalled"
                       % (i, u["pid"], u["reason"]))

    hs = d.disc["holders"]
    for i in d.targets:
        d.baseline[i] = int(d.p["memory_baseline_mib"]) if d.p["memory_baseline_mib"] is not None else d.backend.idle_used_mib(i)
        d.keep_mib[i] = sum((h["gpu_memory_mib"].get(i) or 0) for h in hs.values()
                            if h["class"] in ("protected", "self") and i in h["gpus"])
    d.ignore_pids = set(pid for pid, h in hs.items() if h["class"] in ("protected", "self"))


def drain_plan(d, check_mode):
    """Plan: the result before anything is done (targets, plan, no actions yet) and each target GPU's holders."""
    hs = d.disc["holders"]
    for i in d.targets:
        d.before[i] = [_brief(h) for pid, h in sorted(hs.items()) if i in h["gpus"]]
    plan = d.plan
    d.result = {"changed": False, "check_mode": bool(check_mode), "targets": d.targets,
                "backend": d.backend.driver(),
                "plan": {"units": plan["units"], "signal": plan["signal"], "skipped": plan["skipped"],
                         "not_selected": plan["not_selected"]},
                "actions": []}
    return d.result


def drain_planned_verdict(d):
    """Verdict in check mode, from the plan alone: ``blocked`` where a holder would be left, ``planned``
    where one would be signalled, else ``ready`` by the memory rule; and the diff the drain would make."""
    plan, disc, hs = d.plan, d.disc, d.disc["holders"]
    gres = []
    remaining_pids = set(x["pid"] for x in plan["not_selected"])
    for i in d.targets:
        g = next(x for x in d.gpus if x["index"] == i)
        m = disc["memory"][i]
        blockers = [x for x in plan["not_selected"] if i in (x.get("gpus") or [])]
        blockers += [{"pid": u["pid"], "reason": u["reason"]} for u in disc["unresolved"].get(i, [])]
        if blockers:
            verdict = "blocked"
        elif any(i in (x.get("gpus") or []) for x in plan["signal"]):
            verdict = "planned"
        else:
            ok, why = _gpu_ready(i, disc["memory"], disc["processes"], d.baseline[i],
                                 int(d.p["memory_tolerance_mib"]), d.ignore_pids, d.keep_mib[i])
            verdict = "ready" if ok else "blocked"
            if not ok:
                blockers.append({"reason": why})
        gres.append({"index": i, "uuid": g["uuid"], "verdict": verdict, "blocked_by": blockers,
                     "memory_before": m, "memory_after": None, "baseline_mib": d.baseline[i],
                     "holders": [H.public_holder(h) for pid, h in sorted(hs.items()) if i in h["gpus"]],
                     "time_to_exit_s": None, "time_to_release_s": None})
    d.result.update({"changed": bool(plan["units"] or plan["signal"]), "gpus": gres,
                     "ready": all(x["verdict"] == "ready" for x in gres), "elapsed_s": d.timer.rel()})
    planned = set(x["pid"] for x in plan["signal"])
    d.result["diff"] = {"before": d.before,
                        "after": dict((i, [b for b in d.before[i] if b["pid"] not in planned or b["pid"] in remaining_pids])
                                      for i in d.targets)}
    return d.result


def drain_execute(d):
    """Execute: stop the planned units, signal the targets that are left, wait for the GPUs' release."""
    drain_stop_units(d)
    drain_signal(d)
    drain_wait_released(d)


def drain_stop_units(d):
    """``systemctl stop`` each planned unit; a failed stop only warns (its leftovers are signalled next)."""
    actions = d.result["actions"]
    for u in d.plan["units"]:
        a = {"t": d.timer.rel(), "time": _now_iso(), "action": "systemctl_stop", "unit": u}
        rc, out, err = d.systemd.stop(u, timeout=d.p["unit_stop_timeout"])
        a.update({"rc": rc, "duration_s": round(d.timer.rel() - a["t"], 4)})
        if rc != 0:
            a["error"] = (err or out or "").strip()[:500]
            d.warn("systemctl stop %s failed (rc=%s): %s" % (u, rc, a["error"]))
        actions.append(a)
        d.result["changed"] = True
    d.first_signal_t = actions[0]["t"] if actions else None


def drain_signal(d):
    """SIGTERM the targets still alive, SIGKILL those left after ``grace_period``, wait up to
    ``kill_timeout``; records when each target exited and which survived (and whether in D state)."""
    # Targets: planned holders still alive + unit leftovers (now, after the stop).
    d.allowed = dict(d.plan["allowed"])
    if d.plan["units"]:
        for u, members in unit_members(d.unit_cgroups, d.proc_root).items():
            for pid, ct in members.items():
                if pid in d.own or pid in d.ignore_pids:
                    continue
                if pid not in d.allowed:
                    d.allowed[pid] = ct
    d.alive = dict((pid, ct) for pid, ct in d.allowed.items() if _alive(pid, ct, d.proc_root))
    for pid in d.allowed:
        if pid not in d.alive:
            d.exit_t[pid] = d.timer.rel()
    d.protected_pids = set(pid for pid, h in d.disc["holders"].items() if h["class"] == "protected")

    if d.alive:
        if drain_signal_round(d, signal.SIGTERM, "SIGTERM"):
            d.result["changed"] = True
            if d.first_signal_t is None:
                d.first_signal_t = next(a["t"] for a in d.result["actions"] if a["action"] in ("kill", "killpg"))
        drain_wait_exit(d, d.clock() + float(d.p["grace_period"]))
        if d.alive:
            if drain_signal_round(d, signal.SIGKILL, "SIGKILL"):
                d.result["changed"] = True
            drain_wait_exit(d, d.clock() + float(d.p["kill_timeout"]))

    d.survivors = dict((pid, {"dstate": _dstate(pid, d.proc_root)}) for pid in d.alive)
    for pid, s in sorted(d.survivors.items()):
        if pid in d.followers:  # a target's own survival shows in its GPU's verdict
            d.warn("PID %d, a descendant of a target in its signalled process group, survived SIGKILL%s"
                   % (pid, " in D state (uninterruptible): a reboot may be needed" if s["dstate"] else ""))


def drain_signal_round(d, sig, signame):
    """Send ``sig`` once to every target still alive: to its process group where :func:`.pid_safety.group_ok`
    allows it, else to the PID.  True when any target was alive."""
    table_now = S.process_table(d.proc_root)
    actions = d.result["actions"]
    done = set()
    pids_now = [pid for pid in sorted(d.alive) if _alive(pid, d.alive[pid], d.proc_root)]
    groups = {}
    if d.p["signal_process_group"]:
        for pid in pids_now:
            st = table_now.get(pid)
            if st:
                groups.setdefault(st["pgid"], []).append(pid)
    for pgid, pids in sorted(groups.items()):
        ok, why, members = S.group_ok(pgid, table_now, list(d.alive), d.own, d.protected_pids)
        if not ok:
            continue
        expected = {}
        for m in members:
            expected[m] = H.create_time(m, d.proc_root)
        # members outside the validated targets are descendants: check their identity
        bad = [m for m in members if m in d.alive and expected[m] is not None and abs(expected[m] - d.alive[m]) > 0.011]
        if bad:
            continue
        a = {"t": d.timer.rel(), "time": _now_iso(), "action": "killpg", "signal": signame,
             "pgid": pgid, "pids": members}
        err = d.signaller.send_group(pgid, sig, expected, d.proc_root)
        if err:
            a["error"] = err
        else:
            done.update(members)
            # the targets' descendants got the signal too: wait for them (and escalate) as for the targets,
            # so no member of the group outlives the drain
            for m in members:
                if m not in d.alive and expected[m] is not None:
                    d.alive[m] = d.allowed[m] = expected[m]
                    d.followers.add(m)
        actions.append(a)
    for pid in pids_now:
        if pid in done:
            continue
        why = S.check_pid(pid, d.alive[pid], d.own, d.protected_pids, d.allowed, d.proc_root)
        a = {"t": d.timer.rel(), "time": _now_iso(), "action": "kill", "signal": signame, "pid": pid}
        if why is None:
            why = d.signaller.send(pid, sig, d.alive[pid], d.proc_root)
        if why:
            a["error"] = why
        actions.append(a)
    return bool(pids_now)


def drain_wait_exit(d, deadline):
    """Poll until every target has exited or ``deadline`` (on ``d.clock``) passes."""
    while True:
        now_rel = d.timer.rel()
        for pid in list(d.alive):
            if not _alive(pid, d.alive[pid], d.proc_root):
                d.exit_t[pid] = now_rel
                del d.alive[pid]
        if not d.alive or d.clock() >= deadline:
            return
        d.sleep(float(d.p["poll_interval"]))


def drain_wait_released(d):
    """Poll the backend until each target GPU is ready, is held only by processes the drain leaves alone, or
    ``release_timeout`` passes; the GPUs not ready are left in ``d.pending``."""
    tol = int(d.p["memory_tolerance_mib"])
    deadline = d.clock() + float(d.p["release_timeout"])
    pending = set(d.targets)
    known = {}
    for i in d.targets:
        known[i] = set(x["pid"] for x in d.plan["not_selected"] if i in (x.get("gpus") or []))
        known[i] |= set(u["pid"] for u in d.disc["unresolved"].get(i, []))
    while pending:
        mem, procs = d.backend.poll(d.targets)
        now_rel = d.timer.rel()
        for i in sorted(pending):
            ok, why = _gpu_ready(i, mem, procs, d.baseline[i], tol, d.ignore_pids, d.keep_mib[i])
            if ok:
                d.release_t[i] = now_rel
                pending.discard(i)
                continue
            d.last_reason[i] = why
            listed = set(x["pid"] for x in procs.get(i, []) if x["pid"] not in d.ignore_pids)
            if listed and listed <= known[i]:
                pending.discard(i)  # held by processes we were not asked to (or cannot) touch
        if not pending or d.clock() >= deadline:
            break
        d.sleep(float(d.p["poll_interval"]))
    d.pending = set(d.targets) - set(d.release_t)


def drain_verdict(d):
    """Verdict per target GPU, confirmed by a last look through both views (/proc and the driver): ``ready``,
    ``needs_reboot`` or ``blocked`` with ``blocked_by``; the times to exit and to release; the diff."""
    p, plan = d.p, d.plan
    gpus2, table2, own2, disc2 = snapshot(d.backend, d.matcher, d.proc_root, d.own)
    gres = []
    for i in d.targets:
        g = next(x for x in d.gpus if x["index"] == i)
        remaining = [h for pid, h in sorted(disc2["holders"].items()) if i in h["gpus"]]
        blockers = []
        verdict = "ready"
        # allowed by design, but a compute context is memory the next stage will not have
        protected_compute = [_protected_compute(h, i) for h in remaining
                             if h["class"] == "protected" and i in (h.get("context_gpus") or [])]
        for h in remaining:
            if h["class"] in ("protected", "self"):
                continue
            if h["class"] == "management" and not (p["management_clients"] == "drain" and h["pid"] in d.allowed):
                continue
            if h["pid"] in d.survivors and d.survivors[h["pid"]]["dstate"] or h.get("dstate"):
                blockers.append(_brief(h, "in D state (uninterruptible): survived SIGKILL; reboot needed"))
                verdict = "needs_reboot"
            elif h["pid"] in d.survivors:
                blockers.append(_brief(h, "survived SIGKILL"))
            elif h["pid"] in d.allowed:
                blockers.append(_brief(h, "still holds the GPU after the drain"))
            else:
                blockers.append(_brief(h, "not selected by units / pids / cmdline_pattern" if h["class"] == "compute"
                                       else "holds the GPU"))
        for u in disc2["unresolved"].get(i, []):
            blockers.append({"pid": u["pid"], "reason": "driver lists PID %s: %s" % (u["pid"], u["reason"])})
        if i in d.pending and not blockers:
            blockers.append({"reason": (d.last_reason.get(i) or "not ready") + " (memory held with no holder: a reset may be needed)"})
        if blockers and verdict != "needs_reboot":
            verdict = "blocked"
        gpu_targets = [x["pid"] for x in plan["signal"] if i in (x.get("gpus") or [])]
        exits = [d.exit_t[pid] for pid in gpu_targets if pid in d.exit_t]
        tte = None
        ttr = None
        if d.first_signal_t is not None:
            if exits and len(exits) == len(gpu_targets):
                tte = round(max(exits) - d.first_signal_t, 4)
            if gpu_targets and i in d.release_t and verdict == "ready":
                ttr = round(d.release_t[i] - d.first_signal_t, 4)
        if verdict == "ready":
            for kept in protected_compute:
                d.warn("GPU %d is ready, but the protected process %s (pid %d, %s) holds %s MiB of compute memory on it: "
                       "the next stage has that much less"
                       % (i, kept["name"], kept["pid"], kept["protected_by"],
                          "an unknown amount of" if kept["used_mib"] is None else kept["used_mib"]))
        gres.append({"index": i, "uuid": g["uuid"], "verdict": verdict, "blocked_by": blockers,
                     "protected_compute": protected_compute,
                     "memory_before": d.disc["memory"][i], "memory_after": disc2["memory"][i],
                     "baseline_mib": d.baseline[i],
                     "holders": [H.public_holder(h) for pid, h in sorted(d.disc["holders"].items()) if i in h["gpus"]],
                     "time_to_exit_s": tte, "time_to_release_s": ttr})
    after = {}
    for i in d.targets:
        after[i] = [_brief(h) for pid, h in sorted(disc2["holders"].items()) if i in h["gpus"]]
    d.result.update({"gpus": gres, "ready": all(x["verdict"] == "ready" for x in gres),
                     "elapsed_s": d.timer.rel(), "diff": {"before": d.before, "after": after}})
    return d.result

# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""GPU reset: the phases of one reset, from the look to the verdict (PRIVATE to gpuflow.eagle3).

Note that this module util is private to the collection: it can change at any time.

Entry point :func:`run_reset` (plain data in, plain data out, no Ansible import).  The order
follows NVIDIA's documented rules for ``nvidia-smi --gpu-reset`` and NVSentinel's reset job
(research/gpu_drain.md B.9-B.12), one function per phase, sharing one :class:`ResetRun`.
The facts and decisions the phases use live beside this file: :mod:`.gpu_platform` (platform
probe, NVLink groups), :mod:`.reset_plan` (health checks, plan; no side effects),
:mod:`.nvidia_smi` (the commands) and :mod:`.simulated_backend` (the simulated reset).

1. look (:func:`reset_look`): GPUs, platform (architecture, NVLink peers, NVSwitch, ECC / MIG
   pending modes, virtualization), holders (same discovery as ``gpu_drain``), health;
2. decide (:func:`reset_decide`) which GPUs need a reset (``force`` resets every chosen GPU);
   a clean host stops here, unchanged (:func:`reset_healthy_verdict`);
3. plan (:func:`reset_plan`, with :func:`.reset_plan.build_plan`, pure): reset groups (NVLink rules),
   prerequisites, the daemons to stop, the GPUs whose persistence mode is turned off.  A group
   with an unmet prerequisite is ``blocked`` and nothing is done to it.  Check mode returns the
   plan (:func:`reset_planned_verdict`);
4. execute (:func:`reset_execute`): stop the active daemons (systemd), persistence off, close
   this module's own NVML worker (it is a client of the device too), ``nvidia-smi --gpu-reset
   -i <uuids>`` per group with a timeout; then, in ``finally`` blocks whatever happened: reopen
   the backend, restore persistence mode where it was on, health checks, start the daemons that
   were running before (all of them, even when the reset failed: a host must never be left
   without its monitoring);
5. verdict per GPU (:func:`reset_verdict`): ``healthy`` (nothing needed, or reset and every
   health check passed), ``planned`` (check mode), ``blocked`` (prerequisite unmet;
   ``blocked_by`` says why), ``busy`` (the driver refused: in use), ``unsupported`` (the device
   or platform cannot reset: a result, not a crash), ``unhealthy`` (reset ran, a health check
   failed: power cycle the node, as NVIDIA's documentation says), ``failed`` (command error or
   timeout).

The NVLink rules are :mod:`.gpu_platform`'s, the MIG and holder rules :mod:`.reset_plan`'s.
"""

from __future__ import annotations

import datetime
import time

from ansible_collections.gpuflow.eagle3.plugins.module_utils import holders as H
from ansible_collections.gpuflow.eagle3.plugins.module_utils import pid_safety as S
from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_backend import (
    BackendError,
    BackendUnsupported,
    bad_number,
    resolve_gpu_spec,
)
from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_platform import platform_info, unit_state
from ansible_collections.gpuflow.eagle3.plugins.module_utils.nvidia_smi import smi_ids
from ansible_collections.gpuflow.eagle3.plugins.module_utils.reset_plan import (
    PERSISTENCED_NAMES,
    build_plan,
    failing,
    health_checks,
    needs_reset,
    plan_diff,
)
from ansible_collections.gpuflow.eagle3.plugins.module_utils.systemd import malformed_unit_name

DEFAULT_DAEMONS = [
    "nvidia-dcgm.service", "dcgm.service", "nv-hostengine.service",
    "nvidia-dcgm-exporter.service", "dcgm-exporter.service", "nvidia_gpu_exporter.service",
    "nvsm.service",
]

DEFAULTS = {
    "gpus": ["all"],
    "force": False,
    "daemons": list(DEFAULT_DAEMONS),
    "fabric_manager": "auto",
    "nvlink_peers": "expand",
    "allow_mig": False,
    "reset_timeout": 120.0,
    "command_timeout": 30.0,
    "health_timeout": 30.0,
    "poll_interval": 0.1,
    "memory_tolerance_mib": 256,
    "memory_baseline_mib": None,
    "protected": [],
    "protected_defaults": True,
    "unit_timeout": 120.0,
}

OK_VERDICTS = ("healthy", "planned")
# worst first: the host-level verdict is the worst GPU verdict
VERDICT_ORDER = ("failed", "unhealthy", "unsupported", "busy", "blocked", "planned", "healthy")


class ResetError(Exception):
    """Bad parameters or an unusable host: raised before anything is changed."""


def _now_iso():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def backend_reset(backend, indices, timeout):
    """Reset a group through the backend; ``unsupported`` when the backend has no hook."""
    fn = getattr(backend, "reset_gpus", None)
    try:
        if fn is not None:
            return fn(list(indices), timeout=timeout)
        if len(indices) != 1:
            raise BackendUnsupported("backend %s cannot reset several GPUs in one command" % backend.name)
        return backend.reset_gpu(indices[0])
    except BackendUnsupported as e:
        return {"rc": None, "stdout": "", "stderr": str(e), "timed_out": False, "duration_s": 0.0,
                "outcome": "unsupported", "argv": []}


def backend_persistence(backend, index, enabled):
    try:
        res = backend.set_persistence_mode(index, enabled)
    except BackendUnsupported as e:
        return {"rc": None, "stdout": "", "stderr": str(e), "outcome": "unsupported", "argv": []}
    except BackendError as e:
        return {"rc": None, "stdout": "", "stderr": str(e), "outcome": "failed", "argv": []}
    if not isinstance(res, dict):
        res = {"rc": 0, "stdout": "", "stderr": "", "outcome": "ok", "argv": []}
    return res


# --------------------------------------------------------------------------- run
def _validate(p):
    for k in ("reset_timeout", "command_timeout", "health_timeout", "unit_timeout", "poll_interval"):
        why = bad_number(k, p[k], 0.001, maximum=5) if k == "poll_interval" else bad_number(k, p[k], above=True)
        if why:
            raise ResetError(why)
    if int(p["memory_tolerance_mib"]) < 0:
        raise ResetError("memory_tolerance_mib must be >= 0")
    if p["fabric_manager"] not in ("auto", "keep", "stop"):
        raise ResetError("fabric_manager must be auto, keep or stop")
    if p["nvlink_peers"] not in ("expand", "fail"):
        raise ResetError("nvlink_peers must be expand or fail")
    for u in p["daemons"] or []:
        if malformed_unit_name(u):
            raise ResetError("malformed unit name %r in daemons" % (u,))
    import re
    for pat in p["protected"] or []:
        try:
            re.compile(pat)
        except re.error as e:
            raise ResetError("malformed protected pattern %r: %s" % (pat, e))
    if not p["gpus"]:
        raise ResetError("gpus must name at least one GPU (index, UUID or all)")


def _resolve(spec, gpus):
    try:
        return resolve_gpu_spec(spec, gpus)
    except ValueError as e:
        raise ResetError(str(e))


def _worst(verdicts):
    for v in VERDICT_ORDER:
        if v in verdicts:
            return v
    return "healthy"


class _Clock(object):
    def __init__(self, clock, t0):
        self.clock, self.t0 = clock, t0

    def rel(self):
        return round(self.clock() - self.t0, 4)


def reset_params(params):
    """The parameters with their defaults, checked: :class:`ResetError` before the backend is opened."""
    p = dict(DEFAULTS)
    p.update(dict((k, v) for k, v in params.items() if v is not None or k == "memory_baseline_mib"))
    p["daemons"] = list(p["daemons"] if p.get("daemons") is not None else DEFAULT_DAEMONS)
    p["protected"] = list(p.get("protected") or [])
    p["gpus"] = list(p.get("gpus") or [])
    _validate(p)
    return p


class ResetRun(object):
    """One reset on its way through the phases: the injected collaborators, then what each phase leaves
    for the later ones.  Plain attributes, so that a test can set up any phase by hand."""

    def __init__(self, p, open_backend, systemd=None, proc_root="/proc", clock=time.monotonic, sleep=time.sleep,
                 t0=None, warn=None, probe=None):
        self.p = p
        self.open_backend = open_backend
        self.systemd = systemd
        self.proc_root = proc_root
        self.clock = clock
        self.sleep = sleep
        self.warn = warn or (lambda m: None)
        self.probe = probe
        self.timer = _Clock(clock, clock() if t0 is None else t0)
        self.tol = int(p["memory_tolerance_mib"])
        self.matcher = H.ProtectedMatcher(p["protected"], p["protected_defaults"])
        # the open backend (a new one after the reset); closed is True while none is open
        self.backend = None
        self.closed = False
        # reset_look
        self.gpus = []
        self.by_index = {}
        self.targets = []
        self.systemd_ok = False
        self.plat = None
        self.own = set()
        self.disc = None
        self.baseline = {}
        self.keep_mib = {}
        # reset_decide
        self.before_checks = {}
        self.reasons = {}
        self.selected = []
        # reset_plan
        self.plan = None
        self.result = None
        self.group_of = {}
        self.involved = []
        # reset_execute
        self.stopped = []
        self.pm_off_done = []
        self.outcome = {}   # index -> (verdict, output, duration)
        self.after_checks = {}
        self.pm_after = {}


def run_reset(open_backend, params, check_mode=False, systemd=None, proc_root="/proc",
              clock=time.monotonic, sleep=time.sleep, t0=None, own=None, warn=None, probe=None):
    """Reset the chosen GPUs that need it (all of them with ``force``).  See module docstring.

    ``open_backend()`` returns a fresh backend: the backend is closed before the reset (its
    NVML worker would hold the device) and reopened for the health checks.
    Raises :class:`ResetError` for bad parameters or an unusable host before any change.
    """
    r = ResetRun(reset_params(params), open_backend, systemd=systemd, proc_root=proc_root, clock=clock, sleep=sleep,
                 t0=t0, warn=warn, probe=probe)
    r.backend = open_backend()
    try:
        reset_look(r, own)
        reset_decide(r)
        reset_plan(r, check_mode)
        if not r.selected:
            return reset_healthy_verdict(r)
        if check_mode:
            return reset_planned_verdict(r)
        reset_execute(r)
        return reset_verdict(r)
    finally:
        if not r.closed:
            r.backend.close()


def reset_look(r, own=None):
    """Look: GPUs, target GPUs, platform, holders, and each GPU's idle baseline and holders' memory.

    Raises :class:`ResetError` (no GPU, unknown GPU) before any change.
    """
    r.gpus = r.backend.gpus()
    if not r.gpus:
        raise ResetError("no GPU found by the %s backend" % r.backend.name)
    r.by_index = dict((g["index"], g) for g in r.gpus)
    r.targets = _resolve(r.p["gpus"], r.gpus)
    r.systemd_ok = bool(r.systemd is not None and r.systemd.booted())
    r.plat = platform_info(r.backend, r.gpus, r.systemd if r.systemd_ok else None, probe=r.probe,
                           timeout=float(r.p["command_timeout"]))
    for w in r.plat["warnings"]:
        r.warn(w)
    table = S.process_table(r.proc_root)
    r.own = S.own_tree(r.proc_root, table=table) if own is None else own
    r.disc = H.discover(r.backend, r.gpus, r.matcher, own_tree=r.own, proc_root=r.proc_root)
    for i in r.by_index:
        r.baseline[i] = int(r.p["memory_baseline_mib"]) if r.p["memory_baseline_mib"] is not None else r.backend.idle_used_mib(i)
        r.keep_mib[i] = sum((h["gpu_memory_mib"].get(i) or 0) for h in r.disc["holders"].values()
                            if i in h["gpus"])


def reset_decide(r):
    """Decide: health checks of each target GPU; the GPUs selected for a reset are those failing one (all
    targets with ``force``)."""
    for i in r.targets:
        r.before_checks[i] = health_checks(r.by_index[i], r.plat["gpus"].get(i) or {}, r.disc["memory"].get(i),
                                           r.keep_mib[i], r.baseline[i], r.tol)
        r.reasons[i] = needs_reset(r.before_checks[i])
    r.selected = list(r.targets) if r.p["force"] else [i for i in r.targets if r.reasons[i]]


def reset_plan(r, check_mode):
    """Plan: the daemons' states (asked only when a GPU is selected), :func:`build_plan`, and the result
    before anything is done."""
    daemon_units = [u if "." in u else u + ".service" for u in r.p["daemons"]]
    daemon_states = {}
    if r.systemd_ok and r.selected:
        for u in daemon_units:
            daemon_states[u] = unit_state(r.systemd, u)
        fm = r.plat.get("fabric_manager")
        if fm:
            daemon_states[fm["unit"]] = {"load": "loaded", "active": "active" if fm["active"] else "inactive"}
    backend = r.backend
    r.plan = build_plan(r.gpus, r.selected, r.plat, r.disc, r.p, daemon_states, r.systemd_ok,
                        lambda idx: smi_ids(backend, idx) if backend.name == "nvml" else [str(x) for x in idx])
    if backend.name == "simulated":
        for g in r.plan["groups"]:
            g["command"] = ["simulated"] + g["command"][1:]
    plat = r.plat
    r.result = {"changed": False, "check_mode": bool(check_mode), "targets": r.targets,
                "selected": r.selected, "backend": backend.driver(),
                "platform": {"nvswitch": plat["nvswitch"], "fabric_manager": plat["fabric_manager"],
                             "gpus": dict((str(i), v) for i, v in sorted(plat["gpus"].items()))},
                "plan": r.plan, "actions": [], "daemons": [], "persistence": []}
    for g in r.plan["groups"]:
        for i in g["gpus"]:
            r.group_of[i] = g
    r.involved = sorted(set(r.targets) | set(r.plan["reset_set"]))
    return r.result


def reset_gpu_entry(r, i, verdict, action):
    """GPU ``i``'s entry of the result, as the plan leaves it (the verdict phases add what the reset did)."""
    g = r.by_index[i]
    grp = r.group_of.get(i)
    return {"index": i, "uuid": g.get("uuid"), "pci_bus_id": g.get("pci_bus_id"), "chosen": i in r.targets,
            "needed": bool(r.reasons.get(i)), "reasons": r.reasons.get(i, []),
            "action": action, "verdict": verdict,
            "blocked_by": list((grp or {}).get("blocked_by", [])),
            "reset_group": (grp or {}).get("gpus"),
            "persistence_mode_before": g.get("persistence_mode"), "persistence_mode_after": None,
            "mig_mode": g.get("mig_mode"),
            "checks_before": r.before_checks.get(i), "checks_after": None,
            "reset_s": None, "output": None}


def reset_healthy_verdict(r):
    """Verdict when no GPU needs a reset: every target ``healthy``, nothing changed."""
    r.result["gpus"] = [reset_gpu_entry(r, i, "healthy", "none") for i in r.targets]
    r.result.update({"ok": True, "verdict": "healthy", "elapsed_s": r.timer.rel(),
                     "diff": {"before": {}, "after": {}}})
    return r.result


def reset_planned_verdict(r):
    """Verdict in check mode, from the plan alone: ``planned``, ``blocked`` or ``unsupported`` per group."""
    out = []
    for i in r.involved:
        grp = r.group_of.get(i)
        if grp is None:
            out.append(reset_gpu_entry(r, i, "healthy", "none"))
        elif grp["blocked_by"]:
            out.append(reset_gpu_entry(r, i, "unsupported" if grp["unsupported"] else "blocked", "blocked"))
        else:
            out.append(reset_gpu_entry(r, i, "planned", "reset"))
    result = r.result
    result["gpus"] = out
    result["changed"] = any(not g["blocked_by"] for g in r.plan["groups"])
    result["ok"] = all(x["verdict"] in OK_VERDICTS for x in out)
    result["verdict"] = _worst([x["verdict"] for x in out])
    result["elapsed_s"] = r.timer.rel()
    result["diff"] = plan_diff(r.by_index, r.plan)
    return result


def reset_execute(r):
    """Execute the runnable groups of the plan (module docstring, step 4).  Whatever happens, persistence
    mode is restored and the stopped daemons are started again."""
    runnable = [g for g in r.plan["groups"] if not g["blocked_by"]]
    try:
        try:
            reset_stop_daemons(r)
            if r.plan["daemons_to_stop"]:
                runnable = reset_recheck_holders(r, runnable)
            reset_persistence_off(r, runnable)
            # our own NVML worker is a client of the device: close it for the reset
            r.backend.close()
            r.closed = True
            reset_groups(r, runnable)
        except _Abort as e:
            r.warn(str(e))
            for g in runnable:
                for i in g["gpus"]:
                    r.outcome.setdefault(i, ("failed", str(e), None))
        finally:
            reset_restore_persistence(r)
        reset_health_after(r)
    finally:
        reset_start_daemons(r)


def reset_stop_daemons(r):
    """``systemctl stop`` each planned daemon; the first that fails aborts the reset (:class:`_Abort`)."""
    for u in r.plan["daemons_to_stop"]:
        a = {"t": r.timer.rel(), "time": _now_iso(), "action": "systemctl_stop", "unit": u}
        rc, out, err = r.systemd.stop(u, timeout=r.p["unit_timeout"])
        a.update({"rc": rc, "duration_s": round(r.timer.rel() - a["t"], 4)})
        r.result["actions"].append(a)
        r.result["changed"] = True
        d = {"unit": u, "was_active": True, "stopped": rc == 0, "restored": None, "error": None}
        r.result["daemons"].append(d)
        r.stopped.append(u)
        if rc != 0:
            d["error"] = (err or out or "").strip()[:500]
            raise _Abort("systemctl stop %s failed (rc=%s): %s" % (u, rc, d["error"]))


def reset_recheck_holders(r, runnable):
    """Holders after the daemons are gone: anything left blocks its group.  Returns the groups still runnable."""
    disc2 = H.discover(r.backend, r.gpus, r.matcher, own_tree=r.own, proc_root=r.proc_root)
    for g in runnable:
        left = [h for h in disc2["holders"].values() if set(h["gpus"]) & set(g["gpus"])
                and h["class"] != "self"
                and not (set([h.get("name") or ""]) & set(PERSISTENCED_NAMES))]
        if left:
            g["blocked_by"] = [{"pid": h["pid"], "name": h.get("name"), "class": h["class"],
                                "reason": "still holds the GPU after its daemons were stopped"} for h in left]
    return [g for g in runnable if not g["blocked_by"]]


def reset_persistence_off(r, runnable):
    """Persistence mode off on the planned GPUs of each runnable group; a group where it fails is not reset."""
    for g in runnable:
        pm_failed = False
        for i in g["gpus"]:
            if i not in r.plan["persistence_off"]:
                continue
            a = {"t": r.timer.rel(), "time": _now_iso(), "action": "persistence_off", "gpu": i}
            res = backend_persistence(r.backend, i, False)
            a.update({"rc": res.get("rc"), "argv": res.get("argv")})
            r.result["actions"].append(a)
            r.result["changed"] = True
            if res["outcome"] != "ok":
                a["error"] = (res.get("stderr") or res.get("stdout") or "")[-500:]
                pm_failed = True
            else:
                r.pm_off_done.append(i)
        if pm_failed:
            g["failed"] = "could not turn persistence mode off"


def reset_groups(r, runnable):
    """Reset each runnable group in one command; records each GPU's outcome, output and duration."""
    for g in runnable:
        if g.get("failed"):
            for i in g["gpus"]:
                r.outcome[i] = ("failed", g["failed"], None)
            continue
        a = {"t": r.timer.rel(), "time": _now_iso(), "action": "reset", "gpus": g["gpus"],
             "argv": g["command"]}
        res = backend_reset(r.backend, g["gpus"], float(r.p["reset_timeout"]))
        a.update({"rc": res.get("rc"), "outcome": res["outcome"], "duration_s": res.get("duration_s"),
                  "timed_out": res.get("timed_out", False)})
        if res.get("argv"):
            a["argv"] = res["argv"]
        r.result["actions"].append(a)
        r.result["changed"] = True
        text = ((res.get("stdout") or "") + ("\n" + res["stderr"] if res.get("stderr") else "")).strip()
        if res.get("timed_out"):
            text = ("timed out after %s s. " % r.p["reset_timeout"]) + text
        for i in g["gpus"]:
            r.outcome[i] = (res["outcome"], text[-1000:], res.get("duration_s"))


def reset_restore_persistence(r):
    """Reopen the backend if it was closed for the reset, then persistence mode on again where it was turned off."""
    if r.closed:
        try:
            r.backend = r.open_backend()
            r.closed = False
            r.backend.gpus()  # the nvml backend needs the UUIDs for nvidia-smi -i
        except BackendError as e:
            r.warn("the GPU backend does not answer after the reset: %s" % e)
    for i in r.pm_off_done:
        a = {"t": r.timer.rel(), "time": _now_iso(), "action": "persistence_restore", "gpu": i}
        if r.closed:
            a["error"] = "backend unavailable"
            res = {"outcome": "failed"}
        else:
            res = backend_persistence(r.backend, i, True)
            a.update({"rc": res.get("rc"), "argv": res.get("argv")})
            if res["outcome"] != "ok":
                a["error"] = (res.get("stderr") or res.get("stdout") or "")[-500:]
        r.result["actions"].append(a)
        r.result["persistence"].append({"gpu": i, "before": True, "restored": res["outcome"] == "ok"})
        if res["outcome"] != "ok":
            r.warn("persistence mode of GPU %s could not be restored: %s" % (i, a.get("error")))


def reset_health_after(r):
    """Health of the reset GPUs, polled until it passes or ``health_timeout`` (the device may take a moment
    to answer); each involved GPU's persistence mode after."""
    reset_ok = [i for i, o in r.outcome.items() if o[0] == "ok"]
    if r.closed:
        for i in reset_ok:
            r.after_checks[i] = [{"check": "answers", "ok": False, "detail": "the GPU backend does not answer"}]
        return
    deadline = r.clock() + float(r.p["health_timeout"])
    while True:
        try:
            gpus_now = dict((g["index"], g) for g in r.backend.gpus())
            plat_now = platform_info(r.backend, list(gpus_now.values()), None, probe=r.probe,
                                     timeout=float(r.p["command_timeout"]))
            mem_now = r.backend.memory(sorted(gpus_now))
            err = None
        except BackendError as e:
            gpus_now, plat_now, mem_now, err = {}, {"gpus": {}}, {}, str(e)
        for i in reset_ok:
            g2 = gpus_now.get(i)
            r.after_checks[i] = health_checks(g2, plat_now["gpus"].get(i) or {}, mem_now.get(i), keep_mib_after(
                r.disc, i, r.stopped), r.baseline[i], r.tol, expect_uuid=r.by_index[i].get("uuid"))
            if err:
                r.after_checks[i][0]["detail"] += " (%s)" % err
        if all(not failing(r.after_checks[i]) for i in reset_ok) or r.clock() >= deadline:
            break
        r.sleep(float(r.p["poll_interval"]))
    for i in r.involved:
        if gpus_now.get(i) is not None:
            r.pm_after[i] = gpus_now[i].get("persistence_mode")


def reset_start_daemons(r):
    """``systemctl start`` the daemons that were stopped, last stopped first, even when the reset failed."""
    for u in reversed(r.stopped):
        a = {"t": r.timer.rel(), "time": _now_iso(), "action": "systemctl_start", "unit": u}
        rc, out, err = r.systemd.start(u, timeout=r.p["unit_timeout"])
        a.update({"rc": rc, "duration_s": round(r.timer.rel() - a["t"], 4)})
        r.result["actions"].append(a)
        for d in r.result["daemons"]:
            if d["unit"] == u:
                d["restored"] = rc == 0
                if rc != 0:
                    d["error"] = (err or out or "").strip()[:500]
                    r.warn("could not restart %s after the reset (rc=%s): %s" % (u, rc, d["error"]))


def reset_verdict(r):
    """Verdict per involved GPU after the reset (module docstring, step 5), the host's verdict and the diff."""
    out = []
    for i in r.involved:
        grp = r.group_of.get(i)
        if grp is None:
            e = reset_gpu_entry(r, i, "healthy", "none")
        elif grp["blocked_by"]:
            e = reset_gpu_entry(r, i, "unsupported" if grp["unsupported"] else "blocked", "blocked")
        else:
            o = r.outcome.get(i, ("failed", "not attempted", None))
            e = reset_gpu_entry(r, i, None, "reset")
            e["output"], e["reset_s"] = o[1], o[2]
            if o[0] == "ok":
                e["checks_after"] = r.after_checks.get(i)
                bad = failing(e["checks_after"] or [])
                e["verdict"] = "unhealthy" if bad else "healthy"
                if bad:
                    e["blocked_by"] = [{"reason": "after reset: %s" % c["detail"]} for c in bad]
            else:
                e["verdict"] = o[0]
                e["blocked_by"] = [{"reason": (o[1] or o[0])[-300:]}]
        e["persistence_mode_after"] = r.pm_after.get(i)
        out.append(e)
    result = r.result
    result["gpus"] = out
    result["ok"] = all(x["verdict"] in OK_VERDICTS for x in out)
    result["verdict"] = _worst([x["verdict"] for x in out])
    result["needs_power_cycle"] = any(x["verdict"] in ("unhealthy", "failed") or
                                      (x["verdict"] == "unsupported" and x["needed"]) for x in out)
    result["elapsed_s"] = r.timer.rel()
    diff_before = {}
    diff_after = {}
    for i in r.involved:
        diff_before["gpu%d" % i] = {"persistence_mode": r.by_index[i].get("persistence_mode"),
                                    "failing_checks": r.reasons.get(i, [])}
    for x in out:
        diff_after["gpu%d" % x["index"]] = {"persistence_mode": x["persistence_mode_after"], "verdict": x["verdict"]}
    result["diff"] = {"before": diff_before, "after": diff_after}
    return result


def keep_mib_after(disc, i, stopped_units):
    """Memory allowed on GPU ``i`` after the reset: held by processes that stay (not the stopped daemons)."""
    return sum((h["gpu_memory_mib"].get(i) or 0) for h in disc["holders"].values()
               if i in h["gpus"] and h["class"] in ("protected", "self") and h.get("unit") not in stopped_units)


class _Abort(Exception):
    pass


def make_systemd(run, booted=None):
    """A :class:`.systemd.Systemd` (it can also start units, for restoring daemons)."""
    from ansible_collections.gpuflow.eagle3.plugins.module_utils.systemd import Systemd

    return Systemd(run, booted=booted)

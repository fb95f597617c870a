# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""One host's whole GPU reset in one call (PRIVATE to gpuflow.eagle3).

:func:`reset_host` is what ``gpu_reset`` does when it is given ``drain`` or ``mark_state``: the
sequence the ``gpu_reset`` role runs on every host of a fleet, without a module call per step
(a fleet run pays one module call per host, not a dozen tasks):

1. read the host's state file: was the host drained before this run (its services then stay
   stopped), is it marked ``needs_power_cycle`` by an earlier run;
2. assess (:func:`.gpu_reset.run_reset` in check mode): which GPUs need a reset, in which groups;
   a host with nothing to reset and no mark stops here, unchanged;
3. drain the reset groups (:func:`.drain.run_drain`) when there is something to drain: the
   services named (only those systemd reports active) or compute holders on the groups.  The
   drain is recorded in the state file (:func:`.host_state.write_drain_record`, as ``gpu_drain`` does);
4. reset (:func:`.gpu_reset.run_reset`), only when the drain freed the GPUs;
5. restore: start the drained services again when every GPU came back healthy and the host was
   not drained before the run, then clear the drain record;
6. mark: set ``needs_power_cycle`` when a GPU needs one, clear it once the GPUs are healthy.

The result is the reset's (or the assessment's) result, plus ``drain`` (the drain's result or
None), ``host_state`` (the state file as left) and ``report`` (the row the fleet summary shows).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping

from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_backend import bad_number
from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_reset import (
    DEFAULT_DAEMONS,
    ResetError,
    run_reset,
)
from ansible_collections.gpuflow.eagle3.plugins.module_utils.host_state import (
    now_iso,
    read_state_file,
    write_drain_record,
    write_state_file,
)
from ansible_collections.gpuflow.eagle3.plugins.module_utils.systemd import malformed_unit_name, unit_name

DRAIN_DEFAULTS = {"services": [], "grace_period": 15.0, "kill_timeout": 10.0, "restore_services": True}
OK_OUTCOMES = ("healthy", "reset", "planned")
REBOOT_HINT = " (reboot the host: a holder is in D state and survived SIGKILL)"


def validate_drain(drain, daemons):
    """Bad drain options raise :class:`.gpu_reset.ResetError` before anything is looked at or changed."""
    for name in drain["services"]:
        if malformed_unit_name(name):
            raise ResetError("malformed unit name %r in drain.services" % (name,))
    units = set(unit_name(n) for n in drain["services"])
    both = sorted(units & set(daemons))
    if both:
        # daemons are restored on every host, drained services only on healthy ones: one unit cannot be both
        raise ResetError("drain.services and daemons both name %s" % ", ".join(both))
    for k in ("grace_period", "kill_timeout"):
        why = bad_number("drain." + k, drain[k])
        if why:
            raise ResetError(why)


def active_services(systemd, services, warn):
    """The named services that systemd reports running (only those are stopped, and later restarted)."""
    if not services:
        return []
    if systemd is None or not systemd.booted():
        warn("systemd is not booted on this host: services %s are not touched" % ", ".join(services))
        return []
    active = []
    for name in services:
        unit = unit_name(name)
        rc, props = systemd.load_state(unit)
        if rc == 0 and props.get("ActiveState") in ("active", "activating", "reloading"):
            active.append(unit)
    return active


def compute_holders_on_groups(assessment):
    """Whether a compute process blocks a reset group (management clients and daemons are the reset's business)."""
    return any(b.get("class") == "compute" for g in assessment["plan"]["groups"] for b in g.get("blocked_by", []))


def blocked_by_text(blocked_by):
    return "; ".join("%s%s" % ("PID %s %s: " % (b["pid"], b.get("name") or "") if b.get("pid") else "", b.get("reason"))
                     for b in blocked_by)


def explain(drain_result, drain_ok, gpus):
    """One line: why the drain did not free the GPUs, and each GPU that did not end healthy."""
    parts = []
    if not drain_ok:
        parts.append("drain: " + " | ".join(
            "GPU %s %s%s: %s" % (g["index"], g["verdict"], REBOOT_HINT if g["verdict"] == "needs_reboot" else "",
                                 blocked_by_text(g["blocked_by"]))
            for g in drain_result["gpus"] if g["verdict"] not in ("ready", "planned")))
    parts.append(" | ".join("GPU %s %s: %s" % (g["index"], g["verdict"], blocked_by_text(g["blocked_by"]))
                            for g in gpus if g["verdict"] not in ("healthy", "planned")))
    return re.sub(r"\s+", " ", " ".join(parts)).strip()


def reset_host(open_backend, params, drain=None, state_file=None, mark_state=False, check_mode=False,
               systemd=None, clock=time.monotonic, warn=None):
    """Assess, drain, reset, restore and mark one host.  See the module docstring.

    ``params`` are :func:`.gpu_reset.run_reset`'s; ``drain`` is None (no drain) or a dict of
    :data:`DRAIN_DEFAULTS`' keys.  Raises what run_reset and run_drain raise, before any change.
    """
    t0 = clock()
    seen = set()

    def warn_once(msg):
        if warn and msg not in seen:
            seen.add(msg)
            warn(msg)

    drain = None if drain is None else dict(DRAIN_DEFAULTS, **dict((k, v) for k, v in drain.items() if v is not None))
    if drain is not None:
        validate_drain(drain, params.get("daemons") or DEFAULT_DAEMONS)
    try:
        state = read_state_file(state_file) if state_file else {}
    except ValueError as e:
        warn_once("ignoring unreadable state file %s: %s" % (state_file, e))
        state = {}
    was_drained = bool((state.get("drain") or {}).get("drained"))
    had_mark = bool((state.get("reset") or {}).get("needs_power_cycle"))
    changed = False

    # 2. assess: only a drain needs to know the reset groups before the reset runs
    assessment = None
    act = True
    if drain is not None:
        assessment = run_reset(open_backend, params, check_mode=True, systemd=systemd, warn=warn_once)
        act = bool(assessment["selected"]) or had_mark

    # 3. drain
    drain_result = None
    stopped = []
    reset_set = [str(i) for i in assessment["plan"]["reset_set"]] if assessment else []
    if act and drain is not None and reset_set and (drain["services"] or compute_holders_on_groups(assessment)):
        stopped = active_services(systemd, drain["services"], warn_once)
        # only a drain pays for compiling the drain logic (AnsiballZ caches no byte code)
        from ansible_collections.gpuflow.eagle3.plugins.module_utils.drain import DrainError, run_drain

        backend = open_backend()
        try:
            drain_result = run_drain(backend, {"gpus": reset_set, "units": stopped, "all_holders": True,
                                               "protected": params.get("protected"),
                                               "protected_defaults": params.get("protected_defaults", True),
                                               "grace_period": drain["grace_period"],
                                               "kill_timeout": drain["kill_timeout"]},
                                     check_mode=check_mode, systemd=systemd, warn=warn_once)
        except DrainError as e:  # raised before anything is signalled
            raise ResetError("drain: %s" % e)
        finally:
            backend.close()
        changed = changed or drain_result["changed"]
        if drain_result["changed"] and state_file and not check_mode:
            state = write_drain_record(state_file, state, drain_result, stopped)
    drain_ok = drain_result is None or check_mode or drain_result["ready"]

    # 4. reset; in check mode the assessment is the plan (a second look would still see the holders the drain
    # would have stopped)
    result = None
    if act and drain_ok and check_mode and assessment is not None:
        result = assessment
    elif act and drain_ok:
        result = run_reset(open_backend, params, check_mode=check_mode, systemd=systemd, warn=warn_once)
    changed = changed or bool(result and result["changed"])
    reset_ok = bool(result and result["ok"])

    # 5. restore
    restored = []
    if drain is not None and drain["restore_services"] and not check_mode and not was_drained and reset_ok \
            and "drain" in state:
        for unit in (state["drain"].get("services_stopped") or []):
            if systemd is None or not systemd.booted():
                break
            rc, out, err = systemd.start(unit, timeout=params.get("unit_timeout"))
            if rc == 0:
                restored.append(unit)
            else:
                warn_once("could not start %s again after the reset (rc=%s): %s" % (unit, rc, (err or out or "").strip()[:300]))
        left = [u for u in (state["drain"].get("services_stopped") or []) if u not in restored]
        state = dict(state)
        if left:
            state["drain"] = dict(state["drain"], services_stopped=left)
        else:
            state.pop("drain")
        if state_file:
            write_state_file(state_file, state)
        changed = True

    # 6. mark
    mark = had_mark
    if act:
        mark = bool(result and result.get("needs_power_cycle")) or (had_mark and not reset_ok)
    if mark_state and state_file and not check_mode and mark != had_mark:
        state = dict(state)
        if mark:
            state["reset"] = {"needs_power_cycle": True, "since": now_iso(),
                              "verdict": result.get("verdict", "failed") if result else "drain_blocked"}
        else:
            state.pop("reset", None)
        write_state_file(state_file, state)
        changed = True

    base = result or assessment  # without a drain, act is true and the reset ran
    out = dict(base)
    out["changed"] = changed
    out["drain"] = drain_result
    out["host_state"] = state
    out["report"] = host_report(act, drain_result, drain_ok, result, base, check_mode, was_drained, state,
                                restored, mark, round(clock() - t0, 3))
    return out


def host_outcome(act, drain_ok, result, check_mode):
    if not act:
        return "healthy"
    if not drain_ok:
        return "drain_blocked"
    if check_mode:
        return "planned"
    if result["verdict"] == "healthy":
        return "reset" if result["changed"] else "healthy"
    return result["verdict"]


def host_report(act, drain_result, drain_ok, result, base, check_mode, was_drained, state, restored, mark, host_s):
    """The host's row of the fleet summary (the ``gpu_reset`` role's ``gpu_reset_report``, less ``host``)."""
    outcome = host_outcome(act, drain_ok, result, check_mode)
    drained_now = bool(drain_result and drain_result["changed"])
    rows = []
    for g in base["gpus"]:
        if not drain_ok:
            action, verdict = "drain", "drain_blocked"
        else:
            action = "drain+reset" if g["action"] == "reset" and drained_now else g["action"]
            verdict = g["verdict"]
        rows.append({"gpu": g["index"], "uuid": g["uuid"], "action": action, "verdict": verdict,
                     "reasons": g.get("reasons", []), "reset_s": g.get("reset_s")})
    return {
        "outcome": outcome,
        "ok": outcome in OK_OUTCOMES,
        "was_drained": was_drained,
        "services_stopped": list((state.get("drain") or {}).get("services_stopped") or []),
        "services_restored": restored,
        "daemons": (result or {}).get("daemons", []),
        "needs_power_cycle": mark,
        "drain_s": drain_result["elapsed_s"] if drain_result else None,
        "reset_s": result["elapsed_s"] if result else None,
        "host_s": host_s,
        "explanation": explain(drain_result, drain_ok, base["gpus"]),
        "gpus": rows,
    }


def _vars_of(host_vars, host):
    """One host's variables, {} for a host Ansible does not know."""
    try:
        hv = host_vars[host]
    except KeyError:
        return {}
    return hv if isinstance(hv, Mapping) else {}  # an unknown host's hostvars entry is Undefined


def fleet_host_report(host, hv, breaker, stage):
    """The row of one targeted host in the fleet summary, from whatever the playbook's plays left in its variables.

    ``hv`` may hold ``gpu_reset_report`` (the role ran), ``gpu_reset_result`` (the batch's module call) and
    ``gpu_reset_assessment`` (the pre-flight: the role's assess entry point); ``breaker`` is the circuit breaker's sort
    (``down``, ``go``); ``stage`` is ``breaker``, ``batch`` or ``final``.
    """
    pf = hv.get("gpu_reset_assessment")
    result = hv.get("gpu_reset_result")
    if "gpu_reset_report" in hv:
        return dict(hv["gpu_reset_report"])
    if isinstance(result, Mapping) and "report" in result:
        return dict({"host": host}, **result["report"])
    rep = {"host": host, "ok": False, "gpus": []}
    if pf is None or pf.get("unreachable"):
        rep.update(outcome="unreachable", explanation="not reachable at pre-flight" + (
            ": " + pf.get("msg", "") if pf is not None else ""))
    elif "plan" not in pf:
        rep.update(outcome="preflight_failed", explanation=pf.get("msg", ""))
    elif host in breaker.get("down", []):
        rep.update(outcome="needs_power_cycle", needs_power_cycle=True,
                   explanation="marked needs_power_cycle by an earlier run and its GPUs still need a reset; not retried")
    elif stage == "breaker":
        rep.update(outcome="not_run", explanation="circuit breaker tripped before any change")
    elif host in breaker.get("go", []) and result is not None:
        # registered, but without a report: the module call itself failed
        rep.update(outcome="failed", explanation="failed before reporting (unreachable during the run?): " + result.get("msg", ""))
    elif host in breaker.get("go", []):
        rep.update(outcome="not_run", explanation="not run: the run stopped before its batch (max_fail_percentage crossed, "
                                                  "or every host of a batch failed)")
    else:
        rep.update(outcome="healthy", ok=True, explanation="no GPU needed a reset (pre-flight)")
    return rep


def fleet_summary(hosts, host_vars, breaker, stage):
    """The fleet summary the ``gpu_reset`` role's ``summary`` entry point writes: one report per targeted host
    (:func:`fleet_host_report`), one row per GPU (per host when no GPU is known), and a count per outcome."""
    reports, rows, counts = [], [], {}
    for h in hosts:
        hv = _vars_of(host_vars, h)
        rep = fleet_host_report(h, hv, breaker, stage)
        pf = hv.get("gpu_reset_assessment")
        gpus = rep.get("gpus") or []
        # hosts never reset show the GPUs the pre-flight saw
        seen = list(pf.get("gpus") or []) if pf is not None and rep["outcome"] in ("healthy", "not_run") else []
        reports.append(rep)
        counts[rep["outcome"]] = counts.get(rep["outcome"], 0) + 1
        times = {"drain_s": rep.get("drain_s"), "host_s": rep.get("host_s")}
        if not (gpus or seen):
            rows.append(dict(times, host=h, gpu="-", action="none", verdict=rep["outcome"], reset_s=rep.get("reset_s")))
        for g in gpus or seen:
            rows.append(dict(times, host=h, gpu=g["gpu"] if "gpu" in g else g.get("index"),
                             action=g.get("action", "none") if rep["outcome"] != "not_run" else "none",
                             verdict=g.get("verdict") if gpus else rep["outcome"], reset_s=g.get("reset_s")))
    return {"stage": stage, "breaker": breaker, "hosts": reports, "rows": rows, "outcomes": counts}


def fleet_table(summary):
    """The summary as text lines: one per row, then why each host that is not ok is not."""
    fmt = "%-28s %-4s %-12s %-18s %8s %8s %8s"

    def secs(v):
        return "-" if v is None else "%.2f" % float(v)

    lines = [fmt % ("HOST", "GPU", "ACTION", "VERDICT", "DRAIN_S", "RESET_S", "HOST_S")]
    for r in summary["rows"]:
        lines.append(fmt % (r["host"], r["gpu"], r["action"], r["verdict"], secs(r["drain_s"]), secs(r["reset_s"]),
                            secs(r["host_s"])))
    for h in summary["hosts"]:
        if h.get("explanation") and not h.get("ok"):
            lines.append("  %s: %s" % (h["host"], h["explanation"]))
    return lines

#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r'''
---
module: gpu_drain
short_description: Free chosen GPUs exactly, safely and fast, and prove they are free
version_added: 0.1.0
description:
  - Finds who holds the target GPUs by joining the driver's process lists with a scan of C(/proc/*/fd) links to the
    GPU device nodes (orphans, re-parented children and processes that escaped into their own session are found this
    way), classifies them (see M(gpuflow.eagle3.gpu_info)) and ends only the selected, unprotected ones.
  - Selection is by owner, restricted to holders of the target GPUs. O(units) are stopped through systemd first,
    then their cgroup's leftovers are signalled. O(pids) are signalled together with their descendants that hold a
    target GPU. O(cmdline_pattern) selects holders of a target GPU that match, and the matching owners above a
    holder (its parent, grandparent and so on while each matches), with all their holding descendants, so that
    vLLM's API server goes with its engine and workers. When none of these is given, or with O(all_holders=true), every
    unprotected compute holder of the target GPUs is drained.
  - Escalation is C(SIGTERM) to the holder's process group where that group holds only drain targets and their
    descendants (never a protected process, never this module's own group; else to each PID), a poll until the
    holders and every other member of a group so signalled exit or O(grace_period) passes, C(SIGKILL) to the
    survivors, and a poll up to O(kill_timeout); a group member that survives it is warned about. Every
    wait is a poll of the driver and C(/proc) every O(poll_interval) seconds, never a fixed sleep.
  - Before any signal, each PID is validated. It must be an integer above 1, outside this module's process
    tree, not protected, with its create time unchanged since discovery, and seen holding a target GPU (or in a
    targeted unit's cgroup). Signals to single PIDs go through a pidfd, so a reused PID cannot be hit.
  - A GPU is V(ready) when no unprotected compute holder is left on it and its memory is back at its baseline
    (driver-reserved memory excluded; memory of protected holders allowed) within O(memory_tolerance_mib).
    Otherwise the verdict is V(blocked) with who blocks it, or V(needs_reboot) when a holder in
    uninterruptible sleep (D state) survives C(SIGKILL).
  - Management clients (monitors, exporters, any bare NVML client) hold device files but no GPU context; they are
    reported and left alone unless O(management_clients=drain).
  - A clean host returns after one look, unchanged.
author:
  - gpuflow maintainers (@gpuflow)
options:
  gpus:
    description:
      - Target GPUs, as indices, UUIDs, or V(all).
      - An unknown GPU fails the task before anything is signalled.
    type: list
    elements: str
    default: [all]
  units:
    description:
      - systemd units whose processes are drained. Each is stopped with C(systemctl stop) first, then any process
        left in its cgroup is signalled like other targets.
      - An unknown unit, or units on a host without systemd, fail the task before anything is signalled.
    type: list
    elements: str
    default: []
  pids:
    description:
      - PIDs to drain. A named PID is signalled when it, or one of its descendants, holds a target GPU; its
        descendants that hold a target GPU are drained too, even in another session. A PID that is not running
        is reported as skipped.
    type: list
    elements: int
    default: []
  cmdline_pattern:
    description:
      - Regular expression searched in the command line of holders of the target GPUs and of their ancestors.
        Matching holders are drained. A matching process that holds no target GPU is drained when it owns a
        holder through a chain of matching processes (vLLM's API server above its engine and workers), together
        with its holding descendants, so that a server stops as a whole and its process group can take one signal.
        The climb stops at the first ancestor that does not match (a shell, a terminal multiplexer). A process that
        matches but owns no holder of a target GPU is never drained.
    type: str
  all_holders:
    description:
      - Drain every unprotected compute holder of the target GPUs, in addition to any O(units), O(pids) and
        O(cmdline_pattern). Implied when none of those is given.
    type: bool
    default: false
  protected:
    description:
      - Extra regular expressions (searched in name, executable, command line and systemd unit) naming processes
        that are never signalled.
    type: list
    elements: str
    default: []
  protected_defaults:
    description:
      - Also protect the built-in GPU daemons (nvidia-persistenced, nv-fabricmanager, nvlsm, nv-hostengine, DCGM and
        dcgm-exporter, nvsm, nvidia-smi, nvidia-gridd, nvidia-topologyd, mig-manager, device plugins, nv_peer_mem).
    type: bool
    default: true
  management_clients:
    description:
      - What to do with selected holders that hold device files but no GPU context.
      - V(ignore) leaves them running; they do not block readiness.
      - V(drain) treats them like compute holders.
    type: str
    choices: [ignore, drain]
    default: ignore
  signal_process_group:
    description:
      - Signal a holder's whole process group when the group holds only drain targets and their descendants.
        Orphaned workers of a dead parent are freed this way.
    type: bool
    default: true
  grace_period:
    description:
      - Seconds to wait after C(SIGTERM) for the holders to exit before C(SIGKILL) (an upper bound; the wait ends as
        soon as they have exited).
    type: float
    default: 15.0
  kill_timeout:
    description:
      - Seconds to wait after C(SIGKILL) for the survivors to exit.
    type: float
    default: 10.0
  release_timeout:
    description:
      - Seconds to wait after the holders are gone for the memory to return to its baseline.
    type: float
    default: 10.0
  poll_interval:
    description:
      - Seconds between two polls of the driver and C(/proc) while waiting.
    type: float
    default: 0.02
  memory_tolerance_mib:
    description:
      - How far above the baseline the used memory may be on a ready GPU.
    type: int
    default: 256
  memory_baseline_mib:
    description:
      - Used memory of an idle GPU, in MiB. By default the backend's figure (0 with NVML's v2 API; the simulated
        GPU's configured baseline). Set it when the driver only offers the v1 API.
    type: int
  unit_stop_timeout:
    description:
      - Seconds C(systemctl stop) may take for each unit.
    type: float
    default: 120.0
  fail_when_not_ready:
    description:
      - Fail the task when a target GPU is not V(ready) at the end. The result still carries every GPU's verdict.
    type: bool
    default: true
  state_file:
    description:
      - The host's GPU state file that the collection's roles share with M(gpuflow.eagle3.gpu_reset). When given, a
        drain that changed something adds itself to the file's C(drain) record (C(drained), C(since), the O(units)
        in C(services_stopped), the target GPUs in C(gpus); units and GPUs accumulate over drains), so that a
        restore starts exactly those units again and a fleet reset leaves the host drained. Never in check mode.
      - The file is read before anything is stopped or signalled; one that is not a JSON object fails the task then.
      - Unset, no state file is read or written.
    type: path
extends_documentation_fragment:
  - gpuflow.eagle3.gpu_backend
  - gpuflow.eagle3.attributes
attributes:
  check_mode:
    details: Returns the exact plan (units to stop, processes to signal and why, processes left alone and why).
  diff_mode:
    support: full
    details: The holders of each target GPU before and after.
notes:
  - Run as root; processes of other users cannot be seen or signalled otherwise.
  - The module's own NVML worker is a bare NVML client inside the module's process tree and is never a target.
seealso:
  - module: gpuflow.eagle3.gpu_info
'''

EXAMPLES = r'''
- name: Hand all GPUs over after the vLLM server, stopping its unit first
  gpuflow.eagle3.gpu_drain:
    units: [vllm-kimi-k25-int4]
    all_holders: true
  register: drain

- name: Free GPU 1 only, leaving GPU 0's job running
  gpuflow.eagle3.gpu_drain:
    gpus: ["1"]

- name: Show what would be signalled, without signalling anything
  gpuflow.eagle3.gpu_drain:
    gpus: [all]
    cmdline_pattern: 'vllm|VLLM::'
  check_mode: true
  register: plan

- name: Drain a job by PID with a short grace period, protecting a site agent
  gpuflow.eagle3.gpu_drain:
    pids: [41327]
    grace_period: 5
    protected: ['^site-agent$']

- name: Report blocked GPUs without failing the play
  gpuflow.eagle3.gpu_drain:
    fail_when_not_ready: false
  register: drain
- name: Show the verdicts
  ansible.builtin.debug:
    msg: "{{ drain.gpus | map(attribute='verdict') | list }}"
'''

RETURN = r'''
ready:
  description: Whether every target GPU is ready (in check mode, whether they already are).
  returned: always
  type: bool
  sample: true
targets:
  description: Indices of the target GPUs.
  returned: always
  type: list
  elements: int
  sample: [0, 1]
gpus:
  description: One entry per target GPU.
  returned: always
  type: list
  elements: dict
  contains:
    index:
      description: GPU index.
      type: int
      sample: 0
    uuid:
      description: GPU UUID.
      type: str
      sample: GPU-5f0f2a1e-3c1b-7d9e-8a55-1f2e3d4c5b6a
    verdict:
      description:
        - V(ready), V(blocked), V(needs_reboot); in check mode also V(planned) (signals are planned and would free it).
      type: str
      sample: ready
    blocked_by:
      description: Holders (or conditions) that keep the GPU from being ready, each with a C(reason).
      type: list
      elements: dict
      sample: []
    protected_compute:
      description:
        - Protected processes that keep a compute context on the GPU after the drain (C(pid), C(name), C(protected_by),
          C(used_mib)). They are allowed by design, but a GPU called ready with one also gets a warning with its MiB.
        - Returned after a drain, not in check mode.
      type: list
      elements: dict
      returned: when not in check mode
      sample: []
    memory_before:
      description: Memory (MiB) at discovery.
      type: dict
      sample: {total_mib: 143771, used_mib: 121000, reserved_mib: 615, free_mib: 22156, api: v2}
    memory_after:
      description: Memory (MiB) at the final check (null in check mode).
      type: dict
      sample: {total_mib: 143771, used_mib: 0, reserved_mib: 615, free_mib: 143155, api: v2}
    baseline_mib:
      description: Used memory of this GPU when idle, as compared against.
      type: int
      sample: 0
    holders:
      description: Holders found at discovery, classified (same keys as M(gpuflow.eagle3.gpu_info) holders).
      type: list
      elements: dict
      sample: []
    time_to_exit_s:
      description: Seconds from the first signal (or unit stop) until the last drained holder of this GPU exited.
      type: float
      sample: 0.14
    time_to_release_s:
      description: Seconds from the first signal (or unit stop) until the GPU was seen ready.
      type: float
      sample: 0.21
plan:
  description: What was (or in check mode would be) done.
  returned: always
  type: dict
  contains:
    units:
      description: Units stopped through systemd.
      type: list
      elements: str
      sample: [vllm-kimi.service]
    signal:
      description: Processes to signal, each with pid, name, cmdline, class, pgid, unit, gpus, create_time and reason.
      type: list
      elements: dict
      sample: [{pid: 4242, name: python3, class: compute, pgid: 4242, gpus: [0], reason: holder of a target GPU}]
    skipped:
      description: Holders of the target GPUs left alone, with the reason (protected, management client, own tree).
      type: list
      elements: dict
      sample: [{pid: 911, name: nv-hostengine, reason: protected (nv-hostengine)}]
    not_selected:
      description: Unprotected compute holders of the target GPUs that the selectors did not select (they block).
      type: list
      elements: dict
      sample: []
actions:
  description: Every unit stop and signal sent, with C(t) (seconds since the module started), C(time) (UTC),
    and C(error) when it was refused or failed.
  returned: always
  type: list
  elements: dict
  sample: [{t: 0.412, time: "2026-11-30T17:01:02.345+00:00", action: killpg, signal: SIGTERM, pgid: 4242, pids: [4242]}]
backend:
  description: Backend name and driver version.
  returned: always
  type: dict
  sample: {backend: nvml, driver_version: 580.159.04, nvml_version: 13.580.159.04}
elapsed_s:
  description: Seconds from the module's start to the end of the final check.
  returned: always
  type: float
  sample: 0.61
host_state:
  description: The state file's content as this module left it.
  returned: when O(state_file) is given
  type: dict
  sample: {drain: {drained: true, since: "2025-01-01T00:00:00+00:00", services_stopped: [vllm-kimi.service], gpus: [0, 1]}}
'''

import time

_T0 = time.monotonic()

import traceback  # noqa: E402  (after the start time is taken)

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_backend import (  # noqa: E402
    BackendError,
    backend_argument_spec,
    open_backend_for_module,
)
from ansible_collections.gpuflow.eagle3.plugins.module_utils.drain import DrainError, drain_params, run_drain  # noqa: E402
from ansible_collections.gpuflow.eagle3.plugins.module_utils.systemd import Systemd  # noqa: E402


def _render_diff(d):
    def fmt(lst):
        return ["%s %s (%s)%s" % (h["pid"], h.get("name"), h.get("class"),
                                  " unit=%s" % h["unit"] if h.get("unit") else "") for h in lst]
    return {
        "before": dict(("gpu%s" % i, fmt(v)) for i, v in sorted(d["before"].items())),
        "after": dict(("gpu%s" % i, fmt(v)) for i, v in sorted(d["after"].items())),
    }


def _read_state(module, path):
    """The state file, read before anything is stopped: a drain that could not be recorded is not started."""
    # imported here: only a drain that records itself pays for compiling it (AnsiballZ caches no byte code)
    from ansible_collections.gpuflow.eagle3.plugins.module_utils.host_state import read_state_file

    try:
        return read_state_file(path)
    except ValueError as e:
        module.fail_json(msg="cannot read the state file %s: %s" % (path, e), changed=False)


def main():
    argument_spec = dict(
        gpus=dict(type="list", elements="str", default=["all"]),
        units=dict(type="list", elements="str", default=[]),
        pids=dict(type="list", elements="int", default=[]),
        cmdline_pattern=dict(type="str"),
        all_holders=dict(type="bool", default=False),
        protected=dict(type="list", elements="str", default=[]),
        protected_defaults=dict(type="bool", default=True),
        management_clients=dict(type="str", default="ignore", choices=["ignore", "drain"]),
        signal_process_group=dict(type="bool", default=True),
        grace_period=dict(type="float", default=15.0),
        kill_timeout=dict(type="float", default=10.0),
        release_timeout=dict(type="float", default=10.0),
        poll_interval=dict(type="float", default=0.02),
        memory_tolerance_mib=dict(type="int", default=256),
        memory_baseline_mib=dict(type="int"),
        unit_stop_timeout=dict(type="float", default=120.0),
        fail_when_not_ready=dict(type="bool", default=True),
        state_file=dict(type="path"),
    )
    argument_spec.update(backend_argument_spec())
    module = AnsibleModule(argument_spec=argument_spec, supports_check_mode=True)
    p = module.params

    def run(argv):
        return module.run_command(argv, environ_update={"SYSTEMD_PAGER": "", "LC_ALL": "C"})

    systemd = Systemd(run)
    not_drain = ("backend", "sim_state_dir", "nvml_timeout", "fail_when_not_ready", "state_file")
    params = dict((k, p[k]) for k in argument_spec if k not in not_drain)
    try:
        drain_params(params)  # bad options fail before the backend looks at any GPU
    except DrainError as e:
        module.fail_json(msg=str(e), changed=False)
    state = _read_state(module, p["state_file"]) if p["state_file"] else None
    backend = open_backend_for_module(module)
    try:
        result = run_drain(backend, params, check_mode=module.check_mode, systemd=systemd,
                           t0=_T0, warn=module.warn)
    except DrainError as e:
        module.fail_json(msg=str(e), changed=False)
    except BackendError as e:
        module.fail_json(msg="GPU backend error: %s" % e, exception=traceback.format_exc())
    finally:
        backend.close()

    if p["state_file"]:
        if result["changed"] and not module.check_mode:
            from ansible_collections.gpuflow.eagle3.plugins.module_utils.host_state import write_drain_record

            try:
                state = write_drain_record(p["state_file"], state, result, params["units"])
            except OSError as e:
                result.pop("diff")
                module.fail_json(msg="drained, but the state file %s could not be written: %s" % (p["state_file"], e),
                                 **result)
        result["host_state"] = state
    diff = result.pop("diff")
    result.pop("check_mode", None)
    if module._diff:
        result["diff"] = _render_diff(diff)
    if not result["ready"] and not module.check_mode and p["fail_when_not_ready"]:
        module.fail_json(msg="not every target GPU is ready: " + not_ready_explanation(result["gpus"]), **result)
    module.exit_json(**result)


def not_ready_explanation(gpus):
    """One line per GPU that is not ready: its verdict and what blocks it (PID, name, reason)."""
    reboot = " (reboot the host: a holder is in D state and survived SIGKILL)"
    return " | ".join(
        "GPU %s %s%s: %s" % (g["index"], g["verdict"], reboot if g["verdict"] == "needs_reboot" else "",
                             "; ".join("%s%s" % ("PID %s %s: " % (b["pid"], b.get("name") or "") if b.get("pid") else "",
                                                 b.get("reason")) for b in g["blocked_by"]))
        for g in gpus if g["verdict"] != "ready")


if __name__ == "__main__":
    main()

#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r'''
---
module: gpu_reset
short_description: Reset chosen GPUs only when asked and only when the prerequisites hold
version_added: 0.1.0
description:
  - Resets the chosen GPUs that need it (a failing health check), or every chosen GPU with O(force=true), through
    C(nvidia-smi --gpu-reset -i <uuids>) bounded by O(reset_timeout). A host whose chosen GPUs are healthy is left
    untouched and the task reports no change.
  - "Prerequisites, checked before anything is changed: no holder of a GPU to be reset (compute contexts and
    management clients alike: the driver refuses a reset while any client is attached), except this module's own
    NVML worker (closed before the reset), protected daemons whose systemd unit is listed in O(daemons), the
    persistence daemon (released by turning persistence mode off) and Fabric Manager when it is kept running.
    A GPU with MIG mode enabled is not reset unless O(allow_mig=true). An unmet prerequisite gives the verdict
    V(blocked) with C(blocked_by) naming who or what; nothing is done to that GPU's reset group."
  - "Sequence: stop the active units of O(daemons); turn persistence mode off on the GPUs that have it on;
    close the module's NVML worker; reset each group; then, whatever happened (also when the reset failed or
    timed out): restore persistence mode where it was on, run the health checks, and start every daemon that was
    stopped."
  - "Health checks after the reset (polled up to O(health_timeout)): the device answers with the same UUID,
    memory is back at its baseline, no pending retired pages, no pending remapped rows, no row-remapping failure,
    no pending ECC or MIG mode change, and (simulated backend) the device's health flag. The same checks decide
    whether a GPU needs a reset in the first place."
  - "NVLink rules: pre-Ampere GPUs (and GPUs of unknown architecture) with NVLink are reset together with all
    their NVLink peers in one command; Ampere GPUs on NVSwitch are reset individually only while Fabric Manager
    runs, else every GPU of the fabric together; Ampere without NVSwitch and Hopper or later are reset
    individually. Peers the caller did not choose are added (O(nvlink_peers=expand), and checked like the others)
    or block the group (V(fail))."
  - V(unsupported) (device, board or platform cannot reset, for example a MIG-enabled vGPU guest) is a result,
    not a crash.
  - NVIDIA says GPU reset "is not guaranteed to work in all cases"; a GPU that fails its health checks after a
    reset is reported V(unhealthy) and C(needs_power_cycle) is set.
author:
  - gpuflow maintainers (@gpuflow)
options:
  gpus:
    description:
      - GPUs to consider, as indices, UUIDs, or V(all). An unknown GPU fails the task before anything is changed.
    type: list
    elements: str
    required: true
  force:
    description:
      - Reset every chosen GPU, not only those whose health checks fail.
    type: bool
    default: false
  daemons:
    description:
      - systemd units that hold GPUs and are stopped for the reset and started again afterwards, even when the
        reset fails. Only units active before the reset are stopped; units that do not exist are ignored.
      - Holders of a GPU to be reset that run in one of these units do not block the reset.
    type: list
    elements: str
    default: [nvidia-dcgm.service, dcgm.service, nv-hostengine.service, nvidia-dcgm-exporter.service,
              dcgm-exporter.service, nvidia_gpu_exporter.service, nvsm.service]
  fabric_manager:
    description:
      - V(auto) and V(keep) leave Fabric Manager running (Ampere NVSwitch systems need it running for individual
        GPU reset; Hopper and later do not depend on it).
      - V(stop) stops it before the reset and starts it again afterwards, for platforms whose procedure requires
        it stopped.
    type: str
    choices: [auto, keep, stop]
    default: auto
  nvlink_peers:
    description:
      - What to do when the NVLink rules require resetting GPUs that were not chosen.
      - V(expand) adds them to the reset (they must meet the same prerequisites); V(fail) blocks the group.
    type: str
    choices: [expand, fail]
    default: expand
  allow_mig:
    description:
      - Reset GPUs that have MIG mode enabled. Their GPU and compute instances are destroyed by the reset and must
        be recreated afterwards (for example by nvidia-mig-parted). The MIG mode itself is never changed here.
    type: bool
    default: false
  reset_timeout:
    description:
      - Seconds one C(nvidia-smi --gpu-reset) command may take before it is killed and the group reported
        V(failed).
    type: float
    default: 120.0
  command_timeout:
    description:
      - Seconds for each other command (persistence mode, the NVML platform probe).
    type: float
    default: 30.0
  health_timeout:
    description:
      - Seconds to poll the health checks after a reset before a GPU is declared V(unhealthy).
    type: float
    default: 30.0
  poll_interval:
    description:
      - Seconds between two polls of the health checks.
    type: float
    default: 0.1
  unit_timeout:
    description:
      - Seconds C(systemctl stop) or C(systemctl start) may take for each daemon.
    type: float
    default: 120.0
  memory_tolerance_mib:
    description:
      - How far above its baseline the used memory of a healthy GPU may be.
    type: int
    default: 256
  memory_baseline_mib:
    description:
      - Used memory of an idle GPU, in MiB. By default the backend's figure (0 with NVML's v2 API).
    type: int
  protected:
    description:
      - Extra regular expressions naming protected processes (see M(gpuflow.eagle3.gpu_info)). A protected holder of
        a GPU to be reset blocks it unless its systemd unit is in O(daemons).
    type: list
    elements: str
    default: []
  protected_defaults:
    description:
      - Also protect the built-in GPU daemons (see M(gpuflow.eagle3.gpu_drain)).
    type: bool
    default: true
  state_file:
    description:
      - A JSON file on the host that the collection's roles keep (drained mark, needs_power_cycle mark). When given,
        its content is returned as RV(host_state) (an empty dict when the file does not exist). Lets a fleet
        pre-flight learn everything about a host in one call.
      - The module writes it only with O(drain) (the drain record) or O(mark_state=true) (the needs_power_cycle
        mark), never in check mode.
    type: path
  drain:
    description:
      - Drain the reset groups before the reset, in the same call (what the M(gpuflow.eagle3.gpu_drain) module does,
        with O(gpuflow.eagle3.gpu_drain#module:all_holders=true) on the GPUs to be reset, and the listed services
        stopped first). The drain runs only when there is something to drain (a listed service is active, or a
        compute process holds a GPU of a reset group); the reset runs only when the drain freed the GPUs.
      - The drain is recorded in O(state_file). When every GPU comes back healthy and the host was not drained
        before this run, the stopped services are started again and the record is cleared.
      - A host's whole sequence in one module call (assess, drain, reset, restore, health, mark), so a fleet run
        costs one call per host; the M(gpuflow.eagle3.gpu_reset) role uses it.
    type: dict
    suboptions:
      services:
        description: systemd services of the workload to stop first (only those active are stopped and restarted).
        type: list
        elements: str
        default: []
      grace_period:
        description: Seconds between SIGTERM and SIGKILL.
        type: float
        default: 15
      kill_timeout:
        description: Seconds to wait for the processes to exit after SIGKILL.
        type: float
        default: 10
      restore_services:
        description: Start the stopped services again once every GPU is healthy.
        type: bool
        default: true
  mark_state:
    description:
      - Keep the needs_power_cycle mark in O(state_file) - set it when a GPU needs a power cycle (or the drain failed
        on a host already marked), clear it once the GPUs are healthy. The fleet's circuit breaker reads it.
    type: bool
    default: false
  fail_when_not_healthy:
    description:
      - Fail the task when a GPU ends in any verdict other than V(healthy) (in check mode, V(planned) is fine too).
        The result still carries every GPU's verdict and explanation.
    type: bool
    default: true
extends_documentation_fragment:
  - gpuflow.eagle3.gpu_backend
  - gpuflow.eagle3.attributes
attributes:
  check_mode:
    details: Returns the plan (reset groups and commands, daemons to stop, persistence changes, blockers); nothing is
      stopped, no persistence mode is changed, no reset is run.
  diff_mode:
    support: full
    details: Persistence mode and verdict of each GPU involved, and the daemons stopped and restarted.
notes:
  - Run as root.
  - NVIDIA documents GPU reset as "not recommended for production environments at this time"; verify, and power cycle
    the node when a GPU is reported V(unhealthy).
  - Drain the GPUs first (M(gpuflow.eagle3.gpu_drain)); this module never signals a process.
seealso:
  - module: gpuflow.eagle3.gpu_drain
  - module: gpuflow.eagle3.gpu_info
  - name: nvidia-smi documentation (-r, --gpu-reset)
    description: The rules for GPU reset, NVLink peers and Fabric Manager.
    link: https://docs.nvidia.com/deploy/nvidia-smi/index.html
'''

EXAMPLES = r'''
- name: Reset the GPUs that need it (pending remapped rows, failed health), leaving healthy ones alone
  gpuflow.eagle3.gpu_reset:
    gpus: [all]
  register: reset

- name: Show the plan for a forced reset of GPU 3, changing nothing
  gpuflow.eagle3.gpu_reset:
    gpus: ["3"]
    force: true
  check_mode: true
  register: plan

- name: Reset GPU 0 on a site whose exporter runs as its own unit, reporting instead of failing
  gpuflow.eagle3.gpu_reset:
    gpus: ["GPU-5f0f2a1e-3c1b-7d9e-8a55-1f2e3d4c5b6a"]
    force: true
    daemons: [nvidia-dcgm.service, site-gpu-exporter.service]
    fail_when_not_healthy: false
  register: reset

- name: Print the verdicts
  ansible.builtin.debug:
    msg: "{{ reset.gpus | map(attribute='verdict') | list }}"

- name: A host's whole sequence in one call - drain the vLLM service off the GPUs to reset, reset, restart it
  gpuflow.eagle3.gpu_reset:
    gpus: [all]
    drain:
      services: [vllm-kimi.service]
      grace_period: 30
    state_file: /var/lib/gpuflow/gpu_state.json
    mark_state: true
    fail_when_not_healthy: false
  register: reset

- name: Say what happened to the host
  ansible.builtin.debug:
    msg: "{{ reset.report.outcome }}: {{ reset.report.explanation }}"
'''

RETURN = r'''
ok:
  description: Whether every GPU involved ended V(healthy) (or V(planned) in check mode).
  returned: always
  type: bool
  sample: true
verdict:
  description:
    - The worst GPU verdict, in the order V(failed), V(unhealthy), V(unsupported), V(busy), V(blocked), V(planned),
      V(healthy).
  returned: always
  type: str
  sample: healthy
needs_power_cycle:
  description: A GPU that needed a reset could not be brought back (unhealthy after reset, reset failed, or
    reset unsupported).
  returned: when a reset was attempted
  type: bool
  sample: false
targets:
  description: Indices of the chosen GPUs.
  returned: always
  type: list
  elements: int
  sample: [0, 1]
selected:
  description: Indices of the chosen GPUs that are to be reset (all with O(force), else those that need it).
  returned: always
  type: list
  elements: int
  sample: [1]
gpus:
  description: One entry per chosen GPU and per NVLink peer added to a reset group.
  returned: always
  type: list
  elements: dict
  contains:
    index:
      description: GPU index.
      type: int
      sample: 1
    uuid:
      description: GPU UUID.
      type: str
      sample: GPU-5f0f2a1e-3c1b-7d9e-8a55-1f2e3d4c5b6a
    chosen:
      description: Whether the GPU was chosen by O(gpus) (false for an added NVLink peer).
      type: bool
      sample: true
    needed:
      description: Whether a health check failed before the reset.
      type: bool
      sample: true
    reasons:
      description: The failing health checks before the reset.
      type: list
      elements: str
      sample: ["pending remapped rows: yes"]
    action:
      description: V(reset) (done, or planned in check mode), V(blocked), or V(none).
      type: str
      sample: reset
    verdict:
      description: V(healthy), V(planned), V(blocked), V(busy), V(unsupported), V(unhealthy) or V(failed).
      type: str
      sample: healthy
    blocked_by:
      description: What blocks or failed the GPU's reset group, each with a C(reason) (and C(pid), C(name),
        C(class), C(unit) for holders).
      type: list
      elements: dict
      sample: [{pid: 4242, name: python3, class: compute, reason: "holds a GPU context: drain it first"}]
    reset_group:
      description: GPUs reset in the same command.
      type: list
      elements: int
      sample: [1]
    persistence_mode_before:
      description: Persistence mode before.
      type: bool
      sample: true
    persistence_mode_after:
      description: Persistence mode after (null in check mode or when the device does not answer).
      type: bool
      sample: true
    checks_before:
      description: Health checks before, each C(check), C(ok) (null when the device cannot tell) and C(detail).
      type: list
      elements: dict
      sample: [{check: remapped_rows_pending, ok: false, detail: "pending remapped rows: yes"}]
    checks_after:
      description: Health checks after the reset.
      type: list
      elements: dict
      sample: [{check: remapped_rows_pending, ok: true, detail: "pending remapped rows: no"}]
    reset_s:
      description: Seconds the reset command took.
      type: float
      sample: 2.41
    output:
      description: Output of the reset command (last 1000 characters).
      type: str
      sample: GPU 00000000:1A:00.0 was successfully reset.
plan:
  description: The reset plan (what was, or in check mode would be, done).
  returned: always
  type: dict
  contains:
    groups:
      description: Reset groups, each with C(gpus), C(command) (argv), C(blocked_by) and C(unsupported).
      type: list
      elements: dict
      sample: [{gpus: [1], command: [nvidia-smi, --gpu-reset, -i, GPU-5f0f2a1e], blocked_by: [], unsupported: false}]
    daemons_to_stop:
      description: Active daemon units stopped for the reset and started again afterwards.
      type: list
      elements: str
      sample: [nvidia-dcgm.service]
    persistence_off:
      description: GPUs whose persistence mode is turned off for the reset and restored afterwards.
      type: list
      elements: int
      sample: [1]
    expanded_peers:
      description: NVLink peers added to the reset groups.
      type: list
      elements: int
      sample: []
    notes:
      description: How the NVLink rules applied.
      type: list
      elements: str
      sample: []
    fabric_manager:
      description: V(keep), V(stop) or V(not present).
      type: str
      sample: not present
platform:
  description: Architecture, NVLink peers, ECC / MIG pending modes and virtualization of each GPU; NVSwitch and
    Fabric Manager state of the host.
  returned: always
  type: dict
  sample: {nvswitch: false, fabric_manager: null, gpus: {"0": {architecture: hopper, nvlink_peers: []}}}
daemons:
  description: Each daemon stopped, whether it was restored, and any error.
  returned: always
  type: list
  elements: dict
  sample: [{unit: nvidia-dcgm.service, was_active: true, stopped: true, restored: true, error: null}]
persistence:
  description: Each GPU whose persistence mode was turned off, and whether it was restored.
  returned: always
  type: list
  elements: dict
  sample: [{gpu: 1, before: true, restored: true}]
actions:
  description: Every unit stop and start, persistence change and reset, with C(t) (seconds since the module
    started), C(time) (UTC), C(argv), C(rc) and C(error) where one occurred.
  returned: always
  type: list
  elements: dict
  sample: [{t: 0.31, action: reset, gpus: [1], argv: [nvidia-smi, --gpu-reset, -i, GPU-5f0f2a1e], rc: 0}]
host_state:
  description: Content of O(state_file) as the module left it (empty when the file does not exist).
  returned: always
  type: dict
  sample: {drain: {drained: true, services_stopped: [vllm-kimi.service]}}
drain:
  description: The drain's result (as M(gpuflow.eagle3.gpu_drain) returns it), or null when no drain ran.
  returned: always
  type: dict
  sample: {changed: true, ready: true, targets: [0], gpus: [{index: 0, verdict: ready}]}
report:
  description:
    - The host's row of the fleet summary.
    - C(outcome) is V(healthy) (nothing needed a reset), V(reset), V(planned) (check mode), V(drain_blocked) (the
      drain did not free the GPUs; nothing was reset), or the reset's worst verdict.
    - C(services_stopped) are still stopped, C(services_restored) were started again, C(needs_power_cycle) is the
      host's mark, C(drain_s), C(reset_s) and C(host_s) are seconds, C(explanation) says why a GPU is not healthy.
  returned: always
  type: dict
  sample: {outcome: reset, ok: true, was_drained: false, services_stopped: [], services_restored: [vllm.service],
           daemons: [], needs_power_cycle: false, drain_s: 1.2, reset_s: 0.4, host_s: 1.9, explanation: "",
           gpus: [{gpu: 0, uuid: GPU-5f0f2a1e, action: drain+reset, verdict: healthy, reasons: [], reset_s: 0.3}]}
backend:
  description: Backend name and driver version.
  returned: always
  type: dict
  sample: {backend: nvml, driver_version: 580.159.04}
elapsed_s:
  description: Seconds from the module's start to its end.
  returned: always
  type: float
  sample: 3.2
'''

import time

_T0 = time.monotonic()

import traceback  # noqa: E402  (after the start time is taken)

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_backend import (  # noqa: E402
    BackendError,
    BackendUnavailable,
    backend_argument_spec,
    select_backend,
)
from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_reset import (  # noqa: E402
    DEFAULT_DAEMONS,
    ResetError,
    make_systemd,
)
from ansible_collections.gpuflow.eagle3.plugins.module_utils.host_reset import reset_host  # noqa: E402


def main():
    argument_spec = dict(
        gpus=dict(type="list", elements="str", required=True),
        force=dict(type="bool", default=False),
        daemons=dict(type="list", elements="str", default=list(DEFAULT_DAEMONS)),
        fabric_manager=dict(type="str", default="auto", choices=["auto", "keep", "stop"]),
        nvlink_peers=dict(type="str", default="expand", choices=["expand", "fail"]),
        allow_mig=dict(type="bool", default=False),
        reset_timeout=dict(type="float", default=120.0),
        command_timeout=dict(type="float", default=30.0),
        health_timeout=dict(type="float", default=30.0),
        poll_interval=dict(type="float", default=0.1),
        unit_timeout=dict(type="float", default=120.0),
        memory_tolerance_mib=dict(type="int", default=256),
        memory_baseline_mib=dict(type="int"),
        protected=dict(type="list", elements="str", default=[]),
        protected_defaults=dict(type="bool", default=True),
        fail_when_not_healthy=dict(type="bool", default=True),
        state_file=dict(type="path"),
        drain=dict(type="dict", options=dict(
            services=dict(type="list", elements="str", default=[]),
            grace_period=dict(type="float", default=15.0),
            kill_timeout=dict(type="float", default=10.0),
            restore_services=dict(type="bool", default=True),
        )),
        mark_state=dict(type="bool", default=False),
    )
    argument_spec.update(backend_argument_spec())
    module = AnsibleModule(argument_spec=argument_spec, supports_check_mode=True,
                           required_if=[("mark_state", True, ["state_file"])],
                           required_by={"drain": "state_file"})
    p = module.params

    def run(argv):
        return module.run_command(argv, environ_update={"SYSTEMD_PAGER": "", "LC_ALL": "C"})

    def open_backend():
        return select_backend(p["backend"], p.get("sim_state_dir"), timeout=p["nvml_timeout"])

    host_options = ("backend", "sim_state_dir", "nvml_timeout", "fail_when_not_healthy", "state_file", "drain",
                    "mark_state")
    params = dict((k, p[k]) for k in argument_spec if k not in host_options)
    try:
        result = reset_host(open_backend, params, drain=p["drain"], state_file=p["state_file"],
                            mark_state=p["mark_state"], check_mode=module.check_mode, systemd=make_systemd(run),
                            warn=module.warn)
    except ResetError as e:
        module.fail_json(msg=str(e), changed=False)
    except BackendUnavailable as e:
        if e.missing_lib:
            from ansible.module_utils.basic import missing_required_lib
            module.fail_json(msg="%s. %s" % (missing_required_lib(e.missing_lib), e))
        module.fail_json(msg="no usable GPU backend: %s" % e)
    except BackendError as e:
        module.fail_json(msg="GPU backend error: %s" % e, exception=traceback.format_exc())

    result["elapsed_s"] = round(time.monotonic() - _T0, 4)
    diff = result.pop("diff")
    result.pop("check_mode", None)
    if module._diff:
        result["diff"] = diff
    if result["report"]["outcome"] == "drain_blocked" and p["fail_when_not_healthy"]:
        module.fail_json(msg="nothing was reset, the drain did not free the GPUs: " + result["report"]["explanation"],
                         **result)
    if not result["ok"] and p["fail_when_not_healthy"]:
        bad = ["GPU %s %s: %s" % (g["index"], g["verdict"],
                                  "; ".join("%s%s" % ("PID %s " % b["pid"] if b.get("pid") else "", b.get("reason"))
                                            for b in g["blocked_by"]) or "; ".join(g["reasons"]))
               for g in result["gpus"] if g["verdict"] not in ("healthy", "planned")]
        module.fail_json(msg="GPU reset did not leave every GPU healthy: " + " | ".join(bad), **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()

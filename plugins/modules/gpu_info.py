#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r'''
---
module: gpu_info
short_description: Report every GPU, its memory and exactly who holds it
version_added: 0.1.0
description:
  - Lists every NVIDIA GPU of the host with its UUID, minor number, memory (NVML v2 C(used) and C(reserved),
    not nvidia-smi's C(0 MiB)), persistence and MIG mode, and pending retired pages / remapped rows where the
    device reports them.
  - Lists the holders of each GPU by joining the driver's compute, graphics and MPS process lists with a scan of
    C(/proc/*/fd) links to the device nodes, and classifies each holder as V(compute) (holds a context),
    V(management) (holds device files but no context, such as monitors and exporters), V(protected) (matches a
    protected pattern) or V(self) (this module's own process tree).
  - Each holder carries its PID, name, command line, user, parent, process group, session, create time,
    systemd unit or container (from C(/proc/PID/cgroup)), C(NSpid) mapping, GPU memory and process state.
  - Driver PIDs that cannot be mapped to a local process (another PID namespace, or nonsense such as 0 or
    4294967295 from broken bindings) are reported, never trusted.
author:
  - gpuflow maintainers (@gpuflow)
options:
  protected:
    description:
      - Extra regular expressions; a holder whose name, executable, command line or systemd unit matches one
        (searched, not anchored) is classified V(protected).
    type: list
    elements: str
    default: []
  protected_defaults:
    description:
      - Also treat the built-in GPU daemons as protected (nvidia-persistenced, nv-fabricmanager, nvlsm,
        nv-hostengine, DCGM and dcgm-exporter, nvsm, nvidia-smi, nvidia-gridd, nvidia-topologyd, mig-manager,
        device plugins, nv_peer_mem).
    type: bool
    default: true
extends_documentation_fragment:
  - gpuflow.eagle3.gpu_backend
  - gpuflow.eagle3.attributes
attributes:
  diff_mode:
    support: none
notes:
  - Run as root to see every process's file descriptors; PIDs whose C(/proc/PID/fd) cannot be read are listed in
    RV(unreadable_pids).
seealso:
  - module: gpuflow.eagle3.gpu_drain
'''

EXAMPLES = r'''
- name: Read GPU facts
  gpuflow.eagle3.gpu_info:
  register: gpu

- name: Show who holds GPU 0
  ansible.builtin.debug:
    msg: "{{ gpu.gpus[0].holders | map(attribute='pid') | list }}"

- name: Read the simulated GPUs of a CI host
  gpuflow.eagle3.gpu_info:
    backend: simulated
    sim_state_dir: /var/tmp/gpusim

- name: Treat a site monitoring agent as protected
  gpuflow.eagle3.gpu_info:
    protected:
      - '^site-gpu-monitor$'
'''

RETURN = r'''
gpus:
  description: One entry per GPU, ordered by index.
  returned: success
  type: list
  elements: dict
  contains:
    index:
      description: NVML index.
      type: int
      sample: 0
    uuid:
      description: GPU UUID.
      type: str
      sample: GPU-5f0f2a1e-3c1b-7d9e-8a55-1f2e3d4c5b6a
    name:
      description: Product name.
      type: str
      sample: NVIDIA H200
    minor:
      description: Minor number, the N of C(/dev/nvidiaN).
      type: int
      sample: 0
    pci_bus_id:
      description: PCI bus id.
      type: str
      sample: 00000000:00:05.0
    persistence_mode:
      description: Whether persistence mode is on (null where unknown).
      type: bool
      sample: true
    mig_mode:
      description: Whether MIG mode is currently enabled (null where unsupported).
      type: bool
      sample: false
    retired_pages_pending:
      description: Whether retired pages await a reset (null where unsupported).
      type: bool
      sample: null
    remapped_rows_pending:
      description: Whether remapped rows await a reset (null where unsupported).
      type: bool
      sample: false
    remapped_rows_failure:
      description: Whether a row remapping failed (null where unsupported).
      type: bool
      sample: false
    memory:
      description: Memory in MiB; C(used_mib) excludes driver-reserved memory (NVML v2).
      type: dict
      sample: {total_mib: 143771, used_mib: 0, reserved_mib: 615, free_mib: 143155, api: v2}
    idle_used_mib:
      description: What C(memory.used_mib) reads when nothing holds the GPU (the drain baseline).
      type: int
      sample: 0
    holders:
      description:
        - Processes holding this GPU, classified.
        - C(gpus) is what a process holds. It is the GPUs on which the driver lists it (C(context_gpus)) when it has a
          context anywhere, else the GPUs whose device node it has open (C(device_gpus)). CUDA opens every GPU's node
          at start, so an open node alone does not make a job a holder of that GPU.
      type: list
      elements: dict
      sample:
        - pid: 4242
          name: python3
          cmdline: python3 -m vllm.entrypoints.openai.api_server
          exe: /usr/bin/python3.12
          user: vllm
          ppid: 1
          pgid: 4242
          sid: 4242
          state: S
          dstate: false
          create_time: 1764500000.12
          cgroup: /system.slice/vllm-kimi.service
          unit: vllm-kimi.service
          container: null
          nspid: [4242]
          gpus: [0]
          context_gpus: [0]
          device_gpus: [0, 1]
          hostwide_files: [/dev/nvidia-uvm, /dev/nvidiactl]
          gpu_memory_mib: {"0": 121000}
          nvml_listed: true
          seen_by: [fd, driver]
          class: compute
          protected_by: null
    unresolved_processes:
      description: Driver-listed PIDs that could not be mapped to a local process, with the reason.
      type: list
      elements: dict
      sample: []
hostwide_holders:
  description: Processes that hold only host-wide nodes (C(nvidiactl), C(nvidia-uvm), C(nvidia-caps)), classified.
  returned: success
  type: list
  elements: dict
  sample: []
driver:
  description: Backend name and driver / NVML versions.
  returned: success
  type: dict
  sample: {backend: nvml, driver_version: 580.159.04, nvml_version: 13.580.159.04}
unreadable_pids:
  description: PIDs whose file descriptors could not be read (run as root to avoid).
  returned: success
  type: list
  elements: int
  sample: []
invalid_driver_pids:
  description: PIDs the driver reported that cannot be real (0, 1, 4294967295...), with their GPU.
  returned: success
  type: list
  elements: dict
  sample: []
'''

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_backend import (
    BackendError,
    backend_argument_spec,
    open_backend_for_module,
)
from ansible_collections.gpuflow.eagle3.plugins.module_utils.holders import ProtectedMatcher
from ansible_collections.gpuflow.eagle3.plugins.module_utils.drain_plan import gpu_facts


def main():
    argument_spec = dict(
        protected=dict(type="list", elements="str", default=[]),
        protected_defaults=dict(type="bool", default=True),
    )
    argument_spec.update(backend_argument_spec())
    module = AnsibleModule(argument_spec=argument_spec, supports_check_mode=True)
    try:
        matcher = ProtectedMatcher(module.params["protected"], module.params["protected_defaults"])
    except Exception as e:
        module.fail_json(msg="malformed protected pattern: %s" % e)
    backend = open_backend_for_module(module)
    try:
        facts = gpu_facts(backend, matcher)
    except BackendError as e:
        module.fail_json(msg="GPU backend error: %s" % e)
    finally:
        backend.close()
    for pid in facts["invalid_driver_pids"]:
        module.warn("the driver reported an invalid PID %(pid)s on GPU %(gpu)s; ignored" % pid)
    module.exit_json(changed=False, **facts)


if __name__ == "__main__":
    main()

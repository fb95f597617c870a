# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations


class ModuleDocFragment(object):

    # Options shared by every module that talks to GPUs (gpu_info, gpu_drain, gpu_reset).
    DOCUMENTATION = r'''
options:
  backend:
    description:
      - How GPUs are reached.
      - V(nvml) uses nvidia-ml-py (C(pynvml)) in a worker process; every NVML call is bounded by O(nvml_timeout).
      - V(simulated) uses the state directory named by O(sim_state_dir), created by C(tools/gpu_sim.py init);
        for containers, CI and dry runs of fleet playbooks.
      - V(auto) picks V(simulated) when O(sim_state_dir) or the environment variable E(GPUFLOW_GPU_SIM_STATE_DIR)
        is set (or E(GPUFLOW_GPU_BACKEND) names a backend), else V(nvml).
    type: str
    choices: [auto, nvml, simulated]
    default: auto
  sim_state_dir:
    description:
      - State directory of the simulated backend.
      - Defaults to the environment variable E(GPUFLOW_GPU_SIM_STATE_DIR) when set.
    type: path
  nvml_timeout:
    description:
      - Seconds each NVML call may take before the module gives up on the driver and fails with a clear message
        instead of hanging.
    type: float
    default: 15.0
requirements:
  - nvidia-ml-py (for O(backend=nvml))
  - psutil (for O(backend=simulated))
'''

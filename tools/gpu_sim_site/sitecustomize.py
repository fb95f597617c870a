# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Makes a server hold simulated GPUs the way a CUDA server holds real ones.

Python imports this module at start-up from any directory on PYTHONPATH. In a process whose environment
sets GPUFLOW_SIM_STATE_DIR, it opens that state's device files (every simulated GPU's node, nvidiactl,
nvidia-uvm, as CUDA does at init) and keeps them open until the process exits. Every Python process of a
server started with this directory (and tools/gpu_sim.py beside it) on PYTHONPATH does so, the API server
and the engine it spawns alike. `gpu_sim.py attach` then registers their memory, and a drain finds them
by their device files, as it finds a real server's processes, and may signal them.
"""
import os

if os.environ.get("GPUFLOW_SIM_STATE_DIR"):
    import gpu_sim

    HELD_DEVICE_FDS = gpu_sim.open_devices(os.environ["GPUFLOW_SIM_STATE_DIR"], [], every_gpu=True)

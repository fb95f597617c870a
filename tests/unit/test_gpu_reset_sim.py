"""The simulated backend's reset (gpu_reset.simulate_reset) and tools/gpu_sim.py set-gpu.

Uses a real state directory; the one holder process is started here and killed here.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from ansible_collections.gpuflow.eagle3.plugins.module_utils import gpu_reset as R
from ansible_collections.gpuflow.eagle3.plugins.module_utils.simulated_backend import SimulatedBackend

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_SIM = os.path.join(REPO, "tools", "gpu_sim.py")


def sim(*args):
    return subprocess.run([sys.executable, GPU_SIM] + list(args), check=True, capture_output=True, text=True).stdout


@pytest.fixture
def state(tmp_path):
    d = str(tmp_path / "sim")
    sim("init", "--state-dir", d, "--gpus", "2")
    return d


def test_set_gpu_sets_faults_and_fields(state):
    out = json.loads(sim("set-gpu", "--state-dir", state, "--gpu", "1", "--health", "unhealthy", "--reset", "unsupported",
                         "--set", "remapped_rows_pending=true", "--set", "nvlink_peers=[0]", "--set", "reset.count=5",
                         "--host", "nvswitch=true").strip())
    assert out["health"] == "unhealthy" and out["remapped_rows_pending"] is True and out["nvlink_peers"] == [0]
    assert out["reset"] == {"supported": False, "busy": False, "unhealthy_after_reset": False, "count": 5}
    with open(os.path.join(state, "state.json")) as f:
        assert json.load(f)["nvswitch"] is True


def test_reset_refused_while_persistence_on(state):
    b = SimulatedBackend(state)
    r = b.reset_gpus([0])
    assert r["outcome"] == "busy" and "persistence mode" in r["stdout"]
    b.set_persistence_mode(0, False)
    r = b.reset_gpus([0])
    assert r["outcome"] == "ok" and r["rc"] == 0
    assert b.read_gpu_state(0)["reset"]["count"] == 1


def test_reset_refused_while_a_process_holds_the_device(state):
    b = SimulatedBackend(state)
    b.set_persistence_mode(1, False)
    dev = os.path.join(state, "dev", "nvidia1")
    p = subprocess.Popen([sys.executable, "-c", "import sys,time; f=open(sys.argv[1]); print('ok', flush=True); time.sleep(60)", dev],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ok"
        r = b.reset_gpus([1])
        assert r["outcome"] == "busy" and str(p.pid) in r["stdout"]
    finally:
        p.kill()
        p.wait()
    assert b.reset_gpus([1])["outcome"] == "ok"


def test_group_fails_together_and_outcomes(state):
    b = SimulatedBackend(state)
    for i in (0, 1):
        b.set_persistence_mode(i, False)
    b.update_gpu_state(1, reset={"supported": False, "busy": False, "unhealthy_after_reset": False, "count": 0})
    r = b.reset_gpus([0, 1])
    assert r["outcome"] == "unsupported" and r["rc"] == 3
    assert b.read_gpu_state(0)["reset"]["count"] == 0   # nothing reset in a failed group
    b.update_gpu_state(1, health="unhealthy", reset={"supported": True, "busy": False, "unhealthy_after_reset": True, "count": 0})
    assert b.reset_gpus([1])["outcome"] == "ok"
    assert b.read_gpu_state(1)["health"] == "unhealthy" and b.read_gpu_state(1)["reset"]["count"] == 1


def test_run_reset_end_to_end_on_simulation(state):
    sim("set-gpu", "--state-dir", state, "--gpu", "0", "--health", "unhealthy")
    sim("set-gpu", "--state-dir", state, "--gpu", "1", "--health", "unhealthy", "--reset", "unhealthy-after")

    def ob():
        return SimulatedBackend(state)
    plan = R.run_reset(ob, {"gpus": ["all"]}, check_mode=True)
    assert [g["verdict"] for g in plan["gpus"]] == ["planned", "planned"]
    assert SimulatedBackend(state).read_gpu_state(0)["reset"]["count"] == 0
    t = time.monotonic()
    r = R.run_reset(ob, {"gpus": ["all"], "health_timeout": 0.3, "poll_interval": 0.05})
    assert time.monotonic() - t < 5
    assert [g["verdict"] for g in r["gpus"]] == ["healthy", "unhealthy"]
    assert r["needs_power_cycle"] and not r["ok"]
    b = SimulatedBackend(state)
    assert b.read_gpu_state(0)["persistence_mode"] is True and b.read_gpu_state(1)["persistence_mode"] is True
    again = R.run_reset(ob, {"gpus": ["0"]})
    assert again["changed"] is False and again["gpus"][0]["verdict"] == "healthy"


def test_unsupported_is_a_result(state):
    sim("set-gpu", "--state-dir", state, "--gpu", "0", "--health", "unhealthy", "--reset", "unsupported")
    r = R.run_reset(lambda: SimulatedBackend(state), {"gpus": ["0"]})
    assert r["gpus"][0]["verdict"] == "unsupported" and r["needs_power_cycle"]
    assert SimulatedBackend(state).read_gpu_state(0)["persistence_mode"] is True


def test_memory_held_with_no_process_blocks_the_drain_and_a_reset_frees_it(state):
    from ansible_collections.gpuflow.eagle3.plugins.module_utils import drain as D
    sim("set-gpu", "--state-dir", state, "--gpu", "0", "--set", "stuck_used_mib=2048")
    d = D.run_drain(SimulatedBackend(state), {"gpus": ["0"], "release_timeout": 0.3, "poll_interval": 0.05})
    g = d["gpus"][0]
    assert not d["ready"] and g["verdict"] == "blocked" and g["memory_after"]["used_mib"] == 2048
    assert g["blocked_by"][0]["reason"].endswith("(memory held with no holder: a reset may be needed)")
    r = R.run_reset(lambda: SimulatedBackend(state), {"gpus": ["0"], "health_timeout": 0.3, "poll_interval": 0.05})
    assert r["gpus"][0]["verdict"] == "healthy" and r["changed"]
    assert SimulatedBackend(state).poll([0])[0][0]["used_mib"] == 0

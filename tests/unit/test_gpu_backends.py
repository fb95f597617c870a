"""Backends: selection, the NVML worker (with a fake pynvml), its time bound, the simulated state."""

import json
import os
import subprocess
import sys
import time
import types

import pytest

from ansible_collections.gpuflow.eagle3.plugins.module_utils import gpu_backend as B
from ansible_collections.gpuflow.eagle3.plugins.module_utils import nvml_backend as N
from ansible_collections.gpuflow.eagle3.plugins.module_utils import simulated_backend as SB

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_SIM = os.path.join(REPO, "tools", "gpu_sim.py")
MIB = 1024 * 1024


def fake_pynvml(v2=True, procs=None):
    class NVMLError(Exception):
        pass

    nv = types.SimpleNamespace(NVMLError=NVMLError, nvmlMemory_v2=0x02000028)
    nv.nvmlInit = lambda: None
    nv.nvmlShutdown = lambda: None
    nv.nvmlDeviceGetCount = lambda: 2
    nv.nvmlSystemGetDriverVersion = lambda: "580.159.04"
    nv.nvmlSystemGetNVMLVersion = lambda: "13.580.159.04"
    nv.nvmlDeviceGetHandleByIndex = lambda i: ("h", i)
    nv.nvmlDeviceGetUUID = lambda h: b"GPU-%d" % h[1]
    nv.nvmlDeviceGetName = lambda h: "NVIDIA H200"
    nv.nvmlDeviceGetMinorNumber = lambda h: h[1]
    nv.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId="00000000:0%d:00.0" % h[1])
    nv.nvmlDeviceGetPersistenceMode = lambda h: 1
    nv.nvmlDeviceGetMigMode = lambda h: [0, 0]

    def unsupported(h):
        raise NVMLError("Not Supported")
    nv.nvmlDeviceGetRetiredPagesPendingStatus = unsupported
    nv.nvmlDeviceGetRemappedRows = lambda h: (0, 0, 1 if h[1] == 1 else 0, 0)

    def mem(h, version=None):
        if version and not v2:
            raise NVMLError("Function Not Found")
        if version:
            return types.SimpleNamespace(total=143771 * MIB, used=0, reserved=615 * MIB, free=143156 * MIB)
        return types.SimpleNamespace(total=143771 * MIB, used=615 * MIB, free=143156 * MIB)
    nv.nvmlDeviceGetMemoryInfo = mem
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in (procs or {}).get(h[1], [])]
    nv.nvmlDeviceGetGraphicsRunningProcesses = lambda h: []
    nv.nvmlDeviceGetMPSComputeRunningProcesses = unsupported
    return nv


def worker(nv):
    ns = {"__name__": "gpuflow_worker_test"}
    exec(compile(N.WORKER_SOURCE, "<nvml worker>", "exec"), ns)
    return ns["Worker"](nv)


def test_worker_reports_v2_memory_and_optional_fields():
    w = worker(fake_pynvml(procs={0: [(4242, 120000 * MIB), (0, None)]}))
    assert w.handle({"op": "init"})["count"] == 2
    gpus = w.handle({"op": "gpus"})
    assert gpus[0]["uuid"] == "GPU-0"
    assert gpus[0]["memory"] == {"total_mib": 143771, "used_mib": 0, "reserved_mib": 615,
                                 "free_mib": 143156, "api": "v2"}
    assert gpus[0]["retired_pages_pending"] is None          # not supported: None, not a crash
    assert gpus[1]["remapped_rows_pending"] is True
    assert gpus[0]["mig_mode"] is False and gpus[0]["persistence_mode"] is True
    res = w.handle({"op": "poll", "indices": [0, 1]})
    assert res["processes"]["0"] == [{"pid": 4242, "type": "compute", "used_mib": 120000},
                                     {"pid": 0, "type": "compute", "used_mib": None}]
    assert res["processes"]["1"] == []


def test_worker_falls_back_to_v1():
    w = worker(fake_pynvml(v2=False))
    w.handle({"op": "init"})
    assert w.handle({"op": "gpus"})[0]["memory"]["api"] == "v1"


def test_nvml_call_is_bounded_in_time():
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    t = time.monotonic()
    with pytest.raises(B.BackendTimeout):
        N.NvmlBackend(timeout=0.5, worker_argv=hang)
    assert time.monotonic() - t < 3


def test_nvml_worker_protocol_roundtrip(tmp_path):
    """A real worker process with a fake pynvml module on its path."""
    (tmp_path / "pynvml.py").write_text(
        "import types\n"
        "class NVMLError(Exception): pass\n"
        "nvmlMemory_v2 = 1\n"
        "def nvmlInit(): pass\n"
        "def nvmlShutdown(): pass\n"
        "def nvmlDeviceGetCount(): return 1\n"
        "def nvmlSystemGetDriverVersion(): return 'x'\n"
        "def nvmlSystemGetNVMLVersion(): return 'y'\n"
        "def nvmlDeviceGetHandleByIndex(i): return i\n"
        "def nvmlDeviceGetMemoryInfo(h, version=None):\n"
        "    import time, os\n"
        "    if os.path.exists(%r): time.sleep(30)\n"
        "    return types.SimpleNamespace(total=2**30, used=2**20, reserved=2**21, free=2**29)\n"
        "def nvmlDeviceGetComputeRunningProcesses(h): return [types.SimpleNamespace(pid=77, usedGpuMemory=2**20)]\n"
        % str(tmp_path / "hang"))
    env_pp = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = str(tmp_path) + (os.pathsep + env_pp if env_pp else "")
    try:
        b = N.NvmlBackend(timeout=2.0, worker_argv=[sys.executable, "-c", N.WORKER_SOURCE])
        mem, procs = b.poll([0])
        assert mem[0]["used_mib"] == 1 and procs[0][0]["pid"] == 77
        (tmp_path / "hang").write_text("1")
        t = time.monotonic()
        with pytest.raises(B.BackendTimeout):
            b.poll([0])
        assert time.monotonic() - t < 4
        with pytest.raises(B.BackendTimeout):     # fails fast afterwards
            b.poll([0])
        b.close()
        assert b.proc.poll() is not None
    finally:
        os.environ["PYTHONPATH"] = env_pp


def test_select_backend(tmp_path):
    with pytest.raises(B.BackendUnavailable, match="sim_state_dir"):
        B.select_backend("simulated", None, env={})
    with pytest.raises(B.BackendUnavailable, match="not initialised"):
        B.select_backend("auto", str(tmp_path), env={})
    with pytest.raises(B.BackendUnavailable, match="unknown backend"):
        B.select_backend("cuda", None, env={})
    subprocess.check_call([sys.executable, GPU_SIM, "init", "--state-dir", str(tmp_path), "--gpus", "2"],
                          stdout=subprocess.DEVNULL)
    b = B.select_backend("auto", None, env={B.SIM_STATE_ENV: str(tmp_path)})
    assert b.name == "simulated"
    assert [g["index"] for g in b.gpus()] == [0, 1]


def test_simulated_release_semantics(tmp_path):
    subprocess.check_call([sys.executable, GPU_SIM, "init", "--state-dir", str(tmp_path), "--gpus", "1",
                           "--baseline-mib", "3"], stdout=subprocess.DEVNULL)
    clock = [1000.0]
    b = SB.SimulatedBackend(str(tmp_path), clock=lambda: clock[0])
    p = subprocess.Popen(["sleep", "30"])
    try:
        ct = __import__("psutil").Process(p.pid).create_time()
        rec = {"pid": p.pid, "create_time": ct, "gpus": {"0": 5000}, "context": True, "dead_since": None}
        with open(os.path.join(str(tmp_path), "holders", "%d.json" % p.pid), "w") as f:
            json.dump(rec, f)
        mem, procs = b.poll([0])
        assert mem[0]["used_mib"] == 5003 and procs[0][0]["pid"] == p.pid
        p.kill()
        p.wait()
        mem, procs = b.poll([0])           # exit noticed: off the list at once, memory held for release_delay
        assert mem[0]["used_mib"] == 5003 and procs[0] == []
        clock[0] += 0.05
        assert b.poll([0])[0][0]["used_mib"] == 5003
        clock[0] += 0.06
        assert b.poll([0])[0][0]["used_mib"] == 3
        assert os.listdir(os.path.join(str(tmp_path), "holders")) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_simulated_reset_state_fields(tmp_path):
    subprocess.check_call([sys.executable, GPU_SIM, "init", "--state-dir", str(tmp_path), "--gpus", "1"],
                          stdout=subprocess.DEVNULL)
    b = SB.SimulatedBackend(str(tmp_path))
    st = b.read_gpu_state(0)
    assert st["reset"] == {"supported": True, "busy": False, "unhealthy_after_reset": False, "count": 0}
    for k in SB.GPU_FIELDS:
        assert k in st
    b.update_gpu_state(0, persistence_mode=False)
    assert SB.SimulatedBackend(str(tmp_path)).read_gpu_state(0)["persistence_mode"] is False
    assert b.classify_device_path(os.path.join(b.state_dir, "dev", "nvidia0")) == ("gpu", 0)
    assert b.classify_device_path(os.path.join(b.state_dir, "dev", "nvidiactl"))[0] == "hostwide"
    assert b.classify_device_path("/dev/nvidia0") is None


def test_base_backend_reset_hooks_unsupported():
    with pytest.raises(B.BackendUnsupported):
        B.GpuBackend().reset_gpu(0)
    with pytest.raises(B.BackendUnsupported):
        B.GpuBackend().set_persistence_mode(0, True)


# ------------------------------------------------------------------ the NVML backend's reset path, real subprocesses
STUB_SMI = """#!/bin/sh
# records its argv; behaves as the mode file says
mode=$(cat "$(dirname "$0")/mode")
printf '%s\\n' "$*" >> "$(dirname "$0")/calls"
case "$mode" in
  ok) echo "GPU 00000000:1A:00.0 was successfully reset."; exit 0 ;;
  busy) printf 'The following GPUs could not be reset:\\n  GPU 00000000:1A:00.0: In use by another client\\n'; exit 255 ;;
  unsupported) echo "Resetting GPU is not supported"; exit 3 ;;
  hang) sleep 30 ;;
esac
"""


def test_nvml_backend_resets_through_nvidia_smi_and_bounds_a_hang(tmp_path, monkeypatch):
    """Through a stub nvidia-smi first on PATH: the argv lists the NVML backend runs, the outcome of each exit
    code, and a hung nvidia-smi ended at the timeout (failed, timed out), not waited for."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(STUB_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", "%s%s%s" % (tmp_path, os.pathsep, os.environ["PATH"]))
    backend = object.__new__(N.NvmlBackend)  # no NVML worker: the reset path needs only the GPUs' UUIDs
    backend._gpus = [{"index": 0, "uuid": "GPU-aaaa"}, {"index": 1, "uuid": "GPU-bbbb"}]
    backend.timeout = 1.0
    outcomes = {}
    for mode in ("ok", "busy", "unsupported"):
        (tmp_path / "mode").write_text(mode)
        outcomes[mode] = backend.reset_gpus([0, 1], timeout=10)["outcome"]
    assert outcomes == {"ok": "ok", "busy": "busy", "unsupported": "unsupported"}
    (tmp_path / "mode").write_text("ok")
    assert backend.set_persistence_mode(1, False)["outcome"] == "ok"
    (tmp_path / "mode").write_text("hang")
    t = time.monotonic()
    hung = backend.reset_gpus([0], timeout=0.5)
    assert hung["outcome"] == "failed" and hung["timed_out"] and time.monotonic() - t < 5
    assert (tmp_path / "calls").read_text().splitlines() == [
        "--gpu-reset -i GPU-aaaa,GPU-bbbb"] * 3 + ["-i GPU-bbbb -pm 0", "--gpu-reset -i GPU-aaaa"]

"""host_reset.reset_host: a host's whole sequence in one call, on a real simulated state directory.

Holders are tools/gpu_sim.py processes started here (and killed here). systemd is a recording fake
(no systemd here); the real one is exercised by molecule/gpu_fleet.
"""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from ansible_collections.gpuflow.eagle3.plugins.module_utils import drain as D
from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_reset import ResetError
from ansible_collections.gpuflow.eagle3.plugins.module_utils.host_reset import reset_host
from ansible_collections.gpuflow.eagle3.plugins.module_utils.simulated_backend import SimulatedBackend

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_SIM = os.path.join(REPO, "tools", "gpu_sim.py")
FAST = {"gpus": ["all"], "health_timeout": 2.0, "poll_interval": 0.02}
QUICK_DRAIN = {"services": ["gpu-workload"], "grace_period": 0.5, "kill_timeout": 2.0}


def sim(*args):
    return subprocess.run([sys.executable, GPU_SIM] + list(args), check=True, capture_output=True, text=True).stdout


class FakeSystemd(object):
    """Booted systemd where only the workload's unit is loaded and active; records starts."""

    def __init__(self, start_rc=0):
        self.started = []
        self.start_rc = start_rc

    def booted(self):
        return True

    def load_state(self, unit):
        if unit == "gpu-workload.service":
            return 0, {"LoadState": "loaded", "ActiveState": "active", "ControlGroup": ""}
        return 0, {"LoadState": "not-found", "ActiveState": "inactive", "ControlGroup": ""}

    def stop(self, unit, timeout=None):
        return 0, "", ""

    def start(self, unit, timeout=None):
        self.started.append(unit)
        return self.start_rc, "", "" if self.start_rc == 0 else "failed"


@pytest.fixture
def host(tmp_path):
    d = str(tmp_path / "sim")
    sim("init", "--state-dir", d, "--gpus", "2", "--release-delay", "0")
    sim("set-gpu", "--state-dir", d, "--gpu", "0", "--health", "unhealthy")
    procs = []

    def hold(*args):
        """A holder outside this process's tree (setsid -f: reparented to init), else it would be "own" and kept."""
        ready = str(tmp_path / ("ready-%d.json" % len(procs)))
        subprocess.run(["setsid", "-f", sys.executable, GPU_SIM, "hold", "--state-dir", d, "--ready-file", ready] + list(args),
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while not os.path.exists(ready):
            assert time.time() < deadline, "holder did not start"
            time.sleep(0.02)
        with open(ready) as f:
            p = psutil.Process(json.load(f)["pid"])
        procs.append(p)
        return p

    h = {"dir": d, "state_file": str(tmp_path / "gpuflow" / "gpu_state.json"), "hold": hold,
         "open": lambda: SimulatedBackend(d)}
    yield h
    for p in procs:
        if p.is_running():   # psutil compares the create time too: never a recycled PID
            p.kill()


def gone(p, timeout=5):
    try:
        p.wait(timeout)
    except psutil.TimeoutExpired:
        return False
    return True


def read_state(h):
    with open(h["state_file"]) as f:
        return json.load(f)


def reset_count(h, i=0):
    return SimulatedBackend(h["dir"]).read_gpu_state(i)["reset"]["count"]


def test_drain_reset_restore_and_no_marks_left(host):
    holder = host["hold"]("--gpu", "0", "--mib", "4096", "--ignore-sigterm")
    systemd = FakeSystemd()
    r = reset_host(host["open"], FAST, drain=QUICK_DRAIN, state_file=host["state_file"], mark_state=True,
                   systemd=systemd)
    assert gone(holder)
    assert r["changed"] and r["report"]["outcome"] == "reset" and r["report"]["ok"]
    assert r["report"]["gpus"][0]["action"] == "drain+reset" and r["report"]["gpus"][1]["action"] == "none"
    assert systemd.started == ["gpu-workload.service"] and r["report"]["services_restored"] == ["gpu-workload.service"]
    assert r["report"]["services_stopped"] == [] and r["report"]["drain_s"] is not None
    assert reset_count(host) == 1 and read_state(host) == {} and r["host_state"] == {}


def test_host_drained_before_the_run_keeps_its_services_stopped(host):
    os.makedirs(os.path.dirname(host["state_file"]))
    with open(host["state_file"], "w") as f:
        json.dump({"drain": {"drained": True, "services_stopped": ["gpu-workload.service"], "gpus": [0]}}, f)
    systemd = FakeSystemd()
    r = reset_host(host["open"], FAST, drain=QUICK_DRAIN, state_file=host["state_file"], mark_state=True,
                   systemd=systemd)
    assert r["report"]["outcome"] == "reset" and r["report"]["was_drained"]
    assert systemd.started == [] and r["report"]["services_restored"] == []
    assert read_state(host)["drain"]["services_stopped"] == ["gpu-workload.service"]


def test_unsupported_reset_marks_the_host_and_a_healthy_rerun_clears_the_mark(host):
    sim("set-gpu", "--state-dir", host["dir"], "--gpu", "0", "--reset", "unsupported")
    r = reset_host(host["open"], FAST, drain=QUICK_DRAIN, state_file=host["state_file"], mark_state=True,
                   systemd=FakeSystemd())
    assert r["report"]["outcome"] == "unsupported" and not r["report"]["ok"] and r["report"]["needs_power_cycle"]
    assert read_state(host)["reset"]["needs_power_cycle"] is True and read_state(host)["reset"]["verdict"] == "unsupported"
    assert r["report"]["services_restored"] == []        # GPUs not healthy: the drained services stay stopped
    assert "GPU 0 unsupported" in r["report"]["explanation"]
    sim("set-gpu", "--state-dir", host["dir"], "--gpu", "0", "--health", "ok", "--reset", "ok")
    r = reset_host(host["open"], FAST, drain=QUICK_DRAIN, state_file=host["state_file"], mark_state=True,
                   systemd=FakeSystemd())
    assert r["report"]["outcome"] == "healthy" and not r["report"]["needs_power_cycle"]
    assert "reset" not in read_state(host)


def test_drain_that_does_not_free_the_gpus_skips_the_reset(host, monkeypatch):
    def stuck_drain(backend, params, check_mode=False, systemd=None, warn=None):
        return {"changed": True, "ready": False, "targets": [0], "elapsed_s": 1.0,
                "gpus": [{"index": 0, "verdict": "needs_reboot", "blocked_by": [{"pid": 4242, "name": "python",
                                                                                "reason": "in D state"}]}]}

    monkeypatch.setattr(D, "run_drain", stuck_drain)
    host["hold"]("--gpu", "0", "--mib", "1024")
    r = reset_host(host["open"], FAST, drain=QUICK_DRAIN, state_file=host["state_file"], mark_state=True,
                   systemd=FakeSystemd())
    assert r["report"]["outcome"] == "drain_blocked" and reset_count(host) == 0
    assert r["report"]["gpus"][0]["verdict"] == "drain_blocked"
    assert r["report"]["explanation"].startswith("drain: GPU 0 needs_reboot (reboot the host")
    assert read_state(host)["drain"]["drained"] is True and "reset" not in read_state(host)


def test_check_mode_plans_and_changes_nothing(host):
    marked = {"reset": {"needs_power_cycle": True, "verdict": "unhealthy"}}
    os.makedirs(os.path.dirname(host["state_file"]))
    with open(host["state_file"], "w") as f:
        json.dump(marked, f)
    holder = host["hold"]("--gpu", "0", "--mib", "1024")
    r = reset_host(host["open"], FAST, drain=QUICK_DRAIN, state_file=host["state_file"], mark_state=True,
                   check_mode=True, systemd=FakeSystemd())
    assert r["report"]["outcome"] == "planned" and r["drain"]["changed"]
    assert holder.is_running() and reset_count(host) == 0 and read_state(host) == marked


def test_healthy_host_is_left_alone(host):
    sim("set-gpu", "--state-dir", host["dir"], "--gpu", "0", "--health", "ok")
    holder = host["hold"]("--gpu", "1", "--mib", "1024")
    r = reset_host(host["open"], FAST, drain=QUICK_DRAIN, state_file=host["state_file"], mark_state=True,
                   systemd=FakeSystemd())
    assert not r["changed"] and r["report"]["outcome"] == "healthy" and r["drain"] is None
    assert holder.is_running() and not os.path.exists(host["state_file"])


@pytest.mark.parametrize("drain, words", [
    (dict(QUICK_DRAIN, services=["../etc/passwd"]), "malformed unit name"),
    (dict(QUICK_DRAIN, services=["nvidia-dcgm"]), "both name nvidia-dcgm.service"),
    (dict(QUICK_DRAIN, grace_period=-1), "drain.grace_period must be >= 0"),
])
def test_bad_drain_options_are_refused_before_anything_changes(host, drain, words):
    holder = host["hold"]("--gpu", "0", "--mib", "1024")
    with pytest.raises(ResetError, match=words):
        reset_host(host["open"], FAST, drain=drain, state_file=host["state_file"], mark_state=True,
                   systemd=FakeSystemd())
    assert holder.is_running() and reset_count(host) == 0 and not os.path.exists(host["state_file"])


def test_check_mode_leaves_the_mark_of_a_host_it_would_clear(host):
    marked = {"reset": {"needs_power_cycle": True, "verdict": "unhealthy"}}
    os.makedirs(os.path.dirname(host["state_file"]))
    with open(host["state_file"], "w") as f:
        json.dump(marked, f)
    r = reset_host(host["open"], FAST, drain=QUICK_DRAIN, state_file=host["state_file"], mark_state=True,
                   check_mode=True, systemd=FakeSystemd())
    assert r["report"]["outcome"] == "planned" and not r["report"]["needs_power_cycle"]
    assert read_state(host) == marked

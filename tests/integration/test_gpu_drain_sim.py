"""gpu_info / gpu_drain through Ansible, against real processes and real signals, simulated GPUs.

Each scenario of issue 3 that a simulation can express (1-8; 6 as two simulated GPUs).  The
holders are tools/gpu_sim.py processes started here, each in its own session; every
process started is killed in the fixture's finalizer (only those, checked by create time).
"""

import json
import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_SIM = os.path.join(REPO, "tools", "gpu_sim.py")
PY = sys.executable

sys.path.insert(0, os.path.join(REPO, "tests", "gpu"))

from gpulib import run_module  # noqa: E402  (shared with the real-GPU scenario runner)

pytestmark = pytest.mark.slow


class Procs(object):
    """Starts gpu_sim.py processes and remembers every PID they report, to clean up."""

    def __init__(self, state_dir, tmp):
        self.state_dir = state_dir
        self.tmp = tmp
        self.started = {}   # pid -> create_time
        self.n = 0

    def _remember(self, pid):
        try:
            self.started[pid] = psutil.Process(pid).create_time()
        except psutil.NoSuchProcess:
            pass

    def hold(self, *args, new_session=True):
        self.n += 1
        ready = os.path.join(self.tmp, "ready-%d.json" % self.n)
        p = subprocess.Popen([PY, GPU_SIM, "hold", "--state-dir", self.state_dir, "--ready-file", ready] + list(args),
                             start_new_session=new_session, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._remember(p.pid)
        deadline = time.time() + 20
        while not os.path.exists(ready):
            if time.time() > deadline:
                raise AssertionError("holder did not become ready: %s" % (args,))
            time.sleep(0.02)
        with open(ready) as f:
            info = json.load(f)
        for pid in info["holders"] + info["spawned"]:
            self._remember(pid)
        info["proc"] = p
        return info

    def idle(self, *args):
        p = subprocess.Popen([PY, GPU_SIM, "idle"] + list(args), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._remember(p.pid)
        time.sleep(0.2)
        return p.pid

    def alive(self, pid):
        try:
            p = psutil.Process(pid)
            return abs(p.create_time() - self.started[pid]) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def cleanup(self):
        for pid, ct in self.started.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - ct) < 0.01:
                    p.kill()
            except psutil.NoSuchProcess:
                pass
        for pid in self.started:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


@pytest.fixture
def sim(tmp_path):
    state = str(tmp_path / "gpusim")
    subprocess.check_call([PY, GPU_SIM, "init", "--state-dir", state, "--gpus", "2"], stdout=subprocess.DEVNULL)
    procs = Procs(state, str(tmp_path))
    yield procs
    procs.cleanup()
    shutil.rmtree(state, ignore_errors=True)


def ansible(module, args, state_dir, check=False, diff=False):
    """Run one module on localhost through ansible-playbook; return (rc, result, wall seconds).

    rc is 0 when the module succeeded, non-zero when it failed (the result says why).
    """
    a = dict(args)
    a.setdefault("backend", "simulated")
    a.setdefault("sim_state_dir", state_dir)
    return run_module(module, a, check=check, diff=diff, timeout=120)


def by_gpu(res):
    return dict((g["index"], g) for g in res["gpus"])


def signals(res):
    return [(a["action"], a.get("signal"), a.get("pgid") or a.get("pid")) for a in res["actions"]]


def test_info_classifies_holders(sim):
    h = sim.hold("--gpu", "0", "--mib", "4096")
    m = sim.hold("--gpu", "0", "--gpu", "1", "--management-client")
    d = sim.hold("--gpu", "1", "--mib", "0", "--comm", "nv-hostengine")
    rc, res, dummy = ansible("gpu_info", {}, sim.state_dir)
    assert rc == 0, res
    g = by_gpu(res)
    classes = dict((x["pid"], x["class"]) for x in g[0]["holders"] + g[1]["holders"])
    assert classes[h["pid"]] == "compute"
    assert classes[m["pid"]] == "management"
    assert classes[d["pid"]] == "protected"
    assert g[0]["memory"]["used_mib"] == 4096 and g[0]["memory"]["reserved_mib"] == 615
    holder = [x for x in g[0]["holders"] if x["pid"] == h["pid"]][0]
    assert holder["seen_by"] == ["fd", "driver"] and holder["gpu_memory_mib"] == {"0": 4096}
    assert res["changed"] is False


def test_s1_sigterm_honoured_ready_fast(sim):
    h = sim.hold("--gpu", "0", "--mib", str(100 * 1024))
    rc, res, wall = ansible("gpu_drain", {"gpus": ["0"]}, sim.state_dir)
    assert rc == 0, res
    assert res["changed"] is True and res["ready"] is True
    g = by_gpu(res)[0]
    assert g["verdict"] == "ready"
    assert g["memory_before"]["used_mib"] == 102400 and g["memory_after"]["used_mib"] == 0
    assert [s[1] for s in signals(res)] == ["SIGTERM"]
    assert g["time_to_release_s"] < 1.0, g
    assert not sim.alive(h["pid"])


def test_s2_sigterm_ignored_killed_after_grace(sim):
    h = sim.hold("--gpu", "0", "--mib", "8192", "--ignore-sigterm")
    rc, res, dummy = ansible("gpu_drain", {"grace_period": 1.0}, sim.state_dir)
    assert rc == 0, res
    sig = signals(res)
    assert [s[1] for s in sig] == ["SIGTERM", "SIGKILL"], sig
    t_term, t_kill = res["actions"][0]["t"], res["actions"][1]["t"]
    assert 1.0 <= t_kill - t_term < 1.5
    assert res["ready"] and not sim.alive(h["pid"])


def test_s3_orphans_found_and_freed(sim):
    info = sim.hold("--gpu", "0", "--mib", "0", "--children", "2", "--child-mib", "9000", "--orphan")
    info["proc"].wait(timeout=10)      # the parent is gone
    kids = info["holders"]
    assert len(kids) == 2 and all(sim.alive(k) for k in kids)
    assert all(psutil.Process(k).ppid() != info["pid"] for k in kids)
    rc, res, dummy = ansible("gpu_drain", {"gpus": ["0"]}, sim.state_dir)
    assert rc == 0, res
    planned = sorted(x["pid"] for x in res["plan"]["signal"])
    assert planned == sorted(kids)
    assert ("killpg", "SIGTERM", info["pid"]) in signals(res)      # the dead parent's group
    assert res["ready"] and not any(sim.alive(k) for k in kids)


def test_s4_setsid_grandchild_found_by_device_scan(sim):
    info = sim.hold("--gpu", "0", "--mib", "7000", "--escape")
    top = info["pid"]
    grandchild = info["holders"][0]
    gp = psutil.Process(grandchild)
    assert gp.parent().ppid() == top and os.getsid(grandchild) != os.getsid(top)
    rc, res, dummy = ansible("gpu_drain", {"gpus": ["0"], "pids": [top]}, sim.state_dir)
    assert rc == 0, res
    reasons = dict((x["pid"], x["reason"]) for x in res["plan"]["signal"])
    assert "descendant" in reasons[grandchild]
    assert res["ready"] and not sim.alive(grandchild)
    assert by_gpu(res)[0]["memory_after"]["used_mib"] == 0


def test_s5_management_client_and_cpu_vllm_untouched(sim):
    job = sim.hold("--gpu", "0", "--mib", "20000", "--tag", "vllm-engine")
    mgmt = sim.hold("--gpu", "0", "--management-client")
    dcgm = sim.hold("--gpu", "0", "--mib", "0", "--comm", "nv-hostengine")
    cpu = sim.idle("--comm", "python3", "vllm", "serve", "--cpu-only")
    rc, res, dummy = ansible("gpu_drain", {"gpus": ["all"], "cmdline_pattern": "vllm"}, sim.state_dir)
    assert rc == 0, res
    assert [x["pid"] for x in res["plan"]["signal"]] == [job["pid"]]
    skipped = dict((x["pid"], x["reason"]) for x in res["plan"]["skipped"])
    assert "management" in skipped[mgmt["pid"]]
    assert "protected" in skipped[dcgm["pid"]]
    assert cpu not in [x.get("pid") for x in res["plan"]["skipped"] + res["plan"]["signal"]]
    assert sim.alive(mgmt["pid"]) and sim.alive(dcgm["pid"]) and sim.alive(cpu)
    assert not sim.alive(job["pid"])
    assert res["ready"]
    # the same host drained with every holder selected still spares them
    rc, res, dummy = ansible("gpu_drain", {"all_holders": True}, sim.state_dir)
    assert rc == 0 and res["changed"] is False
    assert sim.alive(mgmt["pid"]) and sim.alive(dcgm["pid"]) and sim.alive(cpu)


OWNER = """
import subprocess, sys
state_dir, ready = sys.argv[-2:]
# the engine: holds GPU 0 and does not match the pattern itself
engine = subprocess.Popen([sys.executable, %r, "hold", "--state-dir", state_dir, "--gpu", "0", "--mib", "8192",
                           "--tag", "engine-core", "--ready-file", ready])
engine.wait()
""" % GPU_SIM


def test_pattern_owner_holding_no_gpu_is_drained_with_its_holder_as_a_group(sim):
    """vLLM's shape: an API server (matches, holds nothing) above an engine (holds the GPU, does not
    match). Both go, with one signal to their group; a bystander that matches but owns nothing stays."""
    ready = os.path.join(sim.tmp, "engine.json")
    owner = subprocess.Popen([PY, "-c", OWNER, "vllm", "serve", "tiny", sim.state_dir, ready],
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sim._remember(owner.pid)
    deadline = time.time() + 20
    while not os.path.exists(ready) and time.time() < deadline:
        time.sleep(0.02)
    with open(ready) as f:
        engine = json.load(f)["pid"]
    sim._remember(engine)
    bystander = sim.idle("--comm", "python3", "vllm", "serve", "--cpu-only")

    rc, res, dummy = ansible("gpu_drain", {"gpus": ["0"], "cmdline_pattern": "vllm"}, sim.state_dir)
    assert rc == 0 and res["ready"], res
    reasons = dict((x["pid"], x["reason"]) for x in res["plan"]["signal"])
    assert sorted(reasons) == sorted([owner.pid, engine])
    assert "owner of GPU-holding descendants" in reasons[owner.pid]
    assert "descendant of a process whose cmdline matches" in reasons[engine]
    assert signals(res) == [("killpg", "SIGTERM", owner.pid)]  # the whole group at once
    assert not sim.alive(owner.pid) and not sim.alive(engine)
    assert sim.alive(bystander)


def test_s6_drain_gpu1_only(sim):
    keep = sim.hold("--gpu", "0", "--mib", "30000")
    go = sim.hold("--gpu", "1", "--mib", "40000")
    rc, res, dummy = ansible("gpu_drain", {"gpus": ["1"]}, sim.state_dir)
    assert rc == 0, res
    assert res["targets"] == [1] and res["ready"]
    assert not sim.alive(go["pid"]) and sim.alive(keep["pid"])
    rc, info, dummy = ansible("gpu_info", {}, sim.state_dir)
    g = by_gpu(info)
    assert g[0]["memory"]["used_mib"] == 30000 and [x["pid"] for x in g[0]["holders"]] == [keep["pid"]]
    assert g[1]["memory"]["used_mib"] == 0 and g[1]["holders"] == []


def test_s7_check_mode_plans_exactly_and_signals_nothing(sim):
    a = sim.hold("--gpu", "0", "--mib", "1000")
    b = sim.hold("--gpu", "1", "--mib", "0", "--children", "2", "--child-mib", "500", "--orphan")
    b["proc"].wait(timeout=10)
    m = sim.hold("--gpu", "0", "--management-client")
    rc, res, dummy = ansible("gpu_drain", {}, sim.state_dir, check=True, diff=True)
    assert rc == 0, res
    assert res["changed"] is True
    assert sorted(x["pid"] for x in res["plan"]["signal"]) == sorted([a["pid"]] + b["holders"])
    assert res["actions"] == []
    assert all(sim.alive(p) for p in [a["pid"], m["pid"]] + b["holders"])
    assert set(g["verdict"] for g in res["gpus"]) == {"planned"}
    assert any(str(m["pid"]) in line for line in res["diff"]["after"]["gpu0"])
    assert not any(str(a["pid"]) in line for line in res["diff"]["after"]["gpu0"])


def test_s8_clean_gpu_no_change(sim):
    m = sim.hold("--gpu", "0", "--management-client")
    rc, res, dummy = ansible("gpu_drain", {"gpus": ["all"]}, sim.state_dir)
    assert rc == 0, res
    assert res["changed"] is False and res["ready"] is True
    assert res["actions"] == []
    assert res["elapsed_s"] < 2.0
    assert sim.alive(m["pid"])


@pytest.mark.parametrize("args,match", [
    ({"gpus": ["5"]}, "unknown GPU index 5"),
    ({"cmdline_pattern": "vllm(("}, "malformed cmdline_pattern"),
    ({"units": ["vllm-x"]}, "systemd is not running"),
    ({"grace_period": "nan"}, "grace_period must be a finite number, not nan"),
    ({"kill_timeout": "inf"}, "kill_timeout must be a finite number, not inf"),
    ({"nvml_timeout": "nan"}, "nvml_timeout must be a finite number, not nan"),
])
def test_bad_parameters_fail_before_signalling(sim, args, match):
    h = sim.hold("--gpu", "0", "--mib", "1000")
    rc, res, dummy = ansible("gpu_drain", args, sim.state_dir)
    assert rc != 0 and res.get("failed") is True
    assert match in res["msg"]
    assert sim.alive(h["pid"])


def test_no_backend_fails_clearly(tmp_path):
    rc, res, dummy = ansible("gpu_drain", {"backend": "simulated"}, str(tmp_path / "nowhere"))
    assert rc != 0 and "not initialised" in res["msg"]


def test_blocked_verdict_names_the_holder(sim):
    keep = sim.hold("--gpu", "0", "--mib", "2000", "--comm", "trainer")
    go = sim.hold("--gpu", "0", "--mib", "3000", "--comm", "vllm-engine")
    rc, res, dummy = ansible("gpu_drain", {"pids": [go["pid"]], "release_timeout": 1}, sim.state_dir)
    assert rc != 0
    g = by_gpu(res)[0]
    assert g["verdict"] == "blocked"
    assert [b["pid"] for b in g["blocked_by"]] == [keep["pid"]]
    assert "not every target GPU is ready" in res["msg"] and str(keep["pid"]) in res["msg"]
    assert sim.alive(keep["pid"]) and not sim.alive(go["pid"])


def test_no_nvml_fails_clearly(tmp_path):
    """This machine has nvidia-ml-py but no NVIDIA driver: a clear failure, not a traceback or a hang."""
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("an NVIDIA driver is present")
    # what one module run costs on this machine now (the same failure path, no NVML): a loaded 2-core machine
    # took 32 s for it, so the bound is relative
    rc, res, reference = run_module("gpu_drain", {"backend": "simulated"}, timeout=300)
    assert rc != 0 and "no usable GPU backend" in res["msg"], res
    nvml_timeout = 5
    rc, res, wall = run_module("gpu_drain", {"backend": "nvml", "nvml_timeout": nvml_timeout}, timeout=300)
    assert rc != 0 and "no usable GPU backend" in res["msg"] and "NVML" in res["msg"], res
    assert wall < 1.5 * reference + nvml_timeout, (wall, reference)


SERVER = """
import subprocess, sys, time
# the API server spawns its engine as a fresh interpreter (as vLLM's multiprocessing does); both inherit the env
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(engine.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("with_site", [True, False], ids=["device-files-held", "attached-only"])
def test_server_started_with_the_sim_site_is_drained_by_its_pid(sim, with_site):
    """The pipeline's hand-off gives gpu_drain the launcher's group leader. With tools/gpu_sim_site on its
    PYTHONPATH every Python process of the server holds the simulated device files, as CUDA's do, so the
    drain maps the attached holders to them and stops the group; without it nothing maps, and nothing is
    signalled (a process the drain cannot tie to the device is never a target)."""
    env = dict(os.environ)
    if with_site:
        env.update(PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tools", "gpu_sim_site"), os.path.dirname(GPU_SIM)]),
                   GPUFLOW_SIM_STATE_DIR=sim.state_dir)
    server = subprocess.Popen([PY, "-c", SERVER], start_new_session=True, stdout=subprocess.PIPE, env=env, text=True)
    engine = int(server.stdout.readline())
    for pid in (server.pid, engine):
        sim._remember(pid)
    subprocess.check_call([PY, GPU_SIM, "attach", "--state-dir", sim.state_dir, "--gpu", "0", "--mib", "2048",
                           "--pid", str(server.pid), "--pid", str(engine)], stdout=subprocess.DEVNULL)

    rc, res, dummy = ansible("gpu_drain", {"gpus": ["0"], "pids": [server.pid], "release_timeout": 2,
                                           "fail_when_not_ready": False}, sim.state_dir)
    assert rc == 0, res
    if with_site:
        assert res["ready"] and signals(res) == [("killpg", "SIGTERM", server.pid)], res
        assert not sim.alive(server.pid) and not sim.alive(engine)
    else:
        assert not res["ready"] and signals(res) == [], res
        assert sim.alive(server.pid) and sim.alive(engine)


SLOW_HELPER = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (time.sleep(6), sys.exit(0)))
print("ready", flush=True)
time.sleep(600)
"""
SERVER_WITH_SLOW_HELPER = """
import os, subprocess, sys, time
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
# holds no device (the site is off its path), takes 6 s to exit on SIGTERM, as a resource tracker might
helper = subprocess.Popen([sys.executable, "-c", %r], stdout=subprocess.PIPE,
                          env=dict((k, v) for k, v in os.environ.items() if k != "PYTHONPATH"))
helper.stdout.readline()
print(engine.pid, helper.pid, flush=True)
time.sleep(600)
""" % SLOW_HELPER


def test_member_of_the_signalled_group_that_exits_slowly_is_gone_when_the_drain_returns(sim):
    env = dict(os.environ, GPUFLOW_SIM_STATE_DIR=sim.state_dir,
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tools", "gpu_sim_site"), os.path.dirname(GPU_SIM)]))
    server = subprocess.Popen([PY, "-c", SERVER_WITH_SLOW_HELPER], start_new_session=True, stdout=subprocess.PIPE,
                              env=env, text=True)
    engine, helper = (int(x) for x in server.stdout.readline().split())
    for pid in (server.pid, engine, helper):
        sim._remember(pid)
    subprocess.check_call([PY, GPU_SIM, "attach", "--state-dir", sim.state_dir, "--gpu", "0", "--mib", "2048",
                           "--pid", str(server.pid), "--pid", str(engine)], stdout=subprocess.DEVNULL)

    rc, res, dummy = ansible("gpu_drain", {"gpus": ["0"], "pids": [server.pid], "grace_period": 10}, sim.state_dir)
    assert rc == 0 and res["ready"], res
    assert helper not in [x["pid"] for x in res["plan"]["signal"]]  # not a target: reached through its group
    assert signals(res) == [("killpg", "SIGTERM", server.pid)], res
    assert not sim.alive(helper)

"""gpu_reset module, gpu_drain / gpu_reset roles and playbooks on this machine, simulated GPUs.

A "fleet" of local-connection inventory hosts, each with its own simulated GPU state directory and
state file. Holders are tools/gpu_sim.py processes started here (and killed here, by PID and create
time). No systemd here: the roles' systemd guard is exercised; systemd itself is tested by
molecule/gpu_fleet.
"""

import json
import os
import re
import subprocess
import sys
import time

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_SIM = os.path.join(REPO, "tools", "gpu_sim.py")
PY = sys.executable
BIN = os.path.dirname(PY)

pytestmark = pytest.mark.slow


def sim(*args):
    return subprocess.run([PY, GPU_SIM] + list(args), check=True, capture_output=True, text=True).stdout


def env():
    coll = os.path.join(REPO, ".cache", "collections")
    return dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_COLLECTIONS_PATH=coll,
                ANSIBLE_NOCOLOR="1", ANSIBLE_STDOUT_CALLBACK="default", ANSIBLE_PIPELINING="True")


def playbook(inv, name, *extra, check=False):
    argv = [os.path.join(BIN, "ansible-playbook"), "-i", inv, os.path.join(REPO, "playbooks", name)] + list(extra)
    if check:
        argv += ["--check", "--diff"]
    return subprocess.run(argv, env=env(), capture_output=True, text=True, cwd=REPO, check=False)


def gpu(fleet, host, i=0):
    with open(os.path.join(fleet, host, "sim", "gpus", "%d.json" % i)) as f:
        return json.load(f)


def recap(out):
    return dict((m.group(1), dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))))
                for m in re.finditer(r"^(\S+)\s+: (ok=.*)$", out, re.M))


@pytest.fixture
def fleet(tmp_path):
    """make(hosts) -> inventory path; hosts: {name: [set-gpu args...] or None}."""
    root = str(tmp_path)
    started = {}

    def make(hosts):
        lines = ["all:", "  children:", "    gpu_nodes:", "      hosts:"]
        for h, fault in hosts.items():
            d = os.path.join(root, h)
            sim("init", "--state-dir", os.path.join(d, "sim"), "--gpus", "2")
            if fault:
                sim("set-gpu", "--state-dir", os.path.join(d, "sim"), *fault)
            lines.append("        %s: {gpu_reset_sim_state_dir: %s/sim, gpu_drain_sim_state_dir: %s/sim, "
                         "gpu_reset_state_file: %s/state.json, gpu_drain_state_file: %s/state.json}" % (h, d, d, d, d))
        lines += ["      vars:", "        ansible_connection: local", "        ansible_python_interpreter: %s" % PY,
                  "        gpu_reset_backend: simulated", "        gpu_drain_backend: simulated",
                  "        gpu_reset_health_timeout: 0.5", "        gpu_reset_drain_grace_period: 1",
                  "        gpu_drain_grace_period: 1"]
        inv = os.path.join(root, "inventory.yml")
        with open(inv, "w") as f:
            f.write("\n".join(lines) + "\n")
        return inv

    def hold(host, *args):
        ready = os.path.join(root, "ready-%s-%d.json" % (host, len(started)))
        p = subprocess.Popen([PY, GPU_SIM, "hold", "--state-dir", os.path.join(root, host, "sim"), "--ready-file", ready]
                             + list(args), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started[p.pid] = psutil.Process(p.pid).create_time()
        deadline = time.time() + 20
        while not os.path.exists(ready):
            assert time.time() < deadline, "holder did not start"
            time.sleep(0.02)
        return p

    make.root = root
    make.hold = hold
    yield make
    for pid, ct in started.items():
        try:
            pr = psutil.Process(pid)
            if abs(pr.create_time() - ct) < 0.01:
                pr.kill()
                pr.wait(5)
        except psutil.Error:
            pass


def test_module_check_mode_then_reset_then_noop(fleet):
    inv = fleet({"h1": ["--gpu", "1", "--health", "unhealthy"]})
    base = [os.path.join(BIN, "ansible"), "-i", inv, "h1", "-m", "gpuflow.eagle3.gpu_reset", "-a",
            json.dumps({"gpus": ["all"], "sim_state_dir": os.path.join(fleet.root, "h1", "sim"),
                        "fail_when_not_healthy": False})]
    r = subprocess.run(base + ["--check", "--diff"], env=env(), capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "CHANGED" in r.stdout, r.stdout + r.stderr
    assert gpu(fleet.root, "h1", 1)["reset"]["count"] == 0
    r = subprocess.run(base, env=env(), capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "CHANGED" in r.stdout, r.stdout + r.stderr
    g = gpu(fleet.root, "h1", 1)
    assert g["reset"]["count"] == 1 and g["health"] == "ok" and g["persistence_mode"] is True
    r = subprocess.run(base, env=env(), capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "SUCCESS" in r.stdout and "CHANGED" not in r.stdout


def test_fleet_playbook_outcomes_summary_and_second_run(fleet):
    inv = fleet({
        "ok": ["--gpu", "0", "--health", "unhealthy"],
        "held": ["--gpu", "0", "--health", "unhealthy"],
        "unsupported": ["--gpu", "0", "--health", "unhealthy", "--reset", "unsupported"],
        "unhealthy": ["--gpu", "1", "--health", "unhealthy", "--reset", "unhealthy-after"],
        "clean": None,
    })
    holder = fleet.hold("held", "--gpu", "0", "--mib", "8192", "--ignore-sigterm")
    summary = os.path.join(fleet.root, "summary.json")
    # check mode first: nothing changes anywhere
    r = playbook(inv, "gpu_reset.yml", "-e", "gpu_reset_summary_path=%s" % summary, "-e", "gpu_reset_serial=5",
                 "-e", "gpu_reset_max_fail_percentage=100", "-e", "gpu_reset_circuit_breaker_percentage=50", check=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert holder.poll() is None and all(gpu(fleet.root, h)["reset"]["count"] == 0 for h in ("ok", "held"))
    # the real run
    r = playbook(inv, "gpu_reset.yml", "-e", "gpu_reset_summary_path=%s" % summary, "-e", "gpu_reset_serial=5",
                 "-e", "gpu_reset_max_fail_percentage=100", "-e", "gpu_reset_circuit_breaker_percentage=50")
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-2000:]
    with open(summary) as f:
        s = json.load(f)
    out = dict((h["host"], h["outcome"]) for h in s["hosts"])
    assert out == {"ok": "reset", "held": "reset", "unsupported": "unsupported", "unhealthy": "unhealthy",
                   "clean": "healthy"}, out
    assert holder.wait(5) is not None                     # the SIGTERM-ignoring holder was killed
    assert gpu(fleet.root, "held")["reset"]["count"] == 1
    with open(os.path.join(fleet.root, "summary.txt")) as f:
        table = f.read()
    assert table.startswith("HOST") and "unsupported" in table and "drain+reset" in table
    assert "HOST" in r.stdout                              # printed too
    for h in ("unsupported", "unhealthy"):
        with open(os.path.join(fleet.root, h, "state.json")) as f:
            assert json.load(f)["reset"]["needs_power_cycle"] is True
    # second run on the healthy hosts: nothing changes
    r = playbook(inv, "gpu_reset.yml", "--limit", "ok,held,clean,localhost", "-e", "gpu_reset_summary_path=%s" % summary)
    assert r.returncode == 0, r.stdout[-3000:]
    rc = recap(r.stdout)
    assert set(rc) == {"ok", "held", "clean", "localhost"} and all(v["changed"] == 0 for v in rc.values()), rc


def test_circuit_breaker_and_max_fail_percentage(fleet):
    inv = fleet({
        "a": ["--gpu", "0", "--health", "unhealthy", "--reset", "unsupported"],
        "b": ["--gpu", "0", "--health", "unhealthy", "--reset", "unsupported"],
        "c": ["--gpu", "0", "--health", "unhealthy"],
        "broken": None,
    })
    os.unlink(os.path.join(fleet.root, "broken", "sim", "state.json"))     # GPUs do not answer
    summary = os.path.join(fleet.root, "summary.json")
    r = playbook(inv, "gpu_reset.yml", "-e", "gpu_reset_summary_path=%s" % summary,
                 "-e", "gpu_reset_circuit_breaker_percentage=20")
    assert r.returncode != 0 and "Circuit breaker tripped" in r.stdout + r.stderr
    assert "pre-flight failed: " in r.stdout + r.stderr and "(broken)" in r.stdout + r.stderr
    with open(summary) as f:
        s = json.load(f)
    assert s["stage"] == "breaker" and s["breaker"]["down"] == ["broken"]
    assert [hosts for cause, hosts in s["breaker"]["causes"].items() if cause.startswith("pre-flight failed: ")] \
        == [["broken"]], s["breaker"]["causes"]
    assert all(gpu(fleet.root, h)["reset"]["count"] == 0 for h in "abc")
    # breaker passes at 30%; batches of 2: a and b fail (100% > 49%), c is never touched
    r = playbook(inv, "gpu_reset.yml", "-e", "gpu_reset_summary_path=%s" % summary, "-e", "gpu_reset_serial=2",
                 "-e", "gpu_reset_max_fail_percentage=49", "-e", "gpu_reset_circuit_breaker_percentage=30")
    assert r.returncode == 2
    with open(summary) as f:
        s = json.load(f)
    out = dict((h["host"], h["outcome"]) for h in s["hosts"])
    assert out == {"a": "unsupported", "b": "unsupported", "c": "not_run", "broken": "preflight_failed"}, out
    assert gpu(fleet.root, "c")["reset"]["count"] == 0 and gpu(fleet.root, "c")["health"] == "unhealthy"


def test_bad_drain_option_stops_the_fleet_at_the_breaker_naming_it_and_changes_nothing(fleet):
    inv = fleet({h: ["--gpu", "0", "--health", "unhealthy"] for h in ("a", "b", "c")})
    holder = fleet.hold("a", "--gpu", "0", "--mib", "1024")
    summary = os.path.join(fleet.root, "summary.json")
    r = playbook(inv, "gpu_reset.yml", "-e", "gpu_reset_summary_path=%s" % summary,
                 "-e", '{"gpu_reset_drain_services": ["bad unit!"]}')
    out = " ".join((r.stdout + r.stderr).split())   # the YAML callback folds long messages
    assert r.returncode != 0 and "Circuit breaker tripped: 3 of 3" in out, out[-3000:]
    assert "pre-flight failed: malformed unit name" in out and "in drain.services (a, b, c)" in out, out[-3000:]
    with open(summary) as f:
        s = json.load(f)
    assert s["stage"] == "breaker" and s["breaker"]["causes"] == {
        "pre-flight failed: malformed unit name 'bad unit!' in drain.services": ["a", "b", "c"]}
    assert holder.poll() is None
    assert all(gpu(fleet.root, h)["reset"]["count"] == 0 for h in "abc")
    assert not any(os.path.exists(os.path.join(fleet.root, h, "state.json")) for h in "abc")


def test_drain_playbook_marks_and_is_idempotent(fleet):
    inv = fleet({"d1": None, "d2": None})
    h1 = fleet.hold("d1", "--gpu", "0", "--gpu", "1", "--mib", "4096")
    r = playbook(inv, "gpu_drain.yml", check=True)
    assert r.returncode == 0 and h1.poll() is None, r.stdout[-2000:]
    r = playbook(inv, "gpu_drain.yml")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert h1.wait(5) is not None
    with open(os.path.join(fleet.root, "d1", "state.json")) as f:
        assert json.load(f)["drain"]["drained"] is True
    assert not os.path.exists(os.path.join(fleet.root, "d2", "state.json"))   # nothing drained, no mark
    assert "d1 GPU 0: ready" in r.stdout
    r = playbook(inv, "gpu_drain.yml")
    rc = recap(r.stdout)
    assert r.returncode == 0 and {"d1", "d2"} <= set(rc) and all(v["changed"] == 0 for v in rc.values()), rc


def test_role_alone_drains_resets_and_reports_in_one_module_call(fleet):
    inv = fleet({"r1": ["--gpu", "0", "--health", "unhealthy"]})
    holder = fleet.hold("r1", "--gpu", "0", "--mib", "2048")
    report = os.path.join(fleet.root, "report.json")
    play = os.path.join(fleet.root, "role.yml")
    with open(play, "w") as f:
        f.write("- hosts: r1\n  gather_facts: false\n  roles: [gpuflow.eagle3.gpu_reset]\n  tasks:\n"
                "    - ansible.builtin.copy: {content: '{{ gpu_reset_report | to_json }}', dest: %s}\n"
                "      delegate_to: localhost\n" % report)
    r = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", inv, play], env=env(), capture_output=True,
                       text=True, cwd=REPO, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert holder.wait(5) is not None
    with open(report) as f:
        rep = json.load(f)
    assert rep["host"] == "r1" and rep["outcome"] == "reset" and rep["gpus"][0]["action"] == "drain+reset"
    assert gpu(fleet.root, "r1")["reset"]["count"] == 1
    assert r.stdout.count("gpuflow.eagle3.gpu_reset : Assess, drain, reset") == 1

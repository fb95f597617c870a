"""tools/cpu_profile.py: the accounting records it reads, and the test, container and kind it gives each."""
import ctypes
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

import cpu_profile  # noqa: E402  pylint: disable=wrong-import-position

TEST = "tests/integration/test_x.py::test_y"


def acct_v3(comm, pid, ppid, begin, utime, stime, version=3):
    return cpu_profile.ACCT_V3.pack(0, version, 0, 0, 0, 0, pid, ppid, begin, 1.5, utime, stime, 0, 0, 0, 0, 0, 0,
                                    comm.encode())


def sample(pid, ppid, cmd, start, last, test=None, container=None):
    return {"pid": pid, "ppid": ppid, "cmd": cmd, "comm": os.path.basename(cmd.split(" ")[0])[:15], "start": start,
            "last": last, "test": test, "container": container, "container_name": None}


def test_comp_t_scales_the_mantissa_by_eight_per_exponent_step():
    assert cpu_profile.comp_t(5) == 5
    assert cpu_profile.comp_t((2 << 13) | 3) == 3 * 64


def test_read_pacct_keeps_v3_records_with_their_cpu_seconds(tmp_path):
    path = tmp_path / "pacct"
    path.write_bytes(acct_v3("python3", 40, 30, 1000, 150, 50) + acct_v3("old", 41, 30, 1000, 1, 1, version=2))
    (rec,) = cpu_profile.read_pacct(str(path))
    assert rec == {"comm": "python3", "pid": 40, "ppid": 30, "begin": 1000, "elapsed": 0.015, "cpu": 2.0}


def test_an_unsampled_module_run_counts_for_its_test_under_its_worker():
    samples = cpu_profile.Samples([
        sample(10, 1, "/venv/bin/python -m pytest tests/integration", 900, 2000, test=TEST + " (call)"),
        sample(20, 10, "/venv/bin/python3 /venv/bin/ansible-playbook play.yml", 950, 1100, test=TEST + " (call)"),
    ])
    records = [{"comm": "python3", "pid": 30, "ppid": 20, "begin": 1000, "elapsed": 0.4, "cpu": 0.3},
               {"comm": "sh", "pid": 31, "ppid": 1, "begin": 1000, "elapsed": 0.1, "cpu": 0.0}]
    module, orphan = cpu_profile.attribute(records, samples)
    assert (module["kind"], module["test"]) == ("ansible module", TEST)
    assert (orphan["kind"], orphan["test"]) == ("other (sh)", None)


def test_a_reused_pid_takes_the_owner_alive_at_the_time():
    samples = cpu_profile.Samples([
        sample(50, 1, "/v/bin/python -m vllm.entrypoints.openai.api_server", 100, 200, container="c" * 64),
        sample(50, 1, "/usr/bin/pip install x", 500, 600),
    ])
    early, late = cpu_profile.attribute([
        {"comm": "python", "pid": 51, "ppid": 50, "begin": 150, "elapsed": 1, "cpu": 1},
        {"comm": "python", "pid": 52, "ppid": 50, "begin": 550, "elapsed": 1, "cpu": 1}], samples)
    assert (early["kind"], early["container"]) == ("vllm", "c" * 12)
    assert (late["kind"], late["container"]) == ("pip", None)


def accounting_allowed(tmp_path):
    """acct(2) needs CAP_SYS_PACCT: root outside a container, not root in docker's default set."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(str(tmp_path / "probe").encode()) != 0:
        return False
    libc.acct(None)
    return True


def test_record_counts_a_real_process_cpu_under_its_name(tmp_path):
    if os.environ.get(cpu_profile.RECORDING_ENV):
        pytest.skip("this run is being recorded: acct(2) here would end that recording")
    (tmp_path / "probe").touch()
    if not accounting_allowed(tmp_path):
        pytest.skip("process accounting is not allowed here (it needs CAP_SYS_PACCT)")
    out = tmp_path / "profile"
    # two seconds of CPU, a quarter of it required: accounting counts clock ticks, which a loaded machine
    # under-samples (0.38 s recorded for a 0.5 s burn beside the suite's other phases, 0.49 s for 1 s on CI)
    burn = "import time\nend = time.process_time() + 2.0\nwhile time.process_time() < end: pass\n"
    run = subprocess.run([sys.executable, os.path.join(REPO, "tools", "cpu_profile.py"), "record", str(out), "--",
                          sys.executable, "-c", burn], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    records = cpu_profile.read_pacct(str(out / "pacct"))
    assert max(r["cpu"] for r in records if r["comm"].startswith("python")) >= 0.5
    assert json.loads((out / "busy.json").read_text())["busy_cpu_s"] >= 0.4

"""ansible.builtin.script hands its command and executable to the remote shell (issue 23, finding 3): the
tasks that use it quote every value, so that a value the preflight did not see (a task file entered
alone, a variable of another role) runs nothing. Each task file is entered alone here, its values set
past any check, and a command smuggled into them would touch a marker file."""
import os
import subprocess

import pytest

from vllm_localhost import REPO, run_playbook

pytestmark = pytest.mark.slow

VENV_PYTHON = os.path.join(REPO, ".venv", "bin", "python")
GPU_SIM = os.path.join(REPO, "tools", "gpu_sim.py")


def run_tasks(tmp_path, role, tasks_from, extra_vars, check_mode=False):
    playbook = tmp_path / "tasks.yml"
    playbook.write_text("- hosts: localhost\n  gather_facts: false\n  tasks:\n"
                        "    - ansible.builtin.include_role:\n        name: %s\n        tasks_from: %s\n"
                        % (role, tasks_from))
    extra = dict(extra_vars, ansible_python_interpreter=VENV_PYTHON)
    return run_playbook(str(playbook), extra, str(tmp_path), check=False, timeout=300,
                        options=["--check"] if check_mode else [])


def injected(marker):
    """A value that, unquoted in a shell command line, ends the command and touches the marker."""
    return "/nonexistent;touch %s;#" % marker


def test_vllm_server_stop_quotes_the_pidfile(tmp_path):
    marker = tmp_path / "PWNED"
    rc, out, _recap = run_tasks(tmp_path, "gpuflow.eagle3.vllm_server", "stopped.yml", {
        "__vllm_server_manager": "process", "__vllm_server_pidfile": injected(marker),
        "vllm_server_python": VENV_PYTHON})
    assert "Stop the server process group" in out, out[-3000:]
    assert not marker.exists(), "the pid file's path ran as a command:\n" + out[-3000:]


def test_vllm_server_stop_quotes_the_python(tmp_path):
    marker = tmp_path / "PWNED"
    rc, out, _recap = run_tasks(tmp_path, "gpuflow.eagle3.vllm_server", "stopped.yml", {
        "__vllm_server_manager": "process", "__vllm_server_pidfile": str(tmp_path / "none.pid"),
        "vllm_server_python": "%s -c pass;touch %s;#" % (VENV_PYTHON, marker)})
    assert rc != 0, out[-3000:]  # no interpreter of that name
    assert not marker.exists(), "vllm_server_python ran as a command line:\n" + out[-3000:]


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check_mode"])
def test_hidden_state_extract_gpu_check_quotes_the_pidfile(tmp_path, check_mode):
    """The extraction's GPU check reads the server's pid file through vllm_server's helper, under --check too."""
    marker = tmp_path / "PWNED"
    sim = tmp_path / "sim"
    subprocess.run([VENV_PYTHON, GPU_SIM, "init", "--state-dir", str(sim), "--gpus", "1"], check=True,
                   stdout=subprocess.DEVNULL)
    rc, out, _recap = run_tasks(tmp_path, "gpuflow.eagle3.hidden_state_extract", "gpu_check.yml", {
        "__hidden_state_extract_runner": "process", "__hidden_state_extract_server_pidfile": injected(marker),
        "hidden_state_extract_gpu_backend": "simulated", "hidden_state_extract_gpu_sim_state_dir": str(sim),
        "hidden_state_extract_python": VENV_PYTHON}, check_mode=check_mode)
    assert rc == 0, out[-3000:]  # no pid file: no own server, and no other holder of the simulated GPU
    assert not marker.exists(), "the pid file's path ran as a command:\n" + out[-3000:]

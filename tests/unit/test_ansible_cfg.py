"""The repo's ansible.cfg as the local runs read it (make pipeline, the integration tests)."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAY = """
- hosts: localhost
  gather_facts: false
  connection: local
  tasks:
    - ansible.builtin.stat:
        path: /
"""


def test_local_module_task_is_pipelined(tmp_path):
    play = tmp_path / "play.yml"
    play.write_text(PLAY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env["ANSIBLE_CONFIG"] = os.path.join(REPO, "ansible.cfg")
    argv = [os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", "localhost,",
            "-e", "ansible_python_interpreter=" + sys.executable, "-vvv", str(play)]
    run = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    # without pipelining the module file is put into a remote temp dir before it runs
    assert "PUT " not in run.stdout, run.stdout
    assert "EXEC" in run.stdout, run.stdout

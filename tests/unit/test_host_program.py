"""The host_program filter: a host program and the libraries it imports as one text that `python -` runs from stdin,
as the roles feed vllm_proc.py and hs_extract.py before anything is installed on the host."""
import json
import os
import subprocess
import sys

from ansible_collections.gpuflow.eagle3.plugins.filter.host_program import host_program

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOBS = os.path.join(REPO, "roles", "detached_job", "files", "gpuflow_jobs.py")


def run_stdin(text, *args):
    """`python - ARGS` with text on stdin, in an empty directory and without PYTHONPATH: nothing to import beside it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-"] + list(args), input=text, cwd="/", env=env, universal_newlines=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False)


def read(path):
    with open(path) as f:
        return f.read()


def test_the_program_imports_its_library_and_sees_its_own_name_and_arguments():
    program = ("import sys\nfrom shapes import area\n"
               "if __name__ == '__main__':\n    print(sys.argv[0], sys.argv[1:], area(3))\n    sys.exit(4)\n")
    p = run_stdin(host_program(program, "tool.py", {"shapes": "def area(n):\n    return n * n\n"}), "a b", "--c")
    assert p.returncode == 4, p.stderr
    assert p.stdout == "tool.py ['a b', '--c'] 9\n"


def test_a_traceback_names_the_file_and_line_it_comes_from():
    p = run_stdin(host_program("import lib\nlib.fail()\n", "tool.py", {"lib": "x = 1\n\ndef fail():\n    raise ValueError('no')\n"}))
    assert p.returncode == 1
    assert 'File "tool.py", line 2' in p.stderr and 'File "lib.py", line 4, in fail' in p.stderr, p.stderr


def test_vllm_proc_runs_from_stdin_with_the_job_library():
    helper = os.path.join(REPO, "roles", "vllm_server", "files", "vllm_proc.py")
    text = host_program(read(helper), "vllm_proc.py", {"gpuflow_jobs": read(JOBS)})
    assert run_stdin(read(helper), "pids").returncode != 0  # alone it cannot import the job library
    p = run_stdin(text, "pids", "--unit", "gpuflow-no-such-unit.service")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"pids": [], "stale": None}


def test_hs_extract_budget_runs_from_stdin_with_the_job_library():
    script = os.path.join(REPO, "roles", "hidden_state_extract", "files", "hs_extract.py")
    p = run_stdin(host_program(read(script), "hs_extract.py", {"gpuflow_jobs": read(JOBS)}), "budget", "--help")
    assert p.returncode == 0, p.stderr
    assert "--inputs" in p.stdout

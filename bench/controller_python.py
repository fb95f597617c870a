"""The same Ansible work on two Python builds, side by side: which interpreter `.venv` should be built on.

For each interpreter (--python, twice; by default python3 on PATH and /usr/bin/python3), a venv of its own
under .cache/bench/controller-python with requirements/controller.txt (made once, reused). Each run is
bench/pipelining_local.py's playbook (--tasks `stat` and --command-tasks `command` tasks against localhost,
the repo's ansible.cfg), with that venv's ansible-playbook as the controller and its python as the module
interpreter, as `make test` runs the tests that use `.venv`. Rounds alternate which goes first. CPU seconds
(user + system) of ansible-playbook and everything it waited for, from the children's rusage; medians.

  .venv/bin/python bench/controller_python.py [--rounds 5] [--tasks 40] [--command-tasks 10]
      [--python python3 --python /usr/bin/python3]

Writes bench/results/controller_python.json: summary{cpu_ratio (the first's CPU over the second's),
cpu_s_first, cpu_s_second, cpu_s_per_module_task_first, cpu_s_per_module_task_second, wall_s_first,
wall_s_second, module_tasks}, each interpreter's version and configure arguments, and every run.
"""
import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys

from pipeline_local import git_commit
from pipelining_local import side_by_side, timed_playbook

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIREMENTS = os.path.join(REPO, "requirements", "controller.txt")
# how it was built: Debian keeps its PGO and LTO flags out of sysconfig (python3.11's changelog.Debian), so the
# configure arguments say something only of a build from source, such as pyenv's
BUILD = ("import json, sys, sysconfig; print(json.dumps({'executable': sys.executable, 'version': sys.version.split()[0], "
         "'config_args': sysconfig.get_config_var('CONFIG_ARGS') or ''}))")


def interpreter(python):
    """The interpreter's path, version and configure arguments."""
    found = shutil.which(python)
    if not found:
        raise SystemExit("no interpreter %s" % python)
    return json.loads(subprocess.run([found, "-c", BUILD], capture_output=True, text=True, check=True).stdout)


def controller_venv(build):
    """A venv on this interpreter with the controller's requirements, made once."""
    with open(REQUIREMENTS, "rb") as f:
        key = hashlib.sha256(f.read() + build["executable"].encode() + build["version"].encode()).hexdigest()[:16]
    venv = os.path.join(REPO, ".cache", "bench", "controller-python", key)
    if not os.path.exists(os.path.join(venv, ".complete")):
        print("making", venv, "on", build["executable"], flush=True)
        subprocess.run([build["executable"], "-m", "venv", "--clear", venv], check=True)
        subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", "--disable-pip-version-check", "-r",
                        REQUIREMENTS], check=True)
        open(os.path.join(venv, ".complete"), "w").close()
    return venv


def run(play, workdir, venv):
    python = os.path.join(venv, "bin", "python")
    return timed_playbook(os.path.join(venv, "bin", "ansible-playbook"), python, play, workdir, "on " + python,
                          ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tasks", type=int, default=40, help="stat tasks per run")
    ap.add_argument("--command-tasks", type=int, default=10, help="command tasks per run")
    ap.add_argument("--python", action="append", help="an interpreter to compare (twice; default python3 and "
                    "/usr/bin/python3)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "controller_python.json"))
    a = ap.parse_args()
    pythons = a.python or ["python3", "/usr/bin/python3"]
    if len(pythons) != 2:
        ap.error("--python: give two interpreters")
    builds = [interpreter(p) for p in pythons]
    if builds[0]["executable"] == builds[1]["executable"]:
        ap.error("both are %s" % builds[0]["executable"])
    venvs = [controller_venv(b) for b in builds]
    module_tasks = a.tasks + a.command_tasks

    def run_on(play, workdir, i):
        return dict(run(play, workdir, venvs[i]), python=builds[i]["executable"])

    runs = side_by_side(a, (0, 1), run_on, lambda i: "%-40s" % builds[i]["executable"])

    def median(key, i):
        return statistics.median(x[key] for x in runs if x["python"] == builds[i]["executable"])

    first, second = median("cpu_s", 0), median("cpu_s", 1)
    summary = {"cpu_ratio": round(first / second, 3), "cpu_s_first": first, "cpu_s_second": second,
               "cpu_s_per_module_task_first": round(first / module_tasks, 4),
               "cpu_s_per_module_task_second": round(second / module_tasks, 4),
               "wall_s_first": median("wall_s", 0), "wall_s_second": median("wall_s", 1),
               "module_tasks": module_tasks}
    doc = {"name": "controller_python",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"host": platform.node(), "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
           "commit": git_commit(), "interpreters": {"first": builds[0], "second": builds[1]},
           "params": {"rounds": a.rounds, "tasks": a.tasks, "command_tasks": a.command_tasks},
           "summary": summary, "runs": runs}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("median CPU: %.2f s on %s (%s), %.2f s on %s (%s): ratio %.3f"
          % (first, builds[0]["executable"], builds[0]["version"], second, builds[1]["executable"],
             builds[1]["version"], summary["cpu_ratio"]))
    print("wrote", a.out)


if __name__ == "__main__":
    sys.exit(main())

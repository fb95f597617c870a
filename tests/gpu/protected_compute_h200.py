# Copyright: gpuflow maintainers
# Apache License 2.0 (see LICENSE)
"""gpu_drain leaves a protected compute holder and says so (issue 13): on GPU 0, a holder named like a
protected daemon (comm nv-hostengine, 2 GiB) and an ordinary job (4 GiB), both with this run's tag in
their command lines. The drain selects the tag: it must stop the job, never signal the protected
holder, call the GPU ready and warn with the protected process's name and MiB.

    python3 tests/gpu/protected_compute_h200.py --kind cuda --out tests/gpu/results/protected_compute_h200.json
    .venv/bin/python tests/gpu/protected_compute_h200.py --kind sim --out /tmp/protected.json   # rehearsal

Only processes this script started are signalled (by the drain, which selects them by the run tag, and by
the cleanup, which checks PID and create time).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpulib import PY, REPO, Holders, run_module  # noqa: E402


def commit():
    if os.environ.get("GPUFLOW_COMMIT"):
        return os.environ["GPUFLOW_COMMIT"]
    res = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return res.stdout.strip() or None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=["cuda", "sim"], required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="gpuflow-protected-")
    args = {"gpus": ["0"], "release_timeout": 60}
    sim = None
    if a.kind == "sim":
        sim = os.path.join(work, "sim")
        subprocess.check_call([PY, os.path.join(REPO, "tools", "gpu_sim.py"), "init", "--state-dir", sim, "--gpus", "1"],
                              stdout=subprocess.DEVNULL)
        args.update(backend="simulated", sim_state_dir=sim)
    holders = Holders(a.kind, work, sim_state_dir=sim)
    args["cmdline_pattern"] = holders.tag
    try:
        protected = holders.hold([0], gib=2, comm="nv-hostengine")["holders"][0]
        job = holders.hold([0], gib=4)["holders"][0]
        rc, res, wall = run_module("gpu_drain", args)
        gpu = (res.get("gpus") or [{}])[0]
        warnings = [w for w in res.get("warnings") or [] if "is ready, but" in w]
        checks = {
            "module ok": rc == 0,
            "GPU 0 ready": gpu.get("verdict") == "ready",
            "job stopped": not holders.alive(job),
            "protected holder never signalled, still alive": holders.alive(protected),
            "protected holder listed with its MiB": [(x["pid"], x["name"]) for x in gpu.get("protected_compute") or []]
            == [(protected, "nv-hostengine")] and (gpu["protected_compute"][0]["used_mib"] or 0) >= 2048,
            "one warning naming it": len(warnings) == 1 and "nv-hostengine (pid %d" % protected in warnings[0],
        }
    finally:
        holders.cleanup()
    report = {
        "name": "gpu_drain leaves a protected compute holder and warns (issue 13)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"kind": a.kind, "python": platform.python_version()},
        "commit": commit(),
        "passed": all(checks.values()),
        "checks": checks,
        "warnings": warnings,
        "protected_compute": gpu.get("protected_compute"),
        "verdict": gpu.get("verdict"),
        "memory_after_mib": (gpu.get("memory_after") or {}).get("used_mib"),
        "ansible_wall_s": round(wall, 2),
    }
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print(json.dumps({"passed": report["passed"], "checks": checks, "warnings": warnings}, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

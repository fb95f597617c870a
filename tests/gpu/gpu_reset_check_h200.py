# Copyright: gpuflow maintainers
# Apache License 2.0 (see LICENSE)
"""gpu_reset in CHECK MODE against the real GPUs of this machine (issue 4). Never resets.

    python3 tests/gpu/gpu_reset_check_h200.py --out tests/gpu/results/gpu_reset_check_h200.json

What it does, all read-only:

1. reads every GPU's persistence / MIG mode through NVML (before);
2. calls gpu_reset's logic directly (module_utils.gpu_reset.run_reset, check_mode=True), once as
   users run it (reset only what needs it) and once with force=true (the full plan);
3. runs the real module through ansible-playbook in check mode with --diff (ansible-core carried as
   wheels on the GPU machine);
4. reads persistence / MIG mode again and compares.

Safety net on top of check mode: a guard directory is put first on PATH with an ``nvidia-smi`` that
refuses (and records) any ``--gpu-reset`` / ``-r`` / ``-pm`` / ``-mig`` / ``-e`` / clock call and
passes every other call to the real binary. The run fails if the guard saw anything. No process is
signalled: gpu_reset never signals, and this script starts none that hold a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpulib import REPO, ensure_collection_link, run_module  # noqa: E402

GUARD = r'''#!/bin/sh
# gpuflow guard: refuse state-changing nvidia-smi calls, pass the rest to the real binary
for a in "$@"; do
  case "$a" in
    --gpu-reset|-r|-pm|--persistence-mode*|-mig|--multi-instance-gpu*|-e|--ecc-config*|-lgc|-rgc|-ac|-rac|-pl|--reset-gpu-clocks|--lock-gpu-clocks*)
      echo "$$ $*" >> "%(log)s"; echo "gpuflow guard: refused nvidia-smi $*" >&2; exit 99 ;;
  esac
done
exec "%(real)s" "$@"
'''


def nvml_modes():
    import pynvml as nv
    nv.nvmlInit()
    try:
        out = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            try:
                mig = list(nv.nvmlDeviceGetMigMode(h))
            except nv.NVMLError:
                mig = None
            try:
                ecc = list(nv.nvmlDeviceGetEccMode(h))
            except nv.NVMLError:
                ecc = None
            uuid = nv.nvmlDeviceGetUUID(h)
            out.append({"index": i, "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                        "persistence_mode": bool(nv.nvmlDeviceGetPersistenceMode(h)), "mig_mode": mig, "ecc_mode": ecc})
        return out
    finally:
        nv.nvmlShutdown()


def brief(r):
    keep = ("changed", "ok", "verdict", "targets", "selected", "plan", "platform", "actions", "daemons", "persistence",
            "backend", "elapsed_s", "msg", "failed", "diff")
    out = dict((k, r.get(k)) for k in keep if k in r)
    gkeys = ("index", "uuid", "needed", "reasons", "action", "verdict", "blocked_by", "reset_group",
             "persistence_mode_before", "checks_before")
    out["gpus"] = [dict((k, g.get(k)) for k in gkeys) for g in r.get("gpus", [])]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "gpu", "results", "gpu_reset_check_h200.json"))
    ap.add_argument("--skip-ansible", action="store_true")
    a = ap.parse_args()

    real = shutil.which("nvidia-smi")
    guard_dir = tempfile.mkdtemp(prefix="gpuflow-guard-")
    guard_log = os.path.join(guard_dir, "refused.log")
    open(guard_log, "w").close()
    if real:
        with open(os.path.join(guard_dir, "nvidia-smi"), "w") as f:
            f.write(GUARD % {"log": guard_log, "real": real})
        os.chmod(os.path.join(guard_dir, "nvidia-smi"), 0o755)
    os.environ["PATH"] = guard_dir + os.pathsep + os.environ.get("PATH", "")

    coll = ensure_collection_link()
    if coll not in sys.path:
        sys.path.insert(0, coll)
    from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_backend import select_backend
    from ansible_collections.gpuflow.eagle3.plugins.module_utils import gpu_reset as R

    report = {"name": "gpu_reset_check_h200", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "machine": platform.node(), "python": sys.version.split()[0], "checks": []}
    # $GPUFLOW_COMMIT first: the device machine's copy may carry no .git, or one of an older HEAD
    report["commit"] = os.environ.get("GPUFLOW_COMMIT") or None
    if not report["commit"]:
        try:
            report["commit"] = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                                              text=True, check=False).stdout.strip() or None
        except OSError:
            report["commit"] = None
    smi = subprocess.run([real or "nvidia-smi", "--query-gpu=index,name,driver_version,persistence_mode,mig.mode.current,"
                          "memory.used,memory.reserved", "--format=csv,noheader"], capture_output=True, text=True,
                         check=False)
    report["nvidia_smi"] = smi.stdout.strip()
    before = nvml_modes()
    report["modes_before"] = before

    def check(name, ok, detail=""):
        report["checks"].append({"check": name, "ok": bool(ok), "detail": detail})
        print("%-4s %s %s" % ("ok" if ok else "FAIL", name, detail), flush=True)

    def open_backend():
        return select_backend("nvml", None, timeout=30)

    t = time.monotonic()
    asis = R.run_reset(open_backend, {"gpus": ["all"]}, check_mode=True, warn=lambda m: print("warn:", m))
    report["direct_check_mode_as_needed"] = brief(asis)
    report["direct_as_needed_s"] = round(time.monotonic() - t, 3)
    check("as needed: healthy GPUs need no reset, nothing planned",
          asis["selected"] == [] and asis["changed"] is False and all(g["verdict"] == "healthy" for g in asis["gpus"]),
          "selected=%s verdicts=%s" % (asis["selected"], [g["verdict"] for g in asis["gpus"]]))

    t = time.monotonic()
    forced = R.run_reset(open_backend, {"gpus": ["all"], "force": True}, check_mode=True,
                         warn=lambda m: print("warn:", m))
    report["direct_check_mode_forced"] = brief(forced)
    report["direct_forced_s"] = round(time.monotonic() - t, 3)
    pm_on = [g["index"] for g in before if g["persistence_mode"]]
    plan = forced["plan"]
    check("forced plan: every GPU planned or blocked with a named reason",
          all(g["verdict"] == "planned" or g["blocked_by"] for g in forced["gpus"]),
          str([(g["index"], g["verdict"]) for g in forced["gpus"]]))
    check("forced plan: persistence mode turned off exactly on the GPUs that have it on",
          sorted(plan["persistence_off"]) == sorted(i for i in pm_on if any(i in grp["gpus"] and not grp["blocked_by"] for grp in plan["groups"])),
          "persistence_off=%s, on=%s" % (plan["persistence_off"], pm_on))
    check("forced plan: reset command is nvidia-smi --gpu-reset -i <UUID> per group",
          all(grp["command"][:3] == ["nvidia-smi", "--gpu-reset", "-i"] and grp["command"][3].startswith("GPU-")
              for grp in plan["groups"]), str([grp["command"] for grp in plan["groups"]]))
    arch = [v.get("architecture") for v in forced["platform"]["gpus"].values()]
    check("platform probe: architecture read from NVML", all(x for x in arch), str(arch))
    check("forced plan: every GPU is Hopper (an H200) and resets individually (one GPU per group)",
          bool(arch) and all(x == "hopper" for x in arch) and all(len(grp["gpus"]) == 1 for grp in plan["groups"]),
          "architectures %s, groups %s" % (arch, [grp["gpus"] for grp in plan["groups"]]))
    check("check mode acted on nothing", forced["actions"] == [] and forced["daemons"] == [] and forced["persistence"] == [],
          "actions=%s" % forced["actions"])

    if not a.skip_ansible:
        rc, res, wall = run_module("gpu_reset", {"gpus": ["all"], "force": True, "backend": "nvml",
                                                 "fail_when_not_healthy": False}, check=True, diff=True)
        report["ansible_check_mode_forced"] = brief(res)
        report["ansible_wall_s"] = round(wall, 3)
        check("through ansible-playbook --check --diff: plan returned, no action",
              rc == 0 and res.get("plan") is not None and res.get("actions") == [],
              "rc=%s verdict=%s changed=%s%s" % (rc, res.get("verdict"), res.get("changed"),
                                                 "" if res.get("plan") else " " + json.dumps(res)[:1500]))
        check("through ansible: same groups as the direct call",
              res.get("plan", {}).get("groups") and [g["gpus"] for g in res["plan"]["groups"]] == [g["gpus"] for g in plan["groups"]])

    after = nvml_modes()
    report["modes_after"] = after
    check("persistence / MIG / ECC modes unchanged", before == after, "before=%s after=%s" % (before, after))
    with open(guard_log) as f:
        refused = f.read().strip()
    report["guard_refused"] = refused.splitlines()
    check("no state-changing nvidia-smi call was even attempted", refused == "", refused)
    report["passed"] = all(c["ok"] for c in report["checks"])
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True, default=str)
    print("wrote %s; passed=%s" % (a.out, report["passed"]))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

# Copyright: gpuflow maintainers
# Apache License 2.0 (see LICENSE)
"""The seed's drain recipe, replayed verbatim (less `systemctl stop`) inside its own PID namespace.

Run only as:  unshare --pid --fork --mount-proc python3 bench/seed_ns.py --kind cuda --gib 110 --out F
This process is PID 1 of the namespace; the kernel ignores SIGKILL sent to a namespace's
init from inside it, so it survives the recipe's `kill -9` of every python and records what
happened.  When it exits the kernel ends everything left in the namespace: nothing outside
is ever touched.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "gpu"))

from gpulib import Holders  # noqa: E402

# msg 2958 of the seed, verbatim after `systemctl stop vllm-kimi-k25-int4 && `.
SEED_RECIPE = (r'echo "Service stopped" && sleep 5 && ps aux | grep -E "python3|VLLM" | grep -v grep | '
               r'awk "{print \$2}" | xargs kill -9 2>/dev/null; sleep 3; kill -9 $(fuser /dev/nvidia* 2>/dev/null '
               r'| tr " " "\n" | sort -u | grep -v "^$") 2>/dev/null; sleep 2; echo "---GPU MEMORY---"; '
               r'nvidia-smi --query-gpu=index,memory.used,memory.free --format=csv,noheader')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="cuda")
    ap.add_argument("--gib", type=float, default=110.0)
    ap.add_argument("--sim-state-dir")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    res = {"pid_in_namespace": os.getpid(), "fuser": shutil.which("fuser"), "nvidia_smi": shutil.which("nvidia-smi")}
    if os.getpid() != 1:
        res["error"] = "not PID 1 of a new PID namespace: refusing to run the recipe"
        json.dump(res, open(a.out, "w"))
        return 2
    H = Holders(a.kind, "/tmp/seed-ns", a.sim_state_dir)
    holder = H.hold([0], gib=a.gib)
    mgmt = H.hold([0], management_client=True)
    cpu = H.idle("vllm-cpu-job")
    watched = {"holder": holder["pid"], "management_client": mgmt["pid"], "unrelated_python": cpu}
    t0 = time.monotonic()
    p = subprocess.run(["bash", "-c", SEED_RECIPE], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    res["recipe_s"] = round(time.monotonic() - t0, 4)
    res["recipe_rc"] = p.returncode
    res["recipe_output"] = p.stdout.decode(errors="replace")[-2000:]
    H.reap()
    res["killed"] = dict((k, not H.alive(v)) for k, v in watched.items())
    res["collateral_kills"] = sum(1 for k, dead in res["killed"].items() if dead and k != "holder")
    res["holder_freed"] = res["killed"]["holder"]
    with open(a.out, "w") as f:
        json.dump(res, f)
    H.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

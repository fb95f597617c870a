"""List the processes a test run left behind; exit 1 when there is one.

    python tests/leftovers.py --since EPOCH_SECONDS [--root CHECKOUT] [--wait SECONDS]

A leftover is a process created at or after --since that is still running, is not this check or one of
its ancestors (the test runner itself), and belongs to the run: its command line names the checkout
(servers, trainers, simulated GPU holders, molecule or ansible processes) or it is part of a Docker
engine (dockerd, containerd, a container's shim). Processes from before the run, such as a Docker
engine that was already running, are never counted. Processes on their way out (a daemon's children
after it was stopped) get --wait seconds (default 15) to go.
"""

import argparse
import os
import sys
import time

import psutil

ENGINE = ("dockerd", "containerd", "containerd-shim", "containerd-shim-runc-v2", "docker-proxy", "runc")


def ancestors():
    me = psutil.Process()
    return {me.pid} | set(p.pid for p in me.parents())


def leftovers(since, root):
    mine = ancestors()
    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline", "create_time"]):
        info = p.info
        if info["pid"] in mine or (info["create_time"] or 0) < since:
            continue
        cmdline = " ".join(info["cmdline"] or [])
        if info["name"] in ENGINE or (root and root in cmdline):
            found.append("%d %s: %s" % (info["pid"], info["name"], cmdline[:200]))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--since", type=float, required=True)
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--wait", type=float, default=15.0)
    a = ap.parse_args()
    deadline = time.monotonic() + a.wait
    found = leftovers(a.since, a.root)
    while found and time.monotonic() < deadline:
        time.sleep(0.5)
        found = leftovers(a.since, a.root)
    if found:
        print("processes this run started are still running:")
        print("\n".join("  " + line for line in found))
        return 1
    print("no process this run started is left")
    return 0


if __name__ == "__main__":
    sys.exit(main())

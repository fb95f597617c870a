# Copyright: gpuflow maintainers
# Apache License 2.0 (see LICENSE)
"""Real CUDA GPU holders for tests/gpu and bench/ (needs torch; the management client needs pynvml).

Same command line as tools/gpu_sim.py's ``hold`` / ``idle`` where it matters:

  python3 cuda_holder.py hold --gpu 0 --gib 110 [--ignore-sigterm]
                              [--children N [--child-gib G] [--orphan]] [--escape]
                              [--management-client] [--ready-file F] [--tag TEXT] [--comm NAME]
  python3 cuda_holder.py idle [--tag TEXT]          # CPU-only python process

Forks happen before CUDA is initialised (CUDA does not survive fork); every GPU holder
allocates and touches its memory, then reports its PID to the top process through a pipe;
the top process writes the ready file.  SIGTERM keeps its default action (terminate)
unless --ignore-sigterm.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")   # CUDA index == NVML index


def _write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _hold_memory(a, gib):
    if a.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    keep = []
    if a.management_client:
        import pynvml
        pynvml.nvmlInit()
        for g in a.gpu:
            keep.append(pynvml.nvmlDeviceGetHandleByIndex(g))
            pynvml.nvmlDeviceGetMemoryInfo(keep[-1])
        return keep
    import torch
    for g in a.gpu:
        n = int(gib * (1 << 30))
        t = torch.empty(max(n, 1), dtype=torch.uint8, device="cuda:%d" % g)
        t.fill_(1)
        torch.cuda.synchronize(g)
        keep.append(t)
    return keep


def _become_holder(a, gib, w):
    keep = _hold_memory(a, gib)  # noqa: F841
    os.write(w, ("%d\n" % os.getpid()).encode())
    while True:
        signal.pause()


def _fork(fn):
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(0)
    return pid


def _set_comm(name):
    """The process name (comm) others see, e.g. a protected daemon's (prctl PR_SET_NAME)."""
    import ctypes
    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def cmd_hold(a):
    if a.comm:
        _set_comm(a.comm)
    child_gib = a.gib if a.child_gib is None else a.child_gib
    r, w = os.pipe()
    spawned = []
    if a.escape:
        def middle():
            os.close(r)

            def grandchild():
                os.setsid()
                _become_holder(a, a.gib, w)
            _fork(grandchild)
            while True:
                signal.pause()
        spawned.append(_fork(middle))
        need = 1
    else:
        for dummy in range(a.children):
            spawned.append(_fork(lambda: (os.close(r), _become_holder(a, child_gib, w))))
        need = a.children
    holders = []
    keep = None
    if not a.escape and not a.orphan:
        keep = _hold_memory(a, a.gib)  # noqa: F841
        holders.append(os.getpid())
    os.close(w)
    buf = b""
    got = 0
    deadline = time.time() + 300
    while got < need and time.time() < deadline:
        chunk = os.read(r, 4096)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            holders.append(int(line))
            got += 1
    if a.ready_file:
        _write_json(a.ready_file, {"pid": os.getpid(), "holders": holders, "spawned": spawned})
    if a.orphan:
        os._exit(0)
    while True:
        signal.pause()


def cmd_idle(a):
    while True:
        signal.pause()


def main(argv=None):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("hold")
    p.add_argument("--gpu", type=int, action="append", required=True)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--children", type=int, default=0)
    p.add_argument("--child-gib", type=float)
    p.add_argument("--orphan", action="store_true")
    p.add_argument("--escape", action="store_true")
    p.add_argument("--management-client", action="store_true")
    p.add_argument("--ready-file")
    p.add_argument("--comm", help="process name (comm), e.g. nv-hostengine")
    p.add_argument("--tag")
    p = sub.add_parser("idle")
    p.add_argument("--tag")
    a = ap.parse_args(argv)
    return {"hold": cmd_hold, "idle": cmd_idle}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())

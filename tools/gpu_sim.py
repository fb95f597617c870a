# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Simulated GPUs and GPU holders for gpuflow.eagle3's `simulated` backend.

Standard library + psutil only, so this file can be copied into containers.
The state directory format is documented in
plugins/module_utils/simulated_backend.py (format 1).

  gpu_sim.py init   --state-dir D --gpus 2 [--total-mib 143771] [--reserved-mib 615]
                    [--baseline-mib 0] [--release-delay 0.1] [--force]
  gpu_sim.py hold   --state-dir D --gpu 0 [--gpu 1] --mib 102400
                    [--ignore-sigterm | --term-delay S]
                    [--children N [--child-mib M] [--orphan]]
                    [--escape]                # hold in a setsid() grandchild, parent chain kept alive
                    [--management-client]     # open device files, no context, no memory
                    [--comm NAME]             # process name (comm), e.g. nv-hostengine
                    [--tag TEXT]              # free text in the command line, e.g. vllm
                    [--ready-file F]          # JSON {"pid", "holders": [...]} once everything holds
  gpu_sim.py attach --state-dir D --gpu 0 --pid P [--pid P2] [--mib 1024]
                                             # running processes (a server's) hold GPUs until they exit
  gpu_sim.py idle   [--comm NAME] [--tag TEXT] [ARGS...]   # CPU-only process
  gpu_sim.py status --state-dir D            # memory per GPU as the backend computes it
  gpu_sim.py set-gpu --state-dir D --gpu 0 [--health unhealthy] [--persistence on|off]
                    [--reset ok|unsupported|busy|unhealthy-after] [--set KEY=JSON] [--host KEY=JSON]
                                             # faults and fields for gpu_reset (issue 4);
                                             # --set stuck_used_mib=N: memory held with no process

A holder opens every <D>/dev/nvidia<k> (as CUDA does at init), <D>/dev/nvidiactl and
<D>/dev/nvidia-uvm and keeps them open (a management client opens only its --gpu nodes),
then registers <D>/holders/<pid>.json {"pid", "create_time", "gpus": {"k": mib},
"context": true}.  The backend counts the memory while that exact process (PID + create
time) is alive and not a zombie, and releases it `release_delay` s after noticing its exit:
an ignored SIGTERM keeps the memory, orphans keep the memory, SIGKILL frees it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time
import uuid

import psutil

FORMAT = 1


def _atomic_write_json(path, data):
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(data, f, sort_keys=True)
    os.replace(tmp, path)


def set_comm(name):
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


def cmd_init(a):
    d = os.path.abspath(a.state_dir)
    if os.path.exists(os.path.join(d, "state.json")) and not a.force:
        print("already initialised: %s (use --force)" % d, file=sys.stderr)
        return 1
    for sub in ("gpus", "holders", "dev", os.path.join("dev", "nvidia-caps")):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    if a.force:
        for n in os.listdir(os.path.join(d, "holders")):
            os.unlink(os.path.join(d, "holders", n))
        for n in os.listdir(os.path.join(d, "gpus")):
            os.unlink(os.path.join(d, "gpus", n))
    for n in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", os.path.join("nvidia-caps", "nvidia-cap1")] + \
            ["nvidia%d" % i for i in range(a.gpus)]:
        open(os.path.join(d, "dev", n), "a").close()
    for i in range(a.gpus):
        _atomic_write_json(os.path.join(d, "gpus", "%d.json" % i), {
            "index": i, "minor": i,
            "uuid": "GPU-%s" % uuid.uuid5(uuid.NAMESPACE_URL, "gpusim:%s:%d" % (d, i)),
            "name": a.name, "pci_bus_id": "00000000:%02X:00.0" % (0x10 + i),
            "memory_total_mib": a.total_mib, "memory_reserved_mib": a.reserved_mib,
            "baseline_used_mib": a.baseline_mib, "stuck_used_mib": 0,
            "persistence_mode": True, "mig_mode": False,
            "retired_pages_pending": None, "remapped_rows_pending": False, "remapped_rows_failure": False,
            "health": "ok",
            "reset": {"supported": True, "busy": False, "unhealthy_after_reset": False, "count": 0},
        })
    _atomic_write_json(os.path.join(d, "state.json"),
                       {"format": FORMAT, "gpu_count": a.gpus, "release_delay_s": a.release_delay})
    print(d)
    return 0


def open_devices(d, gpus, every_gpu=False):
    """Open the device nodes.  Like CUDA, a context holder opens *every* GPU's node
    (every_gpu); a management client opens only the GPUs it asked for."""
    if every_gpu:
        gpus = sorted(int(n[6:]) for n in os.listdir(os.path.join(d, "dev"))
                      if n.startswith("nvidia") and n[6:].isdigit())
    fds = []
    for k in gpus:
        fds.append(os.open(os.path.join(d, "dev", "nvidia%d" % k), os.O_RDONLY))
    for n in ("nvidiactl", "nvidia-uvm", os.path.join("nvidia-caps", "nvidia-cap1")):
        fds.append(os.open(os.path.join(d, "dev", n), os.O_RDONLY))
    return fds


def _become_holder(a, mib, report_fd):
    """Open the device files, register memory, report our PID, then wait for signals."""
    d = os.path.abspath(a.state_dir)
    _install_term_handler(a)
    fds = open_devices(d, a.gpu, every_gpu=not a.management_client)
    if not a.management_client:
        me = psutil.Process()
        _atomic_write_json(os.path.join(d, "holders", "%d.json" % me.pid), {
            "pid": me.pid, "create_time": me.create_time(),
            "gpus": dict((str(k), int(mib)) for k in a.gpu), "context": True, "dead_since": None})
    os.write(report_fd, ("%d\n" % os.getpid()).encode())
    while True:
        signal.pause()
    return fds  # pragma: no cover


def _fork(fn):
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(0)
    return pid


def _install_term_handler(a):
    if a.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif a.term_delay:
        def on_term(signum, frame):
            time.sleep(a.term_delay)
            os._exit(0)
        signal.signal(signal.SIGTERM, on_term)
    else:
        signal.signal(signal.SIGTERM, lambda s, f: os._exit(0))


def _register_holder(state_dir, proc, gpus, mib):
    """holders/<pid>.json: the backend counts mib on each GPU while this exact process lives."""
    _atomic_write_json(os.path.join(state_dir, "holders", "%d.json" % proc.pid), {
        "pid": proc.pid, "create_time": proc.create_time(),
        "gpus": dict((str(k), int(mib)) for k in gpus), "context": True, "dead_since": None})


def cmd_hold(a):
    if a.comm:
        set_comm(a.comm)
    child_mib = a.mib if a.child_mib is None else a.child_mib
    r, w = os.pipe()
    spawned = []
    if a.escape:
        # main -> middle (no GPU, waits) -> grandchild: setsid() and hold.
        def middle():
            os.close(r)

            def grandchild():
                os.setsid()
                _become_holder(a, a.mib, w)
            _fork(grandchild)
            signal.signal(signal.SIGTERM, lambda s, f: os._exit(0))
            while True:
                signal.pause()
        spawned.append(_fork(middle))
        need = 1
    else:
        for dummy in range(a.children):
            spawned.append(_fork(lambda: (os.close(r), _become_holder(a, child_mib, w))))
        need = a.children
    _install_term_handler(a)
    holders = []
    own_hold = not a.escape and not a.orphan
    if own_hold:
        d = os.path.abspath(a.state_dir)
        a._fds = open_devices(d, a.gpu, every_gpu=not a.management_client)  # kept open
        if not a.management_client:
            _register_holder(d, psutil.Process(), a.gpu, a.mib)
        holders.append(os.getpid())
    os.close(w)
    buf = b""
    got = 0
    deadline = time.time() + 30
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
        _atomic_write_json(a.ready_file, {"pid": os.getpid(), "holders": holders, "spawned": spawned})
    if a.orphan:
        os._exit(0)
    while True:
        signal.pause()


def cmd_attach(a):
    """Register running processes this tool did not start (a vLLM server's) as holders: memory and a
    context, no device files. Each holds until it exits, and its memory lags the exit like any holder's."""
    d = os.path.abspath(a.state_dir)
    attached = []
    for pid in a.pid:
        _register_holder(d, psutil.Process(pid), a.gpu, a.mib)
        attached.append(pid)
    print(json.dumps({"attached": attached, "gpus": a.gpu, "mib_each": a.mib}))


def cmd_idle(a):
    if a.comm:
        set_comm(a.comm)
    signal.signal(signal.SIGTERM, lambda s, f: os._exit(0))
    while True:
        signal.pause()


def _parse_value(text):
    try:
        return json.loads(text)
    except ValueError:
        return text


def cmd_set_gpu(a):
    """Set per-GPU fields (faults for gpu_reset) and host fields; prints the GPU's state."""
    d = os.path.abspath(a.state_dir)
    if a.host:
        path = os.path.join(d, "state.json")
        with open(path) as f:
            data = json.load(f)
        for kv in a.host:
            k, dummy, v = kv.partition("=")
            data[k] = _parse_value(v)
        _atomic_write_json(path, data)
    for k in a.gpu or []:
        path = os.path.join(d, "gpus", "%d.json" % k)
        with open(path) as f:
            data = json.load(f)
        reset = dict(data.get("reset") or {})
        if a.health:
            data["health"] = a.health
        if a.persistence:
            data["persistence_mode"] = a.persistence == "on"
        if a.reset:
            reset.update({"supported": a.reset != "unsupported", "busy": a.reset == "busy",
                          "unhealthy_after_reset": a.reset == "unhealthy-after"})
        for kv in a.set or []:
            key, dummy, v = kv.partition("=")
            if key.startswith("reset."):
                reset[key[6:]] = _parse_value(v)
            else:
                data[key] = _parse_value(v)
        data["reset"] = reset
        _atomic_write_json(path, data)
        print(json.dumps(data, sort_keys=True))
    return 0


def cmd_status(a):
    d = os.path.abspath(a.state_dir)
    with open(os.path.join(d, "state.json")) as f:
        state = json.load(f)
    out = []
    for i in range(state["gpu_count"]):
        with open(os.path.join(d, "gpus", "%d.json" % i)) as f:
            g = json.load(f)
        held = 0
        for n in os.listdir(os.path.join(d, "holders")):
            try:
                with open(os.path.join(d, "holders", n)) as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue
            try:
                p = psutil.Process(rec["pid"])
                alive = abs(p.create_time() - rec["create_time"]) < 0.05 and p.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                alive = False
            if alive or (rec.get("dead_since") and time.time() - rec["dead_since"] < state["release_delay_s"]):
                held += int(rec["gpus"].get(str(i), 0))
        out.append({"index": i, "uuid": g["uuid"], "used_mib": g["baseline_used_mib"] + g.get("stuck_used_mib", 0) + held,
                    "total_mib": g["memory_total_mib"]})
    print(json.dumps(out, indent=1))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("init")
    p.add_argument("--state-dir", required=True)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--total-mib", type=int, default=143771)
    p.add_argument("--reserved-mib", type=int, default=615)
    p.add_argument("--baseline-mib", type=int, default=0)
    p.add_argument("--release-delay", type=float, default=0.1)
    p.add_argument("--name", default="NVIDIA H200 (simulated)")
    p.add_argument("--force", action="store_true")
    p = sub.add_parser("hold")
    p.add_argument("--state-dir", required=True)
    p.add_argument("--gpu", type=int, action="append", required=True)
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--term-delay", type=float, default=0.0)
    p.add_argument("--children", type=int, default=0)
    p.add_argument("--child-mib", type=int)
    p.add_argument("--orphan", action="store_true")
    p.add_argument("--escape", action="store_true")
    p.add_argument("--management-client", action="store_true")
    p.add_argument("--comm")
    p.add_argument("--ready-file")
    p.add_argument("--tag", help="free text that only shows in the command line (e.g. vllm)")
    p = sub.add_parser("attach", help="running processes (e.g. a server's) hold simulated GPUs until they exit")
    p.add_argument("--state-dir", required=True)
    p.add_argument("--gpu", type=int, action="append", required=True)
    p.add_argument("--pid", type=int, action="append", required=True)
    p.add_argument("--mib", type=int, default=1024, help="held by each process on each GPU")
    p = sub.add_parser("idle")
    p.add_argument("--comm")
    p.add_argument("--tag", help="free text that only shows in the command line (e.g. vllm)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p = sub.add_parser("status")
    p.add_argument("--state-dir", required=True)
    p = sub.add_parser("set-gpu", help="set faults / fields of simulated GPUs (gpu_reset)")
    p.add_argument("--state-dir", required=True)
    p.add_argument("--gpu", type=int, action="append", help="GPU index (repeat); none: host fields only")
    p.add_argument("--health", choices=["ok", "unhealthy"])
    p.add_argument("--persistence", choices=["on", "off"])
    p.add_argument("--reset", choices=["ok", "unsupported", "busy", "unhealthy-after"],
                   help="what the next reset does")
    p.add_argument("--set", action="append", metavar="KEY=JSON",
                   help="any GPU field, e.g. remapped_rows_pending=true, nvlink_peers=[1], reset.count=0")
    p.add_argument("--host", action="append", metavar="KEY=JSON", help="state.json field, e.g. nvswitch=true")
    a = ap.parse_args(argv)
    return {"init": cmd_init, "hold": cmd_hold, "attach": cmd_attach, "idle": cmd_idle, "status": cmd_status,
            "set-gpu": cmd_set_gpu}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())

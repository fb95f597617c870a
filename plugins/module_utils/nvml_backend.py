# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""NVML backend: real GPUs through nvidia-ml-py, every call bounded in time (PRIVATE).

Why a worker process: an NVML call can hang in the kernel (D state) after some Xid errors
(NVIDIA/open-gpu-kernel-modules#1333).  A hung *thread* would keep the module's process,
and with it Ansible's stdout pipe, alive forever.  So all NVML calls run in a child
process (``python -c WORKER_SOURCE``) that speaks one JSON line per request on its stdin /
stdout; the parent waits for each answer with ``select`` and a deadline.  On a timeout the
worker is killed and abandoned (it is our own child, with its own pipes and no access to
Ansible's stdout), :class:`BackendTimeout` is raised, and later calls fail fast.

The worker is a bare NVML client: it holds the GPUs' device files but no context, and it is
part of the module's own process tree, so discovery never treats it as a drain target.

Memory uses the v2 API (``used`` excludes driver-reserved memory, 0 MiB on an idle H200).
When the driver lacks v2, v1 ``used`` (which includes reserved memory) is reported with
``api: v1``; then the idle figure is not knowable from NVML and callers should pass an
explicit baseline (``gpu_drain``'s ``memory_baseline_mib``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_backend import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    GpuBackend,
    classify_real_device_path,
)

try:
    import importlib.util
    # Only looked up here: pynvml is imported by the worker process, never by the module.
    HAS_PYNVML = importlib.util.find_spec("pynvml") is not None
except (ImportError, ValueError):
    HAS_PYNVML = False

# The worker: self-contained (stdlib + pynvml), run with ``python -c``.  Unit tests exec it
# with a fake pynvml and call handle() directly.
WORKER_SOURCE = r'''
import json, sys

MIB = 1024 * 1024


def _s(v):
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return v


class Worker(object):
    def __init__(self, nv):
        self.nv = nv
        self.handles = {}
        self.count = None

    def h(self, i):
        if i not in self.handles:
            self.handles[i] = self.nv.nvmlDeviceGetHandleByIndex(i)
        return self.handles[i]

    def opt(self, fn, *a):
        """Call fn, returning None where the device does not support it."""
        try:
            return fn(*a)
        except self.nv.NVMLError:
            return None

    def mem(self, i):
        nv = self.nv
        h = self.h(i)
        try:
            m = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
            return {"total_mib": int(m.total // MIB), "used_mib": int(m.used // MIB),
                    "reserved_mib": int(m.reserved // MIB), "free_mib": int(m.free // MIB), "api": "v2"}
        except (nv.NVMLError, AttributeError, TypeError):
            m = nv.nvmlDeviceGetMemoryInfo(h)
            return {"total_mib": int(m.total // MIB), "used_mib": int(m.used // MIB),
                    "reserved_mib": None, "free_mib": int(m.free // MIB), "api": "v1"}

    def procs(self, i):
        nv = self.nv
        h = self.h(i)
        out = []
        for kind, name in (("compute", "nvmlDeviceGetComputeRunningProcesses"),
                           ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
                           ("mps", "nvmlDeviceGetMPSComputeRunningProcesses")):
            fn = getattr(nv, name, None)
            if fn is None:
                continue
            try:
                lst = fn(h)
            except nv.NVMLError:
                continue
            for p in lst or []:
                used = getattr(p, "usedGpuMemory", None)
                out.append({"pid": int(p.pid), "type": kind,
                            "used_mib": None if used is None else int(used // MIB)})
        return out

    def gpu(self, i):
        nv = self.nv
        h = self.h(i)
        mig = self.opt(nv.nvmlDeviceGetMigMode, h)
        rr = self.opt(nv.nvmlDeviceGetRemappedRows, h)
        rp = self.opt(nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
        pm = self.opt(nv.nvmlDeviceGetPersistenceMode, h)
        pci = self.opt(nv.nvmlDeviceGetPciInfo, h)
        return {
            "index": i,
            "uuid": _s(nv.nvmlDeviceGetUUID(h)),
            "name": _s(self.opt(nv.nvmlDeviceGetName, h)),
            "minor": self.opt(nv.nvmlDeviceGetMinorNumber, h),
            "pci_bus_id": _s(getattr(pci, "busId", None)) if pci is not None else None,
            "persistence_mode": None if pm is None else bool(pm),
            "mig_mode": None if mig is None else bool(mig[0]),
            "mig_mode_pending": None if mig is None else bool(mig[1]),
            "retired_pages_pending": None if rp is None else bool(rp),
            "remapped_rows_pending": None if rr is None else bool(rr[2]),
            "remapped_rows_failure": None if rr is None else bool(rr[3]),
            "remapped_rows_correctable": None if rr is None else int(rr[0]),
            "remapped_rows_uncorrectable": None if rr is None else int(rr[1]),
            "memory": self.mem(i),
        }

    def handle(self, req):
        op = req.get("op")
        nv = self.nv
        if op == "init":
            nv.nvmlInit()
            self.count = int(nv.nvmlDeviceGetCount())
            return {"count": self.count,
                    "driver_version": _s(self.opt(nv.nvmlSystemGetDriverVersion)),
                    "nvml_version": _s(self.opt(nv.nvmlSystemGetNVMLVersion))}
        if op == "gpus":
            return [self.gpu(i) for i in range(self.count)]
        if op == "poll":
            idx = req.get("indices") or []
            return {"memory": dict((str(i), self.mem(i)) for i in idx),
                    "processes": dict((str(i), self.procs(i)) for i in idx)}
        if op == "shutdown":
            try:
                nv.nvmlShutdown()
            except Exception:
                pass
            return True
        raise ValueError("unknown op %r" % (op,))


def main():
    try:
        import pynvml as nv
    except ImportError as e:
        sys.stdout.write(json.dumps({"ok": False, "error": "import pynvml: %s" % e, "kind": "import"}) + "\n")
        sys.stdout.flush()
        return
    w = Worker(nv)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            res = {"ok": True, "result": w.handle(req)}
        except Exception as e:  # report every NVML / programming error to the parent
            res = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
        sys.stdout.write(json.dumps(res) + "\n")
        sys.stdout.flush()
        if req.get("op") == "shutdown":
            return


if __name__ == "__main__":
    main()
'''


class NvmlBackend(GpuBackend):
    """GPU access through NVML in a bounded worker process (see module docstring)."""

    name = "nvml"

    def __init__(self, timeout=10.0, worker_argv=None, python=None):
        if not HAS_PYNVML and worker_argv is None:
            raise BackendUnavailable("nvidia-ml-py (pynvml) is not installed", missing_lib="nvidia-ml-py")
        self.timeout = float(timeout)
        self._dead = None
        self._buf = b""
        argv = worker_argv or [python or sys.executable, "-c", WORKER_SOURCE]
        env = dict(os.environ)
        env.pop("PYTHONSTARTUP", None)
        try:
            # not run_command: a long-lived worker spoken to over its pipes, killed on a deadline
            self.proc = subprocess.Popen(  # pylint: disable=ansible-bad-function
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                close_fds=True, env=env)
        except OSError as e:
            raise BackendUnavailable("cannot start the NVML worker: %s" % e)
        info = self._call({"op": "init"}, unavailable_on_error=True)
        self.count = info["count"]
        self._driver = {"backend": self.name, "driver_version": info.get("driver_version"),
                        "nvml_version": info.get("nvml_version")}
        self._gpus = None

    @property
    def worker_pid(self):
        return self.proc.pid

    def _readline(self, deadline):
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackendTimeout("NVML did not answer within %.1f s" % self.timeout)
            r = select.select([fd], [], [], left)[0]
            if not r:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise BackendError("the NVML worker exited unexpectedly (rc=%s)" % self.proc.poll())
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def _abandon(self):
        try:
            self.proc.send_signal(signal.SIGKILL)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass  # stuck in the kernel: leave it, its pipes are ours alone

    def _call(self, req, unavailable_on_error=False):
        if self._dead:
            raise BackendTimeout(self._dead)
        deadline = time.monotonic() + self.timeout
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            line = self._readline(deadline)
        except BackendTimeout as e:
            self._dead = "NVML hung earlier in this run (%s); no further NVML calls made" % e
            self._abandon()
            raise
        except (OSError, BackendError) as e:
            self._dead = str(e)
            self._abandon()
            if unavailable_on_error:
                raise BackendUnavailable("NVML is not usable: %s" % e)
            raise BackendError(str(e))
        try:
            res = json.loads(line)
        except ValueError:
            raise BackendError("malformed answer from the NVML worker: %r" % line[:200])
        if not res.get("ok"):
            err = res.get("error", "unknown error")
            if res.get("kind") == "import":
                self._dead = err
                raise BackendUnavailable("nvidia-ml-py (pynvml) is not importable: %s" % err,
                                         missing_lib="nvidia-ml-py")
            if unavailable_on_error:
                self._dead = err
                self._abandon()
                raise BackendUnavailable("NVML is not usable (no driver or no GPU?): %s" % err)
            raise BackendError("NVML error: %s" % err)
        return res["result"]

    # --- interface ---------------------------------------------------------------------
    def gpus(self):
        self._gpus = self._call({"op": "gpus"})
        return [dict(g) for g in self._gpus]

    def poll(self, indices):
        res = self._call({"op": "poll", "indices": [int(i) for i in indices]})
        mem = dict((int(k), v) for k, v in res["memory"].items())
        procs = dict((int(k), v) for k, v in res["processes"].items())
        return mem, procs

    def classify_device_path(self, path):
        return classify_real_device_path(path)

    def idle_used_mib(self, index):
        # NVML v2: used excludes driver-reserved memory and is 0 on an idle GPU.
        return 0

    def driver(self):
        return dict(self._driver)

    # --- gpu_reset hooks (issue 4): nvidia-smi argv lists with a timeout, see nvidia_smi.py.
    # Close this backend first: its NVML worker is a client that makes the reset "in use".
    def reset_gpus(self, indices, timeout=120.0):
        from ansible_collections.gpuflow.eagle3.plugins.module_utils.nvidia_smi import nvidia_smi_reset, smi_ids
        return nvidia_smi_reset(smi_ids(self, indices), timeout)

    def reset_gpu(self, index):
        return self.reset_gpus([index])

    def set_persistence_mode(self, index, enabled):
        from ansible_collections.gpuflow.eagle3.plugins.module_utils.nvidia_smi import nvidia_smi_persistence, smi_ids
        return nvidia_smi_persistence(smi_ids(self, [index])[0], enabled, min(self.timeout * 2, 60.0))

    def close(self):
        if self._dead is None and self.proc.poll() is None:
            try:
                self._call({"op": "shutdown"})
            except BackendError:
                pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                self._abandon()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Simulated GPU backend driven by a state directory (PRIVATE to gpuflow.eagle3).

The state directory is created and populated by ``tools/gpu_sim.py`` (stdlib + psutil only,
so it can be copied into containers).  Layout (format 1)::

    <state>/state.json          {"format": 1, "gpu_count": N, "release_delay_s": 0.1}
    <state>/gpus/<index>.json   one per GPU, see GPU_FIELDS below
    <state>/dev/nvidia<minor>   per-GPU "device nodes" (regular files) that holders keep open
    <state>/dev/nvidiactl, <state>/dev/nvidia-uvm, <state>/dev/nvidia-caps/nvidia-cap1
                                host-wide nodes
    <state>/holders/<pid>.json  memory registry: {"pid", "create_time", "gpus": {"<index>": mib},
                                "context": bool, "dead_since": float|null}

Behaviour, following FIELD_NOTES.md (measured on an H200):

* a holder's memory counts while its process is alive (same PID *and* create time, not a
  zombie); an ignored SIGTERM therefore keeps the memory, and so do orphans;
* once the process is gone, it leaves the driver's process list at once, but its memory is
  released only ``release_delay_s`` (0.1 s) after the first reader noticed the exit, as on
  a real GPU, where the memory lags the exit; the record is then deleted;
* ``stuck_used_mib`` of a GPU is memory held with no process at all (as after a driver fault):
  counted as used until a successful reset clears it;
* a management client opens the device files but registers no memory and no context, so it
  is absent from :meth:`processes`, as bare NVML clients are on real hardware.

Per-GPU JSON fields (``GPU_FIELDS``) include what a reset simulation (issue 4) needs:
``persistence_mode``, ``mig_mode``, ``retired_pages_pending``, ``remapped_rows_pending``,
``remapped_rows_failure``, ``health`` (``ok``/``unhealthy``) and ``reset``:
``{"supported": bool, "busy": bool, "unhealthy_after_reset": bool, "count": int}``.
:meth:`SimulatedBackend.read_gpu_state` / :meth:`SimulatedBackend.update_gpu_state` read and
atomically rewrite that file.
"""

from __future__ import annotations

import json
import os
import time

from ansible_collections.gpuflow.eagle3.plugins.module_utils import holders as H
from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_backend import (
    BackendError,
    BackendUnavailable,
    GpuBackend,
)

try:
    import psutil
    HAS_PSUTIL = True
except ImportError:  # pragma: no cover - psutil is a controller requirement
    psutil = None
    HAS_PSUTIL = False

FORMAT = 1
GPU_FIELDS = (
    "index", "uuid", "name", "minor", "pci_bus_id", "memory_total_mib", "memory_reserved_mib",
    "baseline_used_mib", "persistence_mode", "mig_mode", "retired_pages_pending",
    "remapped_rows_pending", "remapped_rows_failure", "health", "reset", "stuck_used_mib",
)
CREATE_TIME_TOLERANCE = 0.05


def _atomic_write_json(path, data):
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(data, f, sort_keys=True)
        f.flush()
    os.replace(tmp, path)


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def process_alive(pid, create_time):
    """True when ``pid`` runs and is the same process (create time) and not a zombie."""
    try:
        p = psutil.Process(int(pid))
        if abs(p.create_time() - float(create_time)) > CREATE_TIME_TOLERANCE:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError, TypeError):
        return False


class SimulatedBackend(GpuBackend):
    name = "simulated"

    def __init__(self, state_dir, clock=time.time):
        if not HAS_PSUTIL:
            raise BackendUnavailable("the simulated backend needs psutil", missing_lib="psutil")
        self.state_dir = os.path.realpath(state_dir)
        self.clock = clock
        state_file = os.path.join(self.state_dir, "state.json")
        if not os.path.isfile(state_file):
            raise BackendUnavailable(
                "simulated GPU state directory %s is not initialised (run tools/gpu_sim.py init)" % state_dir)
        try:
            self.state = _read_json(state_file)
        except (OSError, ValueError) as e:
            raise BackendError("cannot read %s: %s" % (state_file, e))
        if self.state.get("format") != FORMAT:
            raise BackendError("unsupported simulated state format %r" % self.state.get("format"))
        self.release_delay = float(self.state.get("release_delay_s", 0.1))
        self.dev_prefix = os.path.join(self.state_dir, "dev") + os.sep
        self._gpu_cache = None

    # --- per-GPU state (also used by gpu_reset simulation) ----------------------------
    def _gpu_path(self, index):
        return os.path.join(self.state_dir, "gpus", "%d.json" % int(index))

    def read_gpu_state(self, index):
        try:
            return _read_json(self._gpu_path(index))
        except (OSError, ValueError) as e:
            raise BackendError("cannot read simulated GPU %s: %s" % (index, e))

    def update_gpu_state(self, index, **fields):
        data = self.read_gpu_state(index)
        data.update(fields)
        _atomic_write_json(self._gpu_path(index), data)
        self._gpu_cache = None
        return data

    def _all_gpu_states(self):
        if self._gpu_cache is None:
            count = int(self.state.get("gpu_count", 0))
            self._gpu_cache = [self.read_gpu_state(i) for i in range(count)]
        return self._gpu_cache

    # --- memory registry ------------------------------------------------------------
    def _holder_records(self):
        """Live (or recently dead, not yet released) records, with garbage collection."""
        hdir = os.path.join(self.state_dir, "holders")
        out = []
        try:
            names = os.listdir(hdir)
        except OSError:
            return out
        now = self.clock()
        for n in names:
            if not n.endswith(".json"):
                continue
            path = os.path.join(hdir, n)
            try:
                rec = _read_json(path)
            except (OSError, ValueError):
                continue  # being written or removed
            rec["alive"] = process_alive(rec.get("pid"), rec.get("create_time"))
            if rec["alive"]:
                out.append(rec)
                continue
            dead_since = rec.get("dead_since")
            if dead_since is None:
                rec["dead_since"] = now
                try:
                    _atomic_write_json(path, rec)
                except OSError:
                    pass
                out.append(rec)
            elif now - float(dead_since) < self.release_delay:
                out.append(rec)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        return out

    # --- interface ---------------------------------------------------------------------
    def gpus(self):
        states = self._all_gpu_states()
        mem = self.memory([s["index"] for s in states])
        out = []
        for s in states:
            out.append({
                "index": s["index"],
                "uuid": s["uuid"],
                "name": s.get("name"),
                "minor": s.get("minor", s["index"]),
                "pci_bus_id": s.get("pci_bus_id"),
                "persistence_mode": s.get("persistence_mode"),
                "mig_mode": s.get("mig_mode"),
                "retired_pages_pending": s.get("retired_pages_pending"),
                "remapped_rows_pending": s.get("remapped_rows_pending"),
                "remapped_rows_failure": s.get("remapped_rows_failure"),
                "memory": mem[s["index"]],
            })
        return out

    def poll(self, indices):
        states = {s["index"]: s for s in self._all_gpu_states()}
        recs = self._holder_records()
        mem = {}
        procs = {}
        for i in indices:
            if i not in states:
                raise BackendError("no simulated GPU with index %s" % i)
            s = states[i]
            held = 0
            plist = []
            for r in recs:
                mib = r.get("gpus", {}).get(str(i))
                if mib is None:
                    continue
                held += int(mib)
                if r.get("context", True) and r["alive"]:
                    plist.append({"pid": int(r["pid"]), "used_mib": int(mib), "type": "compute"})
            total = int(s["memory_total_mib"])
            reserved = int(s.get("memory_reserved_mib", 0))
            used = int(s.get("baseline_used_mib", 0)) + int(s.get("stuck_used_mib", 0)) + held
            mem[i] = {"total_mib": total, "used_mib": used, "reserved_mib": reserved,
                      "free_mib": max(total - reserved - used, 0), "api": "v2"}
            procs[i] = plist
        return mem, procs

    def classify_device_path(self, path):
        if not path.startswith(self.dev_prefix):
            return None
        rest = path[len(self.dev_prefix):]
        if rest.startswith("nvidia") and rest[6:].isdigit():
            return ("gpu", int(rest[6:]))
        if rest in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset") or rest.startswith("nvidia-caps/"):
            return ("hostwide", path)
        return None

    def idle_used_mib(self, index):
        for s in self._all_gpu_states():
            if s["index"] == index:
                return int(s.get("baseline_used_mib", 0))
        raise BackendError("no simulated GPU with index %s" % index)

    # --- gpu_reset hooks (issue 4): the simulation's rules are simulate_reset below ----
    def reset_gpus(self, indices, timeout=None):
        return simulate_reset(self, [int(i) for i in indices])

    def reset_gpu(self, index):
        return self.reset_gpus([index])

    def set_persistence_mode(self, index, enabled):
        return simulate_persistence(self, int(index), enabled)

    def driver(self):
        return {"backend": self.name, "driver_version": "simulated", "nvml_version": None,
                "state_dir": self.state_dir}


def simulate_reset(backend, indices, proc_root="/proc"):
    """What the simulated backend does for ``reset_gpus``: follows nvidia-smi's rules.

    Refused (``busy``) while persistence mode is on, while any process holds one of the
    GPUs' device nodes, or when the GPU's ``reset.busy`` fault is set; ``unsupported`` when
    ``reset.supported`` is false.  The whole group fails together, as one nvidia-smi command
    does.  A successful reset clears health faults, pending retired pages / remapped rows and
    memory held with no process, and applies pending ECC / MIG modes, unless
    ``reset.unhealthy_after_reset`` is set.
    """
    t = time.monotonic()
    states = dict((i, backend.read_gpu_state(i)) for i in indices)
    fds, dummy = H.scan_device_fds(backend.classify_device_path, proc_root)
    minors = dict((s.get("minor", i), i) for i, s in states.items())
    lines = []
    outcome = "ok"
    for i, s in sorted(states.items()):
        bus = s.get("pci_bus_id") or str(i)
        r = s.get("reset") or {}
        holders = sorted(pid for pid, f in fds.items() if any(m in minors for m in f["gpus"])
                         and any(minors[m] == i for m in f["gpus"] if m in minors))
        if r.get("supported", True) is False:
            lines.append("GPU %s: Resetting GPU is not supported on this device." % bus)
            outcome = "unsupported" if outcome == "ok" else outcome
        elif s.get("persistence_mode"):
            lines.append("GPU %s: In use by another client (persistence mode is enabled)" % bus)
            outcome = "busy" if outcome in ("ok", "unsupported") else outcome
        elif holders:
            lines.append("GPU %s: In use by another client (PIDs %s)" % (bus, ", ".join(str(p) for p in holders)))
            outcome = "busy" if outcome in ("ok", "unsupported") else outcome
        elif r.get("busy"):
            lines.append("GPU %s: In use by another client" % bus)
            outcome = "busy" if outcome in ("ok", "unsupported") else outcome
    if outcome == "ok":
        for i, s in sorted(states.items()):
            r = dict(s.get("reset") or {})
            r["count"] = int(r.get("count", 0)) + 1
            fields = {"reset": r}
            if not r.get("unhealthy_after_reset"):
                fields.update({"health": "ok", "retired_pages_pending": False if s.get("retired_pages_pending") is not None else None,
                               "remapped_rows_pending": False, "stuck_used_mib": 0})
                if s.get("ecc_mode_pending") is not None:
                    fields["ecc_mode_current"] = s.get("ecc_mode_pending")
                if s.get("mig_mode_pending") is not None:
                    fields["mig_mode"] = s.get("mig_mode_pending")
            backend.update_gpu_state(i, **fields)
            lines.append("GPU %s was successfully reset." % (s.get("pci_bus_id") or i))
        rc = 0
    else:
        lines.append("The following GPUs could not be reset:")
        rc = {"busy": 255, "unsupported": 3}.get(outcome, 255)
    return {"rc": rc, "stdout": "\n".join(lines), "stderr": "", "timed_out": False,
            "duration_s": round(time.monotonic() - t, 4), "outcome": outcome,
            "argv": ["simulated", "--gpu-reset", "-i", ",".join(str(i) for i in indices)]}


def simulate_persistence(backend, index, enabled):
    backend.update_gpu_state(index, persistence_mode=bool(enabled))
    return {"rc": 0, "stdout": "", "stderr": "", "timed_out": False, "duration_s": 0.0, "outcome": "ok",
            "argv": ["simulated", "-i", str(index), "-pm", "1" if enabled else "0"]}

# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""GPU backend interface and backend selection (PRIVATE to gpuflow.eagle3).

Note that this module util is private to the collection: it can change at any time.

Every GPU-facing module of the collection (``gpu_info``, ``gpu_drain``, and later
``gpu_reset``) talks to GPUs only through a :class:`GpuBackend`.  Two implementations exist:

``nvml`` (:mod:`.nvml_backend`)
    Real GPUs through nvidia-ml-py.  Every NVML call runs in a worker *process* and is
    bounded in time (``timeout``); a driver call that hangs raises :class:`BackendTimeout`
    and the worker is abandoned, so the module itself never hangs.

``simulated`` (:mod:`.simulated_backend`)
    A state directory per host (see ``tools/gpu_sim.py`` for the holder program and the
    on-disk format).  Holders are real processes that keep simulated device files open, so
    the ``/proc/*/fd`` scan of :mod:`.holders` finds them exactly as on real hardware.

The interface is deliberately small and returns plain data (dicts, lists, ints), so the
logic in :mod:`.holders` and :mod:`.drain` is the same for both backends:

``gpus() -> list[dict]``
    Static and slow-changing facts for every GPU, ordered by index.  Keys (all present,
    ``None`` when the device cannot tell): ``index`` (int), ``uuid`` (str), ``name``,
    ``minor`` (int: the N of the per-GPU device node ``nvidiaN``), ``pci_bus_id``,
    ``persistence_mode`` (bool), ``mig_mode`` (bool: current mode enabled),
    ``retired_pages_pending`` (bool), ``remapped_rows_pending`` (bool),
    ``remapped_rows_failure`` (bool), ``memory`` (see ``memory()``).
``memory(indices) -> dict[int, dict]``
    ``{index: {"total_mib", "used_mib", "reserved_mib", "free_mib", "api"}}``; ``used_mib``
    excludes driver-reserved memory (NVML v2 semantics, ``api == "v2"``; with only v1,
    ``used - reserved`` is reported and ``api == "v1"``).
``processes(indices) -> dict[int, list[dict]]``
    What the driver itself says holds a context on each GPU:
    ``{"pid": int (as the driver reports it: host PID), "used_mib": int|None,
    "type": "compute"|"graphics"|"mps"}``.  PIDs are *not* validated here (bindings have
    returned 0 and 4294967295): :mod:`.holders` validates them.
``poll(indices) -> (memory, processes)``
    Both of the above in one round trip: what the drain loop calls every poll interval.
``classify_device_path(path) -> tuple|None``
    Maps the target of a ``/proc/PID/fd`` link to ``("gpu", minor)`` for a per-GPU node or
    ``("hostwide", path)`` for nvidiactl / nvidia-uvm / nvidia-caps / nvidia-modeset;
    ``None`` for anything else.
``idle_used_mib(index) -> int``
    The ``used_mib`` of this GPU when nothing holds it (0 with NVML v2 on an H200; the
    configured baseline in the simulation).
``driver() -> dict``
    ``{"backend": name, "driver_version": str|None, "nvml_version": str|None}``.
``close()``
    Release resources (stop the NVML worker).  Backends are also context managers.

Hooks for ``gpu_reset`` (issue 4) are declared here and raise :class:`BackendUnsupported`
until implemented: ``reset_gpu(index)``, ``set_persistence_mode(index, enabled)``.  The
simulated backend stores the fields a reset simulation needs in its per-GPU JSON (see
:mod:`.simulated_backend`), and exposes ``read_gpu_state(index)`` /
``update_gpu_state(index, **fields)`` for that work.
"""

from __future__ import annotations

import math
import os

SIM_STATE_ENV = "GPUFLOW_GPU_SIM_STATE_DIR"
BACKEND_ENV = "GPUFLOW_GPU_BACKEND"


class BackendError(Exception):
    """A backend could not answer (driver missing, NVML error, bad state directory)."""


class BackendTimeout(BackendError):
    """A backend call did not answer within its time bound (hung driver)."""


class BackendUnavailable(BackendError):
    """No usable backend (no NVML library / driver, no simulated state)."""

    def __init__(self, msg, missing_lib=None):
        super().__init__(msg)
        self.missing_lib = missing_lib


class BackendUnsupported(BackendError):
    """The backend does not implement this operation."""


class GpuBackend(object):
    """Base class: see the module docstring for the contract of each method."""

    name = "base"

    def gpus(self):
        raise NotImplementedError

    def poll(self, indices):
        raise NotImplementedError

    def memory(self, indices):
        return self.poll(indices)[0]

    def processes(self, indices):
        return self.poll(indices)[1]

    def classify_device_path(self, path):
        raise NotImplementedError

    def idle_used_mib(self, index):
        return 0

    def driver(self):
        return {"backend": self.name, "driver_version": None, "nvml_version": None}

    # --- hooks for gpu_reset (issue 4) ---------------------------------------------
    def reset_gpu(self, index):
        raise BackendUnsupported("reset is not implemented by the %s backend" % self.name)

    def set_persistence_mode(self, index, enabled):
        raise BackendUnsupported("persistence mode is not implemented by the %s backend" % self.name)

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def classify_real_device_path(path):
    """Classify a ``/proc/PID/fd`` link target against the real ``/dev/nvidia*`` nodes."""
    if not path.startswith("/dev/nvidia"):
        return None
    rest = path[len("/dev/nvidia"):]
    if rest.isdigit():
        return ("gpu", int(rest))
    if rest in ("ctl", "-uvm", "-uvm-tools", "-modeset") or rest.startswith("-caps/") or rest.startswith("-caps-imex-channels/"):
        return ("hostwide", path)
    return None


def select_backend(backend="auto", sim_state_dir=None, timeout=10.0, env=None):
    """Return an open :class:`GpuBackend`.

    ``backend`` is ``auto``, ``nvml`` or ``simulated``.  ``auto`` picks ``simulated`` when
    ``sim_state_dir`` (or the environment variable ``GPUFLOW_GPU_SIM_STATE_DIR``) names a
    state directory, else ``nvml``.  ``GPUFLOW_GPU_BACKEND`` overrides ``auto``.
    Raises :class:`BackendUnavailable` with a clear message when nothing usable exists.
    """
    why = bad_number("nvml_timeout", timeout, above=True)
    if why:
        raise BackendUnavailable(why)
    env = os.environ if env is None else env
    state_dir = sim_state_dir or env.get(SIM_STATE_ENV) or None
    if backend == "auto":
        backend = env.get(BACKEND_ENV) or ("simulated" if state_dir else "nvml")
    if backend == "simulated":
        if not state_dir:
            raise BackendUnavailable(
                "backend=simulated needs sim_state_dir (or %s) naming a state directory "
                "created by tools/gpu_sim.py init" % SIM_STATE_ENV)
        from ansible_collections.gpuflow.eagle3.plugins.module_utils.simulated_backend import SimulatedBackend
        return SimulatedBackend(state_dir)
    if backend == "nvml":
        from ansible_collections.gpuflow.eagle3.plugins.module_utils.nvml_backend import NvmlBackend
        return NvmlBackend(timeout=timeout)
    raise BackendUnavailable("unknown backend %r (expected auto, nvml or simulated)" % (backend,))


def backend_argument_spec():
    """The options of the ``gpuflow.eagle3.gpu_backend`` doc fragment."""
    return dict(
        backend=dict(type="str", default="auto", choices=["auto", "nvml", "simulated"]),
        sim_state_dir=dict(type="path"),
        nvml_timeout=dict(type="float", default=15.0),
    )


def open_backend_for_module(module):
    """Open the backend a module asked for, or ``fail_json`` with a clear message."""
    from ansible.module_utils.basic import missing_required_lib

    p = module.params
    try:
        return select_backend(p["backend"], p.get("sim_state_dir"), timeout=p["nvml_timeout"])
    except BackendUnavailable as e:
        if e.missing_lib:
            module.fail_json(msg="%s. %s" % (missing_required_lib(e.missing_lib), e))
        module.fail_json(msg="no usable GPU backend: %s" % e)
    except BackendError as e:
        module.fail_json(msg="GPU backend error: %s" % e)


def resolve_gpu_spec(spec, gpus):
    """Map ``spec`` (``all``, indices, UUIDs; ints or strings) to sorted GPU indices; ValueError when unknown.

    Shared by gpu_drain and gpu_reset (here, so that gpu_reset does not load the drain logic for it)."""
    by_index = dict((g["index"], g) for g in gpus)
    by_uuid = dict((str(g["uuid"]).lower(), g["index"]) for g in gpus if g.get("uuid"))
    out = set()
    for item in spec or ["all"]:
        s = str(item).strip()
        if s.lower() == "all":
            out.update(by_index)
            continue
        if s.isdigit():
            if int(s) not in by_index:
                raise ValueError("unknown GPU index %s (this host has %s)" % (s, sorted(by_index) or "no GPUs"))
            out.add(int(s))
            continue
        key = s.lower()
        if key in by_uuid:
            out.add(by_uuid[key])
            continue
        if "gpu-" + key in by_uuid:
            out.add(by_uuid["gpu-" + key])
            continue
        raise ValueError("unknown GPU %r: not an index or UUID of this host" % s)
    return sorted(out)


def bad_number(name, value, minimum=0.0, above=False, maximum=None):
    """Why option ``name`` is not a usable number of seconds, or None: finite, at least ``minimum`` (more than
    it with ``above``), at most ``maximum``.

    Every module's timeouts and intervals pass here. Ansible's ``type: float`` accepts "nan" and "inf", and
    ``nan < 0`` is false: a bound alone lets NaN through, and a wait bounded by either never ends."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return "%s must be a number, not %r" % (name, value)
    if not math.isfinite(v):
        return "%s must be a finite number, not %s" % (name, value)
    if maximum is not None and not minimum <= v <= maximum:
        return "%s must be between %g and %g seconds" % (name, minimum, maximum)
    if v < minimum or (above and v == minimum):
        return "%s must be %s %g" % (name, ">" if above else ">=", minimum)
    return None

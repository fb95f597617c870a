# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The host's GPU state file: its one reader and its one writer (PRIVATE to gpuflow.eagle3).

A JSON object shared by ``gpu_drain`` and ``gpu_reset`` (default ``/var/lib/gpuflow/gpu_state.json``):
``drain`` (``drained``, ``since``, ``services_stopped``, ``gpus``: what a drain stopped, for a later
restore) and ``reset`` (``needs_power_cycle``, ``since``, ``verdict``).  The ``gpu_drain`` module and
:mod:`.host_reset` both record a drain through :func:`write_drain_record`.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile


def now_iso():
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def read_state_file(path):
    """The roles' host state file as a dict; {} when missing.  ValueError when not a JSON object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ValueError(str(e))
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def write_state_file(path, state):
    """Replace the state file atomically (root-owned 0644 in a 0755 directory, as the roles wrote it)."""
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.makedirs(directory, 0o755)
    fd, tmp = tempfile.mkstemp(prefix=".gpu_state.", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(state, indent=4, sort_keys=True) + "\n")
        os.chmod(tmp, 0o644)
        os.rename(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def record_drain(state, drain_result, stopped):
    """The state with this drain added to its ``drain`` record (services and GPUs accumulate)."""
    prev = state.get("drain") or {}
    new = dict(state)
    new["drain"] = {
        "drained": True,
        "since": prev.get("since") or now_iso(),
        "services_stopped": unique(list(prev.get("services_stopped") or []) + stopped),
        "gpus": sorted(unique(list(prev.get("gpus") or []) + list(drain_result.get("targets") or []))),
    }
    return new


def unique(items):
    seen = []
    for x in items:
        if x not in seen:
            seen.append(x)
    return seen


def write_drain_record(path, state, drain_result, stopped):
    """Add this drain to the state file's drain record; returns the state as written."""
    state = record_drain(state, drain_result, stopped)
    write_state_file(path, state)
    return state

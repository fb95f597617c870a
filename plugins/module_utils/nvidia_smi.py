# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""nvidia-smi commands for GPU reset, and the bounded runner they use (PRIVATE to gpuflow.eagle3).

The nvml backend's reset hooks (:mod:`.nvml_backend`) and the platform probe
(:mod:`.gpu_platform`) run their commands here: argv lists, never a shell, each with a hard
deadline.  Kept apart from :mod:`.gpu_reset` so that a module that only opens a backend does
not carry the reset logic.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time


def run_argv(argv, timeout, env=None):
    """Run ``argv`` (a list, never a shell) with a hard time bound.

    Returns ``{"rc", "stdout", "stderr", "timed_out", "duration_s"}``.  On timeout the child
    gets SIGKILL and is waited for at most 2 s more (a child stuck in the kernel is left
    behind rather than hanging the module).
    """
    t = time.monotonic()
    try:
        # not run_command: no AnsibleModule here, and the child needs a hard deadline and SIGKILL
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,  # pylint: disable=ansible-bad-function
                                stdin=subprocess.DEVNULL, close_fds=True, env=env)
    except OSError as e:
        return {"rc": 127, "stdout": "", "stderr": str(e), "timed_out": False, "duration_s": 0.0}
    out, err = [], []
    fds = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    deadline = t + float(timeout)
    timed_out = False
    while fds:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        r = select.select(list(fds), [], [], left)[0]
        for fd in r:
            chunk = os.read(fd, 65536)
            if chunk:
                fds[fd].append(chunk)
            else:
                del fds[fd]
    if timed_out:
        try:
            proc.send_signal(signal.SIGKILL)
        except OSError:
            pass
    try:
        rc = proc.wait(timeout=2.0 if timed_out else max(deadline - time.monotonic(), 0) + 2.0)
    except subprocess.TimeoutExpired:
        rc = None
    for f in (proc.stdout, proc.stderr):
        try:
            f.close()
        except OSError:
            pass
    return {"rc": 124 if timed_out else rc, "stdout": b"".join(out).decode("utf-8", "replace"),
            "stderr": b"".join(err).decode("utf-8", "replace"), "timed_out": timed_out,
            "duration_s": round(time.monotonic() - t, 4)}


def classify_smi_reset(res):
    """Map an ``nvidia-smi --gpu-reset`` result to an outcome.

    nvidia-smi exit codes: 0 success, 3 operation not available on the device, 4 no
    permission, 255 other errors ("In use by another client" among them).
    """
    text = ((res.get("stdout") or "") + "\n" + (res.get("stderr") or "")).lower()
    if res.get("timed_out"):
        return "failed"
    if res.get("rc") == 0 and "could not be reset" not in text:
        return "ok"
    if "in use by another client" in text or "is currently in use" in text or "in use by" in text:
        return "busy"
    if res.get("rc") == 3 or "not supported" in text or "is not available" in text:
        return "unsupported"
    return "failed"


def smi_ids(backend, indices):
    """UUIDs for ``nvidia-smi -i`` (unambiguous), indices when the UUID is unknown."""
    by_index = dict((g["index"], g) for g in (getattr(backend, "_gpus", None) or []))
    out = []
    for i in indices:
        u = (by_index.get(i) or {}).get("uuid")
        out.append(str(u) if u else str(int(i)))
    return out


def nvidia_smi_reset(ids, timeout, runner=run_argv, smi="nvidia-smi"):
    """One ``nvidia-smi --gpu-reset -i a,b,c`` for GPUs that must reset together."""
    argv = [smi, "--gpu-reset", "-i", ",".join(ids)]
    res = runner(argv, timeout)
    res["argv"] = argv
    res["outcome"] = classify_smi_reset(res)
    return res


def nvidia_smi_persistence(gpu_id, enabled, timeout, runner=run_argv, smi="nvidia-smi"):
    argv = [smi, "-i", str(gpu_id), "-pm", "1" if enabled else "0"]
    res = runner(argv, timeout)
    res["argv"] = argv
    res["outcome"] = "ok" if res["rc"] == 0 else "failed"
    return res

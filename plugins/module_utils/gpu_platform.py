# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the reset rules need to know of the platform, and the NVLink reset groups (PRIVATE to gpuflow.eagle3).

:func:`platform_info` gathers, per GPU, the architecture, NVLink peers, ECC / MIG pending modes and
virtualization (from the simulated state, or from an out-of-process NVML probe), whether an NVSwitch
fabric is present and whether Fabric Manager runs.  :func:`nvlink_groups` turns those facts into reset
groups under NVIDIA's NVLink rules.

NVLink rules implemented (NVIDIA's nvidia-smi documentation, ``-r``):

* Pre-Ampere GPUs (Volta, Turing, Pascal...) with NVLink: a GPU and all its NVLink peers must
  be reset in the same command: the group is the peer closure.
* Ampere with NVSwitch: individual reset needs Fabric Manager running; with FM running each
  GPU is its own group and FM is kept running; without FM every GPU on the fabric is reset
  together.
* Ampere without NVSwitch (direct NVLink bridges), Hopper and later (NVSwitch or not):
  individual reset; Fabric Manager is not a prerequisite and is left as it is
  (``fabric_manager=stop`` stops and restores it; ``keep`` never touches it).
* Unknown architecture with NVLink peers: treated like pre-Ampere (the safe reading).
* When the closure reaches GPUs the caller did not choose: ``nvlink_peers=expand`` adds them
  (they are checked for holders like the others), ``fail`` blocks the group.
"""

from __future__ import annotations

import json
import os
import sys

from ansible_collections.gpuflow.eagle3.plugins.module_utils.nvidia_smi import run_argv

ARCH_NAMES = {2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing", 7: "ampere",
              8: "ada", 9: "hopper", 10: "blackwell"}
ARCH_RANK = dict((v, k) for k, v in ARCH_NAMES.items())
FABRIC_MANAGER_UNITS = ["nvidia-fabricmanager.service", "nv-fabricmanager.service"]

# Run with ``python -c`` (out of process, bounded in time like every NVML call here).
PROBE_SOURCE = r'''
import json, os, sys
try:
    import pynvml as nv
except ImportError as e:
    print(json.dumps({"error": "import pynvml: %s" % e})); sys.exit(0)

def s(v):
    return v.decode() if isinstance(v, bytes) else v

def norm(b):
    b = s(b).lower()
    return b[-12:] if len(b) >= 12 else b

out = {"gpus": {}}
try:
    nv.nvmlInit()
    n = nv.nvmlDeviceGetCount()
    hs = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
    bus = {}
    for i, h in enumerate(hs):
        try:
            bus[norm(nv.nvmlDeviceGetPciInfo(h).busId)] = i
        except nv.NVMLError:
            pass
    maxl = getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)
    for i, h in enumerate(hs):
        d = {"arch_code": None, "ecc_mode_current": None, "ecc_mode_pending": None,
             "mig_mode_pending": None, "virtualization_mode": None, "nvlink_peers": [],
             "nvlink_remote": []}
        for key, fn in (("arch_code", "nvmlDeviceGetArchitecture"), ("virtualization_mode", "nvmlDeviceGetVirtualizationMode")):
            try:
                d[key] = int(getattr(nv, fn)(h))
            except (nv.NVMLError, AttributeError):
                pass
        try:
            cur, pend = nv.nvmlDeviceGetEccMode(h)
            d["ecc_mode_current"], d["ecc_mode_pending"] = bool(cur), bool(pend)
        except nv.NVMLError:
            pass
        try:
            cur, pend = nv.nvmlDeviceGetMigMode(h)
            d["mig_mode_pending"] = bool(pend)
        except nv.NVMLError:
            pass
        peers, remote = set(), set()
        for link in range(maxl):
            try:
                if not nv.nvmlDeviceGetNvLinkState(h, link):
                    continue
                fn = getattr(nv, "nvmlDeviceGetNvLinkRemotePciInfo_v2", None) or nv.nvmlDeviceGetNvLinkRemotePciInfo
                b = norm(fn(h, link).busId)
            except nv.NVMLError:
                continue
            if b in bus and bus[b] != i:
                peers.add(bus[b])
            elif b not in bus:
                remote.add(b)
        d["nvlink_peers"], d["nvlink_remote"] = sorted(peers), sorted(remote)
        out["gpus"][str(i)] = d
    nv.nvmlShutdown()
except Exception as e:
    out["error"] = "%s: %s" % (type(e).__name__, e)
print(json.dumps(out))
'''


def _nvswitch_present(root="/"):
    d = os.path.join(root, "proc", "driver", "nvidia-nvswitch", "devices")
    try:
        return bool(os.listdir(d))
    except OSError:
        return False


def probe_nvml(timeout, python=None, runner=run_argv):
    res = runner([python or sys.executable, "-c", PROBE_SOURCE], timeout)
    if res["rc"] != 0:
        return {"error": "platform probe failed (rc=%s%s): %s" % (
            res["rc"], ", timed out" if res.get("timed_out") else "", (res["stderr"] or "")[-300:])}
    try:
        return json.loads(res["stdout"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": "platform probe answered %r" % res["stdout"][:200]}


def platform_info(backend, gpus, systemd=None, fm_units=None, probe=None, timeout=30.0):
    """Facts the reset rules need, per GPU and for the host.

    ``{"nvswitch": bool, "fabric_manager": {"unit", "active"}|None, "gpus": {index:
    {"architecture", "arch_rank", "nvlink_peers", "ecc_mode_current", "ecc_mode_pending",
    "mig_mode_pending", "virtualization", "health"}}, "warnings": [...]}``
    """
    warnings = []
    out = {"nvswitch": False, "fabric_manager": None, "gpus": {}, "warnings": warnings}
    if backend.name == "simulated":
        state = dict(getattr(backend, "state", {}) or {})
        out["nvswitch"] = bool(state.get("nvswitch", False))
        for g in gpus:
            s = backend.read_gpu_state(g["index"])
            arch = s.get("architecture", "hopper")
            out["gpus"][g["index"]] = {
                "architecture": arch, "arch_rank": ARCH_RANK.get(arch),
                "nvlink_peers": sorted(int(x) for x in s.get("nvlink_peers", []) or []),
                "ecc_mode_current": s.get("ecc_mode_current", True),
                "ecc_mode_pending": s.get("ecc_mode_pending", s.get("ecc_mode_current", True)),
                "mig_mode_pending": s.get("mig_mode_pending", s.get("mig_mode")),
                "virtualization": s.get("virtualization", "none"),
                "health": s.get("health", "ok"),
            }
    else:
        raw = probe(timeout) if probe is not None else probe_nvml(timeout)
        if raw.get("error"):
            warnings.append("NVML platform probe: %s (NVLink peers and ECC state unknown)" % raw["error"])
        out["nvswitch"] = _nvswitch_present()
        virt = {0: "none", 1: "passthrough", 2: "vgpu", 3: "host_vgpu", 4: "host_vsga"}
        for g in gpus:
            d = (raw.get("gpus") or {}).get(str(g["index"])) or {}
            code = d.get("arch_code")
            arch = ARCH_NAMES.get(code, None if code is None else "unknown(%s)" % code)
            out["gpus"][g["index"]] = {
                "architecture": arch, "arch_rank": code if code in ARCH_NAMES else None,
                "nvlink_peers": sorted(int(x) for x in d.get("nvlink_peers", [])),
                "ecc_mode_current": d.get("ecc_mode_current"), "ecc_mode_pending": d.get("ecc_mode_pending"),
                "mig_mode_pending": d.get("mig_mode_pending"),
                "virtualization": virt.get(d.get("virtualization_mode"), d.get("virtualization_mode")),
                "health": None,
            }
            if d.get("nvlink_remote"):
                out["nvswitch"] = True  # links end on a device that is not a GPU: a switch
    if systemd is not None and systemd.booted():
        for u in fm_units or FABRIC_MANAGER_UNITS:
            st = unit_state(systemd, u)
            if st["load"] not in ("not-found", "", None):
                out["fabric_manager"] = {"unit": u, "active": st["active"] == "active"}
                break
    return out


def unit_state(systemd, unit):
    rc, props = systemd.load_state(unit)
    return {"load": props.get("LoadState"), "active": props.get("ActiveState")}


def nvlink_groups(selected, plat, fm_active, peers_policy, all_indices):
    """Reset groups for ``selected`` GPUs under the NVLink rules (module docstring).

    Returns ``(groups, notes, expanded, blocked)``: ``groups`` a list of sorted index lists,
    ``expanded`` indices added as peers, ``blocked`` ``{index: reason}`` for groups refused
    by ``nvlink_peers=fail``.
    """
    notes = []
    pg = plat["gpus"]
    nvswitch = plat.get("nvswitch")

    def rank(i):
        return (pg.get(i) or {}).get("arch_rank")

    def peers(i):
        return set((pg.get(i) or {}).get("nvlink_peers") or [])

    def must_group(i):
        r = rank(i)
        has_links = bool(peers(i)) or nvswitch
        if not has_links:
            return None
        if r is None:
            return "architecture unknown with NVLink: resetting with all NVLink peers (the safe reading)"
        if r < ARCH_RANK["ampere"]:
            return "pre-Ampere GPU with NVLink: all NVLink peers must be reset in the same command"
        if r == ARCH_RANK["ampere"] and nvswitch and not fm_active:
            return "Ampere on NVSwitch without Fabric Manager running: every GPU on the fabric is reset together"
        return None

    groups = []
    seen = set()
    expanded = set()
    blocked = {}
    for i in sorted(selected):
        if i in seen:
            continue
        why = must_group(i)
        if why is None:
            groups.append([i])
            seen.add(i)
            continue
        # closure over NVLink peers (on a switch without FM: all GPUs of the host)
        if nvswitch and rank(i) == ARCH_RANK["ampere"] and not fm_active:
            closure = set(all_indices)
        else:
            closure = {i}
            stack = [i]
            while stack:
                for q in peers(stack.pop()):
                    if q not in closure:
                        closure.add(q)
                        stack.append(q)
        extra = closure - set(selected)
        notes.append("GPU %d: %s -> group %s" % (i, why, sorted(closure)))
        if extra and peers_policy == "fail":
            for j in closure:
                blocked[j] = "NVLink peers %s must be reset together with GPU %d, but were not chosen (nvlink_peers=fail)" % (
                    sorted(extra), i)
        expanded |= extra
        groups.append(sorted(closure))
        seen |= closure
    for i in sorted(selected):
        r = rank(i)
        if r is not None and r >= ARCH_RANK["ampere"] and peers(i) and not any(len(g) > 1 and i in g for g in groups):
            notes.append("GPU %d: %s with NVLink: individual reset allowed" % (i, ARCH_NAMES.get(r)))
    return groups, notes, sorted(expanded), blocked

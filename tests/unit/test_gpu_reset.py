"""gpu_reset (gpu_reset.py): NVLink rules, prerequisites, plan, restore-in-finally, verdicts.

Fake /proc, fake backend (records persistence / reset calls), fake systemd, fake clock: no
process is signalled and no command runs, except run_argv's own tests (a `sleep` child).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from gpu_fakes import BASE, HOSTWIDE, FakeBackend, FakeClock, FakeProc, gpu_fd  # noqa: E402

from ansible_collections.gpuflow.eagle3.plugins.module_utils import gpu_platform as PL  # noqa: E402
from ansible_collections.gpuflow.eagle3.plugins.module_utils import gpu_reset as R  # noqa: E402
from ansible_collections.gpuflow.eagle3.plugins.module_utils import nvidia_smi as SMI  # noqa: E402
from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_backend import BackendUnsupported  # noqa: E402


class ResetBackend(FakeBackend):
    """FakeBackend + persistence / reset hooks and per-GPU faults; records call order."""

    name = "fake"

    def __init__(self, fp, n=2, log=None, outcome="ok", health_after=None, pm=True, mig=False,
                 remapped=None, raise_on_reset=None, **kw):
        FakeBackend.__init__(self, fp, n=n, **kw)
        self.log = log if log is not None else []
        self.pm = dict((i, pm) for i in range(n))
        self.mig = dict((i, mig) for i in range(n))
        self.remapped = dict((i, bool(remapped and i in remapped)) for i in range(n))
        self.outcome = outcome
        self.health_after = health_after or {}
        self.raise_on_reset = raise_on_reset
        self.closed = False

    def gpus(self):
        out = FakeBackend.gpus(self)
        for g in out:
            g["persistence_mode"] = self.pm[g["index"]]
            g["mig_mode"] = self.mig[g["index"]]
            g["remapped_rows_pending"] = self.remapped[g["index"]]
        return out

    def set_persistence_mode(self, index, enabled):
        self.log.append(("pm", index, enabled))
        self.pm[index] = enabled
        return {"rc": 0, "outcome": "ok", "argv": ["nvidia-smi", "-i", str(index), "-pm", "1" if enabled else "0"]}

    def reset_gpus(self, indices, timeout=None):
        self.log.append(("reset", list(indices), self.closed, dict(self.pm)))
        if self.raise_on_reset:
            raise self.raise_on_reset
        if self.outcome == "ok":
            for i in indices:
                self.remapped[i] = self.health_after.get(i, False)
        # a reset past its timeout: the child was killed (rc 124), which classify_smi_reset calls failed
        timed_out = self.outcome == "timeout"
        return {"rc": 0 if self.outcome == "ok" else (124 if timed_out else 255), "stdout": "x", "stderr": "",
                "outcome": "failed" if timed_out else self.outcome, "duration_s": 0.5,
                "argv": ["nvidia-smi", "--gpu-reset", "-i", ",".join(map(str, indices))], "timed_out": timed_out}

    def close(self):
        self.closed = True
        self.log.append(("close",))


class Opener(object):
    """open_backend(): the first call returns the backend, later calls reopen it."""

    def __init__(self, b):
        self.b = b
        self.opens = 0

    def __call__(self):
        self.opens += 1
        self.b.closed = False
        return self.b


class FakeSystemd(object):
    def __init__(self, units=None, booted=True, log=None, fail_stop=()):
        self.units = units or {}   # unit -> ActiveState
        self._booted = booted
        self.log = log if log is not None else []
        self.fail_stop = set(fail_stop)

    def booted(self):
        return self._booted

    def load_state(self, unit):
        if unit not in self.units:
            return 0, {"LoadState": "not-found", "ActiveState": "inactive"}
        return 0, {"LoadState": "loaded", "ActiveState": self.units[unit]}

    def stop(self, unit, timeout=None):
        self.log.append(("stop", unit))
        if unit in self.fail_stop:
            return 1, "", "Job failed"
        self.units[unit] = "inactive"
        return 0, "", ""

    def start(self, unit, timeout=None):
        self.log.append(("start", unit))
        self.units[unit] = "active"
        return 0, "", ""


def probe_for(arch=9, peers=None, remote=None, ecc=(True, True), virt=0):
    def probe(timeout):
        gpus = {}
        for i in range(8):
            gpus[str(i)] = {"arch_code": arch, "ecc_mode_current": ecc[0], "ecc_mode_pending": ecc[1],
                            "mig_mode_pending": None, "virtualization_mode": virt,
                            "nvlink_peers": (peers or {}).get(i, []), "nvlink_remote": (remote or {}).get(i, [])}
        return {"gpus": gpus}
    return probe


@pytest.fixture
def env(tmp_path):
    fp = FakeProc(tmp_path / "proc")
    me = fp.add(BASE + 1, comm="python3")     # stands for the module itself
    clock = FakeClock()
    return fp, me, clock


def run(b, params, env, check=False, systemd=None, probe=None, warns=None, own=None):
    fp, me, clock = env
    return R.run_reset(Opener(b), params, check_mode=check, systemd=systemd or FakeSystemd(),
                       proc_root=fp.root, clock=clock, sleep=clock.sleep, own=own or {me},
                       warn=(warns.append if warns is not None else None), probe=probe or probe_for())


# ------------------------------------------------------------------ commands
def test_classify_smi_reset():
    assert SMI.classify_smi_reset({"rc": 0, "stdout": "GPU 00000000:1A:00.0 was successfully reset."}) == "ok"
    busy = "The following GPUs could not be reset:\n  GPU 00000000:1A:00.0: In use by another client"
    assert SMI.classify_smi_reset({"rc": 255, "stdout": busy}) == "busy"
    assert SMI.classify_smi_reset({"rc": 3, "stdout": "Resetting GPU is not supported"}) == "unsupported"
    assert SMI.classify_smi_reset({"rc": 4, "stdout": "Insufficient Permissions"}) == "failed"
    assert SMI.classify_smi_reset({"rc": 124, "timed_out": True, "stdout": ""}) == "failed"


def test_nvidia_smi_commands_are_argv_lists():
    seen = []

    def runner(argv, timeout):
        seen.append((argv, timeout))
        return {"rc": 0, "stdout": "ok", "stderr": "", "timed_out": False, "duration_s": 0.1}
    r = SMI.nvidia_smi_reset(["GPU-a", "GPU-b"], 90, runner=runner)
    assert seen[-1] == (["nvidia-smi", "--gpu-reset", "-i", "GPU-a,GPU-b"], 90)
    assert r["outcome"] == "ok"
    SMI.nvidia_smi_persistence("GPU-a", False, 30, runner=runner)
    assert seen[-1][0] == ["nvidia-smi", "-i", "GPU-a", "-pm", "0"]


def test_run_argv_bounded_in_time():
    r = SMI.run_argv(["sleep", "5"], 0.3)
    assert r["timed_out"] and r["rc"] == 124 and r["duration_s"] < 3
    r = SMI.run_argv(["sh", "-c", "echo out; echo err >&2; exit 3"], 5)
    assert (r["rc"], r["stdout"].strip(), r["stderr"].strip(), r["timed_out"]) == (3, "out", "err", False)
    assert SMI.run_argv(["/nonexistent/nvidia-smi"], 1)["rc"] == 127


# ------------------------------------------------------------------ NVLink rules
def plat(arch, peers=None, nvswitch=False, n=4):
    return {"nvswitch": nvswitch, "gpus": dict((i, {"arch_rank": PL.ARCH_RANK.get(arch) if arch else None,
                                                    "nvlink_peers": (peers or {}).get(i, [])}) for i in range(n))}


def test_hopper_resets_individually_even_with_nvlink_and_switch():
    groups, notes, extra, blocked = PL.nvlink_groups([1], plat("hopper", {1: [0, 2]}, nvswitch=True), False, "expand", [0, 1, 2, 3])
    assert groups == [[1]] and extra == [] and not blocked


def test_volta_resets_with_all_nvlink_peers():
    p = plat("volta", {0: [1], 1: [0, 2], 2: [1], 3: []})
    groups, notes, extra, blocked = PL.nvlink_groups([0], p, False, "expand", [0, 1, 2, 3])
    assert groups == [[0, 1, 2]] and extra == [1, 2]
    assert "pre-Ampere" in notes[0]
    groups, notes, extra, blocked = PL.nvlink_groups([3], p, False, "expand", [0, 1, 2, 3])
    assert groups == [[3]]   # no NVLink: alone


def test_peers_policy_fail_blocks_the_group():
    p = plat("volta", {0: [1], 1: [0]})
    groups, notes, extra, blocked = PL.nvlink_groups([0], p, False, "fail", [0, 1, 2, 3])
    assert groups == [[0, 1]] and set(blocked) == {0, 1} and "nvlink_peers=fail" in blocked[0]


def test_ampere_switch_needs_fabric_manager_for_individual_reset():
    p = plat("ampere", {}, nvswitch=True)
    assert PL.nvlink_groups([2], p, True, "expand", [0, 1, 2, 3])[0] == [[2]]
    groups, notes, extra, blocked = PL.nvlink_groups([2], p, False, "expand", [0, 1, 2, 3])
    assert groups == [[0, 1, 2, 3]] and "Fabric Manager" in notes[0]


def test_unknown_architecture_with_nvlink_is_treated_as_pre_ampere():
    groups = PL.nvlink_groups([0], plat(None, {0: [1], 1: [0]}), False, "expand", [0, 1])[0]
    assert groups == [[0, 1]]


# ------------------------------------------------------------------ prerequisites
def test_clean_host_is_a_no_op(env):
    fp, me, clock = env
    b = ResetBackend(fp)
    r = run(b, {"gpus": ["all"]}, env)
    assert r["changed"] is False and r["ok"] and r["selected"] == []
    assert [g["verdict"] for g in r["gpus"]] == ["healthy", "healthy"]
    assert not [x for x in b.log if x[0] in ("pm", "reset")]


def test_unknown_gpu_fails_before_anything(env):
    fp, me, clock = env
    b = ResetBackend(fp)
    with pytest.raises(R.ResetError, match="unknown GPU index 5"):
        run(b, {"gpus": ["5"], "force": True}, env)
    assert not [x for x in b.log if x[0] in ("pm", "reset")]


@pytest.mark.parametrize("override,match", [
    ({"reset_timeout": 0}, "reset_timeout"),
    ({"daemons": ["../x"]}, "malformed unit"),
    ({"protected": ["[x"]}, "malformed protected"),
    ({"gpus": []}, "at least one GPU"),
])
def test_bad_parameters(env, override, match):
    fp, me, clock = env
    params = {"gpus": ["0"], "force": True}
    params.update(override)
    with pytest.raises(R.ResetError, match=match):
        run(ResetBackend(fp), params, env)


def test_needed_gpu_selected_by_health(env):
    fp, me, clock = env
    b = ResetBackend(fp, remapped={1})
    r = run(b, {"gpus": ["all"]}, env, check=True)
    assert r["selected"] == [1]
    g1 = [g for g in r["gpus"] if g["index"] == 1][0]
    assert g1["needed"] and "pending remapped rows: yes" in g1["reasons"] and g1["verdict"] == "planned"


def test_compute_holder_blocks_and_is_named(env):
    fp, me, clock = env
    h = fp.add(BASE + 10, comm="python3", argv=["python3", "train.py"], fds=[gpu_fd(0)] + HOSTWIDE)
    b = ResetBackend(fp, holds={h: {0: 4096}})
    r = run(b, {"gpus": ["0"], "force": True}, env)
    g = r["gpus"][0]
    assert g["verdict"] == "blocked" and g["blocked_by"][0]["pid"] == h and "drain it first" in g["blocked_by"][0]["reason"]
    assert r["changed"] is False and not [x for x in b.log if x[0] in ("pm", "reset")]


def test_management_client_blocks(env):
    fp, me, clock = env
    m = fp.add(BASE + 11, comm="monitor", fds=[gpu_fd(0)] + HOSTWIDE)
    r = run(ResetBackend(fp), {"gpus": ["0"], "force": True}, env, check=True)
    assert r["gpus"][0]["verdict"] == "blocked" and r["gpus"][0]["blocked_by"][0]["class"] == "management"
    assert r["gpus"][0]["blocked_by"][0]["pid"] == m


def test_protected_daemon_in_daemons_is_stopped_and_restored(env):
    fp, me, clock = env
    d = fp.add(BASE + 12, comm="nv-hostengine", fds=[gpu_fd(0)] + HOSTWIDE,
               cgroup="0::/system.slice/nvidia-dcgm.service")
    b = ResetBackend(fp, holds={d: {0: 300}})
    log = b.log
    sd = FakeSystemd({"nvidia-dcgm.service": "active"}, log=log)
    plan = run(b, {"gpus": ["0"], "force": True}, env, check=True, systemd=sd)
    assert plan["plan"]["daemons_to_stop"] == ["nvidia-dcgm.service"] and plan["gpus"][0]["verdict"] == "planned"
    assert not [x for x in log if x[0] in ("stop", "pm", "reset")]   # check mode: nothing

    def stop(unit, timeout=None):     # stopping the unit ends its process
        log.append(("stop", unit))
        fp.remove(d)
        return 0, "", ""
    sd.stop = stop
    del log[:]
    r = run(b, {"gpus": ["0"], "force": True}, env, systemd=sd)
    assert r["gpus"][0]["verdict"] == "healthy" and r["changed"]
    kinds = [x[0] for x in log]
    assert kinds.index("stop") < kinds.index("pm") < kinds.index("close") < kinds.index("reset") < kinds.index("start")
    assert r["daemons"] == [{"unit": "nvidia-dcgm.service", "was_active": True, "stopped": True, "restored": True, "error": None}]


def test_protected_process_not_in_daemons_blocks(env):
    fp, me, clock = env
    fp.add(BASE + 13, comm="site-agent", fds=[gpu_fd(1)] + HOSTWIDE, cgroup="0::/system.slice/site-agent.service")
    r = run(ResetBackend(fp), {"gpus": ["1"], "force": True, "protected": ["^site-agent$"]}, env, check=True)
    b = r["gpus"][0]["blocked_by"][0]
    assert r["gpus"][0]["verdict"] == "blocked" and b["class"] == "protected" and "add its systemd unit" in b["reason"]


def test_persistenced_and_own_worker_do_not_block(env):
    fp, me, clock = env
    fp.add(BASE + 14, comm="nvidia-persistenced", fds=[gpu_fd(0)] + HOSTWIDE)
    w = fp.add(BASE + 15, comm="python3", ppid=me, fds=[gpu_fd(0)] + HOSTWIDE)  # our NVML worker
    r = run(ResetBackend(fp), {"gpus": ["0"], "force": True}, env, check=True, own={me, w})
    assert r["gpus"][0]["verdict"] == "planned", r["gpus"][0]["blocked_by"]
    assert r["plan"]["persistence_off"] == [0]


def test_mig_enabled_blocks_unless_allowed_and_vgpu_mig_is_unsupported(env):
    fp, me, clock = env
    r = run(ResetBackend(fp, mig=True), {"gpus": ["0"], "force": True}, env, check=True)
    assert r["gpus"][0]["verdict"] == "blocked" and "MIG" in r["gpus"][0]["blocked_by"][0]["reason"]
    r = run(ResetBackend(fp, mig=True), {"gpus": ["0"], "force": True, "allow_mig": True}, env, check=True)
    assert r["gpus"][0]["verdict"] == "planned"
    r = run(ResetBackend(fp, mig=True), {"gpus": ["0"], "force": True, "allow_mig": True}, env, check=True,
            probe=probe_for(virt=2))
    assert r["gpus"][0]["verdict"] == "unsupported"


def test_volta_peer_with_holder_blocks_whole_group(env):
    fp, me, clock = env
    h = fp.add(BASE + 16, comm="python3", fds=[gpu_fd(1)] + HOSTWIDE)
    b = ResetBackend(fp, n=2, holds={h: {1: 100}})
    r = run(b, {"gpus": ["0"], "force": True}, env, check=True, probe=probe_for(arch=5, peers={0: [1], 1: [0]}))
    assert r["plan"]["expanded_peers"] == [1]
    assert [(g["index"], g["chosen"], g["verdict"]) for g in r["gpus"]] == [(0, True, "blocked"), (1, False, "blocked")]


def test_check_mode_plan_on_hopper_with_persistence(env):
    fp, me, clock = env
    b = ResetBackend(fp, n=1)
    r = run(b, {"gpus": ["all"], "force": True}, env, check=True)
    assert r["changed"] is True and r["ok"] and r["verdict"] == "planned"
    assert r["plan"]["groups"][0]["command"] == ["nvidia-smi", "--gpu-reset", "-i", "0"]
    assert r["plan"]["persistence_off"] == [0]
    assert r["platform"]["gpus"]["0"]["architecture"] == "hopper"
    assert not [x for x in b.log if x[0] in ("pm", "reset")] and b.pm[0] is True


# ------------------------------------------------------------------ execution
def test_reset_runs_with_persistence_off_and_backend_closed_then_restores(env):
    fp, me, clock = env
    b = ResetBackend(fp, remapped={0})
    r = run(b, {"gpus": ["all"]}, env)
    resets = [x for x in b.log if x[0] == "reset"]
    assert resets == [("reset", [0], True, {0: False, 1: True})]
    assert b.pm == {0: True, 1: True}
    g0 = r["gpus"][0]
    assert g0["verdict"] == "healthy" and g0["persistence_mode_after"] is True and r["persistence"][0]["restored"]
    assert [c for c in g0["checks_after"] if c["check"] == "remapped_rows_pending"][0]["ok"] is True


@pytest.mark.parametrize("outcome,verdict", [("busy", "busy"), ("unsupported", "unsupported"), ("failed", "failed"),
                                             ("timeout", "failed")])
def test_failed_reset_stops_daemons_before_and_restarts_them_and_persistence_after(env, outcome, verdict):
    fp, me, clock = env
    b = ResetBackend(fp, n=1, outcome=outcome, remapped={0})
    sd = FakeSystemd({"dcgm-exporter.service": "active"}, log=b.log)
    r = run(b, {"gpus": ["all"]}, env, systemd=sd)
    steps = [x[:2] if x[0] in ("stop", "start") else x[:3] if x[0] == "pm" else x[:1] for x in b.log]
    reset = steps.index(("reset",))
    assert steps.index(("stop", "dcgm-exporter.service")) < reset < steps.index(("start", "dcgm-exporter.service"))
    assert steps.index(("pm", 0, False)) < reset < steps.index(("pm", 0, True))
    assert b.pm[0] is True and sd.units["dcgm-exporter.service"] == "active"
    assert r["gpus"][0]["verdict"] == verdict
    assert not r["ok"] and r["changed"]
    if outcome == "timeout":
        assert r["gpus"][0]["output"].startswith("timed out after %s s." % R.DEFAULTS["reset_timeout"])
    if outcome == "unsupported":
        assert r["needs_power_cycle"]


def test_exception_during_reset_still_restores(env):
    fp, me, clock = env
    b = ResetBackend(fp, n=1, raise_on_reset=RuntimeError("driver exploded"), remapped={0})
    sd = FakeSystemd({"nvidia-dcgm.service": "active"}, log=b.log)
    with pytest.raises(RuntimeError):
        run(b, {"gpus": ["all"]}, env, systemd=sd)
    assert b.pm[0] is True and sd.units["nvidia-dcgm.service"] == "active"


def test_backend_unsupported_hook_is_a_result(env):
    fp, me, clock = env
    b = ResetBackend(fp, n=1, raise_on_reset=BackendUnsupported("no reset here"), remapped={0})
    r = run(b, {"gpus": ["all"]}, env)
    assert r["gpus"][0]["verdict"] == "unsupported" and b.pm[0] is True


def test_unhealthy_after_reset(env):
    fp, me, clock = env
    b = ResetBackend(fp, n=1, remapped={0}, health_after={0: True})
    r = run(b, {"gpus": ["all"], "health_timeout": 1.0}, env)
    g = r["gpus"][0]
    assert g["verdict"] == "unhealthy" and r["needs_power_cycle"] and "after reset" in g["blocked_by"][0]["reason"]


def test_daemon_stop_failure_aborts_reset_but_restores(env):
    fp, me, clock = env
    b = ResetBackend(fp, n=1, remapped={0})
    sd = FakeSystemd({"nvidia-dcgm.service": "active", "dcgm-exporter.service": "active"}, log=b.log,
                     fail_stop={"dcgm-exporter.service"})
    warns = []
    r = run(b, {"gpus": ["all"]}, env, systemd=sd, warns=warns)
    assert not [x for x in b.log if x[0] == "reset"]
    assert r["gpus"][0]["verdict"] == "failed" and any("systemctl stop" in w for w in warns)
    assert ("start", "nvidia-dcgm.service") in b.log


def test_systemd_not_booted_skips_daemons(env):
    fp, me, clock = env
    b = ResetBackend(fp, n=1, remapped={0})
    sd = FakeSystemd({"nvidia-dcgm.service": "active"}, booted=False, log=b.log)
    r = run(b, {"gpus": ["all"]}, env, systemd=sd)
    assert r["plan"]["daemons_to_stop"] == [] and r["gpus"][0]["verdict"] == "healthy"
    assert not [x for x in b.log if x[0] in ("stop", "start")]


def test_fabric_manager_stop_policy(env):
    fp, me, clock = env
    b = ResetBackend(fp, n=1, remapped={0})
    sd = FakeSystemd({"nvidia-fabricmanager.service": "active"}, log=b.log)
    r = run(b, {"gpus": ["all"], "fabric_manager": "stop"}, env, systemd=sd, check=True)
    assert r["plan"]["fabric_manager"] == "stop" and "nvidia-fabricmanager.service" in r["plan"]["daemons_to_stop"]
    r = run(b, {"gpus": ["all"]}, env, systemd=sd, check=True)
    assert r["plan"]["fabric_manager"] == "keep" and r["plan"]["daemons_to_stop"] == []

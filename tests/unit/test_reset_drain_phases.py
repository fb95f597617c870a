"""The phases of run_drain (drain.py) and run_reset (gpu_reset.py), each called on its own.

A test sets up the state a phase starts from (by running the phases before it, or by hand) and
checks only what that phase decides, does or returns. Same fakes as test_gpu_drain.py and
test_gpu_reset.py: no process is signalled and no command runs.
"""

import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from gpu_fakes import BASE, HOSTWIDE, FakeClock, FakeProc, FakeSignaller, gpu_fd  # noqa: E402
from test_gpu_drain import Host  # noqa: E402
from test_gpu_reset import FakeSystemd, Opener, ResetBackend, probe_for  # noqa: E402

from ansible_collections.gpuflow.eagle3.plugins.module_utils import drain as D  # noqa: E402
from ansible_collections.gpuflow.eagle3.plugins.module_utils import gpu_reset as R  # noqa: E402
from ansible_collections.gpuflow.eagle3.plugins.module_utils import reset_plan as RP  # noqa: E402
from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_backend import BackendError  # noqa: E402
from ansible_collections.gpuflow.eagle3.plugins.module_utils.systemd import Systemd  # noqa: E402

TERM, KILL = int(signal.SIGTERM), int(signal.SIGKILL)
VLLM_UNIT = "0::/system.slice/vllm-x.service"


# ================================================================== drain
def unit_systemd(h, stop_rc=0):
    """A systemd that knows the loaded unit vllm-x.service; a stop ends the unit's main process BASE+1."""
    calls = []

    def run(argv):
        calls.append(argv)
        if "show" in argv:
            return 0, "LoadState=loaded\nActiveState=active\nControlGroup=/system.slice/vllm-x.service\n", ""
        if stop_rc:
            return stop_rc, "", "Job failed"
        h.fp.remove(BASE + 1)
        return 0, "", ""
    return Systemd(run, booted=True), calls


def drain_run(h, params, sig=None, systemd=None, warnings=None):
    p, rx = D.drain_params(params)
    return D.DrainRun(p, rx, h.be, systemd=systemd, proc_root=h.fp.root, clock=h.clock, sleep=h.clock.sleep,
                      warn=None if warnings is None else warnings.append, signaller=sig or FakeSignaller(h.fp))


def drain_looked(h, params, **kw):
    d = drain_run(h, params, **kw)
    D.drain_look(d, own=set())
    return d


def drain_decided(h, params, **kw):
    d = drain_looked(h, params, **kw)
    D.drain_decide(d)
    return d


def drain_planned(h, params, **kw):
    d = drain_decided(h, params, **kw)
    D.drain_plan(d, False)
    return d


def test_drain_params_fill_defaults_read_an_empty_gpu_list_as_all_and_compile_the_pattern():
    p, rx = D.drain_params({"gpus": [], "units": ("vllm",), "grace_period": None, "cmdline_pattern": "vllm"})
    assert p["gpus"] == ["all"] and p["units"] == ["vllm"] and p["grace_period"] == D.DEFAULTS["grace_period"]
    assert rx.search("python3 -m vllm.entrypoints")


def test_drain_params_refuse_an_invalid_pid():
    with pytest.raises(D.DrainError, match="invalid PID"):
        D.drain_params({"pids": [1]})


def test_drain_look_resolves_the_targets_and_the_units_processes(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [1], cgroup=VLLM_UNIT)
    h.holder(BASE + 2, [0])
    sd, calls = unit_systemd(h)
    d = drain_looked(h, {"gpus": ["1"], "units": ["vllm-x"]}, systemd=sd)
    assert d.targets == [1]
    assert d.unit_procs == {"vllm-x.service": {BASE + 1: h.fp.create_time(BASE + 1)}}
    assert sorted(d.disc["holders"]) == [BASE + 1, BASE + 2]
    assert [a[1] for a in calls] == ["show"]


def test_drain_look_refuses_units_without_systemd(tmp_path):
    h = Host(tmp_path)
    with pytest.raises(D.DrainError, match="systemd is not running"):
        drain_looked(h, {"units": ["vllm-x"]}, systemd=Systemd(lambda argv: (0, "", ""), booted=False))


def test_drain_decide_selects_the_holders_and_allows_for_protected_memory(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0], argv=["python3", "job.py"])
    h.holder(BASE + 2, [0], comm="nv-hostengine", argv=["/usr/bin/nv-hostengine"], mib=512)
    d = drain_looked(h, {"memory_baseline_mib": 100})
    D.drain_decide(d)
    assert [x["pid"] for x in d.plan["signal"]] == [BASE + 1]
    assert d.baseline == {0: 100, 1: 100}
    assert d.keep_mib == {0: 512, 1: 0}
    assert d.ignore_pids == {BASE + 2}


def test_drain_decide_warns_about_a_driver_pid_it_cannot_signal(tmp_path):
    h = Host(tmp_path)
    h.be.extra_listed = {0: [{"pid": BASE + 77, "used_mib": 900, "type": "compute"}]}
    warnings = []
    d = drain_looked(h, {}, warnings=warnings)
    D.drain_decide(d)
    assert d.plan["signal"] == []
    assert len(warnings) == 1 and "GPU 0: driver PID %d cannot be mapped" % (BASE + 77) in warnings[0]


def test_drain_plan_starts_an_unchanged_result_with_the_holders_before(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0])
    d = drain_decided(h, {})
    result = D.drain_plan(d, True)
    assert result is d.result
    assert (result["changed"], result["check_mode"], result["targets"], result["actions"]) == (False, True, [0, 1], [])
    assert result["backend"] == h.be.driver()
    assert [x["pid"] for x in result["plan"]["signal"]] == [BASE + 1]
    assert [[x["pid"] for x in d.before[i]] for i in (0, 1)] == [[BASE + 1], []]


def test_drain_planned_verdict_is_planned_blocked_or_ready_per_gpu(tmp_path):
    h = Host(tmp_path, n=3)
    h.holder(BASE + 1, [0], argv=["python3", "-m", "vllm.entrypoints"])
    h.holder(BASE + 2, [1], argv=["python3", "train.py"])
    sig = FakeSignaller(h.fp)
    d = drain_decided(h, {"cmdline_pattern": "vllm"}, sig=sig)
    D.drain_plan(d, True)
    res = D.drain_planned_verdict(d)
    assert [(g["index"], g["verdict"]) for g in res["gpus"]] == [(0, "planned"), (1, "blocked"), (2, "ready")]
    assert [(x["pid"], x["reason"]) for x in res["gpus"][1]["blocked_by"]] == [
        (BASE + 2, "not selected by units / pids / cmdline_pattern")]
    assert res["changed"] is True and res["ready"] is False
    assert [[x["pid"] for x in res["diff"]["after"][i]] for i in (0, 1, 2)] == [[], [BASE + 2], []]
    assert sig.calls == [] and h.fp.alive(BASE + 1)


def test_drain_stop_units_records_a_failed_stop_and_warns(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0], cgroup=VLLM_UNIT)
    sd, calls = unit_systemd(h, stop_rc=1)
    warnings = []
    d = drain_planned(h, {"units": ["vllm-x"]}, systemd=sd, warnings=warnings)
    D.drain_stop_units(d)
    actions = d.result["actions"]
    assert [(a["action"], a["unit"], a["rc"], a["error"]) for a in actions] == [
        ("systemctl_stop", "vllm-x.service", 1, "Job failed")]
    assert warnings == ["systemctl stop vllm-x.service failed (rc=1): Job failed"]
    assert d.result["changed"] is True and d.first_signal_t == actions[0]["t"]


def test_drain_signal_sends_sigkill_after_the_grace_period_to_a_holder_that_ignores_sigterm(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0])
    sig = FakeSignaller(h.fp, ignore_term={BASE + 1})
    d = drain_planned(h, {"grace_period": 2.0, "poll_interval": 0.5}, sig=sig)
    D.drain_signal(d)
    assert sig.calls == [("killpg", BASE + 1, TERM, [BASE + 1]), ("killpg", BASE + 1, KILL, [BASE + 1])]
    assert d.result["changed"] is True and d.first_signal_t == 0.0
    assert d.alive == {} and d.exit_t == {BASE + 1: 2.0} and d.survivors == {}


def test_drain_signal_records_a_survivor_in_d_state(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0], state="D")
    d = drain_planned(h, {"grace_period": 1, "kill_timeout": 1}, sig=FakeSignaller(h.fp, dstate={BASE + 1}))
    D.drain_signal(d)
    assert d.survivors == {BASE + 1: {"dstate": True}} and BASE + 1 not in d.exit_t


def test_drain_signal_round_signals_the_pid_when_its_group_holds_a_bystander(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0])
    h.fp.add(BASE + 2, ppid=1, pgid=BASE + 1, argv=["python3", "unrelated.py"])
    sig = FakeSignaller(h.fp)
    d = drain_planned(h, {}, sig=sig)
    d.allowed = d.alive = {BASE + 1: h.fp.create_time(BASE + 1)}
    assert D.drain_signal_round(d, signal.SIGTERM, "SIGTERM") is True
    assert sig.calls == [("kill", BASE + 1, TERM)]
    assert [(a["action"], a["signal"], a["pid"]) for a in d.result["actions"]] == [("kill", "SIGTERM", BASE + 1)]


def test_drain_wait_exit_returns_at_the_deadline_while_a_target_lives(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0])
    d = drain_planned(h, {"poll_interval": 0.25})
    d.alive = {BASE + 1: h.fp.create_time(BASE + 1)}
    D.drain_wait_exit(d, h.clock() + 1.0)
    assert h.clock.t == 101.0 and BASE + 1 in d.alive and d.exit_t == {}


def test_drain_wait_exit_records_when_a_target_exited(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0])
    d = drain_planned(h, {})
    d.alive = {BASE + 1: h.fp.create_time(BASE + 1)}
    h.clock.t += 3.0
    h.fp.remove(BASE + 1)
    D.drain_wait_exit(d, h.clock() + 10.0)
    assert d.alive == {} and d.exit_t == {BASE + 1: 3.0}


def test_drain_wait_released_waits_for_memory_that_lags_the_holders_exit(tmp_path):
    h = Host(tmp_path)
    h.be.release_polls = 4
    h.holder(BASE + 1, [0], mib=102400)
    d = drain_planned(h, {"gpus": ["0"], "poll_interval": 0.5, "release_timeout": 30})
    h.fp.remove(BASE + 1)
    D.drain_wait_released(d)
    assert d.release_t == {0: 2.0} and d.pending == set()


def test_drain_wait_released_stops_waiting_on_a_gpu_held_by_a_process_it_leaves_alone(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0], argv=["python3", "train.py"])
    d = drain_planned(h, {"gpus": ["0"], "cmdline_pattern": "vllm", "release_timeout": 30})
    D.drain_wait_released(d)
    assert h.clock.t == 100.0
    assert d.pending == {0} and d.release_t == {}
    assert d.last_reason == {0: "driver still lists PIDs [%d]" % (BASE + 1)}


def test_drain_execute_stops_the_unit_signals_its_leftover_and_waits_for_the_release(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0], cgroup=VLLM_UNIT)
    h.holder(BASE + 2, [0], cgroup=VLLM_UNIT, ppid=1)
    sd, calls = unit_systemd(h)
    sig = FakeSignaller(h.fp)
    d = drain_planned(h, {"gpus": ["0"], "units": ["vllm-x"]}, systemd=sd, sig=sig)
    D.drain_execute(d)
    assert [a["action"] for a in d.result["actions"]] == ["systemctl_stop", "killpg"]
    assert sig.calls == [("killpg", BASE + 2, TERM, [BASE + 2])]
    assert sorted(d.exit_t) == [BASE + 1, BASE + 2] and 0 in d.release_t and d.pending == set()


def test_drain_verdict_needs_reboot_for_a_survivor_in_d_state(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0])
    d = drain_planned(h, {"gpus": ["0"]})
    d.allowed = {BASE + 1: h.fp.create_time(BASE + 1)}
    d.survivors = {BASE + 1: {"dstate": True}}
    res = D.drain_verdict(d)
    g = res["gpus"][0]
    assert g["verdict"] == "needs_reboot" and res["ready"] is False
    assert [(b["pid"], b["reason"]) for b in g["blocked_by"]] == [
        (BASE + 1, "in D state (uninterruptible): survived SIGKILL; reboot needed")]


def test_drain_verdict_blames_memory_held_with_no_holder_on_a_pending_gpu(tmp_path):
    h = Host(tmp_path)
    d = drain_planned(h, {"gpus": ["0"]})
    d.pending = {0}
    d.last_reason = {0: "memory used 900 MiB > baseline 0 MiB + tolerance 256 MiB"}
    g = D.drain_verdict(d)["gpus"][0]
    assert g["verdict"] == "blocked"
    assert g["blocked_by"] == [{"reason": "memory used 900 MiB > baseline 0 MiB + tolerance 256 MiB"
                                          " (memory held with no holder: a reset may be needed)"}]


def test_drain_verdict_times_exit_and_release_from_the_first_signal(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0], mib=2048)
    d = drain_planned(h, {"gpus": ["0"]})
    h.fp.remove(BASE + 1)
    d.first_signal_t, d.exit_t, d.release_t = 1.0, {BASE + 1: 1.5}, {0: 2.25}
    res = D.drain_verdict(d)
    g = res["gpus"][0]
    assert (g["verdict"], g["time_to_exit_s"], g["time_to_release_s"]) == ("ready", 0.5, 1.25)
    assert g["memory_before"]["used_mib"] == 2048 and g["memory_after"]["used_mib"] == 0
    assert res["ready"] is True and res["diff"]["after"] == {0: []}


# ================================================================== reset
@pytest.fixture
def host(tmp_path):
    fp = FakeProc(tmp_path / "proc")
    me = fp.add(BASE + 1, comm="python3")     # stands for the module itself
    return fp, me, FakeClock()


def reset_run(host, b, params, systemd=None, probe=None, warnings=None, opener=None):
    fp, me, clock = host
    r = R.ResetRun(R.reset_params(params), opener or Opener(b), systemd=systemd or FakeSystemd(), proc_root=fp.root,
                   clock=clock, sleep=clock.sleep, warn=None if warnings is None else warnings.append,
                   probe=probe or probe_for())
    r.backend = r.open_backend()
    return r


def reset_looked(host, b, params, **kw):
    r = reset_run(host, b, params, **kw)
    R.reset_look(r, own={host[1]})
    return r


def reset_decided(host, b, params, **kw):
    r = reset_looked(host, b, params, **kw)
    R.reset_decide(r)
    return r


def reset_planned(host, b, params, **kw):
    r = reset_decided(host, b, params, **kw)
    R.reset_plan(r, False)
    return r


def runnable(r):
    return [g for g in r.plan["groups"] if not g["blocked_by"]]


def test_reset_params_fill_defaults_and_keep_an_empty_daemon_list_empty():
    assert R.reset_params({"gpus": ["0"], "daemons": None})["daemons"] == R.DEFAULT_DAEMONS
    p = R.reset_params({"gpus": ["0"], "daemons": [], "fabric_manager": None})
    assert p["daemons"] == [] and p["fabric_manager"] == "auto"


def test_reset_params_refuse_an_empty_gpu_list():
    with pytest.raises(R.ResetError, match="at least one GPU"):
        R.reset_params({"gpus": []})


def test_reset_look_measures_every_gpu_and_resolves_the_targets(host):
    fp, me, clock = host
    h = fp.add(BASE + 10, argv=["python3", "train.py"], fds=[gpu_fd(1)] + HOSTWIDE)
    b = ResetBackend(fp, holds={h: {1: 4096}}, baseline=300)
    r = reset_looked(host, b, {"gpus": ["1"]})
    assert r.targets == [1] and sorted(r.by_index) == [0, 1]
    assert r.baseline == {0: 300, 1: 300} and r.keep_mib == {0: 0, 1: 4096}
    assert r.systemd_ok is True and r.plat["gpus"][1]["architecture"] == "hopper"
    assert sorted(r.disc["holders"]) == [h]


def test_reset_look_refuses_an_unknown_gpu(host):
    fp, me, clock = host
    with pytest.raises(R.ResetError, match="unknown GPU index 5"):
        reset_looked(host, ResetBackend(fp), {"gpus": ["5"]})


def test_reset_decide_selects_only_the_gpus_that_fail_a_check(host):
    fp, me, clock = host
    r = reset_looked(host, ResetBackend(fp, remapped={1}), {"gpus": ["all"]})
    R.reset_decide(r)
    assert r.selected == [1]
    assert r.reasons[0] == [] and "pending remapped rows: yes" in r.reasons[1]
    assert sorted(r.before_checks) == [0, 1]


def test_reset_decide_with_force_selects_every_target(host):
    fp, me, clock = host
    r = reset_looked(host, ResetBackend(fp), {"gpus": ["all"], "force": True})
    R.reset_decide(r)
    assert r.selected == [0, 1] and r.reasons == {0: [], 1: []}


def test_reset_plan_asks_no_daemon_state_when_no_gpu_is_selected(host):
    fp, me, clock = host
    asked = []

    class AskedSystemd(FakeSystemd):
        def load_state(self, unit):
            asked.append(unit)
            return FakeSystemd.load_state(self, unit)
    r = reset_decided(host, ResetBackend(fp), {"gpus": ["all"]}, systemd=AskedSystemd({"nvidia-dcgm.service": "active"}))
    del asked[:]
    result = R.reset_plan(r, False)
    assert asked == [] and r.plan["groups"] == [] and r.plan["daemons_to_stop"] == []
    assert (result["changed"], result["selected"], result["actions"]) == (False, [], [])


def test_reset_plan_groups_nvlink_peers_and_lists_the_daemons_to_stop(host):
    fp, me, clock = host
    sd = FakeSystemd({"nvidia-dcgm.service": "active"})
    r = reset_decided(host, ResetBackend(fp), {"gpus": ["0"], "force": True}, systemd=sd,
                      probe=probe_for(arch=5, peers={0: [1], 1: [0]}))
    result = R.reset_plan(r, True)
    assert [g["gpus"] for g in r.plan["groups"]] == [[0, 1]]
    assert r.group_of[0] is r.group_of[1] and r.involved == [0, 1]
    assert r.plan["daemons_to_stop"] == ["nvidia-dcgm.service"]
    assert result["check_mode"] is True and result["plan"] is r.plan and result["changed"] is False


def test_reset_healthy_verdict_reports_every_target_healthy_and_unchanged(host):
    fp, me, clock = host
    r = reset_planned(host, ResetBackend(fp), {"gpus": ["1"]})
    res = R.reset_healthy_verdict(r)
    assert [(g["index"], g["verdict"], g["action"]) for g in res["gpus"]] == [(1, "healthy", "none")]
    assert (res["ok"], res["verdict"], res["changed"], res["diff"]) == (True, "healthy", False, {"before": {}, "after": {}})


def test_reset_planned_verdict_blocks_the_gpu_of_a_compute_holder_and_plans_the_other(host):
    fp, me, clock = host
    h = fp.add(BASE + 10, argv=["python3", "train.py"], fds=[gpu_fd(0)] + HOSTWIDE)
    b = ResetBackend(fp, holds={h: {0: 4096}})
    r = reset_planned(host, b, {"gpus": ["all"], "force": True})
    res = R.reset_planned_verdict(r)
    assert [(g["index"], g["verdict"], g["action"]) for g in res["gpus"]] == [(0, "blocked", "blocked"), (1, "planned", "reset")]
    assert (res["changed"], res["ok"], res["verdict"]) == (True, False, "blocked")
    assert sorted(res["diff"]["after"]) == ["gpu1"]
    assert not [x for x in b.log if x[0] in ("pm", "reset")]


def test_reset_execute_stops_turns_off_closes_resets_then_restores_in_that_order(host):
    fp, me, clock = host
    b = ResetBackend(fp, n=1, remapped={0})
    sd = FakeSystemd({"nvidia-dcgm.service": "active"}, log=b.log)
    r = reset_planned(host, b, {"gpus": ["all"]}, systemd=sd)
    del b.log[:]
    R.reset_execute(r)
    assert [x[:2] if x[0] in ("stop", "start", "pm") else x[:1] for x in b.log] == [
        ("stop", "nvidia-dcgm.service"), ("pm", 0), ("close",), ("reset",), ("pm", 0), ("start", "nvidia-dcgm.service")]
    assert r.outcome[0][0] == "ok" and r.closed is False and not RP.failing(r.after_checks[0])


def test_reset_execute_fails_the_groups_and_still_restarts_after_a_failed_daemon_stop(host):
    fp, me, clock = host
    b = ResetBackend(fp, n=1, remapped={0})
    sd = FakeSystemd({"nvidia-dcgm.service": "active", "dcgm-exporter.service": "active"}, log=b.log,
                     fail_stop={"dcgm-exporter.service"})
    warnings = []
    r = reset_planned(host, b, {"gpus": ["all"]}, systemd=sd, warnings=warnings)
    R.reset_execute(r)
    assert not [x for x in b.log if x[0] in ("pm", "reset")]
    assert r.outcome == {0: ("failed", "systemctl stop dcgm-exporter.service failed (rc=1): Job failed", None)}
    assert warnings == ["systemctl stop dcgm-exporter.service failed (rc=1): Job failed"]
    assert sd.units["nvidia-dcgm.service"] == "active"


def test_reset_stop_daemons_aborts_at_the_first_stop_that_fails(host):
    fp, me, clock = host
    b = ResetBackend(fp, n=1, remapped={0})
    sd = FakeSystemd({"nvidia-dcgm.service": "active", "dcgm-exporter.service": "active"},
                     fail_stop={"nvidia-dcgm.service"})
    r = reset_planned(host, b, {"gpus": ["all"]}, systemd=sd)
    with pytest.raises(R._Abort, match="systemctl stop nvidia-dcgm.service failed"):
        R.reset_stop_daemons(r)
    assert r.stopped == ["nvidia-dcgm.service"] and sd.units["dcgm-exporter.service"] == "active"
    assert r.result["daemons"] == [{"unit": "nvidia-dcgm.service", "was_active": True, "stopped": False,
                                    "restored": None, "error": "Job failed"}]


def test_reset_recheck_holders_blocks_a_group_still_held_after_its_daemons_stopped(host):
    fp, me, clock = host
    d = fp.add(BASE + 12, comm="nv-hostengine", fds=[gpu_fd(0)] + HOSTWIDE, cgroup="0::/system.slice/nvidia-dcgm.service")
    b = ResetBackend(fp, holds={d: {0: 300}})
    r = reset_planned(host, b, {"gpus": ["0"], "force": True}, systemd=FakeSystemd({"nvidia-dcgm.service": "active"}))
    groups = runnable(r)
    assert R.reset_recheck_holders(r, groups) == []
    assert [(x["pid"], x["reason"]) for x in groups[0]["blocked_by"]] == [
        (d, "still holds the GPU after its daemons were stopped")]


def test_reset_persistence_off_fails_the_group_where_it_cannot_be_turned_off(host):
    fp, me, clock = host

    class StuckPersistence(ResetBackend):
        def set_persistence_mode(self, index, enabled):
            return {"rc": 6, "outcome": "failed", "stderr": "Insufficient Permissions", "argv": ["nvidia-smi"]}
    b = StuckPersistence(fp)
    r = reset_planned(host, b, {"gpus": ["all"], "force": True})
    R.reset_persistence_off(r, runnable(r))
    assert [g.get("failed") for g in r.plan["groups"]] == ["could not turn persistence mode off"] * 2
    assert r.pm_off_done == []
    assert [(a["action"], a["gpu"], a["error"]) for a in r.result["actions"]] == [
        ("persistence_off", 0, "Insufficient Permissions"), ("persistence_off", 1, "Insufficient Permissions")]


def test_reset_persistence_off_records_the_gpus_it_turned_off(host):
    fp, me, clock = host
    b = ResetBackend(fp)
    r = reset_planned(host, b, {"gpus": ["1"], "force": True})
    R.reset_persistence_off(r, runnable(r))
    assert r.pm_off_done == [1] and b.pm == {0: True, 1: False} and r.result["changed"] is True


def test_reset_groups_reports_a_timeout_in_the_output(host):
    fp, me, clock = host
    b = ResetBackend(fp, n=1, outcome="timeout")
    r = reset_planned(host, b, {"gpus": ["all"], "force": True})
    R.reset_groups(r, runnable(r))
    verdict, output, duration = r.outcome[0]
    assert verdict == "failed" and duration == 0.5
    assert output == "timed out after %s s. x" % R.DEFAULTS["reset_timeout"]
    assert r.result["actions"][0]["timed_out"] is True


def test_reset_groups_skips_a_group_that_already_failed(host):
    fp, me, clock = host
    b = ResetBackend(fp, n=1)
    r = reset_planned(host, b, {"gpus": ["all"], "force": True})
    groups = runnable(r)
    groups[0]["failed"] = "could not turn persistence mode off"
    R.reset_groups(r, groups)
    assert r.outcome == {0: ("failed", "could not turn persistence mode off", None)}
    assert not [x for x in b.log if x[0] == "reset"] and r.result["actions"] == []


def test_reset_restore_persistence_reopens_the_backend_and_turns_persistence_back_on(host):
    fp, me, clock = host
    b = ResetBackend(fp, n=1)
    opener = Opener(b)
    r = reset_planned(host, b, {"gpus": ["all"], "force": True}, opener=opener)
    b.pm[0] = False
    r.pm_off_done = [0]
    r.backend.close()
    r.closed = True
    R.reset_restore_persistence(r)
    assert r.closed is False and opener.opens == 2 and b.pm[0] is True
    assert r.result["persistence"] == [{"gpu": 0, "before": True, "restored": True}]


def test_reset_restore_persistence_reports_it_not_restored_when_the_backend_does_not_answer(host):
    fp, me, clock = host
    b = ResetBackend(fp, n=1)
    opens = []

    def opener():
        opens.append(1)
        if len(opens) > 1:
            raise BackendError("NVML: GPU is lost")
        return b
    warnings = []
    r = reset_planned(host, b, {"gpus": ["all"], "force": True}, opener=opener, warnings=warnings)
    r.pm_off_done = [0]
    r.closed = True
    R.reset_restore_persistence(r)
    assert r.closed is True
    assert r.result["persistence"] == [{"gpu": 0, "before": True, "restored": False}]
    assert r.result["actions"][-1]["error"] == "backend unavailable"
    assert warnings == ["the GPU backend does not answer after the reset: NVML: GPU is lost",
                        "persistence mode of GPU 0 could not be restored: backend unavailable"]


def test_reset_health_after_fails_the_answers_check_while_the_backend_is_closed(host):
    fp, me, clock = host
    r = reset_planned(host, ResetBackend(fp, n=1), {"gpus": ["all"], "force": True})
    r.outcome = {0: ("ok", "", 0.5)}
    r.closed = True
    R.reset_health_after(r)
    assert r.after_checks == {0: [{"check": "answers", "ok": False, "detail": "the GPU backend does not answer"}]}
    assert r.pm_after == {}


def test_reset_health_after_polls_until_the_health_timeout_while_a_check_fails(host):
    fp, me, clock = host
    b = ResetBackend(fp, n=1, remapped={0})
    r = reset_planned(host, b, {"gpus": ["all"], "health_timeout": 1.0, "poll_interval": 0.25})
    r.outcome = {0: ("ok", "", 0.5)}
    R.reset_health_after(r)
    assert clock.t == 101.0
    assert [c["check"] for c in RP.failing(r.after_checks[0])] == ["remapped_rows_pending"]
    assert r.pm_after == {0: True}


def test_reset_start_daemons_restarts_the_stopped_daemons_last_stopped_first(host):
    fp, me, clock = host
    sd = FakeSystemd({"nvidia-dcgm.service": "inactive", "dcgm-exporter.service": "inactive"})
    r = reset_planned(host, ResetBackend(fp, n=1), {"gpus": ["all"]}, systemd=sd)
    r.stopped = ["nvidia-dcgm.service", "dcgm-exporter.service"]
    r.result["daemons"] = [{"unit": u, "was_active": True, "stopped": True, "restored": None, "error": None}
                           for u in r.stopped]
    R.reset_start_daemons(r)
    assert sd.log == [("start", "dcgm-exporter.service"), ("start", "nvidia-dcgm.service")]
    assert [d["restored"] for d in r.result["daemons"]] == [True, True]


def test_reset_verdict_maps_each_outcome_and_after_checks_to_a_verdict(host):
    fp, me, clock = host
    b = ResetBackend(fp, n=3)
    r = reset_planned(host, b, {"gpus": ["all"], "force": True})
    bad = {"check": "remapped_rows_pending", "ok": False, "detail": "pending remapped rows: yes"}
    r.outcome = {0: ("ok", "done", 0.5), 1: ("busy", "In use by another client", 0.25)}
    r.after_checks = {0: [bad]}
    r.pm_after = {0: True, 1: True, 2: True}
    res = R.reset_verdict(r)
    assert [(g["index"], g["verdict"]) for g in res["gpus"]] == [(0, "unhealthy"), (1, "busy"), (2, "failed")]
    assert [g["blocked_by"] for g in res["gpus"]] == [
        [{"reason": "after reset: pending remapped rows: yes"}], [{"reason": "In use by another client"}],
        [{"reason": "not attempted"}]]
    assert (res["ok"], res["verdict"], res["needs_power_cycle"]) == (False, "failed", True)
    assert res["diff"]["after"]["gpu1"] == {"persistence_mode": True, "verdict": "busy"}

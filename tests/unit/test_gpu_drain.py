"""Plan and escalation of gpu_drain (drain.py) with a fake /proc, backend, signaller and clock."""

import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from gpu_fakes import BASE, HOSTWIDE, FakeBackend, FakeClock, FakeProc, FakeSignaller, gpu_fd  # noqa: E402

from ansible_collections.gpuflow.eagle3.plugins.module_utils import drain as D  # noqa: E402
from ansible_collections.gpuflow.eagle3.plugins.module_utils.systemd import Systemd  # noqa: E402

TERM, KILL = int(signal.SIGTERM), int(signal.SIGKILL)


def test_resolve_gpus():
    gpus = [{"index": 0, "uuid": "GPU-aaaa"}, {"index": 1, "uuid": "GPU-bbbb"}]
    assert D.resolve_gpus(["all"], gpus) == [0, 1]
    assert D.resolve_gpus([], gpus) == [0, 1]
    assert D.resolve_gpus(["1"], gpus) == [1]
    assert D.resolve_gpus([1], gpus) == [1]
    assert D.resolve_gpus(["GPU-BBBB", "0"], gpus) == [0, 1]
    assert D.resolve_gpus(["bbbb"], gpus) == [1]
    with pytest.raises(D.DrainError, match="unknown GPU index 7"):
        D.resolve_gpus(["7"], gpus)
    with pytest.raises(D.DrainError, match="unknown GPU"):
        D.resolve_gpus(["GPU-cccc"], gpus)


@pytest.mark.parametrize("override,match", [
    ({"cmdline_pattern": "vllm(("}, "malformed cmdline_pattern"),
    ({"protected": ["[x"]}, "malformed protected"),
    ({"pids": [0]}, "invalid PID"),
    ({"pids": [1]}, "invalid PID"),
    ({"grace_period": -1}, "grace_period"),
    ({"poll_interval": 0}, "poll_interval"),
    ({"units": ["../etc"]}, "malformed unit"),
])
def test_validate_params(override, match):
    p = dict(D.DEFAULTS)
    p.update(override)
    with pytest.raises(D.DrainError, match=match):
        D.validate_params(p)


class Host(object):
    """A fake host: GPU 0 and 1, holders as asked."""

    def __init__(self, tmp_path, n=2):
        self.fp = FakeProc(tmp_path / "proc")
        self.holds = {}
        self.be = FakeBackend(self.fp, n=n, holds=self.holds)
        self.clock = FakeClock()

    def holder(self, pid, gpus, mib=1000, **kw):
        self.fp.add(pid, fds=[gpu_fd(g) for g in gpus] + HOSTWIDE, **kw)
        self.holds[pid] = dict((g, mib) for g in gpus)
        return pid

    def run(self, params, check_mode=False, sig=None, systemd=None, own=None):
        sig = sig or FakeSignaller(self.fp)
        warnings = []
        res = D.run_drain(self.be, params, check_mode=check_mode, proc_root=self.fp.root, clock=self.clock,
                          sleep=self.clock.sleep, own=own or set(), signaller=sig, warn=warnings.append,
                          systemd=systemd)
        return res, sig, warnings


def _verdicts(res):
    return dict((g["index"], g["verdict"]) for g in res["gpus"])


def test_clean_host_is_a_noop(tmp_path):
    h = Host(tmp_path)
    h.fp.add(BASE + 1, argv=["python3", "mon.py"], fds=[gpu_fd(0)] + HOSTWIDE)   # management client
    res, sig, dummy = h.run({"gpus": ["all"]})
    assert res["changed"] is False and res["ready"] is True
    assert sig.calls == []
    assert res["actions"] == []
    assert h.clock.t - 100.0 < 0.001     # no waiting at all
    assert _verdicts(res) == {0: "ready", 1: "ready"}


def test_sigterm_honoured_group_signal(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0], mib=102400)
    res, sig, dummy = h.run({"gpus": ["0"], "grace_period": 5})
    assert res["changed"] and res["ready"]
    assert sig.calls == [("killpg", BASE + 1, TERM, [BASE + 1])]
    g = res["gpus"][0]
    assert g["verdict"] == "ready"
    assert g["memory_before"]["used_mib"] == 102400 and g["memory_after"]["used_mib"] == 0
    assert g["time_to_exit_s"] is not None and g["time_to_release_s"] >= g["time_to_exit_s"]
    assert h.clock.t - 100.0 < 1.0  # no grace period spent


def test_memory_that_lags_the_holders_exit_keeps_the_gpu_pending_until_it_is_back(tmp_path):
    # on a real GPU the memory comes back after the process has left the driver's list
    h = Host(tmp_path)
    h.be.release_polls = 6
    h.holder(BASE + 1, [0], mib=102400)
    res, sig, dummy = h.run({"gpus": ["0"], "poll_interval": 0.5, "release_timeout": 30})
    g = res["gpus"][0]
    assert g["verdict"] == "ready" and g["memory_after"]["used_mib"] == 0
    # the holder was gone from the list at once; the GPU was ready only once the memory was back
    assert g["time_to_release_s"] - g["time_to_exit_s"] >= 2.5


def test_memory_held_after_every_holder_is_gone_blocks_with_the_reset_hint(tmp_path):
    h = Host(tmp_path)
    h.be.release_polls = 10 ** 6    # the driver never gives it back
    h.holder(BASE + 1, [0], mib=102400)
    res, sig, dummy = h.run({"gpus": ["0"], "poll_interval": 0.5, "release_timeout": 3})
    g = res["gpus"][0]
    assert res["ready"] is False and g["verdict"] == "blocked"
    assert [b["reason"] for b in g["blocked_by"]] == [
        "memory used 102400 MiB > baseline 0 MiB + tolerance %d MiB (memory held with no holder: a reset may be needed)"
        % D.DEFAULTS["memory_tolerance_mib"]]


def test_named_holder_in_the_modules_own_tree_is_skipped_and_never_signalled(tmp_path):
    h = Host(tmp_path)
    me = h.holder(BASE + 1, [0])
    res, sig, dummy = h.run({"gpus": ["0"], "pids": [me]}, own={me})
    assert sig.calls == [] and h.fp.alive(me)
    assert {"pid": me, "reason": "own process tree"}.items() <= res["plan"]["skipped"][0].items()


def test_named_owner_in_the_modules_own_tree_is_skipped_and_never_signalled(tmp_path):
    h = Host(tmp_path)
    me = h.fp.add(BASE + 1, argv=["python3", "ansible-module"])
    child = h.holder(BASE + 2, [0], ppid=me, pgid=me)
    res, sig, dummy = h.run({"gpus": ["0"], "pids": [me]}, own={me, child})
    assert sig.calls == [] and h.fp.alive(me) and h.fp.alive(child)
    assert {"pid": me, "reason": "own process tree"} in res["plan"]["skipped"]


def test_sigterm_ignored_escalates_after_grace(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0])
    sig = FakeSignaller(h.fp, ignore_term={BASE + 1})
    res, sig, dummy = h.run({"grace_period": 2.0, "poll_interval": 0.05}, sig=sig)
    assert [c[2] for c in sig.calls] == [TERM, KILL]
    kill_t = [a["t"] for a in res["actions"] if a["signal"] == "SIGKILL"][0]
    term_t = [a["t"] for a in res["actions"] if a["signal"] == "SIGTERM"][0]
    assert 2.0 <= kill_t - term_t < 2.2
    assert res["ready"]


def test_dstate_survivor_needs_reboot(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0], state="D")
    sig = FakeSignaller(h.fp, dstate={BASE + 1})
    res, sig, dummy = h.run({"grace_period": 1, "kill_timeout": 1, "release_timeout": 1}, sig=sig)
    assert _verdicts(res)[0] == "needs_reboot"
    assert not res["ready"]
    assert "D state" in res["gpus"][0]["blocked_by"][0]["reason"]


def test_orphans_freed_by_group(tmp_path):
    h = Host(tmp_path)
    # parent BASE+1 is dead; children re-parented to 1 but still in its process group
    h.holder(BASE + 2, [0], ppid=1, pgid=BASE + 1)
    h.holder(BASE + 3, [0], ppid=1, pgid=BASE + 1)
    res, sig, dummy = h.run({})
    assert sig.calls == [("killpg", BASE + 1, TERM, [BASE + 2, BASE + 3])]
    assert res["ready"]


def test_group_member_that_ignores_sigterm_is_killed_before_the_drain_returns(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0])
    h.fp.add(BASE + 2, ppid=BASE + 1, pgid=BASE + 1, argv=["python3", "-c", "resource_tracker"])  # no GPU
    sig = FakeSignaller(h.fp, ignore_term={BASE + 2})
    res, sig, warnings = h.run({"grace_period": 2.0, "poll_interval": 0.05}, sig=sig)
    assert sig.calls == [("killpg", BASE + 1, TERM, [BASE + 1, BASE + 2]), ("killpg", BASE + 1, KILL, [BASE + 2])]
    assert not h.fp.alive(BASE + 2)
    assert res["ready"] and warnings == []


def test_group_member_that_survives_sigkill_is_warned_about(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0])
    h.fp.add(BASE + 2, ppid=BASE + 1, pgid=BASE + 1, state="D", argv=["python3", "-c", "resource_tracker"])
    sig = FakeSignaller(h.fp, dstate={BASE + 2})
    res, sig, warnings = h.run({"grace_period": 1.0, "kill_timeout": 1.0, "poll_interval": 0.05}, sig=sig)
    assert res["ready"]
    assert len(warnings) == 1 and "PID %d" % (BASE + 2) in warnings[0] and "D state" in warnings[0]


def test_group_with_bystander_signals_pids_only(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0])
    h.fp.add(BASE + 2, ppid=1, pgid=BASE + 1, argv=["python3", "-m", "vllm.unrelated"])  # CPU-only, same group
    res, sig, dummy = h.run({})
    assert sig.calls == [("kill", BASE + 1, TERM)]
    assert h.fp.alive(BASE + 2)
    assert res["ready"]


def test_pattern_only_touches_target_gpu_holders(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0], argv=["python3", "-m", "vllm.entrypoints"])
    h.holder(BASE + 2, [1], argv=["python3", "-m", "vllm.entrypoints"])        # other GPU
    h.fp.add(BASE + 3, argv=["python3", "vllm_cpu_job.py"])                   # no GPU at all
    h.holder(BASE + 4, [0], argv=["python3", "train.py"])                      # not matched
    res, sig, dummy = h.run({"gpus": ["0"], "cmdline_pattern": "vllm", "release_timeout": 1})
    assert [c[1] for c in sig.calls] == [BASE + 1]
    assert [x["pid"] for x in res["plan"]["not_selected"]] == [BASE + 4]
    assert _verdicts(res) == {0: "blocked"}
    assert res["gpus"][0]["blocked_by"][0]["pid"] == BASE + 4
    assert h.fp.alive(BASE + 2) and h.fp.alive(BASE + 3)


def test_pattern_owner_chain_stops_at_the_first_ancestor_that_does_not_match(tmp_path):
    """tmux "vllm" > bash > vllm serve (no GPU) > engine (GPU 0): the server and its engine are selected,
    the shell and the multiplexer that started it are not, although the multiplexer's cmdline matches."""
    h = Host(tmp_path)
    h.fp.add(BASE + 1, comm="tmux: server", argv=["tmux", "new", "-s", "vllm"])
    h.fp.add(BASE + 2, comm="bash", ppid=BASE + 1, argv=["bash"])
    h.fp.add(BASE + 3, ppid=BASE + 2, argv=["python3", "-m", "vllm.entrypoints.openai.api_server"])
    h.holder(BASE + 4, [0], ppid=BASE + 3, pgid=BASE + 3, argv=["python3", "engine_core.py"])
    res, sig, dummy = h.run({"gpus": ["0"], "cmdline_pattern": "vllm", "release_timeout": 1})
    assert sorted(x["pid"] for x in res["plan"]["signal"]) == [BASE + 3, BASE + 4]
    assert h.fp.alive(BASE + 1) and h.fp.alive(BASE + 2)
    assert not h.fp.alive(BASE + 3) and not h.fp.alive(BASE + 4)
    assert res["ready"]


def test_drain_one_gpu_leaves_other(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0], mib=50000)
    h.holder(BASE + 2, [1], mib=60000)
    res, sig, dummy = h.run({"gpus": ["1"]})
    assert [c[1] for c in sig.calls] == [BASE + 2]
    assert h.fp.alive(BASE + 1)
    assert res["targets"] == [1] and res["ready"]


def test_protected_and_management_untouched(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0], comm="nv-hostengine", argv=["/usr/bin/nv-hostengine"])
    h.fp.add(BASE + 2, argv=["python3", "nvml_mon.py"], fds=[gpu_fd(0)] + HOSTWIDE)
    h.holder(BASE + 3, [0], argv=["python3", "job.py"], mib=3000)
    res, sig, warnings = h.run({"protected": ["never-matches"]})
    assert [c[1] for c in sig.calls] == [BASE + 3]
    reasons = dict((x["pid"], x["reason"]) for x in res["plan"]["skipped"])
    assert "protected" in reasons[BASE + 1] and "management" in reasons[BASE + 2]
    # the protected holder's memory is allowed for: GPU is ready with it still running
    assert res["ready"]


def test_ready_with_a_protected_compute_holder_warns_with_its_memory(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0], comm="nv-hostengine", argv=["/usr/bin/nv-hostengine"], mib=512)
    h.holder(BASE + 2, [1], argv=["python3", "job.py"], mib=3000)
    res, sig, warnings = h.run({})
    assert res["ready"] and [c[1] for c in sig.calls] == [BASE + 2]
    kept = res["gpus"][0]["protected_compute"]
    assert [(x["pid"], x["name"], x["used_mib"]) for x in kept] == [(BASE + 1, "nv-hostengine", 512)]
    assert res["gpus"][1]["protected_compute"] == []
    assert [w for w in warnings if "is ready, but" in w] == [
        "GPU 0 is ready, but the protected process nv-hostengine (pid %d, %s) holds 512 MiB of compute memory on it: "
        "the next stage has that much less" % (BASE + 1, kept[0]["protected_by"])]


def test_pids_with_setsid_grandchild(tmp_path):
    h = Host(tmp_path)
    h.fp.add(BASE + 1, argv=["python3", "launcher.py"])                         # drained PID, no GPU
    h.fp.add(BASE + 2, ppid=BASE + 1, pgid=BASE + 1, sid=BASE + 1, argv=["python3", "mid.py"])
    h.holder(BASE + 3, [0], ppid=BASE + 2, pgid=BASE + 3, sid=BASE + 3)        # escaped: own session
    h.holder(BASE + 4, [0], argv=["python3", "someone_else.py"])               # not named: untouched
    res, sig, dummy = h.run({"pids": [BASE + 1], "release_timeout": 1})
    signalled = sorted(c[1] for c in sig.calls)
    assert BASE + 3 in signalled and BASE + 1 in signalled
    assert BASE + 4 not in signalled
    assert _verdicts(res)[0] == "blocked"


def test_check_mode_plan_signals_nothing(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0])
    h.holder(BASE + 2, [1], ppid=1, pgid=BASE + 9)
    h.fp.add(BASE + 3, argv=["python3", "mon.py"], fds=[gpu_fd(0)] + HOSTWIDE)
    res, sig, dummy = h.run({}, check_mode=True)
    assert sig.calls == []
    assert res["changed"] is True
    assert sorted(x["pid"] for x in res["plan"]["signal"]) == [BASE + 1, BASE + 2]
    assert _verdicts(res) == {0: "planned", 1: "planned"}
    assert h.fp.alive(BASE + 1) and h.fp.alive(BASE + 2)
    assert [x["pid"] for x in res["diff"]["after"][0]] == [BASE + 3]


def test_unresolved_driver_pid_blocks_and_warns(tmp_path):
    h = Host(tmp_path)
    h.be.extra_listed = {0: [{"pid": BASE + 77, "used_mib": 900, "type": "compute"}]}
    res, sig, warnings = h.run({"release_timeout": 1})
    assert sig.calls == []
    assert _verdicts(res)[0] == "blocked"
    assert any("cannot be mapped" in w for w in warnings)


def test_units_require_systemd(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0])

    class NoSystemd(Systemd):
        def booted(self):
            return False
    with pytest.raises(D.DrainError, match="systemd is not running"):
        h.run({"units": ["vllm"]}, systemd=NoSystemd(lambda argv: (0, "", "")))
    assert h.fp.alive(BASE + 1)


def test_unknown_unit_fails_before_signals(tmp_path):
    h = Host(tmp_path)
    h.holder(BASE + 1, [0])
    calls = []

    def run(argv):
        calls.append(argv)
        return 0, "LoadState=not-found\nActiveState=inactive\n", ""
    with pytest.raises(D.DrainError, match="unknown systemd unit vllm.service"):
        h.run({"units": ["vllm"], "all_holders": True}, systemd=Systemd(run, booted=True))
    assert all(a[1] == "show" for a in calls)
    assert h.fp.alive(BASE + 1)


def test_unit_stopped_then_leftovers_signalled(tmp_path):
    h = Host(tmp_path)
    cg = "0::/system.slice/vllm-x.service"
    h.holder(BASE + 1, [0], cgroup=cg)                       # main process: systemd stops it
    h.holder(BASE + 2, [0], cgroup=cg, ppid=1)               # KillMode=process leftover
    h.holder(BASE + 3, [0], argv=["python3", "other.py"])    # another job on GPU 0
    calls = []

    def run(argv):
        calls.append(argv)
        if "show" in argv:
            return 0, "LoadState=loaded\nActiveState=active\nControlGroup=/system.slice/vllm-x.service\n", ""
        h.fp.remove(BASE + 1)
        return 0, "", ""
    res, sig, dummy = h.run({"units": ["vllm-x"], "release_timeout": 0.5}, systemd=Systemd(run, booted=True))
    assert any("stop" in a for a in calls)
    assert [c[1] for c in sig.calls] == [BASE + 2]
    assert h.fp.alive(BASE + 3)
    assert res["actions"][0]["action"] == "systemctl_stop"
    assert _verdicts(res)[0] == "blocked"   # BASE+3 was not selected


def test_a_containers_unit_of_the_same_name_is_not_signalled(tmp_path):
    """A container's own systemd (cgroupns host) runs vllm-x.service too: its cgroup lies under the container's
    scope, not under this host's unit, so the drain of the host's unit leaves it alone."""
    h = Host(tmp_path)
    h.holder(BASE + 1, [0], cgroup="0::/system.slice/vllm-x.service")
    h.holder(BASE + 2, [0], cgroup="0::/system.slice/vllm-x.service/control", ppid=1)  # a leftover below it
    h.holder(BASE + 4, [0], cgroup="0::/system.slice/docker-" + "c" * 64 + ".scope/system.slice/vllm-x.service")
    h.holder(BASE + 5, [0], cgroup="0::/system.slice/vllm-x.service-canary.service")

    def run(argv):
        if "show" in argv:
            return 0, "LoadState=loaded\nActiveState=active\nControlGroup=/system.slice/vllm-x.service\n", ""
        h.fp.remove(BASE + 1)
        return 0, "", ""
    res, sig, dummy = h.run({"units": ["vllm-x"], "release_timeout": 0.5}, systemd=Systemd(run, booted=True))
    assert [c[1] for c in sig.calls] == [BASE + 2]
    assert h.fp.alive(BASE + 4) and h.fp.alive(BASE + 5)


def test_cuda_opens_every_node_but_holds_one_gpu(tmp_path):
    """CUDA opens /dev/nvidia0 and /dev/nvidia1; the driver lists the job on GPU 0 only."""
    h = Host(tmp_path)
    h.fp.add(BASE + 1, fds=[gpu_fd(0), gpu_fd(1)] + HOSTWIDE)
    h.holds[BASE + 1] = {0: 30000}
    h.fp.add(BASE + 2, fds=[gpu_fd(0), gpu_fd(1)] + HOSTWIDE)
    h.holds[BASE + 2] = {1: 40000}
    res, sig, dummy = h.run({"gpus": ["1"]})
    assert [c[1] for c in sig.calls] == [BASE + 2]
    assert h.fp.alive(BASE + 1)
    assert res["ready"] and _verdicts(res) == {1: "ready"}
    holders = res["gpus"][0]["holders"]
    assert [x["pid"] for x in holders] == [BASE + 2]
    assert holders[0]["device_gpus"] == [0, 1] and holders[0]["context_gpus"] == [1]

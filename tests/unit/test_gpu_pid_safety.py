"""PID safety rules (pid_safety.py)."""

import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from gpu_fakes import BASE, FakeProc  # noqa: E402

from ansible_collections.gpuflow.eagle3.plugins.module_utils import pid_safety as S  # noqa: E402


@pytest.mark.parametrize("pid,ok", [(0, False), (1, False), (-1, False), (True, False), (2, True),
                                    (4194304, False), (4294967295, False), ("5", False), (None, False)])
def test_valid_pid_value(pid, ok):
    assert S.valid_pid_value(pid) is ok


@pytest.fixture
def fp(tmp_path):
    f = FakeProc(tmp_path / "proc")
    f.add(BASE + 1, comm="sshd", ppid=1)
    f.add(BASE + 2, comm="python3", ppid=BASE + 1)           # "the module"
    f.add(BASE + 3, comm="python3", ppid=BASE + 2)           # its NVML worker
    f.add(BASE + 4, comm="holder", ppid=1, start=2000)
    f.add(BASE + 5, comm="holderchild", ppid=BASE + 4, pgid=BASE + 4)
    f.add(BASE + 6, comm="bystander", ppid=1, pgid=BASE + 4)
    return f


def test_own_tree_has_ancestors_and_descendants(fp):
    own = S.own_tree(fp.root, pid=BASE + 2)
    assert own == {BASE + 1, BASE + 2, BASE + 3, 1}


def test_check_pid_rules(fp):
    own = {BASE + 2, BASE + 3}
    ct = fp.create_time(BASE + 4)
    allowed = {BASE + 4: ct}
    assert S.check_pid(BASE + 4, ct, own, set(), allowed, fp.root) is None
    assert "invalid" in S.check_pid(0, ct, own, set(), allowed, fp.root)
    assert "invalid" in S.check_pid(1, ct, own, set(), allowed, fp.root)
    assert "invalid" in S.check_pid(-1, ct, own, set(), allowed, fp.root)
    assert "own process tree" in S.check_pid(BASE + 3, ct, own, set(), {BASE + 3: ct}, fp.root)
    assert "protected" in S.check_pid(BASE + 4, ct, own, {BASE + 4}, allowed, fp.root)
    assert "not seen holding" in S.check_pid(BASE + 5, ct, own, set(), allowed, fp.root)
    assert "changed identity" in S.check_pid(BASE + 4, ct + 5, own, set(), allowed, fp.root)
    fp.remove(BASE + 4)
    assert "exited" in S.check_pid(BASE + 4, ct, own, set(), allowed, fp.root)


def test_send_signal_checks_identity_before_kill(fp):
    calls = []
    ct = fp.create_time(BASE + 4)
    assert S.send_signal(BASE + 4, signal.SIGTERM, ct, fp.root, kill=lambda p, s: calls.append((p, s))) is None
    assert calls == [(BASE + 4, signal.SIGTERM)]
    assert "changed identity" in S.send_signal(BASE + 4, signal.SIGTERM, ct + 1, fp.root,
                                               kill=lambda p, s: calls.append((p, s)))
    for bad in (0, 1, -1, 4294967295):
        assert "refused" in S.send_signal(bad, signal.SIGKILL, ct, fp.root, kill=lambda p, s: calls.append((p, s)))
    assert len(calls) == 1


def test_group_ok(fp):
    table = S.process_table(fp.root)
    # group BASE+4 holds a bystander that is neither a target nor a descendant of one
    ok, why, members = S.group_ok(BASE + 4, table, [BASE + 4], set(), set())
    assert not ok and "not a drain target" in why
    fp.remove(BASE + 6)
    table = S.process_table(fp.root)
    ok, why, members = S.group_ok(BASE + 4, table, [BASE + 4], set(), set())
    assert ok and members == [BASE + 4, BASE + 5]      # the child is a descendant: fine
    ok, why, dummy = S.group_ok(BASE + 4, table, [BASE + 4], set(), {BASE + 5})
    assert not ok and "protected" in why
    ok, why, dummy = S.group_ok(BASE + 4, table, [BASE + 4], {BASE + 5}, set())
    assert not ok and "process tree" in why
    ok, why, dummy = S.group_ok(os.getpgrp(), table, [BASE + 4], set(), set())
    assert not ok and "own group" in why
    for bad in (0, 1, -1):
        assert not S.group_ok(bad, table, [BASE + 4], set(), set())[0]


def test_send_group_signal_revalidates(fp):
    fp.remove(BASE + 6)
    calls = []
    expected = {BASE + 4: fp.create_time(BASE + 4), BASE + 5: fp.create_time(BASE + 5)}
    assert S.send_group_signal(BASE + 4, signal.SIGTERM, expected, fp.root,
                               killpg=lambda g, s: calls.append((g, s))) is None
    assert calls == [(BASE + 4, signal.SIGTERM)]
    fp.add(BASE + 7, comm="newcomer", ppid=1, pgid=BASE + 4)
    assert "gained members" in S.send_group_signal(BASE + 4, signal.SIGTERM, expected, fp.root,
                                                   killpg=lambda g, s: calls.append((g, s)))
    assert "refused" in S.send_group_signal(os.getpgrp(), signal.SIGTERM, expected, fp.root,
                                            killpg=lambda g, s: calls.append((g, s)))
    assert "refused" in S.send_group_signal(0, signal.SIGTERM, expected, fp.root,
                                            killpg=lambda g, s: calls.append((g, s)))
    assert len(calls) == 1


def test_real_send_signal_to_own_child():
    """The pidfd path against a real process we started."""
    import subprocess
    import time
    from ansible_collections.gpuflow.eagle3.plugins.module_utils.holders import create_time
    p = subprocess.Popen(["sleep", "30"])
    try:
        ct = create_time(p.pid)
        assert "changed identity" in S.send_signal(p.pid, signal.SIGTERM, ct - 10)
        assert p.poll() is None
        assert S.send_signal(p.pid, signal.SIGTERM, ct) is None
        t = time.time()
        while p.poll() is None and time.time() - t < 5:
            time.sleep(0.01)
        assert p.returncode == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()

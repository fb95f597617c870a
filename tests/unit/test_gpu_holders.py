"""Discovery and classification of GPU holders (holders.py), against a fake /proc."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from gpu_fakes import BASE, HOSTWIDE, FakeBackend, FakeProc, gpu_fd  # noqa: E402

from ansible_collections.gpuflow.eagle3.plugins.module_utils import holders as H  # noqa: E402
from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_backend import (  # noqa: E402
    classify_real_device_path,
)


def test_parse_stat_with_odd_comm():
    st = H.parse_stat("42 (my (odd) name) R 7 42 40 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5555 0 0")
    assert st == {"name": "my (odd) name", "state": "R", "ppid": 7, "pgid": 42, "sid": 40, "starttime": 5555}


@pytest.mark.parametrize("text,unit,container", [
    ("0::/system.slice/vllm-kimi.service\n", "vllm-kimi.service", None),
    ("0::/system.slice/vllm-kimi.service/payload\n", "vllm-kimi.service", None),
    ("12:cpu,cpuacct:/foo\n1:name=systemd:/system.slice/nvidia-persistenced.service\n",
     "nvidia-persistenced.service", None),
    ("0::/system.slice/docker-" + "a" * 64 + ".scope\n", "docker-" + "a" * 64 + ".scope", "docker:" + "a" * 64),
    ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podx.slice/cri-containerd-"
     + "b" * 64 + ".scope\n", "cri-containerd-" + "b" * 64 + ".scope", "containerd:" + "b" * 64),
    ("0::/user.slice/user-0.slice/session-3.scope\n", "session-3.scope", None),
    ("0::/\n", None, None),
    ("", None, None),
])
def test_parse_cgroup(text, unit, container):
    cg = H.parse_cgroup(text)
    assert cg["unit"] == unit
    assert cg["container"] == container


def test_parse_status_nspid():
    st = H.parse_status("Name:\tx\nUid:\t1000\t1000\t1000\t1000\nNSpid:\t91234\t17\n")
    assert st["uid"] == 1000
    assert st["nspid"] == [91234, 17]


@pytest.mark.parametrize("path,expected", [
    ("/dev/nvidia0", ("gpu", 0)),
    ("/dev/nvidia15", ("gpu", 15)),
    ("/dev/nvidiactl", ("hostwide", "/dev/nvidiactl")),
    ("/dev/nvidia-uvm", ("hostwide", "/dev/nvidia-uvm")),
    ("/dev/nvidia-caps/nvidia-cap1", ("hostwide", "/dev/nvidia-caps/nvidia-cap1")),
    ("/dev/nvidia-foo", None),
    ("/dev/null", None),
    ("socket:[1234]", None),
])
def test_classify_real_device_path(path, expected):
    assert classify_real_device_path(path) == expected


@pytest.mark.parametrize("info,protected", [
    ({"name": "nv-hostengine", "exe": "/usr/bin/nv-hostengine", "argv": ["nv-hostengine"]}, True),
    ({"name": "nvidia-persiste", "exe": "/usr/bin/nvidia-persistenced", "argv": ["/usr/bin/nvidia-persistenced"]}, True),
    ({"name": "dcgm-exporter", "exe": "/usr/bin/dcgm-exporter", "argv": ["dcgm-exporter"]}, True),
    ({"name": "python3", "exe": "/usr/bin/python3", "argv": ["python3", "x.py"], "unit": "nvsm-core.service"}, True),
    ({"name": "nvidia-smi", "exe": "/usr/bin/nvidia-smi", "argv": ["nvidia-smi"]}, True),
    # a job that merely mentions a daemon in its arguments is not protected by the defaults
    ({"name": "python3", "exe": "/usr/bin/python3", "argv": ["python3", "log-nvidia-smi.py"],
      "cmdline": "python3 log-nvidia-smi.py"}, False),
    ({"name": "python3", "exe": "/usr/bin/python3", "argv": ["python3", "-m", "vllm"], "cmdline": "python3 -m vllm"},
     False),
])
def test_protected_defaults(info, protected):
    assert bool(H.ProtectedMatcher().match(info)) is protected


def test_protected_user_pattern_and_no_defaults():
    m = H.ProtectedMatcher(["site-agent"], use_defaults=False)
    assert m.match({"name": "python3", "cmdline": "python3 /opt/site-agent/run.py"}) == "site-agent"
    assert m.match({"name": "nv-hostengine", "exe": "/usr/bin/nv-hostengine"}) is None
    with pytest.raises(Exception):
        H.ProtectedMatcher(["(unclosed"])


@pytest.fixture
def host(tmp_path):
    fp = FakeProc(tmp_path / "proc")
    pids = {
        "job": fp.add(BASE + 1, argv=["python3", "train.py"], fds=[gpu_fd(0)] + HOSTWIDE),
        "child": fp.add(BASE + 2, ppid=1, pgid=BASE + 1, argv=["python3", "train.py"], fds=[gpu_fd(0)]),
        "monitor": fp.add(BASE + 3, argv=["python3", "mon.py"], fds=[gpu_fd(0), gpu_fd(1)] + HOSTWIDE),
        "dcgm": fp.add(BASE + 4, comm="nv-hostengine", argv=["/usr/bin/nv-hostengine"], fds=[gpu_fd(0)] + HOSTWIDE,
                       cgroup="0::/system.slice/nvidia-dcgm.service"),
        "cpu": fp.add(BASE + 5, argv=["python3", "-m", "vllm.fake"]),
        "ctlonly": fp.add(BASE + 6, argv=["python3", "q.py"], fds=HOSTWIDE),
        "other_gpu": fp.add(BASE + 7, argv=["python3", "serve.py"], fds=[gpu_fd(1)],
                            cgroup="0::/system.slice/docker-" + "c" * 64 + ".scope", nspid=[BASE + 7, 12]),
        "reused": fp.add(BASE + 8, argv=["bash"]),
    }
    holds = {pids["job"]: {0: 100000}, pids["child"]: {0: 8000}, pids["other_gpu"]: {1: 5000},
             pids["dcgm"]: {0: 0}}
    extra = {0: [{"pid": 0, "used_mib": 1, "type": "compute"},
                 {"pid": 4294967295, "used_mib": 1, "type": "compute"},
                 {"pid": BASE + 99, "used_mib": 700, "type": "compute"},   # not visible here
                 {"pid": pids["reused"], "used_mib": 50, "type": "compute"}]}  # visible, holds no GPU
    be = FakeBackend(fp, n=2, holds=holds, extra_listed=extra)
    return fp, be, pids


def test_discover_joins_views_and_classifies(host):
    fp, be, pids = host
    d = H.discover(be, be.gpus(), H.ProtectedMatcher(), own_tree={pids["ctlonly"]}, proc_root=fp.root)
    hs = d["holders"]
    assert hs[pids["job"]]["class"] == "compute"
    assert hs[pids["job"]]["seen_by"] == ["fd", "driver"]
    assert hs[pids["job"]]["gpu_memory_mib"] == {0: 100000}
    assert hs[pids["child"]]["class"] == "compute" and hs[pids["child"]]["ppid"] == 1
    assert hs[pids["monitor"]]["class"] == "management"
    assert hs[pids["monitor"]]["gpus"] == [0, 1]
    assert hs[pids["dcgm"]]["class"] == "protected"
    assert hs[pids["dcgm"]]["unit"] == "nvidia-dcgm.service"
    assert hs[pids["ctlonly"]]["class"] == "self"
    assert hs[pids["ctlonly"]]["gpus"] == []
    assert pids["cpu"] not in hs
    assert hs[pids["other_gpu"]]["container"] == "docker:" + "c" * 64
    assert hs[pids["other_gpu"]]["nspid"] == [BASE + 7, 12]
    assert pids["reused"] not in hs
    unresolved = dict((u["pid"], u["reason"]) for u in d["unresolved"][0])
    assert set(unresolved) == {BASE + 99, pids["reused"]}
    assert "another PID namespace" in unresolved[BASE + 99]
    assert "does not hold" in unresolved[pids["reused"]]
    assert sorted(x["pid"] for x in d["invalid_driver_pids"]) == [0, 4294967295]


def test_describe_process_fields(host):
    fp, be, pids = host
    info = H.describe_process(pids["job"], fp.root)
    assert info["cmdline"] == "python3 train.py"
    assert info["create_time"] == fp.create_time(pids["job"])
    assert info["user"] == "root"
    assert info["dstate"] is False
    fp.set_state(pids["job"], "D")
    assert H.describe_process(pids["job"], fp.root)["dstate"] is True
    assert H.describe_process(BASE + 500, fp.root) is None


def test_scan_device_fds(host):
    fp, be, pids = host
    found, unreadable = H.scan_device_fds(classify_real_device_path, fp.root)
    assert found[pids["monitor"]]["gpus"] == {0, 1}
    assert found[pids["ctlonly"]]["gpus"] == set()
    assert pids["cpu"] not in found


def test_valid_driver_pid():
    assert not H.valid_driver_pid(0)
    assert not H.valid_driver_pid(1)
    assert not H.valid_driver_pid(4294967295)
    assert not H.valid_driver_pid(-1)
    assert not H.valid_driver_pid("x")
    assert H.valid_driver_pid(2)

"""Fakes for the GPU unit tests: a fake /proc tree, a fake backend, a fake signaller.

Fake PIDs live above 4,000,000 so that even a bug could not reach a real process (and the
fake signaller never calls the kernel anyway).
"""

import os

from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_backend import (
    GpuBackend,
    classify_real_device_path,
)

BTIME = 1700000000
HZ = os.sysconf("SC_CLK_TCK")
BASE = 4000000


class FakeProc(object):
    """Builds /proc/<pid>/{stat,status,cmdline,cgroup,fd/} under a temp dir."""

    def __init__(self, root):
        self.root = str(root)
        os.makedirs(self.root, exist_ok=True)
        with open(os.path.join(self.root, "stat"), "w") as f:
            f.write("cpu  1 2 3 4\nbtime %d\n" % BTIME)
        self.procs = {}

    def add(self, pid, comm="python3", ppid=1, pgid=None, sid=None, state="S", start=1000,
            argv=None, fds=(), cgroup="0::/user.slice/user-0.slice/session-1.scope", uid=0, nspid=None):
        pgid = pid if pgid is None else pgid
        sid = pid if sid is None else sid
        d = os.path.join(self.root, str(pid))
        os.makedirs(os.path.join(d, "fd"), exist_ok=True)
        rest = [state, str(ppid), str(pgid), str(sid)] + ["0"] * 15 + [str(start)] + ["0"] * 10
        with open(os.path.join(d, "stat"), "w") as f:
            f.write("%d (%s) %s\n" % (pid, comm, " ".join(rest)))
        with open(os.path.join(d, "status"), "w") as f:
            f.write("Name:\t%s\nUid:\t%d\t%d\t%d\t%d\nNSpid:\t%s\n"
                    % (comm, uid, uid, uid, uid, "\t".join(str(x) for x in (nspid or [pid]))))
        with open(os.path.join(d, "cmdline"), "wb") as f:
            f.write(b"\0".join(a.encode() for a in (argv or [comm])) + b"\0")
        with open(os.path.join(d, "cgroup"), "w") as f:
            f.write(cgroup + "\n")
        for n, target in enumerate(fds):
            os.symlink(target, os.path.join(d, "fd", str(n + 3)))
        self.procs[pid] = {"start": start}
        return pid

    def create_time(self, pid):
        return round(BTIME + self.procs[pid]["start"] / float(HZ), 2)

    def set_state(self, pid, state):
        p = os.path.join(self.root, str(pid), "stat")
        with open(p) as f:
            text = f.read()
        head, tail = text.rsplit(")", 1)
        parts = tail.split()
        parts[0] = state
        with open(p, "w") as f:
            f.write(head + ") " + " ".join(parts) + "\n")

    def remove(self, pid):
        d = os.path.join(self.root, str(pid))
        for n in os.listdir(os.path.join(d, "fd")):
            os.unlink(os.path.join(d, "fd", n))
        os.rmdir(os.path.join(d, "fd"))
        for n in os.listdir(d):
            os.unlink(os.path.join(d, n))
        os.rmdir(d)
        self.procs.pop(pid, None)

    def alive(self, pid):
        return os.path.isdir(os.path.join(self.root, str(pid)))


class FakeBackend(GpuBackend):
    """GPUs whose memory is baseline + the memory of fake processes still in the fake /proc.

    ``holds`` maps pid -> {gpu index: MiB}; ``release_polls`` polls after a holder vanished
    its memory is still counted (release latency).
    """

    name = "fake"

    def __init__(self, fp, n=2, holds=None, extra_listed=None, release_polls=1, baseline=0):
        self.fp = fp
        self.n = n
        self.holds = holds if holds is not None else {}
        self.extra_listed = extra_listed or {}
        self.release_polls = release_polls
        self.gone = {}
        self.baseline = baseline
        self.polls = 0

    def gpus(self):
        mem = self.memory(range(self.n))
        return [{"index": i, "uuid": "GPU-0000000%d-aaaa-bbbb-cccc-dddddddddddd" % i, "name": "Fake H200",
                 "minor": i, "pci_bus_id": None, "persistence_mode": True, "mig_mode": False,
                 "retired_pages_pending": None, "remapped_rows_pending": False,
                 "remapped_rows_failure": False, "memory": mem[i]} for i in range(self.n)]

    def poll(self, indices):
        self.polls += 1
        mem, procs = {}, {}
        for i in indices:
            used = self.baseline
            lst = []
            for pid, g in self.holds.items():
                if i not in g:
                    continue
                if self.fp.alive(pid):
                    lst.append({"pid": pid, "used_mib": g[i], "type": "compute"})
                    used += g[i]
                else:
                    seen = self.gone.setdefault(pid, self.polls)
                    if self.polls - seen < self.release_polls:
                        used += g[i]
            lst += self.extra_listed.get(i, [])
            mem[i] = {"total_mib": 143771, "used_mib": used, "reserved_mib": 615,
                      "free_mib": 143771 - 615 - used, "api": "v2"}
            procs[i] = lst
        return mem, procs

    def classify_device_path(self, path):
        return classify_real_device_path(path)

    def idle_used_mib(self, index):
        return self.baseline


class FakeSignaller(object):
    """Applies signals to the fake /proc: SIGTERM removes unless ignored, SIGKILL removes
    unless in D state.  Records every call."""

    def __init__(self, fp, ignore_term=(), dstate=()):
        self.fp = fp
        self.ignore_term = set(ignore_term)
        self.dstate = set(dstate)
        self.calls = []

    def _hit(self, pid, sig):
        import signal
        if not self.fp.alive(pid):
            return
        if pid in self.dstate:
            return
        if sig == signal.SIGTERM and pid in self.ignore_term:
            return
        self.fp.remove(pid)

    def send(self, pid, sig, create_time, proc_root):
        assert pid > 1
        self.calls.append(("kill", pid, int(sig)))
        self._hit(pid, sig)

    def send_group(self, pgid, sig, expected, proc_root):
        assert pgid > 1
        self.calls.append(("killpg", pgid, int(sig), sorted(expected)))
        for pid in list(expected):
            self._hit(pid, sig)


class FakeClock(object):
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def gpu_fd(i):
    return "/dev/nvidia%d" % i


HOSTWIDE = ["/dev/nvidiactl", "/dev/nvidia-uvm"]

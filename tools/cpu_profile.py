# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Where a command's CPU goes: every process that exits while it runs, each attributed through its
parents to the pytest test, the container and the kind of program it belongs to.

  sudo .venv/bin/python tools/cpu_profile.py record OUT -- make test
  .venv/bin/python tools/cpu_profile.py report OUT

record (root, CAP_SYS_PACCT): turns Linux process accounting on into OUT/pacct for the command's run
(acct(2); any accounting already on is replaced, and accounting is off afterwards), and
samples every process once a second into OUT/procs.jsonl: its command line, parent, start, the pytest
test in its environment (PYTEST_CURRENT_TEST) and its container (from its cgroup; names from `docker
ps`). OUT/busy.json holds the machine's busy CPU seconds over the run (/proc/stat). The command's exit
status is record's; its environment has GPUFLOW_CPU_PROFILE_OUT=OUT (a test that calls acct(2) skips
then). A process shorter than a second is not sampled; accounting still counts its CPU, which goes to
its nearest sampled parent.

report: CPU seconds by kind of program, by pytest test, by container, the dearest processes, and what
Ansible's tasks cost: worker forks of ansible-playbook, and module runs (a bare interpreter reading
its module from a pipe, or an AnsiballZ file).
"""
import argparse
import collections
import ctypes
import json
import os
import re
import statistics
import struct
import subprocess
import sys
import threading
import time

# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime, etime (float),
# utime, stime, mem, io, rw, minflt, majflt, swaps (comp_t), comm[16]
ACCT_V3 = struct.Struct("<BBHIIIIIIf8H16s")
AHZ = 100  # comp_t times are in 1/AHZ seconds
RECORDING_ENV = "GPUFLOW_CPU_PROFILE_OUT"  # set for the recorded command: OUT
KINDS = (  # first match on a command line (or a process name) names the kind
    ("vllm", r"vllm\.entrypoints|vllm serve|VLLM::|multiprocessing\.spawn.*venvs?/vllm|/vllm[^ ]*/bin/python -c"),
    ("training", r"gpuflow_train_launch|e3_train\.py|speculators\.train|torch\.distributed"),
    ("extraction", r"hs_extract\.py"),
    ("ansible controller and workers", r"ansible-playbook|^ansible-playboo$"),
    ("ansible module", r"AnsiballZ|^/bin/sh -c .*python3? && sleep 0|^/\S*python3?(\.\d+)?$"),
    ("pip", r"\bpip\b"),
    ("ansible-test", r"ansible-test|/ansible/test/venv/"),
    ("ansible-lint", r"ansible-lint"),
    ("molecule", r"\bmolecule\b"),
    ("docker", r"^(dockerd|containerd|containerd-shim|runc|docker|docker-init|docker-proxy)\b"),
    ("pytest", r"\bpytest\b"),
)


def comp_t(value):
    """comp_t: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def read_pacct(path):
    """The v3 records of a process accounting file: comm, pid, ppid, begin (epoch s), cpu_s, elapsed_s."""
    records = []
    with open(path, "rb") as f:
        data = f.read()
    for offset in range(0, len(data) - ACCT_V3.size + 1, ACCT_V3.size):
        rec = ACCT_V3.unpack_from(data, offset)
        if rec[1] & 0x0F != 3:
            continue
        records.append({"comm": rec[18].split(b"\0", 1)[0].decode(errors="replace"), "pid": rec[6],
                        "ppid": rec[7], "begin": rec[8], "elapsed": rec[9] / AHZ,
                        "cpu": (comp_t(rec[10]) + comp_t(rec[11])) / AHZ})
    return records


def busy_seconds():
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields[i] for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")  # user nice system irq softirq


def read_text(path, mode="r"):
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return None


def sample_once(procs, boot, tick):
    now = time.time()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = read_text("/proc/%s/stat" % name)
        if not stat:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        start = boot + int(fields[19]) / tick
        key = "%s@%.2f" % (name, start)
        if key not in procs:
            environ = read_text("/proc/%s/environ" % name, "rb") or b""
            test = next((v[20:].decode(errors="replace") for v in environ.split(b"\0")
                         if v.startswith(b"PYTEST_CURRENT_TEST=")), None)
            container = re.search(r"docker[-/]([0-9a-f]{64})", read_text("/proc/%s/cgroup" % name) or "")
            procs[key] = {"pid": int(name), "ppid": int(fields[1]), "start": start,
                          "comm": stat[stat.find("(") + 1:stat.rfind(")")],
                          "cmd": (read_text("/proc/%s/cmdline" % name) or "").replace("\0", " ").strip()[:400],
                          "test": test, "container": container.group(1) if container else None}
        procs[key]["last"] = now


def container_names():
    try:
        out = subprocess.run(["docker", "ps", "--no-trunc", "--format", "{{.ID}} {{.Names}}"], capture_output=True,
                             text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def record(out, command):
    os.makedirs(out, exist_ok=True)
    pacct = os.path.join(out, "pacct")
    open(pacct, "wb").close()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(pacct.encode()) != 0:
        sys.exit("acct(%s): %s (process accounting needs root)" % (pacct, os.strerror(ctypes.get_errno())))
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    procs, names, done = {}, {}, threading.Event()
    tick = os.sysconf("SC_CLK_TCK")

    def sampler():
        last_names = 0.0
        while not done.wait(1.0):
            sample_once(procs, boot, tick)
            if time.time() - last_names > 20:
                last_names = time.time()
                names.update(container_names())

    thread = threading.Thread(target=sampler, daemon=True)
    busy0, wall0 = busy_seconds(), time.time()
    thread.start()
    try:
        # the command learns that it is recorded: acct(2) inside it would end this recording (one file per system)
        status = subprocess.run(command, check=False, env=dict(os.environ, **{RECORDING_ENV: out})).returncode
    finally:
        done.set()
        thread.join()
        libc.acct(None)
        with open(os.path.join(out, "busy.json"), "w") as f:
            json.dump({"busy_cpu_s": round(busy_seconds() - busy0, 1), "wall_s": round(time.time() - wall0, 1),
                       "command": command}, f)
        with open(os.path.join(out, "procs.jsonl"), "w") as f:
            for proc in procs.values():
                proc["container_name"] = names.get(proc["container"])
                f.write(json.dumps(proc) + "\n")
    return status


class Samples:
    """The sampled processes by pid, each with the time span it was seen alive in."""

    def __init__(self, rows):
        self.by_pid = collections.defaultdict(list)
        for row in rows:
            self.by_pid[row["pid"]].append(row)

    def at(self, pid, when):
        return next((r for r in self.by_pid.get(pid, ()) if r["start"] - 2 <= when <= r["last"] + 2), None)

    def ancestry(self, pid, when):
        """The sampled process and its sampled parents, nearest first (a pid reused later is not confused
        with its earlier owner: each must have been alive at `when`)."""
        chain = []
        while pid > 1 and len(chain) < 100:
            row = self.at(pid, when)
            if row is None:
                break
            chain.append(row)
            pid = row["ppid"]
        return chain


def kind_of(comm, own, chain):
    """The kind of a process: from its own command line when it was sampled, else from its nearest sampled
    parents'; an unsampled Python right under ansible-playbook is a module run (/bin/sh -c 'python3 && ...')."""
    if own is None and comm.startswith("python") and chain and "ansible-playbook" in chain[0]["cmd"]:
        return "ansible module"
    for text in ([own["cmd"]] if own else []) + [comm] + [r["cmd"] or r["comm"] for r in chain]:
        for kind, pattern in KINDS:
            if re.search(pattern, text):
                return kind
    return "other (%s)" % comm


def attribute(records, samples):
    """Each accounting record with its kind, pytest test and container, from its own sample or, when it
    was too short to be sampled, its parent's."""
    for rec in records:
        when = rec["begin"] + 0.5
        own = samples.at(rec["pid"], when)
        chain = samples.ancestry(rec["ppid"] if own is None else own["ppid"], when)
        lineage = ([own] if own else []) + chain
        test = next((r["test"] for r in lineage if r["test"]), None)
        container = next((r["container_name"] or r["container"][:12] for r in lineage if r["container"]), None)
        yield dict(rec, kind=kind_of(rec["comm"], own, chain), container=container,
                   test=re.sub(r" \((setup|call|teardown)\)$", "", test) if test else None)


def report(out, top):
    with open(os.path.join(out, "procs.jsonl")) as f:
        samples = Samples(json.loads(line) for line in f)
    records = list(attribute(read_pacct(os.path.join(out, "pacct")), samples))
    total = sum(r["cpu"] for r in records)
    busy = read_text(os.path.join(out, "busy.json"))
    if busy:
        busy = json.loads(busy)
        print("machine: %.0f busy CPU-s over %.0f s of wall time (%.2f cores busy on average)"
              % (busy["busy_cpu_s"], busy["wall_s"], busy["busy_cpu_s"] / max(busy["wall_s"], 1)))
    print("process accounting: %.0f CPU-s in %d processes" % (total, len(records)))
    for title, key, limit in (("kind of program", "kind", 20), ("pytest test", "test", top),
                              ("container", "container", top)):
        sums = collections.Counter()
        for r in records:
            if r[key]:
                sums[r[key]] += r["cpu"]
        print("\n== CPU-s by %s ==" % title)
        for name, cpu in sums.most_common(limit):
            print("%8.0f  %5.1f%%  %s" % (cpu, 100 * cpu / total, name))
    workers = [r["cpu"] for r in records if r["comm"] == "ansible-playboo"]
    modules = [r["cpu"] for r in records if r["kind"] == "ansible module" and r["comm"].startswith("python")]
    print("\n== Ansible per task ==")
    for name, runs in (("ansible-playbook processes (a worker fork per task and host)", workers),
                       ("module runs (their Python processes)", modules)):
        if runs:
            print("%-62s %6d  %7.0f CPU-s  median %.2f" % (name, len(runs), sum(runs), statistics.median(runs)))
    print("\n== the %d dearest processes ==" % top)
    for r in sorted(records, key=lambda r: -r["cpu"])[:top]:
        print("%7.1f  %-16s %-14s %s" % (r["cpu"], r["comm"], r["kind"][:14], r["test"] or r["container"] or ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True)
    rec = sub.add_parser("record", help="run a command with process accounting and sampling")
    rec.add_argument("out")
    rec.add_argument("command", nargs=argparse.REMAINDER)
    rep = sub.add_parser("report", help="print where the recorded CPU went")
    rep.add_argument("out")
    rep.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    if a.action == "record":
        command = a.command[1:] if a.command[:1] == ["--"] else a.command
        if not command:
            ap.error("record needs a command after --")
        sys.exit(record(a.out, command))
    report(a.out, a.top)


if __name__ == "__main__":
    main()

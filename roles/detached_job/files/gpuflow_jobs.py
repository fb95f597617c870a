"""The detached-job machinery of gpuflow's host programs (datagen.py, hs_extract.py, e3_train.py, vllm_proc.py).

Shipped beside each program by its role (standard library only), or put in front of a program that a role feeds
to `python -` on stdin (the host_program filter). One behaviour for all of them:

  detach        pipe, fork, setsid, fork again, own process group, stdin from /dev/null, stdout and
                stderr appended to the job's log; the caller returns once the job has recorded its pid.
  pid files     the pid with the process's create time (/proc/PID/stat field 22): a pid file whose pid
                now belongs to another process is stale, and nobody signals or awaits that process.
  atomic_json   temp file, fsync, rename, fsync of the directory: a reader sees the old file or the new,
                never a torn one, even across a SIGKILL or a crash.
  read_json     reading a JSON file that may be missing or half-written by someone else.
  job_status    a job that vanished without writing its last state (SIGKILL, OOM killer, reboot) reads
                ``died``, with its log named.
  emit          one JSON line on stdout, flushed (what the roles parse).
  sha256_file   a file's checksum, read in 1 MiB pieces (the jobs' input fingerprints).
"""
import errno
import hashlib
import json
import os
import sys
import time

# what a job writes while it works; gone without one of its final states, it died
RUNNING_STATES = ("starting", "running")


def emit(obj):
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def sync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        # raised, but for filesystems that cannot sync a directory at all (EINVAL), where the rename is all
        # the durability there is: a state file reported written must survive a crash, or the run must fail
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def atomic_json(path, obj, sync=True):
    """Replace path with obj as JSON. sync=False for progress rewritten every second and worthless after a
    crash: still atomic (no torn file), not durable."""
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        sync_dir(os.path.dirname(os.path.abspath(path)))


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- processes and pid files
def stat_fields(pid):
    """The fields of /proc/PID/stat from field 3 (state) on; None when the process is gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            text = f.read()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: split after the last ')'
    return text.rsplit(")", 1)[1].split()


def create_time(pid):
    """Start time of a live process in clock ticks after boot; None when it is gone or a zombie."""
    fields = stat_fields(pid)
    if not fields or fields[0] == "Z":
        return None
    return int(fields[19])


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return [c.decode(errors="replace") for c in f.read().split(b"\0") if c]
    except OSError:
        return []


def own_record():
    return {"pid": os.getpid(), "starttime": create_time(os.getpid()), "started": time.time()}


def write_pidfile(path, text=False):
    """This process's record: JSON, or with text=True one line "PID STARTTIME" (datagen.pid, whose first
    word tools read as the pid)."""
    record = own_record()
    if not text:
        atomic_json(path, record)
        return
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        f.write("%d %d\n" % (record["pid"], record["starttime"]))
    os.replace(tmp, path)


def read_pidfile(path):
    """(pid, starttime) of a pid file in either form, None for a missing, torn or foreign one."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if isinstance(record, dict):
        pid, starttime = record.get("pid"), record.get("starttime")
    else:
        try:
            pid, starttime = (int(word) for word in text.split()[:2])
        except ValueError:  # also fewer than two words
            return None
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return None
    return pid, starttime


def live_pid(path, looks_like=None):
    """The pid the pid file records while that process still runs, or None. The pid is believed only with
    the create time recorded: pids are reused, and a stale pid file must not make another process a job
    that is awaited or signalled. looks_like(argv), when given, also checks the command line."""
    record = read_pidfile(path)
    if record is None:
        return None
    pid, starttime = record
    if starttime is None or create_time(pid) != starttime:
        return None
    if looks_like is not None and not looks_like(cmdline(pid)):
        return None
    return pid


# ----------------------------------------------------------------------------- detach
def detach(log_path, pid_path, text_pidfile=False):
    """Fork the job off so that it outlives the caller, its SSH session and the Ansible task that started it.
    In the caller: returns {"started", "running", "pid"} once the job has written its pid file (pid None when
    it failed before that). In the job: returns None; the job ends with os._exit."""
    sys.stdout.flush()
    r, w = os.pipe()
    first = os.fork()
    if first > 0:
        os.close(w)
        with os.fdopen(r) as rf:
            pid = rf.read().strip()
        os.waitpid(first, 0)
        return {"started": bool(pid), "running": bool(pid), "pid": int(pid) if pid else None}
    os.close(r)
    # a new session: no controlling terminal, and the end of the caller's session (SIGHUP, a kill of
    # its processes) does not reach the job
    os.setsid()
    if os.fork() > 0:
        os._exit(0)  # the job is re-parented to init: not the caller's child, not a session leader
    os.setpgid(0, 0)  # the job leads its own process group: one signal reaches it and its children
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)
    write_pidfile(pid_path, text=text_pidfile)
    os.write(w, str(os.getpid()).encode())
    os.close(w)
    return None


# ----------------------------------------------------------------------------- status
def job_status(progress_path, running, log_path, what="job"):
    """The job's progress file as the roles read it, with "running"; a job that is gone while its progress
    still says it works died without a word (SIGKILL, the OOM killer, a reboot)."""
    p = read_json(progress_path)
    if not isinstance(p, dict):
        p = {"state": "absent"}
    p["running"] = bool(running)
    if not p["running"] and p.get("state") in RUNNING_STATES:
        p["state"] = "died"
        p["msg"] = "the %s (pid %s) is gone without a final state (killed?); see %s" % (
            what, p.get("pid", "?"), log_path)
    return p

"""roles/detached_job/files/gpuflow_jobs.py, the job library datagen.py, hs_extract.py and e3_train.py share: a
detached job outlives its caller, a pid file is believed only with its process's create time, a state write
is whole or not at all, and a job gone without a word reads died."""
import json
import os
import signal
import subprocess
import sys
import time

LIB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "roles", "detached_job", "files")
sys.path.insert(0, LIB_DIR)
import gpuflow_jobs as J  # noqa: E402  pylint: disable=wrong-import-position

# the caller detaches a job that writes "running" and sleeps, prints what detach returned, and sleeps too
CALLER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import gpuflow_jobs as J
out = sys.argv[2]
launched = J.detach(out + "/job.log", out + "/job.pid")
if launched is None:
    print("job log line", flush=True)
    J.atomic_json(out + "/progress.json", {"state": "running", "pid": J.os.getpid()})
    time.sleep(60)
    J.os._exit(0)
print(json.dumps(launched), flush=True)
time.sleep(60)
"""


def alive(pid):
    return J.create_time(pid) is not None


def wait_until(cond, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def start_caller(tmp_path):
    caller = subprocess.Popen([sys.executable, "-c", CALLER, LIB_DIR, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    launched = json.loads(caller.stdout.readline())
    assert launched["started"] and launched["pid"]
    return caller, launched["pid"]


def kill_session(sid):
    """What the end of an SSH session does to what it started: every process of its session killed."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getsid(int(d)) == sid:
                    os.kill(int(d), signal.SIGKILL)
            except OSError:
                pass


def test_a_detached_job_survives_its_parents_sigkill(tmp_path):
    caller, job = start_caller(tmp_path)
    try:
        assert J.live_pid(str(tmp_path / "job.pid")) == job
        kill_session(os.getsid(caller.pid))
        caller.wait(timeout=10)
        time.sleep(0.3)
        assert alive(job), "the job died with its caller's session"
        assert os.getpgid(job) == job, "the job does not lead its own process group"
        assert J.live_pid(str(tmp_path / "job.pid")) == job
    finally:
        if alive(job):
            os.kill(job, signal.SIGKILL)


def test_a_pid_file_whose_pid_is_another_process_now_is_stale(tmp_path):
    other = subprocess.Popen(["sleep", "30"])
    try:
        assert wait_until(lambda: J.create_time(other.pid) is not None)
        now = J.create_time(other.pid)
        pidfile = str(tmp_path / "job.pid")
        # the pid was reused: the recorded job started at another tick than the process now holding the pid
        J.atomic_json(pidfile, {"pid": other.pid, "starttime": now - 1})
        assert J.live_pid(pidfile) is None
        with open(pidfile, "w") as f:
            f.write("%d %d\n" % (other.pid, now + 7))
        assert J.live_pid(pidfile) is None
        # a record without a create time (an older job's) is not believed either
        J.atomic_json(pidfile, {"pid": other.pid})
        assert J.live_pid(pidfile) is None
        J.atomic_json(pidfile, {"pid": other.pid, "starttime": now})
        assert J.live_pid(pidfile) == other.pid
        assert J.live_pid(pidfile, looks_like=lambda args: "hs_extract.py" in args) is None
    finally:
        other.kill()
        other.wait()


def test_the_pid_file_the_job_writes_is_believed_in_both_forms(tmp_path):
    for text in (False, True):
        path = str(tmp_path / ("t.pid" if text else "j.pid"))
        J.write_pidfile(path, text=text)
        assert J.live_pid(path) == os.getpid()
    with open(str(tmp_path / "t.pid")) as f:
        assert int(f.read().split()[0]) == os.getpid()  # datagen.pid: tools read its first word


# writes the new state through a list that SIGKILLs the writer halfway through the serialisation
KILLED_WRITER = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import gpuflow_jobs as J

class Killer(list):
    def __iter__(self):
        yield "x" * 100000
        os.kill(os.getpid(), signal.SIGKILL)

J.atomic_json(sys.argv[2], {"state": "new", "rows": Killer([1])})
"""


def test_an_atomic_write_killed_halfway_leaves_the_old_file_whole(tmp_path):
    path = str(tmp_path / "MANIFEST.json")
    J.atomic_json(path, {"state": "old", "rows": list(range(100))})
    p = subprocess.run([sys.executable, "-c", KILLED_WRITER, LIB_DIR, path], check=False)
    assert p.returncode == -signal.SIGKILL
    assert J.read_json(path) == {"state": "old", "rows": list(range(100))}


def test_read_json_of_a_half_written_file_is_the_default(tmp_path):
    path = tmp_path / "progress.json"
    path.write_text('{"state": "runn')
    assert J.read_json(str(path), {"state": "absent"}) == {"state": "absent"}


def test_a_job_killed_without_a_word_reads_died_with_its_log(tmp_path):
    caller, job = start_caller(tmp_path)
    progress, log = str(tmp_path / "progress.json"), str(tmp_path / "job.log")
    try:
        assert wait_until(lambda: (J.read_json(progress) or {}).get("state") == "running")
        p = J.job_status(progress, J.live_pid(str(tmp_path / "job.pid")), log)
        assert p["running"] and p["state"] == "running"
        os.kill(job, signal.SIGKILL)
        assert wait_until(lambda: J.live_pid(str(tmp_path / "job.pid")) is None)
        p = J.job_status(progress, J.live_pid(str(tmp_path / "job.pid")), log, "extraction job")
        assert not p["running"]
        assert p["state"] == "died"
        assert log in p["msg"] and str(job) in p["msg"]
        with open(log) as f:
            assert "job log line" in f.read()  # the job's stdout went to its log
    finally:
        caller.kill()
        caller.wait()
        if alive(job):
            os.kill(job, signal.SIGKILL)


def test_a_job_that_ended_keeps_its_final_state(tmp_path):
    progress = str(tmp_path / "progress.json")
    for state in ("extracted", "failed", "stopped", "trained", "complete"):
        J.atomic_json(progress, {"state": state})
        assert J.job_status(progress, None, "log")["state"] == state
    assert J.job_status(str(tmp_path / "none.json"), None, "log") == {"state": "absent", "running": False}

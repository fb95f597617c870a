"""roles/vllm_server/files/vllm_proc.py, the process launcher that runs as root while the server runs as its
service account: what that account can plant (symlinks, pid files, directories) must not make root chown,
overwrite or signal anything, the pid file is believed only while its process keeps the recorded identity,
the API key never reaches a command line, and the env file reads back what the template wrote.

The account here is nobody:nogroup; the tests run the helper as root (as in CI)."""
import contextlib
import grp
import http.server
import importlib.util
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest
from ansible.plugins.filter.core import to_json

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HELPER = os.path.join(REPO, "roles", "vllm_server", "files", "vllm_proc.py")
ACCOUNT = pwd.getpwnam("nobody")
ACCOUNT_GROUP = grp.getgrgid(ACCOUNT.pw_gid).gr_name
SECRET_KEY = "sk-test-3f9c1e77b2a04d5e"
# the "server": says so on its stdout (the log), then sleeps
SERVER_ARGV = ["/usr/bin/python3", "-c", "print('server up', flush=True); import time; time.sleep(300)"]

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the launcher's privileged paths need root")


def helper(*args, timeout=60):
    p = subprocess.run([sys.executable, HELPER] + [str(a) for a in args], capture_output=True, text=True,
                       timeout=timeout, check=False)
    assert p.stdout, p.stderr
    return p.returncode, json.loads(p.stdout)


def as_account(action):
    """Run action() in a child that is the service account; its exit status: 0 done, 13 refused (EACCES)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.setgroups([])
            os.setgid(ACCOUNT.pw_gid)
            os.setuid(ACCOUNT.pw_uid)
            action()
        except PermissionError:
            code = 13
        except BaseException:  # any other failure must not look like success or a refusal
            code = 1
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def owner_mode(path):
    st = os.lstat(path)
    return st.st_uid, st.st_gid, st.st_mode


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def identity(pid):
    """(start time, command line) of a process; the command line reads empty for a moment after Popen returns."""
    with open("/proc/%d/stat" % pid) as f:
        starttime = int(f.read().rsplit(")", 1)[1].split()[19])
    for _attempt in range(400):
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            cmdline = f.read().decode().split("\0")[:-1]
        if cmdline:
            break
        time.sleep(0.005)
    return starttime, cmdline


@pytest.fixture
def host():
    """A managed host in miniature: etc/ (root's: config, run, log), home/ (the account's), a root-only file."""
    base = tempfile.mkdtemp(prefix="vllm-proc-")
    h = {"base": base, "etc": os.path.join(base, "etc"), "home": os.path.join(base, "home"),
         "run": os.path.join(base, "etc", "run"), "log": os.path.join(base, "etc", "log"),
         "secret": os.path.join(base, "secret"), "started": []}
    try:
        os.chmod(base, 0o755)  # the account must reach its home; /tmp itself is sticky, so this stays root's
        assert helper("mkdir", *("--path=" + h[d] for d in ("etc", "run", "log")), "--mode", "0750", "--owner", "root",
                      "--group", ACCOUNT_GROUP, "--trusted") == (0, {"changed": True, "paths": [h["etc"], h["run"], h["log"]]})
        assert helper("mkdir", "--path", h["home"], "--mode", "0750", "--owner", ACCOUNT.pw_name,
                      "--group", ACCOUNT_GROUP)[0] == 0
        os.mkdir(h["secret"], 0o700)
        h["shadow"] = os.path.join(h["secret"], "shadow")
        with open(h["shadow"], "w") as f:
            f.write("root-only\n")
        os.chmod(h["shadow"], 0o600)
        with open(os.path.join(h["etc"], "argv.json"), "w") as f:
            json.dump(SERVER_ARGV, f)
        write_env(os.path.join(h["etc"], "x.env"), {"VLLM_API_KEY": SECRET_KEY})
        yield h
    finally:
        # only the groups the launcher reported starting: a pid file here may name anybody's process
        for pid in h["started"]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(base, ignore_errors=True)


def write_env(path, env):
    """The env file as roles/vllm_server/templates/vllm.env.j2 writes it (KEY={{ v | string | to_json }})."""
    with open(path, "w") as f:
        f.write("#\n# Ansible managed\n#\n# Environment of vllm-x.service (read by systemd as root; mode 0600).\n")
        for k, v in sorted(env.items()):
            f.write("%s=%s\n" % (k, to_json(str(v))))
    os.chmod(path, 0o600)


def start(h, run=None, log=None, user=True):
    args = ["start", "--argv-file", os.path.join(h["etc"], "argv.json"), "--env-file", os.path.join(h["etc"], "x.env"),
            "--log", os.path.join(log or h["log"], "x.log"), "--pidfile", os.path.join(run or h["run"], "x.pid"),
            "--cwd", h["home"]]
    if user:
        args += ["--user", ACCOUNT.pw_name, "--group", ACCOUNT_GROUP]
    rc, res = helper(*args)
    if res.get("pid"):
        h["started"].append(res["pid"])
    return rc, res


@contextlib.contextmanager
def victim(own_session=True):
    """A root process the launcher did not start (in its own session: pid == pgid) and its identity record,
    as the launcher would write it; killed afterwards if the test left it running."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=own_session)
    try:
        starttime, cmdline = identity(proc.pid)
        yield proc, {"pid": proc.pid, "starttime": starttime, "cmdline": cmdline}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def log_text(path, timeout=30):
    """The log once the server's first line is in it: the launcher returns as soon as the process runs, and a
    loaded machine may take seconds to start its python."""
    deadline = time.monotonic() + timeout
    while True:
        with open(path) as f:
            text = f.read()
        if text.endswith("\n") or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def write_pidfile(path, record):
    with open(path, "w") as f:
        json.dump(record, f)


# --- the default layout: nothing root writes is in a directory the account can change -------------------------

@as_root
def test_the_account_cannot_plant_in_the_run_or_log_directory(host):
    for name in (os.path.join(host["log"], "x.log"), os.path.join(host["run"], "x.pid.tmp"),
                 os.path.join(host["run"], "x.pid")):
        assert as_account(lambda: os.symlink(host["shadow"], name)) == 13, name
        assert not os.path.lexists(name)


@as_root
def test_start_records_the_identity_and_stop_ends_the_group(host):
    rc, res = start(host)
    assert rc == 0 and res["changed"], res
    pid = res["pid"]
    with open(os.path.join(host["run"], "x.pid")) as f:
        record = json.load(f)
    starttime, cmdline = identity(pid)
    assert record == {"pid": pid, "starttime": starttime, "cmdline": SERVER_ARGV} and cmdline == record["cmdline"]
    assert os.stat("/proc/%d" % pid).st_uid == ACCOUNT.pw_uid and os.getpgid(pid) == pid
    log = os.stat(os.path.join(host["log"], "x.log"))
    assert log.st_uid == 0 and log.st_mode & 0o777 == 0o640  # root keeps the log; the server writes through its fd
    assert log_text(os.path.join(host["log"], "x.log")) == "server up\n"
    assert helper("status", "--pidfile", os.path.join(host["run"], "x.pid"))[1] == \
        {"running": True, "pid": pid, "pids": [pid], "stale": None}
    assert start(host)[1] == {"changed": False, "pid": pid}  # a second start finds it
    rc, res = helper("stop", "--pidfile", os.path.join(host["run"], "x.pid"), "--timeout", 10)
    assert rc == 0 and res["changed"] and res["pids_left"] == [] and not alive(pid), res
    assert not os.path.exists(os.path.join(host["run"], "x.pid"))


@as_root
def test_stop_without_a_run_directory_has_nothing_to_stop_and_start_names_the_missing_one(host):
    never = os.path.join(host["base"], "never", "run")
    assert helper("stop", "--pidfile", os.path.join(never, "x.pid")) == \
        (0, {"changed": False, "pids_left": [], "stale": None})
    rc, res = start(host, run=never)
    assert rc == 1 and "no such directory" in res["msg"] and os.path.dirname(never) in res["msg"], res


# --- the old layout (run and log under the home the account owns): refused, nothing touched --------------------

@as_root
def test_start_refuses_a_log_directory_the_account_owns_and_leaves_the_planted_target_alone(host):
    account_log = os.path.join(host["home"], "log")
    assert as_account(lambda: (os.mkdir(account_log), os.symlink(host["shadow"], os.path.join(account_log, "x.log")))) == 0
    before = owner_mode(host["shadow"])
    rc, res = start(host, log=account_log)
    assert rc == 1 and res["failed"] and "is not root's" in res["msg"] and account_log in res["msg"], res
    assert owner_mode(host["shadow"]) == before == (0, 0, before[2]) and open(host["shadow"]).read() == "root-only\n"
    assert not os.path.exists(os.path.join(host["run"], "x.pid"))  # nothing was started


@as_root
def test_start_refuses_a_run_directory_the_account_owns_and_writes_no_planted_tmp(host):
    account_run = os.path.join(host["home"], "run")
    assert as_account(lambda: (os.mkdir(account_run),
                               os.symlink(host["shadow"], os.path.join(account_run, "x.pid.tmp")))) == 0
    rc, res = start(host, run=account_run)
    assert rc == 1 and "is not root's" in res["msg"], res
    assert open(host["shadow"]).read() == "root-only\n" and owner_mode(host["shadow"])[0] == 0


@as_root
def test_stop_refuses_a_pid_file_the_account_forged_with_the_exact_identity_of_a_root_process(host):
    with victim() as (proc, forged):
        account_run = os.path.join(host["home"], "run")
        assert as_account(lambda: (os.mkdir(account_run), write_pidfile(os.path.join(account_run, "x.pid"), forged))) == 0
        rc, res = helper("stop", "--pidfile", os.path.join(account_run, "x.pid"), "--timeout", 2)
        assert rc == 1 and "is not root's" in res["msg"], res
        assert helper("pids", "--pidfile", os.path.join(account_run, "x.pid"))[1]["pids"] == []
        time.sleep(0.2)
        assert alive(proc.pid)


# --- symlinks and files in root's directories (defence in depth: only root could have made them) ----------------

@as_root
def test_start_does_not_follow_a_log_symlink(host):
    os.symlink(host["shadow"], os.path.join(host["log"], "x.log"))
    os.chown(host["shadow"], 0, 0)
    before = owner_mode(host["shadow"])
    rc, res = start(host)
    time.sleep(0.5)  # a server started anyway would have written by now
    assert owner_mode(host["shadow"]) == before and open(host["shadow"]).read() == "root-only\n"
    assert rc == 1 and "symlink" in res["msg"], res


@as_root
def test_the_pid_file_is_written_through_a_fresh_temp_name_never_a_planted_one(host):
    os.symlink(host["shadow"], os.path.join(host["run"], "x.pid.tmp"))
    rc, res = start(host)
    assert rc == 0, res
    assert open(host["shadow"]).read() == "root-only\n"
    with open(os.path.join(host["run"], "x.pid")) as f:
        assert json.load(f)["pid"] == res["pid"]
    assert sorted(os.listdir(host["run"])) == ["x.pid", "x.pid.tmp"]  # no temp file left behind


@as_root
def test_a_pid_file_root_does_not_own_is_not_believed(host):
    with victim() as (proc, record):
        pidfile = os.path.join(host["run"], "x.pid")
        write_pidfile(pidfile, record)
        os.chown(pidfile, ACCOUNT.pw_uid, ACCOUNT.pw_gid)
        rc, res = helper("stop", "--pidfile", pidfile, "--timeout", 2)
        assert rc == 0 and not res["changed"] and "not a regular file of root's" in res["stale"], res
        time.sleep(0.2)
        assert alive(proc.pid)


# --- the pid file's identity ----------------------------------------------------------------------------------

@as_root
@pytest.mark.parametrize("change", ["starttime", "cmdline", "not the group leader"])
def test_a_pid_file_whose_process_changed_identity_is_stale_and_nothing_is_signalled(host, change):
    with victim(own_session=change != "not the group leader") as (proc, record):
        if change == "starttime":
            record["starttime"] += 1
        elif change == "cmdline":
            record["cmdline"] = ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
        pidfile = os.path.join(host["run"], "x.pid")
        write_pidfile(pidfile, record)
        rc, res = helper("stop", "--pidfile", pidfile, "--timeout", 2)
        assert rc == 0 and res["changed"] is False and res["pids_left"] == [], res
        assert "stale pid file" in res["stale"] and "PID %d" % proc.pid in res["stale"], res
        for sub in ("status", "pids"):
            out = helper(sub, "--pidfile", pidfile)[1]
            assert out["pids"] == [] and "stale pid file" in out["stale"], out
        time.sleep(0.2)
        assert alive(proc.pid), "stop signalled a process the pid file no longer describes"


@as_root
def test_a_pid_file_with_the_current_identity_is_believed(host):
    with victim() as (proc, record):
        pidfile = os.path.join(host["run"], "x.pid")
        write_pidfile(pidfile, record)
        assert helper("pids", "--pidfile", pidfile)[1] == {"pids": [proc.pid], "stale": None}
        rc, res = helper("stop", "--pidfile", pidfile, "--timeout", 5)
        assert rc == 0 and res["changed"] and proc.wait(timeout=5) == -signal.SIGTERM, res


def helper_module():
    spec = importlib.util.spec_from_file_location("vllm_proc", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONTAINER_SCOPE = "/system.slice/docker-" + "c" * 64 + ".scope"


def test_a_units_processes_are_those_in_the_control_group_systemd_names(monkeypatch):
    """A container's systemd (cgroupns host) runs a unit of the same name under its own scope: not this unit."""
    module = helper_module()
    cgroups = {
        10: "0::/system.slice/vllm-x.service",
        11: "0::/system.slice/vllm-x.service/control",
        12: "0::" + CONTAINER_SCOPE + "/system.slice/vllm-x.service",
        13: "0::/system.slice/vllm-x.service-canary.service",
        14: "9:name=systemd:/system.slice/vllm-x.service\n4:memory:/\n0::/",  # a hybrid host
        15: "9:name=systemd:" + CONTAINER_SCOPE + "/system.slice/vllm-x.service\n0::/",
    }
    monkeypatch.setattr(module, "unit_cgroup", lambda unit: "/system.slice/vllm-x.service")
    monkeypatch.setattr(module, "all_pids", lambda: iter(cgroups))
    monkeypatch.setattr(module, "read", lambda path: cgroups.get(int(path.split("/")[2])))
    monkeypatch.setattr(module, "pgid_of", lambda pid: pid)
    assert module.unit_pids("vllm-x.service") == [10, 11, 14]


@pytest.mark.skipif(os.path.isdir("/run/systemd/system"), reason="needs a host where systemd is not booted")
def test_no_process_is_a_units_where_systemd_is_not_booted(monkeypatch):
    """Every process here reads as a container's vllm-x.service: without a systemd of its own, the host has none."""
    module = helper_module()
    container = "9:name=systemd:/docker/" + "c" * 64 + "/system.slice/vllm-x.service\n0::/\n"
    monkeypatch.setattr(module, "read", lambda path: container if path.endswith("/cgroup") else None)
    assert module.unit_pids("vllm-x.service") == []


def test_the_recorded_command_line_is_the_one_after_the_exec():
    """Right after Popen returns, /proc/PID/cmdline reads empty about half the time (the kernel sets it a moment
    after the exec closed Popen's error pipe); a pid file with that empty line would call the server stale."""
    exec_identity = helper_module().exec_identity
    for _attempt in range(20):
        p = subprocess.Popen(["sleep", "300"], start_new_session=True)
        try:
            assert exec_identity(p.pid)[2] == ["sleep", "300"]
        finally:
            p.kill()
            p.wait()


# --- directories the role creates for the account ---------------------------------------------------------------

@as_root
def test_mkdir_does_not_follow_a_symlinked_directory_the_account_planted(host):
    before = owner_mode(host["secret"])
    link = os.path.join(host["home"], "hidden_states")
    assert as_account(lambda: os.symlink(host["secret"], link)) == 0
    rc, res = helper("mkdir", "--path", os.path.join(link, "x"), "--mode", "0750", "--owner", ACCOUNT.pw_name,
                     "--group", ACCOUNT_GROUP)
    assert rc == 1 and "symlink" in res["msg"], res
    assert owner_mode(host["secret"]) == before and os.listdir(host["secret"]) == ["shadow"]
    # the last component a symlink: the same
    os.unlink(link)
    assert as_account(lambda: (os.mkdir(link), os.symlink(host["secret"], os.path.join(link, "x")))) == 0
    rc, res = helper("mkdir", "--path", os.path.join(link, "x"), "--mode", "0750", "--owner", ACCOUNT.pw_name,
                     "--group", ACCOUNT_GROUP)
    assert rc == 1 and "symlink" in res["msg"], res
    assert owner_mode(host["secret"]) == before


@as_root
def test_mkdir_creates_the_accounts_directories_and_follows_root_symlinks_in_roots_directories(host):
    real = os.path.join(host["base"], "data")
    os.mkdir(real, 0o755)
    os.symlink(real, os.path.join(host["base"], "data-link"))  # root's symlink in root's directory
    path = os.path.join(host["base"], "data-link", "hs", "x")
    rc, res = helper("mkdir", "--path", path, "--mode", "0750", "--owner", ACCOUNT.pw_name, "--group", ACCOUNT_GROUP)
    assert rc == 0 and res["changed"], res
    for d in (os.path.join(real, "hs"), os.path.join(real, "hs", "x")):
        assert owner_mode(d)[:2] == (ACCOUNT.pw_uid, ACCOUNT.pw_gid) and owner_mode(d)[2] & 0o7777 == 0o750
    assert owner_mode(real)[0] == 0
    assert helper("mkdir", "--path", path, "--mode", "0750", "--owner", ACCOUNT.pw_name,
                  "--group", ACCOUNT_GROUP) == (0, {"changed": False, "paths": []})


@as_root
def test_mkdir_does_not_hand_the_account_a_directory_someone_else_owns_inside_its_home(host):
    taken = os.path.join(host["home"], "hidden_states")
    os.mkdir(taken, 0o700)  # root's, where the account could have moved it
    rc, res = helper("mkdir", "--path", taken, "--mode", "0750", "--owner", ACCOUNT.pw_name, "--group", ACCOUNT_GROUP)
    assert rc == 1 and "not taking it over" in res["msg"], res
    assert owner_mode(taken)[0] == 0 and owner_mode(taken)[2] & 0o777 == 0o700


@as_root
def test_mkdir_trusted_refuses_a_directory_inside_the_accounts_home_before_creating_it(host):
    path = os.path.join(host["home"], "run")
    rc, res = helper("mkdir", "--path", path, "--mode", "0750", "--owner", "root", "--group", ACCOUNT_GROUP, "--trusted")
    assert rc == 1 and "is not root's" in res["msg"] and host["home"] in res["msg"], res
    assert not os.path.exists(path)


@as_root
def test_mkdir_stops_at_the_first_refused_directory_of_a_call(host):
    first, refused, after = (os.path.join(host["etc"], "a"), os.path.join(host["home"], "run"),
                             os.path.join(host["etc"], "b"))
    rc, res = helper("mkdir", "--path", first, "--path", refused, "--path", after, "--mode", "0750", "--owner", "root",
                     "--group", ACCOUNT_GROUP, "--trusted")
    assert rc == 1 and "is not root's" in res["msg"] and host["home"] in res["msg"], res
    assert os.path.isdir(first) and not os.path.exists(refused) and not os.path.exists(after)


# --- the environment file and the API key ----------------------------------------------------------------------

def load_env_function():
    return helper_module().load_env


VALUES = {"QUOTE": 'a"b', "BACKSLASH": "c:\\dir\\", "EQUALS": "k=v=w", "SPACES": "  two  words ", "EMPTY": "",
          "UNICODE": "caf\u00e9", "ALL": 'x\\"y=z\\\\'}


def test_load_env_reads_back_what_the_template_wrote(tmp_path):
    path = str(tmp_path / "x.env")
    write_env(path, VALUES)
    assert load_env_function()(path) == VALUES


@pytest.mark.parametrize("line", ["A=1\nLD_PRELOAD", "BAD KEY=\"v\"", "K=\"unterminated"])
def test_load_env_refuses_a_line_the_template_cannot_have_written(tmp_path, line):
    path = str(tmp_path / "x.env")
    with open(path, "w") as f:
        f.write("OK=\"1\"\n%s\n" % line)
    with pytest.raises(Exception, match="line"):
        load_env_function()(path)


@as_root
def test_the_server_gets_the_values_the_template_wrote(host):
    write_env(os.path.join(host["etc"], "x.env"), VALUES)
    rc, res = start(host)
    assert rc == 0, res
    # read as the server's own account: root without CAP_SYS_PTRACE (a container) may not read another user's environ
    raw = subprocess.run(["cat", "/proc/%d/environ" % res["pid"]], user=ACCOUNT.pw_uid, group=ACCOUNT.pw_gid,
                         extra_groups=[], capture_output=True, check=True).stdout
    env = dict(kv.decode().split("=", 1) for kv in raw.split(b"\0") if kv)
    assert {k: env.get(k) for k in VALUES} == VALUES


class Models(http.server.BaseHTTPRequestHandler):
    """/v1/models: 401 without the key; the model only from the READY_AFTER-th request with the key on, so that
    the wait polls a while (counted in requests, not seconds: a loaded machine may start the helper late)."""
    READY_AFTER = 5
    authorized = []

    def do_GET(self):
        if self.headers.get("Authorization") != "Bearer " + SECRET_KEY:
            self.send_response(401)
            self.end_headers()
            return
        self.authorized.append(self.path)
        body = json.dumps({"data": [{"id": "tiny"}] if len(self.authorized) >= self.READY_AFTER else []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def key_holders(tree_root):
    """Processes whose command line holds the key, and those of tree_root's tree (it and its descendants) whose
    environment does. The environment scan stays within the tree: the mutation check runs this module's servers
    at the same time, and a server's environment holds the key by design."""
    found = []
    try:
        root = psutil.Process(tree_root)
        tree = {root.pid} | {c.pid for c in root.children(recursive=True)}
    except psutil.NoSuchProcess:
        tree = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        for what in ("cmdline", "environ") if int(d) in tree else ("cmdline",):
            try:
                with open("/proc/%s/%s" % (d, what), "rb") as f:
                    if SECRET_KEY.encode() in f.read():
                        found.append((int(d), what))
            except OSError:
                pass
    return found


def test_wait_reads_the_key_from_the_env_file_and_it_is_in_no_command_line(tmp_path):
    env_file = str(tmp_path / "x.env")
    write_env(env_file, {"VLLM_API_KEY": SECRET_KEY, "HOME": "/nonexistent"})
    Models.authorized = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = "http://127.0.0.1:%d/v1/models" % server.server_address[1]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
        p = subprocess.Popen([sys.executable, HELPER, "wait", "--url", url, "--model", "tiny", "--env-file", env_file,
                              "--poll", "0.2", "--timeout", "30"], stdout=subprocess.PIPE, text=True, env=env)
        seen = set()
        while p.poll() is None:
            seen |= set(key_holders(p.pid))
            time.sleep(0.05)
        res = json.loads(p.stdout.read())
    finally:
        server.shutdown()
    # it polled with the key a while: READY_AFTER requests, --poll 0.2 s apart
    assert p.returncode == 0 and res["ready"] and res["seconds"] >= 0.2 * (Models.READY_AFTER - 1) - 0.05, res
    assert len(Models.authorized) == Models.READY_AFTER
    assert not seen, "the API key was visible in %s" % sorted(seen)

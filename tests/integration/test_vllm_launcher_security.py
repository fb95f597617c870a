"""vllm_server's process launcher through the role, as root, with the server under a service account (nobody):
the API key stays off every command line (and out of -vvv output) during the readiness wait, the pid file and
log are root's and outside the account's home, a second run changes nothing, a stop ends the server, and a
symlinked directory the account planted in its home fails the run without touching its target.

The server is a stand-in (no vLLM needed): it answers /v1/models, with the key only, after a delay."""
import grp
import json
import os
import pwd
import shutil
import tempfile
import time

import pytest

from vllm_localhost import free_port, group_members, role_playbook, run_playbook

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="runs the role as root")]

ACCOUNT = pwd.getpwnam("nobody")
ACCOUNT_GROUP = grp.getgrgid(ACCOUNT.pw_gid).gr_name
KEY = "sk-launcher-9d2e6c41f0b7"

STAND_IN = '''#!/usr/bin/python3
"""vLLM's api_server, as far as the role can tell: /v1/models lists the served name after a delay, with the key."""
import http.server, json, os, sys, time
args = sys.argv[1:]
def opt(name):
    return args[args.index(name) + 1]
time.sleep(3)
class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.headers.get("Authorization") != "Bearer " + os.environ["VLLM_API_KEY"]:
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps({"data": [{"id": opt("--served-model-name")}]}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
print("stand-in serving", flush=True)
http.server.HTTPServer((opt("--host"), int(opt("--port"))), Models).serve_forever()
'''


@pytest.fixture
def host():
    base = tempfile.mkdtemp(prefix="vllm-launcher-")
    os.chmod(base, 0o755)  # the account reaches its home and the stand-in's "venv"
    os.makedirs(os.path.join(base, "venv", "bin"))
    python = os.path.join(base, "venv", "bin", "python")
    with open(python, "w") as f:
        f.write(STAND_IN)
    os.chmod(python, 0o755)
    os.makedirs(os.path.join(base, "model"))
    with open(os.path.join(base, "model", "config.json"), "w") as f:
        f.write("{}")
    ev = {
        "vllm_server_name": "sec",
        "vllm_server_install": False,
        "vllm_server_service_manager": "process",
        "vllm_server_launcher": "api_server",
        "vllm_server_user": ACCOUNT.pw_name,
        "vllm_server_group": ACCOUNT_GROUP,
        "vllm_server_model_path": os.path.join(base, "model"),
        "vllm_server_venv": os.path.join(base, "venv"),
        "vllm_server_home": os.path.join(base, "home"),
        "vllm_server_config_dir": os.path.join(base, "etc"),
        "vllm_server_port": free_port(),
        "vllm_server_api_key": KEY,
        "vllm_server_shutdown_timeout": 1,
        "vllm_server_stop_timeout": 10,
        "vllm_server_ready_timeout": 60,
        "vllm_server_ready_poll": 1,
    }
    yield {"base": base, "ev": ev, "pidfile": os.path.join(base, "etc", "run", "sec.pid"),
           "log": os.path.join(base, "etc", "log", "sec.log")}
    run_playbook(role_playbook(base), dict(ev, vllm_server_state="stopped"), base, check=False, timeout=300)
    shutil.rmtree(base, ignore_errors=True)


def key_holders():
    """Processes with the key on their command line, or in their environment unless they are the server."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.stat("/proc/" + d).st_uid == ACCOUNT.pw_uid:
                whats = ("cmdline",)  # the server's environment holds the key by design
            else:
                whats = ("cmdline", "environ")
            for what in whats:
                with open("/proc/%s/%s" % (d, what), "rb") as f:
                    if KEY.encode() in f.read():
                        found.append((int(d), what))
        except OSError:
            pass
    return found


def test_the_key_stays_off_command_lines_and_the_launchers_files_are_roots(host, monkeypatch):
    base, ev = host["base"], host["ev"]
    monkeypatch.setenv("ANSIBLE_VERBOSITY", "3")  # -vvv prints every command the controller runs
    proc = run_playbook(role_playbook(base), ev, base, background=True)
    seen, deadline = set(), time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        seen |= set(key_holders())
        time.sleep(0.05)
    with open(os.path.join(base, "playbook.log")) as f:
        log = f.read()
    assert proc.wait(timeout=10) == 0, log[-5000:]
    assert "ready after" in log, log[-3000:]
    assert not seen, "the API key was visible in %s" % sorted(seen)
    assert KEY not in log, "the API key is in the -vvv output"

    with open(host["pidfile"]) as f:
        record = json.load(f)
    # the stand-in is a script: the kernel puts its interpreter first
    assert record["cmdline"][:3] == ["/usr/bin/python3", os.path.join(base, "venv", "bin", "python"), "-m"]
    assert group_members(record["pid"]) and os.stat("/proc/%d" % record["pid"]).st_uid == ACCOUNT.pw_uid
    for d in ("run", "log"):
        st = os.stat(os.path.join(base, "etc", d))
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, ACCOUNT.pw_gid, 0o750), d
    st = os.stat(host["log"])
    assert st.st_uid == 0 and "stand-in serving" in open(host["log"]).read()
    st = os.stat(ev["vllm_server_home"])
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (ACCOUNT.pw_uid, ACCOUNT.pw_gid, 0o750)
    # nothing of root's in the account's home: only its tmp/ (TMPDIR, vLLM's sockets), the account's too
    assert os.listdir(ev["vllm_server_home"]) == ["tmp"]
    st = os.stat(os.path.join(ev["vllm_server_home"], "tmp"))
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (ACCOUNT.pw_uid, ACCOUNT.pw_gid, 0o750)

    recap = run_playbook(role_playbook(base), ev, base)[2]
    assert recap["changed"] == 0, recap

    run_playbook(role_playbook(base), dict(ev, vllm_server_state="stopped"), base)
    assert group_members(record["pid"]) == [] and not os.path.exists(host["pidfile"])


def test_a_symlinked_directory_the_account_planted_fails_the_run_and_its_target_keeps_its_owner(host):
    base, ev = host["base"], dict(host["ev"], vllm_server_profile="extract", vllm_server_extract_layer_ids=[1])
    secret = os.path.join(base, "secret")
    os.mkdir(secret, 0o700)
    home = ev["vllm_server_home"]
    os.mkdir(home, 0o750)
    os.chown(home, ACCOUNT.pw_uid, ACCOUNT.pw_gid)
    pid = os.fork()
    if pid == 0:  # the account plants the link in its own home
        os.setgroups([])
        os.setgid(ACCOUNT.pw_gid)
        os.setuid(ACCOUNT.pw_uid)
        os.symlink(secret, os.path.join(home, "hidden_states"))
        os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    rc, out, _recap = run_playbook(role_playbook(base), ev, base, check=False, timeout=300)
    assert rc != 0 and "is a symlink that a user other than root could have made" in out, out[-3000:]
    st = os.stat(secret)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o700) and os.listdir(secret) == []
    assert not os.path.exists(host["pidfile"])  # nothing was started

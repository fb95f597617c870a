"""The API key of the clients stays off every command line and out of every environment (issue 23, finding 2).

synthetic_data (its detached data client) and drafter_eval (its measuring client) run through
ansible-playbook at -vvv against a fake OpenAI-compatible server started here, which answers only
`Authorization: Bearer <key>` and answers slowly, so that the clients run for a while. Meanwhile a thread
reads /proc/*/cmdline and /proc/*/environ of every process, and watches the directory the roles make for
the key (TMPDIR of the run). Then: no process ever carried the key, every request arrived authorized (the
key did reach the client), the key file was 0600 in a 0700 directory of this user, and it is gone after
the run; the playbook's output does not hold the key either.
"""
import http.server
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import threading
import time

import pytest

from vllm_localhost import LOCAL_INVENTORY, PLAYBOOK_BIN, REPO, free_port, role_playbook

pytestmark = pytest.mark.slow
KEY = "sk-" + secrets.token_hex(16)
ANSWER_S = 0.4  # each chat answer takes this long: the clients run for seconds


class FakeServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port):
        self.authorized = 0
        self.refused = []
        super().__init__(("127.0.0.1", port), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def stop(self):
        self.shutdown()
        self.server_close()


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *_args):
        pass

    def reply(self, status, body, ctype="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def authorized(self):
        if self.headers.get("Authorization") == "Bearer " + KEY:
            self.server.authorized += 1
            return True
        self.server.refused.append(self.path)
        self.reply(401, {"error": "Unauthorized"})
        return False

    def do_GET(self):
        if not self.authorized():
            return
        if self.path == "/metrics":
            self.reply(200, "vllm:spec_decode_num_drafts_total 0\n", "text/plain")
        elif self.path == "/v1/models":
            self.reply(200, {"data": [{"id": "m"}]})
        else:
            self.reply(200, {"version": "fake"})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if not self.authorized():
            return
        time.sleep(ANSWER_S)
        self.reply(200, {"model": "m", "prompt_token_ids": [1, 2, 3],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 2},
                         "choices": [{"message": {"content": "ok"}, "finish_reason": "stop", "token_ids": [5, 6]}]})


class Watcher:
    """Scans every process's command line and environment for the key, and the key directories under
    tmpdir (prefix) for their modes, until stopped."""

    def __init__(self, tmpdir, prefix, client):
        self.tmpdir, self.prefix, self.client = tmpdir, prefix, client.encode()
        self.leaks, self.client_pids, self.keyfiles = {}, set(), {}
        self.scans = 0
        self.running = True
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self):
        key = KEY.encode()
        while self.running:
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                for part in ("cmdline", "environ"):
                    try:
                        with open("/proc/%s/%s" % (pid, part), "rb") as f:
                            data = f.read()
                    except OSError:
                        continue
                    if key in data:  # the command line, or the names of the variables that hold the key
                        self.leaks[(int(pid), part)] = (
                            data[max(0, data.find(key) - 200):].replace(key, b"<KEY>").replace(b"\0", b" ")[:300]
                            if part == "cmdline"
                            else [v.split(b"=", 1)[0] for v in data.split(b"\0") if key in v])
                    if part == "cmdline" and self.client in data:
                        self.client_pids.add(int(pid))
            for name in os.listdir(self.tmpdir):
                if name.startswith(self.prefix):
                    d = os.path.join(self.tmpdir, name)
                    try:
                        ds, fs = os.stat(d), os.stat(os.path.join(d, "api_key"))
                    except OSError:
                        continue
                    self.keyfiles[d] = (stat.S_IMODE(ds.st_mode), ds.st_uid, stat.S_IMODE(fs.st_mode), fs.st_uid)
            self.scans += 1
            time.sleep(0.005)

    def stop(self):
        self.running = False
        self.thread.join(timeout=10)


def run_watched(tmp_path, playbook, extra_vars, prefix, client):
    """ansible-playbook -vvv with the extra vars in a file (never on argv) and TMPDIR in tmp_path, watched."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(LOCAL_INVENTORY)
    ev = tmp_path / "extra_vars.json"
    ev.write_text(json.dumps(extra_vars))
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_FORCE_COLOR="0", TMPDIR=str(tmpdir))
    watcher = Watcher(str(tmpdir), prefix, client)
    try:
        p = subprocess.run([PLAYBOOK_BIN, "-vvv", "-i", str(inventory), playbook, "-e", "@" + str(ev)], cwd=REPO,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                           timeout=600, check=False)
    finally:
        watcher.stop()
    assert p.returncode == 0, p.stdout[-6000:].replace(KEY, "<KEY>")
    assert watcher.scans > 10
    return p.stdout, watcher, [n for n in os.listdir(tmpdir) if n.startswith(prefix)]


def check_secret_kept(log, watcher, left, server, requests):
    print("%d scans, client pids %s, key files %s, %d authorized requests"
          % (watcher.scans, sorted(watcher.client_pids), watcher.keyfiles, server.authorized))
    assert not watcher.leaks, "the key in a process's argv or environment: %s" % watcher.leaks
    assert watcher.client_pids, "the client never ran while the processes were scanned"
    assert KEY not in log, "the key in the output of ansible-playbook -vvv"
    assert server.refused == [] and server.authorized >= requests, (server.refused, server.authorized)
    assert watcher.keyfiles, "the key file was never seen"
    for path, (dmode, duid, fmode, fuid) in watcher.keyfiles.items():
        assert (dmode, fmode) == (0o700, 0o600), (path, oct(dmode), oct(fmode))
        assert duid == fuid == os.getuid(), path
    assert left == [], "key directories left after the run: %s" % left


@pytest.fixture
def server():
    s = FakeServer(free_port())
    yield s
    s.stop()


def prompt_set(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": "p%d" % i, "messages": [{"role": "user", "content": "q%d" % i}]}) + "\n")


def test_synthetic_data_client_gets_the_key_through_a_private_file(tmp_path, server):
    n = 6
    prompt_set(tmp_path / "prompts.jsonl", n)
    out = tmp_path / "out"
    ev = {"synthetic_data_name": "argv", "synthetic_data_prompts": str(tmp_path / "prompts.jsonl"),
          "synthetic_data_output_dir": str(out), "synthetic_data_endpoint": "http://127.0.0.1:%d" % server.server_port,
          "synthetic_data_model": "m", "synthetic_data_api_key": KEY, "synthetic_data_python": sys.executable,
          "synthetic_data_runner": "process", "synthetic_data_concurrency": 1, "synthetic_data_max_tokens": 8,
          "synthetic_data_poll_interval": 1, "synthetic_data_lib_dir": str(tmp_path / "lib")}
    playbook = role_playbook(str(tmp_path), "gpuflow.eagle3.synthetic_data")
    log, watcher, left = run_watched(tmp_path, playbook, ev, "synthetic_data.", "datagen.py\0run")
    check_secret_kept(log, watcher, left, server, n)
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["status"] == "complete" and manifest["counts"]["done"] == n


def test_drafter_eval_client_gets_the_key_through_a_private_file(tmp_path, server):
    n = 4
    prompt_set(tmp_path / "prompts.jsonl", n)
    out = tmp_path / "eval"
    out.mkdir()
    shutil.copy(os.path.join(REPO, "roles", "drafter_eval", "files", "evalbench.py"), str(out))
    playbook = tmp_path / "measure.yml"
    playbook.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - name: Measure against the fake server\n"
        "      ansible.builtin.include_role:\n        name: gpuflow.eagle3.drafter_eval\n        tasks_from: measure.yml\n"
        "      vars:\n        __drafter_eval_pass: speculative\n"
        "    - name: Keep the figures\n"
        "      ansible.builtin.copy:\n        content: '{{ __drafter_eval_run.stdout }}'\n"
        "        dest: '%s/figures.json'\n        mode: '0644'\n" % tmp_path)
    ev = {"drafter_eval_name": "d", "drafter_eval_output_dir": str(out), "drafter_eval_port": server.server_port,
          "drafter_eval_prompts": str(tmp_path / "prompts.jsonl"), "drafter_eval_num_prompts": n,
          "drafter_eval_concurrency": 1, "drafter_eval_python": sys.executable, "vllm_server_api_key": KEY}
    log, watcher, left = run_watched(tmp_path, str(playbook), ev, "drafter_eval.", "evalbench.py")
    check_secret_kept(log, watcher, left, server, n + 2)  # the prompts and /metrics before and after
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["requests"] == n and figures["errors"] == 0 and figures["completion_tokens"] == 2 * n

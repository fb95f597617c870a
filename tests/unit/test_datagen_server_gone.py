"""datagen.py against a server that stops in the middle of a run (stopped by hand, or crashed): the run
stops once connections have been refused for --server-gone-after seconds, the unanswered prompts are not
turned into errors, and a rerun against the restarted server finishes them, each prompt exactly once."""
import http.server
import json
import os
import subprocess
import sys
import threading
import time


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATAGEN = os.path.join(REPO, "roles", "synthetic_data", "files", "datagen.py")
PROMPTS = 12
ANSWERED_BEFORE_STOP = 5


class ChatServer(http.server.HTTPServer):
    """A minimal OpenAI chat endpoint with token ids, one request at a time. With stop_after it closes its
    socket right after that many answers, before it accepts another connection."""

    def __init__(self, port, stop_after=None):
        self.answered = 0
        self.stop_after = stop_after
        super().__init__(("127.0.0.1", port), ChatHandler)
        threading.Thread(target=self.serve_forever if stop_after is None else self.serve_until_stop,
                         daemon=True).start()

    def serve_until_stop(self):
        while self.answered < self.stop_after:
            self.handle_request()
        self.server_close()  # from now on the port refuses connections

    def stop(self):
        self.shutdown()
        self.server_close()


class ChatHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *_args):
        pass

    def reply(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.reply({"version": "fake"})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        server = self.server
        self.reply({"model": "m", "prompt_token_ids": [1, 2, 3],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2},
                    "choices": [{"message": {"content": "ok"}, "finish_reason": "stop", "token_ids": [5, 6]}]})
        server.answered += 1


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_client(port, prompts, out):
    start = time.monotonic()
    p = subprocess.run([sys.executable, DATAGEN, "run", "--endpoint", "http://127.0.0.1:%d" % port,
                        "--prompts", prompts, "--out-dir", out, "--model", "m", "--concurrency", "1",
                        "--max-retries", "3", "--backoff-base", "0.2", "--server-gone-after", "3"],
                       capture_output=True, text=True, timeout=120, check=False)
    with open(os.path.join(out, "MANIFEST.json")) as f:
        return p.returncode, json.load(f), time.monotonic() - start


def primary_ids(out):
    with open(os.path.join(out, "rows.jsonl")) as f:
        return [json.loads(line)["primary_id"] for line in f]


def test_stopped_server_stops_the_run_and_a_rerun_finishes_each_prompt_once(tmp_path):
    prompts = str(tmp_path / "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(PROMPTS):
            f.write(json.dumps({"id": "p%d" % i, "messages": [{"role": "user", "content": "q%d" % i}]}) + "\n")
    out = str(tmp_path / "out")
    port = free_port()

    ChatServer(port, stop_after=ANSWERED_BEFORE_STOP)
    rc, manifest, took = run_client(port, prompts, out)
    assert rc != 0 and manifest["status"] == "failed"
    assert "refused connections" in manifest["aborted"]
    assert manifest["counts"]["done"] == ANSWERED_BEFORE_STOP
    # the prompts left are still to do, not failures: no retries used up, nothing in errors.jsonl
    assert manifest["counts"]["errors_this_run"] == 0
    errors = os.path.join(out, "errors.jsonl")
    assert not os.path.exists(errors) or os.path.getsize(errors) == 0
    assert took < 30, "the run took %.1f s to notice the stopped server" % took

    server = ChatServer(port)
    try:
        rc, manifest = run_client(port, prompts, out)[:2]
    finally:
        server.stop()
    assert rc == 0 and manifest["status"] == "complete" and manifest["aborted"] is None
    assert manifest["this_run"]["resume"]["done_before"] == ANSWERED_BEFORE_STOP
    ids = primary_ids(out)
    assert sorted(ids) == sorted("p%d" % i for i in range(PROMPTS))

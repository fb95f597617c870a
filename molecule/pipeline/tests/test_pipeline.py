"""After the pipeline ran across the three containers: each artifact on the host that needs it, moved and
verified, the drafter evaluated on inference-1, the report on the controller with its verified hand-offs,
and no server, job or trainer left running anywhere."""
import calendar
import json
import os
import time

import pytest
import testinfra

WORK = "/srv/gpuflow"
REPORT = os.path.join(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"], "report")
HOSTS = ["inference-1", "extract-1", "train-1"]
MOVES = [  # what arrived where, from where
    ("tiny_model", "extract-1", WORK + "/models/tiny", "inference-1"),
    ("tiny_model", "train-1", WORK + "/models/tiny", "inference-1"),
    ("dataset", "extract-1", WORK + "/synthetic_data/default", "inference-1"),
    ("hidden_states", "train-1", WORK + "/hidden_states/default", "extract-1"),
    ("drafter", "inference-1", WORK + "/train/default/drafter", "train-1"),
]


def container(name):
    return testinfra.get_host("ansible://" + name, ansible_inventory=os.environ["MOLECULE_INVENTORY_FILE"])


def read_json(name, path):
    return json.loads(container(name).file(path).content_string)


@pytest.fixture(scope="module")
def report():
    """The first run's report (side_effect.yml kept it aside before the second run)."""
    with open(os.path.join(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"], "first-run.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def rerun_report():
    with open(os.path.join(REPORT, "pipeline.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("what, receiver, directory, source", MOVES, ids=["%s-to-%s" % (m[0], m[1]) for m in MOVES])
def test_artifact_arrived_verified_from_its_source(what, receiver, directory, source):
    record = read_json(receiver, directory + "/TRANSFER.json")
    assert record["source"] == source and record["verified"] is True and record["files"] > 0
    # the receiver holds the bytes the source listed (sha256sum on the receiver, not the tool)
    sums = read_json(receiver, directory + "/SHA256SUMS.json")["files"]
    for rel, expected in sums.items():
        digest = container(receiver).check_output("sha256sum %s/%s" % (directory, rel)).split()[0]
        assert digest == expected["sha256"], rel


def test_each_stage_ran_on_its_own_group(report):
    stages = {s["name"]: s for s in report["stages"]}
    for name in ("generate", "handoff_inference", "extract", "train", "evaluate"):
        assert stages[name]["status"] == "ran", stages[name]
    assert stages["generate"]["hosts"] == ["inference-1"] and stages["extract"]["hosts"] == ["extract-1"]
    assert stages["train"]["hosts"] == ["train-1"]


def test_both_handoffs_drained_and_verified_the_gpus(report):
    handoffs = {h["name"]: h for h in report["handoffs"]}
    assert handoffs["inference -> extract"]["host"] == "inference-1"
    assert handoffs["extract -> train"]["host"] == "extract-1"
    for h in handoffs.values():
        assert h["ready"] is True and h["backend"] == "simulated" and h["gpus"], h
        assert all(g["verdict"] == "ready" for g in h["gpus"])


def test_second_run_skipped_every_stage_and_moved_nothing(report, rerun_report):
    stages = {s["name"]: s["status"] for s in rerun_report["stages"]}
    assert all(stages[name] == "skipped" for name in ("generate", "extract", "train", "evaluate")), stages
    # every copy was received during the first run, before the second began
    for what, receiver, directory, source in MOVES:
        record = read_json(receiver, directory + "/TRANSFER.json")
        received = calendar.timegm(time.strptime(record["received"], "%Y-%m-%dT%H:%M:%SZ"))
        assert received < rerun_report["started"], (what, receiver)


def test_drafter_was_evaluated_on_the_inference_host():
    ev = read_json("inference-1", WORK + "/eval/default/MANIFEST.json")
    assert ev["status"] == "complete" and ev["speculative"]["drafts"] > 0
    # the speculative pass alone (drafter_eval_baseline: false): the baseline is test_pipeline_local's
    assert ev["speculative"]["completion_tokens"] > 0 and not ev.get("baseline")


def test_report_page_was_written_on_the_controller():
    with open(os.path.join(REPORT, "report.html")) as f:
        page = f.read()
    for section in ("timeline", "handoffs", "data", "disk", "training", "evaluation", "resumptions"):
        assert 'id="%s"' % section in page


@pytest.mark.parametrize("name", HOSTS)
def test_no_server_job_or_trainer_is_left_running(name):
    left = [p for p in container(name).check_output("ps -eo args").splitlines()
            if any(k in p for k in ("vllm", "hs_extract", "generate-offline-data", "torchrun", "e3_train", "datagen"))]
    assert left == []

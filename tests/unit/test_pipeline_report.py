"""The pipeline report (roles/pipeline_report): the page from real manifests, its figures' pixels,
a headless Chromium screenshot, a run with nothing but stages, and the role through ansible-playbook."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from matplotlib import image
from report_screenshot import figure_blue_share, non_white_share, screenshot

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(REPO, "roles", "pipeline_report", "files", "gpuflow_report.py")
FIXTURES = os.path.join(REPO, "tests", "fixtures", "pipeline_report")
SECTION_IDS = ("timeline", "handoffs", "data", "disk", "training", "evaluation", "resumptions")
MANIFESTS = ("synthetic_data", "hidden_state_extract", "eagle3_train", "drafter_eval")
FIGURES = ("timeline", "disk", "training_loss", "evaluation")
NOT_RUN = "not run in this pipeline"


def full_data(tmp_path):
    """The fixture timeline with the four stages' manifests and a copy of metrics.jsonl."""
    with open(os.path.join(FIXTURES, "pipeline.json")) as f:
        data = json.load(f)
    data["manifests"] = {}
    for name in MANIFESTS:
        with open(os.path.join(FIXTURES, name + ".MANIFEST.json")) as f:
            data["manifests"][name] = json.load(f)
    data["metrics_file"] = str(tmp_path / "metrics.jsonl")
    shutil.copy(os.path.join(FIXTURES, "metrics.jsonl"), data["metrics_file"])
    return data


def render(tmp_path, data):
    """Runs the script on data; returns (its JSON result, the page's text)."""
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, SCRIPT, "--data", str(path), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    with open(result["html"]) as f:
        return result, f.read()


def section(page, sid):
    match = re.search(r'<section id="%s">(.*?)</section>' % sid, page, re.S)
    assert match, "no section %s" % sid
    return match.group(1)


def test_full_report_has_every_section_and_real_figures(tmp_path):
    result, page = render(tmp_path, full_data(tmp_path))
    for sid in SECTION_IDS:
        assert "<h2>" in section(page, sid)
    assert NOT_RUN not in page
    sources = re.findall(r'<img src="([^"]+)"', page)
    assert sorted(sources) == sorted("figures/%s.png" % f for f in FIGURES)
    assert sorted(result["figures"]) == sorted(os.path.join(os.path.dirname(result["html"]), s) for s in sources)
    for src in sources:
        pixels = image.imread(os.path.join(os.path.dirname(result["html"]), src))
        assert pixels.std() > 0.05, "%s is (nearly) one colour" % src
        # frame, ticks and labels alone cover about 0.047 of a figure, these figures 0.09 to 0.25
        assert non_white_share(pixels) > 0.07, "%s is nearly blank" % src
    # numbers from the real manifests and the drafter_eval one reach the page
    assert "64 / 64" in section(page, "data") and "11.1 MiB" in section(page, "data")
    assert "97.4%" in section(page, "disk") and "51.6 GiB" in section(page, "disk")
    assert "0.3692" in section(page, "training") and "4964" in section(page, "training")
    assert "1.28x" in section(page, "evaluation") and "1.43" in section(page, "evaluation")
    resumptions = section(page, "resumptions")
    assert "generate skipped, already done" in resumptions
    # each resumption of the work is listed, also one of an earlier run that failed before its report
    assert "extract resumed in run 20261201T040100Z: run 20261201T035500Z had stopped" in resumptions
    assert "train resumed in run 20261201T041300Z: run 20261201T040100Z had stopped" in resumptions


BELOW_ONE = "Why the speedup is below 1"


def test_speedup_below_one_is_explained_with_the_break_even(tmp_path):
    """The local default's evaluation (0.74x): the page says why, and how far the drafter is from breaking even."""
    data = full_data(tmp_path)
    with open(os.path.join(FIXTURES, "drafter_eval_local_default.MANIFEST.json")) as f:
        data["manifests"]["drafter_eval"] = ev = json.load(f)
    evaluation = section(render(tmp_path, data)[1], "evaluation")
    assert "0.74x" in evaluation and BELOW_ONE in evaluation
    assert "a draft step costs about what a target step does" in evaluation
    assert "1.95 of at most 4 (3 draft tokens + 1 bonus)" in evaluation
    # tau* = tau * tok/s without / tok/s with the drafter = 1.95 * 675.6 / 501.3
    tau = ev["speculative"]["mean_acceptance_length"]
    break_even = tau * ev["baseline"]["output_tokens_per_s"] / ev["speculative"]["output_tokens_per_s"]
    assert "%.2f" % break_even == "2.63"
    assert "break-even acceptance length \u03c4* = speculative step / target step</td><td>%.2f<" % break_even in evaluation
    assert "\u03c4 = 1.95, %.2f short of \u03c4*" % (break_even - tau) in evaluation


def test_speedup_above_one_has_no_break_even(tmp_path):
    evaluation = section(render(tmp_path, full_data(tmp_path))[1], "evaluation")
    assert "1.28x" in evaluation
    assert BELOW_ONE not in evaluation and "break-even" not in evaluation


def test_page_renders_in_headless_chromium(tmp_path):
    result = render(tmp_path, full_data(tmp_path))[0]
    pixels = screenshot(result["html"], tmp_path)
    assert pixels.shape[:2] == (4000, 1280)
    # text, tables and the four figures cover about a tenth of the window, an empty page 0.05%
    assert non_white_share(pixels) > 0.06, "the screenshot is (nearly) blank"
    # the browser loaded the PNGs: their blue covers about 0.3% of the window
    assert figure_blue_share(pixels) > 0.001, "no figure in the screenshot"


def test_only_stages_says_what_was_not_run(tmp_path):
    data = {"stages": [{"name": "generate", "status": "skipped", "seconds": 3.0, "detail": "<b>64 rows</b>"},
                       {"name": "extract", "status": "not_selected"}]}
    result, page = render(tmp_path, data)
    for sid in ("handoffs", "disk", "training", "evaluation"):
        assert NOT_RUN in section(page, sid), sid
    assert section(page, "data").count(NOT_RUN) == 2
    # the detail reaches the timeline table and the resumptions list, escaped both times
    assert page.count("&lt;b&gt;64 rows&lt;/b&gt;") == 2 and "<b>64 rows</b>" not in page
    assert [os.path.basename(f) for f in result["figures"]] == ["timeline.png"]


@pytest.mark.parametrize("content, needle", [
    (None, "cannot read"),
    ("{not json", "cannot read"),
    ('{"title": "no stages"}', "has no list of stages"),
    ('{"stages": [{"name": "x", "started": "soon"}]}', "does not follow the pipeline.json schema"),
])
def test_unreadable_input_fails_with_a_message(tmp_path, content, needle):
    path = tmp_path / "pipeline.json"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, SCRIPT, "--data", str(path), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert proc.stderr.startswith("gpuflow_report: ") and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "report.html").exists()


def test_role_writes_the_report_once_from_any_host(tmp_path):
    out = tmp_path / "out"
    data = full_data(tmp_path)
    data["metrics_file"] = "../metrics.jsonl"  # relative: taken from pipeline_report_dir
    (tmp_path / "vars.json").write_text(json.dumps({"pipeline_report_dir": str(out), "pipeline_report_data": data}))
    (tmp_path / "hosts.yml").write_text(
        "all:\n  hosts:\n    localhost: {ansible_connection: local}\n    other: {ansible_connection: local}\n"
        "  vars:\n    ansible_python_interpreter: \"{{ ansible_playbook_python }}\"\n")
    (tmp_path / "play.yml").write_text("""
- name: Report from a play over two hosts
  hosts: all
  gather_facts: false
  roles:
    - role: gpuflow.eagle3.pipeline_report
  post_tasks:
    - name: Every host has the result
      ansible.builtin.assert:
        that:
          - pipeline_report_result.html == '%s/report.html'
          - pipeline_report_result.figures | length == 4  # the loss curve too
""" % out)
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", "hosts.yml",
                           "play.yml", "-e", "@vars.json"], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=300, check=False,
                          # ansible.cfg resolves gpuflow.eagle3 to this checkout (tests/conftest.py makes the link)
                          env=dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg")))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert (out / "report.html").is_file() and (out / "pipeline.json").is_file()
    assert proc.stdout.count("report: file://%s/report.html" % out) == 1  # once, not once per host
    assert "train: resumed (38.5 s)" in proc.stdout

"""The install steps of vllm_server and hidden_state_extract, entered alone (tasks_from: install.yml), on
wheels made here: the packages that break a build (vllm_server_remove_packages,
hidden_state_extract_remove_packages) are removed whenever one is installed, also when the pinned versions
are there already and nothing else is installed; a venv without them does not ask pip at all (its module
run is the dearest of the install check)."""
import base64
import glob
import hashlib
import os
import shutil
import subprocess
import sysconfig
import zipfile

import pytest

from vllm_localhost import REPO, run_playbook

VENV_PYTHON = os.path.join(REPO, ".venv", "bin", "python")
UNWANTED = "gpuflowunwanted"
REMOVE_TASK = "Remove packages that break this build"


def wheel(directory, name, version):
    """A pure-Python wheel of one empty package, as pip installs it."""
    dist_info = "%s-%s.dist-info" % (name, version)
    files = {"%s/__init__.py" % name: b"",
             dist_info + "/METADATA": ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (name, version)).encode(),
             dist_info + "/WHEEL": b"Wheel-Version: 1.0\nGenerator: gpuflow-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    digest = {path: base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
              for path, data in files.items()}
    record = "".join("%s,sha256=%s,%d\n" % (path, digest[path], len(data)) for path, data in files.items())
    files[dist_info + "/RECORD"] = (record + dist_info + "/RECORD,,\n").encode()
    with zipfile.ZipFile(os.path.join(directory, "%s-%s-py3-none-any.whl" % (name, version)), "w") as whl:
        for path, data in files.items():
            whl.writestr(path, data)


@pytest.fixture
def wheelhouse(tmp_path):
    """The fake builds, the package a build must not have, and the pip wheel that Python bundles (offline)."""
    path = tmp_path / "wheelhouse"
    path.mkdir()
    for name, version in (("fakevllm", "1.0"), ("speculators", "1.0"), ("hs_connectors", "1.0"),
                          ("tiktoken", "0.14.0"), (UNWANTED, "1.0")):
        wheel(str(path), name, version)
    # ensurepip's own, or Debian's python3-pip-whl where its Python leaves ensurepip's out
    bundled = glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "ensurepip", "_bundled", "pip-*.whl")) \
        + glob.glob("/usr/share/python-wheels/pip-*.whl")
    assert bundled, "no pip wheel on this machine (ensurepip's, or python3-pip-whl's)"
    shutil.copy(bundled[0], str(path))
    return str(path)


def install_playbook(tmp, role):
    path = os.path.join(tmp, "install.yml")
    with open(path, "w") as f:
        f.write("- hosts: localhost\n  gather_facts: false\n  tasks:\n    - ansible.builtin.include_role:\n"
                "        name: %s\n        tasks_from: install.yml\n" % role)
    return path


def installed(venv, name):
    return subprocess.run([os.path.join(venv, "bin", "python"), "-c", "import importlib.metadata as m, sys; "
                           "m.version(sys.argv[1])", name], check=False, capture_output=True).returncode == 0


def remove_task_outcome(log):
    """The line after the removal task's header: ok / changed / skipping."""
    lines = log.splitlines()
    at = next(i for i, line in enumerate(lines) if REMOVE_TASK in line)
    return next(line for line in lines[at + 1:] if line.strip()).split(":")[0]


@pytest.mark.parametrize("role,prefix,extra", [
    ("gpuflow.eagle3.vllm_server", "vllm_server",
     {"vllm_server_package": "fakevllm", "vllm_server_version": "1.0", "vllm_server_user": ""}),
    ("gpuflow.eagle3.hidden_state_extract", "hidden_state_extract",
     {"hidden_state_extract_speculators_version": "1.0", "hidden_state_extract_hs_connectors_version": "1.0"}),
], ids=["vllm_server", "hidden_state_extract"])
def test_a_package_to_remove_is_removed_whenever_installed_and_pip_is_not_asked_otherwise(
        tmp_path, wheelhouse, role, prefix, extra):
    venv = str(tmp_path / "venv")
    extra_vars = dict(extra, ansible_python_interpreter=VENV_PYTHON, **{
        prefix + "_venv": venv, prefix + "_python": VENV_PYTHON, prefix + "_wheelhouse": wheelhouse,
        prefix + "_remove_packages": [UNWANTED]})
    playbook = install_playbook(str(tmp_path), role)

    rc, log = run_playbook(playbook, extra_vars, str(tmp_path), check=False, timeout=600)[:2]
    assert rc == 0, log[-4000:]
    assert remove_task_outcome(log) == "ok", log[-4000:]  # just installed: pip checks, finds nothing to remove

    # a later install (an extra package, a hand) brought it in; the pinned build is still there
    subprocess.run([os.path.join(venv, "bin", "pip"), "install", "--no-index", "--find-links", wheelhouse,
                    "--disable-pip-version-check", "-q", UNWANTED], check=True)
    rc, log = run_playbook(playbook, extra_vars, str(tmp_path), check=False, timeout=600)[:2]
    assert rc == 0, log[-4000:]
    assert remove_task_outcome(log) == "changed" and not installed(venv, UNWANTED), log[-4000:]

    rc, log, recap = run_playbook(playbook, extra_vars, str(tmp_path), check=False, timeout=600)
    assert rc == 0 and recap.get("changed") == 0, log[-4000:]
    assert remove_task_outcome(log) == "skipping", log[-4000:]

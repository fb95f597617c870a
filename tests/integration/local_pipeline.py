"""Runs of playbooks/pipeline.yml on the embedded local default (inventories/local), as its user would run them:
an ordinary account without sudo (gpuflow-it, created here, when the tests run as root), the work under
ROOT/share as the XDG data directory, HOME in ROOT/home. Shared by test_pipeline_local.py and
test_pipeline_kimi.py, each with a ROOT of its own."""
import json
import os
import pwd
import shutil
import subprocess

from extract_env import SPEC_VENV
from vllm_localhost import CACHE, PLAYBOOK_BIN, REPO, VENV

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
        subprocess.run([os.path.join(REPO, "scripts", "pip_install_controller.sh"), venv, req], check=True)
        with open(stamp, "w") as f:
            f.write(wanted)
    return os.path.join(venv, "bin", "ansible-playbook")


def reused_setup(ports):
    """The extra vars every test pipeline takes: the integration tests' venvs and wheelhouses, reused, and
    the extract and eval servers on these two free ports."""
    return {"gpuflow_cache_dir": CACHE, "vllm_server_venv": VENV,
            "hidden_state_extract_venv": SPEC_VENV, "eagle3_train_venv": SPEC_VENV,
            # the generation server keeps the inventory's port: an extra var would win over the port
            # the extract and eval roles give their own servers
            "hidden_state_extract_port": ports[0], "drafter_eval_port": ports[1]}


def fresh_root(root):
    """An empty ROOT (and ROOT/home) that the account owns."""
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.join(root, "home"))
    ids = run_as()
    if ids:
        for d in (root, os.path.join(root, "home")):
            os.chown(d, *ids)


def start(root, log_name, extra, options=()):
    """Start the pipeline with these extra vars (and more ansible-playbook options); its output goes to
    ROOT/log_name. Returns the Popen (a session of its own, so a test can kill the whole run)."""
    ev = os.path.join(root, "extra_vars.json")
    with open(ev, "w") as f:
        json.dump(extra, f)
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               XDG_DATA_HOME=os.path.join(root, "share"), HOME=os.path.join(root, "home"),
               ANSIBLE_REMOTE_TMP=os.path.join(root, "home", ".ansible", "tmp"),
               ANSIBLE_LOCAL_TEMP=os.path.join(root, "home", ".ansible", "local"))
    ids = run_as()
    drop = {"user": ids[0], "group": ids[1], "extra_groups": []} if ids else {}
    argv = [controller_venv() if ids else PLAYBOOK_BIN, "-i", os.path.join(REPO, "inventories", "local"),
            os.path.join(REPO, "playbooks", "pipeline.yml"), "-e", "@" + ev, *options]
    with open(os.path.join(root, log_name), "w") as log:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, **drop)


def finished(root, proc, log_name):
    """Waits for a pipeline started in the background: (exit status, its log)."""
    rc = proc.wait(timeout=2400)
    with open(os.path.join(root, log_name)) as f:
        return rc, f.read()

# Copyright: gpuflow maintainers
# Apache License 2.0 (see LICENSE)
"""Shared by tests/gpu/run_scenarios.py and bench/drain_h200.py.

``Holders`` starts holder processes of one kind: ``cuda`` (tests/gpu/cuda_holder.py: real
CUDA allocations, the GPU machine) or ``sim`` (tools/gpu_sim.py: the simulated backend, to
rehearse the scripts on a machine without a GPU).  Every process started carries a unique
run tag in its command line, is remembered with its create time, and is the only thing the
cleanup ever signals.  ``run_module`` runs a gpuflow.eagle3 module through Ansible on
localhost and returns (rc, result, wall seconds).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable


def ensure_collection_link():
    coll = os.path.join(REPO, ".cache", "collections")
    link = os.path.join(coll, "ansible_collections", "gpuflow", "eagle3")
    if not os.path.islink(link):
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.join("..", "..", "..", ".."), link)
    return coll


def ansible_bin(name):
    for d in (os.path.dirname(PY), "/tmp/site/bin"):
        p = os.path.join(d, name)
        if os.path.exists(p):
            return [p]
    return [name]


class Holders(object):
    def __init__(self, kind, workdir, sim_state_dir=None):
        self.kind = kind
        self.workdir = workdir
        self.sim_state_dir = sim_state_dir
        self.tag = "gpuflow-test-%s" % uuid.uuid4().hex[:12]
        self.started = {}
        self.n = 0
        os.makedirs(workdir, exist_ok=True)

    def _remember(self, pid):
        try:
            self.started[pid] = psutil.Process(pid).create_time()
        except psutil.NoSuchProcess:
            pass

    def _argv(self, sub):
        if self.kind == "cuda":
            return [PY, os.path.join(REPO, "tests", "gpu", "cuda_holder.py"), sub]
        argv = [PY, os.path.join(REPO, "tools", "gpu_sim.py"), sub]
        if sub == "hold":
            argv += ["--state-dir", self.sim_state_dir]
        return argv

    def hold(self, gpus, gib=1.0, ignore_sigterm=False, children=0, child_gib=None, orphan=False,
             escape=False, management_client=False, comm=None, timeout=300):
        self.n += 1
        ready = os.path.join(self.workdir, "ready-%s-%d.json" % (self.tag, self.n))
        argv = self._argv("hold")
        for g in gpus:
            argv += ["--gpu", str(g)]
        if self.kind == "cuda":
            argv += ["--gib", str(gib)]
            if child_gib is not None:
                argv += ["--child-gib", str(child_gib)]
        else:
            argv += ["--mib", str(int(gib * 1024))]
            if child_gib is not None:
                argv += ["--child-mib", str(int(child_gib * 1024))]
        if ignore_sigterm:
            argv.append("--ignore-sigterm")
        if children:
            argv += ["--children", str(children)]
        if orphan:
            argv.append("--orphan")
        if escape:
            argv.append("--escape")
        if management_client:
            argv.append("--management-client")
        if comm:
            argv += ["--comm", comm]
        argv += ["--ready-file", ready, "--tag", self.tag]
        p = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._remember(p.pid)
        deadline = time.time() + timeout
        while not os.path.exists(ready):
            if p.poll() is not None and not orphan:
                raise RuntimeError("holder exited early (rc=%s): %s" % (p.returncode, argv))
            if time.time() > deadline:
                raise RuntimeError("holder not ready after %ss: %s" % (timeout, argv))
            time.sleep(0.05)
        with open(ready) as f:
            info = json.load(f)
        for pid in info["holders"] + info["spawned"]:
            self._remember(pid)
        info["proc"] = p
        return info

    def idle(self, tag_extra="vllm-cpu-job"):
        argv = self._argv("idle") + ["--tag", "%s-%s" % (tag_extra, self.tag)]
        p = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._remember(p.pid)
        time.sleep(0.3)
        return p.pid

    def alive(self, pid):
        try:
            p = psutil.Process(pid)
            return abs(p.create_time() - self.started[pid]) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def reap(self):
        while True:
            try:
                pid, dummy = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def cleanup(self):
        for pid, ct in list(self.started.items()):
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - ct) < 0.01:
                    p.kill()
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.3)
        self.reap()
        self.started.clear()


PLAYBOOK = """- hosts: localhost
  gather_facts: false
  tasks:
    - name: Run the module
      %(fqcn)s: %(args)s
      register: result
      ignore_errors: true
      check_mode: %(check)s
      diff: %(diff)s
    - name: Save its result
      ansible.builtin.copy:
        content: "{{ result | to_json }}"
        dest: %(out)s
        mode: "0600"
      check_mode: false
      diff: false
"""


def run_module(module, args, check=False, diff=False, env_extra=None, timeout=300):
    """Run gpuflow.eagle3.<module> on localhost with ansible-playbook (ansible-core only:
    no callback from another collection); return (rc of the module, result, wall seconds)."""
    coll = ensure_collection_link()
    work = tempfile.mkdtemp(prefix="gpuflow-run-")
    out_file = os.path.join(work, "result.json")
    pb = os.path.join(work, "run.yml")
    with open(pb, "w") as f:
        f.write(PLAYBOOK % {"fqcn": "gpuflow.eagle3.%s" % module, "args": json.dumps(args),
                            "check": "true" if check else "false", "diff": "true" if diff else "false",
                            "out": json.dumps(out_file)})
    cmd = ansible_bin("ansible-playbook") + ["-i", "localhost,", "-c", "local", pb,
                                             "-e", "ansible_python_interpreter=%s" % PY]
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_COLLECTIONS_PATH=coll, ANSIBLE_STDOUT_CALLBACK="default")
    env.update(env_extra or {})
    t = time.monotonic()
    out = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         timeout=timeout, check=False)
    wall = time.monotonic() - t
    try:
        with open(out_file) as f:
            res = json.load(f)
    except (OSError, ValueError):
        return out.returncode or 99, {"unparsable": True, "stdout": out.stdout.decode(errors="replace")[-4000:],
                                      "stderr": out.stderr.decode(errors="replace")[-4000:]}, wall
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return (2 if res.get("failed") else 0), res, wall

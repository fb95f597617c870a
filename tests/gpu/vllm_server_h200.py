"""The vllm_server role with a real CUDA vLLM on the GPU machine (issue 11): no systemd there, so the role's
own process-group launcher runs the server. Start and health, a rerun that changes nothing, a changed
setting that restarts once, then the pipeline's hand-off: the role stops the server and gpu_drain verifies
the GPUs free, timed from the stop to the verdict.

The carried vLLM (tests/gpu/README.md) is in /tmp/vsite; the role gets a venv on the machine's Python
that sees it and the machine's torch (vllm_server_install: false: nothing can be installed there).

    PYTHONPATH=/tmp/vsite:/tmp/site python3 tests/gpu/vllm_server_h200.py --tp 1 \\
        --out tests/gpu/results/vllm_server_h200_tp1.json
"""
import argparse
import json
import os
import subprocess
import sys
import time
import uuid

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from gpulib import ansible_bin, ensure_collection_link  # noqa: E402
from vllm_drain_h200 import commit, free_port, get_json, machine, make_tiny_model  # noqa: E402

PLAY = """- name: vllm_server, then the hand-off as the pipeline runs it
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Learn who runs this
      ansible.builtin.setup:
        gather_subset: [user]
    - name: The server
      ansible.builtin.include_role:
        name: gpuflow.eagle3.vllm_server
    - name: Verify the GPUs free after the stop
      ansible.builtin.include_role:
        name: gpuflow.eagle3.gpu_drain
      when: drain_after | default(false) | bool
"""


def venv_with_vllm(path):
    """A venv on this Python that sees the carried vLLM and this Python's own packages (torch)."""
    if not os.path.exists(os.path.join(path, "bin", "python")):
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", path], check=True)
        site = subprocess.run([os.path.join(path, "bin", "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        with open(os.path.join(site, "gpuflow-carried.pth"), "w") as f:
            f.write("\n".join(["/tmp/vsite"] + [p for p in sys.path if p and os.path.isdir(p)]) + "\n")
    return path


def server_vars(name, model, venv, work, tp, tag, port, **extra):
    """(extra vars, pidfile) of one server of these runs: the carried vLLM through the process launcher, the
    tiny model on GPUs 0..tp-1, and a drain that may select only this run's server (its tag): anything else on
    the GPU blocks, unsignalled. extra (full variable names) on top."""
    home = os.path.join(work, "home")
    ev = {
        "vllm_server_name": name, "vllm_server_served_model_name": tag, "vllm_server_model_path": model,
        "vllm_server_install": False, "vllm_server_venv": venv, "vllm_server_package": "vllm",
        "vllm_server_version": "0.26.0", "vllm_server_launcher": "api_server", "vllm_server_user": "",
        "vllm_server_home": home, "vllm_server_config_dir": os.path.join(work, "etc"),
        "vllm_server_gpus": list(range(tp)), "vllm_server_tensor_parallel_size": tp, "vllm_server_port": port,
        "vllm_server_max_model_len": 1024, "vllm_server_reasoning_parser": "", "vllm_server_ready_timeout": 600,
        "vllm_server_extra_args": ["--enforce-eager", "--gpu-memory-utilization", "0.3"],
        "vllm_server_env": {"VLLM_USE_FLASHINFER_SAMPLER": "0"},
        "gpu_drain_gpus": [str(i) for i in range(tp)], "gpu_drain_backend": "nvml", "gpu_drain_mark_drained": False,
        "gpu_drain_all_holders": False, "gpu_drain_cmdline_pattern": tag,
        "gpu_drain_state_file": os.path.join(work, "gpu_state.json"),
    }
    ev.update(extra)
    return ev, os.path.join(work, "etc", "run", name + ".pid")  # vllm_server_run_dir: config_dir/run


def playbook(work, ev, name, play=PLAY, timeout=900):
    """(rc, wall seconds, log tail) of one run of a play (PLAY unless given) with extra vars ev; its output in
    work/<name>.log."""
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "play.yml"), "w") as f:
        f.write(play)
    with open(os.path.join(work, name + ".json"), "w") as f:
        json.dump(ev, f)
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_COLLECTIONS_PATH=ensure_collection_link())
    argv = ansible_bin("ansible-playbook") + ["-i", "localhost,", "-c", "local", os.path.join(work, "play.yml"),
                                              "-e", "@" + os.path.join(work, name + ".json"),
                                              "-e", "ansible_python_interpreter=" + sys.executable]
    t0 = time.monotonic()
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    wall = round(time.monotonic() - t0, 2)
    with open(os.path.join(work, name + ".log"), "w") as f:
        f.write(p.stdout + p.stderr)
    recap = [line for line in p.stdout.splitlines() if line.startswith("localhost")]
    return p.returncode, wall, recap[-1] if recap else p.stdout[-2000:]


def server_tree(pidfile):
    try:
        with open(pidfile) as f:
            pid = int(json.load(f)["pid"])  # the launcher's record: pid, starttime, cmdline
        root = psutil.Process(pid)
        return {p.pid: p.name() for p in [root] + root.children(recursive=True)}
    except (OSError, ValueError, psutil.NoSuchProcess):
        return {}


def compute_apps():
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False).stdout
    return [int(x) for x in out.split() if x.strip().isdigit()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--work", default="/tmp/vllm-role")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    model = os.path.join(a.work, "tiny")
    make_tiny_model(model)
    tag = "gpuflow-it-%s" % uuid.uuid4().hex[:10]
    port = free_port()
    ev, pidfile = server_vars("h200", model, venv_with_vllm(os.path.join(a.work, "venv")), a.work, a.tp, tag, port,
                              vllm_server_shutdown_timeout=5)
    steps = {}
    rc, wall, recap = playbook(a.work, ev, "start")
    tree1 = server_tree(pidfile)
    answer = get_json("http://127.0.0.1:%d/v1/chat/completions" % port,
                      {"model": tag, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}) if rc == 0 else {}
    steps["start"] = {"rc": rc, "wall_s": wall, "recap": recap, "processes": sorted(tree1.values()),
                      "answered": bool(answer.get("choices")), "on_gpu": sorted(set(compute_apps()) & set(tree1))}

    rc, wall, recap = playbook(a.work, ev, "rerun")
    steps["rerun"] = {"rc": rc, "wall_s": wall, "recap": recap, "same_server": server_tree(pidfile) == tree1}

    rc, wall, recap = playbook(a.work, dict(ev, vllm_server_max_model_len=2048), "changed")
    tree2 = server_tree(pidfile)
    steps["changed_setting"] = {"rc": rc, "wall_s": wall, "recap": recap, "new_server": bool(tree2) and not (set(tree2) & set(tree1))}

    rc, wall, recap = playbook(a.work, dict(ev, vllm_server_max_model_len=2048, vllm_server_state="stopped",
                                            drain_after=True), "handoff")
    steps["handoff"] = {"rc": rc, "wall_s": wall, "recap": recap,
                        "left": [p for p in tree2 if psutil.pid_exists(p)], "compute_apps_after": compute_apps()}
    ok = (steps["start"]["rc"] == 0 and steps["start"]["answered"] and steps["rerun"]["rc"] == 0
          and steps["rerun"]["same_server"] and steps["changed_setting"]["new_server"] and steps["handoff"]["rc"] == 0
          and not steps["handoff"]["left"] and not steps["handoff"]["compute_apps_after"])
    result = {"name": "vllm_server_h200_tp%d" % a.tp, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine(), "commit": commit(), "steps": steps,
              "summary": {"ok": ok, "start_to_ready_s": steps["start"]["wall_s"],
                          "rerun_s": steps["rerun"]["wall_s"], "restart_s": steps["changed_setting"]["wall_s"],
                          "stop_to_verified_free_s": steps["handoff"]["wall_s"]}}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, s in steps.items():
        print(name, s, flush=True)
    print(json.dumps(result["summary"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

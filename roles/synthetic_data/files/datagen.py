"""Token-exact synthetic training data from a served model (gpuflow.eagle3.synthetic_data).

Sends every prompt of a JSONL prompt set to an OpenAI-compatible vLLM server
(/v1/chat/completions with ``return_token_ids``) and writes rows in the format
``speculators regenerate-responses`` writes: ``id``, ``primary_id``, ``input_ids``
(prompt + completion token ids, exactly as the server saw and produced them),
``loss_mask`` (0 over the prompt, 1 over the completion), the messages with the
assistant turn (``content`` and ``reasoning_content``) and ``metadata``.

What it adds to speculators' command: detached running (``--detach``), progress in
``progress.json`` (done / total, tokens, rate, ETA), resume keyed by prompt id (a
torn last line is cut off first), retries with backoff and jitter only on
transient errors (connection errors, timeouts, 408/409/425/429/5xx; other 4xx fail
at once), a stop without using up retries when the server refuses connections for
``--server-gone-after`` seconds (stopped or crashed: the prompts stay to do), rows cut by ``finish_reason == "length"`` kept apart in
``truncated.jsonl``, reasoning presence measured, and an atomic ``MANIFEST.json``
with counts, tokens, errors, truncations and the reasoning fraction; exit status 2
when the error share crosses ``--error-threshold``.

Input rows: ``{"id": str, "conversations"|"messages": [{"role", "content"}, ...]}``
(``from``/``value`` also accepted). The last assistant turn, if any, is dropped and
regenerated; everything before it is the prompt.

Output directory:
  rows.jsonl        finished rows (finish_reason "stop")
  truncated.jsonl   rows cut by max_tokens (finish_reason "length"), same format
  errors.jsonl      one line per prompt that failed in a run (retried on resume)
  progress.json     live progress, rewritten atomically every second
  MANIFEST.json     written atomically at the end of a run
  datagen.pid       pid of the running client

Several hosts share one prompt set with ``run --shard R/W``: this client answers the prompts whose
position in the set is R modulo W, into its own directory (``shards/rank-R-of-W`` by the role's
convention), and ``merge`` joins the W complete shard directories into one dataset with one
manifest, refusing a prompt answered twice or missing.

The server's API key, if any, comes from ``--api-key-file`` (read before ``--detach`` forks, so the
file may go as soon as the launcher returns), never from argv or the environment.

Subcommands: ``run`` (default), ``status`` (print progress.json),
``wait`` (block up to N seconds for the run to end, print progress), ``merge``.
Needs Python >= 3.9 and aiohttp (the vLLM venv has it).
"""
import argparse
import asyncio
import hashlib
import json
import os
import random
import signal
import sys
import time

from gpuflow_jobs import atomic_json, detach, job_status, live_pid, read_json, sha256_file, write_pidfile

RETRY_STATUS = {408, 409, 425, 429}
SCHEMA = 1


# ----------------------------------------------------------------------------- files
def repair_tail(path):
    """Cut a torn last line (a crash mid-write) so the file holds whole rows only."""
    if not os.path.exists(path):
        return 0
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return 0
        pos = size - 1
        while pos > 0:
            step = min(65536, pos)
            f.seek(pos - step)
            buf = f.read(step)
            i = buf.rfind(b"\n")
            if i >= 0:
                pos = pos - step + i + 1
                break
            pos -= step
        f.truncate(pos)
        return size - pos


def read_rows(path):
    """Yield parsed rows; a line that does not parse is skipped (and reported)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except ValueError:
                yield None


def load_prompts(path):
    prompts, seen = [], set()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            pid = str(obj.get("id") if obj.get("id") is not None else
                      hashlib.sha256(line.encode()).hexdigest()[:16])
            if pid in seen:
                raise SystemExit("prompt id %s appears twice (line %d of %s)" % (pid, n, path))
            seen.add(pid)
            conv = obj.get("conversations") or obj.get("messages") or []
            msgs = []
            for m in conv:
                role = m.get("role") or {"human": "user", "gpt": "assistant"}.get(m.get("from"), m.get("from"))
                msgs.append({"role": role, "content": m.get("content", m.get("value", ""))})
            while msgs and msgs[-1]["role"] == "assistant":
                msgs.pop()
            if not msgs:
                raise SystemExit("prompt %s has no message to answer (line %d)" % (pid, n))
            prompts.append({"id": pid, "messages": msgs})
    return prompts


# ----------------------------------------------------------------------------- client
class Transient(Exception):
    pass


class Fatal(Exception):
    pass


class ServerGone(Exception):
    """Nothing has listened at the endpoint for --server-gone-after seconds: stopped or crashed."""


class Run:
    def __init__(self, a):
        self.a = a
        self.out = a.out_dir
        self.rows_path = os.path.join(self.out, "rows.jsonl")
        self.trunc_path = os.path.join(self.out, "truncated.jsonl")
        self.err_path = os.path.join(self.out, "errors.jsonl")
        self.progress_path = os.path.join(self.out, "progress.json")
        self.manifest_path = os.path.join(self.out, "MANIFEST.json")
        self.t0 = time.time()
        self.done_before = 0
        self.done_now = 0
        self.tokens_now = 0
        self.completion_tokens_now = 0
        self.errors_now = 0
        self.retries = 0
        self.stop = False
        self.state = "running"
        self.last_error = None
        self.aborted = None
        self.refused_since = None  # first refused connection since the last answer

    # -- progress ------------------------------------------------------------
    def progress(self, final=False):
        el = max(1e-6, time.time() - self.t0)
        done = self.done_before + self.done_now
        rate = self.done_now / el
        left = self.total - done - self.errors_now
        p = {"state": self.state, "pid": os.getpid(), "total": self.total, "done": done,
             "done_this_run": self.done_now, "errors": self.errors_now, "retries": self.retries,
             "tokens_this_run": self.tokens_now,
             "completion_tokens_per_s": round(self.completion_tokens_now / el, 1),
             "requests_per_s": round(rate, 3), "elapsed_s": round(el, 1),
             "eta_s": (round(left / rate, 1) if rate > 0 and left > 0 else (0 if left <= 0 else None)),
             "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "last_error": self.last_error}
        atomic_json(self.progress_path, p) if final else self._write_fast(p)
        return p

    def _write_fast(self, p):
        tmp = self.progress_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(p, f, sort_keys=True)
        os.replace(tmp, self.progress_path)

    async def ticker(self):
        while not self.stop:
            self.progress()
            await asyncio.sleep(1.0)

    # -- requests ------------------------------------------------------------
    async def one(self, http, item):
        a = self.a
        body = {"model": self.model, "messages": item["messages"], "max_tokens": a.max_tokens,
                "return_token_ids": True, "stream": False}
        body.update(self.sampling)
        if self.template_kwargs:
            body["chat_template_kwargs"] = self.template_kwargs
        attempt = 0
        while True:
            attempt += 1
            t = time.time()
            try:
                async with http.post(self.url, json=body, headers=self.headers) as r:
                    text = await r.text()
                    if r.status in RETRY_STATUS or r.status >= 500:
                        raise Transient("HTTP %d: %s" % (r.status, text[:300]))
                    if r.status != 200:
                        raise Fatal("HTTP %d: %s" % (r.status, text[:300]))
                    data = json.loads(text)
                self.refused_since = None
                return self.make_row(item, data, time.time() - t, attempt)
            except Fatal:
                raise
            except (self.aiohttp.ClientConnectorError, ConnectionRefusedError) as e:
                # A refused connection is a server that is down or restarting, not a bad prompt: it does not
                # use up the prompt's retries; the run stops (the prompt stays to do) once it lasts too long.
                self.last_error = "%s: %s" % (type(e).__name__, str(e)[:300])
                now = time.time()
                self.refused_since = self.refused_since or now
                if now - self.refused_since >= a.server_gone_after:
                    raise ServerGone("the server at %s refused connections for %.0f s: it was stopped or crashed. "
                                     "Start it and rerun: finished prompts are kept"
                                     % (self.url, now - self.refused_since)) from e
                await asyncio.sleep(min(a.backoff_base, a.server_gone_after / 4) * random.uniform(0.5, 1.5))
                continue
            except (Transient, asyncio.TimeoutError, self.aiohttp.ClientError, ConnectionError) as e:
                self.last_error = "%s: %s" % (type(e).__name__, str(e)[:300])
                if attempt > a.max_retries:
                    raise Fatal("gave up after %d attempts: %s" % (attempt, self.last_error))
                self.retries += 1
                delay = min(a.backoff_max, a.backoff_base * (2 ** (attempt - 1))) * random.uniform(0.5, 1.5)
                await asyncio.sleep(delay)

    def make_row(self, item, data, latency, attempts):
        ch = data["choices"][0]
        msg = ch.get("message") or {}
        prompt_ids = data.get("prompt_token_ids")
        out_ids = ch.get("token_ids")
        if prompt_ids is None or out_ids is None:
            raise Fatal("the server returned no token ids (needs vLLM with return_token_ids)")
        reasoning = msg.get("reasoning") or msg.get("reasoning_content") or ""
        content = msg.get("content") or ""
        asst = {"role": "assistant", "content": content}
        if reasoning:
            asst["reasoning_content"] = reasoning
        return {
            "id": item["id"] + "_gen0",
            "primary_id": item["id"],
            "input_ids": list(prompt_ids) + list(out_ids),
            "loss_mask": [0] * len(prompt_ids) + [1] * len(out_ids),
            "messages": item["messages"] + [asst],
            "metadata": {
                "finish_reason": ch.get("finish_reason"),
                "usage": data.get("usage"),
                "model": data.get("model"),
                "endpoint": self.url,
                "sampling_params": dict(self.sampling, max_tokens=self.a.max_tokens),
                "chat_template_kwargs": self.template_kwargs,
                "has_reasoning": bool(reasoning),
                "think_leak": ("<think>" in content) or ("</think>" in content),
                "latency_s": round(latency, 3),
                "attempts": attempts,
            },
        }

    async def worker(self, http, queue, files):
        while not self.stop:
            try:
                item = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                row = await self.one(http, item)
            except ServerGone as e:
                self.aborted = self.last_error = str(e)
                self.state = "aborted"
                self.stop = True
                return
            except Fatal as e:
                self.errors_now += 1
                self.last_error = str(e)[:300]
                files["err"].write(json.dumps({"id": item["id"], "error": str(e),
                                               "time": time.time()}) + "\n")
                files["err"].flush()
                if self.a.max_consecutive_errors and self.consecutive_errors_inc() >= self.a.max_consecutive_errors:
                    self.aborted = "%d prompts failed in a row; the last: %s" % (self.consecutive, self.last_error)
                    self.state = "aborted"
                    self.stop = True
                continue
            self.consecutive = 0
            target = files["trunc"] if row["metadata"]["finish_reason"] == "length" else files["rows"]
            target.write(json.dumps(row, separators=(",", ":")) + "\n")
            target.flush()
            self.done_now += 1
            n_out = sum(row["loss_mask"])
            self.tokens_now += len(row["input_ids"])
            self.completion_tokens_now += n_out
            if self.done_now % 64 == 0:
                os.fsync(target.fileno())

    def consecutive_errors_inc(self):
        self.consecutive = getattr(self, "consecutive", 0) + 1
        return self.consecutive

    async def main(self):
        import aiohttp
        self.aiohttp = aiohttp
        a = self.a
        base = a.endpoint.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        self.url = base + "/v1/chat/completions"
        self.headers = {"Authorization": "Bearer " + a.api_key} if a.api_key else {}
        self.sampling = json.loads(a.sampling_params) if a.sampling_params else {}
        self.template_kwargs = json.loads(a.chat_template_kwargs) if a.chat_template_kwargs else None

        prompts = load_prompts(a.prompts)
        self.prompts_in_set = len(prompts)
        prompts = prompts[a.shard_rank::a.shard_world]
        self.total = len(prompts)
        os.makedirs(self.out, exist_ok=True)
        cut = {p: repair_tail(p) for p in (self.rows_path, self.trunc_path, self.err_path)}
        done_ids = set()
        for path in (self.rows_path, self.trunc_path):
            for row in read_rows(path):
                if row and "primary_id" in row:
                    done_ids.add(row["primary_id"])
        self.done_before = len(done_ids & {p["id"] for p in prompts})
        todo = [p for p in prompts if p["id"] not in done_ids]
        self.resume_info = {"done_before": self.done_before, "torn_bytes_cut": cut}

        timeout = aiohttp.ClientTimeout(total=a.request_timeout, sock_connect=a.connect_timeout)
        conn = aiohttp.TCPConnector(limit=a.concurrency + 8)
        ticker = asyncio.ensure_future(self.ticker())
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
            if not a.model:
                async with http.get(base + "/v1/models", headers=self.headers) as r:
                    self.model = (await r.json())["data"][0]["id"]
            else:
                self.model = a.model
            self.vllm_version = None
            try:
                async with http.get(base + "/version", headers=self.headers) as r:
                    self.vllm_version = (await r.json()).get("version")
            except Exception:  # noqa: BLE001 - informative only
                pass
            queue = asyncio.Queue()
            for p in todo:
                queue.put_nowait(p)
            self.t_req0 = time.time()
            with open(self.rows_path, "a") as fr, open(self.trunc_path, "a") as ft, \
                    open(self.err_path, "a") as fe:
                files = {"rows": fr, "trunc": ft, "err": fe}
                n_workers = min(a.concurrency, max(1, len(todo)))
                await asyncio.gather(*[self.worker(http, queue, files) for i in range(n_workers)])
                for f in (fr, ft, fe):
                    f.flush()
                    os.fsync(f.fileno())
            self.t_req1 = time.time()
        self.stop = True
        await ticker
        return self.finish(prompts)

    def finish(self, prompts):
        a = self.a
        ids = {p["id"] for p in prompts}
        counts = {"rows": 0, "truncated": 0, "duplicates": 0, "unparsable": 0, "unknown_ids": 0}
        seen = set()
        tok = {"prompt": 0, "completion": 0}
        reasoning = leaks = 0
        for path, key in ((self.rows_path, "rows"), (self.trunc_path, "truncated")):
            for row in read_rows(path):
                if row is None:
                    counts["unparsable"] += 1
                    continue
                pid = row.get("primary_id")
                if pid not in ids:
                    counts["unknown_ids"] += 1
                    continue
                if pid in seen:
                    counts["duplicates"] += 1
                    continue
                seen.add(pid)
                counts[key] += 1
                n_out = sum(row["loss_mask"])
                tok["completion"] += n_out
                tok["prompt"] += len(row["input_ids"]) - n_out
                md = row.get("metadata", {})
                reasoning += bool(md.get("has_reasoning"))
                leaks += bool(md.get("think_leak"))
        done = len(seen)
        missing = self.total - done
        error_share = missing / self.total if self.total else 0.0
        ok = (missing == 0 or error_share <= a.error_threshold) and self.state != "aborted" \
            and counts["duplicates"] == 0 and counts["unparsable"] == 0
        self.state = "complete" if ok else "failed"
        req_s = max(1e-6, self.t_req1 - self.t_req0)
        manifest = {
            "schema": SCHEMA, "stage": "synthetic_data", "status": self.state,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "inputs": {"prompts": os.path.abspath(a.prompts), "prompts_sha256": sha256_file(a.prompts),
                       "model": self.model, "endpoint": self.url, "vllm_version": self.vllm_version,
                       "max_tokens": a.max_tokens, "sampling_params": self.sampling,
                       "chat_template_kwargs": self.template_kwargs, "fingerprint": a.fingerprint},
            "shard": {"rank": a.shard_rank, "world_size": a.shard_world, "prompts_in_set": self.prompts_in_set},
            "counts": {"prompts": self.total, "done": done, "rows": counts["rows"],
                       "truncated": counts["truncated"], "errors": missing,
                       "errors_this_run": self.errors_now, "retries_this_run": self.retries,
                       "duplicates": counts["duplicates"], "unparsable_lines": counts["unparsable"],
                       "unknown_ids": counts["unknown_ids"]},
            "tokens": {"prompt": tok["prompt"], "completion": tok["completion"],
                       "total": tok["prompt"] + tok["completion"]},
            "reasoning_fraction": round(reasoning / done, 4) if done else 0.0,
            "think_leaks": leaks,
            "error_share": round(error_share, 4), "error_threshold": a.error_threshold,
            "aborted": self.aborted,
            "this_run": {"requests": self.done_now + self.errors_now, "completed": self.done_now,
                         "request_phase_s": round(req_s, 3),
                         "requests_per_s": round(self.done_now / req_s, 3),
                         "resume": self.resume_info},
            "files": {os.path.basename(p): {"lines": sum(1 for line in open(p)), "sha256": sha256_file(p)}
                      for p in (self.rows_path, self.trunc_path) if os.path.exists(p)},
        }
        atomic_json(self.manifest_path, manifest)
        self.progress(final=True)
        return manifest


# ----------------------------------------------------------------------------- commands
def cmd_run(a):
    os.makedirs(a.out_dir, exist_ok=True)
    pidfile = os.path.join(a.out_dir, "datagen.pid")
    other = live_pid(pidfile)
    if other:
        print(json.dumps({"started": False, "pid": other, "msg": "a client already runs on this directory"}))
        return 0
    if os.path.exists(pidfile):
        os.unlink(pidfile)
    fpath = os.path.join(a.out_dir, "FINGERPRINT")
    if a.fingerprint:
        old = open(fpath).read().strip() if os.path.exists(fpath) else None
        if old is None and not any(os.path.exists(os.path.join(a.out_dir, n))
                                   for n in ("rows.jsonl", "truncated.jsonl")):
            with open(fpath, "w") as f:
                f.write(a.fingerprint + "\n")
        elif old != a.fingerprint:
            print(json.dumps({"started": False, "failed": True,
                              "msg": "%s holds rows made with other inputs (fingerprint %s, now %s); "
                                     "use a new output directory" % (a.out_dir, old, a.fingerprint)}))
            return 3
    # before the fork: the launcher's caller may remove the key file as soon as --detach returns
    try:
        a.api_key = read_api_key(a.api_key_file)
    except OSError as e:
        print(json.dumps({"started": False, "failed": True,
                          "msg": "cannot read the API key file: %s" % e}))
        return 3
    if a.detach:
        # survives the SSH session and the Ansible task that started it
        launched = detach(os.path.join(a.out_dir, "datagen.log"), pidfile, text_pidfile=True)
        if launched is not None:
            print(json.dumps({"started": launched["started"], "pid": launched["pid"], "detached": True}))
            return 0
    else:
        write_pidfile(pidfile, text=True)
    if os.path.exists(os.path.join(a.out_dir, "MANIFEST.json")):
        os.replace(os.path.join(a.out_dir, "MANIFEST.json"), os.path.join(a.out_dir, "MANIFEST.prev.json"))
    run = Run(a)
    loop = asyncio.new_event_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(run, "stop", True))
    try:
        m = loop.run_until_complete(run.main())
    except BaseException as e:  # noqa: BLE001 - record the failure for the poller, then re-raise
        run.state = "failed"
        run.last_error = "%s: %s" % (type(e).__name__, e)
        try:
            run.total = getattr(run, "total", 0)
            run.progress(final=True)
        except Exception:  # noqa: BLE001
            pass
        raise
    finally:
        try:
            os.unlink(pidfile)
        except OSError:
            pass
    print(json.dumps({"status": m["status"], "counts": m["counts"], "tokens": m["tokens"],
                      "reasoning_fraction": m["reasoning_fraction"],
                      "requests_per_s": m["this_run"]["requests_per_s"]}))
    return 0 if m["status"] == "complete" else 2


def read_api_key(path):
    """The key from a file (a trailing newline dropped), never from argv or the environment, where other
    local users could read it; empty without --api-key-file."""
    if not path:
        return ""
    with open(path) as f:
        return f.read().strip()


def status(out_dir):
    prog = job_status(os.path.join(out_dir, "progress.json"), live_pid(os.path.join(out_dir, "datagen.pid")),
                      os.path.join(out_dir, "datagen.log"), "client")
    prog["manifest"] = read_json(os.path.join(out_dir, "MANIFEST.json"))
    return prog


def cmd_status(a):
    print(json.dumps(status(a.out_dir)))
    return 0


def cmd_wait(a):
    end = time.time() + a.seconds
    while True:
        s = status(a.out_dir)
        if not s["running"] or time.time() >= end:
            s.pop("manifest", None) if s["running"] else None
            print(json.dumps(s))
            return 0
        time.sleep(min(1.0, max(0.0, end - time.time())))


def parse_shard(text):
    rank, world = (text.split("/", 1) + ["1"])[:2]
    rank, world = int(rank), int(world or 1)
    if not 0 <= rank < world:
        raise argparse.ArgumentTypeError("shard must be R/W with 0 <= R < W, got %s" % text)
    return rank, world


def shard_dir(out_dir, rank, world):
    return os.path.join(out_dir, "shards", "rank-%d-of-%d" % (rank, world))


def cmd_merge(a):
    """Join the complete shards of one prompt set into out_dir (rows, truncated, errors, MANIFEST)."""
    problems, manifests = [], []
    for rank in range(a.world_size):
        m = None
        try:
            with open(os.path.join(shard_dir(a.out_dir, rank, a.world_size), "MANIFEST.json")) as f:
                m = json.load(f)
        except (OSError, ValueError):
            problems.append("shard %d of %d has no manifest" % (rank, a.world_size))
            continue
        shard = m.get("shard", {})
        if m.get("status") != "complete":
            problems.append("shard %d is %s" % (rank, m.get("status")))
        elif m["inputs"].get("fingerprint") != a.fingerprint:
            problems.append("shard %d was made from other inputs" % rank)
        elif (shard.get("rank"), shard.get("world_size")) != (rank, a.world_size):
            problems.append("shard %d says it is %s" % (rank, shard))
        manifests.append(m)
    if problems:
        print(json.dumps({"merged": False, "problems": problems}))
        return 2
    seen, duplicates = set(), 0
    written = {}
    for name in ("rows.jsonl", "truncated.jsonl", "errors.jsonl"):
        tmp = os.path.join(a.out_dir, name + ".tmp")
        with open(tmp, "w") as out:
            for rank in range(a.world_size):
                path = os.path.join(shard_dir(a.out_dir, rank, a.world_size), name)
                for line in open(path) if os.path.exists(path) else []:
                    if name != "errors.jsonl":
                        pid = json.loads(line)["primary_id"]
                        duplicates += pid in seen
                        seen.add(pid)
                    out.write(line)
            out.flush()
            os.fsync(out.fileno())
        written[name] = tmp
    total = manifests[0]["shard"]["prompts_in_set"]
    counts = {k: sum(m["counts"][k] for m in manifests) for k in manifests[0]["counts"]}
    counts["duplicates"] += duplicates
    done = counts["done"]
    ok = duplicates == 0 and counts["prompts"] == total and done + counts["errors"] == total
    for name, tmp in written.items():
        os.replace(tmp, os.path.join(a.out_dir, name))
    inputs = dict(manifests[0]["inputs"], endpoint=[m["inputs"]["endpoint"] for m in manifests])
    manifest = {
        "schema": SCHEMA, "stage": "synthetic_data", "status": "complete" if ok else "failed",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "inputs": inputs, "shard": {"world_size": a.world_size, "prompts_in_set": total}, "counts": counts,
        "tokens": {k: sum(m["tokens"][k] for m in manifests) for k in ("prompt", "completion", "total")},
        "reasoning_fraction": round(sum(m["reasoning_fraction"] * m["counts"]["done"] for m in manifests) / done, 4)
        if done else 0.0,
        "think_leaks": sum(m["think_leaks"] for m in manifests),
        "error_share": round(counts["errors"] / total, 4) if total else 0.0,
        "error_threshold": manifests[0]["error_threshold"],
        "this_run": {"requests": sum(m["this_run"]["requests"] for m in manifests),
                     "completed": sum(m["this_run"]["completed"] for m in manifests),
                     "requests_per_s": round(sum(m["this_run"]["requests_per_s"] for m in manifests), 3),
                     "resume": {"done_before": sum(m["this_run"]["resume"]["done_before"] for m in manifests)},
                     "shards": [{"rank": r, "prompts": m["counts"]["prompts"], "done": m["counts"]["done"],
                                 "endpoint": m["inputs"]["endpoint"]} for r, m in enumerate(manifests)]},
        "files": {n: {"lines": sum(1 for line in open(os.path.join(a.out_dir, n))),
                      "sha256": sha256_file(os.path.join(a.out_dir, n))} for n in ("rows.jsonl", "truncated.jsonl")},
    }
    atomic_json(os.path.join(a.out_dir, "MANIFEST.json"), manifest)
    print(json.dumps({"merged": ok, "status": manifest["status"], "counts": counts,
                      "problems": [] if ok else ["%d prompt(s) answered twice" % duplicates]}))
    return 0 if ok else 2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    r = sub.add_parser("run")
    r.add_argument("--endpoint", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    r.add_argument("--prompts", required=True)
    r.add_argument("--out-dir", required=True)
    r.add_argument("--model", default="", help="served model name (default: the first of /v1/models)")
    r.add_argument("--concurrency", type=int, default=64)
    r.add_argument("--max-tokens", type=int, default=8192)
    r.add_argument("--sampling-params", default='{"temperature": 0.6, "top_p": 0.95}')
    r.add_argument("--chat-template-kwargs", default="")
    r.add_argument("--max-retries", type=int, default=5)
    r.add_argument("--backoff-base", type=float, default=2.0)
    r.add_argument("--backoff-max", type=float, default=60.0)
    r.add_argument("--request-timeout", type=float, default=3600.0)
    r.add_argument("--connect-timeout", type=float, default=60.0)
    r.add_argument("--max-consecutive-errors", type=int, default=0,
                   help="abort the run after this many prompts fail in a row (0: never)")
    r.add_argument("--server-gone-after", type=float, default=60.0,
                   help="stop the run when the endpoint refuses connections this long (a rerun resumes)")
    r.add_argument("--error-threshold", type=float, default=0.01,
                   help="fail (exit 2, status failed) when more than this share of prompts has no row")
    r.add_argument("--api-key-file", default="",
                   help="file holding the server's API key, read once at the start (default: no key)")
    r.add_argument("--fingerprint", default="", help="opaque identity of the inputs, stored in the manifest")
    r.add_argument("--detach", action="store_true")
    r.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="R/W",
                   help="answer only the prompts at positions R, R+W, R+2W, ... of the set (default 0/1: all)")
    s = sub.add_parser("status")
    s.add_argument("--out-dir", required=True)
    w = sub.add_parser("wait")
    w.add_argument("--out-dir", required=True)
    w.add_argument("--seconds", type=float, default=30)
    m = sub.add_parser("merge")
    m.add_argument("--out-dir", required=True, help="the dataset directory; shards are in OUT/shards/rank-R-of-W")
    m.add_argument("--world-size", type=int, required=True)
    m.add_argument("--fingerprint", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "run":
        a.shard_rank, a.shard_world = a.shard
    fn = {"run": cmd_run, "status": cmd_status, "wait": cmd_wait, "merge": cmd_merge}.get(a.cmd)
    if not fn:
        ap.error("a subcommand is required")
    return fn(a)


if __name__ == "__main__":
    sys.exit(main())

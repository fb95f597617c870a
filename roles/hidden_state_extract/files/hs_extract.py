"""Hidden-state extraction driver (gpuflow.eagle3.hidden_state_extract).

Runs with the speculators venv's python, around speculators 0.9.0's own commands:

  prepare   `speculators prepare-data --no-skip-token-freq` into a fresh directory,
            swapped in only when complete; skipped when PREPARED.json matches the
            inputs' fingerprint (input files' sha256, model config, parameters).
  plan      the preflight that needs data: layer ids against the model, sequence length
            against the server's max model length, this rank's shard (speculators' own
            split), the disk budget (tokens x layers x hidden x bytes per value plus a
            margin) against the output filesystem's free space, staging and output on one
            filesystem; the mode (--mode auto: offline when it fits, else online) and
            what online costs instead (no bytes stored, epochs x samples target passes).
            Prints {"problems": [...]} and the figures; exit 0 either way.
  smoke     one sample through the extraction server: layer count, sequence length,
            dtype and token ids of the file vLLM writes; the file is removed after.
  run       `speculators generate-offline-data` for this rank, rerun until every sample
            of the shard has a readable file (at most --max-passes passes), progress in
            progress.json (samples done/total, bytes, rate, ETA). --detach: in its own
            session, surviving the caller.
  status / wait   print progress.json (wait: block up to --seconds for the job to end).
  validate  every sample of the shard: one file, header complete (no truncated file),
            shape [seq_len, layers, hidden], dtype, token_ids equal to the dataset's
            input_ids; writes shards/rank-R-of-W.json (sizes per file).
  finish    writes MANIFEST.json atomically from the shard records of every host.
  check     is this host's part complete? MANIFEST.json fingerprint and this rank's files
            present with the sizes recorded (a rerun after completion does nothing).
  serve-manifest  online mode: MANIFEST.json names the live server and the connector path
            training fetches hidden states through, instead of files.
  release   online mode, the server stopped: removes hidden-states files fetched and never
            consumed, marks the manifest released.

Files in the output directory: hs/hs_{i}.safetensors, prepared/, staging/ (vLLM's),
progress.json, extract.log, extract.pid, shards/, MANIFEST.json.
"""
import argparse
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

SCHEMA = 1
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}
CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32", "float": "F32"}
# safetensors header (JSON of two or three tensors) plus the 8-byte length, per file
HEADER_ALLOWANCE = 256
# online mode: in the connector path, so that a training host proves it sees the directory the server writes
ONLINE_MARK = ".gpuflow-online.json"


# ----------------------------------------------------------------------------- small helpers
def emit(obj):
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def atomic_json(path, obj):
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def replace_json(path, obj):
    """Atomic but not synced: for progress, rewritten every second and worthless after a crash."""
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(obj, f, sort_keys=True)
    os.replace(tmp, path)


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_config(model_dir):
    """The text model's config (multimodal configs such as Kimi-K2.5 nest it in text_config)."""
    cfg = read_json(os.path.join(model_dir, "config.json"))
    if cfg is None:
        raise SystemExit("no readable config.json in %s" % model_dir)
    text = cfg.get("text_config") or cfg
    dtype = text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    return {
        "num_hidden_layers": int(text["num_hidden_layers"]),
        "hidden_size": int(text["hidden_size"]),
        "max_position_embeddings": int(text.get("max_position_embeddings") or 0),
        "dtype": CONFIG_DTYPES.get(str(dtype).replace("torch.", ""), "BF16"),
    }


def shard_range(num_samples, world_size, rank):
    """speculators' split (data_generation/offline.py::get_indices_to_process): contiguous
    chunks that differ by at most one sample, the remainder on the first ranks."""
    chunk, rem = divmod(num_samples, world_size)
    start = rank * chunk + min(rank, rem)
    return start, start + chunk + (1 if rank < rem else 0)


def hs_name(idx):
    return "hs_%d.safetensors" % idx


def list_hs(hs_dir):
    """{index: size} of hs_{i}.safetensors files in hs_dir."""
    found = {}
    try:
        entries = os.scandir(hs_dir)
    except FileNotFoundError:
        return found
    with entries:
        for e in entries:
            n = e.name
            if n.startswith("hs_") and n.endswith(".safetensors") and n[3:-12].isdigit():
                try:
                    found[int(n[3:-12])] = e.stat().st_size
                except FileNotFoundError:
                    pass
    return found


def read_header(path):
    """(header dict, expected file size) of a safetensors file, or raise ValueError."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise ValueError("implausible header length %d" % n)
        body = f.read(n)
        if len(body) < n:
            raise ValueError("header cut short")
    header = json.loads(body.decode("utf-8"))
    end = max([t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"] or [0])
    return header, 8 + n + end


def file_problem(path):
    """None when the file's header is complete and its size matches it, else the reason."""
    try:
        expected = read_header(path)[1]
        actual = os.path.getsize(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return "unreadable header: %s" % e
    if actual != expected:
        return "truncated: %d of %d bytes" % (actual, expected)
    return None


def load_dataset(path):
    from datasets import load_from_disk  # the speculators venv has it; imported only where needed
    return load_from_disk(path)


# ----------------------------------------------------------------------------- prepare
def prepare_fingerprint(a):
    parts = {
        "data": [(os.path.basename(p), sha256_file(p)) for p in a.data],
        "model_config": sha256_file(os.path.join(a.model, "config.json")),
        "tokenizer": [sha256_file(os.path.join(a.model, n)) for n in sorted(os.listdir(a.model))
                      if n.startswith("tokenizer") or n == "chat_template.jinja"],
        "seq_length": a.seq_length,
        "seed": a.seed,
        "max_samples": a.max_samples,
        "trust_remote_code": a.trust_remote_code,
        "schema": SCHEMA,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def cmd_prepare(a):
    a.data = [p for p in a.data if os.path.getsize(p) > 0]
    if not a.data:
        raise SystemExit("no non-empty data file to prepare")
    fp = prepare_fingerprint(a)
    marker = os.path.join(a.output, "PREPARED.json")
    old = read_json(marker, {})
    if old.get("fingerprint") == fp and any(n.endswith(".arrow") for n in os.listdir(a.output)):
        emit(dict(old, changed=False))
        return 0
    tmp = a.output.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    argv = [sys.executable, "-m", "speculators", "prepare-data", "--model", a.model, "--output", tmp,
            "--seq-length", str(a.seq_length), "--seed", str(a.seed), "--no-skip-token-freq"]
    for p in a.data:
        argv += ["--data", p]
    if a.max_samples > 0:
        argv += ["--max-samples", str(a.max_samples)]
    if a.trust_remote_code:
        argv.append("--trust-remote-code")
    t0 = time.time()
    with open(a.log, "ab") as log:
        rc = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit("speculators prepare-data failed (rc %d); see %s" % (rc, a.log))
    ds = load_dataset(tmp)
    lengths = [int(x) for x in ds["seq_len"]]
    info = {"fingerprint": fp, "samples": len(lengths), "tokens": int(sum(lengths)),
            "max_seq_len": int(max(lengths)), "seq_length": a.seq_length,
            "inputs": a.data, "seconds": round(time.time() - t0, 1), "schema": SCHEMA}
    atomic_json(os.path.join(tmp, "PREPARED.json"), info)
    # swap in only the complete dataset: a failure above leaves the old one untouched
    if os.path.exists(a.output):
        shutil.rmtree(a.output)
    os.rename(tmp, a.output)
    emit(dict(info, changed=True))
    return 0


# ----------------------------------------------------------------------------- plan
def storage_bytes_per_token(storage, model_dtype, layers, hidden):
    """Bytes one token costs on disk: the hidden states, the int64 token id, fp8's scale."""
    if storage == "fp8":
        return layers * hidden * 1 + 8 + 4
    return layers * hidden * DTYPE_BYTES[model_dtype] + 8


def existing_dir(path):
    """path, or its nearest ancestor that exists: where it will live once created."""
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


def human(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return "%.1f %s" % (n, unit) if unit != "B" else "%d B" % n
        n /= 1024.0
    return str(n)


def cmd_plan(a):
    problems = []
    cfg = model_config(a.model)
    n_layers = cfg["num_hidden_layers"]
    aux = a.layer_ids
    if len(set(aux)) != len(aux):
        problems.append("layer ids %s contain duplicates" % aux)
    if n_layers in aux:
        problems.append("layer id %d (num_hidden_layers) is the final layer, which is always captured last; "
                        "list only the auxiliary layers" % n_layers)
    bad = [i for i in aux if i < 0 or i >= n_layers]
    if bad:
        problems.append("layer ids %s are out of range for a model with num_hidden_layers=%d "
                        "(auxiliary ids must be within 0..%d)" % (bad, n_layers, n_layers - 1))
    if aux != sorted(aux):
        problems.append("layer ids %s must be in increasing order" % aux)
    capture = aux + [n_layers]
    max_len = a.max_model_len or cfg["max_position_embeddings"]
    # a request is the sample plus the one token vLLM generates
    if max_len and a.seq_length + 1 > max_len:
        problems.append("seq_length %d does not fit the server's max model length %d (a request needs "
                        "seq_length + 1 tokens); lower hidden_state_extract_seq_length or raise "
                        "vllm_server_max_model_len" % (a.seq_length, max_len))
    if cfg["max_position_embeddings"] and a.seq_length + 1 > cfg["max_position_embeddings"]:
        problems.append("seq_length %d is above the model's max_position_embeddings %d"
                        % (a.seq_length, cfg["max_position_embeddings"]))

    ds = load_dataset(a.dataset)
    lengths = [int(x) for x in ds["seq_len"]]
    start, end = shard_range(len(lengths), a.world_size, a.rank)
    shard_lengths = lengths[start:end]
    per_token = storage_bytes_per_token(a.storage, cfg["dtype"], len(capture), cfg["hidden_size"])
    predicted = sum(shard_lengths) * per_token + HEADER_ALLOWANCE * len(shard_lengths)
    present = list_hs(a.hs_dir)
    existing = sum(size for i, size in present.items() if start <= i < end)
    needed = max(0, predicted - existing)
    with_margin = int(needed * (1 + a.margin)) + a.reserve_bytes
    st = os.statvfs(existing_dir(a.hs_dir))
    free = st.f_bavail * st.f_frsize
    # online: no hidden states are kept, but the target runs again for every sample of every epoch
    online_cost = {"stored_bytes": 0, "target_passes": a.epochs * len(lengths), "epochs": a.epochs,
                   "samples": len(lengths), "tokens": a.epochs * int(sum(lengths))}
    online_note = ("online instead (gpuflow_hidden_states: online) stores 0 bytes of hidden states and runs the "
                   "target %d times (%d epochs x %d samples, %d tokens)"
                   % (online_cost["target_passes"], a.epochs, len(lengths), online_cost["tokens"]))
    fits = with_margin <= free
    budget_problem = None
    if not fits:
        fp8_bytes = sum(shard_lengths) * storage_bytes_per_token("fp8", cfg["dtype"], len(capture), cfg["hidden_size"])
        budget_problem = (
            "disk budget: this shard needs %s (%d samples, %d tokens x %d layers x hidden %d x %s per value = "
            "%s, %s already written, margin %d%%, reserve %s) but %s has %s free. Ways out: "
            "hidden_state_extract_storage: fp8 (about %s), fewer samples (hidden_state_extract_max_samples), "
            "another hidden_state_extract_output_dir on a larger filesystem, or %s."
            % (human(with_margin), len(shard_lengths), sum(shard_lengths), len(capture), cfg["hidden_size"],
               "1 byte" if a.storage == "fp8" else "%d bytes" % DTYPE_BYTES[cfg["dtype"]], human(predicted),
               human(existing), int(a.margin * 100), human(a.reserve_bytes), a.hs_dir, human(free),
               human(fp8_bytes) if a.storage != "fp8" else "already fp8", online_note))
    if a.mode == "auto":
        mode = "offline" if fits else "online"
        mode_reason = ("auto: offline fits (%s needed, %s free)" % (human(with_margin), human(free)) if fits else
                       "auto chose online: offline needs %s but %s has %s free; %s"
                       % (human(with_margin), a.hs_dir, human(free), online_note))
    else:
        mode = a.mode
        mode_reason = "%s, as asked" % mode
    if mode == "offline" and budget_problem:
        problems.append(budget_problem)
    if mode == "online" and a.world_size != 1:
        problems.append("online mode serves hidden states from one server; this shard is rank %d of %d. Put one "
                        "host in the extract group (or hidden_state_extract_world_size: 1)" % (a.rank, a.world_size))
    if mode == "offline" and os.stat(existing_dir(a.staging)).st_dev != os.stat(existing_dir(a.hs_dir)).st_dev:
        problems.append("the connector's staging path %s and the output %s are on different filesystems: "
                        "files would be copied, not renamed, and an interruption could leave a truncated file; "
                        "put the staging path on the output's filesystem" % (a.staging, a.hs_dir))
    emit({"problems": problems, "mode": mode, "mode_reason": mode_reason, "online_cost": online_cost,
          "model": cfg, "capture_layer_ids": capture,
          "samples": len(lengths), "tokens": int(sum(lengths)), "max_seq_len": int(max(lengths or [0])),
          "shard": {"rank": a.rank, "world_size": a.world_size, "start": start, "end": end,
                    "samples": len(shard_lengths), "tokens": int(sum(shard_lengths))},
          "budget": {"bytes_per_token": per_token, "predicted_bytes": int(predicted), "existing_bytes": existing,
                     "needed_with_margin": with_margin, "free_bytes": free, "storage": a.storage,
                     "dtype": "F8_E4M3" if a.storage == "fp8" else cfg["dtype"]},
          "max_model_len": max_len})
    return 0


# ----------------------------------------------------------------------------- smoke
def http_json(url, body=None, timeout=600):
    import urllib.request
    headers = {"Content-Type": "application/json"}
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def wait_unlocked(lock_path, timeout):
    import fcntl
    deadline = time.time() + timeout
    with open(lock_path) as lf:
        while True:
            try:
                fcntl.flock(lf, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.time() > deadline:
                    raise SystemExit("the server did not finish writing %s within %d s" % (lock_path, timeout))
                time.sleep(0.05)


def cmd_smoke(a):
    from safetensors import safe_open
    ds = load_dataset(a.dataset)
    ids = [int(x) for x in ds[a.index]["input_ids"]]
    t0 = time.time()
    resp = http_json(a.endpoint.rstrip("/") + "/completions",
                     {"model": a.served_model, "prompt": ids, "max_tokens": 1, "return_token_ids": True})
    params = resp.get("kv_transfer_params") or {}
    path = params.get("hidden_states_path")
    problems = []
    if not path:
        raise SystemExit("the server answered without kv_transfer_params.hidden_states_path: is it the "
                         "extract profile? answer: %s" % json.dumps(resp)[:500])
    if os.path.exists(path + ".lock"):
        wait_unlocked(path + ".lock", a.timeout)
    try:
        with safe_open(path, framework="pt") as f:
            hs = f.get_slice("hidden_states")
            shape, dtype = list(hs.get_shape()), hs.get_dtype()
            token_ids = [int(x) for x in f.get_tensor("token_ids").tolist()]
    finally:
        for p in (path, path + ".lock"):
            if os.path.exists(p):
                os.remove(p)
    want = [len(ids), a.layers, a.hidden]
    if shape != want:
        problems.append("hidden_states shape %s, expected [seq_len %d, layers %d, hidden %d]%s"
                        % (shape, len(ids), a.layers, a.hidden,
                           " (one layer fewer: this vLLM does not capture the final layer; use a release "
                           "with that fix)" if len(shape) == 3 and shape[1] == a.layers - 1 else ""))
    if dtype != a.dtype:
        problems.append("hidden_states dtype %s, expected %s" % (dtype, a.dtype))
    if token_ids != ids:
        problems.append("token_ids differ from the sample's input_ids (prefix caching on?)")
    emit({"problems": problems, "shape": shape, "dtype": dtype, "index": a.index,
          "seconds": round(time.time() - t0, 3)})
    return 0


# ----------------------------------------------------------------------------- run (detached job)
def job_paths(out):
    return {"progress": os.path.join(out, "progress.json"), "pid": os.path.join(out, "extract.pid"),
            "log": os.path.join(out, "extract.log")}


def job_alive(out):
    """PID of the running job of this output directory, validated by its command line, or None."""
    info = read_json(job_paths(out)["pid"])
    if not info:
        return None
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 1:
        return None
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            cmd = f.read().split(b"\0")
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    args = [c.decode(errors="replace") for c in cmd]
    if state == "Z" or not any(x.endswith("hs_extract.py") for x in args) or os.path.abspath(out) not in args:
        return None
    return pid


def die_with_parent():
    """In the client, before exec: SIGTERM when the job dies, so a killed job leaves no client writing on."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Job:
    def __init__(self, a):
        self.a = a
        self.p = job_paths(a.out)
        self.child = None
        self.t0 = time.time()
        self.base_done = None
        self.passes = 0

    def mine(self):
        """{index: size} of the files of this job's shard."""
        return {i: size for i, size in list_hs(self.a.hs_dir).items() if self.a.start <= i < self.a.end}

    def progress(self, state, extra=None):
        a = self.a
        mine = self.mine()
        done, total = len(mine), a.end - a.start
        if self.base_done is None:
            self.base_done = done
        elapsed = max(time.time() - self.t0, 1e-6)
        rate = (done - self.base_done) / elapsed
        p = {"state": state, "done": done, "total": total, "bytes": sum(mine.values()),
             "samples_per_s": round(rate, 2), "eta_s": round((total - done) / rate) if rate > 0 else None,
             "elapsed_s": round(elapsed, 1), "pass": self.passes, "pid": os.getpid(),
             "rank": a.rank, "world_size": a.world_size, "updated": time.time()}
        p.update(extra or {})
        if state == "running":
            replace_json(self.p["progress"], p)
        else:
            atomic_json(self.p["progress"], p)
        return p

    def one_pass(self):
        a = self.a
        argv = [sys.executable, "-m", "speculators", "generate-offline-data",
                "--endpoint", a.endpoint, "--preprocessed-data", a.dataset, "--output", a.hs_dir,
                "--concurrency", str(a.concurrency), "--request-timeout", str(a.request_timeout),
                "--max-retries", str(a.max_retries), "--world-size", str(a.world_size), "--rank", str(a.rank),
                "--model", a.served_model]
        if a.validate_outputs:
            argv.append("--validate-outputs")
        with open(self.p["log"], "ab") as log:
            log.write(("=== pass %d: %s\n" % (self.passes, " ".join(argv))).encode())
            log.flush()
            self.child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
            while self.child.poll() is None:
                self.progress("running")
                try:  # returns as soon as the client exits, not at the next tick
                    self.child.wait(timeout=a.progress_interval)
                except subprocess.TimeoutExpired:
                    pass
        rc, self.child = self.child.returncode, None
        return rc

    def run(self):
        a = self.a

        def on_term(signum, _frame):
            if self.child is not None and self.child.poll() is None:
                self.child.send_signal(signum)  # the child this job started, nothing else
            self.progress("stopped", {"signal": signum})
            sys.exit(128 + signum)

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        last_rc, bad = None, []
        while self.passes < a.max_passes:
            self.passes += 1
            last_rc = self.one_pass()
            bad = self.incomplete()
            if not bad:
                self.progress("extracted", {"last_rc": last_rc})
                return 0
        self.progress("failed", {"last_rc": last_rc, "missing_or_bad": bad[:20],
                                 "msg": "samples still missing after %d passes; see %s" % (self.passes, self.p["log"])})
        return 1

    def incomplete(self):
        a = self.a
        mine = self.mine()
        bad = [i for i in range(a.start, a.end) if i not in mine]
        bad += [i for i in sorted(mine) if file_problem(os.path.join(a.hs_dir, hs_name(i)))]
        return sorted(bad)


def cmd_run(a):
    running = job_alive(a.out)
    if running:
        emit({"started": False, "running": True, "pid": running})
        return 0
    os.makedirs(a.hs_dir, exist_ok=True)
    a.start, a.end = shard_range(len(load_dataset(a.dataset)), a.world_size, a.rank)
    paths = job_paths(a.out)
    if a.detach:
        r, w = os.pipe()
        if os.fork() > 0:
            os.close(w)
            with os.fdopen(r) as rf:
                pid = rf.read().strip()
            emit({"started": bool(pid), "running": bool(pid), "pid": int(pid) if pid else None})
            return 0
        os.close(r)
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        os.setpgid(0, 0)  # the job leads its own process group: one signal reaches it and its client
        log = os.open(paths["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        atomic_json(paths["pid"], {"pid": os.getpid(), "started": time.time()})
        os.write(w, str(os.getpid()).encode())
        os.close(w)
    else:
        atomic_json(paths["pid"], {"pid": os.getpid(), "started": time.time()})
    job = Job(a)
    job.progress("starting")
    rc = job.run()
    if a.detach:
        os._exit(rc)
    return rc


def cmd_status(a):
    paths = job_paths(a.out)
    p = read_json(paths["progress"], {"state": "absent"})
    p["running"] = job_alive(a.out) is not None
    if not p["running"] and p["state"] in ("starting", "running"):
        # the job had no chance to write its last state: SIGKILL, the OOM killer, a reboot
        p["state"] = "died"
        p["msg"] = "the extraction job (pid %s) is gone without a final state (killed?); see %s" % (
            p.get("pid", "?"), paths["log"])
    emit(p)
    return 0


def cmd_wait(a):
    deadline = time.time() + a.seconds
    while time.time() < deadline and job_alive(a.out):
        time.sleep(0.5)
    return cmd_status(a)


# ----------------------------------------------------------------------------- validate / finish / check
def cmd_validate(a):
    from safetensors import safe_open
    ds = load_dataset(a.dataset)
    start, end = shard_range(len(ds), a.world_size, a.rank)
    problems, sizes, tokens = [], {}, 0
    dtype_seen = set()
    for i in range(start, end):
        path = os.path.join(a.hs_dir, hs_name(i))
        if not os.path.exists(path):
            problems.append("sample %d: no file" % i)
            continue
        why = file_problem(path)
        if why:
            problems.append("sample %d: %s" % (i, why))
            continue
        ids = [int(x) for x in ds[i]["input_ids"]]
        with safe_open(path, framework="pt") as f:
            hs = f.get_slice("hidden_states")
            shape, dtype = list(hs.get_shape()), hs.get_dtype()
            token_ids = [int(x) for x in f.get_tensor("token_ids").tolist()]
        dtype_seen.add(dtype)
        if shape != [len(ids), a.layers, a.hidden]:
            problems.append("sample %d: shape %s, expected %s" % (i, shape, [len(ids), a.layers, a.hidden]))
        if dtype != a.dtype:
            problems.append("sample %d: dtype %s, expected %s" % (i, dtype, a.dtype))
        if token_ids != ids:
            problems.append("sample %d: token_ids differ from the dataset's input_ids" % i)
        sizes[str(i)] = os.path.getsize(path)
        tokens += len(ids)
    record = {"host": a.host, "rank": a.rank, "world_size": a.world_size, "start": start, "end": end,
              "samples": end - start, "tokens": tokens, "bytes": sum(sizes.values()), "sizes": sizes,
              "dtype": sorted(dtype_seen), "fingerprint": a.fingerprint, "valid": not problems,
              "validated": time.time(), "schema": SCHEMA}
    stale = []
    if not problems:
        shard_dir = os.path.join(a.out, "shards")
        os.makedirs(shard_dir, exist_ok=True)
        atomic_json(os.path.join(shard_dir, "rank-%d-of-%d.json" % (a.rank, a.world_size)), record)
        # files vLLM staged for requests whose client is gone (a killed run): never moved, never used
        for n in os.listdir(a.staging) if os.path.isdir(a.staging) else []:
            if n.endswith(".safetensors") or n.endswith(".safetensors.lock"):
                os.remove(os.path.join(a.staging, n))
                stale.append(n)
    summary = {k: v for k, v in record.items() if k != "sizes"}
    emit(dict(summary, problems=problems[:50], problem_count=len(problems), stale_staging_removed=len(stale)))
    return 0


def cmd_finish(a):
    shards = json.loads(a.shards)
    manifest = {
        "stage": "hidden_state_extract", "status": "complete", "mode": "offline", "mode_reason": a.mode_reason,
        "schema": SCHEMA, "fingerprint": a.fingerprint, "inputs": json.loads(a.inputs),
        "samples": sum(s["samples"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards), "layer_ids": json.loads(a.layer_ids), "dtype": a.dtype,
        "shards": sorted(shards, key=lambda s: s["rank"]),
        "checks": ["one file per sample", "header complete (no truncated file)", "shape [seq_len, layers, hidden]",
                   "dtype", "token_ids equal the dataset's input_ids", "smoke test of one sample"],
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_json(os.path.join(a.out, "MANIFEST.json"), manifest)
    emit({"changed": True, "samples": manifest["samples"]})
    return 0


def without_written(m):
    return {k: v for k, v in (m or {}).items() if k != "written"}


def cmd_serve_manifest(a):
    """Online mode: the manifest says where training fetches hidden states (the live server, the connector
    path both sides see) instead of listing files. Rewritten only when something in it changed."""
    plan = json.loads(a.plan)
    manifest = {
        "stage": "hidden_state_extract", "status": "serving", "mode": "online", "schema": SCHEMA,
        "fingerprint": a.fingerprint, "inputs": json.loads(a.inputs),
        "samples": plan["samples"], "tokens": plan["tokens"], "bytes": 0,
        "layer_ids": plan["capture_layer_ids"], "dtype": plan["budget"]["dtype"],
        "mode_reason": plan["mode_reason"], "online_cost": plan["online_cost"],
        "online": {"endpoint": a.endpoint, "served_model": a.served_model, "connector_path": a.connector_path,
                   "host": a.host},
        "checks": ["smoke test of one sample"],
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = os.path.join(a.out, "MANIFEST.json")
    changed = without_written(read_json(path)) != without_written(manifest)
    mark = os.path.join(a.connector_path, ONLINE_MARK)
    if read_json(mark) != {"fingerprint": a.fingerprint, "host": a.host}:
        os.makedirs(a.connector_path, exist_ok=True)
        atomic_json(mark, {"fingerprint": a.fingerprint, "host": a.host})
        changed = True
    if changed:
        atomic_json(path, manifest)
    emit({"changed": changed, "samples": manifest["samples"]})
    return 0


def hidden_state_leftovers(path):
    """Connector files in path: hidden states written for a request and never consumed, with their locks."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    return [os.path.join(path, n) for n in names if n.endswith((".safetensors", ".safetensors.lock"))]


def cmd_release(a):
    """Online mode, once the server is stopped: no fetched-but-unconsumed file is left behind, and the
    manifest says the server is gone (a later training needs the extract stage again)."""
    removed = 0
    for path in hidden_state_leftovers(a.connector_path):
        try:
            os.remove(path)
            removed += 1
        except FileNotFoundError:
            pass
    manifest_path = os.path.join(a.out, "MANIFEST.json")
    m = read_json(manifest_path)
    changed = removed > 0
    if m and m.get("mode") == "online" and m.get("status") == "serving":
        m.update(status="released", released=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        atomic_json(manifest_path, m)
        changed = True
    emit({"changed": changed, "leftovers_removed": removed})
    return 0


def cmd_check(a):
    m = read_json(os.path.join(a.out, "MANIFEST.json"))
    rec = read_json(os.path.join(a.out, "shards", "rank-%d-of-%d.json" % (a.rank, a.world_size)))
    reason = None
    if not m or m.get("status") != "complete" or not rec:
        reason = "no complete manifest for this shard"
    elif m.get("fingerprint") != a.fingerprint or rec.get("fingerprint") != a.shard_fingerprint:
        reason = "the inputs changed since the manifest was written"
    else:
        present = list_hs(a.hs_dir)
        wrong = [i for i, size in rec["sizes"].items() if present.get(int(i)) != size]
        if wrong:
            reason = "%d file(s) missing or changed since validation, e.g. %s" % (len(wrong), hs_name(int(wrong[0])))
    if reason:
        emit({"complete": False, "reason": reason})
    else:
        emit({"complete": True, "samples": rec["samples"], "tokens": rec["tokens"], "bytes": rec["bytes"]})
    return 0


# ----------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def shard_args(p):
        p.add_argument("--world-size", type=int, default=1)
        p.add_argument("--rank", type=int, default=0)

    p = sub.add_parser("prepare")
    p.add_argument("--model", required=True)
    p.add_argument("--data", action="append", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-samples", type=int, default=0, help="0: all")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log", required=True)

    p = sub.add_parser("plan")
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--hs-dir", required=True)
    p.add_argument("--staging", required=True)
    p.add_argument("--layer-ids", type=json.loads, required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument("--storage", choices=["model", "fp8"], default="model")
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--reserve-bytes", type=int, default=0)
    p.add_argument("--mode", choices=["offline", "online", "auto"], default="offline")
    p.add_argument("--epochs", type=int, default=1, help="training epochs: what online mode costs")
    shard_args(p)

    p = sub.add_parser("smoke")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--served-model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--timeout", type=int, default=600)

    p = sub.add_parser("run")
    p.add_argument("--out", required=True)
    p.add_argument("--hs-dir", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--served-model", required=True)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--request-timeout", type=int, default=1200)
    p.add_argument("--max-retries", type=int, default=3)
    p.add_argument("--max-passes", type=int, default=3)
    p.add_argument("--validate-outputs", action="store_true")
    p.add_argument("--progress-interval", type=float, default=1.0)
    p.add_argument("--detach", action="store_true")
    shard_args(p)

    for name in ("status", "wait"):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        p.add_argument("--seconds", type=float, default=30)

    p = sub.add_parser("validate")
    p.add_argument("--out", required=True)
    p.add_argument("--hs-dir", required=True)
    p.add_argument("--staging", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--fingerprint", required=True)
    shard_args(p)

    p = sub.add_parser("finish")
    p.add_argument("--out", required=True)
    p.add_argument("--fingerprint", required=True)
    p.add_argument("--inputs", required=True, help="JSON object")
    p.add_argument("--shards", required=True, help="JSON list of the shard records of every host")
    p.add_argument("--layer-ids", required=True, help="JSON list")
    p.add_argument("--dtype", required=True)
    p.add_argument("--mode-reason", default="offline, as asked")

    p = sub.add_parser("serve-manifest")
    p.add_argument("--out", required=True)
    p.add_argument("--fingerprint", required=True)
    p.add_argument("--inputs", required=True, help="JSON object")
    p.add_argument("--plan", required=True, help="the plan's JSON")
    p.add_argument("--endpoint", required=True, help="the server's URL as training hosts reach it")
    p.add_argument("--served-model", required=True)
    p.add_argument("--connector-path", required=True)
    p.add_argument("--host", required=True)

    p = sub.add_parser("release")
    p.add_argument("--out", required=True)
    p.add_argument("--connector-path", required=True)

    p = sub.add_parser("check")
    p.add_argument("--out", required=True)
    p.add_argument("--hs-dir", required=True)
    p.add_argument("--fingerprint", required=True, help="the stage's (MANIFEST.json)")
    p.add_argument("--shard-fingerprint", required=True, help="this rank's (shards/rank-R-of-W.json)")
    shard_args(p)

    a = ap.parse_args(argv)
    if getattr(a, "world_size", 1) < 1 or not 0 <= getattr(a, "rank", 0) < getattr(a, "world_size", 1):
        ap.error("--rank must be within 0..world_size-1")
    return {"prepare": cmd_prepare, "plan": cmd_plan, "smoke": cmd_smoke, "run": cmd_run, "status": cmd_status,
            "wait": cmd_wait, "validate": cmd_validate, "finish": cmd_finish, "check": cmd_check,
            "serve-manifest": cmd_serve_manifest, "release": cmd_release}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())

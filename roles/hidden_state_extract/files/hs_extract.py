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
  budget    the pipeline's preflight (playbooks/preflight.yml), before any data exists: the same
            rules and disk formula as plan, the samples from the data manifest or the inventory's
            expectation. JSON in (--inputs), JSON out; the standard library and gpuflow_jobs only,
            so it runs with any python3 of the host before speculators is installed (the preflight
            feeds it on stdin, put together with gpuflow_jobs by the host_program filter).
  drafter   the pipeline's preflight of the training: the EAGLE-3 drafter's shape for the
            verifier and the GPU memory its training needs, against the declared GPUs.
  smoke     one sample through the extraction server: layer count, sequence length,
            dtype and token ids of the file vLLM writes; the file is removed after.
  run       the extraction client (Client) over this rank's samples, rerun until every
            sample of the shard has a good file (at most --max-passes passes), progress in
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

from gpuflow_jobs import atomic_json, detach, emit, job_status, live_pid, read_json, sha256_file, write_pidfile

SCHEMA = 1
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}
CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32", "float": "F32"}
# safetensors header (JSON of two or three tensors) plus the 8-byte length, per file
HEADER_ALLOWANCE = 256
# online mode: in the connector path, so that a training host proves it sees the directory the server writes
ONLINE_MARK = ".gpuflow-online.json"


# ----------------------------------------------------------------------------- small helpers
# multimodal wrappers whose text model (layers, width, vocabulary) sits under text_config
WRAPPER_MODEL_TYPES = ("kimi_k25",)


def text_model(cfg, where):
    """The text model's config: under text_config in a multimodal wrapper such as Kimi-K2.5, else the config.
    A wrapper without it is refused: its top level holds no usable geometry, and guessing would plan wrong."""
    if cfg.get("text_config"):
        return cfg["text_config"]
    if cfg.get("model_type") in WRAPPER_MODEL_TYPES or cfg.get("vision_config"):
        raise ValueError(
            "%s is a multimodal wrapper (model_type %s, %s) without text_config, where its text model's "
            "num_hidden_layers, hidden_size and vocab_size are read: use the checkpoint's own config.json (Kimi-K2.5 "
            "ships one with text_config), or give vllm_server_model_path a directory whose config.json has it"
            % (where, cfg.get("model_type"), ", ".join(cfg.get("architectures") or []) or "no architectures"))
    return cfg


def model_geometry(cfg, where):
    """What the plans need of a model's config.json: layers, width, dtype and the drafter's shape inputs.
    Raises ValueError naming the fix when the config cannot give them."""
    text = text_model(cfg, where)
    dtype = str(text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype")
                or "bfloat16").replace("torch.", "")
    geometry = {
        "num_hidden_layers": int(text.get("num_hidden_layers") or 0),
        "hidden_size": int(text.get("hidden_size") or 0),
        "max_position_embeddings": int(text.get("max_position_embeddings") or 0),
        "torch_dtype": dtype,
        "dtype": CONFIG_DTYPES.get(dtype, "BF16"),
        "vocab_size": int(text.get("vocab_size") or 0),
        # speculators' draft MLP mirrors a dense intermediate_size, else 3 x hidden (resolve_draft_intermediate_size)
        "intermediate_size": int(text.get("intermediate_size") or 3 * int(text.get("hidden_size") or 0)),
        "num_attention_heads": int(text.get("num_attention_heads") or 0),
        "num_key_value_heads": int(text.get("num_key_value_heads") or text.get("num_attention_heads") or 0),
        # transformers' DeepseekV3Config (Kimi's text model) sets head_dim to qk_rope_head_dim
        "head_dim": int(text.get("head_dim") or text.get("qk_rope_head_dim") or 0),
    }
    if not geometry["num_hidden_layers"] or not geometry["hidden_size"]:
        raise ValueError("%s gives no num_hidden_layers or hidden_size (looked at the top level and under "
                         "text_config)" % where)
    return geometry


def model_config(model_dir):
    """The text model's geometry from model_dir/config.json, or exit naming what is wrong."""
    where = os.path.join(model_dir, "config.json")
    cfg = read_json(where)
    if cfg is None:
        raise SystemExit("no readable config.json in %s" % model_dir)
    try:
        return model_geometry(cfg, where)
    except ValueError as e:
        raise SystemExit(str(e))


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
    """(header dict, offset of the data, expected file size) of a safetensors file, or raise ValueError."""
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
    return header, 8 + n, 8 + n + end


def checked_header(path):
    """(header, offset of the data, None) when the file's header is complete and its size matches it, else
    (None, None, the reason)."""
    try:
        header, base, expected = read_header(path)
        actual = os.path.getsize(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, None, "unreadable header: %s" % e
    if actual != expected:
        return None, None, "truncated: %d of %d bytes" % (actual, expected)
    return header, base, None


def file_problem(path):
    """None when the file's header is complete and its size matches it, else the reason."""
    return checked_header(path)[2]


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


def default_layer_ids(num_layers):
    """speculators 0.9.0's auxiliary layers when --target-layer-ids is not given (resolve_target_layer_ids)."""
    return [2, num_layers // 2, num_layers - 3]


def capture_check(geometry, layer_ids, seq_length, max_model_len):
    """The layer ids and the sequence length against the model: the rules the role's plan and the pipeline's
    preflight both apply (each words them for its reader). geometry None: the model does not exist yet."""
    listed = isinstance(layer_ids, list) and len(layer_ids) > 0 and all(
        isinstance(i, int) and not isinstance(i, bool) for i in layer_ids)
    ids = layer_ids if listed else []
    n_layers = geometry["num_hidden_layers"] if geometry else 0
    positions = geometry["max_position_embeddings"] if geometry else 0
    # a request is the sample plus the one token vLLM generates; vLLM's own limit is max_position_embeddings
    server_max_len = max_model_len or positions
    return {
        "listed": listed,
        "repeats": len(set(ids)) != len(ids),
        "unordered": ids != sorted(ids),
        "outside": [i for i in ids if i < 0 or i >= n_layers] if n_layers else [],
        "final_listed": bool(n_layers) and n_layers in ids,
        "num_hidden_layers": n_layers,
        "default_layer_ids": default_layer_ids(n_layers) if n_layers else [],
        # the final layer is always captured last
        "capture_layer_ids": ids + [n_layers] if n_layers else ids,
        "server_max_len": server_max_len,
        "over_server_max_len": bool(server_max_len) and seq_length + 1 > server_max_len,
        "over_max_model_len": bool(max_model_len) and seq_length + 1 > max_model_len,
        "over_max_positions": bool(positions) and seq_length + 1 > positions,
    }


def disk_budget(storage, geometry, capture_layers, samples, tokens, existing, margin, reserve_bytes):
    """The hidden states' disk budget of samples holding tokens: per token (storage_bytes_per_token), a header
    per file, what is already written taken off, the margin and the reserve added."""
    per_token = storage_bytes_per_token(storage, geometry["dtype"], capture_layers, geometry["hidden_size"])
    predicted = tokens * per_token + HEADER_ALLOWANCE * samples
    return {"bytes_per_token": per_token, "predicted_bytes": predicted, "existing_bytes": existing,
            "needed_with_margin": int(max(0, predicted - existing) * (1 + margin)) + reserve_bytes,
            "fp8_bytes": tokens * storage_bytes_per_token("fp8", geometry["dtype"], capture_layers,
                                                          geometry["hidden_size"])}


def cmd_plan(a):
    problems = []
    cfg = model_config(a.model)
    n_layers = cfg["num_hidden_layers"]
    aux = a.layer_ids
    check = capture_check(cfg, aux, a.seq_length, a.max_model_len)
    if check["repeats"]:
        problems.append("layer ids %s contain duplicates" % aux)
    if check["final_listed"]:
        problems.append("layer id %d (num_hidden_layers) is the final layer, which is always captured last; "
                        "list only the auxiliary layers" % n_layers)
    if check["outside"]:
        problems.append("layer ids %s are out of range for a model with num_hidden_layers=%d "
                        "(auxiliary ids must be within 0..%d)" % (check["outside"], n_layers, n_layers - 1))
    if check["unordered"]:
        problems.append("layer ids %s must be in increasing order" % aux)
    capture = check["capture_layer_ids"]
    max_len = check["server_max_len"]
    if check["over_server_max_len"]:
        problems.append("seq_length %d does not fit the server's max model length %d (a request needs "
                        "seq_length + 1 tokens); lower hidden_state_extract_seq_length or raise "
                        "vllm_server_max_model_len" % (a.seq_length, max_len))
    if check["over_max_positions"]:
        problems.append("seq_length %d is above the model's max_position_embeddings %d"
                        % (a.seq_length, cfg["max_position_embeddings"]))

    ds = load_dataset(a.dataset)
    lengths = [int(x) for x in ds["seq_len"]]
    start, end = shard_range(len(lengths), a.world_size, a.rank)
    shard_lengths = lengths[start:end]
    present = list_hs(a.hs_dir)
    existing = sum(size for i, size in present.items() if start <= i < end)
    budget = disk_budget(a.storage, cfg, len(capture), len(shard_lengths), sum(shard_lengths), existing, a.margin,
                         a.reserve_bytes)
    per_token, predicted, with_margin = budget["bytes_per_token"], budget["predicted_bytes"], budget["needed_with_margin"]
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
        budget_problem = (
            "disk budget: this shard needs %s (%d samples, %d tokens x %d layers x hidden %d x %s per value = "
            "%s, %s already written, margin %d%%, reserve %s) but %s has %s free. Ways out: "
            "hidden_state_extract_storage: fp8 (about %s), fewer samples (hidden_state_extract_max_samples), "
            "another hidden_state_extract_output_dir on a larger filesystem, or %s."
            % (human(with_margin), len(shard_lengths), sum(shard_lengths), len(capture), cfg["hidden_size"],
               "1 byte" if a.storage == "fp8" else "%d bytes" % DTYPE_BYTES[cfg["dtype"]], human(predicted),
               human(existing), int(a.margin * 100), human(a.reserve_bytes), a.hs_dir, human(free),
               human(budget["fp8_bytes"]) if a.storage != "fp8" else "already fp8", online_note))
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


# ----------------------------------------------------------------------------- budget (the pipeline's preflight)
def planned_samples(data_manifest, expected_samples, include_truncated, max_samples):
    """(samples, token ceiling or None, where the count came from) before any dataset is prepared: a complete
    data manifest's rows (and truncated rows when they are extracted too), else the inventory's expectation."""
    data = read_json(data_manifest, {}) if data_manifest else {}
    if data.get("status") == "complete":
        counts = data.get("counts", {})
        samples = int(counts.get("rows", 0)) + (int(counts.get("truncated", 0)) if include_truncated else 0)
        tokens, source = int(data.get("tokens", {}).get("total", 0)), "the data manifest " + data_manifest
    else:
        samples, tokens, source = int(expected_samples), None, "gpuflow_expected_samples" if expected_samples else ""
    return (min(samples, max_samples) if max_samples > 0 else samples), tokens, source


def cmd_budget(a):
    """The pipeline preflight's checks of the extraction, on the extract host, before any data exists: the model's
    geometry, the layer ids, the sequence length and the disk budget, by the plan's own rules and formula.
    Input: one JSON object (--inputs); output: the figures and the problems of each check, in the preflight's
    words (it names inventory variables). Changes nothing."""
    i = json.loads(a.inputs)
    out = {"model": None, "model_problems": [], "layer_problems": [], "sequence_problems": [], "disk": None,
           "disk_problems": []}
    geometry = None
    if i["model"]:
        where = os.path.join(i["model"], "config.json")
        try:
            geometry = model_geometry(read_json(where, {}), where)
        except ValueError as e:
            out["model_problems"].append(str(e))
            emit(out)
            return 0
    out["model"] = geometry
    ids, seq_length, max_model_len = i["layer_ids"], i["seq_length"], i["max_model_len"]
    check = out["layers"] = capture_check(geometry, ids, seq_length, max_model_len)
    n_layers = check["num_hidden_layers"]
    if not check["listed"]:
        example = ((check["default_layer_ids"], "this %d-layer model" % n_layers) if n_layers
                   else (default_layer_ids(61), "a 61-layer model such as Kimi-K2.5"))
        out["layer_problems"].append(
            "hidden_state_extract_layer_ids must be a non-empty list of integers, the auxiliary layers to capture "
            "(e.g. %s, speculators' default for %s); got %s" % (example + (json.dumps(ids),)))
    elif check["repeats"] or check["unordered"]:
        out["layer_problems"].append("hidden_state_extract_layer_ids %s must be increasing, without repeats"
                                     % json.dumps(ids))
    if check["outside"]:
        out["layer_problems"].append(
            "layer ids %s are outside 0..%d: %s has num_hidden_layers %d (the final layer %d is always captured, "
            "do not list it)" % (json.dumps(check["outside"]), n_layers - 1, i["model"], n_layers, n_layers))
    if check["over_max_model_len"]:
        out["sequence_problems"].append(
            "hidden_state_extract_seq_length %d does not fit vllm_server_max_model_len %d (a request is seq_length "
            "+ 1 tokens); lower the first or raise the second" % (seq_length, max_model_len))
    if check["over_max_positions"]:
        out["sequence_problems"].append("hidden_state_extract_seq_length %d + 1 is above the model's "
                                        "max_position_embeddings %d" % (seq_length, geometry["max_position_embeddings"]))
    if geometry is None or out["layer_problems"]:
        emit(out)
        return 0

    manifest = os.path.join(i["out_dir"], "MANIFEST.json")
    if read_json(manifest, {}).get("status") == "complete":
        out["disk"] = {"extracted": True, "manifest": manifest}
        emit(out)
        return 0
    samples, token_ceiling, source = planned_samples(i["data_manifest"], i["expected_samples"],
                                                     i["include_truncated"], i["max_samples"])
    start, end = shard_range(samples, i["world_size"], i["rank"])
    # each sample at most seq_length tokens, or the manifest's count when smaller
    tokens = (end - start) * seq_length if token_ceiling is None else min((end - start) * seq_length, token_ceiling)
    existing = sum(size for n, size in list_hs(i["hs_dir"]).items() if start <= n < end)
    disk = out["disk"] = disk_budget(i["storage"], geometry, len(check["capture_layer_ids"]), end - start, tokens,
                                     existing, i["margin"], i["reserve_bytes"])
    if i["free_bytes"] > 0:
        free, free_from = i["free_bytes"], "gpuflow_disk_free_bytes"
    else:
        nearest = existing_dir(i["hs_dir"])
        st = os.statvfs(nearest)
        free, free_from = st.f_bavail * st.f_frsize, "the filesystem of " + nearest
    disk.update(extracted=False, source=source, samples=end - start, tokens=tokens, free=free, free_from=free_from,
                shard="every shard, shared work dir" if i["shared"] else "shard %d/%d" % (i["rank"], i["world_size"]))
    # online stores no hidden states; auto goes online when they do not fit (the role's plan decides)
    if source and i["mode"] == "offline" and disk["needed_with_margin"] > free:
        out["disk_problems"].append(
            "disk budget. The hidden states of %d samples (%s, planned from %s) need %d bytes (%.1f GB: up to %d "
            "tokens x %d bytes, %d layers x hidden %d, less %d bytes already written, plus the margin %s) but only "
            "%d bytes (%.1f GB) are free on %s for %s. Ways out: hidden_state_extract_storage fp8 (about %.1f GB), "
            "fewer samples (hidden_state_extract_max_samples), a shorter hidden_state_extract_seq_length, or "
            "gpuflow_work_dir on a larger filesystem."
            % (end - start, disk["shard"], source, disk["needed_with_margin"], disk["needed_with_margin"] / 1e9,
               tokens, disk["bytes_per_token"], len(check["capture_layer_ids"]), geometry["hidden_size"], existing,
               i["margin"], free, free / 1e9, free_from, i["hs_dir"], disk["fp8_bytes"] / 1e9))
    emit(out)
    return 0


# ----------------------------------------------------------------------------- drafter (the pipeline's preflight)
# speculators 0.9.0 trains each draft position this many times per step (test-time training steps)
TTT_STEPS = 3
# the CUDA caching allocator's reserve over what tensors hold, and the CUDA context: fitted to the one measured
# training (research/h200_training_probe.md: 9.6 GB allocated, 12,664 MiB nvidia-smi peak)
ALLOCATOR_RESERVE = 0.3
CUDA_CONTEXT_BYTES = 1 << 30


def drafter_shape(geometry, draft_vocab_size, aux_layers):
    """The EAGLE-3 drafter speculators 0.9.0 builds for this verifier (one Llama decoder layer at the verifier's
    width): its dimensions and parameter counts. Trainable: fc (aux x hidden -> hidden), the layer (q/k/v take
    2 x hidden: the token embedding and the hidden state), the norms. Frozen: the verifier's embeddings, the
    draft lm_head and the teacher's (both draft vocab x hidden, rows of the verifier's lm_head), its final norm."""
    h, inter = geometry["hidden_size"], geometry["intermediate_size"]
    heads, kv_heads = geometry["num_attention_heads"], geometry["num_key_value_heads"]
    head_dim = geometry["head_dim"] or h // heads
    vocab = geometry["vocab_size"]
    draft_vocab = draft_vocab_size or vocab
    attn, kv = heads * head_dim, kv_heads * head_dim
    trainable = {"fc": aux_layers * h * h,
                 "attention": 2 * h * attn + 2 * (2 * h * kv) + attn * h,
                 "mlp": 3 * h * inter,
                 # input, hidden and post-attention norms of the layer, the output norm, the norm before fc
                 "norms": 4 * h + aux_layers * h}
    frozen = {"embed_tokens": vocab * h, "lm_heads": 2 * draft_vocab * h, "verifier_norm": h}
    return {"hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "verifier_vocab_size": vocab,
            "draft_vocab_size": draft_vocab, "aux_layers": aux_layers, "trainable": trainable, "frozen": frozen,
            "trainable_parameters": sum(trainable.values()), "frozen_parameters": sum(frozen.values())}


def drafter_train_memory(shape, total_seq_len, world_size=1, fsdp_shard=False, gradient_checkpointing=False):
    """Bytes one GPU holds at the peak of a training step of this drafter (speculators 0.9.0, bf16 autocast).
    States: every parameter in fp32, fp32 gradients and AdamW's two fp32 moments for the trainable ones
    (speculators' default Muon keeps one for its matrices: this is the bound), DDP's flat gradient copy, the bf16
    copies autocast makes of the matrices it multiplies; fsdp_shard splits the states over the world and gathers
    bf16 weights instead. Activations, per token of total_seq_len: for each TTT step the layer's saved tensors
    (bf16, the norms' fp32), the draft logits in bf16 and their fp32 log-probabilities; once, the teacher's
    targets and the inputs. Checked against the H200 probe (tests/unit): 9.6 GB allocated, 12,664 MiB peak."""
    h, inter, vd = shape["hidden_size"], shape["intermediate_size"], shape["draft_vocab_size"]
    attn, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    trainable, every = shape["trainable_parameters"], shape["trainable_parameters"] + shape["frozen_parameters"]
    shards = world_size if fsdp_shard else 1
    states = {"weights": 4 * every // shards, "gradients": 4 * trainable // shards,
              "optimizer": 8 * trainable // shards,
              "ddp_buckets": 0 if fsdp_shard else 4 * trainable,
              "bf16_copies": 2 * every if fsdp_shard else 2 * (trainable + shape["frozen"]["lm_heads"])}
    layer = 30 * h + 4 * attn + 4 * kv + 8 * inter
    logits = 6 * vd
    once = 6 * vd + 22 * h
    # checkpointing keeps each step's layer input (2 x hidden, bf16) and recomputes one step's layer at a time
    per_token = (TTT_STEPS * (4 * h + logits) + layer if gradient_checkpointing
                 else TTT_STEPS * (layer + logits)) + once
    allocated = sum(states.values()) + total_seq_len * per_token
    return {"states": states, "states_bytes": sum(states.values()), "activation_bytes": total_seq_len * per_token,
            "allocated_bytes": allocated, "peak_bytes": int(allocated * (1 + ALLOCATOR_RESERVE)) + CUDA_CONTEXT_BYTES}


def cmd_drafter(a):
    """The pipeline preflight's check of the training, on a train host: the drafter's shape from the verifier's
    config.json (text_config in a wrapper) and the GPU memory its training needs, against the declared memory
    per GPU. Input: one JSON object (--inputs); output: the figures and the problems. Changes nothing."""
    i = json.loads(a.inputs)
    where = os.path.join(i["verifier"], "config.json")
    try:
        geometry = model_geometry(read_json(where, {}), where)
    except ValueError as e:
        emit({"problems": [str(e)]})
        return 0
    shape = drafter_shape(geometry, i["draft_vocab_size"], i["aux_layers"])
    world = i["gpus_per_node"] * i["nodes"]

    def need(**change):
        args = dict(world_size=world, fsdp_shard=i["fsdp_shard"], gradient_checkpointing=i["gradient_checkpointing"])
        args.update(change)
        return drafter_train_memory(shape, i["total_seq_len"], **args)

    memory = need()
    problems = []
    gib = float(1 << 30)
    available = i["gpu_memory_mib"] << 20
    if available and memory["peak_bytes"] > available:
        ways = ["a shorter eagle3_train_total_seq_len (%d: %.1f GiB)"
                % (i["total_seq_len"] // 2, drafter_train_memory(
                    shape, i["total_seq_len"] // 2, world, i["fsdp_shard"], i["gradient_checkpointing"])["peak_bytes"] / gib)]
        if not i["gradient_checkpointing"]:
            ways.append("eagle3_train_gradient_checkpointing: true (%.1f GiB)"
                        % (need(gradient_checkpointing=True)["peak_bytes"] / gib))
        if not i["fsdp_shard"] and world > 1:
            ways.append("eagle3_train_fsdp_shard: true, the states split over %d GPUs (%.1f GiB)"
                        % (world, need(fsdp_shard=True)["peak_bytes"] / gib))
        problems.append(
            "training the drafter (hidden %d, draft vocab %d of %d) needs about %.1f GiB per GPU (weights, gradients "
            "and AdamW states %.1f GiB, activations of eagle3_train_total_seq_len %d tokens %.1f GiB, allocator "
            "and CUDA context) but gpuflow_gpu_memory_mib declares %d MiB (%.1f GiB) per GPU. Ways out: %s, or GPUs "
            "with more memory."
            % (shape["hidden_size"], shape["draft_vocab_size"], shape["verifier_vocab_size"],
               memory["peak_bytes"] / gib, memory["states_bytes"] / gib, i["total_seq_len"],
               memory["activation_bytes"] / gib, i["gpu_memory_mib"], available / gib, ", ".join(ways)))
    emit({"problems": problems, "shape": shape, "memory": memory, "world_size": world})
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
    """Returns once the connector has released its exclusive lock on lock_path (it holds it while the
    file is written; the lock file itself stays); TimeoutError after timeout seconds."""
    import fcntl
    deadline = time.time() + timeout
    with open(lock_path) as lf:
        while True:
            try:
                fcntl.flock(lf, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.time() > deadline:
                    raise TimeoutError("the server did not finish writing %s within %d s" % (lock_path, timeout))
                time.sleep(0.01)


def cmd_smoke(a):
    ids = read_input_ids(a.dataset)[a.index]
    t0 = time.time()
    resp = http_json(a.endpoint.rstrip("/") + "/completions",
                     {"model": a.served_model, "prompt": ids, "max_tokens": 1, "return_token_ids": True})
    params = resp.get("kv_transfer_params") or {}
    path = params.get("hidden_states_path")
    problems = []
    if not path:
        raise SystemExit("the server answered without kv_transfer_params.hidden_states_path: is it the "
                         "extract profile? answer: %s" % json.dumps(resp)[:500])
    try:
        if os.path.exists(path + ".lock"):
            wait_unlocked(path + ".lock", a.timeout)
        header, base, why = checked_header(path)
        if why:
            raise ValueError(why)
        shape, dtype, token_ids = sample_tensors(path, header, base)
    except TimeoutError as e:
        raise SystemExit(str(e)) from None
    except ValueError as e:
        raise SystemExit("the server's file %s: %s" % (path, e)) from None
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


# ----------------------------------------------------------------------------- the extraction client
# What the job sends and checks. Its own, not `speculators generate-offline-data`: that command imports torch and
# transformers before its first request (17 s on an H200 host), a fixed cost of every pass and every rank.
# The exponent bits of each storage dtype: all set means inf or NaN (F8_E4M3 has no inf; 0x7F is its NaN)
NON_FINITE_MASK = {"BF16": ("<u2", 0x7F80), "F16": ("<u2", 0x7C00), "F32": ("<u4", 0x7F800000), "F8_E4M3": ("u1", 0x7F)}
FINITE_CHECK_CHUNK = 16 << 20  # bytes read at a time: 32 requests in flight hold 512 MiB, not 32 whole files


class SampleError(Exception):
    """A sample the server answered wrongly: retrying the same request would not help."""


class InputIds:
    """The prepared dataset's input_ids, row i as a list of ints when asked for, read with pyarrow from the files
    `datasets` saved: no import of datasets, and so none of torch."""

    def __init__(self, column):
        self.column = column

    def __len__(self):
        return len(self.column)

    def __getitem__(self, i):
        return self.column[i].as_py()


def read_input_ids(dataset_dir):
    """InputIds of the prepared dataset in dataset_dir."""
    import pyarrow as pa
    with open(os.path.join(dataset_dir, "state.json")) as f:
        files = [d["filename"] for d in json.load(f)["_data_files"]]
    tables = []
    for name in files:
        with pa.memory_map(os.path.join(dataset_dir, name)) as source:
            tables.append(pa.ipc.open_stream(source).read_all().select(["input_ids"]))
    return InputIds(pa.concat_tables(tables).column("input_ids"))


def tensor_bytes(path, header, base, name):
    """The raw bytes of one tensor of a safetensors file (its header and data offset from checked_header)."""
    begin, end = header[name]["data_offsets"]
    with open(path, "rb") as f:
        f.seek(base + begin)
        return f.read(end - begin)


def non_finite_values(path, header, base, name):
    """Whether the tensor holds inf or NaN, read in chunks (numpy: no torch)."""
    import numpy
    dtype, mask = NON_FINITE_MASK[header[name]["dtype"]]
    itemsize = numpy.dtype(dtype).itemsize
    begin, end = header[name]["data_offsets"]
    buf = bytearray(FINITE_CHECK_CHUNK - FINITE_CHECK_CHUNK % itemsize)
    with open(path, "rb") as f:
        f.seek(base + begin)
        left = end - begin
        while left > 0:
            n = f.readinto(memoryview(buf)[:min(left, len(buf))])
            if not n:
                raise SampleError("%s ends inside tensor %s" % (path, name))
            if numpy.any((numpy.frombuffer(buf, dtype=dtype, count=n // itemsize) & mask) == mask):
                return True
            left -= n
    return False


def sample_tensors(path, header, base):
    """(hidden_states shape, its dtype, token_ids) of a hidden-states file whose header checked_header read;
    ValueError when a tensor is missing or the token ids are not I64."""
    if "hidden_states" not in header or "token_ids" not in header:
        raise ValueError("tensors %s, expected hidden_states and token_ids"
                         % sorted(k for k in header if k != "__metadata__"))
    if header["token_ids"]["dtype"] != "I64":
        raise ValueError("token_ids dtype %s, expected I64" % header["token_ids"]["dtype"])
    raw = tensor_bytes(path, header, base, "token_ids")
    return header["hidden_states"]["shape"], header["hidden_states"]["dtype"], \
        list(struct.unpack("<%dq" % (len(raw) // 8), raw))


def sample_problem(path, ids, check_values):
    """None when the file holds the sample: hidden_states [len(ids), ...] and token_ids equal to ids, and (with
    check_values) only finite values; else the reason."""
    header, base, problem = checked_header(path)
    if problem:
        return problem
    try:
        shape, _dtype, token_ids = sample_tensors(path, header, base)
    except ValueError as e:
        return str(e)
    if shape[0] != len(ids):
        return "hidden_states shape %s for %d tokens" % (shape, len(ids))
    if token_ids != ids:
        return "token_ids differ from the sample's input_ids"
    if check_values and header["hidden_states"]["dtype"] in NON_FINITE_MASK and \
            non_finite_values(path, header, base, "hidden_states"):
        return "hidden_states hold inf or NaN"
    return None


def place(src, dst):
    """Moves the server's file to its final name: a rename (the plan keeps staging on the output's filesystem);
    across filesystems a copy under a temporary name first, so a final name never holds half a file."""
    import errno
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        shutil.copyfile(src, dst + ".part")
        os.rename(dst + ".part", dst)
        os.remove(src)


class Client:
    """One pass over the samples still missing: C requests at a time (a completion of the token ids,
    max_tokens 1), each file waited for through its lock, checked and renamed into place."""

    def __init__(self, a, input_ids):
        import threading
        self.a = a
        self.input_ids = input_ids
        self.url = a.endpoint.rstrip("/") + "/completions"
        self.abort = threading.Event()  # set once C samples in a row failed: the server is likely gone
        self.lock = threading.Lock()
        self.failed_in_row = 0
        self.counts = {"ok": 0, "failed": 0, "request_s": 0.0, "place_s": 0.0}

    def request(self, ids):
        """The server's file for these token ids, with retries (2, 4, 8 s apart) of what may pass."""
        import urllib.error
        body = {"model": self.a.served_model, "prompt": ids, "max_tokens": 1, "return_token_ids": True}
        for attempt in range(self.a.max_retries + 1):
            try:
                answer = http_json(self.url, body, timeout=self.a.request_timeout)
                break
            except urllib.error.HTTPError as e:
                if e.code < 500 or attempt == self.a.max_retries:
                    raise SampleError("HTTP %d: %s" % (e.code, e.read()[:300].decode("utf-8", "replace"))) from None
            except (OSError, ValueError) as e:  # refused, reset, timed out, a cut-off answer
                if attempt == self.a.max_retries:
                    raise SampleError("no answer after %d attempts: %s" % (attempt + 1, e)) from None
            time.sleep(2 ** (attempt + 1))
        choice = (answer.get("choices") or [{}])[0]
        if choice.get("prompt_token_ids") not in (None, ids):
            raise SampleError("the server tokenised the prompt differently (prompt_token_ids differ)")
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise SampleError("no kv_transfer_params.hidden_states_path in the answer: %s" % json.dumps(answer)[:300])
        return path

    def one(self, idx):
        if self.abort.is_set():
            return
        ids = self.input_ids[idx]
        target = os.path.join(self.a.hs_dir, hs_name(idx))
        try:
            t0 = time.monotonic()
            path = self.request(ids)
            t1 = time.monotonic()
            if os.path.exists(path + ".lock"):
                wait_unlocked(path + ".lock", self.a.request_timeout)
            problem = sample_problem(path, ids, self.a.validate_outputs)
            if problem:
                os.remove(path)
                raise SampleError(problem)
            place(path, target)
            if os.path.exists(path + ".lock"):
                os.remove(path + ".lock")
            with self.lock:
                self.counts["request_s"] += t1 - t0
                self.counts["place_s"] += time.monotonic() - t1
                self.counts["ok"] += 1
                self.failed_in_row = 0
        except (SampleError, TimeoutError, OSError) as e:
            print("sample %d failed: %s" % (idx, e), flush=True)
            with self.lock:
                self.counts["failed"] += 1
                self.failed_in_row += 1
                if self.failed_in_row >= self.a.concurrency:
                    self.abort.set()

    def run(self, todo, tick):
        """Every index of todo once (tick() every progress interval while they run); the counts."""
        import concurrent.futures
        t0 = time.monotonic()
        pool = concurrent.futures.ThreadPoolExecutor(self.a.concurrency, thread_name_prefix="extract")
        pending = {pool.submit(self.one, i) for i in todo}
        while pending:
            tick()
            pending = concurrent.futures.wait(pending, timeout=self.a.progress_interval).not_done
        pool.shutdown()
        self.counts["seconds"] = time.monotonic() - t0
        if self.abort.is_set():
            print("pass stopped: %d samples in a row failed; is the server up at %s?" % (
                self.a.concurrency, self.a.endpoint), flush=True)
        return self.counts


# ----------------------------------------------------------------------------- run (detached job)
def job_paths(out):
    return {"progress": os.path.join(out, "progress.json"), "pid": os.path.join(out, "extract.pid"),
            "log": os.path.join(out, "extract.log")}


def job_alive(out):
    """PID of the running job of this output directory, validated by its create time and command line, or None."""
    def looks_like(args):
        return any(x.endswith("hs_extract.py") for x in args) and os.path.abspath(out) in args

    return live_pid(job_paths(out)["pid"], looks_like)


class Job:
    def __init__(self, a, input_ids, started):
        self.a = a
        self.input_ids = input_ids
        self.p = job_paths(a.out)
        self.t0 = started
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
        # running: rewritten every second, worthless after a crash
        atomic_json(self.p["progress"], p, sync=state != "running")
        return p

    def one_pass(self, todo):
        """The client over todo, this shard's samples that have no good file yet; its counts, logged."""
        for i in todo:  # a truncated or unreadable file is made again
            path = os.path.join(self.a.hs_dir, hs_name(i))
            if os.path.exists(path):
                os.remove(path)
        print("=== pass %d: %d of %d samples, %d requests at a time, to %s" % (
            self.passes, len(todo), self.a.end - self.a.start, self.a.concurrency, self.a.endpoint), flush=True)
        counts = Client(self.a, self.input_ids).run(todo, lambda: self.progress("running"))
        print("=== pass %d: %d ok, %d failed in %.1f s (requests %.1f s, lock waits, checks and renames %.1f s, summed over "
              "requests)" % (self.passes, counts["ok"], counts["failed"], counts["seconds"], counts["request_s"],
                             counts["place_s"]), flush=True)
        return counts

    def run(self):
        a = self.a

        def on_term(signum, _frame):
            self.progress("stopped", {"signal": signum})
            # now: the client's threads would hold a normal exit until their requests end
            os._exit(128 + signum)

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        counts, bad = None, self.incomplete()
        while self.passes < a.max_passes:
            self.passes += 1
            counts = self.one_pass(bad)
            bad = self.incomplete()
            if not bad:
                self.progress("extracted", {"last_pass": counts})
                return 0
        self.progress("failed", {"last_pass": counts, "missing_or_bad": bad[:20],
                                 "msg": "samples still missing after %d passes; see %s" % (self.passes, self.p["log"])})
        return 1

    def incomplete(self):
        a = self.a
        mine = self.mine()
        bad = [i for i in range(a.start, a.end) if i not in mine]
        bad += [i for i in sorted(mine) if file_problem(os.path.join(a.hs_dir, hs_name(i)))]
        return sorted(bad)


def cmd_run(a):
    started = time.time()  # the job's elapsed time includes reading the dataset
    running = job_alive(a.out)
    if running:
        emit({"started": False, "running": True, "pid": running})
        return 0
    os.makedirs(a.hs_dir, exist_ok=True)
    input_ids = read_input_ids(a.dataset)
    a.start, a.end = shard_range(len(input_ids), a.world_size, a.rank)
    paths = job_paths(a.out)
    if a.detach:
        # the job leads its own process group: one signal reaches it and whatever it started
        launched = detach(paths["log"], paths["pid"])
        if launched is not None:
            emit(launched)
            return 0
    else:
        write_pidfile(paths["pid"])
    job = Job(a, input_ids, started)
    job.progress("starting")
    rc = job.run()
    if a.detach:
        os._exit(rc)
    return rc


def cmd_status(a):
    paths = job_paths(a.out)
    emit(job_status(paths["progress"], job_alive(a.out), paths["log"], "extraction job"))
    return 0


def cmd_wait(a):
    deadline = time.time() + a.seconds
    while time.time() < deadline and job_alive(a.out):
        time.sleep(0.5)
    return cmd_status(a)


# ----------------------------------------------------------------------------- validate / finish / check
def cmd_validate(a):
    input_ids = read_input_ids(a.dataset)
    start, end = shard_range(len(input_ids), a.world_size, a.rank)
    problems, sizes, tokens = [], {}, 0
    dtype_seen = set()
    for i in range(start, end):
        path = os.path.join(a.hs_dir, hs_name(i))
        if not os.path.exists(path):
            problems.append("sample %d: no file" % i)
            continue
        header, base, why = checked_header(path)
        if not why:
            try:
                shape, dtype, token_ids = sample_tensors(path, header, base)
            except ValueError as e:
                why = str(e)
        if why:
            problems.append("sample %d: %s" % (i, why))
            continue
        ids = input_ids[i]
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

    for name in ("budget", "drafter"):
        p = sub.add_parser(name)
        p.add_argument("--inputs", required=True, help="JSON object: what playbooks/preflight.yml gives")

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
    return {"prepare": cmd_prepare, "plan": cmd_plan, "budget": cmd_budget, "drafter": cmd_drafter, "smoke": cmd_smoke,
            "run": cmd_run, "status": cmd_status, "wait": cmd_wait, "validate": cmd_validate, "finish": cmd_finish, "check": cmd_check,
            "serve-manifest": cmd_serve_manifest, "release": cmd_release}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())

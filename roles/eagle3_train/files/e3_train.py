"""EAGLE-3 training driver (gpuflow.eagle3.eagle3_train).

Runs with the speculators venv's python, around `torchrun ... gpuflow_train_launch.py`
(speculators.train with an event log and, where no accelerator exists, a CPU adapter):

  plan     the preflight that needs files: the extraction MANIFEST.json (complete, its
           prepared dataset unchanged, one hidden-states file per sample; online mode: its
           server answers and this host sees the server's connector path), layer ids and
           sequence length against what was extracted, the token frequency file when a
           draft vocabulary is set, existing checkpoints made from other inputs.
           Prints {"problems": [...], ...}; exit 0 either way.
  dryrun   `--dry-run` into dryrun/checkpoint, then loads it with speculators in that process (config,
           weights, verifier heads): minutes, before hours are spent. Skipped when
           dryrun/DRYRUN.json holds the same fingerprint.
  run      the training job of one node: torchrun with one process per GPU (or CPU
           process). Follows metrics.jsonl into nodes/R/progress.json (step, epoch, loss,
           tokens/s, ETA). Before launching: ends stale workers of this output directory
           and sets aside a checkpoint whose save never finished, so speculators resumes
           from the last complete one. --detach: in its own session. Online mode
           (--watch-dir, the connector path): removes files an interrupted run fetched and
           never consumed, samples the path's high-water mark while training runs, counts
           the requests and prompt tokens the server served (--metrics-url), and appends
           one record per run to nodes/R/online.jsonl (a run killed without a word is
           recorded by the next from what it kept in nodes/R/online-run.json).
           SIGTERM/SIGINT: waits for a checkpoint save in progress to end, then sends
           SIGTERM to the trainer processes only (not torchrun's group, whose DataLoader
           workers would die mid-save), so speculators writes a complete interrupted/.
  status / wait   print this node's progress (wait: block up to --seconds for the job).
  stop     SIGTERM to this node's job (PID validated by its command line), then wait.
  stage    records the checkpoints' identity; links the prepared dataset into data/.
  finish   the drafter: the best (or last) checkpoint's config and weights copied to
           drafter/ and known to load (the trainer's own load of that checkpoint, nodes/0/
           loaded.json, while its weights are unchanged; else loaded here in a child process),
           and MANIFEST.json (steps, final loss, validation metrics, paths, fingerprint, save
           cost) written atomically.
  check    is training complete for this fingerprint? (a rerun after completion does nothing)

Output directory: data/ (links to the prepared dataset, vocabulary mapping), checkpoints/
(speculators' save path), logs/, metrics.jsonl (every logged
step and validation, rank 0), nodes/R/{job.json,progress.json,train.log}, nodes/0/loaded.json, dryrun/,
drafter/, MANIFEST.json.
"""
import argparse
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

from gpuflow_jobs import atomic_json, detach, emit, job_status, live_pid, read_json, write_pidfile
from gpuflow_train_launch import drafter_checkpoint, numbered_checkpoints, weights_identity

SCHEMA = 1
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpuflow_train_launch.py")
DRAFTER_FILES = ("config.json", "config.py", "model.safetensors")
ONLINE_MARK = ".gpuflow-online.json"  # written by hidden_state_extract into the connector path


# ----------------------------------------------------------------------------- small helpers
def node_dir(out, rank):
    return os.path.join(out, "nodes", str(rank))


def read_events(path, offset=0):
    """(events, new offset) of metrics.jsonl from offset; a partly written last line waits."""
    events = []
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return events, offset
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return events, offset + end


def proc_args(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            args = [c.decode(errors="replace") for c in f.read().split(b"\0") if c]
        with open("/proc/%d/stat" % pid) as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None, None
    return (None, None) if rest[0] == "Z" else (args, int(rest[1]))


def trainer_pids(save_path, node_rank, parent=None):
    """Trainer processes of this output directory and node (our launcher with this --save-path
    and --node-rank; other nodes may run on the same host), optionally only the children of
    `parent` (torchrun)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        args, ppid = proc_args(int(d))
        if not args or (parent is not None and ppid != parent):
            continue
        launcher = [i for i, x in enumerate(args) if x.endswith("gpuflow_train_launch.py")]
        if launcher and args[launcher[0] + 3:launcher[0] + 5] == ["--node-rank", str(node_rank)] \
                and "--save-path" in args and "--dry-run" not in args \
                and os.path.abspath(args[args.index("--save-path") + 1]) == os.path.abspath(save_path):
            found.append(int(d))
    return found


def job_alive(out, rank):
    """PID of this node's running job, validated by its create time and command line, or None."""
    def looks_like(args):
        return any(x.endswith("e3_train.py") for x in args) and "run" in args and os.path.abspath(out) in args

    return live_pid(os.path.join(node_dir(out, rank), "job.json"), looks_like)


# ----------------------------------------------------------------------------- checkpoints
def safetensors_complete(path):
    """The file's size matches its header's data offsets (a truncated save fails)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > size - 8:
                return False
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return False
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    return size == 8 + n + end


def unfinished_saves(events):
    """Checkpoint labels whose last save began and never ended."""
    state = {}
    for e in events:
        if e.get("kind") in ("save_begin", "save_end"):
            state[e["checkpoint"]] = e["kind"]
    return sorted(k for k, v in state.items() if v == "save_begin")


def trained_load(out):
    """Where the trainer (rank 0) writes the load of the checkpoint its drafter is made from."""
    return os.path.join(node_dir(out, 0), "loaded.json")


def load_check(python, path, verifier):
    """Load a checkpoint with speculators, in a child process (it reads the verifier's heads)."""
    p = subprocess.run([python, LAUNCHER, "--load-check", path, verifier], capture_output=True, text=True, check=False)
    if p.returncode != 0:
        return {"ok": False, "error": (p.stderr.strip().splitlines() or ["rc %d" % p.returncode])[-1]}
    return dict(json.loads(p.stdout.strip().splitlines()[-1]), ok=True)


# ----------------------------------------------------------------------------- plan
def cmd_plan(a):
    problems = []
    m = read_json(os.path.join(a.hidden_states, "MANIFEST.json"))
    online = (m or {}).get("mode") == "online"
    if not m or m.get("stage") != "hidden_state_extract" or m.get("status") not in ("complete", "serving"):
        why = ("its online server was released after an earlier training; run hidden_state_extract again (the "
               "extract stage) to serve hidden states" if online else "run hidden_state_extract first")
        emit({"problems": ["no complete extraction manifest in %s (%s)" % (a.hidden_states, why)]})
        return 0
    inputs = m["inputs"]
    prepared = inputs["prepared_dataset"]
    prep = read_json(os.path.join(prepared, "PREPARED.json"), {})
    if prep.get("fingerprint") != inputs.get("prepared_fingerprint"):
        problems.append("the prepared dataset %s changed since the hidden states were extracted "
                        "(rerun hidden_state_extract)" % prepared)
    hs_dir = inputs["hidden_states_dir"]
    if online:
        problems += online_problems(m["online"], m["fingerprint"])
        if a.verifier != m["online"]["served_model"]:
            problems.append("online mode: the verifier must be %s, the name the server serves under (speculators asks "
                            "the server for the verifier by name); leave eagle3_train_verifier_path empty"
                            % m["online"]["served_model"])
    else:
        count = sum(1 for n in os.listdir(hs_dir) if n.startswith("hs_") and n.endswith(".safetensors")) \
            if os.path.isdir(hs_dir) else 0
        if count != m["samples"] or prep.get("samples") not in (None, m["samples"]):
            problems.append("%s holds %d hidden-states files for %d samples in the manifest"
                            % (hs_dir, count, m["samples"]))
    aux = inputs["auxiliary_layer_ids"]
    if a.layer_ids and a.layer_ids != aux:
        problems.append("layer ids %s differ from the extracted auxiliary layers %s; train with the extracted "
                        "ones (leave eagle3_train_layer_ids empty) or extract again" % (a.layer_ids, aux))
    if a.verifier != inputs["model_path"]:
        cfg_a = read_json(os.path.join(a.verifier, "config.json"))
        cfg_b = read_json(os.path.join(inputs["model_path"], "config.json"))
        if cfg_a is None or cfg_a != cfg_b:
            problems.append("the verifier %s is not the model the hidden states were extracted from (%s)"
                            % (a.verifier, inputs["model_path"]))
    seq_length = int(inputs["seq_length"])
    longest = int(prep.get("max_seq_len") or seq_length)
    if a.total_seq_len < longest:
        problems.append("total_seq_len %d is shorter than the longest extracted sample (%d tokens, seq_length %d): "
                        "raise eagle3_train_total_seq_len" % (a.total_seq_len, longest, seq_length))
    freq = os.path.join(prepared, "token_freq.pt")
    if a.draft_vocab_size > 0 and not os.path.exists(freq):
        problems.append("draft_vocab_size %d needs the token frequency file %s (prepare-data --no-skip-token-freq); "
                        "without it speculators silently trains over the full vocabulary" % (a.draft_vocab_size, freq))
    verifier_cfg = read_json(os.path.join(a.verifier, "config.json"), {})
    vocab = (verifier_cfg.get("text_config") or verifier_cfg).get("vocab_size", 0)
    if a.draft_vocab_size > vocab > 0:
        problems.append("draft_vocab_size %d is above the verifier's vocabulary (%d)" % (a.draft_vocab_size, vocab))
    run_file = os.path.join(a.out, "checkpoints", "gpuflow-run.json")
    earlier = read_json(run_file)
    if earlier and earlier.get("identity") != a.identity and numbered_checkpoints(os.path.join(a.out, "checkpoints")):
        problems.append("the checkpoints in %s/checkpoints were trained from other inputs or another draft shape "
                        "(%s); resuming them would mix the two. Remove them or choose another "
                        "eagle3_train_output_dir" % (a.out, earlier.get("summary")))
    emit({"problems": problems, "mode": "online" if online else "offline", "layer_ids": aux,
          "hidden_states_dir": hs_dir, "prepared": prepared,
          "samples": m["samples"], "tokens": m["tokens"], "seq_length": seq_length, "max_seq_len": longest,
          "extract_fingerprint": m["fingerprint"], "token_freq": freq if os.path.exists(freq) else None})
    return 0


def online_problems(online, fingerprint):
    """This host must reach the server and see the directory it writes hidden states to."""
    import urllib.request
    problems = []
    try:
        with urllib.request.urlopen(online["endpoint"].rstrip("/") + "/models", timeout=10) as r:
            served = [d["id"] for d in json.load(r)["data"]]
        if online["served_model"] not in served:
            problems.append("the server at %s serves %s, not the extraction server %s"
                            % (online["endpoint"], served, online["served_model"]))
    except (OSError, ValueError, KeyError) as e:
        problems.append("the online extraction server at %s does not answer (%s): run hidden_state_extract "
                        "(the extract stage) first, in online mode" % (online["endpoint"], e))
    mark = read_json(os.path.join(online["connector_path"], ONLINE_MARK), {})
    if mark.get("fingerprint") != fingerprint:
        problems.append("%s is not the directory the server on %s writes hidden states to (its mark is %s): "
                        "online training needs that path on a filesystem both hosts share"
                        % (online["connector_path"], online["host"], "missing" if not mark else "another's"))
    return problems


# ----------------------------------------------------------------------------- dry run
def cmd_dryrun(a):
    d = os.path.join(a.out, "dryrun")
    marker = os.path.join(d, "DRYRUN.json")
    old = read_json(marker, {})
    if old.get("fingerprint") == a.fingerprint and old.get("ok"):
        emit(dict(old, changed=False))
        return 0
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    ckpt = os.path.join(d, "checkpoint")
    loaded_file = os.path.join(d, "loaded.json")
    # the launcher loads what it saved, in the process that has speculators imported already
    argv = [sys.executable, LAUNCHER, "--events", os.path.join(d, "events.jsonl"), "--node-rank", "0",
            "--load-after", loaded_file] + a.train_args + ["--dry-run", "--save-path", ckpt]
    t0 = time.time()
    with open(os.path.join(d, "dryrun.log"), "ab") as log:
        rc = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT)
    result = {"fingerprint": a.fingerprint, "rc": rc, "seconds": round(time.time() - t0, 1), "checkpoint": ckpt}
    if rc != 0:
        result.update(ok=False, error="speculators train --dry-run failed (rc %d); see %s/dryrun.log" % (rc, d))
    else:
        cfg = read_json(os.path.join(ckpt, "config.json"), {})
        loaded = read_json(loaded_file) or {"ok": False, "error": "the dry run wrote no load result (%s)" % loaded_file}
        problems = []
        if cfg.get("eagle_aux_hidden_state_layer_ids") != a.layer_ids:
            problems.append("aux layer ids %s, expected %s" % (cfg.get("eagle_aux_hidden_state_layer_ids"), a.layer_ids))
        if a.draft_vocab_size and cfg.get("draft_vocab_size") != a.draft_vocab_size:
            problems.append("draft vocab %s, expected %d" % (cfg.get("draft_vocab_size"), a.draft_vocab_size))
        if not loaded["ok"]:
            problems.append("does not load: %s" % loaded["error"])
        result.update(ok=not problems, problems=problems, loaded=loaded)
    atomic_json(marker, result)
    emit(dict(result, changed=True))
    return 0


# ----------------------------------------------------------------------------- online mode
def served_counters(url):
    """Requests and prompt tokens the extraction server has served so far (its Prometheus /metrics)."""
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    except (OSError, ValueError):
        return None
    counts = {"requests": 0, "prompt_tokens": 0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = {"vllm:request_success_total": "requests", "vllm:prompt_tokens_total": "prompt_tokens"}.get(name)
        if key:
            counts[key] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def served_between(before, after):
    """Requests and prompt tokens served between two served_counters() readings (None where one is missing)."""
    if not before or not after:
        return {"requests_served": None, "prompt_tokens_served": None}
    return {"requests_served": after["requests"] - before["requests"],
            "prompt_tokens_served": after["prompt_tokens"] - before["prompt_tokens"]}


def hidden_state_files(path):
    """(paths, bytes) of the connector's hidden-states files (and their locks) in path."""
    paths, total = [], 0
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return paths, total
    for e in entries:
        if e.name.endswith((".safetensors", ".safetensors.lock")):
            try:
                total += e.stat().st_size
                paths.append(e.path)
            except FileNotFoundError:
                pass
    return paths, total


class DiskWatch(threading.Thread):
    """Samples the online hidden-states path while training runs: its high-water mark in bytes and files."""

    def __init__(self, path, interval=0.05):
        super().__init__(daemon=True)
        self.path, self.interval = path, interval
        self.peak_bytes = self.peak_files = self.samples = 0
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            paths, total = hidden_state_files(self.path)
            self.peak_bytes = max(self.peak_bytes, total)
            self.peak_files = max(self.peak_files, sum(1 for p in paths if p.endswith(".safetensors")))
            self.samples += 1
            self.done.wait(self.interval)


def remove_hidden_state_files(path):
    removed = 0
    for p in hidden_state_files(path)[0]:
        try:
            os.remove(p)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


# ----------------------------------------------------------------------------- the job
class Job:
    def __init__(self, a):
        self.a = a
        self.dir = node_dir(a.out, a.node_rank)
        self.save_path = os.path.join(a.out, "checkpoints")
        self.metrics = os.path.join(a.out, "metrics.jsonl")
        self.torchrun = None
        self.stop_requested = None
        self.offset = 0
        self.steps = collections.deque(maxlen=50)  # (time, global_step, tokens_per_s) of recent train records
        self.last = {}
        self.t0 = time.time()
        self.watch = None
        self.served_before = None
        self.orphans_removed = 0

    def follow(self):
        events, self.offset = read_events(self.metrics, self.offset)
        for e in events:
            kind = e.get("kind")
            if kind == "train":
                self.last.update(step=e["global_step"] + 1, epoch=e["epoch"], loss=e["train"].get("loss"))
                self.steps.append((e["time"], e["global_step"], (e.get("profile") or {}).get("tokens_per_s")))
            elif kind == "val":
                self.last["val_loss"] = e["val"].get("loss_epoch")
            elif kind == "epoch":
                per_epoch = e["steps_per_epoch"]
                total = per_epoch * e["epochs"]
                self.last.update(steps_per_epoch=per_epoch, epochs=e["epochs"],
                                 total_steps=min(total, e["max_steps"]) if e.get("max_steps") else total)
            elif kind in ("save_begin", "save_end"):
                self.last["saving"] = e["checkpoint"] if kind == "save_begin" else None

    def progress(self, state, extra=None):
        p = dict(self.last, state=state, node_rank=self.a.node_rank, pid=os.getpid(), updated=time.time(),
                 elapsed_s=round(time.time() - self.t0, 1))
        tps = [step[2] for step in self.steps if step[2]]
        p["tokens_per_s"] = round(statistics.median(tps)) if tps else None
        if len(self.steps) >= 2 and p.get("total_steps"):
            (t1, s1), (t2, s2) = self.steps[0][:2], self.steps[-1][:2]
            rate = (s2 - s1) / (t2 - t1) if t2 > t1 else 0
            p["steps_per_s"] = round(rate, 3)
            p["eta_s"] = round((p["total_steps"] - s2 - 1) / rate) if rate > 0 else None
        p.update(extra or {})
        atomic_json(os.path.join(self.dir, "progress.json"), p, sync=state != "running")
        return p

    def prepare(self):
        """Leave speculators a resumable directory: no stale trainer, no half-written checkpoint."""
        stale = trainer_pids(self.save_path, self.a.node_rank)
        for pid in stale:
            os.kill(pid, signal.SIGTERM)
        deadline = time.time() + self.a.stop_timeout
        while time.time() < deadline and trainer_pids(self.save_path, self.a.node_rank):
            time.sleep(0.5)
        for pid in trainer_pids(self.save_path, self.a.node_rank):
            os.kill(pid, signal.SIGKILL)
        set_aside = []
        if self.a.node_rank == 0:
            unfinished = unfinished_saves(read_events(self.metrics)[0])
            for label in unfinished:
                src = os.path.join(self.save_path, label)
                if os.path.isdir(src) and label.isdigit():
                    dst = "%s.incomplete-%d" % (src, int(time.time()))
                    os.rename(src, dst)
                    set_aside.append(dst)
            # marked handled: a later save of the same label starts afresh
            if set_aside:
                with open(self.metrics, "a") as f:
                    for label in unfinished:
                        f.write(json.dumps({"kind": "save_end", "checkpoint": label, "set_aside": True,
                                            "time": time.time()}) + "\n")
        return {"stale_trainers_stopped": stale, "incomplete_checkpoints_set_aside": set_aside}

    def save_online_run(self):
        """What this run has cost so far, kept while it runs: a run killed without a word is still counted."""
        atomic_json(os.path.join(self.dir, "online-run.json"),
                    {"served_before": self.served_before, "peak_bytes": self.watch.peak_bytes,
                     "peak_files": self.watch.peak_files, "orphans_removed": self.orphans_removed,
                     "disk_samples": self.watch.samples}, sync=False)

    def fold_killed_run(self):
        """A run that never wrote its record was killed: record it from what it kept, its requests being what the
        server served between its start and this one's."""
        path = os.path.join(self.dir, "online-run.json")
        killed = read_json(path)
        if not killed:
            return
        record = dict(killed, state="killed", time=time.time(), leftovers_removed=0,
                      **served_between(killed.pop("served_before", None), self.served_before))
        with open(os.path.join(self.dir, "online.jsonl"), "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        os.remove(path)

    def online_record(self, state):
        """What this run cost the extraction server and the disk, appended to online.jsonl (a resumed
        training adds up its runs)."""
        after = served_counters(self.a.metrics_url) if self.a.metrics_url else None
        record = dict({"state": state, "time": time.time(), "peak_bytes": self.watch.peak_bytes,
                       "peak_files": self.watch.peak_files, "disk_samples": self.watch.samples,
                       "orphans_removed": self.orphans_removed,
                       "leftovers_removed": remove_hidden_state_files(self.a.watch_dir)},
                      **served_between(self.served_before, after))
        with open(os.path.join(self.dir, "online.jsonl"), "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        os.remove(os.path.join(self.dir, "online-run.json"))
        return record

    def on_signal(self, signum, _frame):
        self.stop_requested = signum

    def graceful_stop(self):
        """Let a save in progress end, then SIGTERM the trainers (only they) so each saves interrupted/."""
        deadline = time.time() + self.a.stop_timeout
        while self.last.get("saving") and time.time() < deadline:
            time.sleep(0.2)
            self.follow()
        trainers = trainer_pids(self.save_path, self.a.node_rank, parent=self.torchrun.pid)
        for pid in trainers:
            os.kill(pid, signal.SIGTERM)
        try:
            self.torchrun.wait(timeout=max(deadline - time.time(), 10))
        except subprocess.TimeoutExpired:
            self.torchrun.kill()
            self.torchrun.wait()
        return trainers

    def run(self):
        a = self.a
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        prep = self.prepare()
        if a.watch_dir:
            # files an earlier, interrupted run fetched and never consumed
            self.orphans_removed = prep["orphan_hidden_states_removed"] = remove_hidden_state_files(a.watch_dir)
            self.watch = DiskWatch(a.watch_dir)
            self.watch.start()
            self.served_before = served_counters(a.metrics_url) if a.metrics_url else None
            self.fold_killed_run()
            self.save_online_run()
        self.offset = os.path.getsize(self.metrics) if os.path.exists(self.metrics) else 0
        # rank 0 loads the checkpoint the drafter will be made from, once the training ends (finish reads it)
        launcher = [LAUNCHER, "--events", self.metrics, "--node-rank", str(a.node_rank),
                    "--load-after", trained_load(a.out)]
        argv = [sys.executable, "-m", "torch.distributed.run"] + a.torchrun + launcher + a.train_args
        with open(os.path.join(self.dir, "train.log"), "ab") as log:
            log.write(("=== %s: %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), " ".join(argv))).encode())
            log.flush()
            self.torchrun = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.progress("running", prep)
        while self.torchrun.poll() is None:
            if self.stop_requested:
                signalled = self.graceful_stop()
                self.follow()
                return self.end("stopped", {"signal": self.stop_requested, "trainers_signalled": signalled})
            try:
                self.torchrun.wait(timeout=a.progress_interval)
            except subprocess.TimeoutExpired:
                pass
            self.follow()
            self.progress("running")
            if self.watch:
                self.save_online_run()
        self.follow()
        rc = self.torchrun.returncode
        if rc != 0:
            return self.end("failed", {"rc": rc, "msg": "torchrun exited %d; see %s" % (rc, os.path.join(self.dir, "train.log"))})
        return self.end("trained", {"rc": 0})

    def end(self, state, extra):
        interrupted = os.path.join(self.save_path, "interrupted", "model.safetensors")
        if os.path.exists(interrupted):
            extra["interrupted_checkpoint_complete"] = safetensors_complete(interrupted)
        if self.watch:
            self.watch.done.set()
            self.watch.join()
            extra["online"] = self.online_record(state)
        self.progress(state, extra)
        return 0 if state in ("trained", "stopped") else 1


def cmd_run(a):
    os.makedirs(node_dir(a.out, a.node_rank), exist_ok=True)
    running = job_alive(a.out, a.node_rank)
    if running:
        emit({"started": False, "running": True, "pid": running})
        return 0
    job_file = os.path.join(node_dir(a.out, a.node_rank), "job.json")
    if a.detach:
        # the job leads its own process group, torchrun in it (trainers: their own sessions)
        launched = detach(os.path.join(node_dir(a.out, a.node_rank), "job.log"), job_file)
        if launched is not None:
            emit(launched)
            return 0
        os._exit(Job(a).run())
    write_pidfile(job_file)
    return Job(a).run()


def cmd_status(a):
    d = node_dir(a.out, a.node_rank)
    emit(job_status(os.path.join(d, "progress.json"), job_alive(a.out, a.node_rank), os.path.join(d, "train.log"),
                    "training job"))
    return 0


def cmd_wait(a):
    deadline = time.time() + a.seconds
    while time.time() < deadline and job_alive(a.out, a.node_rank):
        time.sleep(0.5)
    return cmd_status(a)


def cmd_stop(a):
    pid = job_alive(a.out, a.node_rank)
    if pid:
        os.kill(pid, signal.SIGTERM)
        deadline = time.time() + a.seconds
        while time.time() < deadline and job_alive(a.out, a.node_rank):
            time.sleep(0.5)
    p = read_json(os.path.join(node_dir(a.out, a.node_rank), "progress.json"), {"state": "absent"})
    p.update(changed=bool(pid), running=job_alive(a.out, a.node_rank) is not None)
    emit(p)
    return 0


# ----------------------------------------------------------------------------- finish / check
def cmd_finish(a):
    save_path = os.path.join(a.out, "checkpoints")
    numbered = numbered_checkpoints(save_path)
    chosen = drafter_checkpoint(save_path)
    if not chosen or not safetensors_complete(os.path.join(chosen, "model.safetensors")):
        raise SystemExit("no complete checkpoint in %s" % save_path)
    drafter = os.path.join(a.out, "drafter")
    tmp = drafter + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in DRAFTER_FILES:  # the weights without optimizer state, readable by the serving user
        shutil.copyfile(os.path.join(chosen, name), os.path.join(tmp, name))
        os.chmod(os.path.join(tmp, name), 0o644)
    os.chmod(tmp, 0o755)
    loaded = read_json(trained_load(a.out), {})
    if loaded.get("checkpoint") != chosen or loaded.get("weights") != weights_identity(chosen):
        # the trainer's own load was of another checkpoint, or never happened (a run that ended otherwise)
        loaded = load_check(sys.executable, tmp, a.verifier)
    if not loaded["ok"]:
        raise SystemExit("the trained drafter %s does not load: %s" % (chosen, loaded["error"]))
    shutil.rmtree(drafter, ignore_errors=True)
    os.rename(tmp, drafter)
    events = read_events(os.path.join(a.out, "metrics.jsonl"))[0]
    train = [e for e in events if e.get("kind") == "train"]
    val = [e for e in events if e.get("kind") == "val"]
    saves, begun = [], {}
    for e in events:
        if e.get("kind") == "save_begin":
            begun[e["checkpoint"]] = e["time"]
        elif e.get("kind") == "save_end" and e["checkpoint"] in begun and not e.get("set_aside"):
            saves.append(e["time"] - begun.pop(e["checkpoint"]))
    tps = [e["profile"]["tokens_per_s"] for e in train if (e.get("profile") or {}).get("tokens_per_s")]
    # the last checkpoint knows how far training went; the drafter is the best one
    state = read_json(os.path.join(save_path, str(numbered[-1]), "training_state.json"), {}) if numbered else {}
    inputs = json.loads(a.inputs)
    runs = read_events(os.path.join(node_dir(a.out, 0), "online.jsonl"))[0]
    if inputs.get("mode") == "online":
        # one record per run of the job: a resumed training adds up what every run cost
        hidden_states = {
            "mode": "online", "peak_bytes": max([r["peak_bytes"] for r in runs] or [0]),
            "peak_files": max([r["peak_files"] for r in runs] or [0]), "runs": len(runs),
            "requests_served": sum(r["requests_served"] or 0 for r in runs),
            "prompt_tokens_served": sum(r["prompt_tokens_served"] or 0 for r in runs),
            # files an interrupted run left, removed before the next run, and any left at a run's end
            "orphans_removed": sum(r.get("orphans_removed", 0) for r in runs),
            "leftovers_removed": sum(r["leftovers_removed"] for r in runs),
        }
    else:
        hidden_states = {"mode": "offline", "peak_bytes": inputs.get("hidden_states_bytes")}
    manifest = {
        "stage": "eagle3_train", "status": "complete", "schema": SCHEMA, "fingerprint": a.fingerprint,
        "hidden_states": hidden_states,
        "inputs": inputs, "drafter": drafter, "checkpoint": chosen,
        "steps": state.get("global_step") or ((train[-1]["global_step"] + 1) if train else 0),
        "final_loss": train[-1]["train"].get("loss") if train else None,
        "validation": val[-1]["val"] if val else {}, "epochs_completed": state.get("epoch", 0) + 1,
        "tokens_per_s_median": round(statistics.median(tps)) if tps else None,
        "checkpoint_save_s_median": round(statistics.median(saves), 3) if saves else None,
        "checkpoint_saves": len(saves), "metrics": os.path.join(a.out, "metrics.jsonl"),
        "loaded": loaded, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_json(os.path.join(a.out, "MANIFEST.json"), manifest)
    emit(dict(manifest, changed=True))
    return 0


def cmd_check(a):
    m = read_json(os.path.join(a.out, "MANIFEST.json"))
    reason = None
    if not m or m.get("status") != "complete":
        reason = "no complete training manifest"
    elif m.get("fingerprint") != a.fingerprint:
        reason = "the inputs or training parameters changed since the manifest was written"
    elif not all(os.path.exists(os.path.join(m["drafter"], n)) for n in DRAFTER_FILES) \
            or not safetensors_complete(os.path.join(m["drafter"], "model.safetensors")):
        reason = "the drafter %s is missing or incomplete" % m["drafter"]
    emit({"complete": reason is None, "reason": reason, "manifest": m if reason is None else None})
    return 0


def cmd_stage(a):
    """Record what the checkpoints are made from (a later plan refuses to resume them from other
    inputs) and link the prepared dataset into data/: speculators caches its vocabulary mapping
    (d2t/t2d) in the data path, and the extraction's output stays untouched."""
    run_file = os.path.join(a.out, "checkpoints", "gpuflow-run.json")
    os.makedirs(os.path.dirname(run_file), exist_ok=True)
    changed = read_json(run_file, {}).get("identity") != a.identity
    if changed:
        atomic_json(run_file, {"identity": a.identity, "summary": json.loads(a.summary)})
        # what online runs of another training cost is not this one's
        for rank_dir in (os.listdir(os.path.join(a.out, "nodes")) if os.path.isdir(os.path.join(a.out, "nodes")) else []):
            for name in ("online.jsonl", "online-run.json"):
                if os.path.exists(os.path.join(a.out, "nodes", rank_dir, name)):
                    os.remove(os.path.join(a.out, "nodes", rank_dir, name))
    data = os.path.join(a.out, "data")
    source = {"prepared": os.path.abspath(a.prepared), "extract_fingerprint": a.extract_fingerprint}
    if read_json(os.path.join(data, "SOURCE.json")) != source:
        shutil.rmtree(data, ignore_errors=True)  # a stale vocabulary mapping goes with it
        os.makedirs(data)
        for name in os.listdir(a.prepared):
            if name != "PREPARED.json":
                os.symlink(os.path.join(source["prepared"], name), os.path.join(data, name))
        atomic_json(os.path.join(data, "SOURCE.json"), source)
        changed = True
    emit({"changed": changed, "data_path": data})
    return 0


# ----------------------------------------------------------------------------- main
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("plan")
    p.add_argument("--hidden-states", required=True, help="the hidden_state_extract output directory")
    p.add_argument("--verifier", required=True)
    p.add_argument("--layer-ids", type=json.loads, default=[])
    p.add_argument("--total-seq-len", type=int, required=True)
    p.add_argument("--draft-vocab-size", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--identity", required=True)

    p = sub.add_parser("dryrun")
    p.add_argument("--out", required=True)
    p.add_argument("--fingerprint", required=True)
    p.add_argument("--verifier", required=True)
    p.add_argument("--layer-ids", type=json.loads, required=True)
    p.add_argument("--draft-vocab-size", type=int, default=0)

    p = sub.add_parser("run")
    p.add_argument("--out", required=True)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--torchrun", type=json.loads, required=True, help="JSON list of torchrun's arguments")
    p.add_argument("--stop-timeout", type=float, default=300)
    p.add_argument("--watch-dir", default="", help="online mode: the connector path, sampled for its high-water "
                   "mark and cleared of unconsumed files before and after the run")
    p.add_argument("--metrics-url", default="", help="online mode: the extraction server's /metrics")
    p.add_argument("--progress-interval", type=float, default=2.0)
    p.add_argument("--detach", action="store_true")

    for name in ("status", "wait", "stop"):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        p.add_argument("--node-rank", type=int, default=0)
        p.add_argument("--seconds", type=float, default=30)

    p = sub.add_parser("finish")
    p.add_argument("--out", required=True)
    p.add_argument("--fingerprint", required=True)
    p.add_argument("--verifier", required=True)
    p.add_argument("--inputs", required=True, help="JSON object")

    p = sub.add_parser("check")
    p.add_argument("--out", required=True)
    p.add_argument("--fingerprint", required=True)

    p = sub.add_parser("stage")
    p.add_argument("--out", required=True)
    p.add_argument("--identity", required=True)
    p.add_argument("--summary", required=True, help="JSON object")
    p.add_argument("--prepared", required=True)
    p.add_argument("--extract-fingerprint", required=True)

    a = ap.parse_args(argv)
    a.train_args = train_args
    return {"plan": cmd_plan, "dryrun": cmd_dryrun, "run": cmd_run, "status": cmd_status, "wait": cmd_wait,
            "stop": cmd_stop, "finish": cmd_finish, "check": cmd_check, "stage": cmd_stage}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())

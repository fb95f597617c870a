"""Verify vllm_server + synthetic_data in the systemd container (after converge + idempotence)."""
import json
import re

UNIT = "vllm-tiny.service"
KEY = "molecule-secret"
BASE = "http://127.0.0.1:8000"
OUT = "/srv/gpuflow/synthetic_data/tiny"


def test_unit_active_and_shaped(host):
    svc = host.service(UNIT)
    assert svc.is_running, host.run("journalctl -u %s -n 80 --no-pager" % UNIT).stdout
    props = svc.systemd_properties
    assert props["Type"] == "exec"
    assert props["KillMode"] == "mixed"
    assert props["KillSignal"] == "15"
    assert props["User"] == "vllm"
    assert props["NoNewPrivileges"] == "yes"
    assert props["DevicePolicy"] == "closed"
    assert props["ProtectSystem"] == "strict"
    assert props["Restart"] == "no"
    assert "api_server" in props["ExecStart"] and "--served-model-name" in props["ExecStart"]
    # the API key lives in the 0600 EnvironmentFile, never in the unit
    assert KEY not in host.file("/etc/systemd/system/" + UNIT).content_string
    env = host.file("/etc/vllm/tiny.env")
    assert env.mode == 0o600 and env.user == "root"
    # GPU device nodes stay reachable: DeviceAllow keeps every NVIDIA device class
    allow = host.check_output("systemctl show -p DeviceAllow %s" % UNIT)  # one line per entry
    for dev in ("/dev/nvidiactl", "/dev/nvidia-uvm", "char-nvidia-frontend", "char-nvidia-uvm"):
        assert dev in allow, allow
    # the service user is a system account
    assert host.user("vllm").uid < 1000


def test_hardening_exposure(host):
    out = host.run("systemd-analyze security --no-pager %s" % UNIT)
    print(out.stdout)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout)
    assert m, out.stdout + out.stderr
    assert float(m.group(1)) <= 5.0, "exposure %s > 5.0" % m.group(1)


def test_process_helper_lists_the_processes_systemd_runs_in_the_unit(host):
    """vllm_proc.py pids --unit (the stop waits on it, the hand-off registers its answer as GPU holders) finds a
    unit's processes by the control group systemd names for it: here, a systemd in a container (cgroupns host)."""
    tree = host.check_output("systemctl status --no-pager --lines 0 %s" % UNIT)
    # the CGroup tree's branches: box drawing on a UTF-8 locale, ASCII otherwise
    in_unit = sorted(int(pid) for pid in re.findall(r"(?:[\u251c\u2514]\u2500|[|`]-)(\d+) ", tree))
    listed = json.loads(host.check_output("python3 /etc/vllm/bin/vllm_proc.py pids --unit %s" % UNIT))["pids"]
    assert len(in_unit) >= 2 and listed == in_unit, tree


def test_listens_on_loopback_only(host):
    assert host.socket("tcp://127.0.0.1:8000").is_listening
    assert not host.socket("tcp://0.0.0.0:8000").is_listening


def _post(host, body, key=KEY):
    cmd = ("python3 -c 'import json,sys,urllib.request as u; "
           "r=u.Request(sys.argv[1], data=sys.argv[2].encode(), headers={\"Content-Type\": \"application/json\", "
           "\"Authorization\": \"Bearer \"+sys.argv[3]}); print(u.urlopen(r, timeout=60).read().decode())' "
           "%s/v1/chat/completions '%s' '%s'" % (BASE, json.dumps(body), key))
    return host.run(cmd)


def test_chat_completion_has_reasoning(host):
    got = []
    for seed in range(5):  # random weights: most sampled answers open with reasoning
        body = {"model": "tiny", "messages": [{"role": "user", "content": "why is the sky blue?"}],
                "max_tokens": 32, "temperature": 1.0, "seed": seed, "min_tokens": 8, "return_token_ids": True}
        r = _post(host, body)
        assert r.rc == 0, r.stderr
        d = json.loads(r.stdout)
        msg = d["choices"][0]["message"]
        assert d["prompt_token_ids"] and d["choices"][0]["token_ids"]
        got.append(bool(msg.get("reasoning")))  # the kimi_k2 parser split the <think> block off
    assert any(got), got


def test_api_key_required(host):
    r = _post(host, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, key="wrong")
    assert r.rc != 0 and "401" in r.stderr


def test_synthetic_data(host):
    m = json.loads(host.file(OUT + "/MANIFEST.json").content_string)
    print(json.dumps({k: m[k] for k in ("status", "counts", "tokens", "reasoning_fraction")}, indent=1))
    assert m["status"] == "complete"
    c = m["counts"]
    assert c["prompts"] == 64 and c["done"] == 64 and c["errors"] == 0 and c["duplicates"] == 0
    assert c["rows"] + c["truncated"] == 64
    assert m["reasoning_fraction"] > 0
    ids = []
    for name in ("rows.jsonl", "truncated.jsonl"):
        for line in host.file("%s/%s" % (OUT, name)).content_string.splitlines():
            row = json.loads(line)
            assert len(row["input_ids"]) == len(row["loss_mask"])
            assert sum(row["loss_mask"]) == row["metadata"]["usage"]["completion_tokens"]
            assert (name == "truncated.jsonl") == (row["metadata"]["finish_reason"] == "length")
            ids.append(row["primary_id"])
    assert len(ids) == len(set(ids)) == 64
    # the client ran as a transient unit (its journal says so), which is gone (collected) now
    assert host.check_output("journalctl -q --no-pager -u gpuflow-datagen-tiny.service | wc -l") != "0"
    assert not host.service("gpuflow-datagen-tiny").is_running

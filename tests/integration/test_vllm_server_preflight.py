"""vllm_server: bad input fails with a clear message before anything changes (no vLLM needed)."""
import json
import os
import socket

import pytest

from vllm_localhost import free_port, role_playbook, run_playbook

pytestmark = pytest.mark.slow


@pytest.fixture
def base(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return {
        "vllm_server_name": "pf",
        "vllm_server_install": False,
        "vllm_server_model_path": str(model),
        "vllm_server_port": free_port(),
        "vllm_server_home": str(tmp_path / "home"),
        "vllm_server_config_dir": str(tmp_path / "etc"),
        "vllm_server_venv": str(tmp_path / "venv"),
        "vllm_server_service_manager": "process",
    }


def expect_failure(tmp_path, extra, needle):
    rc, out, recap = run_playbook(role_playbook(str(tmp_path)), extra, str(tmp_path), check=False, timeout=300)
    assert rc != 0, out[-3000:]
    assert needle in out, out[-3000:]
    assert recap.get("changed") == 0, recap
    assert not os.path.exists(extra["vllm_server_config_dir"]), "something was written before the check"
    assert not os.path.exists(extra["vllm_server_home"])
    return out


def test_missing_model_path(tmp_path, base):
    base["vllm_server_model_path"] = str(tmp_path / "nowhere")
    expect_failure(tmp_path, base, "is not a directory on localhost")


def test_port_taken_by_another_program(tmp_path, base):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", base["vllm_server_port"]))
    s.listen(1)
    try:
        expect_failure(tmp_path, base, "is taken by another program")
    finally:
        s.close()


def test_unknown_profile(tmp_path, base):
    base["vllm_server_profile"] = "benchmark"
    expect_failure(tmp_path, base, "vllm_server_profile must be one of: generate, extract, speculative")


@pytest.mark.parametrize("args", [
    ["bfloat16", "--dtype"],                      # value before any option
    ["--dtype", "bfloat16\n--evil"],              # newline smuggles a line into the unit
    ["--port", "9000"],                           # a flag the role sets itself
    ["--served-model-name=x"],                    # the same, in = form
])
def test_malformed_extra_args(tmp_path, base, args):
    base["vllm_server_extra_args"] = args
    expect_failure(tmp_path, base, "vllm_server_extra_args must be a list of strings")


def test_declared_gpus_missing(tmp_path, base):
    if os.path.exists("/dev/nvidia0"):
        pytest.skip("this host has a GPU")
    base["vllm_server_gpus"] = [0]
    expect_failure(tmp_path, base, "/dev/nvidiaN nodes")


def test_extract_profile_needs_layers(tmp_path, base):
    base["vllm_server_profile"] = "extract"
    expect_failure(tmp_path, base, "profile extract needs vllm_server_extract_layer_ids")


def test_stop_timeout_not_above_shutdown_timeout(tmp_path, base):
    base["vllm_server_shutdown_timeout"] = 60
    base["vllm_server_stop_timeout"] = 60
    expect_failure(tmp_path, base, "stop_timeout above shutdown_timeout (got 60")


# issue 23, finding 3: no variable reaches the remote shell. The port probe runs under --check too, and
# reads the pid file under vllm_server_run_dir (vllm_server_config_dir/run by default).
@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check_mode"])
@pytest.mark.parametrize("variable", ["vllm_server_home", "vllm_server_config_dir", "vllm_server_run_dir"])
def test_injected_path_runs_nothing(tmp_path, base, variable, check_mode):
    # the "/x;id>/tmp/PWNED;#", kept under tmp_path should the role ever create it as a directory
    marker = tmp_path / "PWNED"
    base[variable] = "%s/x;touch %s;#" % (tmp_path, marker)
    rc, out, recap = run_playbook(role_playbook(str(tmp_path)), base, str(tmp_path), check=False, timeout=300,
                                  options=["--check"] if check_mode else [])
    assert not marker.exists(), "a command injected through %s ran" % variable
    assert rc != 0 and "%s must be an absolute path" % variable in out, out[-3000:]
    assert recap.get("changed") == 0 and not os.path.exists(os.path.join(str(tmp_path), "x;touch "))


def test_home_with_a_space_refused_cleanly(tmp_path, base):
    base["vllm_server_home"] = str(tmp_path / "with space")
    expect_failure(tmp_path, base, "vllm_server_home must be an absolute path of letters")


# finding 4: nothing adds a line to the unit or the environment file
@pytest.mark.parametrize("variable,value", [
    ("vllm_server_served_model_name", "tiny\nExecStartPre=/bin/touch /tmp/x"),   # Description=
    ("vllm_server_home", "{tmp}/home\nExecStartPre=/bin/true"),                  # WorkingDirectory=
    ("vllm_server_read_write_paths", ["/data\nReadWritePaths=/"]),               # ReadWritePaths=
    ("vllm_server_device_allow", ["/dev/nvidiactl rw\nDevicePolicy=auto"]),      # DeviceAllow=
    ("vllm_server_env", {"A=1\nLD_PRELOAD": "/tmp/x.so"}),                       # a key that adds a line
    ("vllm_server_env", {"A-B": "1"}),                                            # not a variable name
    ("vllm_server_env", {"A": "1\rLD_PRELOAD=/tmp/x.so"}),                        # a value that adds a line
    ("vllm_server_model_path", "{tmp}/model\nExecStartPre=/bin/true"),          # ExecStart= (the directory exists)
], ids=["description", "working-directory", "read-write-paths", "device-allow", "env-key", "env-key-name",
        "env-value", "exec-start"])
def test_injected_unit_or_env_line_refused(tmp_path, base, variable, value):
    # (paths under tmp_path: a role that let them through would create them)
    if isinstance(value, str):
        value = value.format(tmp=tmp_path)
    if variable == "vllm_server_model_path":
        os.makedirs(value)
    base[variable] = value
    expect_failure(tmp_path, base, variable)


# finding 5: vLLM reads --a_b as --a-b, --a.b.c as a key of the JSON flag --a, argparse any unambiguous prefix
@pytest.mark.parametrize("args", [
    ["--api_key", "S"],
    ["--api-key=S"],
    ["--api-k", "S"],
    ["--tensor_parallel_size", "2"],
    ["-tp=2"],
    ["--kv-transfer-config.kv_connector_extra_config.allow_custom_save_path", "true"],
    ["--speculative_config.num_speculative_tokens", "9"],
    ["--config", "/tmp/more-args.yaml"],
    ["--additional-config", '{"kv_connector_extra_config": {"Allow-Custom-Save-Path": true}}'],
    ["--additional-config", '{"allow\\u005fcustom\\u005fsave\\u005fpath": true}'],
])
def test_managed_flag_bypass_refused(tmp_path, base, args):
    base["vllm_server_extra_args"] = args
    out = expect_failure(tmp_path, base, "vllm_server_extra_args must be a list of strings")
    assert "Got: %s" % json.dumps(args) in " ".join(out.split()), out[-3000:]


def test_plain_extra_args_pass(tmp_path, base):
    base["vllm_server_extra_args"] = ["--dtype", "bfloat16", "--enforce-eager", "--max-num-seqs", "4",
                                      "--model-impl", "vllm", "--compilation-config.level", "0"]
    rc, out, _recap = run_playbook(role_playbook(str(tmp_path)), base, str(tmp_path), check=False, timeout=300,
                                   options=["--tags", "vllm_server_preflight"])
    assert rc == 0, out[-3000:]


# issue 29: vLLM's ZMQ sockets go to vllm_server_home/tmp, not /tmp, as <that>/<36-character uuid>; a unix
# socket path holds 107 bytes at most: a home of 66 characters fits, 67 do not
def test_home_too_long_for_the_socket_paths(tmp_path, base):
    def home(length):
        return str(tmp_path) + "/" + "h" * max(1, length - len(str(tmp_path)) - 1)

    def preflight(extra):
        return run_playbook(role_playbook(str(tmp_path)), extra, str(tmp_path), check=False, timeout=300,
                            options=["--tags", "vllm_server_preflight"])[:2]

    base["vllm_server_home"] = home(67)
    expect_failure(tmp_path, base, "a unix socket path holds at most 107 bytes")
    if len(home(66)) == 66:
        rc, out = preflight(dict(base, vllm_server_home=home(66)))
        assert rc == 0, out[-3000:]
    # or the sockets somewhere shorter that the account can write
    rc, out = preflight(dict(base, vllm_server_env={"VLLM_RPC_BASE_PATH": "/srv/vllm-rpc"}))
    assert rc == 0, out[-3000:]

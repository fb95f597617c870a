"""vllm_server: bad input fails with a clear message before anything changes (no vLLM needed)."""
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

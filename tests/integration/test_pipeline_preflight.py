"""playbooks/preflight.yml: the pipeline's own checks, run against the seed-shaped example inventory
(pointed at this machine) and the local default. Every failing case asserts the check's own message,
and every run asserts that nothing was changed or created."""
import glob
import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from vllm_localhost import cpu_has_amx

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAYBOOK_BIN = os.path.join(REPO, ".venv", "bin", "ansible-playbook")
VENV_PYTHON = os.path.join(REPO, ".venv", "bin", "python")
PREFLIGHT = os.path.join(REPO, "playbooks", "preflight.yml")
SEED = os.path.join(REPO, "inventories", "seed_kimi_k25")
FLEET = os.path.join(REPO, "inventories", "fleet_example")
EXAMPLES = [SEED, FLEET]

# A stand-in for Kimi-K2.5's config.json, written from its published geometry (not the real file):
# a multimodal wrapper whose DeepSeek-V3 text model sits under text_config.
KIMI_K25_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 1,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "max_position_embeddings": 262144,
        "rope_theta": 50000.0,
        "torch_dtype": "bfloat16",
    },
    "vision_config": {"model_type": "moonvit", "hidden_size": 1152},
    "torch_dtype": "bfloat16",
}

# hidden_state_extract's estimate for the seed: 10,000 samples x 2,048 tokens x (4 layers x 7,168 x 2 + 8)
# + 256 per file, plus 5 %; the figure inventories/seed_kimi_k25/group_vars/all.yml writes out.
SEED_BUDGET = 1233300096000


def tree(root):
    """Every path under root (what a run must leave as it found it)."""
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files)


def run_preflight(inventories, extra_vars, tmp_path, check_mode=False, allow_changes=False, skip_tags=None):
    """Run the preflight; return (rc, output). Asserts that no host reported a change (allow_changes: online
    mode across hosts writes and removes its probe)."""
    ev = tmp_path / "extra_vars.json"
    ev.write_text(json.dumps(extra_vars))
    argv = [PLAYBOOK_BIN, PREFLIGHT, "-e", "@%s" % ev]
    for inv in inventories:
        argv += ["-i", inv]
    if check_mode:
        argv.append("--check")
    if skip_tags:
        argv += ["--skip-tags", skip_tags]
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_FORCE_COLOR="0")
    p = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       universal_newlines=True, timeout=300, check=False)
    out = p.stdout
    changed = [int(n) for n in re.findall(r"\bchanged=(\d+)", out)]
    assert changed and (allow_changes or not any(changed)), out[-4000:]
    return p.returncode, out


def unwrapped(out):
    """The output with the YAML callback's line folding undone, so a message reads as one line."""
    return re.sub(r"\s*\n\s+", " ", out)


@pytest.fixture
def seed(tmp_path):
    """The seed inventory pointed at this machine, its model a stand-in in tmp_path; returns
    (run(extra, inventories=None, check_mode=False) -> (rc, output), extra vars)."""
    model = tmp_path / "models" / "Kimi-K2.5"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(KIMI_K25_CONFIG, indent=1))
    work = tmp_path / "data" / "gpuflow"
    extra = {
        "ansible_connection": "local",
        "ansible_host": "127.0.0.1",
        "ansible_python_interpreter": VENV_PYTHON,
        "vllm_server_model_path": str(model),
        "gpuflow_work_dir": str(work),
        "gpuflow_disk_free_bytes": 2 * 10 ** 12,
    }
    runs = tmp_path / "runs"
    runs.mkdir()

    def run(overrides, inventories=None, check_mode=False):
        before = tree(tmp_path / "data") if (tmp_path / "data").exists() else None
        before_models = tree(tmp_path / "models")
        rc, out = run_preflight(inventories or [SEED], dict(extra, **overrides), runs, check_mode)
        after = tree(tmp_path / "data") if (tmp_path / "data").exists() else None
        assert after == before, "the preflight created something under %s" % (tmp_path / "data")
        assert tree(tmp_path / "models") == before_models
        return rc, unwrapped(out)

    return run, extra


def expect_failure(run, overrides, *needles, inventories=None):
    rc, out = run(overrides, inventories)
    assert rc != 0, out[-4000:]
    for needle in needles:
        assert needle in out, "%r not in:\n%s" % (needle, out[-4000:])
    return out


# (a) ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check_mode"])
def test_seed_passes_with_room_for_the_budget(seed, tmp_path, check_mode):
    run = seed[0]
    rc, out = run({}, check_mode=check_mode)
    assert rc == 0, out[-4000:]
    assert not (tmp_path / "data").exists(), "the work dir was created"
    # one line per check that passed
    for line in ["groups: inference 1 host(s), extract 1 host(s), train 1 host(s)",
                 "GPUs on gpu-node-01: serve/extract [0, 1, 2, 3, 4, 5, 6, 7], train [0, 1, 2, 3, 4, 5, 6, 7]",
                 "61 layers, hidden 7168, bfloat16",
                 "layer ids on gpu-node-01: [2, 30, 58] fit num_hidden_layers 61; captured [2, 30, 58, 61]",
                 "sequence length on gpu-node-01: 2048 + 1 fits vllm_server_max_model_len 8192",
                 "disk budget on gpu-node-01: %d bytes" % SEED_BUDGET,
                 "training on gpu-node-01: total_seq_len 8192 >= seq_length 2048"]:
        assert line in out, "%r not in:\n%s" % (line, out[-4000:])


# (b) ---------------------------------------------------------------------------------------------
def test_too_little_disk_names_needed_and_free_bytes(seed):
    run = seed[0]
    expect_failure(run, {"gpuflow_disk_free_bytes": SEED_BUDGET - 1},
                   "disk budget. The hidden states of 10000 samples",
                   "need %d bytes" % SEED_BUDGET,
                   "only %d bytes" % (SEED_BUDGET - 1),
                   "free on gpuflow_disk_free_bytes",
                   "hidden_state_extract_storage fp8")


def test_measured_free_space_of_the_nearest_existing_parent(seed, tmp_path):
    """Without gpuflow_disk_free_bytes the filesystem is measured at the deepest existing parent of the
    hidden states' directory (the work dir does not exist yet), and 1.2 TB does not fit this disk. The
    parent is on another filesystem than / where there is one (/dev/shm), so measuring the wrong path shows."""
    run = seed[0]
    other_fs = os.path.isdir("/dev/shm") and os.stat("/dev/shm").st_dev != os.stat("/").st_dev
    parent = "/dev/shm" if other_fs else str(tmp_path)
    work = os.path.join(parent, "gpuflow-preflight-test-%d" % os.getpid(), "gpuflow")
    st = os.statvfs(parent)
    free = st.f_bavail * st.f_frsize
    if free >= SEED_BUDGET:
        pytest.skip("this disk has room for the seed's hidden states")
    out = expect_failure(run, {"gpuflow_disk_free_bytes": 0, "gpuflow_work_dir": work}, "need %d bytes" % SEED_BUDGET,
                         "are free on the filesystem of %s for %s/hidden_states/default/hs" % (parent, work))
    assert not os.path.exists(os.path.dirname(work)), "the work dir was created"
    measured = int(re.search(r"but only (\d+) bytes", out).group(1))
    assert abs(measured - free) < 256 * 2 ** 20, (measured, free)


def test_budget_planned_from_the_data_manifest(seed, tmp_path):
    """A complete data manifest beats gpuflow_expected_samples: its samples and (smaller) token count."""
    run = seed[0]
    data = tmp_path / "data" / "gpuflow" / "synthetic_data" / "default"
    data.mkdir(parents=True)
    (data / "MANIFEST.json").write_text(json.dumps({
        "stage": "synthetic_data", "status": "complete",
        "counts": {"rows": 90, "truncated": 10}, "tokens": {"prompt": 20000, "completion": 80000, "total": 100000}}))
    # 100 samples, 100,000 tokens (under 100 x 2,048) x 57,352 + 256 x 100, plus 5 %
    needed = int((100000 * 57352 + 256 * 100) * 1.05)
    expect_failure(run, {"gpuflow_disk_free_bytes": needed - 1}, "need %d bytes" % needed,
                   "planned from the data manifest %s/MANIFEST.json" % data)
    rc, out = run({"gpuflow_disk_free_bytes": needed})
    assert rc == 0, out[-4000:]


# (c) ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer_ids,needle", [
    ([2, 30, 61], "layer ids [61] are outside 0..60"),
    ([-1, 30, 58], "layer ids [-1] are outside 0..60"),
    ([30, 2, 58], "must be increasing, without repeats"),
    ([], "must be a non-empty list of integers"),
])
def test_layer_ids_must_fit_the_model(seed, layer_ids, needle):
    run = seed[0]
    expect_failure(run, {"hidden_state_extract_layer_ids": layer_ids}, needle)


def test_train_layer_ids_must_be_the_extracted_ones(seed):
    run = seed[0]
    expect_failure(run, {"eagle3_train_layer_ids": [2, 30, 59]},
                   "eagle3_train_layer_ids [2, 30, 59] differ from hidden_state_extract_layer_ids [2, 30, 58]")


# sequence length -----------------------------------------------------------------------------------
def test_seq_length_must_fit_the_server(seed):
    run = seed[0]
    expect_failure(run, {"vllm_server_max_model_len": 2048},
                   "hidden_state_extract_seq_length 2048 does not fit vllm_server_max_model_len 2048")


def test_train_total_seq_len_must_hold_a_sample(seed):
    run = seed[0]
    expect_failure(run, {"eagle3_train_total_seq_len": 1024},
                   "eagle3_train_total_seq_len 1024 is below hidden_state_extract_seq_length 2048")


# (d) ---------------------------------------------------------------------------------------------
def seed_inventory_with(tmp_path, edit):
    """A copy of the seed inventory whose hosts.yml groups were changed by edit(children); its path."""
    inv = tmp_path / "inventory"
    inv.mkdir()
    with open(os.path.join(SEED, "hosts.yml")) as f:
        hosts = yaml.safe_load(f)
    edit(hosts["all"]["children"])
    (inv / "hosts.yml").write_text(yaml.safe_dump(hosts))
    shutil.copytree(os.path.join(SEED, "group_vars"), str(inv / "group_vars"))
    return str(inv)


def test_empty_train_group(seed, tmp_path):
    run = seed[0]
    inv = seed_inventory_with(tmp_path, lambda groups: groups["train"].update(hosts={}))
    expect_failure(run, {}, "preflight: the inventory group(s) train have no hosts", inventories=[inv])


def test_two_extract_hosts_need_a_shared_work_dir(seed, tmp_path):
    run = seed[0]
    inv = seed_inventory_with(tmp_path, lambda groups: groups["extract"]["hosts"].update({"gpu-node-02": None}))
    expect_failure(run, {}, "preflight: 2 extract hosts without a shared work directory", inventories=[inv])
    rc, out = run({"gpuflow_work_dir_shared": True}, [inv])
    assert "extract hosts without a shared work directory" not in out


# online hidden states --------------------------------------------------------------------------------
DISJOINT = {"vllm_server_gpus": [0, 1, 2, 3], "vllm_server_tensor_parallel_size": 4, "eagle3_train_gpus": [4, 5, 6, 7]}


def test_online_on_one_host_needs_disjoint_gpus(seed):
    run = seed[0]
    expect_failure(run, {"gpuflow_hidden_states": "online"},
                   "online mode keeps the extraction server running while this host trains, but vllm_server_gpus "
                   "[0, 1, 2, 3, 4, 5, 6, 7] and eagle3_train_gpus [0, 1, 2, 3, 4, 5, 6, 7] share")
    # disjoint sets pass, and a disk far too small is no limit when nothing is stored
    rc, out = run(dict(DISJOINT, gpuflow_hidden_states="online", gpuflow_disk_free_bytes=1))
    assert rc == 0, out[-4000:]


def test_auto_lets_a_budget_that_does_not_fit_go_online(seed):
    run = seed[0]
    expect_failure(run, dict(DISJOINT, gpuflow_disk_free_bytes=1), "disk budget. The hidden states of 10000 samples")
    rc, out = run(dict(DISJOINT, gpuflow_hidden_states="auto", gpuflow_disk_free_bytes=1))
    assert rc == 0, out[-4000:]


def test_online_serves_from_one_extract_host(seed, tmp_path):
    run = seed[0]
    inv = seed_inventory_with(tmp_path, lambda groups: groups["extract"]["hosts"].update({"gpu-node-02": None}))
    expect_failure(run, dict(DISJOINT, gpuflow_hidden_states="online", gpuflow_work_dir_shared=True),
                   "serves hidden states to training from one server: put one host in the extract group (it has 2)",
                   inventories=[inv])


def online_across_hosts(tmp_path, train_python, **extract_vars):
    """preflight.yml on serve-host (inference, extract) and train-host (train), both this machine through
    local connections, the local default's tiny-model settings; (rc, output, the connector path)."""
    work = tmp_path / "work"
    hosts = {"all": {
        "children": {"inference": {"hosts": {"serve-host": extract_vars}}, "extract": {"hosts": {"serve-host": None}},
                     "train": {"hosts": {"train-host": {"ansible_python_interpreter": train_python}}}},
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": VENV_PYTHON, "gpuflow_tiny_model": True,
                 "gpuflow_work_dir": str(work), "gpuflow_hidden_states": "online",
                 "hidden_state_extract_layer_ids": [1, 2, 3], "hidden_state_extract_seq_length": 512,
                 "eagle3_train_total_seq_len": 512}}}
    inv = tmp_path / "online.yml"
    inv.write_text(yaml.safe_dump(hosts))
    rc, out = run_preflight([str(inv)], {}, tmp_path, allow_changes=True)
    return rc, unwrapped(out), work / "hidden_states" / "default" / "staging"


def test_online_across_hosts_needs_a_server_other_hosts_reach(tmp_path):
    rc, out = online_across_hosts(tmp_path, VENV_PYTHON)[:2]
    assert rc != 0 and "train-host: online mode trains here against the extraction server on serve-host, which " \
        "listens on 127.0.0.1 only" in out, out[-4000:]


def test_online_across_hosts_needs_the_connector_path_on_both(tmp_path):
    rc, out, staging = online_across_hosts(tmp_path, VENV_PYTHON, hidden_state_extract_listen_host="10.0.0.1")
    assert rc == 0, out[-4000:]
    assert staging.is_dir() and not list(staging.iterdir())  # the probe was written, read and removed
    if os.geteuid() != 0:
        pytest.skip("hiding the work directory from the train host needs a mount namespace (root)")
    # the train host's modules run in their own mount namespace, an empty tmpfs over the work directory:
    # a host that does not share the extract host's filesystem
    hidden = tmp_path / "train-python"
    hidden.write_text("#!/bin/sh\nexec unshare --mount sh -c 'mount -t tmpfs tmpfs \"$0\" && exec \"$@\"' %s %s \"$@\"\n"
                      % (tmp_path / "work", VENV_PYTHON))
    hidden.chmod(0o755)
    rc, out, staging = online_across_hosts(tmp_path, str(hidden), hidden_state_extract_listen_host="10.0.0.1")
    assert rc != 0 and "train-host: online mode fetches each sample's hidden states from files the server on " \
        "serve-host writes to %s, but the probe written there is not visible here" % staging in out, out[-4000:]
    assert not list(staging.iterdir())


# (e) ---------------------------------------------------------------------------------------------
def test_missing_model_path(seed, tmp_path):
    run = seed[0]
    expect_failure(run, {"vllm_server_model_path": str(tmp_path / "models" / "nowhere")},
                   "the model directory %s is not on this host" % (tmp_path / "models" / "nowhere"))


def test_model_dir_without_config(seed, tmp_path):
    run = seed[0]
    expect_failure(run, {"vllm_server_model_path": str(tmp_path / "models")},
                   "%s holds no config.json" % (tmp_path / "models"))


# (f) ---------------------------------------------------------------------------------------------
def test_train_host_without_gpus(seed):
    run = seed[0]
    expect_failure(run, {"eagle3_train_gpus": []}, "eagle3_train_gpus is empty on this train host",
                   "gpuflow_require_gpus is True")


def test_serving_host_without_gpus(seed):
    run = seed[0]
    expect_failure(run, {"vllm_server_gpus": []}, "vllm_server_gpus is empty on this inference host")


def test_no_gpus_needed_when_not_required(seed):
    run = seed[0]
    rc, out = run({"eagle3_train_gpus": [], "vllm_server_gpus": [], "gpuflow_require_gpus": False})
    assert rc == 0, out[-4000:]
    assert "GPUs on gpu-node-01: serve/extract CPU, train CPU (required: False)" in out


# (g) ---------------------------------------------------------------------------------------------
def test_local_default_passes_as_is(tmp_path):
    rc, out = run_preflight([os.path.join(REPO, "inventories", "local", "hosts.yml")], {}, tmp_path)
    assert rc == 0, out[-4000:]
    assert "model: made by the pipeline (gpuflow_tiny_model), not checked" in out


MLA_REFUSAL = "serves beside a drafter only on a CPU with AMX tiles (amx_tile), and this one has none"


@pytest.mark.parametrize("arch", ["kimi_k2", "kimi_k25"])
def test_tiny_kimi_evaluation_on_vllm_cpu_is_refused_up_front_where_the_cpu_has_no_amx(tmp_path, arch):
    """issue 24: the evaluation would serve an MLA target beside its drafter on vllm-cpu, which needs AMX tiles;
    the pipeline's preflight says so before any stage runs and names the way to run the other stages."""
    local = [os.path.join(REPO, "inventories", "local", "hosts.yml")]
    rc, out = run_preflight(local, {"gpuflow_tiny_arch": arch}, tmp_path)
    out = unwrapped(out)
    if cpu_has_amx():
        assert rc == 0, out[-4000:]
    else:
        assert rc != 0 and "the evaluation serves the target (the tiny %s model) beside its drafter" % arch in out
        assert MLA_REFUSAL in out, out[-4000:]
        assert "ANSIBLE_SKIP_TAGS=evaluate make pipeline MODEL=%s" % arch in out, out[-4000:]
    # without the evaluation, every other stage passes its checks here
    rc, out = run_preflight(local, {"gpuflow_tiny_arch": arch}, tmp_path, skip_tags="evaluate")
    assert rc == 0 and MLA_REFUSAL not in unwrapped(out), out[-4000:]


def test_mla_target_from_its_config_on_vllm_cpu_is_refused_where_the_cpu_has_no_amx(seed):
    """The same rule for a model of the inventory's: Kimi-K2.5's config (kv_lora_rank under text_config), vllm-cpu."""
    run = seed[0]
    rc, out = run({"vllm_server_package": "vllm-cpu"})
    if cpu_has_amx():
        assert rc == 0, out[-4000:]
    else:
        assert rc != 0 and MLA_REFUSAL in out and "To run every other stage on this host" in out, out[-4000:]
    rc, out = run({})  # the seed's CUDA vLLM serves MLA beside a drafter anywhere
    assert rc == 0 and MLA_REFUSAL not in out, out[-4000:]


# the example inventories ---------------------------------------------------------------------------
def known_variables():
    """Every role option (meta/argument_specs.yml) and every gpuflow_* variable a playbook documents
    in its header comment ('#   gpuflow_<name>   <what it is>')."""
    known = set()
    roles = os.path.join(REPO, "roles")
    for role in os.listdir(roles):
        spec = os.path.join(roles, role, "meta", "argument_specs.yml")
        if os.path.exists(spec):
            with open(spec) as f:
                for entry in (yaml.safe_load(f)["argument_specs"] or {}).values():
                    known.update((entry or {}).get("options", {}))
    for playbook in glob.glob(os.path.join(REPO, "playbooks", "*.yml")):
        with open(playbook) as f:
            known.update(re.findall(r"^#\s+(gpuflow_[a-z0-9_]+)\s", f.read(), re.M))
    return known


def inventory_variables(inventory):
    """(file, variable) for every variable an inventory sets: hosts.yml vars and host vars, group_vars."""
    found = []

    def walk_group(group, path):
        for host_vars in (group.get("hosts") or {}).values():
            found.extend((path, v) for v in (host_vars or {}))
        found.extend((path, v) for v in (group.get("vars") or {}))
        for child in (group.get("children") or {}).values():
            walk_group(child or {}, path)

    hosts = os.path.join(inventory, "hosts.yml")
    with open(hosts) as f:
        walk_group(yaml.safe_load(f)["all"], hosts)
    for d in ("group_vars", "host_vars"):
        base = os.path.join(inventory, d)
        for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            with open(os.path.join(base, name)) as f:
                found.extend((os.path.join(base, name), v) for v in (yaml.safe_load(f) or {}))
    return found


@pytest.mark.parametrize("inventory", EXAMPLES, ids=os.path.basename)
def test_example_inventories_use_only_known_variables(inventory):
    known = known_variables()
    assert {"gpuflow_disk_free_bytes", "gpuflow_expected_samples", "gpuflow_require_gpus",
            "vllm_server_gpus", "eagle3_train_gpus"} <= known
    found = inventory_variables(inventory)
    assert len(found) > 10
    unknown = [(os.path.relpath(path, REPO), v) for path, v in found if v not in known and not v.startswith("ansible_")]
    assert not unknown, "variables no role or playbook declares (typos?): %s" % unknown

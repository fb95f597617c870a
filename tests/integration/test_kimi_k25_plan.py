"""The real Kimi-K2.5 config, planned (issue 24, item 4): playbooks/preflight.yml on inventories/seed_kimi_k25
against a config.json written from Kimi-K2.5's public values (no weights). Every figure the preflight prints is
checked against its derivation here, and the disk figures against the role's own plan for the same inputs."""
import importlib.util
import json
import os
import re

import pytest

from test_pipeline_preflight import REPO, SEED, VENV_PYTHON, run_preflight, unwrapped

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(REPO, "roles", "hidden_state_extract", "files", "hs_extract.py")
spec = importlib.util.spec_from_file_location("hs_extract", SCRIPT)
H = importlib.util.module_from_spec(spec)
spec.loader.exec_module(H)

# Kimi-K2.5's config.json, its public values: the DeepSeek-V3 text model under text_config, MLA attention,
# 384 routed experts + 1 shared with 8 active, the first layer dense, routed experts INT4 (group 32).
KIMI_K25 = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                 "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "first_k_dense_replace": 1, "num_attention_heads": 64, "num_key_value_heads": 64,
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 262144, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096},
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]},
    },
    "vision_config": {"model_type": "moonvit", "hidden_size": 1152, "patch_size": 14},
    "torch_dtype": "bfloat16",
}

H_, V, VD, L, I_ = 7168, 163840, 32000, 61, 18432
# the drafter speculators 0.9.0 builds: fc 3H -> H; one Llama layer whose q/k/v take 2H, 64 heads of
# head_dim 64 (DeepseekV3Config's qk_rope_head_dim); MLP 3 x H x intermediate; 7 norms of H
TRAINABLE = 3 * H_ * H_ + 3 * (2 * H_ * 64 * 64) + 64 * 64 * H_ + 3 * H_ * I_ + 7 * H_
# frozen: the verifier's embeddings, the draft and the teacher lm_head (draft vocab rows), the final norm
FROZEN = V * H_ + 2 * VD * H_ + H_
# 10,000 samples x 2,048 tokens x (3 aux + 1 final layers x 7168 x 2 bytes + the int64 token id), a 256-byte
# header per file, plus the 5 % margin
BYTES_PER_TOKEN = 4 * H_ * 2 + 8
BUDGET = int((10000 * 2048 * BYTES_PER_TOKEN + 256 * 10000) * 1.05)


@pytest.fixture
def kimi(tmp_path):
    """run(overrides, config=None: KIMI_K25) -> (rc, output) of the preflight on the seed inventory, pointed here."""
    model = tmp_path / "models" / "Kimi-K2.5"
    model.mkdir(parents=True)

    def run(overrides, config=None):
        (model / "config.json").write_text(json.dumps(config or KIMI_K25, indent=1))
        extra = {"ansible_connection": "local", "ansible_host": "127.0.0.1", "ansible_python_interpreter": VENV_PYTHON,
                 "vllm_server_model_path": str(model), "gpuflow_work_dir": str(tmp_path / "data" / "gpuflow"),
                 "gpuflow_disk_free_bytes": 2 * 10 ** 12}
        runs = tmp_path / "runs"
        runs.mkdir(exist_ok=True)
        rc, out = run_preflight([SEED], dict(extra, **overrides), runs)
        return rc, unwrapped(out)

    return run, model


def test_every_figure_of_the_seed(kimi, tmp_path, capsys, monkeypatch):
    run, model = kimi
    rc, out = run({})
    assert rc == 0, out[-4000:]
    assert BYTES_PER_TOKEN == 57352 and BUDGET == 1233300096000  # about 1.23 TB
    shape = H.drafter_shape(H.model_geometry(KIMI_K25, "c"), VD, 3)
    assert (shape["trainable_parameters"], shape["frozen_parameters"]) == (TRAINABLE, FROZEN)
    memory = H.drafter_train_memory(shape, 8192, world_size=8)
    # weights in fp32, fp32 gradients, AdamW's two fp32 moments, DDP's gradient copy, autocast's bf16 copies
    assert memory["states_bytes"] == 4 * (TRAINABLE + FROZEN) + 4 * TRAINABLE + 8 * TRAINABLE + 4 * TRAINABLE \
        + 2 * (TRAINABLE + 2 * VD * H_)
    peak_gib = memory["peak_bytes"] / 2 ** 30
    assert 40 < peak_gib < 60 and memory["peak_bytes"] < 97253 * 2 ** 20
    for line in ["61 layers, hidden 7168, bfloat16",
                 "captured [2, 30, 58, 61] (the speculators default for this model: [2, 30, 58])",
                 "disk budget on gpu-node-01: %d bytes (1233.3 GB, %d bytes per token) for 10000 samples"
                 % (BUDGET, BYTES_PER_TOKEN),
                 "drafter on gpu-node-01: hidden 7168, draft vocab 32000 of 163840, %d trainable parameters; training "
                 "needs about %.1f GiB per GPU (fits the 97253 MiB of gpuflow_gpu_memory_mib)" % (TRAINABLE, peak_gib)]:
        assert line in out, "%r not in:\n%s" % (line, out[-4000:])

    # the role's own plan, for the same model, layers and samples (10,000 of 2,048 tokens), gives the same figures
    monkeypatch.setattr(H, "load_dataset", lambda path: {"seq_len": [2048] * 10000})
    H.main(["plan", "--model", str(model), "--dataset", "unused", "--hs-dir", str(tmp_path / "hs"), "--staging",
            str(tmp_path / "staging"), "--layer-ids", "[2, 30, 58]", "--seq-length", "2048", "--max-model-len", "8192",
            "--mode", "online"])
    plan = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert plan["capture_layer_ids"] == [2, 30, 58, 61]
    assert plan["budget"]["bytes_per_token"] == BYTES_PER_TOKEN and plan["budget"]["needed_with_margin"] == BUDGET


def test_gpus_too_small_for_the_drafter_are_refused(kimi):
    run = kimi[0]
    rc, out = run({"gpuflow_gpu_memory_mib": 40960})
    assert rc != 0, out[-4000:]
    for needle in ["training the drafter (hidden 7168, draft vocab 32000 of 163840) needs about",
                   "but gpuflow_gpu_memory_mib declares 40960 MiB (40.0 GiB) per GPU",
                   "a shorter eagle3_train_total_seq_len (4096:", "eagle3_train_gradient_checkpointing: true",
                   "eagle3_train_fsdp_shard: true, the states split over 8 GPUs"]:
        assert needle in out, "%r not in:\n%s" % (needle, out[-4000:])
    # refused before anything else is planned: the extraction checks come after
    assert "disk budget on" not in out
    # checkpointing as the message says brings it under the same GPUs
    need = float(re.search(r"eagle3_train_gradient_checkpointing: true \(([\d.]+) GiB\)", out).group(1))
    if need < 40:
        rc, out = run({"gpuflow_gpu_memory_mib": 40960, "eagle3_train_gradient_checkpointing": True})
        assert rc == 0, out[-4000:]


def test_layer_ids_past_the_model_are_refused(kimi):
    rc, out = kimi[0]({"hidden_state_extract_layer_ids": [2, 30, 62]})
    assert rc != 0
    assert "layer ids [62] are outside 0..60" in out and "has num_hidden_layers 61 (the final layer 61 is always " \
        "captured, do not list it)" in out, out[-4000:]


def test_a_kimi_k25_config_without_text_config_is_refused(kimi):
    flat = {k: v for k, v in KIMI_K25.items() if k != "text_config"}
    rc, out = kimi[0]({}, config=flat)
    assert rc != 0
    assert "is a multimodal wrapper (model_type kimi_k25, KimiK25ForConditionalGeneration) without text_config" in out
    assert "use the checkpoint's own config.json (Kimi-K2.5 ships one with text_config)" in out, out[-4000:]

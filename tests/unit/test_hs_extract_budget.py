"""hidden_state_extract's shared plan code (roles/hidden_state_extract/files/hs_extract.py): the text model read
through a multimodal wrapper, the layer and sequence rules, the disk formula the role's plan and the pipeline's
preflight (its budget subcommand) both use, and the drafter's training memory against the one measured run."""
import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "roles", "hidden_state_extract", "files", "hs_extract.py")
spec = importlib.util.spec_from_file_location("hs_extract", SCRIPT)
H = importlib.util.module_from_spec(spec)
spec.loader.exec_module(H)

KIMI_TEXT = {"vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
             "num_attention_heads": 64, "num_key_value_heads": 64, "qk_rope_head_dim": 64,
             "max_position_embeddings": 262144, "torch_dtype": "bfloat16"}
KIMI = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": KIMI_TEXT,
        "vision_config": {"model_type": "moonvit"}}


def test_the_text_model_is_read_through_the_wrapper():
    g = H.model_geometry(KIMI, "config.json")
    assert (g["num_hidden_layers"], g["hidden_size"], g["vocab_size"], g["dtype"]) == (61, 7168, 163840, "BF16")
    # transformers' DeepseekV3Config: head_dim is qk_rope_head_dim
    assert g["head_dim"] == 64


def test_a_wrapper_without_text_config_is_refused_naming_the_fix():
    broken = {k: v for k, v in KIMI.items() if k != "text_config"}
    with pytest.raises(ValueError) as e:
        H.model_geometry(broken, "/m/config.json")
    assert "model_type kimi_k25" in str(e.value) and "without text_config" in str(e.value)
    assert "use the checkpoint's own config.json" in str(e.value)


def test_speculators_default_layers_and_the_final_one():
    check = H.capture_check(H.model_geometry(KIMI, "c"), [2, 30, 58], 2048, 8192)
    assert check["default_layer_ids"] == [2, 30, 58]
    assert check["capture_layer_ids"] == [2, 30, 58, 61]
    assert not (check["outside"] or check["unordered"] or check["over_server_max_len"])
    assert H.capture_check(H.model_geometry(KIMI, "c"), [2, 30, 62], 2048, 8192)["outside"] == [62]


def test_the_seed_disk_budget():
    g = H.model_geometry(KIMI, "c")
    b = H.disk_budget("model", g, 4, 10000, 10000 * 2048, 0, 0.05, 0)
    assert b["bytes_per_token"] == 4 * 7168 * 2 + 8 == 57352
    assert b["needed_with_margin"] == int((20480000 * 57352 + 256 * 10000) * 1.05) == 1233300096000


def test_budget_and_plan_give_the_same_figures(tmp_path, capsys, monkeypatch):
    """The preflight's subcommand and the role's plan, for the same model, samples, layers and settings."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(KIMI))
    lengths = [2048] * 100
    monkeypatch.setattr(H, "load_dataset", lambda path: {"seq_len": lengths})
    out = tmp_path / "out"
    common = dict(layer_ids=[2, 30, 58], seq_length=2048, max_model_len=8192, storage="model", margin=0.05,
                  reserve_bytes=0)
    H.main(["plan", "--model", str(model), "--dataset", "unused", "--hs-dir", str(out / "hs"), "--staging",
            str(out / "staging"), "--layer-ids", json.dumps(common["layer_ids"]), "--seq-length", "2048",
            "--max-model-len", "8192", "--margin", "0.05", "--mode", "online"])
    plan = json.loads(capsys.readouterr().out.splitlines()[-1])
    H.main(["budget", "--inputs", json.dumps(dict(
        common, model=str(model), out_dir=str(out), hs_dir=str(out / "hs"), data_manifest="", expected_samples=100,
        include_truncated=True, max_samples=0, world_size=1, rank=0, shared=False, free_bytes=0, mode="online"))])
    budget = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert budget["layers"]["capture_layer_ids"] == plan["capture_layer_ids"] == [2, 30, 58, 61]
    for key in ("bytes_per_token", "predicted_bytes", "needed_with_margin"):
        assert budget["disk"][key] == plan["budget"][key], key
    assert budget["disk"]["tokens"] == plan["shard"]["tokens"] == 204800


def test_training_memory_bounds_the_measured_run():
    """research/h200_training_probe.md: speculators 0.9.0 on one H200, a Llama verifier of hidden 4096
    (intermediate 11008, 32/8 heads of 128, vocab 32,000), draft vocab 8192, total_seq_len 4096, Muon:
    12,664 MiB peak in nvidia-smi. The estimate counts AdamW's two moments (Muon keeps one): at or above
    the measured peak, and by no more than 15 %."""
    probe = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 4, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000}
    shape = H.drafter_shape(H.model_geometry(probe, "c"), 8192, 3)
    peak_mib = H.drafter_train_memory(shape, 4096)["peak_bytes"] / 2 ** 20
    assert 12664 <= peak_mib <= 12664 * 1.15, peak_mib


def test_training_memory_grows_with_the_sequence_and_shrinks_with_sharding():
    shape = H.drafter_shape(H.model_geometry(KIMI, "c"), 32000, 3)
    base = H.drafter_train_memory(shape, 8192, world_size=8)
    assert H.drafter_train_memory(shape, 4096, world_size=8)["peak_bytes"] < base["peak_bytes"]
    assert H.drafter_train_memory(shape, 8192, 8, gradient_checkpointing=True)["peak_bytes"] < base["peak_bytes"]
    assert H.drafter_train_memory(shape, 8192, 8, fsdp_shard=True)["states_bytes"] < base["states_bytes"]

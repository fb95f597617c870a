"""The Kimi builds of tools/make_tiny_model.py (tools/tiny_kimi.py): the checkpoint's layout against the
names vLLM loads, the INT4 packing, the remote-code tokenizer and (kimi_k25) processor.

Building needs torch, which the repo's .venv lacks: the models are built, and the torch checks run, with
the vLLM venv's python (.cache/venvs/vllm, made by `make venvs`), so these tests run in make test's
integration-vllm phase, after the venvs phase. The layout checks read the safetensors headers here, in
plain Python. The processor is loaded in the speculators venv, as `speculators prepare-data` loads it.
"""
import json
import os
import re
import struct
import subprocess
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO, "tools")
VENV_PYTHON = os.path.join(REPO, ".cache", "venvs", "vllm", "bin", "python")
SPECULATORS_PYTHON = os.path.join(REPO, ".cache", "venvs", "speculators", "bin", "python")

pytestmark = [pytest.mark.venvs,
              pytest.mark.skipif(not os.access(VENV_PYTHON, os.X_OK),
                                 reason="needs the vLLM venv (make venvs): torch, transformers, tiktoken")]


def venv_python(code, *args, python=VENV_PYTHON):
    """Run code with the vLLM venv's python (or another), tools/ importable; returns stdout."""
    proc = subprocess.run([python, "-c", textwrap.dedent(code), *args], cwd=TOOLS, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"), stdin=subprocess.DEVNULL,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def make(out, *options):
    proc = subprocess.run([VENV_PYTHON, os.path.join(TOOLS, "make_tiny_model.py"), out, *options],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    built = {}
    for arch, experts in (("kimi_k2", "bf16"), ("kimi_k25", "bf16"), ("kimi_k25", "int4")):
        path = str(root / ("%s-%s" % (arch, experts)))
        make(path, "--arch", arch, "--experts", experts)
        built[arch, experts] = path
    return built


def safetensors_header(path):
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def read_json(path, name):
    with open(os.path.join(path, name)) as f:
        return json.load(f)


def expected_names(cfg, experts, wrapped):
    """The tensor names of Kimi-K2 / Kimi-K2.5 checkpoints that vLLM 0.32 loads, from its own code:
    - text model: vllm/model_executor/models/deepseek_v2.py (DeepseekV2ForCausalLM.load_weights: MLA
      projections q_a_proj/q_a_layernorm/q_b_proj/kv_a_proj_with_mqa/kv_a_layernorm/kv_b_proj/o_proj;
      mlp.gate.weight and mlp.gate.e_score_correction_bias; routed experts mlp.experts.E.{gate,up,down}_proj
      through FusedMoE.make_expert_params_mapping, with compressed-tensors' weight_packed/weight_scale/
      weight_shape (compressed_tensors_moe_wna16.py w13_/w2_ parameters); mlp.shared_experts.*; dense
      layers below first_k_dense_replace with mlp.{gate,up,down}_proj);
    - wrapper: vllm/model_executor/models/kimi_k25.py (language_model.model.* and language_model.lm_head;
      hf_to_vllm_mapper maps mm_projector.proj.0/2 to linear_1/2) and kimi_k25_vit.py
      (MoonViT3dPretrainedModel: patch_embed.proj, patch_embed.pos_emb.weight, encoder.blocks.N.{norm0,
      norm1,wqkv,wo,mlp.fc0,mlp.fc1}, encoder.final_layernorm; KimiK25MultiModalProjector.pre_norm)."""
    text = cfg["text_config"] if wrapped else cfg
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for layer in range(text["num_hidden_layers"]):
        pre = "model.layers.%d." % layer
        names |= {pre + "input_layernorm.weight", pre + "post_attention_layernorm.weight"}
        names |= {pre + "self_attn.%s.weight" % m for m in (
            "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")}
        if layer < text["first_k_dense_replace"]:
            names |= {pre + "mlp.%s.weight" % m for m in ("gate_proj", "up_proj", "down_proj")}
            continue
        names |= {pre + "mlp.gate.weight", pre + "mlp.gate.e_score_correction_bias"}
        names |= {pre + "mlp.shared_experts.%s.weight" % m for m in ("gate_proj", "up_proj", "down_proj")}
        suffixes = ("weight_packed", "weight_scale", "weight_shape") if experts == "int4" else ("weight",)
        names |= {pre + "mlp.experts.%d.%s.%s" % (e, m, s) for e in range(text["n_routed_experts"])
                  for m in ("gate_proj", "up_proj", "down_proj") for s in suffixes}
    if not wrapped:
        return names
    names = {"language_model." + n for n in names}
    names |= {"vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.proj.bias",
              "vision_tower.patch_embed.pos_emb.weight", "vision_tower.encoder.final_layernorm.weight",
              "vision_tower.encoder.final_layernorm.bias", "mm_projector.pre_norm.weight",
              "mm_projector.pre_norm.bias", "mm_projector.proj.0.weight", "mm_projector.proj.0.bias",
              "mm_projector.proj.2.weight", "mm_projector.proj.2.bias"}
    for block in range(cfg["vision_config"]["num_hidden_layers"]):
        names |= {"vision_tower.encoder.blocks.%d.%s.%s" % (block, m, s) for m in (
            "norm0", "norm1", "wqkv", "wo", "mlp.fc0", "mlp.fc1") for s in ("weight", "bias")}
    return names


@pytest.mark.parametrize("arch,experts", [("kimi_k2", "bf16"), ("kimi_k25", "bf16"), ("kimi_k25", "int4")])
def test_tensor_names_are_the_real_checkpoints(models, arch, experts):
    path = models[arch, experts]
    cfg = read_json(path, "config.json")
    header = safetensors_header(os.path.join(path, "model.safetensors"))
    want = expected_names(cfg, experts, wrapped=arch == "kimi_k25")
    assert sorted(set(header) - want) == [] and sorted(want - set(header)) == []


def test_kimi_k25_config_is_the_wrapper_with_kimi_text_model(models):
    cfg = read_json(models["kimi_k25", "int4"], "config.json")
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    text = cfg["text_config"]
    assert text["architectures"] == ["DeepseekV3ForCausalLM"] and text["model_type"] == "deepseek_v3"
    assert {k: text[k] for k in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                 "v_head_dim", "n_shared_experts", "first_k_dense_replace", "scoring_func",
                                 "topk_method")} == {
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "n_shared_experts": 1, "first_k_dense_replace": 1, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc"}
    assert text["rope_scaling"]["type"] == "yarn"
    tokenizer_ids = read_json(models["kimi_k25", "int4"], "tiny_model.json")["special_token_ids"]
    assert cfg["image_token_id"] == tokenizer_ids["<|media_pad|>"]
    media = read_json(models["kimi_k25", "int4"], "preprocessor_config.json")["media_proc_cfg"]
    # the keys vLLM's fused processor (transformers_utils/processors/kimi_k25_vision_fused.py) reads
    assert {"patch_size", "merge_kernel_size", "temporal_merge_kernel_size", "image_mean", "image_std",
            "in_patch_limit", "in_patch_limit_each_frame", "in_patch_limit_video", "patch_limit_on_one_side",
            "fixed_output_tokens"} <= set(media)
    assert "quantization_config" not in read_json(models["kimi_k25", "bf16"], "config.json")["text_config"]


def test_int4_quantization_covers_the_routed_experts_only(models):
    path = models["kimi_k25", "int4"]
    quant = read_json(path, "config.json")["text_config"]["quantization_config"]
    assert (quant["quant_method"], quant["format"]) == ("compressed-tensors", "pack-quantized")
    weights = quant["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"], weights["strategy"]) == (
        4, 32, True, "group")
    ignored = [re.compile(t[3:]) for t in quant["ignore"]]
    header = safetensors_header(os.path.join(path, "model.safetensors"))
    for name, meta in header.items():
        module = name.rsplit(".", 1)[0]
        if ".mlp.experts." in name:
            assert not any(p.match(module) for p in ignored), name
            continue
        if name.endswith(".weight") and len(meta["shape"]) == 2 and "embed_tokens" not in name \
                and not name.endswith("mlp.gate.weight"):
            # every other Linear stays bf16, as in Kimi-K2.5 (the router gate is no Linear to quantize)
            assert any(p.match(module) for p in ignored), name
    for name, meta in header.items():
        if name.endswith("weight_shape"):
            rows, cols = header[name.replace("weight_shape", "weight_packed")]["shape"][0], None
            stem = name[:-len("weight_shape")]
            assert meta["dtype"] == "I32" and meta["shape"] == [2]
            packed, scale = header[stem + "weight_packed"], header[stem + "weight_scale"]
            assert packed["dtype"] == "I32" and scale["dtype"] == "BF16"
            cols = packed["shape"][1] * 8
            assert packed["shape"][0] == rows and scale["shape"] == [rows, cols // 32]


def test_int4_packing_round_trips_and_matches_compressed_tensors(models):
    print(venv_python("""
        import sys, torch
        from safetensors.torch import load_file
        from tiny_kimi import dequantize_int4, pack_int4, quantize_int4, unpack_int4
        torch.manual_seed(0)
        weight = torch.randn(48, 96) * 0.02
        weight[3, 40] = 1.0  # an outlier: its group's scale grows, the others' do not
        quantized, scale = quantize_int4(weight)
        assert quantized.dtype == torch.int8 and int(quantized.min()) >= -8 and int(quantized.max()) <= 7
        assert scale.shape == (48, 3) and scale.dtype == torch.bfloat16
        assert float(scale[3, 1]) > 10 * float(scale[3, 0])
        packed = pack_int4(quantized)
        assert packed.dtype == torch.int32 and packed.shape == (48, 12)
        assert torch.equal(unpack_int4(packed, quantized.shape), quantized)
        every_nibble = torch.arange(-8, 8, dtype=torch.int8).repeat(2, 2)
        assert torch.equal(unpack_int4(pack_int4(every_nibble), every_nibble.shape), every_nibble)
        assert (dequantize_int4(quantized, scale) - weight).abs().max() <= scale.float().max() / 2 + 1e-6
        # compressed-tensors' own packing (0.17 in the vLLM venv; older releases kept it elsewhere)
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
        assert torch.equal(pack_int4(quantized), pack_to_int32(quantized, 4))
        assert torch.equal(unpack_from_int32(packed, 4, quantized.shape), quantized)
        # the two builds are one model: bf16 experts are the INT4 experts dequantized
        int4, bf16 = load_file(sys.argv[1]), load_file(sys.argv[2])
        stem = "language_model.model.layers.2.mlp.experts.5.down_proj."
        shape = tuple(int4[stem + "weight_shape"].tolist())
        values = dequantize_int4(unpack_int4(int4[stem + "weight_packed"], shape), int4[stem + "weight_scale"])
        assert torch.equal(values.to(torch.bfloat16), bf16[stem + "weight"])
        print("ok")
    """, os.path.join(models["kimi_k25", "int4"], "model.safetensors"),
                      os.path.join(models["kimi_k25", "bf16"], "model.safetensors")))


def test_tokenizer_loads_only_through_remote_code(models):
    path = models["kimi_k2", "bf16"]
    assert read_json(path, "tokenizer_config.json")["auto_map"]["AutoTokenizer"][0] == \
        "tokenization_kimi.TikTokenTokenizer"
    out = json.loads(venv_python("""
        import json, sys
        from transformers import AutoTokenizer
        try:
            AutoTokenizer.from_pretrained(sys.argv[1])
            without = "loaded"
        except Exception as e:
            without = type(e).__name__
        tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
        prompt = tok.apply_chat_template([{"role": "user", "content": "is the red cat fast?"}],
                                         tokenize=False, add_generation_prompt=True)
        ids = tok.encode(prompt, add_special_tokens=False)
        names = ["<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>", "<think>", "</think>",
                 "<|tool_calls_section_begin|>", "<|media_pad|>"]
        print(json.dumps({"without": without, "class": type(tok).__name__, "prompt": prompt,
                          "round_trip": tok.decode(ids) == prompt,
                          "ids": dict(zip(names, tok.convert_tokens_to_ids(names)))}))
    """, path).strip().splitlines()[-1])
    assert out["without"] != "loaded" and out["class"] == "TikTokenTokenizer"
    assert out["prompt"].endswith("<|im_user|>user<|im_middle|>is the red cat fast?<|im_end|>"
                                  "<|im_assistant|>assistant<|im_middle|><think>")
    assert out["round_trip"]
    recorded = read_json(path, "tiny_model.json")["special_token_ids"]
    assert out["ids"] == {name: recorded[name] for name in out["ids"]}


def test_processor_is_remote_code_named_by_auto_map(models):
    """As Kimi-K2.5 ships it: preprocessor_config.json names the processor and image processor by auto_map,
    in files of the build, beside media_proc_cfg (which vLLM reads); the image processor needs no torchvision."""
    path = models["kimi_k25", "bf16"]
    config = read_json(path, "preprocessor_config.json")
    assert set(config["auto_map"]) == {"AutoProcessor", "AutoImageProcessor"}
    assert (config["processor_class"], config["image_processor_type"]) == ("KimiK25Processor", "KimiK25VisionProcessor")
    assert config["auto_map"]["AutoProcessor"].endswith(".KimiK25Processor")
    recorded = read_json(path, "tiny_model.json")["files"]
    for ref in config["auto_map"].values():
        module, cls = ref.split(".")
        assert module + ".py" in recorded
        with open(os.path.join(path, module + ".py")) as f:
            source = f.read()
        assert re.search(r"^class %s\(" % cls, source, re.M), ref
        assert "torchvision" not in re.findall(r"^\s*(?:import|from) (\w+)", source, re.M), ref
    assert "media_proc_cfg" in config
    assert not os.path.exists(os.path.join(models["kimi_k2", "bf16"], "preprocessor_config.json"))


@pytest.mark.skipif(not os.access(SPECULATORS_PYTHON, os.X_OK), reason="needs the speculators venv (make venvs)")
def test_processor_loads_only_through_remote_code(models):
    """speculators' load_processor (prepare-data) gets the remote KimiK25Processor with the remote tokenizer,
    with trust_remote_code only: without it, transformers refuses rather than taking its own Kimi-K2.5
    processor (whose image processor needs torchvision, which the speculators venv lacks)."""
    out = json.loads(venv_python("""
        import json, sys
        from PIL import Image
        from speculators.data_generation.preprocessing import load_processor
        try:
            load_processor(sys.argv[1])
            without = "loaded"
        except Exception as e:
            without = "%s: %s" % (type(e).__name__, e)
        proc = load_processor(sys.argv[1], trust_remote_code=True)
        image = Image.new("RGB", (150, 100), (200, 30, 90))
        message = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}
        text = proc.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
        inputs = proc(text=text, vision_chunks=[{"type": "image", "image": image}], return_tensors="np")
        print(json.dumps({
            "without": without, "class": type(proc).__name__, "module": type(proc).__module__,
            "tokenizer": type(proc.tokenizer).__name__, "image_processor": type(proc.image_processor).__name__,
            "media": int((inputs["input_ids"] == proc.tokenizer.convert_tokens_to_ids("<|media_pad|>")).sum()),
            "patches": list(inputs["pixel_values"].shape), "grid": inputs["grid_thws"].tolist(),
            "torchvision": "torchvision" in sys.modules}))
    """, models["kimi_k25", "bf16"], python=SPECULATORS_PYTHON).strip().splitlines()[-1])
    assert out["without"].startswith("ValueError") and "trust_remote_code=True" in out["without"], out["without"]
    assert (out["class"], out["tokenizer"], out["image_processor"]) == (
        "KimiK25Processor", "TikTokenTokenizer", "KimiK25VisionProcessor")
    assert out["module"].startswith("transformers_modules.") and out["module"].endswith(".kimi_k25_processor")
    # 150 x 100 pixels padded to whole tokens (2 x 2 patches of 14 pixels): 168 x 112, 12 x 8 patches, 6 x 4 tokens
    assert (out["patches"], out["grid"], out["media"]) == ([96, 3, 14, 14], [[1, 8, 12]], 24)
    assert not out["torchvision"]


def test_remote_image_processor_matches_vllms(models):
    """The remote image processor cuts an image and a video chunk as vLLM's own (fused) Kimi-K2.5 image
    processor does from the same media_proc_cfg: the same token counts, grids and pixel values."""
    print(venv_python("""
        import sys
        import numpy as np
        from PIL import Image
        from transformers import AutoImageProcessor
        from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor
        remote = AutoImageProcessor.from_pretrained(sys.argv[1], trust_remote_code=True)
        fused = KimiK25FusedVisionProcessor.from_pretrained(sys.argv[1])
        assert type(remote).__name__ == "KimiK25VisionProcessor", type(remote)
        assert remote.num_frames_per_chunk == fused.num_frames_per_chunk == 4
        frame = Image.fromarray(np.random.default_rng(0).integers(0, 256, (301, 517, 3), dtype=np.uint8))
        chunks = [{"type": "image", "image": frame}, {"type": "video_chunk", "video_chunk": [frame] * 4}]
        assert [remote.media_tokens_calculator(c) for c in chunks] == [fused.media_tokens_calculator(c) for c in chunks]
        a, b = remote.preprocess(chunks, return_tensors="pt"), fused.preprocess(chunks, return_tensors="pt")
        assert a["grid_thws"].tolist() == b["grid_thws"].tolist(), (a["grid_thws"], b["grid_thws"])
        assert float((a["pixel_values"] - b["pixel_values"]).abs().max()) < 1e-5
        print("ok")
    """, models["kimi_k25", "bf16"]))


def test_rebuild_is_a_no_op_when_current(tmp_path):
    path = str(tmp_path / "kimi_k2")
    assert make(path, "--arch", "kimi_k2")["changed"] is True
    before = read_json(path, "tiny_model.json")
    assert make(path, "--arch", "kimi_k2")["changed"] is False
    assert read_json(path, "tiny_model.json") == before
    assert make(path, "--arch", "kimi_k2", "--experts", "int4")["changed"] is True

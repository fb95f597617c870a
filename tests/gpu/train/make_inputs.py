"""Build, from nothing, the inputs the eagle3_train role reads: a hidden_state_extract output directory.

Steps (OUT = --out):
  1. tokenizer of tools/make_tiny_model.py (OUT/models/tiny-tok), and a random-weight bf16
     LlamaForCausalLM verifier of the given shape with that tokenizer (OUT/models/verifier);
  2. speculators-format rows (id, input_ids, loss_mask) in OUT/synthetic_data/rows.jsonl
     (truncated.jsonl empty);
  3. `hs_extract.py prepare` (the role's driver, so speculators prepare-data) into
     OUT/hidden_states/prepared;
  4. hidden states from a transformers forward pass in vLLM's convention: slot k of an
     auxiliary layer id k is the input of decoder layer k, the last slot the output of the
     last decoder layer before the final norm; OUT/hidden_states/hs/hs_{i}.safetensors for
     row i of the prepared dataset;
  5. `hs_extract.py validate` and `finish`: shards/rank-0-of-1.json and MANIFEST.json as the
     role writes them (fingerprints computed as the role computes them).
The last stdout line is a JSON summary.

On the GPU machine (the wheels of .whl/ unpacked into /tmp/site, no internet):
  PYTHONPATH=/tmp/site python3 tests/gpu/train/make_inputs.py --out /data/gk
Rehearsal on CPU with a small shape:
  .cache/venvs/speculators/bin/python tests/gpu/train/make_inputs.py --out /tmp/gk --hidden 256 \\
      --intermediate 512 --heads 4 --kv-heads 2 --vocab 2048 --rows 48 --min-len 64 --max-len 200 \\
      --seq-length 512 --self-check
"""
import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
HS_EXTRACT = REPO / "roles" / "hidden_state_extract" / "files" / "hs_extract.py"
MAKE_TINY = REPO / "tools" / "make_tiny_model.py"
MAX_POSITIONS = 4096
SERVER = "transformers forward (tests/gpu/train/make_inputs.py)"


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run_json(*argv):
    """Run a script with this python; its last stdout line, parsed (its stderr passes through)."""
    # the role installs the job library beside hs_extract.py; here it is found through PYTHONPATH
    env = dict(os.environ, PYTHONPATH=str(REPO / "roles" / "detached_job" / "files"))
    p = subprocess.run([sys.executable, *map(str, argv)], check=True, stdout=subprocess.PIPE, text=True, env=env)
    return json.loads(p.stdout.strip().splitlines()[-1])


def sha256_json(obj):
    # the role's `to_json(sort_keys=true) | hash('sha256')`
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def build_verifier(a, tok_dir, out_dir, dev):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False, dtype="bfloat16",
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(a.seed)
    # built in bf16, not cast: .to(bfloat16) would also round RoPE's float32 inv_freq buffer, and the
    # hidden states would no longer be those of the saved checkpoint as vLLM or the trainer load it
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(dev).eval()
    shutil.rmtree(out_dir, ignore_errors=True)
    # safetensors is transformers 5's only format; one shard whatever the size
    model.save_pretrained(out_dir, max_shard_size="1TB")
    for n in os.listdir(tok_dir):
        if n.startswith(("tokenizer", "special_tokens")) or n == "chat_template.jinja":
            shutil.copy2(tok_dir / n, out_dir / n)
    for n in os.listdir(out_dir):
        os.chmod(out_dir / n, 0o644)  # save_pretrained leaves the weights 0600; other users read them
    return model, len(tok)


def write_rows(a, path, top):
    rng = random.Random(a.seed)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for i in range(a.rows):
            n = rng.randint(a.min_len, a.max_len)
            n_prompt = int(n * rng.uniform(0.1, 0.3))
            ids = [rng.randint(12, top) for k in range(n)]
            f.write(json.dumps({"id": "gk-%05d" % i, "input_ids": ids,
                                "loss_mask": [0] * n_prompt + [1] * (n - n_prompt)}) + "\n")
    os.replace(tmp, path)
    path.with_name("truncated.jsonl").write_text("")


def extract(model, ds, aux, hs_dir, dev, self_check):
    """hs_{i}.safetensors for every row i of the prepared dataset; the bytes written."""
    import torch
    from safetensors.torch import save_file

    captured = {}
    # the final norm's input is the last decoder layer's output (hidden_states[-1] is post-norm)
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: captured.update(final=args[0]))
    nbytes, t0 = 0, time.time()
    with torch.inference_mode():
        for i in range(len(ds)):
            ids = torch.as_tensor(ds[i]["input_ids"], dtype=torch.long)
            out = model.model(input_ids=ids[None].to(dev), output_hidden_states=True, use_cache=False)
            final = captured["final"]
            if self_check and i == 0:
                assert len(out.hidden_states) == model.config.num_hidden_layers + 1, len(out.hidden_states)
                assert torch.allclose(model.model.norm(final), out.hidden_states[-1]), "final slot is not pre-norm"
                assert not torch.allclose(final, out.hidden_states[-1]), "hidden_states[-1] is not post-norm"
                log("self-check: final slot == pre-norm output of the last decoder layer")
            hs = torch.stack([out.hidden_states[k] for k in aux] + [final], dim=2)[0]
            path = hs_dir / ("hs_%d.safetensors" % i)
            tmp = path.with_name(path.name + ".tmp")
            save_file({"hidden_states": hs.to(torch.bfloat16).contiguous().cpu(), "token_ids": ids}, str(tmp))
            os.replace(tmp, path)
            nbytes += path.stat().st_size
            if (i + 1) % 32 == 0 or i + 1 == len(ds):
                log("extract: %d/%d rows, %.1f s" % (i + 1, len(ds), time.time() - t0))
    hook.remove()
    return nbytes


def self_check(verifier, prepared, hs_dir, seq_length, aux, hidden, dev):
    """The saved checkpoint, reloaded, gives sample 0's auxiliary slots bit for bit; speculators'
    trainer dataset loads the first and last samples."""
    import torch
    from datasets import load_from_disk
    from hs_connectors.transfer import FileTransfer
    from safetensors.torch import load_file
    from speculators.train.data import ArrowDataset
    from transformers import AutoModelForCausalLM

    ds = load_from_disk(str(prepared))
    ids0 = torch.as_tensor(ds[0]["input_ids"], dtype=torch.long)
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.bfloat16).to(dev).eval()
    with torch.inference_mode():
        out = model.model(input_ids=ids0[None].to(dev), output_hidden_states=True, use_cache=False)
    saved = load_file(hs_dir / "hs_0.safetensors")["hidden_states"]
    for slot, k in enumerate(aux):
        assert torch.equal(saved[:, slot], out.hidden_states[k][0].cpu()), "slot %d differs from the reload" % slot
    log("self-check: the reloaded verifier reproduces sample 0's auxiliary slots")
    sds = ArrowDataset(max_len=seq_length, datapath=str(prepared), transfer=FileTransfer(hs_dir), on_missing="raise")
    for i in (0, len(sds) - 1):
        item = sds[i]
        ids = torch.as_tensor(ds[i]["input_ids"], dtype=torch.long)
        assert isinstance(item, dict), "speculators could not load sample %d: %s" % (i, item)
        assert torch.equal(item["input_ids"], ids), "sample %d: token ids differ" % i
        assert tuple(item["hidden_states"].shape) == (len(ids), len(aux) * hidden), item["hidden_states"].shape
        assert tuple(item["verifier_last_hidden_states"].shape) == (len(ids), hidden)
    log("self-check: speculators' ArrowDataset loads samples 0 and %d" % (len(sds) - 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--layer-ids", type=int, nargs="+", default=[1, 2, 3], help="auxiliary layer ids")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--self-check", action="store_true",
                    help="assert the final slot is pre-norm, the reloaded checkpoint reproduces the files, "
                         "speculators' trainer dataset loads them")
    ap.add_argument("--force", action="store_true", help="rebuild over a complete output")
    ap.add_argument("--no-hidden-states", action="store_true",
                    help="stop after the verifier and the rows (bench/extract_h200.py extracts through the role)")
    a = ap.parse_args()
    aux = a.layer_ids
    if aux != sorted(set(aux)) or aux[0] < 1 or aux[-1] >= a.layers:
        ap.error("--layer-ids must be increasing, distinct and within 1..%d" % (a.layers - 1))
    # the role's plan wants seq_length + 1 positions (the token vLLM generates)
    if not 0 < a.min_len <= a.max_len <= a.seq_length < MAX_POSITIONS:
        ap.error("need 0 < --min-len <= --max-len <= --seq-length < %d" % MAX_POSITIONS)

    out = a.out.resolve()
    tok_dir, verifier = out / "models" / "tiny-tok", out / "models" / "verifier"
    data_dir, hs_root = out / "synthetic_data", out / "hidden_states"
    prepared, hs_dir = hs_root / "prepared", hs_root / "hs"
    if (hs_root / "MANIFEST.json").exists() and not a.force:
        sys.exit("%s exists; pass --force to rebuild" % (hs_root / "MANIFEST.json"))
    (hs_root / "MANIFEST.json").unlink(missing_ok=True)
    for p in (hs_root / "shards", hs_dir):
        shutil.rmtree(p, ignore_errors=True)
    for p in (tok_dir.parent, data_dir, hs_dir):
        p.mkdir(parents=True, exist_ok=True)
    # as the role runs its driver: offline, caches under the output
    os.environ.update(HF_HOME=str(out / ".cache" / "huggingface"), XDG_CACHE_HOME=str(out / ".cache"),
                      HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                      HF_HUB_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1")

    import torch
    from datasets import load_from_disk

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seconds, t = {}, time.time()

    def step(name):
        nonlocal t
        seconds[name] = round(time.time() - t, 2)
        log("step %s: %.2f s" % (name, seconds[name]))
        t = time.time()

    run_json(MAKE_TINY, tok_dir, "--seed", a.seed)
    step("tokenizer")
    model, tok_len = build_verifier(a, tok_dir, verifier, dev)
    step("verifier")
    rows = data_dir / "rows.jsonl"
    write_rows(a, rows, min(tok_len, a.vocab) - 1)
    step("rows")
    if a.no_hidden_states:
        print(json.dumps({"rows": a.rows, "seconds": seconds, "device": str(dev),
                          "paths": {"verifier": str(verifier), "rows": str(rows)}}))
        return 0
    data_files = [str(rows), str(data_dir / "truncated.jsonl")]
    prep = run_json(HS_EXTRACT, "prepare", "--model", verifier, "--output", prepared, "--seq-length", a.seq_length,
                    "--seed", 0, "--max-samples", 0, "--log", hs_root / "prepare.log",
                    *["--data=" + p for p in data_files])
    step("prepare")
    ds = load_from_disk(str(prepared))
    hs_bytes = extract(model, ds, aux, hs_dir, dev, a.self_check)
    step("extract")

    common = {"prepared": prep["fingerprint"], "layer_ids": aux, "storage": "model", "world_size": 1}
    val = run_json(HS_EXTRACT, "validate", "--out", hs_root, "--hs-dir", hs_dir, "--staging", hs_root / "staging",
                   "--dataset", prepared, "--layers", len(aux) + 1, "--hidden", a.hidden, "--dtype", "BF16",
                   "--host", "localhost", "--fingerprint", sha256_json(dict(common, rank=0)),
                   "--world-size", 1, "--rank", 0)
    if not val["valid"] or val["problem_count"]:
        sys.exit("validation failed: %d problem(s): %s" % (val["problem_count"], val["problems"][:5]))
    shard = json.loads((hs_root / "shards" / "rank-0-of-1.json").read_text())
    del shard["sizes"]
    inputs = {"model_path": str(verifier), "data_files": data_files, "include_truncated": True,
              "prepared_dataset": str(prepared), "prepared_fingerprint": prep["fingerprint"],
              "seq_length": a.seq_length, "storage": "model", "auxiliary_layer_ids": aux, "world_size": 1,
              "hidden_states_dir": str(hs_dir), "server": SERVER}
    run_json(HS_EXTRACT, "finish", "--out", hs_root, "--fingerprint", sha256_json(common),
             "--inputs", json.dumps(inputs), "--shards", json.dumps([shard]),
             "--layer-ids", json.dumps(aux + [a.layers]), "--dtype", "BF16")
    step("validate_finish")
    if a.self_check:
        self_check(verifier, prepared, hs_dir, a.seq_length, aux, a.hidden, dev)
        step("self_check")

    print(json.dumps({"rows": len(ds), "tokens": val["tokens"], "seconds": seconds, "hs_bytes": hs_bytes,
                      "device": str(dev), "shape": {"hidden": a.hidden, "layers": a.layers, "vocab": a.vocab},
                      "paths": {"verifier": str(verifier), "rows": str(rows), "prepared": str(prepared),
                                "hs_dir": str(hs_dir), "manifest": str(hs_root / "MANIFEST.json")}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

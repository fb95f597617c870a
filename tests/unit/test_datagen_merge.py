"""datagen.py merge: joins complete shards into one dataset and refuses what would lose or double a prompt."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATAGEN = os.path.join(REPO, "roles", "synthetic_data", "files", "datagen.py")


def make_shard(out, rank, world, ids, status="complete", fingerprint="fp"):
    d = os.path.join(out, "shards", "rank-%d-of-%d" % (rank, world))
    os.makedirs(d)
    with open(os.path.join(d, "rows.jsonl"), "w") as f:
        for pid in ids:
            f.write(json.dumps({"id": pid, "primary_id": pid, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n")
    open(os.path.join(d, "truncated.jsonl"), "w").close()
    manifest = {"status": status, "error_threshold": 0.01, "think_leaks": 0, "reasoning_fraction": 1.0,
                "inputs": {"fingerprint": fingerprint, "endpoint": "http://h%d" % rank},
                "shard": {"rank": rank, "world_size": world, "prompts_in_set": 4},
                "counts": {"prompts": len(ids), "done": len(ids), "rows": len(ids), "truncated": 0, "errors": 0,
                           "duplicates": 0},
                "tokens": {"prompt": len(ids), "completion": 2 * len(ids), "total": 3 * len(ids)},
                "this_run": {"requests": len(ids), "completed": len(ids), "requests_per_s": 1.0,
                             "resume": {"done_before": 0}}}
    with open(os.path.join(d, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f)


def merge(out, world=2):
    p = subprocess.run([sys.executable, DATAGEN, "merge", "--out-dir", out, "--world-size", str(world),
                        "--fingerprint", "fp"], capture_output=True, text=True, check=False)
    return p.returncode, json.loads(p.stdout)


def test_merge_joins_complete_shards_into_one_manifest(tmp_path):
    out = str(tmp_path)
    make_shard(out, 0, 2, ["p0", "p2"])
    make_shard(out, 1, 2, ["p1", "p3"])
    rc, res = merge(out)
    assert rc == 0 and res["merged"]
    rows = [json.loads(line)["primary_id"] for line in open(os.path.join(out, "rows.jsonl"))]
    assert sorted(rows) == ["p0", "p1", "p2", "p3"]
    m = json.load(open(os.path.join(out, "MANIFEST.json")))
    assert m["status"] == "complete" and m["counts"]["done"] == 4 and m["tokens"]["total"] == 12
    assert m["files"]["rows.jsonl"]["lines"] == 4


def test_merge_refuses_a_prompt_answered_twice(tmp_path):
    out = str(tmp_path)
    make_shard(out, 0, 2, ["p0", "p2"])
    make_shard(out, 1, 2, ["p1", "p2"])
    rc, res = merge(out)
    assert rc == 2 and not res["merged"] and "answered twice" in res["problems"][0]
    assert json.load(open(os.path.join(out, "MANIFEST.json")))["status"] == "failed"


def test_merge_refuses_a_missing_or_unfinished_shard_and_writes_nothing(tmp_path):
    out = str(tmp_path)
    make_shard(out, 0, 2, ["p0", "p2"])
    rc, res = merge(out)
    assert rc == 2 and res["problems"] == ["shard 1 of 2 has no manifest"]
    make_shard(out, 1, 2, ["p1", "p3"], status="running")
    rc, res = merge(out)
    assert rc == 2 and res["problems"] == ["shard 1 is running"]
    assert not os.path.exists(os.path.join(out, "MANIFEST.json"))
    assert not os.path.exists(os.path.join(out, "rows.jsonl"))


def test_merge_refuses_shards_from_other_inputs(tmp_path):
    out = str(tmp_path)
    make_shard(out, 0, 2, ["p0", "p2"])
    make_shard(out, 1, 2, ["p1", "p3"], fingerprint="other")
    rc, res = merge(out)
    assert rc == 2 and res["problems"] == ["shard 1 was made from other inputs"]

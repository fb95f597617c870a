"""playbooks/tasks/files/gpuflow_artifacts.py, the checksum tool of the pipeline's transfer step: what the source
lists, what a copy is checked against, and when a host counts as already holding a verified copy."""
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "playbooks", "tasks", "files", "gpuflow_artifacts.py")


def tool(*args):
    p = subprocess.run([sys.executable, TOOL] + list(args), capture_output=True, text=True, check=False)
    return p.returncode, json.loads(p.stdout)


def stage_dir(root):
    d = os.path.join(root, "src")
    os.makedirs(os.path.join(d, "hs"))
    os.makedirs(os.path.join(d, ".cache"))
    for name, data in (("MANIFEST.json", b'{"status": "complete"}'), ("hs/hs_0.safetensors", b"a" * 1000),
                       ("hs/hs_1.safetensors", b"b" * 2000), (".cache/junk", b"not moved")):
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    return d


def copy_of(src, root):
    dst = os.path.join(root, "dst")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".cache", "SHA256SUMS.json"))
    return dst


def test_sums_list_every_file_but_the_excluded_and_reuse_unchanged_ones(tmp_path):
    src = stage_dir(str(tmp_path))
    rc, first = tool("sums", src, "--exclude", ".cache")
    assert rc == 0 and first["files"] == 3 and first["hashed"] == 3 and first["bytes"] == 3000 + 22
    with open(os.path.join(src, "SHA256SUMS.json")) as f:
        assert sorted(json.load(f)["files"]) == ["MANIFEST.json", "hs/hs_0.safetensors", "hs/hs_1.safetensors"]
    rc, again = tool("sums", src, "--exclude", ".cache")
    assert again["hashed"] == 0 and again["changed"] is False
    assert again["manifest_sha256"] == first["manifest_sha256"]


def test_sums_refuse_a_directory_without_the_stage_record(tmp_path):
    src = stage_dir(str(tmp_path))
    rc, out = tool("sums", src, "--manifest", "config.json")
    assert rc == 1 and out["failed"] and "has no config.json" in out["msg"]


def test_verify_finds_a_missing_file_another_size_and_another_sha256(tmp_path):
    src = stage_dir(str(tmp_path))
    tool("sums", src, "--exclude", ".cache")
    sums = os.path.join(src, "SHA256SUMS.json")
    dst = copy_of(src, str(tmp_path))
    assert tool("verify", dst, "--sums", sums)[1]["ok"] is True

    os.unlink(os.path.join(dst, "hs", "hs_0.safetensors"))
    with open(os.path.join(dst, "hs", "hs_1.safetensors"), "r+b") as f:
        f.write(b"B")  # same size, one byte flipped
    with open(os.path.join(dst, "MANIFEST.json"), "ab") as f:
        f.write(b" ")
    rc, out = tool("verify", dst, "--sums", sums)
    assert out["ok"] is False and out["problems"] == 3
    assert out["missing"] == ["hs/hs_0.safetensors"]
    assert out["other_size"] == ["MANIFEST.json"] and out["other_sha256"] == ["hs/hs_1.safetensors"]


def test_current_only_after_a_recorded_copy_of_the_same_manifest_with_every_file(tmp_path):
    src = stage_dir(str(tmp_path))
    tool("sums", src, "--exclude", ".cache")
    sums = os.path.join(src, "SHA256SUMS.json")
    dst = copy_of(src, str(tmp_path))
    assert tool("current", dst, "--sums", sums)[1]["current"] is False  # not recorded yet
    rc, rec = tool("record", dst, "--sums", sums, "--source", "node-a", "--seconds", "1.5")
    assert rec["verified"] and rec["source"] == "node-a" and rec["files"] == 3
    assert tool("current", dst, "--sums", sums)[1]["current"] is True

    os.unlink(os.path.join(dst, "hs", "hs_1.safetensors"))
    rc, out = tool("current", dst, "--sums", sums)
    assert out["current"] is False and "1 file(s) missing or changed" in out["reason"]

    shutil.copy(os.path.join(src, "hs", "hs_1.safetensors"), os.path.join(dst, "hs"))
    with open(os.path.join(src, "MANIFEST.json"), "w") as f:
        f.write('{"status": "complete", "run": 2}')
    tool("sums", src, "--exclude", ".cache")
    assert tool("current", dst, "--sums", sums)[1]["current"] is False  # the source has a new manifest

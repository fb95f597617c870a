"""playbooks/tasks/files/gpuflow_artifacts.py, the checksum tool of the pipeline's transfer step: what the source
lists, what a copy is checked against, and when a host counts as already holding a verified copy."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

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


# ----------------------------------------------------------------- a verified transfer ships only what it verified
def outside_secret(root):
    """A root-only file and directory outside the stage's directory, as /etc/shadow and /root/.ssh are."""
    secret = os.path.join(root, "root-only")
    os.makedirs(os.path.join(secret, ".ssh"))
    with open(os.path.join(secret, "shadow"), "wb") as f:
        f.write(b"root:$6$secret-hash:19000:0:99999:7:::\n")
    with open(os.path.join(secret, ".ssh", "id_ed25519"), "wb") as f:
        f.write(b"-----BEGIN OPENSSH PRIVATE KEY-----\n")
    for path in (os.path.join(secret, "shadow"), os.path.join(secret, ".ssh", "id_ed25519")):
        os.chmod(path, 0o600)
    return secret


def sha_of(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write(path, data=b"x"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("plant", ["extra.py", "hs/extra.safetensors", "sub/weights.tmp", "hs/part.tmp"])
def test_verify_refuses_a_file_the_list_does_not_name(tmp_path, plant):
    src = stage_dir(str(tmp_path))
    tool("sums", src, "--exclude", ".cache")
    dst = copy_of(src, str(tmp_path))
    write(os.path.join(dst, plant), b"import os; os.system('id')\n")
    rc, out = tool("verify", dst, "--sums", os.path.join(src, "SHA256SUMS.json"))
    assert rc == 0 and out["ok"] is False and out["unlisted"] == [plant] and out["problems"] == 1


@pytest.mark.parametrize("link, target", [("ckpt", ".ssh"), ("hs/key", "shadow"), ("hs/hs_0.safetensors", "shadow")])
def test_verify_refuses_a_symlink_out_of_the_directory(tmp_path, link, target):
    secret = outside_secret(str(tmp_path))
    src = stage_dir(str(tmp_path))
    tool("sums", src, "--exclude", ".cache")
    dst = copy_of(src, str(tmp_path))
    if os.path.exists(os.path.join(dst, link)):
        os.unlink(os.path.join(dst, link))  # a listed file replaced by a link
    os.symlink(os.path.join(secret, target), os.path.join(dst, link))
    rc, out = tool("verify", dst, "--sums", os.path.join(src, "SHA256SUMS.json"))
    assert rc == 0 and out["ok"] is False and out["not_regular"] == [link]


def test_verify_refuses_a_symlink_that_stays_inside_too(tmp_path):
    # a link means something else on every host: the copy holds regular files only
    src = stage_dir(str(tmp_path))
    tool("sums", src, "--exclude", ".cache")
    dst = copy_of(src, str(tmp_path))
    os.symlink("hs_0.safetensors", os.path.join(dst, "hs", "alias.safetensors"))
    os.symlink("hs", os.path.join(dst, "hs2"))
    out = tool("verify", dst, "--sums", os.path.join(src, "SHA256SUMS.json"))[1]
    assert out["ok"] is False and out["not_regular"] == ["hs/alias.safetensors", "hs2"]


@pytest.mark.parametrize("link, target", [("key", "shadow"), ("hs/key", "shadow"), ("ckpt", ".ssh")])
def test_sums_refuse_a_symlink_and_never_record_what_it_points_to(tmp_path, link, target):
    secret = outside_secret(str(tmp_path))
    src = stage_dir(str(tmp_path))
    os.symlink(os.path.join(secret, target), os.path.join(src, link))
    rc, out = tool("sums", src, "--exclude", ".cache")
    assert rc == 1 and out["failed"] and link in out["msg"] and "regular files only" in out["msg"]
    assert not os.path.exists(os.path.join(src, "SHA256SUMS.json"))
    leaked = sha_of(os.path.join(secret, "shadow"))
    for dirpath, dummy, names in os.walk(src):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                assert leaked.encode() not in f.read()


def test_sums_leave_tmp_files_and_excluded_links_behind(tmp_path):
    secret = outside_secret(str(tmp_path))
    src = stage_dir(str(tmp_path))
    write(os.path.join(src, "hs", "hs_2.safetensors.tmp"))  # a write in progress
    os.symlink(os.path.join(secret, "shadow"), os.path.join(src, "hs", "swap.tmp"))
    os.symlink(os.path.join(secret, ".ssh"), os.path.join(src, ".cache", "link"))  # inside an excluded name
    rc, out = tool("sums", src, "--exclude", ".cache")
    assert rc == 0 and out["files"] == 3


def test_pack_ships_exactly_the_listed_files_and_a_copy_of_it_verifies(tmp_path):
    secret = outside_secret(str(tmp_path))
    src = stage_dir(str(tmp_path))
    write(os.path.join(src, "hs", "hs_2.safetensors.tmp"))
    tool("sums", src, "--exclude", ".cache")
    sums = os.path.join(src, "SHA256SUMS.json")
    # planted after the list was made: none of it may travel
    write(os.path.join(src, "extra.py"))
    write(os.path.join(src, "sub", "weights.tmp"))
    os.symlink(os.path.join(secret, ".ssh"), os.path.join(src, "ckpt"))
    archive = os.path.join(str(tmp_path), "src.transfer.tar")
    rc, out = tool("pack", src, "--sums", sums, "--file", archive)
    assert rc == 0 and out["files"] == 3
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
    assert sorted(m.name for m in members if m.isreg()) == ["MANIFEST.json", "hs/hs_0.safetensors", "hs/hs_1.safetensors"]
    assert sorted(m.name for m in members if not m.isreg()) == [".", "hs"] and all(m.isdir() for m in members if not m.isreg())
    incoming = os.path.join(str(tmp_path), "incoming")
    os.makedirs(incoming)
    subprocess.run(["tar", "--extract", "--file", archive, "--directory", incoming], check=True)
    assert tool("verify", incoming, "--sums", sums)[1]["ok"] is True


def test_an_unpacked_copy_keeps_the_source_directories_modes_over_a_private_incoming_directory(tmp_path):
    src = stage_dir(str(tmp_path))
    os.chmod(src, 0o755)
    os.chmod(os.path.join(src, "hs"), 0o750)
    tool("sums", src, "--exclude", ".cache")
    archive = os.path.join(str(tmp_path), "src.transfer.tar")
    assert tool("pack", src, "--sums", os.path.join(src, "SHA256SUMS.json"), "--file", archive)[0] == 0
    incoming = os.path.join(str(tmp_path), "incoming")
    os.makedirs(incoming, mode=0o700)  # as transfer.yml makes DIR.incoming, before it becomes DIR
    subprocess.run(["tar", "--extract", "--file", archive, "--directory", incoming], check=True)
    assert oct(os.stat(incoming).st_mode & 0o777) == oct(0o755)
    assert oct(os.stat(os.path.join(incoming, "hs")).st_mode & 0o777) == oct(0o750)


def test_records_are_not_written_through_a_link_planted_at_a_predictable_name(tmp_path):
    secret = outside_secret(str(tmp_path))
    src = stage_dir(str(tmp_path))
    for name in ("SHA256SUMS.json.tmp", "TRANSFER.json.tmp"):
        os.symlink(os.path.join(secret, "shadow"), os.path.join(src, name))
    before = sha_of(os.path.join(secret, "shadow"))
    assert tool("sums", src, "--exclude", ".cache")[0] == 0
    assert tool("record", src, "--sums", os.path.join(src, "SHA256SUMS.json"), "--source", "a", "--seconds", "1")[0] == 0
    assert sha_of(os.path.join(secret, "shadow")) == before
    with open(os.path.join(src, "TRANSFER.json")) as f:
        assert json.load(f)["verified"] is True


@pytest.mark.parametrize("swapped", ["file", "directory"])
def test_pack_refuses_a_listed_file_swapped_for_a_symlink_after_the_list(tmp_path, swapped):
    secret = outside_secret(str(tmp_path))
    src = stage_dir(str(tmp_path))
    tool("sums", src, "--exclude", ".cache")
    if swapped == "file":
        os.unlink(os.path.join(src, "hs", "hs_0.safetensors"))
        os.symlink(os.path.join(secret, "shadow"), os.path.join(src, "hs", "hs_0.safetensors"))
    else:  # hs/ elsewhere, with root-only files of the listed names
        os.makedirs(os.path.join(secret, "hs"))
        for name in ("hs_0.safetensors", "hs_1.safetensors"):
            shutil.copy(os.path.join(secret, "shadow"), os.path.join(secret, "hs", name))
        shutil.rmtree(os.path.join(src, "hs"))
        os.symlink(os.path.join(secret, "hs"), os.path.join(src, "hs"))
    archive = os.path.join(str(tmp_path), "src.transfer.tar")
    rc, out = tool("pack", src, "--sums", os.path.join(src, "SHA256SUMS.json"), "--file", archive)
    assert rc == 1 and out["failed"] and not os.path.exists(archive)
    assert [n for n in os.listdir(str(tmp_path)) if n.endswith(".tmp")] == []


@pytest.mark.parametrize("content", [
    "not json {", "[]", '{"files": {}}', '{"files": [], "bytes": 0, "manifest_sha256": "%s"}' % ("0" * 64),
    '{"files": {"a": {"size": 1}}, "bytes": 1, "manifest_sha256": "%s"}' % ("0" * 64),
    '{"files": {"../../etc/passwd": {"size": 1, "sha256": "%s"}}, "bytes": 1, "manifest_sha256": "%s"}'
    % ("0" * 64, "0" * 64),
    '{"files": {"/etc/passwd": {"size": 1, "sha256": "%s"}}, "bytes": 1, "manifest_sha256": "%s"}'
    % ("0" * 64, "0" * 64),
], ids=["not-json", "a-list", "no-bytes", "files-a-list", "no-sha256", "dotdot-name", "absolute-name"])
@pytest.mark.parametrize("cmd", ["verify", "current", "record", "pack"])
def test_a_malformed_sums_file_is_a_clean_failure(tmp_path, content, cmd):
    src = stage_dir(str(tmp_path))
    sums = os.path.join(str(tmp_path), "bad-SHA256SUMS.json")
    with open(sums, "w") as f:
        f.write(content)
    extra = {"record": ["--source", "node-a", "--seconds", "1"],
             "pack": ["--file", os.path.join(str(tmp_path), "x.tar")]}.get(cmd, [])
    p = subprocess.run([sys.executable, TOOL, cmd, src, "--sums", sums] + extra, capture_output=True, text=True,
                       check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    out = json.loads(p.stdout)
    assert out["failed"] is True and "bad-SHA256SUMS.json" in out["msg"] and "\n" not in out["msg"]
    if cmd == "record":
        assert sorted(os.listdir(src)) == [".cache", "MANIFEST.json", "hs"]  # nothing written

"""After converge, idempotence and the side effect: what each receiving container holds, compared file by
file with the container that made it (sha256 computed on each side by sha256sum, not by the tool). The
dataset's source was corrupted on purpose by the side effect, so its files are compared only through the
refusal test."""
import glob
import json
import os
import tempfile

import pytest
import testinfra

WORK = "/var/lib/gpuflow"
MOVES = [  # what, source, receiver, directory, top-level names that stay behind
    ("dataset", "xfer-inference-1", "xfer-extract-1", WORK + "/synthetic_data/default", []),
    ("hidden_states", "xfer-extract-1", "xfer-train-1", WORK + "/hidden_states/default", [".cache", "staging"]),
    ("drafter", "xfer-train-1", "xfer-inference-1", WORK + "/train/default/drafter", []),
]
OWN_RECORDS = ("SHA256SUMS.json", "TRANSFER.json")


def container(name):
    return testinfra.get_host("ansible://" + name, ansible_inventory=os.environ["MOLECULE_INVENTORY_FILE"])


def sha256_of_files(host, directory):
    """{relative path: sha256} of every file under directory, the transfer's own records left out."""
    out = host.check_output("cd %s && find . -type f -print0 | sort -z | xargs -0 sha256sum" % directory)
    sums = {}
    for line in out.splitlines():
        digest, path = line.split(None, 1)
        path = path[2:]  # "./"
        if path not in OWN_RECORDS:
            sums[path] = digest
    return sums


@pytest.mark.parametrize("what, source, receiver, directory, excluded", MOVES[1:], ids=[m[0] for m in MOVES[1:]])
def test_every_file_arrived_with_the_source_sha256(what, source, receiver, directory, excluded):
    made = sha256_of_files(container(source), directory)
    # excluded names and writes in progress (*.tmp) stay behind
    expected = {p: d for p, d in made.items() if p.split("/")[0] not in excluded and not p.endswith(".tmp")}
    assert len(expected) >= 2
    if excluded:  # the source had files that stay behind
        assert len(expected) < len(made)
    assert sha256_of_files(container(receiver), directory) == expected


@pytest.mark.parametrize("what, source, receiver, directory, excluded", MOVES, ids=[m[0] for m in MOVES])
def test_transfer_record_names_the_source_and_its_record(what, source, receiver, directory, excluded):
    record = json.loads(container(receiver).file(directory + "/TRANSFER.json").content_string)
    manifest = "config.json" if what == "drafter" else "MANIFEST.json"
    source_digest = container(source).check_output("sha256sum %s/%s" % (directory, manifest)).split()[0]
    assert record["source"] == source and record["verified"] is True
    assert record["manifest_sha256"] == source_digest


def test_copy_that_differs_from_the_source_is_refused_and_replaces_nothing():
    extract = container("xfer-extract-1")
    refusal = extract.file(WORK + "/dataset-refused.txt").content_string
    assert "differs from" in refusal and "other sha256 ['rows.jsonl']" in refusal
    # the directory is the earlier verified copy, still without the file taken from it
    directory = WORK + "/synthetic_data/default"
    assert not extract.file(directory + "/truncated.jsonl").exists
    assert extract.file(directory + "/TRANSFER.json").exists
    # the refused copy stays beside it for a look
    assert extract.file(directory + ".incoming/rows.jsonl").exists


def test_a_write_in_progress_stayed_behind():
    directory = WORK + "/train/default/drafter"
    assert container("xfer-train-1").file(directory + "/sub/weights.tmp").exists
    assert not container("xfer-inference-1").file(directory + "/sub").exists


def test_a_source_with_links_out_of_it_is_refused_and_the_copy_kept():
    train = container("xfer-train-1")
    refusal = train.file(WORK + "/hidden_states-refused.txt").content_string
    assert "regular files only" in refusal and "ckpt" in refusal and "hs/key" in refusal
    directory = WORK + "/hidden_states/default"
    # no link arrived, and the verified copy is still there (its files: test_every_file_arrived...)
    assert train.check_output("find %s -type l" % directory) == ""
    assert json.loads(train.file(directory + "/TRANSFER.json").content_string)["verified"] is True
    listed = json.loads(container("xfer-extract-1").file(directory + "/SHA256SUMS.json").content_string)["files"]
    assert "hs/key" not in listed and "ckpt" not in listed


def test_no_private_staging_directory_is_left_on_the_controller():
    assert glob.glob(os.path.join(tempfile.gettempdir(), "gpuflow-transfer-*")) == []


def test_side_effect_changes_were_moved_again():
    # the lost hidden-state file is back, the new drafter record reached the evaluating host
    assert container("xfer-train-1").file(WORK + "/hidden_states/default/hs/hs_1.safetensors").exists
    drafter = json.loads(container("xfer-inference-1").file(WORK + "/train/default/drafter/config.json").content_string)
    assert drafter.get("run") == 2


@pytest.mark.parametrize("name", ["xfer-inference-1", "xfer-extract-1", "xfer-train-1"])
def test_no_archive_or_unverified_copy_is_left(name):
    left = container(name).check_output("find %s -name '*.transfer.tar' -o -name '*.incoming'" % WORK).split()
    # but the copy refused on purpose by the side effect
    assert left == ([WORK + "/synthetic_data/default.incoming"] if name == "xfer-extract-1" else [])

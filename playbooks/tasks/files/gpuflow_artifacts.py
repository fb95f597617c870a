"""Checksums of a stage's output directory, for moving it between hosts (playbooks/tasks/transfer.yml).

  sums   DIR [--manifest NAME] [--exclude NAME ...]
                        write DIR/SHA256SUMS.json: every file under DIR (but the transfer's own records and
                        the excluded top-level names) with its size and sha256, and the sha256 of the stage's
                        record DIR/NAME (default MANIFEST.json; no record, no transfer); files whose size and
                        mtime are unchanged since the last SHA256SUMS.json are not read again
  verify DIR --sums F   compare DIR with the sums in F: missing files, other sizes, other sha256
  record DIR --sums F --source HOST --seconds S
                        after a verified copy: write DIR/TRANSFER.json (what arrived, from where)
  current DIR --sums F  whether DIR already holds a verified copy of what F describes (TRANSFER.json has
                        F's manifest and every file has its size): a rerun copies nothing

Each command prints one JSON object. Standard library only (any Python 3.6+ on the hosts).
"""
import argparse
import hashlib
import json
import os
import sys
import time

SUMS = "SHA256SUMS.json"
RECORD = "TRANSFER.json"
OWN_FILES = {SUMS, RECORD}


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def walk(root, exclude=()):
    """{relative path: os.stat} of the regular files under root, the transfer's own records and the
    excluded top-level names left out."""
    found = {}
    for dirpath, dirs, files in os.walk(root):
        if dirpath == root:
            dirs[:] = [d for d in dirs if d not in exclude]
            files = [f for f in files if f not in exclude]
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if rel in OWN_FILES or name.endswith(".tmp") or not os.path.isfile(path):
                continue
            found[rel] = os.stat(path)
    return found


def cmd_sums(a):
    if not os.path.isfile(os.path.join(a.dir, a.manifest)):
        return fail("%s has no %s: the stage did not finish there" % (a.dir, a.manifest))
    old = (read_json(os.path.join(a.dir, SUMS)) or {}).get("files", {})
    files, hashed = {}, 0
    for rel, st in sorted(walk(a.dir, a.exclude).items()):
        before = old.get(rel)
        if before and before["size"] == st.st_size and before["mtime"] == st.st_mtime:
            files[rel] = before
            continue
        files[rel] = {"size": st.st_size, "mtime": st.st_mtime, "sha256": sha256(os.path.join(a.dir, rel))}
        hashed += 1
    sums = {"files": files, "manifest": a.manifest, "manifest_sha256": files[a.manifest]["sha256"],
            "bytes": sum(f["size"] for f in files.values())}
    write_json(os.path.join(a.dir, SUMS), sums)
    emit({"files": len(files), "bytes": sums["bytes"], "hashed": hashed,
          "manifest_sha256": sums["manifest_sha256"], "changed": hashed > 0})
    return 0


def compare(root, expected):
    """(missing, other size, other sha256) of root against the expected {rel: {size, sha256}}."""
    present = walk(root)
    missing = sorted(rel for rel in expected if rel not in present)
    resized = sorted(rel for rel, f in expected.items() if rel in present and present[rel].st_size != f["size"])
    checked = [rel for rel in expected if rel in present and rel not in resized]
    corrupt = sorted(rel for rel in checked if sha256(os.path.join(root, rel)) != expected[rel]["sha256"])
    return missing, resized, corrupt


def cmd_verify(a):
    sums = read_json(a.sums)
    if not sums:
        return fail("cannot read the sums %s" % a.sums)
    missing, resized, corrupt = compare(a.dir, sums["files"])
    ok = not (missing or resized or corrupt)
    emit({"ok": ok, "files": len(sums["files"]), "bytes": sums["bytes"], "missing": missing[:20],
          "other_size": resized[:20], "other_sha256": corrupt[:20],
          "problems": len(missing) + len(resized) + len(corrupt)})
    return 0


def cmd_record(a):
    sums = read_json(a.sums)
    write_json(os.path.join(a.dir, SUMS), sums)
    record = {"source": a.source, "manifest_sha256": sums["manifest_sha256"], "files": len(sums["files"]),
              "bytes": sums["bytes"], "seconds": a.seconds, "verified": True,
              "received": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json(os.path.join(a.dir, RECORD), record)
    emit(dict(record, changed=True))
    return 0


def cmd_current(a):
    sums = read_json(a.sums) or {}
    record = read_json(os.path.join(a.dir, RECORD)) or {}
    if not sums or record.get("manifest_sha256") != sums.get("manifest_sha256"):
        emit({"current": False, "reason": "no verified copy of this manifest here"})
        return 0
    present = walk(a.dir)
    other = [rel for rel, f in sums["files"].items() if rel not in present or present[rel].st_size != f["size"]]
    emit({"current": not other, "reason": ("%d file(s) missing or changed since the copy" % len(other)) if other
          else "a verified copy of this manifest is here", "record": record})
    return 0


def emit(obj):
    print(json.dumps(obj, sort_keys=True))


def fail(msg):
    emit({"failed": True, "msg": msg})
    return 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    p = sub.add_parser("sums")
    p.add_argument("dir")
    p.add_argument("--manifest", default="MANIFEST.json")
    p.add_argument("--exclude", action="append", default=[], help="a top-level name to leave out (repeatable)")
    for name in ("verify", "current"):
        p = sub.add_parser(name)
        p.add_argument("dir")
        p.add_argument("--sums", required=True)
    p = sub.add_parser("record")
    p.add_argument("dir")
    p.add_argument("--sums", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--seconds", type=float, required=True)
    a = ap.parse_args(argv)
    fn = {"sums": cmd_sums, "verify": cmd_verify, "record": cmd_record, "current": cmd_current}.get(a.cmd)
    if not fn:
        ap.error("a subcommand is required")
    return fn(a)


if __name__ == "__main__":
    sys.exit(main())

"""Checksums of a stage's output directory, for moving it between hosts (playbooks/tasks/transfer.yml).

A transfer carries exactly the files the source lists, as regular files: the list is made without
following a symlink, the archive holds the listed files and nothing else, and a copy passes only when
it holds exactly those files with their sizes and sha256, no file more and no symlink.

  sums   DIR [--manifest NAME] [--exclude NAME ...]
                        write DIR/SHA256SUMS.json: every regular file under DIR with its size and sha256,
                        and the sha256 of the stage's record DIR/NAME (default MANIFEST.json; no record, no
                        transfer). What stays behind: the transfer's own records, the excluded top-level
                        names and *.tmp files (writes in progress). A symlink or other non-regular file
                        anywhere else refuses the transfer: no stage writes one, and on another host it
                        would point at that host's files. Files whose size and mtime are unchanged since
                        the last SHA256SUMS.json are not read again
  pack   DIR --sums F --file TAR
                        write TAR holding exactly the files F lists, each read without following a symlink
  verify DIR --sums F   compare DIR with the sums in F: missing files, other sizes, other sha256, files F
                        does not list, symlinks and other non-regular entries; ok only when there are none
  record DIR --sums F --source HOST --seconds S
                        after a verified copy: write DIR/TRANSFER.json (what arrived, from where)
  current DIR --sums F  whether DIR already holds a verified copy of what F describes (TRANSFER.json has
                        F's manifest and every file has its size): a rerun copies nothing

Each command prints one JSON object; a refusal or a malformed sums file prints {"failed": true, "msg": ...}
and exits 1. Standard library only (any Python 3.6+ on the hosts).
"""
import argparse
import hashlib
import json
import os
import re
import stat
import sys
import tarfile
import tempfile
import time

SUMS = "SHA256SUMS.json"
RECORD = "TRANSFER.json"
OWN_FILES = {SUMS, RECORD}
SHA256 = re.compile(r"^[0-9a-f]{64}$")


class Refused(Exception):
    """A directory or a sums file this tool will not work with: printed as a failure, not a traceback."""


def open_below(root, rel):
    """The regular file root/rel opened for reading, no symlink followed below root: a link swapped in
    after the walk fails here instead of being read."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in rel.split("/")[:-1]:
            sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = sub
        # O_NONBLOCK: a fifo put in a file's place must not hang the open
        sub = os.open(rel.split("/")[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
    f = os.fdopen(sub, "rb")
    if not stat.S_ISREG(os.fstat(sub).st_mode):
        f.close()
        raise Refused("%s in %s is not a regular file" % (rel, root))
    return f


def sha256(root, rel):
    h = hashlib.sha256()
    with open_below(root, rel) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_json(path):
    """The JSON object in the regular file at path (a symlink there is not followed), else None."""
    try:
        with open_below(os.path.dirname(path) or ".", os.path.basename(path)) as f:
            obj = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, Refused):
        return None
    return obj if isinstance(obj, dict) else None


def bad_name(rel):
    """A listed name that could reach outside the directory it is looked up in."""
    return not isinstance(rel, str) or "\0" in rel or any(p in ("", ".", "..") for p in rel.split("/"))


def load_sums(path):
    """The sums file at path, every entry checked, or Refused: its names are opened and archived."""
    sums = read_json(path)
    files = sums.get("files") if sums else None
    if not isinstance(files, dict) or not isinstance(sums.get("bytes"), int) \
            or not SHA256.match(str(sums.get("manifest_sha256"))):
        raise Refused("%s is not a sums file of gpuflow_artifacts.py (unreadable, not JSON, or without "
                      "files, bytes and manifest_sha256)" % path)
    for rel, f in files.items():
        if bad_name(rel) or not isinstance(f, dict) or not isinstance(f.get("size"), int) or f["size"] < 0 \
                or not SHA256.match(str(f.get("sha256"))):
            raise Refused("%s has a malformed entry %r: a relative path inside the directory with a size "
                          "and a sha256 expected" % (path, rel))
    return sums


def replace_atomically(path, write, mode=0o644):
    """Write path through a private temporary file beside it: nothing is written through a link planted
    at a predictable name, and a reader sees the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                               dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path, obj):
    replace_atomically(path, lambda f: f.write(json.dumps(obj, indent=1, sort_keys=True).encode("utf-8")))


def walk(root, exclude=()):
    """({relative path: lstat} of the regular files under root, sorted relative paths of everything else
    that is not a directory: symlinks (to directories too), fifos, sockets, devices). Nothing is followed;
    the excluded top-level names are left out."""
    files, odd = {}, []

    def unreadable(e):
        raise e  # a directory that cannot be listed would hide its files

    for dirpath, dirs, names in os.walk(root, onerror=unreadable):
        if dirpath == root:
            dirs[:] = [d for d in dirs if d not in exclude]
            names = [n for n in names if n not in exclude]
        # os.walk lists a link to a directory among the directories and does not enter it
        odd.extend(os.path.relpath(os.path.join(dirpath, d), root) for d in dirs
                   if os.path.islink(os.path.join(dirpath, d)))
        for name in names:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                files[os.path.relpath(path, root)] = st
            else:
                odd.append(os.path.relpath(path, root))
    return files, sorted(odd)


def cmd_sums(a):
    if not os.path.isfile(os.path.join(a.dir, a.manifest)):
        return fail("%s has no %s: the stage did not finish there" % (a.dir, a.manifest))
    present, odd = walk(a.dir, set(a.exclude) | OWN_FILES)
    odd = [rel for rel in odd if not rel.endswith(".tmp")]
    if odd:
        return fail("%s holds symlinks or other non-regular files: %s. A transfer carries regular files only "
                    "and follows no link; remove them, or exclude their top-level name if they stay behind"
                    % (a.dir, ", ".join(odd[:20])))
    if a.manifest not in present:
        return fail("%s's %s is not a regular file that the transfer carries" % (a.dir, a.manifest))
    old = (read_json(os.path.join(a.dir, SUMS)) or {}).get("files")
    old = old if isinstance(old, dict) else {}
    files, hashed = {}, 0
    for rel, st in sorted(present.items()):
        if rel.endswith(".tmp"):
            continue
        before = old.get(rel)
        if isinstance(before, dict) and before.get("size") == st.st_size and before.get("mtime") == st.st_mtime \
                and SHA256.match(str(before.get("sha256"))):
            files[rel] = before
            continue
        files[rel] = {"size": st.st_size, "mtime": st.st_mtime, "sha256": sha256(a.dir, rel)}
        hashed += 1
    sums = {"files": files, "manifest": a.manifest, "manifest_sha256": files[a.manifest]["sha256"],
            "bytes": sum(f["size"] for f in files.values())}
    write_json(os.path.join(a.dir, SUMS), sums)
    emit({"files": len(files), "bytes": sums["bytes"], "hashed": hashed,
          "manifest_sha256": sums["manifest_sha256"], "changed": hashed > 0})
    return 0


def listed_dirs(files):
    """The directories that hold the listed files, the root "." first and every parent before its children."""
    dirs = {"."}
    for rel in files:
        parts = rel.split("/")[:-1]
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return sorted(dirs, key=lambda d: (d != ".", d.split("/")))


def cmd_pack(a):
    sums = load_sums(a.sums)

    def write(raw):
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
            # the directories' own entries (metadata only, read with lstat): unpacked as root, the copy gets the
            # source's owners and modes, the receiving DIR.incoming's included, so a server account can read it
            for rel in listed_dirs(sums["files"]):
                info = tar.gettarinfo(os.path.join(a.dir, rel), arcname=rel)
                if not info.isdir():
                    raise Refused("%s in %s is not a directory" % (rel, a.dir))
                tar.addfile(info)
            for rel in sorted(sums["files"]):
                with open_below(a.dir, rel) as f:
                    tar.addfile(tar.gettarinfo(arcname=rel, fileobj=f), f)

    replace_atomically(a.file, write, mode=0o600)
    emit({"files": len(sums["files"]), "bytes": sums["bytes"], "archive": a.file, "changed": True})
    return 0


def cmd_verify(a):
    sums = load_sums(a.sums)
    expected = sums["files"]
    present, odd = walk(a.dir)
    missing = sorted(rel for rel in expected if rel not in present)
    unlisted = sorted(rel for rel in present if rel not in expected)
    resized = sorted(rel for rel, f in expected.items() if rel in present and present[rel].st_size != f["size"])
    checked = [rel for rel in expected if rel in present and rel not in resized]
    corrupt = sorted(rel for rel in checked if sha256(a.dir, rel) != expected[rel]["sha256"])
    problems = set(missing) | set(resized) | set(corrupt) | set(unlisted) | set(odd)
    emit({"ok": not problems, "files": len(expected), "bytes": sums["bytes"], "missing": missing[:20],
          "other_size": resized[:20], "other_sha256": corrupt[:20], "unlisted": unlisted[:20],
          "not_regular": odd[:20], "problems": len(problems)})
    return 0


def cmd_record(a):
    sums = load_sums(a.sums)
    write_json(os.path.join(a.dir, SUMS), sums)
    record = {"source": a.source, "manifest_sha256": sums["manifest_sha256"], "files": len(sums["files"]),
              "bytes": sums["bytes"], "seconds": a.seconds, "verified": True,
              "received": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json(os.path.join(a.dir, RECORD), record)
    emit(dict(record, changed=True))
    return 0


def cmd_current(a):
    # no list yet (a first run in check mode does not copy it): nothing here is current
    sums = load_sums(a.sums) if os.path.lexists(a.sums) else {}
    record = read_json(os.path.join(a.dir, RECORD)) or {}
    if not sums or record.get("manifest_sha256") != sums["manifest_sha256"]:
        emit({"current": False, "reason": "no verified copy of this manifest here"})
        return 0
    present = walk(a.dir)[0]
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
    for name in ("verify", "current", "pack"):
        p = sub.add_parser(name)
        p.add_argument("dir")
        p.add_argument("--sums", required=True)
        if name == "pack":
            p.add_argument("--file", required=True, help="the archive to write")
    p = sub.add_parser("record")
    p.add_argument("dir")
    p.add_argument("--sums", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--seconds", type=float, required=True)
    a = ap.parse_args(argv)
    fn = {"sums": cmd_sums, "pack": cmd_pack, "verify": cmd_verify, "record": cmd_record,
          "current": cmd_current}.get(a.cmd)
    if not fn:
        ap.error("a subcommand is required")
    try:
        return fn(a)
    except (Refused, OSError) as e:
        return fail("%s %s: %s" % (a.cmd, a.dir, e))


if __name__ == "__main__":
    sys.exit(main())

"""The safety rules, each removed in turn: the unit tests must fail every time.

A rule is a piece of code that keeps a drain, a reset, a server's launcher or a transfer from doing
harm. For each one this script replaces that code, in a copy of the checkout (the checkout itself is never
touched), with a version that does not apply the rule, runs the unit tests there, and fails unless
they failed. A test that still passes with a rule gone does not guard it.

    .venv/bin/python tests/mutation_check.py            # all rules (under a minute)
    .venv/bin/python tests/mutation_check.py --list
    .venv/bin/python tests/mutation_check.py own-tree-holder

To add a rule: append a Mutation with the file (relative to the checkout), the exact text of the rule
(it must occur once), its replacement and the unit tests that guard it, then run this script to see
them catch it.
"""
import argparse
import collections
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# tests: a glob under the checkout, the unit tests that must fail without the rule
Mutation = collections.namedtuple("Mutation", "name file rule without tests")
GPU_TESTS = "tests/unit/test_gpu_*.py"

MUTATIONS = [
    Mutation("memory-check", "plugins/module_utils/drain.py",
             '    if used > limit:\n        return False, "memory used',
             '    if False:\n        return False, "memory used',
             GPU_TESTS),
    Mutation("memory-held-blocker", "plugins/module_utils/drain.py",
             "        if i in d.pending and not blockers:\n",
             "        if False:\n",
             GPU_TESTS),
    Mutation("own-tree-holder", "plugins/module_utils/drain_plan.py",
             '        if cls == "self":\n            skipped.append(_brief(h, "own process tree"))\n            continue\n',
             "",
             GPU_TESTS),
    Mutation("own-tree-named-pid", "plugins/module_utils/drain_plan.py",
             '        if pid in own:\n            skipped.append({"pid": pid, "reason": "own process tree"})\n',
             "        if False:\n            pass\n",
             GPU_TESTS),
    Mutation("unit-by-control-group", "plugins/module_utils/drain.py",
             '            if group and (path == group or path.startswith(group.rstrip("/") + "/")):\n',
             '            if path.endswith("/" + unit):\n',
             GPU_TESTS),
    Mutation("pid-identity", "plugins/module_utils/pid_safety.py",
             "    if expected_create_time is None or abs(ct - expected_create_time) > 0.011:\n"
             '        return "PID %d changed identity',
             "    if False:\n"
             '        return "PID %d changed identity',
             GPU_TESTS),
    Mutation("protected-process", "plugins/module_utils/holders.py",
             '    if pat:\n        return "protected", pat\n',
             "",
             GPU_TESTS),
    Mutation("restore-daemons-after-reset", "plugins/module_utils/gpu_reset.py",
             "    for u in reversed(r.stopped):\n",
             "    for u in []:\n",
             GPU_TESTS),
    Mutation("reset-timeout-reported", "plugins/module_utils/gpu_reset.py",
             '            text = ("timed out after %s s. " % r.p["reset_timeout"]) + text\n',
             "            pass\n",
             GPU_TESTS),
    Mutation("transfer-unlisted-file", "playbooks/tasks/files/gpuflow_artifacts.py",
             "    unlisted = sorted(rel for rel in present if rel not in expected)\n",
             "    unlisted = []\n",
             "tests/unit/test_gpuflow_artifacts.py"),
    Mutation("launcher-pid-identity", "roles/vllm_server/files/vllm_proc.py",
             '    if starttime != record["starttime"] or argv != record["cmdline"]:\n',
             "    if False:\n",
             "tests/unit/test_vllm_proc.py"),
    Mutation("launcher-unit-by-control-group", "roles/vllm_server/files/vllm_proc.py",
             "        inside = any(path == group or path.startswith(below) for path in systemd_cgroups(pid))\n",
             '        inside = any(path.endswith("/" + unit) for path in systemd_cgroups(pid))\n',
             "tests/unit/test_vllm_proc.py"),
    Mutation("launcher-mkdir-planted-symlink", "roles/vllm_server/files/vllm_proc.py",
             "                if not (parent_trusted and ours(st)):\n",
             "                if False:\n",
             "tests/unit/test_vllm_proc.py"),
    Mutation("launcher-mkdir-first-refusal-stops", "roles/vllm_server/files/vllm_proc.py",
             "        d = walk_to_dir(path, settle, trusted_only=a.trusted)\n",
             "        try:\n            d = walk_to_dir(path, settle, trusted_only=a.trusted)\n"
             "        except Refused:\n            continue\n",
             "tests/unit/test_vllm_proc.py"),
    Mutation("job-own-session", "roles/detached_job/files/gpuflow_jobs.py",
             "    os.setsid()\n",
             "",
             "tests/unit/test_gpuflow_jobs.py"),
    Mutation("job-pid-create-time", "roles/detached_job/files/gpuflow_jobs.py",
             "    if starttime is None or create_time(pid) != starttime:\n",
             "    if create_time(pid) is None:\n",
             "tests/unit/test_gpuflow_jobs.py"),
    Mutation("job-atomic-write", "roles/detached_job/files/gpuflow_jobs.py",
             '    tmp = "%s.tmp-%d" % (path, os.getpid())\n    with open(tmp, "w") as f:\n        json.dump(',
             '    tmp = path\n    with open(tmp, "w") as f:\n        json.dump(',
             "tests/unit/test_gpuflow_jobs.py"),
    Mutation("job-died", "roles/detached_job/files/gpuflow_jobs.py",
             '    if not p["running"] and p.get("state") in RUNNING_STATES:\n',
             "    if False:\n",
             "tests/unit/test_gpuflow_jobs.py"),
    Mutation("extract-waits-for-the-write", "roles/hidden_state_extract/files/hs_extract.py",
             '                wait_unlocked(path + ".lock", self.a.request_timeout)\n',
             "                pass\n",
             "tests/unit/test_hs_extract_client.py"),
    Mutation("extract-refuses-non-finite", "roles/hidden_state_extract/files/hs_extract.py",
             '            non_finite_values(path, header, base, "hidden_states"):\n',
             "            False:\n",
             "tests/unit/test_hs_extract_client.py"),
]


def copy_of_checkout(dest):
    """The files git would ship (tracked, and untracked but not ignored), copied under dest."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = os.path.join(REPO, name)
        if os.path.isfile(src) and not os.path.islink(src):
            os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, name))
    return dest


def unit_tests(root, pattern):
    """The unit tests matching pattern in the checkout at root, stopping at the first failure: their exit
    status and the end of their output."""
    files = sorted(glob.glob(os.path.join(root, pattern)))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"] + files,
                          cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    return proc.returncode, "\n".join(proc.stdout.splitlines()[-40:])


def check(m, root):
    path = os.path.join(root, m.file)
    with open(path) as f:
        original = f.read()
    if original.count(m.rule) != 1:
        return "the rule's text occurs %d times in %s (update the mutation)" % (original.count(m.rule), m.file)
    try:
        with open(path, "w") as f:
            f.write(original.replace(m.rule, m.without))
        rc = unit_tests(root, m.tests)[0]
    finally:
        with open(path, "w") as f:
            f.write(original)
    return None if rc != 0 else "the unit tests pass without it"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="rules to check (default: all)")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    if a.list:
        print("\n".join("%-28s %s" % (m.name, m.file) for m in MUTATIONS))
        return 0
    chosen = [m for m in MUTATIONS if not a.names or m.name in a.names]
    with tempfile.TemporaryDirectory(prefix="gpuflow-mutation-") as tmp:
        root = copy_of_checkout(tmp)
        for pattern in sorted({m.tests for m in chosen}):
            rc, tail = unit_tests(root, pattern)
            if rc != 0:
                print("%s\nthe unit tests %s fail before any rule is removed" % (tail, pattern))
                return 1
        failures = 0
        for m in chosen:
            t0 = time.monotonic()
            why = check(m, root)
            failures += why is not None
            verdict = "caught" if why is None else "MISSED  " + why
            print("%-28s %5.1fs  %s" % (m.name, time.monotonic() - t0, verdict), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

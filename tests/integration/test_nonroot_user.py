"""`make pipeline` as an ordinary user would run it: an account created for this test (removed after, even on
failure), a copy of the checkout's tracked files in its home, a login environment (none of root's pip
settings), PyPI. Without the CPU torch `make pipeline` stops at the wheelhouse with tools/wheelhouse.sh's
message and exit code, before building anything (within 2 minutes), and leaves no wheelhouse; given a folder
with that wheel through PIP_FIND_LINKS, the account builds both wheelhouses and passes the pipeline's preflight
(`make wheelhouses preflight`: everything `make pipeline` does before its first stage). Nothing it writes lies
outside its home, and in its home nothing outside the XDG directories, Ansible's ~/.ansible and the checkout copy.

Needs root (useradd); skipped otherwise (make test runs as root). 5 to 25 minutes in make test on a 2-core
machine (its own phase, integration-nonroot), most of it pip resolving and downloading into the account's own cache:
the bootstrap's venv and the two wheelhouses.
"""
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.nonroot,
              pytest.mark.skipif(os.geteuid() != 0, reason="creates an account (useradd): needs root")]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ACCOUNT = "gpuflow-nonroot"
NO_CPU_TORCH = 3  # tools/wheelhouse.sh's exit code when the CPU torch does not resolve
# where an ordinary account may write in its home (everything else there is the skeleton useradd copied)
HOME_ALLOWED = {"p", ".cache", ".local", ".config", ".ansible"}


def remove_account():
    """The account, its home and any process of it (a run cut short may leave one)."""
    try:
        uid = pwd.getpwnam(ACCOUNT).pw_uid
    except KeyError:
        return
    # a process may fork while its siblings are killed: kill until none is left, or a while has passed
    deadline = time.monotonic() + 30
    while (pids := processes_of(uid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    # --force: a killed process whose parent never reaps it stays a zombie of the account (exit status 8)
    subprocess.run(["userdel", "--force", "--remove", ACCOUNT], check=True, stderr=subprocess.DEVNULL)


def processes_of(uid):
    pids = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and os.stat("/proc/" + d).st_uid == uid:
                pids.append(int(d))
        except FileNotFoundError:
            pass
    return pids


@pytest.fixture(scope="module")
def account():
    """The account (pw entry), its checkout copy, an empty wheel folder it can read, and what useradd made for it;
    the account and the folder go away after the module, whatever happened."""
    remove_account()  # left by a run that was killed before its clean-up
    wheels = tempfile.mkdtemp(prefix="gpuflow-cpu-torch-")
    try:
        subprocess.run(["useradd", "--create-home", "--user-group", "--shell", "/bin/bash", ACCOUNT], check=True)
        pw = pwd.getpwnam(ACCOUNT)
        checkout = os.path.join(pw.pw_dir, "p")
        # the working tree's tracked files, uncommitted edits included: what is tested is what is here
        tracked = subprocess.run(["git", "-C", REPO, "ls-files", "-z"], check=True, stdout=subprocess.PIPE,
                                 universal_newlines=True).stdout.split("\0")
        for rel in filter(None, tracked):
            src, dst = os.path.join(REPO, rel), os.path.join(checkout, rel)
            if os.path.lexists(src):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copy2(src, dst, follow_symlinks=False)
        for d, dirs, files in os.walk(checkout):
            for name in [d] + [os.path.join(d, n) for n in dirs + files]:
                os.lchown(name, pw.pw_uid, pw.pw_gid)
        os.chmod(wheels, 0o755)
        acct = {"pw": pw, "checkout": checkout, "wheels": wheels, "skeleton": set(os.listdir(pw.pw_dir)), "made": []}
        acct["made"] = written_outside(acct)  # e.g. a mail spool, where useradd makes one
        yield acct
    finally:
        remove_account()
        shutil.rmtree(wheels, ignore_errors=True)


def as_account(acct, argv, given=None, timeout=1800):
    """Run argv in the checkout copy as the account, in a login-like environment plus `given`; (rc, output, s).

    The timeout ends the whole session (make's pip children too). The bootstrap's downloads took over 900 s
    once on CI's machine."""
    pw = acct["pw"]
    env = {"HOME": pw.pw_dir, "USER": ACCOUNT, "LOGNAME": ACCOUNT, "SHELL": "/bin/bash", "LANG": "C.UTF-8",
           "PATH": "/usr/local/bin:/usr/bin:/bin"}
    # a machine that reaches PyPI through a proxy gives every login the same
    env.update((k, v) for k, v in os.environ.items() if k.lower() in ("http_proxy", "https_proxy", "no_proxy"))
    env.update(given or {})
    start = time.monotonic()
    with subprocess.Popen(argv, cwd=acct["checkout"], env=env, user=pw.pw_uid, group=pw.pw_gid, extra_groups=[],
                          umask=0o022, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                          start_new_session=True) as p:
        try:
            out = p.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
    return p.returncode, out, time.monotonic() - start


def written_outside(acct):
    """Files of the account outside its home, and entries in its home outside the allowed ones."""
    pw = acct["pw"]
    # the container engine's trees are root's alone (0710); their layers hold whole systems whose files may carry
    # the account's uid from a container's own accounts, and walking them cost most of the search's CPU
    found = subprocess.run(["find", "/", "/dev/shm", "-xdev", "(", "-path", "/var/lib/docker", "-o", "-path",
                            "/var/lib/containerd", ")", "-prune", "-o", "-uid", str(pw.pw_uid), "-print"],
                           stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, universal_newlines=True, check=False).stdout.split("\n")
    outside = [f for f in found if f and f != pw.pw_dir and not f.startswith(pw.pw_dir + "/")]
    extra = set(os.listdir(pw.pw_dir)) - acct["skeleton"] - HOME_ALLOWED
    return sorted(set(outside) - set(acct["made"])) + sorted(os.path.join(pw.pw_dir, n) for n in extra)


def test_ordinary_account_make_pipeline(account):
    rc, out, _seconds = as_account(account, ["make", "bootstrap"])
    assert rc == 0, out[-3000:]

    # without the CPU torch: the message and the exit code before anything is built (pip's index lookups take
    # 10 to 40 s on a loaded 2-core machine; a wheelhouse build takes minutes, and leaves files, checked below)
    rc, out, seconds = as_account(account, ["make", "pipeline"])
    assert rc != 0 and "Error %d" % NO_CPU_TORCH in out, out[-3000:]
    assert seconds < 120, "make pipeline took %.1f s to say that the CPU torch is missing" % seconds
    req = re.search(r"^wheelhouse\.sh: (torch==\S+\+cpu) does not resolve", out, re.M)
    assert req, out[-3000:]
    assert "PIP_FIND_LINKS=" in out and "PIP_EXTRA_INDEX_URL=" in out, out[-3000:]
    # the wheelhouse script alone: its own exit code, and nothing written that a next run could take as built
    rc, out, seconds = as_account(account, ["tools/wheelhouse.sh", "speculators"])
    assert rc == NO_CPU_TORCH and seconds < 120, out[-3000:]
    assert not os.path.exists(os.path.join(account["checkout"], ".cache", "wheelhouse"))
    assert not os.path.exists(os.path.join(account["pw"].pw_dir, ".local", "share", "gpuflow"))
    assert written_outside(account) == []

    # given a folder with that wheel, as this machine's (root's) pip configuration gets it
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                    "-d", account["wheels"], req.group(1)], check=True)
    given = sorted(os.listdir(account["wheels"]))
    rc, out, _seconds = as_account(account, ["make", "wheelhouses", "preflight"], given={"PIP_FIND_LINKS": account["wheels"]})
    assert rc == 0, out[-5000:]
    for name in ("vllm", "speculators"):
        wheelhouse = os.path.join(account["checkout"], ".cache", "wheelhouse", name)
        assert "wheelhouse %s built in" % wheelhouse in out, out[-5000:]
        assert os.path.isfile(os.path.join(wheelhouse, ".complete"))
        assert sorted(w for w in os.listdir(wheelhouse) if w.startswith("torch-")) == given, wheelhouse
    assert re.search(r"localhost\s+: ok=\d+\s+changed=0\s+unreachable=0\s+failed=0", out), out[-5000:]
    assert written_outside(account) == []
    assert processes_of(account["pw"].pw_uid) == []

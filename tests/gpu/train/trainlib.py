"""Shared by tests/gpu/train/run_h200.py and bench/train_h200.py: the speculators venv, the
gpuflow.eagle3.eagle3_train role through `ansible-playbook`, metrics.jsonl, NVML sampling.

Two devices:
  cuda  the GPU machine: /tmp/specvenv (made by setup_venv from the wheels in .whl/, the
        system torch through --system-site-packages), its ansible-playbook, the role on the
        GPUs the caller names, seq len 4096 and a draft vocabulary of 8192;
  cpu   a rehearsal here: .cache/venvs/speculators (the integration tests' venv) for the job,
        .venv's ansible-playbook, no GPUs (the role's CPU adapter, gloo), seq len 512 and a
        draft vocabulary of 256.

Alone, on the GPU machine, it makes the venv (which make_inputs.py can then run with):
  python3 tests/gpu/train/trainlib.py setup
"""
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))

from gpulib import ensure_collection_link  # noqa: E402

SPECVENV = "/tmp/specvenv"
CPU_VENV = os.path.join(REPO, ".cache", "venvs", "speculators")
CPU_PLAYBOOK = os.path.join(REPO, ".venv", "bin", "ansible-playbook")
# never NVLink multicast on the shared hosts (also set by the role; this covers what we start ourselves)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# one warm compile cache for every run of a session, instead of the role's per-output-dir default
COMPILE_CACHE = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor-cache", "TRITON_CACHE_DIR": "/tmp/triton-cache"}
HF_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}
PLAY = "- hosts: train\n  gather_facts: false\n  roles: [gpuflow.eagle3.eagle3_train]\n"
SHAPES = {"cuda": {"total_seq_len": 4096, "draft_vocab_size": 8192},
          "cpu": {"total_seq_len": 512, "draft_vocab_size": 256}}


def setup_venv(venv=SPECVENV):
    """The GPU machine's speculators venv: the system torch and transformers, the carried wheels
    (speculators and its missing deps, ansible-core) on top. Skipped when already there."""
    python = os.path.join(venv, "bin", "python")
    if os.path.exists(os.path.join(venv, "bin", "ansible-playbook")) and subprocess.run(
            [python, "-c", "import speculators"], capture_output=True, check=False).returncode == 0:
        return
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    # where this Python is itself a venv, --system-site-packages reaches only the base install: list its paths
    site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                          text=True, check=True).stdout.strip()
    with open(os.path.join(site, "gpuflow-system.pth"), "w") as f:
        f.write("\n".join(p for p in sys.path if p and os.path.isdir(p)) + "\n")
    wheels = sorted(os.path.join(REPO, ".whl", n) for n in os.listdir(os.path.join(REPO, ".whl")) if n.endswith(".whl"))
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"] + wheels,
                   check=True)


def export_nccl_env():
    os.environ.update(NCCL_ENV)


def tools(device):
    """(speculators venv, ansible-playbook) for the device."""
    if device == "cuda":
        return SPECVENV, os.path.join(SPECVENV, "bin", "ansible-playbook")
    return CPU_VENV, CPU_PLAYBOOK


def role_vars(device, hidden_states, out, lib_dir, max_steps, epochs=1, **extra):
    """The role's variables of these runs; extra (eagle3_train_ without the prefix) on top."""
    venv = tools(device)[0]
    ev = {
        "eagle3_train_hidden_states_dir": hidden_states, "eagle3_train_output_dir": out,
        "eagle3_train_install": False, "eagle3_train_venv": venv, "eagle3_train_lib_dir": lib_dir,
        "eagle3_train_total_seq_len": SHAPES[device]["total_seq_len"],
        "eagle3_train_draft_vocab_size": SHAPES[device]["draft_vocab_size"],
        "eagle3_train_epochs": epochs, "eagle3_train_max_steps": max_steps, "eagle3_train_checkpoint_freq": 0.25,
        "eagle3_train_log_freq": 1, "eagle3_train_poll_interval": 5, "eagle3_train_env": dict(COMPILE_CACHE),
        # a stop (Playbook.abandon) of a job whose torchrun hangs at the rendezvous ends it in 2 minutes, not 5
        "eagle3_train_stop_timeout": 120,
    }
    if device == "cuda":
        ev["eagle3_train_gpu_backend"] = "nvml"
    ev.update({"eagle3_train_" + k: v for k, v in extra.items()})
    return ev


def inventory(hosts):
    """Group `train` of local hosts, {name: host vars} in node-rank order."""
    lines = ["all:", "  children:", "    train:", "      hosts:"]
    for name, hv in hosts.items():
        lines.append("        %s:%s" % (name, "" if hv else " {}"))
        lines += ["          %s: %s" % (k, json.dumps(v)) for k, v in hv.items()]
    lines += ["  vars:", "    ansible_connection: local",
              "    ansible_python_interpreter: '{{ ansible_playbook_python }}'", ""]
    return "\n".join(lines)


class Playbook:
    """One role invocation's files under run_dir: play.yml, inventory.yml, vars.json; its output
    appends to playbook.log."""

    def __init__(self, device, run_dir, ev, hosts):
        self.playbook_bin = tools(device)[1]
        self.run_dir = run_dir
        self.log = os.path.join(run_dir, "playbook.log")
        os.makedirs(run_dir, exist_ok=True)
        os.makedirs(ev["eagle3_train_lib_dir"], exist_ok=True)
        for name, text in (("play.yml", PLAY), ("inventory.yml", inventory(hosts)), ("vars.json", json.dumps(ev)),
                           ("stop.json", json.dumps(dict(ev, eagle3_train_action="stop")))):
            with open(os.path.join(run_dir, name), "w") as f:
                f.write(text)
        coll = ensure_collection_link()
        self.env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
                        ANSIBLE_COLLECTIONS_PATH=coll, **NCCL_ENV)

    def start(self, vars_file="vars.json"):
        argv = [self.playbook_bin, "-i", os.path.join(self.run_dir, "inventory.yml"),
                os.path.join(self.run_dir, "play.yml"), "-e", "@" + os.path.join(self.run_dir, vars_file)]
        with open(self.log, "ab") as log:
            log.write(("=== %s: %s\n" % (utc_now(), " ".join(argv))).encode())
            log.flush()
            # its own group: it can be ended alone, and a Ctrl-C of the test does not cut a task short
            return subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def run(self, timeout):
        """(rc, wall seconds) of a run to its end; rc None when it ran past timeout: then the
        playbook is ended and the role's stop action ends the jobs it started (they run detached)."""
        t0 = time.monotonic()
        proc = self.start()
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.abandon(proc)
            rc = None
        return rc, round(time.monotonic() - t0, 1)

    def abandon(self, proc):
        """End our ansible-playbook (its own process group) and, through the role, its jobs."""
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
        self.start("stop.json").wait()


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def events(out):
    """The complete lines of out/metrics.jsonl, parsed."""
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def train_records(evs):
    return [e for e in evs if e.get("kind") == "train"]


def median_tps(values_by_step, min_step=10):
    """Median tokens/s over steps >= min_step (compile and warm-up excluded) when at least 5 are
    there, else over all; values_by_step: [(global_step, tokens/s)]."""
    late = [t for s, t in values_by_step if s >= min_step and t]
    pool = late if len(late) >= 5 else [t for s, t in values_by_step if t]
    return round(statistics.median(pool), 1) if pool else None


def role_tps(evs, min_step=10):
    return median_tps([(e["global_step"], (e.get("profile") or {}).get("tokens_per_s")) for e in train_records(evs)],
                      min_step)


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def tail(path, n=40):
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()[-n:]
    except OSError:
        return []


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def trainer_pids(out):
    """Trainer processes of this output directory: the role's launcher with out in its arguments."""
    out = os.path.abspath(out)
    return [int(d) for d in os.listdir("/proc") if d.isdigit()
            and "gpuflow_train_launch.py" in (c := cmdline(int(d))) and out + "/" in c]


def wait_until(predicate, timeout, interval=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class GpuSampler:
    """NVML every `interval` s in a thread while the with-block runs: per GPU the memory used
    and the utilisation. A no-op when disabled (the CPU rehearsal)."""

    def __init__(self, enabled, interval=0.5):
        self.enabled = enabled
        self.interval = interval
        self.samples = {}
        self.names = {}
        self.stop = threading.Event()
        self.thread = None

    def __enter__(self):
        if self.enabled:
            import pynvml
            self.nv = pynvml
            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.samples = {i: [] for i in range(len(self.handles))}
            self.thread = threading.Thread(target=self.loop, daemon=True)
            self.thread.start()
        return self

    def loop(self):
        while True:
            for i, h in enumerate(self.handles):
                used = self.nv.nvmlDeviceGetMemoryInfo(h).used / 2**20
                self.samples[i].append((used, self.nv.nvmlDeviceGetUtilizationRates(h).gpu))
            if self.stop.wait(self.interval):
                return

    def __exit__(self, *exc):
        if self.thread:
            self.stop.set()
            self.thread.join()
            self.nv.nvmlShutdown()

    def summary(self):
        """{gpu index: max_used_mib, baseline_used_mib (first sample), median_util_pct over the
        whole run, median_util_active_pct over the samples with more than 512 MiB above the
        baseline (a process on it: the training, not Ansible or the start-up), samples}."""
        if not self.enabled:
            return None
        out = {}
        for i, s in self.samples.items():
            if not s:
                continue
            base = s[0][0]
            active = [u for m, u in s if m > base + 512]
            out[str(i)] = {"max_used_mib": round(max(m for m, u in s)), "baseline_used_mib": round(base),
                           "median_util_pct": statistics.median(u for m, u in s),
                           "median_util_active_pct": statistics.median(active) if active else None,
                           "samples": len(s)}
        return out


def machine(device):
    """Host, CPUs, python; on cuda the GPU names and the driver from NVML."""
    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(), "device": device}
    if device == "cuda":
        import pynvml
        pynvml.nvmlInit()
        try:
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
            info["gpus"] = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                            for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    return info


def git_commit():
    """$GPUFLOW_COMMIT when set (the device machine's copy of the tree can carry a .git of an older
    HEAD), else HEAD of this checkout (-dirty when roles/, tests/ or bench/ differ from it)."""
    if os.environ.get("GPUFLOW_COMMIT"):
        return os.environ["GPUFLOW_COMMIT"]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    clean = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "roles", "tests", "bench"], cwd=REPO,
                           check=False).returncode == 0
    untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "roles", "tests", "bench"],
                               cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()
    return rev + ("" if clean and not untracked else "-dirty")


if __name__ == "__main__":
    if sys.argv[1:] != ["setup"]:
        sys.exit("usage: python3 tests/gpu/train/trainlib.py setup")
    setup_venv()
    print(SPECVENV)

# Copyright: gpuflow maintainers
# Apache License 2.0 (see LICENSE)
"""The hand-off of an idle CUDA vLLM server: the roles beside the seed's recipe (issue 11).

Each hand-off is of a fresh server on the same GPUs, started by the vllm_server role (process launcher:
the GPU machine has no systemd). A round hands the GPUs over three ways, one server each:

  role   (pipeline) one ansible-playbook command, as playbooks/pipeline.yml runs the hand-off: the play
         first finds the server as the generate stage leaves it (vllm_server state=started on the running
         server: nothing changes, and the play knows what a pipeline run knows by the hand-off), then
         runs gpu_drain with the pipeline's selection, the server's port in the command line: it stops the
         server (SIGTERM to the group; its NVML check starts while the server exits) and verifies the GPUs
         free (NVML: no compute process, memory back at its baseline; only a holder of the GPU under test
         whose command line, or whose owner's, names this port could ever be signalled). Timed inside the
         play from the hand-off's first task to the verdict (in_playbook_s, the figure a pipeline run
         spends), and as a command of its own (ready_s: the command's wall time less the part before the
         hand-off's first task). memory_free_s counts from the hand-off's first task too. The log of each
         command (ANSIBLE_LOG_PATH) has every task's time; the bench keeps the hand-off's slowest tasks.
  drain  the same command without the server's own stop: gpu_drain selects the server by its tag and
         ends it as a whole (one killpg), then verifies.
  seed   the seed's recipe (msg 2958), verbatim after its `systemctl stop`, which becomes what systemd
         would do: SIGTERM to the server's group and a wait for its main process. It runs in a PID
         namespace of its own (unshare --pid --fork --mount-proc), whose init starts the same argv and
         environment the role wrote, so its `kill -9` of every python and its fuser sweep reach only
         that namespace. Timed as the whole recipe: its user moves on when it returns.

Two bystanders run beside every server, as on a shared host: an unrelated python whose command line
says vllm, and an NVML management client (a monitoring agent). A hand-off that ends either is a
collateral kill. A thread samples GPU memory every 50 ms, so each round also records when the memory
was actually back, which the user of either method does not see.

    PYTHONPATH=/tmp/site python3 bench/handoff_vllm_h200.py --tp 1 --rounds 3 --inflight \\
        --out bench/results/handoff_vllm_h200.json
    PYTHONPATH=/tmp/site python3 bench/handoff_vllm_h200.py --tp 2 --rounds 3 --merge \\
        --out bench/results/handoff_vllm_h200.json

--merge keeps the other TP sizes already in --out (one command may run 10 minutes on the GPU machine,
and a TP size takes about that). --inflight adds, on the first TP size, the hand-off of a server with
requests in flight under vllm_server_shutdown_timeout 0 (abort) and 30 (drain); with --rounds 0 it is
all that runs. The carried vLLM must
be in /tmp/vsite (tests/gpu/README.md); the role's venv sees it through a .pth file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "gpu"))
sys.path.insert(0, os.path.join(REPO, "roles", "vllm_server", "files"))
sys.path.insert(0, os.path.join(REPO, "roles", "detached_job", "files"))  # the job library vllm_proc.py imports

from gpulib import Holders, ansible_bin, ensure_collection_link  # noqa: E402
from vllm_proc import load_env  # noqa: E402  (the role's launcher reads its env file with it)
from seed_ns import SEED_RECIPE  # noqa: E402  (msg 2958 of the seed, verbatim after its `systemctl stop`)
from vllm_drain_h200 import commit, free_port, machine, tree, wait_ready  # noqa: E402
from vllm_server_h200 import playbook, server_tree, server_vars, venv_with_vllm  # noqa: E402

# `systemctl stop` of a unit with KillMode=control-group: SIGTERM to every process, wait for the main one.
SYSTEMCTL_STOP = 'kill -TERM -- -{pgid} && while kill -0 {pid} 2>/dev/null; do sleep 0.1; done'
FREE_SLACK_MIB = 256
# The hand-off as one ansible-playbook command. `pipeline` is what playbooks/pipeline.yml runs (the server's
# own stop, then the drain verifies); `drain` leaves the stop to gpu_drain, which selects the server by its
# tag and ends it as a whole. The debug task prints the time from the hand-off's first task to the verdict,
# which is what a pipeline run spends there (it has started Ansible already).
HANDOFF_PLAY = """- name: Hand the GPUs over
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Note the start of the play
      ansible.builtin.set_fact:
        play_t0: "{{ now().timestamp() }}"
    - name: Find the server as the generate stage leaves it (running already; nothing changes)
      ansible.builtin.include_role:
        name: gpuflow.eagle3.vllm_server
      vars:
        vllm_server_state: started
      when: handoff_method == 'pipeline'
    - name: Note the start of the hand-off
      ansible.builtin.set_fact:
        handoff_t0: "{{ now().timestamp() }}"
    - name: Drain and verify the GPUs
      ansible.builtin.include_role:
        name: gpuflow.eagle3.gpu_drain
      vars:
        gpu_drain_cmdline_pattern: >-
          {{ ('(^| )--port ' ~ vllm_server_port ~ '( |$)') if handoff_method == 'pipeline' else vllm_server_served_model_name }}
    - name: Say how long the hand-off took
      ansible.builtin.debug:
        msg: >-
          handoff_in_playbook_s={{ now().timestamp() - handoff_t0 | float }}
          handoff_t0={{ handoff_t0 }} before_handoff_s={{ handoff_t0 | float - play_t0 | float }}
"""


class MemoryWatch(threading.Thread):
    """Samples the used memory of GPUs every 50 ms; free_at() is the first sample back at baseline."""

    def __init__(self, gpus, baseline):
        super().__init__(daemon=True)
        import pynvml
        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(g) for g in gpus]
        self.baseline = baseline
        self.samples = []
        self.stop = threading.Event()

    def used(self):
        return [self.nvml.nvmlDeviceGetMemoryInfo(h).used // 2**20 for h in self.handles]

    def run(self):
        while not self.stop.is_set():
            self.samples.append((time.time(), self.used()))
            time.sleep(0.05)

    def free_at(self, t0):
        """Seconds from t0 (time.time()) to the first sample back at the baseline."""
        for t, used in self.samples:
            if t >= t0 and at_baseline(used, self.baseline):
                return round(t - t0, 3)
        return None


def nvml_init_seconds(times=5):
    """Median seconds of nvmlInit in a fresh process (what each gpu_drain module run pays once)."""
    code = "import time, pynvml; t = time.monotonic(); pynvml.nvmlInit(); print(time.monotonic() - t); pynvml.nvmlShutdown()"
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
            for dummy in range(times)]
    return round(statistics.median(runs), 4)


def at_baseline(used, baseline):
    return all(u <= b + FREE_SLACK_MIB for u, b in zip(used, baseline))


def used_mib(gpus):
    import pynvml
    pynvml.nvmlInit()
    return [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(g)).used // 2**20 for g in gpus]


def seed_in_namespace(a):
    """PID 1 of a fresh PID namespace: start the role's argv, the bystanders, replay the recipe."""
    res = {"pid_in_namespace": os.getpid()}
    if os.getpid() != 1:
        res["error"] = "not PID 1 of a new PID namespace: refusing to run the recipe"
        with open(a.out, "w") as f:
            json.dump(res, f)
        return 2
    with open(a.argv_file) as f:
        argv = json.load(f)
    env = dict(os.environ, **load_env(a.env_file))
    gpus = [int(g) for g in a.gpus.split(",")]
    baseline = used_mib(gpus)
    log = open(a.log, "w")
    server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              cwd="/")
    threading.Thread(target=server.wait, daemon=True).start()
    holders = Holders("cuda", a.work)
    try:
        wait_ready(server, a.port, a.tag)
        res["server_processes"] = sorted(tree(server.pid).values())
        watched = {"unrelated_python": holders.idle("vllm-cpu-job"),
                   "management_client": holders.hold(gpus[:1], management_client=True)["pid"]}
        watch = MemoryWatch(gpus, baseline)
        watch.start()
        recipe = SYSTEMCTL_STOP.format(pgid=server.pid, pid=server.pid) + " && " + SEED_RECIPE
        t0 = time.time()
        p = subprocess.run(["bash", "-c", recipe], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
        res["ready_s"] = round(time.time() - t0, 3)
        time.sleep(0.3)
        watch.stop.set()
        res["memory_free_s"] = watch.free_at(t0)
        res["recipe_rc"] = p.returncode
        res["recipe_output"] = p.stdout.decode(errors="replace")[-1500:]
        holders.reap()
        res["collateral"] = sorted(k for k, pid in watched.items() if not holders.alive(pid))
        res["server_left"] = server.poll() is None
        res["freed"] = at_baseline(used_mib(gpus), baseline)
    except Exception as e:  # the namespace init must always write its result
        res["error"] = repr(e)
    finally:
        with open(a.out, "w") as f:
            json.dump(res, f)
        holders.cleanup()
    return 0


def task_times(log):
    """(seconds, task name) of each task of the hand-off (from "Note the start of the hand-off" on) in an
    ANSIBLE_LOG_PATH log: the time from its TASK line to the next one."""
    stamps = []
    with open(log) as f:
        for line in f:
            m = re.match(r"(\d+-\d+-\d+ \d+:\d+:\d+),(\d+) .*?\| (TASK \[.*?\]|PLAY RECAP)", line)
            if m:
                stamps.append((time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000,
                               m.group(3)))
    names = [n for dummy, n in stamps]
    start = "TASK [Note the start of the hand-off]"
    first = names.index(start) if start in names else 0
    return [(round(t2 - t1, 3), n[6:-1]) for (t1, n), (t2, dummy) in zip(stamps[first:], stamps[first + 1:])]


def handoff_playbook(work, ev, method):
    """(rc, seconds of the hand-off as a command of its own, in-playbook seconds, the hand-off's start as
    time.time(), recap, the 8 slowest tasks) of HANDOFF_PLAY."""
    with open(os.path.join(work, "handoff.yml"), "w") as f:
        f.write(HANDOFF_PLAY)
    with open(os.path.join(work, "handoff.json"), "w") as f:
        # the play chooses the drain's selection: the pipeline's (the server's port) or the run's tag
        json.dump(dict({k: v for k, v in ev.items() if k != "gpu_drain_cmdline_pattern"}, handoff_method=method), f)
    log = os.path.join(work, "handoff-%s.log" % method)
    if os.path.exists(log):
        os.remove(log)  # Ansible appends: each command's tasks alone
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_COLLECTIONS_PATH=ensure_collection_link(), ANSIBLE_LOG_PATH=log)
    argv = ansible_bin("ansible-playbook") + ["-i", "localhost,", "-c", "local", os.path.join(work, "handoff.yml"),
                                              "-e", "@" + os.path.join(work, "handoff.json"),
                                              "-e", "ansible_python_interpreter=" + sys.executable]
    t0 = time.monotonic()
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    wall = time.monotonic() - t0
    found = re.search(r"handoff_in_playbook_s=([0-9.]+) handoff_t0=([0-9.]+) before_handoff_s=([0-9.]+)", p.stdout)
    recap = [line for line in p.stdout.splitlines() if line.startswith("localhost")]
    recap = recap[-1] if recap else p.stdout[-2000:]
    if not found:
        return p.returncode, round(wall, 3), None, None, recap, []
    inside, handoff_t0, before = (float(x) for x in found.groups())
    slowest = sorted(task_times(log), reverse=True)[:8]
    return p.returncode, round(wall - before, 3), round(inside, 3), handoff_t0, recap, slowest


def still_there(pids):
    """(running, unreaped) of pids: those still running, and those that exited but whose parent has not yet
    reaped them (zombies hold no memory and no device; reaping an orphan is PID 1's work, not the drain's)."""
    running, unreaped = [], []
    for pid in pids:
        try:
            (unreaped if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE else running).append(pid)
        except psutil.NoSuchProcess:
            pass
    return running, unreaped


def role_round(a, tp, work, inflight=None, method="pipeline"):
    """Start with the role, then the hand-off playbook; inflight = (shutdown_timeout, requests, max_tokens)."""
    tag = "gpuflow-bench-%s" % uuid.uuid4().hex[:10]
    port = free_port()
    extra = {}
    if inflight:
        extra = {"vllm_server_shutdown_timeout": inflight[0], "vllm_server_max_model_len": 2048}
    # the default drain window (shutdown_timeout 30) stays; a hung stop costs 60 s here, not 300
    ev, pidfile = server_vars("bench", a.model, a.venv, work, tp, tag, port, vllm_server_stop_timeout=60, **extra)
    gpus = list(range(tp))
    baseline = used_mib(gpus)
    rc, wall, recap = playbook(work, ev, "start")
    out = {"start_rc": rc, "start_s": wall}
    if rc != 0:
        out["start_recap"] = recap
        return out
    server = server_tree(pidfile)
    out["server_processes"] = sorted(server.values())
    holders = Holders("cuda", os.path.join(work, "holders"))
    try:
        watched = {"unrelated_python": holders.idle("vllm-cpu-job"),
                   "management_client": holders.hold(gpus[:1], management_client=True)["pid"]}
        clients = []
        if inflight:
            clients = start_requests(port, tag, inflight[1], inflight[2])
            time.sleep(a.inflight_after)
        watch = MemoryWatch(gpus, baseline)
        watch.start()
        rc, wall, inside, handoff_t0, recap, slowest = handoff_playbook(work, ev, method)
        out.update(method=method, handoff_rc=rc, ready_s=wall, in_playbook_s=inside, recap=recap,
                   slowest_tasks=slowest)
        time.sleep(0.3)
        watch.stop.set()
        out["memory_free_s"] = watch.free_at(handoff_t0) if handoff_t0 else None
        for c in clients:
            c.join(timeout=120)
        if clients:
            out["requests"] = summarize_requests(clients, inflight[2])
        holders.reap()
        out["collateral"] = sorted(k for k, pid in watched.items() if not holders.alive(pid))
        out["server_left"], out["server_unreaped"] = still_there(server)
        out["freed"] = at_baseline(used_mib(gpus), baseline)
    finally:
        holders.cleanup()
    out["tag"], out["port"] = tag, port
    return out


def seed_round(a, tp, work, role):
    """The recipe on the same server (the argv and environment the role wrote under work/etc for the instance
    "bench"), in its own PID namespace."""
    out_file = os.path.join(work, "seed-%s.json" % uuid.uuid4().hex[:8])
    argv = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, os.path.abspath(__file__), "seed-ns",
            "--argv-file", os.path.join(work, "etc", "bench.argv.json"), "--env-file", os.path.join(work, "etc", "bench.env"),
            "--tag", role["tag"],
            "--port", str(role["port"]), "--gpus", ",".join(str(g) for g in range(tp)), "--work", work,
            "--log", os.path.join(work, "seed-server.log"), "--out", out_file]
    t0 = time.monotonic()
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900, check=False)
    try:
        with open(out_file) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {"error": "no result", "output": p.stdout.decode(errors="replace")[-2000:]}
    res["namespace_rc"] = p.returncode
    res["with_start_s"] = round(time.monotonic() - t0, 2)
    return res


class Request(threading.Thread):
    """One streamed completion; records the tokens received and how it ended."""

    def __init__(self, port, tag, max_tokens):
        super().__init__(daemon=True)
        self.url = "http://127.0.0.1:%d/v1/completions" % port
        self.body = {"model": tag, "prompt": "the model", "max_tokens": max_tokens, "ignore_eos": True,
                     "stream": True, "temperature": 0}
        self.tokens, self.finish, self.error = 0, None, None

    def run(self):
        req = urllib.request.Request(self.url, data=json.dumps(self.body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    self.tokens += 1
                    self.finish = choice.get("finish_reason") or self.finish
        except Exception as e:  # a cut connection is a result here, not a failure of the script
            self.error = repr(e)[:200]


def start_requests(port, tag, n, max_tokens):
    clients = [Request(port, tag, max_tokens) for dummy in range(n)]
    for c in clients:
        c.start()
    return clients


def summarize_requests(clients, max_tokens):
    complete = [c for c in clients if c.finish == "length" and c.tokens >= max_tokens]
    return {"sent": len(clients), "completed": len(complete), "cut_short": len(clients) - len(complete),
            "tokens_received": sorted(c.tokens for c in clients), "finish_reasons": sorted({str(c.finish) for c in clients}),
            "errors": sorted({c.error for c in clients if c.error})[:3]}


def med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def run_tp(a, tp, save):
    """Rounds of three hand-offs, each of a fresh server: pipeline, the seed's recipe, drain. save(part) after each."""
    work = os.path.join(a.work, "tp%d" % tp)
    rounds = []
    for n in range(a.rounds):
        role = role_round(a, tp, work, method="pipeline")
        seed = seed_round(a, tp, work, role) if role.get("start_rc") == 0 else {"error": "the role's start failed"}
        drain = role_round(a, tp, work, method="drain")
        for name, r in (("pipeline", role), ("seed", seed), ("drain", drain)):
            shown = ("start_s", "ready_s", "in_playbook_s", "memory_free_s", "collateral", "freed", "error")
            print("tp%d round %d %s" % (tp, n + 1, name), {k: r.get(k) for k in shown if k in r}, flush=True)
        rounds.append({"role": role, "seed": seed, "drain": drain})
        save(tp_summary(rounds))
    return tp_summary(rounds)


def tp_summary(rounds):
    roles, seeds, drains = ([r[k] for r in rounds] for k in ("role", "seed", "drain"))
    ok = all(r.get("handoff_rc") == 0 and r.get("freed") and not r.get("server_left") for r in roles + drains) and all(
        s.get("freed") and "error" not in s for s in seeds)
    return {"rounds": rounds, "ok": ok,
            "role_ready_s": med(r.get("ready_s") for r in roles), "seed_ready_s": med(s.get("ready_s") for s in seeds),
            "drain_ready_s": med(r.get("ready_s") for r in drains),
            "role_in_playbook_s": med(r.get("in_playbook_s") for r in roles),
            "drain_in_playbook_s": med(r.get("in_playbook_s") for r in drains),
            "role_memory_free_s": med(r.get("memory_free_s") for r in roles),
            "drain_memory_free_s": med(r.get("memory_free_s") for r in drains),
            "seed_memory_free_s": med(s.get("memory_free_s") for s in seeds),
            "role_collateral_kills": sum(len(r.get("collateral", [])) for r in roles + drains),
            "seed_collateral_kills": sum(len(s.get("collateral", [])) for s in seeds),
            "role_start_s": med(r.get("start_s") for r in roles + drains)}


def write(result, a):
    """The summary from what has run so far, written to --out (after every round: a cut-off run keeps its data)."""
    tps = sorted(result["tp"])
    per = {tp: result["tp"][tp] for tp in tps}

    def ratio(num, den):
        return {tp: round(per[tp][num] / per[tp][den], 2) for tp in tps if per[tp][num] and per[tp][den]}
    result.update(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), machine=machine(), commit=commit())
    result["summary"] = dict(
        ratio_in_playbook=ratio("seed_ready_s", "role_in_playbook_s"),
        nvml_init_s=result.get("nvml_init_s"),
        **{key: {tp: per[tp][key] for tp in tps} for key in (
            "role_ready_s", "seed_ready_s", "drain_ready_s", "role_in_playbook_s", "drain_in_playbook_s",
            "role_collateral_kills", "seed_collateral_kills", "role_memory_free_s", "drain_memory_free_s",
            "seed_memory_free_s")},
        ratio=ratio("seed_ready_s", "role_ready_s"), ratio_drain=ratio("seed_ready_s", "drain_ready_s"),
        ratio_drain_in_playbook=ratio("seed_ready_s", "drain_in_playbook_s"),
        rounds={tp: len(per[tp]["rounds"]) for tp in tps})
    for key, r in result["inflight"].items():
        result["summary"]["inflight_" + key] = {"ready_s": r.get("ready_s"), "in_playbook_s": r.get("in_playbook_s"), **{
            k: (r.get("requests") or {}).get(k) for k in ("sent", "completed", "cut_short")}}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    ns = sub.add_parser("seed-ns")
    for opt in ("--argv-file", "--env-file", "--tag", "--gpus", "--work", "--log", "--out"):
        ns.add_argument(opt, required=True)
    ns.add_argument("--port", type=int, required=True)
    ap.add_argument("--tp", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inflight", action="store_true")
    ap.add_argument("--inflight-requests", type=int, default=16)
    ap.add_argument("--inflight-tokens", type=int, default=1900)
    ap.add_argument("--inflight-after", type=float, default=2.0)
    ap.add_argument("--work", default="/tmp/handoff-bench")
    ap.add_argument("--merge", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.cmd == "seed-ns":
        return seed_in_namespace(a)
    os.makedirs(a.work, exist_ok=True)
    a.venv = venv_with_vllm(os.path.join(a.work, "venv"))
    a.model = os.path.join(a.work, "tiny")
    # the venv has transformers (from the carried vLLM); the controller's Python need not
    subprocess.run([os.path.join(a.venv, "bin", "python"), os.path.join(REPO, "tools", "make_tiny_model.py"), a.model],
                   check=True)
    result = {"name": "handoff_vllm_h200", "tp": {}, "inflight": {}}
    if a.merge and os.path.exists(a.out):
        with open(a.out) as f:
            result = json.load(f)
    result["nvml_init_s"] = nvml_init_seconds()
    # ansible's own first run writes its bytecode caches; every measured command after it is warm
    playbook(os.path.join(a.work, "warmup"), {"vllm_server_state": "stopped", "vllm_server_name": "warmup",
                                              "vllm_server_home": os.path.join(a.work, "warmup"),
                                              "vllm_server_config_dir": os.path.join(a.work, "warmup", "etc"),
                                              "vllm_server_user": "", "vllm_server_install": False}, "warmup")

    def keeper(tp):
        def keep(part):
            result["tp"][str(tp)] = part
            write(result, a)
        return keep

    for tp in a.tp if a.rounds > 0 else []:
        result["tp"][str(tp)] = run_tp(a, tp, keeper(tp))
    if a.inflight:
        for timeout in (0, 30):
            r = role_round(a, a.tp[0], os.path.join(a.work, "inflight"),
                           inflight=(timeout, a.inflight_requests, a.inflight_tokens))
            shown = ("ready_s", "in_playbook_s", "memory_free_s", "requests")
            print("in flight, shutdown_timeout %d:" % timeout, {k: r.get(k) for k in shown}, flush=True)
            result["inflight"]["shutdown_timeout_%d" % timeout] = dict(r, tp=a.tp[0])
    write(result, a)
    print(json.dumps(result["summary"]))
    return 0 if all(result["tp"][tp]["ok"] for tp in result["tp"]) else 1


if __name__ == "__main__":
    sys.exit(main())

"""EAGLE-3 training through the eagle3_train role beside speculators' own `torchrun` on one H200:
the training throughput each gets from the same GPU, inputs and arguments.

Inputs: tests/gpu/train/make_inputs.py's output (a random-weight Llama verifier, its hidden
states and an extraction MANIFEST.json as hidden_state_extract writes it). On GPU 0, R rounds,
alternating which side goes first (round 0 the role, round 1 direct, ...):
  * role: `ansible-playbook` with gpuflow.eagle3.eagle3_train into a fresh output directory
    (max_steps N, epochs 1, seq len 4096, draft vocabulary 8192, sub-epoch checkpoints every
    quarter epoch, a metric record every step, the run_h200.py 'one' variables); tokens/s = the
    median of profile.tokens_per_s over metrics.jsonl's train records with global_step >= 10
    (compilation and warm-up left out);
  * direct: `python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 1
    -m speculators.train <the role round's MANIFEST inputs.args>` with the speculators venv's
    python, --save-path and --log-dir in a directory of its own, --data-path a directory of its
    own holding links to the role's data/ entries except d2t-*/t2d-* (and the role's SOURCE.json),
    so it builds its vocabulary mapping as each fresh role round does. The environment is the
    role job's: CUDA_VISIBLE_DEVICES=0, the NCCL multicast-off variables, the same
    TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR (one warm compile cache for both sides), HF offline,
    TQDM_MININTERVAL=30, and COLUMNS=400 (Rich's console width). tokens/s = the median over
    global_step >= 10 of the `profile/tokens_per_s=` values speculators prints on its console
    (3 significant digits, e.g. 2.93e+04), each paired with the `global_step=` that follows it in
    the same record (a record Rich wraps over two lines still pairs).
Both numbers come from the same code in speculators' trainer (tokens of a step / its time), so
the ratio (median of role rounds / median of direct rounds) shows what the role changes in the
steps themselves: its launcher (event log, parent-death signal), DataLoader workers, the
controller's polling beside the job. An NVML thread samples every GPU every 0.5 s in each run:
peak memory used, and the median utilisation over the samples with more than 512 MiB above the
run's first sample (while a process holds the GPU, so Ansible's and Python's start-up times do not
dilute it).

Results: bench/results/train_h200.json (name, date, machine, commit, params, rounds, summary
{role_tps, direct_tps, ratio, ratio_paired_median, gpu, gpus, role/direct peak MiB and median
util %}) and a table on stdout.

On the GPU machine, from the repository root:
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  python3 tests/gpu/train/trainlib.py setup
  /tmp/specvenv/bin/python tests/gpu/train/make_inputs.py --out /tmp/gk
  python3 bench/train_h200.py --inputs /tmp/gk [--rounds 2] [--steps 80]
Rehearsal on the CPU (the venv .cache/venvs/speculators, seq len 512, draft vocabulary 256; the
direct side starts the role's gpuflow_train_launch.py instead of `-m speculators.train`, since
speculators 0.9.0 alone cannot train without an accelerator; results to the work directory):
  .venv/bin/python bench/train_h200.py --device cpu --inputs /tmp/gk2 --rounds 1 --steps 20 --epochs 2
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "gpu", "train"))

import trainlib  # noqa: E402

LAUNCHER = os.path.join(REPO, "roles", "eagle3_train", "files", "gpuflow_train_launch.py")
NUMBER = r"([-+0-9.eE]+|nan|inf)"
TPS = re.compile(r"profile/tokens_per_s=" + NUMBER)
STEP = re.compile(r"\bglobal_step=(\d+)")
REPLACED = ("--save-path", "--log-dir", "--data-path")


def console_tps(path):
    """[(global_step, tokens/s)] from speculators' console: each tokens/s with the global_step after it."""
    pairs, pending = [], None
    with open(path, errors="replace") as f:
        for line in f:
            for m in sorted(list(TPS.finditer(line)) + list(STEP.finditer(line)), key=lambda m: m.start()):
                if m.re is TPS:
                    pending = float(m.group(1))
                elif pending is not None:
                    pairs.append((int(m.group(1)), pending))
                    pending = None
    return pairs


def with_own_paths(args, d):
    """The role's speculators arguments with --save-path, --log-dir and --data-path under d."""
    out = list(args)
    for flag, sub in zip(REPLACED, ("checkpoints", "logs", "data")):
        out[out.index(flag) + 1] = os.path.join(d, sub)
    return out


def own_data(role_data, data):
    """data/ of links to what the role's data/ links or holds, less its vocabulary mapping and SOURCE.json."""
    os.makedirs(data)
    for name in os.listdir(role_data):
        if not name.startswith(("d2t-", "t2d-")) and name != "SOURCE.json":
            os.symlink(os.path.realpath(os.path.join(role_data, name)), os.path.join(data, name))


def peak_and_util(gpu, index="0"):
    g = (gpu or {}).get(index) or {}
    return g.get("max_used_mib"), g.get("median_util_active_pct")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", required=True, help="make_inputs.py's --out")
    ap.add_argument("--work", default=os.path.join(REPO, ".cache", "bench", "train_h200"),
                    help="the rounds' directories (emptied first)")
    ap.add_argument("--out", help="results JSON (default bench/results/train_h200.json; on cpu WORK/train_cpu.json)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80, help="max_steps of every run")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--timeout", type=int, default=600,
                    help="seconds one run (role or direct) may take; a cold role round takes about 4 min")
    a = ap.parse_args()
    hidden_states = os.path.join(os.path.abspath(a.inputs), "hidden_states")
    if not os.path.exists(os.path.join(hidden_states, "MANIFEST.json")):
        ap.error("no %s/MANIFEST.json: run make_inputs.py first" % hidden_states)
    work = os.path.abspath(a.work)
    out_json = a.out or (os.path.join(REPO, "bench", "results", "train_h200.json") if a.device == "cuda"
                         else os.path.join(work, "train_cpu.json"))
    trainlib.export_nccl_env()
    if a.device == "cuda":
        trainlib.setup_venv()
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    venv = trainlib.tools(a.device)[0]
    cuda = a.device == "cuda"
    hosts = {"localhost": {"eagle3_train_gpus": [0]} if cuda else {}}
    state = {}

    def role_round(r):
        d = os.path.join(work, "role-%d" % r)
        out = os.path.join(d, "out")
        ev = trainlib.role_vars(a.device, hidden_states, out, os.path.join(work, "lib"), a.steps, a.epochs,
                                name="bench-%d" % r)
        pb = trainlib.Playbook(a.device, d, ev, hosts)
        with trainlib.GpuSampler(cuda) as gpu:
            rc, wall = pb.run(a.timeout)
        m = trainlib.read_json(os.path.join(out, "MANIFEST.json"), {})
        if rc != 0 or m.get("status") != "complete":
            sys.exit("role round %d failed (rc %s):\n%s" % (r, rc, "\n".join(trainlib.tail(pb.log))))
        state["args"], state["data"] = m["inputs"]["args"], os.path.join(out, "data")
        evs = trainlib.events(out)
        job = trainlib.read_json(os.path.join(out, "nodes", "0", "progress.json"), {})
        return {"tps": trainlib.role_tps(evs), "steps": m["steps"], "final_loss": m["final_loss"], "wall_s": wall,
                "job_elapsed_s": job.get("elapsed_s"), "gpu": gpu.summary(), "out": out}

    def direct_round(r):
        d = os.path.join(work, "direct-%d" % r)
        os.makedirs(d)
        own_data(state["data"], os.path.join(d, "data"))
        entry = ["-m", "speculators.train"] if cuda else \
            [LAUNCHER, "--events", os.path.join(d, "events.jsonl"), "--node-rank", "0"]
        argv = [os.path.join(venv, "bin", "python"), "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", "1"] + entry + with_own_paths(state["args"], d)
        env = dict(os.environ, **trainlib.NCCL_ENV, **trainlib.COMPILE_CACHE, **trainlib.HF_OFFLINE,
                   HF_HOME=os.path.join(d, ".cache", "huggingface"), XDG_CACHE_HOME=os.path.join(d, ".cache"),
                   TQDM_MININTERVAL="30", COLUMNS="400")
        if cuda:
            env["CUDA_VISIBLE_DEVICES"] = "0"
        log = os.path.join(d, "console.log")
        with trainlib.GpuSampler(cuda) as gpu, open(log, "w") as f:
            f.write(" ".join(argv) + "\n")
            f.flush()
            t0 = time.monotonic()
            proc = subprocess.Popen(argv, cwd=d, env=env, stdout=f, stderr=subprocess.STDOUT)
            try:
                rc = proc.wait(a.timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()  # torchrun stops its workers on SIGTERM (they run in sessions of their own)
                rc = proc.wait()
            wall = round(time.monotonic() - t0, 1)
        pairs = console_tps(log)
        if rc != 0 or not pairs:
            sys.exit("direct round %d failed (rc %d, %d tokens/s records):\n%s"
                     % (r, rc, len(pairs), "\n".join(trainlib.tail(log))))
        return {"tps": trainlib.median_tps(pairs), "steps": max(step for step, tps in pairs) + 1, "wall_s": wall,
                "gpu": gpu.summary(), "log": log}

    rounds = {"role": [], "direct": []}
    for r in range(a.rounds):
        order = (("role", role_round), ("direct", direct_round))
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            rounds[name].append(fn(r))
            x = rounds[name][-1]
            print("round %d %-6s %8.1f tokens/s, %d steps, %.1f s" % (r, name, x["tps"], x["steps"], x["wall_s"]),
                  flush=True)

    role_tps = statistics.median(x["tps"] for x in rounds["role"])
    direct_tps = statistics.median(x["tps"] for x in rounds["direct"])
    paired = [x["tps"] / y["tps"] for x, y in zip(rounds["role"], rounds["direct"])]
    mach = trainlib.machine(a.device)
    role_mem = [peak_and_util(x["gpu"]) for x in rounds["role"]]
    direct_mem = [peak_and_util(x["gpu"]) for x in rounds["direct"]]

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    summary = {
        "role_tps": role_tps, "direct_tps": direct_tps, "ratio": round(role_tps / direct_tps, 3),
        "ratio_paired_median": round(statistics.median(paired), 3),
        "ratio_paired_min_max": [round(min(paired), 3), round(max(paired), 3)],
        "gpu": (mach.get("gpus") or ["cpu"])[0], "gpus": len(mach.get("gpus") or []),
        "role_peak_mib": max((peak for peak, util in role_mem if peak is not None), default=None),
        "direct_peak_mib": max((peak for peak, util in direct_mem if peak is not None), default=None),
        "role_util_pct": med(util for peak, util in role_mem), "direct_util_pct": med(util for peak, util in direct_mem),
    }
    result = {
        "name": "train_h200", "date": trainlib.utc_now(), "machine": mach, "commit": trainlib.git_commit(),
        "params": {"rounds": a.rounds, "steps": a.steps, "epochs": a.epochs, "device": a.device,
                   "inputs": os.path.abspath(a.inputs), **trainlib.SHAPES[a.device], "checkpoint_freq": 0.25,
                   "log_freq": 1, "tps_from_global_step": 10, "args": state["args"],
                   "extract": {k: (trainlib.read_json(os.path.join(hidden_states, "MANIFEST.json")) or {}).get(k)
                               for k in ("samples", "tokens")}},
        "rounds": rounds, "summary": summary,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
    with open(out_json, "w") as f:
        # the work directory's path is this machine's: the file names it <work>
        f.write(json.dumps(result, indent=1).replace(json.dumps(work)[1:-1], "<work>") + "\n")

    def cell(v, spec):
        return "-" if v is None else spec % v

    print("\n%-8s %12s %10s %10s" % ("", "tokens/s", "peak MiB", "util %"))
    for side in ("role", "direct"):
        print("%-8s %12.1f %10s %10s" % (side, summary[side + "_tps"], cell(summary[side + "_peak_mib"], "%d"),
                                         cell(summary[side + "_util_pct"], "%.0f")))
    print("ratio role/direct %.3f (paired median %.3f, range %s); %s x%d; %s"
          % (summary["ratio"], summary["ratio_paired_median"], summary["ratio_paired_min_max"], summary["gpu"],
             summary["gpus"], out_json))


if __name__ == "__main__":
    main()

"""gpuflow.eagle3.eagle3_train through `ansible-playbook` on real GPUs: four runs, each into its own
output directory under --work, on the inputs tests/gpu/train/make_inputs.py built.

  one         GPU 0, max_steps N: MANIFEST.json complete, steps == N, the drafter loads.
  kill        GPU 0, max_steps N, the playbook in the background; after the first sub-epoch
              checkpoint (a save_end with local_step > 0 in metrics.jsonl) and 2 more train steps,
              SIGKILL to the job's process group (the job, nodes/0/job.json, leads its own session:
              torchrun dies with it, the trainers get SIGTERM from their parent-death signal and
              save interrupted/). Then the playbook again: "Resuming mid-epoch" in train.log, the
              first step after the resume in 0 < step <= the last step before the kill + 1, every
              step from there to N-1 exactly once, MANIFEST complete with steps == N. Only that
              process group is ever signalled.
  two_procs   GPUs 0 and 1 on one host (two torchrun processes): "dp_size=2" in nodes/0/train.log,
              MANIFEST complete with inputs.nproc_per_node == 2.
  two_nodes   two inventory hosts (node-a GPU 0, node-b GPU 1, both local connections, rendezvous
              on 127.0.0.1): both train.logs show "--nnodes 2 --node-rank <r>", "dp_size=2" in one
              of them, MANIFEST complete with inputs.nnodes == 2.
With two ranks an epoch has half the steps, so those two runs accept fewer than N steps when all
epochs ended first; one and kill need N steps within --epochs (the failed check shows the steps
per epoch).
make_inputs.py's defaults (256 rows of 1024-2048 tokens) pack into roughly 85 steps of 4096 tokens
per epoch on one GPU.

Every run records rc, wall seconds, steps, final loss, the median tokens/s of metrics.jsonl
(rank 0's, so per GPU; steps >= 10 when there are 5 of them), and per GPU the peak memory used and
the median utilisation (NVML every 0.5 s; also over the samples with a process on the GPU).
Results: --out JSON ({name, date, machine, commit, params, runs, passed}; for a failed run the last
40 lines of each node's train.log and of the playbook output), a table on stdout, exit status 1
when a check failed.

On the GPU machine (2x H200, no internet), from the repository root:
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  python3 tests/gpu/train/trainlib.py setup          # /tmp/specvenv from .whl/ (run_h200.py also does it)
  /tmp/specvenv/bin/python tests/gpu/train/make_inputs.py --out /tmp/gk
  python3 tests/gpu/train/run_h200.py --inputs /tmp/gk --work /tmp/gk-train --out $OUT/train_h200_runs.json
GPUFLOW_COMMIT names the commit where the copy has no .git. A run takes minutes (Ansible, the dry
run, compilation while /tmp/inductor-cache is cold); where one command may last 10 minutes, split
--runs over several calls (one,kill then two_procs,two_nodes), each with its own --out. A playbook
past --timeout is ended and the role's stop action ends its jobs (eagle3_train_stop_timeout 120).

Rehearsal on this CPU machine (the role's CPU adapter over gloo: two_procs is nproc_per_node 2
without GPUs, and the gloo start-up logs "world_size=2" where NCCL's logs "dp_size=2"):
  .venv/bin/python tests/gpu/train/run_h200.py --device cpu --inputs /tmp/gk2 --work /tmp/gk2-train \\
      --out /tmp/gk2-train/runs.json --steps 30 --epochs 2
"""
import argparse
import json
import os
import shutil
import signal
import socket
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import trainlib  # noqa: E402

RUNS = ("one", "kill", "two_procs", "two_nodes")
# what the start of two-process data parallelism logs: speculators (NCCL), the role's CPU adapter (gloo)
DIST_MARK = {"cuda": "dp_size=2", "cpu": "world_size=2"}


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Run:
    def __init__(self, ctx, name, hosts, **extra):
        self.ctx, self.name = ctx, name
        self.out = os.path.join(ctx.work, name, "out")
        shutil.rmtree(os.path.join(ctx.work, name), ignore_errors=True)
        ev = trainlib.role_vars(ctx.device, ctx.hidden_states, self.out, os.path.join(ctx.work, "lib"), ctx.steps,
                                ctx.epochs, name="gk-" + name.replace("_", "-"), **extra)
        self.playbook = trainlib.Playbook(ctx.device, os.path.join(ctx.work, name), ev, hosts)
        self.nodes = len(hosts)
        self.checks = []
        self.data = {"out": self.out}

    def check(self, desc, ok, detail=None):
        self.checks.append({"check": desc, "ok": bool(ok), **({"detail": detail} if detail is not None else {})})
        print("    [%s] %s%s" % ("ok" if ok else "FAIL", desc, "" if detail is None else ": %s" % (detail,)),
              flush=True)
        return ok

    def log(self, rank=0):
        try:
            with open(os.path.join(self.out, "nodes", str(rank), "train.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def manifest_checks(self, all_steps=True):
        """The end state every run shares: a complete MANIFEST.json, N steps (all_steps; else N or fewer
        when every epoch ended first: data parallelism splits an epoch's batches between the ranks),
        and a drafter that loads."""
        m = trainlib.read_json(os.path.join(self.out, "MANIFEST.json"), {})
        epochs = [e for e in trainlib.events(self.out) if e.get("kind") == "epoch"]
        detail = {"steps": m.get("steps"), "steps_per_epoch": [e["steps_per_epoch"] for e in epochs],
                  "epochs_completed": m.get("epochs_completed")}
        self.check("MANIFEST.json status complete", m.get("status") == "complete", m.get("status"))
        if all_steps:
            self.check("steps == %d" % self.ctx.steps, m.get("steps") == self.ctx.steps, detail)
        else:
            self.check("steps == %d, or fewer after all %d epoch(s)" % (self.ctx.steps, self.ctx.epochs),
                       m.get("steps") == self.ctx.steps or (m.get("steps") or 0) < self.ctx.steps
                       and m.get("epochs_completed") == self.ctx.epochs, detail)
        self.check("drafter/ loads", (m.get("loaded") or {}).get("ok") is True, m.get("loaded"))
        return m

    def measure(self, manifest):
        evs = trainlib.events(self.out)
        train = trainlib.train_records(evs)
        self.data.update(steps=manifest.get("steps"), final_loss=manifest.get("final_loss"),
                         tokens_per_s_median=trainlib.role_tps(evs),
                         train_records=len(train), checkpoint_save_s_median=manifest.get("checkpoint_save_s_median"),
                         validation=manifest.get("validation"))

    def result(self):
        passed = bool(self.checks) and all(c["ok"] for c in self.checks)
        res = dict(self.data, passed=passed, checks=self.checks)
        if not passed:
            res["logs"] = {"playbook.log": trainlib.tail(self.playbook.log)}
            for r in range(self.nodes):
                log = os.path.join(self.out, "nodes", str(r), "train.log")
                res["logs"]["nodes/%d/train.log" % r] = trainlib.tail(log)
        return res


def single(ctx):
    return {"localhost": {"eagle3_train_gpus": [0]} if ctx.device == "cuda" else {}}


def run_one(ctx):
    run = Run(ctx, "one", single(ctx))
    with trainlib.GpuSampler(ctx.device == "cuda") as gpu:
        rc, wall = run.playbook.run(ctx.timeout)
    run.data.update(rc=rc, wall_s=wall, gpu=gpu.summary())
    run.check("playbook rc 0 within %d s" % ctx.timeout, rc == 0, rc)
    run.measure(run.manifest_checks())
    return run


def job_group(out):
    """The job's PID when it is this run's e3_train.py job and leads its own process group."""
    pid = (trainlib.read_json(os.path.join(out, "nodes", "0", "job.json")) or {}).get("pid")
    if not isinstance(pid, int) or pid <= 1:
        return None
    c = trainlib.cmdline(pid)
    try:
        leads = os.getpgid(pid) == pid
    except ProcessLookupError:
        return None
    return pid if leads and "e3_train.py" in c and " run " in c and os.path.abspath(out) in c else None


def run_kill(ctx):
    run = Run(ctx, "kill", single(ctx))
    out = run.out
    t0 = time.monotonic()
    with trainlib.GpuSampler(ctx.device == "cuda") as gpu:
        proc = run.playbook.start()

        def sub_epoch_save():
            return [e for e in trainlib.events(out) if e.get("kind") == "save_end" and e.get("local_step", 0) > 0
                    and not e.get("set_aside")]

        saved = trainlib.wait_until(lambda: sub_epoch_save() or proc.poll() is not None, ctx.timeout)
        if not run.check("a sub-epoch checkpoint saved while the first playbook runs",
                         saved and sub_epoch_save() and proc.poll() is None, proc.poll()):
            run.playbook.abandon(proc)
            run.data.update(rc=proc.returncode, wall_s=round(time.monotonic() - t0, 1), gpu=gpu.summary())
            return run
        save = sub_epoch_save()[0]
        run.data["save_end"] = save

        def after_save():
            return [e["global_step"] for e in trainlib.train_records(trainlib.events(out)) if e["time"] > save["time"]]

        trainlib.wait_until(lambda: len(after_save()) >= 2 or proc.poll() is not None, ctx.timeout)
        pid = job_group(out)
        if not run.check("the job (nodes/0/job.json) runs and leads its process group", pid and proc.poll() is None,
                         pid):
            run.playbook.abandon(proc)
            run.data.update(rc=proc.returncode, wall_s=round(time.monotonic() - t0, 1), gpu=gpu.summary())
            return run
        before_kill = max(e["global_step"] for e in trainlib.train_records(trainlib.events(out)))
        os.killpg(pid, signal.SIGKILL)
        run.data.update(killed_job_pid=pid, last_step_before_kill=before_kill,
                        kill_after_start_s=round(time.monotonic() - t0, 1))
        trainlib.wait_until(lambda: proc.poll() is not None, ctx.timeout, 0.5)
        first_rc = proc.poll()
        run.check("the first playbook ends failed (its job was killed)", first_rc not in (None, 0), first_rc)
        ended = trainlib.wait_until(lambda: not trainlib.trainer_pids(out), 300, 0.5)
        run.check("the orphaned trainers end on their own (parent-death SIGTERM)", ended, trainlib.trainer_pids(out))
        interrupted = os.path.join(out, "checkpoints", "interrupted", "model.safetensors")
        run.data["interrupted_checkpoint"] = os.path.exists(interrupted)
        seen = len(trainlib.events(out))
        rc, wall = run.playbook.run(ctx.timeout)
    run.data.update(rc=rc, first_rc=first_rc, rerun_wall_s=wall, wall_s=round(time.monotonic() - t0, 1),
                    gpu=gpu.summary())
    run.check("the rerun's playbook rc 0 within %d s" % ctx.timeout, rc == 0, rc)
    run.check('"Resuming mid-epoch" in nodes/0/train.log', "Resuming mid-epoch" in run.log())
    after = [e["global_step"] for e in trainlib.train_records(trainlib.events(out)[seen:])]
    first = after[0] if after else None
    run.data["first_step_after_resume"] = first
    run.check("0 < first step after the resume <= last step before the kill + 1",
              first is not None and 0 < first <= before_kill + 1, {"first": first, "before_kill": before_kill})
    run.check("steps from the resume to %d, each once" % (ctx.steps - 1),
              first is not None and after == list(range(first, ctx.steps)),
              None if first is not None and after == list(range(first, ctx.steps)) else after)
    run.measure(run.manifest_checks())
    return run


def run_two_procs(ctx):
    hosts = {"localhost": {"eagle3_train_gpus": [0, 1]} if ctx.device == "cuda" else {"eagle3_train_nproc_per_node": 2}}
    run = Run(ctx, "two_procs", hosts)
    with trainlib.GpuSampler(ctx.device == "cuda") as gpu:
        rc, wall = run.playbook.run(ctx.timeout)
    run.data.update(rc=rc, wall_s=wall, gpu=gpu.summary())
    run.check("playbook rc 0 within %d s" % ctx.timeout, rc == 0, rc)
    run.check('"%s" in nodes/0/train.log' % DIST_MARK[ctx.device], DIST_MARK[ctx.device] in run.log(0))
    m = run.manifest_checks(all_steps=False)
    run.check("MANIFEST inputs.nproc_per_node == 2", (m.get("inputs") or {}).get("nproc_per_node") == 2,
              (m.get("inputs") or {}).get("nproc_per_node"))
    run.measure(m)
    return run


def run_two_nodes(ctx):
    hosts = {"node-a": {"eagle3_train_gpus": [0]}, "node-b": {"eagle3_train_gpus": [1]}} if ctx.device == "cuda" \
        else {"node-a": {}, "node-b": {}}
    run = Run(ctx, "two_nodes", hosts, rdzv_host="127.0.0.1", rdzv_port=free_port())
    with trainlib.GpuSampler(ctx.device == "cuda") as gpu:
        rc, wall = run.playbook.run(ctx.timeout)
    run.data.update(rc=rc, wall_s=wall, gpu=gpu.summary())
    run.check("playbook rc 0 within %d s" % ctx.timeout, rc == 0, rc)
    for r in (0, 1):
        flags = "--nnodes 2 --node-rank %d" % r
        run.check("nodes/%d/train.log: %s" % (r, flags), flags in run.log(r))
    mark = DIST_MARK[ctx.device]
    run.check('"%s" in a node\'s train.log' % mark, any(mark in run.log(r) for r in (0, 1)))
    m = run.manifest_checks(all_steps=False)
    nnodes = (m.get("inputs") or {}).get("nnodes")
    run.check("MANIFEST inputs.nnodes == 2", nnodes == 2, nnodes)
    run.measure(m)
    return run


def fmt(v, spec="%s"):
    return "-" if v is None else spec % v


def table(runs, device):
    row = "%-10s %-6s %4s %8s %6s %9s %11s  %s"
    head = row % ("run", "result", "rc", "wall s", "steps", "loss", "tokens/s",
                  "GPU: peak MiB / median util % (with a process)" if device == "cuda" else "")
    lines = [head, "-" * len(head)]
    for name, r in runs.items():
        gpus = ", ".join("%s: %d / %s (%s)" % (i, g["max_used_mib"], g["median_util_pct"],
                                               fmt(g["median_util_active_pct"]))
                         for i, g in (r.get("gpu") or {}).items())
        lines.append(row % (
            name, "pass" if r["passed"] else "FAIL", fmt(r.get("rc")), fmt(r.get("wall_s")), fmt(r.get("steps")),
            fmt(r.get("final_loss"), "%.4f"), fmt(r.get("tokens_per_s_median"), "%.0f"), gpus))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", required=True, help="make_inputs.py's --out (its hidden_states/ is the role's input)")
    ap.add_argument("--work", required=True, help="the runs' output directories go under it (emptied per run)")
    ap.add_argument("--out", required=True, help="the results JSON")
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of %s" % ",".join(RUNS))
    ap.add_argument("--steps", type=int, default=60, help="max_steps of every run")
    ap.add_argument("--epochs", type=int, default=1, help="epochs (max_steps must fit in them)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a rehearsal without GPUs")
    ap.add_argument("--timeout", type=int, default=480,
                    help="seconds a playbook may run, and the kill run waits for each of its events; past it "
                         "the playbook is ended and the role's stop action ends its jobs")
    a = ap.parse_args()
    selected = [r for r in a.runs.split(",") if r]
    unknown = set(selected) - set(RUNS)
    if unknown:
        ap.error("unknown runs %s (choose from %s)" % (sorted(unknown), ",".join(RUNS)))
    a.work = os.path.abspath(a.work)
    a.hidden_states = os.path.join(os.path.abspath(a.inputs), "hidden_states")
    if not os.path.exists(os.path.join(a.hidden_states, "MANIFEST.json")):
        ap.error("no %s/MANIFEST.json: run make_inputs.py first" % a.hidden_states)

    trainlib.export_nccl_env()
    if a.device == "cuda":
        trainlib.setup_venv()
    os.makedirs(a.work, exist_ok=True)
    extract = trainlib.read_json(os.path.join(a.hidden_states, "MANIFEST.json"))
    result = {"name": "train_h200_runs", "date": trainlib.utc_now(), "machine": trainlib.machine(a.device),
              "commit": trainlib.git_commit(),
              "params": {"steps": a.steps, "epochs": a.epochs, "device": a.device, "inputs": os.path.abspath(a.inputs),
                         **trainlib.SHAPES[a.device], "checkpoint_freq": 0.25,
                         "extract": {"samples": extract["samples"], "tokens": extract["tokens"]}},
              "runs": {}}
    fns = {"one": run_one, "kill": run_kill, "two_procs": run_two_procs, "two_nodes": run_two_nodes}
    for name in selected:
        print("== %s" % name, flush=True)
        try:
            result["runs"][name] = fns[name](a).result()
        except Exception:  # pylint: disable=broad-except  # the other runs still run and are reported
            traceback.print_exc()
            result["runs"][name] = {"passed": False, "error": traceback.format_exc().splitlines()[-40:]}
        result["passed"] = all(r["passed"] for r in result["runs"].values())
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:  # after every run: a later hang still leaves the earlier results
            json.dump(result, f, indent=1)
            f.write("\n")
    print()
    print(table(result["runs"], a.device))
    print("\n%s: %s" % (a.out, "passed" if result["passed"] else "FAILED"))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

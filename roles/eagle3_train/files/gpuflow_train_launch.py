"""Run `speculators.train` (the same arguments) with four additions for gpuflow.eagle3.eagle3_train.

torchrun starts this file instead of `-m speculators.train`:

  torchrun ... gpuflow_train_launch.py --events FILE --node-rank N [--load-after RESULT] <speculators train arguments>
  gpuflow_train_launch.py --load-check CHECKPOINT VERIFIER

The second form loads a checkpoint with speculators, as vLLM will serve it beside its verifier, and prints
{"class", "parameters"} as JSON. --load-after does the same once speculators returns, on rank 0, with the
verifier of the training's arguments, and writes the result to RESULT ("ok", or "ok": false and "error"; the
checkpoint and its weights' size and mtime): for a dry run the checkpoint it saved at --save-path, for a
training the one its drafter is made from (drafter_checkpoint). The checkpoint is loaded in the process that
has speculators imported already (a second process costs a torch + speculators import, 6 to 9 CPU-s on a
2-core machine).

1. Events: every metric record speculators logs (train steps, validation) goes to FILE as
   one JSON line, exact values, rank 0 only; so do the start of each epoch (with the steps
   per epoch the data loader holds) and the start and end of every checkpoint save. The
   driver follows progress, knows when a save is in progress (a stop waits for it to end)
   and measures what a save costs.
2. A trainer whose torchrun is killed gets SIGTERM (the parent-death signal) instead of
   training on alone.
3. CPU adapter, applied only where torch sees no accelerator: speculators 0.9.0 places the
   model and batches on accelerator `local_rank`, autocasts for "cuda", synchronizes the
   accelerator and sets up distributed training with the accelerator's backend. Here the
   model and batches go to the CPU, autocast is the CPU's, synchronize is a no-op and
   distributed training uses gloo, so several processes (or hosts) can train together.
4. Online hidden states: a SIGTERM that lands during a hidden-state fetch stops the training
   (speculators' retries would otherwise swallow it; see keep_interrupts_through_online_fetches).
"""
import json
import logging
import os
import signal
import sys
import time


class EventLog(logging.Handler):
    """Appends one JSON line per record; rank 0 alone writes."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def write(self, record):
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=float, sort_keys=True) + "\n")

    def emit(self, record):
        msg = record.msg
        if not isinstance(msg, dict) or getattr(record, "hparams", False):
            return
        try:
            self.write(dict(msg, kind="val" if "val" in msg else "train", step=getattr(record, "step", None),
                            time=record.created))
        except (OSError, TypeError, ValueError):
            self.handleError(record)


def rank_zero():
    import torch.distributed as dist
    return not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0


def install_events(path):
    from speculators.train import cli, trainer

    handler = EventLog(path)
    setup_metric_logger = cli.setup_metric_logger

    def setup_with_events(*args, **kwargs):
        setup_metric_logger(*args, **kwargs)  # dictConfig: replaces the metric logger's handlers
        handler.addFilter(lambda record: rank_zero())
        logging.getLogger("speculators.metrics").addHandler(handler)

    cli.setup_metric_logger = setup_with_events

    train_epoch = trainer.Trainer.train_epoch
    save = trainer.Trainer.maybe_save_checkpoint

    def train_epoch_with_events(self, epoch, **kwargs):
        if rank_zero():
            handler.write({"kind": "epoch", "epoch": epoch, "steps_per_epoch": len(self.train_loader),
                           "epochs": self.config.num_epochs, "max_steps": self.config.max_steps,
                           "global_step": self.global_step, "time": time.time()})
        return train_epoch(self, epoch, **kwargs)

    def save_with_events(self, epoch, local_step=0):
        label = str(epoch)
        if rank_zero():
            handler.write({"kind": "save_begin", "checkpoint": label, "local_step": local_step,
                           "global_step": self.global_step, "time": time.time()})
        save(self, epoch, local_step)
        if rank_zero():
            handler.write({"kind": "save_end", "checkpoint": label, "local_step": local_step,
                           "global_step": self.global_step, "time": time.time()})

    trainer.Trainer.train_epoch = train_epoch_with_events
    trainer.Trainer.maybe_save_checkpoint = save_with_events


def install_cpu_adapter():
    import torch
    import torch.distributed as dist
    from speculators.train import checkpointer, cli, distributed, trainer

    cpu = torch.device("cpu")
    trainer.get_local_rank = lambda: cpu
    checkpointer.get_current_device = lambda: "cpu"
    # Trainer.__init__ assigns "cuda" when there is no accelerator: a property keeps "cpu"
    trainer.Trainer.device_type = property(lambda self: "cpu", lambda self, value: None)
    torch.accelerator.synchronize = lambda *args, **kwargs: None
    setup_distributed = cli.maybe_setup_distributed

    def setup_gloo(sp_size=1):
        if "LOCAL_RANK" not in os.environ:
            return setup_distributed(sp_size)
        dist.init_process_group("gloo")
        distributed._local_rank = int(os.environ["LOCAL_RANK"])  # pylint: disable=protected-access
        distributed._is_distributed = True  # pylint: disable=protected-access
        distributed._rank = dist.get_rank()  # pylint: disable=protected-access
        distributed._world_size = dist.get_world_size()  # pylint: disable=protected-access
        distributed._init_sp_process_groups(dist.get_rank(), dist.get_world_size(), sp_size)  # pylint: disable=protected-access
        logging.getLogger(__name__).info("Started distributed (gloo, CPU) with rank=%d world_size=%d",
                                         dist.get_rank(), dist.get_world_size(), extra={"override_rank0_filter": True})
        return None

    cli.maybe_setup_distributed = setup_gloo


def keep_interrupts_through_online_fetches():
    """speculators 0.9.0 online mode, no DataLoader workers (the CPU default): SIGTERM raises
    TrainingInterruptedError inside the hidden-state fetch, where two retry layers (the request's and
    the sample's) catch every Exception and retry; the handler ignores every later SIGTERM, so the stop
    is lost and the trainer trains on, orphaned if torchrun died. Raised and caught only in
    graceful_shutdown, by its module-level name: as a BaseException it passes the retries and reaches
    the trainer's save of interrupted/."""
    from speculators.train import graceful_shutdown

    class TrainingInterruptedError(BaseException):
        pass

    graceful_shutdown.TrainingInterruptedError = TrainingInterruptedError


def end_with_parent():
    """SIGTERM (speculators saves interrupted/) when torchrun dies without stopping its workers."""
    import ctypes
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def load_summary(checkpoint, verifier):
    """The checkpoint loaded by speculators with its verifier: its class and parameter count."""
    from speculators import SpeculatorModel
    model = SpeculatorModel.from_pretrained(checkpoint, verifier=verifier)
    return {"class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters())}


def load_after(result_path, checkpoint, verifier):
    """load_summary into RESULT with the checkpoint and its weights' identity, a failure included."""
    try:
        if checkpoint is None:
            raise FileNotFoundError("the training saved no checkpoint")
        result = dict(load_summary(checkpoint, verifier), ok=True)
    except Exception as e:  # pylint: disable=broad-exception-caught  # any failure to load is the answer
        result = {"ok": False, "error": ("%s: %s" % (type(e).__name__, e)).strip().splitlines()[-1]}
    result.update(checkpoint=checkpoint, weights=weights_identity(checkpoint) if checkpoint else None)
    with open(result_path, "w") as f:
        json.dump(result, f)


def numbered_checkpoints(save_path):
    """The epoch and sub-epoch checkpoints speculators saved under save_path, oldest first."""
    try:
        names = os.listdir(save_path)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and not os.path.islink(os.path.join(save_path, n)))


def drafter_checkpoint(save_path):
    """The checkpoint a training's drafter is made from: speculators' best where it kept one, else its last
    numbered one; None when it saved none."""
    best = os.path.join(save_path, "checkpoint_best")
    if os.path.isdir(best):
        return os.path.realpath(best)
    numbered = numbered_checkpoints(save_path)
    return os.path.join(save_path, str(numbered[-1])) if numbered else None


def weights_identity(checkpoint):
    """[size, mtime in ns] of the checkpoint's weights (None: none there): a load result holds for these."""
    try:
        st = os.stat(os.path.join(checkpoint, "model.safetensors"))
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns]


def last_value(args, flag):
    """The value speculators' argument parser takes for flag: the last one given."""
    found = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    if found is None:
        raise SystemExit("--load-after needs %s among the speculators train arguments" % flag)
    return found


def main(argv):
    if len(argv) == 3 and argv[0] == "--load-check":
        print(json.dumps(load_summary(argv[1], argv[2])))
        return
    if len(argv) < 4 or argv[0] != "--events" or argv[2] != "--node-rank":
        raise SystemExit("usage: gpuflow_train_launch.py --events FILE --node-rank N [--load-after RESULT] "
                         "<speculators train arguments> | --load-check CHECKPOINT VERIFIER")
    events, args = argv[1], argv[4:]  # the node rank only marks the process: whose trainer it is
    load = None
    if args[:1] == ["--load-after"]:
        if len(args) < 2:
            raise SystemExit("--load-after RESULT")
        result, args = args[1], args[2:]
        load = (result, last_value(args, "--save-path"), last_value(args, "--verifier-name-or-path"))
    end_with_parent()
    import torch
    install_events(events)
    keep_interrupts_through_online_fetches()
    if torch.accelerator.current_accelerator() is None:
        install_cpu_adapter()
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig
    train_main(TrainConfig.resolve(args))
    if load and rank_zero():
        result, save, verifier = load
        load_after(result, save if "--dry-run" in args else drafter_checkpoint(save), verifier)


if __name__ == "__main__":
    main(sys.argv[1:])

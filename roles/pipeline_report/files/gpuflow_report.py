"""Pipeline report (gpuflow.eagle3.pipeline_report): one HTML page with PNG figures.

Reads the run's data (--data pipeline.json: stages, hand-offs, the stages' manifests, the
training's metrics.jsonl, the disk budget) and writes OUT/report.html and OUT/figures/*.png.
Sections: timeline, handoffs, data, disk, training, evaluation, resumptions. A section whose
data is missing says "not run in this pipeline". Prints one JSON line on stdout:
{"html": "/abs/OUT/report.html", "figures": ["/abs/OUT/figures/x.png", ...]}.

Standard library and matplotlib (Agg backend) only. A relative metrics_file is taken from the
directory of the --data file.
"""
import argparse
import html
import json
import os
import statistics
import sys
import time

try:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch
except ImportError as import_error:
    sys.exit("gpuflow_report: matplotlib is not importable by %s (%s); install requirements/controller.txt "
             "into it or point pipeline_report_python at a Python that has it" % (sys.executable, import_error))

SECTIONS = (("timeline", "Stage timeline"), ("handoffs", "GPU hand-offs"), ("data", "Data"),
            ("disk", "Disk"), ("training", "Training"), ("evaluation", "Drafter evaluation"),
            ("resumptions", "Skipped and resumed work"))
STATUS_COLOURS = {"ran": "#2e7d32", "resumed": "#ef6c00", "skipped": "#78909c", "failed": "#c62828",
                  "not_selected": "#cfd8dc"}
FIGSIZE = (8, 3)
DPI = 100
MISSING = "-"

CSS = """
body { font-family: "DejaVu Sans", Helvetica, Arial, sans-serif; color: #212121; margin: 2em auto; max-width: 1100px; }
h1 { margin-bottom: 0.2em; }
section { border-top: 2px solid #cfd8dc; margin-top: 1.5em; }
table { border-collapse: collapse; margin: 0.6em 0; }
th, td { border: 1px solid #b0bec5; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #eceff1; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.status { color: #fff; border-radius: 3px; padding: 0 0.4em; }
.missing { color: #616161; font-style: italic; }
.bad { color: #c62828; font-weight: bold; }
img { display: block; margin: 0.6em 0; border: 1px solid #eceff1; }
nav a { margin-right: 1em; }
"""


class ReportError(Exception):
    """Input that cannot be read; main() turns it into a message and exit status 1."""


# ----------------------------------------------------------------------------- formatting
def esc(value):
    return html.escape(str(value))


def dig(obj, dotted, default=None):
    """obj["a"]["b"] for "a.b"; default when a key is missing or a level is not a dict."""
    for key in dotted.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return default
        obj = obj[key]
    return obj


def human_bytes(n):
    if n is None:
        return MISSING
    value, units = float(n), ["B", "KiB", "MiB", "GiB", "TiB"]
    while abs(value) >= 1024 and len(units) > 1:
        value /= 1024
        units.pop(0)
    return ("%d B" % value) if units[0] == "B" else ("%.1f %s" % (value, units[0]))


def human_seconds(s):
    if s is None:
        return MISSING
    s = float(s)
    if s < 60:
        return "%.1f s" % s
    if s < 3600:
        return "%d m %02d s" % (s // 60, s % 60)
    return "%d h %02d m" % (s // 3600, s % 3600 // 60)


def utc(epoch):
    return MISSING if epoch is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(float(epoch)))


def number(value, fmt="%s"):
    return MISSING if value is None else fmt % value


def percent(share):
    return MISSING if share is None else "%.1f%%" % (100 * float(share))


def table(headers, rows, numeric=()):
    """An HTML table; every cell is escaped, columns named in numeric are right-aligned."""
    head = "".join("<th>%s</th>" % esc(h) for h in headers)
    body = []
    for row in rows:
        cells = "".join('<td class="num">%s</td>' % esc(c) if headers[i] in numeric else "<td>%s</td>" % esc(c)
                        for i, c in enumerate(row))
        body.append("<tr>%s</tr>" % cells)
    return "<table><tr>%s</tr>%s</table>" % (head, "".join(body))


def pairs(rows):
    """A two-column table of (what, value) rows."""
    return table(["what", "value"], rows)


def not_run(what):
    return '<p class="missing">%s: not run in this pipeline.</p>' % esc(what)


def paragraph(text, css=None):
    return ('<p class="%s">%s</p>' % (css, esc(text))) if css else "<p>%s</p>" % esc(text)


def badge(status):
    return '<span class="status" style="background:%s">%s</span>' % (STATUS_COLOURS.get(status, "#616161"), esc(status))


# ----------------------------------------------------------------------------- figures
class Figures:
    """Saves matplotlib figures under OUT/figures and remembers what it wrote."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.written = []
        os.makedirs(os.path.join(out_dir, "figures"), exist_ok=True)

    def save(self, fig, name, alt):
        rel = "figures/%s.png" % name
        fig.tight_layout()
        fig.savefig(os.path.join(self.out_dir, rel), dpi=DPI)
        plt.close(fig)
        self.written.append(os.path.join(self.out_dir, rel))
        return '<img src="%s" alt="%s" width="%d">' % (esc(rel), esc(alt), FIGSIZE[0] * DPI)


def timeline_figure(stages, t0, figures):
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], max(FIGSIZE[1], 0.45 * len(stages) + 1)))
    cursor = 0.0
    for y, stage in enumerate(stages):
        status = stage.get("status", "unknown")
        left = float(stage["started"]) - t0 if stage.get("started") is not None else cursor
        width = stage_seconds(stage) or 0.0
        ax.barh(y, width, left=left, color=STATUS_COLOURS.get(status, "#616161"), height=0.6)
        label = "%s, %s" % (status, human_seconds(width)) if status in ("ran", "resumed", "failed") else status
        ax.text(left + width, y, "  " + label, va="center", fontsize=8)
        cursor = max(cursor, left + width)
    ax.set_yticks(range(len(stages)), [s.get("name", "?") for s in stages])
    ax.invert_yaxis()  # pipeline order from the top
    ax.set_xlim(0, max(cursor, 1.0) * 1.25)  # room for the labels right of the last bar
    ax.set_xlabel("seconds since the pipeline started")
    present = [s for s in STATUS_COLOURS if any(st.get("status") == s for st in stages)]
    # early stages sit top left, late ones bottom right: the top right corner is free
    ax.legend(handles=[Patch(color=STATUS_COLOURS[s], label=s) for s in present], fontsize=8, loc="upper right")
    return figures.save(fig, "timeline", "stage timeline")


def disk_figure(disk, figures):
    labels = [k for k in ("used", "budget", "free") if disk.get(k + "_bytes")]
    values = [float(disk[k + "_bytes"]) for k in labels]
    fig, ax = plt.subplots(figsize=FIGSIZE)
    # used bytes are often a sliver of the free space: a log axis keeps every bar visible
    log = max(values) / min(values) > 100
    floor = min(values) / 10 if log else 0
    ax.barh(range(len(values)), [v - floor for v in values], left=floor,
            color=["#1565c0", "#ef6c00", "#2e7d32"][:len(values)])
    for y, value in enumerate(values):
        ax.text(value, y, "  " + human_bytes(value), va="center", fontsize=9)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(floor, max(values) * 30)
    else:
        ax.set_xlim(0, max(values) * 1.3)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("bytes" + (" (log scale)" if log else ""))
    return figures.save(fig, "disk", "disk used, budget and free")


def loss_figure(train_points, val_points, figures):
    fig, ax = plt.subplots(figsize=FIGSIZE)
    steps, losses = zip(*train_points)
    ax.plot(steps, losses, color="#1565c0", linewidth=1.5, label="train loss (per step)")
    if val_points:
        steps, losses = zip(*val_points)
        ax.plot(steps, losses, "o--", color="#ef6c00", label="validation loss (per epoch)")
    ax.set_xlabel("global step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return figures.save(fig, "training_loss", "training loss per step and validation loss per epoch")


def evaluation_figure(per_position, throughput, figures):
    panels = int(bool(per_position)) + int(bool(throughput))
    fig, axes = plt.subplots(1, panels, figsize=FIGSIZE, squeeze=False)
    axes = list(axes[0])
    if per_position:
        ax = axes.pop(0)
        positions = range(1, len(per_position) + 1)
        ax.bar(positions, per_position, color="#1565c0")
        ax.set_xticks(list(positions))
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, max(1.0, *per_position))
        ax.set_title("per-position acceptance", fontsize=10)
    if throughput:
        ax = axes.pop(0)
        labels, values = zip(*throughput)
        ax.bar(labels, values, color=["#78909c", "#2e7d32"][:len(values)])
        for x, value in enumerate(values):
            ax.text(x, value, "%.1f" % value, ha="center", va="bottom", fontsize=9)
        ax.set_ylim(0, max(values) * 1.15)  # room for the value labels
        ax.set_ylabel("output tokens/s")
        ax.set_title("throughput", fontsize=10)
    return figures.save(fig, "evaluation", "per-position acceptance and throughput with and without the drafter")


# ----------------------------------------------------------------------------- input
def load_data(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ReportError("cannot read %s: %s" % (path, exc)) from exc
    if not isinstance(data, dict) or not isinstance(data.get("stages"), list):
        raise ReportError("%s has no list of stages (pipeline_report_data.stages)" % path)
    if not all(isinstance(s, dict) for s in data["stages"]):
        raise ReportError("%s: every stage must be an object" % path)
    return data


def read_metrics(path):
    """The training's metrics.jsonl: (train points [(step, loss)], validation [(step, loss)] at each epoch's end,
    tokens/s values, unparsable line count). After a resume a step appears twice: the last wins."""
    train, val, tokens_per_s, bad = {}, [], [], 0
    with open(path) as f:
        for line in f:
            try:
                event = json.loads(line)
            except ValueError:
                bad += 1  # a line cut by a kill, or the one being written
                continue
            if event.get("kind") == "train" and dig(event, "train.loss") is not None:
                train[event["global_step"]] = float(event["train"]["loss"])
                if dig(event, "profile.tokens_per_s") is not None:
                    tokens_per_s.append(float(event["profile"]["tokens_per_s"]))
            elif event.get("kind") == "val" and dig(event, "val.loss_epoch") is not None:
                val.append((event.get("step"), float(event["val"]["loss_epoch"])))
    return sorted(train.items()), val, tokens_per_s, bad


def stage_seconds(stage):
    if stage.get("seconds") is not None:
        return float(stage["seconds"])
    if stage.get("started") is not None and stage.get("finished") is not None:
        return float(stage["finished"]) - float(stage["started"])
    return None


# ----------------------------------------------------------------------------- sections
def section_timeline(data, _base, figures):
    stages = data["stages"]
    if not stages:
        return not_run("stages")
    starts = [float(s["started"]) for s in stages if s.get("started") is not None]
    t0 = float(data["started"]) if data.get("started") is not None else min(starts, default=0.0)
    rows = []
    for stage in stages:
        rows.append("<tr><td>%s</td><td>%s</td><td>%s</td><td>%s</td><td class=\"num\">%s</td><td>%s</td></tr>" % (
            esc(stage.get("name", "?")), esc(", ".join(stage.get("hosts", [])) or MISSING), badge(stage.get("status", "unknown")),
            esc(utc(stage.get("started"))), esc(human_seconds(stage_seconds(stage))), esc(stage.get("detail", ""))))
    head = "".join("<th>%s</th>" % h for h in ("stage", "hosts", "status", "started (UTC)", "duration", "detail"))
    return timeline_figure(stages, t0, figures) + "<table><tr>%s</tr>%s</table>" % (head, "".join(rows))


def section_handoffs(data, _base, _figures):
    handoffs = data.get("handoffs") or []
    if not handoffs:
        return not_run("GPU hand-offs")
    rows = []
    for h in handoffs:
        common = [h.get("name", "?"), h.get("host", MISSING), h.get("backend", MISSING),
                  "yes" if h.get("ready") else "NO", human_seconds(h.get("seconds"))]
        for gpu in h.get("gpus") or [{}]:
            holders = gpu.get("holders")
            memory = gpu.get("memory_after") or {}
            rows.append(common + [
                number(gpu.get("index")), gpu.get("verdict", MISSING), number(gpu.get("time_to_release_s"), "%.2f s"),
                "%s / %s MiB" % (memory.get("used_mib", "?"), memory.get("total_mib", "?")) if memory else MISSING,
                number(len(holders) if isinstance(holders, list) else holders)])
    not_ready = [h.get("name", "?") for h in handoffs if not h.get("ready")]
    verdict = (paragraph("Not ready: %s." % ", ".join(not_ready), "bad") if not_ready
               else paragraph("Every hand-off ended with its GPUs ready."))
    return verdict + table(["hand-off", "host", "backend", "ready", "hand-off time", "GPU", "verdict",
                            "time to release", "memory after", "holders"], rows,
                           numeric=("hand-off time", "GPU", "time to release", "holders"))


def section_data(data, _base, _figures):
    manifests = data.get("manifests") or {}
    gen, ext = manifests.get("synthetic_data"), manifests.get("hidden_state_extract")
    parts = ["<h3>Generated data (synthetic_data)</h3>"]
    if gen:
        parts.append(pairs([
            ("status", gen.get("status", MISSING)),
            ("model", dig(gen, "inputs.model", MISSING)),
            ("prompts answered", "%s / %s" % (dig(gen, "counts.done", "?"), dig(gen, "counts.prompts", "?"))),
            ("complete rows", number(dig(gen, "counts.rows"))),
            ("truncated by max_tokens (kept apart)", "%s (max_tokens %s)" % (
                number(dig(gen, "counts.truncated")), dig(gen, "inputs.max_tokens", "?"))),
            ("errors", "%s (share %s, threshold %s)" % (
                number(dig(gen, "counts.errors")), percent(gen.get("error_share")), percent(gen.get("error_threshold")))),
            ("duplicates", number(dig(gen, "counts.duplicates"))),
            ("prompt tokens", number(dig(gen, "tokens.prompt"))),
            ("completion tokens", number(dig(gen, "tokens.completion"))),
            ("reasoning share (rows with reasoning)", percent(gen.get("reasoning_fraction"))),
            ("think leaks", number(gen.get("think_leaks"))),
            ("requests/s this run", number(dig(gen, "this_run.requests_per_s"))),
        ]))
    else:
        parts.append(not_run("synthetic data generation"))
    parts.append("<h3>Hidden states (hidden_state_extract)</h3>")
    if ext:
        shards = ext.get("shards") or []
        parts.append(pairs([
            ("status", ext.get("status", MISSING)),
            ("samples", number(ext.get("samples"))),
            ("tokens", number(ext.get("tokens"))),
            ("bytes", "%s (%s bytes)" % (human_bytes(ext.get("bytes")), number(ext.get("bytes")))),
            ("dtype", ext.get("dtype", MISSING)),
            ("layer ids", ", ".join(str(i) for i in ext.get("layer_ids", [])) or MISSING),
            ("sequence length", number(dig(ext, "inputs.seq_length"))),
            ("shards", "%d on %s" % (len(shards), ", ".join(sorted({str(s.get("host")) for s in shards})) or MISSING)),
        ]))
    else:
        parts.append(not_run("hidden state extraction"))
    return "".join(parts)


def section_disk(data, _base, figures):
    disk = data.get("disk")
    if not disk:
        return not_run("disk accounting")
    used, budget, free = disk.get("used_bytes"), disk.get("budget_bytes"), disk.get("free_bytes")
    parts = []
    if budget and used is not None and used > budget:
        parts.append(paragraph("Over budget by %s." % human_bytes(used - budget), "bad"))
    if any((used, budget, free)):
        parts.append(disk_figure(disk, figures))
    extract = (data.get("manifests") or {}).get("hidden_state_extract") or {}
    trained = ((data.get("manifests") or {}).get("eagle3_train") or {}).get("hidden_states") or {}
    mode = extract.get("mode", "offline")
    rows = [
        ("hidden states", "%s (%s)" % (mode, extract["mode_reason"]) if extract.get("mode_reason") else mode),
        ("path", disk.get("path", MISSING)),
        ("used", human_bytes(used)),
        ("budget", human_bytes(budget) if budget else "none"),
        ("used share of the budget", percent(used / budget) if budget and used is not None else MISSING),
        ("free on the filesystem", human_bytes(free)),
        ("high-water mark of the hidden-states path during training",
         "%s%s" % (human_bytes(trained.get("peak_bytes")),
                   " (%d file(s) at once)" % trained["peak_files"] if trained.get("peak_files") is not None else "")
         if trained.get("peak_bytes") is not None else MISSING),
    ]
    if mode == "online":
        cost = extract.get("online_cost") or {}
        rows += [
            ("extra target compute: requests served to training",
             "%s (planned %s: %s epochs x %s samples)" % (number(trained.get("requests_served")), number(cost.get("target_passes")),
                                                          number(cost.get("epochs")), number(cost.get("samples")))),
            ("extra target compute: prompt tokens served to training", number(trained.get("prompt_tokens_served"))),
            ("unconsumed hidden-states files removed (left by an interrupted run / at a run's end)",
             "%s / %s" % (number(trained.get("orphans_removed")), number(trained.get("leftovers_removed")))),
        ]
    parts.append(pairs(rows))
    return "".join(parts)


def section_training(data, base, figures):
    manifest = (data.get("manifests") or {}).get("eagle3_train")
    metrics_file = data.get("metrics_file")
    if not manifest and not metrics_file:
        return not_run("training")
    parts, train, val, tokens_per_s = [], [], [], []
    if metrics_file:
        path = os.path.join(base, metrics_file)  # an absolute metrics_file stays as it is
        try:
            train, val, tokens_per_s, bad = read_metrics(path)
        except OSError as exc:
            parts.append(paragraph("metrics.jsonl could not be read: %s" % exc, "bad"))
        else:
            if bad:
                parts.append(paragraph("%d unreadable line(s) in %s skipped." % (bad, path)))
    if train:
        parts.append(loss_figure(train, val, figures))
    else:
        parts.append(paragraph("No loss curve: no training steps in metrics.jsonl.", "missing"))
    manifest = manifest or {}
    tps = manifest.get("tokens_per_s_median") or (statistics.median(tokens_per_s) if tokens_per_s else None)
    parts.append(pairs([
        ("status", manifest.get("status", "no manifest")),
        ("steps", number(manifest.get("steps", len(train) or None))),
        ("epochs", number(manifest.get("epochs_completed"))),
        ("final train loss", number(manifest.get("final_loss", train[-1][1] if train else None), "%.4f")),
        ("final validation loss", number(dig(manifest, "validation.loss_epoch", val[-1][1] if val else None), "%.4f")),
        ("tokens/s (median)", number(tps, "%.0f")),
        ("device, nodes x processes", "%s, %s x %s" % (
            dig(manifest, "inputs.device", "?"), dig(manifest, "inputs.nnodes", "?"), dig(manifest, "inputs.nproc_per_node", "?"))),
        ("checkpoint saves (median seconds)", "%s (%s)" % (number(manifest.get("checkpoint_saves")),
                                                           number(manifest.get("checkpoint_save_s_median")))),
        ("drafter", manifest.get("drafter", MISSING)),
    ]))
    return "".join(parts)


def break_even_acceptance_length(acceptance_length, base_tps, spec_tps):
    """The mean acceptance length at which the drafter neither gains nor loses, at the step costs of this run.

    With k draft tokens per step, a speculative step costs one verification by the target (t_verify) plus k
    draft steps (t_draft each) and yields tau tokens, the mean acceptance length (accepted + 1 bonus, as vLLM
    defines it). Speedup = tau * t_target / (t_verify + k * t_draft), so it breaks even at
    tau* = (t_verify + k * t_draft) / t_target: the cost of a speculative step in target steps.
    Both passes run the same prompts at the same concurrency: t_target is the time per output token without
    the drafter (1 / base_tps), a speculative step is tau times the time per output token with it
    (tau / spec_tps), hence tau* = tau * base_tps / spec_tps = tau / speedup.
    """
    return acceptance_length * base_tps / spec_tps


def speedup_below_one(num_speculative_tokens, acceptance_length, base_tps, spec_tps):
    """Why a speedup below 1 does not condemn the drafter, with the break-even acceptance length of this run."""
    break_even = break_even_acceptance_length(acceptance_length, base_tps, spec_tps)
    return "".join([
        "<h3>Why the speedup is below 1</h3>",
        paragraph("On a small target, such as the local default's 4-layer model on a CPU, a draft step costs about "
                  "what a target step does: here the verification and the %(k)d draft steps together cost %(be).2f "
                  "target steps, more than the %(tau).2f tokens they yield. On a real target a draft step costs a small "
                  "fraction of a target step, so what carries over is the acceptance length against the draft length: "
                  "%(tau).2f of at most %(most)d (%(k)d draft tokens + 1 bonus)."
                  % {"k": num_speculative_tokens, "be": break_even, "tau": acceptance_length,
                     "most": num_speculative_tokens + 1}),
        paragraph("Model: a step of k draft tokens costs one verification plus k draft steps and yields the acceptance "
                  "length \u03c4 (accepted + 1 bonus), so speedup = \u03c4 \u00b7 t_target / (t_verify + k \u00b7 t_draft) "
                  "and the break-even is \u03c4* = (t_verify + k \u00b7 t_draft) / t_target."),
        paragraph("Both passes send the same prompts at the same concurrency, so their times per output token measure "
                  "the two step costs in one unit:"),
        pairs([
            ("target step: time per output token without the drafter", "%.3f ms" % (1000 / base_tps)),
            ("speculative step: \u03c4 \u00d7 time per output token with the drafter", "%.2f \u00d7 %.3f ms = %.3f ms" % (
                acceptance_length, 1000 / spec_tps, 1000 * acceptance_length / spec_tps)),
            ("break-even acceptance length \u03c4* = speculative step / target step", "%.2f" % break_even),
            # speedup = tau / tau*, so below 1 the drafter is always short of the break-even
            ("this drafter", "\u03c4 = %.2f, %.2f short of \u03c4*" % (acceptance_length, break_even - acceptance_length)),
        ]),
    ])


def section_evaluation(data, _base, figures):
    ev = (data.get("manifests") or {}).get("drafter_eval")
    if not ev:
        return not_run("drafter evaluation")
    base_tps, spec_tps = dig(ev, "baseline.output_tokens_per_s"), dig(ev, "speculative.output_tokens_per_s")
    speedup = ev.get("speedup") or (spec_tps / base_tps if base_tps and spec_tps else None)
    per_position = dig(ev, "speculative.per_position_acceptance") or []
    throughput = [(k, float(v)) for k, v in (("without drafter", base_tps), ("with drafter", spec_tps)) if v is not None]
    parts = [evaluation_figure(per_position, throughput, figures)] if per_position or throughput else []
    parts.append(pairs([
        ("status", ev.get("status", MISSING)),
        ("prompts, temperature", "%s, %s" % (number(ev.get("prompts")), number(ev.get("temperature")))),
        ("speculative tokens per step", number(ev.get("num_speculative_tokens"))),
        ("mean acceptance length", number(dig(ev, "speculative.mean_acceptance_length"), "%.2f")),
        ("acceptance rate", percent(dig(ev, "speculative.acceptance_rate"))),
        ("accepted / draft tokens", "%s / %s" % (number(dig(ev, "speculative.accepted_tokens")),
                                                 number(dig(ev, "speculative.draft_tokens")))),
        ("per-position acceptance", ", ".join("%.3f" % p for p in per_position) or MISSING),
        ("output tokens/s without drafter", number(base_tps, "%.1f")),
        ("output tokens/s with drafter", number(spec_tps, "%.1f")),
        ("speedup", number(speedup, "%.2fx")),
    ]))
    acceptance_length, draft_length = dig(ev, "speculative.mean_acceptance_length"), ev.get("num_speculative_tokens")
    if speedup is not None and speedup < 1 and acceptance_length and draft_length and base_tps and spec_tps:
        parts.append(speedup_below_one(draft_length, acceptance_length, base_tps, spec_tps))
    return "".join(parts)


def section_resumptions(data, _base, _figures):
    items = []
    for stage in data["stages"]:
        detail = (": " + stage["detail"]) if stage.get("detail") else ""
        if stage.get("status") == "skipped":
            items.append("%s skipped, already done%s" % (stage.get("name", "?"), detail))
    for resumed in data.get("resumptions") or []:
        items.append("%s resumed in run %s: run %s had stopped before the stage finished (interrupted or failed)" % (
            resumed.get("stage", "?"), resumed.get("run_id", "?"), resumed.get("interrupted_run", "?")))
    for name, manifest in sorted((data.get("manifests") or {}).items()):
        resume = dig(manifest, "this_run.resume") or {}
        if resume.get("done_before"):
            items.append("%s: %s of %s done before this run; this run did %s" % (
                name, resume["done_before"], dig(manifest, "counts.prompts", "?"), dig(manifest, "this_run.completed", "?")))
        for path, cut in sorted((resume.get("torn_bytes_cut") or {}).items()):
            if cut:
                items.append("%s: %d bytes of a line cut short by an interruption removed from %s" % (name, cut, path))
    if not items:
        return paragraph("Nothing was skipped or resumed: every stage that ran started from the beginning.")
    return "<ul>%s</ul>" % "".join("<li>%s</li>" % esc(i) for i in items)


BUILDERS = {"timeline": section_timeline, "handoffs": section_handoffs, "data": section_data, "disk": section_disk,
            "training": section_training, "evaluation": section_evaluation, "resumptions": section_resumptions}


# ----------------------------------------------------------------------------- page
def header(data):
    started, finished = data.get("started"), data.get("finished")
    hosts = data.get("hosts") or {}
    rows = [("run", data.get("run_id", MISSING)), ("inventory", data.get("inventory", MISSING)),
            ("started", utc(started)), ("finished", utc(finished)),
            ("wall time", human_seconds(float(finished) - float(started)) if started and finished else MISSING)]
    rows += [("hosts: " + group, ", ".join(names)) for group, names in sorted(hosts.items())]
    failed = [s.get("name", "?") for s in data["stages"] if s.get("status") == "failed"]
    banner = paragraph("Failed: %s." % ", ".join(failed), "bad") if failed else ""
    nav = "<nav>%s</nav>" % "".join('<a href="#%s">%s</a>' % (sid, esc(title)) for sid, title in SECTIONS)
    return "<h1>%s</h1>%s%s%s" % (esc(data.get("title", "gpuflow.eagle3 pipeline")), banner, pairs(rows), nav)


def render(data, base, out_dir):
    figures = Figures(out_dir)
    body = [header(data)]
    for sid, title in SECTIONS:
        body.append('<section id="%s"><h2>%s</h2>%s</section>' % (sid, esc(title), BUILDERS[sid](data, base, figures)))
    page = ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>%s</title><style>%s</style></head>'
            "<body>%s<footer><p class=\"missing\">written %s by gpuflow.eagle3.pipeline_report</p></footer></body></html>\n"
            % (esc(data.get("title", "gpuflow.eagle3 pipeline")), CSS, "\n".join(body), esc(utc(time.time()))))
    path = os.path.join(out_dir, "report.html")
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, path)  # a reader never sees half a page
    return path, figures.written


def main():
    parser = argparse.ArgumentParser(description="Write report.html and figures/*.png for a gpuflow.eagle3 pipeline run.")
    parser.add_argument("--data", required=True, help="pipeline.json (the role's pipeline_report_data)")
    parser.add_argument("--out", required=True, help="directory for report.html and figures/")
    args = parser.parse_args()
    try:
        data = load_data(args.data)
        out_dir = os.path.abspath(args.out)
        html_path, written = render(data, os.path.dirname(os.path.abspath(args.data)), out_dir)
    except ReportError as exc:
        sys.exit("gpuflow_report: %s" % exc)
    except (KeyError, TypeError, ValueError) as exc:
        sys.exit("gpuflow_report: %s does not follow the pipeline.json schema (%s: %s)" % (args.data, type(exc).__name__, exc))
    except OSError as exc:
        sys.exit("gpuflow_report: cannot write the report into %s: %s" % (args.out, exc))
    print(json.dumps({"html": html_path, "figures": written}))


if __name__ == "__main__":
    main()

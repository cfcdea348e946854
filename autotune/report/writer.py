"""The output directory: report.md, report.html (self-contained), plots, trials.csv, plan.json,
summary.json. Files are built in a scratch folder and moved in one by one at the end, so an
interrupted run never leaves a half-written report over a previous one, and a previous report
found there is moved under ``previous/``, not overwritten."""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from autotune.report import plots
from autotune.run.calibrated_timing import PRESET_TIME_ERROR, time_model_note
from autotune.run.floor import floor_of
from autotune.inputs import format_bytes
from autotune.run.stage_times import StageClock, StageTimes
from autotune.run.training import training_phrase
from simulator.state import moved_kinds, where_updated

RECOMPUTES_SHOWN = 20  # rows of the report's recomputation table


@dataclass
class Section:
    title: str
    paragraphs: list[str] = field(default_factory=list)
    tables: list[pd.DataFrame] = field(default_factory=list)
    images: list[str] = field(default_factory=list)  # file names in the output directory
    code: str | None = None


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1%}"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g} s"


def _rewrites_text(changes: dict[str, list[str]]) -> str:
    return "; ".join(f"{name}: {len(ops)} op(s) ({', '.join(ops[:3])}{', ...' if len(ops) > 3 else ''})"
                     for name, ops in changes.items())


def _listed(names: list[str], shown: int = 5) -> str:
    """A list parameter in a table cell: the first few names and how many (plan.json has them all)."""
    if len(names) <= shown:
        return ", ".join(names)
    return f"{len(names)}: " + ", ".join(names[:shown]) + ", ..."


def _plan_clauses(n_swaps: int, n_recomputes: int, order_name: str, host_state: tuple = ()) -> str:
    """What a plan does, for the report's verdict sentence ("swaps 3 tensors, recomputes 2 tensors")."""
    n_host_state = len(host_state)
    clauses = [f"keeps the {moved_kinds(host_state)} of {n_host_state} variable{'s' * (n_host_state != 1)} on the "
               f"host, {where_updated(host_state)}"] if n_host_state else []
    if n_swaps or not n_recomputes:
        clauses.append(f"swaps {n_swaps} tensor{'s' * (n_swaps != 1)}" if n_swaps else "swaps nothing")
    if n_recomputes:
        clauses.append(f"recomputes {n_recomputes} tensor{'s' * (n_recomputes != 1)}")
    if not n_swaps:  # without swaps, the order is what else changes the step
        clauses.append(f"runs the ops in the `{order_name}` order")
    return ", ".join(clauses)


def param_text(name: str, value) -> str:
    """A swap parameter as a reader takes it: sizes in bytes' units, the recomputation cost per MiB freed."""
    if isinstance(value, list):
        return _listed(value)
    if name == "min_bytes":
        return format_bytes(value)
    if name == "recompute_cost":
        return "no limit" if value is None else f"{value * 2 ** 20 * 1e6:.3g} µs of compute per MiB freed"
    return str(value)


def _sections(result, images: dict[str, Path], plan_file: str, stage_times: StageTimes | None = None) -> list[Section]:
    summary = result.summary()
    shown = result.shown
    sections = []
    verdict = [f"**{result.verdict.headline}**"]
    if result.feasible and result.plan is not None and (result.plan.changes_step or result.recomputes):
        verdict.append(f"The plan {_plan_clauses(result.plan.n_swaps, len(result.recomputes), result.plan.order_name, result.plan.host_state)}"
                       f" and brings the predicted peak from "
                       f"{format_bytes(result.baseline.peak_bytes)} to {format_bytes(shown.peak_bytes)} "
                       f"(budget {format_bytes(result.budget_bytes)}), at a simulated step time of "
                       f"{_seconds(shown.step_s)} ({_pct(shown.metrics['overhead'])} over computing alone"
                       + (f"; {_seconds(result.replay.host_update_s)} of it on the host's CPU"
                          if result.replay is not None and result.replay.host_update_s else "") + ").")
    elif result.feasible:
        verdict.append(f"The predicted peak without swapping is {format_bytes(result.baseline.peak_bytes)}, within "
                       f"the budget of {format_bytes(result.budget_bytes)}"
                       + (" (of the rewritten step; the plan applies the rewrites)." if result.graph_rewrites else "."))
    else:  # peaks as corrected by measured runs, where there were any (the same as predicted otherwise)
        correction = result.correction
        base = correction.corrected(result.baseline.peak_bytes, result.graph.persistent_bytes)
        miss = ""
        if shown is not None:
            closest = correction.corrected(shown.peak_bytes, result.resident_bytes())
            miss = (f" The closest plan found reaches {format_bytes(closest)}, "
                    f"{format_bytes(max(0, closest - result.budget_bytes))} over it"
                    + (f"; its swapped tensors need {format_bytes(shown.metrics['host_peak_bytes'])} of host memory, "
                       f"{format_bytes(shown.host_excess_bytes)} more than the host has." if shown.host_excess_bytes > 0
                       else "."))
        corrected = "" if correction.is_identity else (f" (corrected from measured runs: "
                                                       f"{correction.describe()}; predicted "
                                                       f"{format_bytes(result.baseline.peak_bytes)})")
        verdict.append(f"No plan brings the peak of {format_bytes(base)}{corrected} under the "
                       f"budget of {format_bytes(result.budget_bytes)}.{miss}")
    settings = pd.DataFrame([
        ("model", result.model), ("batch size", result.batch_size), ("device model", result.device.name),
        ("trained with", training_phrase(result.graph.meta.get("training"))),
        ("budget", f"{format_bytes(result.budget_bytes)}, from {result.budget_source}"),
        ("search", f"{result.policy}, {len(result.evaluations)} candidates simulated"
                   + ("" if result.search_budget_bytes in (None, result.budget_bytes) else
                      f", predicted peaks held to {format_bytes(result.search_budget_bytes)} (corrected from "
                      "measured runs)")),
        ("graph", f"{result.graph.n_ops} ops, {result.graph.n_tensors} tensors"),
        ("graph rewrites (every figure is of the rewritten step)" if result.graph_rewrites else "graph rewrites",
         _rewrites_text(summary["graph_rewrite_changes"]) or "none"),
        ("resident (weights, optimizer state, inputs)", floor_of(result.graph).resident_parts()
         + (f"; the plan moves {format_bytes(summary['host_state_bytes'])} of {moved_kinds(result.plan.host_state)} "
            f"({len(summary['host_state'])} "
            "variables) to the host, the rest stays" if summary["host_state"] else "")),
        ("least peak any swap plan can reach (largest op's inputs and outputs + resident)",
         format_bytes(summary["peak_lower_bound_bytes"])),
        ("largest batch without swapping", summary["max_batch_without_swap"]),
    ], columns=["setting", "value"])
    sections.append(Section("Result", verdict + result.notes, [settings]))

    rows = [("peak device memory", format_bytes(result.baseline.peak_bytes),
             format_bytes(shown.peak_bytes) if shown else "n/a"),
            ("step time", _seconds(result.baseline.step_s), _seconds(shown.step_s) if shown else "n/a"),
            ("overhead", "0", _pct(shown.metrics["overhead"]) if shown else "n/a"),
            ("device -> host", "0", format_bytes(shown.metrics["d2h_bytes"]) if shown else "n/a"),
            ("host -> device", "0", format_bytes(shown.metrics["h2d_bytes"]) if shown else "n/a"),
            ("host memory for swapped tensors", "0", format_bytes(shown.metrics["host_peak_bytes"]) if shown else "n/a")]
    if summary["recomputes"]:
        rows += [("recomputed tensors", "0", f"{len(summary['recomputes'])} ({format_bytes(summary['recomputed_bytes'])})"),
                 ("recomputation time", "0", _seconds(summary["predicted_recompute_s"]))]
    label = "with the plan" if result.feasible else "closest plan"
    predicted = pd.DataFrame(rows, columns=["predicted", "without swapping", label])
    params = pd.DataFrame(sorted((k, param_text(k, v))
                                 for k, v in (shown.params.to_dict().items() if shown and shown.params else [])),
                          columns=["parameter", "value"])
    sections.append(Section("Prediction", [f"Simulated on the {result.device.name} device model.",
                                           time_model_note(result.device, result.calibration)],
                            [predicted] + ([params] if len(params) else []),
                            [n for n in ("memory_timeline.png", "pareto_front.png") if n in images]))

    if summary["recomputes"]:
        recomputed = pd.DataFrame(summary["recomputes"][:RECOMPUTES_SHOWN])
        recomputed["bytes"] = recomputed["bytes"].map(format_bytes)
        recomputed["seconds"] = recomputed["seconds"].map(_seconds)
        more = len(summary["recomputes"]) - RECOMPUTES_SHOWN
        sections.append(Section("Recomputation", [
            f"Instead of being kept or swapped, {len(summary['recomputes'])} tensors "
            f"({format_bytes(summary['recomputed_bytes'])}) are freed after their near readers and recomputed by "
            f"clones of the forward ops that made them, shortly before their far readers, in "
            f"{_seconds(summary['predicted_recompute_s'])} of extra compute (counted in the overhead)."
            + (f" The largest {RECOMPUTES_SHOWN} (summary.json lists all):" if more > 0 else "")],
            [recomputed.rename(columns={"ops": "ops cloned", "consumers": "far readers"})]))

    m = result.measurement
    if m is not None:
        measured_peak = "out of memory" if m.out_of_memory else format_bytes(m.peak_bytes)
        rows = [("peak device memory", format_bytes(m.predicted_peak_bytes), measured_peak,
                 f"{m.predicted_peak_bytes / m.peak_bytes:.3f}" if m.peak_bytes else "n/a"),
                ("step time", _seconds(m.predicted_step_s), _seconds(m.step_s),
                 f"{m.predicted_step_s / m.step_s:.3f}" if m.step_s and m.step_s == m.step_s else "n/a")]
        if m.baseline_peak_bytes:
            rows.append(("peak without swapping", format_bytes(m.predicted_baseline_peak_bytes),
                         format_bytes(m.baseline_peak_bytes),
                         f"{m.predicted_baseline_peak_bytes / m.baseline_peak_bytes:.3f}"))
        if m.plain_peak_bytes:
            rows.append(("peak of model.fit's own step (Keras' train_step, TF's op order)", "",
                         format_bytes(m.plain_peak_bytes), ""))
        table = pd.DataFrame(rows, columns=["", "predicted", "measured", "predicted / measured"])
        text = [f"Measured on {m.measured_on} at batch {m.batch_size}. {m.note}".strip(),
                (f"The predicted step time is from the calibration of this machine ({m.time_model})"
                 + (f", re-anchored to its {m.time_anchored_to}, timed in the same passes as the plan's step "
                    f"(the machine's speed drifts; before: {_seconds(m.predicted_step_s_unanchored)})."
                    if m.time_anchored_to else ".") if m.time_calibrated
                 else f"The predicted step time is a datasheet estimate of the {m.time_model or 'preset'} preset "
                      f"({PRESET_TIME_ERROR} on the testbed): --calibrate measures it.")]
        if m.swaps_planned and m.swaps_survived is not None:
            text.append(f"{m.swaps_survived} of {m.swaps_planned} swaps survived TensorFlow's graph optimizer.")
        if m.verification_problems:
            text.append("Not everything of the plan survived TensorFlow's graph optimizer: "
                        + "; ".join(m.verification_problems) + ".")
        if m.clones_planned:
            text.append(f"{m.clones_survived} of {m.clones_planned} recomputed ops survived TensorFlow's graph optimizer"
                        + (" (" + "; ".join(m.recompute_problems) + ")." if m.recompute_problems else "."))
        rounds = result.verdict.checks
        if rounds:
            text.append("The measured run decides the verdict: a plan counts as confirmed when its measured peak is "
                        f"within {rounds[0].tolerance:.0%} of the prediction for the machine it ran on and, that "
                        "measured-over-predicted carried to the target's prediction at the requested batch, within "
                        "the target's budget; otherwise the miss corrects the next search.")
            text += [check.describe() + "." for check in rounds]
        sections.append(Section("Measured run", text, [table],
                                [n for n in ("measured_vs_predicted.png",) if n in images]))
    elif result.plan is not None and not result.verdict.measured:
        sections.append(Section("Measured run", ["Not measured (--no-measure): the verdict is the simulator's "
                                                 "prediction only."]))
    elif result.verdict.measured:
        sections.append(Section("Measured run", [result.verdict.headline]))

    memory = summary.get("replicas")
    if memory is not None:
        sections.append(_replicas_section(memory, result.budget_bytes, images))
    distinct = len({(e.peak_bytes, e.step_s) for e in result.evaluations})
    sections.append(Section("Search", [f"{len(result.evaluations)} candidates simulated, {distinct} of them distinct "
                                       "(different parameters often make the same plan: the same predicted peak and "
                                       "step time); the search space has "
                                       f"{result.space.size():,} grid points."], [],
                            [n for n in ("optimization_history.png", "param_importances.png", "distance_histogram.png")
                             if n in images]))
    if result.applies_plan and memory is not None:
        sections.append(Section("Train with the plan", [f"`{plan_file}` holds the plan for one replica; apply it to "
                                                        "every replica of the model built in the strategy's scope"
                                                        + (":" if memory.get("workers", 1) == 1 else
                                                           f" (each worker with its own copy of `{plan_file}`):")],
                                code=(
                                    "import keras, rewriter, tensorflow as tf\n"
                                    f"with tf.distribute.{_strategy_name(memory)}().scope():\n"
                                    "    model = keras.models.load_model('model.keras')\n"
                                    f"step = rewriter.apply_replicated(model, '{plan_file}', "
                                    f"batch_size={memory['global_batch_size']})\n"
                                    "rewriter.use_replicated_step(model, step)  # model.fit(...) runs it on every "
                                    "replica")))
    elif result.applies_plan:
        sections.append(Section("Train with the plan", [f"`{plan_file}` holds the plan; apply it to the model:"],
                                code=(
                                    "import keras, rewriter\n"
                                    "model = keras.models.load_model('model.keras')\n"
                                    f"step = rewriter.apply(model, '{plan_file}', batch_size={result.batch_size})\n"
                                    "rewriter.use_swap_step(model, step)  # model.fit(...) now runs the swapping step\n"
                                    "# or, in a custom loop: loss = step(x, y)")))
    if stage_times is not None:
        sections.append(Section("Run time", [f"This run took {stage_times.describe()} (summary.json: stage_seconds)."]))
    return sections


def _replicas_section(memory: dict, budget_bytes: int, images: dict[str, Path]) -> Section:
    """Memory per device and per machine of a replicated step (``TuneResult.replica_memory``)."""
    def size(value) -> str:
        return "" if value is None else format_bytes(value)

    where = memory["measured_on"] or "not measured"
    devices = pd.DataFrame([(f"replica {k}", d["device"], d["host"], size(d["predicted_bytes"]),
                             size(d.get("predicted_where_measured_bytes")), size(d.get("measured_bytes")),
                             size(d.get("projected_bytes")), size(d["budget_bytes"]),
                             "the machine's (below)" if d.get("host_shared") else size(d.get("measured_host_bytes")),
                             ("out of memory" if memory["out_of_memory"] else "not measured") if "confirmed" not in d
                             else "confirmed" if d["confirmed"] else "not confirmed")
                            for k, d in enumerate(memory["devices"])],
                           columns=["", "device", "host", "predicted (target)", f"predicted ({where})",
                                    f"measured ({where})", "measured, carried to the target", "budget per device",
                                    "host memory measured", "verdict"])
    machine = memory["machine"]
    per_machine = pd.DataFrame([("host memory of the machine (every replica's swaps, moved state and host update; "
                                 "predicted: an upper bound)",
                                 size(machine["predicted_host_bytes"]), size(machine["measured_host_bytes"]),
                                 size(machine["host_budget_bytes"]),
                                 "no plan" if machine["within_budget"] is None
                                 else "within" if machine["within_budget"] else "over"),
                                ("gradients' all-reduce pack, per replica", size(memory["all_reduce_bytes"]), "", "",
                                 "")],
                               columns=["", "predicted", "measured", "budget", ""])
    workers = memory.get("workers", 1)
    text = [f"{memory['replicas']} replicas of {_strategy_name(memory)}"
            + ("" if workers == 1 else f" ({workers} workers, each its own machine; worker 0 chose the plans, every "
                                       "worker measured them on its replicas)")
            + f" at global batch {memory['global_batch_size']} "
            f"({memory['per_replica_batch_size']} per replica): one plan, made for one replica, runs on every "
            f"replica. The budget is per device ({format_bytes(budget_bytes)} each) and the verdict per device: "
            "each replica's measured peak is checked as a single device's is. Host memory is per machine: the "
            "replicas' swaps share it, so each replica's search had its share of the host budget.",
            f"The gradients are all-reduced in one pack per replica ({', '.join(memory['all_reduce_ops'])}): at "
            "the all-reduce a replica holds its gradients, the pack and the reduced copy (docs/design.md 14)."]
    return Section("Devices and machine", text, [devices, per_machine],
                   [n for n in ("replica_memory.png",) if n in images])


def _strategy_name(memory: dict) -> str:
    return "MirroredStrategy" if memory.get("workers", 1) == 1 else "MultiWorkerMirroredStrategy"


def markdown_table(table: pd.DataFrame, float_format: str = "{:.4g}") -> str:
    """A plain Markdown table (no tabulate dependency)."""
    def cell(value) -> str:
        return float_format.format(value) if isinstance(value, float) else str(value).replace("|", "\\|")

    header = "| " + " | ".join(str(c) for c in table.columns) + " |"
    rule = "|" + "|".join("---" for _ in table.columns) + "|"
    rows = ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join([header, rule, *rows])


def _markdown(title: str, sections: list[Section]) -> str:
    lines = [f"# {title}", ""]
    for section in sections:
        lines += [f"## {section.title}", ""]
        for paragraph in section.paragraphs:
            lines += [paragraph, ""]
        for table in section.tables:
            lines += [markdown_table(table), ""]
        if section.code:
            lines += ["```python", section.code.rstrip(), "```", ""]
        for image in section.images:
            lines += [f"![{image}]({image})", ""]
    return "\n".join(lines)


def _inline(text: str) -> str:
    """Escape, then the two bits of Markdown the paragraphs use: **bold** and `code`."""
    text = html.escape(text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)


def _html(title: str, sections: list[Section], directory: Path) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
             "body{font-family:system-ui,sans-serif;max-width:960px;margin:2em auto;padding:0 1em;color:#222}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 10px;text-align:left}"
             "th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee;margin:0.5em 0}"
             "pre{background:#f6f8fa;padding:1em;overflow:auto}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    for section in sections:
        parts.append(f"<h2>{html.escape(section.title)}</h2>")
        parts += [f"<p>{_inline(p)}</p>" for p in section.paragraphs]
        parts += [table.to_html(index=False, border=0, escape=True) for table in section.tables]
        if section.code:
            parts.append(f"<pre><code>{html.escape(section.code)}</code></pre>")
        for image in section.images:
            data = base64.b64encode((directory / image).read_bytes()).decode()
            parts.append(f"<img alt='{html.escape(image)}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    return "\n".join(parts)


# every file a report may have; study.log (or study.db) is the Optuna storage, not part of it
REPORT_FILES = ("report.md", "report.html", "summary.json", "trials.csv", "plan.json", "closest_plan.json",
                *plots.FIGURES, *plots.STUDY_FIGURES)


def _keep_previous(out_dir: Path) -> Path | None:
    """Move the report already in ``out_dir`` (if any) to ``previous/<time>-<model>-b<batch>/``: it
    is the user's, and may hold what this run does not (a measurement, another batch size)."""
    found = [out_dir / name for name in REPORT_FILES if (out_dir / name).is_file()]
    if not found:
        return None
    try:
        old = json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):
        old = {}
    if not isinstance(old, dict):
        old = {}
    newest = max(path.stat().st_mtime for path in found)
    stamp = datetime.fromtimestamp(newest, timezone.utc).strftime("%Y%m%d-%H%M%S")
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{stamp}-{old.get('model', 'model')}-b{old.get('batch_size', '')}")
    target, k = out_dir / "previous" / label, 1
    while target.exists():
        k += 1
        target = out_dir / "previous" / f"{label}-{k}"
    target.mkdir(parents=True)
    for path in found:
        os.replace(path, target / path.name)
    return target


def write_report(result, out_dir: str | Path, clock: StageClock | None = None, *,
                 figures: bool = True) -> dict[str, Path]:
    """Write every output file of ``result`` into ``out_dir``; returns them by name (and under
    ``"previous"`` where an earlier run's report was moved, if one was). ``clock``: the run's stage
    clock; its times, the plots and tables counted as the report stage, go into summary.json
    (``stage_seconds``) and the report. ``figures=False``: no plots drawn (the report's text and tables are
    the same; an earlier run's figures are removed like any of its files this run does not write)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".partial-", dir=out_dir))
    clock = clock or StageClock()
    try:
        with clock.stage("report"):
            images = plots.draw_all(result, scratch) if figures else {}
            files: dict[str, Path] = dict(images)
            plan_file = "plan.json" if result.feasible else "closest_plan.json"
            named = result.named_plan()
            if named is not None and (named.changes_step or result.applies_plan):
                (scratch / plan_file).write_text(named.to_json())
                files[plan_file] = scratch / plan_file
            pd.DataFrame([e.row() for e in result.evaluations]).to_csv(scratch / "trials.csv", index=False)
            files["trials.csv"] = scratch / "trials.csv"
            summary = result.summary()
        stage_times = clock.times()
        (scratch / "summary.json").write_text(json.dumps({**summary, "stage_seconds": stage_times.to_dict()},
                                                         indent=1, default=str))
        files["summary.json"] = scratch / "summary.json"
        title = f"Swap tuning report: {result.model}, batch {result.batch_size}"
        sections = _sections(result, images, plan_file, stage_times)
        (scratch / "report.md").write_text(_markdown(title, sections))
        (scratch / "report.html").write_text(_html(title, sections, scratch))
        files["report.md"], files["report.html"] = scratch / "report.md", scratch / "report.html"
        previous = _keep_previous(out_dir)
        stale = set(REPORT_FILES) - set(files)  # an earlier run's plan or figure must not pass for this run's
        final = {} if previous is None else {"previous": previous}
        for name, path in files.items():  # each move is atomic; the report pages go last
            if name not in ("report.md", "report.html"):
                os.replace(path, out_dir / name)
                final[name] = out_dir / name
        for name in stale:
            (out_dir / name).unlink(missing_ok=True)
        for name in ("report.md", "report.html"):
            os.replace(files[name], out_dir / name)
            final[name] = out_dir / name
        return final
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

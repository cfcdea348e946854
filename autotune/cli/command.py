"""python -m autotune MODEL_DIR: tune activation swapping for a saved Keras model.

Exit codes: 0 done (a plan fits, confirmed by a measured run unless --no-measure); 2 bad input;
3 no plan fits the budget, or none was confirmed by a measured run (the report is still written);
4 a worker of a TF_CONFIG's cluster stopped (every worker's run ends with it);
130 interrupted (finished trials stay in the study; run the same command again to resume).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from autotune.cli.replicas import (check_settings, check_tf_config, check_workers, device_lines, load_multi_worker,
                                   load_replicated, several_gpus_note, worker_folder)
from autotune.inputs import InputError, format_bytes, parse_bytes

EXIT_OK, EXIT_INPUT, EXIT_NO_FIT, EXIT_WORKER_STOPPED, EXIT_INTERRUPTED = 0, 2, 3, 4, 130

DESCRIPTION = """\
Find swap settings that make a Keras model's training step fit in accelerator memory.

MODEL_DIR holds a compiled Keras model saved as .keras (or give the .keras file) and, optionally,
autotune.toml with defaults for the flags below, e.g.:

    batch_size = 64
    device = "v100-16gb"          # or: memory = "16GiB"
    input_shapes = {image = [224, 224, 3]}   # where the model leaves dimensions open
    trials = 200
    recompute = false             # swap only, as --no-recompute
    split = false                 # never split ops along the batch, as --no-split
    state = false                 # optimizer state stays on the device, as --no-state
    graph_rewrites = ["split-concat", "elide-broadcasts"]   # U-Nets: see --rewrite
    imports = ["my_layers"]       # the model's custom objects: see --import

The tool captures the training step, simulates candidate swap plans (threshold, swap-in
window, grouping, sync mode, size filter, execution order, which tensors, distances in levels or
execution steps, trigger policy, swap-ins after copies out), searches them with
Optuna, applies the winner to the real TensorFlow step, measures it, and writes
report.html/report.md, plots, trials.csv, plan.json and summary.json into --out.
"""


class _Parser(argparse.ArgumentParser):
    """Bad flags: one line and exit 2, like every other input error."""

    def error(self, message: str):
        self.exit(EXIT_INPUT, f"error: {message} (see python -m autotune --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from autotune.search.policies import POLICIES, SAMPLERS
    from simulator.device.presets import DEVICES

    parser = _Parser(prog="python -m autotune", description=DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="directory with one .keras model, or the .keras file")
    parser.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                        help="module with the model's custom layers, losses or model class, imported before the model "
                             "is loaded (repeatable; also imports in autotune.toml): found in MODEL_DIR first, then on "
                             "the Python path; a path to a .py file works too")
    parser.add_argument("--batch-size", type=int, help="training batch size to tune for (required here or in "
                                                       "autotune.toml, except with --maximize-batch)")
    budget = parser.add_argument_group("memory budget (default: the visible GPU; without one, the v100-16gb preset)")
    budget.add_argument("--memory", help="budget for the training step, e.g. 16GiB, 12GB, 800MiB")
    budget.add_argument("--device", choices=sorted(DEVICES),
                        help="device preset: its usable memory is the budget unless --memory is given, and its "
                             "compute and link speeds time the simulation")
    search = parser.add_argument_group("search")
    search.add_argument("--policy", choices=POLICIES, help="search policy (default optuna)")
    search.add_argument("--trials", type=int, help="candidates to simulate (default 200; with recomputation, the "
                                                   "default, a swap-only search of as many runs first; a new "
                                                   "search refines off the grid with 15 %% more; a resumed study "
                                                   "adds this many; the exhaustive policy walks its whole grid, "
                                                   "--timeout stops it)")
    search.add_argument("--timeout", type=float, help="stop the search after this many seconds (with recomputation, "
                                                      "the swap-only search first has half of them)")
    search.add_argument("--sampler", choices=sorted(SAMPLERS), help="Optuna sampler (default tpe)")
    search.add_argument("--seed", type=int, help="random seed of the sampler (default 0)")
    search.add_argument("--storage", help="Optuna storage: a journal file (default: study.log in --out, or the "
                                          "SQLite study.db an earlier version left there) or a database URL, e.g. "
                                          "postgresql://user@host/db to tune from several machines")
    search.add_argument("--study-name", help="Optuna study name (default: derived from model, batch, device, budget)")
    search.add_argument("--maximize-batch", action="store_true",
                        help="find the largest batch that fits with swapping, and tune for it")
    search.add_argument("--max-overhead", type=float,
                        help="with --maximize-batch: largest acceptable simulated slow-down, e.g. 0.3 for 30%%")
    search.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                        help="--no-recompute: swap only, never recompute a tensor for its far readers (by default "
                             "the search recomputes tensors where that costs less than keeping or swapping them; "
                             "also recompute = false in autotune.toml)")
    search.add_argument("--split", action=argparse.BooleanOptionalAction, default=None,
                        help="--no-split: never run ops in parts along the batch (by default, where the budget is "
                             "under the floor of every plan that moves whole tensors, the ops that set it run in "
                             "parts, exactly, docs/design.md 12; also split = false in autotune.toml)")
    search.add_argument("--state", action=argparse.BooleanOptionalAction, default=None,
                        help="--no-state: keep the optimizer state on the device (by default, where no plan fits "
                             "with it there, the slots of the largest variables of SGD, Adam or AdamW, then their "
                             "weights too, live on the host and their update runs there, or the slots are streamed "
                             "around it on the device where that is faster; also state = false in autotune.toml)")
    search.add_argument("--rewrite", action="append", metavar="NAME",
                        help="exact graph rewrite to make before swapping (repeatable; also graph_rewrites in "
                             "autotune.toml): split-concat splits a convolution reading a channel concatenation "
                             "(U-Net decoders) into one per input, so the concatenation is never held; "
                             "elide-broadcasts lets elementwise ops broadcast per-channel gradients instead of "
                             "tiling them to full size (batch normalisation's backward)")
    run = parser.add_argument_group("output")
    run.add_argument("--out", help="output directory (default: autotune-out); a report already there is moved "
                                   "to its previous/ folder")
    run.add_argument("--no-measure", action="store_true", help="skip the measured run of the winning plan")
    run.add_argument("--plots", action=argparse.BooleanOptionalAction, default=None,
                     help="--no-plots: write the report, plan and tables without the figures, which take a few "
                          "seconds to draw (also plots = false in autotune.toml)")
    run.add_argument("--replicas", type=int, default=1, metavar="N",
                     help="train under MirroredStrategy on N devices: a plan for one replica, the budget and verdict "
                          "per device, the host budget shared by the replicas; measured on the first N visible "
                          "GPUs, else on the CPU testbed's N replicas. Under a TF_CONFIG of several workers run the "
                          "command on every worker instead (MultiWorkerMirroredStrategy, a replica on each of a "
                          "worker's GPUs, one on its CPU testbed; worker 0 decides and writes the report, worker k "
                          "the same into --out/worker-k; docs/design.md 14)")
    run.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None,
                     help="measure step times on this machine (the model's own step profiled at two batch sizes, "
                          "copies and swapped steps timed) instead of the preset's datasheet estimate: the search "
                          "runs on them where they model the device searched for (a visible GPU, or --device "
                          "cpu-testbed without one), and they predict the measured run's step time (default: on "
                          "whenever the run is measured)")
    run.add_argument("--recalibrate", action="store_true",
                     help="measure the step times again instead of reusing the calibration an earlier run of the same "
                          "model made on this machine (kept in $AUTOTUNE_CACHE_DIR, else ~/.cache/autotune)")
    run.add_argument("--input-shape", action="append", default=[], metavar="NAME=D1,D2,...",
                     help="shape of an input without the batch, where the model leaves dimensions open or has no "
                          "defined inputs (a subclassed model never built: NAME is its call()'s first argument, "
                          "usually inputs) (repeatable)")
    run.add_argument("--quiet", action="store_true", help="no progress bar, only the result")
    return parser


def _input_shapes(entries: list[str]):
    shapes = {}
    for entry in entries:
        name, _, dims = entry.partition("=")
        try:
            shapes[name.strip()] = [int(d) for d in dims.split(",") if d.strip()]
        except ValueError:
            raise InputError(f"--input-shape {entry!r}: expected NAME=D1,D2,... with whole numbers") from None
        if not name.strip() or not shapes[name.strip()] or min(shapes[name.strip()]) < 1:
            raise InputError(f"--input-shape {entry!r}: expected NAME=D1,D2,... with positive whole numbers")
    return shapes or None


def _settings(args: argparse.Namespace):
    """Flags over autotune.toml over defaults, all checked before anything slow happens."""
    from autotune.cli.imports import check_model_archive, resolve_imports
    from autotune.inputs import find_model_file, load_config

    model_file = find_model_file(args.model_dir)
    check_model_archive(model_file)
    config = load_config(model_file.parent)
    batch = _given(args.batch_size, config.batch_size)
    if batch is None and args.maximize_batch:  # only where the capture starts: sizes are linear in the batch,
        batch = max(1, args.replicas)  # the search picks it (one sample a replica)
    if batch is None:
        raise InputError("no batch size: give --batch-size or batch_size in autotune.toml")
    if batch < 1:
        raise InputError(f"batch size must be positive, got {batch}")
    workers = check_tf_config()  # several: every worker runs this command under MultiWorkerMirroredStrategy
    if workers > 1:
        check_workers(workers, args.replicas, int(batch))
    if args.replicas != 1:  # several devices (docs/design.md 14): what it cannot run refused here
        check_settings(args.replicas, int(batch))
    memory = _given(args.memory, config.memory)
    trials = _given(args.trials, config.trials, 200)
    if trials < 1:
        raise InputError(f"--trials must be at least 1, got {trials}")
    if args.seed is not None and args.seed < 0:
        raise InputError(f"--seed must not be negative, got {args.seed}")
    timeout = _given(args.timeout, config.timeout)
    if timeout is not None and timeout <= 0:
        raise InputError(f"--timeout must be positive, got {timeout}")
    max_overhead = _given(args.max_overhead, config.max_overhead)
    recompute = _given(args.recompute, config.recompute, True)
    split = _given(args.split, config.split, True)
    state = _given(args.state, config.state, True)
    if max_overhead is not None and max_overhead < 0:
        raise InputError(f"--max-overhead must not be negative, got {max_overhead}")
    from autotune.search.policies import POLICIES, SAMPLERS
    from simulator.device.presets import DEVICES

    policy = args.policy or config.policy or "optuna"
    sampler = args.sampler or config.sampler or "tpe"
    device = args.device or config.device
    if policy not in POLICIES:
        raise InputError(f"autotune.toml: policy {policy!r} is not one of {', '.join(POLICIES)}")
    if sampler not in SAMPLERS:
        raise InputError(f"autotune.toml: sampler {sampler!r} is not one of {', '.join(sorted(SAMPLERS))}")
    graph_rewrites = list(dict.fromkeys(args.rewrite or config.graph_rewrites or []))
    if graph_rewrites:  # the names live with the rewrites (importing them loads TensorFlow)
        from rewriter.trace.graph_rewrites import REWRITES

        unknown = [r for r in graph_rewrites if r not in REWRITES]
        if unknown:
            where = "--rewrite" if args.rewrite else "autotune.toml: graph_rewrites"
            raise InputError(f"{where}: unknown graph rewrite {unknown[0]!r}; known: {', '.join(REWRITES)}")
    if device is not None and device.lower().replace("_", "-") not in DEVICES:
        raise InputError(f"unknown device {device!r}; known: {', '.join(sorted(DEVICES))}")
    imports = resolve_imports([(entry, "autotune.toml: imports") for entry in config.imports or []]
                              + [(entry, "--import") for entry in args.imports or []], model_file.parent)
    from autotune.run.options import MeasureOptions, SearchOptions

    return {
        "model_file": model_file,
        "replicas": args.replicas,
        "workers": workers,
        "imports": imports,
        "batch_size": int(batch),
        "memory": None if memory is None else parse_bytes(memory, "--memory"),
        "memory_from": "--memory" if args.memory is not None else "autotune.toml: memory",
        "device": device,
        "device_from": "--device" if args.device else "autotune.toml: device",
        "search": SearchOptions(policy=policy, sampler=sampler, trials=int(trials), timeout_s=timeout,
                                seed=_given(args.seed, config.seed, 0),
                                study_name=args.study_name, maximize_batch=args.maximize_batch,
                                max_overhead=max_overhead, recompute=recompute, split=split, state=state,
                                progress=not args.quiet),
        "input_shapes": _input_shapes(args.input_shape) or config.input_shapes,
        "input_shapes_from": "--input-shape" if args.input_shape else "autotune.toml: input_shapes",
        "graph_rewrites": graph_rewrites,
        "label_shapes": config.label_shapes,
        "label_dtype": config.label_dtype,
        "out": Path(args.out or "autotune-out"),
        "plots": _given(args.plots, config.plots, True),
        "measurement": MeasureOptions(measure=not args.no_measure, calibrate=args.calibrate,
                                      recalibrate=args.recalibrate),
    }


def _given(*values):
    """The first of ``values`` that was given (not None): a flag, then autotune.toml, then the default."""
    return next((value for value in values if value is not None), None)


def default_storage(out: Path) -> str:
    """The study's journal file in ``out``; an existing SQLite ``study.db`` there (what earlier
    versions wrote) is resumed instead."""
    sqlite = out / "study.db"
    return f"sqlite:///{sqlite.resolve()}" if sqlite.is_file() else str((out / "study.log").resolve())


def _say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _said_if_slow(quiet: bool, text: str, after_s: float = 3.0):
    """Say ``text`` once the block has run ``after_s`` seconds (a wait the user would otherwise not understand)."""
    timer = threading.Timer(after_s, _say, args=(quiet, text))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    started = time.monotonic()
    try:
        settings = _settings(args)
        return _run(settings, args, started)
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print("\ninterrupted: finished trials are kept in the study; run the same command again to resume "
              "(the previous report, if any, is unchanged)", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(settings: dict, args: argparse.Namespace, started: float) -> int:
    from rewriter.environment import prepare_environment  # before TensorFlow is imported (docs/design.md 4)

    prepare_environment()
    quiet = args.quiet
    out: Path = settings["out"]
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InputError(f"cannot create --out {out}: {error.strerror or error}") from None
    from autotune.search.study_copy import check_storage

    search = replace(settings["search"], storage=args.storage or default_storage(out))
    check_storage(search.storage)  # a file that is no study: refused before the model loads
    measurement = settings["measurement"]
    replicas = settings["replicas"]
    _say(quiet, f"loading {settings['model_file']} ...")
    from autotune.cli.imports import load_user_model, model_notes
    from autotune.run.stage_times import StageClock
    from autotune.run.target import resolve_target

    clock = StageClock(started)
    with clock.stage("load"):
        from rewriter.placement.placements import configure_testbed  # imports TensorFlow; its runtime starts later

        # resolved once, here (TensorFlow imported: a visible GPU is seen), and handed down to the search, the
        # measured run, the verdict and the report
        target = resolve_target(settings["device"], settings["memory"], memory_from=settings["memory_from"],
                                device_from=settings["device_from"])
        load_notes: list[str] = []
        # a budget given by --memory or --device becomes a GPU's memory limit (each replica's), so that what runs
        # here is held to it
        runs = measurement.measure or measurement.calibrates
        gpu_limit = target.device_budget_bytes if target.limits_gpu and runs else None
        if settings["workers"] > 1:  # each worker's GPUs or testbed, the model in MultiWorkerMirroredStrategy's scope
            model = load_multi_worker(lambda: load_user_model(settings, load_notes), gpu_limit)
        elif replicas != 1:  # N visible GPUs or the testbed's 2N logical CPUs, the model in MirroredStrategy's scope
            model = load_replicated(replicas, lambda: load_user_model(settings, load_notes), gpu_limit)
        else:
            if runs:  # before TF's runtime starts: two logical CPUs when there is no GPU, else GPU:0's limit
                configure_testbed(gpu_memory_limit_bytes=gpu_limit)
            model = load_user_model(settings, load_notes)  # the user's --import modules first
            import tensorflow as tf

            gpus = several_gpus_note(len(tf.config.list_physical_devices("GPU")))
            load_notes += [gpus] if gpus else []
        from simulator.warmup import warm_up

        with _said_if_slow(quiet, "compiling the simulator's kernels (the first run on this machine only: about a "
                                  "minute on 2 cores) ..."):
            warm_up()
    from autotune.run.confirm import tune
    from autotune.run.plan_run import WorkerStopped
    from rewriter.trace.replicas import resolve_replicas
    from rewriter.trace.tracing import CaptureError
    from rewriter.trace.step_inputs import StepInputs

    inputs = StepInputs(settings["input_shapes"], settings["label_shapes"], settings["label_dtype"])
    try:
        result = tune(model, batch_size=settings["batch_size"], target=target, inputs=inputs,
                      graph_rewrites=settings["graph_rewrites"], search=search, measurement=measurement,
                      name=getattr(model, "name", None) or settings["model_file"].stem, say=lambda text: _say(quiet, text),
                      clock=clock)
    except CaptureError as error:
        raise InputError(f"cannot capture the training step of {settings['model_file']}: {error}") from None
    except WorkerStopped as error:  # a worker of a TF_CONFIG's cluster: its own output says more
        print(f"error: {error}", file=sys.stderr)
        return EXIT_WORKER_STOPPED
    result = replace(result, notes=[*result.notes, *load_notes, *model_notes(model)])
    _say(quiet, f"budget: {format_bytes(result.budget_bytes)} from {result.budget_source}")
    several = settings["workers"] > 1
    worker = resolve_replicas(model).task if several else 0
    if worker:  # worker 0's result, written on this worker's machine too (its plan.json to train with), apart from
        out = out / worker_folder(worker)  # worker 0's own report where --out is one folder shared by the workers
    from autotune.report.writer import write_report

    try:
        files = write_report(result, out, clock, figures=settings["plots"])
    except OSError as error:  # the study keeps the trials: the same command writes the report again
        raise InputError(f"cannot write the report into {out}: {error.strerror or error} (the trials are kept "
                         f"in the study; run the same command again once it is writable)") from None
    if "previous" in files:
        _say(quiet, f"the report that was in {out} is now in {files['previous']}")
    text = _summary_text(result, files["report.html"], time.monotonic() - started)
    if replicas != 1 or several:
        text = text.replace("\nverdict: ", "\n" + "\n".join(device_lines(result)) + "\nverdict: ", 1)
    print(text)
    return EXIT_OK if result.verdict.ok else EXIT_NO_FIT


def _summary_text(result, report: Path | str, seconds: float) -> str:
    from autotune.run.calibrated_timing import time_model_note
    from simulator.state import moved_kinds
    from autotune.report.writer import param_text
    from autotune.run.training import training_phrase

    shown = result.shown
    memory = result.replica_memory()
    batch = (f"{result.batch_size}" if memory is None else
             f"{result.batch_size} per replica ({memory['replicas']} replicas, global batch {memory['global_batch_size']})")
    lines = [f"model {result.model}, batch {batch}, budget {format_bytes(result.budget_bytes)}"
             + ("" if memory is None else " per device") + f" ({result.budget_source})",
             f"trained with: {training_phrase(result.graph.meta.get('training'))}"]
    if result.graph_rewrites:
        changes = result.graph.meta.get("graph_rewrite_changes", {})
        lines.append("graph rewrites: " + ", ".join(f"{r} ({len(changes.get(r, []))} ops)" for r in result.graph_rewrites)
                     + "; the figures below are of the rewritten step")
    lines.append(f"without swapping: peak {format_bytes(result.baseline.peak_bytes)}, "
                 f"step {result.baseline.step_s:.4g} s")
    if result.applies_plan and (result.plan.changes_step or result.recomputes):
        recomputed = result.recomputed()
        lines.append(f"with the plan:    peak {format_bytes(shown.peak_bytes)}, step {shown.step_s:.4g} s "
                     f"({shown.metrics['overhead']:+.1%}), {result.plan.n_swaps} tensors swapped, "
                     f"{len(recomputed)} recomputed ({format_bytes(sum(row['bytes'] for row in recomputed))}), "
                     f"{result.plan.order_name} order"
                     + (f", {moved_kinds(result.plan.host_state)} of {len(result.plan.host_state)} variable(s) on the host"
                        if result.plan.host_state else "")
                     + (f" ({result.replay.host_update_s:.3g} s of the step on the host's CPU)"
                        if result.replay is not None and result.replay.host_update_s else ""))
        p = shown.params
    if result.applies_plan and (result.plan.changes_step or result.recomputes) and p is not None:
        cost = param_text("recompute_cost", p.to_dict().get("recompute_cost"))  # a unit, not 1.13e-11
        lines.append(f"parameters: threshold={p.threshold} lb={p.lb} ub={p.ub} groupby={p.groupby} sync={p.sync} "
                     f"min_bytes={p.min_bytes} tensors={p.tensors} distance={p.distance} trigger={p.trigger}"
                     f"{' after_copies_out' if p.after_copies_out else ''}"
                     f"{f' recompute={p.recompute} recompute_cost={cost}' if p.recomputes else ''}"
                     f"{f'; {len(p.keep_tensors)} tensors kept on the device for host room' if p.keep_tensors else ''}")
    if result.plan is not None:  # a foregone verdict (autotune.run.floor) timed nothing
        lines.append(f"step times: {time_model_note(result.device, result.calibration)}")
    lines += [f"note: {note}" for note in result.notes]
    m = result.measurement
    if m is not None:
        peak = "out of memory" if m.out_of_memory else f"peak {format_bytes(m.peak_bytes)}"
        ratio = f", predicted / measured {m.predicted_step_s / m.step_s:.2f}" if m.step_s and m.step_s == m.step_s else ""
        lines.append(f"measured on {m.measured_on} at batch {m.batch_size}: {peak} "
                     f"(predicted {format_bytes(m.predicted_peak_bytes)}), step {m.step_s:.4g} s "
                     f"(predicted {m.predicted_step_s:.4g} s{ratio}, "
                     f"{_time_source(m)})")
    lines.append(f"verdict: {result.verdict.headline}")
    lines.append(f"report: {report}   ({seconds:.0f} s)")
    return "\n".join(lines)


def _time_source(m) -> str:
    """Where a measured run's predicted step time comes from, for the summary line."""
    if not m.time_calibrated:
        return "a datasheet estimate"
    if m.time_anchored_to:
        return "calibrated on this machine, re-anchored to the unswapped steps timed beside it"
    return "calibrated on this machine"

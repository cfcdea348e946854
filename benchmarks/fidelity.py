"""Simulator fidelity on the CPU testbed: predicted vs measured accelerator-side peak, per model and plan.

    python -m benchmarks fidelity [--models resnet50,vgg16] [--quick] [--timeout 900] [--repeats 3] [--peak-repeats 2]
    python -m benchmarks fidelity --zoo [--models lstm,gru]   # benchmarks.zoo, in chunks
    python -m benchmarks fidelity --recompute --models resnet50,mobilenetv2   # plans that recompute

For every model (one fresh Python process each, so models and allocator state never mix) the
training step is captured, then for every plan (no swapping, and ``SwapParams`` settings that
exercise the threshold, the swap-in window lb/ub, groupby, the sync modes and both execution
orders) the rewritten step is built with ``rewriter.step.apply_plan`` (serialized in the plan's order, as by
default) and measured with ``rewriter.timing.measurement`` on the CPU testbed (``CPU:0`` plays the accelerator,
``CPU:1`` the host, swaps are ``DeepCopy``), or on GPU:0 when one is visible (automatic). Beside each
measurement: the simulator's prediction (``simulator.replay(graph, plan, device)``, with the
``cpu-testbed`` preset or the visible GPU's) and, for the unswapped step, Grappler's static
estimate (``Cluster.DeterminePeakMemoryUsage`` on a MetaGraphDef of the traced step), the baseline
the simulator must beat.

Peaks are compared in *requested* bytes (docs/design.md 4: on the testbed the host copies share the
CPU's one allocator pool, which inflates the device-side chunk figure); the allocator (chunk) peak
is reported beside it. Step times are reported too, but the cpu-testbed time model is only roughly
calibrated and swaps compete with compute for the same two cores: the step-time error is
informational, not a target.

Writes ``benchmarks/results/fidelity.{csv,md}``, ``fidelity_scatter.png`` (predicted vs measured,
y = x with +-5 % / +-10 % bands) and ``fidelity_errors.png`` (per-model errors); ``--quick`` (2
models x 3 plans, a smoke run) writes ``fidelity_quick.*`` instead, so it never overwrites the
full table. Target (docs/design.md 5): median error within 5 %, worst within 10 %.

``--zoo`` measures the models of ``benchmarks.zoo`` instead (models nobody tuned the simulator for)
and writes ``fidelity_zoo.*``; each model's records are kept in ``results/fidelity_zoo_runs/``, so
the zoo can be measured in chunks (``--zoo --models a,b``: those again, the others from their kept
run) and its runtime is the sum of the models' runs. Its targets (docs/design.md 5) hold per model: median
|error| <= 2 %, worst <= 10 %, measured above predicted never more than 5 %; the notes give per model
what the capture could not size or swap (``graph.meta``) and, where a model misses, why.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from benchmarks.common import RESULTS_DIR, STARTED_S, start_measuring_process, write_results
from benchmarks.zoo import ZOO

log = logging.getLogger(__name__)
MiB = 2**20
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ModelSetup:
    """A model at a size where one measured step takes a few seconds at most on the 2-core testbed."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    batch: int = 8
    graph_rewrites: tuple[str, ...] = ()  # rewriter.trace.graph_rewrites made before the plans
    zoo: bool = False  # a benchmarks.zoo model (built by its entry), not a benchmarks.models one

    @property
    def key(self) -> str:
        return "+".join((self.name,) + self.graph_rewrites)

    def describe(self) -> str:
        if self.zoo:
            return ZOO[self.name].describe()
        options = ", ".join(f"{key}={value}" for key, value in self.kwargs.items())
        rewrites = "".join(f" --rewrite {r}" for r in self.graph_rewrites)
        return f"{self.name}({options}) b{self.batch}{rewrites}"


MODELS: dict[str, ModelSetup] = {setup.key: setup for setup in (
    ModelSetup("resnet50", {"image_size": 224}, 8),
    ModelSetup("unet3d", {"size": 64, "base_filters": 16, "depth": 4}, 1),
    ModelSetup("unet3d", {"size": 64, "base_filters": 16, "depth": 4}, 1, ("split-concat", "elide-broadcasts")),
    ModelSetup("vgg16", {"image_size": 128}, 8),
    ModelSetup("mobilenetv2", {"image_size": 160}, 8),
    ModelSetup("densenet121", {"image_size": 128}, 4),
    ModelSetup("transformer_encoder", {"seq_len": 128}, 8),
)}

# (label, SwapParams as a dict; None = no swapping). Together they exercise every rule of
# docs/design.md 1.4: thresholds from 1 (every far read) to 20, swap-in windows, groupby, the size
# filter, the sync modes (out, both), both trigger policies, both execution orders, both sets of
# swappable tensors, both units of distance, and swap-ins after their trigger's copies out; 6 swap
# plans, not more, so that the 7 setups stay within docs/design.md 5's 30 minutes on the 2-core machine
# (each plan is a rewrite, a verifying first run and 3 measured steps: 50-75 s on ResNet-50 or
# DenseNet-121; with 7 swap plans the run took 31.6 min).
PLANS: list[tuple[str, dict[str, Any] | None]] = [
    ("none", None),
    ("T1", {"threshold": 1}),
    ("T5 lb2-ub20 g4 sync-out", {"threshold": 5, "lb": 2, "ub": 20, "groupby": 4, "sync": "out"}),
    ("T3 ub5 g2 sync-both mem", {"threshold": 3, "lb": 1, "ub": 5, "groupby": 2, "sync": "both", "order": "memory"}),
    ("T20 lb3-ub30 >=1MiB mem", {"threshold": 20, "lb": 3, "ub": 30, "min_bytes": MiB, "order": "memory"}),
    ("T2 level-trigger mem all", {"threshold": 2, "lb": 2, "ub": 8, "trigger": "level", "order": "memory",
                                  "tensors": "all"}),
    ("T1 slots ub1 all after copies", {"threshold": 1, "ub": 1, "trigger": "level", "tensors": "all", "distance": "slot",
                                       "after_copies_out": True}),
]

# ``--recompute``: plans with recomputation beside the swaps: every cheap tensor of 1 MiB or more
# recomputed for its far readers (``simulator.recompute.choice``), the rest swapped on the graph with the clones
RECOMPUTE_PLANS: list[tuple[str, dict[str, Any] | None]] = [
    ("none", None),
    ("recompute cheap, T2", {"threshold": 2, "recompute": "cheap"}),
    ("recompute cheap, T5 ub20 sync-out mem", {"threshold": 5, "ub": 20, "sync": "out", "order": "memory",
                                               "recompute": "cheap"}),
]

# ``--zoo``: every benchmarks.zoo model at its testbed batch (models nobody tuned the simulator for)
ZOO_MODELS: dict[str, ModelSetup] = {name: ModelSetup(name, {}, entry.batch, zoo=True) for name, entry in ZOO.items()}
# each zoo model's records are kept here, so the zoo can be measured in chunks (``--zoo --models a,b``)
# and its table built from the latest run of every model
ZOO_RUNS_DIR = RESULTS_DIR / "fidelity_zoo_runs"

QUICK_MODELS = ("transformer_encoder", "vgg16")
QUICK_PLANS = ("none", "T1", "T3 ub5 g2 sync-both mem")

TARGET_MEDIAN, TARGET_WORST = 0.05, 0.10
# the zoo's targets (docs/design.md 5): per model, and measured above predicted (the side of an OOM) at most 5 %
ZOO_TARGET_MEDIAN, ZOO_TARGET_WORST, ZOO_TARGET_UNDER = 0.02, 0.10, 0.05
# what a captured graph says about memory it could not size or swap (shown in the zoo's notes)
GRAPH_META_REPORTED = ("unknown_shapes", "unresolved_tensors", "unswappable", "mixed_precision")
# the folded constants a step's kernels hold, counted by the capture and left out of the measurement before
CONSTANTS = ("the measurement left out the constants the step's first call folds and its kernels hold "
             "(rewriter.timing.measurement counts them now, memtrace.constant_bytes)")
# why a zoo model missed its targets, as diagnosed (the mechanism, not one run's numbers; comparing the
# profiler trace's live set at its peak with simulator.explain.live_buffers at the same op)
ZOO_NOTES: dict[str, str] = {
    "efficientnetb0": ("was 10 % over unswapped: swish's beta * x (beta 1), which Grappler removes, was counted and "
                       "held from the forward pass to the backward one (rewriter.tf_effects.passthrough); then its sync-both plan "
                       "12 % under: synchronous swap-ins ran right after the forward pass (rewriter.edit.graph_edit now waits for "
                       "the control edges of the ops a consumer reads through, as the simulator does)"),
    "attention": ("was 11-13 % over: a softmax gradient's dy * softmax writes into the swap-in of softmax when dy is "
                  "still read (simulator.sharing: every input an op may write into, in input order), and a dropout "
                  "mask's uniform * 1 + 0 was swapped three times over (rewriter.tf_effects.passthrough)"),
    "mixed16_attention": f"was 2-4 % over in every plan (0.13 MiB): {CONSTANTS}",
    "custom_layer_loss": f"was 1.6-2.2 % over in every plan (its loss gradient's 108 KiB tile): {CONSTANTS}",
    "unet2d_upsampling": (f"was 1.1-1.4 % over in every plan: {CONSTANTS}. T2 level-trigger: 9 % over (the safe side), "
                          "its 5 profiled steps 2.65-2.91 MB against 3.17 predicted: not traced"),
    "unet2d_transpose": (f"was 1.1-1.4 % over in every plan: {CONSTANTS}. T2 level-trigger: 4.6 % over (the safe side) "
                         "in 4 of 5 profiled steps, the fifth at the prediction (2.870 vs 2.873 MB): step to step, as a "
                         "swap-in the executor queues until its reader needs it (Known sources of deviation); not traced"),
    "separable_cnn": ("its 17-22 % misses and multi_io's 17-20 % were the serialized order broken where Grappler removes "
                      "a convolution bias gradient's reshape pair, taking the chain's control edge along; rewriter.edit.graph_edit "
                      "chains past such ops. Its T2 level-trigger measured 4.5 % above the prediction in the run "
                      "before (not diagnosed; copies out the executor queued behind the chain are one such cause, "
                      "now prevented on the testbed)"),
    **{name: ("was 2-4 % either side: a While loop's variables replace their starting values, a list's zeros hold one "
              "tensor per element, the input sequence lives in the gradient's list, one iteration's temporaries are "
              "live while the loop runs (rewriter.tf_effects.loops)") for name in ("lstm", "gru", "bilstm", "stacked_gru")},
}

# What the deviations seen so far came from (diagnosed by comparing the profiler trace's live set at
# its peak with simulator.explain.live_buffers at the same op). Printed under the table as context
# for the errors; they are mechanisms, not numbers of any one run.
KNOWN_DEVIATIONS = [
    ("- Swap-out completion on the testbed: a device buffer is freed only when its host DeepCopy has read it, and "
     "the testbed has no copy engine: the executor queues that copy on the threads running the step, behind the "
     "chain of ops it runs inline, so left alone it ran right after its producer in some steps and just before its "
     "swap-in in others (separable_cnn's 'T20 lb3-ub30 >=1MiB mem' measured 4.49 MiB in 5 of 6 profiled steps and "
     "7.63 MiB in one; a small dense model 96.1 or 112.1 KiB against 103.8 predicted). The rewriter now makes the op after "
     "the producer wait for the copy out on the testbed (rewriter.edit.graph_edit, Placement.copies_wait_for_compute); "
     "a GPU's copy engine does not wait for the compute cores. The zoo's measured peak is the median of 5 profiled "
     "steps."),
    ("- Swap-in start on the testbed (the safe side): a swap-in may run from its trigger on, but the executor can "
     "queue it until its reader needs it; the replay counts its buffer from the trigger. On small models whose "
     "ops run inline this measured up to 7 % below the prediction (the dense model above: 96.6 KiB against 104.3)."),
]


# ====================================================================== worker (one model, fresh process)


def _grappler_estimate(model, batch: int) -> dict[str, Any]:
    """Grappler's static peak (``Cluster.DeterminePeakMemoryUsage``) of the unswapped training step.

    The step is traced as the rewriter traces it; its FuncGraph is exported as a MetaGraphDef
    whose 'train_op' collection names the function's outputs (the fetch nodes; automatic control
    dependencies tie every variable update to them), and estimated on the local single-machine
    cluster. Grappler sees the variables only as resource handles, so its figure leaves out the
    weights and optimizer state.
    """
    import tensorflow as tf
    from tensorflow.python.grappler import cluster as gcluster
    from tensorflow.python.grappler import item as gitem

    from rewriter.trace.tracing import trace_keras_step

    graph = trace_keras_step(model, batch).concrete.graph
    with graph.as_default():  # export_meta_graph refuses to run eagerly
        meta = tf.compat.v1.train.export_meta_graph(graph=graph)
    fetches = meta.collection_def["train_op"].node_list.value
    for tensor in graph.outputs:
        fetches.append(tensor.op.name)
    item = gitem.Item(meta, ignore_colocation=True)
    cluster = gcluster.Cluster(allow_soft_placement=True, disable_detailed_stats=True, disable_timeline=True)
    try:
        peaks = cluster.DeterminePeakMemoryUsage(item)
    finally:
        cluster.Shutdown()
    if not peaks:
        raise RuntimeError("DeterminePeakMemoryUsage returned no device")
    per_device = {str(device): int(peak) for device, (peak, _live) in peaks.items()}
    accelerator = next((d for d in per_device if d.endswith("CPU:0")), next(iter(per_device)))
    return {"grappler_device": accelerator, "grappler_bytes": per_device[accelerator],
            "grappler_all_devices": per_device, "grappler_live_tensors": len(peaks[accelerator][1])}


def _worker(spec_path: str, out_path: str) -> int:
    """Measure one model under every plan of the spec; append one JSON line per result to out_path."""
    spec = json.loads(Path(spec_path).read_text())
    start_measuring_process()

    import gc

    import rewriter
    from autotune.run.plan_run import run_plan
    from autotune.run.tuning import DEFAULT_DEVICE
    from benchmarks.models import build_model
    from rewriter.trace.step_inputs import synthetic_batch
    from simulator import SwapParams, SwapPlan, get_device, n_levels, plan_swaps
    from simulator.recompute.choice import recomputed_graph

    def emit(record: dict[str, Any]) -> None:
        with open(out_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    place = rewriter.detect()  # a visible GPU, else the testbed configured above
    if place.measured_on == "cpu-testbed" and place.single_device:
        emit({"kind": "fatal", "error": "the two-device CPU testbed could not be configured"})
        return 1
    device = get_device(place.simulator_device or DEFAULT_DEVICE)
    name, batch = spec["model"], int(spec["batch"])
    model = ZOO[name].build(seed=0) if spec.get("zoo") else build_model(name, seed=0, **spec["kwargs"])
    x, y = synthetic_batch(model, batch)
    start = time.perf_counter()
    graph = rewriter.capture(model, batch, name=name, graph_rewrites=spec.get("graph_rewrites", ()))
    emit({"kind": "graph", "capture_s": time.perf_counter() - start, "ops": graph.n_ops,
          "levels": n_levels(graph), "persistent_bytes": graph.persistent_bytes,
          "measured_on": place.describe(), "device": device.name,
          **{key: graph.meta[key] for key in GRAPH_META_REPORTED if key in graph.meta}})
    kept_reads = device.kept_reads
    for label, params_dict in spec["plans"]:
        record: dict[str, Any] = {"kind": "plan", "plan": label, "params": params_dict}
        start = time.perf_counter()
        try:
            plan_graph, recomputes = graph, []
            if params_dict is None:
                plan = SwapPlan.empty(graph)
            else:  # the plan's recomputations first (none unless it asks), its swaps on the graph with them
                params = SwapParams.from_dict(params_dict)
                plan_graph, recomputes = recomputed_graph(graph, params, device)
                plan = plan_swaps(plan_graph, params, kept_reads=kept_reads)
            # the first measurement times the step; every one profiles one more step's memory (the
            # measured peak moves by a few % from step to step: asynchronous swap copies, weight updates)
            run = run_plan(model, plan_graph, plan, device, (x, y), placement=place, repeats=int(spec["repeats"]),
                           peak_repeats=int(spec["peak_repeats"]))
            predicted, step, readings, measured = run.predicted, run.step, run.readings, run.measured
            record.update(order=plan.order_name, planned_swaps=plan.n_swaps, planned_swap_ins=plan.n_swap_ins,
                          planned_swapped_bytes=plan.swapped_bytes(plan_graph), planned_recomputes=len(recomputes),
                          predicted_bytes=predicted.peak_bytes,
                          predicted_step_s=predicted.step_s, predicted_compute_s=predicted.compute_s,
                          predicted_persistent_bytes=predicted.persistent_bytes,
                          predicted_host_peak_bytes=predicted.host_peak_bytes)
            if run.out_of_memory:
                raise MemoryError("the measured step ran out of memory")
            verification = step.verification
            peaks = [m.peak_bytes for m in readings]
            record.update(applied_swaps=step.n_swap_outs, applied_swap_ins=step.n_swap_ins,
                          applied_recomputes=len(step.recomputed),
                          skipped_swaps=len(getattr(step, "skipped", []) or []),
                          surviving_swaps=measured.n_swap_outs,
                          verified=None if verification is None else bool(verification.ok),
                          verification_problems=[] if verification is None else verification.problems(),
                          measured_bytes=int(np.median(peaks)), measured_all_bytes=peaks,
                          allocator_bytes=int(np.median([m.allocator_peak_bytes for m in readings])),
                          measured_persistent_bytes=measured.persistent_bytes,
                          measured_host_peak_bytes=measured.host_peak_bytes, measured_step_s=measured.step_s,
                          measured_step_s_all=list(measured.step_s_all))
            del step, run
        except Exception as error:  # noqa: BLE001 -- one failed plan must not lose the others
            record["error"] = f"{type(error).__name__}: {error}"
        record["wall_s"] = time.perf_counter() - start
        emit(record)
        gc.collect()
        if params_dict is None and spec.get("grappler", True):
            start = time.perf_counter()
            grappler: dict[str, Any] = {"kind": "grappler"}
            try:
                grappler.update(_grappler_estimate(model, batch))
            except Exception as error:  # noqa: BLE001 -- reported in the table, never a fake number
                grappler["grappler_error"] = f"{type(error).__name__}: {error}"
            grappler["wall_s"] = time.perf_counter() - start
            emit(grappler)
    return 0


# ====================================================================== parent (orchestration and results)


def _run_model(setup: ModelSetup, plans: list[tuple[str, dict | None]], *, timeout: float, repeats: int,
               peak_repeats: int, grappler: bool) -> tuple[list[dict], dict[str, Any]]:
    """Run the worker for one model in a fresh interpreter; return its records and a status."""
    with tempfile.TemporaryDirectory(prefix="fidelity_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.jsonl"
        spec_path.write_text(json.dumps({"model": setup.name, "kwargs": setup.kwargs, "batch": setup.batch,
                                         "zoo": setup.zoo,
                                         "graph_rewrites": list(setup.graph_rewrites),
                                         "plans": plans, "repeats": repeats, "peak_repeats": peak_repeats,
                                         "grappler": grappler}))
        from rewriter.environment import testbed_environment  # imports TensorFlow: not at module level

        env = testbed_environment(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        command = [sys.executable, "-m", "benchmarks", "fidelity", "--worker", str(spec_path), str(out_path)]
        start = time.perf_counter()
        status: dict[str, Any] = {"model": setup.key}
        try:
            done = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            status["returncode"] = done.returncode
            if done.returncode != 0:
                status["stderr"] = done.stderr[-2000:]
        except subprocess.TimeoutExpired:  # subprocess.run has killed the child
            status["timeout"] = True
        status["wall_s"] = time.perf_counter() - start
        records = [json.loads(line) for line in out_path.read_text().splitlines()] if out_path.exists() else []
    return records, status


def _params_text(params: dict | None) -> str:
    if params is None:
        return "no swapping"
    from simulator import SwapParams

    defaults = SwapParams(threshold=1)
    return ", ".join(f"{key}={value}" for key, value in params.items()
                     if key == "threshold" or value != getattr(defaults, key))


def build_table(setup: ModelSetup, records: list[dict], status: dict[str, Any],
                plans: list[tuple[str, dict | None]]) -> tuple[list[dict], list[str]]:
    """Rows of the results table for one model, and notes on what went wrong."""
    notes = []
    graph = next((r for r in records if r["kind"] == "graph"), {})
    grappler = next((r for r in records if r["kind"] == "grappler"), None)
    by_plan = {r["plan"]: r for r in records if r["kind"] == "plan"}
    rows = []
    for label, params in plans:
        r = by_plan.get(label)
        row: dict[str, Any] = {"model": setup.key, "setting": setup.describe(), "plan": label,
                               "params": _params_text(params), "order": (params or {}).get("order", "cto")}
        if r is None:
            row["note"] = "not run: timeout" if status.get("timeout") else "not run: worker failed"
            rows.append(row)
            continue
        if "error" in r and "measured_bytes" not in r:
            row["note"] = r["error"][:300]
        elif r.get("verification_problems"):  # what Grappler changed of the plan (the step still ran)
            row["note"] = "verify: " + "; ".join(p.split(":")[0] for p in r["verification_problems"])
        predicted, measured = r.get("predicted_bytes"), r.get("measured_bytes")
        row.update({
            "swaps": r.get("planned_swaps"), "swaps_applied": r.get("applied_swaps"),
            "swaps_surviving": r.get("surviving_swaps"), "swap_ins": r.get("planned_swap_ins"),
            "recomputes": r.get("planned_recomputes"), "recomputes_applied": r.get("applied_recomputes"),
            "swapped_MiB": None if r.get("planned_swapped_bytes") is None else r["planned_swapped_bytes"] / MiB,
            "predicted_MiB": None if predicted is None else predicted / MiB,
            "measured_MiB": None if measured is None else measured / MiB,
            "allocator_MiB": None if r.get("allocator_bytes") is None else r["allocator_bytes"] / MiB,
            "ratio": predicted / measured if predicted and measured else None,
            "spread_pct": (100 * (max(r["measured_all_bytes"]) - min(r["measured_all_bytes"])) / measured
                           if measured and r.get("measured_all_bytes") else None),
            "measured_min_MiB": min(r["measured_all_bytes"]) / MiB if r.get("measured_all_bytes") else None,
            "measured_max_MiB": max(r["measured_all_bytes"]) / MiB if r.get("measured_all_bytes") else None,
            "pred_step_s": r.get("predicted_step_s"), "meas_step_s": r.get("measured_step_s"),
            "step_ratio": (r["predicted_step_s"] / r["measured_step_s"]
                           if r.get("predicted_step_s") and r.get("measured_step_s") else None),
            "verified": r.get("verified"),
            "resident_MiB": (None if r.get("measured_persistent_bytes") is None
                             else r["measured_persistent_bytes"] / MiB),
            "ops": graph.get("ops"), "levels": graph.get("levels"),
        })
        if params is None:
            if grappler is None:
                row["note"] = "Grappler not run" + (" (timeout)" if status.get("timeout") else "")
            elif "grappler_bytes" in grappler:
                row["grappler_MiB"] = grappler["grappler_bytes"] / MiB
                if measured:
                    row["grappler_ratio"] = grappler["grappler_bytes"] / measured
                    resident = r.get("measured_persistent_bytes") or 0
                    row["grappler+resident_ratio"] = (grappler["grappler_bytes"] + resident) / measured
            else:
                row["note"] = f"Grappler failed: {grappler.get('grappler_error', '?')[:300]}"
                notes.append(f"- {setup.key}: Grappler's DeterminePeakMemoryUsage failed: "
                             f"`{grappler.get('grappler_error')}`")
        rows.append(row)
    if status.get("timeout"):
        notes.append(f"- {setup.key}: the worker hit the per-model timeout after {status['wall_s']:.0f} s; "
                     "plans without numbers were not measured.")
    elif status.get("returncode"):
        tail = status.get("stderr", "").strip().splitlines()[-3:]
        notes.append(f"- {setup.key}: the worker exited with code {status['returncode']}: `{' / '.join(tail)}`")
    for r in records:
        if r["kind"] == "plan" and "error" in r:
            notes.append(f"- {setup.key} / {r['plan']}: `{r['error'][:500]}`")
    return rows, notes


COLUMNS = ["model", "setting", "plan", "params", "order", "swaps", "swaps_applied", "swaps_surviving", "swap_ins",
           "recomputes", "recomputes_applied", "swapped_MiB", "predicted_MiB", "measured_MiB", "allocator_MiB", "ratio", "error_pct", "spread_pct",
           "measured_min_MiB", "measured_max_MiB", "pred_step_s", "meas_step_s", "step_ratio", "grappler_MiB",
           "grappler_ratio", "grappler+resident_ratio", "resident_MiB", "verified", "ops", "levels", "note"]


def _finish_table(rows: list[dict]) -> pd.DataFrame:
    table = pd.DataFrame(rows)
    for column in COLUMNS:
        if column not in table:
            table[column] = None
    table["error_pct"] = (pd.to_numeric(table["ratio"], errors="coerce") - 1.0) * 100.0
    return table[COLUMNS]


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Median and worst absolute error of the peak prediction: simulator (all plans, unswapped only)
    and Grappler (unswapped only, as reported and with the resident state added)."""
    def stats(ratios: pd.Series, what: str, rows: str) -> dict[str, Any]:
        errors = (pd.to_numeric(ratios, errors="coerce").dropna() - 1.0).abs()
        if errors.empty:
            return {"estimator": what, "rows": rows, "n": 0, "median_abs_error_pct": None, "worst_abs_error_pct": None,
                    "within_5pct": None, "within_10pct": None}
        return {"estimator": what, "rows": rows, "n": len(errors), "median_abs_error_pct": 100 * errors.median(),
                "worst_abs_error_pct": 100 * errors.max(), "within_5pct": int((errors <= 0.05).sum()),
                "within_10pct": int((errors <= 0.10).sum())}

    unswapped = table["plan"] == "none"
    return pd.DataFrame([
        stats(table["ratio"], "simulator", "all plans"),
        stats(table.loc[~unswapped, "ratio"], "simulator", "swapped plans"),
        stats(table.loc[unswapped, "ratio"], "simulator", "unswapped"),
        stats(table.loc[unswapped, "grappler_ratio"], "Grappler DeterminePeakMemoryUsage", "unswapped"),
        stats(table.loc[unswapped, "grappler+resident_ratio"], "Grappler + resident state", "unswapped"),
        stats(table["step_ratio"], "simulator step time (informational)", "all plans"),
    ])


def _target_bands(ax) -> None:
    """Zero, and dashed +-5 % / dotted +-10 % lines (the fidelity targets) on an error axis."""
    for level, style in ((5, "--"), (10, ":")):
        for sign in (1, -1):
            ax.axhline(sign * level, color="k", ls=style, lw=0.8)
    ax.axhline(0, color="k", lw=0.8)


def plot(table: pd.DataFrame, directory: Path, name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    data = table.dropna(subset=["predicted_MiB", "measured_MiB"])
    models = list(dict.fromkeys(table["model"]))
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(models)}

    # (1) predicted vs measured peak, y = x with +-5 % and +-10 % bands
    fig, ax = plt.subplots(figsize=(7.5, 7))
    if not data.empty:
        low = 0.85 * float(min(data["predicted_MiB"].min(), data["measured_MiB"].min()))
        high = 1.15 * float(max(data["predicted_MiB"].max(), data["measured_MiB"].max()))
        line = np.geomspace(max(low, 1.0), high, 200)
        ax.fill_between(line, 0.9 * line, 1.1 * line, color="0.9", label="±10 %")
        ax.fill_between(line, 0.95 * line, 1.05 * line, color="0.8", label="±5 %")
        ax.plot(line, line, "k-", lw=1, label="y = x")
        for model in models:
            part = data[data["model"] == model]
            swapped = part["plan"] != "none"
            if part["measured_min_MiB"].notna().any():  # range of the profiled steps
                ax.errorbar(part["measured_MiB"], part["predicted_MiB"], fmt="none", ecolor=colours[model], lw=0.8,
                            xerr=[(part["measured_MiB"] - part["measured_min_MiB"]).clip(lower=0).fillna(0),
                                  (part["measured_max_MiB"] - part["measured_MiB"]).clip(lower=0).fillna(0)])
            ax.scatter(part.loc[swapped, "measured_MiB"], part.loc[swapped, "predicted_MiB"], color=colours[model],
                       s=30, label=model, edgecolor="k", linewidth=0.4)
            ax.scatter(part.loc[~swapped, "measured_MiB"], part.loc[~swapped, "predicted_MiB"], color=colours[model],
                       s=70, marker="*", edgecolor="k", linewidth=0.4)
        grappler = table.dropna(subset=["grappler_MiB", "measured_MiB"])
        if not grappler.empty:
            ax.scatter(grappler["measured_MiB"], grappler["grappler_MiB"], marker="x", color="k", s=40,
                       label="Grappler estimate (unswapped)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(low, high)
        ax.set_ylim(min(low, 0.85 * float(grappler["grappler_MiB"].min())) if not grappler.empty else low, high)
    ax.set_xlabel("measured accelerator-side peak (MiB, requested bytes)")
    ax.set_ylabel("predicted peak (MiB)")
    ax.set_title("Simulator fidelity on the CPU testbed (★ = no swapping)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = directory / f"{name}_scatter.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)

    # (2) per-model errors: every plan's signed error, the model's median and range, Grappler's
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), gridspec_kw={"height_ratios": [3, 2]})
    plans = list(dict.fromkeys(table["plan"]))
    width = 0.8 / max(len(plans), 1)
    x = np.arange(len(models))
    def cell(model: str, plan: str, column: str) -> float:
        value = table.loc[(table["model"] == model) & (table["plan"] == plan), column]
        value = pd.to_numeric(value, errors="coerce")
        return float(value.iloc[0]) if len(value) and pd.notna(value.iloc[0]) else np.nan

    for k, plan in enumerate(plans):
        values = np.array([cell(m, plan, "error_pct") for m in models])
        predicted = np.array([cell(m, plan, "predicted_MiB") for m in models])
        # error bar: the error against the lowest and the highest of the profiled steps' peaks
        high = 100 * (predicted / np.array([cell(m, plan, "measured_min_MiB") for m in models]) - 1)
        low = 100 * (predicted / np.array([cell(m, plan, "measured_max_MiB") for m in models]) - 1)
        yerr = np.nan_to_num(np.clip([values - low, high - values], 0, None))
        top.bar(x - 0.4 + (k + 0.5) * width, values, width, label=plan, yerr=yerr, capsize=1.5,
                error_kw={"lw": 0.7})
    _target_bands(top)
    top.set_xticks(x, models)
    top.set_ylabel("simulator error (%)\n(predicted / measured - 1)")
    top.set_title("Per-model peak error by plan (bars: range over the profiled steps; dashed ±5 %, dotted ±10 %)")
    top.legend(fontsize=7, ncol=4)
    errors = [pd.to_numeric(table.loc[table["model"] == m, "error_pct"], errors="coerce").dropna() for m in models]
    medians = np.array([e.median() if len(e) else np.nan for e in errors])
    lows = np.array([e.min() if len(e) else np.nan for e in errors])
    highs = np.array([e.max() if len(e) else np.nan for e in errors])
    bottom.errorbar(x - 0.1, medians, yerr=[medians - lows, highs - medians], fmt="o", capsize=5,
                    label="simulator: median, min-max over plans")
    grappler = [100 * (cell(m, "none", "grappler_ratio") - 1) for m in models]
    bottom.scatter(x + 0.1, grappler, marker="x", color="k", s=50, label="Grappler static estimate (unswapped)")
    _target_bands(bottom)
    bottom.set_xticks(x, models)
    bottom.set_ylabel("error (%)")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    path = directory / f"{name}_errors.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks fidelity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None,
                        help=f"comma-separated subset of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: {' and '.join(QUICK_MODELS)} x {len(QUICK_PLANS)} plans, "
                             "written as fidelity_quick.*")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per model (default 900)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per plan (median; default 3)")
    parser.add_argument("--peak-repeats", type=int, default=2,
                        help="profiled steps per plan; the measured peak is their median (default 2)")
    parser.add_argument("--no-grappler", action="store_true", help="skip Grappler's baseline estimate")
    parser.add_argument("--zoo", action="store_true",
                        help=f"the {len(ZOO_MODELS)} benchmarks.zoo models instead of the benchmark set, written as "
                             "fidelity_zoo.*; each model's run is kept under results/fidelity_zoo_runs/, so "
                             "--zoo --models a,b measures a and b again and the table shows every zoo model's latest run")
    parser.add_argument("--recompute", action="store_true",
                        help="plans with recomputation beside the swaps (RECOMPUTE_PLANS) instead of the swap plans, "
                             "written as fidelity_recompute.*")
    parser.add_argument("--name", default=None, help="result file name (default fidelity, fidelity_quick)")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(*args.worker)

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    catalog = ZOO_MODELS if args.zoo else MODELS
    names = list(QUICK_MODELS if args.quick and not args.zoo else catalog)
    if args.models:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        unknown = [n for n in names if n not in catalog]
        if unknown:
            print(f"unknown model(s): {', '.join(unknown)}; known: {', '.join(catalog)}", file=sys.stderr)
            return 2
    plans = RECOMPUTE_PLANS if args.recompute else [p for p in PLANS if not args.quick or p[0] in QUICK_PLANS]
    if args.timeout <= 0 or args.repeats < 1 or args.peak_repeats < 1:
        print("--timeout must be > 0, --repeats and --peak-repeats >= 1", file=sys.stderr)
        return 2
    name = args.name or ("fidelity_zoo" if args.zoo else "fidelity_recompute" if args.recompute
                         else "fidelity_quick" if args.quick else "fidelity")

    rows, notes, statuses, measured_on, facts = [], [], [], set(), {}
    for model in (list(catalog) if args.zoo else names):  # the zoo's table: every model with a kept run
        setup = catalog[model]
        if model in names:
            log.info("%s: measuring %d plan(s) in a fresh process ...", setup.describe(), len(plans))
            records, status = _run_model(setup, plans, timeout=args.timeout, repeats=args.repeats,
                                         peak_repeats=args.peak_repeats, grappler=not args.no_grappler)
            if args.zoo:
                _keep_zoo_run(model, records, status, plans)
        elif (ZOO_RUNS_DIR / f"{model}.json").exists():
            records, status, kept_plans = _kept_zoo_run(model)
            if [label for label, _ in kept_plans] != [label for label, _ in plans]:
                log.info("%s: kept run has other plans; left out (measure it again with --models)", model)
                continue
        else:
            continue
        model_rows, model_notes = build_table(setup, records, status, plans)
        facts[model] = _graph_facts(records)
        measured_on.update(f"{r['measured_on']} (simulated as {r['device']})" for r in records
                           if r["kind"] == "graph" and "measured_on" in r)
        rows += model_rows
        notes += model_notes
        statuses.append(status)
        done = [r for r in model_rows if r.get("ratio") is not None]
        log.info("  %s%d/%d plan(s) measured in %.0f s; ratios %s", "" if model in names else f"{model}, kept run: ",
                 len(done), len(plans), status["wall_s"], ", ".join(f"{r['ratio']:.3f}" for r in done))
    runtime = time.perf_counter() - STARTED_S  # as write_results records it
    if args.zoo:  # models measured in chunks: the runs' own times, summed
        runtime = sum(status["wall_s"] for status in statuses)

    table = _finish_table(rows)
    if args.zoo:
        _annotate_zoo_misses(table)
    stats = summary(table)
    all_stats = stats.iloc[0]
    grappler_stats = stats.iloc[3]

    def verdict(s) -> str:
        if not s["n"]:
            return "no data"
        return (f"median {s['median_abs_error_pct']:.1f} %, worst {s['worst_abs_error_pct']:.1f} % over {s['n']} "
                f"(model, plan) pair(s)")

    misses = table[pd.to_numeric(table["error_pct"], errors="coerce").abs() > 100 * TARGET_WORST]
    result_notes = [
        "## Notes", "",
        ("- predicted_MiB: `simulator.replay(graph, plan, 'cpu-testbed').peak_bytes`; measured_MiB: "
        "`rewriter.measure(step, x, y).peak_bytes` (accelerator-side peak in requested bytes, resident state "
        "included, swap-out host copies left out); allocator_MiB: the same peak in BFC chunk bytes (inflated on "
        "the testbed by the host copies sharing the one CPU allocator pool, docs/design.md 4). ratio = predicted / "
        "measured; error_pct = (ratio - 1) x 100."),
        ("- swaps: planned swap-outs; swaps_applied: inserted into the graph; swaps_surviving: swap-outs found "
        "in the optimized graph after Grappler (verification)."),
        ("- Step times (pred_step_s, meas_step_s, step_ratio) are informational: the cpu-testbed time model is "
        "only roughly calibrated, and on the testbed DeepCopy swaps run on the same two cores as compute."),
        ("- grappler_MiB: `Cluster.DeterminePeakMemoryUsage` of the unswapped step (MetaGraphDef of "
        "`trace_keras_step(model, batch).concrete.graph`, function outputs in the 'train_op' collection), for "
        "the local cluster's CPU:0 (the device that plays the accelerator). It sees variables only as resource "
        "handles, so it leaves out weights and optimizer state; grappler+resident_ratio adds the measured "
        "resident state (resident_MiB) to it, a generous reading of the baseline."),
        (f"- Simulator (all plans): {verdict(all_stats)}; Grappler (unswapped): {verdict(grappler_stats)}. "
        f"Target (docs/design.md 5): median within {100 * TARGET_MEDIAN:.0f} %, worst within {100 * TARGET_WORST:.0f} %."),
        (f"- Runtime of the zoo's runs (each model's worker, summed; measured in chunks): {runtime / 60:.1f} min."
         if args.zoo else f"- Runtime of this run: {runtime / 60:.1f} min."),
        "", "## Summary", "", _markdown(stats), "",
    ]
    if args.zoo:
        per_model = zoo_summary(table)
        met = int(per_model["targets_met"].fillna(False).sum()) if "targets_met" in per_model else 0
        result_notes += [
            "## Per model (zoo targets)", "",
            (f"Targets (docs/design.md 5): per model median |error| <= {100 * ZOO_TARGET_MEDIAN:.0f} %, worst <= "
             f"{100 * ZOO_TARGET_WORST:.0f} %, measured above predicted never more than {100 * ZOO_TARGET_UNDER:.0f} % "
             f"(worst_measured_above_pct = measured / predicted - 1). Met by {met} of {len(per_model)} models."),
            "", _markdown(per_model), "",
            "What the capture could not size or swap, per model (`graph.meta`):", "",
        ] + [f"- {model}: {text}" for model, text in facts.items() if text] + [""]
    if len(misses):
        result_notes += ["## Misses (|error| > 10 %)", ""]
        result_notes += [f"- {r.model} / {r.plan}: predicted {r.predicted_MiB:.1f} MiB, measured "
                         f"{r.measured_MiB:.1f} MiB ({r.error_pct:+.1f} %)" for r in misses.itertuples()]
        result_notes += [""]
    spread = pd.to_numeric(table["spread_pct"], errors="coerce").dropna()
    if len(spread):
        result_notes += [(f"Run-to-run spread of the measured peak (range of {args.peak_repeats} profiled steps / "
                         f"median): median {spread.median():.1f} %, max {spread.max():.1f} %."), ""]
    result_notes += ["## Known sources of deviation", ""] + KNOWN_DEVIATIONS + [""]
    if notes:
        result_notes += ["## Problems", ""] + notes
    from rewriter.environment import TESTBED_ENV

    testbed_env = ", ".join(f"{k}={v}" for k, v in TESTBED_ENV.items() if k != "TF_CPP_MIN_LOG_LEVEL")
    settings = {
        "command": "python -m benchmarks " + " ".join(["fidelity", *(argv if argv is not None else sys.argv[2:])]),
        "measured_on": "; ".join(sorted(measured_on)) or "nothing measured",
        **({"testbed": f"CPU:0 accelerator, CPU:1 host (two logical CPUs), swaps as DeepCopy, {testbed_env}"}
           if any("cpu-testbed" in m for m in measured_on) else {}),
        "models": "; ".join(catalog[n].describe() for n in dict.fromkeys(table["model"])),
        "plans": "; ".join(f"{label}: {_params_text(params)}" for label, params in plans),
        "timing": f"warm-up 1, median of {args.repeats} steps; step serialized in the plan's order",
        "peak": f"median of {args.peak_repeats} profiled steps (spread_pct = their range / median)",
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = write_results(name, table, settings=settings, notes=result_notes)
    pictures = plot(table, RESULTS_DIR, name)

    with pd.option_context("display.width", 250, "display.max_columns", 40, "display.max_colwidth", 40):
        shown = ["model", "plan", "swaps", "swaps_surviving", "predicted_MiB", "measured_MiB", "allocator_MiB",
                 "ratio", "error_pct", "spread_pct", "pred_step_s", "meas_step_s", "grappler_MiB", "grappler_ratio",
                 "note"]
        print(table[shown].round(3).to_string(index=False))
        print()
        print(stats.round(2).to_string(index=False))
    print()
    print(f"peak error, simulator (all {all_stats['n']} plans): {verdict(all_stats)}")
    print(f"peak error, Grappler (unswapped only):   {verdict(grappler_stats)}")
    print(f"target: median <= {100 * TARGET_MEDIAN:.0f} %, worst <= {100 * TARGET_WORST:.0f} %  |  runtime "
          f"{runtime / 60:.1f} min")
    print(f"written {path}, {', '.join(str(p) for p in pictures)}")
    if notes:
        print("\n".join(notes))
    return 0


def _keep_zoo_run(model: str, records: list[dict], status: dict[str, Any], plans) -> Path:
    ZOO_RUNS_DIR.mkdir(parents=True, exist_ok=True)
    path = ZOO_RUNS_DIR / f"{model}.json"
    path.write_text(json.dumps({"records": records, "status": status, "plans": plans,
                                "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1))
    return path


def _kept_zoo_run(model: str) -> tuple[list[dict], dict[str, Any], list]:
    kept = json.loads((ZOO_RUNS_DIR / f"{model}.json").read_text())
    return kept["records"], kept["status"], [tuple(p) for p in kept["plans"]]


def zoo_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per zoo model: median and worst |error| over its plans, the most the measured peak lay above
    the prediction, and whether the zoo's targets hold."""
    rows = []
    for model, part in table.groupby("model", sort=False):
        ratio = pd.to_numeric(part["ratio"], errors="coerce").dropna()
        if ratio.empty:
            rows.append({"model": model, "plans": 0, "note": "no measurement"})
            continue
        error = (ratio - 1.0).abs()
        under = (1.0 / ratio - 1.0).clip(lower=0.0)  # measured above predicted, as a fraction of the prediction
        meets = (error.median() <= ZOO_TARGET_MEDIAN and error.max() <= ZOO_TARGET_WORST
                 and under.max() <= ZOO_TARGET_UNDER)
        rows.append({"model": model, "plans": len(ratio), "median_abs_error_pct": 100 * error.median(),
                     "worst_abs_error_pct": 100 * error.max(), "worst_measured_above_pct": 100 * under.max(),
                     "targets_met": bool(meets), "note": ZOO_NOTES.get(model, "")})
    return pd.DataFrame(rows)


def _annotate_zoo_misses(table: pd.DataFrame) -> None:
    """Rows whose error misses the zoo's targets get the model's diagnosis (``ZOO_NOTES``) as a note."""
    error = pd.to_numeric(table["ratio"], errors="coerce") - 1.0
    missed = (error.abs() > ZOO_TARGET_MEDIAN) | (1.0 / (1.0 + error) - 1.0 > ZOO_TARGET_UNDER)
    for index in table.index[missed.fillna(False)]:
        why = ZOO_NOTES.get(table.at[index, "model"])
        if why:
            before = table.at[index, "note"]
            table.at[index, "note"] = why if not isinstance(before, str) or not before else f"{before}; {why}"


def _graph_facts(records: list[dict]) -> str:
    """What the capture could not size or swap, from the worker's graph record."""
    graph = next((r for r in records if r["kind"] == "graph"), {})
    facts = []
    if graph.get("unknown_shapes"):
        facts.append(f"{graph['unknown_shapes']} tensor(s) of unknown shape")
    for item in graph.get("unresolved_tensors") or []:
        facts.append(f"unresolved {item.get('tensor')} ({item.get('reason')})")
    unswappable = graph.get("unswappable") or {}
    if unswappable.get("bytes"):
        facts.append(f"{unswappable['bytes'] / MiB:.2f} MiB cannot be swapped ({unswappable.get('reason')})")
    if graph.get("mixed_precision"):
        facts.append(f"mixed precision: {graph['mixed_precision']}")
    return "; ".join(facts)


def _markdown(table: pd.DataFrame) -> str:
    from autotune.report.writer import markdown_table

    return markdown_table(table, "{:.3g}")


if __name__ == "__main__":
    sys.exit(main())

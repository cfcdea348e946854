"""``python -m autotune MODEL --replicas N``: a plan for training under ``tf.distribute.MirroredStrategy`` on N
devices, made for one replica and measured on every replica of the CPU testbed (docs/design.md 14).

The model is loaded in the strategy's scope (the testbed's replicas ``CPU:0``, ``CPU:2``, ... with their hosts
``CPU:1``, ``CPU:3``, ...), one replica's step is captured at the per-replica batch
(``rewriter.capture_replicated``) and searched with the device budget per device and 1/N of the host budget
each (the replicas' swaps share the machine's host memory). Unless ``--no-measure``, the plan is applied on
every replica (``rewriter.apply_replicated``) and each replica's peak is measured at the requested global batch
(``rewriter.measure_replicas``): a device is confirmed when its measured peak is within ``TOLERANCE`` of the
prediction for the testbed and the target's prediction, carried by what the measurement showed, is within the
budget. The verdict is per device: every device confirmed, or exit 3.

A first form: no calibration, correction rounds or HTML report (``summary.json`` and the printed lines hold the
figures); no split regions, optimizer state on the host or graph rewrites; the testbed only (refused beside a
GPU).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

from autotune.inputs import InputError, format_bytes
from autotune.run.target import Target
from autotune.run.tuning import search_graph
from autotune.run.verdict import TOLERANCE
from simulator import replay

EXIT_OK, EXIT_NO_FIT = 0, 3


def per_replica_target(target: Target, replicas: int) -> Target:
    """``target`` for one of ``replicas`` replicas on one machine: the same device budget, 1/N of the host's."""
    host = int(target.host_budget_bytes) // replicas
    return replace(target, device=replace(target.device, host_memory_bytes=host),
                   host_budget_source=f"{target.host_budget_source}, shared by {replicas} replicas: "
                                      f"{format_bytes(host)} each")


def check_settings(replicas: int, batch_size: int, *, maximize_batch: bool, graph_rewrites) -> None:
    """What ``--replicas`` does not do yet, refused in one line before anything slow happens."""
    if replicas < 1:
        raise InputError(f"--replicas must be at least 1, got {replicas}")
    if batch_size % replicas:
        raise InputError(f"--batch-size {batch_size} does not split evenly over {replicas} replicas: "
                         f"give a multiple of {replicas}")
    if maximize_batch or graph_rewrites:
        raise InputError("--replicas does not take --maximize-batch or --rewrite yet (docs/design.md 14)")


def load_replicated(settings: dict, replicas: int, load: Callable[[], object]):
    """Configure the testbed's 2N logical CPUs, then ``load()`` the model in ``MirroredStrategy``'s scope."""
    import tensorflow as tf

    from rewriter.placement.placements import configure_testbed
    from rewriter.trace.replicas import testbed_replicas

    if tf.config.list_physical_devices("GPU"):
        raise InputError("--replicas runs on the CPU testbed only for now: a GPU is visible (docs/design.md 14)")
    if not configure_testbed(2 * replicas):
        raise InputError(f"the testbed of {replicas} replicas needs {2 * replicas} logical CPUs, and TensorFlow "
                         "had started with fewer")
    with tf.distribute.MirroredStrategy(testbed_replicas(replicas)).scope():
        return load()


def run(model, settings: dict, target: Target, replicas: int, out: Path, say: Callable[[str], None]) -> int:
    """Capture, search, measure per replica; print the verdict per device; ``summary.json`` in ``out``."""
    import rewriter
    from rewriter.errors import CaptureError
    from rewriter.trace.step_inputs import StepInputs, synthetic_batch
    from simulator.plan import PlanError

    inputs = StepInputs(settings["input_shapes"], settings["label_shapes"], settings["label_dtype"])
    batch = settings["batch_size"]
    say(f"capturing one replica's training step of {replicas} at global batch {batch} ...")
    try:
        graph = rewriter.capture_replicated(model, batch, inputs, name=settings["model_file"].stem)
    except CaptureError as error:
        raise InputError(f"cannot capture the replicated training step of {settings['model_file']}: {error}") \
            from None
    each = per_replica_target(target, replicas)
    options = replace(settings["search"], split=False, state=False)
    measure = settings["measurement"].measure
    result = search_graph(graph, each, options, batch_size=graph.batch_size, measured=measure)
    summary = {"replicas": graph.meta["replicas"], "target": each.to_dict(), "devices": [], "confirmed": False}
    lines = [f"budget per device: {format_bytes(each.device_budget_bytes)} from {each.budget_source}"]
    if result.chosen is None:
        lines.append(f"verdict: no plan fits {format_bytes(each.device_budget_bytes)} on each of {replicas} devices "
                     f"(closest: {format_bytes(result.closest.peak_bytes) if result.closest else 'none'})")
        return _finish(lines, summary, out, EXIT_NO_FIT)
    plan = result.named_plan()
    predicted = int(result.chosen.peak_bytes)
    summary["plan"] = plan.to_dict()
    (out / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1))
    if not measure:
        lines.append(f"verdict: prediction only (--no-measure): {result.action_phrase} per replica, "
                     f"{format_bytes(predicted)} predicted on each device of {format_bytes(each.device_budget_bytes)}")
        summary["devices"] = [{"device": d, "predicted_bytes": predicted} for d in graph.meta["replicas"]["devices"]]
        return _finish(lines, summary, out, EXIT_OK)
    g = result.plan_graph if result.plan_graph is not None else graph
    on_testbed = int(replay(g, result.plan, "cpu-testbed").peak_bytes)
    x, y = synthetic_batch(model, batch, inputs)
    say(f"measuring the plan on each of {replicas} replicas at global batch {batch} ...")
    try:
        step = rewriter.apply_replicated(model, plan, graph=g, batch_size=batch, inputs=inputs, verify_with=(x, y))
    except PlanError as error:
        raise InputError(f"the plan does not apply to every replica: {error}") from None
    peaks = rewriter.measure_replicas(step, x, y)
    confirmed = True
    for k, peak in enumerate(peaks):
        ratio = peak.peak_bytes / on_testbed
        carried = int(round(predicted * max(1.0, ratio)))
        verified = step.verification is None or not step.verification or step.verification[k].ok
        ok = abs(ratio - 1) <= TOLERANCE and carried <= each.device_budget_bytes and verified
        confirmed &= ok
        summary["devices"].append({"device": peak.device, "host": step.placements[k].host,
                                   "predicted_testbed_bytes": on_testbed, "measured_bytes": peak.peak_bytes,
                                   "host_peak_bytes": peak.host_peak_bytes, "predicted_bytes": predicted,
                                   "projected_bytes": carried, "verified": verified, "confirmed": ok})
        lines.append(f"replica {k} on {peak.device}: measured {format_bytes(peak.peak_bytes)}, predicted "
                     f"{format_bytes(on_testbed)} on the testbed ({ratio:.3f}); on {each.device.name} "
                     f"{format_bytes(carried)} of {format_bytes(each.device_budget_bytes)}"
                     + ("" if ok else " -- not confirmed"))
    summary["confirmed"] = confirmed
    lines.append(f"verdict: {'fits' if confirmed else 'not confirmed'} on each of {replicas} devices: "
                 f"{result.action_phrase} per replica; train with plan.json (rewriter.use_replicated_step)"
                 if confirmed else "verdict: not confirmed by the measured run on every device")
    return _finish(lines, summary, out, EXIT_OK if confirmed else EXIT_NO_FIT)


def _finish(lines: list[str], summary: dict, out: Path, code: int) -> int:
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print("\n".join(lines))
    return code

"""``--calibrate``: step times measured on this machine instead of a preset's datasheet estimate.

A preset times ops with a roofline of datasheet figures and guessed efficiencies; on the CPU testbed
its predictions were off by the figures in ``PRESET_TIME_ERROR`` (``python -m benchmarks step-time``).
A calibration (``rewriter.timing.device_calibration``) profiles the model's own unswapped step at two batch sizes
and times copies and swapped steps, so predicted step times are measured ones. It is used

* for the search, when the device the search is about is the one this machine has (a visible GPU
  modelled by its preset, or ``--device cpu-testbed`` on the testbed);
* for the measured run's prediction in every case (the report shows it beside the measured step).

Bad input (a model that cannot run at the calibration batch sizes) is an ``InputError`` (exit 2).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from autotune.inputs import InputError
from autotune.run import calibration_cache
from autotune.run.calibration_cache import MachineKey, calibration_key
from autotune.run.plan_run import testbed_batch_for
from autotune.run.target import Target, resolve_device
from simulator import CalibratedDevice, CalibrationError, DeviceModel, OpGraph, replay
from simulator.state import movable_state

if TYPE_CHECKING:  # TensorFlow only when a model is calibrated
    from rewriter.trace.step_inputs import StepInputs

log = logging.getLogger(__name__)

# the uncalibrated cpu-testbed preset against measured steps (python -m benchmarks step-time, 4 models x 7
# plans, five runs on 2026-12-01/02): what a report says of a step time that is a datasheet estimate
PRESET_TIME_ERROR = "median 9-55 %, worst 49-88 % off the measured step time"


def calibration_batches(graph: OpGraph, batch_size: int, placement) -> tuple[int, int]:
    """Two batch sizes to calibrate at, 2 at least: on the testbed the measured run's batch and half of it
    (the prediction the report compares is at that batch); beside a GPU the largest batch up to the tuned
    one whose unswapped step the GPU's preset predicts within 80 % of its memory, and half of it. Never
    batch 1: its step is off the line the larger ones lie on (unet2d's b1 and b2 steps extrapolated its b4
    step 12 % too slow, ``benchmarks.step_time.calibration_batches``), and a run that maximizes the batch
    starts from 1."""
    if placement.measured_on == "gpu":
        device = get_simulated(placement)
        high = max(2, batch_size)
        while high > 2 and replay(graph.with_batch(high), None, device).peak_bytes > 0.8 * device.budget_bytes:
            high //= 2
    else:
        high = max(2, testbed_batch_for(graph, batch_size))
    low = max(2, high // 2)
    return low, max(high, low + 1)


def extrapolation_note(batches: tuple[int, int], batch_size: int) -> str:
    """What a report should know of step times predicted beyond the calibration's batch sizes ("" within)."""
    if batch_size <= batches[-1]:
        return ""
    return (f"step times at batch {batch_size} extrapolate the calibration at batch sizes {batches[0]} and "
            f"{batches[1]} linearly per op ({batch_size / batches[1]:.1f}x the larger; the further, the less certain: "
            "python -m benchmarks step-time measures 1.33x)")


def get_simulated(placement) -> DeviceModel:
    """The preset modelling ``placement``'s device (``cpu-testbed``, or the GPU's; v100-16gb without one)."""
    device, _, _ = resolve_device(placement.simulator_device, None)
    return device


def calibrate_for(model, graph: OpGraph, batch_size: int, inputs: StepInputs, *,
                  say: Callable[[str], None] = log.info, recalibrate: bool = False) -> CalibratedDevice:
    """Calibrate ``model``'s step (captured as ``graph`` with ``inputs``) on this machine's placement, or reuse
    the calibration an earlier run of the same graph made here (``autotune.run.calibration_cache``; not when
    ``recalibrate``, which replaces it)."""
    import rewriter
    import tensorflow as tf
    from rewriter.placement.placements import gpu_memory

    placement = rewriter.detect(configure=False)
    batches = calibration_batches(graph, batch_size, placement)
    gpu = gpu_memory() if placement.measured_on == "gpu" else None
    machine = MachineKey.of(placement, None if gpu is None else gpu[0], tf.__version__)
    key = calibration_key(graph, batches, str(placement.simulator_device), machine)
    calibrated = None if recalibrate else calibration_cache.load(key, graph)
    if calibrated is not None:
        say(f"step times calibrated on this machine by an earlier run of this model ({calibration_cache.cache_dir()}; "
            "--recalibrate measures them again)")
    else:
        say(f"calibrating step times on {placement.describe()} at batch sizes {batches[0]} and {batches[1]} ...")
        try:
            calibrated = rewriter.calibrate(model, batch_sizes=batches, placement=placement, inputs=inputs,
                                            name=graph.meta.get("model"),
                                            graph_rewrites=graph.meta.get("graph_rewrites", ()), graph=graph)
            calibrated.check_graph(graph)
        except CalibrationError as error:
            raise InputError(f"cannot calibrate step times: {error} (--no-calibrate uses the preset's "
                             "estimates)") from None
        calibrated = with_host_update(model, graph, calibrated, placement, say)
        calibration_cache.store(key, calibrated, machine)
    say(calibrated.describe())
    note = extrapolation_note(batches, batch_size)
    if note:
        say(note)
    return calibrated


def with_host_update(model, graph: OpGraph, calibrated: CalibratedDevice, placement,
                     say: Callable[[str], None]) -> CalibratedDevice:
    """Beside a GPU, ``calibrated`` with the host's CPU timed at the model's own optimizer update
    (``rewriter.timing.host_update_rate``): a plan that moves optimizer state runs it there. On the testbed the
    update is timed as part of the step."""
    from rewriter.timing.host_update_rate import HostUpdateError, measure_host_update

    if placement.measured_on != "gpu" or not movable_state(graph):
        return calibrated
    try:
        rate = measure_host_update(model.optimizer, host=placement.host)
    except HostUpdateError as error:
        say(f"the host's update rate is the {calibrated.preset} preset's: {error}")
        return calibrated
    return calibrated.with_host_update(rate.bytes_per_s, rate.per_variable_s, rate.describe())


def search_target(target: Target, calibration: CalibratedDevice | None) -> Target:
    """The target the search runs on: timed by the calibration where it models the target's device
    (same preset), with the target's budgets; else as given."""
    if calibration is None or target.device.name != calibration.preset:
        return target
    return target.with_timings(calibration)


def time_model_note(device: DeviceModel, calibration: CalibratedDevice | None = None) -> str:
    """What the step times of a result simulated on ``device`` are, for the report; ``calibration``:
    the run's own, when it calibrated (it times the measured run even where the search used a preset)."""
    if isinstance(device, CalibratedDevice):
        return (f"Step times are measured on this machine ({device.describe()}); "
                + "; ".join(device.notes[:1]) + ".")
    if calibration is not None:
        return (f"The search's step times are a datasheet estimate of the {device.name} preset: the calibration "
                f"of this run measured this machine ({calibration.preset}), not the device searched for; it "
                "predicts the measured run's step time.")
    return (f"Step times are a datasheet estimate of the {device.name} preset, not measured: on the CPU testbed "
            f"the uncalibrated preset was {PRESET_TIME_ERROR} (python -m benchmarks step-time); a calibrated run "
            f"(--calibrate, the default when measuring) predicts the testbed's from measured op times.")

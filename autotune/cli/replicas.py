"""``python -m autotune MODEL --replicas N``: a plan for training under ``tf.distribute.MirroredStrategy`` on N
devices, made for one replica and measured on every replica of the CPU testbed (docs/design.md 14).

The model is loaded in the strategy's scope (the testbed's replicas ``CPU:0``, ``CPU:2``, ... with their hosts
``CPU:1``, ``CPU:3``, ...) and tuned by ``autotune.tune`` as one device's model is: calibration, search,
measured rounds with corrections, the report. What differs lives there (``autotune.run.confirm.tune_replicated``:
one replica's step, the budget per device, 1/N of the host budget each; ``autotune.run.plan_run.ReplicatedRuns``:
every replica measured). Here: what ``--replicas`` refuses before anything slow, the strategy a ``TF_CONFIG``
implies, and the verdict per device the CLI prints.
"""

from __future__ import annotations

import json
import os
from typing import Callable

from autotune.inputs import InputError, format_bytes


def check_settings(replicas: int, batch_size: int, *, graph_rewrites) -> None:
    """What ``--replicas`` does not do yet, refused in one line before anything slow happens."""
    if replicas < 1:
        raise InputError(f"--replicas must be at least 1, got {replicas}")
    if batch_size % replicas:
        raise InputError(f"--batch-size {batch_size} does not split evenly over {replicas} replicas: "
                         f"give a multiple of {replicas}")
    if graph_rewrites:
        raise InputError("--replicas does not take --rewrite yet (docs/design.md 14)")


def check_tf_config(environ=os.environ) -> None:
    """A ``TF_CONFIG`` naming several workers means ``MultiWorkerMirroredStrategy``: said and refused in one line
    (the command tunes one machine; each worker makes and trains its plan with ``rewriter.capture_replicated``,
    ``apply_replicated`` and ``use_replicated_step``, docs/design.md 14); parameter servers are refused as
    unsupported; one worker's (or none) goes on as one machine."""
    text = environ.get("TF_CONFIG")
    if not text:
        return
    try:
        cluster = json.loads(text).get("cluster") or {}
        workers = sum(len(cluster.get(kind) or ()) for kind in ("chief", "worker"))
    except (ValueError, AttributeError, TypeError):
        raise InputError("TF_CONFIG is not a JSON object with a cluster: fix or unset it") from None
    if cluster.get("ps"):
        raise InputError("TF_CONFIG names parameter servers: ParameterServerStrategy detected, "
                         "which the tool does not support; unset TF_CONFIG to tune this machine's step "
                         "(--replicas N for its N devices, docs/design.md 14)")
    if workers > 1:
        raise InputError(f"TF_CONFIG names {workers} workers: MultiWorkerMirroredStrategy detected, which this "
                         "command does not tune (it tunes one machine: unset TF_CONFIG, --replicas N for its N "
                         "devices); each worker can make and train its plan in Python with "
                         "rewriter.capture_replicated, apply_replicated and use_replicated_step (docs/design.md 14)")


def several_gpus_note(gpus: int) -> str | None:
    """What the tool does beside several visible GPUs (a MirroredStrategy over them is what a user would train
    with): the plan is one GPU's, which every replica would run; None for one GPU or none."""
    if gpus < 2:
        return None
    return (f"{gpus} GPUs visible: the plan is made and measured for one of them (GPU:0); under MirroredStrategy "
            f"every replica runs the same step, but its host memory is shared by the {gpus} replicas' swaps and "
            "--replicas measures replicas on the CPU testbed only (docs/design.md 14)")


def load_replicated(replicas: int, load: Callable[[], object]):
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


def device_lines(result) -> list[str]:
    """The verdict per device and the machine's host memory, as printed above the verdict."""
    memory = result.replica_memory()
    if memory is None:
        return []
    lines = [f"budget per device: {format_bytes(result.budget_bytes)}; all-reduce pack "
             f"{format_bytes(memory['all_reduce_bytes'])} per replica at batch {memory['per_replica_batch_size']}"]
    for k, device in enumerate(memory["devices"]):
        if "measured_bytes" not in device:
            predicted = device["predicted_bytes"]
            lines.append(f"replica {k} on {device['device']}: " + ("no plan" if predicted is None else
                                                                    f"predicted {format_bytes(predicted)} (not measured)"))
            continue
        lines.append(f"replica {k} on {device['device']}: measured {format_bytes(device['measured_bytes'])}, "
                     f"predicted {format_bytes(device['predicted_on_testbed_bytes'])} on the testbed; "
                     f"{format_bytes(device['projected_bytes'])} carried to the target of "
                     f"{format_bytes(device['budget_bytes'])}: "
                     + ("confirmed" if device["confirmed"] else "not confirmed"
                        + ("" if device["swaps_verified"] else " (swaps not verified)")))
    machine = memory["machine"]
    host = machine["measured_host_bytes"]
    figures = [f"{what} {format_bytes(value)}" for what, value in (("measured", host),
                                                                    ("predicted", machine["predicted_host_bytes"]))
               if value is not None]
    budget = format_bytes(machine["host_budget_bytes"])
    lines.append(f"host memory of the machine (every replica's swaps and moved state): {', '.join(figures)} "
                 f"of {budget}" if figures
                 else f"host budget of the machine: {budget} (no plan)")
    return lines

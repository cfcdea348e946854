"""``python -m autotune MODEL --replicas N``: a plan for training under ``tf.distribute.MirroredStrategy`` on N
devices, made for one replica and measured on every replica of the CPU testbed (docs/design.md 14).

The model is loaded in the strategy's scope (the testbed's replicas ``CPU:0``, ``CPU:2``, ... with their hosts
``CPU:1``, ``CPU:3``, ...) and tuned by ``autotune.tune`` as one device's model is: calibration, search,
measured rounds with corrections, the report. What differs lives there (``autotune.run.confirm.tune_replicated``:
one replica's step, the budget per device, 1/N of the host budget each; ``autotune.run.plan_run.ReplicatedRuns``:
every replica measured). Here: what ``--replicas`` refuses before anything slow, the strategy a ``TF_CONFIG``
implies, and the verdict per device the CLI prints. Under a ``TF_CONFIG`` of several workers every worker runs
the command: worker 0 tunes, writes the report and decides; the others measure its plans on their replicas and
print its verdict (``autotune.run.confirm.tune_workers``).
"""

from __future__ import annotations

import json
import os
from typing import Callable

from autotune.inputs import InputError, format_bytes


def check_settings(replicas: int, batch_size: int) -> None:
    """What ``--replicas`` cannot run, refused in one line before anything slow happens."""
    if replicas < 1:
        raise InputError(f"--replicas must be at least 1, got {replicas}")
    if batch_size % replicas:
        raise InputError(f"--batch-size {batch_size} does not split evenly over {replicas} replicas: "
                         f"give a multiple of {replicas}")


def check_tf_config(environ=os.environ) -> int:
    """The workers a ``TF_CONFIG`` names (1 when unset): several mean ``MultiWorkerMirroredStrategy``, every
    worker running this command (``load_multi_worker``); parameter servers are refused as unsupported."""
    text = environ.get("TF_CONFIG")
    if not text:
        return 1
    try:
        config = json.loads(text)
        cluster = config.get("cluster") or {}
        workers = sum(len(cluster.get(kind) or ()) for kind in ("chief", "worker"))
        task = config.get("task") or {}
    except (ValueError, AttributeError, TypeError):
        raise InputError("TF_CONFIG is not a JSON object with a cluster: fix or unset it") from None
    if cluster.get("ps"):
        raise InputError("TF_CONFIG names parameter servers: ParameterServerStrategy detected, "
                         "which the tool does not support; unset TF_CONFIG to tune this machine's step "
                         "(--replicas N for its N devices, docs/design.md 14)")
    if workers > 1 and (task.get("type") not in ("chief", "worker") or not isinstance(task.get("index"), int)
                        or not 0 <= task["index"] < len(cluster.get(task["type"]) or ())):
        raise InputError(f"TF_CONFIG names {workers} workers but its task {task!r} is not one of them: give "
                         '"task": {"type": "worker", "index": I} with I this worker\'s place in the cluster')
    return max(workers, 1)


def check_workers(workers: int, replicas: int, batch_size: int) -> None:
    """Under a ``TF_CONFIG`` of several workers: one replica a worker on the testbed, the batch split evenly."""
    if replicas != 1:
        raise InputError(f"TF_CONFIG names {workers} workers: each runs one replica on its CPU testbed, so leave "
                         "out --replicas (it counts one machine's devices without TF_CONFIG)")
    if batch_size % workers:
        raise InputError(f"--batch-size {batch_size} does not split evenly over the {workers} workers' replicas: "
                         f"give a multiple of {workers}")


def worker_folder(worker: int) -> str:
    """The folder of ``--out`` where worker ``worker`` (not 0) of a TF_CONFIG writes worker 0's result: apart from
    worker 0's own report where the workers share one ``--out`` (a shared file system, or one machine)."""
    return f"worker-{worker}"


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


def load_multi_worker(load: Callable[[], object]):
    """Each worker's testbed (its accelerator CPU:0, its host CPU:1), then ``load()`` the model in
    ``MultiWorkerMirroredStrategy``'s scope (which waits for every worker the ``TF_CONFIG`` names)."""
    import tensorflow as tf

    from rewriter.placement.placements import configure_testbed

    if tf.config.list_physical_devices("GPU"):
        raise InputError("a TF_CONFIG of several workers is tuned on the CPU testbed only for now: a GPU is visible "
                         "(docs/design.md 14)")
    if not configure_testbed(2):
        raise InputError("each worker's testbed needs 2 logical CPUs, and TensorFlow had started with fewer")
    with tf.distribute.MultiWorkerMirroredStrategy().scope():
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
    machine_is = "the machine" if memory["workers"] == 1 else "the fullest worker's machine"
    lines.append(f"host memory of {machine_is} (its replicas' swaps and moved state): {', '.join(figures)} "
                 f"of {budget}" if figures
                 else f"host budget of the machine: {budget} (no plan)")
    return lines

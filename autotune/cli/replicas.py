"""``python -m autotune MODEL --replicas N``: a plan for training under ``tf.distribute.MirroredStrategy`` on N
devices, made for one replica and measured on every replica (docs/design.md 14).

The model is loaded in the strategy's scope (the first N visible GPUs, each held to the budget per device when
one was given, their swaps to the machine's ``CPU:0``; without a GPU the testbed's replicas ``CPU:0``,
``CPU:2``, ... with their hosts ``CPU:1``, ``CPU:3``, ...) and tuned by ``autotune.tune`` as one device's model
is: calibration, search, measured rounds with corrections, the report. What differs lives there
(``autotune.run.confirm.tune_replicated``: one replica's step, the budget per device, 1/N of the host budget
each; ``autotune.run.plan_run.ReplicatedRuns``: every replica measured). Here: what ``--replicas`` refuses before
anything slow, the strategy a ``TF_CONFIG`` implies, and the verdict per device the CLI prints. Under a
``TF_CONFIG`` of several workers every worker runs the command: worker 0 tunes, writes the report and decides;
the others measure its plans on their replicas and print its verdict (``autotune.run.confirm.tune_workers``).
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
    """Under a ``TF_CONFIG`` of several workers: a worker's replicas are its visible GPUs (one on its CPU
    testbed), never ``--replicas``; the batch split evenly over the workers (over their GPUs: at the capture)."""
    if replicas != 1:
        raise InputError(f"TF_CONFIG names {workers} workers: each runs a replica on each of its visible GPUs (one "
                         "on its CPU testbed), so leave out --replicas (it counts one machine's devices without "
                         "TF_CONFIG)")
    if batch_size % workers:
        raise InputError(f"--batch-size {batch_size} does not split evenly over the {workers} workers' replicas: "
                         f"give a multiple of {workers}")


def worker_folder(worker: int) -> str:
    """The folder of ``--out`` where worker ``worker`` (not 0) of a TF_CONFIG writes worker 0's result: apart from
    worker 0's own report where the workers share one ``--out`` (a shared file system, or one machine)."""
    return f"worker-{worker}"


def several_gpus_note(gpus: int) -> str | None:
    """What the tool does beside several visible GPUs without ``--replicas``: the plan is one GPU's; None for one
    GPU or none."""
    if gpus < 2:
        return None
    return (f"{gpus} GPUs visible: the plan is made and measured for one of them (GPU:0); to train under "
            f"MirroredStrategy over them, tune with --replicas {gpus}: every replica runs the plan and their swaps "
            "share this machine's host memory (docs/design.md 14)")


def gpu_replicas(replicas: int, gpus: int) -> list[str]:
    """The devices of ``--replicas N``'s MirroredStrategy beside ``gpus`` visible GPUs: the first N; more replicas
    than GPUs refused."""
    if replicas > gpus:
        raise InputError(f"--replicas {replicas} needs {replicas} GPUs and {gpus} "
                         f"{'is' if gpus == 1 else 'are'} visible: give --replicas {gpus} or less")
    return [f"/device:GPU:{k}" for k in range(replicas)]


def load_replicated(replicas: int, load: Callable[[], object], gpu_memory_limit_bytes: int | None = None):
    """``load()`` the model in the scope of ``MirroredStrategy`` over N devices: the first N visible GPUs
    (``gpu_replicas``), each held to ``gpu_memory_limit_bytes`` (the budget per device the user named), else the
    testbed's N replicas on its 2N logical CPUs."""
    import tensorflow as tf

    from rewriter.placement.placements import configure_testbed, limit_device_memory
    from rewriter.trace.replicas import testbed_replicas

    gpus = len(tf.config.list_physical_devices("GPU"))
    devices = gpu_replicas(replicas, gpus) if gpus else testbed_replicas(replicas)
    if gpus and gpu_memory_limit_bytes:
        limit_device_memory(gpu_memory_limit_bytes, gpus=replicas)
    if not gpus and not configure_testbed(2 * replicas):
        raise InputError(f"the testbed of {replicas} replicas needs {2 * replicas} logical CPUs, and TensorFlow "
                         "had started with fewer")
    with tf.distribute.MirroredStrategy(devices).scope():
        return load()


def load_multi_worker(load: Callable[[], object], gpu_memory_limit_bytes: int | None = None):
    """``load()`` the model in ``MultiWorkerMirroredStrategy``'s scope (which waits for every worker the
    ``TF_CONFIG`` names): a replica on each of this worker's visible GPUs, each held to ``gpu_memory_limit_bytes``
    when given; without a GPU this worker's testbed (its accelerator CPU:0, its host CPU:1)."""
    import tensorflow as tf

    from rewriter.placement.placements import configure_testbed, limit_device_memory

    gpus = len(tf.config.list_physical_devices("GPU"))
    if gpus and gpu_memory_limit_bytes:
        limit_device_memory(gpu_memory_limit_bytes, gpus=gpus)
    if not gpus and not configure_testbed(2):
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
            lines.append(f"replica {k} on {device['device']}: " + (
                "no plan" if predicted is None else f"predicted {format_bytes(predicted)} ("
                + (f"out of memory on {memory['measured_on']} held to the budget)" if memory["out_of_memory"]
                   else "not measured)")))
            continue
        lines.append(f"replica {k} on {device['device']}: measured {format_bytes(device['measured_bytes'])}, "
                     f"predicted {format_bytes(device['predicted_where_measured_bytes'])} "
                     f"on {memory['measured_on']}; "
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
    lines.append(f"host memory of {machine_is} (its replicas' swaps, moved state and host updates; predicted: an "
                 f"upper bound): {', '.join(figures)} "
                 f"of {budget}" if figures
                 else f"host budget of the machine: {budget} (no plan)")
    return lines

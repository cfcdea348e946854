"""Shared set-up for the TensorFlow tests of the rewriter. Import it FIRST in a test module.

It sets the testbed's environment (``rewriter.environment``: every allocation visible, oneDNN's CPU
kernels) and splits the CPU into the testbed's two logical devices before TensorFlow's runtime
initialises (it cannot be done later).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from rewriter.environment import prepare_environment, testbed_environment

prepare_environment()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.framework import config as tf_config  # noqa: E402 -- op determinism can be turned off

from rewriter.placement.placements import configure_testbed  # noqa: E402

TESTBED = configure_testbed()
REPO = Path(__file__).resolve().parents[1]


def deterministic() -> None:
    tf.config.experimental.enable_op_determinism()


@contextlib.contextmanager
def op_determinism(enabled: bool):
    """Op determinism on or off inside the block, restored after (an earlier test of the same worker may have
    turned it on, and TF then builds some ops otherwise: the sparse cross-entropy from a LogSoftmax and a gather)."""
    was = tf_config.is_op_determinism_enabled()
    if enabled:
        tf.config.experimental.enable_op_determinism()
    else:
        tf_config.disable_op_determinism()
    try:
        yield
    finally:
        if was:
            tf.config.experimental.enable_op_determinism()
        else:
            tf_config.disable_op_determinism()


@contextlib.contextmanager
def grappler_options(**options):
    """Temporarily set ``tf.config.optimizer`` experimental options (affects functions built inside)."""
    before = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options(options)
    try:
        yield
    finally:
        restore = {key: before.get(key, True) for key in options}
        tf.config.optimizer.set_experimental_options(restore)


def weights_of(model) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in model.weights]


def optimizer_state(model) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in model.optimizer.variables]


def max_relative_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    worst = 0.0
    for left, right in zip(a, b, strict=True):
        left = left.astype(np.float64)
        right = right.astype(np.float64)
        scale = max(np.abs(left).max(initial=0.0), np.abs(right).max(initial=0.0), 1e-12)
        worst = max(worst, float(np.abs(left - right).max(initial=0.0) / scale))
    return worst


def bitwise_equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(left, right) for left, right in zip(a, b, strict=True))


def run_python(code: str, *, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter at the repository root (own TF runtime and devices)."""
    full_env = testbed_environment(PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports the kernel has just handed out for 127.0.0.1 (bound to port 0, then released)."""
    sockets = []
    try:
        for _ in range(count):  # held together, so the kernel gives distinct ones
            sockets.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sockets[-1].bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


ADDRESS_TAKEN = ("Address already in use", "Failed to add port", "Could not start gRPC server")


def run_workers(code: str | list[str], count: int = 2, *, timeout: int = 120, attempts: int = 2,
                env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``code`` in ``count`` fresh interpreters, the workers of one ``MultiWorkerMirroredStrategy`` cluster on
    127.0.0.1 (``TF_CONFIG`` names worker ``i`` of ``count``), each with the testbed's environment (``env`` on top).
    ``code``: a program, or the interpreter's arguments (``["-m", "autotune", ...]``).

    Every worker is stopped (its process group killed) when one fails, when ``timeout`` seconds pass or when the
    caller is interrupted: a worker left waiting for a dead peer's all-reduce would wait forever. The ports are
    free when chosen; another process may take one before TensorFlow binds it, so a cluster that cannot bind its
    ports is started again on new ones (``attempts``)."""
    for attempt in range(attempts):
        ports = free_ports(count)
        cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
        args = ["-c", textwrap.dedent(code)] if isinstance(code, str) else [str(a) for a in code]
        done = _run_cluster(args, cluster, timeout, env or {})
        taken = any(d.returncode != 0 and any(text in d.stderr for text in ADDRESS_TAKEN) for d in done)
        if not taken or attempt == attempts - 1:
            return done
    return done


def _run_cluster(args: list[str], cluster: dict, timeout: int, extra: dict) -> list[subprocess.CompletedProcess]:
    count = len(cluster["worker"])
    with tempfile.TemporaryDirectory(prefix="workers_") as folder:
        outputs = [(open(Path(folder, f"{i}.out"), "w+"), open(Path(folder, f"{i}.err"), "w+")) for i in range(count)]
        processes = []
        try:
            for i, (out, err) in enumerate(outputs):
                config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
                env = testbed_environment(PYTHONPATH=str(REPO), TF_CONFIG=config, **extra)
                processes.append(subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=out,
                                                  stderr=err, text=True, start_new_session=True))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in processes):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in processes):
                    break
                time.sleep(0.2)
        finally:
            for process in processes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)  # its own group: the worker and whatever it started
                process.wait()
            for out, err in outputs:
                out.flush()
                err.flush()
        done = []
        for process, (out, err) in zip(processes, outputs):
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read()))
            out.close()
            err.close()
        return done

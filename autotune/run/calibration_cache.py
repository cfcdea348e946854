"""Calibrate once: a step-time calibration kept on disk for the next run of the same model here.

A calibration (``rewriter.calibrate``) measures one model's step on one machine; it is stored under
a key made of the graph's digest (``OpGraph.fingerprint`` and ``graph_identity``: structure, shapes,
dtypes, graph rewrites), the calibration's batch sizes and preset, and the machine: CPU model, cores
this process may use, the placement (testbed or GPU, and the GPU's name) and the TensorFlow
version. A later run of the same model on the same machine reuses it (``--recalibrate`` measures
again and replaces it); another graph or machine has another key and never sees it.

The cache lives in ``$AUTOTUNE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/autotune`` (``~/.cache/autotune``),
one JSON file per calibration under ``calibrations/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

from simulator import CalibratedDevice, OpGraph
from simulator.device.calibrated import graph_identity

log = logging.getLogger(__name__)

CACHE_ENV = "AUTOTUNE_CACHE_DIR"
FORMAT = 1  # bumped when the stored fields change: older files are then ignored


@dataclass(frozen=True)
class MachineKey:
    """What makes one machine's step times another's: the CPU, the cores, the device, TensorFlow."""

    cpu_model: str
    cores: int
    device: str  # the placement (Placement.describe) and the GPU's name, if any
    tensorflow: str

    @classmethod
    def of(cls, placement, gpu_name: str | None, tensorflow_version: str) -> "MachineKey":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        device = placement.describe() + (f", {gpu_name}" if gpu_name else "")
        return cls(cpu_model=cpu_model(), cores=cores, device=device, tensorflow=tensorflow_version)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    """Where calibrations are kept (see the module's docstring)."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autotune"


def calibration_key(graph: OpGraph, batch_sizes: tuple[int, ...], preset: str, machine: MachineKey) -> str:
    """The digest a calibration of ``graph`` at ``batch_sizes`` on ``machine`` is stored under."""
    text = json.dumps({"format": FORMAT, "graph": graph.fingerprint(), "identity": graph_identity(graph),
                       "batch_sizes": [int(b) for b in batch_sizes], "preset": preset,
                       "machine": machine.__dict__}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _path(key: str) -> Path:
    return cache_dir() / "calibrations" / f"{key}.json"


def _tuples(value):
    """JSON's lists back to the tuples a CalibratedDevice holds."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def load(key: str, graph: OpGraph) -> CalibratedDevice | None:
    """The calibration stored under ``key`` if there is one that serves ``graph``; None otherwise (an
    unreadable or stale file is left to be replaced)."""
    path = _path(key)
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") != key:
            return None
        device = CalibratedDevice(**{name: _tuples(value) for name, value in stored["device"].items()})
        device.check_graph(graph)
    except (OSError, ValueError, TypeError, KeyError) as error:  # CalibrationMismatchError is a ValueError
        log.warning("ignoring the stored calibration %s: %s", path, error)
        return None
    return device


def store(key: str, device: CalibratedDevice, machine: MachineKey) -> Path | None:
    """Keep ``device`` under ``key`` (written whole or not at all); None when the cache is not writable."""
    path = _path(key)
    data = {"key": key, "machine": machine.__dict__,
            "device": {f.name: getattr(device, f.name) for f in fields(device)}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".partial", delete=False) as handle:
            json.dump(data, handle)
        os.replace(handle.name, path)
    except OSError as error:
        log.warning("the calibration was not cached in %s: %s", path.parent, error)
        return None
    return path

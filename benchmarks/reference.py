"""The simulator as it was at an earlier commit, importable beside today's, so speed benchmarks can
time both in one process (issue 23: the compiled replay against the numpy one it replaced).

``reference_simulator()`` extracts ``simulator/`` at ``REFERENCE_COMMIT`` with ``git archive`` into
a temporary package ``simulator_reference`` (its ``simulator.`` imports renamed) and imports it.
"""

from __future__ import annotations

import atexit
import importlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

import numpy as np

from benchmarks.common import interleaved_seconds
from simulator import plan_swaps, replay

# the last commit with the numpy replay (before simulator/kernels.py)
REFERENCE_COMMIT = "21b0f1b"
ROOT = Path(__file__).resolve().parents[1]
_NAME = "simulator_reference"


class ReferenceUnavailable(RuntimeError):
    """No git checkout with that commit here (an installed package, a shallow clone)."""


def reference_simulator(commit: str = REFERENCE_COMMIT) -> ModuleType:
    """The ``simulator`` package at ``commit``, as the module ``simulator_reference``."""
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, "simulator"],
                                 check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise ReferenceUnavailable(f"cannot read simulator/ at {commit}: {error}") from error
    directory = Path(tempfile.mkdtemp(prefix="simulator-reference-"))
    atexit.register(shutil.rmtree, directory, True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.endswith(".py"):
                continue
            source = tar.extractfile(member).read().decode()
            source = re.sub(r"\b(from|import) simulator\b", rf"\1 {_NAME}", source)
            target = directory / _NAME / Path(member.name).relative_to("simulator")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(source)
    sys.path.insert(0, str(directory))
    try:
        return importlib.import_module(_NAME)
    finally:
        sys.path.remove(str(directory))


def reference_graph(reference: ModuleType, g, directory: Path):
    """``g`` as the reference's own OpGraph (saved and loaded, as a user's graph file would be)."""
    path = g.save(Path(directory) / "graph.npz")
    return reference.OpGraph.load(path).with_batch(g.batch_size)


def same_replay(new, old) -> bool:
    """Whether two Replays (today's and the reference's) agree field by field, bit for bit, on every
    field the reference has (fields added since, e.g. ``copy_overlap_s``, have nothing to compare to)."""
    for name, value in vars(new).items():
        if not hasattr(old, name):
            continue
        other = getattr(old, name)
        if isinstance(value, np.ndarray):
            if not (isinstance(other, np.ndarray) and value.dtype == other.dtype and value.shape == other.shape
                    and value.tobytes() == other.tobytes()):
                return False
        elif type(value) is not type(other) or value != other:
            return False
    return True


def speed_row(g, params, device: str, reference: ModuleType | None, seconds: float) -> dict:
    """Milliseconds per replay and per plan + replay (one trial) of ``params`` on ``g``, today's code
    and, when ``reference`` is given, the reference's in the same rounds: fastest, median and slowest
    of 7 rounds, and whether the two replays are identical."""
    plan = plan_swaps(g, params)
    replay(g, plan, device)  # warm the caches (levels, buffers): built once per graph
    functions = {"replay": lambda: replay(g, plan, device), "trial": lambda: replay(g, plan_swaps(g, params), device)}
    row = {"ops": g.n_ops, "swaps": plan.n_swaps, "swap_ins": plan.n_swap_ins}
    if reference is not None:
        with tempfile.TemporaryDirectory() as directory:
            old_g = reference_graph(reference, g, Path(directory))
        old_params = reference.SwapParams(**params.to_dict())
        old_plan = reference.plan_swaps(old_g, old_params)
        reference.replay(old_g, old_plan, device)
        functions["replay_reference"] = lambda: reference.replay(old_g, old_plan, device)
        functions["trial_reference"] = lambda: reference.replay(old_g, reference.plan_swaps(old_g, old_params), device)
        row["identical"] = same_replay(replay(g, plan, device), reference.replay(old_g, old_plan, device))
    for name, rounds in interleaved_seconds(functions, min_seconds=seconds).items():
        ms = np.asarray(rounds) * 1e3
        row[f"ms_per_{name}"] = float(ms.min())
        row[f"ms_per_{name}_median"] = float(np.median(ms))
        row[f"ms_per_{name}_max"] = float(ms.max())
    if reference is not None:
        row["replay_speedup"] = row["ms_per_replay_reference"] / row["ms_per_replay"]
        row["trial_speedup"] = row["ms_per_trial_reference"] / row["ms_per_trial"]
    return row

"""Earlier simulators, importable beside today's, so speed benchmarks can time them in one process
(today's replay against the ones it replaced, docs/design.md 2).

``reference_simulator(commit)`` extracts ``simulator/`` at ``commit`` with ``git archive`` into a
directory of its own under the system's temporary directory (kept between runs: a compiled
reference's numba cache lives beside its files, so only its first run compiles) as the package
``simulator_at_<commit>`` (its ``simulator.`` imports renamed) and imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
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

# the simulators timed beside today's: label -> (commit, what it is)
REFERENCES = {
    "numpy": ("21b0f1b", "the numpy replay, the last commit before the compiled kernels"),
    "compiled": ("95ea400", "the first compiled replay (numba kernels per stage, Python between them), "
                            "main before the replay became one call"),
    "onecall": ("8a64197", "the one-call compiled replay that computed every field in the call, main before "
                           "op_end_s, op_start_s and copy_overlap_s were read on demand"),
}
ROOT = Path(__file__).resolve().parents[1]


class ReferenceUnavailable(RuntimeError):
    """No git checkout with that commit here (an installed package, a shallow clone)."""


def reference_simulator(commit: str = REFERENCES["numpy"][0]) -> ModuleType:
    """The ``simulator`` package at ``commit``, as the module ``simulator_at_<commit>``."""
    name = f"simulator_at_{commit}"
    if name in sys.modules:
        return sys.modules[name]
    directory = Path(tempfile.gettempdir()) / f"tf-swap-autotune-{name}"
    if not (directory / name / "__init__.py").exists():
        try:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, "simulator"],
                                     check=True, capture_output=True).stdout
        except (OSError, subprocess.CalledProcessError) as error:
            raise ReferenceUnavailable(f"cannot read simulator/ at {commit}: {error}") from error
        staging = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tempfile.gettempdir()))
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            for member in tar.getmembers():
                if not member.isfile() or not member.name.endswith(".py"):
                    continue
                source = tar.extractfile(member).read().decode()
                source = re.sub(r"\b(from|import) simulator\b", rf"\1 {name}", source)
                target = staging / name / Path(member.name).relative_to("simulator")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(source)
        try:  # whole or not at all: a run that stops half-way leaves only its staging directory
            staging.rename(directory)
        except OSError:  # another run put it there first
            shutil.rmtree(staging, ignore_errors=True)
    sys.path.insert(0, str(directory))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(directory))


def reference_simulators(labels) -> dict[str, ModuleType]:
    """``reference_simulator`` of each label of ``REFERENCES`` asked for."""
    return {label: reference_simulator(REFERENCES[label][0]) for label in labels}


def add_reference_options(parser: argparse.ArgumentParser) -> None:
    """The options of a speed benchmark that choose the simulators timed beside today's."""
    parser.add_argument("--references", default=",".join(REFERENCES),
                        help="earlier simulators timed beside today's, of " + ", ".join(
                            f"{label} ({commit})" for label, (commit, _) in REFERENCES.items()) + "; '' for none")
    parser.add_argument("--no-reference", action="store_true", help="time today's simulator only")


def references_from_options(parser: argparse.ArgumentParser, args) -> dict[str, ModuleType] | None:
    """The simulators ``add_reference_options`` chose, imported; None (with the reason on stderr)
    where git cannot give them."""
    labels = [] if args.no_reference else [label for label in args.references.split(",") if label]
    unknown = sorted(set(labels) - set(REFERENCES))
    if unknown:
        parser.error(f"unknown reference(s) {unknown}; known: {', '.join(REFERENCES)}")
    try:
        return reference_simulators(labels)
    except ReferenceUnavailable as error:
        print(f"error: {error} (run from a git checkout, or pass --no-reference)", file=sys.stderr)
        return None


def reference_graph(reference: ModuleType, g, directory: Path):
    """``g`` as the reference's own OpGraph (saved and loaded, as a user's graph file would be)."""
    path = g.save(Path(directory) / "graph.npz")
    return reference.OpGraph.load(path).with_batch(g.batch_size)


def same_replay(new, old) -> bool:
    """Whether two Replays (today's and a reference's) agree field by field, bit for bit, on every
    field the reference has (fields added since, e.g. ``copy_overlap_s``, have nothing to compare to)."""
    for field in dataclasses.fields(new):
        name, value = field.name, getattr(new, field.name)
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


def speed_row(g, params, device: str, references: dict[str, ModuleType], seconds: float,
              repeats: int = 15) -> dict:
    """Milliseconds per replay and per plan + replay (one trial) of ``params`` on ``g``, today's code
    and each of ``references`` (label -> module) in the same rounds, taken in turn: fastest, median
    and slowest of ``repeats`` rounds, today's speed-up over each, and whether each one's replay is
    identical to today's."""
    plan = plan_swaps(g, params)
    replay(g, plan, device)  # warm the caches (levels, buffers): built once per graph
    functions = {"replay": lambda: replay(g, plan, device), "trial": lambda: replay(g, plan_swaps(g, params), device)}
    row = {"ops": g.n_ops, "swaps": plan.n_swaps, "swap_ins": plan.n_swap_ins}
    for label, reference in references.items():
        with tempfile.TemporaryDirectory() as directory:
            old_g = reference_graph(reference, g, Path(directory))
        old_params = reference.SwapParams(**params.to_dict())
        old_plan = reference.plan_swaps(old_g, old_params)
        reference.replay(old_g, old_plan, device)
        functions[f"replay_{label}"] = lambda r=reference, h=old_g, p=old_plan: r.replay(h, p, device)
        functions[f"trial_{label}"] = (lambda r=reference, h=old_g, p=old_params:
                                       r.replay(h, r.plan_swaps(h, p), device))
        row[f"identical_{label}"] = same_replay(replay(g, plan, device), reference.replay(old_g, old_plan, device))
    for name, rounds in interleaved_seconds(functions, min_seconds=seconds, repeats=repeats).items():
        ms = np.asarray(rounds) * 1e3
        row[f"ms_per_{name}"] = float(ms.min())
        row[f"ms_per_{name}_median"] = float(np.median(ms))
        row[f"ms_per_{name}_max"] = float(ms.max())
    for label in references:
        row[f"replay_speedup_{label}"] = row[f"ms_per_replay_{label}"] / row["ms_per_replay"]
        row[f"trial_speedup_{label}"] = row[f"ms_per_trial_{label}"] / row["ms_per_trial"]
    return row


def references_note(labels) -> str:
    """What the ``*_<label>`` columns of a speed table are."""
    parts = [f"*_{label}: the simulator at {REFERENCES[label][0]} ({REFERENCES[label][1]})" for label in labels]
    return ("; ".join(parts) + ". Each is timed in the same process as today's, its rounds taken in turn with "
            "today's; identical_*: every Replay field equal, bit for bit; *_speedup_*: its time over today's "
            "(fastest rounds).") if parts else ""

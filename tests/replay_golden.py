"""A golden set of (graph, plan, device) cases: the replay's and the plan's every field, as they were
computed before the replay was compiled, so a faster replay can be held to bit-identical results.

    python -m tests.replay_golden write   # re-record (only when a change of results is intended)

Graphs live in tests/data/golden/ (captured ResNet-50, DenseNet-121 and 3D U-Net at batch 1, synthetic
ones): the test must not depend on TensorFlow or on a capture cache. Plans are the benchmarks' own
parameters, grid points drawn from the tuner's search space (``SearchSpace.for_graph``, seeded) and
host-room mends of them (``fit_host`` under a host limit below the plan's host peak: keep_tensors).
Arrays are kept as SHA-256 digests of their dtype, shape and bytes; scalars exactly.

Cases with ``device_overrides`` (30, added after the replay became one compiled call) take a preset
with copy contention and a per-copy overhead (``DeviceModel.copy_contention``, ``copy_overhead_s``,
which ``Replay.copy_overlap_s`` and the step time depend on).

Recorded from the reference, never from the code under test: all 427 cases were last written by this
generator run on the zoo branch at abb83c1 (main 402ec6b, whose replay is per-stage kernels with numpy
between them and ``compute_during`` in numpy, plus the in-place rule: every input an output
could be written into, in input order), from a ``git archive`` of that commit with this file copied in:
``PYTHONPATH=<copy> python -m tests.replay_golden write``. Its 397 cases agree with the zoo's own
re-recorded set (86eb635) field for field (they now also hold ``copy_overlap_s``).

Re-recorded since, for an intended rule only, the cases it changes: two ResNet-50 cases in the cto order (threshold
739, batch 32) whose swap-ins a bias gradient started while its filter gradient, which oneDNN merges with it, ran
after their reader (``planning.merge_end_positions``, docs/design.md 12): the trigger is now the op before it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from simulator import OpGraph, SwapParams, plan_swaps, replay
from simulator.device.presets import get_device
from simulator.host_room import fit_host
from simulator.planning import SwapPlan
from simulator.replay import Replay
from simulator.synthetic import training_graph

DATA_DIR = Path(__file__).resolve().parent / "data" / "golden"
EXPECTED = DATA_DIR / "expected.json"
GRAPHS = ("resnet50", "densenet121", "unet3d_size64", "synthetic250", "synthetic250_noskip")
# graph file, batch sizes, devices, grid points drawn per (batch, device)
CASES = (
    ("resnet50", (32, 256), ("v100-16gb", "cpu-testbed"), 24),
    ("densenet121", (32, 128), ("v100-16gb", "a100-40gb"), 20),
    ("unet3d_size64", (4, 96), ("v100-16gb", "cpu-testbed"), 24),
    ("synthetic250", (32,), ("v100-16gb", "cpu-testbed"), 16),
    ("synthetic250_noskip", (32,), ("v100-16gb",), 12),
)
# cases on a preset with copy contention and a per-copy overhead: graph file, batch, device, grid points
CONTENTION = {"copy_contention": 0.7, "copy_overhead_s": 3e-6}
CONTENTION_CASES = (("resnet50", 32, "cpu-testbed", 6), ("unet3d_size64", 4, "cpu-testbed", 6),
                    ("synthetic250", 32, "v100-16gb", 6), ("densenet121", 32, "v100-16gb", 4))
# the presets as the set was recorded: since then the cpu-testbed preset waits for every copy out where its
# placement does (DeviceModel.copies_out_wait), which the cases on it leave out, as recorded
RECORDED_PRESETS = {"copies_out_wait": False}
BENCHMARK_PARAMS = (SwapParams(threshold=20, lb=2, ub=12, groupby=2),
                    SwapParams(threshold=20, lb=2, ub=12, groupby=2, min_bytes=4096))
PLAN_FIELDS = ("tensor", "sync_out", "in_swap", "in_trigger", "in_after", "in_consumer_ptr", "in_consumers",
               "order", "order_name", "after_copies_out")


@functools.cache
def load_graph(name: str, batch: int = 1) -> OpGraph:
    """One graph object per file and batch, so its caches (orders, buffers) are built once."""
    if batch != 1:
        return load_graph(name).with_batch(batch)
    return OpGraph.load(DATA_DIR / f"{name}.npz")


def _digest(value) -> str | object:
    """An array as a digest of its dtype, shape and bytes; other values as they are (JSON-exact)."""
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        head = f"{array.dtype.str}{array.shape}".encode()
        return "sha256:" + hashlib.sha256(head + array.tobytes()).hexdigest()
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    return value


def record(plan: SwapPlan, result: Replay) -> dict:
    """Every field of the plan and of its replay, arrays digested."""
    fields = {f"plan.{name}": _digest(getattr(plan, name)) for name in PLAN_FIELDS}
    fields.update({f"replay.{f.name}": _digest(getattr(result, f.name)) for f in dataclasses.fields(Replay)})
    # exact types matter too (an int field must stay an int)
    fields.update({f"type.{f.name}": type(getattr(result, f.name)).__name__ for f in dataclasses.fields(Replay)})
    return fields


def _grid_params(g: OpGraph, count: int, seed: int) -> list[SwapParams]:
    """Grid points of the tuner's search space, drawn uniformly (seeded), deduplicated."""
    from autotune.search.space import SearchSpace  # the tuner's own space (autotune imports optuna)

    space = SearchSpace.for_graph(g)
    rng = np.random.default_rng(seed)
    seen: list[SwapParams] = []
    while len(seen) < count:
        choice = {name: int(rng.integers(len(getattr(space, name)))) for name in space.ordered}
        for name in space.categorical:
            options = getattr(space, name)
            choice[name] = options[int(rng.integers(len(options)))]
        params = space.params(choice)
        if params not in seen:
            seen.append(params)
    return seen


def recorded_device(name: str, overrides: dict | None = None):
    """The preset ``name`` as the set was recorded (``RECORDED_PRESETS``), with a case's ``overrides``."""
    return dataclasses.replace(get_device(name), **RECORDED_PRESETS, **(overrides or {}))


def generate() -> list[dict]:
    """The cases with today's results: [{graph, batch, device, params, fields}]."""
    cases = []
    for seed, (name, batches, devices, count) in enumerate(CASES):
        structure = load_graph(name)
        for batch in batches:
            g = structure.with_batch(batch)
            for device_name in devices:
                device = recorded_device(device_name)
                grid = _grid_params(g, count, seed * 1000 + batch)
                candidates = list(BENCHMARK_PARAMS) + grid
                for index, params in enumerate(candidates):
                    plan = plan_swaps(g, params, kept_reads=device.kept_reads)
                    result = replay(g, plan, device)
                    cases.append({"graph": name, "batch": batch, "device": device_name, "params": params.to_dict(),
                                  "fields": record(plan, result)})
                    # every third plan that swaps something: a host-room mend under 90 % of its host peak
                    if index % 3 == 0 and plan.n_swaps and result.host_peak_bytes > 0:
                        fit = fit_host(g, params, device, budget_bytes=result.peak_bytes + (1 << 30),
                                       host_limit_bytes=int(result.host_peak_bytes * 0.9), plan=plan, result=result,
                                       max_replays=16)
                        if fit is not None and fit.params.keep_tensors:
                            cases.append({"graph": name, "batch": batch, "device": device_name,
                                          "params": fit.params.to_dict(), "fields": record(fit.plan, fit.result)})
                # no plan at all
                empty = SwapPlan.empty(g)
                cases.append({"graph": name, "batch": batch, "device": device_name, "params": None,
                              "fields": record(empty, replay(g, None, device))})
    for seed, (name, batch, device_name, count) in enumerate(CONTENTION_CASES):
        g = load_graph(name, batch)
        device = recorded_device(device_name, CONTENTION)
        for params in list(BENCHMARK_PARAMS) + _grid_params(g, count, 5000 + seed):
            plan = plan_swaps(g, params, kept_reads=device.kept_reads)
            cases.append({"graph": name, "batch": batch, "device": device_name, "device_overrides": CONTENTION,
                          "params": params.to_dict(), "fields": record(plan, replay(g, plan, device))})
    return cases


def recompute(case: dict) -> dict:
    """The fields of one case with the code as it is now."""
    g = load_graph(case["graph"], case["batch"])
    device = recorded_device(case["device"], case.get("device_overrides", {}))
    if case["params"] is None:
        return record(SwapPlan.empty(g), replay(g, None, device))
    plan = plan_swaps(g, SwapParams.from_dict(case["params"]), kept_reads=device.kept_reads)
    return record(plan, replay(g, plan, device))


def _write_graphs() -> None:
    """Copy the captured graphs (from the benchmarks' cache) and make the synthetic ones."""
    from benchmarks.models.graphs import captured_graph

    DATA_DIR.mkdir(parents=True, exist_ok=True)
    captured_graph("resnet50").save(DATA_DIR / "resnet50.npz")
    captured_graph("densenet121").save(DATA_DIR / "densenet121.npz")
    captured_graph("unet3d", size=64).save(DATA_DIR / "unet3d_size64.npz")
    training_graph(250).save(DATA_DIR / "synthetic250.npz")
    training_graph(250, seed=1, skip_every=0).save(DATA_DIR / "synthetic250_noskip.npz")


def main(argv: list[str]) -> int:
    if argv != ["write"]:
        print(__doc__)
        return 2
    if not all((DATA_DIR / f"{name}.npz").exists() for name in GRAPHS):
        _write_graphs()
    cases = generate()
    EXPECTED.write_text(json.dumps(cases, separators=(",", ":")))
    print(f"{len(cases)} cases written to {EXPECTED} ({EXPECTED.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

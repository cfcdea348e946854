"""How much larger a model fits with swapping: ResNet-50 batch and 3D U-Net voxels per sample.

    python -m benchmarks max-batch [--devices v100-16gb v100-16gb-nvlink] [--recompute both|off|on]
                                   [--cases resnet50 unet3d ...] [--no-remat] [--no-measured] [--split [N]]

Simulated, per device preset: the largest ResNet-50 batch (224x224, fp32) and the largest cubic
3D U-Net input (batch 1, as voxels per sample) that fit without swapping and with a tuned plan,
the multiplier, the tuned plan's simulated overhead, the same with the overhead capped at 20% and
at 30%, and the lower bound on the overhead that transfer volume and link bandwidth impose (with
the found overhead's excess over it). Each case with swapping alone and with recomputation beside
it (the search of ``--no-recompute`` and of the default); the overheads are against the step as
captured, clones' time included, on the preset's roofline time model (no calibration exists for
a V100). Keras' own recomputation (``keras.RematScope``'s modes, set as a user would by hand) is
evaluated on the same simulator as a baseline: the largest batch each mode fits without swapping
and what its recomputation costs. The U-Net size found by batch scaling is checked by capturing the
model at that size. Measured counterpart (1 GiB accelerator-side budget, on GPU:0 when one is
visible, else the CPU testbed): the largest ResNet-50 batch whose real step stays within it,
without and with swapping.
The 3D U-Net also with ``--rewrite split-concat`` (rewriter.trace.graph_rewrites), whose bound is higher:
swapping alone reaches the plain graph's bound, set by the decoder's concatenation; and with
``elide-broadcasts`` as well, which leaves batch normalisation's backward two activation-sized
buffers instead of three. ResNet-50 also with ``elide-broadcasts``: with recomputation its batch
norms' tiled gradients are what the largest plans miss the budget by.
With ``--split``, a probed batch whose floor is over the budget searches the step split along the batch,
the number of parts with the plan (``autotune.search.parts``); the 3D U-Net, at batch 1, is then a row
that says why no such split exists.
The original LMS paper reports 4.9x (ResNet-50) and 5.6x (3D U-Net) on 16 GB V100s.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import optuna  # noqa: E402
import pandas as pd  # noqa: E402

from autotune.run.plan_run import run_plan  # noqa: E402
from autotune.search.policies import Budget, make_policy  # noqa: E402
from autotune.search.space import SearchSpace, TuningProblem, best_of  # noqa: E402
from autotune.run.tuning import (SwapProbes, largest_batch, largest_batch_with_swap, max_batch_without_swap,  # noqa: E402
                             tune_graph)
from benchmarks.common import RESULTS_DIR, STARTED_S, start_measuring_process, write_results  # noqa: E402
from benchmarks.models.graphs import captured_graph  # noqa: E402
from benchmarks.models import REMAT_MODES, build_model, unet3d_voxels  # noqa: E402
from simulator import FORWARD, CalibratedDevice, SwapPlan, get_device, replay  # noqa: E402
from simulator.buffers import largest_working_set_op, peak_lower_bound_bytes  # noqa: E402
from simulator.split.overhead_bound import least_overhead  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
UNET_SIZE = 64  # captured size; other sizes by batch scaling, then checked by a capture
UNET_STEP = 16  # the U-Net's input must be divisible by 2**depth
# rewriter.trace.graph_rewrites: the U-Net's second and third rows
UNET_REWRITES = (("split-concat",), ("split-concat", "elide-broadcasts"))
PROBE_TRIALS = 200  # the search space has distance and trigger too: 120 left the 30 %-capped ResNet-50 search short
TRIALS = 200


def overhead_lower_bound(graph, device, budget_bytes: int) -> float:
    """The least slow-down any plan can have: the excess over the budget must leave during the
    forward pass and come back during the backward pass, over links of the preset's bandwidth."""
    base = replay(graph, None, device)
    excess = max(0, base.peak_bytes - budget_bytes)
    forward = base.op_end_s[graph.op_phase == FORWARD].max() if (graph.op_phase == FORWARD).any() else 0.0
    backward = base.compute_s - forward
    stall = max(0.0, excess / device.d2h_bytes_per_s - forward) + max(0.0, excess / device.h2d_bytes_per_s - backward)
    return stall / base.compute_s


def fills_device_and_host(graph, device) -> int:
    """The largest batch whose unswapped step's live set, in the better of the search's execution
    orders, fits the device budget and the host RAM together. Every live tensor is on one side or
    both, so no swap plan fits more, short of the few bytes rewiring lets ops write in place."""
    room = device.budget_bytes + device.host_memory_bytes

    def fits(batch: int) -> bool:
        return any(replay(graph.with_order(order).with_batch(batch), None, device).peak_bytes <= room
                   for order in SearchSpace.order)

    return largest_batch(fits)


def tuned(graph, device, budget_bytes: int, seed: int = 0, recompute: bool = False):
    problem = TuningProblem(graph, device, budget_bytes, space=SearchSpace.for_graph(graph, recompute=recompute))
    return make_policy("optuna", seed=seed).search(problem, optuna.create_study(), Budget(trials=TRIALS)).chosen


def time_model(device) -> str:
    """Which time model a row's overheads come from."""
    return "calibrated" if isinstance(device, CalibratedDevice) else "preset"


CASES = ("resnet50", "resnet50+elide-broadcasts", "unet3d", "unet3d+split-concat",
         "unet3d+split-concat,elide-broadcasts")


def cases(names: tuple[str, ...] = CASES) -> list[tuple]:
    """(label, model, unit, graph tuned, graph of the unswapped baseline, size scale, graph rewrites)."""
    unet, resnet = captured_graph("unet3d", size=UNET_SIZE), captured_graph("resnet50")
    found = [("resnet50", "resnet50", "batch", resnet, None, 1, ()),
             ("resnet50+elide-broadcasts", "resnet50", "batch", captured_graph("resnet50", ("elide-broadcasts",)),
              resnet, 1, ("elide-broadcasts",)),
             ("unet3d", "unet3d", "voxels per sample", unet, None, unet3d_voxels(UNET_SIZE), ())]
    found += [(f"unet3d+{','.join(rewrites)}", "unet3d", "voxels per sample",
               captured_graph("unet3d", rewrites, size=UNET_SIZE), unet, unet3d_voxels(UNET_SIZE), rewrites)
              for rewrites in UNET_REWRITES]
    return [case for case in found if case[0] in names]


# the largest batch at any overhead, within 30 % and within 20 %; each asked alone is its own bisection
QUESTIONS = ("any", "30pct", "20pct")
# the columns of each question's answer, nan in the table where it was not asked
UNASKED_COLUMNS = {
    "any": ("with_swap", "multiplier", "share_of_bound", "with_swap_any_host", "multiplier_any_host",
            "recomputed_tensors", "recomputed_gib", "recompute_s", "recompute_share", "parts"),
    "30pct": ("with_swap_30pct", "multiplier_30pct"),
    "20pct": ("with_swap_20pct", "multiplier_20pct", "parts_20pct"),
}


def simulate(device_name: str, recompute_modes: tuple[bool, ...] = (False, True),
             names: tuple[str, ...] = CASES, parts_doublings: int | None = None,
             questions: tuple[str, ...] = QUESTIONS) -> list[dict]:
    """The rows of ``names`` on one preset, with the ``questions`` asked (``QUESTIONS``). ``parts_doublings``: at
    each probed batch whose floor is over the budget, the step split along the batch is searched
    (``autotune.search.parts``: the fewest parts whose floor fits and that many doublings, the parts searched with
    the plan; 0: the fewest, as the CLI's rule); None: no split."""
    device = get_device(device_name)
    budget = device.budget_bytes
    rows = []
    for _, name, unit, graph, baseline, scale, rewrites in cases(names):
        if parts_doublings is not None and unit != "batch":
            rows.append(_unsplittable_row(device, name, unit, graph, baseline, scale, rewrites))
            continue
        # the baseline is always the step as the user has it: rewritten rows are measured against it
        plain = max_batch_without_swap(baseline or graph, budget, device)
        rewritten_plain = max_batch_without_swap(graph, budget, device) if baseline else plain
        bound_batch = largest_batch(lambda batch: peak_lower_bound_bytes(graph.with_batch(batch)) <= budget)
        room_batch = fills_device_and_host(graph, device)
        bound_op = largest_working_set_op(graph.with_batch(max(bound_batch, 1)))
        for recompute in recompute_modes:
            split = parts_doublings is not None
            probes = SwapProbes(graph, budget, device, probe_trials=PROBE_TRIALS, recompute=recompute, split=split,
                                parts_doublings=parts_doublings or 0)
            # the probes are shared by the questions that follow; a question not asked is nan in the row
            swapped, found = probes.largest() if "any" in questions else (0, [])
            capped, _ = probes.largest(max_overhead=0.3) if "30pct" in questions else (0, [])
            capped20, found20 = probes.largest(max_overhead=0.2) if "20pct" in questions else (0, [])
            # with splits, the searches with no host limit would double the run: not asked
            any_host = np.nan if split or "any" not in questions else probes.host_unlimited().largest()[0]
            chosen = None
            if swapped and split:  # a split probe's search had its trials shared by the parts: what it found
                chosen = best_of(found)
            elif swapped:  # as the CLI does: the fastest of a tuning run there and of what the batch search found
                chosen = best_of([e for e in (tuned(graph.with_batch(swapped), device, budget, recompute=recompute),
                                              *found) if e is not None])
            chosen20 = best_of(found20) if capped20 else None
            bound = overhead_lower_bound(graph.with_batch(swapped), device, budget) if swapped else np.nan
            overhead = np.nan if chosen is None else chosen.metrics["overhead"]
            row = {
                "device": device_name, "model": name, "graph_rewrites": ",".join(rewrites) or "none",
                "recompute": recompute, "time_model": time_model(device), "unit": unit,
                "without_swap": plain * scale, "without_swap_rewritten": rewritten_plain * scale,
                "with_swap": swapped * scale, "multiplier": swapped / plain if plain else np.nan,
                "overhead": overhead, "overhead_lower_bound": bound,
                "overhead_over_bound": overhead - bound if chosen is not None else np.nan,
                "swap_bound": bound_batch * scale, "multiplier_bound": bound_batch / plain if plain else np.nan,
                "share_of_bound": swapped / bound_batch if bound_batch else np.nan,
                "bound_op": f"{graph.op_type[bound_op]} {graph.op_name[bound_op]}",
                "with_swap_20pct": capped20 * scale, "multiplier_20pct": capped20 / plain if plain else np.nan,
                "overhead_20pct": np.nan if chosen20 is None else chosen20.metrics["overhead"],
                "with_swap_30pct": capped * scale, "multiplier_30pct": capped / plain if plain else np.nan,
                "host_peak_gib": np.nan if chosen is None else chosen.metrics["host_peak_bytes"] / 2**30,
                "host_limit_gib": device.host_memory_bytes / 2**30,
                "with_swap_any_host": any_host * scale, "multiplier_any_host": any_host / plain if plain else np.nan,
                "device_and_host_bound": room_batch * scale,
                "multiplier_device_and_host": room_batch / plain if plain else np.nan,
                **_recomputed(probes, swapped, chosen),
                **_any_plan_columns(graph, device, budget, swapped, capped20),
                **(_split_columns(probes, swapped, chosen, capped20, chosen20) if split else {}),
                "params": None if chosen is None or chosen.params is None else chosen.params.to_dict(),
            }
            if name == "unet3d" and swapped:
                row.update(_unet_sizes(plain * scale, swapped * scale, device, budget, rewrites, recompute))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "params"}, default=str),
                  f"({time.perf_counter() - STARTED_S:.0f} s since start)", flush=True)
    return rows


def _any_plan_columns(graph, device, budget_bytes: int, batch: int, batch20: int) -> dict:
    """The least overhead any plan can have at the largest size and the largest within 20 %
    (``simulator.split.overhead_bound``), and the op the first is taken at; nan where no plan is needed."""
    bounds = [least_overhead(graph.with_batch(b), device, budget_bytes) if b else None for b in (batch, batch20)]
    cut = bounds[0].cut_op if bounds[0] is not None else -1
    return {"overhead_any_plan_bound": np.nan if bounds[0] is None else bounds[0].overhead,
            "any_plan_bound_cut": str(graph.op_name[cut]) if cut >= 0 else "",
            "overhead_20pct_any_plan_bound": np.nan if bounds[1] is None else bounds[1].overhead}


def _recomputed(probes: SwapProbes, batch: int, chosen) -> dict:
    """What the chosen plan recomputes: how many tensors, their bytes and the clones' seconds."""
    if chosen is None or chosen.params is None or not chosen.params.recomputes:
        return {"recomputed_tensors": 0, "recomputed_gib": 0.0, "recompute_s": 0.0, "recompute_share": 0.0}
    problem = probes.problem_of(batch, chosen)
    g = problem.graph
    index = g.tensor_index()
    actions = problem.recomputes(chosen.params)
    recomputed = sum(int(g.tensor_bytes[index[action.tensor]]) for action in actions)
    return {"recomputed_tensors": len(actions), "recomputed_gib": recomputed / 2**30,
            "recompute_s": chosen.metrics["recompute_s"],
            "recompute_share": chosen.metrics["recompute_s"] / chosen.metrics["compute_s"]}


def _split_columns(probes: SwapProbes, batch: int, chosen, batch20: int, chosen20) -> dict:
    """The parts of the chosen plans (1: the step as captured) and, where a split was searched at the largest
    batch, each k's best plan there and what sets the split step's floor."""
    found = probes.parts_at.get(batch)
    return {"parts": probes.parts_of(batch, chosen) if chosen is not None else np.nan,
            "parts_20pct": probes.parts_of(batch20, chosen20) if chosen20 is not None else np.nan,
            "parts_searched": "" if found is None else found.line(),
            "split_floor_set_by": "" if found is None else found.stop_reasons[found.parts],
            "split_probes": "; ".join(f"{b}: " + ", ".join(_parts_outcome(probes.parts_at[b], k,
                                                                          probes.device.host_memory_bytes)
                                                           for k in probes.parts_at[b].outcomes)
                                      for b in sorted(probes.parts_at))}


def _parts_outcome(found, parts: int, host_limit_bytes: int) -> str:
    """One k of a probe's parts search in a few words: its fastest plan's overhead, or by how much the
    plan closest to the device budget misses it; where some plans fit the device, by how much the one
    closest to the host limit misses that instead."""
    outcome = found.outcomes[parts]
    if outcome.chosen is not None:
        return f"{parts}p {outcome.chosen.metrics['overhead']:.0%}"
    on_device = [e for e in outcome.evaluations if e.excess_bytes <= 0]
    if on_device:
        host_excess_bytes = min(e.metrics["host_peak_bytes"] for e in on_device) - host_limit_bytes
        return (f"{parts}p misses the host limit by {host_excess_bytes / 2**30:.2f} GiB" if host_excess_bytes > 0
                else f"{parts}p fits both, none chosen")
    return f"{parts}p misses by {min(e.excess_bytes for e in outcome.evaluations) / 2**30:.2f} GiB"


def _unsplittable_row(device, name: str, unit: str, graph, baseline, scale: int, rewrites: tuple[str, ...]) -> dict:
    """A model that grows by size per sample at batch 1 (the 3D U-Net): no split along the batch exists, so
    no search is run; what sets its floor, and what would lower it."""
    budget = device.budget_bytes
    plain = max_batch_without_swap(baseline or graph, budget, device)
    bound_batch = largest_batch(lambda batch: peak_lower_bound_bytes(graph.with_batch(batch)) <= budget)
    op = largest_working_set_op(graph.with_batch(max(bound_batch, 1)))
    note = (f"not searched: it trains at batch 1 and grows by {unit}, so no split along the batch exists (the "
            f"batch-scaled graph is a stand-in for a larger volume, not more samples) and its floor stays at "
            f"{bound_batch * scale} {unit} ({bound_batch / plain:.2f}x), set by {graph.op_type[op]} "
            f"{graph.op_name[op]}; what would lower it is splitting the volume along a spatial axis, with halos "
            "(each part reading the neighbouring slices its convolutions' windows reach), not built")
    row = {"device": device.name, "model": name, "graph_rewrites": ",".join(rewrites) or "none", "unit": unit,
           "without_swap": plain * scale, "swap_bound": bound_batch * scale,
           "multiplier_bound": bound_batch / plain if plain else np.nan,
           "bound_op": f"{graph.op_type[op]} {graph.op_name[op]}", "parts": 1, "split_note": note}
    print(json.dumps(row, default=str), flush=True)
    return row


def _unet_sizes(plain_voxels: int, swapped_voxels: int, device, budget: int, rewrites: tuple[str, ...],
                recompute: bool = False) -> dict:
    """The largest cubic sizes those voxel counts allow, checked by capturing the U-Net there."""
    def side(voxels: int) -> int:
        return int(np.floor(np.cbrt(voxels) / UNET_STEP)) * UNET_STEP

    plain_side, swapped_side = side(plain_voxels), side(swapped_voxels)
    check = {}
    for label, size, swap in (("without_swap", plain_side, False), ("with_swap", swapped_side, True)):
        if size < UNET_STEP:
            continue
        graph = captured_graph("unet3d", rewrites if swap else (), size=size)
        fits = (replay(graph, None, device).peak_bytes <= budget) if not swap else (
            tuned(graph, device, budget, recompute=recompute) is not None)
        check[f"side_{label}"] = size
        check[f"side_{label}_fits"] = bool(fits)
    return check


def _reason(error: Exception) -> str:
    """The line of a Keras error that says why (its first line names only the layer)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line]
    specific = [line for line in lines[1:] if not line.startswith(("Arguments received", "•"))]
    return (specific[0] if specific else lines[0] if lines else type(error).__name__)[:300]


def remat_baselines(device_name: str, names: tuple[str, ...] = ("resnet50", "unet3d")) -> list[dict]:
    """Keras' RematScope modes on the same simulator: the model built inside the scope, captured,
    its largest batch without swapping, and what its recomputation costs there (compute against the
    plain model's at that batch). A mode whose training step cannot be traced (Keras' remat of a
    layer called with keyword arguments fails in a traced step on the TF backend; ``model.fit``
    fails the same way) is a row with the error."""
    device = get_device(device_name)
    budget = device.budget_bytes
    rows = []
    for name in names:
        kwargs = {"size": UNET_SIZE} if name == "unet3d" else {}
        scale = unet3d_voxels(UNET_SIZE) if name == "unet3d" else 1
        plain_graph = captured_graph(name, **kwargs)
        plain = max_batch_without_swap(plain_graph, budget, device)
        for mode in REMAT_MODES:
            row = {"device": device_name, "model": name, "remat_mode": mode, "time_model": time_model(device),
                   "without_remat": plain * scale}
            try:
                graph = captured_graph(name, remat=mode, **kwargs)
            except ValueError as error:  # CaptureError (rewriter is imported once the environment is prepared)
                row["error"] = _reason(error)
                rows.append(row)
                print(json.dumps(row, default=str), flush=True)
                continue
            batch = max_batch_without_swap(graph, budget, device)
            overhead = np.nan
            if batch:
                overhead = (replay(graph.with_batch(batch), None, device).compute_s
                            / replay(plain_graph.with_batch(batch), None, device).compute_s - 1.0)
            row.update({"with_remat": batch * scale, "multiplier": batch / plain if plain else np.nan,
                        "overhead": overhead, "with_remat_20pct": batch * scale if overhead <= 0.2 else 0,
                        "error": ""})
            rows.append(row)
            print(json.dumps(row, default=str), f"({time.perf_counter() - STARTED_S:.0f} s since start)", flush=True)
    return rows


def _measure_worker(batch: int, budget: int, swap: bool, device_name: str) -> int:
    """In a fresh process (``--measure-worker``): ResNet-50 at ``batch``, tuned for ``budget`` (or not
    swapped), predicted, applied and measured (``autotune.run_plan``); prints one ``RESULT`` line."""
    start_measuring_process()
    import rewriter  # after the process is set up to measure
    from rewriter.trace.step_inputs import synthetic_batch

    model = build_model("resnet50", seed=0)
    graph = rewriter.capture(model, batch)
    if swap:
        result = tune_graph(graph, device=device_name, memory=budget, trials=200)
        plan = result.plan if result.feasible else None
    else:
        plan = SwapPlan.empty(graph)
    if plan is None:
        print("RESULT " + json.dumps({"batch": batch, "fits_predicted": False}), flush=True)
        return 0
    run = run_plan(model, graph, plan, device_name, synthetic_batch(model, batch), repeats=1)
    m = run.measured
    print("RESULT " + json.dumps({"batch": batch, "predicted": run.predicted.peak_bytes,
                                  "measured": None if m is None else m.peak_bytes, "swaps": plan.n_swaps,
                                  "step_s": None if m is None else m.step_s, "fits_predicted": True}), flush=True)
    return 0


def _measure(batch: int, budget: int, swap: bool, device: str) -> dict:
    from rewriter.environment import testbed_environment  # imports TensorFlow: not at module level

    env = testbed_environment(PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "benchmarks", "max-batch", "--measure-worker", str(batch), str(budget),
                           "swap" if swap else "plain", device],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        return {"batch": batch, "error": done.stderr.strip().splitlines()[-1:] if done.stderr else "no output"}
    return json.loads(line[len("RESULT "):])


def measured_device() -> str:
    """The preset modelling where the measured part runs: the visible GPU's, else the CPU testbed."""
    import rewriter
    from autotune.run.tuning import DEFAULT_DEVICE

    return rewriter.detect(configure=False).simulator_device or DEFAULT_DEVICE


def measured(budget: int, device_name: str) -> list[dict]:
    """Largest ResNet-50 batch whose real step stays within ``budget`` where ``rewriter.timing.measurement``
    runs (``device_name``: the preset modelling it): start at the simulator's answer and step down
    until the measurement agrees."""
    device = get_device(device_name)
    graph = captured_graph("resnet50")
    rows = []
    for swap in (False, True):
        predicted = (largest_batch_with_swap(graph, budget, device, max_overhead=None, probe_trials=PROBE_TRIALS)[0]
                     if swap else max_batch_without_swap(graph, budget, device))
        batch = predicted
        while batch >= 1:
            result = _measure(batch, budget, swap, device.name)
            print(json.dumps(result), flush=True)
            if result.get("fits_predicted") and (result.get("measured") or budget + 1) <= budget:
                break
            batch -= max(1, batch // 10)
        rows.append({"swapping": swap, "predicted_max_batch": predicted, "measured_max_batch": max(batch, 0),
                     "measured_peak_bytes": result.get("measured"), "predicted_peak_bytes": result.get("predicted"),
                     "budget_bytes": budget, "step_s": result.get("step_s")})
    return rows


ANY_PLAN_NOTE = (
    "overhead_any_plan_bound / overhead_20pct_any_plan_bound: the least overhead any plan (swaps, recomputations and "
    "splits together) can have at with_swap / with_swap_20pct (simulator.split.overhead_bound: at an op that reduces "
    "over the batch, any_plan_bound_cut, everything made before it and read after it is on the device, copied to the "
    "host and back over the links while the ops before and after it run, or dropped and made again at least at its "
    "producers' cost back to what is kept). It looks at one moment: memory later in the backward pass, where "
    "recomputations need their inputs again, is not in it, so plans may be far slower.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks max-batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", nargs="*", default=["v100-16gb", "v100-16gb-nvlink"])
    parser.add_argument("--no-measured", action="store_true",
                        help="skip the measurement (on GPU:0 when one is visible, else the CPU testbed)")
    parser.add_argument("--measured-budget", default=str(2**30), help="accelerator-side budget for it, bytes")
    parser.add_argument("--recompute", choices=("both", "off", "on"), default="both",
                        help="rows with swapping alone (off), with recomputation beside it (on), or both")
    parser.add_argument("--cases", nargs="*", choices=CASES, default=list(CASES), help="which models and rewrites")
    parser.add_argument("--no-remat", action="store_true", help="skip the keras.RematScope baselines")
    parser.add_argument("--name", default="max_batch", help="results file name (a partial run: another name)")
    parser.add_argument("--split", type=int, nargs="?", const=2, default=None, metavar="DOUBLINGS",
                        help="where the floor is over the budget, search the step split along the batch, the "
                             "parts with the plan: the fewest that fit and DOUBLINGS doublings (default 2; 0: the "
                             "fewest, as the CLI's rule)")
    parser.add_argument("--questions", nargs="+", choices=QUESTIONS, default=list(QUESTIONS),
                        help="which largest batches to find: at any overhead, within 30 %%, within 20 %% (one alone: "
                             "a shorter run whose bisection is its own, not shared with the others)")
    parser.add_argument("--measure-worker", nargs=4, metavar=("BATCH", "BUDGET", "SWAP", "DEVICE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_worker:
        batch, budget, swap, device_name = args.measure_worker
        return _measure_worker(int(batch), int(budget), swap == "swap", device_name)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.recompute]
    rows = [row for device in args.devices
            for row in simulate(device, modes, tuple(args.cases), args.split, tuple(args.questions))]
    table = pd.DataFrame(rows)
    for question, columns in UNASKED_COLUMNS.items():
        if question not in args.questions:
            table[[c for c in columns if c in table]] = np.nan
    notes = [
        "Targets: the LMS paper's 4.9x (ResNet-50 batch) and 5.6x (3D U-Net voxels) on a 16 GB V100; "
        "docs/design.md asks for 6x; with recomputation: ResNet-50 >= 8x at any overhead and >= 4x at "
        "<= 20 % overhead, 3D U-Net >= 6x, on v100-16gb.",
        "recompute: the search with recomputation beside swapping (autotune's default), else swapping alone "
        "(`--no-recompute`); time_model: where the overheads' op times come from (preset: the device preset's "
        "roofline; calibrated: op times measured on the machine).",
        "overhead: simulated slow-down of the tuned plan at the largest batch, against the step as captured (the "
        "clones' time included); overhead_lower_bound: the least any swap plan can have there (excess bytes over the "
        "link during the forward and the backward pass; recomputation can go below it).",
        "with_swap_20pct / with_swap_30pct: the largest size whose plan's overhead is at most 20 % / 30 % "
        "(overhead_20pct: that plan's); recomputed_tensors, recomputed_gib, recompute_s, recompute_share: what the "
        "chosen plan at the largest size recomputes, the bytes of those tensors, the clones' seconds and their share "
        "of the step's compute.",
        "swap_bound: the largest size at which any swap plan could fit at all (resident memory plus the largest "
        "op's inputs and outputs, which must be on the device together); share_of_bound: with_swap / swap_bound.",
        "host_peak_gib: host memory the chosen plan's swapped tensors take, against the preset's host RAM per GPU "
        "(host_limit_gib); with_swap_any_host: the largest size with no limit on host memory; "
        "device_and_host_bound: the largest size whose unswapped step's live set fits the device budget and the host "
        "RAM together (no plan can keep more alive).",
        "Reading the table: where with_swap reaches swap_bound, no swap plan can do better on that graph; where "
        "host_peak_gib reaches host_limit_gib and with_swap_any_host is larger, host RAM is what stops it: at "
        "device_and_host_bound the machine's memory is full, below it the plans hold tensors on the host that the "
        "device had room for (a tensor is copied out right after it is made and its host copy lives until its last "
        "swap-in; a plan over the host limit keeps the tensors copied out most briefly at the host's peak on the "
        "device while the device budget allows, simulator.host_room). bound_op: the op whose inputs and outputs set "
        "swap_bound.",
        ANY_PLAN_NOTE,
    ]
    notes.append("graph_rewrites: rewrites made before swapping (`--rewrite`); such a row's without_swap is the "
                 "plain model's, so its multiplier is what the rewrite and swapping give together; "
                 "without_swap_rewritten: what the rewritten step alone fits.")
    if args.split is not None:
        notes.append(f"--split {args.split}: at each probed batch whose floor is over the budget the step is split "
                     "along the batch (autotune.search.parts: the fewest parts whose floor fits and "
                     f"{args.split} doubling(s) of them, each k searched on its split graph with an equal share of "
                     "the probe's trials; the fastest plan that fits over all k counts); parts / parts_20pct: the k "
                     "of the chosen plans (1: the step as captured); parts_searched: each k's best plan at the "
                     "largest batch; split_floor_set_by: what sets the floor of the chosen split there; split_probes: every "
                     "probed batch where a split was searched, each k's best overhead or by how much its plan "
                     "closest to the device budget misses it (or, where plans fit the device, the host limit). Overheads "
                     "are against the step as captured, the parts' own cost included. with_swap_any_host is not "
                     "searched with splits (it would double the run). device_and_host_bound is the step as "
                     "captured's: a split step keeps less alive at once, so its batches can pass it.")
    if tuple(args.questions) != QUESTIONS:
        notes.append(f"--questions {' '.join(args.questions)}: only these largest batches were searched, each by "
                     "its own bisection (all three share their probes); the other questions' columns are nan.")
    from autotune.report.writer import markdown_table
    if not args.no_remat:
        remat = pd.DataFrame([row for device in args.devices for row in remat_baselines(device)])
        remat.to_csv(RESULTS_DIR / f"{args.name}_remat.csv", index=False)
        notes += ["", "keras.RematScope baselines on the same simulator (benchmarks.models.REMAT_LAYERS for "
                  "list_of_layers; without swapping; overhead: the recomputation's compute against the plain model's at "
                  "that batch; error: why the mode's training step cannot be traced, as model.fit cannot run it):", "",
                  markdown_table(remat)]
    if not args.no_measured:
        budget = int(args.measured_budget)
        device_name = measured_device()
        measured_table = pd.DataFrame(measured(budget, device_name))
        where = "the CPU testbed" if device_name == "cpu-testbed" else f"GPU:0 ({device_name} preset)"
        notes += ["", f"Measured on {where} with a {budget / 2**30:.2f} GiB accelerator-side budget "
                  "(ResNet-50, 224x224):", "", markdown_table(measured_table)]
        measured_table.to_csv(RESULTS_DIR / f"{args.name}_measured.csv", index=False)
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(rows)), 4))
    labels = [f"{r['model']}{'' if r['graph_rewrites'] == 'none' else ' + ' + r['graph_rewrites']}"
              f"{' + recompute' if r.get('recompute') else ''}\n{r['device']}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.25, [r.get("multiplier", np.nan) for r in rows], 0.25, label="with a tuned plan")
    ax.bar(x, [r.get("multiplier_30pct", np.nan) for r in rows], 0.25, label="overhead capped at 30%")
    ax.bar(x + 0.25, [r.get("multiplier_20pct", np.nan) for r in rows], 0.25, label="overhead capped at 20%")
    ax.axhline(4.9, color="tab:red", ls="--", lw=1, label="LMS paper, ResNet-50 (4.9x)")
    ax.axhline(5.6, color="tab:purple", ls=":", lw=1, label="LMS paper, 3D U-Net (5.6x)")
    ax.set_xticks(x, labels, fontsize=6)
    ax.set_ylabel("larger than without swapping (x)")
    ax.set_title("Largest batch / input that fits, simulated")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / f"{args.name}.png", dpi=110)
    command = "python -m benchmarks max-batch" + (" " + " ".join(argv) if argv else "")
    path = write_results(args.name, table.drop(columns=["params"]), settings={
        "devices": args.devices, "probe_trials": PROBE_TRIALS, "trials": TRIALS, "command": command}, notes=notes)
    print(table.drop(columns=["params"]).to_string(index=False))
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

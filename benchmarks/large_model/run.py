"""How large a model fits with the optimizer state moved: a GPT-style family with AdamW on a device preset.

    python -m benchmarks large-model [--device v100-16gb] [--depth 12] [--seq-len 512] [--batch 8]
                                     [--vocab 16384] [--trials 80] [--no-measured]

Simulated: the family (``benchmarks.large_model.gpt``) captured at widths 128, 192, 256 and 320 (batch 2;
sizes are linear in the batch), any width derived from the first three (``benchmarks.large_model.scaling``,
checked on the fourth). Per setting, the largest width (a multiple of 64) whose best plan fits the preset's
budget at the batch, found by bisection, its parameter count, and the best plan's simulated overhead against
the unswapped step at that width: no action at all; swaps and recomputation of activations (the state on the
device); the same with every variable's optimizer slots on the host and its update there (``simulator.state``);
each of the last two also with the variable writes after their reads (``simulator.state.writes_after_reads``:
AdamW's decay otherwise holds every weight twice through the backward pass); the slots on the host streamed
in and out around an update left on the device (mode ``stream-slots``), with the writes after their reads; and
with the writes after their reads, every weight on the host beside its slots (mode ``host-weights``: read on the
device through copies in, which the search may swap between the forward and backward reads); each of the last two
also with every copy in a swap-in of the plan started by a trigger (``HostState.triggered_reads``). The ratio of
parameter counts is the headline. Measured (``--no-measured`` skips it): a small member on the CPU testbed with
every slot on the host, its peak against the prediction and its weights after 3 steps
(``benchmarks.large_model.measured``).
ZeRO-Offload reports 10x the model size on one V100 with the state, gradients and update on the host.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass

import optuna
import pandas as pd

from autotune.run.tuning import largest_batch
from autotune.search.policies import Budget, make_policy
from autotune.search.space import SearchSpace, TuningProblem, best_of
from benchmarks.common import write_results
from benchmarks.large_model.gpt import HEAD_SIZE, gpt, gpt_parameters
from benchmarks.large_model.scaling import WidthFamily
from benchmarks.models.graphs import _cached_capture
from simulator import DeviceModel, get_device, replay
from simulator.buffers import largest_working_set_op, peak_lower_bound_bytes
from simulator.state import (HOST_UPDATE, HOST_WEIGHTS, STREAM_SLOTS, HostState, movable_state,
                             with_host_state, with_triggered_reads, writes_after_reads)

CAPTURED_WIDTHS = (128, 192, 256, 320)  # the first three make the fit, the fourth checks it
GiB = 1 << 30
NO_ACTION, SWAP, SWAP_LATE, HOST, HOST_LATE, STREAM_LATE, STREAM_TRIGGERED, WEIGHTS_LATE, WEIGHTS_TRIGGERED = \
    SETTINGS = ("no action", "swap + recompute", "swap + recompute, writes after reads",
                "swap + recompute + slots on host", "swap + recompute + slots on host, writes after reads",
                "swap + recompute + slots streamed, writes after reads",
                "swap + recompute + slots streamed, writes after reads, copies in triggered",
                "swap + recompute + slots and weights on host",
                "swap + recompute + slots and weights on host, copies in triggered")
LATE = (SWAP_LATE, HOST_LATE, STREAM_LATE, STREAM_TRIGGERED, WEIGHTS_LATE, WEIGHTS_TRIGGERED)
MOVED = (HOST, HOST_LATE, STREAM_LATE, STREAM_TRIGGERED, WEIGHTS_LATE, WEIGHTS_TRIGGERED)


@dataclass(frozen=True)
class Family:
    depth: int
    vocab: int
    seq_len: int

    def captured(self, width: int):
        kwargs = dict(width=width, depth=self.depth, vocab=self.vocab, seq_len=self.seq_len)
        return _cached_capture(f"gpt_w{width}_d{self.depth}_v{self.vocab}_s{self.seq_len}", kwargs,
                               lambda: gpt(**kwargs), "gpt", (), batch_size=2)

    def parameters(self, width: int) -> int:
        return gpt_parameters(width, self.depth, self.vocab, self.seq_len)


def _problem(graph, device, setting: str) -> TuningProblem:
    budget = device.budget_bytes
    if setting in LATE:
        graph = writes_after_reads(graph)
    if setting in MOVED:
        mode = {WEIGHTS_LATE: HOST_WEIGHTS, WEIGHTS_TRIGGERED: HOST_WEIGHTS, STREAM_LATE: STREAM_SLOTS,
                STREAM_TRIGGERED: STREAM_SLOTS}.get(setting, HOST_UPDATE)
        moved = tuple(HostState(path, mode) for path in movable_state(graph))
        if setting in (STREAM_TRIGGERED, WEIGHTS_TRIGGERED):
            moved = with_triggered_reads(graph, moved)
        graph = with_host_state(graph, moved, copies_in=not device.host_buffers_shared)
        # the host holds the state beside what the plan swaps: TuningProblem takes its bytes out of the host's room
        return TuningProblem(graph, device, budget, space=SearchSpace.for_graph(graph, recompute=True),
                             host_state=moved)
    return TuningProblem(graph, device, budget, space=SearchSpace.for_graph(graph, recompute=True))


def best_plan(graph, device, setting: str, trials: int, seed: int = 0):
    """The fastest plan that fits ``graph`` in ``setting`` (None: none found), and its problem."""
    problem = _problem(graph, device, setting)
    baseline = problem.baseline()
    if baseline.feasible:
        return baseline, problem
    if setting == NO_ACTION or problem.graph.persistent_bytes > problem.budget_bytes \
            or peak_lower_bound_bytes(problem.graph) > problem.budget_bytes:
        return None, problem
    study = optuna.create_study(direction="minimize")
    found = make_policy("optuna", seed=seed).search(problem, study, Budget(trials=trials)).evaluations
    good = [e for e in found if e.feasible]
    return (best_of(good) if good else None), problem


def largest_width(family: WidthFamily, batch: int, device, setting: str, trials: int) -> int:
    """The largest multiple of 64 whose member fits in ``setting`` (0: not even 64)."""
    def fits(k: int) -> bool:
        found, _ = best_plan(family.at_width(HEAD_SIZE * k).with_batch(batch), device, setting, trials)
        return found is not None

    return HEAD_SIZE * largest_batch(fits)


def row(fam: Family, family: WidthFamily, batch: int, device, setting: str, width: int, trials: int) -> dict:
    graph = family.at_width(width).with_batch(batch)
    found, problem = best_plan(graph, device, setting, trials)
    plain = replay(graph, None, device)
    g = problem.graph
    op = largest_working_set_op(g)
    return {"setting": setting, "width": width, "parameters": fam.parameters(width),
            "parameters_B": round(fam.parameters(width) / 1e9, 3),
            "peak_GiB": None if found is None else round(found.peak_bytes / GiB, 3),
            "budget_GiB": round(device.budget_bytes / GiB, 3),
            "resident_GiB": round(g.persistent_bytes / GiB, 3),
            "floor_GiB": round(peak_lower_bound_bytes(g) / GiB, 3), "floor_op": str(g.op_name[op]),
            "unswapped_peak_GiB": round(plain.peak_bytes / GiB, 3),
            "overhead": None if found is None else round(found.metrics["overhead"], 4),
            # of the plan's step, the host's CPU applying the update moved there (simulator.state.host_cpu_seconds)
            "host_update_s": None if found is None else round(problem.replay(found.params).host_update_s, 3),
            "unswapped_step_s": round(plain.step_s, 4)}


def simulate(fam: Family, batch: int, device: DeviceModel, trials: int) -> tuple[pd.DataFrame, dict]:
    family = WidthFamily.of({w: fam.captured(w) for w in CAPTURED_WIDTHS})
    errors = family.check_held_out()
    rows = []
    for setting in SETTINGS:
        width = largest_width(family, batch, device, setting, trials)
        rows.append(row(fam, family, batch, device, setting, width, trials) if width else
                    {"setting": setting, "width": 0, "parameters": 0})
        print(rows[-1], flush=True)
    return pd.DataFrame(rows), errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks large-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="v100-16gb")
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--trials", type=int, default=80)
    parser.add_argument("--no-measured", action="store_true")
    args = parser.parse_args(argv)
    fam = Family(args.depth, args.vocab, args.seq_len)
    device = get_device(args.device)
    table, errors = simulate(fam, args.batch, device, args.trials)
    count = dict(zip(table["setting"], table["parameters"]))

    width = dict(zip(table["setting"], table["width"]))
    overheads = dict(zip(table["setting"], table.get("overhead", [None] * len(table))))

    def ratio(a: str, b: str) -> str:
        return f"{count[a] / count[b]:.2f}x" if count[b] else "n/a"

    def overhead(setting: str) -> str:
        return "n/a" if overheads[setting] is None or pd.isna(overheads[setting]) else f"{overheads[setting]:.0%}"

    notes = [f"Parameters that fit with the slots on the host / with the state on the device: {ratio(HOST, SWAP)}; "
             f"both with the writes after their reads: {ratio(HOST_LATE, SWAP_LATE)}; the slots on the host and the "
             f"writes after their reads / swaps and recomputation alone: {ratio(HOST_LATE, SWAP)}. With the weights on "
             f"the host too: {ratio(WEIGHTS_LATE, SWAP_LATE)} against the state on the device with the writes after "
             f"their reads, {ratio(WEIGHTS_LATE, SWAP)} against swaps and recomputation alone, "
             f"{ratio(WEIGHTS_LATE, NO_ACTION)} against no action. The slots streamed around an update on the device "
             f"(writes after reads): {ratio(STREAM_LATE, SWAP_LATE)} against the state on the device, "
             f"{ratio(STREAM_LATE, HOST_LATE)} of the parameters with the update on the host. Every copy in of a "
             f"weight or streamed slot a swap-in started by a trigger (the copies before their readers otherwise): "
             f"the slots streamed {overhead(STREAM_TRIGGERED)} simulated overhead at width "
             f"{width[STREAM_TRIGGERED]} ({overhead(STREAM_LATE)} at {width[STREAM_LATE]} without), the weights on the "
             f"host too {overhead(WEIGHTS_TRIGGERED)} at {width[WEIGHTS_TRIGGERED]} ({overhead(WEIGHTS_LATE)} at "
             f"{width[WEIGHTS_LATE]} without).",
             "Derived members checked: width 320 predicted from 128, 192, 256, largest relative error "
             + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()) + "."]
    settings = {"command": "python -m benchmarks " + " ".join(["large-model", *(argv if argv is not None else sys.argv[2:])]),
                "device": args.device, "depth": args.depth, "seq_len": args.seq_len, "batch": args.batch,
                "vocab": args.vocab, "optimizer": "AdamW", "trials per width": args.trials,
                "host update": f"{device.host_update_bytes_per_s / 1e9:.2f} GB/s of weights, gradients and slots, "
                               f"{device.host_update_variable_s * 1e6:.0f} us per variable ({device.name}'s)",
                "captured widths": CAPTURED_WIDTHS}
    if not args.no_measured:
        result = subprocess.run([sys.executable, "-m", "benchmarks.large_model.measured"], capture_output=True,
                                text=True, check=False)
        notes.append("Measured on the CPU testbed: " + (result.stdout.strip() or result.stderr.strip()[-2000:]))
    path = write_results("large_model", table, settings=settings, notes=notes)
    print(path)
    print(table.to_string())
    print("\n".join(notes))
    return 0

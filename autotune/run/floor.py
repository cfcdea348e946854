"""A verdict known right after capture: the budget is under what every plan needs.

No swap or recomputation plan goes under the resident state (weights, optimizer state, inputs) plus
the largest working set one op needs at once (``simulator.buffers.peak_lower_bound_bytes``). When
the budget is below that floor, the answer is "does not fit" before any calibration, search or
measured run, with what holds the floor and only the changes that were computed to get under the
budget: a smaller batch, an optimizer without per-weight state, a graph rewrite (captured with it to
see its floor), or a larger budget. Splitting the ops that set the floor along the batch lowers it
(``split_to_budget``, docs/design.md 12): the search then runs on the split step, its number of parts
chosen with the plan (``choose_parts``), or, where no split gets under the budget or ``--no-split``
forbids it, the verdict says what it would reach.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from autotune.inputs import format_bytes
from autotune.run.options import SearchOptions
from autotune.search.parts import PartsSearch, search_parts, split_to_budget  # noqa: F401 -- split_to_budget: re-exported
from autotune.search.policies import Budget, make_policy
from autotune.search.space import SearchSpace, TuningProblem
from autotune.run.target import Target
from autotune.run.tuning import TuneResult, largest_batch
from autotune.search.state_moves import why_state_stays
from autotune.run.verdict import DOES_NOT_FIT, Verdict
from simulator import BACKWARD, DeviceModel, OpGraph, replay
from simulator.buffers import INPUTS, largest_working_set_op, peak_lower_bound_bytes, resident_split_bytes
from simulator.split import SplitFloor
from simulator.state import (HOST_UPDATE, HOST_WEIGHTS, HostState, movable_state, movable_weights, moved_kinds,
                             state_refusal, with_host_state)

BROADCAST_TYPES = ("Tile", "BroadcastTo")
OPTIMIZER_SLOTS = "optimizer slots"  # rewriter.trace.state_kinds.SLOTS, the kind resident_split_bytes names


@dataclass(frozen=True)
class Floor:
    """The least peak any plan reaches at one batch, and what holds it."""

    batch_size: int
    floor_bytes: int
    resident_bytes: int
    op_name: str
    op_type: str
    working_set_bytes: int
    resident_split: dict[str, int]  # resident bytes by kind (simulator.buffers.resident_split_bytes)

    def resident_parts(self) -> str:
        """The resident state in words: what it is made of, by kind."""
        inside = ", ".join(f"{kind}{f' at batch {self.batch_size}' if kind == INPUTS else ''} {format_bytes(size)}"
                           for kind, size in self.resident_split.items() if size)
        return format_bytes(self.resident_bytes) + (f" ({inside})" if inside else "")

    def describe(self) -> str:
        if self.working_set_bytes <= 0:
            return f"the resident state alone takes {self.resident_parts()}"
        return (f"{self.op_name} ({self.op_type}) needs its inputs and outputs on the device at once, "
                f"{format_bytes(self.working_set_bytes)}, beside the resident state of {self.resident_parts()}")


def floor_of(g: OpGraph) -> Floor:
    bound = peak_lower_bound_bytes(g)
    op = largest_working_set_op(g) if g.n_ops else 0
    return Floor(batch_size=g.batch_size, floor_bytes=bound, resident_bytes=g.persistent_bytes,
                 op_name=str(g.op_name[op]) if g.n_ops else "", op_type=str(g.op_type[op]) if g.n_ops else "",
                 working_set_bytes=bound - g.persistent_bytes, resident_split=resident_split_bytes(g))


def rewrites_touching(g: OpGraph, op: int) -> list[str]:
    """The graph rewrites (not yet made) that change op ``op``: only they can lower a floor it holds.
    split-concat rewrites a concatenation a convolution reads; elide-broadcasts drops a backward
    Tile/BroadcastTo, which changes the op itself or the op reading it."""
    done = set(g.meta.get("graph_rewrites", []))
    found = []
    if "split-concat" not in done and g.op_type[op] == "ConcatV2":
        outputs = np.flatnonzero(g.tensor_producer == op)
        readers = g.edge_consumer[np.isin(g.edge_tensor, outputs)]
        if np.isin(g.op_type[readers], ["Conv2D", "Conv3D"]).any():
            found.append("split-concat")
    inputs = g.edge_tensor[g.edge_consumer == op]
    producers = g.tensor_producer[inputs]
    broadcast = (g.op_type[op] in BROADCAST_TYPES and g.op_phase[op] == BACKWARD) or bool(
        (np.isin(g.op_type[producers], BROADCAST_TYPES) & (g.op_phase[producers] == BACKWARD)).any())
    if "elide-broadcasts" not in done and broadcast:
        found.append("elide-broadcasts")
    return found


def choose_parts(captured: OpGraph, splits: list[SplitFloor], target: Target, options: SearchOptions) -> PartsSearch:
    """The number of parts searched with the plan (``autotune.search.parts``): each split of ``splits`` of the
    step ``captured`` searched with an equal share of the search's trials, overheads against ``captured``;
    the search proper then runs on the split whose plan was fastest."""
    return search_parts(splits, lambda split: TuningProblem(
        split, target.device, target.device_budget_bytes,
        space=SearchSpace.for_graph(split, recompute=options.recompute), captured=captured),
        make_policy(options.policy, sampler=options.sampler, seed=options.seed),
        Budget(options.trials, options.timeout_s))


def split_lines(found: SplitFloor) -> str:
    """A split's effect on the floor, for the report, and where its regions end (the ops that cannot be split
    exactly, and why: inputs, random ops, a batch flattened into another axis, ...)."""
    ends = [(op, why) for op, why in found.ends if not why.startswith("a Placeholder")]
    where = "; ".join(f"{op}: {why}" for op, why in ends[:3]) + (f"; {len(ends) - 3} more" if len(ends) > 3 else "")
    return (f"splitting {found.region_ops} ops in {len(found.regions)} region(s) along the batch in {found.parts} "
            f"parts lowers the floor from {format_bytes(found.floor_bytes)} to {format_bytes(found.split_floor_bytes)} "
            f"({found.stop_reason})" + (f"; the region ends at ops that cannot run in parts exactly: {where}"
                                        if ends else ""))


def _largest_batch_under(g: OpGraph, budget_bytes: int) -> int:
    """The largest batch whose floor is within the budget (0: not even batch 1)."""
    return largest_batch(lambda batch: peak_lower_bound_bytes(g.with_batch(batch)) <= budget_bytes)


def ways_down(g: OpGraph, floor: Floor, budget_bytes: int, rewrite_floors: dict[str, int],
              replicas: int = 1) -> list[str]:
    """What would bring the floor under the budget, each computed; a change that cannot is said to fall short
    (``replicas``: ``g`` is one replica's step of that many, whose global batch the flags give)."""
    ways = []
    batch = _largest_batch_under(g, budget_bytes)
    if batch:
        at = peak_lower_bound_bytes(g.with_batch(batch))
        how = (f"--batch-size {batch * replicas} over {replicas} replicas" if replicas > 1 else
               f"--batch-size {batch}, or --maximize-batch to search the largest batch that fits")
        ways.append(f"a smaller batch: at batch {batch}{' per replica' if replicas > 1 else ''} or less the floor is "
                    f"{format_bytes(at)} or less, within the budget ({how})")
    else:
        ways.append(f"no batch size gets under the budget: at batch 1 the floor is "
                    f"{format_bytes(peak_lower_bound_bytes(g.with_batch(1)))}")
    state = floor.resident_split.get(OPTIMIZER_SLOTS, 0)  # per-weight state; an optimizer without it keeps none
    if not batch and state and peak_lower_bound_bytes(g.with_batch(1)) - state <= budget_bytes:
        ways.append(f"an optimizer without per-weight state (plain SGD) would leave out its "
                    f"{format_bytes(state)} of state and bring the floor at batch 1 within the budget")
    for rewrite, bytes_ in rewrite_floors.items():
        if bytes_ <= budget_bytes:
            ways.append(f"--rewrite {rewrite} lowers the floor to {format_bytes(bytes_)}, within the budget")
        elif bytes_ < floor.floor_bytes:
            ways.append(f"--rewrite {rewrite} lowers the floor only to {format_bytes(bytes_)}, still over the budget")
    ways.append(f"a budget of at least {format_bytes(floor.floor_bytes)} at batch {floor.batch_size} "
                "(--memory, or a device with more memory)")
    return ways


def every_movable(graph: OpGraph) -> tuple[HostState, ...]:
    """The optimizer slots of every variable that can move to the host (``simulator.state``), and the weights with
    them where the capture recorded their reads (mode ``host-weights``)."""
    weights = movable_weights(graph)
    return tuple(HostState(path, HOST_WEIGHTS if path in weights else HOST_UPDATE) for path in movable_state(graph))


def state_floor_bytes(graph: OpGraph, device_model: DeviceModel) -> int:
    """The floor with ``every_movable`` state on the host."""
    return peak_lower_bound_bytes(with_host_state(graph, every_movable(graph),
                                                  copies_in=not device_model.host_buffers_shared))


def split_way(split: SplitFloor, budget_bytes: int, split_allowed: bool) -> str:
    """What splitting the ops that set the floor would do, in a report's words."""
    reach = f"splitting the ops that set the floor along the batch in {split.parts} parts"
    if not split_allowed and split.split_floor_bytes <= budget_bytes:
        return (f"{reach} would lower it to {format_bytes(split.split_floor_bytes)}, within the budget "
                "(without --no-split)")
    return f"{reach} lowers it only to {format_bytes(split.split_floor_bytes)}, still over the budget"


def foregone(graph: OpGraph, target: Target, *, policy: str = "optuna", recompute: bool = True,
             recaptured: Callable[[Sequence[str]], OpGraph] | None = None, state: bool = True,
             split: SplitFloor | None = None, split_allowed: bool = True) -> TuneResult | None:
    """The result "does not fit" when the budget is under ``graph``'s floor at its batch, else None.
    ``recaptured(rewrites)``: the step captured again with more graph rewrites, to see their floor
    (asked only for the rewrites that change the op holding the floor). ``state``: the search may move
    optimizer slots to the host (``simulator.state``), so the floor is the one with every movable slot there.
    ``split``: the lowest floor a split reaches (``split_to_budget``), said among the ways down
    (``split_allowed`` False: --no-split forbade it)."""
    device_model, budget = target.device, target.device_budget_bytes
    floor = floor_of(graph)
    if floor.floor_bytes <= budget:
        return None
    movable = bool(movable_state(graph))
    moved_floor = state_floor_bytes(graph, device_model)
    if state and moved_floor <= budget:
        return None
    op = largest_working_set_op(graph) if floor.working_set_bytes > 0 else None
    rewrite_floors = {} if op is None or recaptured is None else {
        rewrite: peak_lower_bound_bytes(recaptured([rewrite])) for rewrite in rewrites_touching(graph, op)}
    ways = ways_down(graph, floor, budget, rewrite_floors, target.replicas)
    if movable and moved_floor <= budget:
        ways.insert(0, f"the {moved_kinds(every_movable(graph))} on the host (without --no-state) lower the floor to "
                       f"{format_bytes(moved_floor)}, within the budget")
    if split is not None:
        ways.insert(-1, split_way(split, budget, split_allowed))
    headline = (f"Does not fit: no plan can peak under {format_bytes(floor.floor_bytes)} at batch {floor.batch_size}, "
                f"over the budget of {format_bytes(budget)}: {floor.describe()}.")
    notes = [f"decided right after capture, with no calibration, search or measured run: {floor.describe()}; "
             f"no swap or recomputation plan goes under that ({format_bytes(floor.floor_bytes)})",
             "what would get under the budget: " + "; ".join(ways)]
    if state and not movable and state_refusal(graph) and floor.resident_split.get(OPTIMIZER_SLOTS, 0):
        notes.append(why_state_stays(graph))
    problem = TuningProblem(graph, device_model, budget, space=SearchSpace.for_graph(graph, recompute=recompute))
    baseline = problem.baseline()
    return TuneResult(model=str(graph.meta.get("model", "model")), batch_size=graph.batch_size, target=target,
                      graph=graph, policy=policy, baseline=baseline,
                      chosen=None, closest=None, evaluations=[baseline], study=None, plan=None, replay=None,
                      baseline_replay=replay(graph, None, device_model), space=problem.space,
                      max_batch_without_swap=0, notes=notes, search_budget_bytes=budget,
                      verdict=Verdict(DOES_NOT_FIT, False, False, None, headline, tuple(ways)))

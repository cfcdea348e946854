"""Which optimizer state a search moves to the host, and how, where no plan fits with it on the device (docs/design.md
13): the groups ``simulator.state.state_groups`` makes, largest first, each updated on the host and, beside a host
with a rate of its own, streamed around an update on the device, the faster that fits kept; then the weights with
their slots. ``search`` is the plan search with a given state on the host (``autotune.run.tuning``'s)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from autotune.inputs import format_bytes
from simulator import OpGraph
from simulator.state import (HOST_UPDATE, HOST_WEIGHTS, STREAM_SLOTS, HostState, movable_state, moved_bytes,
                             moved_kinds, state_groups, state_refusal, where_updated, with_triggered_reads)

if TYPE_CHECKING:  # the result type only: the search that makes it calls this module
    from autotune.run.tuning import TuneResult

MODE_FLIPS = 4  # variables of a moved group a search tries in the other mode, one at a time (modes_per_variable)
Search = Callable[[tuple[HostState, ...]], "TuneResult"]


def why_state_stays(g: OpGraph) -> str:
    """The note that says why none of ``g``'s optimizer state can move to the host (the capture's refusal)."""
    reason = state_refusal(g)
    return (f"the optimizer state cannot move to the host: {reason}" if reason
            else "no optimizer state of this step can move to the host")


def search_state(result: TuneResult, g: OpGraph, search: Search, *, streaming: bool) -> TuneResult:
    """The first group of ``g``'s state (at the searched batch) with which a plan fits, as ``search`` finds it; else
    ``result`` (the search with the state on the device) with a note that says how far moving all of it missed.
    ``streaming``: the host's CPU updates slower than the device (its own rate, beside a GPU), so streaming the slots
    around an update on the device is tried too; where the update keeps the graph's op times (the testbed) the update
    on the host copies fewer bytes and holds less."""
    groups = state_groups(g)
    if not groups:
        return replace(result, notes=result.notes + [why_state_stays(g)])
    streamed = {tuple(item.variable for item in group): group for group in state_groups(g, mode=STREAM_SLOTS)} \
        if streaming else {}
    slots = movable_state(g)
    for group in groups:  # the update on the host or on the device, the slots streamed: the faster that fits
        tried = [search(state) for state in (group, streamed.get(tuple(item.variable for item in group))) if state]
        moved = min(tried, key=lambda found: (found.chosen is None, found.chosen.step_s if found.chosen else 0.0))
        if moved.chosen is not None and len(tried) == 2 and any(found.chosen is None for found in tried):
            moved = modes_per_variable(moved, search)
        if moved.chosen is not None:
            moved = triggered_copies(g, moved, search)
            size, where = sum(slots[item.variable] for item in group), where_updated(moved.plan.host_state)
            return replace(moved, notes=[f"the optimizer slots of {len(group)} of {len(slots)} variable(s), "
                                         f"{format_bytes(size)}, live on the host, {where}"
                                         " (--no-state keeps them on the device)"] + moved.notes)
    for group in state_groups(g, mode=HOST_WEIGHTS):  # then the weights too, largest first
        moved = search(group)
        if moved.chosen is not None:
            moved = triggered_copies(g, moved, search)
            return replace(moved, notes=[f"the weights and optimizer slots of {len(group)} of {len(slots)} "
                                         f"variable(s), {format_bytes(moved_bytes(g, group))}, live on the host, "
                                         "where their update runs; the device reads each weight through copies in"
                                         " (--no-state keeps them on the device)"] + moved.notes)
    # nothing fits: the step as captured is what is shown (its floor and rewrites are what the user can act on)
    miss_bytes = moved.closest.excess_bytes if moved.closest is not None else 0
    return replace(result, notes=result.notes + [f"not even with the {moved_kinds(group)} of every "
                                                 "movable variable on the host"
                                                 + (f" (its closest plan {format_bytes(miss_bytes)} over the budget)"
                                                    if miss_bytes > 0 else "")])


def modes_per_variable(moved: TuneResult, search: Search) -> TuneResult:
    """``moved``, the group that fits in one mode where the other did not, with its variables one at a time,
    largest first (``MODE_FLIPS`` at most), in the other mode: each kept where the step still fits and is faster
    (``search(host_state)``: the search with that state). Per variable, streaming is faster but keeps the update's
    working set on the device, the update on the host the reverse: a group may fit only with both."""
    state = moved.plan.host_state
    for variable in [item.variable for item in state][:MODE_FLIPS]:
        flipped = tuple(HostState(each.variable, STREAM_SLOTS if each.mode == HOST_UPDATE else HOST_UPDATE)
                        if each.variable == variable else each for each in state)
        tried = search(flipped)
        if tried.chosen is not None and tried.chosen.step_s < moved.chosen.step_s:
            moved, state = tried, flipped
    return moved


def triggered_copies(g: OpGraph, moved: TuneResult, search: Search) -> TuneResult:
    """``moved``, or the same state with the copies in of its weights and streamed slots started by triggers
    (``with_triggered_reads``: every read a swap-in of the plan, where ``g`` allows) where that fits too and is
    faster. Searched after the state is chosen, not instead: the copies before their readers are among the triggered
    plans (synchronous swap-ins), but a search's first trials found them less often (the MLP with AdamW in 24 MiB,
    20 trials)."""
    state = moved.plan.host_state
    triggered = with_triggered_reads(g, state)
    if triggered == state:
        return moved
    tried = search(triggered)
    return tried if tried.chosen is not None and tried.chosen.step_s < moved.chosen.step_s else moved

"""Keep on the device what the host has no room for.

The swap rules copy out every tensor they pick, however briefly it would be away. Where that
overflows the host's RAM while the device still has room, a plan can keep some of them on the
device instead: a 3D U-Net at its largest sizes holds its whole live set on the host at the
forward/backward turn, plus the gradients of the big backward ops there, each copied out and
back within a few ops. ``fit_host`` keeps, one at a time, the tensor on the host at its peak
moment that is away for the shortest time (the least device memory over time per byte the host
gains), as long as the device budget still holds. What it keeps goes into the parameters
(``SwapParams.keep_tensors``), so the plan stays a function of its parameters: the same at any
batch size, in JSON and in the rewriter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from simulator.device.presets import DeviceModel
from simulator.graph import OpGraph
from simulator.params import SwapParams
from simulator.plan import SwapPlan
from simulator.planning import plan_swaps
from simulator.replay import Replay, host_free_s, replay
from simulator.state.host_update import triggered_reads

MAX_REPLAYS = 64  # the 3D U-Net on v100-16gb: 32 at 320 x 64^3 (3.5 % over the host), 43 at 322


@dataclass(frozen=True)
class HostFit:
    """Parameters whose plan fits the host, the plan and its replay."""

    params: SwapParams
    plan: SwapPlan
    result: Replay


def on_host_at_peak(plan: SwapPlan, result: Replay) -> np.ndarray:
    """The swapped tensors whose host copy exists at the host's peak moment, the briefest away first."""
    host_free = host_free_s(plan.n_swaps, plan.in_swap, result.swap_in_end_s)
    moment = result.host_peak_s
    held = np.flatnonzero((result.swap_out_start_s <= moment) & (host_free > moment))
    away_s = host_free[held] - result.swap_out_start_s[held]
    return plan.tensor[held[np.argsort(away_s, kind="stable")]]


def fit_host(g: OpGraph, params: SwapParams, device: DeviceModel, budget_bytes: int, host_limit_bytes: int, *,
             plan: SwapPlan | None = None, result: Replay | None = None,
             max_replays: int = MAX_REPLAYS) -> HostFit | None:
    """Parameters that keep enough tensors on the device for the host copies to fit in
    ``host_limit_bytes`` while the device peak stays within ``budget_bytes``; None when no such
    greedy choice is found within ``max_replays`` replays. ``plan``/``result``: ``params``' own,
    when already known."""
    if plan is None:
        plan = plan_swaps(g, params, kept_reads=device.kept_reads)
    if result is None:
        result = replay(g, plan, device)
    replays = 0
    while result.host_peak_bytes > host_limit_bytes:
        if result.peak_bytes > budget_bytes:
            return None
        # a copy in the plan makes (state.triggered_reads) holds no host bytes of its own and is swapped regardless
        for tensor in np.setdiff1d(on_host_at_peak(plan, result), triggered_reads(g), assume_unique=True).tolist():
            if replays >= max_replays:
                return None
            kept = replace(params, keep_tensors=params.keep_tensors + (g.tensor_name(tensor),))
            kept_plan = replace(plan_swaps(g, kept, kept_reads=device.kept_reads), host_state=plan.host_state)
            kept_result = replay(g, kept_plan, device)
            replays += 1
            if kept_result.peak_bytes <= budget_bytes:
                params, plan, result = kept, kept_plan, kept_result
                break
        else:
            return None
    return HostFit(params, plan, result)
